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

    def step_times(ranks, runs_of_models):
        runs.extend(runs_of_models)
        depths = [next(int(o.split("=")[1]) for o in overrides if o.startswith(("model.n_layer=", "model.depth=")))
                  for _, overrides in runs_of_models]
        return [1e-3 * depth + 5e-3 for depth in depths]

    monkeypatch.setattr(calibrate, "_step_times", step_times)
    monkeypatch.setattr(calibrate, "_modelled_s", lambda ranks, model, overrides: 0.0)
    recorded = {4}  # the worlds whose collectives the profile holds

    def record(ranks, progress):
        runs.append(("collectives", ranks))
        recorded.add(ranks)

    monkeypatch.setattr(calibrate, "_record_collectives", record)
    monkeypatch.setattr(calibrate, "recorded_collectives",
                        lambda hw, device: {("all_reduce", world): [(8.0, 1e-4)] for world in recorded})
    yield runs
    profile.clear()


def test_collectives_are_recorded_first_for_each_group_size_the_profile_lacks(fake_runs, monkeypatch):
    """A layout's groups are as large as any divisor of its ranks (tp 2 of 4), and a smaller group's call costs
    less: each size is benched once, before any other run."""
    calibrate.calibrate(4, [], "gpt", progress=lambda _: None)
    assert fake_runs == [("collectives", 2)], "4 ranks are recorded; groups of 2 are not"
    calibrate.calibrate(4, [], "gpt", progress=lambda _: None)
    assert fake_runs == [("collectives", 2)], "both recorded: nothing to do"
    calibrate.calibrate(8, [], "gpt", progress=lambda _: None)
    assert fake_runs == [("collectives", 2), ("collectives", 8)], "2 and 4 are recorded, 8 is not"
    calibrate.calibrate(1, [], "gpt", progress=lambda _: None)
    assert len(fake_runs) == 2, "one rank has no collective to time"


def test_a_failed_calibration_run_names_the_ranks_error_and_the_run(monkeypatch):
    """What a user sees when a tiny run fails: the rank's own error and the command that shows all, not the tail of
    torchrun's traceback cut mid-word."""
    from meshtrain.errors import MeshtrainError
    from meshtrain.runtime.results import Job

    output = ("run 0 rank 0: step_s=0.01\n[2026-11-26][ERROR][rank 0/1] CUDA out of memory in the tiny run\n"
              "Traceback (most recent call last):\n  File \"/x/torch/distributed/elastic/...\"\n" + "=" * 60)
    jobs = []
    monkeypatch.setattr(calibrate, "run_ranks", lambda *args, **kw: jobs.append(args) or Job(
        1, output, {0: {"run 0": {"step_s": 0.01}}}))
    with pytest.raises(MeshtrainError) as failed:
        calibrate._step_times(1, [("gpt", ["model.n_layer=4"]), ("gpt", ["model.n_layer=8"])])
    said = str(failed.value)
    assert "in the run `model.n_layer=8`: [2026-11-26][ERROR][rank 0/1] CUDA out of memory" in said, said
    assert said.endswith("torchrun --nproc-per-node 1 -m meshtrain.plan.measured.measure gpt model.n_layer=8")
    assert len(jobs) == 1 and '"run 1": {"model": "gpt", "overrides": ["model.n_layer=8"]}' in jobs[0][
        jobs[0].index("--cases") + 1]


@pytest.mark.parametrize("model, depth_key", [("gpt", "model.n_layer"), ("llama", "model.n_layer"),
                                               ("moe", "model.n_layer"), ("vit", "model.depth")])
