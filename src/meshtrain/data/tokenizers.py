"""Every tokenizer meshtrain reads text with, behind one interface, and `load_tokenizer(spec)`.

A spec is one string, stored in meta.json so that a prepared dataset (and a checkpoint, and `sample`) loads
the same tokenizer again:

    char                 one token per character, fitted from the text being prepared
    gpt2                 GPT-2's BPE (50,257 tokens) from the rank file shipped in the package
    cl100k_base, ...     a tiktoken encoding by name, read only from tiktoken's local cache (never downloaded)
    PATH.json            a Hugging Face `tokenizer.json` (the `tokenizers` library), e.g. one that
                         `meshtrain prepare tokenizer` trained
    PATH (any other)     a tiktoken ranks file (`*.tiktoken`, Llama 3's `tokenizer.model`); its split pattern and
                         special tokens come from the sidecar PATH + ".json", else from known defaults (below)

The sidecar of a ranks file (`llama3.model.json` beside `llama3.model`; appended, not replacing the suffix, so it
never collides with a Hugging Face tokenizer.json in the same folder):

    {"pattern": "<the pre-tokenizer regex>", "special_tokens": {"<|end_of_text|>": 128001, ...},
     "eot": "<|end_of_text|>"}

Without one: a file of 128,000 ranks gets Llama 3's pattern and its 256 special tokens; the GPT-2 ranks get
GPT-2's. Any other needs the sidecar. Every tokenizer carries a fingerprint, the sha256 of what defines its
encoding, so that a dataset prepared with one is never read with another that only shares its name or path.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from functools import lru_cache
from importlib import resources
from pathlib import Path
from unittest import mock

from meshtrain.errors import DataError

GPT2_RANKS_ASSET = "gpt2.tiktoken.gz"
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_EOT = "<|endoftext|>"
# GPT-2's pre-tokenizer split as OpenAI released it; tiktoken's bundled copy is an equivalent rewrite
# with possessive quantifiers (same pieces, measured 20% faster here: not worth a newer-tiktoken pin).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Llama 3's (Meta's tokenizer.py): its ranks file carries neither the pattern nor the special tokens.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_RANKS = 128_000
LLAMA3_NAMED_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                         "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                         "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")
LLAMA3_SPECIALS = 256  # Llama 3.1's names; the ids (128,000 on) are Llama 3's too
# The end-of-text token a tokenizer.json's vocabulary is searched for, in this order.
EOT_NAMES = (GPT2_EOT, "<|end_of_text|>", "</s>", "<eos>")
BUILTIN = ("char", "gpt2")
HF_SUFFIX = ".json"
SIDECAR_SUFFIX = ".json"
CHOICES = ("char, gpt2, a tiktoken encoding from its local cache (cl100k_base, o200k_base, ...), the path of a "
           "Hugging Face tokenizer.json, or the path of a tiktoken ranks file (*.tiktoken, Llama 3's tokenizer.model)")


def _sha256_json(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


class Tokenizer:
    """What prepare, training, sample and export ask of a tokenizer. Subclasses set kind, spec, vocab_size,
    eot_id (the end-of-text token that separates documents; None where the vocabulary has none) and fingerprint."""

    kind: str
    spec: str
    vocab_size: int
    eot_id: int | None
    fingerprint: str
    _files: dict[str, str] = {}  # Tokenizer.files: none unless read from files (never mutated, only replaced)

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # A plain loop (tiktoken's too): prepare's worker processes are the parallelism, and tiktoken's
        # encode_ordinary_batch starts a thread pool per call, which cost more than it gained there
        # (benchmarks/prepare_corpus.py).
        return [self.encode(text) for text in texts]

    def decode(self, ids) -> str:
        raise NotImplementedError

    def files(self) -> dict[str, str]:
        """The text of the files this tokenizer was read from, the one its spec names first (none for a built-in or
        a named encoding): what a run and an exported model carry, so that they load without the files."""
        return dict(self._files)

    def meta(self) -> dict:
        """What meta.json keeps of the tokenizer: tokenizer_from_meta(meta) loads it again."""
        return {"tokenizer": self.kind, "vocab_size": self.vocab_size, "spec": self.spec,
                "fingerprint": self.fingerprint, "eot_id": self.eot_id}


class CharTokenizer(Tokenizer):
    """One token per character; ids follow the sorted order of the characters (as nanoGPT's)."""

    kind = "char"
    spec = "char"
    eot_id = None  # a character vocabulary has no document separator

    def __init__(self, itos: list[str]):
        self.itos = list(itos)
        self.stoi = {ch: i for i, ch in enumerate(self.itos)}
        if len(self.stoi) != len(self.itos):
            raise ValueError("a character vocabulary must not repeat characters")
        self.fingerprint = _sha256_json({"char": self.itos})

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[ch] for ch in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in this {self.vocab_size}-character vocabulary") from None

    def decode(self, ids) -> str:
        return "".join(self.itos[int(i)] for i in ids)

    def meta(self) -> dict:
        return {**super().meta(), "stoi": self.stoi, "itos": self.itos}


# -------------------------------------------------------------------------------------------------- tiktoken


class TiktokenTokenizer(Tokenizer):
    """A byte-pair encoding run by tiktoken: ranks, split pattern and special tokens."""

    kind = "tiktoken"

    def __init__(self, spec: str, ranks: dict[bytes, int], pattern: str, special_tokens: dict[str, int],
                 eot: str | None, files: dict[str, str] | None = None):
        import tiktoken

        if eot is not None and eot not in special_tokens:
            raise DataError(f"{spec}: the end-of-text token {eot!r} is not one of its special tokens")
        try:
            self.encoding = tiktoken.Encoding(name=Path(spec).name, pat_str=pattern, mergeable_ranks=ranks,
                                              special_tokens=special_tokens)
        except ValueError as e:  # a pattern the regex engine rejects, ids that collide
            raise DataError(f"{spec}: tiktoken cannot build this encoding ({e})") from None
        self.spec, self._files = spec, files or {}
        self.eot_id = special_tokens[eot] if eot is not None else None
        self.fingerprint = _sha256_json({"ranks_sha256": ranks_sha256(ranks), "pattern": pattern,
                                         "special_tokens": special_tokens})

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        # Ordinary encoding: "<|endoftext|>" inside a text is plain text, never the special token.
        return self.encoding.encode_ordinary(text)

    def decode(self, ids) -> str:
        return self.encoding.decode([int(i) for i in ids])


def parse_ranks(raw: bytes, source: str) -> dict[bytes, int]:
    """A tiktoken ranks file's {token bytes: rank}: one `base64(token) rank` per line. Read here rather than with
    tiktoken's load_tiktoken_bpe, which copies every local file into its download cache (and serves that copy,
    unchecked, after the file changes)."""
    ranks = {}
    for number, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise DataError(f"{source} is not a tiktoken ranks file: line {number} is not `base64-token rank`"
                            ) from None
    if not ranks:
        raise DataError(f"{source} is empty: a tiktoken ranks file holds one `base64-token rank` per line")
    return ranks


def ranks_sha256(ranks: dict[bytes, int]) -> str:
    """The sha256 of the ranks written as tiktoken writes a ranks file (by rank, `base64 rank` a line): the same
    for the same ranks however they were stored or fetched (the shipped GPT-2 file hashes to itself)."""
    lines = (base64.b64encode(token) + b" %d\n" % rank for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]))
    return hashlib.sha256(b"".join(lines)).hexdigest()


