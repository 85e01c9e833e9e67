"""What one rank holds of a model under a layout, counted without processes: parameters, gradients and optimizer
state, exact to the element (plan --validate compares them with what a run's ranks hold).

The count follows what each parallelism does to a parameter, in the order the layouts apply them:

    pp    a stage holds its blocks (pipeline_schedules.split_layers) and the modules the model's StageSplit gives the
          first or the last stage; a tied pair is one parameter on one stage and a copy on each end of a pipeline
    tp    tensor_parallel.SHARDED_DIMS says which dim of which module's weight (and bias) a plan shards; a shard is
          torch.chunk's: rank 0 holds ceil(size / tp), the largest
    ep    the routed experts' stacked [E, ...] parameters (ModelShape.moe.module) are cut Shard(0) over the ep ranks
          (and over tp by their hidden dim before: tensor_parallel.PARTIAL_SUM_DIMS, in SHARDED_DIMS)
    dp    ddp and zero1 replicate parameters and gradients; zero1's ZeroRedundancyOptimizer gives each parameter's
          state to the rank with the fewest elements so far, largest parameters first, group by group; FSDP2 (zero2,
          fsdp, hsdp) chunks dim 0 of each (tp-local) parameter over the ranks it shards across; under ep > 1 the
          experts' slices over their own group, edp (dp_replicate × efsdp: the ranks that hold the same experts)

The largest share is rank 0's of each stage (every chunk above gives rank 0 the rounded-up part), so `stage_shares`
reports one row per pipeline stage, for the ranks at coordinate 0 of every other dim.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from torch import nn

from meshtrain.parallel import backends
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.parallel.pipeline_schedules import StageSplit, split_layers, stage_ids
from meshtrain.parallel.tensor_parallel import SHARDED_BIASES, SHARDED_DIMS, WHOLE_GRADIENTS


@dataclass(frozen=True)
class Share:
    """Elements one rank holds (fp32 master copies: 4 bytes each), and what its stage computes with."""

    stage: int  # pp rank
    params: int  # after every sharding: what the rank keeps between steps
    grads: int
    optimizer: int  # AdamW: two moments per element it steps
    stage_params: int  # the pp stage's parameters after tp, before data-parallel sharding (what FSDP gathers)
    blocks: int  # transformer blocks on this pp rank
    first: bool  # holds the embeddings
    last: bool  # holds the head (and computes the loss)
    block_params: int  # one block's parameters after tp (what FSDP gathers per block)
    tensors: int  # parameter tensors the rank's optimizer steps
    root_params: int = 0  # the stage's parameters outside its blocks, after tp (what FSDP gathers for the root)
    expert_params: int = 0  # of params: the routed experts' elements the rank keeps (after ep and their own sharding)
    expert_local: int = 0  # the routed experts' elements after ep, before data-parallel sharding (what edp reduces)
    parts: tuple[tuple[int, ...], ...] = ()  # the blocks (indices) this pp rank runs, one tuple per stage it holds
    # Gradient elements as backward makes them (plan/backward.py): each block's of `parts` (flattened, forward order),
    # and those made before any block's, the head's and final norm's (a tied embedding's with them)
    block_grads: tuple[int, ...] = ()
    head_grads: int = 0
    # The same before data-parallel sharding: what FSDP2 accumulates unsharded while it does not reduce (a pipeline's
    # micro-batches before the last, an accumulation's micro-steps)
    block_local: tuple[int, ...] = ()
    head_local: int = 0
    unsharded_grads: int = 0  # all of them: stage_params, and tensor_parallel.WHOLE_GRADIENTS whole (DTensor's)
    block_gathered: tuple[int, ...] = ()  # what FSDP2 gathers of each block of `parts` (block_params: the largest)
    # Vectors tp leaves whole (norm weights, a row-parallel layer's bias): under sequence parallel each rank's gradient
    # of one is a partial sum over its own tokens, all-reduced once a step (plan/communication.py)
    whole_vectors: int = 0


def chunk(size: int, parts: int, index: int = 0) -> int:
    """torch.chunk's share of `size` for part `index` of `parts` (DTensor's Shard and FSDP2 cut this way)."""
    step = math.ceil(size / parts)
    return max(0, min(step, size - index * step))


@functools.cache  # a plan asks it of every parameter for each of hundreds of layouts
def tp_local_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The shape of parameter `name` on tp rank 0 (SHARDED_DIMS names its module, or itself: stacked experts)."""
    module, _, kind = name.rpartition(".")
    suffix = next((s for s in SHARDED_DIMS if any(p == s or p.endswith("." + s) for p in (module, name))), None)
    if tp == 1 or suffix is None or (kind == "bias" and suffix not in SHARDED_BIASES):
        return shape
    dim = SHARDED_DIMS[suffix] if kind != "bias" else 0
    return _shard(shape, dim, tp) if dim < len(shape) else shape


def _shard(shape: tuple[int, ...], dim: int, parts: int) -> tuple[int, ...]:
    """The shape of part 0 when `shape` is chunked `parts` ways along `dim`, as DTensor's Shard(dim) cuts it."""
    return shape[:dim] + (chunk(shape[dim], parts),) + shape[dim + 1:]


