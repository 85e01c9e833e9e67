"""Profiling the training loop: a torch.profiler trace or an Nsight Systems window over a few iterations.

Profiling every step of a long run makes huge traces and slows it down, so one window of iterations
[start, start + steps) is recorded, after warm-up (as in NERSC's dl-at-scale-training tutorial):

    profiler = StepProfiler("torch", start=20, steps=5, out_dir=run_dir / "profile", rank=rank, device=device)
    try:
        for it in range(first, last):
            profiler.step(it)
            with record("forward", device): loss = model(x, y)
            with record("backward", device): loss.backward()
    finally:
        profiler.close()

mode "torch" writes a Chrome trace per rank (open it at https://ui.perfetto.dev) and logs the top ops.
mode "nsys" only marks the window for Nsight Systems, which the job runs under:
    nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop -t cuda,nvtx python -m meshtrain ...
In both, the named ranges (`record`, and one per iteration) show up as NVTX ranges on the nsys timeline.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from meshtrain.errors import MeshtrainError
from meshtrain.runtime.log import get_logger

log = get_logger("train")

MODES = ("none", "torch", "nsys")
TOP_OPS = 10  # rows of the op table logged when a torch trace is written


class ProfilingError(MeshtrainError, ValueError):
    """A profiling setting that cannot work: an unknown mode or an empty window."""


class CudaGraphsNeedCudaError(MeshtrainError, ValueError):
    """train.cuda_graphs was asked for on a device that has no CUDA kernels to capture."""


def _on_cuda(device: torch.device | str) -> bool:
    # torch.cuda.nvtx raises on a CPU-only build, so this is asked before touching anything CUDA.
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


@contextmanager
def nvtx_range(name: str, device: torch.device | str) -> Iterator[None]:
    """An NVTX range (a named span on the Nsight Systems timeline) on CUDA; nothing elsewhere."""
    if not _on_cuda(device):
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


@contextmanager
def record(name: str, device: torch.device | str) -> Iterator[None]:
    """A named part of an iteration (forward, backward, optimizer): a range in the torch trace and,
    on CUDA, an NVTX range for nsys. Outside a profiling window it costs next to nothing."""
    with torch.profiler.record_function(name), nvtx_range(name, device):
        yield


def cuda_graphs_check(enabled: bool, device: torch.device | str) -> None:
    """Refuse train.cuda_graphs=true on a device without CUDA, before any model is built."""
    if enabled and not _on_cuda(device):
        raise CudaGraphsNeedCudaError(
            f"train.cuda_graphs=true, but CUDA graphs capture GPU kernel launches and there is none on "
            f"{torch.device(device)}; set train.cuda_graphs=false"
        )


class StepProfiler:
    """Records iterations [start, start + steps) of the training loop; see the module's docstring.

    Iteration numbers are absolute: a run resumed at iteration 200 with start=100 records nothing (and
    says so at close), since the window it asked for lies in the attempt before."""

    def __init__(self, mode: str, *, start: int, steps: int, out_dir: str | os.PathLike, rank: int,
                 device: torch.device | str):
        if mode not in MODES:
            raise ProfilingError(f"unknown profiling mode {mode!r}: choose one of {', '.join(MODES)}")
        if start < 0:
            raise ProfilingError(f"profiling start iteration is {start}; it must be 0 or more")
        if steps < 1:
            raise ProfilingError(f"profiling window of {steps} steps; it must record at least 1 step")
        self.mode, self.start, self.steps = mode, int(start), int(steps)
        self.stop = self.start + self.steps
        self.out_dir, self.rank, self.device = Path(out_dir), rank, torch.device(device)
        self.trace_path = self.out_dir / f"trace_rank{rank}.json"
        self._profiler = None  # the running torch.profiler.profile, or True for a running nsys window
        self._iteration_range = None  # the open per-iteration range, closed when the next one begins
        self._first: int | None = None  # first and last iterations the loop reported
        self._last: int | None = None
        self._finished = False  # the window was recorded (or cut short by close)
        self._closed = False
        if mode == "nsys" and not _on_cuda(self.device) and rank == 0:
            log.warning("profiling mode nsys marks a capture window for Nsight Systems, which needs CUDA and "
                        "nsys; this run is on %s, so nothing will be recorded", self.device)

    @property
    def active(self) -> bool:
        """True during the iterations being recorded."""
        return self._profiler is not None

    @property
    def _can_record(self) -> bool:
        return self.mode == "torch" or (self.mode == "nsys" and _on_cuda(self.device))

    def step(self, iteration: int) -> None:
        """Call at the top of every training iteration, with its absolute number."""
        if not self._can_record or self._closed:
            return
        if self._first is None:
            self._first = iteration
        self._last = iteration
        if self.active:
            self._end_iteration_range()
            if iteration >= self.stop:
                self._finish()
                return
            self._begin_iteration_range(iteration)
        elif not self._finished and iteration == self.start:
            self._begin()
            self._begin_iteration_range(iteration)

    def close(self) -> None:
        """End of training (or training raised): finish a window still open; say why none was recorded.

        Safe to call twice. It runs in the loop's `finally`, so a trace that cannot be written is
        logged rather than raised: it must not hide the error that stopped training."""
        if self._closed:
            return
        self._closed = True
        if not self._can_record:
            return
        if self.active:
            self._end_iteration_range()
            try:
                self._finish()
            except Exception:  # noqa: BLE001 - logged: see the docstring
                log.exception("profiling: could not finish the %s profile", self.mode)
        elif not self._finished:
            log.info("profiling (%s): nothing recorded: %s", self.mode, self._why_nothing())

    def _why_nothing(self) -> str:
        if self._first is None:
            return "the loop ran no iteration"
        if self._first > self.start:
            return (f"the window starts at iteration {self.start}, before this run's first iteration "
                    f"{self._first} (a resumed run); set a later start")
        return f"the run ended at iteration {self._last}, before the window's start {self.start}"

    def _begin(self) -> None:
        if self.mode == "nsys":
            torch.cuda.profiler.start()
            self._profiler = True
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=False,
                                                profile_memory=True, with_stack=False)
        self._profiler.start()

    def _finish(self) -> None:
        profiler, self._profiler, self._finished = self._profiler, None, True
        last = self._last if self._last < self.stop else self.stop - 1
        if self.mode == "nsys":
            torch.cuda.profiler.stop()
            log.info("profiling (nsys): iterations %d-%d captured", self.start, last)
            return
        profiler.stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        partial = self.trace_path.with_name(f".{self.trace_path.name}.{os.getpid()}.tmp")
        profiler.export_chrome_trace(str(partial))
        os.replace(partial, self.trace_path)  # a reader never sees half a trace
        # "cuda": newer torch reads it as its renamed "device" time, older torch as it is.
        time_key = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=time_key, row_limit=TOP_OPS)
        log.info("profiling (torch): iterations %d-%d traced to %s (open it at https://ui.perfetto.dev); "
                 "top %d ops by %s:\n%s", self.start, last, self.trace_path, TOP_OPS, time_key, table)

    def _begin_iteration_range(self, iteration: int) -> None:
        self._iteration_range = record(f"iteration {iteration}", self.device)
        self._iteration_range.__enter__()

    def _end_iteration_range(self) -> None:
        if self._iteration_range is not None:
            self._iteration_range.__exit__(None, None, None)
            self._iteration_range = None
