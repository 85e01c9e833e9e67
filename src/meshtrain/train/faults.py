"""Fault drills and what a restart cost.

MESHTRAIN_FAULT makes chosen ranks die, hang or get a scheduler's signal at chosen iterations, so that restarts,
resumes, preemption and hang reports can be tested and rehearsed on a real job:

    MESHTRAIN_FAULT=kill:rank=1:step=37                       rank 1 kills itself (SIGKILL) once iteration 37 is done
    MESHTRAIN_FAULT=kill:rank=1:step=13,kill:rank=0:step=27:attempt=1
    MESHTRAIN_FAULT=signal:rank=1:step=5                      rank 1 sends itself SIGUSR1 once iteration 5 is done:
                                                              SLURM's --signal warning of a preemption, met by
                                                              one rank at a known iteration (the job stops after 5)
    MESHTRAIN_FAULT=stop:rank=2:step=3:phase=backward         rank 2 stops itself (SIGSTOP) as iteration 3's
                                                              backward begins: a frozen process, silent
    MESHTRAIN_FAULT=hang:rank=1:step=3:phase=data             rank 1 sleeps for ever as iteration 3 fetches its
                                                              batch: a stuck loop in a process that still runs
    MESHTRAIN_FAULT=hold:rank=1:step=8:phase=data             rank 1 waits as iteration 8 fetches its batch until
                                                              the rank is signalled (SIGTERM, SIGUSR1): a job held
                                                              at a known iteration until its launcher restarts it
                                                              (torchrun admitting a node that joined), however long
                                                              that takes on this machine
    MESHTRAIN_FAULT=slow:rank=1:step=5:phase=data:ms=200      rank 1 sleeps 200 ms as it fetches each batch from
                                                              iteration 5 on: a straggler (a slow disk, say)
    MESHTRAIN_FAULT=slow:rank=3:step=31:phase=data:steps=3    rank 3 sleeps 3 of its own median iterations (those
                                                              before 31) at every batch from 31 on: a straggler as
                                                              late relative to the job on any machine

Phases are the heartbeat's (runtime/heartbeat.py): data, forward, backward, forward_backward (a pipeline schedule),
optimizer; and finish, once the loop has ended after iteration `step` (before the last checkpoint, written in the
background, is published): `slow:rank=0:step=30:phase=finish:ms=5000` holds a run there, for a signal to meet it.

A fault fires in one attempt of the job only (`attempt`, 0 by default: the first launch), so that the restarted job,
which replays the iterations since its checkpoint, does not meet it again. The attempt is torchrun's
TORCHELASTIC_RESTART_COUNT, or MESHTRAIN_RESTART_COUNT that `meshtrain launch --max-restarts` sets for mpiexec and
srun.

`restart_cost` reads what a resumed run lost from its metrics.jsonl: the iterations done since the checkpoint (to
be done again) and the seconds since the previous attempt last logged.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from meshtrain.errors import MeshtrainError
from meshtrain.runtime import heartbeat
from meshtrain.runtime.log import get_logger
from meshtrain.runtime.rundir import read_jsonl
from meshtrain.train import stopping

ENV = "MESHTRAIN_FAULT"
log = get_logger("faults")


class FaultSpecError(MeshtrainError, ValueError):
    """MESHTRAIN_FAULT does not parse."""


KINDS = ("kill", "signal", "stop", "hang", "hold", "slow")
AFTER = ("kill", "signal")  # carried out once the iteration is done, not in a phase of it
IN_STEP = ("data", "forward", "forward_backward", "backward", "optimizer")  # heartbeat phases inside an iteration
PHASES = (*IN_STEP, "finish")  # and the one after the last iteration


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    attempt: int = 0
    phase: str | None = None  # stop, hang, hold and slow: where in the iteration; kill and signal: after it
    ms: int = 0  # slow: the sleep, in every iteration from `step` on
    steps: int = 0  # slow, in place of ms: the sleep as this many of the rank's median iterations before `step`


def attempt() -> int:
    """Which launch of the job this is: 0 first, then one more per restart."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("MESHTRAIN_RESTART_COUNT") or 0)


