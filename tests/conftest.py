"""Shared helpers: run meshtrain under a real launcher (torchrun / mpirun) on this machine."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from meshtrain.runtime.results import ENV as RESULTS
from meshtrain.runtime.results import Job, read_results, torchrun_argv
from tests import preloaded

REPO = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[\d;]*m")


def output(proc: subprocess.CompletedProcess) -> str:
    """stdout + stderr without colour codes (rich colours what it prints at a terminal)."""
    return ANSI.sub("", proc.stdout + proc.stderr)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment minus any launcher/scheduler variables the test runner itself might carry."""
    prefixes = ("SLURM_", "PBS_", "OMPI_", "PMI_", "PMIX_", "PALS_", "MPI_LOCAL", "TORCHELASTIC_")
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
             "MESHTRAIN_FAULT", "MESHTRAIN_RESTART_COUNT")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in names}
    env.update(PYTHONUNBUFFERED="1", MESHTRAIN_DEVICE="cpu", OMP_NUM_THREADS="1", **extra)
    return env


@pytest.fixture(scope="session", autouse=True)
def suite_machine_profile(tmp_path_factory) -> Path:
    """The suite's own machine profile (MESHTRAIN_CACHE_DIR), empty when it starts and shared by both workers: what
    the suite's processes measure under its load never lands in the runner's ~/.cache/meshtrain (where a plan would
    later read it as this machine's figures), and no test passes or fails by what that profile holds."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "machine-profile"
    folder.mkdir(exist_ok=True)
    os.environ["MESHTRAIN_CACHE_DIR"] = str(folder)
    return folder


def prepare_data(root: Path, name: str = "shakespeare_char", env: dict[str, str] | None = None) -> Path:
    """`meshtrain prepare NAME --data-root ROOT`, which must succeed; returns ROOT."""
    __tracebackhide__ = True
    out = preloaded.run([sys.executable, "-m", "meshtrain", "prepare", name, "--data-root", str(root)],
                        env=env or clean_env(), cwd=REPO, timeout=120)
    assert out.returncode == 0, output(out)
    return root


def rewound_copy(run_dir: Path, to: Path, iteration: int) -> Path:
    """A copy of a finished run as it stood at `iteration`: later checkpoints and metrics gone, `latest` back there.
    Resuming it replays what the original did after that iteration."""
    shutil.copytree(run_dir, to)
    checkpoints = to / "checkpoints"
    for step in checkpoints.glob("step-*"):
        if int(step.name.split("-")[1]) > iteration:
            shutil.rmtree(step)
    (checkpoints / "latest").write_text(f"step-{iteration:07d}\n")
    rows = [line for line in (to / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= iteration]
    (to / "metrics.jsonl").write_text("".join(f"{line}\n" for line in rows))
    return to


# The GPT of the resume-anywhere tests (fp32, no dropout: runs in different layouts can be compared), 30 iterations
# of a global batch of 16 with a checkpoint every 10 and a ledger of the samples each step read.
RESUMABLE_GPT = ["train", "gpt", "model.n_layer=2", "model.n_head=4", "model.n_embd=32", "model.block_size=32",
                 "model.batch_size=4", "model.dropout=0.0", "train.eval_iters=2", "train.dtype=fp32",
                 "optimizer.warmup_iters=5", "optimizer.lr_decay_iters=30", "train.global_batch_size=16",
                 "train.sample_tokens=8", "train.max_iters=30", "train.eval_interval=10", "train.log_interval=1",
                 "train.sample_ledger=true", "train.keep_checkpoints=0"]


@pytest.fixture(scope="session")
def uninterrupted_gpt(tmp_path_factory) -> tuple[Path, Path]:
    """(the data root, the run directory) of RESUMABLE_GPT trained under ddp on 4 ranks, never interrupted: what a
    run resumed in another layout (test_resume_anywhere.py) or restarted on fewer nodes (test_multinode.py) follows."""
    data_root = prepare_data(tmp_path_factory.mktemp("resumable_gpt_data"))
    out_dir = tmp_path_factory.mktemp("uninterrupted_gpt")
    run = fork_ranks(4, *RESUMABLE_GPT, f"data.root={data_root}", f"train.out_dir={out_dir}", "train.backend=ddp",
                     "train.async_checkpoint=true", timeout=300)
    assert run.returncode == 0, output(run)[-3000:]
    return data_root, (out_dir / "gpt" / "ddp" / "latest").resolve()


def lines_until_iteration(job, iteration: int) -> list[str]:
    """The output of `job` (the one with rank 0) up to the line that logs `iteration`."""
    lines = []
    for line in job.stdout:
        lines.append(line)
        if f"] step={iteration} " in line:
            return lines
    raise AssertionError("".join(lines[-40:]))


def assert_follows_the_uninterrupted_run(out_dir, uninterrupted) -> None:
    """Every iteration's loss within 1e-4 of the uninterrupted run's (a repeated one: its last), the ledger equal."""
    from meshtrain.train.ledger import read_ledger

    def losses_and_ledger(run_dir):
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}, read_ledger(run_dir / "ledger.txt")

    (want, want_ledger) = losses_and_ledger(uninterrupted)
    (got, got_ledger) = losses_and_ledger((out_dir / "gpt" / "ddp" / "latest").resolve())
    assert sorted(got) == list(range(1, 31)) and got == pytest.approx(want, rel=1e-4)
    assert got_ledger == want_ledger and sorted(got_ledger) == list(range(30))


torchrun_cmd = torchrun_argv  # `torchrun --standalone --nproc-per-node N ARGS` with this interpreter


def forked_cmd(nproc: int, *args: str) -> list[str]:
    """torchrun_cmd's job with its ranks forked from a server that imported torch and meshtrain (forked_ranks.py):
    the same elastic agent, rendezvous and environment, a fraction of the CPU. For the tests whose subject is what
    the ranks compute; those about the launcher itself (signals, restarts, hangs) run torchrun_cmd."""
    return [sys.executable, str(REPO / "tests" / "forked_ranks.py"), str(nproc), *args]


def fork_ranks(nproc: int, *args: str, timeout: float = 120, env: dict[str, str] | None = None):
    """`-m meshtrain ARGS` on `nproc` forked ranks (forked_cmd, itself forked: preloaded.run); returns the
    CompletedProcess."""
    return preloaded.run(forked_cmd(nproc, "-m", "meshtrain", *args), env=env or clean_env(), cwd=REPO,
                         timeout=timeout)


def launch_seconds(nproc: int) -> float:
    """The wall time of `torchrun --nproc-per-node nproc -m meshtrain test-dist --iters 1` here and now: what starting
    `nproc` ranks costs this machine under its present load (the interpreter, torch and meshtrain on every rank,
    the rendezvous, a process group, one DDP iteration). A reference for a limit that a job's start-up must fit in,
    measured rather than tuned on one box: it follows the CPU's speed, the cores per rank and the load together."""
    __tracebackhide__ = True
    started = time.monotonic()
    out = subprocess.run(torchrun_cmd(nproc, "-m", "meshtrain", "test-dist", "--iters", "1"), capture_output=True,
                         text=True, timeout=300, env=clean_env(), cwd=REPO)
    assert out.returncode == 0, output(out)[-3000:]
    return time.monotonic() - started


