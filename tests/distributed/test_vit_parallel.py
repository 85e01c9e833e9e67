"""The weather ViT under tensor parallel (± sequence parallel, ± FSDP2) and context (token) parallel (Ulysses, ring;
± data parallel, ± tensor parallel) trains exactly like one process; the non-causal CP kernels equal SDPA."""

from pathlib import Path

import pytest
from tests.conftest import assert_all_equal, run_driver

CHECK = Path(__file__).with_name("vit_parallel_check.py")

# One launch per world size runs many cases: starting gloo dominates the cost of each.
LAUNCHES = {
    2: ["attn-ulysses", "attn-ring",  # cp = 2: kernel vs SDPA(is_causal=False), outputs and input gradients
        "errors",
        "tp", "tp-sp",  # tp = 2, without and with sequence parallel
        "cp-ulysses", "cp-ring"],  # cp = 2, DDP over dp_cp = cp
    4: ["attn-ring",  # cp = 4: the K/V and their gradients go round a ring of 4
        "tp",  # tp = 4
        "fsdp-tp",  # FSDP2 on dp = 2 after tp = 2
        "cp-ulysses", "cp-ring",  # dp = 2 × cp = 2, DDP over the flattened dp_cp mesh
        "tp-cp-ring"],  # tp = 2 × cp = 2, FSDP2 over dp_shard_cp averaging the cp ranks' gradients
}


@pytest.mark.parametrize("ranks", sorted(LAUNCHES), ids=[f"{r}ranks" for r in sorted(LAUNCHES)])
def test_vit_parallel_equals_one_process(ranks):
    results = run_driver(CHECK, ranks, *LAUNCHES[ranks], timeout=240)
    assert_all_equal(results, LAUNCHES[ranks], ranks, "outputs and gradients (and for training cases loss, "
                     "gradient norm and parameters after 3 SGD steps) within 1e-5 of one process")
