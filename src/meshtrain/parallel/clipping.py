"""Gradient clipping over a model laid out on a mesh: each gradient's norm with DTensor ops (so FSDP × TP's strided
shards and the experts' two-mesh DTensors count once), summed over the pipeline ranks, then every gradient's local
shard scaled. torch.nn.utils.clip_grad_norm_ cannot add norms of DTensors on different meshes, nor across pipeline
stages, and scales DTensors through sharding propagation (clip_by_total_norm_)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def process_group_of(mesh_or_group):
    return mesh_or_group.get_group() if hasattr(mesh_or_group, "get_group") else mesh_or_group


def local_shard(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, pp_group=None, *, norm_type: float = 2.0,
                    scale_only: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for a model split over pipeline ranks (and sharded by FSDP / TP).

    The norm is over `parameters` on every rank of `pp_group` (a process group, a 1-D DeviceMesh, or None):
    each rank sums |g|^p of what it holds, a DTensor gradient's shards are summed over the mesh dims it is
    sharded on (not those it is replicated on), then the ranks of the pipeline add theirs. `scale_only` are
    clipped but not counted (the second copy of a tied weight). Returns the total norm.
    """
    norm_type = float(norm_type)
    parameters = list(parameters)
    sum_partial_gradients(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    extra = [p.grad for p in scale_only if p.grad is not None]
    device = (grads or extra)[0].device if grads or extra else torch.device("cpu")
    infinite = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
    # DTensor ops reduce over whatever dims a gradient is sharded on, strided FSDP x TP shards included;
    # every rank of a stage holds the same gradients in the same order, so their collectives line up.
    norms = [torch.linalg.vector_norm(g.detach().float(), norm_type) for g in grads]
    norms = [whole_norm(n) for n in norms]
    if not norms:
        total = torch.zeros((), device=device)
    elif infinite:
        total = torch.stack([n.to(device) for n in norms]).max()
    else:
        total = torch.stack([n.to(device) for n in norms]).pow(norm_type).sum()
    group = process_group_of(pp_group)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, op=op, group=group)
    total_norm = total if infinite else total.pow(1.0 / norm_type)
    coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    for g in grads + extra:
        local = local_shard(g)
        local.mul_(coef.to(local.device, local.dtype))
    return total_norm


def several_meshes(parameters: Iterable[torch.Tensor]) -> bool:
    """Whether the parameters are DTensors on more than one mesh, or DTensors beside plain tensors (the experts' view
    beside the data-parallel mesh; a mixture-of-experts layer's plain weights beside tensor-parallel ones), which
    torch.nn.utils.clip_grad_norm_ cannot add up and clip_grad_norm_ here can."""
    return len({getattr(p, "device_mesh", None) for p in parameters}) > 1


def clip_by_total_norm_(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (its total norm, the same coefficient), with each gradient's local shard scaled
    by it rather than the DTensors: torch scales them with one `_foreach_mul_` whose sharding propagation torch 2.13
    expands over every placement of the whole mesh (seconds of a first step on an hsdp × tp mesh on CPU ranks).
    Returns the total norm, whole."""
    parameters = list(parameters)
    sum_partial_gradients(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    total = total.full_tensor() if hasattr(total, "full_tensor") else total
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_([local_shard(g) for g in grads], coef.to(grads[0].device))
    return total


def whole_norm(norm: torch.Tensor) -> torch.Tensor:
    """A gradient's norm, whole on every rank. Over a mesh of several dims one dim at a time: torch 2.13 fuses the
    dims' reductions over a flattened mesh, which it can slice only for dims in the root mesh's order, and FSDP's
    mesh for experts under cp is not in it (edp = cp, then ep, which lies outside cp in the ranks)."""
    if not hasattr(norm, "full_tensor"):
        return norm
    if norm.device_mesh.ndim == 1:
        return norm.full_tensor()
    from torch.distributed.tensor import Replicate

    for dim in range(norm.device_mesh.ndim):
        placements = list(norm.placements)
        if not placements[dim].is_replicate():
            placements[dim] = Replicate()
            norm = norm.redistribute(norm.device_mesh, placements)
    return norm.to_local()


def sum_partial_gradients(parameters: Iterable[torch.Tensor]) -> None:
    """Sum, in place and once, each DTensor gradient that still awaits a sum over a mesh dim (Partial: the weight of a
    sequence-parallel norm, each tp rank's from its own tokens). Left so, the norm sums it for itself and the
    optimizer's step again: two all-reduces a norm a step (counted under tp: plan/communication.py)."""
    for p in parameters:
        grad = p.grad
        if isinstance(grad, DTensor) and any(place.is_partial() for place in grad.placements):
            p.grad = grad.redistribute(placements=[Replicate() if place.is_partial() else place
                                                   for place in grad.placements])
