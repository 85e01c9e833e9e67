"""GPT-2 124M (block 1024) on BPE Shakespeare on one GPU: tokens/s, MFU and memory per training feature.

    python benchmarks/gpt2_gpu_features.py                       # every row, 30 iterations each
    python benchmarks/gpt2_gpu_features.py --rows bf16+compile,fp16 --iters 50
    python benchmarks/gpt2_gpu_features.py --rows bf16+compile --profile     # and the kernels of one iteration

Each row is a fresh `meshtrain train gpt preset=gpt2` process with batch 12 x accumulation --accum, changing one
thing against the first row: bf16 + compile of each block (the goal: MFU >= 50% on an H100), the whole model
compiled as one graph, the same tokens in fewer and larger micro-batches (no gradient accumulation to add up, fewer
launches per token), the loss in chunks (train.loss_chunks: no whole fp32 logits; every row without it says off, as
measured), batch 8 with and without it, op-level and every-other-block activation checkpointing, float8 linears
(torchao, tensorwise and rowwise scales; `--iters 200 --accum 1` compares their loss with bf16's), eager, fp16 with a GradScaler,
activation checkpointing of every block, FSDP2 with parameters and optimizer state in pinned host memory
(one NCCL rank under torchrun), and checkpoints every 5 iterations written synchronously or in the background.

tokens/s and MFU (against the run's own peak: the datasheet's, for a GPU in the table) are medians over the
logged iterations after the first third (compilation happens in those; a logged iteration synchronises the GPU
around its sections, the others do not); val loss is the evaluation after the last iteration; memory is the CUDA allocator's high
watermark (max_memory_allocated); data wait is the median share of an iteration the slowest rank spent taking its
batches. For the checkpoint rows, "train s" is the wall time from the first to the last
logged iteration, which a synchronous save stalls and a background one should not.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from train_runs import prepared, run_train

ROWS = {
    "bf16+compile": ["train.dtype=bf16", "train.compile=true"],
    "micro 24 × 2": ["train.dtype=bf16", "train.compile=true", "model.batch_size=24", "train.grad_accum=2"],
    "micro 48 × 1": ["train.dtype=bf16", "train.compile=true", "model.batch_size=48", "train.grad_accum=1"],
    "micro 48 × 1 + loss in chunks": ["train.dtype=bf16", "train.compile=true", "model.batch_size=48",
                                      "train.grad_accum=1", "train.loss_chunks=8192"],
    "compile whole model": ["train.dtype=bf16", "train.compile=model"],
    "loss in chunks (auto)": ["train.dtype=bf16", "train.compile=true", "train.loss_chunks=auto"],
    "loss in chunks 1024": ["train.dtype=bf16", "train.compile=true", "train.loss_chunks=1024"],
    "loss in chunks 2048": ["train.dtype=bf16", "train.compile=true", "train.loss_chunks=2048"],
    "loss in chunks 4096": ["train.dtype=bf16", "train.compile=true", "train.loss_chunks=4096"],
    "loss in chunks 12288": ["train.dtype=bf16", "train.compile=true", "train.loss_chunks=12288"],
    "whole model + loss in chunks (auto)": ["train.dtype=bf16", "train.compile=model", "train.loss_chunks=auto"],
    "batch 8 × 1": ["train.dtype=bf16", "train.compile=true", "model.batch_size=8", "train.grad_accum=1"],
    "batch 8 × 1 + loss in chunks (auto)": ["train.dtype=bf16", "train.compile=true", "model.batch_size=8",
                                            "train.grad_accum=1", "train.loss_chunks=auto"],
    "AC op": ["train.dtype=bf16", "train.compile=true", "train.activation_checkpointing=op"],
    "AC selective": ["train.dtype=bf16", "train.compile=true", "train.activation_checkpointing=selective"],
    "float8 tensorwise": ["train.dtype=bf16", "train.compile=true", "train.float8=tensorwise"],
    "float8 rowwise": ["train.dtype=bf16", "train.compile=true", "train.float8=rowwise"],
    "bf16 eager": ["train.dtype=bf16"],
    "bf16 eager + loss in chunks (auto)": ["train.dtype=bf16", "train.loss_chunks=auto"],
    "bf16 eager + AC op": ["train.dtype=bf16", "train.activation_checkpointing=op"],
    "bf16 eager + AC full": ["train.dtype=bf16", "train.activation_checkpointing=full"],
    "fp32 eager": ["train.dtype=fp32"],
    "compile whole model + epoch order": ["train.dtype=bf16", "train.compile=model", "data.order=epoch"],
    "fp16+scaler+compile": ["train.dtype=fp16", "train.compile=true"],
    "bf16+compile+AC full": ["train.dtype=bf16", "train.compile=true", "train.activation_checkpointing=full"],
    "FSDP2 cpu offload (bf16)": ["train.dtype=bf16", "train.backend=fsdp", "parallel.cpu_offload=true"],
    "sync checkpoint /5 it": ["train.dtype=bf16", "train.compile=true", "train.save_checkpoints=true",
                              "train.eval_interval=5"],
    "async checkpoint /5 it": ["train.dtype=bf16", "train.compile=true", "train.save_checkpoints=true",
                               "train.eval_interval=5", "train.async_checkpoint=true"],
}


# Kernel families by name, first match wins: what a profile of one iteration is made of.
FAMILIES = [("GEMM (cuBLAS/CUTLASS)", re.compile(r"gemm|nvjet|xmma|cutlass|cublas", re.I)),
            ("attention", re.compile(r"flash|fmha|cudnn|attention|sdpa", re.I)),
            ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
            ("collectives", re.compile(r"nccl", re.I)),
            ("inductor (fused by compile)", re.compile(r"^triton_", re.I)),
            ("other", re.compile(""))]


def kernel_profile(trace_path: Path, top: int = 12) -> dict:
    """One profiled iteration's GPU kernels (a torch.profiler Chrome trace): each family's and the top kernels'
    share of the kernel time, and the kernel time against the iteration's wall time (the rest: the GPU idle)."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    busy = sum(e["dur"] for e in kernels)
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e["name"]] = by_name.get(e["name"], 0.0) + e["dur"]
    families: dict[str, float] = {}
    for name, dur in by_name.items():
        family = next(f for f, pattern in FAMILIES if pattern.search(name))
        families[family] = families.get(family, 0.0) + dur
    wall = max((e["dur"] for e in events if str(e.get("name", "")).startswith("iteration ")), default=float("nan"))
    return {"kernel_ms": busy / 1e3, "iteration_ms": wall / 1e3, "kernels": len(kernels),
            "families": {f: d / busy for f, d in sorted(families.items(), key=lambda kv: -kv[1])},
            "top": [(name[:90], d / busy) for name, d in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]]}


