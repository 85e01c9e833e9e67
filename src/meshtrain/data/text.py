"""Text data for the GPT trainer: the shipped corpus, `prepare`, and random token windows (the tokenizers are
data/tokenizers.py's).

A prepared dataset is a folder DATA_ROOT/NAME holding
    train.bin, val.bin  token ids as raw little-endian uint16 (np.memmap-able): the first 90% of the
                        text, by character position, and the last 10%
    meta.json           tokenizer kind, vocab size, spec and fingerprint (+ stoi/itos for char), token counts,
                        source md5
A tokenizer of more than 65,536 ids writes the same split as uint32 shards + manifest.json instead
(data/prepare_text.py, through data/corpus.py write_text_shards; data/shards.py's format).

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

from meshtrain.data.tokenizers import (  # CharTokenizer, GPT2Tokenizer: importable here as before
    BUILTIN,
    CharTokenizer,
    GPT2Tokenizer,
)
from meshtrain.errors import DataError
from meshtrain.runtime.doctor import ERROR, OK, WARNING, Check
from meshtrain.runtime.log import get_logger

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


def shipped_data_check(data_root: Path) -> Check:
    """`meshtrain doctor`'s row: which of the shipped corpus's datasets are prepared under `data_root`, and whole."""
    prepared, missing = [], []
    for name in BUILTIN_TOKENIZER:
        data_dir = Path(data_root) / name
        if not (data_dir / "meta.json").is_file():
            missing.append(name)
            continue
        try:
            meta = load_meta(data_dir)
            tokens = [check_split(data_dir, split, meta=meta) for split in SPLITS]
        except DataError as e:
            return Check("shipped data", ERROR, str(e), f"{prepare_command(data_dir)} --force")
        prepared.append(f"{name} ({tokens[0]:,} train / {tokens[1]:,} val tokens)")
    found = f"{data_root}: " + "; ".join(prepared + [f"{name} not prepared" for name in missing])
    if missing:
        return Check("shipped data", WARNING, found, " && ".join(
            prepare_command(Path(data_root) / name) for name in missing))
    return Check("shipped data", OK, found)


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
