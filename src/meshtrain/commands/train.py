"""`meshtrain train MODEL [KEY=VALUE ...]`: resolve the config, join the process group, choose the layout when
parallel.plan=auto, check that it fits in memory, train, and summarise the run (its report page with
train.report=true)."""

from __future__ import annotations

import argparse

from meshtrain import registry
from meshtrain.config import ALIASES, load_config
from meshtrain.runtime.log import get_logger
from meshtrain.runtime.rundir import PREEMPTED

log = get_logger("train")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workload", metavar="MODEL",
                        help=f"what to train: {', '.join(registry.names())}, or your own model as "
                             "package.module:SPEC (docs/models.md)")
    parser.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE",
                        help="preset=NAME (one of the model's presets/, or a .yaml path), data=VALUE (the model's "
                             "data key), dotted keys such as train.max_iters=100 model.n_layer=6 optimizer.lr=3e-4, "
                             f"and NERSC's flag names {', '.join(ALIASES)}")


def run(args: argparse.Namespace) -> int:
    # here, not at the top, which the parser imports (`meshtrain launch` builds it): these import torch
    from meshtrain.plan.measured import auto, preflight
    from meshtrain.runtime.progress import said_while_quiet
    from meshtrain.runtime.setup import distributed
    from meshtrain.train.trainer import train

    cfg = load_config(args.overrides, args.workload)  # before joining: a bad key fails on every rank alike, at once
    with distributed(device=args.device, backend=args.backend, timeout=args.timeout) as info, \
            said_while_quiet(info.is_main):  # a first step of minutes, a long evaluation: never a silent wait
        cfg = auto.resolve(cfg, info)
        preflight.check_memory(cfg, info)  # a run that cannot fit stops here, not under the OOM killer
        result = train(cfg, info)
        if info.is_main:
            summarise(result.run_dir, page=cfg.train.report)
            log.info("done: %s", result.outcome())
            sample = (f"; sample from it with `meshtrain sample --run {result.run_dir}`"
                      if registry.get(args.workload).text else "")
            log.info("run directory %s: config.yaml, checkpoints/, metrics.jsonl%s", result.run_dir, sample)
    return PREEMPTED if result.preempted else 0


def summarise(run_dir, page: bool) -> None:
    """The run's totals and text plots of its loss and throughput; its report page when asked for."""
    from meshtrain.report.runs import read_run
    from meshtrain.report.summary import summary

    run = read_run(run_dir)
    report = f"meshtrain report {run_dir} (or train.report=true) writes it"
    if page:  # matplotlib and the page's parts take 0.4 s to import: only when asked for
        from meshtrain.report.page import write_report

        report = str(write_report([run], run_dir / "report"))
    log.info("%s", summary(run, report))
