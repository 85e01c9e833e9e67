"""NERSC's single-device optimisation ladder for the ViT weather model, on whatever device is here.

    python benchmarks/vit_ladder.py                                  # preset tiny on the synthetic ERA5
    python benchmarks/vit_ladder.py --preset short data=/path/to/era5 --workers 8    # NERSC's rungs on real data

Each rung adds one flag to the one before and trains a fresh run of --steps iterations as its own process:

    baseline   fp32, loader in the training process, AdamW's for-each kernel, eager
    workers    data.num_workers=--workers (NERSC's num_data_workers): reading and normalising move off the step
    DALI       data.loader=dali, where NVIDIA DALI is installed: its pipeline reads, batches and copies to the GPU
    AMP        train.dtype=bf16 (--amp fp16 on a GPU: NERSC's A100 rung, with a GradScaler)
    fused      optimizer.fused=true (NERSC's enable_fused)
    compile    train.compile=true (NERSC's enable_jit)
    CUDA graphs train.cuda_graphs=true (GPU only: compile's reduce-overhead mode)

samples/s is the median over the iterations after --warmup (compilation happens in those); the step time
includes waiting for data, which is what the workers rung removes. NERSC's A100 figures for `short` are
8.8 (baseline) -> 12.5 (4 workers) -> 13.2 (DALI) -> ~54 (AMP) -> ~55 samples/s (fused + compile).
"""

from __future__ import annotations

import argparse

import torch
from train_runs import markdown, median_rate, run_train

from meshtrain.data.era5_dali import dali_available


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="more `meshtrain train vit` overrides, e.g. data=DIR")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=30, help="iterations per rung")
    parser.add_argument("--warmup", type=int, default=10, help="iterations left out of the median")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--amp", choices=("bf16", "fp16"), default="bf16")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    rungs = [("baseline", ["train.dtype=fp32", "data.num_workers=0", "optimizer.fused=false", "train.compile=false"]),
             ("+ workers", [f"data.num_workers={args.workers}"]),
             *([("+ DALI", ["data.loader=dali"])] if dali_available() else []),
             (f"+ AMP ({args.amp})", [f"train.dtype={args.amp}"]),
             ("+ fused Adam", ["optimizer.fused=true"]),
             ("+ compile", ["train.compile=true"])]
    if cuda:
        rungs.append(("+ CUDA graphs", ["train.cuda_graphs=true"]))
    common = [f"preset={args.preset}", "train.max_epochs=null", f"train.max_iters={args.steps}",
              f"train.eval_interval={args.steps}", "train.eval_iters=1", "train.log_interval=1", *args.overrides]
    flags, table, baseline = [], [], None
    for name, added in rungs:
        flags += added
        rate = median_rate(run_train("vit", 1, [*common, *flags]).rows, skip=args.warmup)
        baseline = baseline or rate
        table.append([name, " ".join(added), f"{rate:.1f}", f"{rate / baseline:.2f}×"])
        print(f"{name}: {rate:.1f} samples/s", flush=True)
    device = torch.cuda.get_device_name() if cuda else f"CPU ({torch.get_num_threads()} threads)"
    print(f"\nViT ladder, preset {args.preset} {' '.join(args.overrides)}, one {device}, median of iterations "
          f"{args.warmup + 1}..{args.steps}")
    print(markdown(["rung", "flag", "samples/s", "vs baseline"], table))


if __name__ == "__main__":
    main()
