"""The one order in which every layout is applied (the GPT's and the Llama's through lm_layout.py, the ViT's, and the
public `parallelize`): each step must see what the one before left.

    tensor (+ sequence) parallel on the plain model   the model's own plan (a ModelSpec supplies it)
    -> context-parallel attention                     every block's attention kernel over the cp ranks
    -> activation checkpointing                       wraps the blocks tp and cp already changed
    -> float8 linears                                 torchao's, in the blocks (train.float8)
    -> compile each block                             train.compile=blocks (true): every block on its own, in
                                                      place (its names unchanged), around what tp, cp, AC and
                                                      float8 made of it (under tp, inside AC: compile_blocks);
                                                      FSDP2's hooks then run outside its graph; on a GPU
                                                      a decoder's output layer and loss too (compile_loss)
    -> data parallelism, last of all                  DDP over dp×cp, or FSDP2 per block then the part over
                                                      dp_shard×cp: FSDP shards whatever the others left (tp's
                                                      DTensors included); experts sharded over ep
                                                      (expert_parallel.py) are reduced over their edp group instead
                                                      (FSDP2 shards them over it); train.compile=model compiles the
                                                      whole part instead, around DDP's module or FSDP's (no pipeline)

A model supplies only its tensor-parallel plan (`tensor_parallel(part, tp_mesh)`) and, for a pipeline, the parts its
stage split made; the model's layout adds what its forward needs (sequence shards, token bands, a tied embedding).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from meshtrain.parallel import backends, float8
from meshtrain.parallel.checkpointing import apply_activation_checkpointing
from meshtrain.parallel.context_parallel import apply_context_parallel
from meshtrain.parallel.data_parallel import apply_data_parallel, wraps
from meshtrain.parallel.expert_parallel import expert_parallel_modules
from meshtrain.parallel.mesh import ParallelDims, submesh
from meshtrain.runtime.log import get_logger

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig

log = get_logger("parallel")


@dataclass(frozen=True)
class Recipe:
    """What the composition takes from a run's train and parallel sections (the same names), so that the trainer's
    layouts and the public `parallelize` apply it alike."""

    backend: str = "fsdp"
    activation_checkpointing: str = "none"
    ac_every: int = 2
    cp_impl: str = "ring"
    float8: str = "off"
    compile: str = "off"  # off | blocks | model (config.Compile)
    cuda_graphs: bool | None = None
    param_dtype: torch.dtype | None = None  # FSDP2's compute dtype (gradients reduce in fp32)
    cpu_offload: bool = False

    @classmethod
    def of(cls, cfg: RunConfig) -> Recipe:
        t, p = cfg.train, cfg.parallel
        return cls(backend=t.backend, activation_checkpointing=t.activation_checkpointing, ac_every=t.ac_every,
                   cp_impl=p.cp_impl, float8=t.float8, compile=t.compile, cuda_graphs=t.cuda_graphs,
                   param_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.dtype),
                   cpu_offload=p.cpu_offload)


def apply_model_parallelism(parts: list[nn.Module], blocks: str, recipe: Recipe, dims: ParallelDims, mesh, *,
                            tensor_parallel: Callable[[nn.Module, object], None],
                            num_heads: int | None = None) -> None:
    """Tensor parallel, context-parallel attention and activation checkpointing on each part (the whole model, or
    this rank's pipeline stages), in place. `blocks`: the path of the repeated blocks (a ModuleList or ModuleDict)
    from each part's root; `num_heads` lets Ulysses check the heads once instead of per call."""
    if dims.tp > 1:
        for part in parts:
            tensor_parallel(part, submesh(mesh, "tp"))
    if dims.cp > 1:
        for part in parts:
            apply_context_parallel(part.get_submodule(blocks).children(), submesh(mesh, "cp"), recipe.cp_impl,
                                   num_heads)
    for part in parts:
        apply_activation_checkpointing(part.get_submodule(blocks), recipe.activation_checkpointing, recipe.ac_every)


def wrap_data_parallel(parts: list[nn.Module], blocks: str, recipe: Recipe, dims: ParallelDims, mesh,
                       device: torch.device) -> list[nn.Module]:
    """float8 linears in each part's blocks, then compile (each block, or the whole part) and data parallelism over
    each part, last of all. Context-parallel ranks hold the same weights and see the same batch, each a slice of its
    tokens, so to data parallelism they are replicas whose gradients are averaged: a slice's loss is the mean over its
    tokens and the slices are equal-sized, so their mean is the whole's."""
    sharded = backends.get(recipe.backend).sharded
    dp_mesh = data_parallel_mesh(mesh, dims, recipe.backend)
    graphs = use_cuda_graphs(recipe, dims, device, sum(q.numel() for part in parts for q in part.parameters()))
    compile_options = {"mode": "reduce-overhead"} if graphs else {}  # CUDA graphs through compile
    gathered = sharded and wraps(recipe.backend, dims.size("dp_cp"))  # FSDP2 shards the blocks: float8 gathers pay
    wrapped, loss_compiled = [], False
    for part in parts:
        part_blocks = list(part.get_submodule(blocks).children())
        if swapped := float8.convert_blocks(part_blocks, recipe.float8, fsdp=gathered):
            log.info("float8 (%s): %d linears of the blocks%s", recipe.float8, swapped,
                     ", their weights gathered in float8 by FSDP2" if gathered and recipe.float8 == "tensorwise"
                     else "")
        if recipe.compile == "blocks":
            compile_blocks(part_blocks, inside_checkpoint=dims.tp > 1, options=compile_options)
            loss_compiled = compile_loss(part, dims, device) or loss_compiled
        whole = recipe.compile == "model" and not sharded  # DDP: compile around its module; FSDP2: below
        wrapped.append(apply_data_parallel(
            torch.compile(part, **compile_options) if whole else part, recipe.backend,
            device, dims.size("dp_cp"), blocks=part_blocks, mesh=dp_mesh,
            param_dtype=recipe.param_dtype if sharded else None, cpu_offload=recipe.cpu_offload,
            experts=expert_parallel_modules(part), experts_mesh=submesh(mesh, "edp") if mesh is not None else None))
    if sharded and recipe.compile == "model":  # FSDP first, then compile the sharded model
        wrapped = [torch.compile(w, **compile_options) for w in wrapped]
    if recipe.compile != "off":
        log.info("torch.compile: %s", "the whole model" if recipe.compile == "model" else
                 "each block on its own" + (", and the output layer and loss" if loss_compiled else ""))
    return wrapped


def compile_blocks(blocks: list[nn.Module], *, inside_checkpoint: bool, options: dict) -> None:
    """torch.compile each block in place (the same module, names and FSDP2 unit), around its activation checkpoint
    (torchtitan's order), or under tensor parallel inside it: torch 2.13's AOT autograd fails to save the DeviceMesh a
    checkpointed region of DTensors holds ("expected all tensors_saved_with_vc_check to be Tensors")."""
    for block in blocks:
        (getattr(block, "_checkpoint_wrapped_module", block) if inside_checkpoint else block).compile(**options)


def compile_loss(part: nn.Module, dims: ParallelDims, device: torch.device) -> bool:
    """Under train.compile=blocks, a decoder's output layer and loss compiled beside the blocks (as torchtitan compiles
    its loss): the whole logits' as one graph, or each chunk's softmax and gradient (train.loss_chunks) as one. The
    model's `compile_loss`, which its forward reads. On a GPU only (on CPU, torch 2.13's inductor miscompiles some
    reductions' tails, pytorch/pytorch#196681, and a softmax over an arbitrary vocabulary is one), with the
    vocabulary whole (tp 1: a sharded head's loss all-reduces inside its softmax) and no pipeline (its schedule
    computes the last stage's loss). GPT-2 on an H200: 1.53× with the whole loss; chunks of 1,024 in graphs 1.44×
    faster than auto's old eager 320 (docs/gpu.md, rounds 6 and 7)."""
    if not hasattr(part, "compile_loss"):  # not a decoder: the ViT
        return False
    part.compile_loss = device.type == "cuda" and dims.tp == 1 and dims.pp == 1
    return part.compile_loss


# train.cuda_graphs=null (auto) captures models under this many parameters: their kernels are short, so a step waits on
# the CPU's launches. Measured on one H100 (bf16 + compile, docs/gpu.md): the 10.7M baby GPT ran 1.23× faster with CUDA
# graphs; GPT-2 124M's kernels already keep the GPU busy.
CUDA_GRAPHS_AUTO_MAX_PARAMS = 50_000_000


def use_cuda_graphs(t, dims: ParallelDims, device: torch.device, params: int) -> bool:
    """train.cuda_graphs, with null (auto) resolved: on for a whole compiled model of under CUDA_GRAPHS_AUTO_MAX_PARAMS
    parameters trained by one CUDA rank in float32/bf16/fp16 linears (several ranks' collectives, and torchao's float8
    casts, are left out of capture)."""
    if t.cuda_graphs is not None or device.type != "cuda" or t.compile != "model":
        return bool(t.cuda_graphs)
    chosen = dims.world_size == 1 and t.float8 == "off" and params < CUDA_GRAPHS_AUTO_MAX_PARAMS
    log.info("CUDA graphs: %s (train.cuda_graphs=null: %.1fM parameters on %d rank(s), float8 %s; on for one rank, "
             "no float8, under %dM)", "on" if chosen else "off", params / 1e6, dims.world_size, t.float8,
             CUDA_GRAPHS_AUTO_MAX_PARAMS // 10**6)
    return chosen


def data_parallel_mesh(mesh, dims: ParallelDims, backend: str):
    """What data parallelism spans: dp and cp together (cp ranks are replicas that see other tokens)."""
    if mesh is None:
        return None
    chosen = backends.get(backend)
    if chosen.replicas:  # replicate x shard, a 2-D mesh (such a backend does not compose with cp)
        return mesh[("dp_replicate", "dp_shard")]
    return submesh(mesh, "dp_shard_cp" if chosen.sharded else "dp_cp")
