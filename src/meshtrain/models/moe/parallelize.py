"""How the mixture-of-experts decoder is laid out: every language model's layout (parallel/lm_layout.py) with the
Llama's structure, under data parallelism (ddp, zero1, zero2, fsdp, zero3, hsdp), tensor, context and pipeline
parallelism, and expert parallelism (parallel.ep) composed with any of them. What the MoE layers add to the decoder's:

    ep   each MoE layer's routed experts (the stacked [E, ...] weights) sharded over the ep ranks, their forward
         dispatching the rows to the experts' owners and back (parallel/expert_parallel.py); first, on the plain model
         (as tensor parallelism is applied), so that everything after wraps what the experts became
    tp   attention, norms, the dense layers and the ends as the Llama's plan. An MoE layer takes the whole tokens
         on every tp rank (gathered under sequence parallel) and returns a partial sum (tensor_parallel.PartialSum,
         reduce-scattered back into the sequence shards, or all-reduced): its router runs whole, the same routing on
         every tp rank; every routed expert is cut over tp (expert tensor parallelism, Megatron-Core's ETP = tp):
         gate and up projections by their hidden rows, the down projection by its hidden columns
         (EXPERT_HIDDEN_DIMS), so a rank holds 1/tp of each of its experts (on the (ep, tp) mesh under ep, on tp's
         without) and computes its part of each row; the shared experts are cut likewise (local_linear). Gradients:
         the input's parts are summed over tp by PartialSum's backward; the router, whose gates multiply partial
         outputs, gets its gates' gradient summed over tp (sum_gradient), so it is whole and the same on every tp
         rank, and passes 1/tp of the input's gradient it gives on each rank
    cp   each cp rank routes its own positions; the balance loss sums its statistics over the cp ranks (with a
         gradient), so it is the whole sequence's, as one process computes it
    pp   each stage's MoE layers are its own, sharded over the ep ranks of that stage; torch's shape inference is
         kept out of the routers' tallies (its forward routes garbage) and off the ep ranks' all-to-alls (its rows
         stay on their rank: expert_parallel.keep_to_this_rank)

Under pp (no decoder forward runs whole in a stage) and tp (whose loss-parallel loss is a DTensor, which a plain
balance loss added to it cannot take a gradient from), each MoE layer's balance loss reaches the gradient through the
layer's output instead (parallel/auxiliary_loss.py), weighted as the loss of the same forward is.

Rules (ParallelDims.from_config, models/moe/config.py): ep divides dp_shard and the experts; tp divides the experts'
hidden width; a capacity factor is refused under cp (it limits each expert per forward by token order, which cp
shards cannot see whole).
"""

from __future__ import annotations

from functools import partial

import torch
from torch.distributed.nn.functional import all_reduce
from torch.distributed.tensor.parallel import ColwiseParallel

from meshtrain.models.llama import SPLIT
from meshtrain.models.moe.model import MoE, Tally
from meshtrain.parallel.auxiliary_loss import attach_loss
from meshtrain.parallel.expert_parallel import (
    EXPERT_PARALLEL,
    apply_expert_parallel,
    apply_expert_tensor_parallel,
    keep_to_this_rank,
    scale_grad,
)
from meshtrain.parallel.lm_layout import build_language_model_layout
from meshtrain.parallel.mesh import expert_mesh, submesh
from meshtrain.parallel.tensor_parallel import (
    PARTIAL_SUM_DIMS,
    apply_decoder_tensor_parallel,
    local_linear,
    sum_gradient,
)

# The hidden dim of each stacked expert weight (experts.py: c_gate, c_fc [E, hidden, dim]; c_proj [E, dim, hidden])
# and of the shared experts' linears (weights [hidden, dim], [dim, hidden]): what tp cuts, from the table plan/shares.py
# counts by.
EXPERT_HIDDEN_DIMS = {name: PARTIAL_SUM_DIMS[f"mlp.experts.{name}"] for name in ("c_gate", "c_fc", "c_proj")}
SHARED_HIDDEN_DIMS = {name: PARTIAL_SUM_DIMS[f"mlp.shared.{name}"] for name in ("c_gate", "c_fc", "c_proj")}


