"""The mixture-of-experts decoder: routing against a per-token loop, the dropless combine against its definition,
capacity drops counted on a constructed routing, the balance loss and the bias update against their formulas, the
grouped-GEMM path against the loop, the parameter counts against the analytic count, and the rules."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from meshtrain import registry
from meshtrain.config import ConfigError, load_config
from meshtrain.models.moe.model import MoE, MoEConfig, MoEDecoder
from meshtrain.models.moe.router import (
    Router,
    balance_loss,
    capacity,
    capacity_keep,
    load_entropy,
    top_k_experts,
)
from meshtrain.models.moe.workload import MoEWorkload

TINY = dict(block_size=16, vocab_size=65, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64, n_experts=4,
            top_k=2, expert_hidden=48)


def layer(**overrides) -> MoE:
    torch.manual_seed(0)
    moe = MoE(MoEConfig(**{**TINY, **overrides}))
    with torch.no_grad():  # a router of some spread, so that no two scores tie by accident
        moe.router.gate.weight.normal_(0, 0.5)
    return moe


def expert(moe: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e's SwiGLU, from its own slices of the stacked weights."""
    w = moe.experts
    return (F.silu(x @ w.c_gate[e].t()) * (x @ w.c_fc[e].t())) @ w.c_proj[e].t()


@pytest.mark.parametrize("score, norm_topk", [("softmax", True), ("softmax", False), ("sigmoid", True)])
def test_router_picks_each_tokens_top_k_as_a_per_token_loop_does(score, norm_topk):
    torch.manual_seed(1)
    router = Router(8, 5, 2, score=score, norm_topk=norm_topk, route_scale=2.5)
    router.expert_bias.copy_(torch.tensor([0.0, 0.3, -0.2, 0.0, 0.1]))
    x = torch.randn(7, 8)
    routing = router(x)
    for t in range(7):
        logits = [sum(router.gate.weight[e, i].item() * x[t, i].item() for i in range(8)) for e in range(5)]
        scores = ([math.exp(v) / sum(math.exp(u) for u in logits) for v in logits] if score == "softmax"
                  else [1 / (1 + math.exp(-v)) for v in logits])
        ranked = sorted(range(5), key=lambda e: (-(scores[e] + router.expert_bias[e].item()), e))[:2]
        gates = [scores[e] for e in ranked]  # the bias chose them; the gates are the scores without it
        if norm_topk:
            gates = [g / sum(gates) for g in gates]
        assert routing.experts[t].tolist() == ranked
        assert routing.gates[t].tolist() == pytest.approx([2.5 * g for g in gates], rel=1e-5)


def test_ties_go_to_the_lower_expert_index():
    ranking = torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.1, 0.7, 0.7, 0.2], [0.3, 0.3, 0.9, 0.3]])
    assert top_k_experts(ranking, 2).tolist() == [[0, 1], [1, 2], [2, 0]]
    router = Router(4, 6, 3)
    torch.nn.init.zeros_(router.gate.weight)  # every score equal: the first three experts, for every token
    assert router(torch.randn(5, 4)).experts.tolist() == [[0, 1, 2]] * 5


@pytest.mark.parametrize("matmul", ["loop", "grouped"])
def test_dropless_output_is_each_tokens_gated_sum_over_its_experts_plus_the_shared(matmul):
    moe = layer(n_shared_experts=2, expert_matmul=matmul)
    x = torch.randn(3, 5, 32)
    y = moe(x)
    flat = x.reshape(-1, 32)
    routing = moe.router(flat)
    for t in range(flat.shape[0]):
        want = moe.shared(flat[t]) + sum(routing.gates[t, j] * expert(moe, routing.experts[t, j].item(), flat[t])
                                         for j in range(2))
        torch.testing.assert_close(y.reshape(-1, 32)[t], want, atol=1e-6, rtol=1e-5)
    assert moe.tally.dropped.item() == 0 and moe.tally.assigned.sum().item() == 15 * 2 and moe.tally.tokens == 15


