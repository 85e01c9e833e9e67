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