def apply_tensor_parallel(part, tp_mesh, *, sequence_parallel: bool, loss_parallel: bool) -> None:
    """The Llama's plan (the SwiGLU's gate column-parallel like its up projection); each MoE layer a partial sum over
    tp (module docstring): its experts' hidden widths cut, its router whole."""
    layers = {name: block.mlp for name, block in part.transformer.h.items() if isinstance(block.mlp, MoE)}
    apply_decoder_tensor_parallel(part, tp_mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                                  block_extras={"mlp.c_gate": ColwiseParallel()}, partial_mlps=list(layers))
    if tp_mesh is None or tp_mesh.size() == 1:
        return
    for moe in layers.values():
        if not hasattr(moe.experts, EXPERT_PARALLEL):  # under ep they were cut over (ep, tp) already
            apply_expert_tensor_parallel(moe.experts, tp_mesh, EXPERT_HIDDEN_DIMS)
        if moe.shared is not None:
            for name, dim in SHARED_HIDDEN_DIMS.items():
                local_linear(getattr(moe.shared, name), tp_mesh, dim)
        # The router runs whole on every tp rank: the gates' gradient, which the experts' partial outputs give in
        # parts, summed over tp (so every rank's router takes the same, whole gradient), and the input's gradient it
        # gives then taken 1/tp on each rank, a part of the sum the layer's input reduces (tensor_parallel.PartialSum).
        moe.router.register_forward_pre_hook(partial(_part_of_input_gradient, 1.0 / tp_mesh.size()))
        moe.router.register_forward_hook(partial(_gates_gradient_summed, tp_mesh))


def _part_of_input_gradient(share: float, _router, args: tuple) -> tuple:
    return (scale_grad(args[0], share), *args[1:])


def _gates_gradient_summed(tp_mesh, _router, _args, routing):
    return routing._replace(gates=sum_gradient(routing.gates, tp_mesh))


def build_moe_layout(model, cfg, dims, mesh, device, rank):
    """The decoder's layout (module docstring): experts over ep (and tp) first, then every language model's layout,
    then what the balance loss needs under cp and pp."""
    if dims.ep > 1:
        for moe in _moe_layers(model):
            apply_expert_parallel(moe.experts, expert_mesh(mesh), EXPERT_HIDDEN_DIMS)
    if dims.cp > 1:
        total = partial(all_reduce, group=submesh(mesh, "cp").get_group())  # autograd's: its backward sums too
        for moe in _moe_layers(model):
            moe.forward_total = total
    # Where the decoder's forward, which adds the balance losses to the loss, does not run (a pipeline stage) or its
    # loss is a DTensor that a plain balance loss cannot join in backward (tp's loss parallel), each MoE layer brings
    # its own into the gradient. Registered before tp's hooks: it sees the layer's plain output.
    attached = dims.pp > 1 or dims.tp > 1
    holder = _Weight()
    if attached:
        for moe in _moe_layers(model):
            moe.register_forward_hook(partial(_balance_loss_into_gradient, holder, model.config.balance_coef))
    layout = build_language_model_layout(model, cfg, dims, mesh, device, rank, split=SPLIT,
                                         tensor_parallel=apply_tensor_parallel)
    holder.layout = layout
    if layout.pipeline is not None:
        layers = _moe_layers(layout.model)
        layout.pipeline.shape_inference_hooks += [_TalliesAside(layers),
                                                  partial(keep_to_this_rank, [moe.experts for moe in layers])]
    return layout


def _moe_layers(model) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


class _Weight:
    """The weight of one forward's balance loss in the gradient, read from the layout at each forward: its
    micro-step's scale, over the pipeline's microbatches (each a forward of its own)."""

    layout = None

    def __call__(self) -> float:
        pipeline = self.layout.pipeline
        return self.layout.loss_scale / (pipeline.microbatches if pipeline is not None else 1)


def _balance_loss_into_gradient(weight: _Weight, coef: float, moe: MoE, _inputs, out: torch.Tensor) -> torch.Tensor:
    """The layer's balance loss attached to its output (parallel/auxiliary_loss.py), weighted as the loss of its
    forward is, instead of added to the loss by the decoder's forward (which then finds none to add)."""
    aux, moe.balance_loss = moe.balance_loss, None  # a recomputation (activation checkpointing) leaves it None
    if aux is None or not coef or not torch.is_grad_enabled():
        return out
    return attach_loss(out, coef * aux, weight())


class _TalliesAside:
    """Keeps torch's shape inference out of the routers' tallies (its forward routes garbage): fresh tallies while it
    runs, this step's own back afterwards (pipeline.shape_inference_hooks)."""

    def __init__(self, layers: list[MoE]):
        self.layers, self.kept = layers, None

    def __call__(self, inferring: bool) -> None:
        if inferring:
            self.kept = [moe.tally for moe in self.layers]
            for moe in self.layers:
                moe.tally = Tally()
        elif self.kept is not None:
            for moe, tally in zip(self.layers, self.kept, strict=True):
                moe.tally, moe.balance_loss = tally, None
            self.kept = None
