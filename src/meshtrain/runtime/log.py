"""Timestamped, rank-tagged log lines: `[2024-07-17 07:42:15.351][INFO][rank 0/4] message`.

Rank 0 logs INFO; the others log WARNING and above, so a 1,000-rank job prints one story and
every rank's trouble. MESHTRAIN_LOG_ALL_RANKS=1 lets every rank speak at INFO.

torch's own warnings are the same on every rank and come again at every step that meets them: rank 0 shows each
once (Python's UserWarning and FutureWarning by message; the loggers in TORCH_REPEATING by message), the other
ranks none of them (all of them under MESHTRAIN_LOG_ALL_RANKS=1).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings

ROOT = "meshtrain"
# torch loggers that repeat one message at every step: DTensor's "sequential ... operations will be performed. This is
# suboptimal" for each redistribution it plans in several steps (a tensor-parallel layout's, every iteration).
TORCH_REPEATING = ("torch.distributed.tensor._redistribute",)


class _Once(logging.Filter):
    """Each message once; none at all where `quiet` (the ranks that are not 0)."""

    def __init__(self):
        super().__init__()
        self.quiet, self.seen = False, set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.quiet or message in self.seen:
            return False
        self.seen.add(message)
        return True


_once = _Once()
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
    _once.quiet = not (rank == 0 or all_ranks)
    for name in TORCH_REPEATING:
        logging.getLogger(name).addFilter(_once)  # the same object: added once however often this runs
    for category in (UserWarning, FutureWarning):
        warnings.filterwarnings("ignore" if _once.quiet else "once", category=category)
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
