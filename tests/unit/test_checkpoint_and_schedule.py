"""Atomic checkpoints, run directories, and the learning-rate schedule."""

import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from meshtrain.runtime import rundir
from meshtrain.train import checkpoint
from meshtrain.train.optim import learning_rate


def test_schedule_warms_up_linearly_then_follows_the_cosine_to_min_lr():
    lr, min_lr, warmup, decay = 1e-3, 1e-4, 10, 110
    assert learning_rate(0, lr, min_lr, warmup, decay) == pytest.approx(lr * 1 / 11)
    assert learning_rate(9, lr, min_lr, warmup, decay) == pytest.approx(lr * 10 / 11)
    assert learning_rate(10, lr, min_lr, warmup, decay) == pytest.approx(lr)
    assert learning_rate(60, lr, min_lr, warmup, decay) == pytest.approx(min_lr + 0.5 * (lr - min_lr))
    assert learning_rate(110, lr, min_lr, warmup, decay) == min_lr
    assert learning_rate(500, lr, min_lr, warmup, decay) == min_lr
    assert learning_rate(35, lr, min_lr, warmup, decay) == pytest.approx(
        min_lr + 0.5 * (1 + math.cos(math.pi * 0.25)) * (lr - min_lr))
    assert learning_rate(35, lr, min_lr, warmup, decay, decay=False) == lr


def test_run_dirs_are_unique_and_latest_points_at_the_last(tmp_path):
    a = rundir.new_run_dir(tmp_path, "gpt", "ddp", now=0)
    b = rundir.new_run_dir(tmp_path, "gpt", "ddp", now=0)
    assert a != b and a.parent == b.parent and a.is_dir()
    rundir.record_run(tmp_path, "gpt", "ddp", a)
    rundir.record_run(tmp_path, "gpt", "ddp", b)
    assert rundir.latest_run(tmp_path, "gpt", "ddp") == b.resolve()
    assert len((tmp_path / "checkpoints.log").read_text().splitlines()) == 2


def test_resume_without_any_run_is_a_clear_error(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="found no earlier run"):
        rundir.latest_run(tmp_path, "gpt", "ddp")


