"""How a run ends when the end and a signal meet: a SIGTERM in the last iteration or as the run finishes (torchrun's,
when its agent restarts the ranks to admit a node that joined late), and a start that resumes the run's last
checkpoint. Each says what happened in its last line, with the losses of the evaluation they come from."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.conftest import REPO, clean_env, output, prepare_data

TINY = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "model.batch_size=4",
        "model.dropout=0.0", "train.eval_iters=2", "train.dtype=fp32", "optimizer.warmup_iters=2",
        "train.sample_tokens=8", "train.log_interval=1"]
HOLD_S = 5.0  # how long a drill holds a run where a signal must meet it, at least


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return prepare_data(tmp_path_factory.mktemp("data"))


def command(data_root: Path, out_dir: Path, *overrides: str) -> list[str]:
    """`meshtrain train gpt` of TINY on one process."""
    return [sys.executable, "-m", "meshtrain", "train", "gpt", *TINY, f"data.root={data_root}",
            f"train.out_dir={out_dir}", *overrides]


def start(data_root: Path, out_dir: Path, *overrides: str, fault: str) -> subprocess.Popen:
    return subprocess.Popen(command(data_root, out_dir, *overrides), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=clean_env(MESHTRAIN_FAULT=fault), cwd=REPO)


def read_until(job: subprocess.Popen, pattern: str) -> list[str]:
    """The job's output up to the line that matches `pattern`."""
    lines = []
    for line in job.stdout:
        lines.append(line)
        if re.search(pattern, line):
            return lines
    raise AssertionError("".join(lines[-40:]))


def signal_in_the_hold(job: subprocess.Popen, said: list[str], hold_s: float) -> str:
    """SIGTERM to `job` once its drill holds it: the line read last comes a few operations before the hold, less
    than an iteration's work (its `dt` here, the last one logged), so the signal follows the line by 2 iterations'
    time, and at least a tenth of the hold (a busy box may pause the job a while), yet well inside the hold.
    Returns the job's whole output."""
    dt = float(re.findall(r"\] step=\d+ loss=\S+ dt=([\d.]+)", "".join(said))[-1])
    assert 4 * dt < hold_s, f"an iteration took {dt:.2f} s here: hold the run longer than {hold_s} s"
    time.sleep(max(2 * dt, hold_s / 10))
    job.send_signal(signal.SIGTERM)
    return "".join(said) + job.communicate(timeout=120)[0]


def run(data_root: Path, out_dir: Path, *overrides: str) -> str:
    done = subprocess.run(command(data_root, out_dir, *overrides), capture_output=True, text=True, env=clean_env(),
                          cwd=REPO, timeout=300)
    assert done.returncode == 0, output(done)[-3000:]
    return output(done)


def final_row(out_dir: Path) -> dict:
    from meshtrain.runtime.rundir import read_jsonl

    return [r for r in read_jsonl(out_dir / "gpt/ddp/latest/metrics.jsonl") if "val_loss" in r][-1]


def saved_iteration(out_dir: Path) -> int:
    from meshtrain.train import checkpoint

    run = (out_dir / "gpt/ddp/latest").resolve()
    return checkpoint.load_trainer_state(checkpoint.latest_checkpoint(run))["iteration"]


def done_line(row: dict) -> str:
    return f"done: {row['step']} iterations, train loss {row['train_loss']:.4f}, val loss {row['val_loss']:.4f}\n"


def test_a_signal_in_the_last_iteration_completes_the_run_and_exits_0(data_root, tmp_path):
    """SIGTERM while iteration 6 of 6 fetches its batch (held there by a drill): the run completes it, evaluates and
    saves it, and exits 0 (nothing to re-queue), saying so the moment the signal comes and at the end; its last line
    gives the losses of that evaluation."""
    job = start(data_root, tmp_path, "train.max_iters=6", "train.eval_interval=1000",
                fault=f"slow:rank=0:step=6:phase=data:ms={HOLD_S * 1000:.0f}")
    text = signal_in_the_hold(job, read_until(job, r"\] step=5 loss="), HOLD_S)
    assert job.returncode == 0, text[-3000:]
    assert re.search(r"SIGTERM received while reading the data of step 6 .*: this is the run's last iteration \(6\), "
                     r"so the run completes it, evaluates and saves it, and exits 0", text), text[-3000:]
    assert "SIGTERM received on this rank, in or after the run's last iteration (6): the run is complete" in text
    assert "stopped by a signal" not in text and saved_iteration(tmp_path) == 6
    last = final_row(tmp_path)
    assert last["step"] == 6 and done_line(last) in text, text[-2000:]


def test_a_signal_as_the_run_finishes_waits_for_its_last_checkpoint(data_root, tmp_path):
    """SIGTERM after the last iteration, its checkpoint being written in the background (a drill holds the run
    there): the signal is noted, not fatal, so the checkpoint of iteration 4 is published and the run exits 0."""
    job = start(data_root, tmp_path, "train.max_iters=4", "train.eval_interval=2", "train.async_checkpoint=true",
                fault=f"slow:rank=0:step=4:phase=finish:ms={HOLD_S * 1000:.0f}")
    said = read_until(job, r"checkpoint: .*\(iteration 4\) writing in the background")  # the loop ends next
    text = signal_in_the_hold(job, said, HOLD_S)
    assert job.returncode == 0, text[-3000:]
    assert "SIGTERM received on this rank, in or after the run's last iteration (4): the run is complete" in text
    assert saved_iteration(tmp_path) == 4, text[-3000:]


def test_a_start_that_resumes_the_last_checkpoint_gives_that_checkpoints_losses(data_root, tmp_path):
    """A run done (4 of 4 iterations, checkpointed), started again with train.init_from=auto, as a restarted job is:
    nothing is left to train, and its last line says so, with the losses evaluated at iteration 4, not NaN."""
    first = run(data_root, tmp_path, "train.max_iters=4", "train.eval_interval=2")
    last = final_row(tmp_path)
    assert done_line(last) in first, first[-2000:]
    again = run(data_root, tmp_path, "train.max_iters=4", "train.eval_interval=2", "train.init_from=auto")
    assert (f"done: 4 iterations, all of them before this start (it resumed the checkpoint of iteration 4, the run's "
            f"last: nothing was left to train), train loss {last['train_loss']:.4f}, val loss "
            f"{last['val_loss']:.4f}\n") in again, again[-2000:]
