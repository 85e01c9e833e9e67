"""Every parallel layout on the ranks at hand, side by side: speed, memory and traffic per rank.

    python benchmarks/layouts.py --ranks 4                 # each layout in a job of its own (torchrun)
    python benchmarks/layouts.py --ranks 4 --steps 20 --n-layer 8 --n-embd 256 --dtype bf16
    torchrun --nproc-per-node 4 benchmarks/layouts.py --layouts ddp: fsdp:tp=2 ddp:pp=2   # all in one job

Started without a launcher, the script runs every layout as a torchrun job of its own, so that each
one's peak memory is its own (a CPU process's RSS high-water mark never comes back down); under a
launcher (or `meshtrain launch`) it runs the layouts one after another in that one job.

Each layout (`backend:key=value,...` over cfg.parallel, as in the trainer) builds the same GPT through
build_gpt_layout and trains --steps steps of random tokens after --warmup steps, through the layout's own
micro-step, clip and optimizer step (AdamW), exactly as the loop does. Columns, per rank (rank 0's shown;
ranks differ only under pp, where the table shows the largest stage):

    tok/s        tokens per second of the whole job (dp ranks × batch × accum × seq / step time)
    ms/step      median step time
    peak MiB     peak memory: CUDA max allocated, or the process's peak RSS on CPU
    params/grads/optim MiB   bytes this rank holds after a step (shards, not the whole)
    comm Melem/step  millions of elements this rank handed to collectives and point-to-point ops in one
                 step (× 4 for bytes in fp32; bf16 casts halve some), read from the torch profiler's
                 events of the communication backend, where DDP, FSDP, pipeline send/recv and DTensor /
                 functional collectives all show up
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from meshtrain.models.gpt.config import GPTRunConfig
from meshtrain.models.gpt.model import GPT, GPTConfig
from meshtrain.models.gpt.parallelize import build_gpt_layout
from meshtrain.parallel.data_parallel import bytes_held
from meshtrain.parallel.mesh import MeshError, ParallelDims
from meshtrain.runtime.device import synchronize
from meshtrain.runtime.results import record, run_ranks
from meshtrain.runtime.setup import distributed
from meshtrain.train import metrics
from meshtrain.train.optim import build_optimizer

DEFAULT_LAYOUTS = {
    1: ["ddp:"],
    2: ["ddp:", "zero1:", "zero2:", "fsdp:", "fsdp:tp=2", "ddp:pp=2", "ddp:cp=2,cp_impl=ring",
        "ddp:cp=2,cp_impl=ulysses"],
    4: ["ddp:", "zero1:", "zero2:", "fsdp:", "hsdp:dp_replicate=2", "fsdp:tp=4", "fsdp:tp=2",
        "ddp:pp=2,pp_schedule=1f1b", "ddp:pp=4,pp_schedule=1f1b", "ddp:pp=2,pp_schedule=interleaved_1f1b,virtual_stages=2",
        "ddp:tp=2,pp=2", "ddp:cp=2,cp_impl=ring", "fsdp:cp=4,cp_impl=ring", "fsdp:cp=4,cp_impl=ulysses"],
}
INTS = {"tp", "cp", "pp", "dp_replicate", "dp_shard", "microbatches", "virtual_stages"}
BACKEND_EVENTS = ("gloo", "nccl", "xccl", "mpi")


def parse(case: str, dtype: str) -> GPTRunConfig:
    cfg = GPTRunConfig()
    backend, _, options = case.partition(":")
    cfg.train.backend, cfg.train.dtype = backend, dtype
    for item in filter(None, options.split(",")):
        key, value = item.split("=")
        setattr(cfg.parallel, key, int(value) if key in INTS else value)
    return cfg


def comm_elements(prof) -> int:
    """Elements of the tensors this rank handed to the communication backend in a profiled step: the
    backend's own events (gloo:all_reduce, nccl:send, ...) carry their tensors' shapes."""
    total = 0
    for event in prof.events():
        if event.name.split(":")[0] in BACKEND_EVENTS and event.input_shapes:
            total += sum(math.prod(shape) for shape in event.input_shapes if shape)
    return total


def bench(case: str, args, info) -> dict | None:
    cfg = parse(case, args.dtype)
    m = cfg.model
    m.block_size, m.n_layer, m.n_head, m.n_embd, m.batch_size = args.seq, args.n_layer, args.n_head, args.n_embd, args.batch
    try:
        dims = ParallelDims.from_config(cfg, info.world_size, info.local_world_size)
    except MeshError as e:
        if info.is_main:
            print(f"skip {case}: {e}")
        return None
    device = info.torch_device
    torch.manual_seed(0)
    config = GPTConfig(block_size=args.seq, vocab_size=50304 if args.vocab == "gpt2" else 65, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd, dropout=0.0, bias=False)
    mesh = dims.build_mesh(device.type) if info.world_size > 1 else None
    layout = build_gpt_layout(GPT(config).to(device), cfg, dims, mesh, device, info.rank)
    optimizer = build_optimizer(layout.model.configure_optimizer_groups(0.1), device, cfg.train.backend,
                                info.world_size, lr=1e-4)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bf16" else nullcontext()
    scaler, timer = torch.amp.GradScaler(device.type, enabled=False), metrics.StepTimer(device)
    generator = torch.Generator().manual_seed(dims.dp_rank(info.rank))
    times, held, comm = [], None, 0

    def step(profile: bool = False):
        nonlocal held, comm
        context = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
                   if profile else nullcontext())
        with context as prof:
            for micro in range(args.accum):
                batch = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=generator).to(device)
                layout.train_micro_step(batch[:, :-1], batch[:, 1:], accum=args.accum, sync=micro == args.accum - 1,
                                        autocast=autocast, scaler=scaler, timer=timer)
            layout.finish_backward()
            layout.clip_grad_norm(1.0)
            optimizer.step()
        if profile:
            comm = comm_elements(prof)
            held = bytes_held(layout.model, optimizer)
        optimizer.zero_grad(set_to_none=True)

    metrics.reset_peak_memory(device)
    for i in range(args.warmup):
        step(profile=i == 0)
    for _ in range(args.steps):
        synchronize(device)
        started = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - started)
    ms = statistics.median(times) * 1e3
    row = {"layout": case, "mesh": " × ".join(f"{d}{getattr(dims, d)}" for d in dims.mesh_dims),
           "tok/s": dims.dp_size * args.batch * args.accum * args.seq / (ms / 1e3), "ms/step": ms,
           "peak MiB": metrics.peak_memory_bytes(device) / 2**20,
           **{f"{k} MiB": v / 2**20 for k, v in held.items()}, "comm Melem/step": comm / 1e6}
    rows = [None] * info.world_size
    dist.all_gather_object(rows, row)
    return max(rows, key=lambda r: r["params MiB"])  # the fullest rank: under pp, the heaviest stage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="*", default=None)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="sequences per micro-step per data-parallel rank")
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--vocab", choices=("char", "gpt2"), default="char")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--ranks", type=int, default=4, help="ranks per job when the script launches the jobs")
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        return launch_each(args, sys.argv[1:])
    with distributed() as info:
        layouts = args.layouts or DEFAULT_LAYOUTS.get(info.world_size, ["ddp:", "fsdp:"])
        rows = [row for case in layouts if (row := bench(case, args, info)) is not None]
        if info.is_main:
            for row in rows:
                record(row["layout"], **row)  # for launch_each, when it started this job
            print_table(rows, args, f"{info.world_size} ranks on {info.torch_device} ({info.backend})")


def launch_each(args, argv: list[str]) -> None:
    """One torchrun job per layout; their rank-0 rows make one table."""
    layouts = args.layouts or DEFAULT_LAYOUTS.get(args.ranks, ["ddp:", "fsdp:"])
    passed = [a for a in argv if not a.startswith("--layouts") and a not in layouts]
    rows = []
    for case in layouts:
        job = run_ranks(__file__, args.ranks, *passed, "--layouts", case, timeout=3600)
        found = list(job.results.get(0, {}).values())
        if job.returncode or not found:
            print(f"{case}: failed (exit {job.returncode})\n{job.output[-2000:]}", file=sys.stderr)
            continue
        rows += found
        print(f"{case}: {found[0]['tok/s']:,.0f} tok/s", file=sys.stderr, flush=True)
    print_table(rows, args, f"{args.ranks} ranks, one job per layout")


def print_table(rows: list[dict], args, where: str) -> None:
    if not rows:
        return
    print(f"\n{where}, GPT {args.n_layer}L/{args.n_head}H/{args.n_embd}, seq {args.seq}, batch {args.batch}×"
          f"{args.accum} per dp rank, {args.dtype}, median of {args.steps} steps")
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(f"{row[k]:,.1f}" if isinstance(row[k], float) else str(row[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