def _gpt2_ranks_bytes() -> bytes:
    raw = gzip.decompress(resources.files("meshtrain.data").joinpath("assets", GPT2_RANKS_ASSET).read_bytes())
    if hashlib.sha256(raw).hexdigest() != GPT2_RANKS_SHA256:
        raise DataError(f"the shipped {GPT2_RANKS_ASSET} is damaged (sha256 mismatch); reinstall meshtrain")
    return raw


@lru_cache(maxsize=1)
def _gpt2_encoding():
    # Built from the shipped ranks: tiktoken.get_encoding("gpt2") would download them.
    return TiktokenTokenizer("gpt2", parse_ranks(_gpt2_ranks_bytes(), GPT2_RANKS_ASSET), GPT2_PATTERN,
                             {GPT2_EOT: 50256}, GPT2_EOT)


class GPT2Tokenizer(TiktokenTokenizer):
    """GPT-2's byte-pair encoding (50,257 tokens) via tiktoken, offline, from the rank file in the package."""

    kind = "gpt2"
    eot_token = 50256  # <|endoftext|>

    def __init__(self):  # the encoding is built once per process: 50,256 ranks take ~0.1 s to read
        built = _gpt2_encoding()
        self.encoding, self.spec, self.eot_id, self.fingerprint = built.encoding, "gpt2", 50256, built.fingerprint