def test_each_model_is_calibrated_tiny_on_itself(fake_runs, tmp_path, model, depth_key):
    known = calibrate.calibrate(2, ["backend:ddp"], model, data_root=str(tmp_path), progress=lambda _: None)
    assert known["backend:ddp"] == pytest.approx([1e-3, 5e-3])  # per block, per step
    tiny = registry.get(model).tiny
    assert [m for m, _ in fake_runs] == ["collectives", model, model]
    del fake_runs[0]
    assert [o[:len(tiny)] for _, o in fake_runs] == [list(tiny)] * 2
    assert [o[len(tiny) + 1] for _, o in fake_runs] == [f"{depth_key}=4", f"{depth_key}=8"]
    assert fixed_costs.cached(2, model) == known  # kept under the model's own name
    roots = {o for _, overrides in fake_runs for o in overrides if o.startswith("data.root=")}
    # a language model on the shipped corpus prepared aside (the user's data root may hold another corpus or none)
    assert (roots == {f"data.root={tmp_path}"}) == (model == "vit"), roots
    # whatever corpus the model's defaults name (the Llama's and the MoE's: GPT-2 BPE, a download away)
    assert all(("data.name=shakespeare_char" in o) == (model != "vit") for _, o in fake_runs)


def test_a_cold_profile_measures_the_slowdown_and_every_kind_in_one_job(fake_runs, monkeypatch, tmp_path):
    """An empty machine profile (a new machine): the reference's ddp, the slowdown of ranks sharing cores and the
    model's own kinds run in one job (the ranks start once), and are fitted in the order each rests on the last. The
    slowdown runs here take what the cost model gives at a slowdown of 1.7 with the ddp costs the tiny runs imply
    (1 ms a block, 5 ms a step): the fit reads back 1.7."""
    from dataclasses import replace

    from meshtrain import config as config_mod
    from meshtrain.parallel.mesh import ParallelDims
    from meshtrain.plan.cost import predict
    from meshtrain.plan.measured.this_machine import this_machine
    from meshtrain.plan.workload import ModelFacts

    monkeypatch.setattr(calibrate, "cached_slowdown", fixed_costs.cached_slowdown)
    tiny_times, jobs = calibrate._step_times, []

    def step_times(ranks, runs):
        jobs.append(runs)
        if not any("model.n_embd=192" in overrides for _, overrides in runs):
            return tiny_times(ranks, runs)
        cfg = config_mod.load_config(runs[0][1], "gpt")  # the first three: the slowdown's
        machine = replace(this_machine(ranks), fixed={"backend:ddp": [1e-3, 5e-3]}, slowdown=1.7,
                          slowdown_under_autocast=None)
        slowed = predict(ModelFacts.of(cfg), cfg, ParallelDims.from_config(cfg, ranks), machine).step_s
        return [slowed, slowed, slowed, *tiny_times(ranks, runs[3:])]

    monkeypatch.setattr(calibrate, "_step_times", step_times)
    known = calibrate.calibrate(2, ["cp:ring"], "vit", data_root=str(tmp_path), progress=lambda _: None)
    assert len(jobs) == 1, "one job"
    # the slowdown's three first, then the ViT's ddp and cp:ring and the reference GPT's ddp, each at 2 depths
    assert [m for m, _ in jobs[0]] == ["gpt"] * 3 + ["vit"] * 4 + ["gpt"] * 2
    assert known == {"backend:ddp": pytest.approx([1e-3, 5e-3]), "cp:ring": pytest.approx([0.0, 0.0])}
    assert fixed_costs.cached(2, "gpt") == {"backend:ddp": pytest.approx([1e-3, 5e-3])}
    assert fixed_costs.cached_slowdown(2) == pytest.approx(1.7)
    jobs.clear()
    calibrate.calibrate(2, ["cp:ring"], "vit", data_root=str(tmp_path), progress=lambda _: None)
    assert jobs == [], "all cached: nothing measured again"


def test_a_model_without_a_tiny_configuration_is_not_calibrated(fake_runs, monkeypatch):
    plain = dataclasses.replace(registry.get("gpt"), name="plain", tiny=())
    monkeypatch.setitem(registry._loaded, "plain", plain)
    said = []
    assert calibrate.calibrate(2, ["backend:ddp"], "plain", progress=said.append) == {}
    assert fake_runs == [("collectives", 2)] and "no tiny configuration" in said[0]  # the machine's, still


