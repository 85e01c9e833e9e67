"""nanoGPT's CPU recipe (4L/4H/128, block 64, batch 12, 2000 iterations) under meshtrain, measured.

    python benchmarks/gpt_cpu_recipe.py                      # preset=cpu: 1 process and 2-rank DDP
    python benchmarks/gpt_cpu_recipe.py --runs 2 --dtypes auto,fp32,bf16   # the dtypes side by side
    python benchmarks/gpt_cpu_recipe.py --nanogpt ~/src/nanoGPT               # nanoGPT's train.py run now too

Prints, per run: median ms/iter, tokens/s, MFU, val loss at the end, wall time, and the time at which
val loss first reached --target (evaluated every --eval-interval iterations, so that time is coarse) beside
nanoGPT's own time to it (its whole wall time where it never reached it).
Two baselines, run now on this box, side by side, so their ratios hold even when the machine's speed drifts
between days: plain_gpt_loop.py, a framework-free fp32 loop of the same model, and, with --nanogpt (a checkout of
github.com/karpathy/nanoGPT, outside this project), nanoGPT's own train.py with the CPU recipe of its README in
fp32, one process (its train.py sets a CUDA device for every DDP rank, so it has no CPU data parallelism).
Without --nanogpt the nanoGPT row holds the figures measured for issue 3 on another day.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from gpt_vs_nanogpt import run_nanogpt
from train_runs import prepared, run_train

REFERENCE = {"name": "nanoGPT (issue 3's figures, another day)", "ms_iter": 36.6, "tps": 21_000, "val": 1.8857,
             "wall": 80.7, "steps": 2000}
# nanoGPT README's CPU recipe, fp32 stated (on a CPU its default, float16, computes fp32 and warns of a GradScaler).
NANOGPT_CPU = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--dtype=float32",
               "--eval_iters=20", "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4",
               "--n_head=4", "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]


def run_once(ranks: int, overrides: list[str], data_root: Path, eval_interval: int, log_interval: int) -> dict:
    run = run_train("gpt", ranks, [f"data.root={data_root}", f"train.eval_interval={eval_interval}",
                                   "train.eval_iters=20", f"train.log_interval={log_interval}", *overrides])
    steady = run.steady(0.1)  # the first tenth warms caches and allocators
    evals = run.evals()
    return {"dtype": run.dtype(), "ms_iter": 1e3 * statistics.median(r["dt"] for r in steady),
            "tps": statistics.median(r["tps"] for r in steady),
            "mfu": statistics.median(r["mfu"] for r in steady), "val": evals[-1]["val_loss"],
            "steps": evals[-1]["step"], "wall": run.wall,
            "evals": [(r["step"], r["time"] - run.started, r["val_loss"]) for r in evals]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="1,2", help="rank counts to run (default 1,2)")
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--dtypes", default="auto",
                        help="train.dtype values to run side by side, comma-separated (default auto)")
    parser.add_argument("--extra", nargs="*", default=[], help="more KEY=VALUE overrides for every run")
    parser.add_argument("--target", type=float, default=1.88, help="val loss whose first time is reported")
    parser.add_argument("--eval-interval", type=int, default=100)
    parser.add_argument("--nanogpt", type=Path, help="a checkout of karpathy/nanoGPT: run its train.py now")
    parser.add_argument("--no-baseline", dest="baseline", action="store_false",
                        help="skip the side-by-side plain fp32 loop")
    parser.add_argument("--log-interval", type=int, default=10,
                        help="iterations between metric lines (default 10, the presets'; nanoGPT's figure logged every 1)")
    args = parser.parse_args()
    os.environ.setdefault("MESHTRAIN_DEVICE", "cpu")  # the CPU recipe, also on a machine with a GPU

    from rich.console import Console
    from rich.table import Table

    with tempfile.TemporaryDirectory() as tmp:
        data_root = prepared(tmp)
        results, ref = [], REFERENCE
        if args.nanogpt:
            nano = run_nanogpt(args.nanogpt.expanduser(), [*NANOGPT_CPU, f"--eval_interval={args.eval_interval}"],
                               12 * 64, args.eval_interval, args.target)
            ref = {"name": "nanoGPT train.py, 1 process (run now)", "ms_iter": nano["ms"], "tps": nano["tps"],
                   "val": nano["val"], "wall": nano["wall"], "steps": nano["steps"], "reached": nano["reached"]}
        if args.baseline:
            plain = subprocess.run([sys.executable, str(Path(__file__).with_name("plain_gpt_loop.py")),
                                    str(data_root / "shakespeare_char")], capture_output=True, text=True, check=True)
            baseline = json.loads(plain.stdout.strip().splitlines()[-1])
        for ranks in (int(r) for r in args.runs.split(",")):
            for dtype in args.dtypes.split(","):
                overrides = [f"preset={args.preset}", f"train.dtype={dtype}", *args.extra]
                result = run_once(ranks, overrides, data_root, args.eval_interval, args.log_interval)
                name = f"{ranks} rank{'s' if ranks > 1 else ''} ({' '.join(overrides)})"
                results.append((name + (f" -> {result['dtype']}" if dtype == "auto" else ""), result))

    table = Table(title=f"GPT CPU recipe on {os.cpu_count()} cores", title_justify="left")
    for column in ("run", "ms/iter", "tokens/s", "vs nanoGPT", "vs plain loop", "MFU %", "iters", "val loss", "wall s",
                   f"s to val≤{args.target}", "that / nanoGPT's"):
        table.add_column(column, justify="right" if column != "run" else "left")
    ref_reached = ref.get("reached")
    table.add_row(ref["name"], f"{ref['ms_iter']:.1f}", f"{ref['tps']:,.0f}", "1.00", "", "", str(ref["steps"]),
                  f"{ref['val']:.4f}", f"{ref['wall']:.1f}", "—" if ref_reached is None else f"{ref_reached:.1f}",
                  "1.00")
    base_tps = baseline["tps"] if args.baseline else None
    if args.baseline:
        table.add_row("plain fp32 loop, 1 process (run now)", f"{baseline['ms_iter']:.1f}", f"{baseline['tps']:,.0f}",
                      f"{baseline['tps'] / ref['tps']:.2f}", "1.00", "", str(baseline["steps"]),
                      f"{baseline['val']:.4f}", f"{baseline['wall']:.1f}", "—", "—")
    for name, r in results:
        reached = next((t for _, t, v in r["evals"] if v <= args.target), None)
        table.add_row(name, f"{r['ms_iter']:.1f}", f"{r['tps']:,.0f}", f"{r['tps'] / ref['tps']:.2f}",
                      f"{r['tps'] / base_tps:.2f}" if base_tps else "", f"{r['mfu']:.1f}", str(r["steps"]), f"{r['val']:.4f}", f"{r['wall']:.1f}",
                      "not reached" if reached is None else f"{reached:.1f}",
                      "—" if reached is None else f"{reached / (ref_reached or ref['wall']):.2f}")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
