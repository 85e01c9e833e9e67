"""Under torchrun: the ViT under tensor and context (token) parallelism trains exactly like one process.

    python -m torch.distributed.run --nproc-per-node N vit_parallel_check.py CASE [CASE ...]

    attn-IMPL      random q, k, v of N=32 tokens split over cp = N ranks: the gathered output of the non-causal
                   CP kernel and the gradients of q, k, v equal SDPA(is_causal=False) on the whole sequence
    tp, tp-sp      tensor parallel over all ranks (tp-sp: with sequence parallel)
    fsdp-tp        FSDP2 over dp = world/2 on top of tp = 2 (fully_shard on the dp submesh, after TP)
    cp-IMPL        context parallel over cp = 2, dp = world/2 (DDP over the flattened dp_cp mesh)
    tp-cp-IMPL     tp = 2 × cp = 2 (4 ranks), FSDP2 over the flattened dp_shard_cp mesh (= cp here) averaging
                   the gradients over the cp ranks
    errors         clear errors: heads tp does not divide, tokens cp does not divide, Ulysses heads, ring dropout,
                   relative-L2 loss under CP

Each training case builds a single-process reference from the same seed, trains STEPS SGD steps (lr 0.1, momentum
0.9) on the same global batch of random [B, C, H, W] fields, and compares loss, every gradient (gathered, relative to
max(|ref|, 1e-2)), the gradient norm and every parameter, within 1e-5. CP cases also gather the prediction of the
whole image (gather_tokens) after training and compare it with the reference's. Every rank records per case
(meshtrain.runtime.results.record) its verdict and worst differences, and exits non-zero if any differs.
"""

import gc
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

from meshtrain.models.vit.model import ViT, ViTConfig
from meshtrain.models.vit.parallelize import (
    apply_vit_tensor_parallel,
    cp_forward_loss,
    cp_forward_patches,
    gather_tokens,
    token_band,
)
from meshtrain.nn.transformer import full_attention
from meshtrain.parallel.context_parallel import (
    ContextParallelError,
    apply_context_parallel,
    ring_attention,
    ulysses_attention,
)
from meshtrain.parallel.data_parallel import apply_data_parallel
from meshtrain.parallel.mesh import ParallelDims, submesh
from meshtrain.runtime.results import full, record
from meshtrain.runtime.setup import distributed

TOL, STEPS, LOCAL_BATCH = 1e-5, 3, 2
CONFIG = ViTConfig(img_size=(16, 32), patch_size=4, in_channels=3, out_channels=3, embed_dim=32, depth=2,
                   num_heads=4)  # 4 x 8 = 32 tokens
KERNELS = {"ulysses": lambda cp_mesh: ulysses_attention(cp_mesh, full_attention),  # the ViT's: non-causal
           "ring": lambda cp_mesh: ring_attention(cp_mesh, full_attention, causal=False)}
_meshes: dict[tuple[int, int], tuple] = {}


def mesh_for(info, tp: int = 1, cp: int = 1):
    """(ParallelDims, mesh) with dp filling the rest; built once per (tp, cp) (collective: same order everywhere)."""
    if (tp, cp) not in _meshes:
        dims = ParallelDims(world_size=info.world_size, tp=tp, cp=cp)
        _meshes[tp, cp] = dims, dims.build_mesh("cpu")
    return _meshes[tp, cp]


def check_attention(info, impl: str) -> tuple[bool, dict]:
    cp = info.world_size
    _, mesh = mesh_for(info, cp=cp)
    cp_mesh = submesh(mesh, "cp")
    B, H, N, D = 2, 4, 32, 8
    g = torch.Generator().manual_seed(1)
    q, k, v, dy = (torch.randn(B, H, N, D, generator=g) for _ in range(4))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = F.scaled_dot_product_attention(*ref_in, is_causal=False)
    (ref_out * dy).sum().backward()

    mine = token_band(N, cp_mesh.get_local_rank(), cp)
    local_in = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    out = KERNELS[impl](cp_mesh)(*local_in, 0.0)
    (out * dy[:, :, mine]).sum().backward()
    pairs = {"out": (out.detach(), ref_out)} | {f"d{n}": (t.grad, r.grad) for n, t, r in zip("qkv", local_in, ref_in,
                                                                                           strict=True)}
    # gather_tokens gathers dim 1; attention tensors hold tokens in dim 2
    diffs = {name: (gather_tokens(mine_.transpose(1, 2), cp_mesh).transpose(1, 2) - ref).abs().max().item()
             for name, (mine_, ref) in pairs.items()}
    return max(diffs.values()) < TOL, {"worst": diffs}


