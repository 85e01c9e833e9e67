"""A mixture-of-experts decoder on text: the Llama-style decoder whose feed-forward in every (or every k-th) layer is
a router over E SwiGLU experts, top-k, with optional shared experts.

    model.py        the decoder (no distributed code): MoE layers in the Llama's blocks
    router.py       routing (softmax or sigmoid, top-k, the tie rule), balance loss, bias update, capacity
    experts.py      the routed experts' stacked weights; their matmuls as one grouped GEMM or a loop
    workload.py     the language model's workload, plus the routing's counts summed over the data-parallel ranks:
                    the bias update after each optimizer step, and the routing figures of each evaluation
    parallelize.py  its layout: every language model's (parallel/lm_layout.py), with expert parallelism composed
                    with data, tensor, context and pipeline parallelism
    config.py       its run config and rules; presets/ the YAML presets (cpu, shakespeare, published shapes)
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from meshtrain.models import model_spec
from meshtrain.models.language import resolve_loss_chunks
from meshtrain.models.llama import SPLIT, block_activations
from meshtrain.models.llama.config import ffn_hidden
from meshtrain.models.moe.config import MoERunConfig, expert_hidden, moe_layers, validate
from meshtrain.nn.activation_counts import AutocastActivations
from meshtrain.registry import ExpertShape, ModelShape

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig

_KEYS = MappingProxyType({"layers": "model.n_layer", "heads": "model.n_head", "kv_heads": "model.n_kv_head",
                          "mlp_hidden": "model.ffn_hidden", "tokens": "model.block_size",
                          "batch_size": "model.batch_size", "dropout": "model.dropout",
                          "experts": "model.n_experts"})


def _shape(cfg: MoERunConfig) -> ModelShape:
    m = cfg.model
    saved, autocast = block_activations(m)  # the dense layers' (first_dense, and between MoE layers)
    # mlp_hidden: the dense layers' width, which tensor parallelism splits (the experts' hidden widths too: moe).
    return ModelShape(width=m.n_embd, layers=m.n_layer, heads=m.n_head, kv_heads=m.n_kv_head,
                      mlp_hidden=ffn_hidden(m), tokens=m.block_size, causal=True, batch_size=m.batch_size,
                      dropout=m.dropout, keys=_KEYS, parallelisms=frozenset({"ep", "tp", "cp", "pp"}),
                      experts=m.n_experts,
                      activations_per_token=saved, autocast_activations=autocast, moe=_experts_shape(m))


# What an MoE block saves for backward (no dropout), as autograd's saved-tensor hooks count it
# (tests/unit/test_plan_moe.py), in elements (an int64 as two):
#   per token of the rank   the attention half of the Llama block (11 × width, a log-sum-exp per head, two rstds, the
#                           rotary table counted per token as the Llama's count does, half a head), the router's scores
#                           (E) and top-k sort's int64 order (2 E), the shared experts' SwiGLU (4 × their hidden), per
#                           choice the expert output it gathers back (width) and five elements of int64 indices and
#                           gates, the top-k normalisation's k + 1, sigmoid's sum
#   per routed row          the expert's input (width) and its SwiGLU's four hidden tensors, on the rank that computes
#                           it; under expert parallelism two int64 orders more (arrival and return), 4 elements
# Under autocast (measured by dtype, tests/unit/test_plan_moe.py) the norms' inputs and statistics, the router's
# scores and gates, each choice's fp32 copy of its expert output and the int64 indices stay 32-bit; the shared and
# routed experts' inputs and hidden tensors are 16-bit; with 16-bit weights (FSDP2's mixed precision) three more
# widths are 16-bit, with fp32 weights the linears' own casts of their inputs: 5 widths, one per choice, two for the
# shared experts; attention keeps q, k, v and its output (4 × width) in the dtype it runs in.
def _experts_shape(m) -> ExpertShape:
    k, width, hidden, shared = m.top_k, m.n_embd, expert_hidden(m), m.n_shared_experts * expert_hidden(m)
    routing = m.n_head + 2 + m.n_experts + (k + 1 if m.norm_topk else 0) + (1 if m.score == "sigmoid" else 0)
    per_token = 11 * width + m.n_embd // m.n_head // 2 + 4 * shared + 2 * m.n_experts + k * (width + 5) + routing
    fp32 = 4 * width + routing + 2 * m.n_experts + k * (width + 1) + 4 * k
    casts = (5 + k + (2 if shared else 0)) * width  # fp32 weights: each linear's own cast of its input, per choice too
    autocast = AutocastActivations(fp32=fp32, low=casts + 4 * shared, attention=4 * width, fp32_16bit_weights=fp32,
                                   low_16bit_weights=3 * width + 4 * shared)
    # The attention half: the dense block's count without its SwiGLU (its four hidden tensors; under autocast with
    # fp32 weights the gate's and up's casts of their input, with 16-bit weights their one shared input)
    dense, dense_autocast = block_activations(m)
    mlp = 4 * ffn_hidden(m)
    attention = dense_autocast._replace(low=dense_autocast.low - 2 * width - mlp,
                                        low_16bit_weights=dense_autocast.low_16bit_weights - width - mlp)
    return ExpertShape(layers=tuple(moe_layers(m)), top_k=k, hidden=hidden, shared_hidden=shared, module="mlp.experts",
                       capacity_factor=m.capacity_factor, saved_per_token=per_token, saved_per_row=width + 4 * hidden,
                       saved_per_row_ep=4, autocast_per_token=autocast, autocast_per_row=width + 4 * hidden,
                       attention_per_token=dense - mlp, attention_autocast=attention)


def build_model(cfg: MoERunConfig, data_facts: dict):
    """The decoder of a run config; the vocabulary comes from the data's meta.json (data_facts["meta"])."""
    from meshtrain.models.moe.model import MoEConfig, MoEDecoder

    m = cfg.model
    return MoEDecoder(MoEConfig(
        block_size=m.block_size, vocab_size=data_facts["meta"]["vocab_size"], n_layer=m.n_layer, n_head=m.n_head,
        n_kv_head=m.n_kv_head, n_embd=m.n_embd, ffn_hidden=ffn_hidden(m), rope_theta=m.rope_theta, dropout=m.dropout,
        loss_chunks=resolve_loss_chunks(cfg.train.loss_chunks, data_facts["meta"]["vocab_size"]),
        n_experts=m.n_experts, top_k=m.top_k, expert_hidden=expert_hidden(m), n_shared_experts=m.n_shared_experts,
        moe_layers=tuple(moe_layers(m)),
        score=m.score, norm_topk=m.norm_topk, route_scale=m.route_scale, balance_coef=m.balance_coef,
        capacity_factor=m.capacity_factor, expert_matmul=m.expert_matmul))


