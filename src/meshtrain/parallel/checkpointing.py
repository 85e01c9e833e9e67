"""Activation checkpointing: keep a block's input, drop its activations, recompute them in backward.

    none        every activation is kept (fastest, the most memory)
    full        every block is recomputed (about one extra forward; activations ~ one per block)
    selective   every `every`-th block is recomputed (a trade between the two)
    op          every block keeps its matmuls' and attention's outputs and recomputes only the element-wise ops
                between them (norms, activations, residual adds, dropout): torch's selective checkpoint API

Applied to the model's blocks before FSDP wraps them (the order torchtitan uses), so it composes
with every data-parallel backend. The wrapper keeps parameter names as they were in checkpoints.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

MODES = ("none", "full", "selective", "op")

_aten = torch.ops.aten
# The ops whose outputs `op` keeps: the matmuls (a linear reaches the dispatcher as mm/addmm, or as linear where a
# backend keeps it whole), the MoE experts' grouped GEMM, and the fused attention kernels. What lies between them is
# element-wise: cheap to run again, as large to keep as a matmul's output.
SAVED_OPS = frozenset((
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default, _aten.linear.default,
    _aten._grouped_mm.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default, _aten._scaled_dot_product_cudnn_attention.default,
))


def _draws_random(op, args, kwargs) -> bool:
    """Whether an attention kernel runs dropout: it draws from the generator, and an op kept from the forward is not
    run again in the recomputation, which would shift every later dropout's draws (masks unlike the forward's)."""
    names = [a.name for a in op._schema.arguments]
    if "dropout_p" not in names:
        return False
    i = names.index("dropout_p")
    return bool(kwargs.get("dropout_p", args[i] if i < len(args) else 0.0))


def op_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep the matmuls' and attention's outputs (SAVED_OPS), recompute the rest."""
    if op in SAVED_OPS and not _draws_random(op, args, kwargs):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(blocks: nn.Module, mode: str, every: int = 2) -> int:
    """Wrap the chosen blocks of `blocks` (a ModuleDict or ModuleList) in place; returns how many were wrapped."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing {mode!r}: choose one of {', '.join(MODES)}")
    if mode == "none":
        return 0
    step = every if mode == "selective" else 1
    # op: each forward gets fresh contexts (the cache of kept outputs lives for one forward and its backward)
    options = {"context_fn": partial(create_selective_checkpoint_contexts, op_policy)} if mode == "op" else {}
    chosen = [(name, block) for i, (name, block) in enumerate(blocks.named_children()) if i % step == 0]
    for name, block in chosen:
        # use_reentrant=False: the autograd-friendly variant (works with FSDP2, compile and no-grad inputs);
        # it restores the RNG state, so dropout masks in the recomputation match the first forward.
        setattr(blocks, name, checkpoint_wrapper(block, preserve_rng_state=True, **options))
    return len(chosen)
