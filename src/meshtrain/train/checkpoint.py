"""Run directories and atomic checkpoints.

    outputs/runs/<workload>/<backend>/<YYYY-MM-DD>/<HH-MM-SS>/   config.yaml, ckpt.pt, metrics.jsonl, samples.txt
    outputs/runs/<workload>/<backend>/latest                    the last run's directory (a text file)
    outputs/runs/checkpoints.log                                one line per run directory

A checkpoint is written to a temporary file and renamed over the old one: a kill at any moment
leaves either the previous checkpoint or the new one, never half of one. It loads with
`torch.load(weights_only=True)`: tensors, numbers, strings, lists and dicts only.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from meshtrain.errors import MeshtrainError

CHECKPOINT = "ckpt.pt"


class CheckpointError(MeshtrainError, RuntimeError):
    """No checkpoint where one was asked for, or one that cannot be used."""


def new_run_dir(out_dir: str | Path, workload: str, backend: str, now: float | None = None) -> Path:
    stamp = time.localtime(now)
    run_dir = Path(out_dir) / workload / backend / time.strftime("%Y-%m-%d", stamp) / time.strftime("%H-%M-%S", stamp)
    suffix, candidate = 1, run_dir
    while candidate.exists():  # two runs started in the same second
        candidate = run_dir.with_name(f"{run_dir.name}-{suffix}")
        suffix += 1
    candidate.mkdir(parents=True)
    return candidate


def record_run(out_dir: str | Path, workload: str, backend: str, run_dir: Path) -> None:
    """Point `latest` at run_dir and list it in checkpoints.log."""
    latest = Path(out_dir) / workload / backend / "latest"
    _atomic_write_text(latest, f"{run_dir.resolve()}\n")
    with open(Path(out_dir) / "checkpoints.log", "a") as log:
        log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {workload} {backend} {run_dir.resolve()}\n")


def latest_run(out_dir: str | Path, workload: str, backend: str) -> Path:
    latest = Path(out_dir) / workload / backend / "latest"
    if not latest.is_file():
        raise CheckpointError(f"train.init_from=resume found no earlier run: {latest} does not exist. Start one with "
                              "train.init_from=scratch, or name the run with train.run_dir=DIR")
    return Path(latest.read_text().strip())


def save(run_dir: Path, state: dict[str, Any]) -> Path:
    path = run_dir / CHECKPOINT
    tmp = path.with_name(f".{CHECKPOINT}.tmp-{os.getpid()}")
    try:
        torch.save(state, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}: the run saved none yet (train.save_checkpoints, "
                              "train.eval_interval), or the path is wrong")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: say which, not a pickle traceback
        raise CheckpointError(f"{path} is not a readable meshtrain checkpoint: {e}") from e


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
