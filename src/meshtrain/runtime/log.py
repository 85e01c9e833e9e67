"""Timestamped, rank-tagged log lines: `[2024-07-17 07:42:15.351][INFO][rank 0/4] message`.

Rank 0 logs INFO; the others log WARNING and above, so a 1,000-rank job prints one story and
every rank's trouble. MESHTRAIN_LOG_ALL_RANKS=1 lets every rank speak at INFO.
"""

from __future__ import annotations

import logging
import os
import sys
import time

ROOT = "meshtrain"
_last_line_at = time.monotonic()  # when this process last wrote a log line


def last_line_at() -> float:
    """time.monotonic() of this process's last log line (or of the import, before the first)."""
    return _last_line_at


class _RankFormatter(logging.Formatter):
    def __init__(self, rank: int, world_size: int):
        super().__init__()
        self.tag = f"rank {rank}/{world_size}"

    def format(self, record: logging.LogRecord) -> str:
        global _last_line_at
        _last_line_at = time.monotonic()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
        head = f"[{stamp}.{int(record.msecs):03d}][{record.levelname}][{self.tag}]"
        text = f"{head} {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def configure_logging(rank: int = 0, world_size: int = 1, all_ranks: bool | None = None,
                      stream=None) -> logging.Logger:
    """(Re)configure the `meshtrain` logger for this rank; safe to call again after init. Lines go to stdout, or to
    `stream` (a command whose stdout is data, such as `meshtrain machine --json`, logs to stderr)."""
    if all_ranks is None:
        all_ranks = os.environ.get("MESHTRAIN_LOG_ALL_RANKS", "0").lower() in ("1", "true", "yes")
    logger = logging.getLogger(ROOT)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stdout)
    handler.setFormatter(_RankFormatter(rank, world_size))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 or all_ranks else logging.WARNING)
    logger.propagate = False
    return logger


def get_logger(name: str = "") -> logging.Logger:
    return logging.getLogger(f"{ROOT}.{name}" if name else ROOT)


def print_rich(renderable) -> None:
    """Print a rich table or text to stdout (tables are rank 0's to print; callers check)."""
    from rich.console import Console

    from meshtrain.runtime.env import output_goes_to_a_log

    # Command lines and paths end up in these tables: ":ring:" must not become an emoji, "[x]" not markup. Under a
    # launcher whose output is a log file, no colour codes, though Open MPI's pseudo-terminal says "terminal".
    Console(width=120, emoji=False, markup=False, force_terminal=False if output_goes_to_a_log() else None
            ).print(renderable)
