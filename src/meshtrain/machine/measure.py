"""Timed figures of one device: matmul peak per dtype and memory bandwidth, taken so they can be trusted.

A peak measured too low makes every MFU after it too high, so a measurement here: grows the matmul
until one call takes long enough to time (a small one measures the call, not the units), keeps the best
of several timings, takes another round when the timings disagree (another process took the cores), and
records how many cores other processes kept busy meanwhile (and the load average), so a figure taken on a
busy box can be recognised and taken again.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from meshtrain.runtime.device import synchronize

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):  # Windows
        return None


def _busy_cpu_seconds() -> float | None:
    """CPU seconds every process on the machine has run (Linux /proc/stat), or None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def others_cpu(record: dict) -> Iterator[None]:
    """Set record["others_cores"]: how many cores other processes kept busy while the block ran (the machine's
    busy CPU time less this process's, over the wall time). Unlike the load average, which trails by a minute
    and counts this process too, it says whether a neighbour competed with the measurement itself."""
    machine, mine, t0 = _busy_cpu_seconds(), sum(os.times()[:2]), time.perf_counter()
    yield
    wall = time.perf_counter() - t0
    if machine is not None and wall > 0:
        others = (_busy_cpu_seconds() - machine) - (sum(os.times()[:2]) - mine)
        record["others_cores"] = round(max(0.0, others / wall), 2)


@contextlib.contextmanager
def fp32_matmuls(device: torch.device, mode: str) -> Iterator[None]:
    """Run fp32 matmuls as `mode` ('ieee' or 'tf32') inside the block, restoring the setting after."""
    if device.type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        before, matmul.fp32_precision = matmul.fp32_precision, mode
        try:
            yield
        finally:
            matmul.fp32_precision = before
    else:
        before, matmul.allow_tf32 = matmul.allow_tf32, mode == "tf32"
        try:
            yield
        finally:
            matmul.allow_tf32 = before


def best_of_rounds(timed: Callable[[], float], reps: int = 5, rounds: int = 3, tolerance: float = 0.1,
                   budget_s: float = 3.0) -> dict:
    """Time `timed` in rounds of `reps`; stop at the first round whose median is within `tolerance` of its best
    (stable), after `rounds`, or once `budget_s` is spent. Returns the best time over all rounds and the spread."""
    started, all_times, spread, round_no = time.perf_counter(), [], float("inf"), 0
    while round_no < rounds:
        round_no += 1
        times = [timed() for _ in range(reps)]
        all_times += times
        best, median = min(times), statistics.median(times)
        spread = (median - best) / best
        if spread <= tolerance or time.perf_counter() - started > budget_s:
            break
    return {"best_s": min(all_times), "median_s": statistics.median(all_times), "spread": round(spread, 4),
            "rounds": round_no, "stable": spread <= tolerance}


def matmul_peak(device: torch.device | str, label: str, *, min_time_s: float = 0.025,
                budget_s: float = 3.0) -> dict:
    """The best FLOP/s of an n×n matmul in `label` (fp32, tf32, bf16, fp16) on `device`, at this process's
    thread count. n doubles from 256 (1024 on accelerators) until one timing takes `min_time_s`, or the next
    size would not fit the budget: an AVX2 CPU does ~1 GFLOP/s in bf16, an H100 ~700 TFLOP/s."""
    device = torch.device(device)
    accelerator = device.type != "cpu"
    n, max_n, inner = (1024, 16384, 10) if accelerator else (256, 4096, 1)  # several calls hide launch latency
    load_before = load_average()

    with fp32_matmuls(device, "tf32" if label == "tf32" else "ieee"):
        def timer(a, b) -> Callable[[], float]:
            def timed() -> float:
                synchronize(device)
                t0 = time.perf_counter()
                for _ in range(inner):
                    torch.mm(a, b)
                synchronize(device)
                return time.perf_counter() - t0
            return timed

        # A generator of its own: a measurement inside a training run must not move the RNG that drives dropout.
        generator = torch.Generator(device=device).manual_seed(0)
        interference: dict = {}
        started = time.perf_counter()
        while True:
            a, b = (torch.randn(n, n, device=device, generator=generator).to(DTYPES[label]) for _ in range(2))
            timed = timer(a, b)
            timed()  # the first call of a size pays for allocation and kernel selection
            one = min(timed(), timed())
            if n < max_n and one < min_time_s and 8 * one * 5 <= budget_s:  # the next size: 8× a call, 5 calls
                n *= 2
                continue
            with others_cpu(interference):
                stats = best_of_rounds(timed, budget_s=budget_s)
            # Two calls that another process slowed can look long enough; the rounds' best says whether they were
            # (while the budget lasts: each measurement may take all of it)
            if n >= max_n or stats["best_s"] >= min_time_s / 2 or 8 * stats["best_s"] * 5 > budget_s \
                    or time.perf_counter() - started > budget_s:
                break
            n *= 2
    flops = 2 * n**3 * inner
    return {"flops": flops / stats["best_s"], "n": n, **stats, "threads": torch.get_num_threads(),
            "load": load_before, **interference, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}


