"""`meshtrain launch` under a real SLURM: slurmctld and a slurmd per node on the network-namespace nodes of
tests/netns.py (tests/slurm.py), jobs asked for with salloc from node 0 as a user asks from a login node, and srun
starting the ranks on both nodes. Skipped, saying why, where SLURM or namespaces cannot run (root; .ci/run installs
Debian's SLURM and munge)."""

from __future__ import annotations

import re
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from tests.conftest import (
    ANSI,
    RESUMABLE_GPT,
    assert_follows_the_uninterrupted_run,
    lines_until_iteration,
)
from tests.netns import Cluster
from tests.slurm import CRED_EXPIRE_S, Slurm, why_not

pytestmark = pytest.mark.skipif(why_not() is not None, reason=f"no SLURM on namespace nodes here: {why_not()}")
LAUNCH = [sys.executable, "-m", "meshtrain", "launch"]


@pytest.fixture(scope="module")
def slurm():
    with Cluster(2) as cluster, Slurm(cluster) as running:
        yield running


def salloc(slurm: Slurm, cwd, *argv: str, options: tuple[str, ...] = ()):
    """`salloc --nodes=2 --ntasks-per-node=2 OPTIONS ARGV` from node 0: ARGV runs there, inside the allocation."""
    return slurm.cluster.start(0, ["salloc", "--nodes=2", "--ntasks-per-node=2", *options, *argv],
                               slurm.env(MESHTRAIN_TIMEOUT="60"), cwd)


def test_a_job_written_by_submit_runs_under_sbatch_and_requeues_itself_when_preempted(slurm, uninterrupted_gpt,
                                                                                        tmp_path):
    """`meshtrain submit --scheduler slurm --nodes 2 --ranks-per-node 2` from node 0, as from a login node: it checks
    the train command (RESUMABLE_GPT), writes the script and queues it with the real sbatch, printing the job id and
    its log. In the job, `meshtrain launch` writes srun's command from SLURM's variables, and the 4 ranks train on
    both nodes: the world, the hosts and the job id the ranks find are those SLURM reports for the job.

    At iteration 12, two past its first checkpoint, the job gets SLURM's warning signal: `scancel --signal=USR1
    JOBID` sends it as `#SBATCH --signal=USR1@120` does, to the job's steps (srun's ranks), not to the batch shell.
    The ranks stop after the same iteration with a checkpoint and exit 75, srun and launch pass that on, and the
    script runs `scontrol requeue`. SLURM puts the job back in the queue with a begin time (cred_expire + 1 s:
    Reason=BeginTime; tests/slurm.py's CRED_EXPIRE_S), then runs the script again under the same job id, its log
    opened again in append mode. The requeued run resumes at its checkpoint and ends as the uninterrupted run did,
    each iteration logged once. (One job for both: a second 4-rank job that only trained cost the suite 38 s.)"""
    data_root, uninterrupted = uninterrupted_gpt
    job_id, log, script = submitted(slurm, tmp_path, "python", "-m", "meshtrain", *RESUMABLE_GPT,
                                    f"data.root={data_root}", f"train.out_dir={tmp_path}")
    assert log == tmp_path / f"meshtrain-gpt-{job_id}.out"
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n" in script.read_text()
    wait_for_text(log, "] step=12 ", timeout=300)
    assert command(slurm, tmp_path, "scancel", "--signal=USR1", job_id) == ""
    requeued = wait_for_requeue(slurm, job_id, log, timeout=120)
    state = wait_for_job(slurm, job_id, tmp_path, timeout=300)
    started = datetime.fromisoformat(state["StartTime"]) - datetime.fromisoformat(requeued["SubmitTime"])
    print(f"requeued: PENDING (BeginTime) until {requeued['EligibleTime']}, started again {started} after")
    assert started.total_seconds() >= CRED_EXPIRE_S + 1, (requeued, state)
    text = ANSI.sub("", log.read_text())
    assert (state["JobState"], state["Restarts"], state["ExitCode"]) == ("COMPLETED", "1", "0:0"), \
        f"{state}\n{text[-4000:]}{slurm.logs()}"
    assert (state["NumNodes"], state["NumTasks"], state["NodeList"]) == ("2", "4", "node[0-1]"), state
    # each run of the script (the first, the requeued one): srun's command, and the job as the ranks found it
    assert len(re.findall(r"^srun --nodes=2 --ntasks=4 --ntasks-per-node=2 ", text, re.MULTILINE)) == 2, text[:2000]
    for key, value in (("world_size", "4"), ("num_nodes", "2"), ("hosts", "node0, node1"), ("job_id", job_id),
                       ("scheduler", "slurm"), ("launcher", "srun")):
        assert len(re.findall(rf"│ {key}\s+│ {re.escape(value)}\s+│", text)) == 2, (key, text[:3000])
    stopped = re.search(r"stopped by a signal \(SIGUSR1 on this rank\) after iteration (\d+), with a checkpoint: "
                        r"exiting with 75", text)
    assert stopped and int(stopped[1]) >= 12, text[-6000:]
    assert f"resuming at iteration {stopped[1]}" in text, text[-4000:]
    steps = [int(step) for step in re.findall(r"\] step=(\d+) loss=", text)]
    assert steps == list(range(1, 31)), steps  # one log, appended: each iteration done once
    assert "done: 30 iterations" in text, text[-3000:]
    assert_follows_the_uninterrupted_run(tmp_path, uninterrupted)