def test_capacity_keeps_first_choices_before_second_ones_then_token_order():
    # 4 tokens, top-2 of 3 experts; a limit of 2 per expert
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    keep = capacity_keep(experts, 3, limit=2)
    # expert 0: first choices of tokens 0, 1, 2 (the third over the limit), then token 3's second: kept are 0 and 1
    # expert 1: token 3's first choice, then second choices of tokens 0 and 2: kept are token 3's and token 0's
    # expert 2: token 1's second choice only
    assert keep.tolist() == [[True, True], [True, True], [False, False], [True, False]]
    assert capacity(tokens=4, top_k=2, n_experts=3, factor=0.75) == 2  # ceil(0.75 · 8 / 3)


@pytest.mark.parametrize("matmul", ["loop", "grouped"])
def test_capacity_drops_are_counted_and_add_nothing(matmul):
    moe = layer(capacity_factor=0.5, expert_matmul=matmul)
    x = torch.randn(2, 6, 32)
    y = moe(x).reshape(-1, 32)
    flat = x.reshape(-1, 32)
    routing = moe.router(flat)
    keep = capacity_keep(routing.experts, 4, capacity(12, 2, 4, 0.5))
    assert moe.tally.dropped.item() == (~keep).sum().item() > 0
    for t in range(12):
        want = torch.zeros(32)
        for j in range(2):
            if keep[t, j]:
                want = want + routing.gates[t, j] * expert(moe, routing.experts[t, j].item(), flat[t])
        torch.testing.assert_close(y[t], want, atol=1e-6, rtol=1e-5)


def test_grouped_and_loop_paths_give_the_same_outputs_and_gradients_on_cpu():
    results = []
    for matmul in ("loop", "grouped"):
        moe = layer(capacity_factor=0.75, n_shared_experts=1, expert_matmul=matmul)
        x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
        y = moe(x)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        results.append((y, x.grad, {n: p.grad for n, p in moe.named_parameters()}))
    (y0, dx0, g0), (y1, dx1, g1) = results
    torch.testing.assert_close(y1, y0, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dx1, dx0, atol=1e-6, rtol=1e-5)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-6, rtol=1e-5, msg=name)


def test_balance_loss_is_switchs_formula_on_a_hand_made_case():
    # 4 tokens, 2 experts, top-1: tokens 0-2 chose expert 0, token 3 expert 1
    scores = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.7, 0.3], [0.2, 0.8]])
    experts = torch.tensor([[0], [0], [0], [1]])
    f, p = [3 / 4, 1 / 4], [(0.9 + 0.6 + 0.7 + 0.2) / 4, (0.1 + 0.4 + 0.3 + 0.8) / 4]
    assert balance_loss(scores, experts).item() == pytest.approx(2 * (f[0] * p[0] + f[1] * p[1]))  # 1.2
    even = torch.full((6, 3), 1 / 3)
    assert balance_loss(even, torch.tensor([[0, 1], [1, 2], [2, 0]] * 2)).item() == pytest.approx(1.0)
    sigmoid = torch.tensor([[0.8, 0.2], [0.5, 0.5]])  # normalised per token first: [0.8, 0.2], [0.5, 0.5]
    assert balance_loss(sigmoid * 0.5, torch.tensor([[0], [1]]), "sigmoid").item() == pytest.approx(
        2 * (0.5 * 0.65 + 0.5 * 0.35))


