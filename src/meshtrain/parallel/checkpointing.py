"""Activation checkpointing: keep a block's input, drop its activations, recompute them in backward.

    none        every activation is kept (fastest, the most memory)
    full        every block is recomputed (about one extra forward; activations ~ one per block)
    selective   every `every`-th block is recomputed (a trade between the two)

Applied to the model's blocks before FSDP wraps them (the order torchtitan uses), so it composes
with every data-parallel backend. The wrapper keeps parameter names as they were in checkpoints.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

MODES = ("none", "full", "selective")


def apply_activation_checkpointing(blocks: nn.Module, mode: str, every: int = 2) -> int:
    """Wrap the chosen blocks of `blocks` (a ModuleDict or ModuleList) in place; returns how many were wrapped."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing {mode!r}: choose one of {', '.join(MODES)}")
    if mode == "none":
        return 0
    step = 1 if mode == "full" else every
    chosen = [(name, block) for i, (name, block) in enumerate(blocks.named_children()) if i % step == 0]
    for name, block in chosen:
        # use_reentrant=False: the autograd-friendly variant (works with FSDP2, compile and no-grad inputs);
        # it restores the RNG state, so dropout masks in the recomputation match the first forward.
        setattr(blocks, name, checkpoint_wrapper(block, preserve_rng_state=True))
    return len(chosen)
