"""A fault drill: one 2-rank GPT job killed 4 times by MESHTRAIN_FAULT, restarted by `meshtrain launch --max-restarts`
(torchrun's restarts) and resumed by train.init_from=auto each time, beside the same job uninterrupted.

    python benchmarks/fault_drill.py [--iters 60] [--every 10]

Prints each restart's cost as the resumed run logged it (iterations done again, seconds since the last log of the
dead attempt), the wall time of both jobs and their ratio, and whether the drilled job's losses equal the
uninterrupted one's bit for bit.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.conftest import clean_env, prepare_data  # noqa: E402

TINY = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "model.batch_size=4",
        "model.dropout=0.1", "train.eval_iters=4", "train.dtype=fp32", "train.log_interval=1",
        "train.init_from=auto"]


def job(out_dir: Path, data_root: Path, iters: int, every: int, faults: str = "") -> tuple[float, str]:
    argv = [sys.executable, "-m", "meshtrain", "launch", "-n", "2", "--max-restarts", "6", "--",
            "python", "-m", "meshtrain", "train", "gpt", *TINY, f"data.root={data_root}", f"train.out_dir={out_dir}",
            f"train.max_iters={iters}", f"train.eval_interval={every}", f"optimizer.lr_decay_iters={iters}"]
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=clean_env(MESHTRAIN_FAULT=faults))
    wall = time.monotonic() - started
    if done.returncode:
        raise SystemExit(f"the job failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    return wall, done.stdout + done.stderr


def losses(out_dir: Path) -> dict[int, float]:
    from meshtrain.runtime.rundir import read_jsonl

    run_dir = (out_dir / "gpt" / "ddp" / "latest").resolve()
    return {r["step"]: r.get("loss", r.get("val_loss")) for r in read_jsonl(run_dir / "metrics.jsonl")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--every", type=int, default=10, help="checkpoint interval")
    args = parser.parse_args()
    # 4 kills spread over the run, past the first checkpoint, alternating ranks, each in the next attempt
    kills = [(attempt % 2, (attempt + 1) * args.iters // 5 + 3, attempt) for attempt in range(4)]
    faults = ",".join(f"kill:rank={rank}:step={step}:attempt={attempt}" for rank, step, attempt in kills)
    with tempfile.TemporaryDirectory() as tmp:
        data_root = prepare_data(Path(tmp) / "data")
        plain_s, _ = job(Path(tmp) / "plain", data_root, args.iters, args.every)
        drilled_s, log = job(Path(tmp) / "drilled", data_root, args.iters, args.every, faults)
        equal = losses(Path(tmp) / "plain") == losses(Path(tmp) / "drilled")
    print(f"MESHTRAIN_FAULT={faults}")
    print(f"{'restart':>7} {'killed':>18} {'iterations redone':>18} {'s since last log':>17}")
    costs = re.findall(r"done (\d+) iteration\(s\) past this checkpoint, to be done again, and last logged "
                       r"([\d.]+) s ago", log)
    for n, ((rank, step, _), (redone, seconds)) in enumerate(zip(kills, costs, strict=False), 1):
        print(f"{n:>7} {f'rank {rank} after {step}':>18} {redone:>18} {seconds:>17}")
    print(f"uninterrupted {plain_s:.1f} s, drilled {drilled_s:.1f} s ({len(costs)} restarts): "
          f"{drilled_s / plain_s:.2f}× the wall time, {(drilled_s - plain_s) / max(len(costs), 1):.1f} s per restart")
    print(f"losses (every iteration and evaluation) equal bit for bit: {equal}")


if __name__ == "__main__":
    main()