def mpirun_cmd(nproc: int, *argv: str) -> list[str]:
    """`mpirun -n nproc ARGV` as an argv (Open MPI flags; runs as root in CI)."""
    return ["mpirun", "-n", str(nproc), "--oversubscribe", *(["--allow-run-as-root"] if os.geteuid() == 0 else []),
            *argv]


def mpirun(nproc: int, *args: str, timeout: float = 120, env: dict[str, str] | None = None):
    """`mpirun -n nproc python -m meshtrain ARGS`; returns the CompletedProcess."""
    return subprocess.run(mpirun_cmd(nproc, sys.executable, "-m", "meshtrain", *args), capture_output=True, text=True,
                          timeout=timeout, env=env or clean_env(), cwd=REPO)


requires_mpirun = pytest.mark.skipif(
    shutil.which("mpirun") is None, reason="mpirun not found: install Debian's openmpi-bin (.ci/run does)"
)


def run_driver(script: str | Path, ranks: int, *args: str, timeout: float = 180) -> dict[int, dict[str, dict]]:
    """The test driver `script ARGS` on `ranks` forked ranks (forked_job); it must exit 0. Returns what its ranks
    recorded: {rank: {case: fields}}. Either failure shows the end of the job's output."""
    __tracebackhide__ = True
    job = forked_job(script, ranks, *args, timeout=timeout)
    if job.returncode is None:
        pytest.fail(f"{Path(script).name} {' '.join(args)} ran past {timeout} s:\n{job_end(job.output)}")
    if job.returncode != 0:
        unequal = [f"  {case} on rank {rank}: worst={fields.get('worst')}"
                   for rank, cases in sorted(job.results.items()) for case, fields in cases.items()
                   if fields.get("equal") is False]
        pytest.fail(f"{Path(script).name} {' '.join(args)} exited {job.returncode}\n"
                    + "".join(f"{line}\n" for line in ["not equal:", *unequal] if unequal) + job_end(job.output))
    return job.results


