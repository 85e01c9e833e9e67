"""A mixture of experts, priced: what its MoE layers add to a layout's memory, compute and communication (plan/cost.py
asks here for every model whose ModelShape has `moe`, registry.ExpertShape).

Routed rows. Each MoE layer sends each of a rank's N tokens (per micro-batch) to top_k experts: N·k rows. Under
expert parallelism (ep > 1) the rows go to the ranks that hold their experts, so what one rank's experts compute is
what the routing sends it, not N·k. The plan uses, per rank and MoE layer:

    ep = 1                    N·k exactly (dropless), or at most E·ceil(c·N·k/E) under model.capacity_factor c
    ep > 1, dropless          imbalance × N·k: the balanced expectation (every rank of an ep group sends N·k rows and
                              the group's ranks receive as many in all) times `ModelFacts.expert_imbalance` (the
                              busiest rank's share over the mean; `meshtrain plan --expert-imbalance`, default 1.25),
                              capped by the worst case, every token of the ep group sent to this rank's experts:
                              ep·N·min(k, E/ep) rows
    ep > 1, capacity c        E·ceil(c·N·k/E): each of the ep senders keeps at most ceil(c·N·k/E) rows per expert
                              (router.capacity), and the rank holds E/ep experts: a bound no routing exceeds

The same rows set what an MoE block keeps for backward (ExpertShape: per token of the rank, plus per routed row its
experts compute) and the experts' share of the step time (the busiest rank sets the pace of every all-to-all).

All-to-all bytes. Each MoE layer exchanges, per micro-batch (parallel/expert_parallel.py): the row counts (E int64,
once per forward), the rows to the experts' owners (dispatch) and the outputs back (combine); backward sends the
gradients of both the other way. What a rank passes to all_to_all is N·k rows for its own dispatch and for the
gradient of its own combine, and the rows its experts received for the other two; over an ep group the received rows
add up to the sent ones, so the mean per rank is exactly 2·N·k·width·(dispatch bytes + combine bytes) + 8·E a
layer (dropless; an upper bound under a capacity factor, whose dropped rows are not sent). Rows go in the stream's dtype
(fp32, or 16-bit under FSDP2's mixed precision) and come back in the experts' compute dtype (16-bit under autocast).
A layer that activation checkpointing recomputes runs its forward exchanges again. The count includes the part of
each buffer a rank sends to itself; the time prices it as nccl-tests do, (ep - 1)/ep of it over the link the ep group
crosses (inside a node or between nodes, Machine.collective_s), times the imbalance for the busiest rank.

With tp, cp and pp, as the trainer lays them out (models/moe/parallelize.py):

    tp    each MoE layer routes all of the rank's tokens on every tp rank (gathered in under sequence parallel),
          and every expert's hidden width is cut over tp (expert tensor parallelism): the experts' states
          (shares.py: tensor_parallel.PARTIAL_SUM_DIMS), their hidden tensors saved per row and per token (the shared
          experts'), their matmuls and weight casts are divided by tp; the routed rows, their all-to-alls (each tp
          rank exchanges the same whole rows within its ep group) and the router are not. The block's attention half
          is cut as a dense block's (plan/activations.py); the block reduces its stream as a dense block does (the
          MoE layer's partial sums: reduce-scattered, or all-reduced), plus the gates' gradient (fp32 [N, k])
          all-reduced in backward (communication.py)
    cp    each cp rank routes its own positions: N is the tokens a micro-batch puts on the rank (already / cp); the
          balance loss sums its statistics over cp (balance_loss_collectives)
    pp    a stage holds, keeps, computes and exchanges its own MoE layers only (Share.parts: the pipeline's split)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from meshtrain.nn.activation_counts import AutocastActivations
from meshtrain.parallel import backends
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.plan import activations
from meshtrain.plan.machines import Machine
from meshtrain.plan.shares import Share, chunk

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig
    from meshtrain.plan.workload import ModelFacts

FP32 = 4
INT64 = 8


def capacity(tokens: int, top_k: int, n_experts: int, factor: float) -> int:
    """Rows one expert keeps of one rank's forward under a capacity factor (models/moe/router.capacity's rule)."""
    return math.ceil(factor * tokens * top_k / n_experts)


def sent_rows(facts: ModelFacts, tokens: int) -> float:
    """Rows one rank dispatches in one MoE layer for `tokens` of its tokens (at most, under a capacity factor)."""
    moe, n_experts = facts.shape.moe, facts.shape.experts
    assigned = tokens * moe.top_k
    if moe.capacity_factor is None:
        return float(assigned)
    return float(min(assigned, n_experts * capacity(tokens, moe.top_k, n_experts, moe.capacity_factor)))


def routed_rows(facts: ModelFacts, dims: ParallelDims, tokens: int) -> float:
    """Rows the busiest rank's experts compute in one MoE layer when every rank routes `tokens` tokens (module
    docstring: exact at ep = 1, the imbalance bound or the capacity bound under ep > 1)."""
    moe, n_experts = facts.shape.moe, facts.shape.experts
    if dims.ep == 1:
        return sent_rows(facts, tokens)
    worst = dims.ep * tokens * min(moe.top_k, n_experts // dims.ep)
    if moe.capacity_factor is not None:
        return float(min(worst, n_experts * capacity(tokens, moe.top_k, n_experts, moe.capacity_factor)))
    return float(min(worst, facts.expert_imbalance * tokens * moe.top_k))


Parts = tuple[tuple[int, ...], ...]  # the blocks a pp rank runs, one tuple per stage it holds (Share.parts)


def whole_model(facts: ModelFacts) -> Parts:
    """Every block, as one part: a rank without a pipeline."""
    return (tuple(range(facts.shape.layers)),)


def moe_layers_of(facts: ModelFacts, parts: Parts | None) -> list[int]:
    """The MoE layers among `parts` (the whole model when None): under pp a stage's own."""
    moe = set(facts.shape.moe.layers)
    return [i for part in parts or whole_model(facts) for i in part if i in moe]


