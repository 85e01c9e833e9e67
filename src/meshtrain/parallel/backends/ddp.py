"""The DDP family: ddp (every rank holds everything; gradients all-reduced in buckets during backward) and zero1 (the
same, with ZeroRedundancyOptimizer keeping each rank's share of the optimizer state)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def wrap(model: nn.Module, backend, device: torch.device, world_size: int, *, blocks, mesh, param_dtype,
         cpu_offload: bool, experts=(), experts_mesh=None) -> nn.Module:
    """DDP over `mesh` (default: every rank); DDP computes in the model's own dtype and keeps it where it is. The
    `experts`' parameters (sharded over ep, parallel/expert_parallel.py) are left out: the layout averages them over
    the ranks that hold the same experts."""
    if experts:
        names = {id(p): n for n, p in model.named_parameters()}
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, [names[id(p)] for module in experts for p in module.parameters(recurse=False)])
    kwargs = {"device_mesh": mesh} if mesh is not None else {}
    if experts and mesh is not None:
        # Given a mesh sliced from a larger one (with pp or cp), DDP turns every DTensor parameter, ignored or not,
        # into a local tensor between forwards (torch's DDP × TP shim), and the experts' stop being parameters in
        # forward. The same ranks as a process group: no shim.
        kwargs = {"process_group": mesh.get_group()}
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None, **kwargs)


def sharded_optimizer(param_groups: list[dict], optimizer_class: type[torch.optim.Optimizer],
                      **hyper) -> torch.optim.Optimizer:
    """zero1: each rank keeps and updates only its share of the optimizer state."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    first, *rest = param_groups
    optimizer = ZeroRedundancyOptimizer(first["params"], optimizer_class=optimizer_class,
                                        **{**hyper, **{k: v for k, v in first.items() if k != "params"}})
    for group in rest:  # it takes further groups one at a time
        optimizer.add_param_group(dict(group))
    return optimizer
