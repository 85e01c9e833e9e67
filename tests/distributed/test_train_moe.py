"""The mixture-of-experts decoder end to end through `meshtrain train moe`: one process whose metrics hold the
routing figures (shares that sum to 1, nothing dropped when dropless) and whose report draws them; and two DDP ranks
against one process with the same global batch (accumulation 2): the same losses and the same routing, so the
balance loss and the bias update see the whole step's tokens on every rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests import preloaded
from tests.conftest import REPO, clean_env, fork_ranks, output, prepare_data

# The cpu preset made smaller (2 MoE layers after 1 dense), with a bias update fast enough to change routing within
# the run, so that a wrongly summed load would show in the losses and shares.
TINY = ["preset=cpu", "model.n_layer=3", "model.block_size=32", "model.batch_size=4", "train.eval_iters=2",
        "train.dtype=fp32", "train.log_interval=1", "train.eval_interval=6", "train.max_iters=6",
        "train.sample_tokens=8", "optimizer.warmup_iters=2", "optimizer.lr=1e-2", "model.bias_update_rate=0.05",
        "train.save_checkpoints=false"]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return prepare_data(tmp_path_factory.mktemp("data"))


def rows_of(out_dir: Path, backend: str = "ddp") -> list[dict]:
    from meshtrain.runtime.rundir import read_jsonl

    return read_jsonl((out_dir / "moe" / backend / "latest").resolve() / "metrics.jsonl")


def one_process(data_root: Path, out_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return preloaded.run([sys.executable, "-m", "meshtrain", "train", "moe", *TINY, f"data.root={data_root}",
                          f"train.out_dir={out_dir}", *overrides], env=clean_env(), cwd=REPO, timeout=180)


def test_one_process_logs_the_routing_and_its_report_draws_it(data_root, tmp_path):
    run = one_process(data_root, tmp_path, "train.report=true")
    said = output(run)
    assert run.returncode == 0, said[-3000:]
    assert "M parameters (" in said and "M active per token)" in said
    evals = [r for r in rows_of(tmp_path) if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 6]
    for row in evals:
        shares = row["expert_share"]["share"]
        assert row["expert_share"]["layers"] == [1, 2] and len(shares) == 2 and all(len(s) == 8 for s in shares)
        assert all(sum(s) == pytest.approx(1.0) for s in shares)  # every assignment reached one of the experts
        assert row["dropped_tokens"] == 0 and row["dropped_frac"] == 0  # dropless
        assert row["expert_share_min"] == min(map(min, shares)) and row["expert_share_max"] == max(map(max, shares))
        assert 0 < row["expert_entropy"] <= 1 and row["balance_loss"] >= 1 - 1e-6  # E·Σ f·P is at least 1
    report = (tmp_path / "moe" / "ddp" / "latest").resolve() / "report"
    assert (report / "experts.png").is_file() and 'alt="experts"' in (report / "report.html").read_text()


def test_two_ddp_ranks_route_and_learn_as_one_process_with_the_whole_batch(data_root, tmp_path):
    ranks = fork_ranks(2, "train", "moe", *TINY, f"data.root={data_root}", f"train.out_dir={tmp_path / 'ddp'}",
                     timeout=180)
    assert ranks.returncode == 0, output(ranks)[-3000:]
    one = one_process(data_root, tmp_path / "one", "train.grad_accum=2")
    assert one.returncode == 0, output(one)[-3000:]
    got, want = rows_of(tmp_path / "ddp"), rows_of(tmp_path / "one")
    losses = lambda rows: {r["step"]: r["loss"] for r in rows if "loss" in r}  # noqa: E731
    assert sorted(losses(got)) == list(range(1, 7))
    assert losses(got) == pytest.approx(losses(want), rel=1e-5)
    last = lambda rows: [r for r in rows if "val_loss" in r][-1]  # noqa: E731
    for key in ("val_loss", "balance_loss", "expert_share_min", "expert_share_max"):
        assert last(got)[key] == pytest.approx(last(want)[key], rel=1e-5), key
    assert np_close(last(got)["expert_share"]["share"], last(want)["expert_share"]["share"])


def np_close(a: list[list[float]], b: list[list[float]]) -> bool:
    return all(x == pytest.approx(y, abs=1e-6) for row_a, row_b in zip(a, b, strict=True)
               for x, y in zip(row_a, row_b, strict=True))


# Expert parallelism's checkpoints reshard: a run saved under fsdp × ep4 on 4 ranks (each rank alone holds 2 of the
# 8 experts, a DTensor Shard(0) over ep) resumed at iteration 6 under fsdp × ep2 on 2 ranks (4 experts a rank, the
# accumulation doubled by train.global_batch_size) and under ddp × tp2 on 2 ranks (ep1: every rank holds every
# expert, half of each one's hidden width: Shard(0) over ep saved, loaded into Shard(1) and Shard(2) over tp) follows
# the uninterrupted run.
RESUMABLE = [*TINY, "model.dropout=0.0", "train.max_iters=12", "train.global_batch_size=16", "train.sample_ledger=true",
             "train.save_checkpoints=true", "train.keep_checkpoints=0", "optimizer.lr_decay_iters=12"]
RESUMED_INTO = [(2, ["train.backend=fsdp", "parallel.ep=2"]), (2, ["train.backend=ddp", "parallel.tp=2"])]


@pytest.mark.slow  # one 4-rank and two 2-rank CLI runs
def test_a_run_saved_under_ep4_resumes_under_ep2_and_tp2_as_if_uninterrupted(data_root, tmp_path):
    from tests.conftest import rewound_copy

    from meshtrain.train.ledger import read_ledger

    full = fork_ranks(4, "train", "moe", *RESUMABLE, f"data.root={data_root}", f"train.out_dir={tmp_path / 'full'}",
                    "train.backend=fsdp", "parallel.ep=4", timeout=240)
    assert full.returncode == 0, output(full)[-3000:]
    full_dir = (tmp_path / "full" / "moe" / "fsdp" / "latest").resolve()
    want, want_ledger = rows_of(tmp_path / "full", "fsdp"), read_ledger(full_dir / "ledger.txt")
    assert sorted(want_ledger) == list(range(12))
    for number, (ranks, layout) in enumerate(RESUMED_INTO):
        split = rewound_copy(full_dir, tmp_path / f"split{number}", 6)
        run = fork_ranks(ranks, "train", "moe", *RESUMABLE, f"data.root={data_root}", f"train.out_dir={tmp_path / 'r'}",
                       *layout, "train.init_from=resume", f"train.run_dir={split}", timeout=240)
        assert run.returncode == 0 and "resuming at iteration 6" in output(run), output(run)[-3000:]
        got = [json.loads(line) for line in (split / "metrics.jsonl").read_text().splitlines()]
        for step, key in [(s, "loss") for s in range(7, 13)] + [(12, "val_loss"), (12, "balance_loss")]:
            mine = next(r[key] for r in got if r["step"] == step and key in r)
            expected = next(r[key] for r in want if r["step"] == step and key in r)
            assert mine == pytest.approx(expected, rel=1e-4), (layout, step, key, mine, expected)
        assert read_ledger(split / "ledger.txt") == want_ledger, layout
