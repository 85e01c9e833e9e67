"""The CUDA paths, each against a reference: fp32 on the GPU against the CPU, bf16/fp16 against fp32, compile, CUDA
graphs, activation checkpointing, FSDP2 offload and async checkpointing against eager fp32 on the GPU, and the
profile, MFU and memory figures against the datasheet and the model's size. Skipped without CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, clean_env, output, prepare_data, torchrun_cmd

pytestmark = [pytest.mark.gpu, pytest.mark.distributed,  # each test starts meshtrain processes
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on a GPU machine; see docs/gpu.md)")]

# Dropout off and fixed seeds, so runs on different devices or paths can be compared step by step.
TINY = ["model.n_layer=2", "model.n_head=2", "model.n_embd=64", "model.block_size=64", "model.batch_size=8",
        "model.dropout=0.0", "train.eval_iters=2", "train.eval_interval=20", "train.max_iters=20",
        "train.log_interval=1", "optimizer.warmup_iters=5", "train.sample_tokens=8"]


def env(device: str = "cuda", **extra: str) -> dict[str, str]:
    return {**clean_env(**extra), "MESHTRAIN_DEVICE": device}


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return prepare_data(tmp_path_factory.mktemp("data"), env=env())


class Run:
    def __init__(self, proc: subprocess.CompletedProcess, out_dir: Path, backend: str, model: str = "gpt"):
        self.text = output(proc)
        assert proc.returncode == 0, self.text[-4000:]
        self.run_dir = (out_dir / model / backend / "latest").resolve()
        self.rows = [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]

    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.rows if "loss" in r}

    def logs(self) -> list[dict]:
        return [r for r in self.rows if "mfu" in r]


def train(data_root: Path, out_dir: Path, *overrides: str, device: str = "cuda", ranks: int = 1,
          backend: str = "ddp", timeout: float = 300, model: str = "gpt") -> Run:
    own = ["data.name=shakespeare_char", "model.n_kv_head=1"] if model == "llama" else []
    args = ["train", model, *TINY, *own, f"data.root={data_root}", f"train.out_dir={out_dir}",
            f"train.backend={backend}", *overrides]
    argv = torchrun_cmd(ranks, "-m", "meshtrain", *args) if ranks > 1 or backend != "ddp" else \
        [sys.executable, "-m", "meshtrain", *args]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env(device), cwd=REPO, timeout=timeout)
    return Run(proc, out_dir, backend, model)


@pytest.fixture(scope="module")
def eager_fp32(data_root, tmp_path_factory) -> Run:
    return train(data_root, tmp_path_factory.mktemp("eager"), "train.dtype=fp32")


def assert_close_losses(run: Run, reference: Run, rel: float) -> None:
    got, want = run.losses(), reference.losses()
    assert sorted(got) == sorted(want) == list(range(1, 21))
    worst = max(abs(got[s] - want[s]) / want[s] for s in want)
    assert worst <= rel, f"largest relative loss difference {worst:.2e} > {rel:.0e}: {got} vs {want}"


def test_fp32_on_the_gpu_follows_the_cpu_reference(eager_fp32, data_root, tmp_path):
    cpu = train(data_root, tmp_path, "train.dtype=fp32", device="cpu")
    # Same initial weights (built on the CPU from one seed) and the same batches (a CPU generator): only the
    # kernels' summation order differs, which 20 AdamW steps must not amplify.
    assert_close_losses(eager_fp32, cpu, rel=1e-3)
    assert eager_fp32.losses()[20] < eager_fp32.losses()[1] - 0.5


def test_llama_on_the_gpu_follows_the_cpu_and_compiles_in_bf16(data_root, tmp_path):
    """The Llama-style decoder's CUDA path (RoPE in fp32, GQA, SwiGLU): fp32 against the CPU, bf16 + compile
    against fp32."""
    gpu = train(data_root, tmp_path / "gpu", "train.dtype=fp32", model="llama")
    cpu = train(data_root, tmp_path / "cpu", "train.dtype=fp32", device="cpu", model="llama")
    assert_close_losses(gpu, cpu, rel=1e-3)
    fast = train(data_root, tmp_path / "fast", "train.dtype=bf16", "train.compile=true", model="llama")
    assert_close_losses(fast, gpu, rel=3e-2)
    assert gpu.losses()[20] < gpu.losses()[1] - 0.5


def test_auto_picks_bf16_with_mfu_against_the_datasheet_and_memory(eager_fp32, data_root, tmp_path):
    run = train(data_root, tmp_path)  # train.dtype=auto
    major = torch.cuda.get_device_capability()[0]
    assert f"precision: {'bf16' if major >= 8 else 'fp16'} (auto: " in run.text
    if major >= 8:
        assert_close_losses(run, eager_fp32, rel=3e-2)  # bf16 autocast rounds to 8 bits of mantissa
    for row in run.logs():
        assert 0 < row["mfu"] <= 100
        # The high watermark holds at least the fp32 weights, their gradients and AdamW's two moments.
        params = float(run.text.split("model: ")[1].split("M parameters")[0]) * 1e6
        assert 4 * params * 4 / 2**30 <= row["mem_gb"] < torch.cuda.get_device_properties(0).total_memory / 2**30
    from meshtrain.machine.datasheet import match_device

    if match_device(torch.cuda.get_device_name()):
        assert "TFLOP/s per device (datasheet: " in run.text


def test_fp16_with_a_grad_scaler_follows_fp32(eager_fp32, data_root, tmp_path):
    run = train(data_root, tmp_path, "train.dtype=fp16")
    assert "precision: fp16" in run.text
    assert_close_losses(run, eager_fp32, rel=3e-2)
    from meshtrain.train import checkpoint

    scale = checkpoint.load_trainer_state(checkpoint.latest_checkpoint(run.run_dir))["scaler"]["scale"]
    assert scale > 1 and float(scale).is_integer() and (int(scale) & (int(scale) - 1)) == 0, scale  # a power of 2


@pytest.mark.parametrize("flags", [["train.compile=true", "train.cuda_graphs=false"],
                                   ["train.compile=true", "train.cuda_graphs=true"]],
                         ids=["compile", "cuda_graphs"])
def test_compile_and_cuda_graphs_follow_eager(flags, eager_fp32, data_root, tmp_path):
    run = train(data_root, tmp_path, "train.dtype=fp32", *flags, timeout=600)
    assert_close_losses(run, eager_fp32, rel=1e-3)  # inductor fuses and reorders fp32 sums


def test_activation_checkpointing_recomputes_the_same_step(eager_fp32, data_root, tmp_path):
    run = train(data_root, tmp_path, "train.dtype=fp32", "train.activation_checkpointing=full")
    assert_close_losses(run, eager_fp32, rel=1e-4)


def test_fsdp2_with_pinned_cpu_offload_on_nccl_follows_eager(eager_fp32, data_root, tmp_path):
    run = train(data_root, tmp_path, "train.dtype=fp32", "parallel.cpu_offload=true", backend="fsdp")
    assert "layout: fsdp over 1 rank(s)" in run.text
    assert_close_losses(run, eager_fp32, rel=1e-4)


def test_async_checkpoint_resumes_to_the_uninterrupted_run(eager_fp32, data_root, tmp_path):
    train(data_root, tmp_path, "train.dtype=fp32", "train.async_checkpoint=true", "train.max_iters=10",
          "optimizer.lr_decay_iters=20", "train.eval_interval=10")
    resumed = train(data_root, tmp_path, "train.dtype=fp32", "train.async_checkpoint=true", "train.init_from=resume")
    got, want = resumed.losses(), eager_fp32.losses()
    assert "(resuming at iteration 10)" in resumed.text and set(range(11, 21)) <= set(got)
    # CUDA's embedding backward adds with atomics, so the order (and the last bits) may differ between runs.
    for step in range(11, 21):
        assert got[step] == pytest.approx(want[step], rel=1e-5)


def test_torch_profiler_traces_cuda_kernels_inside_the_named_ranges(data_root, tmp_path):
    run = train(data_root, tmp_path, "train.profile=torch", "train.profile_start=3", "train.profile_steps=2")
    trace = json.loads((run.run_dir / "profile" / "trace_rank0.json").read_text())
    events = trace["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"iteration 3", "iteration 4"} <= names, sorted(n for n in names if n and n.startswith("iter"))
    assert any(e.get("cat") == "kernel" for e in events), "the trace holds the GPU's kernels"


def test_nsys_window_brackets_the_asked_iterations(data_root, tmp_path):
    run = train(data_root, tmp_path, "train.profile=nsys", "train.profile_start=3", "train.profile_steps=2")
    assert "profiling (nsys): iterations 3-4 captured" in run.text


def test_machine_profile_measures_the_gpu_below_its_datasheet(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "meshtrain", "machine", "--json"], capture_output=True, text=True,
                          env=env(MESHTRAIN_CACHE_DIR=str(tmp_path)), cwd=REPO, timeout=300)
    assert proc.returncode == 0, output(proc)[-3000:]
    profile = json.loads(proc.stdout)
    assert profile["hardware"]["kind"] == "cuda"
    assert profile["hardware"]["device_memory_bytes"] == torch.cuda.get_device_properties(0).total_memory
    major = torch.cuda.get_device_capability()[0]
    assert profile["auto_dtype"]["dtype"] == ("bf16" if major >= 8 else "fp16")
    matmul = profile["matmul"]
    for dtype in ("fp32", "bf16", "fp16"):
        measured, datasheet = matmul[dtype]["measured"]["flops"], matmul[dtype]["datasheet"]
        assert measured > 0
        if datasheet:  # a dense matmul reaches a good share of the datasheet and never beats it by much
            assert 0.3 * datasheet < measured < 1.1 * datasheet, (dtype, measured, datasheet)
    if major >= 8:
        assert matmul["bf16"]["measured"]["flops"] > 4 * matmul["fp32"]["measured"]["flops"]  # tensor cores


def test_test_dist_passes_on_one_nccl_rank():
    proc = subprocess.run(torchrun_cmd(1, "-m", "meshtrain", "test-dist"), capture_output=True, text=True,
                          env=env(), cwd=REPO, timeout=300)
    text = output(proc)
    assert proc.returncode == 0, text[-3000:]
    assert "test-dist passed: 1 rank(s)" in text and "nccl" in text


def test_vit_trains_on_the_gpu_in_bf16_and_fp16(tmp_path):
    from meshtrain.data.era5_synthetic import generate

    generate(tmp_path / "era5", years=list(range(2010, 2014)), samples_per_year=16, grid=(34, 66), channels=4,
             seed=0)
    finals = {}
    for dtype in ("fp32", "bf16", "fp16"):
        out = tmp_path / dtype
        proc = subprocess.run([sys.executable, "-m", "meshtrain", "train", "vit", "preset=tiny", "model.patch_size=4",
                               "model.embed_dim=32", "model.depth=2", "model.num_heads=4", "data.crop=[32,64]",
                               f"data.root={tmp_path / 'era5'}", f"train.out_dir={out}", f"train.dtype={dtype}",
                               "train.max_epochs=null", "train.max_iters=30", "train.eval_interval=30",
                               "train.log_interval=1", "optimizer.warmup_iters=0", "optimizer.lr=3e-3"],
                              capture_output=True, text=True, env=env(), cwd=REPO, timeout=300)
        assert proc.returncode == 0, output(proc)[-3000:]
        run_dir = (out / "vit" / "ddp" / "latest").resolve()
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        losses = [r["loss"] for r in rows if "loss" in r]
        assert sum(losses[-5:]) < 0.8 * sum(losses[:5]), (dtype, losses)
        finals[dtype] = losses[-1]
    for dtype in ("bf16", "fp16"):
        assert finals[dtype] == pytest.approx(finals["fp32"], rel=0.1)


def test_auto_captures_cuda_graphs_for_a_small_compiled_model(eager_fp32, data_root, tmp_path):
    run = train(data_root, tmp_path, "train.dtype=fp32", "train.compile=true", timeout=600)  # cuda_graphs=null
    assert "CUDA graphs: on (train.cuda_graphs=null" in run.text
    assert_close_losses(run, eager_fp32, rel=1e-3)


def test_float8_follows_bf16_eager_compiled_and_under_fsdp2(data_root, tmp_path):
    pytest.importorskip("torchao.float8", reason="torchao (the float8 extra) is not installed")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"{torch.cuda.get_device_name()} has no float8 tensor cores (compute capability 8.9+)")
    bf16 = train(data_root, tmp_path / "bf16", "train.dtype=bf16")
    eager = train(data_root, tmp_path / "eager", "train.dtype=bf16", "train.float8=tensorwise")
    assert "float8 (tensorwise): 12 linears of the blocks" in eager.text
    assert_close_losses(eager, bf16, rel=5e-2)  # e4m3's 3 mantissa bits against bf16's 8
    assert eager.losses() != bf16.losses()  # the blocks really ran in float8
    # FSDP2 on one NCCL rank gathers the weights in float8 and recomputes their scales after each step; compiled.
    fsdp = train(data_root, tmp_path / "fsdp", "train.dtype=bf16", "train.float8=tensorwise", "train.compile=true",
                 backend="fsdp", timeout=600)
    assert "their weights gathered in float8 by FSDP2" in fsdp.text
    assert_close_losses(fsdp, eager, rel=2e-2)
    rowwise = train(data_root, tmp_path / "rowwise", "train.dtype=bf16", "train.float8=rowwise", "train.compile=true",
                    timeout=600)
    assert_close_losses(rowwise, bf16, rel=5e-2)
