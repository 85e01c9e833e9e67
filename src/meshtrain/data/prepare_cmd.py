"""`meshtrain prepare`: tokenize a corpus into DATA_ROOT/NAME/{train.bin,val.bin,meta.json}.

    meshtrain prepare shakespeare_char            characters of the shipped tiny-Shakespeare
    meshtrain prepare shakespeare                 GPT-2 BPE of the same corpus
    meshtrain prepare text PATH [--tokenizer char|gpt2] [--name NAME]   a text file of your own

DATA_ROOT is --data-root, else $MESHTRAIN_DATA_ROOT, else ./data. Running it again is cheap: a dataset
made from the same source bytes is left as it is.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from meshtrain.data.text import (
    BUILTIN_TOKENIZER,
    DATA_ROOT_ENV,
    DEFAULT_DATA_ROOT,
    TOKENIZERS,
    DataError,
    default_data_root,
    prepare,
)
from meshtrain.dist.log import get_logger

DATASETS = (*BUILTIN_TOKENIZER, "text")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dataset", choices=DATASETS,
                        help="shakespeare_char (chars), shakespeare (GPT-2 BPE), or text (your file at PATH)")
    parser.add_argument("path", nargs="?", type=Path, default=None, metavar="PATH",
                        help="the UTF-8 text file to prepare (only with `text`)")
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default=None,
                        help="for `text`: char (default) or gpt2")
    parser.add_argument("--name", default=None,
                        help="for `text`: the dataset's folder under the data root (default: PATH's file stem)")
    parser.add_argument("--data-root", type=Path, default=None,
                        help=f"where datasets live (default: ${DATA_ROOT_ENV} or ./{DEFAULT_DATA_ROOT})")
    parser.add_argument("--val-fraction", type=float, default=0.1,
                        help="share of the text, taken from its end, held out for validation (default 0.1)")
    parser.add_argument("--force", action="store_true", help="prepare again even if the dataset is up to date")


def run(args: argparse.Namespace) -> int:
    log = get_logger("data")
    if args.dataset == "text" and args.path is None:
        log.error("`meshtrain prepare text` needs the file to prepare: meshtrain prepare text PATH")
        return 2
    if args.dataset != "text" and (args.path is not None or args.tokenizer or args.name):
        log.error("PATH, --tokenizer and --name go with `text` only; %s always uses the shipped corpus "
                  "and its %s tokenizer", args.dataset, BUILTIN_TOKENIZER[args.dataset])
        return 2
    data_root = args.data_root if args.data_root is not None else default_data_root()
    try:
        prepare(args.dataset, data_root, source=args.path, tokenizer=args.tokenizer,
                val_fraction=args.val_fraction, out_name=args.name, force=args.force)
    except DataError as e:
        log.error("%s", e)
        return 1
    return 0
