"""The machine a plan is for, as the cost model reads it: matmul rates by shape or size, attention rates, memory
bandwidth, fixed costs, and collective time by message size and link. Two sources (the second measures, so it lives
in the planner's measured side):

    from_system(System)   a shipped description (plan/systems.py): GEMM rates by shape (m, k, n) and SDPA rates by
                          sequence length measured on one H100 (plan/data/h100_curves.json), as they are for the
                          DGX H100 and scaled by the ratio of datasheet peaks for every other device; alpha-beta links
                          per node and between
    this_machine(...)     (plan/measured/this_machine.py) this machine, measured (machine/profile.py's cache): on a CUDA GPU the same GEMM and SDPA
                          tables, measured here; elsewhere a curve of square matmul rates by size at the threads one
                          rank gets and attention timed as it runs; copy bandwidth, the fixed cost of a block's
                          forward and backward and of an optimizer step per tensor, and the collective timings
                          `meshtrain machine --ranks N` recorded; ranks that share cores slow each other down (slowdown)
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources

from meshtrain.machine.datasheet import match_device
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.plan.systems import System

SHIPPED_CURVES = "plan/data/h100_curves.json"  # the measured H100 tables every shipped system's GPU side comes from
BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
       "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
       "broadcast": lambda n: 1.0, "send_recv": lambda n: 1.0}


def _bracket(axis: Sequence[float], x: float) -> list[tuple[float, float]]:
    """The grid points of a sorted `axis` around x, with their weights, linear in log2 x: one point (weight 1) at a
    grid point or past either end (clamped), else the two neighbours."""
    if x <= axis[0]:
        return [(axis[0], 1.0)]
    if x >= axis[-1]:
        return [(axis[-1], 1.0)]
    i = bisect.bisect_left(axis, x)
    if axis[i] == x:
        return [(axis[i], 1.0)]
    lo, hi = axis[i - 1], axis[i]
    w = (math.log2(x) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return [(lo, 1.0 - w), (hi, w)]


@dataclass(frozen=True)
class GemmTable:
    """FLOP/s of an m × k by k × n matmul measured on a grid of shapes (machine/measure.gemm_curve): trilinear in
    log2 of m, k and n between grid points, clamped at the grid's edges, so a grid point reads its measurement."""

    axes: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    rates: dict[tuple[int, int, int], float]

    @classmethod
    def of(cls, rows: Iterable[Sequence[float]]) -> GemmTable:
        """From [m, k, n, FLOP/s] rows covering a whole grid."""
        rates = {(int(m), int(k), int(n)): float(rate) for m, k, n, rate in rows}
        axes = tuple(tuple(sorted({shape[i] for shape in rates})) for i in range(3))
        missing = [shape for shape in itertools.product(*axes) if shape not in rates]
        if missing:
            raise ValueError(f"a GEMM table must cover its grid: no rate for {missing[:3]}")
        return cls(axes, rates)

    def scaled(self, factor: float) -> GemmTable:
        return GemmTable(self.axes, {shape: rate * factor for shape, rate in self.rates.items()})

    def rate(self, m: float, k: float, n: float) -> float:
        corners = itertools.product(*(_bracket(axis, x) for axis, x in zip(self.axes, (m, k, n), strict=True)))
        return sum(math.prod(w for _, w in corner) * self.rates[tuple(x for x, _ in corner)] for corner in corners)


@dataclass(frozen=True)
class SdpaTable:
    """FLOP/s of torch's SDPA forward + backward by (head_dim, causal) and sequence length T, with FLOPs counted as
    the planner counts them (12 · head_dim · T² per head, causal or not; machine/measure.sdpa_curve): linear in log2
    T between measured lengths, clamped at the ends, the nearest measured head_dim (in log), the same causal flag."""

    curves: dict[tuple[int, bool], tuple[tuple[int, float], ...]]

    @classmethod
    def of(cls, rows: Iterable[Sequence[float]]) -> SdpaTable:
        """From [T, head_dim, causal (0/1), FLOP/s] rows."""
        curves: dict[tuple[int, bool], list[tuple[int, float]]] = {}
        for length, head_dim, causal, rate in rows:
            curves.setdefault((int(head_dim), bool(causal)), []).append((int(length), float(rate)))
        return cls({key: tuple(sorted(points)) for key, points in curves.items()})

    def scaled(self, factor: float) -> SdpaTable:
        return SdpaTable({key: tuple((t, rate * factor) for t, rate in points) for key, points in self.curves.items()})

    def rate(self, tokens: float, head_dim: int, causal: bool) -> float:
        nearest = min({d for d, _ in self.curves}, key=lambda d: (abs(math.log2(d / head_dim)), d))
        points = self.curves[nearest, causal]
        lengths, rates = [t for t, _ in points], dict(points)
        return sum(w * rates[t] for t, w in _bracket(lengths, tokens))