def _default_specials(path: Path, ranks: dict[bytes, int]) -> tuple[str, dict[str, int], str]:
    """(pattern, special tokens, end-of-text token) of a ranks file that has no sidecar, where it is a known one."""
    if len(ranks) == 50_256 and ranks_sha256(ranks) == GPT2_RANKS_SHA256:
        return GPT2_PATTERN, {GPT2_EOT: 50256}, GPT2_EOT
    if len(ranks) == LLAMA3_RANKS:
        names = [*LLAMA3_NAMED_SPECIALS,
                 *(f"<|reserved_special_token_{2 + i}|>" for i in range(LLAMA3_SPECIALS - len(LLAMA3_NAMED_SPECIALS)))]
        return LLAMA3_PATTERN, {name: LLAMA3_RANKS + i for i, name in enumerate(names)}, "<|end_of_text|>"
    raise DataError(f"{path} is a tiktoken ranks file of {len(ranks):,} tokens that meshtrain does not know: write "
                    f"its split pattern and special tokens to {_sidecar(path)} as "
                    '{"pattern": "...", "special_tokens": {"<|endoftext|>": ID}, "eot": "<|endoftext|>"}')


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + SIDECAR_SUFFIX)


def load_ranks_file(path: Path) -> TiktokenTokenizer:
    """A tiktoken ranks file, with the pattern and special tokens of its sidecar (or known defaults)."""
    raw = path.read_bytes()
    ranks = parse_ranks(raw, str(path))
    sidecar = _sidecar(path)
    if not sidecar.is_file():
        pattern, specials, eot = _default_specials(path, ranks)
        return TiktokenTokenizer(str(path), ranks, pattern, specials, eot, {path.name: raw.decode("ascii")})
    try:
        described_text = sidecar.read_text(encoding="utf-8")
        described = json.loads(described_text)
        pattern, specials = described["pattern"], {str(k): int(v) for k, v in described["special_tokens"].items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise DataError(f"{sidecar} should be JSON with a \"pattern\" string and \"special_tokens\" "
                        f"{{name: id}} ({type(e).__name__}: {e})") from None
    eot = described.get("eot", next((name for name in EOT_NAMES if name in specials), None))
    return TiktokenTokenizer(str(path), ranks, pattern, specials, eot,
                             {path.name: raw.decode("ascii"), sidecar.name: described_text})


def _tiktoken_cache_path(url: str) -> tuple[str | None, Path | None]:
    """(the cache folder, the file in it) where tiktoken looks for `url` before downloading it: the rule of
    tiktoken.load.read_file_cached (TIKTOKEN_CACHE_DIR, else DATA_GYM_CACHE_DIR, else <tmp>/data-gym-cache; the
    file is named by the sha1 of the URL). An empty setting turns the cache off: (None, None)."""
    folder = os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get("DATA_GYM_CACHE_DIR"))
    if folder is None:
        folder = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    if folder == "":
        return None, None
    return folder, Path(folder) / hashlib.sha1(url.encode()).hexdigest()


