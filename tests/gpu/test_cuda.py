"""The CUDA paths, each against a reference: fp32 on the GPU against the CPU, bf16/fp16 against fp32, compile, CUDA
graphs, activation checkpointing, FSDP2 offload and async checkpointing against eager fp32 on the GPU, float8
against bf16, and the profile, MFU and memory figures against the datasheet and the model's size. Skipped without
CUDA.

`make test-gpu` runs them in parallel processes on the one GPU (each run is a 2-layer model of width 64: the GPU
is nowhere near full), one test per CUDA path and one training run per test where a reference can be shared: the
references (eager fp32, bf16, float8, the Llama-style decoder's fp32, the ViT's fp32) are module fixtures, made
once in each worker that needs them. The test that times the GPU's matmuls is marked `alone` and runs first, by
itself."""

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
COMPILED = 600  # seconds a compiled run may take: inductor compiles while other workers do too


def env(device: str = "cuda", **extra: str) -> dict[str, str]:
    return {**clean_env(**extra), "MESHTRAIN_DEVICE": device}


def float8_capable() -> None:
    pytest.importorskip("torchao.float8", reason="torchao (the float8 extra) is not installed")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"{torch.cuda.get_device_name()} has no float8 tensor cores (compute capability 8.9+)")


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


def assert_close_losses(run: Run, reference: Run, rel: float) -> None:
    got, want = run.losses(), reference.losses()
    assert sorted(got) == sorted(want) == list(range(1, 21))
    worst = max(abs(got[s] - want[s]) / want[s] for s in want)
    assert worst <= rel, f"largest relative loss difference {worst:.2e} > {rel:.0e}: {got} vs {want}"


# ---- the references, made once per worker that needs them -------------------------------------------------------

@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return prepare_data(tmp_path_factory.mktemp("data"), env=env())


@pytest.fixture(scope="module")
def eager_fp32(data_root, tmp_path_factory) -> Run:
    return train(data_root, tmp_path_factory.mktemp("eager"), "train.dtype=fp32")


@pytest.fixture(scope="module")
def auto_dtype(data_root, tmp_path_factory) -> Run:
    """train.dtype=auto: bf16 on compute capability 8.0+ (every GPU float8 needs), fp16 before."""
    return train(data_root, tmp_path_factory.mktemp("auto"))


@pytest.fixture(scope="module")
def float8_eager(data_root, tmp_path_factory) -> Run:
    float8_capable()
    return train(data_root, tmp_path_factory.mktemp("float8"), "train.dtype=bf16", "train.float8=tensorwise")


@pytest.fixture(scope="module")
def llama_fp32(data_root, tmp_path_factory) -> Run:
    return train(data_root, tmp_path_factory.mktemp("llama"), "train.dtype=fp32", model="llama")


@pytest.fixture(scope="module")
def era5_root(tmp_path_factory) -> Path:
    from meshtrain.data.era5_synthetic import generate

    root = tmp_path_factory.mktemp("era5")
    generate(root, years=list(range(2010, 2014)), samples_per_year=16, grid=(34, 66), channels=4, seed=0)
    return root


def train_vit(era5_root: Path, out: Path, dtype: str) -> list[float]:
    proc = subprocess.run([sys.executable, "-m", "meshtrain", "train", "vit", "preset=tiny", "model.patch_size=4",
                           "model.embed_dim=32", "model.depth=2", "model.num_heads=4", "data.crop=[32,64]",
                           f"data.root={era5_root}", f"train.out_dir={out}", f"train.dtype={dtype}",
                           "train.max_epochs=null", "train.max_iters=30", "train.eval_interval=30",
                           "train.log_interval=1", "optimizer.warmup_iters=0", "optimizer.lr=3e-3"],
                          capture_output=True, text=True, env=env(), cwd=REPO, timeout=300)
    assert proc.returncode == 0, output(proc)[-3000:]
    run_dir = (out / "vit" / "ddp" / "latest").resolve()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5]), (dtype, losses)
    return losses


