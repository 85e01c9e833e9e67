"""One layout, measured: run on every rank of a job (`plan --validate` starts it under torchrun), it builds the run
exactly as `train` does (the Trainer, in a scratch directory), steps it, and records per rank:

    params, grads, optimizer   bytes held after a step (parallel.data_parallel.bytes_held)
    peak                       the most bytes of tensors alive at once during the measured steps: CUDA's
                               max_memory_allocated on a GPU; on a CPU, the allocator's own count, read from the
                               torch profiler's memory events (every allocation and free, from the process's start)
    step_s                     the median wall time of a step, timed without the profiler

    python -m torch.distributed.run --nproc-per-node 4 -m meshtrain.plan.measure gpt preset=cpu train.backend=fsdp
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time

import torch

from meshtrain import config as config_mod
from meshtrain import registry
from meshtrain.parallel.data_parallel import bytes_held
from meshtrain.runtime import distributed
from meshtrain.runtime.device import synchronize
from meshtrain.runtime.results import record

WINDOW = "meshtrain.plan.measured_step"


class TensorBytes:
    """Bytes of tensors alive over time on a CPU, from the profiler's record of every allocation and free."""

    def __init__(self):
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self.window = torch.profiler.record_function(WINDOW)
        self.marked = False

    def __enter__(self):
        self.profiler.start()
        return self

    def mark(self) -> None:
        """Peaks count from here on (the measured steps); allocations before still count as alive."""
        self.window.__enter__()
        self.marked = True

    def __exit__(self, *exc) -> None:
        if self.marked:
            self.window.__exit__(None, None, None)
        self.profiler.stop()

    def peak(self) -> int:
        recorded = self.profiler.profiler.kineto_results.events()
        events = sorted((e.start_ns(), e.nbytes()) for e in recorded if e.name() == "[memory]")
        start = min((e.start_ns() for e in recorded if e.name() == WINDOW), default=0)
        alive = best = 0
        for when, nbytes in events:
            alive += nbytes
            if when >= start:
                best = max(best, alive)
        return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--case", default="layout")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    spec = registry.get(args.model)
    with tempfile.TemporaryDirectory(prefix="meshtrain-measure-") as scratch:
        overrides = [*args.overrides, f"train.out_dir={scratch}", "train.save_checkpoints=false",
                     "train.log_interval=1000000", "train.eval_interval=1000000"]
        cfg = config_mod.load_config(overrides, spec.name)
        with distributed() as info:
            record(args.case, **measure(cfg, info, args.warmup, args.steps), rank=info.rank)


def measure(cfg, info, warmup: int, steps: int) -> dict:
    """Build the run as `train` would, step it `warmup` times, then measure one step's peak and `steps` steps' time."""
    from meshtrain.train.trainer import Trainer

    device = info.torch_device
    tracker = TensorBytes() if device.type == "cpu" else None
    with tracker or contextlib.nullcontext():
        trainer = Trainer(cfg, info)
        for it in range(warmup):
            trainer.step(it)
        if tracker:
            tracker.mark()
        else:
            torch.cuda.reset_peak_memory_stats(device)
        trainer.step(warmup)
    peak = tracker.peak() if tracker else torch.cuda.max_memory_allocated(device)
    held = {}
    zero_grad = trainer.optimizer.zero_grad

    def count_then_zero(*args, **kwargs):  # gradients exist between backward and zero_grad only
        held.update(bytes_held(trainer.model, trainer.optimizer))
        zero_grad(*args, **kwargs)

    times = []
    for it in range(warmup + 1, warmup + 1 + steps):
        trainer.optimizer.zero_grad = count_then_zero if it == warmup + steps else zero_grad
        synchronize(device)
        started = time.perf_counter()
        trainer.step(it)
        synchronize(device)
        times.append(time.perf_counter() - started)
    trainer.batches.close()
    trainer.sinks.close()
    return {**held, "peak": peak, "step_s": statistics.median(times)}

if __name__ == "__main__":
    main()
