"""Heartbeats and the hang report: who is behind, who fell silent, and who says so."""

from __future__ import annotations

import json
import time

import pytest
import torch.distributed as dist

from meshtrain.runtime import heartbeat
from meshtrain.train import faults

NOW = 1_000_000.0


def _note(rank, step, phase, micro=0, posted=NOW, collective=None, host="n1"):
    return {"rank": rank, "host": host, "pid": 100 + rank, "step": step, "micro": micro, "phase": phase,
            "collective": collective, "posted": posted}


def test_progress_orders_phases_micro_batches_and_steps():
    order = [_note(0, 0, "start-up", None), _note(0, 3, "data", 0), _note(0, 3, "forward", 0),
             _note(0, 3, "backward", 0), _note(0, 3, "data", 1), _note(0, 3, "backward", 1),
             _note(0, 3, "optimizer", None), _note(0, 3, "evaluate", None), _note(0, 3, "checkpoint", None),
             _note(0, 4, "data", 0)]
    keys = [heartbeat.progress(n) for n in order]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)


def test_a_job_that_is_merely_slow_everywhere_is_not_a_hang():
    notes = {r: _note(r, 7, "evaluate", None, posted=NOW - 1) for r in range(4)}
    assert heartbeat.explain(notes, 4, NOW, 1.0, 300, 600) is None


def test_the_report_names_the_silent_rank_the_one_behind_and_those_waiting():
    notes = {0: _note(0, 3, "backward", collective="gradient reduction"),
             1: _note(1, 3, "data", posted=NOW - 0.5),
             2: _note(2, 3, "backward", posted=NOW - 9, host="n2"),
             3: _note(3, 3, "backward", collective="gradient reduction")}
    report = heartbeat.explain(notes, 4, NOW, 1.0, 8.2, 16)
    lines = report.splitlines()
    assert lines[0].startswith("hang: no progress for 8 s; the process-group timeout (16 s)")
    assert lines[1] == "  rank 1 (host n1, pid 101): at step 3 in data, still running: it has not reached the others' " \
                       "collective"
    assert lines[2] == "  rank 2 (host n2, pid 102): at step 3 in backward, last posted 9 s ago and silent since: " \
                       "stopped, or dead"
    assert lines[3] == "  ranks 0, 3 (host n1): at step 3 in backward, inside gradient reduction, waiting"
    assert len(lines) == 4
    assert heartbeat.reporter(notes, NOW, 1.0) == 0
    del notes[0]  # rank 0 never posted at all; rank 1 is the lowest that still posts
    assert "rank 0: never posted" in heartbeat.explain(notes, 4, NOW, 1.0, 8, 16)
    assert heartbeat.reporter(notes, NOW, 1.0) == 1


def test_a_silent_rank_is_named_even_where_the_others_are():
    notes = {r: _note(r, 5, "forward", micro=1, posted=NOW - (10 if r == 0 else 0)) for r in range(3)}
    report = heartbeat.explain(notes, 3, NOW, 1.0, 8, 16)
    assert "rank 0 (host n1, pid 100): at step 5 in forward (micro-batch 2), last posted 10 s ago" in report
    assert "ranks 1, 2 (host n1): at step 5 in forward (micro-batch 2), waiting" in report
    assert heartbeat.reporter(notes, NOW, 1.0) == 1


def test_interval_follows_the_timeout():
    assert heartbeat.interval_for(20) == 1.0 and heartbeat.interval_for(100) == 5.0
    assert heartbeat.interval_for(600) == 15.0 and heartbeat.interval_for(2) == 1.0


def test_the_thread_posts_notes_and_reports_a_peer_that_fell_silent(monkeypatch):
    store, said = dist.HashStore(), []
    monkeypatch.setattr(heartbeat.log, "error", lambda fmt, *args: said.append(fmt % args))
    peer = heartbeat.Heartbeat(store, 1, 2, "n1", timeout_s=2)  # interval 1 s, stall after 1 s
    peer.note({"step": 3, "micro": 0, "phase": "backward"})
    peer.post()
    peer.close()  # from here on rank 1 is silent, as a stopped process is
    me = heartbeat.Heartbeat(store, 0, 2, "n1", timeout_s=2)
    try:
        me.note({"step": 3, "micro": 0, "phase": "backward", "collective": "all_reduce of gradients"})
        time.sleep(0.5)
        assert json.loads(store.get("0"))["collective"] == "all_reduce of gradients"
        deadline = time.monotonic() + 15
        while not said and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        me.close()
    assert len(said) == 1, said
    assert "rank 1 (host n1" in said[0] and "at step 3 in backward, last posted" in said[0]
    assert "rank 0 (host n1): at step 3 in backward, inside all_reduce of gradients, waiting" in said[0]


def test_the_flight_recorder_is_set_up_without_overriding_the_user(tmp_path, monkeypatch):
    for name in ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                 "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")
    prefix = heartbeat.flight_recorder_env(str(tmp_path / "fr"))
    import os

    assert prefix == str(tmp_path / "fr" / "rank_") and (tmp_path / "fr").is_dir()
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50" and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


