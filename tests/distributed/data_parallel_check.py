"""Under torchrun: a data-parallel backend must train exactly like one process on the whole batch.

    python -m torch.distributed.run --nproc-per-node N data_parallel_check.py CASE [CASE ...]

CASE is BACKEND[:OPTION,...], OPTION cpu-offload or ac=full (activation checkpointing), e.g. fsdp:cpu-offload.
One launch runs several cases (starting the processes is the slow part). For each, every rank builds the same
global batch and a single-process reference; the parallel model sees only this rank's share, in ACCUM
micro-steps of which only the last synchronises (the loop's apply_data_parallel + build_optimizer +
gradient_sync). Loss, gradients and parameters are compared after each of STEPS steps; sharded ones (FSDP's
DTensors) are gathered first. Each rank records per case (meshtrain.runtime.results.record) its verdict, the worst
differences and the bytes of parameters, gradients and optimizer state it holds and the whole model's.
"""

import gc
import sys

import torch
import torch.distributed as dist

from meshtrain.models.gpt.model import GPT, GPTConfig
from meshtrain.parallel.checkpointing import apply_activation_checkpointing
from meshtrain.parallel.data_parallel import apply_data_parallel, bytes_held, gradient_sync
from meshtrain.runtime.results import full, record
from meshtrain.runtime.setup import distributed
from meshtrain.train.optim import build_optimizer

ACCUM, MICRO, STEPS, TOL = 2, 3, 3, 1e-5
CONFIG = GPTConfig(block_size=16, vocab_size=65, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True)
_hsdp_mesh = None


def check(case: str, info) -> bool:
    global _hsdp_mesh
    backend, _, options = case.partition(":")
    options = set(filter(None, options.split(",")))
    activation_checkpointing = "full" if "ac=full" in options else "none"
    torch.manual_seed(0)
    reference = GPT(CONFIG)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    apply_activation_checkpointing(model.transformer.h, activation_checkpointing)
    mesh = None
    if backend == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        if _hsdp_mesh is None:  # built once (collective)
            _hsdp_mesh = init_device_mesh("cpu", (2, info.world_size // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        mesh = _hsdp_mesh
    parallel = apply_data_parallel(model, backend, info.torch_device, info.world_size,
                                   blocks=model.transformer.h.values(), mesh=mesh, cpu_offload="cpu-offload" in options)
    # SGD is linear in the gradients; Adam's first steps divide by |g| and would magnify rounding noise in
    # near-zero gradients into differences that say nothing about the parallel layout.
    sgd = dict(optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = build_optimizer(reference.configure_optimizer_groups(0.1), torch.device("cpu"), **sgd)
    opt = build_optimizer(model.configure_optimizer_groups(0.1), info.torch_device, backend, info.world_size, **sgd)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(STEPS):
        batch = torch.randint(0, 65, (info.world_size * ACCUM * MICRO, 17), generator=torch.Generator().manual_seed(step))
        x, y = batch[:, :-1], batch[:, 1:]
        _, ref_loss = reference(x, y)
        ref_loss.backward()
        rows = list(range(info.rank * ACCUM * MICRO, (info.rank + 1) * ACCUM * MICRO))
        loss_sum = torch.zeros(())
        for micro in range(ACCUM):
            mine = rows[micro * MICRO:(micro + 1) * MICRO]
            with gradient_sync(parallel, micro == ACCUM - 1):
                _, micro_loss = parallel(x[mine], y[mine])
                (micro_loss / ACCUM).backward()
            loss_sum += micro_loss.detach() / ACCUM
        dist.all_reduce(loss_sum)
        worst["loss"] = max(worst["loss"], abs(loss_sum.item() / info.world_size - ref_loss.item()))
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            # k_proj.bias has an exactly zero gradient in exact arithmetic (shifting every key alike changes
            # no softmax), so its reference is rounding noise: relative to at least 1e-2, not to the noise.
            scale = q.grad.abs().max().clamp_min(1e-2)
            worst["grad"] = max(worst["grad"], ((full(p.grad).cpu() - q.grad).abs().max() / scale).item())
        ref_opt.step()
        opt.step()
        held, whole = bytes_held(model, opt), bytes_held(reference, ref_opt)  # with gradients and optimizer state
        ref_opt.zero_grad()
        opt.zero_grad()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            worst["param"] = max(worst["param"], (full(p.detach()).cpu() - q.detach()).abs().max().item())
    ok = worst["loss"] < TOL and worst["grad"] < TOL and worst["param"] < TOL
    record(case, equal=ok, worst=worst, held=held, whole=whole)  # worst grad: relative
    return ok


with distributed() as info:
    results = [check(case, info) for case in sys.argv[1:]]
    exit_code = 0 if all(results) else 1
gc.freeze()  # leave without the interpreter's last collections: 0.5 s a rank
sys.exit(exit_code)
