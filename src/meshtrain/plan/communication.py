"""The communication of one layout per iteration, per rank and by kind (dp, tp, cp, pp, ep): the bytes a rank sends
and their seconds, each collective over the link its group crosses (Machine.collective_s). plan/cost.py adds what
compute does not hide.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from meshtrain.parallel import backends
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.parallel.tensor_parallel import SHARDED_DIMS
from meshtrain.plan import experts
from meshtrain.plan.machines import Machine
from meshtrain.plan.shares import Share

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig
    from meshtrain.plan.cost import _Micro
    from meshtrain.plan.workload import ModelFacts

FP32 = 4


def communication(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, share: Share, micro: _Micro,
                   machine: Machine) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Bytes this rank sends per iteration, and their seconds, by kind (dp, tp, cp, pp, ep); and the calls of each
    collective op (each pays its latency)."""
    t, p = cfg.train, cfg.parallel
    act_bytes = 2 if t.dtype in ("bf16", "fp16") else FP32
    sent, seconds, calls = {}, {}, {}

    def add(kind: str, op: str, dim: str, nbytes: float, times: float) -> None:
        if nbytes <= 0 or times <= 0 or dims.size(dim) == 1:
            return
        sent[kind] = sent.get(kind, 0.0) + nbytes * times
        calls[op] = calls.get(op, 0.0) + times
        seconds[kind] = seconds.get(kind, 0.0) + times * machine.collective_s(op, nbytes, dims, dim)

    grads = (share.stage_params - share.expert_local) * FP32  # under ep > 1 the experts' own traffic is over edp
    chosen = backends.get(t.backend)
    for op, dim, nbytes, times in experts.expert_dp_collectives(share, cfg, dims, micro.count):
        add("dp", op, dim, nbytes, times)
    if chosen.all_reduces:  # DDP's buckets, each its own all-reduce; zero1's owners broadcast each parameter
        for nbytes, times in _ddp_buckets(grads):
            add("dp", "all_reduce", "dp_cp", nbytes, times)
        if chosen.shards == "optimizer":
            add("dp", "broadcast", "dp_cp", grads / share.tensors, share.tensors)
    elif chosen.sharded:  # FSDP2 gathers each unit (a block, the root) and reduce-scatters each unit's gradients
        units = share.blocks + (share.root_params > 0)
        shard_dim = "dp_shard" if chosen.replicas else "dp_shard_cp"
        gathers = micro.count * units * (2 if chosen.reshard_after_forward else 1)  # forward, and again for backward
        add("dp", "all_gather", shard_dim, grads / FP32 * act_bytes / units, gathers)
        add("dp", "reduce_scatter", shard_dim, grads / units, units)
        if chosen.replicas:
            add("dp", "all_reduce", "dp_replicate", grads / dims.dp_shard / units, units)
    stream = micro.tokens * facts.shape.width * act_bytes  # one block's input on this rank (whole sequence over tp)
    if dims.tp > 1:
        for op, nbytes, times in _tensor_parallel_calls(facts, cfg, dims, share, micro, stream):
            add("tp", op, "tp", nbytes, times)
        if facts.shape.moe is not None:  # an MoE layer's gates' gradient summed over tp (plan/experts.py), backward
            gates = micro.tokens * facts.shape.moe.top_k * FP32
            add("tp", "all_reduce", "tp", gates, len(experts.moe_layers_of(facts, share.parts)) * micro.count)
    for dim, times in _clip_calls(facts, cfg, dims, share):
        add("dp" if dim == "dp_shard_cp" else dim, "all_reduce", dim, share.tensors * FP32, times)
    if dims.cp > 1:
        kv = 2 * stream / dims.tp * facts.shape.kv_heads / facts.shape.heads
        if p.cp_impl == "ring":  # K and V go round the ring forward and again backward, then their fp32 gradients
            add("cp", "send_recv", "cp", kv, 2 * (dims.cp - 1) * share.blocks * micro.count)
            add("cp", "send_recv", "cp", kv * FP32 / act_bytes, dims.cp * share.blocks * micro.count)
        else:  # Ulysses: q, k, v in one all-to-all and the output in another, forward and again backward
            add("cp", "all_to_all", "cp", 3 * stream / dims.tp, 2 * share.blocks * micro.count)
            add("cp", "all_to_all", "cp", stream / dims.tp, 2 * share.blocks * micro.count)
    if facts.shape.moe is not None:
        for op, dim, nbytes, times in experts.balance_loss_collectives(facts, cfg, dims, share.parts, micro.count):
            add("cp", op, dim, nbytes, times)
    if facts.shape.moe is not None and dims.ep > 1:  # dispatch and combine, forward, backward, recomputed
        exchanged = experts.all_to_all_bytes(facts, cfg, dims, micro.tokens, share.parts)
        sent["ep"] = sum(exchanged.values()) * micro.count
        seconds["ep"] = experts.all_to_all_s(facts, cfg, dims, micro.tokens, machine, share.parts) * micro.count
    if dims.pp > 1:  # activations forward, their gradients backward, per micro-batch and boundary
        boundaries = 2 * p.virtual_stages if not (share.first or share.last) else 2 * p.virtual_stages - 1
        add("pp", "send_recv", "pp", micro.samples * facts.tokens * facts.shape.width * act_bytes,
            boundaries * micro.count)
    return sent, seconds, calls