def _workload(cfg: RunConfig, info, dims):
    from meshtrain.models.moe.parallelize import build_moe_layout
    from meshtrain.models.moe.workload import MoEWorkload

    return MoEWorkload(cfg, info, dims, build_model=build_model, build_layout=build_moe_layout)


def _build_layout(model, cfg, dims, mesh, device, rank: int):
    from meshtrain.models.moe.parallelize import build_moe_layout

    return build_moe_layout(model, cfg, dims, mesh, device, rank)


SPEC = model_spec(__file__, language_model=True, name="moe",
                  summary="a mixture-of-experts decoder on text (Llama-style, top-k routed SwiGLU experts)",
                  run_config=MoERunConfig, workload=_workload, shape=_shape, validate=validate,
                  build_model=build_model, stage_split=SPLIT, build_layout=_build_layout,
                  legend=MappingProxyType({
                      "balance_loss": "the routers' balance loss E·Σ f_i·P_i (1: even) over all the evaluation's "
                                      "tokens, mean over MoE layers",
                      "expert_share_min": "the smallest share of a layer's token assignments one expert took "
                                          "(even: 1/n_experts), over every MoE layer, at evaluation",
                      "expert_share_max": "the largest such share",
                      "expert_entropy": "the entropy of each layer's expert shares / log(n_experts), mean over "
                                        "layers (1: even load, 0: one expert takes all)",
                      "dropped_tokens": "token assignments dropped by model.capacity_factor at evaluation (0: "
                                        "dropless)",
                      "dropped_frac": "dropped_tokens / all assignments (tokens × top_k × MoE layers)",
                      "a2a_mib": "MiB a training step's expert-parallel all-to-alls sent (dispatch, combine, their "
                                 "gradients), mean per rank, since the last evaluation (parallel.ep > 1)",
                  }))
