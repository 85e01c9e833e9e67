"""Tensor parallelism (Megatron-style) on DTensor, with sequence and loss parallelism: the plan of one transformer
block (nn/transformer.Block) and the pieces each model's own plan is made of.

Each rank of a tp group holds a slice of every big matrix of a block and computes with it:

    attn.q/k/v_proj  colwise: rank r computes heads [r·heads/tp, (r+1)·heads/tp), whole heads, so attention
                     needs no communication (the attention reads its local head count from q's width)
    attn.c_proj      rowwise: each rank's heads give a partial sum of the output, reduced across the group
    mlp.c_fc         colwise, then the activation on each rank's hidden/tp features
    mlp.c_proj       rowwise, reduced like attn.c_proj

A model's parallelize.py adds its own ends (the GPT: vocab-sharded embedding and head; the ViT: replicated patch
embedding and head) and makes every other parameter a replicated DTensor (`replicate_module`), so every parameter
sits on the tp mesh and FSDP2, DCP and clip_grad_norm_ handle them uniformly. The exception: a block whose mlp takes
the whole input on every tp rank and returns a partial sum (`partial_mlp_plan`, a mixture of experts: whole tokens
to route, a slice of every expert's hidden width) is laid out by its model: the slices run on plain tensors
(`local_linear`, parallel/expert_parallel.py), the parts it replicates (a router) stay plain, the same on every tp
rank with the same gradients, which clipping takes norm by norm (parallel/clipping.py).

Between sublayers the residual stream is, without sequence parallel, a plain tensor that is the same on every tp
rank (the rowwise outputs all-reduce). With sequence parallel it is a DTensor Shard(1): each rank holds T/tp
positions and runs the LayerNorms, dropouts and residual adds on those alone; the rowwise outputs reduce-scatter
into it and attention/MLP all-gather from it, once per sublayer (PrepareModuleInput on attn and mlp, not once per
q/k/v). Same bytes on the wire as the all-reduce it replaces, 1/tp of the norm and dropout activations.

Loss parallel (a language model's head): the head leaves the logits sharded over the vocabulary, and the model's own
F.cross_entropy runs under torch's loss_parallel(): each rank takes the log-softmax of its vocab slice with small
all-reduces (max, sum of exponentials, target logit) instead of gathering [B, T, V] logits. That needs the forward
AND backward inside loss_parallel_context(True). Outside it (sampling, evaluation the loop did not wrap)
`gather_logits_outside_loss_parallel` hands out whole logits, so the model still computes the right thing, only
with the bigger all-gather; `plain_loss` hands the loss out as a plain tensor holding the whole mean on every rank.

Nothing is padded: the vocabulary (65 over tp=2 is 33 + 32) and the sequence need not divide by tp; DTensor
shards like torch.chunk and the vocab-parallel embedding and loss mask by each rank's actual range.

Gradients: under sequence parallel the LayerNorm gradients come out Partial(sum) DTensors (each rank's sequence
shard contributes a part); DTensor reduces them when the optimizer or clip_grad_norm_ reads them, so read
gradients with DTensor ops (full_tensor), never to_local().

Randomness: dropout on the replicated stream (no sequence parallel) must draw the same mask on every tp rank, so
tp ranks must share their torch seed: seed dropout by data-parallel rank, not by global rank. Likewise build the
model with real weights, the same on every rank, before applying a plan: on CPU DTensor has no RNG tracker, so
init_weights() after a meta-device build would draw different replicated weights on different ranks.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from meshtrain.parallel.expert_parallel import eager, expert_parameters
from meshtrain.parallel.mesh import MeshError

BLOCKS = "transformer.h.*"  # a decoder's blocks; parallelize_module matches each path token with fnmatch
# What the plans below shard, by module path suffix: the dim of its weight cut over tp ranks (colwise Linear 0,
# rowwise Linear 1, vocab-parallel embedding 0), and which biases are cut with it (colwise ones). plan/shares.py
# counts a rank's bytes from these without a mesh; plan --validate checks the count against real ranks.
SHARDED_DIMS = {"attn.q_proj": 0, "attn.k_proj": 0, "attn.v_proj": 0, "mlp.c_fc": 0, "mlp.c_gate": 0, "lm_head": 0,
                "attn.c_proj": 1, "mlp.c_proj": 1, "transformer.wte": 0}
# A mixture of experts' feed-forwards, which its layout cuts over tp by their hidden width (models/moe/parallelize.py
# reads its dims here): the shared experts' linears by module path suffix, the routed experts' stacked weights
# ([E, hidden, dim], [E, dim, hidden]) by parameter path suffix.
PARTIAL_SUM_DIMS = {"mlp.shared.c_gate": 0, "mlp.shared.c_fc": 0, "mlp.shared.c_proj": 1,
                    "mlp.experts.c_gate": 1, "mlp.experts.c_fc": 1, "mlp.experts.c_proj": 2}
SHARDED_DIMS |= PARTIAL_SUM_DIMS
SHARDED_BIASES = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.c_fc", "mlp.c_gate", "lm_head")
# Sharded weights whose gradient comes back whole: DTensor's embedding backward hands the vocab-parallel embedding's
# gradient back Replicate, all [V, C] of it on every tp rank (measured on the Llama's and the MoE's untied wte under
# ddp × tp2), and it stays so unless FSDP2 reduces it into its shard. Tied to lm_head (the GPT), the sum with the
# head's Shard(0) gradient is a shard. plan/shares.py counts it.
WHOLE_GRADIENTS = ("transformer.wte",)


def check_tp_mesh(tp_mesh: DeviceMesh, who: str) -> None:
    if tp_mesh.ndim != 1:
        raise MeshError(f"{who} needs a 1-D tp mesh, got dims {tp_mesh.mesh_dim_names}: pass submesh(mesh, 'tp')")


def replicate_block_norms(blocks, tp_mesh: DeviceMesh) -> None:
    """Without sequence parallel the blocks' norms see the whole stream: their parameters become Replicate DTensors."""
    for block in blocks:
        for norm in (block.ln_1, block.ln_2):
            replicate_module(norm, tp_mesh, output=None)