def parse(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, *fields = item.split(":")
        try:
            values = dict(field.split("=", 1) for field in fields)
            fault = Fault(kind, **{key: value if key == "phase" else int(value) for key, value in values.items()})
        except (ValueError, TypeError):
            fault = None
        if (kind not in KINDS or fault is None or (kind in AFTER) != (fault.phase is None)
                or fault.phase not in (None, *PHASES) or (kind == "slow") != ((fault.ms > 0) != (fault.steps > 0))
                or (fault.steps > 0 and fault.step < 3)):  # a median needs iterations before the fault
            raise FaultSpecError(f"{ENV}={text!r}: each fault is kill|signal:rank=R:step=S[:attempt=A], "
                                 f"stop|hang|hold:rank=R:step=S:phase={'|'.join(PHASES)}[:attempt=A] or "
                                 f"slow:rank=R:step=S:phase=P:ms=M|steps=K[:attempt=A] (steps: S >= 3; "
                                 f"comma-separated), not {item!r}")
        faults.append(fault)
    return faults


class Drill:
    """The faults meant for this rank in this attempt; `during` and `after` carry them out."""

    def __init__(self, rank: int):
        now = attempt()
        self.rank = rank
        self.faults = [f for f in parse(os.environ.get(ENV, "")) if f.rank == rank and f.attempt == now]
        self.started: dict[int, float] = {}  # iteration -> when this rank entered it: the steps of `steps=K`
        self.timed_until = max((f.step for f in self.faults if f.steps), default=0)  # none kept past the need
        self.sleep_s: dict[Fault, float] = {}

    def during(self, iteration: int, phase: str) -> None:
        """Called as iteration `iteration` (counting from 1) enters `phase`, once the heartbeat has noted it."""
        if iteration <= self.timed_until and iteration not in self.started:
            self.started[iteration] = time.monotonic()
        for fault in self.faults:
            if fault.kind == "slow" and fault.phase == phase and iteration >= fault.step:
                time.sleep(self._sleep_s(fault))
            elif (fault.step, fault.phase) == (iteration, phase):
                heartbeat.flush()  # what the others read of this rank: where it stopped
                if fault.kind == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)  # frozen, threads and all, until SIGCONT or SIGKILL
                while fault.kind == "hang":
                    time.sleep(3600)
                while fault.kind == "hold" and not stopping.SIGNALLED.is_set():
                    time.sleep(0.05)

    def _sleep_s(self, fault: Fault) -> float:
        """A slow fault's sleep: its ms, or `steps` × this rank's median iteration before the fault's step (said
        once, on the rank's log, so that a test or a drill knows the delay it asked for)."""
        if fault not in self.sleep_s:
            if fault.steps:
                ends = [self.started[i] for i in range(1, fault.step + 1) if i in self.started]
                median = statistics.median(b - a for a, b in zip(ends, ends[1:], strict=False))
                self.sleep_s[fault] = fault.steps * median
                log.warning("fault drill: rank %d sleeps %.6f s in %s at every iteration from %d: %d × its median "
                            "iteration before it (%.6f s)", self.rank, self.sleep_s[fault], fault.phase, fault.step,
                            fault.steps, median)
            else:
                self.sleep_s[fault] = fault.ms / 1000
        return self.sleep_s[fault]

    def after(self, iteration: int) -> None:
        """Called once iteration `iteration` (counting from 1) is done."""
        kinds = {f.kind for f in self.faults if f.step == iteration}
        if "signal" in kinds:
            os.kill(os.getpid(), signal.SIGUSR1)  # the handler notes it; the next iteration's check stops every rank
        if "kill" in kinds:
            os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, no last words: as a node that dies


def restart_cost(metrics: Path, resumed_at: int) -> tuple[int, float] | None:
    """(iterations the previous attempt did after the checkpoint at `resumed_at`, seconds since it last logged), or
    None when it logged nothing after that checkpoint (a resume after a clean stop)."""
    if not metrics.is_file():
        return None
    after = [row for row in read_jsonl(metrics) if row["step"] > resumed_at]
    if not after:
        return None
    return after[-1]["step"] - resumed_at, time.time() - after[-1]["time"]
