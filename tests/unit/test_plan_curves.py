"""The planner's GPU side from measured curves: the shipped H100 GEMM and SDPA tables (plan/data/h100_curves.json),
read at their grid points and interpolated between them, as they are for the DGX H100 and scaled by the peak ratio
for every other system; on a CUDA GPU of one's own, the same tables measured once and cached in the machine profile
(the CUDA parts faked here)."""

from __future__ import annotations

import itertools
import json
import math
from types import SimpleNamespace

import pytest
import torch

from meshtrain.commands import machine as machine_command
from meshtrain.machine import hardware, measure, profile, survey
from meshtrain.machine.hardware import Hardware
from meshtrain.plan import machines, systems
from meshtrain.plan.machines import GemmTable, SdpaTable
from meshtrain.plan.measured import this_machine

SHIPPED = machines.shipped_curves()
H100_BF16, H100_TF32, H100_FP32 = 989.4e12, 494.7e12, 66.9e12  # machine/datasheet.py: NVIDIA H100 SXM, dense


def shipped(kind: str, label: str, *key) -> float:
    """The measured FLOP/s of one shipped row: (m, k, n) for gemm, (T, head_dim, causal) for sdpa."""
    (rate,) = [row[-1] for row in SHIPPED[kind][label] if tuple(row[:-1]) == key]
    return rate


def log_middle(a: float, b: float) -> float:
    return math.sqrt(a * b)


# ------------------------------------------------------------------------------------------- the tables
def test_the_shipped_file_says_where_it_was_measured_and_covers_the_grid():
    source = SHIPPED["source"]
    assert source["device"] == "NVIDIA H100 80GB HBM3" and source["torch"] == "2.11.0+cu130"
    assert "benchmarks/gpu_curves.py" in source["command"]
    for label in ("bf16", "tf32", "fp32"):
        assert len(SHIPPED["gemm"][label]) == len(measure.GEMM_TOKENS) * len(measure.GEMM_WIDTHS) ** 2
        assert GemmTable.of(SHIPPED["gemm"][label]).axes == (measure.GEMM_TOKENS, measure.GEMM_WIDTHS,
                                                             measure.GEMM_WIDTHS)
    assert len(SHIPPED["sdpa"]["bf16"]) == len(measure.SDPA_LENGTHS) * len(measure.SDPA_HEAD_DIMS) * 2


def test_gemm_table_reads_its_measurement_at_every_grid_point():
    for label, rows in SHIPPED["gemm"].items():
        table = GemmTable.of(rows)
        for m, k, n, rate in rows:
            assert table.rate(m, k, n) == rate, (label, m, k, n)


def test_gemm_table_between_grid_points_is_between_its_neighbours_linear_in_log2():
    table = GemmTable.of(SHIPPED["gemm"]["bf16"])
    # one axis: halfway in log2 between n = 3072 and 6144 is the mean of the two measurements
    low, high = shipped("gemm", "bf16", 16384, 768, 3072), shipped("gemm", "bf16", 16384, 768, 6144)
    assert table.rate(16384, 768, log_middle(3072, 6144)) == pytest.approx((low + high) / 2, rel=1e-12)
    quarter = 2 ** (math.log2(3072) + 0.25)
    assert table.rate(16384, 768, quarter) == pytest.approx(0.75 * low + 0.25 * high, rel=1e-12)
    assert min(low, high) < table.rate(16384, 768, 4000) < max(low, high)
    # all three axes: the middle of a cell is the mean of its 8 corners, and lies between them
    corners = [shipped("gemm", "bf16", m, k, n) for m, k, n in itertools.product((4096, 16384), (768, 1536),
                                                                                   (1536, 3072))]
    middle = table.rate(log_middle(4096, 16384), log_middle(768, 1536), log_middle(1536, 3072))
    assert middle == pytest.approx(sum(corners) / 8, rel=1e-12)
    assert min(corners) < middle < max(corners)


def test_gemm_table_is_clamped_at_the_edges_of_its_grid():
    table = GemmTable.of(SHIPPED["gemm"]["bf16"])
    assert table.rate(64, 32, 100) == shipped("gemm", "bf16", 1024, 256, 256) == 4.5e12
    assert table.rate(1 << 20, 50000, 50000) == shipped("gemm", "bf16", 65536, 12288, 12288)
    assert table.rate(512, 768, 1 << 16) == shipped("gemm", "bf16", 1024, 768, 12288)  # one axis past each end


