"""Each collective at work on small tensors (demo), or its bandwidth (bench): what `meshtrain collectives` runs.

The demo draws the picture HPC courses draw: what every rank holds before and after all_reduce,
broadcast, scatter, ... Each rank's input is a known function of its rank, so every rank can work out
the right answer alone and check its own result: a wrong result fails the command, not just the eye.

The bench follows nccl-tests: per message size, warm up, time repetitions, report the slowest rank's
mean time, algbw = size / time and busbw = algbw × a per-collective factor (bus_bandwidth_factor).
busbw is what each rank's link must carry, so it is comparable across collectives and rank counts and
tops out near the link's bandwidth. Sizes follow nccl-tests too: the whole buffer (SIZE_CONVENTION).
"""

from __future__ import annotations

import argparse
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshtrain.runtime.device import synchronize
from meshtrain.runtime.log import get_logger, print_rich
from meshtrain.runtime.setup import CollectiveError, DistInfo, collective, reduce_scalar

log = get_logger("collectives")

BENCH_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce")
DEMO_CASES = (
    "all_reduce(SUM)", "all_reduce(MIN)", "all_reduce(MAX)", "all_reduce(AVG)", "reduce(SUM, to 0)",
    "broadcast(from 0)", "all_gather", "scatter(from 0)", "gather(to 0)", "reduce_scatter(SUM)", "all_to_all",
    "send/recv ring",
)
SIZE_CONVENTION = (
    "size = the whole buffer, as in nccl-tests: all_reduce, broadcast, reduce: the buffer; all_gather: the "
    "gathered output (n × each rank's input); reduce_scatter: the input (n × each rank's output); "
    "all_to_all: each rank's send buffer"
)
DEFAULT_MAX_BYTES = 256 << 20
MAX_SHOWN_RANKS = 8  # the demo checks every rank but draws only the first few
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Older gloo lacks these; each has a fallback built from collectives every backend has.
OPTIONAL = ("avg", "reduce_scatter", "all_to_all")

# torch 2.13 deprecates the *_into_tensor / *_tensor names in favour of *_single; older torch has only the old.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# What the bench measured: op -> (bytes, seconds per call, busbw GB/s) per size (what --record keeps).
Points = dict[str, list[tuple[int, float, float]]]


@dataclass(frozen=True)
class BenchOptions:
    """What `bench` sweeps and how long it times each size (the command's bench options)."""

    min_bytes: int = 8
    max_bytes: int = DEFAULT_MAX_BYTES  # fitting_max_bytes(info): this, lowered to what fits in memory
    ops: tuple[str, ...] | None = None  # None: every op of BENCH_OPS
    warmup: int = 5  # iterations per size before timing
    iters: int = 20  # timed iterations per size: fewer where they would exceed time_per_size, but at least 2
    time_per_size: float = 0.5  # seconds of warm-up, and again of timing, to aim for per size
    dtype: str = "float32"  # a key of DTYPES
    force_fallbacks: bool = False  # native_support refused the optional ops on request: skips say so, not 'no native'


# ---------------------------------------------------------------- pure helpers (unit-tested)

def bus_bandwidth_factor(op: str, n: int) -> float:
    """busbw / algbw for `op` on n ranks (nccl-tests' PERFORMANCE.md): the share of `size` each link carries.

    A ring all_reduce moves 2(n-1)/n of the buffer through every link (reduce-scatter, then all-gather);
    all_gather, reduce_scatter and all_to_all move (n-1)/n of it (a rank's own part stays put); broadcast
    and reduce pass the whole buffer along once.
    """
    if n < 1:
        raise ValueError(f"need at least one rank, got {n}")
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"no bus bandwidth factor for {op!r}")


def sweep_sizes(min_bytes: int, max_bytes: int) -> list[int]:
    """min_bytes, 2·min_bytes, 4·min_bytes, ... up to max_bytes (nccl-tests' -f 2)."""
    if min_bytes < 1 or max_bytes < min_bytes:
        raise ValueError(f"need 1 <= min_bytes <= max_bytes, got {min_bytes} and {max_bytes}")
    sizes = [min_bytes]
    while sizes[-1] * 2 <= max_bytes:
        sizes.append(sizes[-1] * 2)
    return sizes


