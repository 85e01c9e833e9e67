"""Stopping early, on every rank at the same iteration, with a checkpoint: the time budget (train.max_minutes) and
the signals a scheduler sends before it takes the nodes back.

    SIGTERM  SLURM at the time limit or on scancel (SIGKILL follows after KillWait, 30 s by default), PBS on qdel or
             at the walltime (SIGKILL after kill_delay), torchrun passing its own shutdown on to the ranks
    SIGUSR1  an early warning: SLURM's `#SBATCH --signal=USR1@120`, or anyone's `kill -USR1`

A handler only notes the signal (nothing else is safe inside one); a thread of rank 0 then says at once what the
run will do and how long that may take (the iteration under way, the last one's time), since a launcher's grace
before its SIGKILL is short (SLURM's KillWait and torchrun: 30 s). After each iteration the loop asks whether any
rank noted one, or has run out of time: one all-reduce of a flag, so that all ranks stop after the same iteration.
The flag travels on a CPU (gloo) group, so that asking never waits for a GPU's queue to drain.
The run then saves a checkpoint (after a signal, without the evaluation of a regular stop; the interval's figures
are logged), and `meshtrain train` exits with PREEMPTED (75), a code a job script tests to re-queue itself; the
re-queued job continues with train.init_from=auto. A signal in the run's last iteration, or after it (as torchrun
restarts the ranks to admit a node that joined late), stops nothing: the run completes (its last iteration
evaluated, its checkpoint published: the handler stays until then), says so and exits 0, as there is nothing left
to re-queue:

    meshtrain train gpt train.init_from=auto ...; [ $? -eq 75 ] && sbatch "$0"   # mpiexec and srun pass it on

torchrun reports its ranks' codes (75 each) in its failure summary but exits 1 itself.
"""

from __future__ import annotations

import signal
import threading
import time

from meshtrain.runtime import heartbeat
from meshtrain.runtime.log import get_logger
from meshtrain.runtime.progress import doing
from meshtrain.runtime.rundir import PREEMPTED
from meshtrain.runtime.setup import DistInfo, cpu_group, reduce_scalar

log = get_logger("train")

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
SIGNALLED = threading.Event()  # set once this process has noted one of SIGNALS (a fault drill's `hold` waits on it)


class Stopping:
    """`with Stopping(max_minutes, info) as stopping:` ... `reason = stopping.check()` after each iteration."""

    def __init__(self, max_minutes: float | None, info: DistInfo, last_iteration: int | None = None):
        self.max_minutes, self.info, self.last_iteration = max_minutes, info, last_iteration
        self.received: str | None = None  # the signal this rank got, by name
        self.reason: str | None = None  # why every rank stopped: "signal" or "time"; None while running
        self._previous: dict[int, object] = {}
        self._arrived, self._leaving = threading.Event(), threading.Event()
        self.last_iteration_s: float | None = None
        self.started = self._checked = time.perf_counter()  # again as the loop starts (__enter__)
        self._speaker: threading.Thread | None = None  # rank 0's thread that says what a signal means
        self._noted: tuple[dict, float] = ({}, 0.0)  # where this rank was when the first signal came, and for how long

    def __enter__(self) -> Stopping:
        self.started = self._checked = time.perf_counter()
        self.group = cpu_group()  # a collective: every rank enters together
        if threading.current_thread() is threading.main_thread():  # Python delivers signals to the main thread only
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)
            if self.info.is_main:
                self._speaker = threading.Thread(target=self._say_what_follows, name="meshtrain-signal", daemon=True)
                self._speaker.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.received and self._speaker:  # said before the run's last words, however late its thread was woken
            self._speaker.join(timeout=5)
        self._leaving.set()
        self._arrived.set()
        stopped = (self.reason == "signal" or self.received) and exc[0] is None
        for sig, handler in self._previous.items():
            # Stopped by a signal, the run has its checkpoint and only leaves: a launcher's SIGTERM now (srun's
            # --kill-on-bad-exit, as the first rank to exit 75 ends the step) would turn a rank's 75 into a death by
            # signal, srun's code into another than 75, and the job FAILED, not requeued. SIGKILL after KillWait stays.
            signal.signal(sig, signal.SIG_IGN if stopped else handler)

    def _note(self, signum: int, _frame) -> None:
        if self.received is None:  # where the rank was when the first came: the thread that says so may wake late
            self._noted = heartbeat.where()[0], time.perf_counter() - self._checked
        self.received = signal.Signals(signum).name
        self._arrived.set()
        SIGNALLED.set()

    def _say_what_follows(self) -> None:
        """Rank 0, the moment a signal arrives: what the run waits for before it can leave, and for how long."""
        self._arrived.wait()
        if self._leaving.is_set():
            return
        where, under_way = self._noted
        last = f"; an iteration took {self.last_iteration_s:.1f} s" if self.last_iteration_s else ""
        if self._in_last_iteration(where):
            log.warning("%s received while %s (for %.1f s%s): this is the run's last iteration (%d), so the run "
                        "completes it, evaluates and saves it, and exits 0", self.received, doing(where), under_way,
                        last, self.last_iteration)
            return
        log.warning("%s received while %s (for %.1f s%s): the run stops after this iteration, with a checkpoint, and "
                    "exits %d. A launcher kills after its grace period (SLURM's KillWait and torchrun: 30 s by "
                    "default): where an iteration and a checkpoint take longer, ask the scheduler for an earlier "
                    "signal (#SBATCH --signal=USR1@120)", self.received, doing(where), under_way, last, PREEMPTED)

    def _in_last_iteration(self, where: dict) -> bool:
        """Whether a rank noted at `where` (its heartbeat) is in the run's last iteration, its evaluation, or past."""
        return where.get("phase") == "finish" or (self.last_iteration is not None
                                                  and (where.get("step") or 0) >= self.last_iteration)

    def say_how_it_ended(self, iteration: int, complete: bool) -> bool:
        """The run's last words about a signal, once it has left the loop after `iteration` (`complete`: it did all
        its iterations); True where it was stopped short by one (preempted: exit 75)."""
        if (self.reason == "signal" or self.received) and not complete:  # the checkpoint is there: re-queue goes on
            log.warning("stopped by a signal (%s) after iteration %d, with a checkpoint: exiting with %d so that a job "
                        "script can re-queue; train.init_from=auto continues from here",
                        f"{self.received} on this rank" if self.received else "on another rank", iteration, PREEMPTED)
            return True
        if self.received or self.reason == "signal":  # it came too late to stop anything
            log.warning("%s, in or after the run's last iteration (%d): the run is complete (that iteration evaluated, "
                        "its checkpoint published); exiting 0, nothing is left to re-queue",
                        f"{self.received} received on this rank" if self.received else "a signal on another rank",
                        iteration)
        return False

    def check(self) -> str | None:
        """"signal" if any rank got one, "time" if any rank's clock passed max_minutes, else None: the same answer
        on every rank (a collective: every rank calls it after every iteration)."""
        now = time.perf_counter()
        self.last_iteration_s, self._checked = now - self._checked, now
        over = self.max_minutes is not None and now - self.started > self.max_minutes * 60
        flag = reduce_scalar(2 if self.received else 1 if over else 0, "max", "all_reduce of the stop flags (signals, "
                             "time budget)", self.info.timeout_s, group=self.group)
        self.reason = {2: "signal", 1: "time"}.get(int(flag))
        return self.reason
