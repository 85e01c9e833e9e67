"""The machine profile: hardware facts, the dtype auto picks, peak selection and the measured-figure cache."""

import json
import time
from types import SimpleNamespace

import pytest
import torch

from meshtrain.commands import machine as machine_command
from meshtrain.machine import hardware, measure, precision, profile
from meshtrain.machine.datasheet import PEAK_FLOPS, match_device
from meshtrain.machine.hardware import Hardware, cpu_bf16, cpu_caps, cpu_flags
from meshtrain.machine.profile import peak_flops

T = 1e12


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Each test measures into its own cache, never the user's ~/.cache."""
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    profile.clear()
    yield
    profile.clear()


def fake_measure(monkeypatch, flops=50e9, load=0.0, calls=None):
    """measure.matmul_peak without timing: `flops` (or flops(label, call number)), recording each call."""
    calls = [] if calls is None else calls

    def matmul_peak(device, label):
        calls.append(label)
        value = flops(label, len(calls)) if callable(flops) else flops
        return {"flops": value, "n": 1024, "best_s": 0.01, "median_s": 0.01, "spread": 0.0, "rounds": 1,
                "stable": True, "threads": torch.get_num_threads(), "load": load, "measured": "now"}

    monkeypatch.setattr(measure, "matmul_peak", matmul_peak)
    return calls


# ------------------------------------------------------------------------------------------ CPU facts
X86_AVX2 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx avx2 fma\n\nprocessor\t: 1\nflags : x"
X86_SPR = "model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile avx512_fp16"
ARM_V2 = "processor\t: 0\nBogoMIPS\t: 2000.00\nFeatures\t: fp asimd evtstrm sve bf16 asimdhp fphp i8mm\n"


def test_cpu_flags_read_x86_flags_and_arm_features():
    assert cpu_flags(X86_AVX2) == {"fpu", "sse", "avx", "avx2", "fma"}  # the first core's line only
    assert {"avx512_bf16", "amx_bf16", "avx512_fp16"} <= cpu_flags(X86_SPR)
    assert {"asimd", "sve", "bf16", "fphp"} <= cpu_flags(ARM_V2)


@pytest.mark.parametrize("flags,capability,caps,native,why", [
    ({"avx2"}, "AVX2", (), False, "AVX2 without avx512_bf16 or AMX"),
    ({"avx2", "avx512f"}, "AVX512", (), False, "AVX-512 without avx512_bf16 or AMX"),
    ({"avx2", "avx512f", "avx512_bf16"}, "AVX512", (), True, "avx512_bf16"),
    ({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, "AVX512", (), True, "avx512_bf16 + amx_bf16"),
    # the emulation of an AVX2-only box on a big one: either cap takes the bf16 units away
    ({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, "AVX2", ("ATEN_CPU_CAPABILITY=avx2", "ONEDNN_MAX_CPU_ISA=AVX2"),
     False, "avx512_bf16 + amx_bf16 capped by ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2"),
    ({"avx512f", "avx512_bf16"}, "AVX512", ("ONEDNN_MAX_CPU_ISA=AVX512_CORE",), False, "capped by ONEDNN"),
    ({"avx512f", "avx512_bf16"}, "AVX512", ("ONEDNN_MAX_CPU_ISA=AVX512_CORE_AMX",), True, "avx512_bf16"),
    ({"avx512f", "amx_bf16"}, "DEFAULT", ("ATEN_CPU_CAPABILITY=default",), False, "capped"),
    ({"asimd", "bf16"}, "SVE256", (), True, "bf16"),
    ({"asimd"}, "DEFAULT", (), False, "Arm without the BF16 extension"),
])
def test_cpu_bf16_needs_the_units_and_no_cap(flags, capability, caps, native, why):
    got, reason = cpu_bf16(flags, capability, caps)
    assert got is native and why in reason


def test_cpu_caps_come_from_the_environment():
    assert cpu_caps({}) == ()
    assert cpu_caps({"ATEN_CPU_CAPABILITY": "avx2", "DNNL_MAX_CPU_ISA": "AVX2"}) == (
        "ATEN_CPU_CAPABILITY=avx2", "ONEDNN_MAX_CPU_ISA=AVX2")


def test_this_cpu_is_described_consistently():
    hw = hardware.describe("cpu")
    assert hw.kind == "cpu" and hw.name and hw.cores >= 1 and hw.host_memory_bytes > 2**28
    assert hw.isa == torch.backends.cpu.get_cpu_capability()
    assert (hw.bf16, hw.why_bf16) == cpu_bf16(cpu_flags(), hw.isa, cpu_caps())


def _gpu(monkeypatch, name, major, minor, native_bf16):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(major=major, minor=minor, total_memory=80 << 30))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native_bf16)
    monkeypatch.setattr(torch.version, "hip", None)
    return torch.device("cuda", 0)


