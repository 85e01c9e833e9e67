"""Data parallelism for the training loop: DDP today; ZeRO/FSDP/HSDP join here.

The loop asks two things of this module: wrap the model, and tell it whether a micro-step should
synchronise gradients (only the last of an accumulation does; the others skip the all-reduce).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def apply_data_parallel(model: nn.Module, backend: str, device: torch.device, world_size: int) -> nn.Module:
    """The model as the loop should call it; unchanged on one process (no all-reduce to pay for)."""
    if backend != "ddp":
        raise ValueError(f"unknown data-parallel backend {backend!r}")
    if world_size == 1:
        return model
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def gradient_sync(model: nn.Module, sync: bool):
    """Context for one micro-step's backward: no all-reduce unless `sync` (DDP's no_sync)."""
    if sync or not isinstance(model, DistributedDataParallel):
        return nullcontext()
    return model.no_sync()


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model under DDP and torch.compile wrappers (for eval, sampling and checkpoints)."""
    model = model.module if isinstance(model, DistributedDataParallel) else model
    return getattr(model, "_orig_mod", model)
