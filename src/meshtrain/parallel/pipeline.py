"""Pipeline parallelism for a language model on torch.distributed.pipelining, with every one of torch's schedules.

    pipeline = build_pipeline(model, SPLIT, submesh(mesh, "pp"), schedule="1f1b", microbatches=8, device=device)
    for module in pipeline.stages: fully_shard(module, mesh=dp_mesh)   # optional, in place (or DDP: replace)
    loss = pipeline.step(x, y)              # forward + backward of every microbatch; the loss on the last stage
    pipeline.sync_tied_embedding()          # after the last step() of an accumulation, before clipping
    pipeline.clip_grad_norm_(1.0); optimizer.step()

The blocks are cut into S = pp × virtual_stages contiguous stages (split_layers, which counts the embedding and
the head as blocks of work) and each pp rank holds the stages stage_ids gives it: rank r, r + pp, ... for the
looped schedules, r and 2·pp-1-r for the V-shaped ones. A Stage holds the model's own submodules (which ones: the
model's StageSplit), so its state_dict keys are the full model's: checkpoints load by name whatever the layout.
build_pipeline takes the model apart, keeping only this rank's stages: every rank builds the whole model from the
same seed (fine at test sizes); a big one can be built on the meta device, then each stage to_empty()'d and
loaded by name.

Loss scale: torch calls loss_fn once per microbatch and backpropagates each result. Our loss_fn returns the
microbatch's summed token loss divided by the number of targets (not -1) in the whole batch, and torch's own
division by the number of microbatches is switched off (scale_grads=False; torch 2.6 has no such division),
so the gradients are exactly those of the whole batch's mean loss, whatever the microbatches' token counts.

Tied embedding (the GPT's; StageSplit.tied): wte (first stage) and lm_head (last stage) become separate
parameters that start equal, also when one rank holds both (V schedules), so that every stage module owns its
parameters (two FSDP units cannot share one, an optimizer must not see one twice). sync_tied_embedding() makes
each copy's gradient the sum of both (an all-reduce over {first-stage rank, last-stage rank}, Megatron's
embedding group; a local add on one rank), which is the tied weight's gradient, so both copies take the same step
and stay equal.

Data parallel composes the way torchtitan does it: fully_shard each stage module (and its blocks) in place,
or replace pipeline.stages[i] with DDP(pipeline.stages[i]); the schedule is rebuilt around whatever `stages`
holds and drives no_sync / FSDP's reduction itself. Known torch 2.13 pitfalls are handled in _check_wrappers
(DDP with the split-backward schedules is refused) and eval_loss (V schedules' eval() is broken).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshtrain.parallel.clipping import clip_grad_norm_, local_shard, process_group_of
from meshtrain.parallel.pipeline_schedules import (  # noqa: F401  (re-exported: the pipeline's vocabulary)
    SCHEDULES,
    SINGLE_STAGE,
    SPLIT_BACKWARD,
    V_SHAPED,
    PipelineError,
    StageSplit,
    check_schedule,
    schedule_class,
    split_layers,
    stage_ids,
)

_HIDDEN_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# ---- one stage of a model ------------------------------------------------------------------------------
class Stage(nn.Module):
    """Blocks `block_ids` of `model`, plus split.first's modules on the first stage and split.last's on the last.

    It holds the model's own modules under the model's own paths, so state_dict() keys are exactly the full
    model's ("transformer.h.3.mlp.c_fc.weight", "lm_head.weight", ...) for what this stage owns. Its forward calls
    the model's embed / block_kwargs / logits, which touch only what this stage holds.
    """

    def __init__(self, model: nn.Module, split: StageSplit, block_ids: Sequence[int], *, first: bool, last: bool):
        super().__init__()
        blocks = model.get_submodule(split.blocks)
        for path in split.first if first else ():
            _attach(self, path, model.get_submodule(path))
        _attach(self, split.blocks, nn.ModuleDict({str(i): blocks[str(i)] for i in block_ids}))
        for path in split.last if last else ():
            _attach(self, path, model.get_submodule(path))
        object.__setattr__(self, "_model", model)  # not a submodule: the stage owns only its own parts
        self._blocks = split.blocks
        self.is_first, self.is_last = first, last
        self.block_ids = tuple(block_ids)
        self.positions: torch.Tensor | None = None  # the tokens' positions when not 0..T-1 (a context-parallel slice)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """First stage: token ids [B, T] -> hidden [B, T, C]; middle: hidden -> hidden; last: -> logits [B, T, V],
        or, given the microbatch's `targets` (a chunked loss: the pipeline hands them to every stage), the summed
        loss, which the model's `loss_sum` computes inside this forward, where the head's parameters are gathered."""
        model = self._model
        positions = self.positions
        if positions is None:
            positions = torch.arange(x.shape[1], dtype=torch.long, device=x.device)
        if self.is_first:
            x = model.embed(x, positions)
        kwargs = model.block_kwargs(positions) if hasattr(model, "block_kwargs") else {}
        for block in self.get_submodule(self._blocks).values():
            x = block(x, **kwargs)
        if self.is_last:
            x = model.logits(x) if targets is None else model.loss_sum(x, targets)
        return x


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register `module` under the dotted `path` of `root`, making ModuleDicts for the missing parents."""
    *parents, name = path.split(".")
    for parent in parents:
        if parent not in root._modules:
            root.add_module(parent, nn.ModuleDict())
        root = root._modules[parent]
    root.add_module(name, module)