def test_the_script_of_submit_outlives_a_usr1_sent_to_the_whole_job_and_requeues_it(slurm, tmp_path):
    """`scancel --signal=USR1 --full` (like `#SBATCH --signal=B:USR1@120`) signals the batch shell as well as srun's
    ranks: an untrapped bash dies of it (the job FAILED, ExitCode 0:10) before it can requeue. The script of submit
    traps USR1, so when the ranks end, srun's 75 still requeues the job. The ranks here are a python that exits 75
    on USR1 or TERM, as a meshtrain run does: once the first task exits, srun's --kill-on-bad-exit sends TERM to
    the others, which may come before their own USR1 (a stand-in that left TERM to kill it made the job FAILED with
    143 once in CI)."""
    ranks = "import signal, sys, time; [signal.signal(s, lambda *_: sys.exit(75)) for s in (signal.SIGUSR1, " \
            "signal.SIGTERM)]; print('rank', 'up', flush=True); time.sleep(60)"
    job_id, log, _ = submitted(slurm, tmp_path, "python", "-c", ranks)
    wait_for_text(log, "rank up", timeout=60, count=4)
    assert command(slurm, tmp_path, "scancel", "--signal=USR1", "--full", job_id) == ""
    wait_for_requeue(slurm, job_id, log, timeout=60)
    text = log.read_text()
    # every task ended with 75, none by srun's TERM (srun: "node0: tasks 0-1: Terminated")
    assert "Exited with exit code 75" in text and not re.search(r"tasks? [\d,-]+: Terminated", text), text[-3000:]
    command(slurm, tmp_path, "scancel", job_id)  # else it starts again once eligible, and sleeps


def test_submit_refuses_a_job_whose_data_is_missing_and_queues_nothing(slurm, tmp_path):
    """A train command whose data is not prepared is refused before sbatch: the error names the `meshtrain prepare`
    line to run, submit exits 1, and squeue shows no job of it."""
    out, code = submit(slurm, tmp_path, "python", "-m", "meshtrain", "train", "gpt", f"data.root={tmp_path}")
    assert code == 1 and f"Run `meshtrain prepare shakespeare_char --data-root {tmp_path}`" in out, out
    assert "queued job" not in out and not list(tmp_path.glob(".meshtrain/jobs/*.sh")), out
    assert command(slurm, tmp_path, "squeue", "--noheader") == ""  # no job at all


def test_submit_refuses_a_job_that_would_not_fit_and_queues_nothing(slurm, uninterrupted_gpt, tmp_path):
    """A 1.47B GPT (1,024 tokens) in fp32 under DDP on one Perlmutter node (4 × A100 40GB) needs about 47 GiB a
    rank: refused before sbatch with the planner's figure and a layout that fits, exit 1, and squeue shows no job of
    it. (The namespace nodes have no GPUs: the check is against the system named, as on its login node.)"""
    data_root, _ = uninterrupted_gpt
    job = slurm.cluster.start(0, [sys.executable, "-m", "meshtrain", "submit", "--system", "perlmutter", "--nodes",
                                  "1", "--", "python", "-m", "meshtrain", "train", "gpt", "preset=gpt2",
                                  "data=shakespeare_char", f"data.root={data_root}", "model.n_layer=12", "model.n_embd=3200", "model.n_head=25", "model.batch_size=8",
                                  "train.dtype=fp32"], slurm.env(), tmp_path)
    out = ANSI.sub("", job.communicate(timeout=120)[0])
    assert job.returncode == 1 and re.search(r"out of memory ahead: ddp dp4 ac=none needs about 4\d\.\d\d GiB per "
                                             r"rank .* gives 36\.00 GiB", out), out
    assert "train.backend=fsdp" in out and "nothing submitted" in out and "queued job" not in out, out
    assert command(slurm, tmp_path, "squeue", "--noheader") == ""


def submit(slurm: Slurm, cwd, *train: str) -> tuple[str, int]:
    """`meshtrain submit --scheduler slurm --nodes 2 --ranks-per-node 2 -- TRAIN` from node 0: (its output, code)."""
    job = slurm.cluster.start(0, [sys.executable, "-m", "meshtrain", "submit", "--scheduler", "slurm", "--nodes", "2",
                                  "--ranks-per-node", "2", "--time", "00:10:00", "--", *train],
                              slurm.env(MESHTRAIN_TIMEOUT="60"), cwd)
    return ANSI.sub("", job.communicate(timeout=120)[0]), job.returncode


def submitted(slurm: Slurm, cwd, *train: str) -> tuple[str, Path, Path]:
    """submit's job, queued: (its id, its log, its script)."""
    said, code = submit(slurm, cwd, *train)
    queued = re.search(r"^queued job (\d+) \(slurm\): script (\S+)\nlog: (\S+)$", said, re.MULTILINE)
    assert code == 0 and queued, said + slurm.logs()
    return queued[1], Path(queued[3]), Path(queued[2])


