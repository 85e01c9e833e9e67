"""Did the distributed set-up work? The check behind `meshtrain test-dist`.

Same seed everywhere -> DDP broadcasts rank 0's initial state -> a few iterations on data that
differs per rank -> every rank must end with bit-identical parameters. If gradients were not
averaged across ranks, each rank's own data would pull its copy its own way and the check fails.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from meshtrain.runtime.device import synchronize
from meshtrain.runtime.log import get_logger
from meshtrain.runtime.setup import DistInfo, collective, reduce_scalar

log = get_logger("test-dist")


@dataclass(frozen=True)
class Outcome:
    """What `train_and_compare` found."""

    losses: list[float]  # the loss of each iteration, averaged over ranks
    differing: list[int]  # ranks whose parameters ended unlike rank 0's: empty when the check passed


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


def train_and_compare(info: DistInfo, *, iters: int = 10, batch_size: int = 64, width: int = 256,
                      seed: int = 0) -> Outcome:
    """Train a small MLP with DDP for `iters` iterations of `batch_size` samples per rank, then compare every
    rank's parameters with rank 0's. Call it inside `distributed()`; DDP, which holds the process group, lives
    only in here, so it is freed before teardown (a group destroyed while DDP still references it dies at
    interpreter exit and can abort there)."""
    device, world = info.torch_device, info.world_size
    torch.manual_seed(seed)
    model = small_model(width).to(device)
    teacher = small_model(32).to(device)  # the function to learn; same on every rank (same seed)
    with collective("DDP's broadcast of rank 0's initial parameters", info.timeout_s):
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(seed + 1 + info.rank)  # different samples on every rank

    log.info("training %d iterations: %d ranks x %d samples, %s on %s", iters, world, batch_size,
             info.backend, info.device)
    losses = []
    for it in range(1, iters + 1):
        x = torch.randn(batch_size, 64, generator=data).to(device)
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

    return Outcome(losses, parameter_mismatch(model, info.timeout_s))