def test_expert_parallel_is_calibrated_at_its_size_with_enough_experts():
    assert calibrate.runs_of("ep:2", "moe") == (["train.backend=ddp", "parallel.ep=2", "model.n_experts=8"],
                                                "backend:ddp")
    assert calibrate.runs_of("ep:16", "moe")[0][-1] == "model.n_experts=16"


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
    slow = calibrate._step_times
    monkeypatch.setattr(calibrate, "_step_times", lambda *args: (time.sleep(0.4), slow(*args))[1])
    try:
        with caplog.at_level(logging.INFO, logger="meshtrain"), progress.said_while_quiet():
            calibrate.calibrate(2, ["cp:ring"], "gpt", progress=lambda _: None)  # measured against ddp
    finally:
        heartbeat.note(step=0, phase="start-up", collective=None)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("still ")]
    # one job runs the tiny runs of both kinds (ranks started once)
    assert any(m.startswith("still measuring the fixed costs of backend:ddp, cp:ring (gpt) on 2 ranks (4 runs in "
                            "one job) (") for m in said), said


def test_recalibrating_measures_the_model_and_the_slowdown_again_and_keeps_the_rest(fake_runs):
    """`plan --validate --recalibrate` forgets what a drifting machine's last calibration read: the model's fixed
    costs, the slowdown in the dtype validated and the reference's own fixed costs it stands on; other rank counts'
    and dtypes' figures stay. The next calibration then runs the model's kinds again."""
    calibrate.calibrate(4, ["backend:ddp"], "vit", data_root="unused", progress=lambda _: None)
    for ranks in (2, 4):
        for model in ("gpt", "vit"):
            profile.remember("plan_fixed", fixed_costs.key(ranks, model), {"backend:ddp": [1.0, 2.0]})
        for dtype in ("fp32", "bf16"):
            profile.remember("plan_slowdown", fixed_costs.slowdown_key(ranks, dtype), 2.5)
    fixed_costs.forget(4, "vit", "fp32")
    kept = profile.read_cache()
    assert set(kept["plan_fixed"]) == {fixed_costs.key(2, "gpt"), fixed_costs.key(2, "vit")}
    assert set(kept["plan_slowdown"]) == {fixed_costs.slowdown_key(2, "fp32"), fixed_costs.slowdown_key(2, "bf16"),
                                          fixed_costs.slowdown_key(4, "bf16")}
    fake_runs.clear()
    calibrate.calibrate(4, ["backend:ddp"], "vit", data_root="unused", progress=lambda _: None)
    assert [model for model, _ in fake_runs] == ["vit", "vit"], "ddp's fixed costs at both depths, measured again"


def test_recalibrate_without_validate_is_one_clear_error(capsys):
    from meshtrain.commands import main

    assert main(["plan", "gpt", "--recalibrate"]) != 0
    said = capsys.readouterr()
    assert "--recalibrate measures this machine again for --validate: add --validate N" in said.out + said.err


@pytest.mark.parametrize("model", registry.names())
def test_every_preset_of_every_model_can_be_measured(model, tmp_path):
    """plan --validate and calibration run each layout through measure.py, which adds its own settings (steps only,
    iterations counted) to the user's: none of them may refuse a preset (the ViT's counts epochs)."""
    from meshtrain import config as config_mod
    from meshtrain.plan.measured import measure

    presets = sorted(path.stem for path in registry.get(model).presets.glob("*.yaml"))
    assert presets, f"{model} has no presets"
    for preset in presets:
        cfg = measure.run_config(model, [f"preset={preset}"], str(tmp_path))
        assert cfg.train.max_epochs is None and cfg.train.eval_interval == 1000000, preset
    with pytest.raises(config_mod.ConfigError):  # the settings are checked as train checks them
        measure.run_config(model, ["train.no_such_key=1"], str(tmp_path))


def test_a_layout_that_fails_to_run_is_named_with_its_error_not_torchruns_closing_lines():
    from meshtrain.runtime.results import first_error

    output = """Traceback (most recent call last):
    raise ConfigError(f"train.eval_interval={t.eval_interval}: with")
meshtrain.config.ConfigError: train.eval_interval=1000000: with train.max_epochs=30 (from the preset) the run
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================"""
    assert first_error(output).startswith("meshtrain.config.ConfigError: train.eval_interval=1000000")
    logged = "[2026][ERROR][rank 1/4] data/x not found"
    assert first_error(f"{logged}\nTraceback\nValueError: x") == logged
    ranks = "[rank0]: Traceback (most recent call last):\n[rank0]: meshtrain.data.text.DataError: x not found\n" + "=" * 60
    assert first_error(ranks) == "meshtrain.data.text.DataError: x not found"  # torchrun's prefix of a rank's lines
    assert first_error("") == "no output" and first_error("killed\n====") == "===="