@dataclass
class Machine:
    name: str
    devices_per_node: int
    device_memory_bytes: float
    peak: dict[str, float]  # dense FLOP/s per device by dtype label
    memory_bps: float  # elementwise traffic, bytes/s
    intra_bps: float  # bus bandwidth inside a node, bytes/s per device
    inter_bps: float
    intra_latency_s: float
    inter_latency_s: float
    overlap: bool  # data-parallel traffic can hide behind backward (an accelerator's own copy engines and streams)
    slowdown: float = 1.0  # ranks sharing cores: compute runs this many times slower
    slowdown_under_autocast: float | None = None  # the same for bf16 compute, where calibrated apart
    # the ranks are CPUs: under autocast meshtrain runs attention (and keeps q, k, v) in fp32, and the loss's backward
    # holds three fp32 tensors the size of the logits where a GPU's holds two beside the 16-bit gradient
    cpu: bool = False
    block_overhead_s: float = 0.0  # fixed cost of one block's forward and backward (operator dispatch)
    optimizer_tensor_s: float = 0.0  # fixed cost per parameter tensor of an optimizer step
    fixed: dict[str, list[float]] = field(default_factory=dict)  # calibrate.py: kind -> [per block, per step] s
    # (label, heads, tokens, head_dim, causal, ring) -> seconds of one attention forward and backward, timed on this
    # machine at the threads one rank of the plan gets (plan/measured/this_machine.py); None: from the tables
    attention_timer: Callable[[str, int, int, int, bool, int], float] | None = None
    curve: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # label -> [(size, FLOP/s)] measured
    gemm: dict[str, GemmTable] = field(default_factory=dict)  # label -> FLOP/s by GEMM shape (an accelerator's)
    sdpa: dict[str, SdpaTable] = field(default_factory=dict)  # label -> attention FLOP/s by sequence length
    collectives: dict[tuple[str, int], list[tuple[float, float]]] = field(default_factory=dict)  # (op, n) -> [(B, s)]
    sources: dict[str, str] = field(default_factory=dict)

    def matmul_rate(self, label: str, m: int, k: int, n: int) -> float:
        """FLOP/s of an m×k by k×n matmul in `label` (a label without a table or curve of its own: fp32's): the
        GEMM table by shape where the machine has one (an accelerator), else the curve by size (cube root of m·k·n,
        this CPU), else the peak."""
        if self.gemm:  # fp16 runs on the same tensor cores as bf16
            return (self.gemm.get(label) or self.gemm.get("bf16" if label == "fp16" else "fp32")).rate(m, k, n)
        if self.curve:
            return _interpolate(self.curve.get(label, self.curve.get("fp32")), (m * k * n) ** (1 / 3), log_y=True)
        return self.peak.get(label) or self.peak["fp32"]

    def attention_s(self, label: str, samples: int, heads: int, tokens: int, head_dim: int, *, causal: bool,
                    ring: int = 1) -> float:
        """Seconds of one block's attention forward and backward over `samples` × `heads` local heads × `tokens`
        queries (this rank's), each seeing all `tokens` × `ring` keys. Measured (`attention_timer` set): the kernel
        the run calls, torch's SDPA or, with ring > 1, ring attention's own block arithmetic; else 12 × heads ×
        head_dim × queries × keys FLOPs (the whole score matrix, causal or not) at the SDPA table's rate for
        `tokens` (a ring step's block is tokens × tokens) where there is one for `label`, else at the matmul rate."""
        if self.attention_timer:  # timed on at most 4M scores' worth of heads (linear in them), as planning a long
            many = samples * heads  # sequence must not take minutes
            timed = max(1, min(many, 2**22 // (tokens * tokens * ring)))
            return self.attention_timer(label, timed, tokens, head_dim, causal, ring) * many / timed
        keys = tokens * ring
        flops = 12 * samples * heads * head_dim * tokens * keys
        if label in self.sdpa:
            return flops / self.sdpa[label].rate(tokens, head_dim, causal)
        return flops / self.matmul_rate(label, samples * tokens, head_dim, keys)

    def collective_s(self, op: str, nbytes: float, dims: ParallelDims, dim: str) -> float:
        """Seconds of `op` on `nbytes` (nccl-tests' size: the whole buffer) over rank 0's group of `dim`."""
        group = dims.group_of(0, dim)
        n = len(group)
        measured = self._measured(op, n)
        if measured:
            return _interpolate(measured, nbytes, log_y=True, grow=True)
        nodes = len({r // self.devices_per_node for r in group})
        bps, latency = (self.inter_bps, self.inter_latency_s) if nodes > 1 else (self.intra_bps, self.intra_latency_s)
        steps = 2 * (n - 1) if op == "all_reduce" else (1 if op in ("send_recv", "broadcast") else n - 1)
        return steps * latency + BUS[op](n) * nbytes / bps

    def _measured(self, op: str, n: int) -> list[tuple[float, float]] | None:
        """Recorded timings of `op` on n ranks (a point-to-point send as a 2-rank broadcast), else the nearest n."""
        op = "broadcast" if op == "send_recv" else op
        sizes = sorted(size for kind, size in self.collectives if kind == op)
        if not sizes:
            return None
        nearest = min(sizes, key=lambda s: (abs(math.log(s / (2 if op == "broadcast" and n == 2 else n))), s))
        return self.collectives[op, nearest]


def _interpolate(points: list[tuple[float, float]], x: float, *, log_y: bool, grow: bool = False) -> float:
    """y at x, linear in log x (and in log y with log_y) between points; before the first, its y; past the last, its
    y (a rate saturates) or, with grow, y ∝ x (a time grows with the bytes)."""
    xs = [p[0] for p in points]
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1] * (x / points[-1][0] if grow else 1.0)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0))) if log_y else y0 + w * (y1 - y0)