def check_training(info, *, tp: int = 1, cp: int = 1, impl: str = "ulysses", sp: bool = False,
                   fsdp: bool = False) -> tuple[bool, dict]:
    dims, mesh = mesh_for(info, tp=tp, cp=cp)
    tp_mesh, cp_mesh, dp_mesh = submesh(mesh, "tp"), submesh(mesh, "cp"), submesh(mesh, "dp")
    dp_cp_mesh, dp_shard_cp_mesh = submesh(mesh, "dp_cp"), submesh(mesh, "dp_shard_cp")
    coords, dp_rank = dims.coords(info.rank), dims.dp_rank(info.rank)
    torch.manual_seed(0)
    reference = ViT(CONFIG)
    torch.manual_seed(0)
    model = ViT(CONFIG)
    apply_vit_tensor_parallel(model, tp_mesh, sequence_parallel=sp)
    if cp > 1:
        apply_context_parallel(model.blocks.values(), cp_mesh, impl)
    layout = check_layout(model, tp, cp, sp)
    if layout:
        return False, {"problems": layout}
    parallel = model
    if fsdp:  # over dp (fsdp-tp) or over dp_shard x cp (tp-cp): cp ranks' gradients are averaged like dp ranks'
        shard_mesh = dp_shard_cp_mesh if cp > 1 else dp_mesh
        apply_data_parallel(model, "fsdp", info.torch_device, shard_mesh.size(), blocks=model.blocks.values(),
                            mesh=shard_mesh)
    elif dp_cp_mesh is not None:  # DDP averages every rank's gradient of its own mean loss
        parallel = DistributedDataParallel(model, process_group=dp_cp_mesh.get_group())
    positions = token_band(CONFIG.num_patches, coords["cp"], cp)
    rows = slice(dp_rank * LOCAL_BATCH, (dp_rank + 1) * LOCAL_BATCH)  # tp and cp ranks of a replica: same rows
    worst, x = train_and_compare(model, parallel, reference, dims.dp_size, rows, positions, cp, dp_cp_mesh)
    if cp > 1:  # evaluation: the whole prediction, gathered from the ranks' token slices
        with torch.no_grad():
            local = cp_forward_patches(parallel, x[rows], positions)
            whole = model.unpatchify(gather_tokens(local, cp_mesh))
            worst["predict"] = (whole - reference(x[rows])).abs().max().item()
    shape = f"dp={dims.dp_size} tp={tp} cp={cp}" + (f" {impl}" if cp > 1 else "") + (" sp" if sp else "")
    return max(worst.values()) < TOL, {"worst": worst, "shape": shape}  # grad and norm: relative


