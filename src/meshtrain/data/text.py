"""Text data for the GPT trainer: the shipped corpus, `prepare`, and random token windows (the tokenizers are
data/tokenizers.py's).

A prepared dataset is a folder DATA_ROOT/NAME holding
    train.bin, val.bin  token ids as raw little-endian uint16 (np.memmap-able): the first 90% of the
                        text, by character position, and the last 10%
    meta.json           tokenizer kind, vocab size, spec and fingerprint (+ stoi/itos for char), token counts,
                        source md5
A tokenizer of more than 65,536 ids writes the same split as uint32 shards + manifest.json instead
(data/corpus.py write_text_shards; data/shards.py's format).

Names: `shakespeare_char` (characters of the shipped corpus), `shakespeare` (GPT-2 BPE of the same),
and `text` (a file of the user's, in DATA_ROOT/<file stem> unless named otherwise, with any tokenizer spec).
Everything works offline: the corpus and the GPT-2 rank file ship inside the package.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from meshtrain.data.tokenizers import (  # CharTokenizer, GPT2Tokenizer, tokenizer_from_meta: importable here as before
    BUILTIN,
    CharTokenizer,
    GPT2Tokenizer,
    Tokenizer,
    canonical_spec,
    load_tokenizer,
    tokenizer_from_meta,
)
from meshtrain.errors import DataError
from meshtrain.runtime.log import get_logger
from meshtrain.runtime.progress import progress_bar

log = get_logger("data")

DATA_ROOT_ENV = "MESHTRAIN_DATA_ROOT"
DEFAULT_DATA_ROOT = "data"  # relative to the current directory
BUILTIN_TOKENIZER = {"shakespeare_char": "char", "shakespeare": "gpt2"}
TOKENIZERS = BUILTIN  # the tokenizers by name; any spec of data/tokenizers.py is accepted
SPLITS = ("train", "val")
TOKEN_DTYPE = np.dtype("<u2")  # explicit little-endian, so a .bin reads the same on any machine
WIDE_TOKEN_DTYPE = np.dtype("<u4")  # a vocabulary past 65,536: written as shards (data/shards.py), not train.bin
FORMAT_VERSION = 1
ENCODE_PIECE_CHARS = 1 << 23  # 8 Mi characters, a few seconds of BPE: a long corpus's progress is told between

SHAKESPEARE_ASSET = "tinyshakespeare.txt.gz"
SHAKESPEARE_MD5 = "6fb458f1232090904fb40fe944165e91"


def default_data_root() -> Path:
    """$MESHTRAIN_DATA_ROOT, else ./data."""
    return Path(os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT)


def prepare_command(data_dir: Path) -> str:
    """The `meshtrain prepare ...` line that (re)creates the dataset in `data_dir`."""
    data_dir = Path(data_dir)
    name = data_dir.name
    if name in BUILTIN_TOKENIZER:
        command = f"meshtrain prepare {name}"
    else:
        command = f"meshtrain prepare text PATH --name {name}"
    if data_dir.parent.resolve() != default_data_root().resolve():
        command += f" --data-root {data_dir.parent}"
    return command


def _asset_bytes(name: str) -> bytes:
    return gzip.decompress(resources.files("meshtrain.data").joinpath("assets", name).read_bytes())


def shakespeare_text() -> str:
    """The shipped tiny-Shakespeare corpus (1,115,394 characters)."""
    return _asset_bytes(SHAKESPEARE_ASSET).decode("utf-8")


# ---------------------------------------------------------------------------------------------- prepare


def prepare(name: str, data_root: Path, source: Path | None = None, tokenizer: str | None = None,
            val_fraction: float = 0.1, *, out_name: str | None = None, force: bool = False) -> dict:
    """Tokenize a corpus into data_root/<name>/{train.bin,val.bin,meta.json}; return the meta.

    Skips the work when the outputs are complete and were made from the same source bytes with the same
    tokenizer and split (unless `force`). Writes go to temp files renamed into place, so an interrupted
    prepare leaves the previous dataset or none, never a half-written one.
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must lie strictly between 0 and 1, got {val_fraction}")
    spec, raw, source_label, out_dir = _resolve_corpus(name, Path(data_root), source, tokenizer, out_name)

    source_md5 = hashlib.md5(raw).hexdigest()
    if not force:
        meta = _up_to_date_meta(out_dir, source_md5, spec, val_fraction)
        if meta is None and (out_dir / "manifest.json").is_file():
            meta = _up_to_date_shards(out_dir, _shard_settings(source_md5, spec, val_fraction))
        if meta is not None:
            log.info("%s is up to date (source md5 %s, train %s tokens, val %s tokens): nothing to do",
                     out_dir, source_md5, f"{meta['train_tokens']:,}", f"{meta['val_tokens']:,}")
            return meta

    text = _decode_corpus(raw, source_label)
    tok = _fit_tokenizer(spec, text, source_label)
    ids = _encode_splits(tok, text, val_fraction, source_label)
    if ids["train"].dtype != TOKEN_DTYPE:  # ids past uint16 (cl100k_base, Llama 3's): uint32 shards instead
        return _sharded_writer().write_text_shards(out_dir, tok, ids, _shard_settings(source_md5, spec, val_fraction))
    meta = {
        "format_version": FORMAT_VERSION,
        "name": out_dir.name,
        **tok.meta(),
        "dtype": "uint16",
        "train_tokens": len(ids["train"]),
        "val_tokens": len(ids["val"]),
        "val_fraction": val_fraction,
        "source": source_label,
        "source_md5": source_md5,
        "source_chars": len(text),
    }
    _write_dataset(out_dir, ids, meta)
    log.info("wrote %s and %s", ", ".join(str(out_dir / f"{s}.bin") for s in SPLITS), out_dir / "meta.json")
    return meta


