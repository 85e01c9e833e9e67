"""A mixture-of-experts decoder in plain PyTorch: no distributed code.

It is the Llama-style decoder (models/llama/model.py: RMSNorm, RoPE, grouped-query attention, untied head) whose
feed-forward, in the layers `moe_layers` names, is a mixture of experts (MoE) instead of one dense SwiGLU:

    y = Σ_{e in top-k(x)} gate_e(x) · SwiGLU_e(x)  +  SwiGLU_shared(x)

(router.py: the routing, the balance loss, the bias update, the capacity; experts.py: the routed experts' stacked
weights and their loop or grouped-GEMM matmuls). Every other layer keeps the dense SwiGLU (DeepSeek-V3's first three).
The shared experts are one SwiGLU of n_shared_experts × expert_hidden: the sum of that many experts of expert_hidden
each is exactly that (their hidden units side by side).

The balance loss joins the gradient but not the loss's value: forward returns loss + (aux - aux.detach()), so the
logged loss stays the language-model loss (comparable with the dense models'), while backward sees
balance_coef × Σ_layers aux. (Where the decoder's forward does not run whole, a pipeline stage, the layout brings
each layer's `balance_loss` into the gradient itself: models/moe/parallelize.py.) What routing did is counted in each MoE layer's `tally` (a plain attribute, not a buffer:
DDP would broadcast a buffer over it), which the workload reads and resets; the routers' `expert_bias` buffers are the
only state that routing keeps across steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from meshtrain.models.llama.model import Block, Llama, LlamaConfig, SwiGLU
from meshtrain.models.moe.experts import GroupedExperts
from meshtrain.models.moe.router import (
    Router,
    balance_loss,
    capacity,
    capacity_keep,
    routing_counts,
    routing_probabilities,
)


@dataclass
class MoEConfig(LlamaConfig):
    n_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 1408  # each routed (and shared) expert's SwiGLU hidden width
    n_shared_experts: int = 0
    moe_layers: tuple[int, ...] | None = None  # the layers with a mixture of experts; None: every layer
    score: str = "softmax"  # or "sigmoid"
    norm_topk: bool = True
    route_scale: float = 1.0
    balance_coef: float = 0.01
    capacity_factor: float | None = None  # None: dropless
    expert_matmul: str = "auto"  # auto | grouped | loop (experts.py)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.moe_layers is None:
            self.moe_layers = tuple(range(self.n_layer))
        self.moe_layers = tuple(self.moe_layers)
        if not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"MoEConfig.top_k ({self.top_k}) must be in 1..n_experts ({self.n_experts})")
        if any(not 0 <= i < self.n_layer for i in self.moe_layers):
            raise ValueError(f"MoEConfig.moe_layers {self.moe_layers} must be layers of 0..{self.n_layer - 1}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"MoEConfig.capacity_factor must be above 0 or None, got {self.capacity_factor!r}")


class Tally:
    """What one MoE layer's routing did since the last reset: assignments per expert (selection, before capacity),
    the routing probabilities summed per expert over the tokens, assignments dropped, tokens routed. Totals over
    tokens, not per-forward figures: the balance loss of all of them (router.balance_of_totals) is then the same
    however a layout cuts them into forwards (a pipeline's microbatches) or ranks. Tensors on the layer's device, never
    read back here (no host sync in a step)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.assigned: torch.Tensor | None = None  # int64 [E]
        self.probability: torch.Tensor | None = None  # fp32 [E], summed over the tokens
        self.dropped: torch.Tensor | None = None  # int64 []
        self.tokens = 0

    def add(self, assigned: torch.Tensor, probability: torch.Tensor, dropped: torch.Tensor, tokens: int) -> None:
        if self.assigned is None:
            self.assigned, self.dropped = torch.zeros_like(assigned), torch.zeros_like(dropped)
            self.probability = torch.zeros(assigned.shape, dtype=torch.float32, device=assigned.device)
        self.assigned += assigned
        self.probability += probability.detach().float()
        self.dropped += dropped
        self.tokens += tokens


def in_backward() -> bool:
    """Whether autograd is running a backward pass now: activation checkpointing recomputes a block's forward there,
    which must not count its routing twice."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """The mixture-of-experts feed-forward of one layer (module docstring), [B, T, dim] -> [B, T, dim]."""

    def __init__(self, c: MoEConfig):
        super().__init__()
        self.router = Router(c.n_embd, c.n_experts, c.top_k, score=c.score, norm_topk=c.norm_topk,
                             route_scale=c.route_scale)
        self.experts = GroupedExperts(c.n_experts, c.n_embd, c.expert_hidden, matmul=c.expert_matmul)
        hidden = c.n_shared_experts * c.expert_hidden
        self.shared = SwiGLU(c.n_embd, hidden, dropout=0.0) if hidden else None
        self.dropout = nn.Dropout(c.dropout)
        self.capacity_factor = c.capacity_factor
        self.tally = Tally()
        self.balance_loss: torch.Tensor | None = None  # this training forward's, for the model's loss
        # Sums a tensor over every part of one forward's tokens, for the balance loss (router.balance_loss): set by a
        # layout whose ranks each route some positions of the same sequences (context parallel); None: all are here.
        self.forward_total: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        routing = self.router(flat)
        keep = self.kept(routing.experts)
        routed = self.combine(flat, routing.experts, routing.gates, keep)
        out = routed if self.shared is None else routed + self.shared(flat)
        # Computed in a recomputation too (activation checkpointing checks that it saves what the forward saved);
        # only the forward keeps it and counts.
        aux = balance_loss(routing.scores, routing.experts, self.router.score, self.forward_total)
        if not in_backward():
            self.balance_loss = aux if self.training else None
            dropped = (~keep).sum() if keep is not None else torch.zeros((), dtype=torch.int64, device=x.device)
            probability = routing_probabilities(routing.scores.detach(), self.router.score).sum(dim=0)
            self.tally.add(routing_counts(routing.experts, self.router.n_experts), probability, dropped, flat.shape[0])
        return self.dropout(out.to(x.dtype).view(x.shape))

    def kept(self, experts: torch.Tensor) -> torch.Tensor | None:
        """The assignments the experts keep under the capacity factor; None when dropless (all of them)."""
        if self.capacity_factor is None:
            return None
        n, k = experts.shape
        limit = capacity(n, k, self.router.n_experts, self.capacity_factor)
        return capacity_keep(experts, self.router.n_experts, limit)

    def combine(self, flat: torch.Tensor, experts: torch.Tensor, gates: torch.Tensor,
                keep: torch.Tensor | None) -> torch.Tensor:
        """Σ over each token's kept assignments of gate × its expert's output: [N, dim] in fp32."""
        n, k = experts.shape
        n_experts = self.router.n_experts
        # Token-major assignments (token t's choices at t·k .. t·k+k-1); a dropped one is sent past the last expert,
        # so sorting puts it after every expert's rows, where the experts return zeros.
        target = experts if keep is None else experts.masked_fill(~keep, n_experts)
        order = torch.argsort(target.flatten(), stable=True)
        counts = torch.bincount(target.flatten(), minlength=n_experts + 1)[:n_experts]
        expert_out = self.experts(flat[order // k], counts)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        per_assignment = expert_out[inverse].view(n, k, -1)
        # A fixed order of summation over the k slots (no atomics): the same sum on every run.
        return (per_assignment.float() * gates.unsqueeze(-1)).sum(dim=1)


class MoEDecoder(Llama):
    """The Llama-style decoder with mixture-of-experts feed-forwards in config.moe_layers."""

    def __init__(self, config: MoEConfig):
        super().__init__(config)

    def make_block(self, layer: int) -> nn.Module:
        c = self.config
        return Block(c, mlp=MoE(c) if layer in c.moe_layers else None)

    def init_weights(self) -> None:
        """The Llama's init (GPT-2's), the stacked experts' the same way, every router's bias at 0."""
        super().init_weights()
        for moe in self.moe_layers():
            moe.experts.reset_parameters(self.config.n_layer)
            moe.router.expert_bias.zero_()

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, positions: torch.Tensor | None = None):
        """As Llama.forward; in training, the balance loss joins the loss's gradient, not its value (module
        docstring)."""
        logits, loss = super().forward(idx, targets, positions)
        terms = [m.balance_loss for m in self.moe_layers()]
        for m in self.moe_layers():
            m.balance_loss = None  # not kept (with its graph) past this forward
        if loss is not None and self.training and self.config.balance_coef and all(t is not None for t in terms):
            aux = self.config.balance_coef * torch.stack(terms).sum()
            loss = loss + (aux - aux.detach())
        return logits, loss

    # ---- counts ------------------------------------------------------------------------------------------------
    def num_params(self, non_embedding: bool = True, active: bool = False) -> int:
        """Parameter count as Llama.num_params; active: only those one token uses (every dense part, the router,
        the shared experts and top_k of the routed experts)."""
        n = super().num_params(non_embedding)
        if active:
            for moe in self.moe_layers():
                e = moe.experts
                per_expert = e.c_gate[0].numel() + e.c_fc[0].numel() + e.c_proj[0].numel()
                n -= (e.n_experts - moe.router.top_k) * per_expert
        return n

    def num_active_params(self) -> int:
        """Non-embedding parameters one token uses: what FLOPs and MFU count (the trainer's header shows both)."""
        return self.num_params(non_embedding=True, active=True)

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token, PaLM's 6N + 12·L·H·Q·T with N the active non-embedding parameters."""
        c = self.config
        T = c.block_size if seq_len is None else seq_len
        return 6 * self.num_active_params() + 12 * c.n_layer * c.n_head * c.head_dim * T