@functools.cache
def shipped_curves() -> dict:
    """The GEMM and SDPA tables measured on one H100 (plan/data/h100_curves.json) with their source."""
    return json.loads(resources.files("meshtrain").joinpath(SHIPPED_CURVES).read_text())


def from_system(system: System) -> Machine:
    """A shipped system: its datasheet peaks (for MFU) and links, and the measured H100 tables, as they are on an
    H100 and scaled by the ratio of datasheet peaks of the same label on any other device. The fp32 label is the
    H100's IEEE fp32 table (torch's default for fp32 matmuls) against the datasheet's fp32 column, not tf32's."""
    shipped = shipped_curves()
    reference = match_device(shipped["source"]["device"])
    ratios = {label: system.peak_flops[label] / reference.flops[label] for label in shipped["gemm"]
              if system.peak_flops.get(label)}
    gemm = {label: GemmTable.of(shipped["gemm"][label]).scaled(ratio) for label, ratio in ratios.items()}
    sdpa = {label: SdpaTable.of(rows).scaled(ratios[label]) for label, rows in shipped["sdpa"].items()
            if label in ratios}
    src = shipped["source"]
    curve = f"H100 measured curve ({SHIPPED_CURVES}: {src['device']}, torch {src['torch']}, {src['measured']}, " \
            "`python benchmarks/gpu_curves.py`)"
    same = {label for label, ratio in ratios.items() if ratio == 1.0}
    scaled = {label: "as measured" if label in same else f"scaled by peak ratio {ratio:.3g}"
              for label, ratio in ratios.items()}
    sources = {**system.sources,
               "matmul": f"{curve}: GEMM FLOP/s by shape (m, k, n), "
                         + ", ".join(f"{label} {how}" for label, how in scaled.items())
                         + (f" (this device's datasheet peak / the {reference.name}'s)" if ratios.keys() - same else "")
                         + "; the fp32 label is the IEEE fp32 table (torch runs fp32 matmuls as IEEE unless set to "
                           "tf32)",
               "attention": f"{curve}: torch SDPA forward + backward FLOP/s by sequence length, head_dim and causal, "
                            + ", ".join(f"{label} {scaled[label]}" for label in sdpa)
                            + "; other dtypes at the matmul rate"}
    return Machine(name=system.name, devices_per_node=system.devices_per_node,
                   device_memory_bytes=system.device_memory_bytes,
                   peak={k: v for k, v in system.peak_flops.items() if v}, memory_bps=system.memory_gbs * 1e9,
                   intra_bps=system.intra_node_gbs * 1e9, inter_bps=system.inter_node_gbs * 1e9,
                   intra_latency_s=system.intra_node_latency_s, inter_latency_s=system.inter_node_latency_s,
                   overlap=True, gemm=gemm, sdpa=sdpa, sources=sources)
