"""What every language model here shares (the GPT, the Llama-style decoder): the text data and sampling sections of
its run config (below), its workload (workload.py: token windows in, text samples out) and the sampling loop
(sampling.py). The layout a decoder is trained under is parallel/lm_layout.py's."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Annotated, Literal

from meshtrain.config import ConfigError, TrainSection

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig


Order = Literal["random", "epoch"]  # data/streams.py


@dataclass
class TextDataSection:
    name: str = "shakespeare_char"  # shakespeare_char | shakespeare | the name given to `prepare text`
    root: str = "data"  # where `meshtrain prepare` wrote <name>/train.bin, val.bin, meta.json (or shards + manifest.json)
    # random: windows at offsets drawn per global batch (any dataset) | epoch: one pass an epoch over the documents in
    # a shuffled order, each token once (a sharded corpus: data/streams.py)
    order: Annotated[str, Order] = "random"


@dataclass
class TextTrainSection(TrainSection):  # the sample written after each evaluation (sampling.py)
    prompt: str = "What is an LLM?"  # the text it continues
    sample_tokens: int = 200  # tokens it generates
    temperature: float = 0.8  # the logits are divided by it before sampling; 0: greedy
    top_k: int | None = 200  # sample among the k likeliest tokens only; null: among all
    # The output layer and the loss a chunk of tokens at a time (nn/chunked_loss.py), so that the [tokens, vocabulary]
    # logits and their fp32 loss tensors never exist whole (GPT-2's 50,304 words: 491 KiB a token under autocast):
    # auto (chunks of AUTO_CHUNK_LOGITS bytes of fp32 logits for the run's device, for vocabularies above AUTO_VOCAB
    # words; off below) | N tokens a chunk | off (all of a micro-batch's at once)
    loss_chunks: str = "auto"


AUTO_VOCAB = 8192  # train.loss_chunks=auto chunks vocabularies above this many words: GPT-2's, Llama's; not characters
# ... in chunks whose fp32 logits take at most this. A CPU's: 64 MiB (320 tokens of GPT-2's). A GPU's: 256 MiB (1,280
# tokens of GPT-2's), where the chunks' matmuls and the softmax's passes need more rows to keep it busy: GPT-2 on an
# H200 with each block compiled ran 1.44× faster in chunks of 1,024 than of 320, for 0.15 GiB more (docs/gpu.md,
# round 7).
AUTO_CHUNK_LOGITS = {"cpu": 64 * 2**20, "gpu": 256 * 2**20}


def resolve_loss_chunks(setting: str, vocab_size: int, device_type: str = "cpu") -> int | None:
    """The tokens a chunk of train.loss_chunks=`setting` holds with `vocab_size` words; None: the whole loss. `auto`:
    whole multiples of 64 tokens (at least 64) whose fp32 logits take at most AUTO_CHUNK_LOGITS of the device kind
    (`device_type`: torch's, cpu or another), for vocabularies above AUTO_VOCAB: one chunk's working set then stays
    small beside the step's while its matmul keeps enough rows for the device."""
    if setting == "off":
        return None
    if setting != "auto":
        return int(setting)
    if vocab_size <= AUTO_VOCAB:
        return None
    budget = AUTO_CHUNK_LOGITS["cpu" if device_type == "cpu" else "gpu"]
    return max(64, budget // (4 * vocab_size) // 64 * 64)


def with_loss_chunks(cfg: RunConfig, vocab_size: int, device_type: str) -> RunConfig:
    """cfg with train.loss_chunks=auto replaced by what auto takes on a `device_type` device (a number, or off), so
    that the model, the plan and the run's saved config all say it; any other cfg as it is."""
    if getattr(cfg.train, "loss_chunks", None) != "auto":  # set, or a model without the key (the ViT)
        return cfg
    chunk = resolve_loss_chunks("auto", vocab_size, device_type)
    return replace(cfg, train=replace(cfg.train, loss_chunks=str(chunk) if chunk else "off"))


def validate_text_training(cfg: RunConfig) -> None:
    """The rules of training on random token windows."""
    if cfg.train.max_epochs is not None:
        raise ConfigError("train.max_epochs is for the vit workload: a language model samples random windows, which "
                          "have no epochs; set train.max_iters instead")
    chunks = str(cfg.train.loss_chunks).strip().lower()
    if chunks not in ("auto", "off") and not (chunks.isdigit() and int(chunks) >= 1):
        raise ConfigError(f"train.loss_chunks={cfg.train.loss_chunks}: must be auto, off or a number of tokens a chunk "
                          "(at least 1)")
    cfg.train.loss_chunks = chunks
