"""train.compile's three modes side by side in one run: eager (off), the whole model (model) and each block on its own
(blocks, what true means), on the GPT's CPU recipe (preset=cpu), one process and 2 DDP ranks.

    python benchmarks/compile_modes.py                         # preset=cpu, 60 iterations, fp32, ranks 1 and 2
    python benchmarks/compile_modes.py --iters 100 --runs 1 --extra model.n_embd=32

Prints one table: per run, the compile time (the first iteration's seconds minus the median of the later ones: what
tracing and inductor's code generation add, once), the median tokens/s of the iterations after the first tenth, and
the loss at the last iteration (a compiled run must follow eager's). Each run is `meshtrain train gpt` as a user runs
it (benchmarks/train_runs.py), with the dtype pinned (--dtype, fp32 by default) so that the figures do not depend on
what train.dtype=auto picks here. A run that fails or logs a NaN loss is shown as such: torch 2.13's CPU inductor
has a known bug (pytorch/pytorch#196681) that corrupts the heap or gives NaN at some widths; `--extra
model.n_embd=N` with N = meshtrain.machine.hardware.inductor_safe_width() runs a width it compiles right.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
from pathlib import Path

import torch
from train_runs import markdown, prepared, run_train

from meshtrain.machine.hardware import device_name

MODES = ("off", "model", "blocks")


def measure(ranks: int, mode: str, data_root: Path, iters: int, dtype: str, extra: list[str]) -> dict:
    """One run's figures, or why it has none."""
    overrides = ["preset=cpu", f"data.root={data_root}", f"train.compile={mode}", f"train.dtype={dtype}",
                 f"train.max_iters={iters}", f"train.eval_interval={iters}", "train.eval_iters=1",
                 "train.log_interval=1", *extra]
    try:
        run = run_train("gpt", ranks, overrides, timeout=1800)
    except RuntimeError as failed:
        exit_line = str(failed).splitlines()[0]
        return {"failed": exit_line[exit_line.rfind("(exit"):] if "(exit" in exit_line else "failed"}
    steps = [r for r in run.rows if "dt" in r]
    later = [r["dt"] for r in steps[1:]]
    steady = run.steady(0.1)
    loss = steps[-1]["loss"]
    if not math.isfinite(loss):
        return {"failed": "NaN loss"}
    return {"compile_s": steps[0]["dt"] - statistics.median(later), "tps": statistics.median(r["tps"] for r in steady),
            "ms": 1e3 * statistics.median(r["dt"] for r in steady), "loss": loss, "wall": run.wall}


def table(results: list[tuple[int, str, dict]]) -> str:
    eager = {ranks: r.get("tps") for ranks, mode, r in results if mode == "off"}
    rows = []
    for ranks, mode, r in results:
        name = f"{ranks} {'process' if ranks == 1 else 'DDP ranks'}, train.compile={mode}"
        if "failed" in r:
            rows.append([name, r["failed"], "", "", "", "", ""])
            continue
        speedup = f"{r['tps'] / eager[ranks]:.2f}×" if eager.get(ranks) else ""
        rows.append([name, f"{r['compile_s']:.1f}", f"{r['ms']:.1f}", f"{r['tps']:,.0f}", speedup,
                     f"{r['loss']:.4f}", f"{r['wall']:.0f}"])
    return markdown(["run", "compile s", "ms/iter", "tokens/s", "vs eager", "last loss", "wall s"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="1,2", help="rank counts (default 1,2)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"train.compile values (default {','.join(MODES)})")
    parser.add_argument("--iters", type=int, default=60, help="iterations per run (default 60)")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--extra", nargs="*", default=[], help="more KEY=VALUE overrides for every run")
    args = parser.parse_args()
    os.environ.setdefault("MESHTRAIN_DEVICE", "cpu")  # the CPU recipe, also on a machine with a GPU
    with tempfile.TemporaryDirectory() as tmp:
        data_root = prepared(tmp)
        results = [(ranks, mode, measure(ranks, mode, data_root, args.iters, args.dtype, args.extra))
                   for ranks in map(int, args.runs.split(",")) for mode in args.modes.split(",")]
    print(f"GPT preset=cpu {' '.join(args.extra)}, {args.iters} iterations, train.dtype={args.dtype}, on "
          f"{device_name(torch.device('cpu'))} ({os.cpu_count()} cores)")
    print(table(results))


if __name__ == "__main__":
    main()