def checkpointed_layers(cfg: RunConfig, parts: Parts) -> set[int]:
    """The blocks activation checkpointing wraps (parallel/checkpointing.py: in each part, a stage's blocks or the
    whole model's, every `step`-th counted from its first)."""
    t = cfg.train
    if t.activation_checkpointing == "none":
        return set()
    step = t.ac_every if t.activation_checkpointing == "selective" else 1  # full and op: every block
    return {layer for part in parts for i, layer in enumerate(part) if i % step == 0}


def _run_again(facts: ModelFacts, cfg: RunConfig, parts: Parts | None) -> tuple[list[int], int]:
    """The MoE layers of `parts`, and how many of them activation checkpointing runs forward a second time."""
    layers = moe_layers_of(facts, parts)
    return layers, len(checkpointed_layers(cfg, parts or whole_model(facts)) & set(layers))


def moe_block_bytes(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, tokens: int, machine: Machine) -> float:
    """Bytes one MoE block saves for backward for one micro-batch of `tokens` tokens on the busiest rank: the part
    that grows with its tokens, and the routed rows its experts compute (ExpertShape's counts; under autocast by the
    dtype each is kept in, with 16-bit weights under FSDP2's mixed precision, attention in the machine's dtype).
    Under tp the block's attention half is cut as a dense block's is (plan/activations.py); the MoE layer runs on all
    of the rank's tokens (gathered under sequence parallel), its experts' hidden tensors cut over tp (cut_hidden)."""
    moe = facts.shape.moe
    rows = routed_rows(facts, dims, tokens)
    exchanged = moe.saved_per_row_ep if dims.ep > 1 else 0
    per_row, shared_cut = cut_hidden(moe.hidden, dims.tp), cut_hidden(moe.shared_hidden, dims.tp)
    half = attention_half(facts, cfg, dims, machine)
    if not activations.autocast(cfg) or moe.autocast_per_token is None:
        rest = (moe.saved_per_token - moe.attention_per_token - shared_cut) * FP32
        return (half + rest) * tokens + rows * (moe.saved_per_row - per_row + exchanged) * FP32
    saved, cut = moe.autocast_per_token, moe.attention_autocast or AutocastActivations(0, 0, 0, 0, 0)
    if activations.fsdp_mixed(cfg, dims):
        fp32, low = saved.fp32_16bit_weights - cut.fp32_16bit_weights, saved.low_16bit_weights - cut.low_16bit_weights
    else:
        fp32, low = saved.fp32 - cut.fp32, saved.low - cut.low
    rest = fp32 * FP32 + (low - shared_cut) * 2 + (saved.attention - cut.attention) * (FP32 if machine.cpu else 2)
    copies = _weight_casts(facts, cfg, dims)
    return (half + rest) * tokens + rows * ((moe.autocast_per_row - per_row) * 2 + exchanged * FP32) + copies


