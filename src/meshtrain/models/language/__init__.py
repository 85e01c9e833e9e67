"""What every language model here shares (the GPT, the Llama-style decoder): the text data and sampling sections of
its run config (below), its workload (workload.py: token windows in, text samples out) and the sampling loop
(sampling.py). The layout a decoder is trained under is parallel/lm_layout.py's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshtrain.config import ConfigError, TrainSection

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig


@dataclass
class TextDataSection:
    name: str = "shakespeare_char"  # shakespeare_char | shakespeare | the name given to `prepare text`
    root: str = "data"  # where `meshtrain prepare` wrote <name>/train.bin, val.bin, meta.json


@dataclass
class TextTrainSection(TrainSection):  # the sample written after each evaluation (sampling.py)
    prompt: str = "What is an LLM?"  # the text it continues
    sample_tokens: int = 200  # tokens it generates
    temperature: float = 0.8  # the logits are divided by it before sampling; 0: greedy
    top_k: int | None = 200  # sample among the k likeliest tokens only; null: among all


def validate_text_training(cfg: RunConfig) -> None:
    """The rules of training on random token windows."""
    if cfg.train.max_epochs is not None:
        raise ConfigError("train.max_epochs is for the vit workload: a language model samples random windows, which "
                          "have no epochs; set train.max_iters instead")
