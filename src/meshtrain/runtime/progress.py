"""Progress bars for a person at a terminal: the training loop's, and an evaluation's (`track`).

A bar is for a person at a terminal. In a batch job's log it is noise (rich would print its final frame, tqdm every
refresh), so it shows only on rank 0 with stdout a TTY; MESHTRAIN_PROGRESS=1/0 forces it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from meshtrain.runtime.log import ROOT

OFF_VALUES = ("", "0", "false", "no", "off")  # an environment switch set to one of these is off


def progress_enabled(is_main: bool = True) -> bool:
    if not is_main:
        return False
    forced = os.environ.get("MESHTRAIN_PROGRESS", "auto").strip().lower()
    if forced != "auto":
        return forced not in OFF_VALUES
    return sys.stdout.isatty()


class _Bar:
    def __init__(self, progress=None, task=None):
        self._progress, self._task = progress, task

    def update(self, advance: float = 1, description: str | None = None) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=advance,
                                  **({} if description is None else {"description": description}))


@contextmanager
def progress_bar(total: int | None, description: str = "", *, is_main: bool = True,
                 transient: bool = False) -> Iterator[_Bar]:
    """A rank-0 progress bar: `with progress_bar(n, "train") as bar: … bar.update()`. A no-op elsewhere."""
    if not progress_enabled(is_main):
        yield _Bar()
        return
    from rich import progress as rp

    stdout = sys.stdout
    columns = (rp.TextColumn("{task.description}"), rp.BarColumn(), rp.MofNCompleteColumn(),
               rp.TimeElapsedColumn(), rp.TimeRemainingColumn())
    with rp.Progress(*columns, transient=transient) as progress:
        # rich sends prints through sys.stdout while the bar is live, but our log handler holds the
        # stream it was made with; point it at rich's proxy so log lines land above the bar, not in it.
        handlers = [h for h in logging.getLogger(ROOT).handlers
                    if isinstance(h, logging.StreamHandler) and h.stream is stdout]
        for handler in handlers:
            handler.setStream(sys.stdout)
        try:
            yield _Bar(progress, progress.add_task(description, total=total))
        finally:
            for handler in handlers:
                handler.setStream(stdout)


def track(iterable: Iterable, description: str = "", total: int | None = None, *, is_main: bool = True,
          transient: bool = True) -> Iterator:
    """Iterate with a rank-0 progress bar (an eval loop's: transient, it vanishes when done)."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    with progress_bar(total, description, is_main=is_main, transient=transient) as bar:
        for item in iterable:
            yield item
            bar.update()