def _offline_fetch(name: str):
    """A stand-in for tiktoken's fetch of a file that is not in its cache: the one clear error, no request."""

    def refuse(url: str) -> bytes:
        folder, path = _tiktoken_cache_path(url)
        where = (f"{path} (TIKTOKEN_CACHE_DIR={folder})" if path else
                 "TIKTOKEN_CACHE_DIR is empty, which turns tiktoken's cache off: set it to a folder")
        raise DataError(f"the tiktoken encoding {name} needs {url}, and meshtrain never downloads at run time: "
                        f"put that file at {where}. On a machine with network, `TIKTOKEN_CACHE_DIR={folder or 'DIR'} "
                        f"python -c \"import tiktoken; tiktoken.get_encoding('{name}')\"` fills the folder to copy; "
                        "or pass the file's path as the tokenizer, with a sidecar .json (docs/training.md)")

    return refuse


def load_named_encoding(name: str) -> TiktokenTokenizer:
    """A tiktoken encoding by name, from tiktoken's local cache only."""
    import tiktoken.load
    from tiktoken_ext.openai_public import ENCODING_CONSTRUCTORS

    # tiktoken's constructors fetch a missing or damaged file over HTTP; its fetch is swapped for the error while
    # the constructor runs, so nothing leaves the machine.
    with mock.patch.object(tiktoken.load, "read_file", _offline_fetch(name)):
        described = ENCODING_CONSTRUCTORS[name]()
    specials = described["special_tokens"]
    eot = next((eot for eot in EOT_NAMES if eot in specials), None)
    return TiktokenTokenizer(name, described["mergeable_ranks"], described["pat_str"], specials, eot)


def tiktoken_names() -> tuple[str, ...]:
    """The encodings tiktoken names (its `gpt2` is meshtrain's shipped one)."""
    from tiktoken_ext.openai_public import ENCODING_CONSTRUCTORS

    return tuple(name for name in ENCODING_CONSTRUCTORS if name != "gpt2")


# -------------------------------------------------------------------------------------------- Hugging Face


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer.json, run by the `tokenizers` library."""

    kind = "huggingface"

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as Backend

        raw = path.read_bytes()
        try:
            self.backend = Backend.from_str(raw.decode("utf-8"))
        except Exception as e:  # the library raises its own Exception for a file it cannot read
            raise DataError(f"{path} is not a Hugging Face tokenizer.json the `tokenizers` library reads ({e})") from None
        # As tiktoken's encode_ordinary: a special token's text inside a document is plain text.
        self.backend.encode_special_tokens = True
        self.spec, self.fingerprint = str(path), hashlib.sha256(raw).hexdigest()
        self._files = {path.name: raw.decode("utf-8")}
        vocab = self.backend.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1  # ids may leave gaps: the model needs the largest + 1 rows
        self.eot_id = next((vocab[name] for name in EOT_NAMES if name in vocab), None)

    def encode(self, text: str) -> list[int]:
        # No post-processor tokens (a BOS some tokenizers add): documents are joined by eot_id where wanted.
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)


def train_bpe(paths: Sequence[Path], vocab_size: int, out: Path) -> HFTokenizer:
    """A byte-level BPE of `vocab_size` tokens (GPT-2's kind, <|endoftext|> included) trained on the text files
    `paths` with the `tokenizers` library, written as a tokenizer.json to `out`; the tokenizer read back from it."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    missing = [str(p) for p in paths if not Path(p).is_file()]
    if missing or not paths:
        raise DataError(f"training a tokenizer needs text files: {', '.join(missing) or 'none given'} not found")
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # every byte a token of its own: any text encodes
    if vocab_size < len(alphabet) + 1:
        raise DataError(f"--vocab-size {vocab_size} is too small: a byte-level BPE holds the {len(alphabet)} "
                        "bytes and <|endoftext|> before any merge")
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[GPT2_EOT], initial_alphabet=alphabet,
                                  show_progress=False)  # its bars would write terminal codes into logs
    try:
        backend.train([str(p) for p in paths], trainer)
    except Exception as e:  # a file that is not UTF-8 text
        raise DataError(f"training the tokenizer on {', '.join(map(str, paths))} failed: {e}") from None
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # renamed into place: never half a file at `out`
    backend.save(str(temp))
    os.replace(temp, out)
    return HFTokenizer(out.resolve())


