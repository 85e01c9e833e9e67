"""How a language model is laid out on the mesh: the one place that composes every parallelism for a decoder on token
windows (the GPT, the Llama-style decoder), given the model's own structure (`StageSplit`) and tensor-parallel plan.

    layout = build_language_model_layout(model, cfg, dims, mesh, device, rank, split=SPLIT,
                                         tensor_parallel=apply_tensor_parallel)
    optimizer = layout.attach_optimizer(build_optimizer(layout.model.configure_optimizer_groups(wd), ...))
    for micro in range(accum):
        loss += layout.train_micro_step(x, y, accum=accum, sync=micro == accum - 1, autocast=ctx,
                                        scaler=scaler, timer=timer)
    layout.finish_backward(); grad_norm = layout.optimizer_step(optimizer, scaler, max_norm=1.0)
    layout.eval_loss(x, y, ctx); layout.save_checkpoint(...); layout.load_checkpoint(...)

The pipeline split (pp) comes first: every other parallelism is applied to each of this rank's stages, in the one
order of compose.py (tp -> cp -> activation checkpointing -> float8 -> compile -> data parallel).

The loop sees one object whatever the layout (parallel/layout.py, shared with the ViT's): the step
methods hide whether a forward is a call, a pipeline schedule or a DeepSpeed engine.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from meshtrain.parallel import backends
from meshtrain.parallel.compose import Recipe, apply_model_parallelism, wrap_data_parallel
from meshtrain.parallel.context_parallel import shard_sequence
from meshtrain.parallel.data_parallel import gradient_sync
from meshtrain.parallel.expert_parallel import average_gradients, expert_parameters
from meshtrain.parallel.layout import Layout
from meshtrain.parallel.mesh import ParallelDims, submesh
from meshtrain.parallel.pipeline import build_pipeline, stage_loss_sum, token_loss_sum
from meshtrain.parallel.pipeline_schedules import StageSplit
from meshtrain.parallel.state_dict import full_model_state
from meshtrain.parallel.tensor_parallel import loss_parallel_context

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig


@dataclass
class LanguageModelLayout(Layout):
    pipeline: object | None = None  # parallel.pipeline.Pipeline, when pp > 1
    sequence_shard: tuple[int, int, str] | None = None  # (cp rank, cp size, cp impl) when cp > 1
    loss_parallel: bool = False
    split: StageSplit | None = None  # the model's structure, as a pipeline cuts it
    # The micro-step's gradient scale (1/accum, times the fp16 loss scale): what a loss attached inside the model
    # (parallel/auxiliary_loss.py) weighs its gradient by, as the loss's own gradient is scaled.
    loss_scale: float = 1.0

    # ---- one micro-step ------------------------------------------------------------------------------------
    def _shard(self, x: torch.Tensor, y: torch.Tensor):
        if self.sequence_shard is None:
            return x, y, None
        return shard_sequence(x, y, *self.sequence_shard)

    def _loss_context(self):
        if not self.loss_parallel:
            return nullcontext()
        return loss_parallel_context(True)

    def train_micro_step(self, x, y, *, accum: int, sync: bool, autocast, scaler, timer) -> torch.Tensor:
        """Forward and backward of one micro-batch, gradients scaled for an accumulation of `accum`; `timer`
        (metrics.StepTimer) times forward and backward, or both as one under a pipeline schedule.
        Returns this micro-step's loss / accum (a 0-dim tensor; 0 on ranks without the last pipeline stage)."""
        x, y, positions = self._shard(x, y)
        self.loss_scale = (scaler.get_scale() if scaler.is_enabled() else 1.0) / accum
        if self.pipeline is not None:
            for part in self.parts:
                gradient_sync(part, sync)
            self._set_stage_positions(positions)
            with timer("dtfb"), autocast:
                loss = self.pipeline.step(x, y, scale=1.0 / accum)  # backward on this step's share of the mean
            return torch.zeros((), device=x.device) if loss is None else loss.detach().float() / accum
        with gradient_sync(self.runnable, sync), self._loss_context():
            with timer("dtf"), autocast:
                # the logits not kept in a name: through backward they would hold a [tokens, vocabulary] tensor
                loss = (self.runnable(x, y, positions) if positions is not None else self.runnable(x, y))[1]
                loss = loss / accum  # the sum of micro-steps is the mean over the whole batch
            with timer("dtb"):
                scaler.scale(loss).backward()
        return loss.detach().float()  # plain under tp too: tensor_parallel hands the loss out whole

    def _set_stage_positions(self, positions: torch.Tensor | None) -> None:
        for part in self.pipeline.parts:
            part.positions = positions

    @torch.no_grad()
    def eval_loss(self, x, y, autocast) -> torch.Tensor:
        """Mean loss of a batch (0 on ranks without the last pipeline stage)."""
        x, y, positions = self._shard(x, y)
        if self.pipeline is not None:
            self._set_stage_positions(positions)
            with autocast:
                loss = self.pipeline.eval_loss(x, y)
            return torch.zeros((), device=x.device) if loss is None else loss.float()
        with self._loss_context(), autocast:
            _, loss = self.model(x, y, positions) if positions is not None else self.model(x, y)
        return loss.float()

    def finish_backward(self) -> None:
        """After the last micro-step: what the backward pass leaves undone (the tied embedding across stages, the
        after_backward hooks)."""
        if self.pipeline is not None:
            self.pipeline.sync_tied_embedding()
        super().finish_backward()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        if self.pipeline is not None:  # over every stage, the tied embedding's two copies counted once
            return self.pipeline.clip_grad_norm_(max_norm)
        return super().clip_grad_norm(max_norm)

    # ---- what the loop reports ------------------------------------------------------------------------------
    def full_state_for_sampling(self) -> dict[str, torch.Tensor] | None:
        """The whole model's tensors on rank 0 (None elsewhere), gathered from every layout. Every rank calls it."""
        # Every rank joins the gathers of its stage's whole tensors (the shards live on its dp/tp peers; FSDP2 on one
        # rank still holds DTensors); one rank per stage keeps them and sends them to rank 0.
        first_of_stage = all(c == 0 for d, c in self.dims.coords(self.rank).items() if d != "pp")
        mine = full_model_state(self.model, keep=first_of_stage)
        if self.dims.world_size == 1:  # all of it, and perhaps no process group to send it through
            return mine
        gathered = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if self.rank != 0:
            return None
        whole = {}
        for part in gathered:
            whole.update(part)
        return whole