def command(slurm: Slurm, cwd, *argv: str) -> str:
    """What a SLURM command run on node 0 printed; it must exit 0."""
    job = slurm.cluster.start(0, list(argv), slurm.env(), cwd)
    out = job.communicate(timeout=30)[0]
    assert job.returncode == 0, f"{' '.join(argv)} exited {job.returncode}: {out}"
    return out


def wait_for_requeue(slurm: Slurm, job_id: str, log: Path, timeout: float) -> dict[str, str]:
    """`scontrol show job`'s fields once the job is back in the queue, requeued once, waiting for its begin time:
    SLURM holds a requeued job for cred_expire (slurm.conf's AuthInfo, 120 s by default) + 1 s from its requeue."""
    state = wait_for_job(slurm, job_id, log.parent, timeout, until=lambda job: job.get("Reason") == "BeginTime"
                         or job.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"))
    assert (state["JobState"], state["Restarts"]) == ("PENDING", "1"), f"{state}\n{log.read_text()[-3000:]}"
    held = datetime.fromisoformat(state["EligibleTime"]) - datetime.fromisoformat(state["SubmitTime"])
    assert held.total_seconds() == CRED_EXPIRE_S + 1, state  # SubmitTime: the requeue's
    return state


def wait_for_text(log: Path, text: str, timeout: float, count: int = 1) -> None:
    """Until the job's log (written as the job runs) holds `text` `count` times, or AssertionError with its end."""
    deadline = time.monotonic() + timeout
    while not (log.exists() and ANSI.sub("", log.read_text()).count(text) >= count):
        assert time.monotonic() < deadline, log.read_text()[-3000:] if log.exists() else f"no {log}"
        time.sleep(0.2)


def wait_for_job(slurm: Slurm, job_id: str, cwd, timeout: float, until=None) -> dict[str, str]:
    """`scontrol show job`'s fields once `until(fields)` holds (default: the job has left PENDING, RUNNING and
    COMPLETING), or AssertionError."""
    until = until or (lambda job: job.get("JobState") not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING",
                                                               "REQUEUED", None))
    deadline = time.monotonic() + timeout
    while True:
        fields = dict(re.findall(r"(\w+)=(\S+)", command(slurm, cwd, "scontrol", "show", "job", job_id)))
        if until(fields):
            return fields
        assert time.monotonic() < deadline, f"job {job_id} still {fields.get('JobState')} after {timeout:.0f} s"
        time.sleep(1)


# Last: it loses node 1 for good (its namespace deleted), and every job above needs both nodes of the module's SLURM.
def test_an_srun_job_that_loses_a_node_is_run_again_on_the_one_left(slurm, uninterrupted_gpt, tmp_path):
    """An allocation of 2 nodes × 2 tasks kept when a node fails (--no-kill), under `meshtrain launch
    --max-restarts 1`: launch writes srun's command from SLURM's variables and srun starts 2 ranks on each node,
    which meet at the allocation's first node. Node 1 is lost for good at iteration 12 (its slurmd with it). Launch
    asks each host to run `true` through srun, narrows the job's node list to node 0 and runs srun there: 2 ranks
    resume the checkpoint of iteration 10 with the accumulation doubled, following the uninterrupted 4-rank run."""
    data_root, uninterrupted = uninterrupted_gpt
    job = salloc(slurm, tmp_path, *LAUNCH, "--max-restarts", "1", "--", "python", "-m", "meshtrain", *RESUMABLE_GPT,
                 f"data.root={data_root}", "train.init_from=auto", f"train.out_dir={tmp_path}", options=("--no-kill",))
    lines = lines_until_iteration(job, 12)
    slurm.cluster.lose(1)
    lost = time.monotonic()
    lines += job.stdout.readlines()
    job.wait(timeout=300)
    text = ANSI.sub("", "".join(lines))
    assert job.returncode == 0, text[-4000:] + slurm.logs()
    # launch wrote srun's command from SLURM's variables; the ranks met at the allocation's first node
    assert re.search(r"^srun --nodes=2 --ntasks=4 --ntasks-per-node=2 ", text, re.MULTILINE), text[:1000]
    assert re.search(r"│ hosts\s+│ node0, node1 ", text), text[:3000]
    assert re.search(r"│ rendezvous\s+│ first host of the slurm job, port derived from job \d+\.0 ", text), text[:3000]
    assert "meshtrain launch: node1 did not answer srun within 30 s; going on with node0" in text, text[-3000:]
    assert re.search(r"^srun --nodes=1 --ntasks=2 --ntasks-per-node=2 ", text, re.MULTILINE), text[-3000:]
    assert "resuming at iteration 10" in text and "× accumulation 2: global batch 16" in text, text[-3000:]
    assert_follows_the_uninterrupted_run(tmp_path, uninterrupted)
    print(f"node lost at iteration 12: done on the node left {time.monotonic() - lost:.1f} s later")
