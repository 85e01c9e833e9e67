"""The fixed costs of each kind of layout on this machine: what a step costs beyond its arithmetic and its bytes
(operator and DTensor dispatch, FSDP's and DDP's hooks and copies, the pipeline's scheduling, collective latency,
ranks sharing cores), measured by training a tiny GPT (width 32, 16 tokens, batch 4: next to no arithmetic) at two
depths under each kind, on as many ranks as the plan is for.

    kind                      measured as                       cost added to a layout of that kind
    backend:ddp|zero1|...     that backend over all ranks       per block and micro-step, and per step
    tp                        fsdp with tp=2, sequence parallel  the difference from fsdp alone
    cp:ring | cp:ulysses      fsdp with cp=2
    pp:1f1b | pp:gpipe | ...  ddp with pp=2                     the difference from ddp alone

Two depths (4 and 8 blocks) separate the cost per block from the cost per step. The tiny model is never a size
`plan --validate` scores: the costs are fitted on it and scored on the layouts' own sizes. Results are cached in the
machine profile (~/.cache/meshtrain/machine.json, "plan_fixed") under this device, thread count, torch and rank
count.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from meshtrain.plan import measure
from meshtrain.runtime.results import run_ranks

DEPTHS = (4, 8)
TINY = ["model.n_embd=32", "model.n_head=2", "model.block_size=16", "model.batch_size=4", "model.dropout=0.0",
        "train.dtype=fp32", "train.grad_accum=1", "parallel.microbatches=null"]
KINDS = {  # kind -> (layout overrides on the tiny GPT, the kind it is measured against)
    "backend:ddp": (["train.backend=ddp"], None),
    "backend:zero1": (["train.backend=zero1"], None),
    "backend:zero2": (["train.backend=zero2"], None),
    "backend:fsdp": (["train.backend=fsdp"], None),
    "backend:hsdp": (["train.backend=hsdp", "parallel.dp_replicate=2"], None),
    "tp": (["train.backend=fsdp", "parallel.tp=2"], "backend:fsdp"),
    "cp:ring": (["train.backend=fsdp", "parallel.cp=2", "parallel.cp_impl=ring"], "backend:fsdp"),
    "cp:ulysses": (["train.backend=fsdp", "parallel.cp=2", "parallel.cp_impl=ulysses"], "backend:fsdp"),
    "pp:1f1b": (["train.backend=ddp", "parallel.pp=2", "parallel.pp_schedule=1f1b"], "backend:ddp"),
    "pp:gpipe": (["train.backend=ddp", "parallel.pp=2", "parallel.pp_schedule=gpipe"], "backend:ddp"),
    "pp:interleaved_1f1b": (["train.backend=ddp", "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
                             "parallel.virtual_stages=2"], "backend:ddp"),
}


def kinds_of(cfg, dims) -> list[str]:
    """The kinds whose fixed costs a layout pays."""
    p, t = cfg.parallel, cfg.train
    kinds = [f"backend:{t.backend}"]
    if dims.tp > 1:
        kinds.append("tp")
    if dims.cp > 1:
        kinds.append(f"cp:{p.cp_impl}")
    if dims.pp > 1:
        kinds.append(f"pp:{p.pp_schedule}")
    return kinds


def _key(ranks: int) -> str:
    import torch

    from meshtrain.machine import profile
    from meshtrain.machine.hardware import describe
    from meshtrain.runtime.device import pick_device, threads_per_rank

    device = pick_device(0)
    threads = threads_per_rank(ranks) if device.type == "cpu" else 0
    return f"{profile.profile_key(describe(device), threads)}|ranks={ranks}|torch={torch.__version__}"


def cached(ranks: int) -> dict[str, list[float]]:
    from meshtrain.machine import profile

    return profile.read_cache().get("plan_fixed", {}).get(_key(ranks), {})


def calibrate(ranks: int, kinds: list[str], progress=print) -> dict[str, list[float]]:
    """[seconds per block and micro-step, seconds per step] of each kind on `ranks` ranks, measuring those not
    cached (and the kinds they are measured against)."""
    from meshtrain.machine import profile

    known = cached(ranks)
    wanted = list(dict.fromkeys(k for kind in kinds for k in (KINDS[kind][1], kind) if k))
    missing = [k for k in wanted if k not in known]
    if not missing:
        return known
    with tempfile.TemporaryDirectory(prefix="meshtrain-calibrate-") as root:
        from meshtrain.data.text import prepare

        prepare("shakespeare_char", Path(root))
        times = {}
        for kind in missing:
            overrides, _ = KINDS[kind]
            times[kind] = [_step_s(ranks, [*TINY, f"data.root={root}", f"model.n_layer={depth}", *overrides])
                           for depth in DEPTHS]
            progress(f"fixed costs of {kind} on {ranks} ranks: {times[kind]}")
    for kind in missing:  # absolute first, then the differences from what each is measured against
        (short, long), base = times[kind], KINDS[kind][1]
        per_block = (long - short) / (DEPTHS[1] - DEPTHS[0])
        per_step = short - DEPTHS[0] * per_block
        if base:
            base_block, base_step = known.get(base) or _absolute(times[base])
            per_block, per_step = per_block - base_block, per_step - base_step
        known[kind] = [per_block, per_step]
    profile.remember("plan_fixed", _key(ranks), known)
    return known


def _absolute(times: list[float]) -> list[float]:
    per_block = (times[1] - times[0]) / (DEPTHS[1] - DEPTHS[0])
    return [per_block, times[0] - DEPTHS[0] * per_block]


def _step_s(ranks: int, overrides: list[str]) -> float:
    job = run_ranks(Path(measure.__file__), ranks, "gpt", *overrides, "--steps", "8", "--warmup", "3", timeout=300)
    rows = [fields for result in job.results.values() for fields in result.values()]
    if job.returncode or not rows:
        raise RuntimeError(f"calibration run {' '.join(overrides)} failed (exit {job.returncode}):\n"
                           f"{job.output[-1500:]}")
    return max(r["step_s"] for r in rows)