def build_language_model_layout(model: nn.Module, cfg: RunConfig, dims: ParallelDims, mesh, device: torch.device,
                                rank: int, *, split: StageSplit, tensor_parallel: Callable) -> LanguageModelLayout:
    """Apply cfg.parallel and cfg.train's layout options to `model` (built identically on every rank) on `mesh`
    (the trainer's DeviceMesh, None on one process), with the model's own `split` (its structure, for the pipeline)
    and `tensor_parallel(part, tp_mesh, sequence_parallel=, loss_parallel=)` plan. The layout was checked by
    ParallelDims.from_config."""
    p, t = cfg.parallel, cfg.train
    aliases = dict([split.tied]) if split.tied else {}
    chosen = backends.get(t.backend)  # an engine (DeepSpeed) runs the steps in a layout of its own
    layout_class = chosen.module().EngineLayout if chosen.engine else LanguageModelLayout
    layout = layout_class(model=model, dims=dims, mesh=mesh, rank=rank, split=split, aliases=aliases)

    if dims.pp > 1:
        chunked = getattr(getattr(model, "config", None), "loss_chunks", None)  # train.loss_chunks, resolved
        layout.pipeline = build_pipeline(model, split, submesh(mesh, "pp"), schedule=p.pp_schedule,
                                         microbatches=_microbatches(cfg, dims), virtual_stages=p.virtual_stages,
                                         device=device, loss_fn=stage_loss_sum if chunked else token_loss_sum)
        parts = layout.pipeline.parts
    else:
        parts = [model]
    # Pipeline stages hand plain tensors to each other and compute the loss in the schedule: no sequence-sharded
    # stream, no vocab-sharded loss across a stage boundary (a chunked loss is vocab-sharded under tp all the same:
    # nn/chunked_loss.py).
    sequence_parallel, loss_parallel = (p.sequence_parallel, p.loss_parallel) if dims.pp == 1 else (False, False)
    recipe = Recipe.of(cfg)

    def tensor_parallel_part(part: nn.Module, tp_mesh) -> None:
        tensor_parallel(part, tp_mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)

    # a stage holds its blocks in a ModuleDict of its own, under the model's own path
    apply_model_parallelism(parts, split.blocks, recipe, dims, mesh, tensor_parallel=tensor_parallel_part)
    layout.loss_parallel = dims.tp > 1 and loss_parallel
    if dims.cp > 1:
        layout.sequence_shard = (dims.coords(rank)["cp"], dims.cp, p.cp_impl)

    if chosen.engine:  # it wraps the model itself, with the optimizer (attach_optimizer)
        layout.settings = dict(device=device, stage=p.zero_stage, micro_batch_size=cfg.model.batch_size,
                               grad_accum=t.grad_accum, grad_clip=cfg.optimizer.grad_clip, dtype=t.dtype)
        layout.runnable = model
        return layout
    wrapped = wrap_data_parallel(parts, split.blocks, recipe, dims, mesh, device)
    layout.parts = wrapped
    experts = expert_parameters(model)
    if experts and not chosen.sharded and dims.size("edp") > 1:  # FSDP2 reduces them itself, DDP leaves them out
        layout.after_backward.append(partial(average_gradients, experts, submesh(mesh, "edp").get_group()))
    if layout.pipeline is None:
        layout.runnable = wrapped[0]
    else:
        layout.pipeline.stages[:] = wrapped  # the schedule runs the wrapped stages (DDP replaces the module)
    return layout


def _microbatches(cfg: RunConfig, dims: ParallelDims) -> int:
    return cfg.parallel.microbatches or dims.pp * cfg.parallel.virtual_stages  # one per stage: the fewest that fill it
