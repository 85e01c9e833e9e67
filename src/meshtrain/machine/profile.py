"""The machine profile: what this machine can do, measured once and cached, for MFU, precision and cost models.

The cache is one JSON file (`~/.cache/meshtrain/machine.json`; MESHTRAIN_CACHE_DIR moves it) shared by
every rank and run on the machine and by machines that share a home directory, so an entry is keyed by
what changes its figures: device kind and name, instruction set and the caps in force, threads, torch:

    {"devices": {"cpu|AMD EPYC|AVX2|caps=none|threads=1|torch=2.13.0+cpu":
                    {"hardware": {...}, "matmul": {"fp32": {"flops": 4.1e10, "n": 1024, ...}}, "memory": {...}},
                 "cuda|NVIDIA H100 80GB HBM3|sm90|...": {..., "curves": {"gemm": {...}, "sdpa": {...}}}},
     "collectives": {"gloo|cpu|AMD EPYC|world=2|nodes=1|torch=2.13.0+cpu": {"ops": {"all_reduce": {...}}}}}

Figures are measured when first asked for. One taken while the box was busy (other processes kept more
cores busy than the measurement left free) is taken again by the next process that asks, and the higher
one kept: interference only ever lowers a peak. Known accelerators keep their datasheet peak (datasheet.py);
measured figures beside it are labelled as measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from meshtrain.machine import measure
from meshtrain.machine.datasheet import match_device
from meshtrain.machine.hardware import Hardware, describe
from meshtrain.runtime.doctor import OK, WARNING, Check
from meshtrain.runtime.log import get_logger

log = get_logger("machine")
LABELS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_MEMO: dict[tuple[str, str], dict] = {}  # (profile key, figure) -> record, for this process


# ------------------------------------------------------------------------------------------------ the cache
def cache_path() -> Path:
    root = os.environ.get("MESHTRAIN_CACHE_DIR")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshtrain"
    return Path(root) / "machine.json"


def read_cache() -> dict:
    try:
        data = json.loads(cache_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """Hold the cache's lock: the ranks of a node then measure one after another (two at once would each see
    the other's load) and never write over each other. No lock where the directory cannot be written."""
    path = cache_path()
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_name(path.name + ".lock"), "a")
    except (ImportError, OSError):
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _write_cache(data: dict) -> None:
    """Write a private temp file and rename it over the cache, so a reader always sees a whole file. A read-only
    home only costs a measurement next run, never the training run."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as err:
        log.debug("could not write the machine profile %s: %s", path, err)


PROFILE_MAX_AGE_DAYS = 30.0  # a driver, BIOS or torch update in the meantime changes what the machine does


def profile_age_check(max_age_days: float = PROFILE_MAX_AGE_DAYS, now: float | None = None) -> Check:
    """`meshtrain doctor`'s row: is there a profile, written lately, with figures for this torch?"""
    path = cache_path()
    try:
        age_days = ((time.time() if now is None else now) - path.stat().st_mtime) / 86400
    except OSError:
        return Check("machine profile", WARNING, f"none at {path}: MFU and train.dtype=auto measure on first use",
                     "meshtrain machine")
    keys = read_cache().get("devices", {})
    found = f"{path}, written {age_days:.0f} days ago, {len(keys)} device entr{'y' if len(keys) == 1 else 'ies'}"
    if age_days > max_age_days:
        return Check("machine profile", WARNING, f"{found}: older than {max_age_days:.0f} days",
                     "meshtrain machine --refresh")
    if not any(key.endswith(f"|torch={torch.__version__}") for key in keys):
        return Check("machine profile", WARNING, f"{found}, none for torch {torch.__version__}", "meshtrain machine")
    return Check("machine profile", OK, found)


def remember(section: str, key: str, value) -> None:
    """Store a figure another module measured (e.g. the planner's fixed costs) under data[section][key]."""
    with _locked():
        data = read_cache()
        data.setdefault(section, {})[key] = value
        _write_cache(data)


def forget(section: str, key: str) -> None:
    """Drop data[section][key], so that its figure is measured again when next asked for."""
    with _locked():
        data = read_cache()
        if data.get(section, {}).pop(key, None) is not None:
            _write_cache(data)


def clear(disk: bool = False) -> None:
    """Forget measured figures in this process (and on disk with disk=True): the next request measures."""
    _MEMO.clear()
    if disk:
        cache_path().unlink(missing_ok=True)


def profile_key(hw: Hardware, threads: int) -> str:
    caps = "+".join(hw.caps) or "none"
    return f"{hw.kind}|{hw.name}|{hw.isa}|caps={caps}|threads={threads}|torch={torch.__version__}"


