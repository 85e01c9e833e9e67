"""Progress for a person: the training loop's, an evaluation's (`track`), and a line whenever the log has been
quiet for QUIET_S seconds (`said_while_quiet`: a first step of minutes, a long evaluation, a checkpoint being written),
so that nobody waits on silence.

A bar is for a person at a terminal. In a batch job's log it is noise (rich would print its frames), so it shows
only on rank 0 with stdout a TTY, and never under mpiexec, srun or a PBS/SLURM batch job: Open MPI gives each rank a
pseudo-terminal, so isatty() is true there while the output goes to a file. Without a bar, rank 0 logs a plain line
(`eval val: 120/200 (31 s)`) when a task has run LINE_EVERY_S seconds since the last one. MESHTRAIN_PROGRESS=1/0
forces the bar on or off.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from meshtrain.runtime import heartbeat
from meshtrain.runtime.env import output_goes_to_a_log
from meshtrain.runtime.log import ROOT, last_line_at

OFF_VALUES = ("", "0", "false", "no", "off")  # an environment switch set to one of these is off
LINE_EVERY_S = 30.0
QUIET_S = 20.0  # seconds without a log line after which rank 0 says what it is doing
DOING = {"start-up": "setting up", "data": "reading the data of step {step}", "forward": "computing step {step}",
         "forward_backward": "computing step {step}", "backward": "computing step {step}",
         "optimizer": "computing step {step}", "evaluate": "evaluating at step {step}",
         "checkpoint": "writing the checkpoint of step {step}", "finish": "finishing"}
log = logging.getLogger(f"{ROOT}.progress")


def progress_enabled(is_main: bool = True) -> bool:
    if not is_main:
        return False
    forced = os.environ.get("MESHTRAIN_PROGRESS", "auto").strip().lower()
    if forced != "auto":
        return forced not in OFF_VALUES
    return sys.stdout.isatty() and not output_goes_to_a_log()


class _Bar:
    def __init__(self, progress=None, task=None):
        self._progress, self._task = progress, task

    def update(self, advance: float = 1, description: str | None = None) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=advance,
                                  **({} if description is None else {"description": description}))


class _Lines(_Bar):
    """A bar's stand-in in a log: one plain line per LINE_EVERY_S seconds of a task that is still running."""

    def __init__(self, total: int | None, description: str):
        super().__init__()
        self.total, self.description, self.done = total, description, 0
        self.started = self.last = time.monotonic()

    def update(self, advance: float = 1, description: str | None = None) -> None:
        self.done += advance
        now = time.monotonic()
        if now - self.last >= LINE_EVERY_S:
            self.last = now
            of = f"/{_count(self.total)}" if self.total else ""
            log.info("%s: %s%s (%.0f s)", description or self.description, _count(self.done), of, now - self.started)


def _count(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:g}"


@contextmanager
def progress_bar(total: int | None, description: str = "", *, is_main: bool = True,
                 transient: bool = False) -> Iterator[_Bar]:
    """A rank-0 progress bar: `with progress_bar(n, "train") as bar: … bar.update()`. A no-op elsewhere."""
    if not progress_enabled(is_main):
        yield _Lines(total, description) if is_main else _Bar()
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


def doing(where: dict) -> str:
    """What a heartbeat note says a rank is doing, in words: `evaluating at step 200, in all_reduce of the loss`."""
    phase = where["phase"]  # a training phase, or what a command is doing in words (`plan --validate`'s runs)
    text = DOING[phase].format(step=where["step"]) if phase in DOING else phase
    return f"{text}, in {where['collective']}" if where.get("collective") else text


@contextmanager
def said_while_quiet(is_main: bool = True) -> Iterator[None]:
    """On rank 0, a line `still evaluating at step 200 (45 s so far)` each time the log has been quiet for QUIET_S
    seconds, from a thread of its own: a step or an evaluation of minutes is shown to be under way, not hung."""
    if not is_main:
        yield
        return
    stop = threading.Event()

    def watch() -> None:
        said = time.monotonic()
        while not stop.wait(QUIET_S / 4):
            if time.monotonic() - max(last_line_at(), said) >= QUIET_S:
                where, for_s = heartbeat.where()
                log.info("still %s (%.0f s so far)", doing(where), for_s)
                said = time.monotonic()

    thread = threading.Thread(target=watch, name="meshtrain-quiet", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
