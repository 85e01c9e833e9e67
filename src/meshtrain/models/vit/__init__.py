"""The ViT weather forecaster (NERSC's dl-at-scale-training model): ERA5 fields at t in, fields at t + dt out.

    model.py        the vision transformer (no distributed code), patchify / unpatchify, losses
    parallelize.py  its layout: tensor/sequence parallel -> context parallel over token bands -> AC -> ddp/fsdp
    workload.py     ERA5 batches by epoch, validation loss and skill, a forecast plot after each evaluation
    metrics.py      RMSE in physical units, latitude-weighted RMSE;  plot.py  the forecast figure
    config.py       its run config and rules; presets/ the YAML presets (NERSC's short, base, bs64_opt, ...)
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from meshtrain.models import model_spec
from meshtrain.models.vit.config import ViTRunConfig, validate
from meshtrain.nn.activation_counts import block_activations, block_autocast_activations
from meshtrain.parallel.pipeline_schedules import StageSplit
from meshtrain.registry import ModelShape

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig

# No pipeline plan (parallelisms below): the split only says where the blocks and ends are, for the planner.
SPLIT = StageSplit(blocks="blocks", first=("patch_embed",), last=("norm", "head"))
ERA5_GRID, ERA5_CHANNELS = (721, 1440), 20  # NERSC's ERA5 at 0.25 degrees, what a plan assumes without the data


def _data_facts(cfg: RunConfig) -> dict:
    """The grid (after cropping) and channels of the configured data; NERSC's ERA5 when it is not on this machine,
    so that a plan for a machine one does not have needs no copy of the data."""
    d = cfg.data
    if (Path(d.root) / "train").is_dir():
        from meshtrain.data.era5 import ERA5Dataset

        data = ERA5Dataset(d.root, "train", crop=tuple(d.crop) if d.crop else None, channels=d.channels)
        try:
            return {"img_size": list(data.img_size), "channels": data.num_channels}
        finally:
            data.close()
    rows, columns = (min(a, b) for a, b in zip(ERA5_GRID, d.crop or ERA5_GRID, strict=True))
    return {"img_size": [rows, columns], "channels": len(d.channels) if d.channels else ERA5_CHANNELS}


def _workload(cfg: RunConfig, info, dims):
    from meshtrain.models.vit.workload import ViTWorkload

    return ViTWorkload(cfg, info, dims)


_KEYS = MappingProxyType({"layers": "model.depth", "heads": "model.num_heads", "kv_heads": "model.num_heads",
                          "mlp_hidden": "model.embed_dim × mlp_ratio", "tokens": "the patch grid (data.crop / model.patch_size)",
                          "batch_size": "data.batch_size", "dropout": "model.dropout"})


def _shape(cfg: ViTRunConfig) -> ModelShape:
    m, crop = cfg.model, cfg.data.crop
    tokens = (crop[0] // m.patch_size) * (crop[1] // m.patch_size) if crop else None  # else the data's grid decides
    hidden = int(m.embed_dim * m.mlp_ratio)
    return ModelShape(width=m.embed_dim, layers=m.depth, heads=m.num_heads, kv_heads=m.num_heads, mlp_hidden=hidden,
                      tokens=tokens, causal=False, batch_size=cfg.data.batch_size, dropout=m.dropout,
                      parallelisms=frozenset({"tp", "cp"}), keys=_KEYS, whole_output=True,
                      token_sharded_grads=MappingProxyType({"pos_embed": 1}),
                      activations_per_token=block_activations(m.embed_dim, m.num_heads, hidden),
                      autocast_activations=block_autocast_activations(m.embed_dim, m.num_heads, hidden))


def _build_layout(model, cfg: RunConfig, dims, mesh, device, rank: int):
    from meshtrain.models.vit.parallelize import build_vit_layout

    return build_vit_layout(model, cfg, dims, mesh, device, rank)


def _micro_batch(cfg: ViTRunConfig, dims, data_facts: dict):
    """One micro-batch as the workload's batches give it to the layout: the fields at t and at t + dt, each
    [samples per dp rank, channels, rows, columns] in fp32 (data/era5.py normalises to fp32), of zeros."""
    import torch

    from meshtrain.models.vit.config import local_batch

    shape = (local_batch(cfg, dims.dp_size), data_facts["channels"], *data_facts["img_size"])
    return torch.zeros(shape), torch.zeros(shape)


def build_model(cfg: ViTRunConfig, data_facts: dict):
    """The ViT of a run config; the grid and channels come from the data (data_facts["img_size"], ["channels"])."""
    from meshtrain.models.vit.model import ViT, ViTConfig

    m, channels = cfg.model, data_facts["channels"]
    return ViT(ViTConfig(img_size=tuple(data_facts["img_size"]), patch_size=m.patch_size, in_channels=channels,
                         out_channels=channels, embed_dim=m.embed_dim, depth=m.depth, num_heads=m.num_heads,
                         mlp_ratio=m.mlp_ratio, dropout=m.dropout, drop_path=m.drop_path, loss=m.loss))


SPEC = model_spec(
    __file__, name="vit", summary="NERSC's ViT weather forecaster on ERA5-format fields", run_config=ViTRunConfig,
    data_key="data.root", workload=_workload, shape=_shape, validate=validate, build_model=build_model,
    stage_split=SPLIT, data_facts=_data_facts, build_layout=_build_layout, micro_batch=_micro_batch,
    # tiny for the planner's calibration: width 32, 50 patches, global batch 8. It differs from a language model's
    # beyond its blocks (a field-sized head and loss, all tokens gathered before the head under cp).
    tiny=("model.embed_dim=32", "model.num_heads=2", "model.patch_size=16", "data.crop=[80,160]",
          "data.global_batch_size=8", "model.dropout=0.0", "train.grad_accum=1", "parallel.microbatches=null"),
    legend=MappingProxyType({
        "val_rmse_u10": "RMSE of the u10 forecast in m/s, per sample over the grid, mean over the validation set",
        "persistence_rmse_u10": "the same RMSE for the persistence forecast (forecast = input): the score to beat",
        "val_skill_u10": "1 - val_rmse_u10 / persistence_rmse_u10 (0: no better than persistence, 1: perfect)",
    }),
)
