"""What every model's layout shares: the object the training loop drives, whatever the model and mesh.

A layout holds this rank's share of a model (`model`: its parameter names are the whole model's, so optimizers
and checkpoints need no layout knowledge) and what a forward calls (`runnable`: the model under DDP / FSDP2 /
compile, or a DeepSpeed engine). A subclass adds the steps that depend on the kind of model: lm_layout.py
(pipeline, sequence shards, a tied embedding) for the decoders, models/vit/parallelize.py (token bands) for the
ViT. The trainer calls

    optimizer = layout.attach_optimizer(optimizer)
    loss = layout.train_micro_step(x, y, accum=, sync=, autocast=, scaler=, timer=)   # per micro-batch
    layout.finish_backward(); norm = layout.optimizer_step(optimizer, scaler, max_norm)
    layout.save_checkpoint(checkpointer, it, optimizer, trainer_state) / layout.load_checkpoint(dir, optimizer, load)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from meshtrain.parallel import float8
from meshtrain.parallel.data_parallel import SHARDED, apply_data_parallel, wraps
from meshtrain.parallel.mesh import ParallelDims, submesh
from meshtrain.runtime.log import get_logger

log = get_logger("parallel")


@dataclass
class Layout:
    model: nn.Module  # this rank's share of the model: optimizer groups, checkpoints and byte counts come from it
    dims: ParallelDims
    mesh: object | None  # the DeviceMesh, None on one process
    rank: int
    runnable: nn.Module | None = None  # what a forward calls (wrapped by DDP / compile)
    parts: list[nn.Module] = field(default_factory=list)  # the modules data parallelism wrapped
    aliases: dict[str, str] = field(default_factory=dict)  # see parallel.state_dict
    deepspeed: dict | None = None  # train.backend=deepspeed: the engine's settings until attach_optimizer
    engine: object | None = None  # the DeepSpeed engine, which then owns forward, backward and step

    # ---- the optimizer and checkpoints ---------------------------------------------------------------------
    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer the loop sets learning rates on and steps (DeepSpeed wraps it in its engine)."""
        if self.deepspeed is None:
            return optimizer
        from meshtrain.parallel import deepspeed_backend

        self.engine, optimizer = deepspeed_backend.initialize(self.model, optimizer, **self.deepspeed)
        self.runnable = self.engine
        return optimizer

    def optimizer_step(self, optimizer, scaler, max_norm: float) -> torch.Tensor | None:
        """Unscale, clip (if max_norm > 0; returns the norm before clipping) and step."""
        if self.engine is not None:  # it stepped (and clipped, from its config) at the accumulation boundary
            return torch.tensor(float(self.engine.get_global_grad_norm() or 0.0)) if max_norm > 0 else None
        norm = None
        if max_norm > 0:
            scaler.unscale_(optimizer)
            norm = self.clip_grad_norm(max_norm)
        scaler.step(optimizer)
        scaler.update()
        if float8.gathers_in_float8(self.model):  # the weights' scales for the next forward's float8 gathers
            float8.after_optimizer_step(self.model)
        return norm

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.grad is not None], max_norm)

    def finish_backward(self) -> None:
        """After the last micro-step: what the backward pass leaves undone (nothing, unless a model says so)."""

    def save_checkpoint(self, checkpointer, iteration: int, optimizer, trainer_state: dict):
        """A checkpoint of this rank's share of model and optimizer (every rank calls it)."""
        if self.engine is not None:
            from meshtrain.parallel import deepspeed_backend

            return checkpointer.save_with(iteration, lambda path: deepspeed_backend.save(self.engine, path),
                                          trainer_state)
        from meshtrain.parallel.state_dict import model_and_optimizer_state

        return checkpointer.save(iteration, model_and_optimizer_state(self.model, optimizer), trainer_state)

    def load_checkpoint(self, checkpoint_dir, optimizer, load) -> None:
        """Load a checkpoint saved under any layout (DeepSpeed's: under deepspeed only); `load(state)` fills a
        template state dict from it (the checkpointer's: train/checkpoint.dcp_loader(checkpoint_dir))."""
        if self.engine is not None:
            from meshtrain.parallel import deepspeed_backend

            return deepspeed_backend.load(self.engine, checkpoint_dir)
        from meshtrain.parallel.state_dict import load_model_and_optimizer_state

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


