"""What every language model here shares (the GPT, the Llama-style decoder): the text data and sampling sections of
its run config (below), its workload (workload.py: token windows in, text samples out) and the sampling loop
(sampling.py). The layout a decoder is trained under is parallel/lm_layout.py's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshtrain.config import ConfigError, TrainSection, check_positive

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
    # The output layer and the loss over this many tokens at a time (nn/chunked_loss.py): the [tokens, vocabulary]
    # logits and their fp32 loss tensors never whole (GPT-2's 50,304 words: 491 KiB a token under autocast); null:
    # all of a micro-batch's at once
    loss_chunk_tokens: int | None = None


def validate_text_training(cfg: RunConfig) -> None:
    """The rules of training on random token windows."""
    if cfg.train.max_epochs is not None:
        raise ConfigError("train.max_epochs is for the vit workload: a language model samples random windows, which "
                          "have no epochs; set train.max_iters instead")
    chunk, p = cfg.train.loss_chunk_tokens, cfg.parallel
    check_positive({"train.loss_chunk_tokens": chunk})
    if chunk and (p.tp > 1 or p.pp > 1):
        why = ("loss parallel already keeps the logits sharded over the vocabulary" if p.tp > 1 else
               "a pipeline's last stage computes the loss of its own micro-batches")
        raise ConfigError(f"train.loss_chunk_tokens={chunk} with parallel.{'tp' if p.tp > 1 else 'pp'}="
                          f"{p.tp if p.tp > 1 else p.pp}: {why}; set train.loss_chunk_tokens=null")
