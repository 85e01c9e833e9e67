"""The machine profile as users meet it: `meshtrain machine`, the dtype a training run picks, its MFU, and the
AVX2-only path emulated on whatever CPU runs the tests (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2)."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.conftest import REPO, clean_env, output, prepare_data

AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
TINY = ["model.n_layer=2", "model.n_head=2", "model.n_embd=64", "model.block_size=32", "model.batch_size=8",
        "train.eval_iters=2", "train.max_iters=20", "train.eval_interval=20", "train.log_interval=5",
        "optimizer.warmup_iters=2", "train.save_checkpoints=false"]


def meshtrain(*args: str, cache: Path, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshtrain", *args], capture_output=True, text=True, cwd=REPO,
                          env=clean_env(MESHTRAIN_CACHE_DIR=str(cache), **env), timeout=timeout)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return prepare_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def avx2_cache(tmp_path_factory) -> Path:
    """One machine cache for the AVX2-capped runs, as one user's: the first measures the capped profile (the
    emulated bf16 matmul is the slow part), the trainings after it read the profile a user's second run reads."""
    return tmp_path_factory.mktemp("avx2_cache")


@pytest.fixture(scope="module")
def native_cache(tmp_path_factory) -> Path:
    """The uncapped runs' machine cache: `machine --ranks` adds its collectives to the profile measured before."""
    return tmp_path_factory.mktemp("native_cache")


def profile_json(cache: Path, *args: str, **env: str) -> dict:
    out = meshtrain("machine", "--json", *args, cache=cache, **env)
    assert out.returncode == 0, output(out)[-3000:]
    return json.loads(out.stdout)


def test_the_emulated_avx2_cpu_has_the_slow_bf16_path_and_auto_picks_fp32(avx2_cache):
    """On an AVX-512/AMX box the caps must really take the bf16 units away (measured, not just reported); on an
    AVX2-only box they change nothing. Either way this is the path an AVX2 user gets."""
    p = profile_json(avx2_cache, **AVX2_ONLY)
    hw = p["hardware"]
    assert hw["isa"] == "AVX2" and hw["caps"] == ["ATEN_CPU_CAPABILITY=avx2", "ONEDNN_MAX_CPU_ISA=AVX2"]
    assert hw["bf16"] is False and p["auto_dtype"]["dtype"] == "fp32"
    assert "|AVX2|caps=ATEN_CPU_CAPABILITY=avx2+ONEDNN_MAX_CPU_ISA=AVX2|threads=1|" in p["key"]
    fp32, bf16 = (p["matmul"][label]["measured"]["flops"] for label in ("fp32", "bf16"))
    assert bf16 < 0.25 * fp32, f"bf16 {bf16:.3g} vs fp32 {fp32:.3g} FLOP/s: the emulation did not slow bf16 down"
    assert p["memory"]["gbs"] > 0.1


def test_the_native_profile_is_cached_and_agrees_with_the_cpu_flags(native_cache):
    first = profile_json(native_cache)
    again = profile_json(native_cache)
    assert again["matmul"] == first["matmul"] or any(m["measured"].get("busy") for m in first["matmul"].values())
    hw = first["hardware"]
    fp32, bf16 = (first["matmul"][label]["measured"]["flops"] for label in ("fp32", "bf16"))
    assert first["auto_dtype"]["dtype"] == ("bf16" if hw["bf16"] and bf16 >= fp32 else "fp32")
    if hw["bf16"]:  # a box with bf16 units: bf16 must not be the 45-100× slower emulated path (a 2-core Intel Xeon's
        assert bf16 > 0.1 * fp32  # avx512_bf16 without AMX measured 0.46-0.56× fp32: real units, slower ones)


def test_machine_ranks_records_collective_bandwidth(native_cache):
    p = profile_json(native_cache, "--ranks", "2", "--max-bytes", "64K")
    (key,) = [k for k in p["collectives"] if k.startswith("gloo|cpu|") and "|world=2|nodes=1|" in k]
    ops = p["collectives"][key]["ops"]
    assert {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"} <= set(ops)
    for fig in ops.values():
        assert fig["bytes"][-1] <= 64 << 10 and 0 < fig["latency_s"] < 1 and fig["peak_busbw_gbs"] > 0
        assert len(fig["bytes"]) == len(fig["seconds"]) == len(fig["busbw_gbs"])


def test_training_on_the_avx2_path_chooses_fp32_says_why_and_keeps_mfu_honest(data_root, avx2_cache, tmp_path):
    out = meshtrain("train", "gpt", *TINY, f"data.root={data_root}", f"train.out_dir={tmp_path}", cache=avx2_cache,
                    **AVX2_ONLY)
    text = output(out)
    assert out.returncode == 0, text[-4000:]
    assert "precision: fp32 (auto: " in text and "so fp32)" in text
    assert "fp32 matmul, 1 thread," in text  # the peak of the dtype the matmuls run in, from the profile
    run_dir = (tmp_path / "gpt" / "ddp" / "latest").resolve()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    mfus = [r["mfu"] for r in rows if "mfu" in r]
    assert len(mfus) == 4 and all(0 < m <= 100 for m in mfus), mfus
    assert "dtype: fp32" in (run_dir / "config.yaml").read_text()


def test_explicit_bf16_on_the_avx2_path_runs_with_one_warning_quoting_the_ratio(data_root, avx2_cache, tmp_path):
    out = meshtrain("train", "gpt", *TINY, "train.max_iters=2", "train.eval_interval=2", "train.log_interval=1",
                    "train.dtype=bf16", f"data.root={data_root}", f"train.out_dir={tmp_path}", cache=avx2_cache,
                    **AVX2_ONLY)
    text = output(out)
    assert out.returncode == 0, text[-4000:]
    warnings = [line for line in text.splitlines() if "train.dtype=bf16 on " in line]
    assert len(warnings) == 1 and "[WARNING]" in warnings[0], warnings
    assert "which has no native bf16" in warnings[0] and " in fp32 here (0.0" in warnings[0]
    assert "train.dtype=auto would pick fp32" in warnings[0]
    assert "precision: bf16 (train.dtype=bf16 as set)" in text and "bf16 matmul" in text


def test_a_neighbour_on_the_cores_is_seen_by_others_cpu():
    """others_cpu counts what other processes ran during the block, whatever else loads the box: here a child
    that burns 0.5 CPU seconds while this process only waits for it."""
    from meshtrain.machine import measure

    record: dict = {}
    spinner = multiprocessing.get_context("fork").Process(target=_spin, args=(0.5,))
    children_before, started = sum(os.times()[2:4]), time.perf_counter()
    with measure.others_cpu(record):
        spinner.start()
        spinner.join()
    if "others_cores" not in record:
        pytest.skip("no /proc/stat here: the load average stands in")
    child = sum(os.times()[2:4]) - children_before
    others = record["others_cores"] * (time.perf_counter() - started)
    assert child >= 0.45 and others >= 0.8 * child, (child, others)


def _spin(cpu_seconds: float) -> None:
    end = time.process_time() + cpu_seconds
    while time.process_time() < end:
        pass
