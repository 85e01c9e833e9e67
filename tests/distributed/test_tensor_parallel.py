"""Tensor parallel (with sequence and loss parallel, alone or under FSDP2) trains like one process, shards as
promised, and refuses what it cannot do with the numbers."""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tests.conftest import SharedLaunches, assert_all_equal

from meshtrain.models.gpt.model import GPT, GPTConfig
from meshtrain.models.gpt.parallelize import apply_tensor_parallel
from meshtrain.parallel.tensor_parallel import loss_parallel_context

CHECK = Path(__file__).with_name("tensor_parallel_check.py")
TINY = dict(block_size=16, vocab_size=65, n_layer=2, n_head=4, n_embd=32)

# case, ranks, tp: (a) plain tp=2, (b) tp=2 + sequence + loss parallel, (c) the same on tp=4, under activation
# checkpointing too, (d) fsdp 2 × tp 2 with sequence + loss parallel
CASES = [("tp", 2, 2), ("tp-sp-lp", 2, 2), ("tp-sp-lp:ac=full", 4, 4), ("fsdp-tp", 4, 2)]


@pytest.fixture(scope="module")
def launches() -> SharedLaunches:
    return SharedLaunches(CHECK, CASES, timeout=240)


@pytest.mark.parametrize("case,ranks,tp", CASES, ids=[f"{c[0]}-{c[1]}ranks" for c in CASES])
def test_tensor_parallel_equals_one_process_and_shards_exactly(launches, case, ranks, tp):
    results = launches(ranks)
    assert_all_equal(results, [case], ranks, "loss, gradients, norm, parameters and sampling within 1e-5 of one "
                     "process")
    whole = 2 * 12 * 32 ** 2  # q, k, v, attn.c_proj (4·C²) + mlp.c_fc, mlp.c_proj (8·C²) per block
    # 65 vocab rows over the tp ranks the way torch.chunk splits them: no padding, the last rank short.
    chunk = math.ceil(65 / tp)
    rows_of = {tp_rank: min(chunk, 65 - tp_rank * chunk) for tp_rank in range(tp)}
    assert sum(rows_of.values()) == 65
    for rank in range(ranks):
        holds = results[rank][case]
        tp_rank, block, total, rows = (holds[k] for k in ("tp_rank", "block_matrices", "whole_block_matrices",
                                                          "wte_rows"))
        assert total == whole and block == whole // tp, "each tp rank holds exactly 1/tp of the block matrices"
        assert rows == rows_of[tp_rank], f"tp rank {tp_rank} holds {rows} of the 65 embedding rows"


def test_blocks_wrapped_before_tensor_parallel_are_refused():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = GPT(GPTConfig(**TINY))
    model.transformer.h["1"] = checkpoint_wrapper(model.transformer.h["1"])
    with pytest.raises(ValueError, match="block 1 is a CheckpointWrapper.*before activation checkpointing"):
        apply_tensor_parallel(model, SimpleNamespace(size=lambda: 2, ndim=1))


def test_one_rank_or_no_tp_mesh_leaves_the_model_alone():
    model = GPT(GPTConfig(**TINY))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    apply_tensor_parallel(model, None)
    apply_tensor_parallel(model, SimpleNamespace(size=lambda: 1, ndim=1))
    assert all(type(p) is torch.nn.Parameter and torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_loss_parallel_context_nests_and_leaves_plain_tensors_alone():
    logits, targets = torch.randn(6, 65), torch.randint(0, 65, (6,))
    expected = torch.nn.functional.cross_entropy(logits, targets)
    with loss_parallel_context(True), loss_parallel_context(True), loss_parallel_context(False):
        inner = torch.nn.functional.cross_entropy(logits, targets)
    with pytest.raises(RuntimeError), loss_parallel_context(True):
        raise RuntimeError("a failed step")
    from meshtrain.parallel import tensor_parallel

    assert tensor_parallel._loss_parallel_depth == 0, "the context unwinds, also on an exception"
    assert torch.equal(inner, expected)