def _stage_parameters(model: nn.Module, split: StageSplit | None, dims: ParallelDims, schedule: str,
                      virtual_stages: int) -> list[dict[str, tuple[int, ...]]]:
    """{name: shape} of the parameters each pp rank holds, the whole model on one stage when pp == 1."""
    params = dict((n, tuple(p.shape)) for n, p in model.named_parameters())  # a tied weight once
    if dims.pp == 1 or split is None:
        return [params]
    every = dict((n, tuple(p.shape)) for n, p in model.named_parameters(remove_duplicate=False))
    n_layer = len(model.get_submodule(split.blocks))
    n_stages = dims.pp * virtual_stages
    blocks = split_layers(n_layer, n_stages)
    stages = []
    for pp_rank in range(dims.pp):
        mine = stage_ids(pp_rank, dims.pp, virtual_stages, schedule)
        owned = {f"{split.blocks}.{i}." for s in mine for i in blocks[s]}
        ends = (split.first if 0 in mine else ()) + (split.last if n_stages - 1 in mine else ())
        prefixes = tuple(owned) + tuple(f"{m}." for m in ends)
        held = {n: s for n, s in every.items() if n.startswith(prefixes)}
        if split.tied and split.tied[0] in held and split.tied[1] in held:  # both ends on one rank: one tensor
            del held[split.tied[0]]
        stages.append(held)
    return stages


def _optimizer_groups(model: nn.Module, numel: dict[str, int]) -> list[list[int]]:
    """The sizes of the parameters in `numel` by the model's own optimizer groups (configure_optimizer_groups), which
    ZeroRedundancyOptimizer partitions one after another: the ViT leaves its 3-D pos_embed undecayed, where a rule of
    matrices first put it among them (its zero1 optimizer state 3% off). Without the method: matrices, then the rest."""
    if not hasattr(model, "configure_optimizer_groups"):
        return [[v for n, v in numel.items() if len(model.get_parameter(n).shape) >= 2],
                [v for n, v in numel.items() if len(model.get_parameter(n).shape) < 2]]
    name = {id(p): n for n, p in model.named_parameters()}
    return [[numel[name[id(p)]] for p in group["params"] if name.get(id(p)) in numel]
            for group in model.configure_optimizer_groups(0.0)]


def _zero1_partition(groups: list[list[int]], ranks: int) -> int:
    """Elements of optimizer state ZeroRedundancyOptimizer gives rank 0: largest first, to the emptiest rank."""
    sizes = [0] * ranks
    for group in groups:
        for numel in sorted(group, reverse=True):
            sizes[sizes.index(min(sizes))] += numel
    return sizes[0]


