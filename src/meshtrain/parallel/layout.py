"""What every model's layout shares: the object the training loop drives, whatever the model and mesh.

A layout holds this rank's share of a model (`model`: its parameter names are the whole model's, so optimizers
and checkpoints need no layout knowledge) and what a forward calls (`runnable`: the model under DDP / FSDP2 /
compile, or a DeepSpeed engine). A subclass adds the steps that depend on the kind of model: lm_layout.py
(pipeline, sequence shards, a tied embedding) for the decoders, models/vit/parallelize.py (token bands) for the
ViT. The trainer calls

    optimizer = layout.attach_optimizer(optimizer)
    loss = layout.train_micro_step(x, y, accum=, sync=, autocast=, scaler=, timer=)   # per micro-batch
    layout.finish_backward(); norm = layout.optimizer_step(optimizer, scaler, max_norm)   # then its after_step hooks
    layout.save_checkpoint(checkpointer, it, optimizer, trainer_state) / layout.load_checkpoint(dir, optimizer, load)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from meshtrain.parallel import float8
from meshtrain.parallel.clipping import clip_by_total_norm_, clip_grad_norm_, several_meshes
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.parallel.state_dict import load_model_and_optimizer_state, model_and_optimizer_state


@dataclass
class Layout:
    model: nn.Module  # this rank's share of the model: optimizer groups, checkpoints and byte counts come from it
    dims: ParallelDims
    mesh: object | None  # the DeviceMesh, None on one process
    rank: int
    runnable: nn.Module | None = None  # what a forward calls (wrapped by DDP / compile)
    parts: list[nn.Module] = field(default_factory=list)  # the modules data parallelism wrapped
    aliases: dict[str, str] = field(default_factory=dict)  # see parallel.state_dict
    # What a model's workload runs after every optimizer step, in order (the MoE routers' bias update)
    after_step: list[Callable[[], None]] = field(default_factory=list)
    # What runs after the last micro-step's backward, before clipping (expert gradients averaged over their edp group)
    after_backward: list[Callable[[], None]] = field(default_factory=list)

    # ---- the optimizer and checkpoints ---------------------------------------------------------------------
    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer the loop sets learning rates on and steps (an engine's layout wraps it in its engine)."""
        return optimizer

    def optimizer_step(self, optimizer, scaler, max_norm: float) -> torch.Tensor | None:
        """Unscale, clip (if max_norm > 0; returns the norm before clipping) and step."""
        norm = None
        if max_norm > 0:
            scaler.unscale_(optimizer)
            norm = self.clip_grad_norm(max_norm)
        scaler.step(optimizer)
        scaler.update()
        if float8.gathers_in_float8(self.model):  # the weights' scales for the next forward's float8 gathers
            float8.after_optimizer_step(self.model)
        for hook in self.after_step:
            hook()
        return norm

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        if several_meshes(self.model.parameters()):  # torch's clip stacks the norms: they must be of one kind
            return clip_grad_norm_(self.model.parameters(), max_norm)
        return clip_by_total_norm_(self.model.parameters(), max_norm)

    def finish_backward(self) -> None:
        """After the last micro-step: what the backward pass leaves undone (the after_backward hooks)."""
        for hook in self.after_backward:
            hook()

    def save_checkpoint(self, checkpointer, iteration: int, optimizer, trainer_state: dict):
        """A checkpoint of this rank's share of model and optimizer (every rank calls it)."""
        return checkpointer.save(iteration, model_and_optimizer_state(self.model, optimizer), trainer_state)

    def load_checkpoint(self, checkpoint_dir, optimizer, load) -> None:
        """Load a checkpoint saved under any layout; `load(state)` fills a template state dict from it (the
        checkpointer's: train/checkpoint.dcp_loader(checkpoint_dir))."""
        load_model_and_optimizer_state(self.model, optimizer, load, self.aliases)
        return None

    def time_gradient_reduction(self, every: int) -> None:
        """Have DDP's reducer time every `every`-th backward (its own timers: compute and all-reduce spans)."""
        for part in self.parts:
            if isinstance(part, DistributedDataParallel):
                part._set_ddp_runtime_logging_sample_rate(every)  # private, but the reducer's only switch for it

    def gradient_reduction_wait(self) -> float | None:
        """Seconds a backward spent waiting for its gradient all-reduce after its own compute ended, as DDP's reducer
        timed it. The reducer reads its timers at the forward after the timed one, so at a logged iteration this
        is the figure of the one timed an interval before. None where it cannot be told apart: FSDP2 reduces in
        hooks and streams of its own."""
        waits = []
        for part in self.parts:
            if not isinstance(part, DistributedDataParallel):
                continue
            try:
                data = part._get_ddp_logging_data()
            except (AttributeError, RuntimeError):  # a torch without the reducer's logging
                return None
            if "backward_comm_time_end" not in data:  # not timed yet
                return None
            waits.append(max(0, data["backward_comm_time_end"] - data["backward_compute_time_end"]) / 1e9)
        return sum(waits) if waits else None

    @property
    def loss_ranks(self) -> int:
        """How many ranks return a loss: all but those without the last pipeline stage."""
        return self.dims.world_size // self.dims.pp
