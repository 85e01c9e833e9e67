"""The planner on a mixture of experts, without processes: the MoE preset `cpu` (width 64, 4 layers: the first dense,
then 3 MoE layers of 8 experts of 128 hidden, top-2, one shared expert; vocabulary 65) counted on the meta device,
against numbers worked out by hand from its parameter shapes:

    ends          wte 65×64 + ln_f 64 + lm_head 65×64                               =   8,384
    attention     ln_1 64 + q 64×64 + k 32×64 + v 32×64 + o 64×64 + ln_2 64         =  12,416 per block
    dense block   attention + SwiGLU 3 × 192×64                                     =  49,280
    MoE block     attention + router 8×64 + experts 3 × 8×128×64 + shared 3×128×64 = 234,112 (experts 196,608)
    all           8,384 + 49,280 + 3 × 234,112                                      = 760,000
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from meshtrain import registry
from meshtrain.config import load_config
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.plan import experts, machines, search, shares, systems
from meshtrain.plan.cost import predict
from meshtrain.plan.workload import ModelFacts

VOCAB = {"meta": {"vocab_size": 65}}
EXPERTS = 3 * 196_608  # the routed experts' elements, all three MoE layers
DENSE = 760_000 - EXPERTS


def facts_of(*overrides: str) -> tuple:
    cfg = load_config(["preset=cpu", "model.batch_size=8", "train.dtype=fp32", *overrides], "moe")
    return cfg, ModelFacts.of(cfg, VOCAB)


@pytest.mark.parametrize("overrides, world, params", [
    # ep halves the experts; DDP keeps the dense part whole
    (["train.backend=ddp", "parallel.ep=2"], 2, 760_000 - EXPERTS // 2),
    # fsdp over 2 with ep 2: edp = 1, so the experts' halves are not sharded further; the dense part halves, but
    # wte and lm_head (65 rows) leave rank 0 33 rows each: 32 elements more apiece
    (["train.backend=fsdp", "parallel.ep=2"], 2, DENSE // 2 + 2 * 32 + EXPERTS // 2),
    # fsdp over 4 with ep 2: the experts' halves sharded over efsdp 2; the dense part over 4 (17 rows of 65)
    (["train.backend=fsdp", "parallel.ep=2"], 4, DENSE // 4 + 2 * 48 + EXPERTS // 4),
    # hsdp 2 × 2 with ep 2: dense over dp_shard 2; the experts over edp = dp_replicate 2 × efsdp 1
    (["train.backend=hsdp", "parallel.dp_replicate=2", "parallel.ep=2"], 4, DENSE // 2 + 2 * 32 + EXPERTS // 4),
    # ep 1: experts are plain parameters, sharded with their block
    (["train.backend=fsdp"], 2, DENSE // 2 + 2 * 32 + EXPERTS // 2),
])
def test_states_per_rank_are_the_hand_count(overrides, world, params):
    cfg, facts = facts_of(*overrides)
    dims = ParallelDims.from_config(cfg, world, world)
    cost = predict(facts, cfg, dims, machines.from_system(systems.get("polaris")))
    assert (cost.memory["params"], cost.memory["grads"], cost.memory["optimizer"]) == (4 * params, 4 * params,
                                                                                      8 * params)


def test_ddp_buckets_leave_the_experts_out_and_their_average_is_a_flat_copy():
    cfg, facts = facts_of("train.backend=ddp", "parallel.ep=2")
    cost = predict(facts, cfg, ParallelDims.from_config(cfg, 4, 4), machines.from_system(systems.get("polaris")))
    assert cost.memory["buffers"] == 4 * DENSE  # DDP's buckets hold the dense gradients only
    assert cost.memory["expert gradient copy"] == 4 * EXPERTS // 2  # average_gradients' torch.cat over edp (2)


def test_routed_rows_bound_by_ep_imbalance_worst_case_and_capacity():
    """512 tokens a rank (batch 8 × 64), top-2, 8 experts."""
    cfg, facts = facts_of()
    one, two, four = (ParallelDims(world_size=w, ep=e) for w, e in ((2, 1), (2, 2), (8, 8)))
    assert experts.routed_rows(facts, one, 512) == 1024  # dropless, no ep: exactly N·k
    assert experts.routed_rows(facts, two, 512) == 1.25 * 1024  # the default imbalance over the balanced 1024
    assert experts.routed_rows(replace(facts, expert_imbalance=3.0), two, 512) == 2048  # capped: 2 ranks × 512 × 2
    # ep 8, one expert a rank: a token reaches a rank once at most, so the worst case is every token: 8 × 512 × 1
    assert experts.routed_rows(replace(facts, expert_imbalance=10.0), four, 512) == 4096
    _, capped = facts_of("model.capacity_factor=1.0")
    assert experts.routed_rows(capped, two, 512) == 8 * 128  # E × ceil(1.0 × 512 × 2 / 8): exact, whatever the routing
    _, half = facts_of("model.capacity_factor=0.5")
    assert experts.routed_rows(half, one, 512) == experts.sent_rows(half, 512) == 8 * 64


def test_capacity_is_the_routers_rule():
    from meshtrain.models.moe.router import capacity

    for tokens, k, e, c in ((512, 2, 8, 1.0), (100, 3, 7, 1.25), (1, 8, 256, 0.3)):
        assert experts.capacity(tokens, k, e, c) == capacity(tokens, k, e, c)


def test_all_to_all_bytes_are_the_hand_count():
    """512 tokens × top-2 = 1024 rows of 64 fp32 a layer: dispatch and combine 2 × 262,144 bytes forward (and the
    counts, 8 int64), as many backward; three MoE layers; full checkpointing runs the forwards again."""
    cfg, facts = facts_of("train.backend=ddp", "parallel.ep=2")
    dims = ParallelDims.from_config(cfg, 2, 2)
    machine = machines.from_system(systems.get("polaris"))
    forward, backward = 2 * 1024 * 64 * 4 + 64, 2 * 1024 * 64 * 4
    assert predict(facts, cfg, dims, machine).comm_bytes["ep"] == 3 * (forward + backward)
    cfg, facts = facts_of("train.backend=fsdp", "parallel.ep=2", "train.activation_checkpointing=full",
                          "train.grad_accum=2")
    assert predict(facts, cfg, dims, machine).comm_bytes["ep"] == 2 * 3 * (2 * forward + backward)
    cfg, facts = facts_of("train.backend=fsdp", "parallel.ep=2", "train.dtype=bf16")  # FSDP2 mixed: 16-bit both ways
    assert predict(facts, cfg, dims, machine).comm_bytes["ep"] == 3 * (2 * 1024 * 64 * 2 + 64 + 2 * 1024 * 64 * 2)


def test_the_all_to_all_crosses_nodes_only_when_the_ep_group_does():
    cfg, facts = facts_of("train.backend=fsdp", "parallel.ep=4")
    machine = machines.from_system(systems.get("polaris"))  # 4 devices a node: 25 GB/s inside, 12.5 between
    inside = experts.all_to_all_s(facts, cfg, ParallelDims.from_config(cfg, 8, 4), 512, machine)
    cfg8, _ = facts_of("train.backend=fsdp", "parallel.ep=8")
    across = experts.all_to_all_s(facts, cfg8, ParallelDims.from_config(cfg8, 8, 4), 512, machine)
    assert across > 5 * inside  # the inter-node link is ~19x slower per device than NVLink on polaris


def test_flops_count_the_active_parameters():
    """6 × the active non-embedding parameters (every dense part, the router, the shared expert, 2 of 8 experts:
    755,840 - 3 × 6 × 24,576 = 313,472) + 12 · layers · heads · head_dim · tokens, per token."""
    cfg, facts = facts_of("train.backend=ddp")
    cost = predict(facts, cfg, ParallelDims.from_config(cfg, 2, 2), machines.from_system(systems.get("polaris")))
    assert cost.flops_per_iteration == (6 * 313_472 + 12 * 4 * 4 * 16 * 64) * cost.tokens_per_iteration


def saved_by_block(block, x: torch.Tensor, kwargs: dict, autocast: bool = False) -> dict[torch.dtype, int]:
    """Bytes autograd keeps for `block`'s backward, by dtype (each storage once, parameters not counted)."""
    params, saved = {p.untyped_storage().data_ptr() for p in block.parameters()}, {}

    def keep(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = (t.dtype, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), torch.autocast("cpu", torch.bfloat16,
                                                                                     enabled=autocast):
        block(x, **kwargs)
    totals: dict[torch.dtype, int] = {}
    for dtype, nbytes in saved.values():
        totals[dtype] = totals.get(dtype, 0) + nbytes
    return totals


CASES = [[], ["model.top_k=3"], ["model.n_shared_experts=0", "model.score=sigmoid"],
         ["model.norm_topk=false", "model.n_embd=32", "model.n_experts=4"]]


@pytest.mark.parametrize("overrides", CASES)
def test_an_moe_block_saves_what_the_shape_counts(overrides):
    """ExpertShape's counts against the bytes autograd keeps for one MoE block's backward (fp32, no ep: N·k rows),
    each storage once, parameters not counted, as tests/unit/test_registry.py counts a dense block."""
    cfg = load_config(["preset=cpu", *overrides], "moe")
    spec = registry.get("moe")
    torch.manual_seed(0)
    model = spec.build_model(cfg, VOCAB)
    block, tokens, moe = model.transformer.h["1"], cfg.model.block_size, spec.shape(cfg).moe
    x = torch.randn(2, tokens, cfg.model.n_embd, requires_grad=True)
    n = 2 * tokens
    counted = moe.saved_per_token * n + n * moe.top_k * moe.saved_per_row
    # the balance loss's (router.balance_loss), a forward's, not a token's: its sums (E counts, E probability sums,
    # the tokens) and the E shares f = counts / (tokens · k)
    saved = saved_by_block(block, x, model.block_kwargs(torch.arange(tokens)))
    assert sum(saved.values()) / 4 == counted + 3 * cfg.model.n_experts + 1


@pytest.mark.parametrize("overrides", CASES)
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_an_moe_block_under_autocast_saves_what_the_shape_counts(overrides, weights):
    """The same under bf16 autocast on a CPU (attention in fp32), with fp32 weights (DDP) and with 16-bit weights and
    input (FSDP2's mixed precision): what grows with the tokens (3 samples less 1), by dtype."""
    cfg = load_config(["preset=cpu", *overrides], "moe")
    spec = registry.get("moe")
    torch.manual_seed(0)
    model = spec.build_model(cfg, VOCAB)
    block, tokens, moe = model.transformer.h["1"].to(weights), cfg.model.block_size, spec.shape(cfg).moe
    kwargs = model.block_kwargs(torch.arange(tokens))
    one, three = (saved_by_block(block, torch.randn(s, tokens, cfg.model.n_embd, dtype=weights, requires_grad=True),
                                 kwargs, autocast=True) for s in (1, 3))
    n = 2 * tokens
    per_token = {d: (three.get(d, 0) - one.get(d, 0)) / n for d in three}
    saved = moe.autocast_per_token
    fp32, low = (saved.fp32, saved.low) if weights == torch.float32 else (saved.fp32_16bit_weights,
                                                                          saved.low_16bit_weights)
    assert per_token[torch.float32] + per_token[torch.int64] == (fp32 + saved.attention) * 4  # CPU attention: fp32
    assert per_token[torch.bfloat16] == low * 2 + moe.top_k * moe.autocast_per_row * 2
    # What does not grow with the tokens: with fp32 weights, the 16-bit weight copies, the linears' from autocast's
    # cache (the planner's `16-bit weight copies`) and the experts' of each forward (plan/experts.py's, in the block)
    constant = one[torch.bfloat16] - tokens * per_token[torch.bfloat16]
    linears = sum(m.weight.numel() for m in block.modules() if isinstance(m, torch.nn.Linear))
    planned, facts = facts_of(*overrides, "train.dtype=bf16")
    experts_copy = experts.moe_block_bytes(facts, planned, ParallelDims(world_size=1), 0,  # 0 tokens: the copy alone
                                           machines.from_system(systems.get("polaris")))
    assert experts_copy == 2 * 3 * cfg.model.n_experts * cfg.model.n_embd * moe.hidden
    assert constant == (2 * linears + experts_copy if weights == torch.float32 else 0)


def test_search_enumerates_ep_and_refuses_what_train_refuses():
    cfg, facts = facts_of()
    ranked, refused = search.search(cfg, 1, 4, machines.from_system(systems.get("polaris")), facts)
    labels = {c.label for c in ranked}
    assert {"ddp dp4 ep2 ac=none", "fsdp dp4 ep4 ac=full", "hsdp dp2×2 ep2 ac=selective"} <= labels
    assert not any(c.cfg.train.backend == "zero1" and c.dims.ep > 1 for c in ranked)
    assert any("ZeroRedundancyOptimizer" in why for why in refused)  # mesh.check_layout's own message
    # tp, cp and pp are planned too, alone and with ep
    assert {"fsdp dp2 tp2 ac=none", "fsdp dp2 tp2 ep2 ac=none", "ddp dp2 pp2:gpipe/mb2 ac=none",
            "fsdp dp2 ep2 pp2:1f1b/mb2 ac=none", "fsdp dp2 cp2:ring ep2 ac=none",
            "ddp dp1 cp4:ulysses ac=none"} <= labels
    assert not any("not planned" in why for why in refused)
    chosen = next(c for c in ranked if c.label == "fsdp dp4 ep4 ac=full")
    assert "parallel.ep=4" in chosen.overrides
    assert search.with_layout(cfg, search.layout_of(chosen)).parallel.ep == 4


def test_the_imbalance_knob_moves_the_memory_and_refuses_less_than_even(capsys):
    from meshtrain.commands import main

    cfg, facts = facts_of("train.backend=ddp", "parallel.ep=2")
    dims, machine = ParallelDims.from_config(cfg, 2, 2), machines.from_system(systems.get("polaris"))
    even, double = (predict(replace(facts, expert_imbalance=x), cfg, dims, machine).memory["activations"]
                    for x in (1.0, 2.0))
    # 1024 more rows a layer, each its input, 4 hidden tensors and 2 int64 orders: (64 + 512 + 4) × 4 bytes
    assert double - even == 3 * 1024 * (64 + 4 * 128 + 4) * 4
    assert main(["plan", "moe", "preset=cpu", "--system", "polaris", "--expert-imbalance", "0.5"]) != 0
    said = capsys.readouterr()
    assert "--expert-imbalance 0.5: the busiest rank receives at least the mean" in said.out + said.err


# Tensor parallelism: attention, the dense SwiGLU and the ends halved (wte and lm_head: 33 rows of 65 on rank 0); each
# MoE layer's routed experts and shared expert halved by their hidden width, its router whole on every tp rank
TP_ENDS = 33 * 64 + 64 + 33 * 64
TP_ATTENTION = 64 + 64 * 64 // 2 + 2 * (32 * 64 // 2) + 64 * 64 // 2 + 64
TP2 = TP_ENDS + TP_ATTENTION + 3 * 192 * 64 // 2 + 3 * (TP_ATTENTION + 512 + 196_608 // 2 + 3 * 128 * 64 // 2)


def test_under_tp_every_expert_is_cut_by_its_hidden_width():
    """ddp × tp 2 on 2 ranks: 381,120 elements, half of the experts' 3 × 196,608 among them; the untied embedding's
    gradient arrives whole (tensor_parallel.WHOLE_GRADIENTS: 32 rows of 64 more than its shard). fsdp × tp 2 on 4
    ranks: FSDP2 halves each tp-local tensor's dim 0 (17 of wte's and lm_head's 33 rows), experts included."""
    polaris = machines.from_system(systems.get("polaris"))
    cfg, facts = facts_of("train.backend=ddp", "parallel.tp=2")
    memory = predict(facts, cfg, ParallelDims.from_config(cfg, 2, 2), polaris).memory
    assert TP2 == 381_120
    assert (memory["params"], memory["grads"], memory["optimizer"]) == (4 * TP2, 4 * (TP2 + 32 * 64), 8 * TP2)
    cfg, facts = facts_of("train.backend=fsdp", "parallel.tp=2")
    memory = predict(facts, cfg, ParallelDims.from_config(cfg, 4, 4), polaris).memory
    assert memory["params"] == memory["grads"] == 4 * (TP2 // 2 + 2 * 32)


def test_under_pp_each_stage_holds_and_keeps_its_own_moe_layers():
    """pp 2 splits the 4 blocks [0, 1] | [2, 3] (the embedding and the head weigh a block each): stage 0 holds the
    dense block and one MoE block, stage 1 two MoE blocks; each keeps for backward, runs and exchanges only its own."""
    cfg, facts = facts_of("train.backend=ddp", "parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.ep=1")
    dims = ParallelDims.from_config(cfg, 2, 2)
    first, last = shares.stage_shares(facts.model, facts.split, dims, "ddp", schedule="gpipe",
                                      experts=facts.shape.moe.module)
    assert (first.parts, last.parts) == (((0, 1),), ((2, 3),))
    assert (first.params, last.params) == (65 * 64 + 49_280 + 234_112, 2 * 234_112 + 64 + 65 * 64)
    machine = machines.from_system(systems.get("polaris"))
    dense, block_input, tokens = 1000.0, 10.0, 512
    moe_block = experts.moe_block_bytes(facts, cfg, dims, tokens, machine)
    assert experts.kept_activations(facts, cfg, dims, tokens, dense, block_input, machine, first.parts) == (
        dense + moe_block, moe_block)
    kept, _ = experts.kept_activations(facts, cfg, dims, tokens, dense, block_input, machine, last.parts)
    assert kept == 2 * moe_block
    whole = experts.expert_matmul_s(facts, cfg, dims, tokens, machine, "fp32")
    assert experts.expert_matmul_s(facts, cfg, dims, tokens, machine, "fp32", first.parts) == pytest.approx(whole / 3)
    # activation checkpointing counts each stage's blocks from its first (parallel/checkpointing.py)
    selective, _ = facts_of("train.activation_checkpointing=selective", "train.ac_every=3")
    assert experts.checkpointed_layers(selective, ((0, 1), (2, 3))) == {0, 2}
    assert experts.checkpointed_layers(selective, ((0, 1, 2, 3),)) == {0, 3}


def test_under_op_level_checkpointing_each_block_keeps_its_matmul_and_attention_outputs():
    """Per token (the module docstring's shapes; each count checked against autograd and the checkpoint's cache in
    tests/unit/test_activation_checkpointing.py): every block its input 64, q, k, v, o 192 and attention's output
    and log-sum-exp 64 + 4; the dense block its SwiGLU's 192 + 192 + 64; an MoE block its router 8, shared expert
    128 + 128 + 64, and per routed row (N·k of them without ep) its experts' gate, up, down 128 + 128 + 64."""
    cfg, facts = facts_of("train.activation_checkpointing=op")
    tokens, machine = 8 * cfg.model.block_size, machines.from_system(systems.get("polaris"))
    dims = ParallelDims.resolve(1)
    attention = 64 + 192 + 68
    dense, moe = attention + 448, attention + 8 + 320 + 2 * 320
    kept, _ = experts.kept_activations(facts, cfg, dims, tokens, 0.0, 0.0, machine)
    assert kept == (dense + 3 * moe) * tokens * 4
    assert experts.checkpointed_layers(cfg, ((0, 1), (2, 3))) == {0, 1, 2, 3}  # its exchanges all run again


def test_under_tp_an_moe_block_cuts_its_attention_half_and_its_experts_hidden_tensors():
    """What an MoE block saves at tp 2: its attention half (the Llama block's count without the SwiGLU: 11 × 64 +
    4 heads + half a head + 2 = 718 a token) cut as a dense block's is (sequence parallel: the two gathered inputs
    whole, the rest halved); of the MoE layer's part, the shared expert's four hidden tensors (4 × 128 a token) and
    each routed row's (4 × 128, all of the rank's tokens routed: 512 × 2 rows) halved, the rest whole."""
    machine = machines.from_system(systems.get("polaris"))
    cfg, facts = facts_of("train.backend=ddp", "parallel.tp=2")
    moe, tokens = facts.shape.moe, 512
    assert (moe.attention_per_token, moe.shared_hidden) == (718, 128)
    one = experts.moe_block_bytes(facts, cfg, ParallelDims(world_size=2), tokens, machine)
    two = experts.moe_block_bytes(facts, cfg, ParallelDims.from_config(cfg, 2, 2), tokens, machine)
    attention = 718 - (2 * 64 + (718 - 2 * 64) / 2)
    assert one - two == (attention + 2 * 128) * tokens * 4 + tokens * 2 * (2 * 128) * 4
    # and so is their compute: every tp rank runs the same rows through half of each expert
    assert experts.expert_matmul_s(facts, cfg, ParallelDims.from_config(cfg, 2, 2), tokens, machine, "fp32") < \
        experts.expert_matmul_s(facts, cfg, ParallelDims(world_size=2), tokens, machine, "fp32")


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_under_tp_an_moe_block_reduces_its_stream_as_a_dense_block_and_its_gates_gradient(sequence_parallel):
    """The calls a step on 2 ranks made (counted by the profiler, clipping off). Under sequence parallel each of the 4
    blocks gathers its stream and reduce-scatters it twice forward and twice backward, the embedding's output and
    the head's input once each: 18 apiece, of 512 tokens × 64 fp32 = 131,072 bytes. Without it each block
    all-reduces its two sublayers' outputs forward and, backward, the inputs of its column-parallel linears (q, k and
    v; in the dense first block the MLP's up and gate projections, in an MoE block its whole input once): 8 + 5 +
    3 × 4 + the ends' 2 = 27. Each of the 3 MoE layers' backward also all-reduces its gates' gradient, 512 × 2 fp32;
    under loss parallel the loss sums 3 figures a token, and sequence parallel's 9 norms' gradients are summed."""
    cfg, facts = facts_of("train.backend=ddp", "parallel.tp=2", f"parallel.sequence_parallel={sequence_parallel}",
                          f"parallel.loss_parallel={sequence_parallel}", "optimizer.grad_clip=0.0")
    cost = predict(facts, cfg, ParallelDims.from_config(cfg, 2, 2), machines.from_system(systems.get("polaris")))
    stream, gates = 512 * 64 * 4, 512 * 2 * 4
    if sequence_parallel:
        assert cost.comm_calls == {"all_gather": 18, "reduce_scatter": 18, "all_reduce": 3 + 9 + 3}
        assert cost.comm_bytes["tp"] == 36 * stream + 3 * 512 * 4 + 9 * 64 * 4 + 3 * gates
    else:  # the logits gathered whole for the loss
        assert cost.comm_calls == {"all_reduce": 27 + 3, "all_gather": 1}
        assert cost.comm_bytes["tp"] == 27 * stream + 3 * gates + 512 * facts.head_features * 4


def test_under_cp_the_balance_loss_sums_over_the_cp_ranks():
    """Each MoE layer's forward all-reduces 8 counts, 8 probability sums and the token count (68 bytes) over cp, its
    backward once more, and under full checkpointing its recomputed forward again: 3 layers × 3 a micro-batch."""
    cfg, facts = facts_of("train.backend=fsdp", "parallel.cp=2", "train.activation_checkpointing=full")
    dims = ParallelDims.from_config(cfg, 2, 2)
    assert experts.balance_loss_collectives(facts, cfg, dims, None, 2) == [("all_reduce", "cp", 68, 2 * 9)]
    assert experts.balance_loss_collectives(facts, cfg, ParallelDims(world_size=2), None, 2) == []
