"""The data-parallel family, from replicated to fully sharded:

    ddp     DistributedDataParallel: every rank holds everything; gradients all-reduced
    zero1   DDP + ZeroRedundancyOptimizer: optimizer state sharded across ranks
    zero2   FSDP2, parameters kept gathered between forward and backward (no reshard after forward)
    fsdp    FSDP2, parameters re-sharded after forward (= zero3): the least memory, the most traffic
    hsdp    FSDP2 on a 2-D mesh: shard within dp_shard, replicate across dp_replicate

The loop asks two things of this module: wrap the model, and say whether a micro-step synchronises
gradients (only the last of an accumulation does). zero1's optimizer is built in train/optim.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from meshtrain.runtime.log import get_logger

BACKENDS = ("ddp", "zero1", "zero2", "fsdp", "zero3", "hsdp")
SHARDED = ("zero2", "fsdp", "zero3", "hsdp")
log = get_logger("parallel")


def apply_data_parallel(model: nn.Module, backend: str, device: torch.device, world_size: int, *,
                        blocks: Iterable[nn.Module] = (), mesh=None, param_dtype: torch.dtype | None = None,
                        cpu_offload: bool = False) -> nn.Module:
    """The model as the loop should call it; unchanged on one data-parallel rank (no collective to pay for).

    `world_size` counts the data-parallel ranks; `blocks` are the repeated layers FSDP shards one by
    one, so only one block's parameters are gathered at a time; `mesh` is the data-parallel DeviceMesh
    (2-D, replicate × shard, for hsdp; default: all ranks).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown data-parallel backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if not wraps(backend, world_size):
        return model
    if backend in ("ddp", "zero1"):
        kwargs = {"device_mesh": mesh} if mesh is not None else {}  # default: every rank
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None, **kwargs)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if mesh is None:
        if backend == "hsdp":
            raise ValueError("hsdp needs a 2-D mesh (dp_replicate × dp_shard)")
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp_shard",))
    options = dict(
        mesh=mesh,
        reshard_after_forward=backend != "zero2",
        # Compute in param_dtype, but reduce gradients in fp32: summing many ranks' bf16 gradients loses bits.
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None),
        # Pinned host memory needs an accelerator; on a CPU-only box pinning fails.
        offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy(),
    )
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    log.info("FSDP2 (%s) over %d data-parallel rank(s)%s", backend, mesh.size(),
             ", parameters and optimizer state in host memory" if cpu_offload else "")
    return model


def wraps(backend: str, world_size: int) -> bool:
    """Whether apply_data_parallel wraps the model: over several data-parallel ranks, or a sharded backend in a job
    of one rank under a launcher (FSDP2 still offloads to the host and gathers in float8 there). One data-parallel
    rank inside a larger job (tensor or pipeline parallel only) has nothing to reduce: left as it is."""
    return world_size > 1 or (backend in SHARDED and dist.is_initialized() and dist.get_world_size() == 1)


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
