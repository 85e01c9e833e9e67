"""meshtrain report RUN [RUN ...] [--out DIR]: a page of plots and tables for one run, or several side by side."""

from __future__ import annotations

import argparse
from pathlib import Path

from meshtrain.runtime.log import get_logger

log = get_logger("report")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (each holds metrics.jsonl)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where report.html and the PNGs go (default: RUN/report for one run, ./report for several)")


def run(args: argparse.Namespace) -> int:
    # Imported here: matplotlib, which `meshtrain report --help` does without.
    from meshtrain.report.page import write_report
    from meshtrain.report.runs import ReportError, check_not_empty, read_run

    try:
        runs = [read_run(path) for path in args.runs]
        for run, given in zip(runs, args.runs, strict=True):
            check_not_empty(run, given)
    except ReportError as e:
        log.error("%s", e)
        return 2
    out = args.out or (runs[0].path / "report" if len(runs) == 1 else Path("report"))
    page = write_report(runs, out)
    log.info("report of %d run(s), as far as each got (last iterations %s): %s", len(runs),
             ", ".join(str(r.last_step) for r in runs), page)
    print(page)
    return 0
