"""`meshtrain prepare`: tokenize a corpus into DATA_ROOT/NAME/{train.bin,val.bin,meta.json}, train a tokenizer,
or write ERA5-like data.

    meshtrain prepare shakespeare_char            characters of the shipped tiny-Shakespeare
    meshtrain prepare shakespeare                 GPT-2 BPE of the same corpus
    meshtrain prepare text PATH [--tokenizer SPEC] [--name NAME]   a text file of your own; SPEC: char (default),
                                  gpt2, a tiktoken encoding from its local cache (cl100k_base ...), a tokenizer.json
                                  or a tiktoken ranks file (data/tokenizers.py)
    meshtrain prepare text PATH… [--tokenizer SPEC] [--field text] [--workers N] [--shard-tokens N] [--name NAME]
                                  a corpus (files, folders, globs of text, jsonl, parquet; .gz/.zst) into shards
                                  and manifest.json (data/corpus.py); llm.c .bin shards are indexed in place
    meshtrain prepare text --verify --name NAME   read every shard of a sharded corpus against its checksums
    meshtrain prepare tokenizer PATH... --vocab-size N --out FILE.json
                                  a byte-level BPE trained on the text files, written as a Hugging Face
                                  tokenizer.json that --tokenizer FILE.json reads
    meshtrain prepare era5-synthetic [--out DIR] [--years 2011 ... 2018] [--samples-per-year 64]
                                     [--grid 90x180] [--channels 20] [--seed 0] [--dt-hours 6]
                                     [--train-years ... --valid-years ... --test-years ...]
                                  weather fields in NERSC's ERA5 layout (train/ valid/ test/ YEAR.h5, stats/)
                                  for the ViT forecaster; years sorted: all but the last two train, the
                                  second to last validates, the last tests (two years: train + valid)

One plain text file without the corpus options keeps the single-file format above. DATA_ROOT is --data-root,
else $MESHTRAIN_DATA_ROOT, else ./data; era5-synthetic writes to --out, else
DATA_ROOT/era5_synthetic. Running it again is cheap: a dataset made from the same source bytes (the same
parameters, for era5-synthetic) is left as it is.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from meshtrain.commands.prepare_corpus import DEFAULT_SHARD_TOKENS, is_corpus, run_corpus
from meshtrain.data.prepare_text import prepare
from meshtrain.data.text import (
    BUILTIN_TOKENIZER,
    DATA_ROOT_ENV,
    DEFAULT_DATA_ROOT,
    DataError,
    default_data_root,
)
from meshtrain.data.tokenizers import train_bpe
from meshtrain.runtime.log import get_logger

ERA5_SYNTHETIC = "era5-synthetic"
ERA5_DIR_NAME = "era5_synthetic"
TOKENIZER = "tokenizer"
DATASETS = (*BUILTIN_TOKENIZER, "text", TOKENIZER, ERA5_SYNTHETIC)
DEFAULT_VAL_FRACTION = 0.1
CORPUS_OPTIONS = ("field", "workers", "shard_tokens", "verify")
ERA5_OPTIONS = ("out", "years", "samples_per_year", "grid", "channels", "seed", "dt_hours", "train_years",
                "valid_years", "test_years")


def grid_size(text: str) -> tuple[int, int]:
    """'90x180' -> (90, 180): rows (latitudes, both poles included) x columns (longitudes)."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected ROWSxCOLUMNS such as 90x180, got {text!r}")
    return int(match[1]), int(match[2])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dataset", choices=DATASETS,
                        help="shakespeare_char (chars), shakespeare (GPT-2 BPE), text (your file at PATH), "
                             f"{TOKENIZER} (train a BPE on the files at PATH...), "
                             f"or {ERA5_SYNTHETIC} (weather fields for the ViT)")
    parser.add_argument("path", nargs="*", type=Path, default=[], metavar="PATH",
                        help="with `text`: a UTF-8 text file, or a corpus: files, folders, globs (quoted) of text, "
                             "jsonl and parquet, plain or .gz/.zst, or llm.c .bin shards to index in place; with "
                             f"`{TOKENIZER}`: the text files to train on")
    parser.add_argument("--tokenizer", default=None, metavar="SPEC",
                        help="for `text`: char (the default for one file), gpt2 (the default for a sharded corpus), "
                             "a tiktoken encoding in its local cache (cl100k_base, o200k_base ...), a tokenizer.json, "
                             "or a tiktoken ranks file (docs/training.md)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help=f"for `{TOKENIZER}`: the tokens of the trained BPE (bytes and <|endoftext|> included)")
    parser.add_argument("--name", default=None,
                        help="for `text`: the dataset's folder under the data root (default: PATH's file stem)")
    parser.add_argument("--data-root", type=Path, default=None,
                        help=f"where datasets live (default: ${DATA_ROOT_ENV} or ./{DEFAULT_DATA_ROOT})")
    parser.add_argument("--val-fraction", type=float, default=None,
                        help="share of the text, taken from its end (one file), or of the documents, chosen by a hash of "
                             "their numbers (a sharded corpus), held out for validation (default 0.1)")
    parser.add_argument("--force", action="store_true", help="prepare again even if the dataset is up to date")
    corpus = parser.add_argument_group("sharded corpus (`text`; any of these, or more than one plain text file)")
    corpus.add_argument("--field", default=None, help="the jsonl field / parquet column of the text (default text)")
    corpus.add_argument("--workers", type=int, default=None,
                        help="tokenizing processes (default: the cores); the shards are the same for any number")
    corpus.add_argument("--shard-tokens", type=int, default=None,
                        help=f"tokens per shard (default {DEFAULT_SHARD_TOKENS:,})")
    corpus.add_argument("--verify", action="store_true",
                        help="read every shard of the corpus --name against the manifest's checksums")

    era5 = parser.add_argument_group(ERA5_SYNTHETIC)
    era5.add_argument("--out", type=Path, default=None,
                      help=f"the dataset directory (default: DATA_ROOT/{ERA5_DIR_NAME}); for `{TOKENIZER}`, "
                           "the tokenizer.json to write")
    era5.add_argument("--years", type=int, nargs="+", default=None,
                      help="years to write, split by the rule: all but the last two train, the second to last "
                           "is valid, the last is test; with two: train + valid (default: 2011 to 2018)")
    era5.add_argument("--train-years", type=int, nargs="+", default=None,
                      help="choose the splits explicitly instead of --years (with --valid-years, --test-years)")
    era5.add_argument("--valid-years", type=int, nargs="+", default=None)
    era5.add_argument("--test-years", type=int, nargs="+", default=None)
    era5.add_argument("--samples-per-year", type=int, default=None, help="time steps per year file (default 64)")
    era5.add_argument("--grid", type=grid_size, default=None,
                      help="ROWSxCOLUMNS: latitudes 90N..90S (poles included) x longitudes (default 90x180)")
    era5.add_argument("--channels", type=int, default=None,
                      help="how many of the 20 ERA5 channels (u10, v10, t2m, ... tcwv) to write (default 20)")
    era5.add_argument("--seed", type=int, default=None, help="the synthetic atmosphere's seed (default 0)")
    era5.add_argument("--dt-hours", type=float, default=None, help="hours between time steps (default 6)")


def _run_era5_synthetic(args: argparse.Namespace) -> None:
    from meshtrain.data.era5_synthetic import generate  # h5py only when it is needed

    data_root = args.data_root if args.data_root is not None else default_data_root()
    options = {"years": args.years, "train_years": args.train_years, "valid_years": args.valid_years,
               "test_years": args.test_years, "samples_per_year": args.samples_per_year, "grid": args.grid,
               "channels": args.channels, "seed": args.seed, "dt_hours": args.dt_hours}
    generate(args.out if args.out is not None else data_root / ERA5_DIR_NAME, force=args.force,
             **{key: value for key, value in options.items() if value is not None})


def _run_tokenizer(args: argparse.Namespace) -> int:
    """Train a byte-level BPE on the files at PATH... and write it as a tokenizer.json."""
    log = get_logger("data")
    others = [f"--{key.replace('_', '-')}" for key in ERA5_OPTIONS + CORPUS_OPTIONS + ("tokenizer", "name", "val_fraction")
              if key != "out" and getattr(args, key) not in (None, False)]
    if not args.path or args.vocab_size is None or args.out is None or others:
        log.error("`meshtrain prepare %s` takes the text files and --vocab-size N --out FILE.json%s", TOKENIZER,
                  f" (not {', '.join(others)})" if others else "")
        return 2
    try:
        tokenizer = train_bpe(args.path, args.vocab_size, args.out)
    except DataError as e:
        log.error("%s", e)
        return 1
    log.info("wrote %s: a byte-level BPE of %s tokens (<|endoftext|> is %s), fingerprint %s. Prepare a text "
             "with it: meshtrain prepare text PATH --tokenizer %s", args.out, f"{tokenizer.vocab_size:,}",
             tokenizer.eot_id, tokenizer.fingerprint[:12], args.out)
    return 0


def run(args: argparse.Namespace) -> int:
    log = get_logger("data")
    if args.dataset == TOKENIZER:
        return _run_tokenizer(args)
    if args.vocab_size is not None:
        log.error("--vocab-size goes with `meshtrain prepare %s` only", TOKENIZER)
        return 2
    corpus_given = [f"--{key.replace('_', '-')}" for key in CORPUS_OPTIONS if getattr(args, key, None) not in (None, False)]
    if corpus_given and args.dataset != "text":
        log.error("%s go with `text` only, not %s", ", ".join(corpus_given), args.dataset)
        return 2
    if args.dataset == "text" and (corpus_given or is_corpus(args.path)):
        return run_corpus(args, log)
    if args.dataset == ERA5_SYNTHETIC:
        if args.path or args.tokenizer or args.name or args.val_fraction is not None:
            log.error("PATH, --tokenizer, --name and --val-fraction go with the text datasets, not %s",
                      ERA5_SYNTHETIC)
            return 2
        try:
            _run_era5_synthetic(args)
        except DataError as e:
            log.error("%s", e)
            return 1
        return 0
    given = [f"--{key.replace('_', '-')}" for key in ERA5_OPTIONS if getattr(args, key) is not None]
    if given:
        log.error("%s go with %s only, not %s", ", ".join(given), ERA5_SYNTHETIC, args.dataset)
        return 2
    if args.dataset == "text" and len(args.path) != 1:
        log.error("`meshtrain prepare text` needs the one file to prepare: meshtrain prepare text PATH")
        return 2
    if args.dataset != "text" and (args.path or args.tokenizer or args.name):
        log.error("PATH, --tokenizer and --name go with `text` only; %s always uses the shipped corpus "
                  "and its %s tokenizer", args.dataset, BUILTIN_TOKENIZER[args.dataset])
        return 2
    data_root = args.data_root if args.data_root is not None else default_data_root()
    val_fraction = DEFAULT_VAL_FRACTION if args.val_fraction is None else args.val_fraction
    try:
        prepare(args.dataset, data_root, source=args.path[0] if args.path else None, tokenizer=args.tokenizer,
                val_fraction=val_fraction, out_name=args.name, force=args.force)
    except DataError as e:
        log.error("%s", e)
        return 1
    return 0
