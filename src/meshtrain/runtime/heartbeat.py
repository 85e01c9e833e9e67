"""Heartbeats: where every rank is, posted to the job's store, so that a hang names the rank that holds it up.

    heartbeat.start(...)                          # runtime.setup does this once the group is up
    heartbeat.note(step=5, micro=0, phase="forward")
    with collective("all_reduce of the loss"):    # notes the collective it enters as well

Noting is a dict update in the caller's thread. A daemon thread posts the note to the job's c10d store (the one
torchrun's agent or rank 0 keeps; key meshtrain/heartbeat/<rank>) when it has changed, at most every `interval` / 4
seconds, and every `interval` seconds in any case: the time of the last post tells whether a rank still runs.

When a rank's own note has not changed for half the process-group timeout (so that the report comes before the
timeout ends the job, and NCCL's watchdog with it), its thread reads every rank's note. If some rank stopped posting
or is behind the others, the lowest rank that still posts logs what it saw, e.g.

    hang: no progress for 6 s; the process-group timeout (12 s) ends the job unless the ranks below move
      rank 1 (host n1, pid 4241): at step 3 in data, still running: it has not reached the others' collective
      rank 2 (host n1, pid 4242): at step 3 in backward, inside forward and backward (gradient reduction), last
                                  posted 5 s ago and silent since: stopped, or dead
      ranks 0, 3 (host n1): at step 3 in backward, inside forward and backward (gradient reduction), waiting

A rank that is merely slow alongside the others (a long evaluation, a checkpoint every rank writes) is not a hang:
nobody is behind and everybody posts, so nothing is said.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from collections.abc import Mapping

from meshtrain.runtime.log import get_logger

log = get_logger("heartbeat")
# The order of a step's phases: a rank further down this list at the same step and micro-batch is further on.
PHASES = ("start-up", "data", "forward", "forward_backward", "backward", "optimizer", "evaluate", "checkpoint",
          "finish")
SILENT_AFTER = 3  # intervals without a post before a rank counts as stopped or dead
_current: Heartbeat | None = None
_here = {"step": 0, "micro": None, "phase": "start-up", "collective": None}  # this rank's, posted or not
_here_since = time.monotonic()  # when its step or phase last changed


def note(**fields) -> None:
    """Record where this rank is: step, micro, phase, collective (None clears one); posted once start() ran."""
    global _here, _here_since
    if any(fields.get(key, _here[key]) != _here[key] for key in ("step", "phase")):
        _here_since = time.monotonic()
    _here = {**_here, **fields}
    if _current is not None:
        _current.note(fields)


def where() -> tuple[dict, float]:
    """Where this rank is (step, micro, phase, collective), and the seconds it has been at that step and phase."""
    return dict(_here), time.monotonic() - _here_since


def entering(collective: str) -> str | None:
    """Note the collective this rank enters; returns the one it was in (to note again when this one ends)."""
    outer = _here["collective"]
    note(collective=collective)
    return outer


def flush() -> None:
    """Post this rank's note now (before it stops on purpose, in a drill)."""
    if _current is not None:
        _current.post()


def start(store, rank: int, world_size: int, host: str, timeout_s: float, dumps: str | None = None) -> None:
    """Post this rank's heartbeats to `store` (a c10d Store every rank reaches) until stop(); `dumps`: where NCCL's
    flight recorder writes, for the report."""
    global _current
    stop()
    _current = Heartbeat(store, rank, world_size, host, timeout_s, dumps)


def stop() -> None:
    global _current
    if _current is not None:
        _current.close()
    _current = None


def departed() -> str:
    """Which peers are gone, for the error of a collective that lost its connection: ranks on this host whose
    process no longer exists ("killed (signal 9, likely out of memory)" when the kernel's OOM killer has run on this
    host since the job started), and ranks elsewhere silent for SILENT_AFTER intervals. "" when none is known."""
    if _current is None:
        return ""
    try:
        notes = _current._read_all()
    except Exception:  # noqa: BLE001 - the store went with the rank that kept it
        return ""
    here, now, gone = _current.state["host"], time.time(), []
    oom = oom_kills() - _current.oom_kills_at_start
    for rank, n in sorted(notes.items()):
        if rank == _current.rank:
            continue
        if n["host"] == here and not _alive(n["pid"]):
            how = "was killed (signal 9, likely out of memory: the kernel's OOM killer ran on this host)" if oom \
                else "has exited"
            gone.append(f"rank {rank} ({here}, pid {n['pid']}) {how}, at step {n['step']} in {n['phase']}")
        elif n["host"] != here and silent(n, now, _current.interval):
            gone.append(f"rank {rank} ({n['host']}) has been silent for {now - n['posted']:.0f} s, at step "
                        f"{n['step']} in {n['phase']}")
    return "; ".join(gone)


