"""The communication of one layout per iteration, per rank and by kind (dp, tp, cp, pp, ep): the bytes a rank sends
and their seconds, each collective over the link its group crosses (Machine.collective_s). plan/cost.py adds what
compute does not hide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshtrain.parallel import backends
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.plan import experts
from meshtrain.plan.machines import Machine
from meshtrain.plan.shares import Share

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig
    from meshtrain.plan.cost import _Micro
    from meshtrain.plan.workload import ModelFacts

FP32 = 4


def communication(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, share: Share, micro: _Micro,
                   machine: Machine) -> tuple[dict[str, float], dict[str, float]]:
    """Bytes this rank sends per iteration, and their seconds, by kind (dp, tp, cp, pp, ep)."""
    t, p = cfg.train, cfg.parallel
    act_bytes = 2 if t.dtype in ("bf16", "fp16") else FP32
    sent, seconds = {}, {}

    def add(kind: str, op: str, dim: str, nbytes: float, times: float) -> None:
        if nbytes <= 0 or times <= 0 or dims.size(dim) == 1:
            return
        sent[kind] = sent.get(kind, 0.0) + nbytes * times
        seconds[kind] = seconds.get(kind, 0.0) + times * machine.collective_s(op, nbytes, dims, dim)

    grads = (share.stage_params - share.expert_local) * FP32  # under ep > 1 the experts' own traffic is over edp
    chosen = backends.get(t.backend)
    for op, dim, nbytes, times in experts.expert_dp_collectives(share, cfg, dims, micro.count):
        add("dp", op, dim, nbytes, times)
    if chosen.all_reduces:
        add("dp", "all_reduce", "dp_cp", grads, 1)
        if chosen.shards == "optimizer":
            add("dp", "broadcast", "dp_cp", grads, 1)  # each owner sends its updated parameters
    elif chosen.sharded:
        shard_dim = "dp_shard" if chosen.replicas else "dp_shard_cp"
        gathers = micro.count * (2 if chosen.reshard_after_forward else 1)  # forward, and again for backward
        add("dp", "all_gather", shard_dim, grads / FP32 * act_bytes, gathers)
        add("dp", "reduce_scatter", shard_dim, grads, 1)
        if chosen.replicas:
            add("dp", "all_reduce", "dp_replicate", grads / dims.dp_shard, 1)
    stream = micro.tokens * facts.shape.width * act_bytes  # one block's input on this rank (whole sequence over tp)
    if dims.tp > 1:  # two all-reduces (or all-gather + reduce-scatter pairs) forward, two backward, per block
        add("tp", "all_reduce", "tp", stream, 4 * share.blocks * micro.count)
        if facts.shape.moe is not None:  # an MoE layer's gates' gradient summed over tp (plan/experts.py), backward
            gates = micro.tokens * facts.shape.moe.top_k * FP32
            add("tp", "all_reduce", "tp", gates, len(experts.moe_layers_of(facts, share.parts)) * micro.count)
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
    return sent, seconds
