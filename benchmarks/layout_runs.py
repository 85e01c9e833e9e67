"""The trainer itself under several layouts, side by side, with a comparison page of the runs.

    python benchmarks/layout_runs.py                                  # 4 ranks: ddp, fsdp, fsdp × tp2, ddp × pp2
    python benchmarks/layout_runs.py --ranks 2 --steps 300 --layout "train.backend=zero2" --layout "parallel.tp=2"

Unlike benchmarks/layouts.py (the layouts' step alone, on random tokens), each layout here is a whole
`meshtrain train gpt` job under torchrun: real data, evaluation, samples, the per-rank timings. The runs are kept
under --report with `meshtrain report`'s comparison page of them (curves overlaid, a table of totals), and the
table below is read from what each run logged.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from train_runs import markdown, run_train

from meshtrain.report.page import write_report
from meshtrain.report.runs import read_run

LAYOUTS = {"ddp": "train.backend=ddp", "fsdp": "train.backend=fsdp", "fsdp-tp2": "train.backend=fsdp parallel.tp=2",
           "ddp-pp2": "train.backend=ddp parallel.pp=2 parallel.pp_schedule=1f1b"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="more `meshtrain train gpt` overrides")
    parser.add_argument("--preset", default="cpu_fast")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layout", action="append", help="overrides of one layout (repeat); default: "
                        + ", ".join(LAYOUTS))
    parser.add_argument("--report", default="outputs/reports/layout_runs", help="where the runs and page go")
    args = parser.parse_args()
    layouts = {f"layout{i}": spec for i, spec in enumerate(args.layout)} if args.layout else LAYOUTS
    common = [f"preset={args.preset}", f"train.max_iters={args.steps}", f"train.eval_interval={args.steps // 2}",
              *args.overrides]
    kept, table = Path(args.report) / "runs", []
    for name, spec in layouts.items():
        run_train("gpt", args.ranks, [*common, *spec.split()], keep=kept / name)
        run = read_run(kept / name)
        steady = run.steps[len(run.steps) // 5:] or run.steps  # past warm-up
        table.append([name, run.facts.get("layout", spec), round(steady[-1]["sps"] * steady[-1]["dt"]),
                      f"{statistics.median(r['tps'] for r in steady):.0f}",
                      f"{statistics.median(r['dt'] for r in steady) * 1000:.1f}",
                      f"{statistics.median(r['mfu'] for r in steady):.3f}",
                      f"{max(r['mem_gb'] for r in run.steps):.3f}", f"{run.best_val:.4f}",
                      f"{run.wall_s:.0f}"])
        print(f"{name}: {table[-1][3]} tokens/s, best val loss {table[-1][7]}", flush=True)
    print(f"\nGPT preset {args.preset} {' '.join(args.overrides)}, {args.ranks} ranks, {args.steps} iterations each")
    print(markdown(["run", "layout", "samples/iteration", "tokens/s", "ms/step", "MFU %", "peak memory GiB (rank 0)",
                    "best val loss", "wall s"], table))
    page = write_report([read_run(kept / name) for name in layouts], Path(args.report))
    print(f"comparison page: {page}")


if __name__ == "__main__":
    main()