def oom_kills() -> int:
    """Processes the kernel's OOM killer has ended on this host since boot (/proc/vmstat; 0 where not known)."""
    try:
        with open("/proc/vmstat") as vmstat:
            return next((int(line.split()[1]) for line in vmstat if line.startswith("oom_kill ")), 0)
    except OSError:
        return 0


def _alive(pid: int) -> bool:
    """Whether process `pid` of this host still runs (a zombie, dead but not yet reaped by its launcher, does not)."""
    if not os.path.isdir("/proc"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return False


def interval_for(timeout_s: float) -> float:
    """Seconds between posts: a twentieth of the timeout, within 1..15 s (1 s a post per rank at most)."""
    return min(max(timeout_s / 20, 1.0), 15.0)


class Heartbeat:
    def __init__(self, store, rank: int, world_size: int, host: str, timeout_s: float, dumps: str | None = None):
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.dumps = dumps
        self.interval = interval_for(timeout_s)
        self.stall_s = timeout_s / 2
        self.state = {"rank": rank, "host": host, "pid": os.getpid(), "step": 0, "micro": None,
                      "phase": "start-up", "collective": None}
        self.moved = time.monotonic()  # when this rank's note last changed
        self.oom_kills_at_start = oom_kills()
        self.lock = threading.Lock()  # the store client serves one request at a time
        self.changed, self.stopping = threading.Event(), threading.Event()
        self.post()
        self.thread = threading.Thread(target=self._run, name="meshtrain-heartbeat", daemon=True)
        self.thread.start()

    def note(self, fields: Mapping) -> None:
        if any(self.state.get(k) != v for k, v in fields.items()):
            self.state = {**self.state, **fields}
            self.moved = time.monotonic()
            self.changed.set()

    def post(self) -> bool:
        """This rank's note, with the time, into the store; False if the store is gone (the job is ending)."""
        payload = json.dumps({**self.state, "posted": time.time()})
        try:
            with self.lock:
                self.store.set(f"{self.rank}", payload)
        except Exception:  # noqa: BLE001 - a store that is gone (rank 0 exited first) ends the heartbeat quietly
            return False
        return True

    def close(self) -> None:
        self.stopping.set()
        self.changed.set()
        self.thread.join(timeout=2 * self.interval)

    def _run(self) -> None:
        posted, explained = time.monotonic(), None
        while not self.stopping.is_set():
            self.changed.wait(self.interval)
            if self.stopping.is_set():
                return
            if self.changed.is_set() or time.monotonic() - posted >= self.interval:
                self.changed.clear()
                if not self.post():
                    return
                posted = time.monotonic()
            moved = self.moved
            # Stalled: look every interval until the notes explain it (a stopped rank falls silent only after a few
            # intervals), then say nothing more until this rank moves again.
            if time.monotonic() - moved >= self.stall_s and explained != moved and self._report():
                explained = moved
            self.stopping.wait(self.interval / 4)  # a busy loop notes often: post at most 4 times an interval

    def _report(self) -> bool:
        """Read every rank's note; the reporter logs what holds the job up. True once something does."""
        try:
            notes = self._read_all()
        except Exception as e:  # noqa: BLE001 - the store itself does not answer
            if self.rank == 1:  # rank 0 keeps the store outside torchrun: the next rank says so
                log.error("hang: no progress for %.0f s, and the job's store does not answer (%s): the rank that "
                          "keeps it (rank 0, outside torchrun) is stopped or dead", self.stall_s, type(e).__name__)
            return True
        now = time.time()
        report = explain(notes, self.world_size, now, self.interval, time.monotonic() - self.moved, self.timeout_s)
        if report and reporter(notes, now, self.interval) == self.rank:
            if self.dumps:
                report += (f"\n  NCCL's flight recorder writes each rank's last collectives to {self.dumps}<rank> at "
                           f"the timeout: `torchfrtrace {os.path.dirname(self.dumps)}` lines them up")
            log.error("%s", report)
        return report is not None

    def _read_all(self) -> dict[int, dict]:
        notes = {}
        with self.lock:
            for rank in range(self.world_size):
                if self.store.check([f"{rank}"]):
                    notes[rank] = json.loads(self.store.get(f"{rank}"))
        return notes


def progress(n: Mapping) -> tuple:
    """How far a rank has got: step, then micro-batch (the optimizer and later come after every micro-batch)."""
    micro = n.get("micro")
    return n["step"], float("inf") if micro is None else micro, PHASES.index(n["phase"])


def silent(n: Mapping, now: float, interval: float) -> bool:
    return now - n["posted"] > SILENT_AFTER * interval


def reporter(notes: Mapping[int, Mapping], now: float, interval: float) -> int | None:
    """The rank that writes the report: the lowest that still posts."""
    alive = [r for r, n in notes.items() if not silent(n, now, interval)]
    return min(alive) if alive else None


def explain(notes: Mapping[int, Mapping], world_size: int, now: float, interval: float, stalled_s: float,
            timeout_s: float) -> str | None:
    """What holds the job up, from every rank's last note (this rank has not moved for `stalled_s`); None when nobody
    is behind and everybody posts."""
    if not notes:
        return None
    missing = [r for r in range(world_size) if r not in notes]
    quiet = {r for r, n in notes.items() if silent(n, now, interval)}
    furthest = max(progress(n) for n in notes.values())
    behind = {r for r, n in notes.items() if progress(n) < furthest}
    if not (quiet or behind or missing):
        return None
    lines = [f"hang: no progress for {stalled_s:.0f} s; the process-group timeout ({timeout_s:g} s) ends the job "
             "unless the ranks below move"]
    for r in sorted(quiet | behind):
        n, where = notes[r], _where(notes[r])
        if r in quiet:
            state = f"last posted {now - n['posted']:.0f} s ago and silent since: stopped, or dead"
        else:
            state = "still running: it has not reached the others' collective"
        lines.append(f"  rank {r} (host {n['host']}, pid {n['pid']}): {where}, {state}")
    if missing:
        lines.append(f"  {_ranks(missing)}: never posted (did not start, or died at start-up)")
    waiting: dict[tuple, list[int]] = {}
    for r, n in sorted(notes.items()):
        if r not in quiet | behind:
            waiting.setdefault((_where(n), n["host"]), []).append(r)
    for (where, host), ranks in waiting.items():
        lines.append(f"  {_ranks(ranks)} (host {host}): {where}, waiting")
    return "\n".join(lines)


def _where(n: Mapping) -> str:
    where = f"at step {n['step']} in {n['phase']}"
    if n.get("micro"):
        where += f" (micro-batch {n['micro'] + 1})"
    if n.get("collective"):
        where += f", inside {n['collective']}"
    return where


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def store_client(addr: str, port: int, prefix: str, timeout_s: float):
    """A client of the job's store of its own (the group's client may be busy in the loop's thread), its keys under
    `prefix` + "heartbeat/";
    its requests give up after a few intervals, so a store that stopped answering cannot hang the heartbeat."""
    import torch.distributed as dist

    wait = datetime.timedelta(seconds=SILENT_AFTER * interval_for(timeout_s))
    client = dist.TCPStore(addr, port, is_master=False, timeout=wait, wait_for_workers=False)
    return dist.PrefixStore(f"{prefix}heartbeat", client)


def flight_recorder_env(dump_dir: str) -> str:
    """On NCCL: PyTorch's flight recorder keeps each rank's last collectives and writes them out when one times out
    (`torchfrtrace DIR` lines the ranks up). Names from torch 2.6 on and the later ones; a user's own setting wins.
    Returns the dump files' prefix."""
    prefix = os.path.join(dump_dir, "rank_")
    for name, value in (("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"), ("TORCH_FR_BUFFER_SIZE", "2000"),
                        ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"), ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", prefix),
                        ("TORCH_FR_DUMP_TEMP_FILE", prefix)):
        os.environ.setdefault(name, value)
    os.makedirs(os.path.dirname(os.environ["TORCH_FR_DUMP_TEMP_FILE"]) or ".", exist_ok=True)
    return os.environ["TORCH_FR_DUMP_TEMP_FILE"]
