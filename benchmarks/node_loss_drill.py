"""A node lost mid-run: an elastic job of 2 "nodes" × 2 ranks (`meshtrain launch --nnodes 1:2`, torchrun's agents
meeting by c10d rendezvous) loses one of them, killed whole (agent and ranks) at an iteration, and goes on with the
2 ranks left: torchrun's agent restarts them, train.init_from=auto resumes the last checkpoint, and
train.global_batch_size keeps the global batch (the accumulation doubles). Beside it the same job on 4 ranks,
uninterrupted.

    python benchmarks/node_loss_drill.py [--iters 40] [--every 10] [--kill-at 25]

Both "nodes" are process trees on this machine (Linux: /proc; tests/distributed/test_multinode.py does the same on
network namespaces).
Prints the iterations done again, the seconds from the kill to the first new iteration and to the end, the wall
time of both jobs, the largest loss difference against the uninterrupted run, and whether the sample ledgers agree.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.conftest import clean_env, prepare_data  # noqa: E402

GPT = ["model.n_layer=2", "model.n_head=4", "model.n_embd=64", "model.block_size=64", "model.dropout=0.0",
       "model.batch_size=4", "train.eval_iters=1", "train.dtype=fp32", "train.log_interval=1",
       "train.global_batch_size=16", "train.sample_ledger=true", "train.init_from=auto", "train.keep_checkpoints=0"]


def train_args(data_root: Path, out_dir: Path, iters: int, every: int) -> list[str]:
    return ["train", "gpt", *GPT, f"data.root={data_root}", f"train.out_dir={out_dir}", f"train.max_iters={iters}",
            f"train.eval_interval={every}", f"optimizer.lr_decay_iters={iters}"]


def run_dir(out_dir: Path) -> Path:
    return (out_dir / "gpt" / "ddp" / "latest").resolve()


def losses(out_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}  # a step done again: its last loss


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts its ranks in sessions of their own: no process group holds all)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def drill(data_root: Path, out_dir: Path, iters: int, every: int, kill_at: int) -> dict:
    launch = [sys.executable, "-m", "meshtrain", "launch", "--nnodes", "1:2", "--ppn", "2", "--max-restarts", "1",
              "--rdzv-endpoint", "localhost:29477", "--", "python", "-m", "meshtrain",
              *train_args(data_root, out_dir, iters, every)]
    env = clean_env(MESHTRAIN_TIMEOUT="60")
    started = time.monotonic()
    nodes = []
    for output in (subprocess.PIPE, subprocess.DEVNULL):  # the first keeps the rendezvous (it binds the port first)
        nodes.append(subprocess.Popen(launch, stdout=output, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env,
                                      start_new_session=True))
        time.sleep(3)
    lines, killed, resumed, back = [], None, False, None
    for line in nodes[0].stdout:
        lines.append(line)
        step = re.search(r"\] step=(\d+) loss", line)
        resumed = resumed or "resuming at iteration" in line
        if step and killed is None and int(step.group(1)) == kill_at:
            for pid in [nodes[1].pid, *descendants(nodes[1].pid)]:  # the second node: agent and ranks, at once
                os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
        elif step and resumed and back is None:
            back = time.monotonic()
    nodes[0].wait()
    nodes[1].wait()
    text = "".join(lines)
    if nodes[0].returncode or killed is None or back is None:
        raise SystemExit(f"the elastic job failed ({nodes[0].returncode}):\n{text[-3000:]}")
    redone = re.search(r"restart: the previous attempt had done (\d+) iteration", text)
    return {"wall": time.monotonic() - started, "to_first_step": back - killed, "to_end": time.monotonic() - killed,
            "redone": int(redone.group(1)) if redone else None, "text": text}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="iterations between checkpoints")
    parser.add_argument("--kill-at", type=int, default=25, help="the iteration after which a node dies")
    args = parser.parse_args()
    from meshtrain.train.ledger import read_ledger

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data_root = prepare_data(tmp / "data")
        started = time.monotonic()
        whole = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                                "-m", "meshtrain", *train_args(data_root, tmp / "whole", args.iters, args.every)],
                               capture_output=True, text=True, cwd=REPO, env=clean_env())
        if whole.returncode:
            raise SystemExit(f"the uninterrupted job failed:\n{(whole.stdout + whole.stderr)[-3000:]}")
        whole_wall = time.monotonic() - started
        lost = drill(data_root, tmp / "elastic", args.iters, args.every, args.kill_at)
        want, got = losses(tmp / "whole"), losses(tmp / "elastic")
        worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
        same_ledger = read_ledger(run_dir(tmp / "whole") / "ledger.txt") == read_ledger(
            run_dir(tmp / "elastic") / "ledger.txt")
    print(f"node lost after iteration {args.kill_at} of {args.iters} (checkpoints every {args.every}); 4 ranks "
          "before, 2 after, global batch 16 throughout")
    print(f"  iterations done again           {lost['redone']}")
    print(f"  kill -> first resumed iteration {lost['to_first_step']:.1f} s  (torchrun's agent notices, re-meets, "
          "restarts the ranks; they load the checkpoint)")
    print(f"  kill -> end of the job          {lost['to_end']:.1f} s")
    print(f"  wall time                       {lost['wall']:.1f} s elastic, {whole_wall:.1f} s uninterrupted "
          f"(×{lost['wall'] / whole_wall:.2f})")
    print(f"  losses against uninterrupted    largest relative difference {worst:.2e} over {len(want)} iterations")
    print(f"  sample ledgers                  {'identical' if same_ledger else 'DIFFER'}")


if __name__ == "__main__":
    main()
