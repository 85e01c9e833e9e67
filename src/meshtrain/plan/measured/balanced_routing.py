"""Balanced routing for a trace (plan/measured/trace.py): a mixture of experts on fake tensors.

A router's choices are data, and the experts read them on the host: the rows per expert (`counts.tolist()` in the
looped SwiGLU), the rows sent to each expert-parallel rank (the dispatch's split sizes, from an all-to-all of the
counts), the order they arrive in. A fake tensor has no values (`DataDependentOutputException`), and a fake group's
all-to-all returns none, so a trace fixes the routing, as torchtitan's dry run forces balanced routing: every expert
takes an equal share of the rows (tokens × top_k / E, the remainder one each to the first), and every rank routes
alike, so each ep rank sends and receives rows / ep. The router still runs (its scores, top-k and gates are its
own), and so do the balance loss and the tallies, on counts of the right shape whose values nobody reads. What the
traced figure rests on: the balanced expectation, where the planner prices the busiest rank at `--expert-imbalance`
(1.25 by default) × it, and a real run's routing is what its data and balancers make it.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

from meshtrain.models.moe import experts as experts_module
from meshtrain.parallel import expert_parallel
from meshtrain.parallel.expert_parallel import Route, Sent, _exchange


def split(rows: int, parts: int) -> list[int]:
    """`rows` in `parts` as equal as can be, the remainder one each to the first."""
    return [rows // parts + (i < rows % parts) for i in range(parts)]


@contextlib.contextmanager
def balanced_routing():
    """The experts' host reads answered by balanced routing (module docstring), while inside."""
    with mock.patch.object(torch, "bincount", _counts), \
            mock.patch.object(experts_module, "looped_swiglu", _looped_swiglu), \
            mock.patch.object(expert_parallel, "dispatch", _dispatch):
        yield


def _counts(input: torch.Tensor, weights: torch.Tensor | None = None, minlength: int = 0) -> torch.Tensor:
    """torch.bincount's shape under balanced routing (one count per expert: every call site gives minlength), its
    values nobody's: a bincount's length is its largest value's, which a fake tensor has not."""
    return input.new_zeros(minlength, dtype=torch.int64 if weights is None else weights.dtype)


def _looped_swiglu(rows: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                   down: torch.Tensor) -> torch.Tensor:
    """experts.looped_swiglu with each expert's rows an equal share of `rows`."""
    return experts_module.swiglu_by_counts(rows, split(rows.shape[0], gate.shape[0]), gate, up, down)


def _dispatch(rows: torch.Tensor, counts: torch.Tensor, group, ep: int, tally: Sent | None = None):
    """expert_parallel.dispatch with every ep rank sent, and sending back, an equal share of the rows; they arrive
    in expert order already (a permutation of the same bytes in the real dispatch)."""
    tally = tally if tally is not None else Sent()
    tally.bytes += counts.numel() * counts.element_size()  # the counts' own exchange, as dispatch counts it
    sent = split(rows.shape[0], ep)
    arrived = _exchange(rows.contiguous(), sent, sent, group, tally)
    order = torch.arange(arrived.shape[0], device=rows.device)
    return arrived[order], counts.new_zeros(counts.numel() // ep), Route(group, sent, sent, order, tally)
