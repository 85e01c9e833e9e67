"""tests/suite_cpu.py: the table of the files and tests that cost the most CPU, and the plugin counting, in a test's
row, the CPU of a process the test starts; and what a failed job's message shows of its output (conftest.job_end)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tests.conftest import REPO, clean_env, job_end
from tests.suite_cpu import cgroup_for, summary

# One test whose child process spins for half a CPU second, one that does nothing.
BURNING = '''
import subprocess, sys
def test_a_child_burns():
    subprocess.run([sys.executable, "-c", "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.5: pass"], check=True)
def test_idle():
    pass
'''


def test_the_summary_sums_each_files_tests_and_ranks_both_by_cpu():
    rows = [["tests/a.py::one", 10.0, 4.0], ["tests/b.py::two", 3.5, 30.0], ["tests/a.py::three", 1.5, 1.0]]
    lines = summary(rows, top=2).splitlines()
    assert lines[0] == "15 CPU s over 3 tests (35 s of their wall time)"
    assert lines[2].split() == ["11.5", "5.0", "tests/a.py"] and lines[3].split() == ["3.5", "30.0", "tests/b.py"]
    assert [line.split()[-1] for line in lines[5:]] == ["tests/a.py::one", "tests/b.py::two"]


@pytest.mark.distributed  # starts pytest
def test_a_tests_row_holds_the_cpu_of_the_processes_it_starts(tmp_path):
    if cgroup_for("meshtrain-tests-main") is None:  # the cgroup the run below uses
        pytest.skip("no writable cgroup hierarchy here (root only; CI runs as root)")
    (tmp_path / "test_burning.py").write_text(BURNING)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.suite_cpu", "-p", "no:cacheprovider",
                           "test_burning.py"], cwd=tmp_path, env=clean_env(PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {nodeid: cpu for nodeid, cpu, _ in json.loads((tmp_path / "outputs/suite-cpu/main.json").read_text())}
    assert rows["test_burning.py::test_a_child_burns"] >= 0.5, rows  # the child's half second, and its start-up
    assert rows["test_burning.py::test_idle"] < 0.1, rows


def test_a_crash_report_early_in_a_jobs_output_is_kept_beside_its_end():
    """A rank killed by a signal reports the fault and its innermost frames first; the launcher's words after them
    fill the last 4,000 characters, which alone named no cause (a SIGABRT in test_layouts' 4-rank launch)."""
    crash = 'Fatal Python error: Aborted\n\nThread 0x1 (most recent call first):\n  File "step.py", line 5 in inner\n'
    noise = "torch.multiprocessing.spawn.ProcessExitedException: SIGABRT\n" * 100
    text = "rank 1 starting\n" + crash + noise
    end = job_end(text)
    assert end.startswith(crash) and end.endswith(text[-4000:])
    assert job_end(noise) == noise[-4000:]  # no crash report in it: the end alone
    assert job_end(text[:3000]) == text[:3000]  # a short output whole, its crash report once
