"""Calibration takes what it needs from the model's spec (its `tiny` overrides, its depth key) and names no model:
each model is calibrated on itself, and one without a tiny configuration is not calibrated at all."""

from __future__ import annotations

import dataclasses

import pytest

from meshtrain import registry
from meshtrain.machine import profile
from meshtrain.plan.measured import calibrate, fixed_costs


@pytest.fixture
def fake_runs(tmp_path, monkeypatch):
    """Calibration runs that cost 1 ms per block and 5 ms per step beyond the model (no process started)."""
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    profile.clear()
    monkeypatch.setattr(calibrate, "cached_slowdown", lambda ranks, dtype="fp32": 1.0)  # no slowdown run
    runs = []

    def step_s(ranks, model, overrides):
        runs.append((model, overrides))
        depth = next(int(o.split("=")[1]) for o in overrides if o.startswith(("model.n_layer=", "model.depth=")))
        return 1e-3 * depth + 5e-3

    monkeypatch.setattr(calibrate, "_step_s", step_s)
    monkeypatch.setattr(calibrate, "_modelled_s", lambda ranks, model, overrides: 0.0)
    monkeypatch.setattr(calibrate, "_record_collectives", lambda ranks, progress: runs.append(("collectives", ranks)))
    monkeypatch.setattr(calibrate, "recorded_collectives", lambda hw, device: {("all_reduce", 4): [(8.0, 1e-4)]})
    yield runs
    profile.clear()


def test_collectives_are_recorded_first_where_the_profile_has_none_for_these_ranks(fake_runs, monkeypatch):
    calibrate.calibrate(4, [], "gpt", progress=lambda _: None)
    assert fake_runs == [], "4 ranks are recorded: nothing to do"
    calibrate.calibrate(2, [], "gpt", progress=lambda _: None)
    assert fake_runs == [("collectives", 2)], "none for 2 ranks: the bench runs once, before any other"


@pytest.mark.parametrize("model, depth_key", [("gpt", "model.n_layer"), ("llama", "model.n_layer"),
                                               ("vit", "model.depth")])
def test_each_model_is_calibrated_tiny_on_itself(fake_runs, tmp_path, model, depth_key):
    known = calibrate.calibrate(2, ["backend:ddp"], model, data_root=str(tmp_path), progress=lambda _: None)
    assert known["backend:ddp"] == pytest.approx([1e-3, 5e-3])  # per block, per step
    tiny = registry.get(model).tiny
    assert [m for m, _ in fake_runs] == ["collectives", model, model]
    del fake_runs[0]
    assert [o[:len(tiny)] for _, o in fake_runs] == [list(tiny)] * 2
    assert [o[len(tiny) + 1] for _, o in fake_runs] == [f"{depth_key}=4", f"{depth_key}=8"]
    assert fixed_costs.cached(2, model) == known  # kept under the model's own name


def test_a_model_without_a_tiny_configuration_is_not_calibrated(fake_runs, monkeypatch):
    plain = dataclasses.replace(registry.get("gpt"), name="plain", tiny=())
    monkeypatch.setitem(registry._loaded, "plain", plain)
    said = []
    assert calibrate.calibrate(2, ["backend:ddp"], "plain", progress=said.append) == {}
    assert fake_runs == [("collectives", 2)] and "no tiny configuration" in said[0]  # the machine's, still


@pytest.mark.parametrize("model, heads", [("gpt", ["model.n_head=4"]), ("llama", ["model.n_head=4", "model.n_kv_head=4"]),
                                          ("vit", ["model.num_heads=4"])])
def test_tensor_parallel_is_calibrated_at_the_size_a_layout_uses(model, heads):
    overrides, against = calibrate.runs_of("tp:4", model)
    assert overrides == ["train.backend=fsdp", "parallel.tp=4", *heads] and against == "backend:fsdp"
    assert calibrate.runs_of("cp:ring", model) == calibrate.KINDS["cp:ring"]


def test_a_slow_calibration_says_which_kind_it_measures(fake_runs, tmp_path, monkeypatch, caplog):
    """`plan --validate` calibrates for minutes on a slow machine: each quiet spell names the kind under way."""
    import logging
    import time

    from meshtrain.runtime import heartbeat, progress

    monkeypatch.setattr(progress, "QUIET_S", 0.2)
    slow = calibrate._step_s
    monkeypatch.setattr(calibrate, "_step_s", lambda *args: (time.sleep(0.4), slow(*args))[1])
    try:
        with caplog.at_level(logging.INFO, logger="meshtrain"), progress.said_while_quiet():
            calibrate.calibrate(2, ["cp:ring"], "gpt", progress=lambda _: None)  # measured against ddp
    finally:
        heartbeat.note(step=0, phase="start-up", collective=None)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("still ")]
    kinds = ["still measuring the fixed costs of backend:ddp on 2 ranks (gpt, kind 1 of 2) (",
             "still measuring the fixed costs of cp:ring on 2 ranks (gpt, kind 2 of 2) ("]
    assert [kind for kind in kinds if any(m.startswith(kind) for m in said)] == kinds, said
