"""`meshtrain train WORKLOAD [KEY=VALUE ...]`: resolve the config, join the process group, train."""

from __future__ import annotations

import argparse

from meshtrain.config import ALIASES, RUN_CONFIGS, load_config, presets
from meshtrain.dist.log import get_logger
from meshtrain.dist.setup import distributed

log = get_logger("train")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workload", choices=tuple(RUN_CONFIGS), help="what to train: gpt (text) or vit (weather)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help=f"preset=NAME (gpt: {', '.join(presets('gpt'))}; vit: {', '.join(presets('vit'))}; or "
                             "a .yaml path), data=NAME, dotted keys such as train.max_iters=100 model.n_layer=6 "
                             f"optimizer.lr=3e-4, and NERSC's flag names {', '.join(ALIASES)}")


def run(args: argparse.Namespace) -> int:
    from meshtrain.train.loop import train

    cfg = load_config(args.overrides, args.workload)  # before joining: a bad key fails on every rank alike, at once
    with distributed(device=args.device, backend=args.backend, timeout=args.timeout) as info:
        result = train(cfg, info)
        if info.is_main:
            log.info("done: %d iterations, train loss %.4f, val loss %.4f", result.iterations, result.train_loss,
                     result.val_loss)
            if args.workload == "gpt":
                log.info("run directory %s: config.yaml, checkpoints/, metrics.jsonl; sample from it with "
                         "`meshtrain sample --run %s`", result.run_dir, result.run_dir)
            else:
                log.info("run directory %s: config.yaml, checkpoints/, metrics.jsonl, figures/", result.run_dir)
    return 0