# Where a wrapper keeps the module it wraps: activation checkpointing, torch.compile, DDP.
_WRAPPED = ("_checkpoint_wrapped_module", "_orig_mod", "module")


def refuse_prepared(model: nn.Module, blocks: nn.ModuleDict, who: str) -> None:
    """Tensor parallelism goes first, on the plain model. parallelize_module only warns about a path that matches
    nothing, and a block hidden in a wrapper would silently compute tp times its share."""
    wrapped = [(name, block) for name, block in blocks.named_children() if any(hasattr(block, i) for i in _WRAPPED)]
    if wrapped:
        name, block = wrapped[0]
        raise MeshError(f"{who}: block {name} is a {type(block).__name__}, a wrapper around the block: apply tensor parallel "
                        f"before activation checkpointing and compile")
    experts = {id(p) for p in expert_parameters(model)}  # sharded over ep first, on the plain model: not over tp
    if any(isinstance(p, DTensor) and id(p) not in experts for p in model.parameters()):
        raise MeshError(f"{who}: the model already holds DTensor parameters; apply tensor parallel once, to a plain "
                        f"model, before activation checkpointing, compile and fully_shard")


def stream_layout(sequence_parallel: bool) -> tuple:
    """The residual stream between sublayers: sequence (token) shards as a DTensor, or the whole of it, plain and
    the same on every tp rank. Returns (placement, use_local_output) for the styles that write it."""
    return (Shard(1), False) if sequence_parallel else (Replicate(), True)


def block_plan(blocks: str, sequence_parallel: bool) -> dict:
    """The Megatron plan of a pre-LN transformer block with meshtrain's names (attn.q/k/v_proj, attn.c_proj,
    mlp.c_fc, mlp.c_proj, ln_1, ln_2), for every block matched by the pattern `blocks` (GPT's and ViT's)."""
    stream, local = stream_layout(sequence_parallel)
    plan = {
        f"{blocks}.attn.q_proj": ColwiseParallel(),
        f"{blocks}.attn.k_proj": ColwiseParallel(),
        f"{blocks}.attn.v_proj": ColwiseParallel(),
        f"{blocks}.attn.c_proj": RowwiseParallel(output_layouts=stream, use_local_output=local),
        f"{blocks}.mlp.c_fc": ColwiseParallel(),
        f"{blocks}.mlp.c_proj": RowwiseParallel(output_layouts=stream, use_local_output=local),
    }
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan |= {
            f"{blocks}.ln_1": SequenceParallel(),
            f"{blocks}.ln_2": SequenceParallel(),
            f"{blocks}.attn": gather,  # one all-gather feeds q, k and v
            f"{blocks}.mlp": gather,
        }
    return plan


def partial_mlp_plan(block: str, sequence_parallel: bool) -> dict:
    """The plan of a block whose `mlp` computes on every tp rank, from the whole input, a partial sum of its output (a
    mixture of experts: its routing must see whole tokens, each rank holds a slice of every expert's hidden width):
    attention and norms as block_plan's, the mlp's own parameters laid out by its model (PartialSum)."""
    plan = {path: style for path, style in block_plan(block, sequence_parallel).items()
            if not path.startswith(f"{block}.mlp")}
    return plan | {f"{block}.mlp": PartialSum(sequence_parallel)}


