"""Profiling: the torch trace covers exactly the asked window, nsys and NVTX stay out of a CPU run's way,
CUDA graphs on a CPU and bad settings are refused with the fix."""

import json
import logging

import pytest
import torch

from meshtrain.train.profiling import (
    CudaGraphsNeedCudaError,
    ProfilingError,
    StepProfiler,
    cuda_graphs_check,
    nvtx_range,
    record,
)

CPU = torch.device("cpu")


@pytest.fixture
def train_log(caplog, monkeypatch):
    """The meshtrain.train log records (configure_logging stops meshtrain's from reaching pytest's handler)."""
    monkeypatch.setattr(logging.getLogger("meshtrain"), "propagate", True)
    with caplog.at_level(logging.INFO, logger="meshtrain"):
        yield caplog


def train(profiler: StepProfiler, iterations) -> list[bool]:
    """A tiny model's training steps, each inside a range named it<i>; returns `active` per iteration."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    active = []
    try:
        for i in iterations:
            profiler.step(i)
            active.append(profiler.active)
            with record(f"it{i}", CPU):
                with record("forward", CPU):
                    loss = torch.nn.functional.mse_loss(model(x), y)
                with record("backward", CPU):
                    loss.backward()
                with record("optimizer", CPU):
                    optimizer.step()
                    optimizer.zero_grad()
    finally:
        profiler.close()
    return active


def trace_names(path) -> set[str]:
    return {event.get("name") for event in json.loads(path.read_text())["traceEvents"]}


def test_torch_trace_holds_exactly_the_window(tmp_path, train_log):
    profiler = StepProfiler("torch", start=2, steps=2, out_dir=tmp_path / "profile", rank=3, device=CPU)
    active = train(profiler, range(6))
    assert active == [False, False, True, True, False, False]
    path = tmp_path / "profile" / "trace_rank3.json"
    assert [p.name for p in (tmp_path / "profile").iterdir()] == ["trace_rank3.json"]
    names = trace_names(path)
    assert {f"it{i}" for i in range(6)} & names == {"it2", "it3"}
    assert {f"iteration {i}" for i in range(6)} & names == {"iteration 2", "iteration 3"}
    assert {"forward", "backward", "optimizer", "aten::addmm"} <= names
    (message,) = [m for m in train_log.messages if "traced to" in m]
    assert "iterations 2-3" in message and str(path) in message and "aten::" in message


def test_a_window_running_to_the_last_iteration_is_written_at_close(tmp_path):
    profiler = StepProfiler("torch", start=4, steps=5, out_dir=tmp_path, rank=0, device=CPU)
    assert train(profiler, range(6)) == [False, False, False, False, True, True]
    assert {f"it{i}" for i in range(6)} & trace_names(tmp_path / "trace_rank0.json") == {"it4", "it5"}
    profiler.close()  # a second close is a no-op
    assert not profiler.active


def test_a_run_that_raises_still_writes_its_trace(tmp_path):
    profiler = StepProfiler("torch", start=1, steps=3, out_dir=tmp_path, rank=0, device=CPU)
    with pytest.raises(ZeroDivisionError):
        try:
            for i in range(5):
                profiler.step(i)
                with record(f"it{i}", CPU):
                    if i == 2:
                        raise ZeroDivisionError
        finally:
            profiler.close()
    assert {f"it{i}" for i in range(5)} & trace_names(tmp_path / "trace_rank0.json") == {"it1", "it2"}


@pytest.mark.parametrize("iterations,why", [
    (range(200, 204), "before this run's first iteration 200"),
    (range(0, 50), "the run ended at iteration 49, before the window's start 100"),
])
def test_a_window_never_reached_writes_nothing_and_says_why(tmp_path, train_log, iterations, why):
    profiler = StepProfiler("torch", start=100, steps=2, out_dir=tmp_path / "profile", rank=0, device=CPU)
    assert not any(train(profiler, iterations))
    assert not (tmp_path / "profile").exists()
    (message,) = [m for m in train_log.messages if "profiling" in m]
    assert "nothing recorded" in message and why in message


def test_mode_none_records_nothing(tmp_path, train_log):
    profiler = StepProfiler("none", start=0, steps=3, out_dir=tmp_path / "profile", rank=0, device=CPU)
    assert train(profiler, range(4)) == [False] * 4
    assert not (tmp_path / "profile").exists() and not train_log.messages


def test_nsys_on_cpu_warns_once_and_does_nothing(tmp_path, train_log):
    profiler = StepProfiler("nsys", start=1, steps=2, out_dir=tmp_path / "profile", rank=0, device=CPU)
    assert train(profiler, range(5)) == [False] * 5
    assert [(r.levelname, "needs CUDA and nsys" in r.getMessage()) for r in train_log.records] == [
        ("WARNING", True)]
    assert not (tmp_path / "profile").exists()


def test_nvtx_range_on_cpu_is_a_no_op(monkeypatch):
    def fail(*args):
        raise AssertionError("torch.cuda.nvtx was touched on a CPU device")

    monkeypatch.setattr(torch.cuda.nvtx, "range_push", fail)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", fail)
    with nvtx_range("forward", CPU):
        value = 7
    with nvtx_range("forward", "cpu"), record("backward", "cpu"):
        value += 1
    assert value == 8


def test_cuda_graphs_on_cpu_are_refused_with_the_fix():
    with pytest.raises(CudaGraphsNeedCudaError, match="cuda_graphs=false") as err:
        cuda_graphs_check(True, CPU)
    assert isinstance(err.value, ValueError) and "on cpu" in str(err.value)
    assert cuda_graphs_check(False, CPU) is None


@pytest.mark.parametrize("mode,start,steps,match", [
    ("perfetto", 0, 1, "choose one of none, torch, nsys"),
    ("torch", -1, 1, "must be 0 or more"),
    ("torch", 0, 0, "at least 1 step"),
])
def test_bad_settings_are_refused(tmp_path, mode, start, steps, match):
    with pytest.raises(ProfilingError, match=match) as err:
        StepProfiler(mode, start=start, steps=steps, out_dir=tmp_path, rank=0, device=CPU)
    assert isinstance(err.value, ValueError)