def train_and_compare(model: ViT, parallel, reference: ViT, dp_size: int, rows: slice, positions, cp: int,
                      dp_cp_mesh) -> tuple[dict, torch.Tensor]:
    """STEPS SGD steps of the parallel model (through `parallel`, its DDP wrapper or itself) and the reference on
    the same global batches; the worst differences of loss, gradient and norm (both relative) and parameters, and
    the last step's inputs."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    worst = dict.fromkeys(("loss", "grad", "norm", "param"), 0.0)
    for step in range(STEPS):
        x, y = random_fields(step, dp_size * LOCAL_BATCH)
        ref_loss = reference.loss(reference(x), y)
        ref_loss.backward()
        if cp > 1:
            loss = cp_forward_loss(parallel, x[rows], y[rows], positions)
        else:
            loss = model.loss(parallel(x[rows]), y[rows])
        loss.backward()
        assert type(loss) is torch.Tensor, f"the loss is a plain tensor, got {type(loss)}"
        worst["loss"] = max(worst["loss"], abs(mean_over_ranks(loss, dp_cp_mesh) - ref_loss.item()))
        worst["grad"] = max(worst["grad"], worst_relative_grad(model, reference))
        # What the loop's clipping sees: the global norm over every shard and mesh, the same on every rank.
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        worst["norm"] = max(worst["norm"], abs(full(norm).item() - ref_norm.item()) / ref_norm.item())
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            worst["param"] = max(worst["param"], (full(p.detach()) - q.detach()).abs().max().item())
    return worst, x


def random_fields(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of step `step`: random [batch, C, H, W] fields, the same on every rank."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch, CONFIG.in_channels, *CONFIG.img_size, generator=g)
    y = torch.randn(batch, CONFIG.out_channels, *CONFIG.img_size, generator=g)
    return x, y


def mean_over_ranks(loss: torch.Tensor, dp_cp_mesh) -> float:
    """The loss averaged over the data- and context-parallel ranks: what the reference computes on the whole batch."""
    mean_loss = loss.detach().clone()
    if dp_cp_mesh is not None:  # SUM (gloo has no AVG); equal token and row counts -> the mean
        dist.all_reduce(mean_loss, group=dp_cp_mesh.get_group())
        mean_loss /= dp_cp_mesh.size()
    return mean_loss.item()


def worst_relative_grad(model: ViT, reference: ViT) -> float:
    """The largest gradient difference, parallel (gathered) vs reference, relative to each gradient's size."""
    worst = 0.0
    for (name, p), (ref_name, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert name == ref_name, (name, ref_name)
        # k_proj.bias's gradient is 0 in exact arithmetic (a shift shared by all keys changes no softmax): its
        # reference is rounding noise, hence the 1e-2 floor.
        scale = q.grad.abs().max().clamp_min(1e-2)
        worst = max(worst, ((full(p.grad) - q.grad).abs().max() / scale).item())
    return worst


def check_layout(model: ViT, tp: int, cp: int, sp: bool) -> str:
    """What was promised is what the model holds: whole heads per tp rank, DTensors everywhere, CP kernels swapped
    in, the stream token-sharded under sequence parallel. Returns the problems, empty if none."""
    problems = []
    attn = model.blocks["0"].attn
    if tp > 1:
        q = attn.q_proj.weight.to_local()
        if q.shape[0] != CONFIG.embed_dim // tp:
            problems.append(f"q_proj holds {q.shape[0]} output rows, not {CONFIG.embed_dim // tp}")
        plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
        if plain:
            problems.append(f"plain (not DTensor) parameters under TP: {plain}")
    if (attn.attend is full_attention) == (cp > 1):
        problems.append(f"block attention kernel is {attn.attend} with cp={cp}")
    if sp:
        seen = []
        hook = model.blocks["0"].register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
        with torch.no_grad():
            model(torch.zeros(1, CONFIG.in_channels, *CONFIG.img_size))
        hook.remove()
        if not (isinstance(seen[0], DTensor) and seen[0].placements == (Shard(1),)):
            problems.append(f"sequence parallel stream is {type(seen[0]).__name__} {getattr(seen[0], 'placements', '')}")
    return "; ".join(problems)


def check_errors(info) -> tuple[bool, dict]:
    _, mesh = mesh_for(info, cp=info.world_size)
    any_mesh = submesh(mesh, "cp")
    q = torch.zeros(1, 3, 8, 8)
    relative = ViT(ViTConfig(**{**CONFIG.__dict__, "loss": "relative_l2"}))
    x = torch.zeros(1, 3, *CONFIG.img_size)
    problems = []
    for what, call, error, needles in [
        ("tokens", lambda: token_band(30, 0, 4), ContextParallelError, ["30 patch tokens", "cp=4"]),
        ("ulysses heads", lambda: KERNELS["ulysses"](any_mesh)(q, q, q, 0.0), ContextParallelError, ["3 heads"]),
        ("ring dropout", lambda: KERNELS["ring"](any_mesh)(q, q, q, 0.1), ContextParallelError, ["dropout_p=0.1"]),
        ("relative l2", lambda: cp_forward_loss(relative, x, x, slice(0, 4)), ContextParallelError,
         ["relative_l2"]),
    ]:
        try:
            call()
            problems.append(f"{what}: no error")
        except error as e:
            problems += [f"{what}: message lacks {n!r}: {e}" for n in needles if n not in str(e)]
    return not problems, {"problems": problems}


CASES = {
    "attn-ulysses": lambda info: check_attention(info, "ulysses"),
    "attn-ring": lambda info: check_attention(info, "ring"),
    "tp": lambda info: check_training(info, tp=info.world_size),
    "tp-sp": lambda info: check_training(info, tp=info.world_size, sp=True),
    "fsdp-tp": lambda info: check_training(info, tp=2, fsdp=True),
    "cp-ulysses": lambda info: check_training(info, cp=2, impl="ulysses"),
    "cp-ring": lambda info: check_training(info, cp=2, impl="ring"),
    "tp-cp-ulysses": lambda info: check_training(info, tp=2, cp=2, impl="ulysses", fsdp=True),
    "tp-cp-ring": lambda info: check_training(info, tp=2, cp=2, impl="ring", fsdp=True),
    "errors": check_errors,
}

with distributed() as info:
    failed = 0
    for case in sys.argv[1:]:
        ok, fields = CASES[case](info)
        failed += not ok
        record(case, equal=ok, **fields)
    exit_code = 1 if failed else 0
gc.freeze()  # leave without the interpreter's last collections: 0.5 s a rank
sys.exit(exit_code)
