"""`parallelize`: lay out a model of one's own on the mesh, for a training loop of one's own.

    dims = ParallelDims(world_size=info.world_size, tp=2)           # dp_shard fills the rest
    mesh = dims.build_mesh(info.torch_device.type)                  # None on one process is fine too
    model = parallelize(model.to(info.torch_device), dims, mesh, blocks="transformer.h",
                        tp_plan={"transformer.h.*.mlp.c_fc": ColwiseParallel(), ...}, backend="fsdp")
    optimizer = torch.optim.AdamW(model.parameters())               # after parallelize: FSDP made new parameters

It takes the steps the trainer's layouts take, through the same functions (compose.py), in the one order in which
each sees what the one before left: tensor parallel on the plain model, then context parallel, then activation
checkpointing, then data parallelism last (DDP over the data-parallel ranks, or FSDP2 per block and then the whole),
so FSDP shards whatever tensor parallelism left, DTensors on the tp dim of the same mesh included.

The tensor-parallel plan is torch's: module paths from the model's root (each dot-separated part may be an fnmatch
pattern, `transformer.h.*.attn.c_proj`) to ParallelStyles (ColwiseParallel, RowwiseParallel, SequenceParallel,
PrepareModuleInput). Blocks built from meshtrain's nn.transformer.Block need none: their plan is the one the GPT,
Llama and ViT use. Every parameter the plan leaves becomes a replicated DTensor on the tp dim (its module takes
plain inputs and hands back plain outputs, the same on every tp rank), so that FSDP2, DCP and clip_grad_norm_ see
one kind of parameter; a parameter tied to another (an embedding and its head) stays one.

Pipeline parallelism cuts a model into stages by its structure, which a module of unknown shape does not give:
it is the trainer's (a ModelSpec's StageSplit), not this function's.
"""

from __future__ import annotations

from fnmatch import fnmatch

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from meshtrain.nn.transformer import Attention
from meshtrain.parallel import backends
from meshtrain.parallel.compose import Recipe, apply_model_parallelism, wrap_data_parallel
from meshtrain.parallel.mesh import MeshError, ParallelDims
from meshtrain.parallel.tensor_parallel import block_plan, refuse_prepared, replicate_module


def parallelize(model: nn.Module, dims: ParallelDims, mesh, *, blocks: str, tp_plan: dict | None = None,
                backend: str = "fsdp", activation_checkpointing: str = "none", ac_every: int = 2,
                cp_impl: str = "ring", param_dtype: torch.dtype | None = None, cpu_offload: bool = False) -> nn.Module:
    """`model` (on this rank's device, built the same on every rank) laid out as `dims` on `mesh` (from
    `dims.build_mesh`, or None on one process). Returns the module to call: `model` itself, sharded in place, or
    a DistributedDataParallel around it. Every rank calls it.

    blocks: the path of the container (ModuleList or ModuleDict) of the model's repeated blocks, which activation
        checkpointing wraps and FSDP shards one at a time.
    tp_plan: module path -> ParallelStyle, applied when dims.tp > 1; None for blocks of meshtrain's own.
    backend: ddp | zero1 (DDP; pair it with torch's ZeroRedundancyOptimizer) | zero2 | fsdp | hsdp.
    activation_checkpointing: none | full (every block) | selective (every `ac_every`-th block).
    cp_impl: ring | ulysses, when dims.cp > 1 (meshtrain's attention only). Feed each cp rank its share of the
        sequence: `meshtrain.shard_sequence(x, y, cp_rank, dims.cp, cp_impl)`.
    param_dtype: FSDP2's compute dtype (gradients are reduced in fp32); cpu_offload: FSDP2's parameters on the CPU.
    """
    wrappers = [name for name in backends.names() if not backends.get(name).engine]
    if backend not in wrappers:
        raise MeshError(f"parallelize backend={backend!r}: choose one of {', '.join(wrappers)}")
    container = _blocks(model, blocks)
    if tp_plan is not None:
        _check_plan(model, tp_plan)
    if (dims.world_size > 1) != (mesh is not None):
        raise MeshError(f"parallelize got a {'mesh' if mesh is not None else 'None mesh'} for dims of "
                        f"{dims.world_size} rank(s): pass dims.build_mesh(device_type) when there is more than one "
                        "rank, and None on one")
    if dims.pp > 1:
        raise MeshError("parallelize has no pipeline parallelism (pp > 1): a pipeline cuts a model by its structure, "
                        "which meshtrain knows only for a registered model (meshtrain train, ModelSpec.split)")
    if dims.cp > 1:
        _check_attention(container, blocks)
    recipe = Recipe(backend=backend, activation_checkpointing=activation_checkpointing, ac_every=ac_every,
                    cp_impl=cp_impl, param_dtype=param_dtype, cpu_offload=cpu_offload)
    apply_model_parallelism([model], blocks, recipe, dims, mesh, tensor_parallel=lambda part, tp_mesh:
                            _tensor_parallel(part, container, blocks, tp_plan, tp_mesh))
    if mesh is None:
        return model
    (wrapped,) = wrap_data_parallel([model], blocks, recipe, dims, mesh, next(model.parameters()).device)
    return wrapped


