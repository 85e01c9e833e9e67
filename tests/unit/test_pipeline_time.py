"""plan/pipeline_time.py: the schedule played out gives the textbook bubble on devices of their own, and less
where waiting ranks leave shared cores to busy ones (a number checked by hand below)."""

import pytest

from meshtrain.plan.pipeline_time import pipeline_time, rank_order


@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2),
                                              ("interleaved_1f1b", 3), ("looped_bfs", 2)])
@pytest.mark.parametrize("pp,microbatches", [(2, 2), (2, 8), (4, 4), (4, 8), (8, 16)])
def test_own_devices_give_the_textbook_bubble(schedule, virtual, pp, microbatches):
    one = pipeline_time(schedule, pp, virtual, microbatches, forward_s=1.0, backward_s=2.0)
    work = 3.0 * microbatches
    assert one.busy == pytest.approx(work)
    assert one.makespan - one.busy == pytest.approx((pp - 1) / (microbatches * virtual) * work)


@pytest.mark.parametrize("schedule", ["zbv_zero_bubble", "dualpipev", "interleaved_zero_bubble"])
def test_every_schedule_finishes_its_work(schedule):
    for pp, microbatches in [(2, 4), (4, 8), (4, 16)]:
        one = pipeline_time(schedule, pp, 2, microbatches, forward_s=1.0, backward_s=2.0)
        assert one.busy == pytest.approx(3.0 * microbatches) and one.makespan >= one.busy
        orders = [rank_order(schedule, pp, 2, microbatches, r) for r in range(pp)]
        assert sorted(a for order in orders for a in order) == sorted(
            (forward, stage, m) for forward in (True, False) for stage in range(2 * pp) for m in range(microbatches))


def test_one_f_one_b_orders_as_torch_does():
    # pp 2, 4 micro-batches: rank 0 runs 2 forwards, then a backward before each further forward
    assert [("F" if f else "B") + str(m) for f, _, m in rank_order("1f1b", 2, 1, 4, 0)] == \
        ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]


def test_waiting_ranks_leave_shared_cores_to_the_busy_ones():
    # GPipe on 2 stages, 1 micro-batch, forward 1 s and backward 2 s alone; all ranks busy run 3x slower. Only one
    # stage is ever busy, so each runs at max(1, 3 × 1/2) = 1.5x: (1 + 1 + 2 + 2) × 1.5 = 9 s, not 3 × 6 = 18.
    one = pipeline_time("gpipe", 2, 1, 1, forward_s=1.0, backward_s=2.0, slowdown=3.0)
    assert one.makespan == pytest.approx(9.0) and one.busy == pytest.approx(4.5)
    # with both stages always busy (many micro-batches) it tends to the full slowdown
    many = pipeline_time("1f1b", 2, 1, 64, forward_s=1.0, backward_s=2.0, slowdown=3.0)
    assert 3.0 * 3 * 64 * 0.98 < many.makespan < 3.0 * 3 * 64 * 1.02
