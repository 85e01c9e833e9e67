"""The CPU seconds each test costs, every process it starts included: a pytest plugin, off unless asked for.

    PYTEST_ADDOPTS="-p tests.suite_cpu" make test       # as root: each worker's rows in outputs/suite-cpu/
    python -m tests.suite_cpu outputs/suite-cpu          # the files and tests that cost the most

Wall times (`--durations`) mislead on two cores shared by two workers: a test that waits (a rendezvous, a SLURM
requeue) shows the time it waited, and one beside a heavy neighbour shows the neighbour's. Here each pytest worker
moves itself into a CPU-accounting cgroup of its own as it starts, so that every process it starts afterwards
(forked ranks, torchrun's, mpirun's, SLURM's daemons and their steps) is counted there, and each test's row is the
cgroup's CPU time after the test less before it (the suite's forkserver leaves with its worker, so the cgroup
stays until the next run's worker of that name reuses it, or `rmdir`). Needs root and a cgroup v1 `cpuacct` or v2
hierarchy; elsewhere it says why and records nothing.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

OUT = Path("outputs/suite-cpu")
_state: dict = {}


def cgroup_for(name: str) -> Path | None:
    """The CPU-accounting cgroup `name` (v1's cpuacct, else v2's), made where missing; None where none can be."""
    for root in (Path("/sys/fs/cgroup/cpuacct"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")):
        if (root / "cgroup.procs").exists() and os.access(root, os.W_OK):
            folder = root / name
            folder.mkdir(exist_ok=True)
            return folder
    return None


def cpu_seconds(folder: Path) -> float:
    if (folder / "cpuacct.usage").exists():
        return int((folder / "cpuacct.usage").read_text()) / 1e9  # nanoseconds
    usage = next(line for line in (folder / "cpu.stat").read_text().splitlines() if line.startswith("usage_usec"))
    return int(usage.split()[1]) / 1e6


def pytest_configure(config):
    # xdist's own word for a worker (a pytest started by a test inherits PYTEST_XDIST_WORKER, but is none)
    worker = config.workerinput["workerid"] if hasattr(config, "workerinput") else "main"
    if worker == "main" and config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None):
        return  # the controller runs no test: its workers count
    folder = cgroup_for(f"meshtrain-tests-{worker}")  # the next run's worker of that name reuses it
    if folder is None:
        print("suite_cpu: no writable cgroup hierarchy here (needs root): nothing recorded", file=sys.stderr)
        return
    (folder / "cgroup.procs").write_text(str(os.getpid()))
    _state.update(folder=folder, worker=worker, rows=[], started={})


def pytest_runtest_logstart(nodeid, location):
    if _state:
        _state["started"][nodeid] = (cpu_seconds(_state["folder"]), time.monotonic())


def pytest_runtest_logfinish(nodeid, location):
    if _state and nodeid in _state["started"]:
        cpu, wall = _state["started"].pop(nodeid)
        _state["rows"].append([nodeid, round(cpu_seconds(_state["folder"]) - cpu, 2),
                               round(time.monotonic() - wall, 2)])


def pytest_unconfigure(config):
    if _state:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / f"{_state['worker']}.json").write_text(json.dumps(_state["rows"]))


def summary(rows: list[list], top: int = 20) -> str:
    """The files, then the tests, that cost the most CPU, beside their wall time."""
    cpu, wall = Counter(), Counter()
    for nodeid, seconds, waited in rows:
        cpu[nodeid.split("::")[0]] += seconds
        wall[nodeid.split("::")[0]] += waited
    lines = [f"{sum(r[1] for r in rows):.0f} CPU s over {len(rows)} tests ({sum(r[2] for r in rows):.0f} s of their "
             f"wall time)", "   CPU s   wall s  file"]
    lines += [f"{seconds:8.1f} {wall[name]:8.1f}  {name}" for name, seconds in cpu.most_common(top)]
    lines += ["   CPU s   wall s  test"]
    lines += [f"{seconds:8.1f} {waited:8.1f}  {nodeid}" for nodeid, seconds, waited in
              sorted(rows, key=lambda row: -row[1])[:top]]
    return "\n".join(lines)


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else OUT)
    print(summary([row for path in sorted(folder.glob("*.json")) for row in json.loads(path.read_text())]))
