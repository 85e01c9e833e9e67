"""What a training iteration reports: the legend and log line, throughput, MFU, memory and timers.

MFU is only as honest as its peak, which comes from the machine profile (meshtrain.machine: a datasheet
figure for known accelerators, else measured in the dtype the matmuls run in). MFU is never clamped: a
figure over 100% means the peak is wrong, so MFUMeter measures the peak once more and, if the figure
stays impossible, says so on the log line instead of printing a silent 300%.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType

import torch

from meshtrain.runtime.device import synchronize
from meshtrain.runtime.log import get_logger
from meshtrain.runtime.setup import DistInfo, reduce_scalar

log = get_logger("train")

# Order is the order of the log line: per-iteration figures first, eval-only keys last so that the
# columns of ordinary lines stay put.
LEGEND: Mapping[str, str] = MappingProxyType({
    "step": "optimizer step (training iteration) just finished",
    "loss": "training loss of that iteration, mean over its micro-steps and data-parallel ranks",
    "dt": "seconds per training iteration: all micro-steps and the optimizer step",
    "dtf": "forward seconds of the iteration, summed over micro-steps",
    "dtb": "backward seconds of the iteration, summed over micro-steps",
    "sps": "samples per second: batch_size × grad_accum × data-parallel ranks / dt",
    "sps_per_gpu": "samples per second per rank/device (GPU, XPU or CPU rank): sps / world size",
    "tps": "tokens per second: sps × block_size",
    "tps_per_gpu": "tokens per second per rank/device: tps / world size",
    "mfu": "model FLOPs utilisation, %: model FLOP/s per device / the device's dense peak FLOP/s",
    "lr": "learning rate of the iteration",
    "grad_norm": "global gradient norm before clipping",
    "mem_gb": "peak memory since the previous evaluation, GiB (2^30 bytes): accelerator max allocated, or the CPU process's peak RSS",
    "dtfb": "forward + backward seconds under a pipeline schedule (they interleave), summed over micro-steps",
    "ranks": "(JSONL only) per figure (dt, dtf, dtb, dtfb, data: waiting for batches, opt: optimizer step, comm: DDP's "
             "wait for the gradient all-reduce, inside dtb; mem_gb) "
             "min, median, max over the ranks, the rank with the most, and each rank's value",
    "train_loss": "loss on training batches at evaluation",
    "val_loss": "loss on validation batches at evaluation",
    "epoch": "epochs done (with train.max_epochs)",
    "avg_loss": "mean training loss since the previous evaluation (over the epoch, with train.max_epochs)",
    "train_s": "training seconds since the previous evaluation, evaluation excluded",
    "avg_sps": "samples per second since the previous evaluation: samples trained / train_s",
    "eval_s": "seconds the evaluation took",
    "peak_gb": "memory high watermark since the previous evaluation, GiB, the largest over the ranks",
})  # a model adds the meanings of its own evaluation's keys (its ModelSpec.legend)

_SIX = {"loss", "dt", "dtf", "dtb", "dtfb", "train_loss", "val_loss", "avg_loss"}
_RATES = {"sps", "sps_per_gpu", "tps", "tps_per_gpu"}
_FORMATS = {**dict.fromkeys(_SIX, ".6f"), **dict.fromkeys(_RATES, ".3f"),
            "mfu": ".2f", "lr": ".3e", "grad_norm": ".4f", "mem_gb": ".3f", "peak_gb": ".3f", "avg_sps": ".3f",
            "train_s": ".3f", "eval_s": ".3f", "epoch": ".2f"}


def legend_table(keys: list[str] | None = None, extra: Mapping[str, str] = MappingProxyType({})):
    """The legend as a rich Table (printed once at the start of a run, as the seed does), with a model's own keys."""
    from rich.table import Table

    table = Table(title="metrics legend", title_justify="left")
    table.add_column("key", style="bold")
    table.add_column("meaning")
    meanings = {**LEGEND, **extra}
    for key in keys or meanings:
        table.add_row(key, meanings.get(key, ""))
    return table