def test_fault_specs_for_stops_and_hangs():
    assert faults.parse("stop:rank=2:step=3:phase=backward,hang:rank=1:step=3:phase=data:attempt=1") == [
        faults.Fault("stop", rank=2, step=3, phase="backward"), faults.Fault("hang", 1, 3, attempt=1, phase="data")]
    assert faults.parse("slow:rank=1:step=5:phase=data:ms=200") == [
        faults.Fault("slow", rank=1, step=5, phase="data", ms=200)]
    assert faults.parse("slow:rank=3:step=31:phase=data:steps=3") == [
        faults.Fault("slow", rank=3, step=31, phase="data", steps=3)]
    assert faults.parse("signal:rank=1:step=5") == [faults.Fault("signal", rank=1, step=5)]
    assert faults.parse("hold:rank=1:step=8:phase=data") == [faults.Fault("hold", rank=1, step=8, phase="data")]
    for bad in ("stop:rank=2:step=3", "kill:rank=1:step=3:phase=data", "signal:rank=1:step=5:phase=data",
                "hold:rank=1:step=8", "stop:rank=1:step=3:phase=lunch",
                "slow:rank=1:step=5:phase=data", "hang:rank=1:step=3:phase=data:ms=5",
                "slow:rank=1:step=5:phase=data:ms=5:steps=2", "slow:rank=1:step=2:phase=data:steps=2"):
        with pytest.raises(faults.FaultSpecError, match="stop\\|hang\\|hold:rank=R:step=S:phase="):
            faults.parse(bad)


def test_a_held_rank_waits_in_its_phase_until_it_is_signalled(monkeypatch):
    """hold: the rank stays in iteration 8's data phase, however long, until its signal handler (train.stopping)
    notes SIGTERM or SIGUSR1; then the iteration goes on."""
    import signal
    import threading

    from meshtrain.train import stopping

    monkeypatch.setenv(faults.ENV, "hold:rank=1:step=8:phase=data")
    monkeypatch.setattr(stopping, "SIGNALLED", threading.Event())
    monkeypatch.setattr(faults.heartbeat, "flush", lambda: None)
    drill = faults.Drill(rank=1)
    drill.during(7, "data")  # not its iteration: returns at once
    held = threading.Thread(target=drill.during, args=(8, "data"))
    held.start()
    held.join(0.3)
    assert held.is_alive()
    stopping.Stopping(None, info=None)._note(signal.SIGTERM, None)
    held.join(2)
    assert not held.is_alive()


def test_a_signal_is_said_where_it_came_however_late_the_thread_that_says_it_wakes(monkeypatch):
    """Rank 0's thread that says what a signal means may wake after the loop has ended (seen under a throttled CPU's
    load): it says where the rank was when the signal came (computing step 5), not where it is by then (finishing,
    which would read as a signal in the run's last iteration)."""
    import signal

    from meshtrain.train import stopping

    said = []
    monkeypatch.setattr(stopping.log, "warning", lambda fmt, *args: said.append(fmt % args))
    monkeypatch.setattr(stopping, "SIGNALLED", __import__("threading").Event())
    monkeypatch.setattr(heartbeat, "_here", {"step": 5, "micro": None, "phase": "forward", "collective": None})
    stop = stopping.Stopping(None, info=None, last_iteration=100)
    stop._note(signal.SIGTERM, None)
    heartbeat._here.update(phase="finish")  # the loop has ended before the thread runs
    stop._say_what_follows()
    assert len(said) == 1 and said[0].startswith("SIGTERM received while computing step 5 (for "), said
    assert "the run stops after this iteration, with a checkpoint, and exits 75" in said[0], said


def test_a_straggler_in_steps_sleeps_that_many_of_its_median_iterations(monkeypatch):
    """steps=K: the delay is K of the rank's own median iterations before the fault (one slow iteration, an
    evaluation, does not move it), so a drilled straggler is as late relative to the job on any machine."""
    monkeypatch.setenv(faults.ENV, "slow:rank=1:step=5:phase=data:steps=3")
    clock, slept, said = iter([0.0, 0.1, 0.2, 0.9, 1.0]), [], []
    monkeypatch.setattr(faults.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    monkeypatch.setattr(faults.log, "warning", lambda fmt, *args: said.append(fmt % args))
    drill = faults.Drill(rank=1)
    for iteration in range(1, 6):
        drill.during(iteration, "data")
        drill.during(iteration, "forward")  # later phases of an iteration do not restart its clock
    drill.during(6, "data")  # measured once: no clock read (the clock above has no more), nothing kept, past step 5
    assert slept == pytest.approx([0.3, 0.3]), slept  # iterations 0.1, 0.1, 0.7, 0.1 s: median 0.1
    assert said == ["fault drill: rank 1 sleeps 0.300000 s in data at every iteration from 5: 3 × its median "
                    "iteration before it (0.100000 s)"]


def test_a_lost_connection_names_the_peer_that_is_gone_and_the_oom_killer(monkeypatch):
    import subprocess
    import sys

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    store = dist.HashStore()
    kills = iter([3, 3, 3, 3, 4])  # the host's OOM kills: at each rank's start, at each look
    monkeypatch.setattr(heartbeat, "oom_kills", lambda: next(kills))
    peer = heartbeat.Heartbeat(store, 1, 3, "n1", timeout_s=60)
    peer.state = {**peer.state, "pid": victim.pid, "step": 7, "phase": "backward"}
    peer.post()
    peer.close()
    far = heartbeat.Heartbeat(store, 2, 3, "n2", timeout_s=60)
    far.close()
    heartbeat._current = me = heartbeat.Heartbeat(store, 0, 3, "n1", timeout_s=60)
    try:
        assert heartbeat.departed() == ""  # everyone alive and posting
        victim.kill()
        victim.wait()
        monkeypatch.setattr(heartbeat.time, "time", lambda: time.time_ns() / 1e9 + 200)  # rank 2 silent since
        said = heartbeat.departed()
    finally:
        heartbeat.stop()
    assert f"rank 1 (n1, pid {victim.pid}) was killed (signal 9, likely out of memory" in said, said
    assert "at step 7 in backward" in said and "rank 2 (n2) has been silent for 20" in said, said
    assert me.oom_kills_at_start == 3