def test_a_gemm_table_must_cover_its_grid():
    rows = [[1024, 256, 256, 1e12], [1024, 256, 512, 2e12], [2048, 256, 256, 3e12]]  # (2048, 256, 512) missing
    with pytest.raises(ValueError, match="cover its grid"):
        GemmTable.of(rows)


def test_sdpa_table_by_length_nearest_head_dim_and_causal_flag():
    table = SdpaTable.of(SHIPPED["sdpa"]["bf16"])
    for length, head_dim, causal, rate in SHIPPED["sdpa"]["bf16"]:
        assert table.rate(length, head_dim, bool(causal)) == rate
    assert table.rate(1024, 64, True) == 2.356e14 and table.rate(1024, 64, False) == 1.983e14
    low, high = shipped("sdpa", "bf16", 1024, 64, 1), shipped("sdpa", "bf16", 2048, 64, 1)
    assert table.rate(log_middle(1024, 2048), 64, True) == pytest.approx((low + high) / 2, rel=1e-12)
    assert table.rate(80, 64, True) == shipped("sdpa", "bf16", 256, 64, 1)  # shorter than measured: clamped
    assert table.rate(1 << 20, 64, False) == shipped("sdpa", "bf16", 16384, 64, 0)
    assert table.rate(1024, 80, True) == table.rate(1024, 64, True)  # 80 is nearer 64 than 128 in log
    assert table.rate(1024, 96, True) == table.rate(1024, 128, True) == 3.394e14
    assert table.rate(1024, 32, False) == table.rate(1024, 64, False)


# --------------------------------------------------------------------------------------- shipped systems
def test_dgx_h100_reads_the_shipped_h100_figures():
    machine = machines.from_system(systems.get("dgx-h100"))
    # GPT-2's MLP: 16384 tokens (16 × 1024) by 768 -> 3072, in each label
    assert machine.matmul_rate("bf16", 16384, 768, 3072) == shipped("gemm", "bf16", 16384, 768, 3072) == 5.203e14
    assert machine.matmul_rate("tf32", 16384, 768, 3072) == 2.363e14
    assert machine.matmul_rate("fp32", 16384, 768, 3072) == 4.522e13  # fp32: the IEEE table, not tf32's
    assert machine.peak == pytest.approx({"bf16": H100_BF16, "fp16": H100_BF16, "tf32": H100_TF32, "fp32": H100_FP32})
    assert "as measured" in machine.sources["matmul"] and "h100_curves.json" in machine.sources["matmul"]
    assert "IEEE fp32 table" in machine.sources["matmul"]


def test_other_systems_are_the_h100_figures_times_the_peak_ratio():
    h100 = shipped("gemm", "bf16", 16384, 768, 3072)
    polaris = machines.from_system(systems.get("polaris"))  # A100: 312 TFLOP/s bf16, 156 tf32, 19.5 fp32
    assert polaris.matmul_rate("bf16", 16384, 768, 3072) == pytest.approx(h100 * 312 / 989.4, rel=1e-12)
    assert polaris.matmul_rate("bf16", 16384, 768, 3072) == pytest.approx(164.1e12, rel=1e-3)
    assert polaris.matmul_rate("tf32", 4096, 1536, 6144) == \
        pytest.approx(shipped("gemm", "tf32", 4096, 1536, 6144) * 156 / 494.7, rel=1e-12)
    assert polaris.matmul_rate("fp32", 16384, 768, 3072) == pytest.approx(4.522e13 * 19.5 / 66.9, rel=1e-12)
    assert "scaled by peak ratio 0.315" in polaris.sources["matmul"]
    assert "bf16 scaled by peak ratio 0.315" in polaris.sources["attention"]
    frontier = machines.from_system(systems.get("frontier"))  # MI250X: no tf32 units, so no tf32 table
    assert set(frontier.gemm) == {"bf16", "fp32"}
    assert frontier.matmul_rate("bf16", 16384, 768, 3072) == pytest.approx(h100 * 191.5 / 989.4, rel=1e-12)
    assert frontier.matmul_rate("tf32", 16384, 768, 3072) == frontier.matmul_rate("fp32", 16384, 768, 3072)


