"""Run `meshtrain train vit` jobs for the ViT benchmarks and read back what they logged (metrics.jsonl)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_vit(ranks: int, overrides: list[str], timeout: float = 3600) -> list[dict]:
    """One training job (a plain process, or torchrun with `ranks` processes); its metrics.jsonl rows."""
    with tempfile.TemporaryDirectory(prefix="vit_bench_") as out_dir:
        args = ["-m", "meshtrain", "train", "vit", *overrides, f"train.out_dir={out_dir}",
                "train.save_checkpoints=false"]
        if ranks > 1:
            args = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *args]
        env = {**os.environ, "MESHTRAIN_PROGRESS": "0"}
        done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)
        if done.returncode:
            raise RuntimeError(f"meshtrain train vit {' '.join(overrides)} failed (exit {done.returncode}):\n"
                               f"{(done.stdout + done.stderr)[-3000:]}")
        latest = next(Path(out_dir, "vit").glob("*/latest"))
        run_dir = Path(latest.read_text().strip())
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


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