def test_balance_loss_over_parts_of_a_forward_with_their_totals_is_the_whole_forwards():
    """What a context-parallel rank computes (its positions, the statistics summed with the other rank's) is the
    balance loss of the whole forward, value and gradient (the other part's sums enter as constants here)."""
    logits = torch.randn(10, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    experts = top_k_experts(logits.detach().softmax(-1), 2)
    whole = balance_loss(logits.softmax(-1), experts)
    whole.backward()
    parts = [slice(0, 6), slice(6, 10)]
    sums = [torch.cat([torch.bincount(experts[p].flatten(), minlength=4).float(), logits[p].softmax(-1).sum(0),
                       torch.tensor([float(p.stop - p.start)])]).detach() for p in parts]
    mine = logits.detach().requires_grad_()
    part = balance_loss(mine[parts[0]].softmax(-1), experts[parts[0]], total=lambda t: t + sums[1])
    part.backward()
    assert part.item() == pytest.approx(whole.item())
    torch.testing.assert_close(mine.grad[parts[0]], logits.grad[parts[0]])


def test_an_attached_loss_backpropagates_as_if_added_to_the_loss_with_its_weight():
    from meshtrain.parallel.auxiliary_loss import attach_loss

    w = torch.randn(3, requires_grad=True)
    h = w * 2
    out = attach_loss(h, (w ** 2).sum(), 0.25)
    assert torch.equal(out, h)
    out.sum().backward()
    torch.testing.assert_close(w.grad, 2 + 0.25 * 2 * w.detach())


def test_bias_update_moves_each_expert_by_gamma_toward_the_mean_load():
    router = Router(4, 4, 2)
    router.update_bias(torch.tensor([10, 2, 6, 6]), rate=0.01)  # mean 6: 0 over, 1 under, 2 and 3 at the mean
    assert router.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0])
    router.update_bias(torch.tensor([1, 1, 9, 1]), rate=0.01)
    assert router.expert_bias.tolist() == pytest.approx([0.0, 0.02, -0.01, 0.01])


def test_balance_loss_joins_the_gradient_but_not_the_loss_value():
    idx = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(0))
    grads, losses = {}, {}
    for coef in (0.0, 0.5):
        torch.manual_seed(0)
        model = MoEDecoder(MoEConfig(**TINY, balance_coef=coef))
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        losses[coef], grads[coef] = loss.item(), model.transformer.h["0"].mlp.router.gate.weight.grad.clone()
    assert losses[0.5] == losses[0.0]  # the logged loss is the language model's
    torch.testing.assert_close(grads[0.5] - grads[0.0], 0.5 * _aux_gradient(idx), atol=1e-7, rtol=1e-4)


def _aux_gradient(idx: torch.Tensor) -> torch.Tensor:
    """The gradient of Σ_layers balance loss alone on layer 0's router (the model's forward, its terms kept)."""
    torch.manual_seed(0)
    model = MoEDecoder(MoEConfig(**TINY))
    model.train()
    captured = []
    for block in model.transformer.h.values():
        block.mlp.register_forward_hook(lambda m, _, __: captured.append(m.balance_loss))
    model(idx[:, :-1], idx[:, 1:])
    torch.stack(captured).sum().backward()
    return model.transformer.h["0"].mlp.router.gate.weight.grad


def test_activation_checkpointing_counts_routing_once_and_trains_alike():
    idx = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(0))
    tallies, grads = [], []
    for wrapped in (False, True):
        torch.manual_seed(0)
        model = MoEDecoder(MoEConfig(**TINY))
        if wrapped:
            for name in list(model.transformer.h):
                model.transformer.h[name] = checkpoint_wrapper(model.transformer.h[name])
        model(idx[:, :-1], idx[:, 1:])[1].backward()  # backward recomputes each wrapped block's forward
        tallies.append([m.tally.assigned.tolist() for m in model.moe_layers()])
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert tallies[0] == tallies[1] and sum(tallies[0][0]) == 2 * 15 * 2
    torch.testing.assert_close(grads[1], grads[0])


def test_total_and_active_parameters_and_flops_against_the_analytic_count():
    c = MoEConfig(**{**TINY, "n_layer": 3}, n_shared_experts=1, moe_layers=(1, 2))
    model = MoEDecoder(c)
    C, V, F_, H, E, k, kv = 32, 65, 64, 48, 4, 2, 2 * 8
    attention = C * C + 2 * C * kv + C * C + 2 * C  # q, k, v, o and the two norms
    dense, moe = attention + 3 * C * F_, attention + E * C + 3 * E * C * H + 3 * C * H  # router, experts, shared
    total = dense + 2 * moe + C + C * V  # the final norm, the untied head (the embedding left out)
    assert model.num_params() == total
    assert model.num_params(non_embedding=False) == total + V * C
    active = total - 2 * (E - k) * 3 * C * H
    assert model.num_active_params() == active
    assert model.flops_per_token() == 6 * active + 12 * 3 * 4 * 8 * 16