def _format_value(key: str, value) -> str:
    if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy":
        value = value.item()  # 0-dim tensors and numpy scalars print as plain numbers
    if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if key in _FORMATS:
        return format(float(value), _FORMATS[key])
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def format_line(metrics: Mapping) -> str:
    """`step=10 loss=3.154310 dt=0.282833 …`: LEGEND order, absent/None keys skipped, unknown keys last; nested
    figures (the ranks' spread) are the JSONL's, not the line's."""
    keys = [k for k in LEGEND if k in metrics] + [k for k in metrics if k not in LEGEND]
    return " ".join(f"{k}={_format_value(k, metrics[k])}" for k in keys
                    if metrics[k] is not None and not isinstance(metrics[k], Mapping))


# ------------------------------------------------------------------------------------------- throughput
@dataclass(frozen=True)
class Throughput:
    """Samples and tokens per second of one iteration. `batch_size` is per rank and micro-step;
    `block_size` is tokens per sample (GPT context, ViT patches), None for no tps."""

    batch_size: int
    grad_accum: int = 1
    dp_size: int = 1
    world_size: int = 1
    block_size: int | None = None

    def __post_init__(self):
        if min(self.batch_size, self.grad_accum, self.dp_size, self.world_size) < 1:
            raise ValueError(f"batch_size, grad_accum, dp_size, world_size must be ≥ 1: {self}")
        if self.world_size % self.dp_size:
            raise ValueError(f"dp_size {self.dp_size} must divide world_size {self.world_size}")

    @property
    def samples_per_iter(self) -> int:
        # tp/cp/pp ranks of one replica share a batch, so only the data-parallel ranks multiply it.
        return self.batch_size * self.grad_accum * self.dp_size

    def rates(self, dt: float) -> dict[str, float]:
        if not dt > 0:
            raise ValueError(f"dt must be > 0 seconds, got {dt}")
        sps = self.samples_per_iter / dt
        out = {"sps": sps, "sps_per_gpu": sps / self.world_size}
        if self.block_size:
            out |= {"tps": sps * self.block_size, "tps_per_gpu": sps * self.block_size / self.world_size}
        return out


def throughput(batch_size: int, grad_accum: int, dp_size: int, world_size: int, block_size: int | None,
               dt: float) -> dict[str, float]:
    """{sps, sps_per_gpu, tps, tps_per_gpu} for one iteration of dt seconds (see Throughput)."""
    return Throughput(batch_size, grad_accum, dp_size, world_size, block_size).rates(dt)


def mfu(flops_per_token: float, tokens_per_second_per_device: float, peak: float) -> float:
    """Model FLOPs utilisation in percent of `peak` FLOP/s. Not clamped (see MFUMeter)."""
    if not peak > 0:
        raise ValueError(f"peak FLOP/s must be > 0, got {peak}")
    return 100.0 * flops_per_token * tokens_per_second_per_device / peak


class MFUMeter:
    """MFU of logged iterations against a Peak (meshtrain.machine.Peak), guarded: the first time a figure
    exceeds 100%, a measured peak is measured again (`remeasure`, keeping the better figure); a figure
    still over 100% comes back with a warning that names the peak's source and what to do."""

    def __init__(self, flops_per_token: float, peak, remeasure: Callable[[], object] | None = None):
        self.flops_per_token, self.peak, self.remeasure = flops_per_token, peak, remeasure

    def __call__(self, tokens_per_second_per_device: float) -> tuple[float, str | None]:
        value = mfu(self.flops_per_token, tokens_per_second_per_device, self.peak.flops)
        if value > 100 and self.remeasure is not None:
            before, self.remeasure, self.peak = self.peak, None, self.remeasure()
            log.warning("mfu %.0f%% is over 100%%: measuring the %s peak again (was %s)", value, before.label,
                        before.source)
            value = mfu(self.flops_per_token, tokens_per_second_per_device, self.peak.flops)
        if value <= 100:
            return value, None
        fix = ("run `meshtrain machine --refresh` on an idle machine" if self.peak.kind == "measured" else
               "check the device name against the datasheet table" if self.peak.kind == "datasheet" else
               "raise train.peak_flops")
        return value, (f"mfu {value:.0f}% is impossible: the peak ({self.peak.source}) is below what this run "
                       f"achieves ({self.peak.flops * value / 100:.4g} FLOP/s); set train.peak_flops or {fix}")


