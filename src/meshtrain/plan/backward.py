"""What a rank holds while backward runs through its blocks, past the point where it starts (plan/cost.py's peak).

Backward frees each block's saved tensors as it leaves the block and makes its gradients there, so the bytes it
holds move block by block, from the last block back to the first:

    at block j    what the blocks before j keep (checkpointed ones only their input) + block j's whole saved set (a
                  checkpointed block recomputed) + the gradients made so far: the head's and final norm's, then those
                  of every block after j (Share.block_grads; all of them already where earlier micro-steps made them)
    as j ends     what the blocks before j keep + the gradients through j + FSDP2's fp32 unsharded gradients of j,
                  which it reduce-scatters (they exist only once j's backward is done and its saved tensors are freed,
                  and until the next block's are issued: at block j also those of the block after it)

Where backward starts, no block's gradient exists yet; by the first block all but the embeddings' do. Which point is
higher depends on the two rates: a block whose gradients outweigh what it keeps (an MoE block's experts under full
checkpointing: each block keeps only its input) raises the holding as backward proceeds,
and the peak is near the first block. A dense model with its activations kept peaks where backward starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshtrain.plan import experts
from meshtrain.plan.activations import op_block_bytes

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig
    from meshtrain.parallel.mesh import ParallelDims
    from meshtrain.plan.machines import Machine
    from meshtrain.plan.shares import Share
    from meshtrain.plan.workload import ModelFacts

FP32 = 4


def block_list(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, share: Share, tokens: int, dense_block: float,
               block_input: float, machine: Machine) -> list[tuple[float, float]]:
    """(what each block of the stage keeps for backward for one micro-batch, what it holds while its own backward
    runs), in forward order: a checkpointed block keeps its input and holds its whole saved set again; under `op`
    a block keeps its matmuls' and attention's outputs and holds besides what recomputing its element-wise ops adds
    (cost._blocks_kept's count for the block backward starts with, here for each)."""
    moe = facts.shape.moe
    moe_layers = set(moe.layers) if moe else set()
    moe_block = experts.moe_block_bytes(facts, cfg, dims, tokens, machine) if moe else 0.0
    rows = experts.routed_rows(facts, dims, tokens) if moe else 0.0
    parts = share.parts or experts.whole_model(facts)
    checkpointed = experts.checkpointed_layers(cfg, parts)
    op = cfg.train.activation_checkpointing == "op"
    out = []
    for i in (i for part in parts for i in part):
        own = moe_block if i in moe_layers else dense_block
        if op:
            kept = op_block_bytes(facts, cfg, dims, tokens, machine, i, rows if i in moe_layers else 0.0)
            out.append((kept, kept + max(0.0, own - (kept - block_input))))
        else:
            out.append((block_input if i in checkpointed else own, own))
    return out


def deepest(blocks: list[tuple[float, float]], share: Share, earlier: float, reduced: float = 0.0) -> float:
    """The most bytes one micro-batch's backward holds inside the stage's blocks beyond what is held throughout (the
    states, buffers, other micro-batches): the saved tensors still kept, the block being run, and the gradients made
    so far (module docstring); `earlier`: gradient bytes that exist from the start (earlier micro-steps');
    `reduced`: bytes held only as a block's backward ends, its saved tensors freed (FSDP2's reduce-scatter input)."""
    if not blocks or len(blocks) != len(share.block_grads):
        return 0.0
    kept = sum(k for k, _ in blocks)
    made = share.head_grads * FP32
    most = pending = 0.0
    for (keeps, holds), grads in zip(reversed(blocks), reversed(share.block_grads), strict=True):
        kept -= keeps
        most = max(most, kept + holds + max(earlier, made) + pending)
        made += grads * FP32
        most = max(most, kept + max(earlier, made) + reduced)
        pending = reduced  # FSDP2 frees a reduce-scatter's input only as it issues the next block's
    return most
