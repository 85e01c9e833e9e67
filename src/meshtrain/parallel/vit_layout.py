"""How the ViT weather model is laid out on the mesh: the one place that composes its parallelisms.

    layout = build_vit_layout(model, cfg, dims, device, rank, local_world_size)
    loss = layout.train_micro_step(x, y, accum=, sync=, autocast=, scaler=, timer=)
    fields = layout.predict(x, autocast)          # whole predicted fields on every rank, for metrics and plots

Order of application, as for the GPT (gpt_layout.py) without a pipeline:
    tensor (+ sequence) parallel over heads and MLP (tp)  -> context parallel over patch tokens (cp)
    -> activation checkpointing per block -> data parallel (DDP over dp×cp, FSDP2 over dp_shard×cp), compile

Under context parallel every cp rank of a replica reads the same images and handles a contiguous band of
their patch tokens (vit_parallel.shard_tokens): training takes the MSE of its band, which averages over the
cp ranks to the whole image's; prediction gathers the bands back into whole fields.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshtrain.models.vit import ViT
from meshtrain.parallel.checkpointing import apply_activation_checkpointing
from meshtrain.parallel.data_parallel import gradient_sync
from meshtrain.parallel.layout import Layout, check_data_parallel, wrap_data_parallel
from meshtrain.parallel.mesh import ParallelDims, submesh


@dataclass
class ViTLayout(Layout):
    vit: ViT | None = None  # the plain model under every wrapper: patchify / unpatchify / loss
    token_band: torch.Tensor | None = None  # this cp rank's patch tokens (shard_tokens), when cp > 1
    cp_group: object | None = None

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.token_band is None:
            return self.vit.loss(self.runnable(x), y)
        from meshtrain.parallel.vit_parallel import cp_forward_loss

        return cp_forward_loss(self.runnable, x, y, self.token_band)

    def train_micro_step(self, x, y, *, accum: int, sync: bool, autocast, scaler, timer) -> torch.Tensor:
        """Forward and backward of one micro-batch of fields, gradients scaled for an accumulation of `accum`.
        Returns this micro-step's loss / accum (a 0-dim tensor)."""
        with gradient_sync(self.runnable, sync):
            with timer("dtf"), autocast:
                loss = self._loss(x, y) / accum  # the sum of micro-steps is the mean over the whole batch
            with timer("dtb"):
                scaler.scale(loss).backward()
        return loss.detach().float()

    @torch.no_grad()
    def predict(self, x: torch.Tensor, autocast) -> torch.Tensor:
        """The model's forecast for fields `x`, whole [B, C, H, W] float32 on every rank of the replica (every rank
        must call it: under cp the token bands are gathered)."""
        with autocast:
            if self.token_band is None:
                return self.runnable(x).float()
            from meshtrain.parallel.vit_parallel import cp_forward_patches, gather_tokens

            patches = cp_forward_patches(self.runnable, x, self.token_band)
        return self.vit.unpatchify(gather_tokens(patches.float(), self.cp_group))


def build_vit_layout(model: ViT, cfg, dims: ParallelDims, device: torch.device, rank: int,
                     local_world_size: int) -> ViTLayout:
    """Apply cfg.parallel and cfg.train's layout options to `model` (built identically on every rank)."""
    p, t = cfg.parallel, cfg.train
    dims.check_fits(local_world_size)
    check_data_parallel(t.backend, dims)
    mesh = dims.build_mesh(device.type) if dims.world_size > 1 else None
    layout = ViTLayout(model=model, dims=dims, mesh=mesh, rank=rank, vit=model)
    if dims.tp > 1:
        from meshtrain.parallel.vit_parallel import apply_vit_tensor_parallel

        apply_vit_tensor_parallel(model, submesh(mesh, "tp"), sequence_parallel=p.sequence_parallel)
    if dims.cp > 1:
        from meshtrain.parallel.vit_parallel import apply_vit_context_parallel, shard_tokens

        cp_mesh = submesh(mesh, "cp")
        apply_vit_context_parallel(model, cp_mesh, p.cp_impl)
        layout.token_band = shard_tokens(model.config.num_patches, dims.coords(rank)["cp"], dims.cp, device)
        layout.cp_group = cp_mesh.get_group()
    apply_activation_checkpointing(model.blocks, t.activation_checkpointing, t.ac_every)
    layout.parts = wrap_data_parallel([model], lambda part: part.blocks.values(), cfg, dims, mesh, device)
    layout.runnable = layout.parts[0]
    return layout
