"""The Llama-style decoder's run configuration: its model section and rules (the text data and sampling sections
are every language model's, models/language; optimizer, train and parallel are meshtrain.config's)."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshtrain.config import ConfigError, OptimizerSection, ParallelSection, check_positive
from meshtrain.models.language import TextDataSection, TextTrainSection, validate_text_training


@dataclass
class LlamaModelSection:  # model.py LlamaConfig; the vocabulary comes from the data
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # query heads (n_embd / n_head channels each, an even number for the rotary embedding)
    n_kv_head: int = 2  # grouped-query attention: n_head / n_kv_head query heads per key/value head
    n_embd: int = 128  # each token's channels
    ffn_hidden: int | None = None  # the SwiGLU's hidden width; null: 8/3 × n_embd rounded up to a multiple of 64
    block_size: int = 64  # tokens per sequence (the context)
    batch_size: int = 12  # sequences per micro-step per data-parallel rank
    rope_theta: float = 10000.0  # the rotary embedding's base: its longest wavelength grows with it
    dropout: float = 0.0  # on the embeddings, attention weights and both residual branches


@dataclass
class LlamaRunConfig:
    model: LlamaModelSection = field(default_factory=LlamaModelSection)
    data: TextDataSection = field(default_factory=lambda: TextDataSection(name="shakespeare"))
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    train: TextTrainSection = field(default_factory=TextTrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)


def validate(cfg: LlamaRunConfig) -> None:
    m = cfg.model
    check_positive({"model.n_layer": m.n_layer, "model.n_head": m.n_head, "model.n_kv_head": m.n_kv_head,
                    "model.n_embd": m.n_embd, "model.block_size": m.block_size, "model.batch_size": m.batch_size,
                    "model.ffn_hidden": m.ffn_hidden})
    if m.n_embd % m.n_head or (m.n_embd // m.n_head) % 2:
        raise ConfigError(f"model.n_embd={m.n_embd} must be model.n_head={m.n_head} × an even head size (rotary "
                          "embedding turns pairs of channels)")
    if m.n_head % m.n_kv_head:
        raise ConfigError(f"model.n_head={m.n_head} is not a multiple of model.n_kv_head={m.n_kv_head}: each "
                          "key/value head serves n_head / n_kv_head query heads")
    validate_text_training(cfg)


def ffn_hidden(m: LlamaModelSection) -> int:
    """The SwiGLU's hidden width: as set, or Llama's 8/3 × n_embd rounded up to a multiple of 64."""
    return m.ffn_hidden or 64 * -(-8 * m.n_embd // (3 * 64))
