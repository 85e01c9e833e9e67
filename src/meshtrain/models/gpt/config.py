"""The GPT's run configuration: its model section (the text data and sampling sections are every language model's,
models/language) and the rules that only concern it. The groups every model shares (optimizer, train, parallel) are meshtrain.config's."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshtrain.config import ConfigError, OptimizerSection, ParallelSection, check_positive
from meshtrain.models.language import TextDataSection, TextTrainSection, validate_text_training


@dataclass
class ModelSection:  # models/gpt/model.py GPTConfig; the vocabulary comes from the data
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads (n_embd / n_head channels each)
    n_embd: int = 128  # each token's channels
    block_size: int = 64  # tokens per sequence: the context, and the position table's length
    batch_size: int = 12  # sequences per micro-step per data-parallel rank
    dropout: float = 0.0  # on the embeddings, attention weights and both residual branches
    bias: bool = False  # biases in the linears and layer norms (GPT-2 has them)
    activation: str = "gelu"  # the MLP's: gelu | gelu_tanh (GPT-2's) | relu | silu (nn/transformer.py ACTIVATIONS)


@dataclass
class GPTRunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: TextDataSection = field(default_factory=TextDataSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    train: TextTrainSection = field(default_factory=TextTrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)


def validate(cfg: GPTRunConfig) -> None:
    """The GPT's own rules (the shared ones are config.validate's; those needing the world size, parallel/mesh.py's)."""
    m = cfg.model
    check_positive({"model.n_layer": m.n_layer, "model.n_head": m.n_head, "model.n_embd": m.n_embd,
                     "model.block_size": m.block_size, "model.batch_size": m.batch_size})
    if m.n_embd % m.n_head:
        raise ConfigError(f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}: "
                          "each head gets n_embd / n_head channels")
    validate_text_training(cfg)
