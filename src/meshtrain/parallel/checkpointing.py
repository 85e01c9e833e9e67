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


def apply_activation_checkpointing(blocks: nn.ModuleDict, mode: str, every: int = 2) -> int:
    """Wrap the chosen blocks of `blocks` in place; returns how many were wrapped."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing {mode!r}: choose one of {', '.join(MODES)}")
    if mode == "none":
        return 0
    step = 1 if mode == "full" else every
    chosen = [name for i, name in enumerate(blocks.keys()) if i % step == 0]
    for name in chosen:
        # use_reentrant=False: the autograd-friendly variant (works with FSDP2, compile and no-grad inputs);
        # it restores the RNG state, so dropout masks in the recomputation match the first forward.
        blocks[name] = checkpoint_wrapper(blocks[name], preserve_rng_state=True)
    return len(chosen)
