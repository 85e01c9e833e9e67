"""Under torchrun: context-parallel attention and training must equal one process on the whole sequence.

    python -m torch.distributed.run --nproc-per-node N context_parallel_check.py CASE [CASE ...]

    attn-IMPL-CP          random q, k, v of T=16: the cp ranks' outputs, put back in sequence order, equal causal
                          SDPA on the whole sequence, and so do the gradients of q, k and v (and in bf16, forward and
                          backward, at bf16 tolerance)
    train-IMPL-CP[-ac]    a tiny GPT trained STEPS SGD steps with the sequence split over cp and the rest of the
                          ranks (world / cp) as data parallel, against a single-process reference on the whole
                          global batch; "-ac" wraps every block in activation checkpointing first
    errors                ring refuses dropout, Ulysses refuses a head count cp does not divide

One launch runs several cases (starting the process group is the slow part). The mesh is meshtrain's
ParallelDims(world_size, cp=CP).build_mesh(...); gradients are averaged by DDP over the flattened dp_cp
group (which is the cp group when dp = 1), exactly as the training loop averages them. Every rank records
per case (meshtrain.runtime.results.record) its verdict and worst differences, and exits non-zero if any case differs.
"""

import gc
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from meshtrain.models.gpt.model import GPT, GPTConfig
from meshtrain.parallel.checkpointing import apply_activation_checkpointing
from meshtrain.parallel.context_parallel import (
    ContextParallelError,
    _Ring,
    _RingAttention,
    apply_context_parallel,
    ring_attention,
    sequence_positions,
    shard_sequence,
    ulysses_attention,
)
from meshtrain.parallel.mesh import ParallelDims, submesh
from meshtrain.runtime.results import record
from meshtrain.runtime.setup import distributed

TOL, STEPS, LOCAL_BATCH = 1e-5, 3, 2
KERNELS = {"ulysses": ulysses_attention, "ring": ring_attention}
_meshes: dict[int, tuple] = {}


def mesh_for(info, cp: int):
    """(ParallelDims, mesh) for cp over this job, dp filling the rest; built once per cp size (collective)."""
    if cp not in _meshes:
        dims = ParallelDims(world_size=info.world_size, cp=cp)
        _meshes[cp] = dims, dims.build_mesh(info.torch_device.type)
    return _meshes[cp]


def gather_in_order(local: torch.Tensor, group, positions: list[torch.Tensor], seq_len: int) -> torch.Tensor:
    """Every cp rank's [B, H, T/cp, D] slice, put back at its global positions: [B, H, T, D]."""
    parts = [torch.empty_like(local) for _ in positions]
    dist.all_gather(parts, local.contiguous(), group=group)
    whole = local.new_empty(*local.shape[:2], seq_len, local.shape[3])
    for pos, part in zip(positions, parts, strict=True):
        whole[:, :, pos] = part
    return whole


def check_attention(info, impl: str, cp: int) -> tuple[bool, dict]:
    dims, mesh = mesh_for(info, cp)
    cp_mesh, dev = submesh(mesh, "cp"), info.torch_device
    cp_rank, group = cp_mesh.get_local_rank(), cp_mesh.get_group()
    B, H, T, D = 2, 4, 16, 8
    g = torch.Generator().manual_seed(1)
    q, k, v, dy = (torch.randn(B, H, T, D, generator=g).to(dev) for _ in range(4))

    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = F.scaled_dot_product_attention(*ref_in, is_causal=True)
    (ref_out * dy).sum().backward()

    positions = [sequence_positions(T, r, cp, impl).to(dev) for r in range(cp)]
    mine = positions[cp_rank]
    local_in = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    attend = KERNELS[impl](cp_mesh)
    out = attend(*local_in, 0.0)
    (out * dy[:, :, mine]).sum().backward()

    diffs = {"out": (gather_in_order(out.detach(), group, positions, T) - ref_out).abs().max().item()}
    for name, local, ref in zip("qkv", local_in, ref_in, strict=True):
        diffs[f"d{name}"] = (gather_in_order(local.grad, group, positions, T) - ref.grad).abs().max().item()

    # bf16: the kernels as the model calls them under autocast (on CPU they upcast like the model's own kernel),
    # and for the ring also its bf16 arithmetic itself (what runs on GPUs), forward and backward, against the
    # fp32 results above at bf16 tolerance.
    kernels = {"autocast": attend}
    if impl == "ring":
        ring = _Ring(group)
        kernels["bf16 math"] = lambda q, k, v, p: _RingAttention.apply(q, k, v, ring, True)
    bf16 = {}
    for name, kernel in kernels.items():
        low_in = [t.detach().bfloat16().requires_grad_() for t in local_in]
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            low = kernel(*low_in, 0.0)
        (low.float() * dy[:, :, mine]).sum().backward()
        if low.dtype != torch.bfloat16:
            return False, {"worst": diffs, "problems": f"{name}: bf16 in, {low.dtype} out"}
        pairs = [(low, ref_out[:, :, mine])] + [(t.grad, r.grad[:, :, mine]) for t, r in zip(low_in, ref_in, strict=True)]
        bf16[name] = max(((a.float() - b).abs().max() / b.abs().max()).item() for a, b in pairs)
    ok = max(diffs.values()) < TOL and max(bf16.values()) < 2e-2
    return ok, {"worst": diffs | {f"bf16 {k} (relative)": v for k, v in bf16.items()}}


