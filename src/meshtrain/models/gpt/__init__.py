"""The GPT language model: a GPT-2-style decoder trained on token windows (char-level or GPT-2 BPE text).

    model.py        the decoder (no distributed code), GPT-2 init, from_pretrained, generate
    parallelize.py  its structure for the pipeline (tied embedding) and its tensor-parallel plan; the layout is
                    every language model's (parallel/lm_layout.py)
    config.py       its run config and rules; presets/ the YAML presets
The workload (token windows, evaluation, samples) is every language model's: models/language/workload.py.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from meshtrain.config import ConfigError
from meshtrain.models import model_spec
from meshtrain.models.gpt.config import GPTRunConfig, validate
from meshtrain.models.language import resolve_loss_chunks
from meshtrain.nn.activation_counts import block_activations, block_autocast_activations
from meshtrain.parallel.pipeline_schedules import StageSplit
from meshtrain.registry import ModelShape

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig

# Split by pipeline stages, lm_head keeps its own copy of the tied embedding; a checkpoint from any layout has the
# embedding's optimizer state, which the copy's equals (see parallel.state_dict).
SPLIT = StageSplit(blocks="transformer.h", first=("transformer.wte", "transformer.wpe", "transformer.drop"),
                   last=("transformer.ln_f", "lm_head"), tied=("lm_head.weight", "transformer.wte.weight"))


def _workload(cfg: RunConfig, info, dims):
    from meshtrain.models.gpt.parallelize import build_gpt_layout
    from meshtrain.models.language.workload import LanguageModelWorkload

    return LanguageModelWorkload(cfg, info, dims, build_model=build_model, build_layout=build_gpt_layout)


_KEYS = MappingProxyType({"layers": "model.n_layer", "heads": "model.n_head", "kv_heads": "model.n_head",
                          "mlp_hidden": "4 × model.n_embd", "tokens": "model.block_size",
                          "batch_size": "model.batch_size", "dropout": "model.dropout"})


def _shape(cfg: GPTRunConfig) -> ModelShape:
    m = cfg.model
    return ModelShape(width=m.n_embd, layers=m.n_layer, heads=m.n_head, kv_heads=m.n_head, mlp_hidden=4 * m.n_embd,
                      tokens=m.block_size, causal=True, batch_size=m.batch_size, dropout=m.dropout, keys=_KEYS,
                      activations_per_token=block_activations(m.n_embd, m.n_head, 4 * m.n_embd),
                      autocast_activations=block_autocast_activations(m.n_embd, m.n_head, 4 * m.n_embd))


def build_model(cfg: GPTRunConfig, data_facts: dict):
    """The GPT of a run config; the vocabulary comes from the data's meta.json (data_facts["meta"]). With
    train.init_from a GPT-2 name or Hugging Face directory, its weights (cropped to model.block_size)."""
    from meshtrain.models.gpt.model import GPT, GPTConfig

    m, t = cfg.model, cfg.train
    if t.init_from not in ("scratch", "resume", "auto"):  # auto: the Trainer's scratch or resume
        model = GPT.from_pretrained(t.init_from, override_args={"dropout": m.dropout})
        data_vocab = int(data_facts["meta"]["vocab_size"])
        if data_vocab > model.config.vocab_size:  # else an id past the embedding's rows fails mid-step
            raise ConfigError(f"train.init_from={t.init_from} has {model.config.vocab_size:,} token embeddings, but "
                              f"the data's {data_facts['meta'].get('tokenizer')} tokenizer has {data_vocab:,} ids: "
                              "prepare the data with --tokenizer gpt2 (the weights' own)")
        if m.block_size < model.config.block_size:
            model.crop_block_size(m.block_size)
        model.config.loss_chunks = resolve_loss_chunks(t.loss_chunks, model.config.vocab_size)
        return model
    return GPT(GPTConfig(block_size=m.block_size, vocab_size=data_facts["meta"]["vocab_size"], n_layer=m.n_layer,
                         n_head=m.n_head, n_embd=m.n_embd, dropout=m.dropout, bias=m.bias, activation=m.activation,
                         loss_chunks=resolve_loss_chunks(t.loss_chunks, data_facts["meta"]["vocab_size"])))


def _build_layout(model, cfg: RunConfig, dims, mesh, device, rank: int):
    from meshtrain.models.gpt.parallelize import build_gpt_layout

    return build_gpt_layout(model, cfg, dims, mesh, device, rank)


SPEC = model_spec(__file__, language_model=True, name="gpt",
                  summary="a GPT language model on text (Shakespeare char-level or GPT-2 BPE, or your own)",
                  run_config=GPTRunConfig, workload=_workload, shape=_shape, validate=validate, build_model=build_model,
                  stage_split=SPLIT, build_layout=_build_layout)
