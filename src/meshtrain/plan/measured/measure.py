"""One layout, measured: run on every rank of a job (`plan --validate` starts it under torchrun), it builds the run
exactly as `train` does (the Trainer, in a scratch directory), steps it, and records per rank:

    params, grads, optimizer   bytes held after a step (parallel.data_parallel.bytes_held)
    peak                       the most bytes of tensors alive at once during a measured step (the least of
                               PEAK_STEPS steps'): CUDA's max_memory_allocated on a GPU; on a CPU, the storages
                               every op made, counted from the process's start until each dies (TensorBytes)
    step_s                     the median wall time of a step, timed without the counting, from its batches in
                               hand (data loading is not part of what the planner predicts)
    a2a_bytes                  what expert parallelism's dispatch and combine passed to all_to_all in the measured
                               step, forward and backward (parallel/expert_parallel.sent_bytes; 0 without ep)
    calls                      the collective calls of that step by op, as the backend ran them (the profiler's
                               "gloo:all_reduce", "nccl:all_gather", ... events; gloo runs a reduce-scatter as an
                               all-reduce)

    python -m torch.distributed.run --nproc-per-node 4 -m meshtrain.plan.measured.measure gpt preset=cpu train.backend=fsdp

`--cases` runs several in one job, sparing a start-up of the ranks each: the calibration's tiny runs, and on a CPU
the layouts `plan --validate` measures (each case's storages are counted from its own start). On a GPU a layout's
peak is measured in a job of its own (the CUDA allocator's cache starts empty).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import tempfile
import time
import weakref
from collections import Counter
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from meshtrain import config as config_mod
from meshtrain import registry
from meshtrain.parallel.data_parallel import bytes_held
from meshtrain.parallel.expert_parallel import sent_bytes
from meshtrain.runtime.device import synchronize
from meshtrain.runtime.results import record
from meshtrain.runtime.setup import distributed
from meshtrain.train.trainer import Trainer

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig


class TensorBytes(TorchDispatchMode):
    """Bytes of tensor storages alive at once, counted as this process's ops create them and as they die.

    Every op dispatched on this thread is seen here, those autograd and DDP's reducer issue from C++ included, and
    each new storage is counted until its last reference goes, in whatever thread that happens. That last point is
    why this is not the profiler's allocation record: gloo drops the buffers of a collective in its own threads,
    whose frees the profiler never sees, so its running total grows by megabytes a step under tensor parallelism.
    Storages resized in place (FSDP2 frees and regathers parameters that way) are followed through resize_. What
    kernels allocate for themselves and never hand back as a tensor is not counted: it is not the tensors' bytes."""

    counted: type = torch.Tensor  # the tensors whose storages count (plan/measured/trace.py counts fake ones)

    def __init__(self):
        super().__init__()
        self.alive = self.peak_bytes = 0
        self.sizes: dict[int, int] = {}  # id of a counted storage -> its bytes
        self.refs: dict[int, weakref.ref] = {}
        self.resize = torch.UntypedStorage.resize_

    def __enter__(self):
        tracker = self

        def resize_(storage, size):
            tracker.resize(storage, size)
            key = id(storage)
            if key in tracker.sizes and tracker.refs[key]() is storage:
                tracker._add(storage.nbytes() - tracker.sizes[key])
                tracker.sizes[key] = storage.nbytes()

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self.resize
        return super().__exit__(*exc)

    def mark(self) -> None:
        """Peaks count from here on (the measured steps); storages made before still count as alive."""
        self.peak_bytes = self.alive

    def peak(self) -> int:
        return self.peak_bytes

    def _add(self, nbytes: int) -> None:
        self.alive += nbytes
        self.peak_bytes = max(self.peak_bytes, self.alive)

    def _count(self, tensor: torch.Tensor) -> None:
        if type(tensor) is not self.counted or tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self.sizes and self.refs[key]() is storage:
            return
        self.sizes[key] = storage.nbytes()
        self.refs[key] = weakref.ref(storage, lambda _, key=key: self._gone(key))
        self._add(self.sizes[key])

    def _gone(self, key: int) -> None:
        self.alive -= self.sizes.pop(key, 0)
        self.refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor turn it into ops on local tensors, which come back through here
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):  # most ops: one tensor, or a tuple of them, without pytree's walk
            self._count(out)
        elif isinstance(out, tuple | list) and all(isinstance(t, torch.Tensor) for t in out):
            for tensor in out:
                self._count(tensor)
        else:
            tree_map_only(torch.Tensor, self._count, out)
        return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--case", default="layout")
    parser.add_argument("--cases", type=json.loads, default=None, metavar="JSON",
                        help='{"case": [overrides], ...}: each run in turn in this one job, after the overrides above '
                             "(calibration's tiny runs: one start-up of the ranks, not one per run); a case "
                             '{"model": NAME, "overrides": [...]} runs another model, without the overrides above')
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    cases = args.cases or {args.case: []}
    with tempfile.TemporaryDirectory(prefix="meshtrain-measure-") as scratch, distributed() as info:
        for i, (case, own) in enumerate(cases.items()):
            model, overrides = case_run(args.model, args.overrides, own)
            cfg = run_config(model, overrides, f"{scratch}/{i}")  # run dirs are named by the second
            record(case, **measure(cfg, info, args.warmup, args.steps), rank=info.rank)
            gc.collect()  # the last case's Trainer, now garbage: not collected in the middle of the next one's steps


