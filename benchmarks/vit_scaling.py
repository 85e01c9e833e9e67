"""Data-parallel scaling of the ViT weather model: 1, 2, 4 ... ranks at a fixed batch per rank.

    python benchmarks/vit_scaling.py                        # preset tiny, DDP over 1, 2 and 4 ranks
    python benchmarks/vit_scaling.py --ranks 1 2 4 8 --batch 16 --steps 200 data=/path/to/era5 --preset short

Each rank count trains a fresh run of --steps iterations (DDP, torchrun): the global batch grows with the ranks
and the learning rate follows the square-root rule from the one-rank run (optimizer.base_batch_size = --batch),
as NERSC's bs*_opt configs do. The table gives the global batch and learning rate each run used, its samples/s
(median over the iterations after --warmup), the speed-up and efficiency against one rank, and the validation
loss and u10 RMSE it reached (with the persistence baseline) after the same number of steps. The runs are kept
under --report with a comparison page of them (`meshtrain report`'s).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from train_runs import last_eval, markdown, median_rate, run_train

from meshtrain.report.page import write_report
from meshtrain.report.runs import read_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="more `meshtrain train vit` overrides, e.g. data=DIR")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=8, help="samples per rank per iteration")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3, help="the one-rank learning rate (at --batch)")
    parser.add_argument("--report", default="outputs/reports/vit_scaling", help="where the comparison page goes")
    args = parser.parse_args()
    common = [f"preset={args.preset}", "train.max_epochs=null", f"train.max_iters={args.steps}",
              f"train.eval_interval={args.steps}", "train.log_interval=1", f"data.batch_size={args.batch}",
              "data.global_batch_size=null", f"optimizer.base_batch_size={args.batch}", f"optimizer.lr={args.lr}",
              f"optimizer.min_lr={args.lr / 10}", "train.backend=ddp", *args.overrides]
    table, one, kept = [], None, Path(args.report) / "runs"
    for ranks in args.ranks:
        rows = run_train("vit", ranks, common, keep=kept / f"ddp{ranks}").rows
        rate, final = median_rate(rows, skip=args.warmup), last_eval(rows)
        one = one or rate / ranks
        lr = args.lr * math.sqrt(ranks)
        table.append([ranks, args.batch * ranks, f"{lr:.3g}", f"{rate:.1f}", f"{rate / one:.2f}×",
                      f"{100 * rate / (one * ranks):.0f}%", f"{final['val_loss']:.5f}", f"{final['val_rmse_u10']:.3f}",
                      f"{final['persistence_rmse_u10']:.3f}"])
        print(f"{ranks} rank(s): {rate:.1f} samples/s, val RMSE u10 {final['val_rmse_u10']:.3f}", flush=True)
    device = "CUDA" if torch.cuda.is_available() else "CPU"
    print(f"\nViT DDP scaling, preset {args.preset} {' '.join(args.overrides)}, {args.batch} samples per rank, "
          f"{args.steps} iterations, {device}")
    print(markdown(["ranks", "global batch", "lr (sqrt rule)", "samples/s", "speed-up", "efficiency", "val loss",
                    "val RMSE u10 (m/s)", "persistence (m/s)"], table))
    page = write_report([read_run(kept / f"ddp{ranks}") for ranks in args.ranks], Path(args.report))
    print(f"comparison page: {page}")


if __name__ == "__main__":
    main()