def run(name: str, overrides: list[str], data_root: Path | str, iters: int, accum: int, profile: bool = False) -> dict:
    # the profiled iteration is the last but one: compiled and warm, and its own slower time is one logged row
    traced = ["train.profile=torch", f"train.profile_start={iters - 2}", "train.profile_steps=1"] if profile else []
    kept = Path(tempfile.mkdtemp(prefix="gpt2-profiled-")) if profile else None
    try:  # FSDP2 wraps one rank only inside a process group: under torchrun
        run = run_train("gpt", 1, ["preset=gpt2", f"data.root={data_root}", f"train.max_iters={iters}",
                                   f"train.grad_accum={accum}", f"train.log_interval={max(1, min(5, iters // 10))}",
                                   f"train.eval_interval={iters}", "train.eval_iters=5", "optimizer.warmup_iters=10",
                                   "train.sample_tokens=16", "train.loss_chunks=off", *overrides, *traced],
                        torchrun="train.backend=fsdp" in overrides, keep=kept)
    except RuntimeError as failure:
        return {"name": name, "error": str(failure)[-1500:]}
    steps, steady = run.steady(0), run.steady(1 / 3)
    return {"name": name, "tps": statistics.median(r["tps"] for r in steady),
            "mfu": statistics.median(r["mfu"] for r in steady), "mem": max(r["mem_gb"] for r in steps),
            "ms": statistics.median(r["dt"] for r in steady) * 1e3, "train_s": steps[-1]["time"] - steps[0]["time"],
            "loss": steps[-1]["loss"], "val": run.evals()[-1]["val_loss"],
            "data": statistics.median(r["ranks"]["data"]["max"] / r["dt"] for r in steady) * 100,
            **({"profile": kernel_profile(kept / "profile" / "trace_rank0.json")} if profile else {})}


def print_profile(row: dict) -> None:
    p = row["profile"]
    print(f"\nProfile of one iteration of `{row['name']}`: {p['kernels']} kernels, {p['kernel_ms']:.1f} ms of GPU "
          f"kernel time in a {p['iteration_ms']:.1f} ms iteration (profiled)")
    print("| kernel family | share of kernel time |\n|---|---|")
    for family, share in p["families"].items():
        print(f"| {family} | {share:.1%} |")
    print("| top kernel | share |\n|---|---|")
    for name, share in p["top"]:
        print(f"| `{name}` | {share:.1%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of: {', '.join(ROWS)}")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--accum", type=int, default=4, help="micro-steps of 12 x 1024 tokens per iteration")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for every row, after the row's own (data.root=DIR data.name=NAME: a corpus "
                        "from `meshtrain prepare text`; without data.root, BPE Shakespeare prepared afresh)")
    parser.add_argument("--profile", action="store_true", help="trace one iteration of the first row (torch "
                        "profiler) and print its kernels' shares")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("this benchmark is for a GPU: GPT-2 124M at block 1024 takes hours per iteration batch on a CPU")
    names = args.rows.split(",")
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        sys.exit(f"unknown row(s) {unknown}: choose from {', '.join(ROWS)}")
    given = next((s.split("=", 1)[1] for s in args.set if s.startswith("data.root=")), None)
    with tempfile.TemporaryDirectory(prefix="gpt2-data-") as tmp:
        data_root = given or prepared(tmp, "shakespeare")
        results = []
        for i, name in enumerate(names):
            results.append(run(name, ROWS[name] + args.set, data_root, args.iters, args.accum, args.profile and i == 0))
            print(json.dumps(results[-1]), flush=True)
    print(f"\nGPT-2 124M, block 1024, batch 12 x accumulation {args.accum}, {args.iters} iterations, one "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}{', ' + ' '.join(args.set) if args.set else ''}")
    print("| row | ms/iter | tokens/s | × first | MFU | max memory allocated | data wait | train s | last loss | val loss |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    first = next((r for r in results if "tps" in r), None)
    for r in results:
        if "error" in r:
            print(f"| {r['name']} | failed: {r['error'].splitlines()[-1]} |||||||||")
            continue
        print(f"| {r['name']} | {r['ms']:.1f} | {r['tps']:,.0f} | {r['tps'] / first['tps']:.2f}× | {r['mfu']:.1f}% | "
              f"{r['mem']:.2f} GiB | {r['data']:.2f}% | {r['train_s']:.1f} | {r['loss']:.3f} | {r['val']:.4f} |")
    for r in results:
        if "profile" in r:
            print_profile(r)


if __name__ == "__main__":
    main()
