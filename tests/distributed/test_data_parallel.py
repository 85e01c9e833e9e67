"""Each data-parallel backend trains like one process on the whole batch, and shards what it says it does."""

from pathlib import Path

import pytest
from tests.conftest import SharedLaunches, assert_all_equal

CHECK = Path(__file__).with_name("data_parallel_check.py")

# case (backend[:options]), ranks, which of params/grads/optimizer are sharded over how many ranks
CASES = [
    ("ddp", 2, {}),
    ("ddp", 4, {}),
    ("zero1", 2, {"optimizer": 2}),
    ("zero2", 2, {"params": 2, "grads": 2, "optimizer": 2}),
    ("fsdp", 2, {"params": 2, "grads": 2, "optimizer": 2}),
    ("zero3", 4, {"params": 4, "grads": 4, "optimizer": 4}),
    ("fsdp:cpu-offload", 2, {"params": 2, "grads": 2, "optimizer": 2}),
    ("hsdp", 4, {"params": 2, "grads": 2, "optimizer": 2}),  # 2 replicas x 2 shards
    ("fsdp:ac=full", 2, {"params": 2, "grads": 2, "optimizer": 2}),  # activation checkpointing composes
]


@pytest.fixture(scope="module")
def launches() -> SharedLaunches:
    return SharedLaunches(CHECK, CASES, timeout=240)


@pytest.mark.parametrize("case,ranks,sharded", CASES, ids=[f"{c[0]}-{c[1]}ranks" for c in CASES])
def test_backend_equals_one_process_and_shards_as_promised(launches, case, ranks, sharded):
    results = launches(ranks)
    assert_all_equal(results, [case], ranks, "loss, gradients and parameters within 1e-5 of one process")
    held = {rank: results[rank][case]["held"] for rank in range(ranks)}
    for kind in ("params", "grads", "optimizer"):
        whole = results[0][case]["whole"][kind]
        mine = [held[r][kind] for r in range(ranks)]
        shards = sharded.get(kind, 1)
        if shards == 1:
            assert mine == [whole] * ranks, f"{kind} are replicated under {case}"
        else:  # the shards of one replica partition the whole exactly, about 1/shards each
            for replica in range(ranks // shards):
                group = mine[replica * shards:(replica + 1) * shards]
                assert sum(group) == whole, f"{kind} shards of replica {replica} sum to the whole"
            assert max(mine) <= whole / shards * 1.05, f"each rank holds about 1/{shards} of the {kind}"
