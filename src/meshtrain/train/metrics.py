"""What a training iteration reports: the legend and log line, throughput, MFU, memory and timers.

MFU is only as honest as its peak. The table below holds each device's dense (no 2:4 sparsity) peak
FLOP/s as torch sees the device, with its datasheet; an accelerator not in the table, and every CPU,
gets a peak measured by a short matmul in the training dtype, cached on disk. MFU is never clamped:
a figure over 100% means the peak is wrong, and hiding that would hide the bug.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from meshtrain.dist.device import synchronize
from meshtrain.dist.log import get_logger

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
    "train_loss": "loss on training batches at evaluation",
    "val_loss": "loss on validation batches at evaluation",
    "epoch": "epochs done (with train.max_epochs)",
    "avg_loss": "mean training loss since the previous evaluation (over the epoch, with train.max_epochs)",
    "train_s": "training seconds since the previous evaluation, evaluation excluded",
    "avg_sps": "samples per second since the previous evaluation: samples trained / train_s",
    "eval_s": "seconds the evaluation took",
    "peak_gb": "memory high watermark since the previous evaluation, GiB, the largest over the ranks",
    "val_rmse_u10": "vit: RMSE of the u10 forecast in m/s, per sample over the grid, mean over the validation set",
    "persistence_rmse_u10": "vit: the same RMSE for the persistence forecast (forecast = input): the score to beat",
    "val_skill_u10": "vit: 1 - val_rmse_u10 / persistence_rmse_u10 (0: no better than persistence, 1: perfect)",
})

_SIX = {"loss", "dt", "dtf", "dtb", "dtfb", "train_loss", "val_loss", "avg_loss"}
_RATES = {"sps", "sps_per_gpu", "tps", "tps_per_gpu"}
_FORMATS = {**dict.fromkeys(_SIX, ".6f"), **dict.fromkeys(_RATES, ".3f"),
            "mfu": ".2f", "lr": ".3e", "grad_norm": ".4f", "mem_gb": ".3f", "peak_gb": ".3f", "avg_sps": ".3f",
            "train_s": ".3f", "eval_s": ".3f", "epoch": ".2f"}


def legend_table(keys: list[str] | None = None):
    """The legend as a rich Table (printed once at the start of a run, as the seed does)."""
    from rich.table import Table

    table = Table(title="metrics legend", title_justify="left")
    table.add_column("key", style="bold")
    table.add_column("meaning")
    for key in keys or LEGEND:
        table.add_row(key, LEGEND.get(key, ""))
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
    """`step=10 loss=3.154310 dt=0.282833 …`: LEGEND order, absent/None keys skipped, unknown keys last."""
    keys = [k for k in LEGEND if k in metrics] + [k for k in metrics if k not in LEGEND]
    return " ".join(f"{k}={_format_value(k, metrics[k])}" for k in keys if metrics[k] is not None)


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
    """Model FLOPs utilisation in percent of `peak`. Not clamped: over 100 on a table device means the
    peak or the model's FLOP count is wrong; against a measured peak it means the model's matmuls ran
    faster than the calibration's (the source string says which peak it was)."""
    if not peak > 0:
        raise ValueError(f"peak FLOP/s must be > 0, got {peak}")
    return 100.0 * flops_per_token * tokens_per_second_per_device / peak


# ------------------------------------------------------------------------------------------- peak table
@dataclass(frozen=True)
class PeakEntry:
    """Dense peak FLOP/s of one torch device, per dtype ('bf16', 'fp16', 'tf32', 'fp32'); None: no
    hardware path (then the peak is measured). `stacks` > 1: the card holds that many torch devices."""

    name: str
    flops: Mapping[str, float | None]
    source: str
    note: str = ""
    stacks: int = 1


def _entry(name, bf16, fp16, tf32, fp32, source, note="", stacks=1) -> PeakEntry:
    t = 1e12
    flops = {k: None if v is None else v * t for k, v in (("bf16", bf16), ("fp16", fp16), ("tf32", tf32),
                                                          ("fp32", fp32))}
    return PeakEntry(name, MappingProxyType(flops), source, note, stacks)


def _nv(name, bf16, fp16, tf32, fp32, source, note="datasheet tensor figures are 2:4-sparse; these are half"):
    return _entry(name, bf16, fp16, tf32, fp32, source, note)