def attention_half(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, machine: Machine) -> float:
    """Bytes per token an MoE block's attention half saves (its norm, projections and attention), whose
    column-parallel linears (attn.*) keep their inputs whole under tp."""
    moe = facts.shape.moe
    if not moe.attention_per_token:
        return 0.0
    return activations.per_token_bytes(facts, cfg, dims, machine, moe.attention_per_token, moe.attention_autocast,
                                       lambda name: ".attn." in name)


def cut_hidden(hidden: int, tp: int) -> int:
    """Elements tp takes off the four hidden tensors a SwiGLU of `hidden` keeps (gate, up, its activation, their
    product): a rank keeps its 1/tp (torch.chunk's rank 0 share)."""
    return 4 * (hidden - chunk(hidden, tp)) if tp > 1 else 0


def _weight_casts(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims) -> float:
    """The 16-bit copy of this rank's experts that each forward of an MoE layer saves under autocast with fp32
    weights: its matmuls read slices of the stacked weights (or cast them whole for the grouped GEMM), which
    autocast's cache of weight casts does not keep, so every micro-batch held keeps its own (none where FSDP2's mixed
    precision gathers them 16-bit)."""
    if not _experts_cast(cfg, dims):
        return 0.0
    return 2.0 * _expert_elements(facts, dims)


def weight_grad_transients(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims) -> float:
    """What an MoE block's backward makes of its experts' weight gradients before they reach the fp32 gradients they
    accumulate into, where autocast casts the weights: the 16-bit gradient of each cast and its fp32 copy (the
    DeepSeek-V3-like preset's last stage under fsdp × ep 32, its experts left out of FSDP2 (edp 1): 2.6 GiB a block
    of the 2.9 its trace held beyond the planner's count)."""
    return (2.0 + FP32) * _expert_elements(facts, dims) if _experts_cast(cfg, dims) else 0.0


