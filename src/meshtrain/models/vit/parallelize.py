"""How the ViT weather model is laid out on the mesh: the one place that composes its parallelisms.

    layout = build_vit_layout(model, cfg, dims, mesh, device, rank)
    loss = layout.train_micro_step(x, y, accum=, sync=, autocast=, scaler=, timer=)
    fields = layout.predict(x, autocast)          # whole predicted fields on every rank, for metrics and plots

Order of application, as for the decoders (parallel/lm_layout.py) without a pipeline:
    tensor (+ sequence) parallel over heads and MLP (tp)  -> context parallel over patch tokens (cp)
    -> activation checkpointing per block -> data parallel (DDP over dp×cp, FSDP2 over dp_shard×cp), compile

Under context parallel every cp rank of a replica reads the same images and handles a contiguous band of
their patch tokens (token_band, below): training takes the MSE of its band, which averages over the
cp ranks to the whole image's; prediction gathers the bands back into whole fields.

Below, the ViT's own parallel parts (the model holds no distributed code).

Tensor parallel (`apply_vit_tensor_parallel`): the shared block plan (parallel/tensor_parallel.block_plan) on DTensor,

    attn.q/k/v_proj  colwise: rank r computes heads [r·heads/tp, (r+1)·heads/tp), whole heads, so attention needs
                     no communication (the model reads its local head count from q_proj's width)
    attn.c_proj      rowwise: each rank's heads give a partial sum of the output, all-reduced
    mlp.c_fc         colwise; mlp.c_proj rowwise, reduced like attn.c_proj
    everything else  patch_embed, pos_embed, the LayerNorms and the output head: replicated DTensors. They are small
                     (the head is D x C_out·p², the embedding C_in·p² x D), every rank computes them on the whole
                     stream anyway, and as DTensors every parameter sits on the tp mesh, so FSDP2 on another dim of
                     the same DeviceMesh, DCP and clip_grad_norm_ handle them uniformly.

The residual stream between sublayers is a plain tensor, the same on every tp rank (the rowwise outputs all-reduce).
patch_embed hands out a Replicate DTensor so the DTensor pos_embed can be added to it; pos_drop's input is turned
back into a plain tensor. With sequence_parallel=True the stream is instead a DTensor sharded over tokens (Shard(1)):
LayerNorms, dropouts and residual adds run on N/tp tokens, the rowwise outputs reduce-scatter into the stream and
attn / mlp all-gather from it once per sublayer; the head runs on the local tokens and gathers its patches, so the
model still returns whole fields. As for the GPT: build the model with the same weights on every rank before
applying this (distribute_tensor keeps rank 0's values), and seed dropout by data-parallel rank.

Context parallel (the shared `apply_context_parallel`, whose kernels are full here; `token_band`,
`cp_forward_loss`): the N patch tokens of every image are split over the cp ranks of a replica, which all read the
same batch. Everything but attention is per token, so only attention talks; it is swapped in as
`block.attn.attend`:

    ulysses  all-to-all from [B, H, N/cp, hd] (token-sharded) to [B, H/cp, N, hd] (head-sharded), the model's own
             non-causal attention on whole sequences of H/cp heads, and an all-to-all back. Needs heads % cp == 0.
    ring     K/V blocks travel round the cp ranks; each rank folds every block into its queries' output with an
             online softmax (running log-sum-exp), and the backward sends the K/V gradients round with their
             blocks. Any head count; score memory is one block pair.

Both are context_parallel's kernels with the ViT's full (non-causal) attention: in the ring every block pair is
fully visible and no mask exists. That is also why the tokens are cut into contiguous slices, not zigzag: with causal
attention a late slice does more work than an early one, here every query sees all N keys, so equal slices are
equal work. A contiguous slice of the row-major patch grid is a band of latitude rows, the natural spatial split.

The loss never needs the whole image on one rank: `cp_forward_loss` runs embed -> forward_tokens -> head on this
rank's tokens and takes the MSE against patchify(target)[:, positions]. Every rank holds equally many tokens, so
the mean over cp ranks of these MSEs is the MSE of the whole image, and gradients are averaged over cp exactly as
data parallelism averages them (DDP or FSDP over the flattened dp_cp / dp_shard_cp mesh). FourCastNet's relative
L2 needs each sample's global norms and is refused here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

from meshtrain.models.vit.model import ViT, mse_loss
from meshtrain.parallel.compose import Recipe, apply_model_parallelism, wrap_data_parallel
from meshtrain.parallel.context_parallel import (
    ContextParallelError,
    _as_group,
    unwrap,
)
from meshtrain.parallel.data_parallel import gradient_sync
from meshtrain.parallel.layout import Layout
from meshtrain.parallel.mesh import MeshError, ParallelDims, submesh
from meshtrain.parallel.tensor_parallel import (
    block_plan,
    check_tp_mesh,
    refuse_prepared,
    replicate_block_norms,
    replicate_module,
    stream_layout,
)

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig


@dataclass
class ViTLayout(Layout):
    vit: ViT | None = None  # the plain model under every wrapper: patchify / unpatchify / loss
    # this cp rank's patch tokens (token_band), when cp > 1: a slice, so that no step reads an index tensor on the
    # host (a device sync; and a trace's fake tensors hold no values to read)
    token_band: slice | None = None
    cp_group: object | None = None

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.token_band is None:
            return self.vit.loss(self.runnable(x), y)
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
            patches = cp_forward_patches(self.runnable, x, self.token_band)
        return self.vit.unpatchify(gather_tokens(patches.float(), self.cp_group))


def build_vit_layout(model: ViT, cfg: RunConfig, dims: ParallelDims, mesh, device: torch.device, rank: int) -> ViTLayout:
    """Apply cfg.parallel and cfg.train's layout options to `model` (built identically on every rank) on `mesh`
    (the trainer's DeviceMesh, None on one process). The layout was checked by ParallelDims.from_config."""
    p, recipe = cfg.parallel, Recipe.of(cfg)
    layout = ViTLayout(model=model, dims=dims, mesh=mesh, rank=rank, vit=model)
    apply_model_parallelism([model], "blocks", recipe, dims, mesh, num_heads=model.config.num_heads,
                            tensor_parallel=lambda vit, tp_mesh: apply_vit_tensor_parallel(
                                vit, tp_mesh, sequence_parallel=p.sequence_parallel))
    if dims.cp > 1:
        layout.token_band = token_band(model.config.num_patches, dims.coords(rank)["cp"], dims.cp)
        layout.cp_group = submesh(mesh, "cp").get_group()
    layout.parts = wrap_data_parallel([model], "blocks", recipe, dims, mesh, device)
    layout.runnable = layout.parts[0]
    return layout


BLOCKS = "blocks.*"  # parallelize_module matches each path token with fnmatch: every block


def apply_vit_tensor_parallel(model: ViT, tp_mesh: DeviceMesh | None, *, sequence_parallel: bool = False) -> None:
    """Shard `model` in place over the 1-D `tp_mesh` (a no-op when None or one rank); see the module docstring.

    Every rank of the tp group calls it with the same model. Apply it before activation checkpointing, compile and
    fully_shard (FSDP2 then shards over another dim of the same DeviceMesh).
    """
    if tp_mesh is None or tp_mesh.size() == 1:
        return
    check_tp_mesh(tp_mesh, "apply_vit_tensor_parallel")
    if not isinstance(model, ViT):
        raise MeshError(f"apply_vit_tensor_parallel takes the plain ViT, got a {type(model).__name__}: apply it "
                        f"before DDP, compile and other wrappers")
    refuse_prepared(model, model.blocks, "apply_vit_tensor_parallel")

    stream, _ = stream_layout(sequence_parallel)
    plan = block_plan(BLOCKS, sequence_parallel)
    if sequence_parallel:
        plan |= {"pos_drop": SequenceParallel(), "norm": SequenceParallel()}
    parallelize_module(model, tp_mesh, plan)

    # embed() adds pos_embed to patch_embed's output: both DTensors, so the sum is one (sliced to this rank's tokens
    # for free under sequence parallel, where the Replicate pos_embed meets a Shard(1) stream).
    replicate_module(model.patch_embed, tp_mesh, output=stream)
    model.pos_embed = nn.Parameter(distribute_tensor(model.pos_embed.detach(), tp_mesh, [Replicate()]),
                                   requires_grad=model.pos_embed.requires_grad)
    if sequence_parallel:
        replicate_module(model.head, tp_mesh, output=stream)  # per token on this rank's tokens, then gather the patches
        model.head.register_forward_hook(_whole_output)
    else:
        model.pos_drop.register_forward_pre_hook(_plain_inputs)  # the stream is plain, the same on every rank
        replicate_block_norms(model.blocks.values(), tp_mesh)
        replicate_module(model.norm, tp_mesh, output=None)
        replicate_module(model.head, tp_mesh, output=None)


def _plain_inputs(_module: nn.Module, inputs: tuple) -> tuple:
    return tuple(x.to_local() if isinstance(x, DTensor) else x for x in inputs)


def _whole_output(_module: nn.Module, _inputs: tuple, out: torch.Tensor) -> torch.Tensor:
    return out.full_tensor() if isinstance(out, DTensor) else out


# ---- the token layout -----------------------------------------------------------------------------------------------
def token_band(num_patches: int, cp_rank: int, cp_size: int) -> slice:
    """The contiguous band of patch tokens that cp rank `cp_rank` of `cp_size` holds of `num_patches`."""
    if not isinstance(cp_size, int) or cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ContextParallelError(f"cp_rank={cp_rank} must be in 0..cp_size-1 with cp_size={cp_size} >= 1")
    if num_patches % cp_size:
        raise ContextParallelError(
            f"the {num_patches} patch tokens do not split evenly over cp={cp_size} ranks (every rank must hold "
            f"as many tokens for its mean loss to average to the whole image's): choose a cp that divides "
            f"{num_patches}, or an img_size / patch_size whose token count cp divides")
    size = num_patches // cp_size
    return slice(cp_rank * size, (cp_rank + 1) * size)


def gather_tokens(local: torch.Tensor, cp_mesh) -> torch.Tensor:
    """[B, N/cp, ...] from every cp rank (token_band's contiguous bands) -> [B, N, ...] in patch order, e.g. to
    unpatchify a prediction for evaluation. Autograd-aware: the backward sums the ranks' gradients (reduce-scatter),
    i.e. it differentiates the sum of what every rank computes from the gathered tensor."""
    import torch.distributed._functional_collectives as fc

    # torch 2.13 renamed the op (the old name warns); torch 2.6 has only the old one.
    all_gather = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
    group = _as_group(cp_mesh)
    if dist.get_world_size(group) == 1:
        return local
    return all_gather(local.contiguous(), gather_dim=1, group=group)


# ---- the model ------------------------------------------------------------------------------------------------------
def cp_forward_loss(model: nn.Module, x: torch.Tensor, target: torch.Tensor,
                    positions: slice) -> torch.Tensor:
    """This cp rank's MSE: its tokens (`positions`, token_band's) of the prediction for fields `x` [B, C, H, W]
    against the same tokens of `target`. The mean over cp ranks is the MSE of the whole images.

    `model` is the ViT, or it under DDP, FSDP2 or compile: it is called, so wrappers run their forward machinery.
    """
    vit = unwrap(model)
    if vit.config.loss != "mse":
        raise ContextParallelError(
            f"context parallel trains on the per-token mean squared error, but ViTConfig.loss={vit.config.loss!r} "
            f"needs each sample's norms over the whole image: set loss='mse'")
    index = _token_index(vit, positions)
    pred = model(x, index)
    want = vit.patchify(target)[:, index]
    if pred.shape != want.shape:
        raise ValueError(f"prediction patches {list(pred.shape)} and target patches {list(want.shape)} differ: the "
                         f"target needs ViTConfig.out_channels={vit.config.out_channels} channels")
    return mse_loss(pred, want)


def cp_forward_patches(model: nn.Module, x: torch.Tensor, positions: slice) -> torch.Tensor:
    """This cp rank's predicted patches [B, N/cp, C_out·p²] of fields `x`, for its tokens `positions`; the whole
    prediction is model.unpatchify(gather_tokens(patches, cp_mesh)). `model` as for cp_forward_loss."""
    return model(x, _token_index(unwrap(model), positions))


def _token_index(vit: ViT, positions: slice) -> slice:
    """token_band's slice, checked. embed() picks the rows of the position embedding with it: under tensor parallel
    pos_embed is a Replicate DTensor, which DTensor slices (forward and backward) but cannot index with an index
    tensor; a slice is also a view instead of a copy, and no step reads an index back on the host."""
    if not (isinstance(positions, slice) and positions.step is None and 0 <= positions.start < positions.stop
            <= vit.config.num_patches):
        raise ContextParallelError(f"token positions must be one band of the {vit.config.num_patches} patch tokens "
                                   f"(token_band), got {positions!r}")
    return positions
