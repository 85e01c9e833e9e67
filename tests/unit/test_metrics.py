"""Training metrics: legend and log line, throughput, MFU and its guard, memory, timers."""

import io
import sys
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from meshtrain.machine.profile import Peak
from meshtrain.train import metrics
from meshtrain.train.metrics import (
    LEGEND,
    MFUMeter,
    StepTimer,
    Throughput,
    format_line,
    legend_table,
    mfu,
    peak_memory_bytes,
    reset_peak_memory,
    throughput,
)

T = 1e12


# ------------------------------------------------------------------------------------ legend and line
def test_legend_follows_the_seed_order_with_eval_keys_last():
    keys = list(LEGEND)
    seed = ["step", "loss", "dt", "dtf", "dtb", "sps", "sps_per_gpu", "tps", "tps_per_gpu", "mfu"]
    assert keys[: len(seed)] == seed
    evaluation = keys.index("train_loss")  # then only keys of evaluation rows
    assert keys[evaluation:evaluation + 2] == ["train_loss", "val_loss"]
    assert set(keys[evaluation:]) >= {"avg_loss", "train_s", "avg_sps", "eval_s", "peak_gb"}
    assert "per rank/device" in LEGEND["sps_per_gpu"] and "batch_size" in LEGEND["sps"]


def test_legend_table_renders_every_key():
    console = Console(width=200, file=io.StringIO())
    console.print(legend_table())
    text = console.file.getvalue()
    assert all(key in text for key in LEGEND)
    assert legend_table(["dt", "mfu"]).row_count == 2


def test_a_model_adds_its_own_keys_to_the_legend():
    from meshtrain import registry

    vit = registry.get("vit").legend
    assert "val_rmse_u10" in vit and "val_rmse_u10" not in LEGEND
    table = legend_table(extra=vit)
    assert table.row_count == len(LEGEND) + len(vit)


def test_format_line_exact():
    row = {"val_loss": 3.2, "custom": 7, "step": 10, "loss": 3.15431, "dt": 0.282833, "dtf": 0.005247,
           "dtb": 0.011417, "sps": 452.5, "sps_per_gpu": 113.125, "tps": 115840.0, "tps_per_gpu": 28960.0,
           "mfu": 12.3456, "train_loss": torch.tensor(3.1), "lr": 6e-4, "grad_norm": None, "ratio": 0.123456789}
    assert format_line(row) == (
        "step=10 loss=3.154310 dt=0.282833 dtf=0.005247 dtb=0.011417 sps=452.500 sps_per_gpu=113.125 "
        "tps=115840.000 tps_per_gpu=28960.000 mfu=12.35 lr=6.000e-04 train_loss=3.100000 val_loss=3.200000 "
        "custom=7 ratio=0.123457")


def test_format_line_skips_absent_keys():
    assert format_line({"step": 3, "mem_gb": 1.5, "loss": float("nan")}) == "step=3 loss=nan mem_gb=1.500"


# ------------------------------------------------------------------------------------------ throughput
def test_sps_counts_batch_times_accumulation_times_data_parallel_ranks():
    # The seed's sps was grad_accum × ranks / dt: it forgot the batch size. Here 8 × 4 × 2 / 0.5 = 128.
    rates = throughput(batch_size=8, grad_accum=4, dp_size=2, world_size=4, block_size=256, dt=0.5)
    assert rates == {"sps": 128.0, "sps_per_gpu": 32.0, "tps": 32768.0, "tps_per_gpu": 8192.0}
    assert rates["sps"] != 4 * 2 / 0.5


def test_tensor_parallel_ranks_do_not_multiply_samples():
    # 4 ranks as 2 replicas × TP 2: two batches per iteration, shared over four devices.
    rates = Throughput(batch_size=1, grad_accum=1, dp_size=2, world_size=4).rates(1.0)
    assert rates == {"sps": 2.0, "sps_per_gpu": 0.5}  # no block_size: no token rates


@given(st.integers(1, 64), st.integers(1, 16), st.integers(1, 8), st.integers(1, 4), st.integers(1, 4096),
       st.floats(1e-3, 1e3))
def test_tps_is_sps_times_block(batch, accum, dp, tp, block, dt):
    rates = throughput(batch, accum, dp, dp * tp, block, dt)
    assert rates["sps"] * dt == pytest.approx(batch * accum * dp)
    assert rates["tps"] == pytest.approx(rates["sps"] * block)
    assert rates["tps_per_gpu"] == pytest.approx(rates["tps"] / (dp * tp))


def test_throughput_rejects_impossible_layouts():
    with pytest.raises(ValueError, match="must divide"):
        Throughput(batch_size=1, dp_size=3, world_size=4)
    with pytest.raises(ValueError, match="dt must be > 0"):
        throughput(1, 1, 1, 1, 8, 0.0)