def _expert_elements(facts: ModelFacts, dims: ParallelDims) -> int:
    return 3 * (facts.shape.experts // dims.ep) * facts.shape.width * chunk(facts.shape.moe.hidden, dims.tp)


def _experts_cast(cfg: RunConfig, dims: ParallelDims) -> bool:
    """Whether autocast casts the experts' weights from fp32: FSDP2's mixed precision gathers them 16-bit where it
    shards them (in their blocks without ep, over edp with it), and leaves them fp32 where each rank holds its
    experts alone (ep > 1, edp 1: parallel/backends/fsdp.py's ignored parameters)."""
    if not activations.autocast(cfg):
        return False
    return not (activations.fsdp_mixed(cfg, dims) and (dims.ep == 1 or dims.size("edp") > 1))


def kept_activations(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, tokens: int, dense_block: float,
                     block_input: float, machine: Machine, parts: Parts | None = None) -> tuple[float, float]:
    """(what the blocks of `parts` keep for backward for one micro-batch, the largest such block's bytes): each
    checkpointed block its input, every other its own saved tensors, dense blocks `dense_block`, MoE blocks
    moe_block_bytes; under op-level checkpointing each block its matmuls' and attention's outputs and its input
    (activations.op_block_bytes, with the routed rows of an MoE block)."""
    parts = parts or whole_model(facts)
    moe_layers = set(facts.shape.moe.layers)
    moe_block = moe_block_bytes(facts, cfg, dims, tokens, machine)
    mine = [i for part in parts for i in part]
    own = {i: moe_block if i in moe_layers else dense_block for i in mine}
    if cfg.train.activation_checkpointing == "op":
        rows = routed_rows(facts, dims, tokens)
        kept = sum(activations.op_block_bytes(facts, cfg, dims, tokens, machine, i, rows if i in moe_layers else 0.0)
                   for i in mine)
        return kept, max(own.values(), default=0.0)
    checkpointed = checkpointed_layers(cfg, parts)
    kept = sum(block_input if i in checkpointed else own[i] for i in mine)
    return kept, max(own.values(), default=0.0)


def row_bytes(cfg: RunConfig, dims: ParallelDims) -> tuple[int, int]:
    """Bytes per element of the rows dispatched (the stream's dtype: 16-bit under FSDP2's mixed precision, else fp32)
    and of the outputs combined (the experts' compute dtype: 16-bit under autocast)."""
    return (2 if activations.fsdp_mixed(cfg, dims) else FP32), (2 if activations.autocast(cfg) else FP32)


def all_to_all_bytes(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, tokens: int,
                     parts: Parts | None = None) -> dict[str, float]:
    """Bytes a rank passes to all_to_all for one micro-batch of `tokens` tokens, summed over the MoE layers of `parts`
    (a stage's; the whole model's when None), mean over an ep group (module docstring): {"forward": dispatch +
    combine + counts, "backward": their gradients, "recompute": the forward exchanges of the layers activation
    checkpointing runs again}. Nothing without ep."""
    if dims.ep == 1:
        return {"forward": 0.0, "backward": 0.0, "recompute": 0.0}
    dispatch, combine = row_bytes(cfg, dims)
    rows = sent_rows(facts, tokens) * facts.shape.width
    forward = rows * (dispatch + combine) + facts.shape.experts * INT64
    backward = rows * (dispatch + combine)
    layers, again = _run_again(facts, cfg, parts)
    return {"forward": forward * len(layers), "backward": backward * len(layers), "recompute": forward * again}


def all_to_all_s(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, tokens: int, machine: Machine,
                 parts: Parts | None = None) -> float:
    """Seconds of one micro-batch's all-to-alls on the busiest rank, in the MoE layers of `parts`: each exchange over
    the ep group's link, its rows scaled by the imbalance (the slowest rank sets the pace), its count exchange at
    latency."""
    if dims.ep == 1:
        return 0.0
    dispatch, combine = row_bytes(cfg, dims)
    rows = routed_rows(facts, dims, tokens) * facts.shape.width
    one = (machine.collective_s("all_to_all", rows * dispatch, dims, "ep")
           + machine.collective_s("all_to_all", rows * combine, dims, "ep"))
    counts = machine.collective_s("all_to_all", facts.shape.experts * INT64, dims, "ep")
    layers, again = _run_again(facts, cfg, parts)
    return (2 * one + counts) * len(layers) + (one + counts) * again


def expert_matmul_s(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, tokens: int, machine: Machine,
                    label: str, parts: Parts | None = None) -> float:
    """Seconds of the routed experts' matmuls in the MoE layers of `parts`, forward and backward, of one micro-batch on
    the busiest rank: 6 FLOPs per multiply-add of its routed rows through three width × hidden matrices, at the
    machine's rate for one expert's share of the rows (a grouped GEMM runs each expert's rows as one GEMM). Under tp
    every tp rank runs the same rows through its 1/tp of each expert's hidden width."""
    moe = facts.shape.moe
    rows = routed_rows(facts, dims, tokens)
    local_experts = facts.shape.experts // dims.ep
    per_expert = max(1, round(rows / local_experts))
    width, hidden = facts.shape.width, chunk(moe.hidden, dims.tp)
    rate = machine.matmul_rate(label, per_expert, width, hidden)
    return len(moe_layers_of(facts, parts)) * 3 * 6 * rows * width * hidden / rate


def expert_dp_collectives(share: Share, cfg: RunConfig, dims: ParallelDims, count: int
                          ) -> list[tuple[str, str, float, float]]:
    """(op, dim, bytes, times) of the experts' data-parallel traffic per iteration under ep > 1, which runs over edp
    (the ranks that hold the same experts) instead of the dense parameters' group: DDP's all-reduce of their
    gradients (the layout's own, lm_layout.py), or FSDP2's gathers per micro-batch and reduce-scatter."""
    if dims.ep == 1 or share.expert_local == 0:
        return []
    chosen = backends.get(cfg.train.backend)
    grads = share.expert_local * FP32
    if not chosen.sharded:
        return [("all_reduce", "edp", grads, 1)]
    gathers = count * (2 if chosen.reshard_after_forward else 1)
    gathered = share.expert_local * (2 if cfg.train.dtype != "fp32" else FP32)
    return [("all_gather", "edp", gathered, gathers), ("reduce_scatter", "edp", grads, 1)]


def balance_loss_collectives(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, parts: Parts | None, count: int
                             ) -> list[tuple[str, str, float, float]]:
    """(op, dim, bytes, times) of the balance loss's sums under cp (models/moe/parallelize.py): each MoE layer's
    forward all-reduces its E counts, E probability sums and its token count over the cp ranks, autograd's backward
    once more, a recomputed layer's forward again; per micro-batch."""
    if dims.cp == 1:
        return []
    layers, again = _run_again(facts, cfg, parts)
    return [("all_reduce", "cp", (2 * facts.shape.experts + 1) * FP32, (2 * len(layers) + again) * count)]
