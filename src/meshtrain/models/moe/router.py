"""The router of a mixture-of-experts layer: which k experts each token goes to and with what weights, the two ways
of keeping the experts evenly loaded, and the capacity limit. Plain PyTorch, no distributed code.

Routing (Router.forward), per token x, in fp32:
    logits = gate(x)                          one linear, n_experts outputs
    scores = softmax(logits) over the experts (Mixtral, Qwen)  or  sigmoid(logits) each (DeepSeek-V3)
    chosen = the k experts of highest scores + expert_bias     the bias steers selection only, never a gate
    gates  = the chosen experts' scores, divided by their sum (norm_topk), times route_scale
Ties: the experts are ranked by a stable descending sort of scores + bias, so of two equal values the lower expert
index ranks first. The choice is a function of the values alone, the same on any device and in any layout.

Balance loss (balance_loss): Switch Transformer's (Fedus et al. 2021, eq. 4, with top-k as GShard counts it)

    E · Σ_i f_i · P_i,   f_i = the share of the N·k assignments that went to expert i (selection, before any capacity
                         drop), P_i = the mean over the N tokens of expert i's probability

over the tokens of one forward (one micro-batch on one rank, as Switch computes it per device). Probabilities are the
softmax scores; sigmoid scores are first divided by their sum per token (as DeepSeek-V3's sequence-wise loss does).
It is 1 when both are even and grows to E when every token goes to one expert; f carries no gradient, so the
gradient moves probability away from the busiest experts.

Bias update (update_bias): DeepSeek-V3's auxiliary-loss-free balancing (DeepSeek-V3 report, section 2.1.2): after
each optimizer step every expert's bias moves by γ toward the mean load,

    b_i ← b_i + γ · sign(mean_j load_j − load_i)

an overloaded expert's bias falls by γ, an underloaded one's rises by γ, an expert exactly at the mean keeps its
bias. The loads are the assignments of the whole step (every micro-step, and every data-parallel rank: summed outside
the model, models/moe/workload.py), so a layout updates the bias exactly as one process would.

Capacity (capacity_keep): with capacity factor c, an expert takes at most ceil(c · N · k / E) of a forward's N·k
assignments; the rest are dropped (that expert adds nothing for that token; its other experts and the residual
stream still carry it). Priority: every token's first choice before any second choice, then by token order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn as nn


class Routing(NamedTuple):
    scores: torch.Tensor  # [N, E] fp32, every expert's score (softmax or sigmoid), what the balance loss reads
    experts: torch.Tensor  # [N, k] int64, the chosen experts, best first
    gates: torch.Tensor  # [N, k] fp32, the weight of each chosen expert's output


class Router(nn.Module):
    def __init__(self, dim: int, n_experts: int, top_k: int, *, score: str = "softmax", norm_topk: bool = True,
                 route_scale: float = 1.0):
        super().__init__()
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"Router score {score!r}: choose softmax or sigmoid")
        if not 0 < top_k <= n_experts:
            raise ValueError(f"Router top_k {top_k} must be in 1..n_experts ({n_experts})")
        self.top_k, self.score, self.norm_topk, self.route_scale = top_k, score, norm_topk, route_scale
        self.gate = nn.Linear(dim, n_experts, bias=False)
        # Left out of float8 training (train.float8 reads the mark): routing wants its logits exact, as forward says.
        self.gate.keep_precision = True
        # Persistent: checkpoints keep it, and a resumed run routes as the uninterrupted one. Not a parameter: no
        # gradient and no optimizer touch it, only update_bias.
        self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))

    @property
    def n_experts(self) -> int:
        return self.gate.out_features

    def forward(self, x: torch.Tensor) -> Routing:
        """x [N, dim] -> the routing of its N tokens."""
        logits = self.gate(x).float()  # fp32 under autocast too: close scores must not collapse into ties
        scores = logits.softmax(dim=-1) if self.score == "softmax" else logits.sigmoid()
        experts = top_k_experts(scores.detach() + self.expert_bias, self.top_k)
        gates = scores.gather(1, experts)
        if self.norm_topk:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        return Routing(scores, experts, gates * self.route_scale)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float) -> None:
        """DeepSeek-V3's step (module docstring): load [E], the assignments each expert took since the last one."""
        load = load.to(self.expert_bias.device, torch.float32)
        self.expert_bias += rate * torch.sign(load.mean() - load)


