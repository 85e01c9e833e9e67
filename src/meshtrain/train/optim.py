"""The optimizer (AdamW, or ZeroRedundancyOptimizer under zero1), the square-root learning-rate rule, and
the schedule: linear warm-up, then cosine decay."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from meshtrain.parallel import backends

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig


def build_optimizer(param_groups: list[dict], device: torch.device, backend: str = "ddp", world_size: int = 1,
                    optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW, **hyper) -> torch.optim.Optimizer:
    """`optimizer_class` over prepared groups (AdamW: the fused kernel on CUDA and CPU); under zero1 each
    rank keeps and updates only its share of the optimizer state (ZeroRedundancyOptimizer)."""
    if optimizer_class is torch.optim.AdamW:
        hyper.setdefault("fused", device.type in ("cuda", "cpu"))
    param_groups = split_plain_from_distributed(param_groups)
    chosen = backends.get(backend)
    if chosen.shards == "optimizer" and world_size > 1:
        return chosen.module().sharded_optimizer(param_groups, optimizer_class, **hyper)
    return optimizer_class(param_groups, **hyper)


def split_plain_from_distributed(param_groups: list[dict]) -> list[dict]:
    """Each group that holds both plain tensors and DTensors (DDP's replicated weights beside expert parallelism's
    sharded experts) as two groups with the same settings: a fused or foreach kernel takes one kind per call."""
    out = []
    for group in param_groups:
        kinds = [[p for p in group["params"] if hasattr(p, "to_local") == distributed] for distributed in (False, True)]
        out += [{**group, "params": params} for params in kinds if params] if all(kinds) else [group]
    return out


def scaled_learning_rates(cfg: RunConfig, global_batch: int) -> tuple[float, float, float]:
    """(lr, min_lr, factor) after the square-root rule lr · sqrt(global_batch / optimizer.base_batch_size)."""
    o = cfg.optimizer
    factor = math.sqrt(global_batch / o.base_batch_size) if o.base_batch_size else 1.0
    return o.lr * factor, o.min_lr * factor, factor


def learning_rate(it: int, lr: float, min_lr: float, warmup_iters: int, decay_iters: int, decay: bool = True) -> float:
    """lr at iteration `it`: linear warm-up to `lr`, cosine down to `min_lr` at `decay_iters`, then flat."""
    if not decay:
        return lr
    if it < warmup_iters:
        return lr * (it + 1) / (warmup_iters + 1)
    if it >= decay_iters:
        return min_lr
    progress = (it - warmup_iters) / max(1, decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)
