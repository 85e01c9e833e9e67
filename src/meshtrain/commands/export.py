"""`meshtrain export --run DIR [--out FILE]`: the latest distributed checkpoint of a run, whatever layout
wrote it, consolidated into one file that loads with torch.load and that `meshtrain sample` reads."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, type=Path, help="a run directory")
    parser.add_argument("--out", type=Path, default=None, help="the file to write (default: RUN/model.pt)")


def run(args: argparse.Namespace) -> int:
    from meshtrain.train import checkpoint  # torch: not for `meshtrain export --help`

    out = checkpoint.export_model(args.run, args.out)
    print(f"wrote {out}: sample from it with `meshtrain sample --run {out}`")
    return 0
