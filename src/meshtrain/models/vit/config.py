"""The ViT's run configuration: its model and ERA5 data sections and the rules that only concern it. The groups every
model shares (optimizer, train, parallel) are meshtrain.config's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal, get_args

from meshtrain.config import (
    ConfigError,
    InitFrom,
    OptimizerSection,
    ParallelSection,
    TrainSection,
    check_positive,
)

Loss = Literal["mse", "relative_l2"]  # model.py's LOSSES
Loader = Literal["pytorch", "dali"]  # data/era5_batches.py, data/era5_dali.py


@dataclass
class ViTModelSection:  # models/vit/model.py ViTConfig; img_size and channels come from the data
    patch_size: int = 8  # pixels per side of a square patch (a token); data.crop's sides must be multiples
    embed_dim: int = 384  # each token's channels
    depth: int = 12  # transformer blocks
    num_heads: int = 8  # attention heads (embed_dim / num_heads channels each)
    mlp_ratio: float = 4.0  # the MLP's hidden width, as a multiple of embed_dim
    dropout: float = 0.0  # after the position embedding, on attention weights and on both residual branches
    drop_path: float = 0.0  # stochastic depth, rising linearly from 0 in the first block to this in the last
    loss: Annotated[str, Loss] = "mse"  # mse | relative_l2 (FourCastNet's; not with context parallel)


@dataclass
class ERA5DataSection:  # data/era5.py
    root: str = "data/era5_synthetic"  # train/ valid/ test/ of YEAR.h5 and stats/ (NERSC's layout)
    dt: int = 1  # forecast step, in time steps of the files
    crop: list[int] | None = field(default_factory=lambda: [360, 720])  # top-left rows x columns; null: whole grid
    channels: list[str] | None = None  # null: all; the first is the one RMSE is reported for (u10)
    limit_train: int | None = None  # the first N training samples only (NERSC's short: 512); null: all
    limit_valid: int | None = None  # the first N validation samples only (NERSC's short: 128); null: all
    batch_size: int = 16  # samples per micro-step per data-parallel rank
    global_batch_size: int | None = None  # if set, batch_size = global / (data-parallel ranks x grad_accum)
    loader: Annotated[str, Loader] = "pytorch"  # pytorch (DataLoader) | dali (NVIDIA DALI pipeline, the [dali] extra)
    num_workers: int = 0  # loader worker processes per rank (NERSC's num_data_workers)
    pin_memory: bool | None = None  # page-locked batches for faster copies to the device; null: on a GPU
    persistent_workers: bool = True  # pytorch: the DataLoader keeps its workers between epochs
    prefetch_factor: int = 2  # batches each worker loads ahead (dali: the pipeline's queue depth)


@dataclass
class ViTRunConfig:
    model: ViTModelSection = field(default_factory=ViTModelSection)
    data: ERA5DataSection = field(default_factory=ERA5DataSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)


def validate(cfg: ViTRunConfig) -> None:
    """The ViT's own rules (the shared ones are config.validate's; those needing the world size, parallel/mesh.py's)."""
    m, d, t, p = cfg.model, cfg.data, cfg.train, cfg.parallel
    check_positive({"model.patch_size": m.patch_size, "model.embed_dim": m.embed_dim, "model.depth": m.depth,
                     "model.num_heads": m.num_heads, "data.dt": d.dt, "data.batch_size": d.batch_size,
                     "data.global_batch_size": d.global_batch_size, "data.limit_train": d.limit_train,
                     "data.limit_valid": d.limit_valid, "data.prefetch_factor": d.prefetch_factor})
    if m.embed_dim % m.num_heads:
        raise ConfigError(f"model.embed_dim={m.embed_dim} is not divisible by model.num_heads={m.num_heads}: "
                          "each head gets embed_dim / num_heads channels")
    if not 0 <= m.drop_path < 1:
        raise ConfigError(f"model.drop_path={m.drop_path}: must be in [0, 1)")
    if d.crop is not None and (len(d.crop) != 2 or min(d.crop) < 1 or any(c % m.patch_size for c in d.crop)):
        raise ConfigError(f"data.crop={d.crop}: give [rows, columns], both multiples of model.patch_size="
                          f"{m.patch_size} (e.g. [360, 720] for ERA5 at 0.5 degrees, [80, 160] for the synthetic "
                          "90x180 grid)")
    if d.num_workers < 0:
        raise ConfigError(f"data.num_workers={d.num_workers}: 0 reads in the training process, N > 0 in N workers")
    if t.init_from not in get_args(InitFrom):
        raise ConfigError(f"train.init_from={t.init_from!r}: the ViT starts from scratch, resumes its latest run, "
                          "or (auto) resumes it where it has a checkpoint")
    if p.cp > 1 and m.loss != "mse":
        raise ConfigError(f"model.loss={m.loss} with parallel.cp={p.cp}: context parallel ranks each hold a part "
                          "of every image, and the relative L2 needs whole-image norms; use model.loss=mse")


def local_batch(cfg: ViTRunConfig, dp_size: int) -> int:
    """Samples per data-parallel rank and micro-step: data.batch_size, or data.global_batch_size split over the
    data-parallel ranks and micro-steps (the workload's batches, the planner's and a trace's alike)."""
    d, accum = cfg.data, cfg.train.grad_accum
    if d.global_batch_size is None:
        return d.batch_size
    share = dp_size * accum
    if d.global_batch_size % share:
        raise ConfigError(f"data.global_batch_size={d.global_batch_size} does not split over {dp_size} "
                          f"data-parallel rank(s) × train.grad_accum={accum}: make it a multiple of {share}, "
                          "or set data.batch_size (per rank) and global_batch_size=null")
    return d.global_batch_size // share
