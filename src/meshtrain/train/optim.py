"""The learning-rate schedule: linear warm-up, then cosine decay (the optimizer is built in parallel/)."""

from __future__ import annotations

import math


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
