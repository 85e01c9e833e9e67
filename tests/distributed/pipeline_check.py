"""Under torchrun: every pipeline schedule must train exactly like one process on the whole batch.

    python -m torch.distributed.run --nproc-per-node N pipeline_check.py SCHEDULE@LAYOUT ... [--errors]

LAYOUT is "pp" (all N ranks in one pipeline) or "fsdp" / "ddp" (pp=2 × dp=N/2, the stages wrapped by FSDP2
or DDP over the dp mesh). One launch runs several cases (setting up the process group is the slow part).
For each, every rank builds the same single-process reference and the same model, cuts the model into its
pipeline stages, and trains STEPS SGD steps of ACCUM pipeline step() calls each on its dp share of the
global batch, with the tied embedding synced and the gradients clipped across stages. After every step it
compares the loss (last stage), the clipping norm, and the gradient and value of every parameter it owns,
by full-model name (lm_head.weight and transformer.wte.weight both against the reference's one tied
weight); before the last step it compares eval_loss, through the schedule's eval() and through the plain
forward pass of older torch, so the last step also checks that training still matches after an eval.
Each rank records per case (meshtrain.runtime.results.record) its verdict, worst differences, dp rank and how many
parameters it holds; with --errors, per layout ("errors@LAYOUT") the message each bad layout fails with.
"""

import argparse
import gc
import sys

import torch
import torch.distributed as dist

from meshtrain.models.gpt.model import GPT, GPTConfig
from meshtrain.models.gpt.parallelize import SPLIT
from meshtrain.parallel.mesh import ParallelDims, submesh
from meshtrain.parallel.pipeline import SINGLE_STAGE, PipelineError, build_pipeline
from meshtrain.runtime.results import full, record
from meshtrain.runtime.setup import distributed

ACCUM, ROWS, MICROBATCHES, STEPS, MAX_NORM, TOL = 2, 8, 4, 2, 0.3, 1e-5
CONFIG = GPTConfig(block_size=16, vocab_size=65, n_layer=4, n_head=4, n_embd=32, dropout=0.0, bias=True)

parser = argparse.ArgumentParser()
parser.add_argument("cases", nargs="+", help="SCHEDULE@LAYOUT, LAYOUT one of pp, fsdp, ddp")
parser.add_argument("--errors", action="store_true")
args = parser.parse_args()


def batch(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, CONFIG.vocab_size, (rows, CONFIG.block_size + 1), generator=torch.Generator().manual_seed(seed))
    return data[:, :-1], data[:, 1:]


def wrap(pipeline, dp_mesh, layout: str) -> None:
    if layout == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for module in pipeline.stages:  # in place: the schedule sees an FSDPModule and drives its reduction
            for block in module.transformer.h.values():
                fully_shard(block, mesh=dp_mesh)
            fully_shard(module, mesh=dp_mesh)
    elif layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        pipeline.stages = [DistributedDataParallel(m, process_group=dp_mesh.get_group()) for m in pipeline.stages]


def check(schedule: str, layout: str, mesh, info) -> bool:
    pp_mesh, dp_mesh = submesh(mesh, "pp"), submesh(mesh, "dp")
    dp_size, dp_rank = (dp_mesh.size(), dp_mesh.get_local_rank()) if dp_mesh is not None else (1, 0)
    torch.manual_seed(0)
    reference = GPT(CONFIG)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    virtual = 1 if schedule in SINGLE_STAGE else 2
    pipeline = build_pipeline(model, SPLIT, pp_mesh, schedule=schedule, microbatches=MICROBATCHES, virtual_stages=virtual,
                              device=info.torch_device)
    held = sum(p.numel() for p in pipeline.parameters())
    keys = [k for part in pipeline.parts for k in part.state_dict()]
    wrap(pipeline, dp_mesh, layout)
    sgd = dict(lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(pipeline.parameters(), **sgd)
    ref_opt = torch.optim.SGD(reference.parameters(), **sgd)
    keys_ok = stages_cover_the_model(keys, pp_mesh, reference)

    worst = {"loss": 0.0, "norm": 0.0, "grad": 0.0, "param": 0.0, "eval": 0.0, "eval_plain": 0.0}
    norms = []  # the reference's gradient norm before clipping, per step
    for step in range(STEPS):
        if step == STEPS - 1:  # eval in between training steps: forward only, and training still matches after
            compare_eval(pipeline, reference, dp_size, dp_rank, worst)
        norms.append(compare_train_step(step, pipeline, reference, dp_size, dp_rank, worst))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        worst["param"] = max(worst["param"], worst_difference(pipeline, reference, lambda p: p.detach()))

    ref_held = sum(p.numel() for p in reference.parameters())
    ok = keys_ok and all(v < TOL for v in worst.values()) and min(norms) > MAX_NORM
    record(f"{schedule}@{layout}", equal=ok, worst=worst, dp=dp_rank, held=held, whole=ref_held,
           pp_rank=dist.get_rank(pp_mesh.get_group()), stages=list(pipeline.stage_indices), first=pipeline.is_first,
           last=pipeline.is_last, reference_norms=norms, keys_ok=keys_ok)
    return ok


def stages_cover_the_model(keys: list[str], pp_mesh, reference: GPT) -> bool:
    """Each pp rank's state-dict keys are full-model names; together they must be the whole model, each once."""
    gathered: list = [None] * dist.get_world_size(pp_mesh.get_group())
    dist.all_gather_object(gathered, keys, group=pp_mesh.get_group())
    all_keys = [k for ks in gathered for k in ks]
    return sorted(all_keys) == sorted(reference.state_dict())


def compare_eval(pipeline, reference: GPT, dp_size: int, dp_rank: int, worst: dict) -> None:
    """Raise worst["eval"] (the schedule's eval()) and worst["eval_plain"] (the plain forward pass) to the loss
    differences on this dp rank's rows; only the last stage gets a loss."""
    x, y = batch(100, dp_size * ROWS)
    mine = slice(dp_rank * ROWS, (dp_rank + 1) * ROWS)
    with torch.no_grad():
        ref_eval = reference(x[mine], y[mine])[1]
    default = pipeline._plain_eval  # the schedule's eval(), or for V schedules the plain pass
    for kind, plain in (("eval", default), ("eval_plain", True)):
        pipeline._plain_eval = plain
        got = pipeline.eval_loss(x[mine], y[mine])
        assert (got is None) != pipeline.is_last
        if got is not None:
            worst[kind] = max(worst[kind], abs(got.item() - ref_eval.item()))
    pipeline._plain_eval = default


def compare_train_step(step: int, pipeline, reference: GPT, dp_size: int, dp_rank: int, worst: dict) -> float:
    """Backward and clip both models on batch `step` (the reference on the whole global batch, the pipeline on
    this dp rank's share in ACCUM calls), raise worst["loss"], ["norm"] and ["grad"]; return the reference's
    gradient norm before clipping. The optimizers are left to the caller."""
    x, y = batch(step, dp_size * ACCUM * ROWS)
    _, ref_loss = reference(x, y)
    ref_loss.backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM).item()
    base = dp_rank * ACCUM * ROWS
    with torch.no_grad():
        ref_mine = reference(x[base:base + ACCUM * ROWS], y[base:base + ACCUM * ROWS])[1]
    loss = 0.0
    for micro in range(ACCUM):
        rows = slice(base + micro * ROWS, base + (micro + 1) * ROWS)
        got = pipeline.step(x[rows], y[rows], scale=1 / ACCUM)
        assert (got is None) != pipeline.is_last
        loss = loss + (got.item() / ACCUM if got is not None else 0.0)
    if pipeline.is_last:
        worst["loss"] = max(worst["loss"], abs(loss - ref_mine.item()))
    pipeline.sync_tied_embedding()
    norm = pipeline.clip_grad_norm_(MAX_NORM)
    worst["norm"] = max(worst["norm"], abs(norm.item() - ref_norm))
    worst["grad"] = max(worst["grad"], worst_difference(pipeline, reference, lambda p: p.grad))
    return ref_norm