def test_validation_prepares_a_shipped_corpus_and_names_the_command_for_any_other(tmp_path):
    """`plan --validate` on a machine with no data/ yet: the shipped corpus is prepared where the config looks; a
    corpus of the user's own is one error saying what to run, before any calibration starts."""
    from meshtrain import config as config_mod
    from meshtrain.data import text
    from meshtrain.plan.measured import validate

    said = []
    cfg = config_mod.load_config([f"data.root={tmp_path}", "data.name=shakespeare_char"], "gpt")
    validate.ensure_data("gpt", cfg, said.append)
    assert text.load_meta(tmp_path / "shakespeare_char")["train_tokens"] == 1_003_854
    assert "`meshtrain prepare shakespeare_char --data-root" in said[0]
    validate.ensure_data("gpt", cfg, said.append)
    assert len(said) == 1, "prepared once"
    own = config_mod.load_config([f"data.root={tmp_path}", "data.name=my_corpus"], "gpt")
    with pytest.raises(text.DataError, match=r"--validate trains the layouts on .*my_corpus: .*"
                                             r"`meshtrain prepare text PATH --name my_corpus --data-root "):
        validate.ensure_data("gpt", own)


def test_validation_calibrates_the_kinds_auto_may_pick_with_the_spreads_in_one_go(monkeypatch):
    """Each calibration call starts the ranks again: the kinds of the first ranked layouts (auto's pick among them)
    go with the spread's into the first call, so the loop that checks auto's kinds finds none missing."""
    from meshtrain import config as config_mod
    from meshtrain.plan import machines, search, systems
    from meshtrain.plan.cost import fixed_kind, kinds_of
    from meshtrain.plan.measured import validate

    cfg = config_mod.load_config(["preset=cpu", "train.dtype=fp32"], "gpt")
    calls, fixed = [], {}

    def calibrated():
        return dataclasses.replace(machines.from_system(systems.get("polaris")), fixed=dict(fixed))

    def calibrate_kinds(ranks, kinds, model, data_root, progress, dtype):
        calls.append(sorted(kinds))
        fixed.update({fixed_kind(k, dtype): [0.0, 0.0] for k in kinds})

    ranked = search.search(cfg, 1, 4, calibrated())[0]
    monkeypatch.setattr(validate, "ensure_data", lambda *args: None)
    monkeypatch.setattr(calibrate, "calibrate", calibrate_kinds)
    monkeypatch.setattr(validate, "run", lambda model, overrides, chosen, ranks, **kw: [
        validate.Check(c, None, "not run") for c in chosen])
    checks, auto = validate.validate_plan("gpt", [], cfg, ranked, 1, 1, 4, calibrated, progress=lambda _: None)
    assert len(calls) == 1, calls
    wanted = {k for c in [*validate.spread(ranked, 1), *ranked[:validate.AUTO_CANDIDATES]] for k in kinds_of(c.cfg, c.dims)}
    assert set(calls[0]) == wanted and len(wanted) > len(kinds_of(ranked[0].cfg, ranked[0].dims))
    assert auto.candidate.label == ranked[0].label


def test_explain_names_the_slowdown_a_bf16_plan_is_priced_with(fake_runs):
    """`--explain`'s source of the slowdown of ranks sharing cores: fp32's, and the one under autocast where it was
    calibrated, which a bf16 plan's compute is priced with (it said only fp32's 2.00× beside a calibrated 2.5×)."""
    from meshtrain.plan.measured.this_machine import this_machine

    profile.remember("plan_slowdown", fixed_costs.slowdown_key(4, "bf16"), 2.5)
    said = this_machine(4, device="cpu").sources["slowdown"]
    assert said.endswith("; under autocast 2.50×, calibrated"), said
