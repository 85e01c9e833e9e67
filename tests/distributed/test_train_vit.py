"""`meshtrain train vit` end to end on gloo: every layout equals one process through the real loop, the forecaster
beats persistence, a resume is bit-exact, and bad input gets one clear error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tests import preloaded
from tests.conftest import REPO, clean_env, fork_ranks, output

# 4 channels on a 32 x 64 crop in patches of 4: 128 tokens; fp32 and no dropout so layouts can be compared.
SMALL = ["model.patch_size=4", "model.embed_dim=32", "model.depth=2", "model.num_heads=4", "data.crop=[32,64]",
         "train.dtype=fp32", "train.eval_iters=2", "train.log_interval=1", "optimizer.warmup_iters=0",
         "optimizer.lr=3e-3", "optimizer.min_lr=3e-4", "optimizer.grad_clip=0.5", "train.max_epochs=null"]


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    from meshtrain.data.era5_synthetic import generate

    root = tmp_path_factory.mktemp("era5")
    # 7 training years of 47 pairs: enough that a small model learns the dynamics rather than the samples.
    generate(root, years=list(range(2010, 2019)), samples_per_year=48, grid=(34, 66), channels=4, seed=0)
    return root


def train(world: int, data: Path, out_dir: Path, *overrides: str, preset: str = "tiny", timeout: float = 300):
    args = ["train", "vit", f"preset={preset}", *(SMALL if preset == "tiny" else []), f"data.root={data}",
            f"train.out_dir={out_dir}", *overrides]
    if world == 1:
        return preloaded.run([sys.executable, "-m", "meshtrain", *args], env=clean_env(), cwd=REPO, timeout=timeout)
    return fork_ranks(world, *args, timeout=timeout)


def rows_of(out_dir: Path, backend: str = "ddp") -> list[dict]:
    run_dir = (out_dir / "vit" / backend / "latest").resolve()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(rows: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


# (ranks, overrides): the same global batch of 8 as the reference. Through the trainer, its ERA5 loader and its
# evaluation, one of each kind; the layouts' arithmetic, case by case (fsdp × tp, Ulysses, ring, tp × cp), is
# test_vit_parallel.py's, and fsdp × tp2 and ddp × cp2 on 4 ranks resume into test_resume_anywhere.py's run.
LAYOUTS = [
    (2, ["train.backend=ddp"]),
    (2, ["train.backend=fsdp", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    (4, ["train.backend=fsdp", "parallel.cp=2", "parallel.cp_impl=ulysses", "train.activation_checkpointing=full"]),
]


@pytest.fixture(scope="module")
def reference(small_data, tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("one_process")
    run = train(1, small_data, out_dir, "data.global_batch_size=8", "train.max_iters=4", "train.eval_interval=4")
    assert run.returncode == 0, output(run)[-3000:]
    return rows_of(out_dir)


@pytest.mark.slow
@pytest.mark.parametrize("ranks,overrides", LAYOUTS, ids=[" ".join(o) for _, o in LAYOUTS])
def test_layout_trains_exactly_as_one_process(ranks, overrides, small_data, reference, tmp_path):
    run = train(ranks, small_data, tmp_path, "data.global_batch_size=8", "train.max_iters=4", "train.eval_interval=4",
                *overrides)
    text = output(run)
    assert run.returncode == 0, text[-4000:]
    backend = next((o.split("=")[1] for o in overrides if o.startswith("train.backend=")), "ddp")
    rows = rows_of(tmp_path, backend)
    want, got = losses(reference), losses(rows)
    assert sorted(got) == [1, 2, 3, 4]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=2e-5, abs=1e-7), f"loss at step {step}"
    final = [r for r in rows if r["step"] == 4 and "val_loss" in r][0]
    ref_final = [r for r in reference if r["step"] == 4 and "val_loss" in r][0]
    for key in ("val_loss", "val_rmse_u10", "persistence_rmse_u10", "val_wrmse_t2m"):
        assert final[key] == pytest.approx(ref_final[key], rel=2e-5), key
    assert "global batch 8 samples" in text


def test_dali_loader_trains_exactly_as_the_pytorch_loader(small_data, reference, tmp_path):
    from meshtrain.data.era5_dali import dali_available

    if not dali_available():
        pytest.skip("NVIDIA DALI is not installed (pip install 'meshtrain[dali]'); data.loader=dali is optional")
    run = train(1, small_data, tmp_path, "data.global_batch_size=8", "train.max_iters=4", "train.eval_interval=4",
                "data_loader_config=dali", "num_data_workers=2")
    assert run.returncode == 0, output(run)[-4000:]
    assert losses(rows_of(tmp_path)) == losses(reference)  # the same batches, bit for bit


def test_forecaster_beats_persistence_and_reports_it(small_data, tmp_path):
    run = train(1, small_data, tmp_path, "data.batch_size=8", "model.embed_dim=64", "train.max_iters=300",
                "train.eval_interval=100", "train.eval_iters=4", "train.log_interval=50", "optimizer.warmup_iters=10",
                "optimizer.min_lr=1e-4", "train.tensorboard=true", "train.keep_checkpoints=1", "train.profile=torch",
                "train.profile_start=3", "train.profile_steps=2")
    text = output(run)
    assert run.returncode == 0, text[-4000:]
    rows = rows_of(tmp_path)
    evals = [r for r in rows if "val_rmse_u10" in r]
    assert [r["step"] for r in evals] == [0, 100, 200, 300]
    first, last = evals[0], evals[-1]
    assert first["persistence_rmse_u10"] == last["persistence_rmse_u10"] > 0  # the same validation samples
    assert first["val_rmse_u10"] > 2 * first["persistence_rmse_u10"]  # untrained, it is far worse
    assert last["val_rmse_u10"] < 0.85 * last["persistence_rmse_u10"], (first, last)  # trained, clearly better
    assert last["val_skill_u10"] == pytest.approx(1 - last["val_rmse_u10"] / last["persistence_rmse_u10"])
    for key in ("avg_loss", "train_s", "avg_sps", "eval_s", "peak_gb"):  # what NERSC logs per epoch
        assert last[key] > 0, key
    assert last["avg_sps"] == pytest.approx(100 * 8 / last["train_s"])
    run_dir = (tmp_path / "vit" / "ddp" / "latest").resolve()
    assert sorted(p.name for p in (run_dir / "figures").glob("*.png")) == [f"u10_step{s:07d}.png" for s in
                                                                            (0, 100, 200, 300)]
    trace = json.loads((run_dir / "profile" / "trace_rank0.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"forward", "backward", "optimizer", "iteration 3", "iteration 4"} <= names
    assert not {"iteration 2", "iteration 5"} & names

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0}).Reload()
    assert "forecast/u10" in events.Tags()["images"]
    assert events.Scalars("val_rmse_u10")[-1].value == pytest.approx(last["val_rmse_u10"], rel=1e-6)


def test_epochs_set_the_schedule_and_the_learning_rate_follows_the_global_batch(small_data, tmp_path):
    run = train(2, small_data, tmp_path, "train.max_epochs=2", "data.limit_train=40", "data.global_batch_size=8",
                "optimizer.base_batch_size=2", "optimizer.lr=1e-3", "optimizer.warmup_iters=0",
                "optimizer.decay_lr=false", "train.save_checkpoints=false")
    text = output(run)
    assert run.returncode == 0, text[-4000:]
    # 40 samples over 2 ranks in batches of 4: 5 iterations an epoch; lr = 1e-3 x sqrt(8 / 2)
    assert "2 epochs of 5 iterations: 10 iterations, evaluating after each epoch" in text
    assert "learning rate: 0.002 = optimizer.lr 0.001 × sqrt(global batch 8 / base batch 2) = × 2.0000" in text
    rows = rows_of(tmp_path)
    assert [(r["step"], r.get("epoch")) for r in rows if "val_loss" in r] == [(0, 0.0), (5, 1.0), (10, 2.0)]
    lrs = [r["lr"] for r in rows if "lr" in r]
    assert len(lrs) == 10 and all(lr == pytest.approx(2e-3, rel=1e-12) for lr in lrs)


@pytest.mark.parametrize("overrides,message", [
    (["data.crop=[36,64]"], "is 34x64 after data.crop=[36, 64], not a multiple of model.patch_size=4: set "
                            "data.crop=[32, 64]"),
    (["train.compile=model", "train.cuda_graphs=true"], "train.cuda_graphs=true, but CUDA graphs capture GPU kernel "
                                                       "launches and there is none on cpu"),
    (["data.global_batch_size=6", "train.grad_accum=4"], "data.global_batch_size=6 does not split over 1 "
                                                         "data-parallel rank(s) × train.grad_accum=4"),
])
def test_bad_settings_fail_with_one_clear_line(overrides, message, small_data, tmp_path):
    run = train(1, small_data, tmp_path, "train.max_iters=2", *overrides)
    text = output(run)
    assert run.returncode == 1 and message in text, text[-2000:]
    assert "Traceback" not in text


def test_missing_data_names_the_directory_and_the_command(tmp_path):
    run = train(1, tmp_path / "nowhere", tmp_path, "train.max_iters=2")
    text = output(run)
    assert run.returncode == 1 and "Traceback" not in text
    assert f"{tmp_path / 'nowhere' / 'train'} not found" in text and "meshtrain prepare era5-synthetic" in text