@pytest.mark.parametrize("name,major,minor,native,dtype,why", [
    ("NVIDIA H100 80GB HBM3", 9, 0, True, "bf16", "computes bf16 natively (sm90 tensor cores)"),
    ("NVIDIA A100-SXM4-40GB", 8, 0, True, "bf16", "(sm80 tensor cores)"),
    ("Tesla V100-SXM2-32GB", 7, 0, False, "fp16", "no bf16 units (sm70: bf16 units start at sm80), so fp16 autocast "
                                                  "with a GradScaler"),
    ("Tesla T4", 7, 5, False, "fp16", "sm75"),
])
def test_auto_dtype_on_gpus(monkeypatch, name, major, minor, native, dtype, why):
    hw = hardware.describe(_gpu(monkeypatch, name, major, minor, native))
    assert (hw.isa, hw.bf16, hw.device_memory_bytes) == (f"sm{major}{minor}", native, 80 << 30)
    chosen = precision.choose("auto", torch.device("cuda", 0), hw)
    assert chosen.dtype == dtype and why in chosen.reason and chosen.reason.startswith(f"auto: {name}")


def _cpu_hw(bf16: bool, why: str) -> Hardware:
    return Hardware(kind="cpu", name="Some CPU", isa="AVX2", features=("avx2",), caps=(), bf16=bf16, fp16=False,
                    why_bf16=why, cores=2, host_memory_bytes=1 << 34, device_memory_bytes=None)


def test_auto_dtype_on_cpus(monkeypatch):
    calls = fake_measure(monkeypatch, flops=lambda label, n: {"bf16": 90e9, "fp32": 60e9}[label])
    native = precision.choose("auto", "cpu", _cpu_hw(True, "avx512_bf16 + amx_bf16"))
    assert native == precision.Precision("bf16", "auto: Some CPU computes bf16 natively (avx512_bf16 + amx_bf16)")
    assert sorted(calls) == ["bf16", "fp32"]  # each measured once for the choice
    emulated = precision.choose("auto", "cpu", _cpu_hw(False, "AVX2 without avx512_bf16 or AMX"))
    assert emulated.dtype == "fp32" and emulated.warning is None
    assert emulated.reason == ("auto: Some CPU has no native bf16 (AVX2 without avx512_bf16 or AMX: torch would "
                               "emulate it through fp32), so fp32")
    assert sorted(calls) == ["bf16", "fp32"]  # no bf16 units: nothing to measure


def test_auto_dtype_on_a_cpu_whose_bf16_units_are_slower_than_fp32_is_fp32(monkeypatch):
    """bf16 units that run matmuls at half fp32's rate (as on a 2-core Intel Xeon with avx512_bf16 and no AMX)."""
    fake_measure(monkeypatch, flops=lambda label, n: {"bf16": 141e9, "fp32": 303.8e9}[label])
    chosen = precision.choose("auto", "cpu", _cpu_hw(True, "avx512_bf16"))
    assert chosen == precision.Precision(
        "fp32", "auto: Some CPU has bf16 units (avx512_bf16), but its bf16 matmuls run at 141 GFLOP/s against "
                "303.8 GFLOP/s in fp32 (measured: 0.46×), so fp32")
    explicit = precision.choose("bf16", "cpu", _cpu_hw(True, "avx512_bf16"))
    assert explicit.dtype == "bf16" and explicit.warning is None  # asked for: kept, the units are real


def test_explicit_bf16_on_an_emulating_cpu_runs_with_a_warning_quoting_the_measured_ratio(monkeypatch):
    fake_measure(monkeypatch, flops=lambda label, n: {"bf16": 0.8e9, "fp32": 36e9}[label])
    chosen = precision.choose("bf16", "cpu", _cpu_hw(False, "AVX2 without avx512_bf16 or AMX"))
    assert chosen.dtype == "bf16" and chosen.reason == "train.dtype=bf16 as set"
    assert chosen.warning == ("train.dtype=bf16 on Some CPU, which has no native bf16 (AVX2 without avx512_bf16 or "
                              "AMX): bf16 matmuls run at 800 MFLOP/s against 36 GFLOP/s in fp32 here (0.0222×); "
                              "train.dtype=auto would pick fp32")
    assert precision.choose("bf16", "cpu", _cpu_hw(True, "amx_bf16")).warning is None
    assert precision.choose("fp32", "cpu", _cpu_hw(False, "x")) == precision.Precision("fp32", "train.dtype=fp32 as set")
    with pytest.raises(ValueError, match="train.dtype='fp8': choose one of auto, fp32, bf16, fp16"):
        precision.choose("fp8", "cpu")