class PartialSum(ParallelStyle):
    """A module that takes the whole input on every tp rank and returns this rank's part of its output, the parts
    summing to the output (and, in backward, the input's gradient a part of the whole likewise).

    In: under sequence parallel the stream's shards all-gathered (whose backward reduce-scatters the gradient's
    parts); else the whole stream, whose gradient's parts are all-reduced. Out: the parts reduce-scattered into the
    stream's shards under sequence parallel (Megatron's combine), else all-reduced; the output's gradient is whole on
    every rank. Every path inside must then give the input a part of its gradient (a replicated path, the same on
    every rank, scales its gradient by 1/tp: tensor_parallel's users do that, e.g. models/moe/parallelize.py)."""

    def __init__(self, sequence_parallel: bool):
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(lambda _mod, args: (whole_input(args[0], device_mesh), *args[1:]))
        module.register_forward_hook(lambda _mod, _args, out: summed_output(out, device_mesh, self.sequence_parallel))
        return module


def whole_input(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The whole of the stream `x` (a plain whole tensor or a DTensor of sequence shards) as a plain tensor whose
    gradient, a part on each rank, is summed over `mesh` in backward."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return x.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])


def summed_output(part: torch.Tensor, mesh: DeviceMesh, sequence_parallel: bool) -> torch.Tensor:
    """Each rank's `part` summed over `mesh`: sequence shards (a DTensor) under sequence parallel, else a plain whole."""
    summed = DTensor.from_local(part, mesh, [Partial()], run_check=False).redistribute(
        placements=[stream_layout(sequence_parallel)[0]])
    return summed if sequence_parallel else summed.to_local()


def sum_gradient(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """`t` (plain, the same on every rank of `mesh`) unchanged; in backward its gradient's parts summed over `mesh`
    (Megatron's copy-to-tensor-parallel-region)."""
    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def local_linear(linear: nn.Linear, mesh: DeviceMesh, dim: int) -> None:
    """`linear`'s weight cut over `mesh` (dim 0: its output features, colwise; 1: its input features, rowwise), and
    its forward run on plain tensors with this rank's slice: no communication, inside a PartialSum module (a
    colwise output is this rank's features, a rowwise one a part of the sum)."""
    if linear.bias is not None:  # a rowwise bias would be added once per rank; colwise ones are not needed yet
        raise MeshError(f"local_linear: {linear} has a bias; only bias-free linears are cut this way")
    weight = distribute_tensor(linear.weight.detach(), mesh, [Shard(dim)], src_data_rank=None)
    linear.register_parameter("weight", nn.Parameter(weight, requires_grad=linear.weight.requires_grad))
    linear.forward = eager(partial(_local_linear, linear))


# eager: dynamo cannot trace a sharded weight's local view (parallel/expert_parallel.py)
def _local_linear(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, linear.weight.to_local())


def replicate_module(module: nn.Module, mesh: DeviceMesh, *, output: Shard | None) -> None:
    """Parameters become Replicate DTensors (rank 0's values); inputs are taken as the whole, the same everywhere.

    The output is redistributed to `output`, or returned as a plain tensor when None.
    """
    def partition(_name: str, mod: nn.Module, _mesh: DeviceMesh) -> None:
        for name, param in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [Replicate()]),
                                                      requires_grad=param.requires_grad))

    def to_dtensor(_mod: nn.Module, inputs: tuple, _mesh: DeviceMesh) -> tuple:
        x, *rest = inputs
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        return (x, *rest)

    def from_dtensor(_mod: nn.Module, out: DTensor, _mesh: DeviceMesh) -> torch.Tensor:
        return out.to_local() if output is None else out.redistribute(placements=[output])

    distribute_module(module, mesh, partition, to_dtensor, from_dtensor)


# Depth of loss_parallel_context(True) nesting: lm_head keeps its logits vocab-sharded only inside it.
_loss_parallel_depth = 0


@contextmanager
def loss_parallel_context(enabled: bool) -> Iterator[None]:
    """Wrap the forward AND the backward of a training micro-step: vocab-parallel cross-entropy when enabled."""
    global _loss_parallel_depth
    if not enabled or _loss_parallel_depth:  # torch's loss_parallel() does not nest: enter it once
        _loss_parallel_depth += bool(enabled)
        try:
            yield
        finally:
            _loss_parallel_depth -= bool(enabled)
        return
    with loss_parallel():
        _loss_parallel_depth = 1
        try:
            yield
        finally:
            _loss_parallel_depth = 0


def gather_logits_outside_loss_parallel(_module: nn.Module, _inputs: tuple, logits: torch.Tensor) -> torch.Tensor:
    # Without loss_parallel()'s cross-entropy, vocab-sharded logits would meet plain targets (or sampling code):
    # hand out the whole logits instead.
    if isinstance(logits, DTensor) and not _loss_parallel_depth:
        return logits.full_tensor()
    return logits


