"""Regret: how much slower the layout the planner ranks first ran than the fastest of those measured, in measured
samples per second (layouts of one plan may differ in samples per step)."""

import json
from types import SimpleNamespace

import pytest

from meshtrain.plan.measured import validate


def check(predicted_samples_per_s: float, samples_per_step: int, measured_step_s: float | None):
    candidate = SimpleNamespace(throughput=predicted_samples_per_s,
                                cost=SimpleNamespace(samples_per_iteration=samples_per_step))
    return validate.Check(candidate, None if measured_step_s is None else {"step_s": measured_step_s})


def test_the_pick_that_ran_fastest_has_no_regret():
    checks = [check(100, 48, 0.5), check(80, 48, 0.6), check(60, 48, 1.0)]
    assert validate.regret(checks) == 0.0


def test_regret_is_the_shortfall_of_the_pick_in_measured_samples_per_second():
    # the pick (predicted fastest) ran 48 / 0.6 = 80 samples/s; the best ran 96 / 0.8 = 120
    checks = [check(100, 48, 0.6), check(90, 96, 0.8), check(10, 48, None)]  # a failed run is left out
    assert validate.regret(checks) == pytest.approx(1 - 80 / 120)


def test_validation_measures_each_layout_twice_interleaved_and_reports_the_spread(monkeypatch):
    """--validate's repeats: A B C, then A B C (a drift of the machine falls on every layout alike); the step time is
    the mean, the spread (max - min) / mean; the states and peak are the first run's; a layout that failed is not
    run again and reports its error."""
    from meshtrain.runtime.results import Job

    candidates = [SimpleNamespace(label=label, overrides=[label], dims=SimpleNamespace(coords=lambda rank: {}),
                                  cost=SimpleNamespace(memory_stage=0)) for label in ("A", "B", "C")]
    step_times = {"A": iter([0.10, 0.12]), "C": iter([0.30, 0.30])}
    order = []

    def run_ranks(script, ranks, model, *args, timeout):
        (case, (label,)), = json.loads(args[args.index("--cases") + 1]).items()  # one layout a job
        order.append(label)
        if label == "B":
            return Job(1, "[rank0]: RuntimeError: B does not fit", {})
        row = {"rank": 0, "params": 1, "grads": 1, "optimizer": 2, "peak": 7, "step_s": next(step_times[label])}
        return Job(0, "", {0: {case: row}})

    monkeypatch.setattr(validate, "one_job_per_repeat", lambda: False)  # as on a GPU: a job per layout
    monkeypatch.setattr(validate, "run_ranks", run_ranks)
    checks = validate.run("gpt", [], candidates, 1, repeats=2, progress=lambda check: None)
    assert order == ["A", "B", "C", "A", "C"]
    a, b, c = checks
    assert a.step_times == (0.10, 0.12) and a.measured["step_s"] == pytest.approx(0.11)
    assert a.spread == pytest.approx(0.02 / 0.11) and c.spread == 0.0 and a.measured["peak"] == 7
    assert b.measured is None and "B does not fit" in b.error


def test_on_a_cpu_a_repeats_layouts_share_one_job_and_a_failed_job_is_run_again_a_layout_a_job(monkeypatch):
    """On a CPU each repeat is one job of `measure --cases` (a start-up of the ranks per repeat, not per layout); where
    that job fails, its layouts run again one a job, which names the one that failed and keeps the others' figures."""
    from meshtrain.runtime.results import Job

    candidates = [SimpleNamespace(label=label, overrides=[f"train.backend={label}"],
                                  dims=SimpleNamespace(coords=lambda rank: {}), cost=SimpleNamespace(memory_stage=0))
                  for label in ("a", "b", "c")]
    times = {"train.backend=a": iter([0.1, 0.3]), "train.backend=b": iter([0.2, 0.4])}
    jobs = []

    def row(overrides, rank):
        return {"rank": rank, "params": 1, "grads": 1, "optimizer": 2, "peak": 7, "step_s": next(times[overrides[0]])}

    def run_ranks(script, ranks, model, *args, timeout):
        cases = json.loads(args[args.index("--cases") + 1])
        jobs.append(sorted(o[0] for o in cases.values()))
        if "train.backend=c" in [o[0] for o in cases.values()]:  # any job with c in it fails
            return Job(1, "[rank0]: RuntimeError: c does not fit", {0: {"0": {}}})
        return Job(0, "", {0: {case: row(o, 0) for case, o in cases.items()}})

    monkeypatch.setattr(validate, "one_job_per_repeat", lambda: True)
    monkeypatch.setattr(validate, "run_ranks", run_ranks)
    a, b, c = validate.run("gpt", [], candidates, 1, repeats=2, progress=lambda check: None)
    # repeat 1: the three in one job, which fails, then one job each; repeat 2: a and b in one job
    assert jobs == [["train.backend=a", "train.backend=b", "train.backend=c"], ["train.backend=a"],
                    ["train.backend=b"], ["train.backend=c"], ["train.backend=a", "train.backend=b"]]
    assert a.step_times == (0.1, 0.3) and b.step_times == (0.2, 0.4)
    assert c.measured is None and "c does not fit" in c.error


def test_on_a_cpu_each_repeat_runs_the_speed_reference_first_and_the_errors_are_also_given_at_that_speed(
        monkeypatch):
    """A VM's speed moves between the calibration and the measurements: each repeat's job runs the slowdown's own
    reference first, and its step against its calibrated one (here 0.12 and 0.15 s against 0.10: 1.35× slower on
    average) scales every prediction for the step MdAPE at the measured speed, beside the plain one."""
    from meshtrain.runtime.results import Job

    candidates = [SimpleNamespace(label=label, overrides=[label], dims=SimpleNamespace(coords=lambda rank: {}),
                                  throughput=1.0, cost=SimpleNamespace(memory_stage=0, samples_per_iteration=1, comm_bytes={},
                                                                       step_s=0.2, memory=dict.fromkeys(
                                                                           ("params", "grads", "optimizer", "peak"), 1)))
                  for label in ("a", "b")]
    speeds, jobs = iter([0.12, 0.15]), []

    def run_ranks(script, ranks, model, *args, timeout):
        cases = json.loads(args[args.index("--cases") + 1])
        jobs.append(list(cases))
        rows = {case: {"rank": 0, "params": 1, "grads": 1, "optimizer": 1, "peak": 1, "step_s": 0.27}
                for case in cases}
        rows["speed"]["step_s"] = next(speeds)
        return Job(0, "", {0: rows})

    monkeypatch.setattr(validate, "one_job_per_repeat", lambda: True)
    monkeypatch.setattr(validate, "run_ranks", run_ranks)
    checks = validate.run("gpt", [], candidates, 1, repeats=2, progress=lambda check: None,
                          speed=("gpt", ["model.n_embd=192"], 0.10))
    assert jobs == [["speed", "0", "1"]] * 2
    assert [c.drift for c in checks] == [pytest.approx(1.35)] * 2
    summary = validate.summary(checks)
    assert summary["step_mdape"] == pytest.approx(1 - 0.2 / 0.27)  # 25.9% under
    assert summary["machine_drift"] == pytest.approx(0.35)
    assert summary["step_mdape_at_measured_speed"] == pytest.approx(0.2 * 1.35 / 0.27 - 1, abs=1e-12)  # 0