# ------------------------------------------------------------------------------------------ datasheet
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


# ------------------------------------------------------------------------------------------ peak selection
def _fake_accelerator(monkeypatch, kind, name):
    monkeypatch.setattr(profile, "describe", lambda device: Hardware(
        kind=kind, name=name, isa=kind, features=(), caps=(), bf16=True, fp16=True, why_bf16="", cores=8,
        host_memory_bytes=1 << 36, device_memory_bytes=1 << 36))
    return torch.device(kind, 0)


def test_known_accelerator_takes_its_datasheet_figure_in_the_dtype_matmuls_run_in(monkeypatch):
    device = _fake_accelerator(monkeypatch, "cuda", "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(profile, "fp32_mode", lambda device: "ieee")
    peak = peak_flops(device, torch.bfloat16)
    assert (peak.flops, peak.label, peak.kind) == (pytest.approx(989.4 * T), "bf16", "datasheet")
    assert peak.source.startswith("datasheet: NVIDIA H100 SXM bf16 dense 989.4 TFLOP/s (")
    assert peak_flops(device, torch.float32).flops == pytest.approx(66.9 * T)
    monkeypatch.setattr(profile, "fp32_mode", lambda device: "tf32")  # set_float32_matmul_precision("high")
    peak = peak_flops(device, torch.float32)
    assert peak.flops == pytest.approx(494.7 * T) and peak.label == "tf32" and " tf32 dense " in peak.source


def test_tf32_falls_back_to_fp32_where_the_part_has_none(monkeypatch):
    device = _fake_accelerator(monkeypatch, "cuda", "AMD Instinct MI250X")
    monkeypatch.setattr(profile, "fp32_mode", lambda device: "tf32")
    assert peak_flops(device, torch.float32).flops == pytest.approx(47.85 * T)


def test_pvc_stack_by_default_and_card_in_composite_mode(monkeypatch):
    device = _fake_accelerator(monkeypatch, "xpu", "Intel(R) Data Center GPU Max 1550")
    monkeypatch.delenv("ZE_FLAT_DEVICE_HIERARCHY", raising=False)
    assert peak_flops(device, torch.bfloat16).flops == pytest.approx(419.4 * T)
    monkeypatch.setenv("ZE_FLAT_DEVICE_HIERARCHY", "COMPOSITE")
    assert peak_flops(device, torch.bfloat16).flops == pytest.approx(838.8 * T)


def test_unknown_accelerator_and_a_dtype_without_hardware_are_measured(monkeypatch):
    fake_measure(monkeypatch, flops=123 * T)
    device = _fake_accelerator(monkeypatch, "cuda", "NVIDIA Mystery 9000")
    peak = peak_flops(device, torch.bfloat16)
    assert (peak.flops, peak.kind) == (123 * T, "measured")
    assert peak.source == "measured: 1024² bf16 matmul, 123 TFLOP/s on NVIDIA Mystery 9000 (now)"
    device = _fake_accelerator(monkeypatch, "cuda", "Tesla V100-SXM2-32GB")  # no bf16 units: torch emulates
    assert peak_flops(device, torch.bfloat16).kind == "measured"
    assert peak_flops(device, torch.float16).flops == 125 * T


def test_override_wins():
    peak = peak_flops("cpu", torch.bfloat16, override=123e12)
    assert (peak.flops, peak.kind, peak.source) == (123e12, "override", "train.peak_flops: 123 TFLOP/s")
    with pytest.raises(ValueError, match="must be > 0"):
        peak_flops("cpu", torch.bfloat16, override=0)
    with pytest.raises(ValueError, match="no peak for dtype"):
        peak_flops("cpu", torch.int8)


def test_fp32_mode_reads_torchs_precision_setting(monkeypatch):
    cuda = torch.device("cuda", 0)
    for mode in ("tf32", "ieee"):
        monkeypatch.setattr(torch.backends.cuda, "matmul", SimpleNamespace(fp32_precision=mode))
        assert profile.fp32_mode(cuda) == mode
    monkeypatch.setattr(torch.backends.cuda, "matmul", SimpleNamespace())  # torch without fp32_precision
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert profile.fp32_mode(cuda) == "tf32"


# ------------------------------------------------------------------------------------------ measuring
def test_best_of_rounds_takes_another_round_while_timings_disagree():
    def timings(values):
        it = iter(values)
        return lambda: next(it)

    quiet = measure.best_of_rounds(timings([1.0, 1.01, 1.02, 1.0, 1.03]), reps=5)
    assert (quiet["best_s"], quiet["rounds"], quiet["stable"]) == (1.0, 1, True)
    # a neighbour takes the cores for the first round: its median is 2× its best, so a second round runs
    noisy = measure.best_of_rounds(timings([1.2, 2.0, 2.4, 2.5, 1.9, 1.0, 1.05, 1.0, 1.02, 1.01]), reps=5)
    assert (noisy["best_s"], noisy["rounds"], noisy["stable"]) == (1.0, 2, True)
    never = measure.best_of_rounds(timings([1, 2, 3] * 3), reps=3, rounds=3)
    assert (never["rounds"], never["stable"], never["spread"]) == (3, False, 1.0)


def test_a_real_cpu_measurement_is_quick_large_enough_and_positive():
    started, rng = time.perf_counter(), torch.get_rng_state()
    record = measure.matmul_peak("cpu", "fp32")
    assert time.perf_counter() - started < 10
    assert torch.equal(torch.get_rng_state(), rng)  # measuring inside a run must not shift its dropout masks
    assert record["flops"] > 1e8 and record["n"] >= 256 and record["threads"] == torch.get_num_threads()
    assert record["best_s"] * record["flops"] == pytest.approx(2 * record["n"] ** 3)
    # big enough to time the units, not the call, even where another process slowed the calls that chose the size
    assert record["n"] == 4096 or record["best_s"] >= 0.01
    bandwidth = measure.memory_bandwidth("cpu", nbytes=16 << 20)
    assert bandwidth["gbs"] > 0.1 and bandwidth["bytes"] == 16 << 20


# ------------------------------------------------------------------------------------------ the cache
def test_a_figure_is_measured_once_then_comes_from_memory_then_disk(monkeypatch):
    calls = fake_measure(monkeypatch, flops=lambda label, n: 50e9 * n)
    first = profile.measured("cpu", "bf16")
    assert profile.measured("cpu", "bf16") == first and calls == ["bf16"]
    profile.clear()  # a new process: memory empty, disk file kept
    assert profile.measured("cpu", "bf16") == first and calls == ["bf16"]
    profile.measured("cpu", "fp32")  # another dtype is another figure
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)  # and so is another thread count
    profile.measured("cpu", "bf16")
    assert calls == ["bf16", "fp32", "bf16"]
    keys = list(json.loads(profile.cache_path().read_text())["devices"])
    assert len(keys) == 2 and all(k.startswith("cpu|") and f"|torch={torch.__version__}" in k for k in keys)
    assert any("|threads=97|" in k for k in keys)
    profile.clear(disk=True)
    assert not profile.cache_path().exists()