def plain_loss(_module: nn.Module, _inputs: tuple, outputs):
    # loss_parallel's cross-entropy returns a Replicate DTensor: every rank holds the whole mean. A plain tensor
    # lets the loop divide, accumulate and log it like any other loss; the gradient still flows through.
    if not isinstance(outputs, tuple):  # a pipeline stage's hidden states or logits: no loss
        return outputs
    logits, loss = outputs
    if isinstance(loss, DTensor):
        return logits, loss.full_tensor()
    return outputs


def _blocks_plan(blocks: nn.ModuleDict, sequence_parallel: bool, extras: dict, partial_mlps: set[str]) -> dict:
    """Every block's plan: one pattern for all of them, or block by block when some have a PartialSum mlp."""
    if not partial_mlps:
        return block_plan(BLOCKS, sequence_parallel) | {f"{BLOCKS}.{path}": style for path, style in extras.items()}
    plan = {}
    for name in blocks:
        block = f"{BLOCKS[:-1]}{name}"
        plan |= (partial_mlp_plan(block, sequence_parallel) if name in partial_mlps else
                 block_plan(block, sequence_parallel) | {f"{block}.{path}": style for path, style in extras.items()})
    return plan


def apply_decoder_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh | None, *, sequence_parallel: bool = True,
                                  loss_parallel: bool = True, block_extras: dict | None = None,
                                  partial_mlps: Collection[str] = ()) -> None:
    """Shard a language model with meshtrain's decoder names (`transformer.wte`, optional `transformer.wpe`,
    `transformer.drop`, blocks `transformer.h.N`, `transformer.ln_f`, `lm_head`) in place over the 1-D `tp_mesh` (a
    no-op when it is None or one rank). The plan is block_plan's for every block (plus `block_extras`, sub-paths of
    a block -> style, for a model's own block parts), except the blocks named in `partial_mlps`, whose mlp computes
    a partial sum on every tp rank from the whole input (partial_mlp_plan; the caller cuts its parameters), and:

    wte      rowwise over the vocabulary: a rank embeds the ids in its vocab range, zeros elsewhere, summed
    lm_head  colwise over the vocabulary; tied to wte (the GPT), it is the same Shard(0) of the same [V, C] matrix,
             so the tie stays one parameter; with loss_parallel the logits stay vocab-sharded for the loss
    wpe, norms: replicated DTensors


    Every rank of the tp group must call it (it broadcasts rank 0's values) with the same model. Apply it
    before fully_shard when composing with FSDP2, the FSDP mesh being another dim of the same DeviceMesh.
    `model` may also be a pipeline stage (parallel.pipeline.Stage): the same names, some of them absent.
    A stage passes plain tensors to the next, so pipelines use neither sequence nor loss parallelism.
    """
    if tp_mesh is None or tp_mesh.size() == 1:
        return
    check_tp_mesh(tp_mesh, "apply_tensor_parallel")
    refuse_prepared(model, model.transformer.h, "apply_tensor_parallel")

    t = model.transformer
    tied = "wte" in t and hasattr(model, "lm_head") and model.lm_head.weight is t.wte.weight
    stream, local = stream_layout(sequence_parallel)
    plan = _blocks_plan(t.h, sequence_parallel, block_extras or {}, set(partial_mlps)) | {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream, use_local_output=local),
        "lm_head": ColwiseParallel(input_layouts=stream,
                                   output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                   use_local_output=not loss_parallel),
    }
    if sequence_parallel:
        plan |= {"transformer.drop": SequenceParallel(), "transformer.ln_f": SequenceParallel()}
    # A pipeline stage lacks some of the model's top-level modules; blocks it has (at least one).
    plan = {path: style for path, style in plan.items()
            if path.startswith(BLOCKS) or path in dict(model.named_modules())}
    parallelize_module(model, tp_mesh, plan)

    # wpe's output [T, C] is added to wte's [B, T, C]: sliced to this rank's positions (Shard(0)) under sequence
    # parallel, where the gradient's all-gather back to Replicate sums nothing; plain and whole otherwise.
    if "wpe" in t:
        replicate_module(t.wpe, tp_mesh, output=Shard(0) if sequence_parallel else None)
    if not sequence_parallel:  # the norms see the whole stream; their parameters become Replicate DTensors too
        replicate_block_norms(t.h.values(), tp_mesh)
        if "ln_f" in t:
            replicate_module(t.ln_f, tp_mesh, output=None)

    # Each style registered its own new parameter: tie lm_head back to wte (both Shard(0) of one [V, C] matrix).
    if tied:
        model.lm_head.weight = t.wte.weight
    if loss_parallel:
        model.lm_head.register_forward_hook(gather_logits_outside_loss_parallel)
    model.register_forward_hook(plain_loss)