def check_training(info, impl: str, cp: int, ac: bool) -> tuple[bool, dict]:
    dims, mesh = mesh_for(info, cp)
    cp_mesh, dp_cp_mesh, dev = submesh(mesh, "cp"), submesh(mesh, "dp_cp"), info.torch_device
    cp_rank, dp_rank = cp_mesh.get_local_rank(), dims.dp_rank(info.rank)
    config = GPTConfig(block_size=16, vocab_size=65, n_layer=2, n_head=4, n_embd=32, dropout=0.0, bias=True)
    torch.manual_seed(0)
    reference = GPT(config).to(dev)
    torch.manual_seed(0)
    model = GPT(config).to(dev)
    if ac:  # CP after AC: apply_context_parallel must find attention under the checkpoint wrapper
        apply_activation_checkpointing(model.transformer.h, "full")
    apply_context_parallel(model.transformer.h.values(), cp_mesh, impl, config.n_head)
    # DDP over dp_cp averages every rank's gradient of its own mean loss: the gradient of the global mean,
    # since all ranks hold equally many tokens. (dp_cp is the cp group itself when dp = 1.)
    dp_cp_group = dp_cp_mesh.get_group()
    parallel = DistributedDataParallel(model, process_group=dp_cp_group)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(STEPS):
        batch = torch.randint(0, 65, (dims.dp_size * LOCAL_BATCH, 17), generator=torch.Generator().manual_seed(step))
        x, y = batch[:, :-1].to(dev), batch[:, 1:].to(dev)
        _, ref_loss = reference(x, y)
        ref_loss.backward()
        rows = slice(dp_rank * LOCAL_BATCH, (dp_rank + 1) * LOCAL_BATCH)
        x_local, y_local, positions = shard_sequence(x[rows], y[rows], cp_rank, cp, impl)
        _, loss = parallel(x_local, y_local, positions)
        loss.backward()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=dp_cp_group)  # SUM (gloo has no AVG); equal token counts -> the mean
        worst["loss"] = max(worst["loss"], abs(mean_loss.item() / dist.get_world_size(dp_cp_group) - ref_loss.item()))
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            # Relative, as some gradients are ~1e-4; but the floor matters: k_proj.bias's gradient is exactly 0 in
            # exact arithmetic (shifting every key alike changes no softmax), so its reference is rounding noise.
            scale = q.grad.abs().max().clamp_min(1e-4)
            worst["grad"] = max(worst["grad"], ((p.grad - q.grad).abs().max() / scale).item())
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            worst["param"] = max(worst["param"], (p.detach() - q.detach()).abs().max().item())
    ok = max(worst.values()) < TOL
    return ok, {"worst": worst, "dp": dims.dp_size, "cp": cp}  # grad: relative


def check_errors(info) -> tuple[bool, dict]:
    _, mesh = mesh_for(info, 2)
    cp_mesh = submesh(mesh, "cp")
    q = torch.zeros(1, 4, 8, 8, device=info.torch_device)
    problems = []
    for what, call, needle in [
        ("ring dropout", lambda: ring_attention(cp_mesh)(q, q, q, 0.1), "dropout_p=0.1"),
        ("ulysses 3 heads", lambda: ulysses_attention(cp_mesh)(q[:, :3], q[:, :3], q[:, :3], 0.0), "3 heads"),
    ]:
        try:
            call()
            problems.append(f"{what}: no error")
        except ContextParallelError as e:
            if needle not in str(e):
                problems.append(f"{what}: message lacks {needle!r}: {e}")
    return not problems, {"problems": problems}


def run_case(info, case: str) -> tuple[bool, dict]:
    kind, *rest = case.split("-")
    if kind == "attn":
        return check_attention(info, rest[0], int(rest[1]))
    if kind == "train":
        return check_training(info, rest[0], int(rest[1]), ac=rest[2:] == ["ac"])
    if kind == "errors":
        return check_errors(info)
    raise SystemExit(f"unknown case {case!r}")


with distributed() as info:
    failed = 0
    for case in sys.argv[1:]:
        ok, fields = run_case(info, case)
        failed += not ok
        record(case, equal=ok, **fields)
    exit_code = 1 if failed else 0
gc.freeze()  # leave without the interpreter's last collections: 0.5 s a rank
sys.exit(exit_code)
