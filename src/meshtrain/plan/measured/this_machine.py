"""This machine as the cost model reads it (plan/machines.py's Machine), measured: on a CUDA GPU the GEMM and SDPA
tables (machine/profile.py's cache), elsewhere a curve of square matmul rates by size at the threads one rank gets and
attention timed as the cost model asks; copy bandwidth, the fixed cost of a block and of an optimizer step per tensor,
the collective timings `meshtrain machine --ranks N` recorded, and calibrate.py's fixed costs and slowdown."""

from __future__ import annotations

import functools
import statistics

import torch

from meshtrain.machine import hardware, profile
from meshtrain.machine.measure import timed_call
from meshtrain.nn.transformer import Block, attention
from meshtrain.parallel import context_parallel as cp
from meshtrain.plan.machines import GemmTable, Machine, SdpaTable
from meshtrain.plan.measured import fixed_costs
from meshtrain.runtime.device import pick_device, threads_per_rank


def this_machine(ranks_per_node: int, device: str | None = None, model: str | None = None) -> Machine:
    """This machine as `ranks_per_node` ranks of a job see it (each with the threads the launcher gives it), with
    the fixed costs calibrate.py measured for that many ranks on `model`'s tiny model, if any."""
    dev = torch.device(device) if device else pick_device(0)
    hw = hardware.describe(dev)
    threads = threads_per_rank(ranks_per_node) if dev.type == "cpu" else 0
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        gemm, sdpa, curve = {}, {}, {}
        if dev.type == "cuda":  # rates by GEMM shape and attention by length, measured once and cached
            tables = profile.curves(dev)
            gemm = {label: GemmTable.of(rows) for label, rows in tables["gemm"].items()}
            sdpa = {label: SdpaTable.of(rows) for label, rows in tables["sdpa"].items()}
        else:
            curve = {label: _curve(dev, label) for label in ["fp32"] + (["bf16"] if hw.bf16 else [])}
        memory = profile.measured(dev, "memory")["gbs"] * 1e9
        block_s, tensor_s = _fixed_costs(dev)
    finally:
        torch.set_num_threads(before)
    cores = hw.cores if dev.type == "cpu" else 0
    calibrated = fixed_costs.cached_slowdown(ranks_per_node)
    slowdown = (calibrated or max(1.0, ranks_per_node * threads / cores)) if cores else 1.0
    collectives = recorded_collectives(hw, dev)
    intra = min((max(p[0] / p[1] for p in pts) for pts in collectives.values()), default=1e9)
    return Machine(name="this", devices_per_node=ranks_per_node,
                   # a CPU's ranks share the host's memory
                   device_memory_bytes=hw.device_memory_bytes or hw.host_memory_bytes / ranks_per_node,
                   peak={label: max(r for _, r in points) for label, points in curve.items()} or
                   {label: max(table.rates.values()) for label, table in gemm.items()}, memory_bps=memory,
                   intra_bps=intra, inter_bps=intra, intra_latency_s=50e-6, inter_latency_s=50e-6,
                   overlap=dev.type != "cpu", slowdown=slowdown, cpu=dev.type == "cpu",
                   slowdown_under_autocast=fixed_costs.cached_slowdown(ranks_per_node, "bf16") if cores else None,
                   block_overhead_s=block_s,
                   optimizer_tensor_s=tensor_s, curve=curve, gemm=gemm, sdpa=sdpa, collectives=collectives,
                   fixed=fixed_costs.cached(ranks_per_node, model) if model else {},
                   attention_timer=functools.partial(attention_seconds, threads) if threads else None,
                   sources={"matmul": "measured here: GEMM rate by shape (m, k, n), attention (SDPA) by sequence "
                                      "length (machine profile)" if gemm else
                            f"measured here: matmul rate by size at {threads or 'all'} thread(s)",
                            "memory": "measured here: copy bandwidth (machine profile)",
                            "collectives": "recorded by `meshtrain machine --ranks N`" if collectives else
                            "none recorded: `meshtrain machine --ranks N` measures them (assumed 1 GB/s, 50 µs)",
                            "slowdown": _slowdown_source(ranks_per_node, threads, cores, slowdown, calibrated),
                            "fixed costs": _fixed_costs_source(ranks_per_node, model)})


def _slowdown_source(ranks: int, threads: int, cores: int, slowdown: float, calibrated: float | None) -> str:
    """What `--explain` says of the slowdown: fp32's, and under autocast its own where that was calibrated (a bf16
    plan's compute is priced with it)."""
    said = f"{ranks} rank(s) × {threads} thread(s) on {cores} core(s): {slowdown:.2f}× a rank alone, " + (
        "calibrated (plan/measured/calibrate.py)" if calibrated else "ranks × threads / cores")
    autocast = fixed_costs.cached_slowdown(ranks, "bf16") if cores else None
    return said + (f"; under autocast {autocast:.2f}×, calibrated" if autocast else "")


