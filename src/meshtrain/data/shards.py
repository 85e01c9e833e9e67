"""Sharded token corpora: the shard file format, its writer, the manifest, and the reader the trainer draws from.

A sharded dataset is a folder DATA_ROOT/NAME holding
    manifest.json              the shards of each split in order (token counts, sha256), the tokenizer (spec,
                               fingerprint, vocab size), the split rule and the source files
    train_000000.bin, …        one shard: a 1,024-byte header, then `count` little-endian tokens
    val_000000.bin, …

The header: 8 bytes of magic b"MTSHARD\\0", uint32 version (1), uint32 bytes per token (2: uint16, 4: uint32 where
the vocabulary outgrows 65,536 ids), uint64 token count, 64 ASCII bytes of the tokenizer's sha256 fingerprint, zeros
to 1,024 bytes. llm.c / modded-nanogpt shards (256 int32: magic 20240520, version 1, the count at index 2, uint16
tokens) are read as they are. The trainer sees one split as the concatenation of its shards: a global token index,
windows across shard boundaries, each window read from its shard when drawn (no shard is mapped for long).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshtrain.data.text import SPLITS, DataError, TokenBatches

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "meshtrain-shards"
MANIFEST_VERSION = 1
HEADER_BYTES = 1024  # as llm.c's: the tokens start page-friendly, and both formats share one reader
MAGIC = b"MTSHARD\0"
VERSION = 1
_HEADER = struct.Struct("<8sIIQ64s")
LLMC_MAGIC, LLMC_VERSION = 20240520, 1
DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 where every id fits (half the bytes), else uint32."""
    return DTYPES[2] if vocab_size <= 1 << 16 else DTYPES[4]


@dataclass(frozen=True)
class ShardHeader:
    format: str  # "meshtrain" or "llm.c"
    dtype: np.dtype
    count: int
    fingerprint: str | None  # the tokenizer's; llm.c's header has none


def encode_header(count: int, dtype: np.dtype, fingerprint: str) -> bytes:
    packed = _HEADER.pack(MAGIC, VERSION, np.dtype(dtype).itemsize, count, fingerprint.encode("ascii")[:64])
    return packed.ljust(HEADER_BYTES, b"\0")


def decode_header(raw: bytes, path: Path) -> ShardHeader:
    """The header of shard `path` from its first bytes; DataError for any other file."""
    if len(raw) < HEADER_BYTES:
        raise DataError(f"{path} is truncated: {len(raw)} bytes, shorter than a shard's {HEADER_BYTES}-byte header")
    if raw[:8] == MAGIC:
        _, version, itemsize, count, fingerprint = _HEADER.unpack_from(raw)
        if version != VERSION or itemsize not in DTYPES:
            raise DataError(f"{path} is a meshtrain shard of version {version} with {itemsize}-byte tokens; this "
                            f"meshtrain reads version {VERSION} with 2 or 4: prepare the corpus again with it")
        return ShardHeader("meshtrain", DTYPES[itemsize], count, fingerprint.rstrip(b"\0").decode("ascii"))
    magic, version, count = np.frombuffer(raw[:12], dtype="<i4").tolist()
    if magic == LLMC_MAGIC:
        if version != LLMC_VERSION:
            raise DataError(f"{path} is an llm.c shard of version {version}; meshtrain reads version "
                            f"{LLMC_VERSION} (uint16 GPT-2 tokens) only")
        return ShardHeader("llm.c", DTYPES[2], count, None)
    raise DataError(f"{path} is not a token shard: its magic is {raw[:8]!r}, neither meshtrain's {MAGIC!r} nor "
                    f"llm.c's {LLMC_MAGIC}. Point the manifest at the shards `meshtrain prepare text` wrote")


def read_header(path: Path) -> ShardHeader:
    """The header of the shard at `path`, checked against the file's size."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            header = decode_header(f.read(HEADER_BYTES), path)
    except FileNotFoundError:
        raise DataError(f"{path} not found") from None
    expected = HEADER_BYTES + header.count * header.dtype.itemsize
    size = path.stat().st_size
    if size != expected:
        raise DataError(f"{path} is truncated or corrupt: {size:,} bytes, but its header's {header.count:,} "
                        f"{header.dtype.itemsize}-byte tokens make {expected:,}")
    return header


def read_tokens(path: Path, header: ShardHeader | None = None) -> np.memmap:
    """The tokens of one shard, mapped (not read): pages come in as windows touch them."""
    header = read_header(path) if header is None else header
    return np.memmap(path, dtype=header.dtype, mode="r", offset=HEADER_BYTES, shape=(header.count,))


def write_llmc_shard(path: Path, tokens) -> None:
    """An llm.c-format shard (for tests and for handing data to llm.c): 256 int32 header, uint16 tokens."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = LLMC_MAGIC, LLMC_VERSION, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype="<u2").tobytes())


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------------ writing