# ------------------------------------------------------------------------------------------------- loading


def canonical_spec(spec: str) -> str:
    """The spec as meta.json stores it (a file's absolute path: it loads from any working directory); a DataError
    naming the choices for a spec that is none of them. Cheap: nothing is read."""
    if spec in BUILTIN or spec in tiktoken_names():
        return spec
    path = Path(spec).expanduser()
    if path.is_file():
        return str(path.resolve())
    if os.sep in spec or "." in spec:
        raise DataError(f"tokenizer file {spec} not found (a tokenizer is {CHOICES})")
    raise DataError(f"unknown tokenizer {spec!r}: choose {CHOICES}")


def load_tokenizer(spec: str, *, text: str | None = None) -> Tokenizer:
    """The tokenizer a spec names (see the module's docstring); `text` fits the char tokenizer."""
    spec = canonical_spec(spec)
    if spec == "char":
        if text is None:
            raise DataError("the char tokenizer is fitted from a text: load_tokenizer('char', text=...), or "
                            "tokenizer_from_meta for a prepared dataset's")
        return CharTokenizer.from_text(text)
    if spec == "gpt2":
        return GPT2Tokenizer()
    if spec in tiktoken_names():
        return load_named_encoding(spec)
    path = Path(spec)
    return HFTokenizer(path) if path.suffix == HF_SUFFIX else load_ranks_file(path)


def tokenizer_from_meta(meta: dict) -> Tokenizer:
    """The tokenizer a prepared dataset was written with. meta.json from before specs (char and gpt2 alone) loads
    unchanged; a file-based one must still hold the encoding it had (its fingerprint), or the ids would mean
    other words."""
    kind = meta.get("tokenizer")
    if meta.get("tokenizer_files"):
        return _carried(meta)
    if kind == "char":
        return CharTokenizer(meta["itos"])
    if kind == "gpt2":
        return GPT2Tokenizer()
    if "spec" not in meta:
        raise DataError(f"unknown tokenizer {kind!r} in meta.json with no spec to load it by (a tokenizer is {CHOICES})")
    try:
        tokenizer = load_tokenizer(meta["spec"])
    except DataError as e:
        raise DataError(f"the tokenizer this dataset was prepared with does not load: {e}") from None
    if meta.get("fingerprint") not in (None, tokenizer.fingerprint):
        raise DataError(f"the tokenizer {meta['spec']} is not the one this dataset was prepared with: its "
                        f"fingerprint is {tokenizer.fingerprint[:12]}…, meta.json's {str(meta['fingerprint'])[:12]}…. "
                        "Put the original file back, or prepare the dataset again with this one")
    return tokenizer


def _carried(meta: dict) -> Tokenizer:
    """The tokenizer of a run's or an exported model's meta, from the files it carries (Tokenizer.files): the
    files it was trained with, wherever the originals went."""
    with tempfile.TemporaryDirectory(prefix="meshtrain-tokenizer-") as folder:
        for name, text in meta["tokenizer_files"].items():
            (Path(folder) / name).write_text(text, encoding="utf-8")
        tokenizer = load_tokenizer(str(Path(folder) / next(iter(meta["tokenizer_files"]))))
    if meta.get("fingerprint") not in (None, tokenizer.fingerprint):
        raise DataError(f"the tokenizer files carried for {meta['spec']} are not the ones it was trained with "
                        f"(fingerprint {tokenizer.fingerprint[:12]}…, expected {str(meta['fingerprint'])[:12]}…)")
    tokenizer.spec = meta["spec"]
    return tokenizer