# ------------------------------------------------------------------------------------------------- mfu
def test_mfu_by_hand():
    # GPT-2 small on one A100: 6N + 12·L·H·Q·T = 6·124e6 + 12·12·12·64·1024 FLOPs per token.
    per_token = 6 * 124e6 + 12 * 12 * 12 * 64 * 1024
    assert per_token == 857_246_208
    assert mfu(per_token, 100_000, 312e12) == pytest.approx(100 * 857_246_208 * 100_000 / 312e12)
    assert mfu(per_token, 100_000, 312e12) == pytest.approx(27.47584, rel=1e-6)


def test_mfu_is_not_clamped():
    assert mfu(2e9, 1_000, 1e12) == pytest.approx(200.0)
    with pytest.raises(ValueError):
        mfu(1.0, 1.0, 0.0)


def _peak(flops, kind="measured"):
    return Peak(flops, "fp32", kind, f"{kind}: {flops:g} FLOP/s")


def test_mfu_meter_passes_a_possible_figure_without_measuring():
    calls = []
    meter = MFUMeter(1e6, _peak(1e12), remeasure=lambda: calls.append(1))
    assert meter(500_000) == (pytest.approx(50.0), None) and calls == []


def test_an_impossible_mfu_measures_the_peak_again_once():
    calls = []

    def remeasure():  # the first peak was taken on a busy box: the second is 4× higher
        calls.append(1)
        return _peak(4e12)

    meter = MFUMeter(1e6, _peak(1e12), remeasure=remeasure)
    value, warning = meter(3_000_000)  # 3e12 FLOP/s achieved against a 1e12 peak: 300%
    assert value == pytest.approx(75.0) and warning is None and len(calls) == 1
    assert meter(3_000_000) == (pytest.approx(75.0), None) and len(calls) == 1
    assert meter.peak.flops == 4e12


def test_an_mfu_that_stays_impossible_carries_a_warning_naming_the_peak():
    calls = []
    meter = MFUMeter(1e6, _peak(1e12), remeasure=lambda: calls.append(1) or _peak(1.1e12))
    value, warning = meter(3_000_000)
    assert value == pytest.approx(300 / 1.1) and len(calls) == 1
    assert warning.startswith("mfu 273% is impossible: the peak (measured: 1.1e+12 FLOP/s) is below what this run "
                              "achieves (3e+12 FLOP/s)")
    assert "meshtrain machine --refresh" in warning
    value, warning = meter(3_000_000)  # measured once only: later intervals warn without measuring again
    assert len(calls) == 1 and warning and value > 100


@pytest.mark.parametrize("kind,fix", [("datasheet", "datasheet table"), ("override", "raise train.peak_flops")])
def test_table_and_override_peaks_are_not_measured_but_warned_about(kind, fix):
    value, warning = MFUMeter(1e6, _peak(1e12, kind))(2_000_000)
    assert value == pytest.approx(200.0) and f"({kind}: 1e+12 FLOP/s)" in warning and fix in warning


# ---------------------------------------------------------------------------------------------- memory
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the RSS high-water reset is Linux's clear_refs")
def test_cpu_peak_memory_follows_the_rss_high_water_mark():
    reset_peak_memory("cpu")
    before = peak_memory_bytes("cpu")
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, written so the pages are resident
    assert peak_memory_bytes("cpu") >= before + 60 * 2**20
    del block
    reset_peak_memory("cpu")
    assert peak_memory_bytes("cpu") < before + 32 * 2**20


def test_accelerator_peak_memory_is_max_allocated(monkeypatch):
    resets = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 123)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    assert peak_memory_bytes("cuda:0") == 123
    reset_peak_memory("cuda:1")
    assert resets == [torch.device("cuda", 1)]


# ---------------------------------------------------------------------------------------------- timers
def test_step_timer_sums_sections_and_synchronises(monkeypatch):
    syncs = []
    monkeypatch.setattr(metrics, "synchronize", lambda device: syncs.append(device))
    timer = StepTimer("cpu")
    with timer("dt"):
        for _ in range(2):
            with timer("dtf"):
                time.sleep(0.01)
            with timer("dtb"):
                time.sleep(0.005)
    out = timer.pop()
    assert set(out) == {"dt", "dtf", "dtb"}
    assert out["dtf"] >= 0.02 and out["dtb"] >= 0.01 and out["dt"] >= out["dtf"] + out["dtb"]
    assert len(syncs) == 2 * 5 and timer.pop() == {}
    quiet = StepTimer("cpu", sync=False)
    with quiet("dt"):
        pass
    assert len(syncs) == 10 and quiet.pop()["dt"] >= 0