class ShardWriter:
    """The shards of one split, streamed: tokens go straight to a temp file, which is renamed to its final name
    once full (a half-written shard is never read as whole). `on_shard(entry)` hears of each finished shard.

    Resuming: `resume=(doc, k)` says the finished shards already hold every token of the documents before `doc`
    and the first k of `doc`; add() then drops exactly those, so the shards continue where they stopped.
    """

    def __init__(self, out_dir: Path, split: str, shard_tokens: int, dtype: np.dtype, fingerprint: str,
                 on_shard, first_index: int = 0, resume: tuple[int, int] = (0, 0)):
        self.out_dir, self.split, self.shard_tokens = Path(out_dir), split, shard_tokens
        self.dtype, self.fingerprint, self.on_shard = np.dtype(dtype), fingerprint, on_shard
        self.index, self.resume = first_index, resume
        self.doc, self.in_doc = -1, 0  # the document being added and how many of its tokens came before
        self.file, self.count, self.starts = None, 0, []  # starts: where documents begin in the open shard

    def add(self, doc: int, tokens: np.ndarray) -> None:
        """The next tokens of the split, from document `doc` (documents arrive in order, a long one in pieces)."""
        if doc != self.doc:
            self.doc, self.in_doc = doc, 0
        start, self.in_doc = self.in_doc, self.in_doc + len(tokens)
        if doc < self.resume[0]:
            return
        drop = max(0, self.resume[1] - start) if doc == self.resume[0] else 0
        position = start + drop
        tokens = tokens[drop:]
        while len(tokens):
            if self.file is None:
                self._open()
            if position == 0:  # the document's first token goes here
                self.starts.append(self.count)
            taken = tokens[:self.shard_tokens - self.count]
            self.file.write(np.asarray(taken, dtype=self.dtype).tobytes())
            self.count += len(taken)
            position += len(taken)
            tokens = tokens[len(taken):]
            if self.count == self.shard_tokens:
                self._finish(end=(doc, position))

    def close(self) -> None:
        """Finish the last, shorter shard."""
        if self.file is not None:
            self._finish(end=(self.doc, self.in_doc))

    def _temp(self) -> Path:
        return self.out_dir / f".{self.split}_{self.index:06d}.bin.tmp"

    def _open(self) -> None:
        self.file = open(self._temp(), "wb")
        self.file.write(b"\0" * HEADER_BYTES)  # the real header, with the count, when the shard is done
        self.count, self.starts = 0, []

    def _finish(self, end: tuple[int, int]) -> None:
        self.file.seek(0)
        self.file.write(encode_header(self.count, self.dtype, self.fingerprint))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        self.file = None
        name, index = f"{self.split}_{self.index:06d}.bin", f"{self.split}_{self.index:06d}.idx"
        # The document index beside it (int64 starts within the shard; data.order=epoch shuffles documents), in
        # place before the shard: a shard on disk always has its index.
        temp_index = self.out_dir / f".{index}.tmp"
        np.asarray(self.starts, dtype="<i8").tofile(temp_index)
        os.replace(temp_index, self.out_dir / index)
        os.replace(self._temp(), self.out_dir / name)
        self.on_shard({"path": name, "tokens": self.count, "sha256": file_sha256(self.out_dir / name),
                       "end": list(end), "index": index, "documents": len(self.starts)})
        self.index += 1


# ------------------------------------------------------------------------------------------------ reading


def is_sharded(data_dir: Path) -> bool:
    return (Path(data_dir) / MANIFEST).is_file()


