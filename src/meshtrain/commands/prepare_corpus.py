"""`meshtrain prepare text PATH… --workers N --shard-tokens N --field F`: the sharded-corpus side of `prepare`.

`prepare text` takes this path for more than one input, a folder or glob, jsonl/parquet/compressed files, llm.c
`.bin` shards (indexed in place), or any of its options; one plain text file without them keeps the single-file
train.bin/val.bin format (data/text.py).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from meshtrain.data.corpus import DEFAULT_SHARD_TOKENS, index_bin_shards, prepare_corpus
from meshtrain.data.corpus_sources import COMPRESSED, expand_inputs, file_format
from meshtrain.data.shards import verify
from meshtrain.data.text import DataError, default_data_root

__all__ = ["DEFAULT_SHARD_TOKENS", "is_corpus", "run_corpus"]
DEFAULT_FIELD = "text"


def is_corpus(paths: list[Path]) -> bool:
    """Whether the inputs of `prepare text` make a sharded corpus rather than one train.bin/val.bin."""
    if len(paths) != 1:
        return len(paths) > 1
    text = str(paths[0])
    return (any(char in text for char in "*?[") or Path(text).is_dir() or text.lower().endswith((*COMPRESSED, ".bin"))
            or file_format(Path(text)) != "text")


def _name(args: argparse.Namespace) -> str:
    """--name, else the first input's name without its format and compression suffixes."""
    if args.name:
        return args.name
    first = Path(args.path[0])
    if any(char in str(first) for char in "*?["):
        raise DataError("a glob names no dataset: give --name NAME")
    name = first.name
    for suffix in (*COMPRESSED, ".jsonl", ".ndjson", ".json", ".parquet", ".txt"):
        name = name.removesuffix(suffix)
    return name or "corpus"


def run_corpus(args: argparse.Namespace, log: logging.Logger) -> int:
    data_root = args.data_root if args.data_root is not None else default_data_root()
    try:
        if args.verify:
            if not args.name or args.path:
                log.error("--verify checks a prepared corpus: meshtrain prepare text --verify --name NAME")
                return 2
            problems = verify(data_root / args.name)
            for problem in problems:
                log.error("%s", problem)
            if not problems:
                log.info("%s: every shard agrees with its manifest's checksum", data_root / args.name)
            return 1 if problems else 0
        out_dir = data_root / _name(args)
        files = expand_inputs(args.path)
        if all(p.name.lower().endswith(".bin") for p in files):
            index_bin_shards(files, out_dir, tokenizer=args.tokenizer or "gpt2", force=args.force)
            return 0
        val_fraction = 0.1 if args.val_fraction is None else args.val_fraction
        prepare_corpus(args.path, out_dir, args.tokenizer or "gpt2", field=args.field or DEFAULT_FIELD,
                       workers=args.workers, shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS,
                       val_fraction=val_fraction, force=args.force)
    except DataError as e:
        log.error("%s", e)
        return 1
    return 0
