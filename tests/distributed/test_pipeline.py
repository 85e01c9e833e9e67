"""Every pipeline schedule trains like one process on the whole batch, alone and under FSDP2 / DDP.

One torchrun launch of pipeline_check.py per world size runs several schedules (starting the processes is the
slow part); every rank records per schedule whether loss, clipping norm, gradients and parameters of
everything it owns are within 1e-5 of the single-process reference, and how many parameters it holds.
"""

from pathlib import Path

import pytest
from tests.conftest import assert_all_equal, run_driver

CHECK = Path(__file__).with_name("pipeline_check.py")
ALL = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"]
EMBEDDING = 65 * 32  # vocab × n_embd: the second copy of the tied weight on the last stage
EQUAL = "loss, clipping norm, gradients and parameters of what the rank owns within 1e-5 of one process"
# pp=4; pp=2 × dp=2 with DDP-wrapped stages; the same under FSDP2 (one-stage, looped, V + split backward)
FOUR_RANKS = ["1f1b@pp", "1f1b@ddp", "looped_bfs@ddp", "1f1b@fsdp", "interleaved_1f1b@fsdp", "zbv_zero_bubble@fsdp"]


@pytest.fixture(scope="module")
def four_ranks() -> dict[int, dict[str, dict]]:
    """One 4-rank launch for the tests on 4 ranks."""
    return run_driver(CHECK, 4, *FOUR_RANKS, "--errors", timeout=300)


def held_per_replica(results: dict[int, dict[str, dict]], case: str) -> dict[int, int]:
    """dp replica -> parameters its pp ranks hold together beyond the whole model's (counted before sharding)."""
    held: dict[int, int] = {}
    for by_case in results.values():
        mine = by_case[case]
        held[mine["dp"]] = held.get(mine["dp"], 0) + mine["held"]
        whole = mine["whole"]
    return {dp: total - whole for dp, total in held.items()}


def assert_error(results: dict[int, dict[str, dict]], layout: str, what: str, message: str) -> None:
    """Every rank failed the bad `what` under `layout` with an error that starts with `message`."""
    for rank, by_case in results.items():
        got = by_case[f"errors@{layout}"][what]
        assert got.startswith(message), f"rank {rank}, {what}: {got!r}"


def test_every_schedule_on_two_ranks_and_clear_errors():
    cases = [f"{schedule}@pp" for schedule in ALL]
    results = run_driver(CHECK, 2, *cases, "--errors", timeout=240)
    assert_all_equal(results, cases, 2, EQUAL)
    for case in cases:  # each rank keeps only its stages: together the model plus one embedding copy
        assert held_per_replica(results, case) == {0: EMBEDDING}, case
    assert_error(results, "pp", "microbatches", "schedule '1f1b' needs at least as many microbatches as stages: got "
                 "microbatches=1 for 2 stages")
    assert_error(results, "pp", "dualpipev", "schedule 'dualpipev' needs at least as many microbatches as stages: "
                 "got microbatches=3 for 4 stages")
    assert_error(results, "pp", "layers", "4 blocks cannot fill 6 pipeline stages")
    assert_error(results, "pp", "virtual", "schedule 'zbv_zero_bubble' places exactly 2 stages per rank")
    assert_error(results, "pp", "batch", "batch of 6 sequences does not split into 4 microbatches")


def test_four_stages_and_ddp_over_dp2_times_pp2(four_ranks):
    results = four_ranks
    assert_all_equal(results, ["1f1b@pp", "1f1b@ddp", "looped_bfs@ddp"], 4, EQUAL)
    assert held_per_replica(results, "1f1b@pp") == {0: EMBEDDING}
    assert held_per_replica(results, "looped_bfs@ddp") == {0: EMBEDDING, 1: EMBEDDING}
    assert_error(results, "ddp", "ddp", "schedule 'zbv_zero_bubble' computes weight gradients outside autograd's "
                 "backward")


def test_fsdp_over_dp2_times_pp2(four_ranks):
    cases = ["1f1b@fsdp", "interleaved_1f1b@fsdp", "zbv_zero_bubble@fsdp"]
    results = four_ranks
    assert_all_equal(results, cases, 4, EQUAL)
    for case in cases:  # before sharding, each replica's pp ranks hold the model once (+ embedding copy)
        assert held_per_replica(results, case) == {0: EMBEDDING, 1: EMBEDDING}, case
