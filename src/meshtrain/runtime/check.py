"""`meshtrain test-dist`: did my distributed set-up work?

Same seed everywhere -> DDP broadcasts rank 0's initial state -> a few iterations on data that
differs per rank -> every rank must end with bit-identical parameters. If gradients were not
averaged across ranks, each rank's own data would pull its copy its own way and the check fails.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from meshtrain.runtime.device import synchronize
from meshtrain.runtime.log import get_logger
from meshtrain.runtime.setup import DistInfo, collective, distributed, reduce_scalar

log = get_logger("test-dist")


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iters", type=_positive, default=10, help="training iterations (default 10)")
    parser.add_argument("--batch-size", type=_positive, default=64, help="samples per rank per iteration (default 64)")
    parser.add_argument("--width", type=_positive, default=256, help="hidden width of the MLP (default 256)")
    parser.add_argument("--seed", type=int, default=0)


def small_model(width: int, inputs: int = 64, outputs: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(inputs, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                         nn.Linear(width, outputs))


def differing_ranks(flats: list[torch.Tensor]) -> list[int]:
    """Ranks whose flattened parameters are not bit-identical to rank 0's."""
    reference = flats[0].view(torch.int32) if flats[0].dtype == torch.float32 else flats[0]
    return [r for r, flat in enumerate(flats)
            if not torch.equal((flat.view(torch.int32) if flat.dtype == torch.float32 else flat), reference)]


def parameter_mismatch(model: nn.Module, timeout: float | None = None) -> list[int]:
    """Gather every rank's parameters and return the ranks that differ from rank 0 (empty: all agree)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    with collective("all_gather of parameters for the final check", timeout):
        dist.all_gather(gathered, flat)
    return differing_ranks([g.cpu() for g in gathered])


def run(args: argparse.Namespace) -> int:
    with distributed(device=args.device, backend=args.backend, timeout=args.timeout) as info:
        # In a function of its own so DDP (which holds the process group) is freed before teardown:
        # a group destroyed while DDP still references it dies at interpreter exit and can abort there.
        return train_and_compare(args, info)


def train_and_compare(args: argparse.Namespace, info: DistInfo) -> int:
    device, world = info.torch_device, info.world_size
    torch.manual_seed(args.seed)
    model = small_model(args.width).to(device)
    teacher = small_model(32).to(device)  # the function to learn; same on every rank (same seed)
    with collective("DDP's broadcast of rank 0's initial parameters", info.timeout_s):
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(args.seed + 1 + info.rank)  # different samples on every rank

    log.info("training %d iterations: %d ranks x %d samples, %s on %s", args.iters, world, args.batch_size,
             info.backend, info.device)
    losses = []
    for it in range(1, args.iters + 1):
        x = torch.randn(args.batch_size, 64, generator=data).to(device)
        with torch.no_grad():
            y = teacher(x)
        t0 = time.perf_counter()
        loss = nn.functional.mse_loss(ddp(x), y)
        synchronize(device)
        t1 = time.perf_counter()
        with collective("DDP's gradient all_reduce in backward()", info.timeout_s):
            loss.backward()
        synchronize(device)
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        t3 = time.perf_counter()
        losses.append(reduce_scalar(loss, "mean", "all_reduce of the loss for logging", info.timeout_s))
        log.info("iter=%d loss=%.6f dt=%.6f dtf=%.6f dtb=%.6f", it, losses[-1], t3 - t0, t1 - t0, t2 - t1)

    bad = parameter_mismatch(model, info.timeout_s)
    if bad:
        log.error(
            "test-dist FAILED: rank(s) %s hold parameters that differ from rank 0's after %d iterations: "
            "gradients were not synchronised", ", ".join(map(str, bad)), args.iters)
        return 1
    log.info("test-dist passed: %d rank(s) on %d node(s) hold bit-identical parameters after %d DDP "
             "iterations (loss %.4f -> %.4f)", world, info.num_nodes, args.iters, losses[0], losses[-1])
    return 0
