"""AdamW with decay / no-decay groups, and the learning-rate schedule (linear warm-up, cosine decay)."""

from __future__ import annotations

import math

import torch


def build_optimizer(param_groups: list[dict], lr: float, betas: tuple[float, float], device: torch.device):
    """AdamW over prepared groups; the fused kernel (one pass over all parameters) on CUDA and CPU."""
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(param_groups, lr=lr, betas=betas, fused=fused)


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
