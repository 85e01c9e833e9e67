"""A weather forecast beside the truth, as one PNG: forecast | truth | forecast - truth.

Drawn with matplotlib's Agg canvas on a Figure of its own, never through pyplot: pyplot keeps global
figures and picks a GUI backend, and a training job on a compute node has no display and must not leak
a figure per validation step.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

FIGSIZE = (15.0, 4.0)  # inches: three panels side by side
DPI = 100  # so the image is 1500 x 400 pixels
FIELD_COLOURS = "viridis"
DIFFERENCE_COLOURS = "RdBu_r"  # blue below zero, red above, white at zero


def _as_array(name: str, values) -> np.ndarray:
    if hasattr(values, "detach"):  # a torch tensor, maybe bf16 and on a GPU
        values = values.detach().float().cpu().numpy()
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 2:
        raise ValueError(f"{name} must be one 2-D field [H, W]; got shape {tuple(array.shape)}")
    return array


def _finite_range(*arrays: np.ndarray) -> tuple[float | None, float | None]:
    """The smallest and largest finite value of all arrays; (None, None) when there is none."""
    finite = np.concatenate([a[np.isfinite(a)] for a in arrays])
    if finite.size == 0:
        return None, None
    return float(finite.min()), float(finite.max())


def forecast_figure(forecast, truth, *, lat=None, title: str = "", channel: str = "u10", units: str = "m/s"):
    """The three panels as a matplotlib Figure on an Agg canvas (see `save_forecast_png`)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError("forecast plots need matplotlib: pip install matplotlib") from err
    forecast, truth = _as_array("forecast", forecast), _as_array("truth", truth)
    if forecast.shape != truth.shape:
        raise ValueError(f"forecast has shape {forecast.shape} but truth has shape {truth.shape}; "
                         f"plot the same channel of the same grid")
    height, width = forecast.shape
    extent = None
    if lat is not None:
        lat = np.asarray(lat, dtype=np.float64).reshape(-1)
        if lat.size != height:
            raise ValueError(f"lat has {lat.size} values but the fields have {height} rows; "
                             f"give one latitude per row")
        # Latitudes are the rows' centres, so the image reaches half a row beyond the first and last;
        # row 0 is drawn at the top, whichever way the latitudes run.
        half_row = (lat[0] - lat[-1]) / (2 * (height - 1)) if height > 1 else 0.5
        extent = (0, width, lat[-1] - half_row, lat[0] + half_row)
    difference = forecast - truth
    vmin, vmax = _finite_range(forecast, truth)
    _, largest = _finite_range(np.abs(difference))
    limit = largest or 1.0  # all equal (or no finite value): any symmetric scale shows zero as white

    figure = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, 3)
    panels = [(forecast, f"forecast {channel}", FIELD_COLOURS, vmin, vmax),
              (truth, f"truth {channel}", FIELD_COLOURS, vmin, vmax),
              (difference, f"forecast - truth {channel}", DIFFERENCE_COLOURS, -limit, limit)]
    for ax, (field, name, colours, low, high) in zip(axes, panels, strict=True):
        image = ax.imshow(field, cmap=colours, vmin=low, vmax=high, extent=extent, aspect="auto",
                          interpolation="nearest")
        ax.set_title(name)
        ax.set_xlabel("grid column")
        ax.set_ylabel("latitude (degrees)" if lat is not None else "grid row")
        figure.colorbar(image, ax=ax, label=units)
    if title:
        figure.suptitle(title)
    return figure


def save_forecast_png(path: str | os.PathLike, forecast, truth, *, lat=None, title: str = "",
                      channel: str = "u10", units: str = "m/s") -> Path:
    """Write forecast, truth and their difference (2-D [H, W], physical units) side by side to `path`.

    forecast and truth share one colour scale, so equal colours mean equal values; the difference has a
    scale symmetric about zero. With `lat` (H latitudes, one per row) the y axis is latitude. The image
    is FIGSIZE * DPI pixels, written whole or not at all (a temporary file renamed into place).
    Returns `path`."""
    figure = forecast_figure(forecast, truth, lat=lat, title=title, channel=channel, units=units)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Named after the process, not by mkstemp: mkstemp's file is private (0600), the PNG should not be.
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        figure.savefig(partial, format="png", dpi=DPI)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path