@pytest.fixture(scope="module")
def vit_fp32(era5_root, tmp_path_factory) -> list[float]:
    return train_vit(era5_root, tmp_path_factory.mktemp("vit-fp32"), "fp32")


# ---- compiled paths first: they take longest, so the workers start them before the quick ones --------------------

def test_compile_follows_eager(eager_fp32, data_root, tmp_path):
    """Each block compiled, and beside them the output layer and the whole-logits loss as one graph."""
    run = train(data_root, tmp_path, "train.dtype=fp32", "train.compile=true", "train.cuda_graphs=false",
                timeout=COMPILED)
    assert "torch.compile: each block on its own, and the output layer and loss" in run.text
    assert_close_losses(run, eager_fp32, rel=1e-3)  # inductor fuses and reorders fp32 sums


def test_compiled_loss_in_chunks_follows_eager(eager_fp32, data_root, tmp_path):
    """Each block compiled, and beside them each chunk's softmax and gradient as a graph (48 of the 512 tokens at a
    time: a shorter last chunk, a graph of its own)."""
    run = train(data_root, tmp_path, "train.dtype=fp32", "train.compile=true", "train.cuda_graphs=false",
                "train.loss_chunks=48", timeout=COMPILED)
    assert "torch.compile: each block on its own, and the output layer and loss" in run.text
    assert_close_losses(run, eager_fp32, rel=1e-3)


def test_whole_model_compile_follows_eager(eager_fp32, data_root, tmp_path):
    """train.compile=model: the whole model as one graph (true compiles each block: the test above)."""
    run = train(data_root, tmp_path, "train.dtype=fp32", "train.compile=model", "train.cuda_graphs=false",
                timeout=COMPILED)
    assert "torch.compile: the whole model" in run.text
    assert_close_losses(run, eager_fp32, rel=1e-3)


def test_auto_captures_cuda_graphs_for_a_small_compiled_model(eager_fp32, data_root, tmp_path):
    """CUDA graphs through compile (train.cuda_graphs=null picks them for a model this small), against eager."""
    run = train(data_root, tmp_path, "train.dtype=fp32", "train.compile=model", timeout=COMPILED)
    assert "CUDA graphs: on (train.cuda_graphs=null" in run.text
    assert_close_losses(run, eager_fp32, rel=1e-3)


def test_llama_compiles_in_bf16_and_follows_its_fp32(llama_fp32, data_root, tmp_path):
    fast = train(data_root, tmp_path, "train.dtype=bf16", "train.compile=true", model="llama", timeout=COMPILED)
    assert_close_losses(fast, llama_fp32, rel=3e-2)


def test_float8_under_fsdp2_and_compile_follows_eager_float8(float8_eager, data_root, tmp_path):
    """FSDP2 on one NCCL rank gathers the weights in float8 and recomputes their scales after each step; compiled."""
    fsdp = train(data_root, tmp_path, "train.dtype=bf16", "train.float8=tensorwise", "train.compile=true",
                 backend="fsdp", timeout=COMPILED)
    assert "their weights gathered in float8 by FSDP2" in fsdp.text
    assert_close_losses(fsdp, float8_eager, rel=2e-2)


def test_float8_rowwise_compiled_follows_bf16(auto_dtype, data_root, tmp_path):
    float8_capable()
    rowwise = train(data_root, tmp_path, "train.dtype=bf16", "train.float8=rowwise", "train.compile=true",
                    timeout=COMPILED)
    assert "float8 (rowwise): 12 linears of the blocks" in rowwise.text
    assert_close_losses(rowwise, auto_dtype, rel=5e-2)


# ---- eager paths -------------------------------------------------------------------------------------------------

def test_fp32_on_the_gpu_follows_the_cpu_reference(eager_fp32, data_root, tmp_path):
    cpu = train(data_root, tmp_path, "train.dtype=fp32", device="cpu")
    # Same initial weights (built on the CPU from one seed) and the same batches (a CPU generator): only the
    # kernels' summation order differs, which 20 AdamW steps must not amplify.
    assert_close_losses(eager_fp32, cpu, rel=1e-3)
    assert eager_fp32.losses()[20] < eager_fp32.losses()[1] - 0.5