def case_run(model: str, overrides: list[str], own: list[str] | dict) -> tuple[str, list[str]]:
    """(model, overrides) of one of --cases: its own overrides after the job's, or its own model and overrides
    instead (one job's start-up of the ranks shared by several models' cases)."""
    if isinstance(own, dict):
        return own["model"], list(own.get("overrides", []))
    return model, [*overrides, *own]


# Steps alone: nothing saved, logged or evaluated, and iterations counted (a preset's max_epochs, the ViT's, would
# refuse an eval_interval: it evaluates after each epoch).
STEPS_ONLY = ["train.save_checkpoints=false", "train.log_interval=1000000", "train.eval_interval=1000000",
              "train.max_epochs=null"]


def run_config(model: str, overrides: list[str], scratch: str) -> RunConfig:
    """The run `overrides` describe, as measured here: writing only into `scratch`, doing nothing but steps."""
    return config_mod.load_config([*overrides, f"train.out_dir={scratch}", *STEPS_ONLY], registry.get(model).name)


# A step's peak is the least of this many steps' (each counted from its own start). gloo frees a collective's input
# in its own thread once the collective completes, which under load (ranks sharing cores, a slow peer) can come after
# this thread has gone on to allocate more: a late free raises a step's peak, never lowers it. It happened in CI:
# one rank of the ViT's fsdp × tp 2 held its 128 KiB field a moment too long, 5.9% over its usual peak.
PEAK_STEPS = 2


def measure(cfg: RunConfig, info, warmup: int, steps: int) -> dict:
    """Build the run as `train` would, step it `warmup` times, then measure the peak of the next PEAK_STEPS steps
    (the least of theirs; the first's collective calls) and `steps` steps' time."""
    device = info.torch_device
    tracker = TensorBytes() if device.type == "cpu" else None
    with tracker or contextlib.nullcontext():
        trainer = Trainer(cfg, info)
        for it in range(warmup):
            trainer.step(it)
        sent_bytes(trainer.model, reset=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiled:
            peaks = [_step_peak(trainer, warmup, tracker)]
        exchanged = sent_bytes(trainer.model, reset=True)
        peaks += [_step_peak(trainer, it, tracker) for it in range(warmup + 1, warmup + PEAK_STEPS)]
    # the raw events: the profiler's own events() builds a FunctionEvent tree of every op of the step first
    calls = Counter(name.split(":", 1)[1] for event in profiled.profiler.kineto_results.events()
                    if (name := event.name()).startswith(("gloo:", "nccl:")))
    peak = min(peaks)
    held = {}
    zero_grad = trainer.optimizer.zero_grad

    def count_then_zero(*args, **kwargs):  # gradients exist between backward and zero_grad only
        held.update(bytes_held(trainer.model, trainer.optimizer))
        zero_grad(*args, **kwargs)

    times, next_batch, first = [], trainer.batches.next_batch, warmup + PEAK_STEPS
    for it in range(first, first + steps):
        trainer.optimizer.zero_grad = count_then_zero if it == first + steps - 1 else zero_grad
        # the step from batches in hand: the planner does not model data loading (a loader's workers overlap it)
        ready = [next_batch() for _ in range(cfg.train.grad_accum)]
        trainer.batches.next_batch = ready.pop
        ready.reverse()
        synchronize(device)
        started = time.perf_counter()
        trainer.step(it)
        synchronize(device)
        times.append(time.perf_counter() - started)
    trainer.batches.next_batch = next_batch
    trainer.batches.close()
    trainer.sinks.close()
    return {**held, "peak": peak, "step_s": statistics.median(times), "a2a_bytes": exchanged, "calls": dict(calls)}


def _step_peak(trainer: Trainer, it: int, tracker: TensorBytes | None) -> int:
    """The most bytes alive during step `it`, counted from its start: the tracker's on a CPU, CUDA's on a GPU."""
    if tracker:
        tracker.mark()
    else:
        torch.cuda.reset_peak_memory_stats(trainer.device)
    trainer.step(it)
    return tracker.peak() if tracker else torch.cuda.max_memory_allocated(trainer.device)


if __name__ == "__main__":
    main()