_NO_BF16 = "no bf16 hardware (torch emulates it): bf16 is measured"
_ENTRIES = [
    # NVIDIA, TFLOP/s:   bf16    fp16    tf32   fp32 (fp32: the FMA units, no tensor cores)
    _nv("NVIDIA GB200",  2500,   2500,   1250,  80, "GB200 NVL72 datasheet, rack / 72"),
    _nv("NVIDIA B200",   2250,   2250,   1125,  75, "HGX B200 datasheet, board / 8"),
    _nv("NVIDIA GH200",  989.4,  989.4,  494.7, 66.9, "GH200 Grace Hopper Superchip datasheet"),
    _nv("NVIDIA H200 NVL", 835.5, 835.5, 417.5, 60, "H200 Tensor Core GPU datasheet (NVL)"),
    _nv("NVIDIA H200",   989.4,  989.4,  494.7, 66.9, "H200 Tensor Core GPU datasheet (SXM)"),
    _nv("NVIDIA H100 NVL", 835.5, 835.5, 417.5, 60, "H100 Tensor Core GPU datasheet (NVL)"),
    _nv("NVIDIA H100 PCIe", 756.5, 756.5, 378,  51.2, "H100 Tensor Core GPU Architecture whitepaper"),
    _nv("NVIDIA H100 SXM", 989.4, 989.4, 494.7, 66.9, "H100 Tensor Core GPU Architecture whitepaper"),
    _nv("NVIDIA A100",   312,    312,    156,   19.5, "A100 Tensor Core GPU datasheet (SXM, PCIe)"),
    _nv("NVIDIA A40",    149.7,  149.7,  74.8,  37.4, "A40 datasheet"),
    _nv("NVIDIA A30",    165,    165,    82,    10.3, "A30 Tensor Core GPU datasheet"),
    _nv("NVIDIA A10",    125,    125,    62.5,  31.2, "A10 Tensor Core GPU datasheet"),
    _nv("NVIDIA L40S",   362.05, 362.05, 183,   91.6, "L40S GPU datasheet"),
    _nv("NVIDIA L40",    181.05, 181.05, 90.5,  90.5, "L40 GPU datasheet"),
    _nv("NVIDIA L4",     121,    121,    60,    30.3, "L4 Tensor Core GPU datasheet"),
    _nv("NVIDIA V100S PCIe", None, 130,  None,  16.4, "V100 Tensor Core GPU datasheet", _NO_BF16),
    _nv("NVIDIA V100 PCIe", None, 112,   None,  14,   "V100 Tensor Core GPU datasheet", _NO_BF16),
    _nv("NVIDIA V100 SXM2", None, 125,   None,  15.7, "V100 Tensor Core GPU datasheet", _NO_BF16),
    _nv("NVIDIA T4",     None,   65,     None,  8.1,  "T4 Tensor Core GPU datasheet", _NO_BF16),
    # AMD: an MI250X/MI250 package holds two GCDs and torch sees each GCD as a device: half the package.
    # fp32 is the matrix (MFMA) rate, which matmuls use; MI200 has no tf32, so fp32 stands in.
    _entry("AMD Instinct MI250X (one GCD)", 191.5, 191.5, None, 47.85,
           "AMD Instinct MI250X datasheet, package / 2", "383 TFLOP/s bf16 per OAM package"),
    _entry("AMD Instinct MI250 (one GCD)", 181.05, 181.05, None, 45.25,
           "AMD Instinct MI250 datasheet, package / 2", "362.1 TFLOP/s bf16 per OAM package"),
    _entry("AMD Instinct MI210", 181, 181, None, 45.3, "AMD Instinct MI210 datasheet"),
    _entry("AMD Instinct MI325X", 1307.4, 1307.4, 653.7, 163.4, "AMD Instinct MI325X datasheet", "SPX mode"),
    _entry("AMD Instinct MI300X", 1307.4, 1307.4, 653.7, 163.4, "AMD Instinct MI300X datasheet", "SPX mode"),
    _entry("AMD Instinct MI300A", 980.6, 980.6, 490.3, 122.6, "AMD Instinct MI300A datasheet"),
    # Intel PVC: 2 stacks × 64 Xe cores × 8 XMX × 512 bf16 FLOP/clk × 1.6 GHz = 839 TFLOP/s per card.
    # Torch sees one stack per device in FLAT mode (the default, Aurora's), the card in COMPOSITE mode.
    _entry("Intel Data Center GPU Max 1550 (one stack)", 419.4, 419.4, 209.7, 26.2,
           "Intel Data Center GPU Max Series product brief, card / 2",
           "839 bf16, 52.4 fp32 TFLOP/s per card", stacks=2),
]
PEAK_FLOPS: Mapping[str, PeakEntry] = MappingProxyType({e.name: e for e in _ENTRIES})

