"""Regret: how much slower the layout the planner ranks first ran than the fastest of those measured, in measured
samples per second (layouts of one plan may differ in samples per step)."""

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
        label = args[0]
        order.append(label)
        if label == "B":
            return Job(1, "[rank0]: RuntimeError: B does not fit", {})
        row = {"rank": 0, "params": 1, "grads": 1, "optimizer": 2, "peak": 7, "step_s": next(step_times[label])}
        return Job(0, "", {0: {"case": row}})

    monkeypatch.setattr(validate, "run_ranks", run_ranks)
    checks = validate.run("gpt", [], candidates, 1, repeats=2, progress=lambda check: None)
    assert order == ["A", "B", "C", "A", "C"]
    a, b, c = checks
    assert a.step_times == (0.10, 0.12) and a.measured["step_s"] == pytest.approx(0.11)
    assert a.spread == pytest.approx(0.02 / 0.11) and c.spread == 0.0 and a.measured["peak"] == 7
    assert b.measured is None and "B does not fit" in b.error