def test_latest_is_a_link_every_command_reads(tmp_path):
    """`latest` is a relative symbolic link to the last run (the tree can move), so `meshtrain report …/latest`,
    `sample --run …/latest` and `export` read the run; a text file naming it (no links) is read the same way."""
    from meshtrain.report.runs import read_run

    first, second = (rundir.new_run_dir(tmp_path / "out", "gpt", "ddp", now=t) for t in (0, 60))
    for run in (first, second):
        (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n')
        rundir.record_run(tmp_path / "out", "gpt", "ddp", run)
    latest = tmp_path / "out" / "gpt" / "ddp" / "latest"
    assert latest.is_symlink() and not Path(os.readlink(latest)).is_absolute() and latest.resolve() == second
    shutil.move(tmp_path / "out", tmp_path / "moved")  # a relative link still points into the tree
    moved = tmp_path / "moved" / "gpt" / "ddp" / "latest"
    assert rundir.last_run(tmp_path / "moved", "gpt", "ddp") == rundir.named_run(moved) == moved.resolve()
    assert read_run(moved).steps == [{"step": 1, "loss": 2.5}] and read_run(moved).path == moved.resolve()
    moved.unlink()
    moved.write_text(f"{moved.parent / second.relative_to(tmp_path / 'out' / 'gpt' / 'ddp')}\n")  # no links here
    assert read_run(moved).path == rundir.last_run(tmp_path / "moved", "gpt", "ddp") != moved
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint"):
        checkpoint.export_model(moved)  # the run, not the file `latest`: it has no checkpoint yet


def test_auto_resumes_only_a_run_with_a_complete_checkpoint(tmp_path):
    assert checkpoint.resumable_run(tmp_path, "gpt", "ddp") is None  # no run yet: start fresh
    run = rundir.new_run_dir(tmp_path, "gpt", "ddp", now=0)
    rundir.record_run(tmp_path, "gpt", "ddp", run)
    assert checkpoint.resumable_run(tmp_path, "gpt", "ddp") is None  # killed before its first save
    step = run / "checkpoints" / "step-0000010"
    step.mkdir(parents=True)
    (step / "trainer_state.pt").write_bytes(b"")
    (run / "checkpoints" / "latest").write_text("step-0000010\n")
    assert checkpoint.resumable_run(tmp_path, "gpt", "ddp") == run.resolve()
    assert checkpoint.resumable_run(tmp_path / "elsewhere", "gpt", "ddp", run_dir=run) == run  # train.run_dir
    later = rundir.new_run_dir(tmp_path, "gpt", "ddp", now=60)  # a later run, killed before its first checkpoint
    rundir.record_run(tmp_path, "gpt", "ddp", later)
    assert rundir.last_run(tmp_path, "gpt", "ddp") == later.resolve()
    assert checkpoint.resumable_run(tmp_path, "gpt", "ddp") == run.resolve()  # the earlier run's progress, kept
    (run / "checkpoints" / "latest").write_text("step-0000020\n")  # names a step that is not there
    with pytest.raises(checkpoint.CheckpointError, match="names step-0000020, which is missing or incomplete"):
        checkpoint.resumable_run(tmp_path, "gpt", "ddp")


def test_a_run_with_nothing_in_it_names_the_newest_run_that_has_it(tmp_path):
    """sample/export (no checkpoint) and report (no iteration logged) given `latest` that names a dead start: one
    line each, naming the newest run beside it that has what they need, as the command to run."""
    from meshtrain.report.runs import ReportError, check_not_empty, read_run

    saved, trained, same_second, dead = (rundir.new_run_dir(tmp_path, "gpt", "ddp", now=t) for t in (0, 60, 120, 120))
    assert same_second.name + "-1" == dead.name  # a second run in the same second: the newer, by its suffix
    for run in (saved, trained, same_second):
        (run / "metrics.jsonl").write_text('{"step": 0, "val_loss": 4.2}\n{"step": 1, "loss": 4.1}\n')
    (saved / "checkpoints").mkdir()
    (saved / "checkpoints" / "latest").write_text("step-0000010\n")
    (dead / "metrics.jsonl").write_text('{"step": 0, "val_loss": 4.2, "train_loss": 4.2}\n')  # killed after it
    for run in (saved, trained, same_second, dead):
        rundir.record_run(tmp_path, "gpt", "ddp", run)
    latest = tmp_path / "gpt" / "ddp" / "latest"
    with pytest.raises(checkpoint.CheckpointError) as said:
        checkpoint.load_language_model(latest, torch.device("cpu"))
    assert str(said.value) == (f"no checkpoint in {latest} (which names {dead}): it saved none (a start stopped before "
                               "its first checkpoint, or one with train.save_checkpoints=false); the newest run with "
                               f"one is {saved}: meshtrain sample --run {saved}")
    with pytest.raises(checkpoint.CheckpointError, match=f"the newest run with one is {saved}: meshtrain export"):
        checkpoint.export_model(latest)
    with pytest.raises(ReportError) as said:
        check_not_empty(read_run(latest), latest)
    assert str(said.value) == (f"nothing to report in {latest} (which names {dead}): it logged no iteration (a start "
                               f"stopped before its first); the newest run that did is {same_second}: meshtrain "
                               f"report {same_second}")
    check_not_empty(read_run(trained), trained)  # a run with iterations is reported
    assert rundir.runs(tmp_path, "gpt", "ddp")[:2] == [dead, same_second]
    rundir.record_run(tmp_path, "gpt", "ddp", saved)  # resumed: `latest` again, and first among the runs
    assert rundir.last_run(tmp_path, "gpt", "ddp") == saved and rundir.runs(tmp_path, "gpt", "ddp")[0] == saved


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_checkpoints_are_published_whole_kept_by_count_and_load_exactly(one_rank, tmp_path, async_save):
    from meshtrain.parallel.state_dict import load_model_and_optimizer_state, model_and_optimizer_state

    saver = checkpoint.Checkpointer(tmp_path, is_main=True, keep=2, async_save=async_save)
    for step in (10, 20, 30):
        model, optimizer = _model_and_optimizer(step)
        saver.save(step, model_and_optimizer_state(model, optimizer), {"iteration": step})
    saver.wait()
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-0000020", "step-0000030"]
    latest = checkpoint.latest_checkpoint(tmp_path)
    assert latest == root / "step-0000030" and checkpoint.load_trainer_state(latest) == {"iteration": 30}

    fresh, fresh_optimizer = _model_and_optimizer(0)
    load_model_and_optimizer_state(fresh, fresh_optimizer, checkpoint.dcp_loader(latest))
    for a, b in zip(fresh.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(fresh_optimizer.state[a]["exp_avg_sq"], optimizer.state[b]["exp_avg_sq"])


def test_a_save_killed_halfway_leaves_the_last_checkpoint_current(one_rank, tmp_path, monkeypatch):
    from meshtrain.parallel.state_dict import model_and_optimizer_state

    saver = checkpoint.Checkpointer(tmp_path, is_main=True)
    model, optimizer = _model_and_optimizer(1)
    saver.save(10, model_and_optimizer_state(model, optimizer), {"iteration": 10})

    def dies_after_some_files(state, checkpoint_id):
        Path(checkpoint_id).mkdir(parents=True)
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half a shard")
        raise KeyboardInterrupt  # as if the job were killed mid-write

    monkeypatch.setattr(checkpoint.dcp, "save", dies_after_some_files)
    with pytest.raises(KeyboardInterrupt):
        saver.save(20, model_and_optimizer_state(model, optimizer), {"iteration": 20})
    assert (tmp_path / "checkpoints" / ".step-0000020.partial").is_dir()
    assert checkpoint.latest_checkpoint(tmp_path).name == "step-0000010"
    assert checkpoint.load_trainer_state(checkpoint.latest_checkpoint(tmp_path))["iteration"] == 10


def test_missing_or_broken_checkpoints_are_named(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint in .*: it saved none"):
        checkpoint.latest_checkpoint(tmp_path)
    step = tmp_path / "checkpoints" / "step-0000005"
    step.mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("step-0000005\n")
    with pytest.raises(checkpoint.CheckpointError, match="names step-0000005, which is missing or incomplete"):
        checkpoint.latest_checkpoint(tmp_path)
    (step / "trainer_state.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(checkpoint.CheckpointError, match="trainer_state.pt is not a readable meshtrain trainer state"):
        checkpoint.load_trainer_state(checkpoint.latest_checkpoint(tmp_path))
    with pytest.raises(checkpoint.CheckpointError, match="could not be loaded into this model"):
        checkpoint.dcp_loader(step)({"model": {"w": torch.zeros(2)}})