def _resolve_corpus(name: str, data_root: Path, source: Path | None, tokenizer: str | None,
                    out_name: str | None) -> tuple[str, bytes, str, Path]:
    """(tokenizer spec, source bytes, source label for messages and meta, output folder) for `prepare`.

    Every argument mistake is caught here, before any bytes are hashed or tokenized.
    """
    if name in BUILTIN_TOKENIZER:
        kind = BUILTIN_TOKENIZER[name]
        if source is not None:
            raise DataError(f"{name} uses the shipped corpus; for a file of your own run `meshtrain prepare text PATH`")
        if tokenizer not in (None, kind):
            raise DataError(f"{name} is tokenized with {kind}; for another tokenizer run "
                            f"`meshtrain prepare text PATH --tokenizer {tokenizer}`")
        return kind, _asset_bytes(SHAKESPEARE_ASSET), f"meshtrain:{SHAKESPEARE_ASSET}", data_root / name
    if name == "text":
        spec = canonical_spec(tokenizer or "char")
        if source is None:
            raise DataError("`text` needs the text file to prepare: meshtrain prepare text PATH")
        source = Path(source)
        if not source.is_file():
            raise DataError(f"{source} not found: `meshtrain prepare text PATH` needs an existing text file")
        return spec, source.read_bytes(), str(source.resolve()), data_root / (out_name or source.stem)
    raise DataError(f"unknown dataset {name!r}: choose shakespeare_char, shakespeare or text")