def _blocks(model: nn.Module, path: str) -> nn.Module:
    try:
        container = model.get_submodule(path)
    except AttributeError:
        raise MeshError(f"parallelize blocks={path!r}: {type(model).__name__} has no such submodule; pass the path "
                        "of the ModuleList or ModuleDict that holds its repeated blocks (e.g. 'transformer.h')") from None
    if not isinstance(container, (nn.ModuleList, nn.ModuleDict)):
        raise MeshError(f"parallelize blocks={path!r} is a {type(container).__name__}: it must be the ModuleList or "
                        "ModuleDict of the repeated blocks")
    return container


def _check_plan(model: nn.Module, plan: dict) -> None:
    """torch's parallelize_module only warns about a path that matches nothing, and the model would then silently
    run a layer whole on every rank."""
    names = [name.split(".") for name, _ in model.named_modules() if name]
    for path in plan:
        parts = path.split(".")
        if not any(len(name) == len(parts) and all(map(fnmatch, name, parts)) for name in names):
            raise MeshError(f"tp_plan path {path!r} matches no module of {type(model).__name__}: paths run from the "
                            "model's root, with * for any one part (e.g. 'transformer.h.*.mlp.c_fc')")


def _tensor_parallel(model: nn.Module, container: nn.Module, blocks: str, plan: dict | None, tp_mesh) -> None:
    refuse_prepared(model, container, "parallelize")
    if plan is None:
        if not all(_is_meshtrain_block(block) for block in container.children()):
            raise MeshError(f"parallelize: the blocks under {blocks!r} are not meshtrain's nn.transformer.Block, "
                            "so there is no plan to shard them by: pass tp_plan (module path -> ParallelStyle)")
        plan = block_plan(f"{blocks}.*", sequence_parallel=False)
    parallelize_module(model, tp_mesh, plan)
    _replicate_the_rest(model, tp_mesh)


def _replicate_the_rest(model: nn.Module, tp_mesh) -> None:
    """Every plain parameter becomes a Replicate DTensor, its module fed and read as plain tensors (replicate_module);
    a parameter two modules share is replaced in each, then tied back to one."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}  # by the old parameter: every (module, name) holding it
    for name, module in model.named_modules():
        plain = [n for n, p in module.named_parameters(recurse=False) if not isinstance(p, DTensor)]
        if not plain:
            continue
        if any(True for _ in module.children()):
            raise MeshError(f"parallelize: {name or 'the model'} ({type(module).__name__}) holds parameters of its own "
                            f"({', '.join(plain)}) and submodules; the tp_plan must give it a style")
        for param_name in plain:
            holders.setdefault(id(getattr(module, param_name)), []).append((module, param_name))
        replicate_module(module, tp_mesh, output=None)
    for (first, first_name), *others in holders.values():
        for module, param_name in others:
            module.register_parameter(param_name, getattr(first, first_name))


def _is_meshtrain_block(block: nn.Module) -> bool:
    return isinstance(getattr(block, "attn", None), Attention)


def _check_attention(container: nn.Module, blocks: str) -> None:
    if not all(_is_meshtrain_block(block) for block in container.children()):
        raise MeshError(f"parallelize: context parallelism replaces the attention kernel of meshtrain's "
                        f"nn.transformer.Attention, and the blocks under {blocks!r} have another attention: "
                        "build the blocks from nn.transformer.Block, or set cp=1")
