"""`meshtrain train WORKLOAD [KEY=VALUE ...]`: resolve the config, join the process group, train."""

from __future__ import annotations

import argparse

from meshtrain.config import load_config, presets
from meshtrain.dist.log import get_logger
from meshtrain.dist.setup import distributed

log = get_logger("train")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workload", choices=("gpt",), help="what to train")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help=f"preset=NAME ({', '.join(presets('gpt'))} or a .yaml path), data=NAME, and dotted "
                             "keys such as train.max_iters=100 model.n_layer=6 optimizer.lr=3e-4")


def run(args: argparse.Namespace) -> int:
    from meshtrain.train.loop import train_gpt

    cfg = load_config(args.overrides)  # before joining: a bad key fails on every rank alike, at once
    with distributed(device=args.device, backend=args.backend, timeout=args.timeout) as info:
        result = train_gpt(cfg, info)
        if info.is_main:
            log.info("done: %d iterations, train loss %.4f, val loss %.4f", result.iterations, result.train_loss,
                     result.val_loss)
            log.info("run directory %s: config.yaml, checkpoints/, metrics.jsonl; sample from it with "
                     "`meshtrain sample --run %s`", result.run_dir, result.run_dir)
    return 0
