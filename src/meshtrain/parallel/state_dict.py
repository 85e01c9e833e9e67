"""Model and optimizer state in the form a distributed checkpoint (DCP) saves, for every layout.

Keys are parameter names of the whole model ("transformer.h.3.mlp.c_fc.weight"), whatever the
layout; each rank contributes what it holds: DTensor shards under FSDP and TP, its stages'
parameters under PP, everything (deduplicated by DCP) under DDP. DCP records every tensor's global
shape and which slice each rank wrote, so a checkpoint saved under one layout loads into another:
the loading rank asks for its own slices and DCP reads them from whichever files hold them.

Optimizer state is flattened to one entry per parameter ("state.<name>.exp_avg", "param_groups.<name>.lr")
so that it reshards like the model: a pipeline rank asks for exactly its parameters' entries.
A parameter that is tied in one layout and split in another (the GPT's lm_head and wte, on the last and
first pipeline stages) is named in `aliases`: its optimizer state is read from the name it is tied to,
which every layout saves.

ZeroRedundancyOptimizer (zero1) is the exception: it keeps its state by parameter index, in shards
that DCP cannot see. Its state is gathered to rank 0 and renamed by parameter name, which is the
same form the other layouts save, so zero1 checkpoints move between layouts too.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor


def _is_zero1(optimizer: torch.optim.Optimizer) -> bool:
    return hasattr(optimizer, "consolidate_state_dict")


def _plain_twin(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """An ordinary optimizer over the same parameter groups as a ZeroRedundancyOptimizer."""
    groups = [dict(group) for group in optimizer.param_groups]
    return optimizer._optim_constructor(groups, **optimizer._optim_defaults)


FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def model_and_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """{"model": ..., "optimizer": ...} for dcp.save / dcp.async_save. Every rank must call it."""
    state = {"model": get_model_state_dict(model)}
    if not _is_zero1(optimizer):
        state["optimizer"] = get_optimizer_state_dict(model, optimizer, options=FLAT)
        return state
    optimizer.consolidate_state_dict(to=0)
    twin = _plain_twin(optimizer)
    if torch.distributed.get_rank() == 0:  # only rank 0 has the whole state; the others write none of it
        twin.load_state_dict(optimizer.state_dict())
        state["optimizer"] = get_optimizer_state_dict(model, twin, options=FLAT)
    return state


def load_model_and_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, load,
                                   aliases: dict[str, str] | None = None) -> None:
    """Fill `model` and `optimizer` from a checkpoint. `load(state)` is dcp.load bound to a checkpoint:
    it fills the given template (this rank's slices, in this layout) in place. `aliases` maps a
    parameter name to the name whose optimizer state it takes (see the module docstring)."""
    target = _plain_twin(optimizer) if _is_zero1(optimizer) else optimizer  # zero1: read all, keep a shard
    optim_state = get_optimizer_state_dict(model, target, options=FLAT)
    readers: dict[str, list[str]] = {}  # checkpoint key -> the template keys it fills (two if both copies are here)
    for key in optim_state:
        readers.setdefault(_alias(key, aliases or {}), []).append(key)
    state = {"model": get_model_state_dict(model),
             "optimizer": {source: optim_state[keys[0]] for source, keys in readers.items()}}
    load(state)
    set_model_state_dict(model, state["model"])
    loaded = {}
    for source, keys in readers.items():
        value = state["optimizer"][source]
        for i, key in enumerate(keys):  # a second copy gets its own tensor: the two are stepped separately
            loaded[key] = value.clone() if i and torch.is_tensor(value) else value
    set_optimizer_state_dict(model, target, loaded, options=FLAT)
    if target is not optimizer:
        optimizer.load_state_dict(target.state_dict())


def _alias(key: str, aliases: dict[str, str]) -> str:
    """'state.lm_head.weight.exp_avg' -> 'state.transformer.wte.weight.exp_avg' for aliases {lm_head.weight: ...}."""
    section, _, rest = key.partition(".")
    for name, source in aliases.items():
        if rest.startswith(name + "."):
            return f"{section}.{source}{rest[len(name):]}"
    return key


def full_model_state(model: nn.Module, keep: bool = True) -> dict[str, torch.Tensor]:
    """Whole tensors, on the CPU, of what `model` holds: its shards gathered from the ranks that share it
    (FSDP, TP). Every rank must call it, as the gathers are collective; a rank that does not `keep` them gets none
    (one rank of a stage is enough: a 7B model's 28 GB of host memory each, 8 ranks a node). Under PP each rank has
    only its stages' tensors. One tensor at a time: each is gathered on the device and copied to the CPU before the
    next, where torch's full_state_dict keeps every gathered tensor on the device until the last (a whole fp32 copy
    of the model on every GPU), and its cpu_offload keeps them on global rank 0 alone, which holds one stage."""
    out = {}
    for name, value in get_model_state_dict(model).items():  # the shards, named as torch's full state names them
        whole = _whole(value)  # every rank joins each gather
        if keep:
            out[name] = whole.cpu()
    return out


def _whole(value: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (on its mesh's device: FSDP2 may keep its shards on the CPU); a tensor as it is."""
    if not isinstance(value, DTensor):
        return value.detach()
    if value.device.type != value.device_mesh.device_type:
        value = value.to(value.device_mesh.device_type)
    return value.full_tensor().detach()
