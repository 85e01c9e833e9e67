"""`meshtrain prepare text PATH…` for corpora of any size: documents tokenized by worker processes into shards.

The documents of every input (data/corpus_sources.py) are numbered in order; document d goes to the validation
split when a hash of d falls below --val-fraction (a fixed choice per document: never a document cut in two, the
same split whatever the workers). Documents are gathered into chunks of about CHUNK_CHARS characters, chunks go to
the workers, and their tokens come back and are written in chunk order: the shards are the same bytes for any
number of workers. At most two chunks per worker are in flight, so memory stays flat whatever the corpus.

Each document is preceded by the tokenizer's end-of-text token (as llm.c's fineweb.py), none for a tokenizer
without one. After every finished shard, progress.json records the shards so far; a prepare run again with the
same inputs keeps the finished shards whose checksums agree and continues after them (data/shards.py ShardWriter).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from itertools import chain
from pathlib import Path

import numpy as np

from meshtrain.data.corpus_sources import documents, expand_inputs
from meshtrain.data.shards import (
    MANIFEST,
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    ShardWriter,
    file_sha256,
    load_manifest,
    manifest_meta,
    read_header,
    shard_path,
    token_dtype,
)
from meshtrain.data.text import SPLITS, DataError
from meshtrain.data.tokenizers import CharTokenizer, Tokenizer, load_tokenizer
from meshtrain.runtime.log import get_logger
from meshtrain.runtime.progress import progress_bar
from meshtrain.runtime.rundir import write_atomically

log = get_logger("data")

PROGRESS = "progress.json"
CHUNK_CHARS = 1 << 20  # a worker's unit: large enough that sending it costs little beside tokenizing it
DEFAULT_SHARD_TOKENS = 100_000_000


def available_cores() -> int:
    """The cores this process may run on (a batch job's share of a node, not the node's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def is_val(doc: int, val_fraction: float) -> bool:
    """Whether document `doc` is held out: a hash of its number, so the choice is spread evenly and fixed."""
    digest = hashlib.blake2b(doc.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * (1 << 64)


def _settings(files: list[Path], field: str, tok: Tokenizer, shard_tokens: int, val_fraction: float) -> dict:
    """Everything the shards depend on: a prepare with other settings starts over rather than resume."""
    sources = [{"path": str(p.resolve()), "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns} for p in files]
    return {"sources": sources, "field": field, "tokenizer": tok.fingerprint, "shard_tokens": shard_tokens,
            "val_fraction": val_fraction, "format_version": MANIFEST_VERSION}


def char_vocabulary(files: list[Path], field: str) -> Tokenizer:
    """A character tokenizer for the corpus: one streaming pass collects its characters (sorted, as text.py's)."""
    chars: set[str] = set()
    for path in files:
        for doc in documents(path, field):
            for piece in doc:
                chars.update(piece)
    return CharTokenizer.from_text("".join(chars))


# ------------------------------------------------------------------------------------------------ workers

_worker_tokenizer: Tokenizer | None = None


def _start_worker(tok: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tok


def encode_chunk(texts: list[str], firsts: list[bool], tok: Tokenizer | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The tokens of a chunk's pieces laid end to end (uint32) and each piece's length; a document's first piece
    starts with the end-of-text token. One array rather than lists: it crosses the process boundary cheaply."""
    tok = _worker_tokenizer if tok is None else tok
    eot = tok.eot_id
    encoded = tok.encode_batch(texts)
    heads = [[eot] if first and eot is not None else [] for first in firsts]
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)) + [len(h) for h in heads]
    # chain.from_iterable keeps the per-token loop in C: a generator expression here took most of the time
    flat = chain.from_iterable(chain.from_iterable(zip(heads, encoded, strict=True)))
    return np.fromiter(flat, dtype=np.uint32, count=int(lengths.sum())), lengths


def _chunks(files: list[Path], field: str, skip_before: int, bar) -> Iterator[tuple[list[int], list[str], list[bool]]]:
    """(document numbers, texts, first-piece flags) of about CHUNK_CHARS characters each, in corpus order;
    documents before `skip_before` are counted, not sent (finished shards hold them)."""
    docs, texts, firsts, size, number = [], [], [], 0, -1
    for path in files:
        for doc in documents(path, field):
            number += 1
            for i, piece in enumerate(doc):
                if number < skip_before:
                    continue
                docs.append(number)
                texts.append(piece)
                firsts.append(i == 0)
                size += len(piece)
                if size >= CHUNK_CHARS:
                    yield docs, texts, firsts
                    docs, texts, firsts, size = [], [], [], 0
        bar.update(path.stat().st_size)
    if docs:
        yield docs, texts, firsts


@contextmanager
def worker_pool(tok: Tokenizer, workers: int) -> Iterator[ProcessPoolExecutor | None]:
    """`workers` tokenizing processes (None for one: this process tokenizes), forked before the caller starts any
    thread (a progress bar's): fork copies only the calling thread, so a lock held by another would stay held."""
    if workers <= 1:
        yield None
        return
    # fork: the workers start in milliseconds with the tokenizer already built (a spawn re-imports torch)
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker, initargs=(tok,)) as pool:
        pool.submit(int).result()  # under fork, the first task starts every worker
        yield pool


def _encoded(chunks, tok: Tokenizer, pool: ProcessPoolExecutor | None,
             workers: int) -> Iterator[tuple[list[int], np.ndarray, np.ndarray]]:
    """(document numbers, tokens, piece lengths) of every chunk, in order, tokenized by the pool's processes."""
    if pool is None:
        for docs, texts, firsts in chunks:
            yield docs, *encode_chunk(texts, firsts, tok)
        return
    pending: deque = deque()
    for docs, texts, firsts in chunks:
        pending.append((docs, pool.submit(encode_chunk, texts, firsts)))
        if len(pending) >= 2 * workers:  # bounded: the reader never runs ahead of the workers by more
            docs_done, future = pending.popleft()
            yield docs_done, *future.result()
    while pending:
        docs_done, future = pending.popleft()
        yield docs_done, *future.result()


# ------------------------------------------------------------------------------------------------ prepare


def prepare_corpus(inputs, out_dir: Path, tokenizer="gpt2", *, field: str = "text", workers: int | None = None,
                   shard_tokens: int = DEFAULT_SHARD_TOKENS, val_fraction: float = 0.1, force: bool = False) -> dict:
    """Tokenize the documents of `inputs` (files, folders, globs) into shards in `out_dir`; return the manifest.

    `tokenizer`: a spec of data/tokenizers.py ("char": a vocabulary of the corpus's characters) or a Tokenizer. A corpus
    prepared before with the same settings is left as it is; one interrupted is continued (unless `force`).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must lie in [0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise DataError(f"shard_tokens must be at least 1, got {shard_tokens}")
    out_dir, files = Path(out_dir), expand_inputs(inputs)
    workers = available_cores() if workers is None else max(1, int(workers))
    if tokenizer == "char":  # the one spec fitted to its text: its characters, from a first pass
        tok = char_vocabulary(files, field)
    else:
        tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    settings = _settings(files, field, tok, shard_tokens, val_fraction)
    if not force and (done := _up_to_date(out_dir, settings)) is not None:
        log.info("%s is up to date (%s train and %s val tokens in %s shards): nothing to do", out_dir / MANIFEST,
                 f"{done['splits']['train']['tokens']:,}", f"{done['splits']['val']['tokens']:,}",
                 sum(len(done["splits"][s]["shards"]) for s in SPLITS))
        return done
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = {split: [] for split in SPLITS} if force else _kept_shards(out_dir, settings)
    _clear(out_dir, keep={e["path"] for split in SPLITS for e in shards[split]})
    return _run(files, out_dir, tok, settings, shards, workers)


def _run(files, out_dir: Path, tok: Tokenizer, settings: dict, shards: dict, workers: int) -> dict:
    dtype = token_dtype(tok.vocab_size)

    def finished(split):
        def record(entry):
            shards[split].append(entry)
            _write_json(out_dir / PROGRESS, {"settings": settings, "shards": shards})
            log.info("wrote %s (%s tokens)", out_dir / entry["path"], f"{entry['tokens']:,}")
        return record

    resume = {split: tuple(shards[split][-1]["end"]) if shards[split] else (0, 0) for split in SPLITS}
    writers = {split: ShardWriter(out_dir, split, settings["shard_tokens"], dtype, tok.fingerprint, finished(split),
                                  first_index=len(shards[split]), resume=resume[split]) for split in SPLITS}
    if any(shards.values()):
        log.info("continuing after %s finished shard(s) in %s", sum(map(len, shards.values())), out_dir)
    log.info("tokenizing %s file(s) with %s (vocab %s, %s tokens) in %s worker(s)", len(files), tok.spec[:40],
             f"{tok.vocab_size:,}", dtype.name, workers)
    skip_before = min(doc for doc, _ in resume.values())
    total_bytes = sum(p.stat().st_size for p in files)
    with worker_pool(tok, workers) as pool, progress_bar(total_bytes, "tokenizing, bytes") as bar:
        for docs, tokens, lengths in _encoded(_chunks(files, settings["field"], skip_before, bar), tok, pool, workers):
            for doc, piece in zip(docs, np.split(tokens, np.cumsum(lengths)[:-1]), strict=True):
                writers["val" if is_val(doc, settings["val_fraction"]) else "train"].add(doc, piece)
    for writer in writers.values():
        writer.close()
    return _finish(out_dir, tok, settings, shards, dtype)


def _finish(out_dir: Path, tok: Tokenizer, settings: dict, shards: dict, dtype) -> dict:
    splits = {s: {"tokens": sum(e["tokens"] for e in shards[s]), "shards": shards[s]} for s in SPLITS}
    for split in SPLITS:
        if splits[split]["tokens"] == 0 and (split == "train" or settings["val_fraction"] != 0):
            raise DataError(f"the corpus gave the {split} split no tokens: it needs more documents (a plain text "
                            "file is one document), or another --val-fraction")
    manifest = {"format": MANIFEST_FORMAT, "format_version": MANIFEST_VERSION, "name": out_dir.name,
                "tokenizer": tok.meta(), "dtype": dtype.name, "splits": splits, "settings": settings,
                "split_rule": "document d is val when blake2b-64(d) < val_fraction * 2**64 (corpus.is_val)"}
    _write_json(out_dir / MANIFEST, manifest)
    (out_dir / PROGRESS).unlink(missing_ok=True)
    log.info("wrote %s: %s train and %s val tokens", out_dir / MANIFEST, f"{splits['train']['tokens']:,}",
             f"{splits['val']['tokens']:,}")
    return manifest


def _write_json(path: Path, value: dict) -> None:
    write_atomically(path, json.dumps(value, indent=1) + "\n")  # ASCII (non-ASCII escaped): any locale writes it


def _up_to_date(out_dir: Path, settings: dict) -> dict | None:
    """The manifest of a finished prepare with these settings whose shards are all there at their sizes."""
    try:
        manifest = load_manifest(out_dir)
        if manifest.get("settings") != settings:
            return None
        for split in SPLITS:
            for entry in manifest["splits"][split]["shards"]:
                if read_header(shard_path(out_dir, entry)).count != entry["tokens"]:
                    return None
    except DataError:
        return None
    return manifest


def _kept_shards(out_dir: Path, settings: dict) -> dict[str, list[dict]]:
    """The shards an interrupted prepare with the same settings finished whose checksums still agree: per split,
    the longest run from the first on (a later shard continues where the one before it ended)."""
    kept = {split: [] for split in SPLITS}
    try:
        progress = json.loads((out_dir / PROGRESS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return kept
    if progress.get("settings") != settings:
        return kept
    for split in SPLITS:
        for entry in progress["shards"].get(split, []):
            path = out_dir / entry["path"]
            index = out_dir / entry.get("index", entry["path"])
            if not path.is_file() or not index.is_file() or file_sha256(path) != entry["sha256"]:
                break
            kept[split].append(entry)
    return kept


def _clear(out_dir: Path, keep: set[str]) -> None:
    """Remove what a new or continued prepare rewrites: the manifest first (the folder is then "not prepared",
    never a manifest over other shards), shards not kept, temp files a killed prepare left."""
    (out_dir / MANIFEST).unlink(missing_ok=True)
    for path in out_dir.iterdir():
        shard = path.suffix in (".bin", ".idx") and path.name.startswith(tuple(f"{s}_" for s in SPLITS))
        if (shard and path.with_suffix(".bin").name not in keep) or path.name.endswith(".tmp"):
            path.unlink()


def write_text_shards(out_dir: Path, tok: Tokenizer, ids: dict[str, np.ndarray], settings: dict) -> dict:
    """`prepare text` of one file whose tokenizer outgrows train.bin's uint16 ids: its train and val tokens (split by
    characters, as train.bin's) as uint32 shards and a manifest, which the trainer reads as any sharded corpus.
    Returns what meta.json would say."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _clear(out_dir, keep=set())  # the manifest first: never one over half-replaced shards
    for name in ("meta.json", "train.bin", "val.bin"):  # a narrower tokenizer's dataset written here before
        (out_dir / name).unlink(missing_ok=True)
    dtype, shards = token_dtype(tok.vocab_size), {split: [] for split in SPLITS}
    for split in SPLITS:
        writer = ShardWriter(out_dir, split, DEFAULT_SHARD_TOKENS, dtype, tok.fingerprint, shards[split].append)
        writer.add(0, ids[split])  # each split is one document (data.order=epoch reads it once an epoch)
        writer.close()
    return _meta(_finish(out_dir, tok, settings, shards, dtype))


def text_shards_meta(out_dir: Path, settings: dict) -> dict | None:
    """What meta.json would say of one file's shards written with `settings` (write_text_shards), None unless they
    are all there."""
    done = _up_to_date(out_dir, settings)
    return None if done is None else _meta(done)


def _meta(manifest: dict) -> dict:
    return {**manifest_meta(manifest), "dtype": manifest["dtype"], **manifest["settings"]}


def index_bin_shards(files: list[Path], out_dir: Path, tokenizer="gpt2", *, force: bool = False) -> dict:
    """A manifest over token shards that exist already (llm.c's, modded-nanogpt's, or meshtrain's), read where they
    are: a file whose name holds "val" is validation (llm.c's fineweb_val_000000.bin), every other trains."""
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    settings = {"sources": [str(Path(p).resolve()) for p in files], "tokenizer": tok.fingerprint,
                "format_version": MANIFEST_VERSION, "val_fraction": "by name"}
    out_dir = Path(out_dir)
    if not force and (done := _up_to_date(out_dir, settings)) is not None:
        log.info("%s is up to date: nothing to do", out_dir / MANIFEST)
        return done
    shards: dict[str, list[dict]] = {split: [] for split in SPLITS}
    dtypes = set()
    for path in files:
        header = read_header(path)
        if header.fingerprint not in (None, tok.fingerprint) or header.dtype.itemsize > token_dtype(tok.vocab_size).itemsize:
            raise DataError(f"{path} was not written with the {tok.spec[:40]} tokenizer: choose it with --tokenizer")
        dtypes.add(header.dtype)
        split = "val" if "val" in Path(path).name.lower() else "train"
        shards[split].append({"path": str(Path(path).resolve()), "tokens": header.count, "sha256": file_sha256(path),
                               "format": header.format})
    out_dir.mkdir(parents=True, exist_ok=True)
    return _finish(out_dir, tok, settings, shards, max(dtypes, key=lambda d: d.itemsize))