def top_k_experts(ranking: torch.Tensor, k: int) -> torch.Tensor:
    """The k columns of highest value in each row of ranking [N, E], best first; of equal values the lower index
    first (a stable sort: the tie rule of the module docstring)."""
    return torch.sort(ranking, dim=-1, descending=True, stable=True).indices[:, :k]


def balance_loss(scores: torch.Tensor, experts: torch.Tensor, score: str = "softmax",
                 total: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Switch's E · Σ f_i · P_i (module docstring) of one forward's scores [N, E] and chosen experts [N, k].

    `total`, when given, sums a tensor over every part of the forward's tokens (where several processes each route
    some positions of the same sequences, the layout supplies it, with a gradient): f and P are then the whole
    forward's, as one process that routes all of them computes them."""
    n_experts, k = scores.shape[-1], experts.shape[-1]
    probabilities = routing_probabilities(scores, score)
    counts = torch.bincount(experts.flatten(), minlength=n_experts).to(scores.dtype)  # f's numerator: no gradient
    sums = torch.cat([counts, probabilities.sum(dim=0), scores.new_full((1,), experts.shape[0])])
    if total is not None:
        sums = total(sums)
    counts, probability_sums, tokens = sums[:n_experts].detach(), sums[n_experts:-1], sums[-1].detach()
    return n_experts * (counts / (tokens * k) * probability_sums / tokens).sum()


def routing_probabilities(scores: torch.Tensor, score: str = "softmax") -> torch.Tensor:
    """The probabilities P is the mean of (module docstring): softmax scores as they are, sigmoid scores divided by
    their sum per token."""
    return scores if score == "softmax" else scores / scores.sum(dim=-1, keepdim=True)


def balance_of_totals(assigned: torch.Tensor, probability_sums: torch.Tensor, tokens: torch.Tensor,
                      k: int) -> torch.Tensor:
    """E · Σ f_i · P_i from totals over any set of tokens (assigned [..., E], probability sums [..., E], tokens [...]):
    balance_loss of one forward whose tokens they are, whatever forwards they were counted in."""
    n_experts = assigned.shape[-1]
    tokens = tokens.unsqueeze(-1)
    return n_experts * (assigned / (tokens * k) * probability_sums / tokens).sum(dim=-1)


def capacity(tokens: int, top_k: int, n_experts: int, factor: float) -> int:
    """The assignments one expert takes at most: the factor times its even share, rounded up."""
    return math.ceil(factor * tokens * top_k / n_experts)


def capacity_keep(experts: torch.Tensor, n_experts: int, limit: int) -> torch.Tensor:
    """Which of the assignments experts [N, k] each expert keeps under a limit of `limit`: a bool [N, k]. Priority
    as the module docstring says: all first choices, then all second choices, ...; within one, by token."""
    n, k = experts.shape
    by_slot = experts.t().reshape(-1)  # slot-major: token 0's first choice, token 1's first choice, ...
    order = torch.argsort(by_slot, stable=True)  # by expert; within an expert in slot-major order
    counts = torch.bincount(by_slot, minlength=n_experts)
    first = torch.cumsum(counts, 0) - counts  # where each expert's run starts in `order`
    place = torch.empty_like(by_slot)
    place[order] = torch.arange(by_slot.numel(), device=experts.device) - first[by_slot[order]]
    return (place < limit).view(k, n).t()


def routing_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """The assignments each expert was chosen for (selection, before any capacity drop): int64 [E]."""
    return torch.bincount(experts.flatten(), minlength=n_experts)


def load_entropy(share: torch.Tensor) -> torch.Tensor:
    """The entropy of each row of expert shares [..., E] (summing to 1), divided by log E: 1 when the load is even,
    0 when one expert takes everything."""
    share = share.double()
    terms = torch.where(share > 0, share * share.clamp_min(1e-300).log(), torch.zeros_like(share))
    return -terms.sum(dim=-1) / math.log(share.shape[-1])

