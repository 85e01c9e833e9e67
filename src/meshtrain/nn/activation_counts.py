"""What one transformer block saves for its backward per token, counted from its shape alone: pure arithmetic,
without torch, so that what reads a model's spec (the planner, `meshtrain launch` checking a train command) need
not import it. The counts are of nn/transformer.py's Block, checked against autograd's saved tensors
(tests/unit/test_registry.py)."""

from __future__ import annotations

from typing import NamedTuple


def block_activations(width: int, heads: int, hidden: int) -> int:
    """Elements a Block saves for its backward per token (fp32, no dropout or drop path, no activation
    checkpointing), as autograd's saved-tensor hooks count them (tests/unit/test_registry.py): 8 × width for the
    norms, projections and attention, 2 × hidden for the MLP's activations before and after its nonlinearity, a
    log-sum-exp per head and the two norms' statistics (4)."""
    return 8 * width + 2 * hidden + heads + 4


class AutocastActivations(NamedTuple):
    """Elements one block saves for its backward per token under bf16/fp16 autocast, by the dtype they are kept in,
    in two regimes (tests/unit/test_registry.py checks both against autograd):
    with fp32 weights, autocast casts each linear's input itself (linears reading one tensor keep a cast each);
    with 16-bit weights and block input (FSDP2's mixed precision), the linears share their inputs."""

    fp32: int
    low: int  # 16-bit
    attention: int  # q, k, v and the output, in the dtype attention runs in (a machine's)
    fp32_16bit_weights: int
    low_16bit_weights: int


def block_autocast_activations(width: int, heads: int, hidden: int) -> AutocastActivations:
    """What a Block saves per token under autocast. With fp32 weights: the two norms' inputs, their statistics and
    a log-sum-exp per head stay fp32; q, k, v, the output projection and the MLP's first linear each keep a 16-bit
    cast of their input (autocast caches casts of weights, not of activations), and the MLP's activations before and
    after its nonlinearity are 16-bit; attention keeps q, k, v and its output in the dtype it runs in (fp32 on a
    CPU, see `attention`). With 16-bit weights and input only the log-sum-exp stays fp32, and q, k, v share the
    norm's output. The 16-bit copies of the weights themselves are the planner's to count."""
    return AutocastActivations(fp32=2 * width + heads + 4, low=5 * width + 2 * hidden, attention=4 * width,
                               fp32_16bit_weights=heads, low_16bit_weights=5 * width + 2 * hidden + 4)
