"""What calibrate.py measured, as this_machine reads it back: the fixed costs per kind of layout and the slowdown of
ranks sharing cores, cached in the machine profile (~/.cache/meshtrain/machine.json, "plan_fixed" and
"plan_slowdown") under this device, thread count, torch, rank count, cost-model version and tiny model."""

from __future__ import annotations

import torch

from meshtrain.machine import hardware, profile
from meshtrain.runtime.device import pick_device, threads_per_rank

MODEL_VERSION = 5  # what the fixed costs are measured beyond: a new cost model invalidates the cached ones
# The tiny model of each workload (the GPT's serves models without their own): next to no arithmetic, its blocks at
# two depths. The ViT's differs from the GPT's beyond its blocks (a field-sized head and loss, all tokens gathered
# before the head under context parallelism), so it is calibrated on its own.
TINY = {
    "gpt": ["model.n_embd=32", "model.n_head=2", "model.block_size=16", "model.batch_size=4", "model.dropout=0.0",
            "train.dtype=fp32", "train.grad_accum=1", "parallel.microbatches=null"],
    "vit": ["model.embed_dim=32", "model.num_heads=2", "model.patch_size=16", "data.crop=[80,160]",
            "data.global_batch_size=8", "model.dropout=0.0", "train.dtype=fp32", "train.grad_accum=1",
            "parallel.microbatches=null"],
}


def calibrated_as(model: str) -> str:
    """The tiny model whose fixed costs `model` uses."""
    return model if model in TINY else "gpt"


def key(ranks: int, model: str) -> str:
    device = pick_device(0)
    threads = threads_per_rank(ranks) if device.type == "cpu" else 0
    return (f"{profile.profile_key(hardware.describe(device), threads)}|ranks={ranks}|torch={torch.__version__}"
            f"|model={MODEL_VERSION}|{calibrated_as(model)}")


def cached(ranks: int, model: str) -> dict[str, list[float]]:
    """kind -> [seconds per block and micro-step, seconds per step], as far as measured."""
    return profile.read_cache().get("plan_fixed", {}).get(key(ranks, model), {})


def cached_slowdown(ranks: int) -> float | None:
    return profile.read_cache().get("plan_slowdown", {}).get(key(ranks, "gpt"))
