"""`meshtrain test-dist`: did my distributed set-up work? A few DDP iterations on different data per rank
(runtime/check.py), then every rank must hold bit-identical parameters; the exit code says whether they do."""

from __future__ import annotations

import argparse

from meshtrain.runtime.check import train_and_compare
from meshtrain.runtime.log import get_logger
from meshtrain.runtime.setup import distributed

log = get_logger("test-dist")


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iters", type=_positive, default=10, help="training iterations (default 10)")
    parser.add_argument("--batch-size", type=_positive, default=64, help="samples per rank per iteration (default 64)")
    parser.add_argument("--width", type=_positive, default=256, help="hidden width of the MLP (default 256)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    with distributed(device=args.device, backend=args.backend, timeout=args.timeout) as info:
        outcome = train_and_compare(info, iters=args.iters, batch_size=args.batch_size, width=args.width,
                                    seed=args.seed)
        if outcome.differing:
            log.error(
                "test-dist FAILED: rank(s) %s hold parameters that differ from rank 0's after %d iterations: "
                "gradients were not synchronised", ", ".join(map(str, outcome.differing)), args.iters)
            return 1
        log.info("test-dist passed: %d rank(s) on %d node(s) hold bit-identical parameters after %d DDP "
                 "iterations (loss %.4f -> %.4f)", info.world_size, info.num_nodes, args.iters, outcome.losses[0],
                 outcome.losses[-1])
    return 0
