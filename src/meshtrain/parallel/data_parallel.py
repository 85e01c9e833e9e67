"""What the loop asks of data parallelism whatever the backend (parallel/backends/ says what each one is and wraps
with it): wrap the model, whether a micro-step synchronises gradients (only the last of an accumulation does), and
the bytes a rank holds."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from meshtrain.parallel import backends


def apply_data_parallel(model: nn.Module, backend: str, device: torch.device, world_size: int, *,
                        blocks: Iterable[nn.Module] = (), mesh=None, param_dtype: torch.dtype | None = None,
                        cpu_offload: bool = False, experts: Iterable[nn.Module] = (), experts_mesh=None) -> nn.Module:
    """The model as the loop should call it; unchanged on one data-parallel rank (no collective to pay for).

    `world_size` counts the data-parallel ranks; `blocks` are the repeated layers FSDP shards one by
    one, so only one block's parameters are gathered at a time; `mesh` is the data-parallel DeviceMesh
    (2-D, replicate × shard, for hsdp; default: all ranks). `experts`: modules whose parameters expert parallelism
    sharded (parallel/expert_parallel.py); they are reduced over their own group, not `mesh`: FSDP2 shards them over
    `experts_mesh` (the edp ranks; None: left to the layout), DDP leaves them to the layout.
    """
    chosen = backends.get(backend)
    if chosen.engine:
        raise ValueError(f"train.backend={backend} runs the model in an engine of its own, which the layout builds "
                         "with the optimizer (Layout.attach_optimizer): there is nothing to wrap here")
    if not wraps(backend, world_size):
        return model
    options = dict(experts=list(experts), experts_mesh=experts_mesh) if experts else {}
    return chosen.module().wrap(model, chosen, device, world_size, blocks=blocks, mesh=mesh, param_dtype=param_dtype,
                                cpu_offload=cpu_offload, **options)


def wraps(backend: str, world_size: int) -> bool:
    """Whether apply_data_parallel wraps the model: over several data-parallel ranks, or a sharded backend in a job
    of one rank under a launcher (FSDP2 still offloads to the host and gathers in float8 there). One data-parallel
    rank inside a larger job (tensor or pipeline parallel only) has nothing to reduce: left as it is."""
    return world_size > 1 or (backends.get(backend).sharded and dist.is_initialized() and dist.get_world_size() == 1)


def gradient_sync(model: nn.Module, sync: bool):
    """Context for one micro-step's backward: no gradient reduction unless `sync`."""
    if isinstance(model, DistributedDataParallel):
        return nullcontext() if sync else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # an FSDP2 module
        model.set_requires_gradient_sync(sync)
    return nullcontext()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor holds only its shard here


def bytes_held(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds (shards, not the whole)."""
    params = list(model.parameters())
    held = {"params": sum(_local(p).numel() * p.element_size() for p in params),
            "grads": sum(_local(p.grad).numel() * p.grad.element_size() for p in params if p.grad is not None),
            "optimizer": 0}
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's optimizer here
    for state in (inner.state.values() if inner is not None else ()):
        held["optimizer"] += sum(_local(v).numel() * v.element_size() for v in state.values()
                                 if torch.is_tensor(v) and v.dim() > 0)
    return held