def memory_bandwidth(device: torch.device | str, nbytes: int | None = None) -> dict:
    """Copy bandwidth (STREAM's copy: bytes read + bytes written per second) of a buffer far larger than any
    cache: 256 MiB on a CPU, 1 GiB on an accelerator."""
    device = torch.device(device)
    nbytes = nbytes or (1 << 30 if device.type != "cpu" else 256 << 20)
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)

    def timed() -> float:
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        return time.perf_counter() - t0

    timed()
    interference: dict = {}
    with others_cpu(interference):
        stats = best_of_rounds(timed, budget_s=3.0)
    return {"gbs": 2 * nbytes / stats["best_s"] / 1e9, "bytes": nbytes, **stats, "threads": torch.get_num_threads(),
            "load": load_average(), **interference, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}


# The GEMM shapes of transformer training, for an accelerator's rate curve: tokens per micro-batch (m) by the widths
# of its layers (k in, n out). Rates by shape, not by one square size: a 16384 × 768 × 3072 GEMM (GPT-2's MLP) runs
# well under a square matmul of the same FLOPs on an H100.
GEMM_TOKENS = (1024, 4096, 16384, 65536)
GEMM_WIDTHS = (256, 768, 1536, 3072, 6144, 12288)
# Attention shapes (sequence length, head dim) at about 256K query tokens (batch × heads × T), causal and full.
SDPA_LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384)
SDPA_HEAD_DIMS = (64, 128)


def timed_call(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of `fn`, the device synchronised before and after (its kernels, not their launch)."""
    synchronize(device)
    started = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - started


def _median_call_s(fn: Callable[[], object], device: torch.device) -> float:
    """The median seconds of `fn` after a warm-up call, in best_of_rounds' rounds within 50 ms: a table of hundreds of
    shapes must take a minute, not an hour."""
    fn()
    return best_of_rounds(lambda: timed_call(fn, device), reps=3, budget_s=0.05)["median_s"]


def gemm_curve(device: torch.device | str, label: str, tokens=GEMM_TOKENS, widths=GEMM_WIDTHS) -> list[list[float]]:
    """[m, k, n, FLOP/s] of an m × k by k × n matmul in `label` for every m in `tokens` and k, n in `widths` (random
    operands; fp32 as IEEE unless label is tf32)."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(0)
    points = []
    with fp32_matmuls(device, "tf32" if label == "tf32" else "ieee"):
        for m in tokens:
            for k in widths:
                for n in widths:
                    a = torch.randn(m, k, device=device, generator=generator).to(DTYPES[label])
                    b = torch.randn(k, n, device=device, generator=generator).to(DTYPES[label])
                    seconds = _median_call_s(lambda a=a, b=b: torch.mm(a, b), device)
                    points.append([m, k, n, 2 * m * k * n / seconds])
    return points


def sdpa_curve(device: torch.device | str, label: str, lengths=SDPA_LENGTHS, head_dims=SDPA_HEAD_DIMS,
               query_tokens: int = 1 << 18) -> list[list[float]]:
    """[T, head_dim, causal, FLOP/s] of torch's scaled_dot_product_attention forward + backward in `label`, with
    FLOPs counted as the planner counts them (12 · head_dim · T² per head: the whole score matrix, causal or not), at
    `query_tokens` query tokens per call (batch 1, heads = query_tokens / T)."""
    import torch.nn.functional as F

    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(0)
    points = []
    for d in head_dims:
        for T in lengths:
            heads = max(1, query_tokens // T)
            q, k, v = (torch.randn(1, heads, T, d, device=device, generator=generator).to(DTYPES[label])
                       .requires_grad_() for _ in range(3))
            for causal in (True, False):
                def step(q=q, k=k, v=v, causal=causal):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    out.backward(torch.ones_like(out))
                seconds = _median_call_s(step, device)
                points.append([T, d, int(causal), 12 * heads * d * T * T / seconds])
            del q, k, v
    return points
