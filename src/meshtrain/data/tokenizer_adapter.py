"""The tokenizer interface the sharded corpus is written against, over today's tokenizers in data/text.py.

A stand-in: data/tokenizers.py (being written beside this) will offer `load_tokenizer(spec) -> Tokenizer` with
`kind, spec, vocab_size, eot_id, fingerprint, encode, encode_batch, decode, meta`. Everything in data/corpus.py and
data/shards.py reaches tokenizers only through `load_tokenizer` and `adapt` here, so swapping in the real module is
an edit of this one file (or its deletion and two imports).
"""

from __future__ import annotations

import hashlib
import json

from meshtrain.data.text import GPT2_RANKS_SHA256, CharTokenizer, DataError, GPT2Tokenizer

SPECS = ("gpt2", "char")


class Tokenizer:
    """One tokenizer seen through the shared interface; `base` does the work."""

    def __init__(self, base, spec: str, eot_id: int | None, fingerprint: str):
        self.base, self.spec, self.eot_id, self.fingerprint = base, spec, eot_id, fingerprint
        self.kind = base.kind

    @property
    def vocab_size(self) -> int:
        return int(self.base.vocab_size)

    def encode(self, text: str) -> list[int]:
        return self.base.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # A plain loop: prepare's worker processes are the parallelism. tiktoken's encode_ordinary_batch starts a
        # thread pool per call, which cost more than the encoding itself here (benchmarks/prepare_corpus.py).
        return [self.base.encode(text) for text in texts]

    def decode(self, ids) -> str:
        return self.base.decode(ids)

    def meta(self) -> dict:
        return {**self.base.meta(), "spec": self.spec, "fingerprint": self.fingerprint, "eot_id": self.eot_id}

    def __reduce__(self):
        # Sent to prepare's worker processes: a GPT-2 tokenizer is rebuilt there from its spec (its tiktoken
        # object need not pickle), any other is sent whole.
        if self.kind == "gpt2":
            return load_tokenizer, (self.spec,)
        return Tokenizer, (self.base, self.spec, self.eot_id, self.fingerprint)


def _fingerprint(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, ensure_ascii=False).encode("utf-8")).hexdigest()


def load_tokenizer(spec: str) -> Tokenizer:
    """`gpt2` (the shipped GPT-2 BPE), or `char:CHARACTERS` (one id per character, in the order given)."""
    if spec == "gpt2":
        base = GPT2Tokenizer()
        return Tokenizer(base, "gpt2", base.eot_token, _fingerprint("gpt2", GPT2_RANKS_SHA256))
    if spec.startswith("char:"):
        return adapt(CharTokenizer(list(spec[len("char:"):])))
    raise DataError(f"unknown tokenizer {spec!r}: choose gpt2 (or char, whose vocabulary prepare finds)")


def adapt(base) -> Tokenizer:
    """Any object with kind, vocab_size, encode, decode and meta() (a test's fake included) as a `Tokenizer`."""
    if isinstance(base, Tokenizer):
        return base
    if isinstance(base, GPT2Tokenizer):
        return load_tokenizer("gpt2")
    if isinstance(base, CharTokenizer):
        # No end-of-text id: a character vocabulary has none, so documents are simply concatenated.
        return Tokenizer(base, "char:" + "".join(base.itos), None, _fingerprint("char", base.itos))
    eot = getattr(base, "eot_id", None)
    spec = getattr(base, "spec", base.kind)
    return Tokenizer(base, spec, eot, getattr(base, "fingerprint", None) or _fingerprint(base.kind, spec))
