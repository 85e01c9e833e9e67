"""Forecast plots: a PNG of the promised size, the colour scales the panels must share, and no pyplot."""

import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib", reason="forecast plots need matplotlib")
import matplotlib  # noqa: E402
import matplotlib.image  # noqa: E402

from meshtrain.models.vit.plot import DPI, FIGSIZE, forecast_figure, save_forecast_png  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fields(height=5, width=8):
    truth = np.arange(height * width, dtype=np.float64).reshape(height, width) - 10.0  # -10 .. 29
    forecast = truth.copy()
    forecast[4, 7] += 3.0  # 32: the forecast holds the largest value,
    forecast[0, 0] -= 4.5  # -14.5: and the smallest
    return forecast, truth


def test_png_is_written_whole_with_the_promised_size(tmp_path):
    forecast, truth = fields()
    backend = matplotlib.get_backend()
    path = save_forecast_png(tmp_path / "plots" / "step_100.png", torch.tensor(forecast, dtype=torch.bfloat16),
                             truth, lat=np.linspace(90, -90, 5), title="step 100", channel="u10")
    assert path == tmp_path / "plots" / "step_100.png"
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 0
    assert matplotlib.image.imread(path).shape == (round(FIGSIZE[1] * DPI), round(FIGSIZE[0] * DPI), 4)
    assert [p.name for p in path.parent.iterdir()] == ["step_100.png"]  # no temporary file left
    assert matplotlib.get_backend() == backend


def test_fields_share_a_scale_and_the_difference_is_symmetric():
    forecast, truth = fields()
    figure = forecast_figure(forecast, truth, channel="t2m", units="K")
    panels = [ax for ax in figure.axes if ax.images and ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["forecast t2m", "truth t2m", "forecast - truth t2m"]
    assert [ax.images[0].get_clim() for ax in panels] == [(-14.5, 32.0), (-14.5, 32.0), (-4.5, 4.5)]
    np.testing.assert_array_equal(panels[2].images[0].get_array(), forecast - truth)
    assert [ax.get_ylabel() for ax in panels] == ["grid row"] * 3
    colour_bars = [ax for ax in figure.axes if ax not in panels]
    assert [ax.get_ylabel() for ax in colour_bars] == ["K"] * 3


def test_latitude_labels_the_rows():
    forecast, truth = fields()
    figure = forecast_figure(forecast, truth, lat=[90.0, 45.0, 0.0, -45.0, -90.0])
    ax = figure.axes[0]
    # Row centres at the given latitudes: the image spans half a row (22.5 degrees) beyond each end.
    assert ax.images[0].get_extent() == [0, 8, -112.5, 112.5]
    assert ax.get_ylabel() == "latitude (degrees)"


def test_equal_fields_still_plot():
    truth = np.full((3, 4), 7.0)
    figure = forecast_figure(truth, truth)
    assert figure.axes[2].images[0].get_clim() == (-1.0, 1.0)


@pytest.mark.parametrize("forecast_shape,truth_shape,lat,match", [
    ((5, 8), (5, 7), None, r"forecast has shape \(5, 8\) but truth has shape \(5, 7\)"),
    ((5, 8, 1), (5, 8, 1), None, r"forecast must be one 2-D field \[H, W\]; got shape \(5, 8, 1\)"),
    ((5, 8), (5, 8), np.zeros(4), "lat has 4 values but the fields have 5 rows"),
])
def test_bad_input_is_refused_and_no_file_is_written(tmp_path, forecast_shape, truth_shape, lat, match):
    with pytest.raises(ValueError, match=match):
        save_forecast_png(tmp_path / "x.png", np.zeros(forecast_shape), np.zeros(truth_shape), lat=lat)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.distributed  # starts a fresh interpreter
def test_plotting_never_imports_pyplot(tmp_path):
    # In a fresh interpreter, since this one's tests may have imported pyplot already.
    script = ("import sys, numpy as np; from meshtrain.models.vit.plot import save_forecast_png; "
              f"save_forecast_png({str(tmp_path / 'a.png')!r}, np.ones((2, 3)), np.zeros((2, 3))); "
              "print('matplotlib.pyplot' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False" and (tmp_path / "a.png").exists()