def test_a_busy_figure_is_measured_again_by_the_next_process_and_the_higher_kept(monkeypatch):
    spare = hardware.describe("cpu").cores - 1  # cores a 1-thread measurement leaves to others
    figures = iter([(1.4e9, spare + 1), (0.9e9, spare + 0.5), (36e9, spare), (20e9, 0.0)])

    def matmul_peak(device, label):
        flops, others = next(figures)
        return {"flops": flops, "n": 256, "threads": 1, "load": 9.0, "others_cores": others, "measured": "now",
                "spread": 0.0}

    monkeypatch.setattr(measure, "matmul_peak", matmul_peak)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    first = profile.measured("cpu", "bf16")  # the case: 1.4 GFLOP/s taken while the box was busy
    assert first["flops"] == 1.4e9 and first["busy"]
    profile.clear()
    second = profile.measured("cpu", "bf16")  # still busy, and lower: the higher figure stays, still suspect
    assert second["flops"] == 1.4e9 and second["busy"]
    profile.clear()
    third = profile.measured("cpu", "bf16")  # a quiet measurement replaces it and is trusted from now on
    assert third["flops"] == 36e9 and not third["busy"]
    profile.clear()
    assert profile.measured("cpu", "bf16") == third  # not measured again: 20e9 is never drawn
    assert profile.measured("cpu", "bf16", again=True)["flops"] == 36e9  # again: the better figure is kept


def test_busy_means_other_processes_took_the_measurements_cores():
    hw = hardware.describe("cpu")
    assert not profile._busy({"threads": hw.cores, "others_cores": 0.1, "load": 5.0}, hw)  # a trailing load is not
    assert profile._busy({"threads": hw.cores, "others_cores": 0.8}, hw)
    assert not profile._busy({"threads": 1, "others_cores": hw.cores - 1}, hw)  # the other ranks on their own cores
    assert profile._busy({"load": hw.cores + 1.0}, hw) and not profile._busy({"load": 0.5}, hw)  # no /proc/stat
    assert not profile._busy({"others_cores": 9.0}, SimpleNamespace(kind="cuda", cores=8))