def worst_difference(pipeline, reference: GPT, tensor_of) -> float:
    """The largest absolute difference of `tensor_of(parameter)` (its gradient or its value) between the
    parameters this rank holds and the reference's parameters of the same full-model name."""
    worst = 0.0
    for part in pipeline.parts:
        for name, p in part.named_parameters():
            q = reference.get_parameter(name)  # lm_head.weight resolves to the tied wte weight
            # Absolute: some gradients are exactly zero in theory (k_proj.bias: softmax ignores a constant
            # shift of the scores) and rounding noise of 1e-12 in both would make a relative measure huge.
            worst = max(worst, (full(tensor_of(p)).cpu() - tensor_of(q)).abs().max().item())
    return worst


def errors(mesh, layout: str, info) -> None:
    """Bad layouts fail with one clear message on every rank, before any collective."""
    pp_mesh = submesh(mesh, "pp")
    if layout == "ddp":  # DDP cannot see the weight gradients of a split-backward schedule
        pipeline = build_pipeline(GPT(CONFIG), SPLIT, pp_mesh, schedule="zbv_zero_bubble", microbatches=4, virtual_stages=2,
                                  device=info.torch_device)
        wrap(pipeline, submesh(mesh, "dp"), layout)
        try:
            pipeline.step(*batch(0, 8))
            message = "no error"
        except PipelineError as e:
            message = str(e)
        record("errors@ddp", ddp=message)
        return
    cases = {
        "microbatches": dict(schedule="1f1b", microbatches=1),
        "dualpipev": dict(schedule="dualpipev", microbatches=3, virtual_stages=2),
        "layers": dict(schedule="interleaved_1f1b", microbatches=4, virtual_stages=3),
        "virtual": dict(schedule="zbv_zero_bubble", microbatches=4),
    }
    for what, kwargs in cases.items():
        try:
            build_pipeline(GPT(CONFIG), SPLIT, pp_mesh, device=info.torch_device, **kwargs)
            message = "no error"
        except PipelineError as e:
            message = str(e)
        record(f"errors@{layout}", **{what: message})
    pipeline = build_pipeline(GPT(CONFIG), SPLIT, pp_mesh, schedule="gpipe", microbatches=4, device=info.torch_device)
    x, y = batch(0, 6)
    try:
        pipeline.step(x, y)
        message = "no error"
    except PipelineError as e:
        message = str(e)
    record(f"errors@{layout}", batch=message)


with distributed() as info:
    meshes: dict = {}  # built once per layout, in the same order on every rank (building is collective)
    results = []
    for case in args.cases:
        schedule, layout = case.split("@")
        if layout not in meshes:
            pp = info.world_size if layout == "pp" else 2
            meshes[layout] = ParallelDims(world_size=info.world_size, pp=pp).build_mesh(info.torch_device.type)
        results.append(check(schedule, layout, meshes[layout], info))
    if args.errors:
        for layout, mesh in meshes.items():
            errors(mesh, layout, info)
    exit_code = 0 if all(results) else 1
gc.freeze()  # leave without the interpreter's last collections: 0.5 s a rank
sys.exit(exit_code)
