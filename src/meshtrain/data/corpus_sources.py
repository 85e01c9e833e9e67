"""The documents of a corpus on disk: which files a prepare reads, and the documents of each, streamed.

Inputs are files, folders (every file below, hidden ones skipped) and globs, each expanded in sorted order so
that the document numbering, and with it the split and the shards, is the same on every machine. A file is read
by its name: `.jsonl`/`.ndjson`/`.json` (one JSON object a line, the document in `field`), `.parquet` (the
`field` column, through pyarrow), anything else plain UTF-8 text (the whole file one document, read in pieces);
`.gz` and `.zst` on top of any of them are decompressed as the file streams.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
from collections.abc import Iterator
from pathlib import Path

from meshtrain.data.text import ENCODE_PIECE_CHARS, DataError, _pieces

COMPRESSED = (".gz", ".zst")
JSONL = (".jsonl", ".ndjson", ".json")
INSTALL_CORPUS = "pip install 'meshtrain[corpus]'"


def expand_inputs(paths) -> list[Path]:
    """Every file the inputs name, in a deterministic order, each once; DataError for an input that names none."""
    found: list[Path] = []
    for given in paths:
        text = str(given)
        if any(char in text for char in "*?["):
            files = [Path(p) for p in sorted(glob.glob(text, recursive=True)) if Path(p).is_file()]
        elif Path(text).is_dir():
            root = Path(text)
            files = sorted(p for p in root.rglob("*") if p.is_file()
                           and not any(part.startswith(".") for part in p.relative_to(root).parts))
        elif Path(text).is_file():
            files = [Path(text)]
        else:
            raise DataError(f"{text} not found: give files, folders or globs of text, jsonl or parquet")
        if not files:
            raise DataError(f"{text} names no files")
        found.extend(files)
    return list(dict.fromkeys(found))


def file_format(path: Path) -> str:
    """"jsonl", "parquet" or "text", from the name below any compression suffix."""
    name = path.name.lower()
    for suffix in COMPRESSED:
        name = name.removesuffix(suffix)
    if name.endswith(JSONL):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def _open_binary(path: Path):
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise DataError(f"{path} is zstd-compressed, which needs the zstandard package: {INSTALL_CORPUS}") from None
        # The raw file closes with the reader (closefd), so a long prepare does not collect open files.
        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
    return open(path, "rb")


def _open_text(path: Path):
    return io.TextIOWrapper(_open_binary(path), encoding="utf-8")


def documents(path: Path, field: str = "text") -> Iterator[Iterator[str]]:
    """The documents of one file, each an iterator of its text in pieces (one piece but for long plain text)."""
    kind = file_format(path)
    try:
        if kind == "jsonl":
            yield from _jsonl_documents(path, field)
        elif kind == "parquet":
            yield from _parquet_documents(path, field)
        else:
            yield _text_pieces(path)
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e})") from None
    except (OSError, EOFError) as e:  # a damaged gzip/zstd stream, a vanished file
        raise DataError(f"{path} cannot be read: {e}") from None


def _text_pieces(path: Path) -> Iterator[str]:
    """One plain-text file in pieces of about ENCODE_PIECE_CHARS, cut where tokenizing the pieces apart gives the
    tokens of the whole (text._pieces): memory stays flat whatever the file's size."""
    with _open_text(path) as f:
        buffer = ""
        while block := f.read(ENCODE_PIECE_CHARS):
            buffer += block
            if len(buffer) > 2 * ENCODE_PIECE_CHARS:
                *ready, buffer = _pieces(buffer, ENCODE_PIECE_CHARS)
                yield from ready
        yield buffer


def _jsonl_documents(path: Path, field: str) -> Iterator[Iterator[str]]:
    with _open_text(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[field]
            except (ValueError, KeyError, TypeError):
                raise DataError(f"{path}:{number} is not a JSON object with a string field {field!r} (choose the "
                                "field with --field)") from None
            if not isinstance(text, str):
                raise DataError(f"{path}:{number}: field {field!r} holds {type(text).__name__}, not text")
            yield iter((text,))


def _parquet_documents(path: Path, field: str) -> Iterator[Iterator[str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path} is parquet, which needs pyarrow: {INSTALL_CORPUS}") from None
    if path.name.lower().endswith(COMPRESSED):
        raise DataError(f"{path}: parquet compresses its own columns; give the .parquet file uncompressed")
    # Read as it is consumed: pyarrow's default pre-buffers a row group's column chunks whole, and its parent
    # process's memory then followed the row groups' size (benchmarks/prepare_corpus.py's memory rows).
    table = pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)
    if field not in table.schema_arrow.names:
        raise DataError(f"{path} has no column {field!r} (it has {', '.join(table.schema_arrow.names)}): choose "
                        "it with --field")
    for batch in table.iter_batches(batch_size=1024, columns=[field]):
        for text in batch.column(0).to_pylist():
            if text is not None:  # a null row is no document
                yield iter((text,))
