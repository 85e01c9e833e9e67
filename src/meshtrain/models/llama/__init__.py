"""A Llama-style decoder (RMSNorm, rotary positions, SwiGLU, grouped-query attention, untied head) on text.

    model.py        the decoder (no distributed code)
    parallelize.py  its structure for the pipeline and its tensor-parallel plan; the layout is every language
                    model's (parallel/lm_layout.py), the workload too (models/language/workload.py)
    config.py       its run config and rules; presets/ the YAML presets

Added to meshtrain by this folder and one line in registry.BUILT_IN: the proof that a model needs nothing else.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from meshtrain.models import model_spec
from meshtrain.models.language import resolve_loss_chunks
from meshtrain.models.llama.config import LlamaRunConfig, ffn_hidden, validate
from meshtrain.nn.activation_counts import AutocastActivations
from meshtrain.parallel.pipeline_schedules import StageSplit
from meshtrain.registry import ModelShape

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig

# The output head is its own matrix: nothing tied across the first and last stages.
SPLIT = StageSplit(blocks="transformer.h", first=("transformer.wte", "transformer.drop"),
                   last=("transformer.ln_f", "lm_head"))

_KEYS = MappingProxyType({"layers": "model.n_layer", "heads": "model.n_head", "kv_heads": "model.n_kv_head",
                          "mlp_hidden": "model.ffn_hidden", "tokens": "model.block_size",
                          "batch_size": "model.batch_size", "dropout": "model.dropout"})


# Elements a block saves for its backward per token (fp32, no dropout), as autograd's saved-tensor hooks count them
# (tests/unit/test_registry.py): 11 × width for the norms, projections, rotations and attention, 4 × ffn_hidden for
# the SwiGLU's gate, up, silu and product, a log-sum-exp per head, half a head of rotary table, two rstds.
# Under autocast (nn.activation_counts.AutocastActivations): the two RMSNorms keep their input and output in fp32
# (4 × width) with the log-sum-exp and rstds (the rotary table is per position, not per token: left out); the
# SwiGLU's four hidden tensors are 16-bit, and so are the linears' inputs: six casts (q, k, v, o, gate, up) with
# fp32 weights, three shared inputs with 16-bit ones; attention keeps q, k, v (k and v repeated to every head) and
# its output.


def block_activations(m) -> tuple[int, AutocastActivations]:
    """What one dense block saves per token (the comment above): fp32 elements, and by dtype under autocast."""
    return (11 * m.n_embd + 4 * ffn_hidden(m) + m.n_head + m.n_embd // m.n_head // 2 + 2,
            AutocastActivations(fp32=4 * m.n_embd + m.n_head + 2, low=6 * m.n_embd + 4 * ffn_hidden(m),
                                attention=4 * m.n_embd, fp32_16bit_weights=4 * m.n_embd + m.n_head + 2,
                                low_16bit_weights=3 * m.n_embd + 4 * ffn_hidden(m)))


def _shape(cfg: LlamaRunConfig) -> ModelShape:
    m = cfg.model
    saved, autocast = block_activations(m)
    return ModelShape(width=m.n_embd, layers=m.n_layer, heads=m.n_head, kv_heads=m.n_kv_head, mlp_hidden=ffn_hidden(m),
                      tokens=m.block_size, causal=True, batch_size=m.batch_size, dropout=m.dropout, keys=_KEYS,
                      activations_per_token=saved, autocast_activations=autocast)


def build_model(cfg: LlamaRunConfig, data_facts: dict):
    """The decoder of a run config; the vocabulary comes from the data's meta.json (data_facts["meta"])."""
    from meshtrain.models.llama.model import Llama, LlamaConfig

    m = cfg.model
    return Llama(LlamaConfig(block_size=m.block_size, vocab_size=data_facts["meta"]["vocab_size"], n_layer=m.n_layer,
                             n_head=m.n_head, n_kv_head=m.n_kv_head, n_embd=m.n_embd, ffn_hidden=ffn_hidden(m),
                             rope_theta=m.rope_theta, dropout=m.dropout,
                             loss_chunks=resolve_loss_chunks(cfg.train.loss_chunks, data_facts["meta"]["vocab_size"])))


def _workload(cfg: RunConfig, info, dims):
    from meshtrain.models.language.workload import LanguageModelWorkload
    from meshtrain.models.llama.parallelize import build_llama_layout

    return LanguageModelWorkload(cfg, info, dims, build_model=build_model, build_layout=build_llama_layout)


def _build_layout(model, cfg: RunConfig, dims, mesh, device, rank: int):
    from meshtrain.models.llama.parallelize import build_llama_layout

    return build_llama_layout(model, cfg, dims, mesh, device, rank)


SPEC = model_spec(__file__, language_model=True, name="llama",
                  summary="a Llama-style decoder on text (GPT-2 BPE Shakespeare by default)",
                  run_config=LlamaRunConfig, workload=_workload, shape=_shape, validate=validate,
                  build_model=build_model, stage_split=SPLIT,
                  build_layout=_build_layout)
