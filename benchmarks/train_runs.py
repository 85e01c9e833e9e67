"""Run `meshtrain train` jobs for the benchmarks and read back what they logged (metrics.jsonl, config.yaml)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from meshtrain.runtime.results import torchrun_argv


def prepared(folder: str | Path, corpus: str = "shakespeare_char") -> Path:
    """`meshtrain prepare CORPUS` (a shipped corpus: offline, seconds) into FOLDER/data; returns that data root."""
    root = Path(folder) / "data"
    subprocess.run([sys.executable, "-m", "meshtrain", "prepare", corpus, "--data-root", str(root)], check=True,
                   capture_output=True)
    return root


@dataclass
class TrainRun:
    rows: list[dict]  # metrics.jsonl
    config: str  # the resolved config.yaml (what train.dtype=auto chose, say)
    started: float  # time.time() at launch: a row's "time" minus this is the time since the process started
    wall: float  # seconds from launch to exit

    def steady(self, skip_fraction: float) -> list[dict]:
        """The logged iterations after the first `skip_fraction` of them (warm-up, compilation)."""
        steps = [r for r in self.rows if "dt" in r]
        return steps[int(len(steps) * skip_fraction):] or steps

    def evals(self) -> list[dict]:
        return [r for r in self.rows if "val_loss" in r]

    def dtype(self) -> str:
        return next(line.split(":")[1].strip() for line in self.config.splitlines()
                    if line.strip().startswith("dtype:"))


def run_train(workload: str, ranks: int, overrides: list[str], timeout: float = 3600,
              keep: Path | None = None, torchrun: bool = False) -> TrainRun:
    """`meshtrain train WORKLOAD OVERRIDES` as a plain process, or under torchrun with `ranks` processes (with
    `torchrun`, even one), in a
    fresh output directory with no checkpoints (unless an override turns them on); its run directory is copied to
    `keep` (for a report), if given. Raises on failure."""
    with tempfile.TemporaryDirectory(prefix=f"{workload}_bench_") as out_dir:
        args = ["-m", "meshtrain", "train", workload, "train.save_checkpoints=false", f"train.out_dir={out_dir}",
                *overrides]
        argv = torchrun_argv(ranks, *args) if ranks > 1 or torchrun else [sys.executable, *args]
        env = {**os.environ, "MESHTRAIN_PROGRESS": "0"}
        started = time.time()
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
        wall = time.time() - started
        if done.returncode:
            raise RuntimeError(f"meshtrain train {workload} {' '.join(overrides)} failed (exit {done.returncode}):\n"
                               f"{(done.stdout + done.stderr)[-3000:]}")
        run_dir = next(Path(out_dir, workload).glob("*/latest")).resolve()
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        if keep:
            shutil.copytree(run_dir, keep, dirs_exist_ok=True)
        return TrainRun(rows, (run_dir / "config.yaml").read_text(), started, wall)


def median_rate(rows: list[dict], skip: int) -> float:
    """Median samples/s over the logged iterations after the first `skip` (warm-up, compilation)."""
    rates = [r["sps"] for r in rows if "sps" in r and r["step"] > skip]
    if not rates:
        raise RuntimeError(f"no iterations logged after the first {skip}: raise --steps")
    return statistics.median(rates)


def last_eval(rows: list[dict]) -> dict:
    return [r for r in rows if "val_loss" in r][-1]


def markdown(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
