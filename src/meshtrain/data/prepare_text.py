"""`prepare` of one text file (or the shipped Shakespeare) into DATA_ROOT/NAME: train.bin, val.bin and meta.json
(data/text.py's format, which the trainer reads), or, for a tokenizer of more than 65,536 ids, the same split as
uint32 shards + manifest.json (data/corpus.py write_text_shards). Apart from data/text.py, which reads datasets,
because writing the wide ones needs data/corpus.py, which reads through data/text.py itself.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from meshtrain.data import corpus
from meshtrain.data.text import (
    BUILTIN_TOKENIZER,
    ENCODE_PIECE_CHARS,
    FORMAT_VERSION,
    SHAKESPEARE_ASSET,
    SPLITS,
    TOKEN_DTYPE,
    TOKENIZERS,
    WIDE_TOKEN_DTYPE,
    _asset_bytes,
    _pieces,
    check_split,
    load_meta,
)
from meshtrain.data.tokenizers import Tokenizer, canonical_spec, load_tokenizer, tokenizer_from_meta
from meshtrain.errors import DataError
from meshtrain.runtime.log import get_logger
from meshtrain.runtime.progress import progress_bar

log = get_logger("data")


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
        return corpus.write_text_shards(out_dir, tok, ids, _shard_settings(source_md5, spec, val_fraction))
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


def _shard_settings(source_md5: str, spec: str, val_fraction: float) -> dict:
    """What one file's uint32 shards depend on (their manifest keeps it): the same again is up to date."""
    return {"source_md5": source_md5, "spec": spec, "val_fraction": val_fraction, "format_version": FORMAT_VERSION,
            "split": "the text's last val_fraction of characters (as train.bin/val.bin)"}


def _up_to_date_shards(out_dir: Path, settings: dict) -> dict | None:
    """The meta of one file's shards prepared with `settings`, whose tokenizer still loads as it was."""
    meta = corpus.text_shards_meta(out_dir, settings)
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

