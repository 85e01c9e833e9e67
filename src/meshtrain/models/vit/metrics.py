"""Forecast skill of the ViT weather model: RMSE per channel, in physical units, optionally latitude-weighted.

Both metrics follow WeatherBench (Rasp et al. 2020, eq. 1), which is also what NERSC's `weighted_rmse` computes:
the RMSE of each sample (one forecast) over the grid first, square root included, then the mean of those RMSEs
over the batch. (WeatherBench 2 instead averages the squared error over forecasts before the square root; that
is larger or equal, by Jensen.) The per-sample convention makes the metric independent of the batch size: the
mean over batches of equal size, or a sample-weighted mean over unequal ones, is the mean over the data set.

Fields arrive normalised per channel (x = (value - mean) / std). Undoing that in a difference leaves
(pred - target) * std: the mean cancels, so an RMSE needs only the stds.

Latitude weighting: a row of a regular latitude-longitude grid covers area proportional to cos(latitude), so the
squared error of each row is weighted by w(lat) = cos(lat) / mean over the rows of cos(lat) (mean 1, so equal
errors everywhere give the plain RMSE). The rows are those of the (cropped) grid: pass `dataset.lat`.
"""

from __future__ import annotations

import torch

from meshtrain.data.era5 import latitude_weights


def _as_batch(pred: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if pred.shape != target.shape:
        raise ValueError(f"prediction {list(pred.shape)} and target {list(target.shape)} differ in shape")
    if pred.dim() == 3:  # one sample [C, H, W]
        pred, target = pred.unsqueeze(0), target.unsqueeze(0)
    if pred.dim() != 4:
        raise ValueError(f"expected fields [B, C, H, W] or [C, H, W], got {list(pred.shape)}")
    return pred.float(), target.float()


def _stds_tensor(stds, num_channels: int, like: torch.Tensor) -> torch.Tensor:
    stds = torch.as_tensor(stds, dtype=torch.float64).reshape(-1)
    if stds.numel() != num_channels:
        raise ValueError(f"stds has {stds.numel()} values but the fields have {num_channels} channels: pass the "
                         "dataset's `stds` (of the selected channels)")
    return stds.to(device=like.device, dtype=like.dtype)


def rmse(pred: torch.Tensor, target: torch.Tensor, *, means=None, stds=None, channel: int = 0) -> torch.Tensor:
    """Unweighted RMSE of one channel, 0-dim: per sample over the grid, then the mean over the batch.

    pred and target are normalised fields [B, C, H, W] or [C, H, W]. With `stds` (per channel, e.g. dataset.stds)
    the result is in physical units, otherwise in normalised units. `means` is accepted for symmetry with
    `denormalise` and checked for length, but cannot change the result: it cancels in pred - target.
    """
    pred, target = _as_batch(pred, target)
    C = pred.shape[1]
    if not -C <= channel < C:
        raise ValueError(f"channel {channel} is out of range for {C} channels")
    if means is not None and torch.as_tensor(means).numel() != C:
        raise ValueError(f"means has {torch.as_tensor(means).numel()} values but the fields have {C} channels")
    diff = pred[:, channel] - target[:, channel]
    per_sample = diff.square().mean(dim=(-2, -1)).sqrt()
    if stds is not None:
        per_sample = per_sample * _stds_tensor(stds, C, per_sample)[channel]
    return per_sample.mean()


def latitude_weighted_rmse(pred: torch.Tensor, target: torch.Tensor, lat, stds=None) -> torch.Tensor:
    """Latitude-weighted RMSE of every channel, [C]: mean over the batch of sqrt(mean over lat, lon of w(lat) * err^2).

    lat: the latitude in degrees of each of the H rows (dataset.lat). stds: per-channel standard deviations for
    physical units (dataset.stds); without them the result is in normalised units, as NERSC logs it.
    """
    pred, target = _as_batch(pred, target)
    H = pred.shape[-2]
    weights = latitude_weights(lat)
    if weights.numel() != H:
        raise ValueError(f"lat has {weights.numel()} rows but the fields have {H}: pass the latitudes of the cropped "
                         "grid (dataset.lat)")
    weights = weights.to(device=pred.device, dtype=pred.dtype).reshape(H, 1)
    per_sample = ((pred - target).square() * weights).mean(dim=(-2, -1)).sqrt()  # [B, C]
    if stds is not None:
        per_sample = per_sample * _stds_tensor(stds, pred.shape[1], per_sample)
    return per_sample.mean(dim=0)