def test_attention_on_a_shipped_system_is_its_flops_at_the_measured_sdpa_rate():
    h100, polaris = machines.from_system(systems.get("dgx-h100")), machines.from_system(systems.get("polaris"))
    flops = 12 * 8 * 12 * 64 * 1024 * 1024  # 8 samples × 12 heads, T = 1024, head_dim 64
    assert h100.attention_s("bf16", 8, 12, 1024, 64, causal=True) == pytest.approx(flops / 2.356e14, rel=1e-12)
    assert h100.attention_s("bf16", 8, 12, 1024, 64, causal=False) == pytest.approx(flops / 1.983e14, rel=1e-12)
    assert polaris.attention_s("bf16", 8, 12, 1024, 64, causal=True) == \
        pytest.approx(flops / (2.356e14 * 312 / 989.4), rel=1e-12)
    # ring: 2 steps of 1024 × 1024 blocks, each at the rate of a 1024-long SDPA
    assert h100.attention_s("bf16", 8, 12, 1024, 64, causal=True, ring=2) == \
        pytest.approx(2 * flops / 2.356e14, rel=1e-12)
    # no fp32 attention table: the FLOPs at the fp32 matmul rate
    assert h100.attention_s("fp32", 8, 12, 1024, 64, causal=True) == \
        pytest.approx(flops / h100.matmul_rate("fp32", 8 * 1024, 64, 1024), rel=1e-12)


def test_a_machine_without_tables_keeps_the_cpu_curve_by_size():
    curve = {"fp32": [(32.0, 1e9), (1024.0, 4e10)]}
    here = machines.Machine("this", 1, 1e9, {"fp32": 4e10}, 1e10, 1e9, 1e9, 0.0, 0.0, overlap=False, curve=curve)
    assert here.matmul_rate("fp32", 1024, 1024, 1024) == pytest.approx(4e10)
    assert here.matmul_rate("fp32", 32, 32, 32) == 1e9
    middle = here.matmul_rate("fp32", 181, 181, 181)  # ~ the log-middle of 32 and 1024: geometric mean of rates
    assert middle == pytest.approx(math.sqrt(1e9 * 4e10), rel=0.01)
    assert here.matmul_rate("bf16", 1024, 1024, 1024) == here.matmul_rate("fp32", 1024, 1024, 1024)


# ------------------------------------------------------------------------------- a CUDA GPU of one's own
H100 = Hardware(kind="cuda", name="NVIDIA H100 80GB HBM3", isa="sm90", features=(), caps=(), bf16=True, fp16=True,
                why_bf16="sm90 tensor cores", cores=16, host_memory_bytes=1 << 40, device_memory_bytes=80 << 30)
FAKE_GEMM = {"bf16": 4e14, "tf32": 2e14, "fp32": 4e13}  # FLOP/s at the grid's smallest shape, doubling per axis step


def fake_gemm_curve(device, label):
    return [[m, k, n, FAKE_GEMM[label] * (1 + (m > 1024)) * (1 + (k > 256)) * (1 + (n > 256))]
            for m in (1024, 4096) for k in (256, 1024) for n in (256, 1024)]


def fake_sdpa_curve(device, label):
    return [[t, d, c, 1e14 * t / 1024 * (1 + c)] for d in (64, 128) for t in (1024, 4096) for c in (0, 1)]


@pytest.fixture()
def fake_cuda(tmp_path, monkeypatch):
    """A CUDA H100 whose timings are faked, a private machine profile, and the calls of each measurement."""
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    profile.clear()
    calls = []
    monkeypatch.setattr(hardware, "describe", lambda device: H100)
    monkeypatch.setattr(profile, "describe", lambda device: H100)
    monkeypatch.setattr(survey, "describe", lambda device: H100)
    monkeypatch.setattr(measure, "gemm_curve", lambda device, label: calls.append(("gemm", label))
                        or fake_gemm_curve(device, label))
    monkeypatch.setattr(measure, "sdpa_curve", lambda device, label: calls.append(("sdpa", label))
                        or fake_sdpa_curve(device, label))
    monkeypatch.setattr(measure, "memory_bandwidth", lambda device: {
        "gbs": 3000.0, "bytes": 1 << 30, "spread": 0.01, "threads": 1, "load": 0.1, "measured": "now"})
    monkeypatch.setattr(measure, "matmul_peak", lambda device, label: {
        "flops": FAKE_GEMM.get(label, 4e14), "n": 8192, "best_s": 0.01, "median_s": 0.01, "spread": 0.0,
        "rounds": 1, "stable": True, "threads": 1, "load": 0.1, "measured": "now"})
    monkeypatch.setattr(this_machine, "_fixed_costs", lambda device: (1e-4, 1e-6))
    yield calls
    profile.clear()


