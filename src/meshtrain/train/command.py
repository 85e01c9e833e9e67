"""`meshtrain train MODEL [KEY=VALUE ...]`: resolve the config, join the process group, train."""

from __future__ import annotations

import argparse

from meshtrain import registry
from meshtrain.config import ALIASES, load_config
from meshtrain.runtime.launch import PREEMPTED
from meshtrain.runtime.log import get_logger
from meshtrain.runtime.setup import distributed

log = get_logger("train")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workload", metavar="MODEL",
                        help=f"what to train: {', '.join(registry.names())}, or your own model as "
                             "package.module:SPEC (docs/models.md)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="preset=NAME (one of the model's presets/, or a .yaml path), data=VALUE (the model's "
                             "data key), dotted keys such as train.max_iters=100 model.n_layer=6 optimizer.lr=3e-4, "
                             f"and NERSC's flag names {', '.join(ALIASES)}")


def run(args: argparse.Namespace) -> int:
    from meshtrain.train.trainer import train

    cfg = load_config(args.overrides, args.workload)  # before joining: a bad key fails on every rank alike, at once
    with distributed(device=args.device, backend=args.backend, timeout=args.timeout) as info:
        result = train(cfg, info)
        if info.is_main:
            log.info("done: %d iterations, train loss %.4f, val loss %.4f", result.iterations, result.train_loss,
                     result.val_loss)
            sample = (f"; sample from it with `meshtrain sample --run {result.run_dir}`"
                      if registry.get(args.workload).text else "")
            log.info("run directory %s: config.yaml, checkpoints/, metrics.jsonl%s", result.run_dir, sample)
    return PREEMPTED if result.preempted else 0
