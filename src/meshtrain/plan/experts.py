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
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from meshtrain.parallel import backends
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.plan.machines import Machine
from meshtrain.plan.shares import Share

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig
    from meshtrain.plan.workload import ModelFacts

FP32 = 4
INT64 = 8


def unpriced(experts: int, dims: ParallelDims) -> str | None:
    """Why the planner does not price this layout of a mixture of experts (None: it does). Under tp, cp and pp the
    trainer runs each MoE layer whole on every tp rank, routes each cp rank's positions, splits the layers over
    stages: memory and time this module does not model yet (the parity tests check those layouts, not their plan)."""
    if experts and (dims.tp > 1 or dims.cp > 1 or dims.pp > 1):
        return ("the planner prices a mixture of experts under data and expert parallelism only; its tp, cp and pp "
                "layouts train (parallel.plan=manual) but are not planned yet")
    return None


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


def checkpointed_layers(cfg: RunConfig, layers: int) -> set[int]:
    """The blocks activation checkpointing wraps (parallel/checkpointing.py: every `step`-th, the first included)."""
    t = cfg.train
    if t.activation_checkpointing == "none":
        return set()
    step = 1 if t.activation_checkpointing == "full" else t.ac_every
    return {i for i in range(layers) if i % step == 0}


def moe_block_bytes(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, tokens: int, machine: Machine) -> float:
    """Bytes one MoE block saves for backward for one micro-batch of `tokens` tokens on the busiest rank: the part
    that grows with its tokens, and the routed rows its experts compute (ExpertShape's counts; under autocast by the
    dtype each is kept in, with 16-bit weights under FSDP2's mixed precision, attention in the machine's dtype)."""
    moe = facts.shape.moe
    rows = routed_rows(facts, dims, tokens)
    exchanged = moe.saved_per_row_ep if dims.ep > 1 else 0
    if cfg.train.dtype not in ("bf16", "fp16") or moe.autocast_per_token is None:
        return moe.saved_per_token * tokens * FP32 + rows * (moe.saved_per_row + exchanged) * FP32
    saved = moe.autocast_per_token
    fp32, low = (saved.fp32_16bit_weights, saved.low_16bit_weights) if _fsdp_mixed(cfg, dims) else (saved.fp32,
                                                                                                     saved.low)
    per_token = fp32 * FP32 + low * 2 + saved.attention * (FP32 if machine.cpu else 2)
    return per_token * tokens + rows * (moe.autocast_per_row * 2 + exchanged * FP32)


def _fsdp_mixed(cfg: RunConfig, dims: ParallelDims) -> bool:
    """FSDP2 gathers 16-bit parameters under autocast, and the blocks' inputs are 16-bit (compose.py's policy)."""
    return (cfg.train.dtype in ("bf16", "fp16") and backends.get(cfg.train.backend).sharded
            and dims.size("dp_shard_cp") > 1)


def kept_activations(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, tokens: int, dense_block: float,
                     block_input: float, machine: Machine) -> tuple[float, float]:
    """(what the blocks keep for backward for one micro-batch, the largest block's bytes): each checkpointed block its
    input, every other its own saved tensors, dense blocks `dense_block`, MoE blocks moe_block_bytes."""
    moe_layers = set(facts.shape.moe.layers)
    moe_block = moe_block_bytes(facts, cfg, dims, tokens, machine)
    checkpointed = checkpointed_layers(cfg, facts.shape.layers)
    kept = sum(block_input if i in checkpointed else moe_block if i in moe_layers else dense_block
               for i in range(facts.shape.layers))
    return kept, max(moe_block, dense_block)


def row_bytes(cfg: RunConfig, dims: ParallelDims) -> tuple[int, int]:
    """Bytes per element of the rows dispatched (the stream's dtype: 16-bit under FSDP2's mixed precision, else fp32)
    and of the outputs combined (the experts' compute dtype: 16-bit under autocast)."""
    return (2 if _fsdp_mixed(cfg, dims) else FP32), (2 if cfg.train.dtype in ("bf16", "fp16") else FP32)


def all_to_all_bytes(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, tokens: int) -> dict[str, float]:
    """Bytes a rank passes to all_to_all for one micro-batch of `tokens` tokens, summed over the MoE layers, mean over
    an ep group (module docstring): {"forward": dispatch + combine + counts, "backward": their gradients,
    "recompute": the forward exchanges of the layers activation checkpointing runs again}. Nothing without ep."""
    if dims.ep == 1:
        return {"forward": 0.0, "backward": 0.0, "recompute": 0.0}
    dispatch, combine = row_bytes(cfg, dims)
    rows = sent_rows(facts, tokens) * facts.shape.width
    forward = rows * (dispatch + combine) + facts.shape.experts * INT64
    backward = rows * (dispatch + combine)
    layers = facts.shape.moe.layers
    again = len(checkpointed_layers(cfg, facts.shape.layers) & set(layers))
    return {"forward": forward * len(layers), "backward": backward * len(layers), "recompute": forward * again}


def all_to_all_s(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, tokens: int, machine: Machine) -> float:
    """Seconds of one micro-batch's all-to-alls on the busiest rank: each exchange over the ep group's link, its rows
    scaled by the imbalance (the slowest rank sets the pace), its count exchange at latency."""
    if dims.ep == 1:
        return 0.0
    dispatch, combine = row_bytes(cfg, dims)
    rows = routed_rows(facts, dims, tokens) * facts.shape.width
    one = (machine.collective_s("all_to_all", rows * dispatch, dims, "ep")
           + machine.collective_s("all_to_all", rows * combine, dims, "ep"))
    counts = machine.collective_s("all_to_all", facts.shape.experts * INT64, dims, "ep")
    layers = facts.shape.moe.layers
    again = len(checkpointed_layers(cfg, facts.shape.layers) & set(layers))
    return (2 * one + counts) * len(layers) + (one + counts) * again


def expert_matmul_s(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, tokens: int, machine: Machine,
                    label: str) -> float:
    """Seconds of the routed experts' matmuls, forward and backward, of one micro-batch on the busiest rank: 6 FLOPs
    per multiply-add of its routed rows through three width × hidden matrices, at the machine's rate for one expert's
    share of the rows (a grouped GEMM runs each expert's rows as one GEMM)."""
    moe = facts.shape.moe
    rows = routed_rows(facts, dims, tokens)
    local_experts = facts.shape.experts // dims.ep
    per_expert = max(1, round(rows / local_experts))
    width = facts.shape.width
    rate = machine.matmul_rate(label, per_expert, width, moe.hidden)
    return len(moe.layers) * 3 * 6 * rows * width * moe.hidden / rate


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