def stage_loss_sum(loss_sum: torch.Tensor, _targets: torch.Tensor) -> torch.Tensor:
    """The summed loss the last stage's forward computed (a chunked loss: Stage.forward given targets)."""
    return loss_sum


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of one microbatch (targets of -1 ignored), as GPT.forward computes it."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1,
                           reduction="sum")


# ---- the pipeline ---------------------------------------------------------------------------------------
class Pipeline:
    """This rank's stages and torch's schedule over them. Build it with build_pipeline."""

    def __init__(self, parts: list[Stage], stage_indices: list[int], n_stages: int, group, schedule: str,
                 microbatches: int, device: torch.device, loss_sum: Callable, embed_group, embed_peer_is_self: bool,
                 tied: tuple[str, str] | None = None):
        self.stages: list[nn.Module] = list(parts)  # replace an entry to wrap it (DDP); fully_shard works in place
        self._parts = list(parts)  # the Stages themselves, whatever wraps them later
        self._tied = tied
        self.stage_indices = list(stage_indices)
        self.n_stages = n_stages
        self.is_first = any(p.is_first for p in parts)
        self.is_last = any(p.is_last for p in parts)
        self.schedule_name, self.microbatches, self.device = schedule, microbatches, device
        self._group, self._embed_group, self._embed_on_one_rank = group, embed_group, embed_peer_is_self
        self._loss_sum = loss_sum
        self._targets_to_stages = loss_sum is stage_loss_sum  # the last stage computes the loss in its forward
        self._loss_divisor: torch.Tensor | float = 1.0
        # Called with True before torch's shape inference and False after: a real forward and backward of garbage
        # (an empty tensor past the first stage) that torch runs before the first step and at every switch between
        # step and eval, which a stage's modules may keep out of what they count (a router's tallies).
        self.shape_inference_hooks: list[Callable[[bool], None]] = []
        self._schedule, self._built_for = None, None
        # eval_loss through a plain forward pass instead of the schedule's eval(): where torch has no eval()
        # (before ~2.8), and for V schedules, whose eval() in torch 2.13 still runs the backward actions of the
        # two adjacent stages on the last rank and fails ("can't steal_bwd_input ... doesn't have backward").
        self._plain_eval = schedule in V_SHAPED
        self._ensure_schedule()  # now, so that a layout torch refuses fails at build time

    # -- the schedule, rebuilt if `stages` was wrapped since ------------------------------------------------
    def _loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._loss_sum(logits, targets) / self._loss_divisor

    def _ensure_schedule(self):
        if self._built_for is not None and all(a is b for a, b in zip(self._built_for, self.stages, strict=True)):
            return self._schedule
        from torch.distributed.pipelining import PipelineStage

        cls = schedule_class(self.schedule_name)
        pipe_stages = [PipelineStage(module, index, self.n_stages, self.device, group=self._group)
                       for module, index in zip(self.stages, self.stage_indices, strict=True)]
        kwargs = {"scale_grads": False} if "scale_grads" in inspect.signature(cls.__init__).parameters else {}
        first_arg = pipe_stages[0] if self.schedule_name in SINGLE_STAGE else pipe_stages
        try:
            self._schedule = cls(first_arg, n_microbatches=self.microbatches, loss_fn=self._loss_fn, **kwargs)
        except ValueError as e:
            raise PipelineError(f"torch {torch.__version__} refuses schedule {self.schedule_name!r} with "
                                f"microbatches={self.microbatches} over {self.n_stages} stages: {e}") from e
        self._built_for = list(self.stages)
        initialize = getattr(self._schedule, "_initialize_pp_stages", None)  # torch 2.13's shape inference
        if initialize is not None:
            self._schedule._initialize_pp_stages = partial(self._around_shape_inference, initialize)
        return self._schedule

    def _around_shape_inference(self, initialize: Callable, *args, **kwargs):
        for hook in self.shape_inference_hooks:
            hook(True)
        try:
            return initialize(*args, **kwargs)
        finally:
            for hook in self.shape_inference_hooks:
                hook(False)

    def _check_batch(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if x.shape[0] % self.microbatches:
            raise PipelineError(f"batch of {x.shape[0]} sequences does not split into {self.microbatches} "
                                f"microbatches: make the batch a multiple of {self.microbatches}")
        if tuple(x.shape) != tuple(y.shape):
            raise PipelineError(f"inputs {tuple(x.shape)} and targets {tuple(y.shape)} differ in shape")

    def _inputs(self, x: torch.Tensor, y: torch.Tensor, scale: float) -> tuple[tuple, torch.Tensor | None]:
        target = None
        if self.is_last:
            target = y.to(self.device)
            self._loss_divisor = (target != -1).sum().clamp_min(1) / scale
        return ((x.to(self.device),) if self.is_first else ()), target

    def _check_wrappers(self) -> None:
        """Adjust or refuse the data-parallel wrappers of `stages` where torch's schedules mishandle them.

        DDP: the stage runs every forward under no_sync and starts the reduction itself on the last
        microbatch's backward, but torch 2.13's shape inference calls the DDP module outside no_sync, which
        arms the reducer too early (its bucket rebuild then counts each gradient twice and fails); turning
        the forward-time sync off keeps it for the stage alone. The split-backward schedules compute weight
        gradients with autograd.grad, which DDP never sees: refused. FSDP2 under those schedules: blocks that
        reshard after forward lose their weight gradients (the root is spared: FSDP never reshards it after
        forward), so their parameters stay gathered from forward to backward, as torchtitan does anyway.
        """
        from torch.nn.parallel import DistributedDataParallel

        for module in self.stages:
            if isinstance(module, DistributedDataParallel):
                if self.schedule_name in SPLIT_BACKWARD:
                    raise PipelineError(
                        f"schedule {self.schedule_name!r} computes weight gradients outside autograd's backward, "
                        "where DDP cannot all-reduce them: shard the stages with FSDP (fully_shard) instead, or "
                        "use gpipe / 1f1b / interleaved_1f1b / looped_bfs with DDP")
                module.require_backward_grad_sync = False
        if self.schedule_name not in SPLIT_BACKWARD:
            return
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:
            return
        for stage in self.stages:
            for module in stage.modules():
                if isinstance(module, FSDPModule):
                    if not hasattr(module, "set_reshard_after_forward"):
                        raise PipelineError(f"torch {torch.__version__} cannot switch FSDP's reshard_after_forward "
                                            f"for schedule {self.schedule_name!r}: call fully_shard(..., "
                                            "reshard_after_forward=False) on the stages' blocks")
                    module.set_reshard_after_forward(False, recurse=False)

    def _run(self, method: str, x, y, scale: float) -> torch.Tensor | None:
        self._check_batch(x, y)
        schedule = self._ensure_schedule()
        self._check_wrappers()
        args, target = self._inputs(x, y, scale)
        losses: list[torch.Tensor] = []
        extra = {"return_outputs": False} if "return_outputs" in inspect.signature(schedule.step).parameters else {}
        if self._targets_to_stages:  # every stage is given them, split into microbatches; the last one uses them
            extra["targets"] = y.to(self.device)
        getattr(schedule, method)(*args, target=target, losses=losses, **extra)  # no merged logits: loss only
        if not self.is_last:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum() / scale

    # -- the loop's interface --------------------------------------------------------------------------------
    def step(self, x: torch.Tensor, y: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor | None:
        """Forward + backward of every microbatch of (x, y); gradients ADD to what the parameters hold.

        Returns the batch's mean loss (model(x, y)[1]) on the rank with the last stage, None elsewhere.
        `scale` multiplies this step's gradients only: 1 / accumulation steps for gradient accumulation.
        """
        return self._run("step", x, y, scale)

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """The mean loss of (x, y) without gradients (last stage; None elsewhere). Dropout follows the stages'
        train()/eval() mode. Uses the schedule's eval() where torch has it, a plain forward pass otherwise."""
        schedule = self._ensure_schedule()
        if hasattr(schedule, "eval") and not self._plain_eval:
            return self._run("eval", x, y, 1.0)
        self._check_batch(x, y)
        return self._plain_forward_loss(x, y)

    def _plain_forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Microbatch by microbatch, stage by stage, in one global order that every rank follows, so each
        send meets its receive: slow (no overlap), but it needs nothing from torch's schedules."""
        owner = {index: r for r in range(dist.get_world_size(self._group))
                 for index in stage_ids(r, dist.get_world_size(self._group), len(self.stage_indices),
                                        self.schedule_name)}
        me = dist.get_rank(self._group)
        modules = dict(zip(self.stage_indices, self.stages, strict=True))
        args, target = self._inputs(x, y, 1.0)
        total = torch.zeros((), device=self.device)
        for mb in range(self.microbatches):
            rows = slice(mb * (x.shape[0] // self.microbatches), (mb + 1) * (x.shape[0] // self.microbatches))
            carried = None
            for s in range(self.n_stages):
                if owner[s] != me:
                    continue
                h = args[0][rows] if s == 0 else carried if owner[s - 1] == me else self._recv(owner[s - 1])
                last = s == self.n_stages - 1
                out = modules[s](h, target[rows]) if last and self._targets_to_stages else modules[s](h)
                if last:
                    total += self._loss_fn(out, target[rows]).float()
                elif owner[s + 1] == me:
                    carried = out
                else:
                    self._send(out, owner[s + 1])
        return total if self.is_last else None

    def _send(self, hidden: torch.Tensor, peer: int) -> None:
        header = torch.tensor([*hidden.shape, _HIDDEN_DTYPES.index(hidden.dtype)], device=self.device)
        dist.send(header, dist.get_global_rank(self._group, peer), group=self._group)
        dist.send(hidden.contiguous(), dist.get_global_rank(self._group, peer), group=self._group)

    def _recv(self, peer: int) -> torch.Tensor:
        header = torch.empty(4, dtype=torch.long, device=self.device)
        dist.recv(header, dist.get_global_rank(self._group, peer), group=self._group)
        *shape, dtype = header.tolist()
        hidden = torch.empty(shape, dtype=_HIDDEN_DTYPES[dtype], device=self.device)
        dist.recv(hidden, dist.get_global_rank(self._group, peer), group=self._group)
        return hidden

    @property
    def parts(self) -> list[Stage]:
        """The Stage under each entry of `stages`, unwrapped: full-model names for state dicts."""
        return list(self._parts)

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter this rank holds, once each (both copies of the tied embedding where held)."""
        seen: dict[int, nn.Parameter] = {}
        for module in self.stages:
            for p in module.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def _tied_copies(self) -> tuple[nn.Parameter | None, nn.Parameter | None]:
        """(the first stage's copy of the tied weight, the last stage's) where this rank holds them."""
        if self._tied is None:
            return None, None
        copy, source = self._tied
        embedding = next((p.get_parameter(source) for p in self._parts if p.is_first), None)
        head = next((p.get_parameter(copy) for p in self._parts if p.is_last), None)
        return embedding, head

    def sync_tied_embedding(self) -> None:
        """Make both copies' gradients of a tied weight (the GPT's wte and lm_head) their sum, the tied weight's
        gradient. Every rank of the pipeline calls it after backward (ranks without either copy, and models
        without a tie, return at once)."""
        copies = [p for p in self._tied_copies() if p is not None]
        if not copies:
            return
        if any(p.grad is None for p in copies):
            raise PipelineError("sync_tied_embedding() found no gradient on the embedding / lm_head: call it "
                                "after step(), before clipping and the optimizer step")
        grads = [local_shard(_grad_placed_like_param(p)) for p in copies]
        if self._embed_on_one_rank:
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
        else:
            dist.all_reduce(grads[0], group=self._embed_group)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """clip_grad_norm_ over the whole pipeline, the tied embedding counted once (call after
        sync_tied_embedding). Every rank of the pipeline calls it; returns the total norm."""
        _, head = self._tied_copies()
        counted = [p for p in self.parameters() if p is not head]
        return clip_grad_norm_(counted, max_norm, self._group, norm_type=norm_type,
                               scale_only=[head] if head is not None else [])


def _grad_placed_like_param(p: nn.Parameter) -> torch.Tensor:
    """The gradient, redistributed to its parameter's placements if autograd left it otherwise: under tensor
    parallelism the embedding's gradient comes out Replicate/Partial, the head's Shard(0), and the two local
    tensors must be the same slice to be summed."""
    grad = p.grad
    if hasattr(grad, "placements") and tuple(grad.placements) != tuple(p.placements):
        p.grad = grad = grad.redistribute(grad.device_mesh, p.placements)
    return grad


_EMBED_GROUPS: dict = {}  # (world group, all pairs) -> {pair: group}: new_group once per layout


def _embedding_group(pair: tuple[int, int] | None):
    """The process group of {first-stage rank, last-stage rank} of this rank's pipeline.

    new_group is collective over the whole world: every rank learns every pipeline's pair and creates
    all of them in the same order, keeping the one it belongs to.
    """
    pairs: list = [None] * dist.get_world_size()
    dist.all_gather_object(pairs, pair)
    layout = tuple(sorted({p for p in pairs if p is not None}))
    key = (id(dist.group.WORLD), layout)
    if key not in _EMBED_GROUPS:
        _EMBED_GROUPS[key] = {p: dist.new_group(list(p)) for p in layout}
    return _EMBED_GROUPS[key].get(pair)


def build_pipeline(model: nn.Module, split: StageSplit, pp_mesh, *, schedule: str, microbatches: int, virtual_stages: int = 1,
                   device: torch.device, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_loss_sum,
                   embed_weight: float = 1.0, head_weight: float = 1.0) -> Pipeline:
    """Cut `model` into this rank's stages of `schedule` over the pp mesh (a 1-D DeviceMesh or process group).

    Collective: every rank of the job calls it (the embedding groups are created together). `model` is
    taken apart: afterwards it holds only this rank's parts. loss_fn(logits, targets) must return the
    microbatch's SUMMED loss; the pipeline divides by the number of targets that are not -1. loss_fn=stage_loss_sum
    (a chunked loss): the stages are given the targets too, and the last one's forward returns that sum itself.
    """
    if pp_mesh is None:
        raise PipelineError("build_pipeline needs the pp mesh dim (submesh(mesh, 'pp')); with parallel.pp=1 "
                            "there is no pipeline to build: train the model directly")
    group = process_group_of(pp_mesh)
    pp_size, pp_rank = dist.get_world_size(group), dist.get_rank(group)
    check_schedule(schedule, pp_size, virtual_stages, microbatches)
    schedule_class(schedule)
    n_stages = pp_size * virtual_stages
    model_blocks = model.get_submodule(split.blocks)
    n_layer = len(model_blocks)
    blocks = split_layers(n_layer, n_stages, embed_weight=embed_weight, head_weight=head_weight)
    mine = stage_ids(pp_rank, pp_size, virtual_stages, schedule)
    last_owner = next(r for r in range(pp_size) if n_stages - 1 in stage_ids(r, pp_size, virtual_stages, schedule))
    first, last = 0 in mine, n_stages - 1 in mine

    if last and split.tied:  # untie: the last stage gets its own copy, kept equal by sync_tied_embedding
        owner_path, _, name = split.tied[0].rpartition(".")
        owner = model.get_submodule(owner_path)
        weight = getattr(owner, name)
        setattr(owner, name, nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad))
    owned = {i for s in mine for i in blocks[s]}
    for i in range(n_layer):
        if i not in owned:
            del model_blocks[str(i)]
    for path in (*(() if first else split.first), *(() if last else split.last)):
        parent, _, name = path.rpartition(".")
        delattr(model.get_submodule(parent) if parent else model, name)
    parts = [Stage(model, split, blocks[s], first=s == 0, last=s == n_stages - 1) for s in mine]
    # already in place: nothing to move (and a fake tensor's module cannot swap its parameters: plan --trace)
    if not any(p.is_meta or p.device == torch.device(device) for part in parts for p in part.parameters()):
        for part in parts:
            part.to(device)

    on_one_rank = last_owner == 0
    pair = None
    if not on_one_rank and pp_rank in (0, last_owner):
        pair = (dist.get_global_rank(group, 0), dist.get_global_rank(group, last_owner))
    embed_group = None if on_one_rank or not split.tied else _embedding_group(pair)
    return Pipeline(parts, mine, n_stages, group, schedule, microbatches, device, loss_fn, embed_group, on_one_rank,
                    split.tied)
