"""Atomic checkpoints, run directories, and the learning-rate schedule."""

import math

import pytest
import torch

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
    a = checkpoint.new_run_dir(tmp_path, "gpt", "ddp", now=0)
    b = checkpoint.new_run_dir(tmp_path, "gpt", "ddp", now=0)
    assert a != b and a.parent == b.parent and a.is_dir()
    checkpoint.record_run(tmp_path, "gpt", "ddp", a)
    checkpoint.record_run(tmp_path, "gpt", "ddp", b)
    assert checkpoint.latest_run(tmp_path, "gpt", "ddp") == b.resolve()
    assert len((tmp_path / "checkpoints.log").read_text().splitlines()) == 2


def test_resume_without_any_run_is_a_clear_error(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="found no earlier run"):
        checkpoint.latest_run(tmp_path, "gpt", "ddp")


def test_save_is_atomic_when_interrupted(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, {"iteration": 1, "w": torch.ones(3)})

    def dies_half_way(obj, f, *args, **kwargs):
        with open(f, "wb") as out:
            out.write(b"half a checkpoint")
        raise KeyboardInterrupt  # a kill during the write

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, {"iteration": 2, "w": torch.zeros(3)})
    state = checkpoint.load(tmp_path)
    assert state["iteration"] == 1 and torch.equal(state["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"], "no temporary file is left behind"


def test_corrupt_or_missing_checkpoint_names_the_file(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint at"):
        checkpoint.load(tmp_path)
    (tmp_path / "ckpt.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(checkpoint.CheckpointError, match="ckpt.pt is not a readable meshtrain checkpoint"):
        checkpoint.load(tmp_path)
