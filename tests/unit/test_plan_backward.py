"""The peak inside backward (plan/backward.py): each block's gradients as backward makes them, and the walk from
the last block to the first against a hand count. The runs that check it: tests/distributed/test_plan_runs.py's MoE
job (ddp × tp 2 with full checkpointing, whose ranks peak in the first MoE block's backward)."""

from __future__ import annotations

from dataclasses import replace

from meshtrain.config import load_config
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.plan import backward, machines, systems
from meshtrain.plan.cost import _shares, predict
from meshtrain.plan.workload import ModelFacts

VOCAB = {"meta": {"vocab_size": 65}}
CPU = replace(machines.from_system(systems.get("polaris")), cpu=True)


def test_the_blocks_gradients_and_the_heads_add_up_to_the_ranks_but_the_embeddings():
    """ddp × tp 2: the embedding (wte, 65 × 64, its gradient whole under tp) is made last, after every block's; the
    head (lm_head cut over tp: 33 rows of 64) and the final norm (64) first; the dense block 0 is smaller than the MoE
    blocks 1-3, whose experts are cut over tp by their hidden width."""
    cfg = load_config(["preset=cpu", "model.batch_size=8", "train.dtype=fp32", "train.backend=ddp", "parallel.tp=2"],
                      "moe")
    facts = ModelFacts.of(cfg, VOCAB)
    share, = _shares(facts, cfg, ParallelDims.from_config(cfg, 2, 2))
    assert share.head_grads == 33 * 64 + 64
    assert share.grads - sum(share.block_grads) - share.head_grads == 65 * 64
    assert len(share.block_grads) == 4 and share.block_grads[0] < share.block_grads[1] == share.block_grads[3]
    assert 3 * 8 * 64 * 64 < share.block_grads[1] < 3 * 8 * 128 * 64  # the experts' three stacked tensors, halved


def test_the_walk_is_the_hand_count():
    """Two blocks, each keeping 1 byte (its input) and holding 5 while recomputed, 10 gradient elements each (40
    bytes), a reduce-scatter buffer of 7: at the last block 1 + 5; as it ends 1 + 40 + 7; at the first 0 + 5 + 40 + 7
    (FSDP2 still holds the last block's reduce-scatter input); as it ends 0 + 80 + 7, the most."""
    cfg = load_config(["preset=cpu", "model.batch_size=8", "train.dtype=fp32"], "moe")
    share = replace(_shares(ModelFacts.of(cfg, VOCAB), cfg, ParallelDims.from_config(cfg, 1, 1))[0],
                    block_grads=(10, 10), head_grads=0)
    assert backward.deepest([(1.0, 5.0, 0.0, 0.0)] * 2, share, earlier=0.0, reduced=7.0) == 87.0
    # gradients of earlier micro-steps: all of them from the start, so the last block's recompute, beside the first
    # block's input, is the most: 1 + 5 + 80
    assert backward.deepest([(1.0, 5.0, 0.0, 0.0)] * 2, share, earlier=80.0) == 86.0
    # ring attention's backward inside each block, holding 60 with 30 of the block's gradient bytes made: in the
    # last block 1 + 60 + 30; in the first 0 + 60 + (40 + 30) + 7 (the last block's reduce-scatter input), the most
    assert backward.deepest([(1.0, 5.0, 60.0, 30.0)] * 2, share, earlier=0.0, reduced=7.0) == 137.0
    # with every gradient there from the start, what the ring's point holds beside them: 1 + 60 + 80
    assert backward.deepest([(1.0, 5.0, 60.0, 30.0)] * 2, share, earlier=80.0) == 141.0


def test_full_checkpointing_with_whole_experts_peaks_inside_backward_a_dense_model_where_it_starts():
    moe = load_config(["preset=cpu", "model.batch_size=8", "train.dtype=fp32", "train.backend=ddp", "parallel.tp=2",
                       "train.activation_checkpointing=full"], "moe")
    memory = predict(ModelFacts.of(moe, VOCAB), moe, ParallelDims.from_config(moe, 2, 2), CPU).memory
    assert memory["peak"] == memory["inside backward"] > memory["params"] + memory["optimizer"] + memory["activations"]
    gpt = load_config(["preset=cpu", "model.batch_size=8", "train.dtype=fp32", "train.backend=ddp"], "gpt")
    memory = predict(ModelFacts.of(gpt, VOCAB), gpt, ParallelDims.from_config(gpt, 2, 2), CPU).memory
    assert "inside backward" not in memory  # its saved tensors outweigh its gradients: the start is the most
