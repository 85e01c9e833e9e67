"""meshtrain against nanoGPT's own train.py, one after the other on the same GPU, on nanoGPT's baby GPT.

    python benchmarks/gpt_vs_nanogpt.py --nanogpt ~/src/nanoGPT            # 5000 iterations each, bf16 + compile
    python benchmarks/gpt_vs_nanogpt.py --iters 1500 train.cuda_graphs=true   # meshtrain alone, with overrides

--nanogpt is a checkout of github.com/karpathy/nanoGPT (outside this project); its shakespeare_char data is
prepared offline from the Shakespeare meshtrain ships. Both runs use train_shakespeare_char's recipe
(6 layers, 6 heads, 384 wide, block 256, batch 64, evaluation of 200 batches every 250 iterations).

Prints one row per run: median tokens/s and ms/iter over the logged iterations after the first tenth (the
iterations that ran an evaluation left out), MFU against this GPU's datasheet bf16 peak (nanoGPT's own figure
is against an A100's 312 TFLOP/s: it is recomputed from its tokens/s with its own FLOPs formula), the wall time
from process start to the first evaluation with val loss <= --target, the best and the last val loss (the baby GPT
overfits Shakespeare late in a long run), and the total wall time. nanoGPT also writes a checkpoint whenever val
improves; meshtrain writes none here.
"""

from __future__ import annotations

import argparse
import gzip
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
from train_runs import run_train

NANO_ITER = re.compile(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms")
NANO_EVAL = re.compile(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)")


def baby_gpt_flops_per_token(n_layer=6, n_head=6, n_embd=384, block=256, vocab=65) -> float:
    """nanoGPT's estimate_mfu formula (6N + 12·L·H·Q·T, N without the position embedding) per token."""
    params = 12 * n_layer * n_embd ** 2 + 2 * n_layer * n_embd + n_embd + vocab * n_embd  # no biases; lm_head tied
    return 6 * params + 12 * n_layer * n_head * (n_embd // n_head) * block


def run_nanogpt(root: Path, iters: int, target: float) -> dict:
    data = root / "data" / "shakespeare_char"
    text = gzip.decompress(resources.files("meshtrain.data.assets").joinpath("tinyshakespeare.txt.gz").read_bytes())
    (data / "input.txt").write_bytes(text)
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True)
    cmd = [sys.executable, "train.py", "config/train_shakespeare_char.py", f"--max_iters={iters}",
           f"--lr_decay_iters={iters}", "--always_save_checkpoint=False", "--out_dir=/tmp/nanogpt-out"]
    started, ms, evals, reached = time.time(), [], [], None
    with subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
        for line in proc.stdout:
            if m := NANO_ITER.match(line):
                if int(m[1]) % 250:  # an iteration that evaluated is timed with its evaluation
                    ms.append(float(m[2]))
            elif m := NANO_EVAL.match(line):
                evals.append(float(m[2]))
                if reached is None and evals[-1] <= target:
                    reached = time.time() - started
    if proc.returncode:
        sys.exit(f"nanoGPT failed (exit {proc.returncode}): {' '.join(cmd)}")
    steady = statistics.median(ms[len(ms) // 10:])
    tps = 64 * 256 / (steady / 1e3)
    return {"name": "nanoGPT train.py", "ms": steady, "tps": tps, "flops": tps * baby_gpt_flops_per_token(),
            "reached": reached, "val": evals[-1], "best": min(evals), "wall": time.time() - started}


def run_meshtrain(iters: int, target: float, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="meshtrain-vs-nanogpt-") as root:
        subprocess.run([sys.executable, "-m", "meshtrain", "prepare", "shakespeare_char", "--data-root", root],
                       check=True, capture_output=True)
        run = run_train("gpt", 1, ["preset=shakespeare_char", f"data.root={root}", f"train.max_iters={iters}",
                                   f"optimizer.lr_decay_iters={iters}", "train.compile=true", *overrides])
    steady, evals = run.steady(0.1), run.evals()
    reached = next((r["time"] - run.started for r in evals if r["val_loss"] <= target), None)
    tps = statistics.median(r["tps"] for r in steady)
    return {"name": "meshtrain", "ms": statistics.median(r["dt"] for r in steady) * 1e3, "tps": tps,
            "flops": tps * baby_gpt_flops_per_token(), "reached": reached, "val": evals[-1]["val_loss"],
            "best": min(r["val_loss"] for r in evals), "wall": run.wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="more `meshtrain train gpt` overrides")
    parser.add_argument("--nanogpt", type=Path, help="a checkout of karpathy/nanoGPT")
    parser.add_argument("--iters", type=int, default=5000)
    parser.add_argument("--target", type=float, default=1.47, help="val loss to time (nanoGPT's baby GPT: 1.4697)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("this comparison is for a GPU (nanoGPT's recipe needs bf16 and compile); on a CPU use "
                 "benchmarks/gpt_cpu_recipe.py")
    from meshtrain.machine.datasheet import match_device

    entry = match_device(torch.cuda.get_device_name())
    peak = entry.flops["bf16"] if entry else None
    runs = [run_nanogpt(args.nanogpt.expanduser(), args.iters, args.target)] if args.nanogpt else []
    runs.append(run_meshtrain(args.iters, args.target, args.overrides))
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
