"""The ViT weather forecaster as a workload of the one training loop: ERA5 fields at t in, fields at t + dt out.

Evaluation runs over the validation split (its first train.eval_iters global batches at most), every sample
counted once however the split divides over the data-parallel ranks, and reports in physical units what weather
people look at: the RMSE of u10 (NERSC's metric) next to the persistence baseline (forecast = input, the
score to beat), and the latitude-weighted RMSE of a few headline channels (WeatherBench's). After it, rank 0
plots the first validation sample's u10 forecast, truth and error to figures/ (and TensorBoard).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from meshtrain.config import ConfigError
from meshtrain.data.era5 import ERA5Dataset
from meshtrain.data.era5_batches import ERA5Batches, eval_batches
from meshtrain.data.era5_dali import ERA5DaliBatches
from meshtrain.data.era5_synthetic import channel_units
from meshtrain.models.vit import build_model
from meshtrain.models.vit.config import ViTRunConfig, local_batch
from meshtrain.models.vit.metrics import latitude_weighted_rmse, rmse
from meshtrain.models.vit.model import ViT
from meshtrain.models.vit.parallelize import build_vit_layout
from meshtrain.models.vit.plot import save_forecast_png
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.runtime.progress import track
from meshtrain.runtime.setup import DistInfo, collective

HEADLINE = ("u10", "t2m", "t850", "z500")  # latitude-weighted RMSEs logged by name when the data has them


class ViTWorkload:
    name = "vit"

    def __init__(self, cfg: ViTRunConfig, info: DistInfo, dims: ParallelDims):
        self.info, self.dims, self.device = info, dims, info.torch_device
        d = cfg.data
        common = dict(dt=d.dt, crop=tuple(d.crop) if d.crop else None, channels=d.channels)
        try:
            self.train_data = ERA5Dataset(d.root, "train", limit=d.limit_train, **common)
            self.valid_data = ERA5Dataset(d.root, "valid", limit=d.limit_valid, **common)
        except ValueError as e:  # DataError is one too, and says which file
            raise ConfigError(f"data (data.root={d.root}): {e}") from None
        rows, columns = self.train_data.img_size
        p = cfg.model.patch_size
        if rows % p or columns % p:
            raise ConfigError(f"the {self.train_data.split} grid of {d.root} is {rows}x{columns} after data.crop="
                              f"{d.crop}, not a multiple of model.patch_size={p}: set data.crop=[{rows - rows % p}, "
                              f"{columns - columns % p}]")
        cfg = replace(cfg, data=replace(d, batch_size=local_batch(cfg, dims.dp_size)))
        self.cfg = cfg
        self.batch_size = cfg.data.batch_size
        self.channel_names = self.train_data.channel_names
        self.tokens_per_sample = (rows // p) * (columns // p)
        loader = dict(batch_size=self.batch_size, dp_rank=dims.dp_rank(info.rank), dp_size=dims.dp_size,
                      device=self.device, num_workers=d.num_workers, pin_memory=d.pin_memory)
        stream = ERA5DaliBatches if d.loader == "dali" else ERA5Batches
        self.batches = stream(self.train_data, seed=cfg.train.seed, persistent_workers=d.persistent_workers,
                              prefetch_factor=d.prefetch_factor, accum=cfg.train.grad_accum, **loader)
        # At most eval_iters global batches, the split's first samples: the same ones in every layout.
        global_batch = self.batch_size * dims.dp_size * cfg.train.grad_accum
        self.eval = eval_batches(self.valid_data, limit=cfg.train.eval_iters * global_batch, **loader)
        self.iters_per_epoch = self.batches.steps_per_epoch
        self.first = None  # the first validation sample's u10 (forecast, truth, std, mean, name), for the plot

    def build_model(self) -> ViT:
        return build_model(self.cfg, self.data_facts())

    def build_layout(self, model: ViT, mesh):
        return build_vit_layout(model, self.cfg, self.dims, mesh, self.device, self.info.rank)  # the spec's too

    def data_facts(self) -> dict:
        """What the model's build takes from the data (the grid after cropping, the channels)."""
        return {"img_size": list(self.train_data.img_size), "channels": self.train_data.num_channels}

    def describe(self) -> str:
        rows, columns = self.train_data.img_size
        return (f"batch {self.batch_size} fields of {self.train_data.num_channels}×{rows}×{columns} "
                f"({self.tokens_per_sample} patch tokens each) per data-parallel rank and micro-step")

    # ---- evaluation ------------------------------------------------------------------------------------------
    def evaluate(self, layout, autocast, it: int) -> dict[str, float]:
        """Validation loss and skill, each the mean over the validation samples seen (per-sample RMSE first,
        as WeatherBench and NERSC average it)."""
        data, vit = self.valid_data, layout.vit
        u10 = self.channel_names.index("u10") if "u10" in self.channel_names else 0
        headline = [c for c in HEADLINE if c in self.channel_names]
        # Weighted sums: [weight, loss, rmse u10, persistence u10, latitude-weighted rmse per channel]
        sums = torch.zeros(4 + len(self.channel_names), dtype=torch.float64, device=self.device)
        self.first = None
        for number, (x, y, weight) in enumerate(track(self.eval, "eval valid", total=len(self.eval),
                                                      is_main=self.info.is_main)):
            pred = layout.predict(x, autocast)
            for i in torch.nonzero(weight).flatten().tolist():
                p, truth, now = pred[i:i + 1], y[i:i + 1].float(), x[i:i + 1].float()
                w = float(weight[i])
                sums[0] += w
                sums[1] += w * vit.loss(p, truth).double()
                sums[2] += w * rmse(p, truth, stds=data.stds, channel=u10).double()
                sums[3] += w * rmse(now, truth, stds=data.stds, channel=u10).double()
                sums[4:] += w * latitude_weighted_rmse(p, truth, data.lat, stds=data.stds).double()
                if self.first is None and number == 0:
                    self.first = (p[0, u10], truth[0, u10], data.stds[u10], data.means[u10], self.channel_names[u10])
        if dist.is_initialized() and dist.get_world_size() > 1:
            # The ranks of one replica (tp, cp) add the same sums: the factor cancels in the ratios below.
            with collective("all_reduce of the validation metrics", self.info.timeout_s):
                dist.all_reduce(sums)
        mean = (sums[1:] / sums[0]).tolist()
        row = {"val_loss": mean[0], "val_rmse_u10": mean[1], "persistence_rmse_u10": mean[2]}
        row["val_skill_u10"] = 1.0 - mean[1] / mean[2] if mean[2] > 0 else float("nan")
        for name in headline:
            row[f"val_wrmse_{name}"] = mean[3 + self.channel_names.index(name)]
        return row

    def after_eval(self, it: int, layout, autocast, sinks, result) -> None:
        """Rank 0 plots the first validation sample's forecast, truth and error of u10 in physical units."""
        if not self.info.is_main or self.first is None:
            return

        pred, truth, std, mean, channel = self.first
        to_physical = lambda field: (field.float().cpu() * float(std) + float(mean)).numpy()  # noqa: E731
        path = save_forecast_png(Path(result.run_dir) / "figures" / f"{channel}_step{it:07d}.png",
                                 to_physical(pred), to_physical(truth), lat=self.valid_data.lat,
                                 title=f"{channel} at t + dt, iteration {it}", channel=channel, units=channel_units([channel])[0])
        sinks.log_image(it, f"forecast/{channel}", path)