# First match wins, so a specific name precedes the one it contains (GB200 ⊃ B200, GH200 vs H200,
# H100 PCIe/NVL before plain H100 = SXM). Where a name leaves the part open ("gfx942", "MI250X/MI250"),
# the larger peak is chosen: a wrong guess then understates MFU instead of overstating it.
_PATTERNS = [(re.compile(p, re.I), PEAK_FLOPS[n]) for p, n in [
    (r"\bGB200\b", "NVIDIA GB200"), (r"\bB200\b", "NVIDIA B200"), (r"\bGH200\b", "NVIDIA GH200"),
    (r"\bH200 NVL\b", "NVIDIA H200 NVL"), (r"\bH200\b", "NVIDIA H200"),
    (r"\bH100 NVL\b", "NVIDIA H100 NVL"), (r"\bH100\b.*\bPCIe\b", "NVIDIA H100 PCIe"),
    (r"\bH100\b", "NVIDIA H100 SXM"), (r"\bA[18]00\b", "NVIDIA A100"), (r"\bA40\b", "NVIDIA A40"),
    (r"\bA30\b", "NVIDIA A30"), (r"\bA10\b", "NVIDIA A10"),
    (r"\bL40S\b", "NVIDIA L40S"), (r"\bL40\b", "NVIDIA L40"), (r"\bL4\b", "NVIDIA L4"),
    (r"\bV100S\b", "NVIDIA V100S PCIe"), (r"\bV100\b.*\bPCIe\b", "NVIDIA V100 PCIe"),
    (r"\bV100\b", "NVIDIA V100 SXM2"), (r"\bT4\b", "NVIDIA T4"),
    (r"\bMI250X\b", "AMD Instinct MI250X (one GCD)"), (r"\bMI250\b", "AMD Instinct MI250 (one GCD)"),
    (r"\bgfx90a\b", "AMD Instinct MI250X (one GCD)"), (r"\bMI210\b", "AMD Instinct MI210"),
    (r"\bMI325X\b", "AMD Instinct MI325X"), (r"\bMI300X\b", "AMD Instinct MI300X"),
    (r"\bMI300A\b", "AMD Instinct MI300A"), (r"\bgfx942\b", "AMD Instinct MI300X"),
    (r"\bMax 1550\b", "Intel Data Center GPU Max 1550 (one stack)"),
]]


def match_device(name: str) -> PeakEntry | None:
    """The table entry for a torch device name ("NVIDIA H100 80GB HBM3" -> H100 SXM), or None."""
    return next((entry for pattern, entry in _PATTERNS if pattern.search(name or "")), None)


def format_flops(value: float) -> str:
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6)):
        if value >= scale:
            return f"{value / scale:.4g} {unit}"
    return f"{value:.4g} FLOP/s"


_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def _fp32_mode(device: torch.device) -> str:
    """How fp32 matmuls run on this device now: 'ieee', 'tf32' or 'bf16' (torch's fp32_precision)."""
    matmul = torch.backends.cuda.matmul if device.type == "cuda" else torch.backends.mkldnn.matmul
    mode = getattr(matmul, "fp32_precision", None)
    if mode is None:  # torch before the fp32_precision API
        return {"highest": "ieee", "high": "tf32", "medium": "bf16"}[torch.get_float32_matmul_precision()]
    if mode == "none":
        mode = getattr(torch.backends, "fp32_precision", "none")
    return "ieee" if mode == "none" else mode


def device_name(device: torch.device) -> str:
    if device.type in ("cuda", "xpu"):
        return getattr(torch, device.type).get_device_name(device)
    if device.type == "cpu":
        try:
            with open("/proc/cpuinfo") as f:
                return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        except (OSError, StopIteration):
            return platform.processor() or platform.machine() or "cpu"
    return device.type


