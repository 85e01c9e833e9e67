"""A hang explains itself: a rank frozen by SIGSTOP and one stuck in its data are named, with where they were, before
the process-group timeout ends the job."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import time

from tests.conftest import REPO, clean_env, launch_seconds, prepare_data, torchrun_cmd
from tests.distributed.test_train_gpt import TINY


def hang_timeout_s() -> int:
    """The job's process-group timeout: the report comes at half of it after the hang, and the half must outlast
    every wait that is no hang (a rank still importing torch while another is in its first step, which the report
    would name as behind). Both scale with what 4 ranks take to start here, so the timeout is twice that (an even
    number of seconds, the half a whole one). Never under 12 s: by the report a stopped rank must have been silent
    for 3 heartbeat intervals (3 s at these timeouts), with room, or it reads as merely waiting."""
    return max(12, 2 * math.ceil(launch_seconds(4)))


def test_a_stopped_rank_and_a_stuck_one_are_named_with_their_step_and_phase(tmp_path):
    data_root = prepare_data(tmp_path / "data")
    timeout_s = hang_timeout_s()
    cmd = torchrun_cmd(4, "-m", "meshtrain", "train", "gpt", *TINY, f"data.root={data_root}",
                       f"train.out_dir={tmp_path}", "train.max_iters=1000", "train.log_interval=1")
    faults = "stop:rank=2:step=3:phase=backward,hang:rank=1:step=3:phase=data"
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                           start_new_session=True,
                           env=clean_env(MESHTRAIN_TIMEOUT=str(timeout_s), MESHTRAIN_FAULT=faults))
    lines, report, started = [], [], time.monotonic()
    try:
        for line in job.stdout:  # the report comes half the timeout after iteration 3 stalls
            lines.append(line)
            if "hang: no progress" in line or report:
                report.append(line.rstrip())
            if report and line.rstrip().endswith("waiting"):
                break
            # only bounds a hang of the test itself (the report comes at start-up + half the timeout): a generous
            # limit whose expiry is a failure anyway
            assert time.monotonic() - started < 180 + timeout_s, "".join(lines[-40:])
    finally:
        # The ranks first (torchrun gives them sessions of their own): the stopped one would hold torchrun's shutdown
        # for 30 s.
        subprocess.run(["pkill", "-KILL", "-P", str(job.pid)], check=False)
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate(timeout=60)
    assert report, "".join(lines[-40:])
    head, *ranks = report
    assert re.search(rf"\[ERROR\]\[rank 0/4\] hang: no progress for (\d+) s; the process-group timeout "
                     rf"\({timeout_s} s\)", head), (timeout_s, head)
    assert int(re.search(r"no progress for (\d+) s", head).group(1)) >= timeout_s // 2
    assert re.fullmatch(r"  rank 1 \(host \S+, pid \d+\): at step 3 in data, still running: .*", ranks[0]), ranks
    assert re.fullmatch(r"  rank 2 \(host \S+, pid \d+\): at step 3 in backward, inside forward and backward "
                        r"\(gradient reduction\), last posted \d+ s ago and silent since: stopped, or dead", ranks[1])
    assert re.fullmatch(r"  ranks 0, 3 \(host \S+\): at step 3 in backward, inside forward and backward \(gradient "
                        r"reduction\), waiting", ranks[2]), ranks
    assert not any("step=4 " in line for line in lines), "an iteration finished past the hang"
    print(f"process-group timeout {timeout_s} s (twice a 4-rank start here)")