def test_curves_are_measured_once_then_come_from_memory_then_disk(fake_cuda):
    device = torch.device("cuda", 0)
    first = profile.curves(device)
    assert fake_cuda == [("gemm", "bf16"), ("gemm", "tf32"), ("gemm", "fp32"), ("sdpa", "bf16")]
    assert first["gemm"]["bf16"] == fake_gemm_curve(device, "bf16") and first["sdpa"]["bf16"][0] == [1024, 64, 0, 1e14]
    assert profile.curves(device) is first
    profile.clear()  # a new process: from the cache file
    assert profile.curves(device) == json.loads(json.dumps(first)) and len(fake_cuda) == 4
    key = profile.profile_key(H100, 0)
    assert profile.read_cache()["devices"][key]["curves"]["gemm"]["fp32"] == fake_gemm_curve(device, "fp32")
    profile.curves(device, refresh=True)
    assert len(fake_cuda) == 8


def test_this_machine_on_a_cuda_gpu_reads_the_cached_curves(fake_cuda):
    machine = this_machine.this_machine(1, "cuda:0")
    assert set(machine.gemm) == {"bf16", "tf32", "fp32"} and set(machine.sdpa) == {"bf16"}
    assert machine.curve == {} and machine.attention_timer is None  # no square curve, no attention timed on a CPU
    assert machine.matmul_rate("bf16", 1024, 256, 256) == 4e14
    assert machine.matmul_rate("bf16", 4096, 1024, 1024) == 32e14
    assert machine.matmul_rate("fp32", 4096, 256, 256) == 8e13
    assert machine.matmul_rate("bf16", 2048, 256, 256) == pytest.approx(6e14)  # halfway in log2 m
    assert machine.peak == {"bf16": 32e14, "tf32": 16e14, "fp32": 32e13}
    flops = 12 * 2 * 8 * 64 * 1024 * 1024
    assert machine.attention_s("bf16", 2, 8, 1024, 64, causal=True) == pytest.approx(flops / 2e14)
    assert "GEMM rate by shape" in machine.sources["matmul"] and machine.memory_bps == 3000e9
    this_machine.this_machine(1, "cuda:0")
    assert len(fake_cuda) == 4  # measured once


def test_the_command_shows_the_curves_on_a_cuda_gpu(fake_cuda, monkeypatch, capsys):
    monkeypatch.setattr("meshtrain.runtime.device.pick_device", lambda rank, name=None: torch.device("cuda", 0))
    args = SimpleNamespace(device="cuda", threads=None, refresh=False, ranks=None, max_bytes="64M", json=True)
    assert machine_command.run(args) == 0
    dumped = json.loads(capsys.readouterr().out)
    assert dumped["curves"]["gemm"]["bf16"] == fake_gemm_curve(None, "bf16")
    assert dumped["curves"]["sdpa"]["bf16"] == fake_sdpa_curve(None, "bf16")
    assert machine_command.run(SimpleNamespace(**{**vars(args), "json": False})) == 0
    text = capsys.readouterr().out
    assert "rates by shape for the planner" in text and "3.2 PFLOP/s" in text and "4096, 1024, 1024" in text


def test_the_command_on_a_cpu_has_no_curves(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(measure, "gemm_curve", lambda *a: pytest.fail("a CPU measures no GEMM table"))
    monkeypatch.setattr(measure, "matmul_peak", lambda device, label: {
        "flops": 1e10, "n": 512, "best_s": 0.01, "median_s": 0.01, "spread": 0.0, "rounds": 1, "stable": True,
        "threads": 1, "load": 0.1, "measured": "now"})
    monkeypatch.setattr(measure, "memory_bandwidth", lambda device: {
        "gbs": 10.0, "bytes": 1 << 28, "spread": 0.01, "threads": 1, "load": 0.1, "measured": "now"})
    profile.clear()
    try:
        assert "curves" not in survey.collect(torch.device("cpu"))
    finally:
        profile.clear()