def test_mixtral_preset_counts_the_published_parameters():
    """Mixtral-8x7B's paper: 47B parameters, 13B active (46.7B and 12.9B in its model card), with a 32000 vocabulary."""
    cfg = load_config(["preset=mixtral_8x7b"], "moe")
    with torch.device("meta"):
        model = registry.get("moe").build_model(cfg, {"meta": {"vocab_size": 32000}})
    assert model.num_params(non_embedding=False) / 1e9 == pytest.approx(46.70, abs=0.01)
    assert model.num_params(non_embedding=False, active=True) / 1e9 == pytest.approx(12.88, abs=0.01)


def test_workload_sums_the_step_and_moves_the_bias_then_reports_the_shares():
    """The workload's hooks without data: after a step the bias moves by the step's load, the tallies start again;
    an evaluation's figures come from its own forwards (one process: the sum over ranks is the tally itself)."""
    torch.manual_seed(0)
    model = MoEDecoder(MoEConfig(**TINY, capacity_factor=0.5))
    workload = object.__new__(MoEWorkload)  # its routing part alone
    workload.cfg = load_config(["preset=cpu", "model.top_k=2", "model.bias_update_rate=0.1"], "moe")
    workload.moe, workload.layers, workload.routed_group = model.moe_layers(), [0, 1], None
    workload.pp_group = None
    workload.device = torch.device("cpu")
    workload.model, workload.a2a_mark, workload.a2a_steps = model, 0, 0  # no ep: nothing exchanged
    model(torch.randint(0, 65, (2, 15)))
    load = workload.moe[0].tally.assigned.float()
    workload.after_step()
    assert workload.a2a_steps == 1
    torch.testing.assert_close(workload.moe[0].router.expert_bias, 0.1 * torch.sign(load.mean() - load))
    assert all(m.tally.assigned is None for m in workload.moe)
    model.eval()
    inputs = []  # what each MoE layer took (the second's input is the first block's output)
    hooks = [m.register_forward_hook(lambda _m, args, _out: inputs.append(args[0].reshape(-1, 32)))
             for m in workload.moe]
    with torch.no_grad():
        model(torch.randint(0, 65, (3, 16)))
    for hook in hooks:
        hook.remove()
    figures = workload.routing_figures()
    shares = torch.tensor(figures["expert_share"]["share"])
    assert shares.shape == (2, 4) and shares.sum(dim=1).tolist() == pytest.approx([1.0, 1.0])
    assert figures["expert_share_min"] == shares.min().item() and figures["expert_share_max"] == shares.max().item()
    assert figures["expert_entropy"] == pytest.approx(load_entropy(shares).mean().item())
    dropped = sum(m.tally.dropped.item() for m in workload.moe)
    assert figures["dropped_tokens"] == dropped > 0 and figures["dropped_frac"] == pytest.approx(dropped / (2 * 48 * 2))
    # one forward here: each layer's balance loss over the evaluation's tokens is that forward's, as training has it
    with torch.no_grad():
        want = [balance_loss(*m.router(x)[:2]).item() for m, x in zip(workload.moe, inputs, strict=True)]
    assert figures["balance_loss"] == pytest.approx(sum(want) / 2, rel=1e-6)


def test_the_evaluations_balance_loss_does_not_depend_on_how_its_tokens_were_cut_into_forwards():
    """A pipeline evaluates a batch microbatch by microbatch (and data parallelism on several ranks): the figure is
    that of all the tokens together, so half-batches give the whole batch's, to float rounding."""
    figures = []
    for pieces in (1, 2, 4):
        torch.manual_seed(0)
        model = MoEDecoder(MoEConfig(**TINY)).eval()
        workload = object.__new__(MoEWorkload)
        workload.cfg = load_config(["preset=cpu", "model.top_k=2"], "moe")
        workload.moe, workload.layers, workload.routed_group, workload.pp_group = model.moe_layers(), [0, 1], None, None
        workload.device = torch.device("cpu")
        with torch.no_grad():
            for part in torch.randint(0, 65, (4, 16), generator=torch.Generator().manual_seed(1)).chunk(pieces):
                model(part)
        figures.append(workload.routing_figures())
    assert figures[1]["balance_loss"] == pytest.approx(figures[0]["balance_loss"], rel=1e-6)
    assert figures[2]["balance_loss"] == pytest.approx(figures[0]["balance_loss"], rel=1e-6)
    assert figures[2]["expert_share"] == figures[0]["expert_share"]


