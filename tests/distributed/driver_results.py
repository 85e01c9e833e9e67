"""How a torchrun'd test driver hands its results to the test: one JSON file per rank, never parsed stdout.

The ranks of a job share the launcher's stdout, and their lines interleave (a rank's line may even be cut in two
by another's), so a test that reads verdicts or figures from stdout can fail by timing alone. A driver instead
calls, on every rank, once or more per case:

    from driver_results import full, record      # the driver's own folder is on sys.path under torchrun
    record(case, equal=ok, worst={"loss": 1e-7, ...}, **anything_else_the_test_asserts_on)

which merges the fields into this rank's {case: fields} and rewrites $MESHTRAIN_TEST_RESULTS/rank-R.json
atomically (a temporary file, then os.replace), R being torchrun's RANK. The test (tests/conftest.py
run_driver) reads every rank's file back with read_results once the job has ended. `equal` is the verdict
assert_all_equal checks; `worst` holds the largest differences, shown when a case is not equal. record also
prints one human-readable line, for whoever reads a failing test's output; no test parses it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ENV = "MESHTRAIN_TEST_RESULTS"
_recorded: dict[str, dict] = {}  # this rank's {case: fields} so far


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def record(case: str, **fields) -> None:
    """Merge `fields` (JSON values: numbers, strings, bools, lists, dicts) into this rank's result for `case`."""
    _recorded.setdefault(case, {}).update(fields)
    shown = ", ".join(f"{k}={_short(v)}" for k, v in fields.items())
    sys.stdout.write(f"{case} rank {rank()}: {shown}\n")  # one write per line: for reading, not parsing
    sys.stdout.flush()
    directory = os.environ.get(ENV)
    if not directory:  # run by hand: the printed lines are all there is
        return
    path = Path(directory) / f"rank-{rank()}.json"
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(_recorded, sort_keys=True))
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
