"""The FSDP2 family: zero2, fsdp (= zero3) and hsdp. Every block is sharded on its own, then the whole model, so that
one block's parameters are gathered at a time; zero2 keeps them gathered from forward to backward, hsdp shards
within dp_shard and replicates across dp_replicate (a 2-D mesh)."""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.runtime.log import get_logger

log = get_logger("parallel")


def wrap(model: nn.Module, backend, device: torch.device, world_size: int, *, blocks, mesh, param_dtype,
         cpu_offload: bool, experts=(), experts_mesh=None) -> nn.Module:
    """FSDP2 per block, then the whole model, over `mesh`. The `experts` (sharded over ep) are sharded first, on their
    own, over `experts_mesh` (the ranks that hold the same experts); without one (each rank holds its experts alone)
    they are left out of every FSDP unit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if mesh is None:
        if backend.replicas:
            raise ValueError(f"{backend.name} needs a 2-D mesh (dp_replicate × dp_shard)")
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp_shard",))
    options = dict(
        mesh=mesh,
        reshard_after_forward=backend.reshard_after_forward,
        # Compute in param_dtype, but reduce gradients in fp32: summing many ranks' bf16 gradients loses bits.
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None),
        # Pinned host memory needs an accelerator; on a CPU-only box pinning fails.
        offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy(),
    )
    ignored = set()
    for module in experts:
        if experts_mesh is not None:
            fully_shard(module, **{**options, "mesh": experts_mesh})
        else:
            ignored |= set(module.parameters(recurse=False))
    if ignored:
        options["ignored_params"] = ignored
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    log.info("FSDP2 (%s) over %d data-parallel rank(s)%s", backend.name, mesh.size(),
             ", parameters and optimizer state in host memory" if cpu_offload else "")
    return model
