"""The examples/ scripts, run as their docstrings say, under torchrun and under mpirun, each checked against the same
script on one process: an example that stops working, or stops matching one process, fails here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests import preloaded
from tests.conftest import REPO, clean_env, forked_cmd, mpirun_cmd, output, requires_mpirun

from meshtrain.report.runs import read_run
from meshtrain.runtime.rundir import read_jsonl

EXAMPLES = REPO / "examples"


def run(launcher: str, ranks: int, script: str, *args: str, timeout: float = 300) -> str:
    """`script ARGS` on one process (launcher "python"), or under torchrun or mpirun; must exit 0. Its output.
    One process and torchrun's ranks are forked from a process that imported torch (tests/preloaded.py,
    tests/forked_ranks.py: torch's own elastic agent, rendezvous and environment); mpirun starts its own."""
    __tracebackhide__ = True
    argv, env = [str(EXAMPLES / script), *args], clean_env(MESHTRAIN_PROGRESS="0")
    if launcher == "mpirun":
        done = subprocess.run(mpirun_cmd(ranks, sys.executable, *argv), capture_output=True, text=True, env=env,
                              cwd=REPO, timeout=timeout)
    else:
        done = preloaded.run([sys.executable, *argv] if launcher == "python" else forked_cmd(ranks, *argv), env=env,
                             cwd=REPO, timeout=timeout)
    assert done.returncode == 0, f"{launcher} {script} {' '.join(args)}:\n{output(done)[-4000:]}"
    return output(done)


def losses(run_dir: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_jsonl(run_dir / "metrics.jsonl") if "loss" in row}


def assert_same(got: dict[int, float], want: dict[int, float], rel: float) -> None:
    __tracebackhide__ = True
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    assert worst <= rel, f"largest relative difference {worst:.2e} > {rel:g}: {got} against {want}"


LAUNCHERS = ["torchrun", pytest.param("mpirun", marks=requires_mpirun)]


@pytest.fixture(scope="module")
def one_process_ddp_loop(tmp_path_factory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("ddp_loop") / "one"
    run("python", 1, "ddp_loop.py", "--run-dir", str(run_dir), "--steps", "100")
    return losses(run_dir)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_the_ddp_loop_learns_as_one_process_does_and_its_run_reports(launcher, one_process_ddp_loop, tmp_path):
    reference = one_process_ddp_loop
    assert reference[100] < reference[20] / 10, reference  # it learns the map, not just runs
    run(launcher, 2, "ddp_loop.py", "--run-dir", str(tmp_path), "--steps", "100")
    # the same global batch in two slices, gradients averaged by DDP: the one-process losses
    assert_same(losses(tmp_path), reference, rel=1e-5)
    run_record = read_run(tmp_path)  # what `meshtrain report` reads
    assert [r["step"] for r in run_record.steps] == [20, 40, 60, 80, 100]
    spread = run_record.steps[-1]["ranks"]
    assert len(spread["dt"]["each"]) == 2 and spread["data"]["max"] >= spread["data"]["min"] > 0


@pytest.fixture(scope="module")
def one_process_gpt2(tmp_path_factory) -> dict[int, float]:
    pytest.importorskip("transformers", reason="needs Hugging Face transformers (pip install 'meshtrain[hf]')")
    run_dir = tmp_path_factory.mktemp("hf_gpt2") / "one"
    run("python", 1, "hf_gpt2_fsdp_tp.py", "--run-dir", str(run_dir), "--steps", "6")
    return losses(run_dir)


@pytest.mark.parametrize("launcher, ranks", [("torchrun", 4), pytest.param("mpirun", 2, marks=requires_mpirun)])
def test_hugging_face_gpt2_under_fsdp_and_tensor_parallel_trains_as_one_process(launcher, ranks, one_process_gpt2,
                                                                                 tmp_path):
    # 4 ranks: dp_shard 2 × tp 2; 2 ranks: tp 2 alone (FSDP over one data-parallel rank is no FSDP)
    text = run(launcher, ranks, "hf_gpt2_fsdp_tp.py", "--run-dir", str(tmp_path), "--steps", "6", "--tp", "2")
    assert f"rank 0/{ranks}" in text
    got = losses(tmp_path)
    assert got[6] < got[1] - 0.5, got  # it learns
    # heads split over tp ranks and partial sums all-reduced: the one-process losses up to float rounding
    assert_same(got, one_process_gpt2, rel=1e-4)


def final(text: str) -> tuple[float, float]:
    found = re.search(r"final step=\d+ loss=([\d.]+) parameter_sum=([-\d.]+)", text)
    assert found, text[-3000:]
    return float(found[1]), float(found[2])


@requires_mpirun
def test_a_loop_of_ones_own_resumes_under_other_layouts_and_launchers_as_if_never_stopped(tmp_path):
    reference = tmp_path / "one"
    loss, parameters = final(run("python", 1, "resume_across_layouts.py", "--run-dir", str(reference),
                                 "--steps", "30"))
    run_dir = str(tmp_path / "moving")
    run("torchrun", 4, "resume_across_layouts.py", "--run-dir", run_dir, "--steps", "10", "--backend", "ddp")
    resumed = run("torchrun", 4, "resume_across_layouts.py", "--run-dir", run_dir, "--steps", "20", "--tp", "2",
                  "--cp", "2")
    assert "step=11 " in resumed and "step=10 " not in resumed  # it went on from the checkpoint, not from 0
    last = run("mpirun", 2, "resume_across_layouts.py", "--run-dir", run_dir, "--steps", "30", "--cp", "2")
    # ddp on 4 ranks -> tp2 × cp2 (ring attention, FSDP over the cp ranks) on 4 -> fsdp × cp2 on 2 under mpirun:
    # the one-process run's losses and weights
    assert_same(losses(Path(run_dir)), losses(reference), rel=1e-5)
    got_loss, got_parameters = final(last)
    assert got_loss == pytest.approx(loss, rel=1e-5) and got_parameters == pytest.approx(parameters, rel=1e-6)
    assert sorted(p.name for p in (Path(run_dir) / "checkpoints").glob("step-*")) == ["step-0000020", "step-0000030"]
