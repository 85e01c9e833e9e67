"""The Llama-style decoder end to end through `meshtrain train llama` on GPT-2 BPE Shakespeare: fsdp × tp with
sequence and loss parallel, a bit-exact resume, and the export and sample commands, all from its own folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tests import preloaded
from tests.conftest import REPO, clean_env, fork_ranks, output, prepare_data, rewound_copy

TINY = ["preset=cpu", "model.n_layer=2", "model.n_head=4", "model.n_kv_head=2", "model.n_embd=32",
        "model.block_size=32", "model.batch_size=4", "train.eval_iters=2", "train.dtype=fp32", "train.log_interval=1",
        "train.eval_interval=10", "train.sample_tokens=8", "optimizer.warmup_iters=5", "optimizer.lr_decay_iters=20",
        "optimizer.lr=1e-2", "optimizer.min_lr=1e-3",
        "train.backend=fsdp", "parallel.tp=2"]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return prepare_data(tmp_path_factory.mktemp("data"), "shakespeare")


def train(data_root: Path, out_dir: Path, *overrides: str):
    return fork_ranks(2, "train", "llama", *TINY, f"data.root={data_root}", f"train.out_dir={out_dir}", *overrides,
                    timeout=300)


def rows_of(out_dir: Path) -> list[dict]:
    from meshtrain.runtime.rundir import read_jsonl

    return read_jsonl((out_dir / "llama" / "fsdp" / "latest").resolve() / "metrics.jsonl")


def meshtrain(*args: str) -> subprocess.CompletedProcess:
    return preloaded.run([sys.executable, "-m", "meshtrain", *args], env=clean_env(), cwd=REPO, timeout=120)


def test_llama_trains_under_fsdp_tp_resumes_bit_exactly_exports_and_samples(data_root, tmp_path):
    straight = train(data_root, tmp_path / "straight", "train.max_iters=20")
    assert straight.returncode == 0, output(straight)[-3000:]
    full = rows_of(tmp_path / "straight")
    evals = {r["step"]: r["val_loss"] for r in full if "val_loss" in r}
    assert sorted(evals) == [0, 10, 20] and evals[20] < evals[0] - 0.5, evals  # from ~ln(50304) = 10.8

    from meshtrain.runtime.rundir import read_jsonl

    run_dir = rewound_copy((tmp_path / "straight" / "llama" / "fsdp" / "latest").resolve(),
                           tmp_path / "halves", 10)  # the run as it stood at its checkpoint of iteration 10
    out = train(data_root, tmp_path / "straight", "train.max_iters=20", "train.init_from=resume",
                f"train.run_dir={run_dir}")
    assert out.returncode == 0 and "resuming at iteration 10" in output(out), output(out)[-3000:]
    resumed = read_jsonl(run_dir / "metrics.jsonl")
    losses = lambda rows: {r["step"]: r["loss"] for r in rows if "loss" in r}  # noqa: E731
    assert losses(resumed) == losses(full), "the resumed run's losses equal the uninterrupted run's bit for bit"
    assert [r["val_loss"] for r in resumed if r.get("step") == 20 and "val_loss" in r] == [evals[20]]

    exported = meshtrain("export", "--run", str(run_dir))
    assert exported.returncode == 0, output(exported)
    samples = [meshtrain("sample", "--run", str(source), "--prompt", "ROMEO:", "--max-new-tokens", "12", "--seed", "3")
               for source in (run_dir, run_dir / "model.pt")]
    for sample in samples:
        assert sample.returncode == 0, output(sample)
        assert sample.stdout.startswith("ROMEO:") and len(sample.stdout.strip()) > len("ROMEO:")
    assert samples[0].stdout == samples[1].stdout, "the checkpoint and the exported file hold the same model"
