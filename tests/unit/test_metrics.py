"""Training metrics: legend and log line, throughput, peak table and calibration, MFU, memory, timers."""

import io
import json
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from meshtrain.train import metrics
from meshtrain.train.metrics import (
    LEGEND,
    PEAK_FLOPS,
    StepTimer,
    Throughput,
    format_line,
    legend_table,
    match_device,
    mfu,
    peak_flops,
    peak_memory_bytes,
    reset_peak_memory,
    throughput,
)

T = 1e12


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Each test measures into its own cache, never the user's ~/.cache."""
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    metrics.clear_peak_cache()
    yield
    metrics.clear_peak_cache()


# ------------------------------------------------------------------------------------ legend and line
def test_legend_follows_the_seed_order_with_eval_keys_last():
    keys = list(LEGEND)
    seed = ["step", "loss", "dt", "dtf", "dtb", "sps", "sps_per_gpu", "tps", "tps_per_gpu", "mfu"]
    assert keys[: len(seed)] == seed
    evaluation = keys.index("train_loss")  # then only keys of evaluation rows
    assert keys[evaluation:evaluation + 2] == ["train_loss", "val_loss"]
    assert set(keys[evaluation:]) >= {"avg_loss", "train_s", "avg_sps", "eval_s", "peak_gb", "val_rmse_u10"}
    assert "per rank/device" in LEGEND["sps_per_gpu"] and "batch_size" in LEGEND["sps"]


def test_legend_table_renders_every_key():
    console = Console(width=200, file=io.StringIO())
    console.print(legend_table())
    text = console.file.getvalue()
    assert all(key in text for key in LEGEND)
    assert legend_table(["dt", "mfu"]).row_count == 2


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


# ------------------------------------------------------------------------------------------ peak table
@pytest.mark.parametrize("name,entry", [
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM"),
    ("NVIDIA H100", "NVIDIA H100 SXM"),
    ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe"),
    ("NVIDIA H100 NVL", "NVIDIA H100 NVL"),
    ("NVIDIA H200", "NVIDIA H200"),
    ("NVIDIA H200 NVL", "NVIDIA H200 NVL"),
    ("NVIDIA GH200 480GB", "NVIDIA GH200"),
    ("NVIDIA GH200 144G HBM3e", "NVIDIA GH200"),
    ("NVIDIA B200", "NVIDIA B200"),
    ("NVIDIA GB200", "NVIDIA GB200"),
    ("NVIDIA A100-SXM4-80GB", "NVIDIA A100"),
    ("NVIDIA A100-PCIE-40GB", "NVIDIA A100"),
    ("NVIDIA A100 80GB PCIe", "NVIDIA A100"),
    ("NVIDIA A800-SXM4-80GB", "NVIDIA A100"),
    ("NVIDIA A10", "NVIDIA A10"),
    ("NVIDIA A30", "NVIDIA A30"),
    ("NVIDIA A40", "NVIDIA A40"),
    ("NVIDIA L40S", "NVIDIA L40S"),
    ("NVIDIA L40", "NVIDIA L40"),
    ("NVIDIA L4", "NVIDIA L4"),
    ("Tesla V100-SXM2-16GB", "NVIDIA V100 SXM2"),
    ("Tesla V100-PCIE-32GB", "NVIDIA V100 PCIe"),
    ("Tesla V100S-PCIE-32GB", "NVIDIA V100S PCIe"),
    ("Tesla T4", "NVIDIA T4"),
    ("AMD Instinct MI250X", "AMD Instinct MI250X (one GCD)"),
    ("AMD Instinct MI250X/MI250", "AMD Instinct MI250X (one GCD)"),
    ("AMD Instinct MI250", "AMD Instinct MI250 (one GCD)"),
    ("AMD Instinct MI210", "AMD Instinct MI210"),
    ("AMD Instinct MI300X", "AMD Instinct MI300X"),
    ("AMD Instinct MI300A", "AMD Instinct MI300A"),
    ("AMD Instinct MI325X", "AMD Instinct MI325X"),
    ("Intel(R) Data Center GPU Max 1550", "Intel Data Center GPU Max 1550 (one stack)"),
])
def test_device_names_match_their_entry(name, entry):
    assert match_device(name).name == entry


@pytest.mark.parametrize("name", ["NVIDIA A10G", "NVIDIA GeForce RTX 4090", "Apple M2 Max", "AMD EPYC 7763", "",
                                  "Intel(R) Data Center GPU Max 1100", "NVIDIA H20"])
def test_unknown_devices_match_nothing(name):
    assert match_device(name) is None


def test_table_figures_are_dense_and_consistent():
    h100 = PEAK_FLOPS["NVIDIA H100 SXM"].flops
    assert h100["bf16"] == pytest.approx(989.4 * T) and h100["fp32"] == pytest.approx(66.9 * T)
    for same_chip in ("NVIDIA H200", "NVIDIA GH200"):
        assert PEAK_FLOPS[same_chip].flops["bf16"] == h100["bf16"]
    assert PEAK_FLOPS["NVIDIA A100"].flops["bf16"] == 312 * T and PEAK_FLOPS["NVIDIA A100"].flops["tf32"] == 156 * T
    assert PEAK_FLOPS["AMD Instinct MI250X (one GCD)"].flops["bf16"] == 383 * T / 2
    for entry in PEAK_FLOPS.values():
        f = entry.flops
        assert f["fp32"] and entry.source
        for key in ("bf16", "fp16", "tf32"):
            assert f[key] is None or f[key] >= f["fp32"], entry.name
        assert f["tf32"] is None or f["fp16"] is None or f["tf32"] <= f["fp16"], entry.name