def _fixed_costs_source(ranks_per_node: int, model: str | None) -> str:
    if model and fixed_costs.cached(ranks_per_node, model):
        return f"calibrated here on a tiny {model} (plan/measured/calibrate.py)"
    why = ("no model named" if not model else "not calibrated yet" if fixed_costs.calibrated(model) else
           f"the {model} model's spec gives no tiny configuration")
    return f"dispatch of one block, measured ({why})"


_CURVES: dict[tuple[str, str, int], list[tuple[float, float]]] = {}


def _curve(device: torch.device, label: str) -> list[tuple[float, float]]:
    """FLOP/s of square matmuls of 32..1024 (the sizes small models run), best of a few calls each."""
    key = (str(device), label, torch.get_num_threads())
    if key not in _CURVES:
        dtype = torch.bfloat16 if label == "bf16" else torch.float32
        points = []
        for n in (32, 64, 128, 256, 512, 1024):
            a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
            reps = max(1, int(2e8 / n**3))
            run = lambda a=a, b=b, reps=reps: [torch.mm(a, b) for _ in range(reps)]  # noqa: E731
            best = min(timed_call(run, device) for _ in range(5))
            points.append((float(n), 2 * n**3 * reps / best))
        _CURVES[key] = points
    return _CURVES[key]


@functools.lru_cache(maxsize=256)
def attention_seconds(threads: int, label: str, heads: int, tokens: int, head_dim: int, causal: bool,
                       ring: int) -> float:
    """The median of a few forward and backward passes of the attention a rank runs, on this CPU at `threads`."""
    dtype = torch.bfloat16 if label == "bf16" else torch.float32
    q, k, v = (torch.randn(1, heads, tokens, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))
    scale = head_dim ** -0.5

    def sdpa():
        out = attention(q, k, v, 0.0, causal=causal)
        out.backward(torch.ones_like(out))

    def ring_blocks():  # what one rank computes of the ring's pairs: step 0 on its own K/V (masked if causal),
        half = tokens // 2  # then ring - 1 others, half of whose rows or keys a causal zigzag skips
        with torch.no_grad():
            for step in range(ring):
                keys = slice(None) if step == 0 or not causal else slice(None, half)
                out, lse = cp._block_forward(q, k[:, :, keys], v[:, :, keys], scale, causal and step == 0)
                if step:
                    cp._merge(out.clone(), lse.clone(), out, lse)
                delta = (out * out).sum(-1)
                cp._block_backward(q, k[:, :, keys], v[:, :, keys], out.to(dtype), lse, delta, scale,
                                   causal and step == 0)

    run = ring_blocks if ring > 1 else sdpa
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        run()
        return statistics.median(timed_call(run, torch.device("cpu")) for _ in range(5))
    finally:
        torch.set_num_threads(before)


def _fixed_costs(device: torch.device) -> tuple[float, float]:
    """(seconds of a tiny transformer block's forward and backward, seconds per tensor of a fused AdamW step):
    what a step costs beyond its arithmetic, the operators' dispatch."""
    torch.manual_seed(0)
    block = Block(16, 2, 64, causal=True, dropout=0.0, bias=False).to(device)
    x = torch.randn(1, 4, 16, device=device, requires_grad=True)
    run = lambda: block(x).sum().backward()  # noqa: E731
    run()
    block_s = statistics.median(timed_call(run, device) for _ in range(30))
    params = [torch.nn.Parameter(torch.randn(16, device=device)) for _ in range(64)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=device.type in ("cpu", "cuda"))
    optimizer.step()
    tensor_s = statistics.median(timed_call(optimizer.step, device) for _ in range(20)) / len(params)
    return block_s, tensor_s


def recorded_collectives(hw, device: torch.device) -> dict[tuple[str, int], list[tuple[float, float]]]:
    """(op, ranks) -> [(bytes, seconds)] that `meshtrain collectives --bench --record` kept for this device on one
    node (calibrate.py records them for the ranks it calibrates when none are)."""
    found = {}
    for key, entry in profile.read_cache().get("collectives", {}).items():
        parts = key.split("|")
        if parts[1:3] != [device.type, hw.name] or "nodes=1" not in parts or f"torch={torch.__version__}" not in parts:
            continue
        world = int(next(p for p in parts if p.startswith("world="))[6:])
        for op, record in entry.get("ops", {}).items():
            found[op, world] = list(zip(map(float, record["bytes"]), record["seconds"], strict=True))
    return found