def _decode_corpus(raw: bytes, source_label: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{source_label} is not UTF-8 text ({e})") from None


def _fit_tokenizer(spec: str, text: str, source_label: str) -> Tokenizer:
    """The tokenizer `spec` names, for `text` (a char vocabulary is built from the text itself)."""
    log.info("length of dataset in characters: %s", f"{len(text):,}")
    tok = load_tokenizer(spec, text=text)
    if tok.kind == "char":
        log.info("all the unique characters: %r", "".join(tok.itos))
    log.info("vocab size: %s", f"{tok.vocab_size:,}")
    if tok.vocab_size > 1 << 16:
        log.info("%s token ids outgrow train.bin's uint16: writing uint32 shards and a manifest.json instead",
                 f"{tok.vocab_size:,}")
    return tok


def _encode_splits(tok: Tokenizer, text: str, val_fraction: float,
                   source_label: str) -> dict[str, np.ndarray]:
    """Token ids of the train and val parts of `text`, each long enough for one training window."""
    # Split the text, not the tokens: the val text is then the same whatever the tokenizer (as nanoGPT).
    n_train_chars = int(len(text) * (1.0 - val_fraction))
    splits = {"train": text[:n_train_chars], "val": text[n_train_chars:]}
    ids = {split: _encode_told(tok, part, split) for split, part in splits.items()}
    for split in SPLITS:
        log.info("%s has %s tokens", split, f"{len(ids[split]):,}")
        if len(ids[split]) < 2:
            raise DataError(f"{source_label} is too short: its {split} split has {len(ids[split])} tokens, "
                            "and a training window needs at least 2")
    return ids


def _encode_told(tok: Tokenizer, text: str, split: str) -> np.ndarray:
    """`tok.encode(text)` piece by piece, telling how far it is: a corpus of gigabytes takes minutes. uint16 ids
    where the vocabulary fits (train.bin's), else uint32 (shards')."""
    dtype = TOKEN_DTYPE if tok.vocab_size <= 1 << 16 else WIDE_TOKEN_DTYPE
    if len(text) <= ENCODE_PIECE_CHARS:
        return np.asarray(tok.encode(text), dtype=dtype)
    log.info("tokenizing the %s split: %s characters with %s", split, f"{len(text):,}", tok.kind)
    parts = []
    with progress_bar(len(text), f"tokenizing {split}, characters") as bar:
        for piece in _pieces(text, ENCODE_PIECE_CHARS):
            parts.append(np.asarray(tok.encode(piece), dtype=dtype))
            bar.update(len(piece))
    return np.concatenate(parts)


def _pieces(text: str, size: int) -> Iterator[str]:
    """`text` in pieces of about `size` characters, each cut just after a newline between two letters or digits.
    GPT-2's pre-tokenizer splits there anyway (the newline is a piece of its own), so the ids of the pieces are
    the ids of the whole; for characters any cut is."""
    start = 0
    while len(text) - start > size:
        cut = text.find("\n", start + size)
        while cut != -1 and not (text[cut - 1].isalnum() and text[cut + 1:cut + 2].isalnum()):
            cut = text.find("\n", cut + 1)
        if cut == -1:
            break
        yield text[start:cut + 1]
        start = cut + 1
    yield text[start:]


def _up_to_date_meta(out_dir: Path, source_md5: str, spec: str, val_fraction: float) -> dict | None:
    try:
        meta = load_meta(out_dir)
        for split in SPLITS:
            check_split(out_dir, split, meta=meta)
        # A tokenizer file may have changed under the same path: its fingerprint must still be meta.json's.
        if spec not in TOKENIZERS:
            tokenizer_from_meta(meta)
    except DataError:
        return None
    # meta.json from before specs names char or gpt2 alone, which is their spec.
    same = (meta.get("format_version"), meta.get("source_md5"), meta.get("spec", meta.get("tokenizer")),
            meta.get("val_fraction"))
    return meta if same == (FORMAT_VERSION, source_md5, spec, val_fraction) else None


def _sharded_writer():
    """data/corpus.py, imported when first needed: it imports this module."""
    from meshtrain.data import corpus

    return corpus


def _shard_settings(source_md5: str, spec: str, val_fraction: float) -> dict:
    """What one file's uint32 shards depend on (their manifest keeps it): the same again is up to date."""
    return {"source_md5": source_md5, "spec": spec, "val_fraction": val_fraction, "format_version": FORMAT_VERSION,
            "split": "the text's last val_fraction of characters (as train.bin/val.bin)"}


def _up_to_date_shards(out_dir: Path, settings: dict) -> dict | None:
    """The meta of one file's shards prepared with `settings`, whose tokenizer still loads as it was."""
    meta = _sharded_writer().text_shards_meta(out_dir, settings)
    try:
        if meta is not None and meta["spec"] not in TOKENIZERS:
            tokenizer_from_meta(meta)
    except DataError:
        return None
    return meta


def _write_tokens(file, tokens: np.ndarray) -> None:
    tokens.tofile(file)


def _stage(out_dir: Path, final_name: str, write) -> Path:
    """Write a file's new content next to it under a temp name; return that name."""
    temp = out_dir / f".{final_name}.{os.getpid()}.tmp"
    try:
        with open(temp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return temp


def _write_dataset(out_dir: Path, ids: dict[str, np.ndarray], meta: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    staged: dict[Path, Path] = {}  # final path -> temp path, meta.json last
    try:
        for split in SPLITS:
            staged[out_dir / f"{split}.bin"] = _stage(out_dir, f"{split}.bin", lambda f, s=split: _write_tokens(f, ids[s]))
        meta_bytes = (json.dumps(meta, indent=1, ensure_ascii=False) + "\n").encode("utf-8")
        staged[out_dir / "meta.json"] = _stage(out_dir, "meta.json", lambda f: f.write(meta_bytes))
        # meta.json leaves first and returns last: a crash between the renames leaves no meta.json
        # ("not prepared"), never an old meta.json describing new .bin files. A manifest.json of shards written
        # here before (a wider tokenizer's) goes too: the trainer would read it before train.bin.
        (out_dir / "meta.json").unlink(missing_ok=True)
        (out_dir / "manifest.json").unlink(missing_ok=True)
        for final, temp in staged.items():
            os.replace(temp, final)
    finally:
        for temp in staged.values():
            temp.unlink(missing_ok=True)  # only the ones a failure left behind still exist


# ---------------------------------------------------------------------------------------- read + check


def load_meta(data_dir: Path) -> dict:
    """meta.json of a prepared dataset; DataError (with the command to run) if it is missing or bad."""
    data_dir = Path(data_dir)
    path = data_dir / "meta.json"
    if not data_dir.is_dir():
        raise DataError(f"{data_dir} not found: this dataset has not been prepared. Run `{prepare_command(data_dir)}`")
    if not path.is_file():
        raise DataError(f"{path} not found: the dataset is not (completely) prepared. Run `{prepare_command(data_dir)}`")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        missing = [key for key in ("tokenizer", "vocab_size", "train_tokens", "val_tokens") if key not in meta]
    except (OSError, ValueError, TypeError) as e:
        raise DataError(f"{path} is unreadable ({e}). Re-run `{prepare_command(data_dir)}`") from None
    if missing:
        raise DataError(f"{path} lacks {', '.join(missing)}. Re-run `{prepare_command(data_dir)}`")
    return meta


def meta_or_builtin(data_dir: Path) -> dict:
    """meta.json of a prepared dataset; for a built-in one not prepared here, what its tokenizer alone says (the
    vocabulary: all a plan for another machine needs of the data). DataError for any other missing dataset."""
    try:
        return load_meta(data_dir)
    except DataError:
        kind = BUILTIN_TOKENIZER.get(Path(data_dir).name)
        if kind is None:
            raise
    tokenizer = CharTokenizer.from_text(shakespeare_text()) if kind == "char" else GPT2Tokenizer()
    return {"tokenizer": kind, "vocab_size": tokenizer.vocab_size, "prepared": False,
            **({"itos": tokenizer.itos} if kind == "char" else {})}


def check_split(data_dir: Path, split: str, block_size: int | None = None, meta: dict | None = None) -> int:
    """Number of tokens in data_dir/<split>.bin after checking it against meta.json (and block_size)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    data_dir = Path(data_dir)
    meta = load_meta(data_dir) if meta is None else meta
    path = data_dir / f"{split}.bin"
    if not path.is_file():
        raise DataError(f"{path} not found. Run `{prepare_command(data_dir)}`")
    size = path.stat().st_size
    if size % TOKEN_DTYPE.itemsize:
        raise DataError(f"{path} is truncated or corrupt: {size:,} bytes is not a whole number of 2-byte "
                        f"(uint16) tokens. Re-run `{prepare_command(data_dir)}`")
    n_tokens, expected = size // TOKEN_DTYPE.itemsize, meta[f"{split}_tokens"]
    if n_tokens != expected:
        raise DataError(f"{path} holds {n_tokens:,} tokens but {data_dir / 'meta.json'} expects {expected:,}: "
                        f"truncated or stale. Re-run `{prepare_command(data_dir)}`")
    # A foreign or corrupt file of the right length would otherwise end in the embedding's IndexError, mid-step.
    # One pass of max() over the mapped file: ~1 ms for Shakespeare, seconds for a 9B-token corpus.
    largest = int(np.memmap(path, dtype=TOKEN_DTYPE, mode="r").max()) if n_tokens else -1
    if largest >= int(meta["vocab_size"]):
        raise DataError(f"{path} holds token id {largest:,}, but {data_dir / 'meta.json'} gives a vocabulary of "
                        f"{int(meta['vocab_size']):,} (ids 0..{int(meta['vocab_size']) - 1:,}): the file was not "
                        f"written with this meta.json's tokenizer, or is corrupt. Re-run `{prepare_command(data_dir)}`")
    if block_size is not None and n_tokens < block_size + 1:
        raise DataError(f"block_size={block_size} needs windows of {block_size + 1:,} tokens (inputs and the "
                        f"shifted targets), but the {split} split ({path}) has only {n_tokens:,} tokens: "
                        "use a smaller block_size or a longer text")
    return n_tokens


def window_seed(seed: int, split: str, step: int) -> int:
    """A stable 63-bit seed per (seed, split, global batch number): Python's hash() of a str changes per process."""
    digest = hashlib.sha256(f"meshtrain-windows:{seed}:{split}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class TokenBatches:
    """Random windows of one split, a stream that belongs to the job rather than to its layout: next_batch() ->
    (x, y) int64 [batch_size, block_size], y = x shifted by 1.

    Global batch number i (one optimizer step: batch_size × dp_size × accum windows) starts at offsets drawn from a
    generator keyed by (seed, split, i) alone. Each data-parallel rank takes its slice: micro-step a of dp rank r
    the rows from (a × dp_size + r) × batch_size on. So the job sees the same windows in every layout with the same
    global batch: 4 ranks × 1 micro-step read what 2 ranks × 2 micro-steps do. Ranks that hold one replica in other
    dimensions (tp, cp, pp) pass the same dp_rank and so get the same batch. The position is the global batch number
    alone (`seek`): resuming at iteration i reads what the uninterrupted run read there, in any layout.
    """

    def __init__(self, data_dir: Path, split: str, block_size: int, batch_size: int, seed: int = 0,
                 dp_rank: int = 0, dp_size: int = 1, accum: int = 1, device: str | torch.device = "cpu"):
        if block_size < 1 or batch_size < 1 or accum < 1:
            raise ValueError(f"block_size, batch_size and accum must be >= 1, got {block_size}, {batch_size}, {accum}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must lie in [0, dp_size={dp_size}), got {dp_rank}")
        self.data_dir, self.split = Path(data_dir), split
        self.block_size, self.batch_size, self.accum = block_size, batch_size, accum
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self.global_batch = batch_size * dp_size * accum
        self.device = torch.device(device)
        self._load()
        self.step, self.micro = 0, 0  # where the next batch comes from: global batch `step`, micro-step `micro`
        self._drawn: tuple[int, torch.Tensor] | None = None  # the last global batch's offsets, all ranks'

    def _load(self) -> None:
        """Check the split and learn its size (a sharded corpus's reader does this its own way)."""
        self.meta = load_meta(self.data_dir)
        self.num_tokens = check_split(self.data_dir, self.split, block_size=self.block_size, meta=self.meta)
        self.path = self.data_dir / f"{self.split}.bin"

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def seek(self, step: int) -> None:
        """Start the next batch at global batch `step`, micro-step 0."""
        self.step, self.micro = int(step), 0

    def global_offsets(self, step: int) -> torch.Tensor:
        """The start offsets of every window of global batch `step` (all ranks', all micro-steps')."""
        if self._drawn is None or self._drawn[0] != step:
            generator = torch.Generator().manual_seed(window_seed(self.seed, self.split, step))
            high = self.num_tokens - self.block_size  # the last window starts at num_tokens - block_size - 1
            self._drawn = (step, torch.randint(high, (self.global_batch,), generator=generator))
        return self._drawn[1]

    def next_offsets(self) -> torch.Tensor:
        """The start offsets of this rank's next micro-batch (advances the position)."""
        start = (self.micro * self.dp_size + self.dp_rank) * self.batch_size
        offsets = self.global_offsets(self.step)[start:start + self.batch_size]
        self.micro += 1
        if self.micro == self.accum:
            self.step, self.micro = self.step + 1, 0
        return offsets

    def batch_at(self, offsets) -> tuple[torch.Tensor, torch.Tensor]:
        """The (x, y) windows starting at `offsets`, on the device."""
        windows = torch.from_numpy(self._windows(np.asarray(offsets).tolist()).astype(np.int64))
        x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        if self.device.type == "cuda":  # pinned host memory lets the copy overlap with compute
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)

    def _windows(self, offsets: list[int]) -> np.ndarray:
        """[len(offsets), block_size + 1] tokens, the windows starting at `offsets`."""
        # A fresh memmap per batch, as nanoGPT: a long-lived one keeps every page it touched mapped in
        # this process, so resident memory climbs towards the file size; re-mapping costs microseconds.
        tokens = np.memmap(self.path, dtype=TOKEN_DTYPE, mode="r")
        span = self.block_size + 1
        return np.stack([tokens[o:o + span] for o in offsets])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch_at(self.next_offsets())