def _fake_accelerator(monkeypatch, kind, name):
    monkeypatch.setattr(getattr(torch, kind), "get_device_name", lambda device=None: name, raising=False)
    return torch.device(kind, 0)


def test_known_accelerator_takes_its_table_figure(monkeypatch):
    device = _fake_accelerator(monkeypatch, "cuda", "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(metrics, "_fp32_mode", lambda device: "ieee")
    flops, source = peak_flops(device, torch.bfloat16)
    assert flops == pytest.approx(989.4 * T)
    assert source.startswith("table: NVIDIA H100 SXM bf16 dense 989.4 TFLOP/s (")
    assert peak_flops(device, torch.float32)[0] == pytest.approx(66.9 * T)
    monkeypatch.setattr(metrics, "_fp32_mode", lambda device: "tf32")  # set_float32_matmul_precision("high")
    flops, source = peak_flops(device, torch.float32)
    assert flops == pytest.approx(494.7 * T) and " tf32 dense " in source


def test_tf32_falls_back_to_fp32_where_the_part_has_none(monkeypatch):
    device = _fake_accelerator(monkeypatch, "cuda", "AMD Instinct MI250X")
    monkeypatch.setattr(metrics, "_fp32_mode", lambda device: "tf32")
    assert peak_flops(device, torch.float32)[0] == pytest.approx(47.85 * T)


def test_pvc_stack_by_default_and_card_in_composite_mode(monkeypatch):
    device = _fake_accelerator(monkeypatch, "xpu", "Intel(R) Data Center GPU Max 1550")
    monkeypatch.delenv("ZE_FLAT_DEVICE_HIERARCHY", raising=False)
    assert peak_flops(device, torch.bfloat16)[0] == pytest.approx(419.4 * T)
    monkeypatch.setenv("ZE_FLAT_DEVICE_HIERARCHY", "COMPOSITE")
    assert peak_flops(device, torch.bfloat16)[0] == pytest.approx(838.8 * T)


def test_unknown_accelerator_and_missing_dtype_are_measured(monkeypatch):
    monkeypatch.setattr(metrics, "_measure_matmul", lambda device, dtype: (123 * T, 8192))
    device = _fake_accelerator(monkeypatch, "cuda", "NVIDIA Mystery 9000")
    assert peak_flops(device, torch.bfloat16) == (123 * T, "measured: 8192² bf16 matmul, 123 TFLOP/s on "
                                                             "NVIDIA Mystery 9000")
    device = _fake_accelerator(monkeypatch, "cuda", "Tesla V100-SXM2-32GB")  # no bf16 units: torch emulates
    assert peak_flops(device, torch.bfloat16)[1].startswith("measured: ")
    assert peak_flops(device, torch.float16)[0] == 125 * T


def test_override_wins():
    assert peak_flops("cpu", torch.bfloat16, override=123e12) == (123e12, "override: 123 TFLOP/s")
    with pytest.raises(ValueError, match="must be > 0"):
        peak_flops("cpu", torch.bfloat16, override=0)
    with pytest.raises(ValueError, match="no peak for dtype"):
        peak_flops("cpu", torch.int8)


def test_fp32_mode_reads_torchs_precision_setting(monkeypatch):
    cuda = torch.device("cuda", 0)
    for mode in ("tf32", "ieee"):
        monkeypatch.setattr(torch.backends.cuda, "matmul", SimpleNamespace(fp32_precision=mode))
        assert metrics._fp32_mode(cuda) == mode
    monkeypatch.setattr(torch.backends.cuda, "matmul", SimpleNamespace())  # torch without fp32_precision
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert metrics._fp32_mode(cuda) == "tf32"


# ----------------------------------------------------------------------------------------- calibration
def test_cpu_calibration_measures_a_positive_peak_and_caches_it():
    started = time.perf_counter()
    flops, source = peak_flops("cpu", torch.float32)
    assert time.perf_counter() - started < 5
    threads = torch.get_num_threads()
    assert flops > 1e8  # any CPU this decade does 0.1 GFLOP/s of fp32 matmul
    assert source.startswith("measured: ") and "² fp32 matmul, " in source and f"{threads} thread" in source
    cached = json.loads(metrics.cache_path().read_text())
    (key,) = cached
    assert key.startswith("cpu|") and f"|fp32|threads={threads}|" in key and cached[key]["flops"] == flops


def test_calibration_runs_once_then_comes_from_memory_then_disk(monkeypatch):
    calls = []

    def fake(device, dtype):
        calls.append(dtype)
        return 50e9 * len(calls), 1024

    monkeypatch.setattr(metrics, "_measure_matmul", fake)
    first = peak_flops("cpu", torch.bfloat16)
    assert peak_flops("cpu", torch.bfloat16) == first and len(calls) == 1
    metrics.clear_peak_cache()  # a new process: memory empty, disk file kept
    assert peak_flops("cpu", torch.bfloat16) == first and len(calls) == 1
    peak_flops("cpu", torch.float32)  # another dtype is another calibration
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)  # and so is another thread count
    peak_flops("cpu", torch.bfloat16)
    assert calls == [torch.bfloat16, torch.float32, torch.bfloat16]
    metrics.clear_peak_cache(disk=True)
    assert not metrics.cache_path().exists()


def test_a_broken_or_unwritable_cache_only_costs_a_measurement(monkeypatch, tmp_path):
    monkeypatch.setattr(metrics, "_measure_matmul", lambda device, dtype: (1e9, 256))
    metrics.cache_path().parent.mkdir(parents=True)
    metrics.cache_path().write_text("{not json")
    assert peak_flops("cpu", torch.bfloat16)[0] == 1e9
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(blocker / "sub"))  # cannot mkdir under a file
    metrics.clear_peak_cache()
    assert peak_flops("cpu", torch.float32)[0] == 1e9


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