def peak_flops(device: torch.device | str, dtype: torch.dtype,
               override: float | None = None) -> tuple[float, str]:
    """(dense peak FLOP/s of one device in this dtype, where the figure comes from).

    override > table (known accelerator) > measured (unknown accelerator, any CPU; cached)."""
    device = torch.device(device)
    if override is not None:
        if not override > 0:
            raise ValueError(f"peak FLOP/s override must be > 0, got {override}")
        return float(override), f"override: {format_flops(override)}"
    if dtype not in _DTYPES:
        raise ValueError(f"no peak for dtype {dtype}: use one of {', '.join(map(str, _DTYPES))}")
    label = _DTYPES[dtype]
    if label == "fp32" and _fp32_mode(device) != "ieee":
        label = _fp32_mode(device)  # tf32 (or bf16 passes) run fp32 matmuls on the faster units
    name = device_name(device)
    entry = match_device(name) if device.type != "cpu" else None
    if entry is not None:
        key = "fp32" if label == "tf32" and entry.flops["tf32"] is None else label
        value = entry.flops.get(key)
        if value is not None:
            what = entry.name
            if entry.stacks > 1 and os.environ.get("ZE_FLAT_DEVICE_HIERARCHY", "FLAT").upper() == "COMPOSITE":
                value, what = value * entry.stacks, f"{entry.name} × {entry.stacks} (COMPOSITE)"
            return value, f"table: {what} {key} dense {format_flops(value)} ({entry.source})"
    return _measured_peak(device, name, dtype, label)


# ------------------------------------------------------------------------------------- measured peaks
_MEMO: dict[str, dict] = {}


def cache_path() -> Path:
    root = os.environ.get("MESHTRAIN_CACHE_DIR")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshtrain"
    return Path(root) / "peak_flops.json"


def clear_peak_cache(disk: bool = False) -> None:
    """Forget measured peaks (in memory; on disk too with disk=True) so the next call measures again."""
    _MEMO.clear()
    if disk:
        cache_path().unlink(missing_ok=True)


def _read_disk() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _write_disk(key: str, record: dict) -> None:
    # Ranks on one node may write at once: write a private temp file and rename it over, so the file is
    # always whole. A read-only home only costs a re-measurement next run, never the training run.
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        records = _read_disk() | {key: record}
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(records, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as err:
        log.debug("could not cache the measured peak in %s: %s", path, err)


def _measure_matmul(device: torch.device, dtype: torch.dtype, budget_s: float = 1.0) -> tuple[float, int]:
    """(best FLOP/s over repeated n×n matmuls, n). n grows from 256 until one timing is ≥ 20 ms or the next
    size would not fit the budget: CPU fp16 without fp16 units runs ~1 GFLOP/s, bf16 on AMX ~1 TFLOP/s."""
    accelerator = device.type != "cpu"
    max_n, inner = (8192, 10) if accelerator else (2048, 1)  # several matmuls per timing hide launch latency
    start = time.perf_counter()

    def timed(a, b) -> float:
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(inner):
            torch.mm(a, b)
        synchronize(device)
        return time.perf_counter() - t0

    n = 256
    while True:
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        timed(a, b)  # the first call of a size pays for allocation and kernel selection
        best = timed(a, b)
        if n >= max_n or best >= 0.02 or 8 * best > budget_s / 4:
            break
        n *= 2
    reps = 1
    while reps < 3 or (time.perf_counter() - start < budget_s and reps < 100):
        best = min(best, timed(a, b))
        reps += 1
    return 2 * n**3 * inner / best, n


def _measured_peak(device: torch.device, name: str, dtype: torch.dtype, label: str) -> tuple[float, str]:
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    # The cache lives in a home directory that several node types may share: key on the part, not the host.
    key = f"{device.type}|{name}|{label}|threads={threads}|torch={torch.__version__}"
    record = _MEMO.get(key) or _read_disk().get(key)
    if record is None:
        flops, n = _measure_matmul(device, dtype)
        record = {"flops": flops, "n": n, "threads": threads, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
        _write_disk(key, record)
        log.info("measured peak of %s: %s", name, format_flops(flops))
    _MEMO[key] = record
    where = f"{threads} thread{'s' * (threads != 1)}, " if device.type == "cpu" else ""
    flops = record["flops"]
    return flops, f"measured: {record['n']}² {label} matmul, {where}{format_flops(flops)} on {name}"


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
    """Named wall-clock sections that add up over an iteration:

        with timer("dt"):
            for micro in range(accum):
                with timer("dtf"): loss = model(x, y)
                with timer("dtb"): loss.backward()
        metrics |= timer.pop()        # {"dt": …, "dtf": …, "dtb": …}, summed, then reset

    Each section synchronises the device at both ends so it times the kernels, not their launch. That
    stalls the queue a little; pass sync=False for steps that are not logged."""

    def __init__(self, device: torch.device | str, sync: bool = True):
        self.device = torch.device(device)
        self.sync = sync
        self.totals: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.sync:
            synchronize(self.device)
        t0 = time.perf_counter()
        yield
        if self.sync:
            synchronize(self.device)
        self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        out, self.totals = self.totals, {}
        return out