def threads_of(device: torch.device) -> int:
    """The thread count a figure belongs to: torch's on a CPU, 0 (not a factor) on an accelerator."""
    return torch.get_num_threads() if device.type == "cpu" else 0


def _busy(record: dict, hw: Hardware) -> bool:
    """A CPU figure taken while other processes used more cores than this measurement left free (where the
    machine cannot tell, while the load average exceeded the cores)."""
    if hw.kind != "cpu":
        return False
    spare = hw.cores - record.get("threads", 1)
    if record.get("others_cores") is not None:
        return record["others_cores"] > spare + 0.25
    return record.get("load") is not None and record["load"] > hw.cores + 0.5


def _keep(old: dict | None, new: dict, replace: bool) -> dict:
    """The figure to keep: the new one on --refresh, else the higher (interference only lowers a peak); busy
    only while no quiet measurement has confirmed it."""
    if replace or old is None:
        return new
    kept = dict(new if _value(new) > _value(old) else old)
    kept["busy"] = old.get("busy", False) and new.get("busy", False)
    return kept


def measured(device: torch.device | str, figure: str, *, refresh: bool = False, again: bool = False,
             busy_ok: bool = False) -> dict:
    """This device's measured `figure` ('fp32', 'tf32', 'bf16', 'fp16' matmul peaks, or 'memory' bandwidth),
    from this process's memory, else the cache, else measured now. `again` measures once more and keeps the
    better figure (a suspect peak); `refresh` measures and keeps the new one; a figure measured while the cores were
    busy is measured again, unless `busy_ok` (a comparison of two dtypes, which the load lowers alike)."""
    device = torch.device(device)
    hw = describe(device)
    key = profile_key(hw, threads_of(device))
    if not (refresh or again) and (key, figure) in _MEMO:
        return _MEMO[key, figure]
    with _locked():
        data = read_cache()
        entry = data.setdefault("devices", {}).setdefault(key, {})
        figures = entry if figure == "memory" else entry.setdefault("matmul", {})  # where the figure lives
        old = figures.get(figure)
        if old is not None and not (refresh or again) and (busy_ok or not old.get("busy")):
            if not old.get("busy"):  # a busy one is still measured again by the next caller that is not busy_ok
                _MEMO[key, figure] = old
            return old
        new = measure.memory_bandwidth(device) if figure == "memory" else measure.matmul_peak(device, figure)
        new["busy"] = _busy(new, hw)
        kept = _keep(old, new, refresh)
        entry["hardware"] = dataclasses.asdict(hw)
        figures[figure] = kept
        _write_cache(data)
    if new["busy"]:
        log.warning("measured the %s %s while other processes kept %s of %d cores busy: kept %s; it is measured "
                    "again next run, or now with `meshtrain machine --refresh`", hw.name, figure,
                    new.get("others_cores", f"load {new['load']}"), hw.cores, format_figure(kept))
    _MEMO[key, figure] = kept
    return kept


def curves(device: torch.device | str, *, refresh: bool = False) -> dict:
    """A CUDA device's rate tables for the planner: {"gemm": {label: [[m, k, n, FLOP/s], ...]}, "sdpa": {label:
    [[T, head_dim, causal, FLOP/s], ...]}, "measured": when} (machine/measure.py's gemm_curve and sdpa_curve; bf16,
    tf32 and fp32 GEMMs and bf16 attention where the part has bf16 units, else fp32 GEMMs alone), from this
    process's memory, else the cache, else measured now (once: about a minute); `refresh` measures again."""
    device = torch.device(device)
    hw = describe(device)
    key = profile_key(hw, threads_of(device))
    if not refresh and (key, "curves") in _MEMO:
        return _MEMO[key, "curves"]
    with _locked():
        data = read_cache()
        entry = data.setdefault("devices", {}).setdefault(key, {})
        if refresh or "curves" not in entry:
            log.info("measuring the GEMM and attention rates of %s by shape, once (cached in %s)", hw.name,
                     cache_path())
            labels = ("bf16", "tf32", "fp32") if hw.bf16 else ("fp32",)
            entry["curves"] = {"gemm": {label: measure.gemm_curve(device, label) for label in labels},
                               "sdpa": {"bf16": measure.sdpa_curve(device, "bf16")} if hw.bf16 else {},
                               "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
            entry["hardware"] = dataclasses.asdict(hw)
            _write_cache(data)
        record = entry["curves"]
    _MEMO[key, "curves"] = record
    return record


def _value(record: dict) -> float:
    return record["flops"] if "flops" in record else record["gbs"]


def format_figure(record: dict) -> str:
    return format_flops(record["flops"]) if "flops" in record else f"{record['gbs']:.4g} GB/s"


def format_flops(value: float) -> str:
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6)):
        if value >= scale:
            return f"{value / scale:.4g} {unit}"
    return f"{value:.4g} FLOP/s"