def load_manifest(data_dir: Path) -> dict:
    """manifest.json of a sharded dataset; DataError with the fix if it is missing or unreadable."""
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise DataError(f"{path} not found: the corpus is not (completely) prepared. Run `meshtrain prepare text "
                        f"PATH… --name {Path(data_dir).name}` (again: finished shards are kept)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        ok = manifest.get("format") == MANIFEST_FORMAT and manifest.get("format_version") == MANIFEST_VERSION
        ok = ok and all(split in manifest["splits"] for split in SPLITS) and "vocab_size" in manifest["tokenizer"]
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise DataError(f"{path} is unreadable ({e}): prepare the corpus again") from None
    if not ok:
        raise DataError(f"{path} is not a version-{MANIFEST_VERSION} meshtrain shard manifest: prepare the corpus "
                        "again with this meshtrain")
    return manifest


def manifest_meta(manifest: dict) -> dict:
    """What a prepared dataset's meta.json says (tokenizer, vocab size, token counts), from a manifest."""
    return {**manifest["tokenizer"], **{f"{s}_tokens": manifest["splits"][s]["tokens"] for s in SPLITS}}


def shard_path(data_dir: Path, entry: dict) -> Path:
    return Path(data_dir) / entry["path"]  # an absolute path (llm.c shards indexed in place) stays as it is


class ShardedTokens:
    """One split of a sharded dataset as one token sequence: global index i is token i of the shards laid end to
    end. Start-up checks every shard's header and size against the manifest (a few bytes each; no tokens read)."""

    def __init__(self, data_dir: Path, split: str, manifest: dict | None = None):
        self.data_dir = Path(data_dir)
        manifest = load_manifest(self.data_dir) if manifest is None else manifest
        fingerprint = manifest["tokenizer"].get("fingerprint")
        self.paths, self.headers, self.indexes = [], [], []
        for entry in manifest["splits"][split]["shards"]:
            path = shard_path(self.data_dir, entry)
            try:
                header = read_header(path)
            except DataError as e:
                raise DataError(f"{e}. The manifest {self.data_dir / MANIFEST} lists it: prepare the corpus again "
                                "(`meshtrain prepare text PATH… --name NAME` keeps the shards that are whole)") from None
            foreign = header.format != entry.get("format", "meshtrain") or header.fingerprint not in (None, fingerprint)
            if header.count != entry["tokens"] or foreign:
                what = (f"{header.count:,} tokens where the manifest says {entry['tokens']:,}"
                        if header.count != entry["tokens"] else "another tokenizer's tokens")
                raise DataError(f"{path} holds {what}: it is not the shard {self.data_dir / MANIFEST} lists. "
                                "Prepare the corpus again")
            self.paths.append(path)
            self.headers.append(header)
            self.indexes.append(shard_path(self.data_dir, {"path": entry["index"]}) if "index" in entry else None)
        counts = [h.count for h in self.headers]
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.num_tokens = int(self.starts[-1])

    def document_starts(self) -> np.ndarray:
        """Where each document of the split begins, as global token indices (from the shards' .idx files)."""
        if None in self.indexes:
            raise DataError(f"{self.data_dir} has no document index (shards indexed in place, or an older prepare): "
                            "data.order=epoch needs the .idx files `meshtrain prepare text` writes beside its shards")
        parts = []
        for path, start in zip(self.indexes, self.starts[:-1], strict=True):
            try:
                parts.append(np.fromfile(path, dtype="<i8") + start)
            except OSError as e:
                raise DataError(f"{path} cannot be read ({e}): prepare the corpus again") from None
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the split, across shard boundaries, as int64."""
        out = np.empty(length, dtype=np.int64)
        shard, done = int(np.searchsorted(self.starts, start, side="right")) - 1, 0
        while done < length:
            begin = start + done - int(self.starts[shard])
            take = min(length - done, self.headers[shard].count - begin)
            out[done:done + take] = self._pread(shard, begin, take)
            done += take
            shard += 1
        return out

    def _pread(self, shard: int, begin: int, count: int) -> np.ndarray:
        """Tokens [begin, begin + count) of one shard. A read, not a map: mapping a shard cost ~40 µs a window
        against ~6 µs to open it and read, and keeps no page of it in this process (a long-lived map would keep
        every page it touched resident)."""
        dtype, path = self.headers[shard].dtype, self.paths[shard]
        with open(path, "rb", buffering=0) as f:
            raw = os.pread(f.fileno(), count * dtype.itemsize, HEADER_BYTES + begin * dtype.itemsize)
        if len(raw) != count * dtype.itemsize:
            raise DataError(f"{path} was truncated while training read it: prepare the corpus again")
        return np.frombuffer(raw, dtype=dtype)


class ShardBatches(TokenBatches):
    """TokenBatches over a sharded split: the same draw (offsets keyed by seed, split and global batch alone, over
    the split's token count), the windows read through the global index."""

    def __init__(self, data_dir: Path, split: str, block_size: int, batch_size: int, **kwargs):
        self._tokens = ShardedTokens(data_dir, split)
        super().__init__(data_dir, split, block_size, batch_size, **kwargs)

    def _load(self) -> None:
        self.meta = manifest_meta(load_manifest(self.data_dir))
        self.num_tokens = self._tokens.num_tokens
        self.path = self.data_dir / MANIFEST
        if self.num_tokens < self.block_size + 1:
            raise DataError(f"block_size={self.block_size} needs windows of {self.block_size + 1:,} tokens, but "
                            f"the {self.split} split of {self.data_dir} has only {self.num_tokens:,}: use a smaller "
                            "block_size or more documents")

    def _windows(self, offsets: list[int]) -> np.ndarray:
        span = self.block_size + 1
        return np.stack([self._tokens.read(o, span) for o in offsets])


def verify(data_dir: Path) -> list[str]:
    """The problems found by reading every shard in full (sha256 against the manifest); empty when all is well."""
    manifest, problems = load_manifest(data_dir), []
    for split in SPLITS:
        for entry in manifest["splits"][split]["shards"]:
            path = shard_path(data_dir, entry)
            try:
                read_header(path)
                if entry.get("sha256") and file_sha256(path) != entry["sha256"]:
                    problems.append(f"{path}: sha256 differs from the manifest's (corrupt or replaced)")
            except DataError as e:
                problems.append(str(e))
    return problems