def test_llama_on_the_gpu_follows_the_cpu(llama_fp32, data_root, tmp_path):
    """The Llama-style decoder's CUDA path (RoPE in fp32, GQA, SwiGLU) against the CPU."""
    cpu = train(data_root, tmp_path, "train.dtype=fp32", device="cpu", model="llama")
    assert_close_losses(llama_fp32, cpu, rel=1e-3)
    assert llama_fp32.losses()[20] < llama_fp32.losses()[1] - 0.5


def test_auto_picks_bf16_with_mfu_against_the_datasheet_and_memory(auto_dtype, eager_fp32):
    run = auto_dtype
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


def test_float8_tensorwise_follows_bf16(float8_eager, auto_dtype):
    assert "precision: bf16" in auto_dtype.text  # float8_capable: compute capability 8.9+, so auto is bf16
    assert "float8 (tensorwise): 12 linears of the blocks" in float8_eager.text
    assert_close_losses(float8_eager, auto_dtype, rel=5e-2)  # e4m3's 3 mantissa bits against bf16's 8
    assert float8_eager.losses() != auto_dtype.losses()  # the blocks really ran in float8


def test_fp16_with_a_grad_scaler_follows_fp32(eager_fp32, data_root, tmp_path):
    run = train(data_root, tmp_path, "train.dtype=fp16")
    assert "precision: fp16" in run.text
    assert_close_losses(run, eager_fp32, rel=3e-2)
    from meshtrain.train import checkpoint

    scale = checkpoint.load_trainer_state(checkpoint.latest_checkpoint(run.run_dir))["scaler"]["scale"]
    assert scale > 1 and float(scale).is_integer() and (int(scale) & (int(scale) - 1)) == 0, scale  # a power of 2


def test_activation_checkpointing_recomputes_the_same_step(eager_fp32, data_root, tmp_path):
    run = train(data_root, tmp_path, "train.dtype=fp32", "train.activation_checkpointing=full")
    assert_close_losses(run, eager_fp32, rel=1e-4)


def test_op_checkpointing_keeps_the_cuda_kernels_outputs_and_follows_eager(eager_fp32, data_root, tmp_path):
    """train.activation_checkpointing=op on CUDA: the kept matmuls and fused attention are CUDA's own kernels
    (cuBLAS, the efficient-attention kernel in fp32), the recomputed rest gives the same step."""
    run = train(data_root, tmp_path, "train.dtype=fp32", "train.activation_checkpointing=op")
    assert_close_losses(run, eager_fp32, rel=1e-4)


def test_op_checkpointing_in_bf16_follows_bf16(auto_dtype, data_root, tmp_path):
    """bf16: attention runs flash attention, whose output op keeps rather than runs again."""
    run = train(data_root, tmp_path, "train.dtype=bf16", "train.activation_checkpointing=op")
    assert_close_losses(run, auto_dtype, rel=2e-3)


def test_loss_in_chunks_follows_the_whole_loss(eager_fp32, data_root, tmp_path):
    """train.loss_chunks=48: the head and loss over 48 of the 512 tokens at a time (the last slice shorter)."""
    run = train(data_root, tmp_path, "train.dtype=fp32", "train.loss_chunks=48")
    assert_close_losses(run, eager_fp32, rel=1e-5)


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


def test_test_dist_passes_on_one_nccl_rank():
    proc = subprocess.run(torchrun_cmd(1, "-m", "meshtrain", "test-dist"), capture_output=True, text=True,
                          env=env(), cwd=REPO, timeout=300)
    text = output(proc)
    assert proc.returncode == 0, text[-3000:]
    assert "test-dist passed: 1 rank(s)" in text and "nccl" in text


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_vit_trains_on_the_gpu_in_half_precision_as_in_fp32(dtype, vit_fp32, era5_root, tmp_path):
    losses = train_vit(era5_root, tmp_path, dtype)
    assert losses[-1] == pytest.approx(vit_fp32[-1], rel=0.1)


@pytest.mark.alone  # it times the GPU's matmuls: another process on the GPU would slow them
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