def stage_shares(model: nn.Module, split: StageSplit | None, dims: ParallelDims, backend: str, *,
                 schedule: str = "1f1b", virtual_stages: int = 1,
                 token_sharded_grads: Mapping[str, int] = MappingProxyType({}), experts: str | None = None) -> list[Share]:
    """What rank 0 of each pipeline stage holds of `model` (the whole model, built anywhere: the meta device is
    free) laid out as `dims` with data-parallel `backend`; `token_sharded_grads`: replicated parameters whose
    gradient arrives sharded over tokens (ModelShape's, under sequence parallel); `experts`: the module path suffix
    of the stacked routed experts (ModelShape.moe.module), which ep shards."""
    chosen = backends.get(backend)
    shard_ranks = (dims.dp_shard if chosen.replicas else dims.size("dp_shard_cp")) if chosen.sharded else 1
    # Under ep > 1 FSDP2 shards the experts' slices over edp (compose.py); DDP leaves them to the layout's all-reduce
    expert_ranks = (dims.size("edp") if chosen.sharded else 1) if dims.ep > 1 else shard_ranks
    is_expert = (lambda n: f".{experts}." in f".{n}") if experts and dims.ep > 1 else (lambda n: False)  # noqa: E731
    n_stages = dims.pp * virtual_stages
    blocks = split_layers(len(model.get_submodule(split.blocks)), n_stages) if dims.pp > 1 and split else None
    shares = []
    for pp_rank, held in enumerate(_stage_parameters(model, split, dims, schedule, virtual_stages)):
        local = {n: _shard(tp_local_shape(n, s, dims.tp), 0, dims.ep) if is_expert(n) else tp_local_shape(n, s, dims.tp)
                 for n, s in held.items()}
        numel = {n: math.prod(s) for n, s in local.items()}
        kept = {n: _kept(s, expert_ranks if is_expert(n) else shard_ranks) for n, s in local.items()}
        params = sum(kept.values())
        if chosen.shards == "optimizer" and dims.dp_size > 1:
            optimizer = 2 * _zero1_partition(_optimizer_groups(model, numel), dims.dp_size)
        else:
            optimizer = 2 * params
        mine = stage_ids(pp_rank, dims.pp, virtual_stages, schedule) if blocks else [0]
        count = sum(len(blocks[s]) for s in mine) if blocks else _count_blocks(held, split)
        parts = tuple(tuple(blocks[s]) for s in mine) if blocks else (tuple(range(count)),)
        block_prefix = f"{split.blocks}." if split else None
        # what FSDP gathers for a block: its own parameters, and its experts' unless they are held whole (edp = 1)
        gathered = {n: v for n, v in numel.items() if not is_expert(n) or expert_ranks > 1}
        in_blocks = sum(v for n, v in numel.items() if block_prefix and n.startswith(block_prefix))
        # FSDP2 keeps gradients shaped as its parameters; it wraps only over several dp × cp ranks (data_parallel.
        # wraps), and a tp-only layout's token-sharded gradients stay as they arrive (`plan --trace`: fsdp × tp 4 on 4)
        wrapped = chosen.sharded and dims.size("dp_cp") > 1
        grads = params if wrapped else params - _token_sharded_surplus(local, token_sharded_grads, dims.tp)
        if not wrapped and not (split and split.tied):
            grads += _whole_gradient_surplus(held, local)
        shares.append(Share(stage=pp_rank, params=params, grads=grads, optimizer=optimizer,
                            stage_params=sum(numel.values()), blocks=count, first=0 in mine,
                            last=n_stages - 1 in mine or dims.pp == 1,
                            block_params=_largest_block(gathered, block_prefix) if block_prefix else 0,
                            tensors=len(held), root_params=sum(numel.values()) - in_blocks,
                            expert_params=sum(v for n, v in kept.items() if is_expert(n)),
                            expert_local=sum(v for n, v in numel.items() if is_expert(n)), parts=parts,
                            block_grads=tuple(_block_total(kept, f"{block_prefix}{i}.") for part in parts for i in part)
                            if block_prefix else (),
                            head_grads=_head_grads(kept, split, first=0 in mine, last=n_stages - 1 in mine),
                            block_local=tuple(_block_total(numel, f"{block_prefix}{i}.") for part in parts for i in part)
                            if block_prefix else (),
                            head_local=_head_grads(numel, split, first=0 in mine, last=n_stages - 1 in mine),
                            unsharded_grads=sum(numel.values()) + _whole_gradient_surplus(held, local),
                            block_gathered=tuple(_block_total(gathered, f"{block_prefix}{i}.") for part in parts
                                                 for i in part) if block_prefix else (),
                            whole_vectors=sum(len(s) == 1 and local[n] == s and not is_expert(n)
                                              for n, s in held.items()) if dims.tp > 1 else 0))
    return shares


def _block_total(kept: dict[str, int], prefix: str) -> int:
    return sum(v for n, v in kept.items() if n.startswith(prefix))


def _head_grads(kept: dict[str, int], split: StageSplit | None, first: bool, last: bool) -> int:
    """Gradient elements backward makes before it reaches the blocks: the last stage's own modules' (the final norm,
    the head), and a tied embedding's when both ends are on this rank (the head's backward makes it)."""
    if split is None or not last:
        return 0
    ends = tuple(f"{m}." for m in split.last)
    tied = split.tied[1] if split.tied and first else None
    return sum(v for n, v in kept.items() if n.startswith(ends) or n == tied)


def _kept(shape: tuple[int, ...], ranks: int) -> int:
    """Elements of a tensor of `shape` FSDP2 leaves rank 0 when it chunks dim 0 over `ranks` (a scalar: whole)."""
    return chunk(shape[0], ranks) * math.prod(shape[1:]) if shape and ranks > 1 else math.prod(shape)


def _token_sharded_surplus(local: dict[str, tuple[int, ...]], dims_of: Mapping[str, int], tp: int) -> int:
    """Elements of the replicated parameters in `dims_of` (name -> token dim) whose gradient a rank does not hold:
    it arrives as 1/tp of them, sharded over tokens (a DTensor's gradient takes the placement of the stream it met)."""
    return sum(math.prod(local[name]) - math.prod(_shard(local[name], dim, tp))
               for name, dim in dims_of.items() if name in local)


def _whole_gradient_surplus(held: dict[str, tuple[int, ...]], local: dict[str, tuple[int, ...]]) -> int:
    """Elements more than their tp shard that the gradients of tensor_parallel.WHOLE_GRADIENTS hold: all of them."""
    return sum(math.prod(held[n]) - math.prod(local[n]) for n in held if n.removesuffix(".weight") in WHOLE_GRADIENTS)


def _count_blocks(held: dict, split: StageSplit | None) -> int:
    if split is None:
        return 0
    return len({n[len(split.blocks) + 1:].split(".")[0] for n in held if n.startswith(split.blocks + ".")})


def _largest_block(numel: dict[str, int], prefix: str) -> int:
    """The elements of the stage's largest block (a mixture of experts' blocks differ: dense ones and MoE ones)."""
    sizes: dict[str, int] = {}
    for n, v in numel.items():
        if n.startswith(prefix):
            block = n[len(prefix):].split(".")[0]
            sizes[block] = sizes.get(block, 0) + v
    return max(sizes.values(), default=0)
