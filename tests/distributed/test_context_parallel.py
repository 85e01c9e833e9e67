"""Context parallelism (Ulysses and ring attention) attends and trains exactly like one process on whole sequences."""

from pathlib import Path

import pytest
from tests.conftest import assert_all_equal, run_driver

CHECK = Path(__file__).with_name("context_parallel_check.py")

# One launch per world size runs many cases: starting gloo dominates the cost of each.
LAUNCHES = {
    2: ["attn-ulysses-2", "attn-ring-2", "errors", "train-ulysses-2", "train-ring-2"],
    4: ["attn-ulysses-4", "attn-ring-4",
        "train-ring-4", "train-ulysses-4",  # cp over all 4 ranks (Ulysses with n_head 4 = cp)
        "train-ring-2", "train-ulysses-2",  # dp 2 × cp 2: DDP over the flattened dp_cp group
        "train-ring-4-ac"],  # applied after activation checkpointing: finds attention under the wrapper
}


@pytest.mark.parametrize("ranks", sorted(LAUNCHES), ids=[f"{r}ranks" for r in sorted(LAUNCHES)])
def test_context_parallel_equals_one_process(ranks):
    results = run_driver(CHECK, ranks, *LAUNCHES[ranks], timeout=180)
    assert_all_equal(results, LAUNCHES[ranks], ranks, "outputs, gradients (and for train-*, loss and parameters "
                     "after 3 SGD steps) within 1e-5 of one process")
