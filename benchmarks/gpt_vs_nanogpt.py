"""meshtrain against nanoGPT's own train.py, one after the other on the same GPU, on nanoGPT's baby GPT.

    python benchmarks/gpt_vs_nanogpt.py --nanogpt ~/src/nanoGPT            # 5000 iterations each, bf16 + compile
    python benchmarks/gpt_vs_nanogpt.py --iters 1500 train.cuda_graphs=true   # meshtrain alone, with overrides
    python benchmarks/gpt_vs_nanogpt.py --nanogpt DIR --also "1000 train.cuda_graphs=false"  # + a shorter row

--nanogpt is a checkout of github.com/karpathy/nanoGPT (outside this project); its shakespeare_char data is
prepared offline from the Shakespeare meshtrain ships. Both runs use train_shakespeare_char's recipe
(6 layers, 6 heads, 384 wide, block 256, batch 64, evaluation of 200 batches every 250 iterations).

Prints one row per run: tokens/s and ms/iter, nanoGPT's the median over its logged iterations after the first tenth
(the iterations that ran an evaluation left out), meshtrain's the median over its evaluation intervals after the
first (wall time between evaluations, the evaluation left out), MFU against this GPU's datasheet bf16 peak (nanoGPT's own figure
is against an A100's 312 TFLOP/s: it is recomputed from its tokens/s with its own FLOPs formula), the wall time
from process start to the first evaluation with val loss <= --target, the best and the last val loss (the baby GPT
overfits Shakespeare late in a long run), and the total wall time. nanoGPT also writes a checkpoint whenever val
improves; meshtrain writes none here.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import torch
from train_runs import prepared, run_train

NANO_ITER = re.compile(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms")
NANO_EVAL = re.compile(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)")


def baby_gpt_flops_per_token(n_layer=6, n_head=6, n_embd=384, block=256, vocab=65) -> float:
    """nanoGPT's estimate_mfu formula (6N + 12·L·H·Q·T, N without the position embedding) per token."""
    params = 12 * n_layer * n_embd ** 2 + 2 * n_layer * n_embd + n_embd + vocab * n_embd  # no biases; lm_head tied
    return 6 * params + 12 * n_layer * n_head * (n_embd // n_head) * block


def run_nanogpt(root: Path, args: list[str], tokens_per_iter: int, eval_interval: int, target: float,
                stop_at_target: bool = False) -> dict:
    """nanoGPT's train.py in the checkout `root` with these command-line arguments, on its shakespeare_char data
    prepared offline from the Shakespeare meshtrain ships. Its speed is the median of its logged iteration times
    after the first tenth, the iterations that ran an evaluation left out (one every `eval_interval`)."""
    data = root / "data" / "shakespeare_char"
    text = gzip.decompress(resources.files("meshtrain.data.assets").joinpath("tinyshakespeare.txt.gz").read_bytes())
    (data / "input.txt").write_bytes(text)
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True)
    cmd = [sys.executable, "train.py", *args, "--always_save_checkpoint=False", "--out_dir=/tmp/nanogpt-out"]
    started, ms, evals, reached = time.time(), [], [], None
    with subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
        for line in proc.stdout:
            if m := NANO_ITER.match(line):
                if int(m[1]) % eval_interval:  # an iteration that evaluated is timed with its evaluation
                    ms.append(float(m[2]))
            elif m := NANO_EVAL.match(line):
                evals.append((int(m[1]), time.time() - started, float(m[2])))
                if reached is None and evals[-1][2] <= target:
                    reached = evals[-1][1]
                    if stop_at_target:
                        proc.terminate()
                        break
    if proc.returncode and not (stop_at_target and reached):
        sys.exit(f"nanoGPT failed (exit {proc.returncode}): {' '.join(cmd)}")
    steady = statistics.median(ms[len(ms) // 10:])
    name = "nanoGPT train.py" + (f", stopped at val {target}" if stop_at_target and reached else "")
    return {"name": name, "ms": steady, "tps": tokens_per_iter / (steady / 1e3), "reached": reached,
            "val": evals[-1][2], "best": min(v for _, _, v in evals), "steps": evals[-1][0], "evals": evals,
            "wall": time.time() - started}


def run_baby_gpt_nanogpt(root: Path, iters: int, target: float, stop_at_target: bool) -> dict:
    run = run_nanogpt(root, ["config/train_shakespeare_char.py", f"--max_iters={iters}", f"--lr_decay_iters={iters}"],
                      64 * 256, 250, target, stop_at_target)
    return {**run, "flops": run["tps"] * baby_gpt_flops_per_token()}


def run_meshtrain(iters: int, target: float, overrides: list[str], name: str = "meshtrain") -> dict:
    with tempfile.TemporaryDirectory(prefix="meshtrain-vs-nanogpt-") as tmp:
        root = prepared(tmp)
        run = run_train("gpt", 1, ["preset=shakespeare_char", f"data.root={root}", f"train.max_iters={iters}",
                                   f"optimizer.lr_decay_iters={iters}", "train.compile=true", *overrides])
    evals = run.evals()
    reached = next((r["time"] - run.started for r in evals if r["val_loss"] <= target), None)
    # Whole evaluation intervals after the first (compilation): wall time between two evaluations, every iteration
    # counted as it ran (a logged one synchronises the GPU around its sections, the others do not), as nanoGPT's
    # per-iteration wall times count its own.
    intervals = [r["avg_sps"] for r in evals if "avg_sps" in r][1:] or [r["sps"] for r in run.steady(0.1)]
    tps = statistics.median(intervals) * 256
    return {"name": name, "ms": 64 * 256 / tps * 1e3, "tps": tps,
            "flops": tps * baby_gpt_flops_per_token(), "reached": reached, "val": evals[-1]["val_loss"],
            "best": min(r["val_loss"] for r in evals), "wall": run.wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="more `meshtrain train gpt` overrides")
    parser.add_argument("--nanogpt", type=Path, help="a checkout of karpathy/nanoGPT")
    parser.add_argument("--iters", type=int, default=5000)
    parser.add_argument("--target", type=float, default=1.47, help="val loss to time (nanoGPT's baby GPT: 1.4697)")
    parser.add_argument("--also", action="append", default=[], metavar="'ITERS OVERRIDE…'",
                        help="another meshtrain row: its iterations, then its overrides (repeatable)")
    parser.add_argument("--stop-nanogpt", action="store_true",
                        help="stop nanoGPT at its first evaluation at or under --target (its speed and time to "
                             "target are known then; a short GPU lease keeps the rest)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("this comparison is for a GPU (nanoGPT's recipe needs bf16 and compile); on a CPU use "
                 "benchmarks/gpt_cpu_recipe.py")
    from meshtrain.machine.datasheet import match_device

    entry = match_device(torch.cuda.get_device_name())
    peak = entry.flops["bf16"] if entry else None
    runs = [run_baby_gpt_nanogpt(args.nanogpt.expanduser(), args.iters, args.target, args.stop_nanogpt)] if args.nanogpt else []
    print(json.dumps(runs), flush=True)  # each row as it is measured: a GPU lease may end before the table
    runs.append(run_meshtrain(args.iters, args.target, args.overrides,
                              f"meshtrain {' '.join(args.overrides)}".strip()))
    for also in args.also:
        iters, *overrides = also.split()
        print(json.dumps(runs), flush=True)
        runs.append(run_meshtrain(int(iters), args.target, overrides, f"meshtrain {' '.join(overrides)}, {iters} it"))
    print(f"\nbaby GPT (shakespeare_char), {args.iters} iterations, bf16 + compile, one {torch.cuda.get_device_name()}"
          f"{f' (bf16 peak {peak / 1e12:.1f} TFLOP/s, {entry.name})' if peak else ''}")
    print(f"| run | ms/iter | tokens/s | × first | MFU | time to val {args.target} | best val | last val | wall |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        mfu = f"{100 * run['flops'] / peak:.1f}%" if peak else "—"
        reached = f"{run['reached']:.0f} s" if run["reached"] is not None else "not reached"
        print(f"| {run['name']} | {run['ms']:.2f} | {run['tps']:,.0f} | {run['tps'] / runs[0]['tps']:.2f}× | {mfu} | "
              f"{reached} | {run['best']:.4f} | {run['val']:.4f} | {run['wall']:.0f} s |")


if __name__ == "__main__":
    main()
