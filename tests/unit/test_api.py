"""The public API on one process: every name resolves, parallelize refuses what it cannot do with the fix in the
message, Checkpoints round-trips a model and optimizer with extras, MetricsRecorder writes the trainer's row.
(Many ranks: tests/distributed/test_examples.py.)"""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel

import meshtrain
from meshtrain.runtime.setup import DistInfo


def test_every_public_name_resolves_and_nothing_else_does():
    for name in meshtrain.__all__:
        assert getattr(meshtrain, name) is not None, name
    assert issubclass(meshtrain.MeshError, meshtrain.MeshtrainError)
    assert issubclass(meshtrain.TrainingDiverged, meshtrain.MeshtrainError)
    assert sorted(dir(meshtrain)) == sorted(meshtrain.__all__)
    with pytest.raises(AttributeError, match="no attribute 'Trainer'"):
        meshtrain.Trainer  # noqa: B018 - internal: not reachable from the package


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


ONE = meshtrain.ParallelDims(world_size=1)


@pytest.mark.parametrize("kwargs, dims, message", [
    ({"blocks": "blocks"}, ONE, "blocks='blocks': Stack has no such submodule"),
    ({"blocks": "out"}, ONE, "blocks='out' is a Linear: it must be the ModuleList or ModuleDict"),
    ({"blocks": "layers", "tp_plan": {"layers.*.1": ColwiseParallel(), "layers.*.fc": ColwiseParallel()}}, ONE,
     "tp_plan path 'layers.*.fc' matches no module of Stack"),
    ({"blocks": "layers", "backend": "zero4"}, ONE, "backend='zero4': choose one of ddp, zero1"),
    ({"blocks": "layers"}, meshtrain.ParallelDims(world_size=2), "got a None mesh for dims of 2 rank"),
])
def test_parallelize_refuses_with_the_thing_and_the_fix(kwargs, dims, message):
    with pytest.raises(meshtrain.MeshError, match=message.replace("(", r"\(").replace("*", r"\*")):
        meshtrain.parallelize(Stack(), dims, None, **kwargs)


def test_parallelize_on_one_process_checkpoints_the_blocks_and_computes_the_same():
    torch.manual_seed(0)
    plain, x = Stack(), torch.randn(4, 8)
    laid_out = Stack()
    laid_out.load_state_dict(plain.state_dict())
    returned = meshtrain.parallelize(laid_out, ONE, None, blocks="layers", activation_checkpointing="full")
    assert returned is laid_out and all(hasattr(b, "_checkpoint_wrapped_module") for b in laid_out.layers)
    assert set(laid_out.state_dict()) == set(plain.state_dict())  # names as a checkpoint keeps them
    plain(x).pow(2).sum().backward()
    laid_out(x).pow(2).sum().backward()
    for (name, a), b in zip(plain.named_parameters(), laid_out.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)  # recomputed, not approximated


def test_checkpoints_save_and_load_model_optimizer_and_extras(one_rank, tmp_path):
    torch.manual_seed(0)
    model = Stack()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    checkpoints = meshtrain.Checkpoints(tmp_path, keep=2)
    assert checkpoints.latest() is None
    for step in (1, 2, 3):
        model(torch.randn(2, 8)).sum().backward()
        optimizer.step()
        path = checkpoints.save(step, model, optimizer, data_position=torch.tensor(step * 10), note="kept")
    assert checkpoints.latest() == path and path.name == "step-0000003"
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-0000002", "step-0000003"]
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    moments = optimizer.state[model.out.weight]["exp_avg"].clone()

    torch.manual_seed(1)
    other = Stack()
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=0.1)
    other(torch.randn(2, 8)).sum().backward()
    other_optimizer.step()
    extra = checkpoints.load(other, other_optimizer)
    assert extra["step"] == 3 and extra["note"] == "kept" and int(extra["data_position"]) == 30
    for name, value in other.state_dict().items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=name)
    torch.testing.assert_close(other_optimizer.state[other.out.weight]["exp_avg"], moments, rtol=0, atol=0)


def one_process(device: str = "cpu") -> DistInfo:
    return DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, num_nodes=1, launcher="none",
                    scheduler="none", job_id=None, hostname="here", hosts=("here",), master_addr="127.0.0.1",
                    master_port=0, rendezvous="single process", device=device, backend="gloo", timeout_s=60.0,
                    torch_version=torch.__version__, threads_per_rank=1, command="test")


def test_the_recorder_writes_the_trainers_row_with_rates_and_mfu_from_its_sections(tmp_path):
    recorder = meshtrain.MetricsRecorder(tmp_path, one_process(), batch_size=4, grad_accum=2, tokens_per_sample=16,
                                         flops_per_token=1e6, peak_flops=1e12)
    with pytest.raises(meshtrain.MeshtrainError, match="found no iteration"):
        recorder.log(1, 1.0)
    for first in (True, False):  # two iterations: the row is the last one's
        with recorder.section("dt"):
            time.sleep(0.3 if first else 0)
            for _ in range(2):  # two micro-steps: their forward times add up
                with recorder.section("dtf"):
                    torch.ones(64, 64) @ torch.ones(64, 64)
            with recorder.section("opt"):
                pass
    row = recorder.log(2, torch.tensor(2.5), lr=1e-3)
    dt = row["dt"]
    assert dt < 0.3  # not the first iteration's, nor the two added
    assert row["loss"] == 2.5 and row["lr"] == 1e-3 and 0 < row["dtf"] < dt
    assert row["sps"] == pytest.approx(4 * 2 / dt) and row["tps"] == pytest.approx(4 * 2 * 16 / dt)
    assert row["mfu"] == pytest.approx(100 * 1e6 * row["tps_per_gpu"] / 1e12)
    assert "opt" not in row and row["ranks"]["opt"]["each"][0] >= 0  # the spread keeps it, the line does not
    with recorder.section("dt"):
        pass
    with pytest.raises(meshtrain.TrainingDiverged, match=f"training loss is nan at iteration 3.*{tmp_path}"):
        recorder.log(3, math.nan)
    from meshtrain.train.trainer import divergence_suspect

    assert "pytorch/pytorch#196681" in divergence_suspect(True, torch.device("cpu"))  # what the Trainer sets
    assert divergence_suspect(False, torch.device("cpu")) == divergence_suspect(True, torch.device("cuda")) == ""
    recorder.divergence_suspect = ". A suspect named by the run"
    with recorder.section("dt"):
        pass
    with pytest.raises(meshtrain.TrainingDiverged, match="resume from it. A suspect named by the run$"):
        recorder.log(3, math.inf)
    recorder.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2] and rows[0]["ranks"]["dt"]["slowest"] == 0