CRASH = re.compile(r"^.*(Fatal Python error|terminate called|double free|corrupted|free\(\)|malloc\(\)).*$", re.M)


def job_end(text: str, tail: int = 4000) -> str:
    """The end of a job's output, after the first crash's own report where there was one: a rank killed by a signal
    prints what killed it and its innermost frames first, and the launcher's words after them fill the end."""
    crash = CRASH.search(text)
    if crash is None or crash.start() >= len(text) - tail:
        return text[-tail:]
    return f"{text[crash.start():crash.start() + 3000]}\n[...]\n{text[-tail:]}"


def forked_job(script: str | Path, ranks: int, *args: str, timeout: float) -> Job:
    """meshtrain.runtime.results.run_ranks's job (what each rank `record`ed, read back), on forked ranks."""
    with tempfile.TemporaryDirectory(prefix="meshtrain-results-") as folder:
        try:
            done = preloaded.run(forked_cmd(ranks, str(script), *args), env=clean_env(**{RESULTS: folder}), cwd=REPO,
                                 timeout=timeout)
            code, text = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as late:
            code, text = None, (late.stdout or "") + (late.stderr or "")
        return Job(code, ANSI.sub("", text), read_results(folder))


class SharedLaunches:
    """One launch of a driver per rank count, shared by the tests that check its cases (starting the processes
    dominates the cost of each): `cases` are (case, ranks, ...) rows, and `launches(ranks)` runs `script` over
    every case of that rank count the first time it is asked for, then hands back the same results (or raises the
    same failure) to every later test. Meant for a module-scoped fixture."""

    def __init__(self, script: str | Path, cases: list[tuple], timeout: float = 180):
        self.script, self.timeout = script, timeout
        self.cases: dict[int, list[str]] = {}
        for case, ranks, *_ in cases:
            self.cases.setdefault(ranks, []).append(case)
        self._done: dict[int, dict | BaseException] = {}

    def __call__(self, ranks: int) -> dict[int, dict[str, dict]]:
        __tracebackhide__ = True
        if ranks not in self._done:
            try:
                self._done[ranks] = run_driver(self.script, ranks, *self.cases[ranks], timeout=self.timeout)
            except (AssertionError, pytest.fail.Exception) as failure:
                self._done[ranks] = failure
        done = self._done[ranks]
        if isinstance(done, BaseException):
            raise done
        return done


def assert_all_equal(results: dict[int, dict[str, dict]], cases: list[str], ranks: int, what: str) -> None:
    """Every one of `ranks` ranks recorded equal=True for every case (`what` says what equal means); a failure
    names the case and shows each rank's worst differences."""
    __tracebackhide__ = True
    assert sorted(results) == list(range(ranks)), f"results from ranks {sorted(results)}, expected 0..{ranks - 1}"
    for case in cases:
        mine = {rank: results[rank].get(case) for rank in range(ranks)}
        missing = [rank for rank, fields in mine.items() if fields is None]
        assert not missing, f"{case}: no result from rank(s) {missing}"
        if not all(fields.get("equal") is True for fields in mine.values()):
            figures = "\n".join(f"  rank {rank}: equal={fields.get('equal')} worst={fields.get('worst')}"
                                 + (f" {fields['problems']}" if fields.get("problems") else "")
                                 for rank, fields in mine.items())
            pytest.fail(f"{case}: {what}\n{figures}")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(config, items):
    """`distributed` on every test under tests/distributed (each starts processes); `slow` is set beside the long
    tests themselves. Selected with -m (`make test-fast` runs -m "not distributed and not slow")."""
    distributed_dir = REPO / "tests" / "distributed"
    for item in items:
        if distributed_dir in item.path.parents:
            item.add_marker(pytest.mark.distributed)
