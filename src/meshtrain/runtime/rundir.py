"""A run directory: the one place that knows its layout. train writes it, report reads it, faults and launch
read its exit code and history.

    <out_dir>/<model>/<backend>/<YYYY-MM-DD>/<HH-MM-SS>/   one run
        config.yaml      the resolved config
        metrics.jsonl    step rows (loss, timings, rates, the ranks' spread), evaluation rows, text samples, images
        run.json         the environment, the layout and what each rank holds (written after the first step)
        checkpoints/     step-NNNNNNN directories and `latest` (train/checkpoint.py owns what is inside)
        model.pt         `meshtrain export`: the whole model in one file
    <out_dir>/<model>/<backend>/latest                    a symbolic link to the last run's directory (a text file
                                                          holding its path where the file system has no links)
    <out_dir>/checkpoints.log                             one line per run directory

A run stopped by a preemption signal with a checkpoint exits with PREEMPTED.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from meshtrain.errors import MeshtrainError

CONFIG, METRICS, FACTS, CHECKPOINTS, LATEST, RUNS_LOG = (
    "config.yaml", "metrics.jsonl", "run.json", "checkpoints", "latest", "checkpoints.log")

DAY = re.compile(r"\d{4}-\d{2}-\d{2}")  # a run's date directory, as new_run_dir names it

# The exit code of a run stopped by a preemption signal with a checkpoint (sysexits' EX_TEMPFAIL: a temporary failure,
# try again later): a job script re-queues on it, the relaunch loop does not restart it.
PREEMPTED = 75


class CheckpointError(MeshtrainError, RuntimeError):
    """No checkpoint where one was asked for (no run, or none saved), or one that cannot be used."""


def new_run_dir(out_dir: str | Path, model: str, backend: str, now: float | None = None) -> Path:
    stamp = time.localtime(now)
    run_dir = Path(out_dir) / model / backend / time.strftime("%Y-%m-%d", stamp) / time.strftime("%H-%M-%S", stamp)
    suffix, candidate = 1, run_dir
    while candidate.exists():  # two runs started in the same second
        candidate = run_dir.with_name(f"{run_dir.name}-{suffix}")
        suffix += 1
    candidate.mkdir(parents=True)
    return candidate


def record_run(out_dir: str | Path, model: str, backend: str, run_dir: Path) -> None:
    """Point `latest` at run_dir (a relative link: the tree can move) and list it in checkpoints.log."""
    latest = Path(out_dir) / model / backend / LATEST
    temporary = latest.with_name(f".{LATEST}.tmp-{os.getpid()}")
    try:
        temporary.unlink(missing_ok=True)
        temporary.symlink_to(os.path.relpath(run_dir.resolve(), latest.parent.resolve()), target_is_directory=True)
        os.replace(temporary, latest)  # readers see the old link or the new one
    except OSError:  # a file system without symbolic links
        write_atomically(latest, f"{run_dir.resolve()}\n")
    with open(Path(out_dir) / RUNS_LOG, "a") as log:
        log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {model} {backend} {run_dir.resolve()}\n")


def last_run(out_dir: str | Path, model: str, backend: str) -> Path | None:
    """The run `latest` names, or None before the first."""
    latest = Path(out_dir) / model / backend / LATEST
    return named_run(latest) if latest.exists() else None


def named_run(path: str | Path) -> Path:
    """The run directory `path` names: itself, or the run a `latest` link or file points at."""
    path = Path(path)
    if path.name == LATEST and path.is_file():  # written where the file system has no links
        return Path(path.read_text().strip())
    return path.resolve() if path.is_symlink() else path


def runs(out_dir: str | Path, model: str, backend: str) -> list[Path]:
    """The runs of this model and backend that checkpoints.log lists, the one started or resumed last first."""
    log = Path(out_dir) / RUNS_LOG
    if not log.is_file():
        return []
    found = [Path(fields[4]) for fields in (line.split(" ", 4) for line in log.read_text().splitlines())
             if len(fields) == 5 and fields[2:4] == [model, backend]]
    return list(dict.fromkeys(reversed(found)))  # a resumed run is listed again: its last line counts


def latest_run(out_dir: str | Path, model: str, backend: str) -> Path:
    """The run train.init_from=resume continues: the last one, which must exist."""
    run = last_run(out_dir, model, backend)
    if run is None:
        raise CheckpointError(f"train.init_from=resume found no earlier run: {Path(out_dir) / model / backend / LATEST} "
                          "does not exist. Start one with train.init_from=scratch, or name the run with "
                          "train.run_dir=DIR")
    return run


def newest_run_with(run: Path, has: Callable[[Path], bool]) -> Path | None:
    """The newest run beside `run` (in its <out_dir>/<model>/<backend>/, by date and time) other than `run` for which
    `has(run_dir)` is true; None where there is none, or `run` is not in such a tree."""
    run = Path(run).resolve()
    if not DAY.fullmatch(run.parent.name):  # a run directory given by train.run_dir=DIR
        return None
    days = [day for day in run.parent.parent.iterdir() if DAY.fullmatch(day.name)]  # not `latest`
    siblings = sorted((p for day in days for p in day.iterdir() if p.is_dir()), key=_started, reverse=True)
    return next((p for p in siblings if p != run and has(p)), None)


def _started(run: Path) -> tuple[str, str, int]:
    """A run directory's place in time from its names: YYYY-MM-DD/HH-MM-SS, or HH-MM-SS-N for the N-th other run
    started in the same second (new_run_dir)."""
    clock, _, nth = run.name[:8], run.name[8:9], run.name[9:]
    return run.parent.name, clock, int(nth) if nth.isdigit() else 0


def has_checkpoint(run: Path) -> bool:
    """Whether `run` has published a checkpoint (its checkpoints/latest pointer)."""
    return (Path(run) / CHECKPOINTS / LATEST).is_file()


def has_iterations(run: Path) -> bool:
    """Whether `run` logged any training: a metrics row after iteration 0 (a start killed before its first logged
    iteration has at most the evaluation of iteration 0)."""
    metrics = Path(run) / METRICS
    return metrics.is_file() and any(row["step"] > 0 for row in read_jsonl(metrics))


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a JSONL metrics file as the run's final history.

    A line cut short by a kill is skipped. Where the steps go back (a run resumed from an earlier
    checkpoint), the records from that step on that the first attempt wrote are dropped: they
    belong to a history the checkpoint no longer has."""
    records: list[dict] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict) or "step" not in record:
                continue
            if records and record["step"] < records[-1]["step"]:
                records = [r for r in records if r["step"] < record["step"]]
            records.append(record)
    return records


def write_facts(run_dir: Path, facts: dict) -> None:
    """run.json, written once by rank 0 (atomically: a report of a running job never reads half of it)."""
    write_atomically(run_dir / FACTS, json.dumps(facts, indent=1, default=str))


def read_facts(run_dir: Path) -> dict:
    path = run_dir / FACTS
    return json.loads(path.read_text()) if path.is_file() else {}


def write_atomically(path: Path, text: str) -> None:
    """Readers see the old text or the new, never half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
