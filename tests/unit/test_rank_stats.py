"""The ranks' spread of timings and the straggler rule, on tables whose answers are known."""

from __future__ import annotations

import math

import torch

from meshtrain.train import rank_stats
from meshtrain.train.rank_stats import FIGURES, StragglerWatch, spread


def table(dt: list[float], **others: list[float]) -> list[list[float]]:
    columns = {"dt": dt, **others}
    return [[columns[name][rank] if name in columns else math.nan for name in FIGURES] for rank in range(len(dt))]


def test_spread_is_min_median_max_and_the_rank_with_the_most():
    ranks = spread(table([0.2, 0.5, 0.3, 0.25], data=[0.01, 0.02, 0.30, 0.01]))
    assert ranks["dt"] == {"min": 0.2, "median": 0.275, "max": 0.5, "slowest": 1, "each": [0.2, 0.5, 0.3, 0.25]}
    assert ranks["data"]["slowest"] == 2 and ranks["data"]["median"] == 0.015
    assert set(ranks) == {"dt", "data"}  # figures no rank has (a pipeline's dtfb here) are left out


def test_a_figure_only_some_ranks_have_is_spread_over_those():
    rows = table([0.2, 0.4], dtfb=[math.nan, 0.3])
    assert spread(rows)["dtfb"] == {"min": 0.3, "median": 0.3, "max": 0.3, "slowest": 1, "each": [None, 0.3]}


def test_each_rank_is_kept_up_to_a_size():
    many = spread(table([1.0] * (rank_stats.EACH_UP_TO + 1)))["dt"]
    assert "each" not in many and many["min"] == many["max"] == 1.0


def test_one_process_gathers_its_own_row():
    rows = rank_stats.gather({"dt": 0.5, "mem_gb": 1.5, "ignored": 9.0}, torch.device("cpu"))
    assert len(rows) == 1 and rows[0][FIGURES.index("dt")] == 0.5 and rows[0][FIGURES.index("mem_gb")] == 1.5
    assert math.isnan(rows[0][FIGURES.index("dtf")])


def watch_over(lead_ins: list[list[float]], dt=1.0, ratio=1.2, intervals=3) -> list[str | None]:
    """What the watch says over intervals whose every rank's step took `dt` (they wait for each other), each rank's
    lead-in (here all of it waiting for batches) as given."""
    watch = StragglerWatch(ratio, intervals, [f"node{r // 2}" for r in range(len(lead_ins[0]))])
    return [watch.update(10 * (i + 1), spread(table([dt] * len(lead), lead_in=lead, data=lead)))
            for i, lead in enumerate(lead_ins)]


def test_a_rank_late_for_three_intervals_is_named_once_with_its_host():
    said = watch_over([[0.0, 0.01, 0.5, 0.0]] * 6)
    assert said[:2] == [None, None] and said[3:] == [None, None, None]
    assert said[2].startswith("straggler: rank 2 (host node1) has been the last to reach its step's first "
                              "collective for 3 log intervals in a row, 0.495 s after the median rank at step 30")
    assert "50% of the median step (1.000 s)" in said[2]
    assert "Its batches took 0.500 s against a median of 0.005 s" in said[2]


def test_no_straggler_when_the_late_rank_changes_or_nobody_is_late_enough():
    assert watch_over([[0.5, 0.0, 0.0, 0.0], [0.0, 0.5, 0.0, 0.0]] * 3) == [None] * 6  # never the same rank twice
    assert watch_over([[0.5, 0.5, 0.5, 0.5]] * 4) == [None] * 4  # slow everywhere: nobody to wait for
    assert watch_over([[0.0, 0.1, 0.0, 0.0]] * 4) == [None] * 4  # 10% of the step, under 20%
    assert watch_over([[0.0, 0.0, 0.5, 0.0]] * 2 + [[0.0] * 4] + [[0.0, 0.0, 0.5, 0.0]] * 2) == [None] * 5
    assert watch_over([[0.5]] * 5) == [None] * 5  # one rank