# ------------------------------------------------------------------------------------------------ peaks
@dataclass(frozen=True)
class Peak:
    """The dense peak FLOP/s an MFU is taken against, and where it comes from (printed in the log's legend)."""

    flops: float
    label: str  # the matmul dtype: bf16, fp16, tf32, fp32
    kind: str  # datasheet | measured | override
    source: str


def fp32_mode(device: torch.device) -> str:
    """How fp32 matmuls run on this device now: 'ieee', 'tf32' or 'bf16' (torch's fp32_precision)."""
    matmul = torch.backends.cuda.matmul if device.type == "cuda" else torch.backends.mkldnn.matmul
    mode = getattr(matmul, "fp32_precision", None)
    if mode is None:  # torch before the fp32_precision API
        return {"highest": "ieee", "high": "tf32", "medium": "bf16"}[torch.get_float32_matmul_precision()]
    if mode == "none":
        mode = getattr(torch.backends, "fp32_precision", "none")
    return "ieee" if mode == "none" else mode


def matmul_label(device: torch.device, dtype: torch.dtype) -> str:
    """The dtype a run's matmuls really execute in: autocast's, or for fp32 the mode torch runs them in."""
    if dtype not in LABELS:
        raise ValueError(f"no peak for dtype {dtype}: use one of {', '.join(map(str, LABELS))}")
    label = LABELS[dtype]
    if label == "fp32" and fp32_mode(device) != "ieee":
        label = fp32_mode(device)  # tf32 (or bf16 passes) run fp32 matmuls on the faster units
    return label


def datasheet_peak(device: torch.device, label: str) -> Peak | None:
    hw_name = describe(device).name if device.type != "cpu" else None
    entry = match_device(hw_name) if hw_name else None
    if entry is None:
        return None
    key = "fp32" if label == "tf32" and entry.flops["tf32"] is None else label
    value = entry.flops.get(key)
    if value is None:
        return None  # no hardware path for this dtype (bf16 on a V100): measure what torch makes of it
    what = entry.name
    if entry.stacks > 1 and os.environ.get("ZE_FLAT_DEVICE_HIERARCHY", "FLAT").upper() == "COMPOSITE":
        value, what = value * entry.stacks, f"{entry.name} × {entry.stacks} (COMPOSITE)"
    return Peak(value, key, "datasheet", f"datasheet: {what} {key} dense {format_flops(value)} ({entry.source})")


def measured_peak(device: torch.device, label: str, *, again: bool = False) -> Peak:
    record = measured(device, label, again=again)
    name = describe(device).name
    threads = record.get("threads", 0)
    where = f"{threads} thread{'s' * (threads != 1)}, " if device.type == "cpu" else ""
    when = f" ({record.get('measured', '?')}{', busy' if record.get('busy') else ''})"
    return Peak(record["flops"], label, "measured",
                f"measured: {record['n']}² {label} matmul, {where}{format_flops(record['flops'])} on {name}{when}")


def peak_flops(device: torch.device | str, dtype: torch.dtype, override: float | None = None) -> Peak:
    """The peak an MFU in `dtype` is taken against: override > datasheet (known accelerator) > measured."""
    device = torch.device(device)
    if override is not None:
        if not override > 0:
            raise ValueError(f"peak FLOP/s override must be > 0, got {override}")
        return Peak(float(override), LABELS.get(dtype, "fp32"), "override",
                    f"train.peak_flops: {format_flops(override)}")
    label = matmul_label(device, dtype)
    return datasheet_peak(device, label) or measured_peak(device, label)


# ------------------------------------------------------------------------------------------- collectives
def collectives_key(backend: str, device: torch.device, world: int, nodes: int) -> str:
    return f"{backend}|{device.type}|{describe(device).name}|world={world}|nodes={nodes}|torch={torch.__version__}"


def record_collectives(key: str, dtype: str, rows: dict[str, list[tuple[int, float, float]]]) -> Path:
    """Store `collectives --bench` results: per op, (bytes, seconds, busbw GB/s) per message size, with the
    latency (time of the smallest message) and peak bus bandwidth a cost model reads first."""
    ops = {}
    for op, points in rows.items():
        if not points:
            continue
        sizes, seconds, busbw = (list(column) for column in zip(*points, strict=True))
        ops[op] = {"bytes": sizes, "seconds": seconds, "busbw_gbs": busbw, "latency_s": seconds[0],
                   "peak_busbw_gbs": max(busbw), "peak_at_bytes": sizes[busbw.index(max(busbw))]}
    with _locked():
        data = read_cache()
        data.setdefault("collectives", {})[key] = {"dtype": dtype, "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
                                                   "load": measure.load_average(), "ops": ops}
        _write_cache(data)
    return cache_path()