def test_refresh_replaces_the_figure(monkeypatch):
    fake_measure(monkeypatch, flops=lambda label, n: 10e9 * (3 - n))
    assert profile.measured("cpu", "fp32")["flops"] == 20e9
    assert profile.measured("cpu", "fp32", refresh=True)["flops"] == 10e9


def test_a_broken_or_unwritable_cache_only_costs_a_measurement(monkeypatch, tmp_path):
    fake_measure(monkeypatch, flops=1e9)
    profile.cache_path().parent.mkdir(parents=True)
    profile.cache_path().write_text("{not json")
    assert peak_flops("cpu", torch.bfloat16).flops == 1e9
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(blocker / "sub"))  # cannot mkdir under a file
    profile.clear()
    assert peak_flops("cpu", torch.float32).flops == 1e9


def test_collectives_are_recorded_with_latency_and_peak_bus_bandwidth():
    key = profile.collectives_key("gloo", torch.device("cpu"), 2, 1)
    assert key.startswith("gloo|cpu|") and key.endswith(f"|world=2|nodes=1|torch={torch.__version__}")
    profile.record_collectives(key, "float32", {"all_reduce": [(8, 50e-6, 0.00016), (1 << 20, 1e-3, 1.05),
                                                               (1 << 22, 5e-3, 0.84)], "broadcast": []})
    entry = profile.read_cache()["collectives"][key]
    (op,) = entry["ops"]
    assert op == "all_reduce" and entry["dtype"] == "float32"
    expected = {"latency_s": 50e-6, "peak_busbw_gbs": 1.05, "peak_at_bytes": 1 << 20, "bytes": [8, 1 << 20, 1 << 22]}
    assert entry["ops"]["all_reduce"].items() >= expected.items()


def test_the_command_prints_and_dumps_the_profile(monkeypatch, capsys):
    fake_measure(monkeypatch, flops=lambda label, n: {"fp32": 40e9, "bf16": 1e9, "fp16": 1.2e9}[label])
    monkeypatch.setattr(measure, "memory_bandwidth", lambda device: {
        "gbs": 18.5, "bytes": 256 << 20, "spread": 0.02, "threads": 1, "load": 0.1, "measured": "now"})
    key = profile.collectives_key("gloo", torch.device("cpu"), 2, 1)
    profile.record_collectives(key, "float32", {"all_reduce": [(8, 40e-6, 0.0002), (1 << 20, 2e-3, 0.5)]})
    args = SimpleNamespace(device="cpu", threads=None, refresh=False, ranks=None, max_bytes="64M", json=True)
    assert machine_command.run(args) == 0
    dumped = json.loads(capsys.readouterr().out)
    assert dumped["matmul"]["fp32"]["measured"]["flops"] == 40e9 and dumped["matmul"]["fp32"]["datasheet"] is None
    assert set(dumped["matmul"]) == {"fp32", "bf16", "fp16"} and dumped["memory"]["gbs"] == 18.5
    assert dumped["auto_dtype"]["dtype"] == "fp32"  # bf16 emulated, or its units slower than fp32 (1 against 40)
    assert list(dumped["collectives"]) == [key]
    assert machine_command.run(SimpleNamespace(**{**vars(args), "json": False})) == 0
    text = capsys.readouterr().out
    for expected in ("machine profile:", "train.dtype=auto", "40 GFLOP/s", "0.025", "18.5 GB/s", "all_reduce",
                     "40.0"):  # 40 us latency
        assert expected in text, expected


def test_the_auto_choice_reads_a_busy_figure_without_measuring_it_again(monkeypatch):
    """A peak measured while the cores were busy is measured again by the next run that reads it (MFU's peak), but
    not for the dtype choice: on a loaded box every run would pay a measurement for a ratio the load lowers alike."""
    calls = fake_measure(monkeypatch, flops=lambda label, n: {"bf16": 40e9, "fp32": 80e9}[label], load=99.0)
    hw = _cpu_hw(True, "avx512_bf16")
    assert precision.choose("auto", "cpu", hw).dtype == "fp32" and sorted(calls) == ["bf16", "fp32"]
    profile.clear()  # the next run: a new process
    assert precision.choose("auto", "cpu", hw).dtype == "fp32" and sorted(calls) == ["bf16", "fp32"]
    profile.measured("cpu", "fp32")
    assert sorted(calls) == ["bf16", "fp32", "fp32"]  # the busy fp32 figure, measured again for MFU