def element_count(op: str, nbytes: int, element_size: int, n: int) -> int:
    """Elements of the whole buffer for a message of `nbytes`; 0 where it cannot be split over n ranks."""
    count = nbytes // element_size
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        count -= count % n  # every rank's part must be the same size
    return count


def human_bytes(nbytes: int) -> str:
    """8 -> '8 B', 1536 -> '1.5 KiB', 2**26 -> '64 MiB'."""
    power = min(4, (int(nbytes).bit_length() - 1) // 10) if nbytes >= 1 else 0
    return f"{nbytes / 1024 ** power:.4g} {('B', 'KiB', 'MiB', 'GiB', 'TiB')[power]}"


def parse_bytes(text: str) -> int:
    """'65536', '64K', '64KiB', '64 KB' -> 65536; K, M, G and T are powers of 1024 (as in nccl-tests)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use bytes or a K/M/G suffix (64K, 16MiB)")
    return int(float(match[1]) * 1024 ** " kmgt".index(match[2].lower() or " "))


def fmt_sig(x: float, digits: int = 4) -> str:
    """x with `digits` significant digits and no exponent, so tiny bandwidths stay readable and comparable."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    return f"{x:.{decimals}f}"


def adapt_iterations(first_s: float, warmup: int, iters: int, budget_s: float) -> tuple[int, int]:
    """(warm-up, timed) iterations so one size takes about `budget_s`: large messages get fewer, never
    below one warm-up (it measured `first_s`) and two timed ones (unless fewer were asked for)."""
    fits = int(budget_s / max(first_s, 1e-9))
    return max(1, min(warmup, fits)), min(iters, max(2, fits))


def demo_input(rank: int, n: int) -> torch.Tensor:
    """Rank r holds 10r, 10r+1, ...: the tens digit tells which rank a number came from.

    At least 4 elements, and a multiple of n so scatter-like collectives give every rank an equal part.
    """
    return torch.arange(n * math.ceil(4 / n), dtype=torch.float32) + 10 * rank


def demo_expected(case: str, rank: int, n: int) -> torch.Tensor | None:
    """What `rank` must hold after `case`, from every rank's input alone; None where nothing is defined."""
    xs = torch.stack([demo_input(r, n) for r in range(n)])  # row r: rank r's input
    part = xs.chunk(n, dim=1)[rank]  # row r: the part of rank r's input meant for `rank`
    answers = {
        "all_reduce(SUM)": xs.sum(0), "all_reduce(MIN)": xs.amin(0), "all_reduce(MAX)": xs.amax(0),
        "all_reduce(AVG)": xs.sum(0) / n, "reduce(SUM, to 0)": xs.sum(0) if rank == 0 else None,
        "broadcast(from 0)": xs[0], "all_gather": xs.flatten(), "scatter(from 0)": part[0],
        "gather(to 0)": xs.flatten() if rank == 0 else None, "reduce_scatter(SUM)": part.sum(0),
        "all_to_all": part.flatten(), "send/recv ring": xs[(rank - 1) % n],
    }
    return answers[case]


def check_result(case: str, rank: int, n: int, got: torch.Tensor | None) -> bool:
    """True when `got` is what `rank` must hold after `case` (anything goes where nothing is defined)."""
    want = demo_expected(case, rank, n)
    if want is None:
        return True
    if got is None or tuple(got.shape) != tuple(want.shape):
        return False
    return torch.allclose(got.detach().cpu().to(want.dtype), want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- the demo and the bench (collective calls)

def native_support(info: DistInfo, force_fallbacks: bool) -> dict[str, bool]:
    """Which of OPTIONAL this backend runs, found by trying each on a tiny tensor and agreed by all ranks.

    A backend refuses an op it lacks before talking to any peer, so every rank fails alike and none hangs.
    """
    if force_fallbacks:
        return dict.fromkeys(OPTIONAL, False)
    device, n = info.torch_device, info.world_size
    x = torch.zeros(n, device=device)
    probes = {
        "avg": lambda: dist.all_reduce(x.clone(), op=dist.ReduceOp.AVG),
        "reduce_scatter": lambda: _reduce_scatter_tensor(torch.empty(1, device=device), x.clone()),
        "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(x), x),
    }
    support = {}
    for name, probe in probes.items():
        with collective(f"{name} (probing what {info.backend} supports)", info.timeout_s):
            try:
                probe()
                ok = 1
            except (RuntimeError, ValueError) as e:
                refusal = ("not support", "unsupported", "cannot use", "not implemented")
                if isinstance(e, CollectiveError) or not (
                        isinstance(e, (NotImplementedError, ValueError)) or any(w in str(e).lower() for w in refusal)):
                    raise
                ok = 0
            flag = torch.tensor([ok], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        support[name] = bool(flag.item())
    return support


def _family(case: str) -> str:
    return "send_recv" if case.startswith("send/recv") else case.split("(")[0]


def _demo_case(case: str, x: torch.Tensor, rank: int, n: int, native: dict[str, bool]) -> tuple[torch.Tensor | None, str]:
    """Run `case` with this rank's input x (left untouched); return what this rank holds after, and a note."""
    parts = list(x.chunk(n))
    if case.startswith("all_reduce"):
        y, op = x.clone(), case[len("all_reduce("):-1]
        if op == "AVG" and not native["avg"]:
            dist.all_reduce(y, op=dist.ReduceOp.SUM)
            return y / n, "fallback for backends without ReduceOp.AVG: SUM, then ÷ n on every rank"
        dist.all_reduce(y, op=getattr(dist.ReduceOp, op))
        return y, ""
    if case == "reduce(SUM, to 0)":
        y = x.clone()
        dist.reduce(y, dst=0)
        return (y if rank == 0 else None), "only rank 0's result is defined"
    if case == "broadcast(from 0)":
        y = x.clone()
        dist.broadcast(y, src=0)
        return y, ""
    if case == "all_gather":
        y = torch.empty(n * x.numel(), dtype=x.dtype, device=x.device)
        _all_gather_tensor(y, x)
        return y, ""
    if case == "scatter(from 0)":
        y = torch.empty_like(parts[0])
        dist.scatter(y, parts if rank == 0 else None, src=0)
        return y, "only rank 0's input is sent"
    if case == "gather(to 0)":
        received = [torch.empty_like(x) for _ in range(n)] if rank == 0 else None
        dist.gather(x, received, dst=0)
        return (torch.cat(received) if rank == 0 else None), ""
    if case == "reduce_scatter(SUM)":
        if not native["reduce_scatter"]:
            y = x.clone()
            dist.all_reduce(y)  # about twice the traffic of a real reduce_scatter, but the same answer
            return y.chunk(n)[rank].clone(), "fallback: all_reduce, then keep this rank's part"
        y = torch.empty_like(parts[0])
        _reduce_scatter_tensor(y, x.clone())
        return y, ""
    if case == "all_to_all":
        if not native["all_to_all"]:
            received = [torch.empty_like(parts[0]) for _ in range(n)]
            for src in range(n):  # every rank in turn scatters its parts
                dist.scatter(received[src], parts if rank == src else None, src=src)
            return torch.cat(received), "fallback: one scatter from each rank in turn"
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x)
        return y, ""
    if case == "send/recv ring":
        if n == 1:
            return x.clone(), "one rank: nothing to send"
        y = torch.empty_like(x)
        # Posting the send and the receive together lets every rank send first without deadlock.
        ops = [dist.P2POp(dist.isend, x, (rank + 1) % n), dist.P2POp(dist.irecv, y, (rank - 1) % n)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        return y, "each rank sends to rank + 1 and receives from rank - 1"
    raise ValueError(f"unknown demo case {case!r}")


def _show(t: torch.Tensor | None) -> str:
    return "—" if t is None else "[" + " ".join(f"{v:g}" for v in t.detach().cpu().tolist()) + "]"


def demo(info: DistInfo, ops: list[str] | None, native: dict[str, bool]) -> int:
    """Run and check every demo case of `ops` (None: all) and draw them on rank 0; return how many (case, rank)
    results were wrong, the same count on every rank."""
    rank, n = info.rank, info.world_size
    cases = [case for case in DEMO_CASES if ops is None or _family(case) in ops]
    x = demo_input(rank, n).to(info.torch_device)
    records, failed = [], []
    for case in cases:
        with collective(f"{case} (demo)", info.timeout_s):
            after, note = _demo_case(case, x, rank, n, native)
        ok = check_result(case, rank, n, after)
        before = None if case == "scatter(from 0)" and rank != 0 else x
        records.append((_show(before), _show(after), ok, note))
        if not ok:
            failed.append(case)
            log.warning("%s: rank %d holds %s, expected %s", case, rank, _show(after),
                        _show(demo_expected(case, rank, n)))
    with collective("gather_object of the demo's results to rank 0", info.timeout_s):
        everyone = [None] * n if rank == 0 else None
        dist.gather_object(records, everyone, dst=0)
    with collective("all_reduce of the demo's failure count", info.timeout_s):
        failures = torch.tensor([len(failed)], device=info.torch_device)
        dist.all_reduce(failures)
    if rank == 0:
        print_rich(_demo_table(cases, everyone, info))
        bad = {case: [r for r in range(n) if not everyone[r][i][2]] for i, case in enumerate(cases)}
        bad = {case: ranks for case, ranks in bad.items() if ranks}
        summary = (f"collectives demo: {len(cases) - len(bad)}/{len(cases)} passed on {n} rank{'s' * (n != 1)} "
                   f"({info.backend})")
        if bad:
            log.error("%s; wrong: %s", summary,
                      "; ".join(f"{case} on rank(s) {', '.join(map(str, ranks))}" for case, ranks in bad.items()))
        else:
            log.info("%s", summary)
    return int(failures.item())


def _demo_table(cases: list[str], everyone: list, info: DistInfo):
    from rich.markup import escape
    from rich.table import Table

    shown = min(info.world_size, MAX_SHOWN_RANKS)
    table = Table(title=f"collectives on {info.world_size} ranks ({info.backend}, {info.device}): "
                        "rank r starts with 10r, 10r+1, ...", title_justify="left")
    for column in ("collective", "rank", "before", "after", "check"):
        table.add_column(column)
    notes = []
    for i, case in enumerate(cases):
        note = next((everyone[r][i][3] for r in range(info.world_size) if everyone[r][i][3]), "")
        if note:
            notes.append(f"{len(notes) + 1}. {case}: {note}")
        for r in range(shown):
            before, after, ok, _ = everyone[r][i]
            label = (case + (f" ({len(notes)})" if note else "")) if r == 0 else ""
            table.add_row(escape(label), str(r), escape(before), escape(after), "ok" if ok else "WRONG",
                          end_section=r == shown - 1)
    if shown < info.world_size:
        notes.append(f"ranks {shown}..{info.world_size - 1} were checked but are not shown")
    table.caption, table.caption_justify = "\n".join(notes), "left"
    return table


def _memory_cap(info: DistInfo) -> int:
    """DEFAULT_MAX_BYTES, lowered to a power of two at most 1/16 of the memory this rank may use."""
    device = info.torch_device
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        try:
            with open("/proc/meminfo") as f:
                free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        except (OSError, StopIteration, ValueError):
            return DEFAULT_MAX_BYTES
        free //= info.local_world_size  # the ranks on this node share its memory
    cap = max(1, free // 16)
    return min(DEFAULT_MAX_BYTES, 1 << (cap.bit_length() - 1))


def _bench_call(op: str, count: int, n: int, dtype: torch.dtype, device: torch.device) -> Callable[[], object]:
    """One call of `op` on a buffer of `count` elements (SIZE_CONVENTION), buffers allocated once."""
    whole = torch.zeros(count, dtype=dtype, device=device)  # zeros: repeated sums never overflow
    if op == "all_reduce":
        return lambda: dist.all_reduce(whole)
    if op == "broadcast":
        return lambda: dist.broadcast(whole, src=0)
    if op == "reduce":
        return lambda: dist.reduce(whole, dst=0)
    part = torch.zeros(count // n, dtype=dtype, device=device)
    if op == "all_gather":
        return lambda: _all_gather_tensor(whole, part)
    if op == "reduce_scatter":
        return lambda: _reduce_scatter_tensor(part, whole)
    if op == "all_to_all":
        received = torch.empty_like(whole)
        return lambda: dist.all_to_all_single(received, whole)
    raise ValueError(f"unknown bench op {op!r}")


def _time_op(op: str, count: int, nbytes: int, info: DistInfo, options: BenchOptions) -> tuple[float, int]:
    """(slowest rank's mean seconds per call, timed iterations) for `op` on `count` elements."""
    device = info.torch_device
    call = _bench_call(op, count, info.world_size, DTYPES[options.dtype], device)

    def timed(iterations: int) -> float:
        synchronize(device)
        start = time.perf_counter()
        for _ in range(iterations):
            call()
        synchronize(device)
        return time.perf_counter() - start

    what = f"{op} of {human_bytes(nbytes)}"
    with collective(f"{what} (warm-up)", info.timeout_s):
        # The first call also sizes the loop; every rank must agree on it, hence the slowest rank's time.
        first = reduce_scalar(timed(1), "max", f"{what} (warm-up)", info.timeout_s, device)
        warmup, iters = adapt_iterations(first, options.warmup, options.iters, options.time_per_size)
        timed(warmup - 1)
        dist.barrier()
    with collective(f"{what} ×{iters} (timed)", info.timeout_s):
        elapsed = reduce_scalar(timed(iters), "max", f"{what} ×{iters} (timed)", info.timeout_s, device)
    return elapsed / iters, iters


def fitting_max_bytes(info: DistInfo) -> int:
    """The largest message when none is given: DEFAULT_MAX_BYTES, lowered so that every rank's buffers fit
    (_memory_cap), the smallest over ranks so that all sweep the same sizes."""
    max_bytes = int(reduce_scalar(_memory_cap(info), "min", "all_reduce of the memory cap", info.timeout_s,
                                  info.torch_device))
    if max_bytes < DEFAULT_MAX_BYTES:
        log.info("--max-bytes lowered to %s so the buffers fit in memory", human_bytes(max_bytes))
    return max_bytes


def bench(info: DistInfo, options: BenchOptions, native: dict[str, bool]) -> Points:
    """Time each op of `options` at each size of the sweep, print a table per op on rank 0 and log the peaks;
    return the measured points, the same on every rank. Ops the backend lacks (`native`) are skipped."""
    from rich.table import Table

    n, started = info.world_size, time.perf_counter()
    element_size = torch.empty(0, dtype=DTYPES[options.dtype]).element_size()
    sizes = sweep_sizes(options.min_bytes, options.max_bytes)
    ops = [op for op in BENCH_OPS if options.ops is None or op in options.ops]
    for op in [op for op in ops if not native.get(op, True)]:
        why = "--force-fallbacks" if options.force_fallbacks else f"{info.backend} has no native {op}"
        log.info("skipping %s: %s (a fallback would not measure the collective)", op, why)
        ops.remove(op)
    log.info("%d rank(s), %s on %s, %s; %s", n, info.backend, info.device, options.dtype, SIZE_CONVENTION)
    peaks = {}  # op -> (busbw, algbw, bytes) of its best size
    points: Points = {}
    for op in ops:
        factor = bus_bandwidth_factor(op, n)
        rule = {"all_reduce": "2(n-1)/n", "broadcast": "1", "reduce": "1"}.get(op, "(n-1)/n")
        table = Table(title=f"{op}: busbw = algbw × {rule} = {factor:g}", title_justify="left")
        for column in ("size", "count", "iters", "time (us)", "algbw (GB/s)", "busbw (GB/s)"):
            table.add_column(column, justify="right")
        for nbytes in sizes:
            count = element_count(op, nbytes, element_size, n)
            if count == 0:
                continue  # too small to give every rank a part
            nbytes = count * element_size
            seconds, iters = _time_op(op, count, nbytes, info, options)
            algbw = nbytes / seconds / 1e9
            busbw = algbw * factor
            table.add_row(human_bytes(nbytes), str(count), str(iters), fmt_sig(seconds * 1e6),
                          fmt_sig(algbw), fmt_sig(busbw))
            peaks[op] = max(peaks.get(op, (0.0, 0.0, 0)), (busbw, algbw, nbytes))
            points.setdefault(op, []).append((nbytes, seconds, busbw))
        if info.is_main:
            print_rich(table)
    for op, (busbw, algbw, nbytes) in peaks.items():
        log.info("%-15s peak busbw %s GB/s at %s (algbw %s GB/s)", op, fmt_sig(busbw), human_bytes(nbytes),
                 fmt_sig(algbw))
    log.info("collectives bench: %d op(s) × %d size(s) on %d rank(s) (%s) in %.1f s", len(ops), len(sizes), n,
             info.backend, time.perf_counter() - started)
    return points
