"""Jobs that hand results back: start a script on N ranks under torchrun and collect what each rank recorded.

The ranks of a job share the launcher's stdout, and their lines interleave (a rank's line may even be cut in two
by another's), so whoever reads verdicts or figures from stdout can fail by timing alone. A script run this way
instead calls, on every rank, once or more per case:

    from meshtrain.runtime.results import record
    record(case, equal=ok, worst={"loss": 1e-7, ...}, **anything_else_the_caller_reads)

which merges the fields into this rank's {case: fields} and rewrites $MESHTRAIN_RESULTS/rank-R.json atomically
(a temporary file, then os.replace), R being torchrun's RANK; `run_ranks` reads every rank's file back once the job
has ended. The tests' parity drivers (their verdict `equal`, their largest differences `worst`) and the layout
benchmark's figures travel this way. record also prints one human-readable line for whoever reads the output;
nothing parses it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ENV = "MESHTRAIN_RESULTS"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_recorded: dict[str, dict] = {}  # this rank's {case: fields} so far


def torchrun_argv(ranks: int, *args: str) -> list[str]:
    """`torchrun --standalone --nproc-per-node RANKS ARGS` as an argv, with this interpreter's torch.distributed.run."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *args]


@dataclass
class Job:
    returncode: int | None  # None: killed at its timeout
    output: str  # stdout and stderr together, colour codes removed
    results: dict[int, dict[str, dict]]  # {rank: {case: fields}} of every rank that recorded anything


def run_ranks(script: str | Path, ranks: int, *args: str, timeout: float = 180, env: dict[str, str] | None = None,
              cwd: str | Path | None = None) -> Job:
    """torchrun `script ARGS` on `ranks` ranks and collect what they recorded. On a timeout the whole job (torchrun
    and its ranks, one process group) is killed, so no orphaned rank keeps loading the machine."""
    with tempfile.TemporaryDirectory(prefix="meshtrain-results-") as folder:
        proc = subprocess.Popen(torchrun_argv(ranks, str(script), *args), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env={**(env or os.environ), ENV: folder},
                                cwd=cwd, start_new_session=True)
        try:
            text, _ = proc.communicate(timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
            code = None
        return Job(code, _ANSI.sub("", text), read_results(folder))


def first_error(output: str) -> str:
    """The line of a failed job's output that says why: a rank's first logged error or exception, not torchrun's
    closing rule nor its own ChildFailedError."""
    # torchrun prefixes each line of a rank's traceback with "[rankN]: "
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line.strip()) for line in output.strip().splitlines() if line.strip()]
    said = [line for line in lines if "[ERROR]" in line] or [
        line for line in lines if re.match(r"[\w.]+(Error|Exception): ", line) and "ChildFailedError" not in line]
    return (said or lines[-1:] or ["no output"])[0][:300]


def record(case: str, **fields) -> None:
    """Merge `fields` (JSON values: numbers, strings, bools, lists, dicts) into this rank's result for `case`."""
    rank = int(os.environ.get("RANK", "0"))
    _recorded.setdefault(case, {}).update(fields)
    shown = ", ".join(f"{k}={_short(v)}" for k, v in fields.items())
    sys.stdout.write(f"{case} rank {rank}: {shown}\n")  # one write per line: for reading, not parsing
    sys.stdout.flush()
    directory = os.environ.get(ENV)
    if not directory:  # run by hand: the printed lines are all there is
        return
    path = Path(directory) / f"rank-{rank}.json"
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(_recorded))  # insertion order: a table keeps its columns
    os.replace(temporary, path)


def read_results(directory: str | Path) -> dict[int, dict[str, dict]]:
    """{rank: {case: fields}} of every rank that recorded anything in `directory`."""
    return {int(p.stem.removeprefix("rank-")): json.loads(p.read_text())
            for p in sorted(Path(directory).glob("rank-*.json"))}


def full(t):
    """The whole tensor behind a DTensor (gathered from its shards); any other tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_short(v)}" for k, v in value.items()) + "}"
    return str(value)