# DistributedDataParallel's buckets: its bucket_cap_mb default, and a smaller first bucket
# (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES) so that the first all-reduce starts early in backward
DDP_BUCKET, DDP_FIRST_BUCKET = 25 * 2**20, 2**20


def _ddp_buckets(grads: float) -> list[tuple[float, int]]:
    """(bytes, calls) of DDP's all-reduces per step: the first bucket, then the rest in buckets of at most 25 MiB."""
    first = min(grads, DDP_FIRST_BUCKET)
    rest = grads - first
    count = math.ceil(rest / DDP_BUCKET)
    return [(first, 1)] + ([(rest / count, count)] if count else [])


def _tensor_parallel_calls(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, share: Share, micro: _Micro,
                           stream: float) -> list[tuple[str, float, float]]:
    """(op, bytes, calls) of each collective tensor parallelism makes per iteration (parallel/tensor_parallel.py's
    Megatron plan), call by call: on ranks that share cores each call costs milliseconds of waiting whatever its size,
    and a GPT step under tp 4 made 59 of them (docs/plan.md).

    Per block and micro-step, over the whole stream: with sequence parallel each of its two sublayers gathers its
    input's token shards and reduce-scatters its output, and backward does the reverse; without it, each sublayer's
    output is all-reduced forward and each column-parallel input's gradient backward (q, k and v each their own).
    The ends: the embedding's output and the head's input cross the same way once each (and a learned position
    table's gradient is gathered); loss parallel sums three per-token figures over the vocabulary's shards (its max,
    its sum of exponentials, the target's logit), while without it the head's logits are gathered whole. Per step,
    under sequence parallel, the gradients of the parameters tp leaves whole (the norms), partial sums over tp, are
    all-reduced once each."""
    p = cfg.parallel
    sequence, loss_parallel = (p.sequence_parallel, p.loss_parallel) if dims.pp == 1 else (False, False)
    ends = share.first + share.last
    per_micro = micro.count
    if sequence:
        # a learned position table's output is cut to this rank's positions: its gradient is gathered back
        positions = share.first and hasattr(getattr(facts.model, "transformer", None), "wpe")
        calls = [("all_gather", stream, (4 * share.blocks + ends) * per_micro),
                 ("all_gather", facts.tokens * facts.shape.width * FP32, positions * per_micro),
                 ("reduce_scatter", stream, (4 * share.blocks + ends) * per_micro),
                 ("all_reduce", facts.shape.width * FP32, share.whole_vectors)]
    else:
        calls = [("all_reduce", stream, (2 * share.blocks + _colwise_inputs(facts, share) + ends) * per_micro)]
    if share.last:
        vocabulary = micro.tokens * facts.head_features * (2 if cfg.train.dtype != "fp32" else FP32)
        calls.append(("all_reduce", micro.tokens * FP32, 3 * per_micro) if loss_parallel else
                     ("all_gather", vocabulary, per_micro))
    return calls


def _colwise_inputs(facts: ModelFacts, share: Share) -> int:
    """The inputs of this stage's blocks whose gradients tp sums apart in backward, without sequence parallel: each
    column-parallel linear's (q, k and v, an MLP's up and gate projections), but one for a mixture of experts'
    feed-forward, which takes its whole input once (tensor_parallel.PartialSum)."""
    if facts.split is None:  # no named blocks to read: one input a sublayer
        return 2 * share.blocks
    moe = set(experts.moe_layers_of(facts, share.parts)) if facts.shape.moe is not None else set()
    total = 0
    for block in (i for part in share.parts for i in part):
        prefix = f"{facts.split.blocks}.{block}."
        colwise = [name for name, _ in facts.linears if name.startswith(prefix)
                   and SHARDED_DIMS.get(name.removeprefix(prefix)) == 0]
        total += sum(not name.startswith(f"{prefix}mlp.") for name in colwise) + 1 if block in moe else len(colwise)
    return total


def _clip_calls(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, share: Share) -> list[tuple[str, float]]:
    """(mesh dim, calls) of gradient clipping's sums of DTensor gradients' norms (parallel/clipping.py): the stacked
    norms once over each dim the gradients are sharded on; each gradient's norm on its own where the norms cannot be
    stacked (parallel/clipping.clip_grad_norm_: a pipeline's stage, whose norms the stages then sum, and a mixture of
    experts laid out over tp or ep, whose experts lie on a mesh of their own)."""
    if cfg.optimizer.grad_clip <= 0:
        return []
    chosen = backends.get(cfg.train.backend)
    sharded = [dim for dim, on in (("tp", dims.tp > 1), ("dp_shard_cp", chosen.sharded and
                                                            dims.size("dp_shard_cp") > 1)) if on]
    apart = dims.pp > 1 or (facts.shape.moe is not None and (dims.tp > 1 or dims.ep > 1))
    if not apart:
        return [(dim, 1) for dim in sharded]
    return [(dim, share.tensors) for dim in sharded] + [("pp", 1)]