# -------------------------------------------------------------------------------------------- memory
def peak_memory_bytes(device: torch.device | str) -> int:
    """This rank's peak memory: accelerator max allocated; on a CPU the process's peak RSS (high water)."""
    device = torch.device(device)
    if device.type in ("cuda", "xpu"):
        return int(getattr(torch, device.type).max_memory_allocated(device))
    if device.type == "mps":
        return int(torch.mps.driver_allocated_memory())  # MPS keeps no peak; this is the current figure
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


def reset_peak_memory(device: torch.device | str) -> None:
    """Start a new peak. On Linux, writing 5 to clear_refs resets the RSS high watermark (and ru_maxrss)."""
    device = torch.device(device)
    if device.type in ("cuda", "xpu"):
        getattr(torch, device.type).reset_peak_memory_stats(device)
    elif device.type == "cpu" and sys.platform.startswith("linux"):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass  # a locked-down kernel: the peak then spans the whole process


# -------------------------------------------------------------------------------------------- timers
class StepTimer:
    """Named sections that add up over an iteration:

        with timer("dt"):
            for micro in range(accum):
                with timer("dtf"): loss = model(x, y)
                with timer("dtb"): loss.backward()
        metrics |= timer.pop()        # {"dt": …, "dtf": …, "dtb": …}, summed, then reset

    With sync (the logged iterations), a section times the device's work, not its launch: on CUDA by events
    recorded in the stream around it, read once at pop() (one wait for the GPU per logged iteration: synchronising
    at every section would drain the queue and leave the GPU idle while the next section launches); elsewhere by
    synchronising the device at both ends. Without sync, host wall-clock time only."""

    def __init__(self, device: torch.device | str, sync: bool = True):
        self.device = torch.device(device)
        self.sync = sync
        self.totals: dict[str, float] = {}
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.sync and self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events.append((name, start, end))
            return
        if self.sync:
            synchronize(self.device)
        t0 = time.perf_counter()
        yield
        if self.sync:
            synchronize(self.device)
        self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        if self.events:
            self.events[-1][2].synchronize()  # the last section to end: every other event has run by then
            for name, start, end in self.events:
                self.totals[name] = self.totals.get(name, 0.0) + start.elapsed_time(end) / 1e3
        out, self.totals, self.events = self.totals, {}, []
        return out


class Interval:
    """What happened since the previous evaluation (an epoch, when counting epochs): training time (wall time
    between two synchronised ends, so unsynchronised iterations count in full), iterations, the sum of their
    losses, and the memory high watermark."""

    def __init__(self, device: torch.device):
        self.device = device
        self.restart()

    def restart(self) -> None:
        self.iterations = 0
        self.loss_sum = torch.zeros((), device=self.device)
        reset_peak_memory(self.device)
        synchronize(self.device)
        self.started = time.perf_counter()

    def add(self, loss: torch.Tensor) -> None:
        self.loss_sum += loss
        self.iterations += 1

    def summary(self, mean_loss, samples_per_iter: int, info: DistInfo) -> dict[str, float]:
        if not self.iterations:
            return {}
        synchronize(self.device)
        seconds = time.perf_counter() - self.started
        peak = reduce_scalar(peak_memory_bytes(self.device), "max", "all_reduce of the memory high "
                             "watermark", info.timeout_s, self.device)
        return {"avg_loss": mean_loss(self.loss_sum / self.iterations, "all_reduce of the interval's training loss"),
                "train_s": seconds, "avg_sps": samples_per_iter * self.iterations / seconds,
                "peak_gb": peak / 2**30}