def test_entropy_of_the_load_is_one_when_even_and_zero_on_one_expert():
    assert load_entropy(torch.tensor([[0.25] * 4, [1.0, 0, 0, 0]])).tolist() == pytest.approx([1.0, 0.0])


@pytest.mark.parametrize("overrides, message", [
    (["model.top_k=9"], "model.top_k=9 is more than model.n_experts=8"),
    (["model.capacity_factor=0"], "model.capacity_factor=0.0 must be above 0"),
    (["model.capacity_factor=-1.5"], "model.capacity_factor=-1.5 must be above 0"),
    (["model.n_experts=1", "model.top_k=1"], "model.n_experts=1: a mixture needs 2 experts or more"),
    (["model.first_dense=4"], "model.first_dense=4 with model.n_layer=4 leaves no MoE layer"),
    (["model.bias_update_rate=-0.1"], "model.bias_update_rate=-0.1 must be 0 or more"),
    (["model.score=relu"], "model.score='relu': choose "),
    (["model.n_expert=4"], "unknown key 'model.n_expert': did you mean model.n_experts?"),
    (["parallel.cp=2", "model.capacity_factor=1.25"], "model.capacity_factor=1.25 with parallel.cp=2: the capacity "
                                                        "limits each expert per forward in token order"),
    (["parallel.tp=4", "model.expert_hidden=66"], "model.expert_hidden=66 is not divisible by parallel.tp=4: tensor "
                                                  "parallelism cuts every expert's hidden width into tp equal slices; "
                                                  "set model.expert_hidden to a multiple of 4 (e.g. 64 or 68)"),
])
def test_bad_settings_are_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(["preset=cpu", *overrides], "moe")


def test_registered_with_its_presets_and_shaped_for_the_planner():
    from dataclasses import replace

    from meshtrain.plan.systems import PlanError
    from meshtrain.plan.workload import ModelFacts

    spec = registry.get("moe")
    assert "moe" in registry.names() and spec.text
    presets = {p.stem for p in spec.presets.glob("*.yaml")}
    assert presets == {"cpu", "shakespeare", "mixtral_8x7b", "qwen3_30b_a3b", "deepseek_v3"}
    cfg = load_config(["preset=cpu"], "moe")
    shape = spec.shape(cfg)
    # mlp_hidden: the dense layer's width, which tp splits (the experts' hidden widths too: ExpertShape.hidden)
    assert (shape.experts, shape.mlp_hidden, shape.parallelisms) == (8, 192, frozenset({"ep", "tp", "cp", "pp"}))
    model = spec.build_model(cfg, {"meta": {"vocab_size": 65}})
    assert model.config.moe_layers == (1, 2, 3) and type(model.transformer.h["0"].mlp).__name__ == "SwiGLU"
    assert (shape.moe.layers, shape.moe.top_k, shape.moe.hidden, shape.moe.module) == ((1, 2, 3), 2, 128, "mlp.experts")
    assert ModelFacts.of(cfg, {"meta": {"vocab_size": 65}}).shape.moe == shape.moe
    # a model with experts but no ExpertShape is refused, saying what to add, rather than priced as a dense model
    original = spec.shape
    object.__setattr__(spec, "shape", lambda c: replace(original(c), moe=None))
    try:
        with pytest.raises(PlanError, match="gives no `moe`"):
            ModelFacts.of(cfg, {"meta": {"vocab_size": 65}})
    finally:
        object.__setattr__(spec, "shape", original)
    every_second = load_config(["preset=cpu", "model.first_dense=0", "model.moe_every=2"], "moe")
    assert spec.build_model(every_second, {"meta": {"vocab_size": 65}}).config.moe_layers == (0, 2)