def wrap_data_parallel(parts: list[nn.Module], blocks_of, cfg, dims: ParallelDims, mesh, device) -> list[nn.Module]:
    """float8 linears in each part's blocks (train.float8), then data parallelism (and torch.compile) over each part,
    last of all: DDP over dp×cp, or FSDP2 per block (`blocks_of(part)`) and then the part over dp_shard×cp.
    Context-parallel ranks hold the same weights and see the same batch, each a slice of its tokens, so to data
    parallelism they are replicas whose gradients are averaged: a slice's loss is the mean over its tokens and the
    slices are equal-sized, so their mean is the whole's."""
    t, p = cfg.train, cfg.parallel
    sharded = t.backend in SHARDED
    dp_mesh = data_parallel_mesh(mesh, dims, t.backend)
    graphs = use_cuda_graphs(t, dims, device, sum(q.numel() for part in parts for q in part.parameters()))
    compile_options = {"mode": "reduce-overhead"} if graphs else {}  # CUDA graphs through compile
    gathered = sharded and wraps(t.backend, dims.size("dp_cp"))  # FSDP2 shards the blocks: float8 gathers pay
    wrapped = []
    for part in parts:
        if swapped := float8.convert_blocks(blocks_of(part), t.float8, fsdp=gathered):
            log.info("float8 (%s): %d linears of the blocks%s", t.float8, swapped,
                     ", their weights gathered in float8 by FSDP2" if gathered and t.float8 == "tensorwise" else "")
        wrapped.append(apply_data_parallel(
            part if sharded or not t.compile else torch.compile(part, **compile_options), t.backend, device,
            dims.size("dp_cp"), blocks=blocks_of(part), mesh=dp_mesh,
            param_dtype=_param_dtype(t.dtype) if sharded else None, cpu_offload=p.cpu_offload))
    if sharded and t.compile:  # FSDP first, then compile the sharded model
        wrapped = [torch.compile(w, **compile_options) for w in wrapped]
    return wrapped


# train.cuda_graphs=null (auto) captures models under this many parameters: their kernels are short, so a step waits on
# the CPU's launches. Measured on one H100 (bf16 + compile, docs/gpu.md): the 10.7M baby GPT ran 1.23× faster with CUDA
# graphs; GPT-2 124M's kernels already keep the GPU busy.
CUDA_GRAPHS_AUTO_MAX_PARAMS = 50_000_000


def use_cuda_graphs(t, dims: ParallelDims, device: torch.device, params: int) -> bool:
    """train.cuda_graphs, with null (auto) resolved: on for a compiled model of under CUDA_GRAPHS_AUTO_MAX_PARAMS
    parameters trained by one CUDA rank in float32/bf16/fp16 linears (several ranks' collectives, and torchao's float8
    casts, are left out of capture)."""
    if t.cuda_graphs is not None or device.type != "cuda" or not t.compile:
        return bool(t.cuda_graphs)
    chosen = dims.world_size == 1 and t.float8 == "off" and params < CUDA_GRAPHS_AUTO_MAX_PARAMS
    log.info("CUDA graphs: %s (train.cuda_graphs=null: %.1fM parameters on %d rank(s), float8 %s; on for one rank, "
             "no float8, under %dM)", "on" if chosen else "off", params / 1e6, dims.world_size, t.float8,
             CUDA_GRAPHS_AUTO_MAX_PARAMS // 10**6)
    return chosen


def data_parallel_mesh(mesh, dims: ParallelDims, backend: str):
    """What data parallelism spans: dp and cp together (cp ranks are replicas that see other tokens)."""
    if mesh is None:
        return None
    if backend == "hsdp":  # replicate x shard, a 2-D mesh (cp > 1 is refused by the model's layout)
        return mesh[("dp_replicate", "dp_shard")]
    return submesh(mesh, "dp_shard_cp" if backend in SHARDED else "dp_cp")


def _param_dtype(dtype: str):
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
