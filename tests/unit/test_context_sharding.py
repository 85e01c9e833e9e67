"""The sequence-sharding arithmetic of context parallelism: which tokens each cp rank keeps, and clear refusals."""

import pytest
import torch

from meshtrain.parallel.context_parallel import (
    CP_IMPLS,
    ContextParallelError,
    apply_context_parallel,
    sequence_positions,
    shard_sequence,
)


def test_ring_zigzag_positions_cp2():
    # 16 tokens, 4 chunks of 4: rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2.
    assert sequence_positions(16, 0, 2, "ring").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert sequence_positions(16, 1, 2, "ring").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_ring_zigzag_positions_cp4():
    # 16 tokens, 8 chunks of 2: rank r keeps chunks r and 7 - r.
    want = {0: [0, 1, 14, 15], 1: [2, 3, 12, 13], 2: [4, 5, 10, 11], 3: [6, 7, 8, 9]}
    for rank, positions in want.items():
        assert sequence_positions(16, rank, 4, "ring").tolist() == positions


def test_ulysses_contiguous_positions():
    assert sequence_positions(16, 0, 2, "ulysses").tolist() == list(range(0, 8))
    assert sequence_positions(16, 1, 2, "ulysses").tolist() == list(range(8, 16))
    assert [sequence_positions(16, r, 4, "ulysses").tolist() for r in range(4)] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


@pytest.mark.parametrize("impl", CP_IMPLS)
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_ranks_partition_the_sequence(impl, cp):
    seq_len = 24
    allpos = torch.cat([sequence_positions(seq_len, r, cp, impl) for r in range(cp)])
    assert sorted(allpos.tolist()) == list(range(seq_len))
    assert {len(sequence_positions(seq_len, r, cp, impl)) for r in range(cp)} == {seq_len // cp}


def test_zigzag_balances_causal_work():
    # Causal work of a query = number of keys it sees = its position + 1; every ring rank gets the same total.
    work = [int((sequence_positions(32, r, 4, "ring") + 1).sum()) for r in range(4)]
    assert len(set(work)) == 1, work
    contiguous = [int((sequence_positions(32, r, 4, "ulysses") + 1).sum()) for r in range(4)]
    assert contiguous[-1] > 3 * contiguous[0]  # what zigzag avoids


def test_shard_sequence_slices_idx_and_targets_with_positions():
    idx = torch.arange(2 * 16).reshape(2, 16)
    targets = idx + 100
    x, y, positions = shard_sequence(idx, targets, 1, 4, "ring")
    assert positions.tolist() == [2, 3, 12, 13]
    assert positions.dtype == torch.long
    assert x.tolist() == [[2, 3, 12, 13], [18, 19, 28, 29]]
    assert y.tolist() == [[102, 103, 112, 113], [118, 119, 128, 129]]
    x, y, positions = shard_sequence(idx, None, 0, 2, "ulysses")
    assert y is None and x.tolist() == [list(range(8)), list(range(16, 24))]


def test_sequence_not_divisible_by_two_cp_is_refused_for_ring():
    with pytest.raises(ContextParallelError, match=r"sequence length 12 is not divisible by 8.*cp=4"):
        shard_sequence(torch.zeros(1, 12, dtype=torch.long), None, 0, 4, "ring")
    with pytest.raises(ContextParallelError, match=r"sequence length 10 is not divisible by 4.*multiple of 4"):
        sequence_positions(10, 0, 2, "ring")


def test_sequence_not_divisible_by_cp_is_refused_for_ulysses():
    sequence_positions(12, 0, 4, "ulysses")  # 12 % 4 == 0 suffices without zigzag
    with pytest.raises(ContextParallelError, match=r"sequence length 10 is not divisible by 4"):
        sequence_positions(10, 0, 4, "ulysses")


def test_bad_impl_and_rank_are_refused():
    with pytest.raises(ContextParallelError, match="choose one of ulysses, ring"):
        sequence_positions(16, 0, 2, "zigzag")
    with pytest.raises(ContextParallelError, match="cp_rank=2"):
        sequence_positions(16, 2, 2, "ring")
    with pytest.raises(ContextParallelError, match="choose one of ulysses, ring"):
        apply_context_parallel([], None, "allgather")


def test_errors_are_value_errors():
    assert issubclass(ContextParallelError, ValueError)
