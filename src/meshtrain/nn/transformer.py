"""The parts every transformer here is made of, in plain PyTorch: attention with a causal flag, the MLP, the
pre-norm block, stochastic depth.

The parallel plans in meshtrain.parallel are written against these parts, so their names are an interface:
`attn.q_proj/k_proj/v_proj/c_proj`, `mlp.c_fc/c_proj`, `ln_1`, `ln_2`. Three seams let a plan change the
layout without touching a model:
- attention reads its local head count from the projections' widths (tensor parallel shards heads);
- `attn.attend(q, k, v, dropout_p)` is the kernel, which context parallel swaps for Ulysses or ring attention
  (it reads `attn.causal` to know which kind to build);
- a model's forward takes the positions of the tokens it is given (a context-parallel rank holds a slice).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtrain.nn import chunked_loss
from meshtrain.nn.chunked_loss import chunked_cross_entropy

ACTIVATIONS = {
    "gelu": lambda: nn.GELU(),
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),  # HF GPT-2's "gelu_new"
    "relu": lambda: nn.ReLU(),
    "silu": lambda: nn.SiLU(),
}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, causal: bool) -> torch.Tensor:
    """Scaled-dot-product attention over [B, heads, T, head_dim], causal or full.

    On CPU, bf16 attention runs in fp32: torch's CPU flash-attention backward is ~4x slower in bf16 than
    in fp32 (torch 2.13), while the matmuls around it are 2x faster in bf16, so this split is the fast one.
    """
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        with torch.autocast("cpu", enabled=False):
            y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), dropout_p=dropout_p, is_causal=causal)
        return y.to(torch.bfloat16)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    return attention(q, k, v, dropout_p, causal=True)


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Every token sees every token (the ViT's patches)."""
    return attention(q, k, v, dropout_p, causal=False)


class Attention(nn.Module):
    """Multi-head self-attention with three projections, not one fused qkv, so that sharding each by output
    features gives every tensor-parallel rank whole heads. Grouped-query attention when n_kv_head < n_head (each
    key/value head serves n_head / n_kv_head query heads); rotary position embedding when forward gets `rope`."""

    def __init__(self, dim: int, n_head: int, *, causal: bool, dropout: float, bias: bool,
                 n_kv_head: int | None = None):
        super().__init__()
        self.head_dim = dim // n_head  # fixed; the number of heads is not (see forward)
        kv_dim = (n_kv_head or n_head) * self.head_dim
        self.q_proj = nn.Linear(dim, dim, bias=bias)
        self.k_proj = nn.Linear(dim, kv_dim, bias=bias)
        self.v_proj = nn.Linear(dim, kv_dim, bias=bias)
        self.c_proj = nn.Linear(dim, dim, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)
        self.dropout = dropout
        self.causal = causal
        self.attend = causal_attention if causal else full_attention  # (q, k, v, dropout_p) -> y

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        B, T, _ = q.shape
        # Heads present on this rank: all of them serially, n_head / tp under tensor parallelism.
        heads, kv_heads = q.shape[-1] // self.head_dim, k.shape[-1] // self.head_dim
        q = q.view(B, T, heads, self.head_dim).transpose(1, 2)
        k, v = (t.view(B, T, kv_heads, self.head_dim).transpose(1, 2) for t in (k, v))
        if rope is not None:
            q, k = rotate(q, *rope), rotate(k, *rope)
        if kv_heads != heads:  # repeated before the kernel, so every kernel (and context parallel) sees plain heads
            k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        y = self.attend(q, k, v, self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, heads * self.head_dim)
        return self.resid_dropout(self.c_proj(y))


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [T, head_dim / 2] of rotary position embedding at `positions` [T] (RoFormer; Llama's theta)."""
    inverse = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.to(torch.float32)[:, None] * inverse[None, :]
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair of channels (2i, 2i+1) of x [B, heads, T, head_dim] by its position's angle, in fp32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, *, activation: str, dropout: float, bias: bool):
        super().__init__()
        self.c_fc = nn.Linear(dim, hidden, bias=bias)
        self.act = ACTIVATIONS[activation]()
        self.c_proj = nn.Linear(hidden, dim, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class DropPath(nn.Module):
    """Stochastic depth: in training, drop a residual branch for a whole sample with probability p, else scale by
    1/(1-p). Under tensor or context parallelism the ranks of one replica must draw the same mask (same RNG state)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(1.0 - self.p)
        return x * keep / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class Block(nn.Module):
    """Pre-LN residual block: x + attn(ln(x)), then x + mlp(ln(x)), each branch under stochastic depth."""

    def __init__(self, dim: int, n_head: int, hidden: int, *, causal: bool, dropout: float, bias: bool,
                 activation: str = "gelu", norm_eps: float = 1e-5, drop_path: float = 0.0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=norm_eps, bias=bias)
        self.attn = Attention(dim, n_head, causal=causal, dropout=dropout, bias=bias)
        self.ln_2 = nn.LayerNorm(dim, eps=norm_eps, bias=bias)
        self.mlp = MLP(dim, hidden, activation=activation, dropout=dropout, bias=bias)
        self.drop_path = DropPath(drop_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.ln_1(x)))
        return x + self.drop_path(self.mlp(self.ln_2(x)))


def decoder_output(logits, x: torch.Tensor, targets: torch.Tensor | None, *, head: nn.Module | None = None,
                   norm: nn.Module | None = None, chunk_tokens: int | None = None, compiled: bool = False):
    """A decoder's (logits, loss) from its final hidden states x [B, T, C] and `logits(hidden)`: with targets, logits
    [B, T, V] and the mean cross-entropy (targets of -1 ignored); without, the last position's logits only, which
    is all sampling needs. With chunk_tokens (and the final `norm` and output layer `head` that `logits` applies),
    the loss is computed that many tokens at a time and no logits are made: (None, loss). compiled (the model's
    `compile_loss`, which parallel/compose.py sets): the whole logits' output layer and loss as one torch.compile
    graph, or each chunk's softmax and gradient as one."""
    if targets is None:
        return logits(x[:, -1:, :]), None
    if chunk_tokens:
        return None, chunked_cross_entropy(norm(x), head.weight, targets, chunk_tokens, compiled=compiled)
    return (chunked_loss.compiled_function(logits_and_loss) if compiled else logits_and_loss)(logits, x, targets)


def logits_and_loss(logits, x: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole logits and their mean cross-entropy (targets of -1 ignored): one graph when compiled, in which
    inductor pads the output layer's matmul (GPT-2's 50,257 words) and fuses the softmax's passes."""
    out = logits(x)
    return out, F.cross_entropy(out.reshape(-1, out.size(-1)), targets.reshape(-1), ignore_index=-1)


def decoder_loss_sum(model: nn.Module, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of a decoder's last block output x through its `transformer.ln_f` and `lm_head`,
    `config.loss_chunks` tokens at a time: what a pipeline's last stage computes in its forward when the loss is
    chunked (parallel/pipeline.py). A decoder class takes it as its method `loss_sum`."""
    return chunked_cross_entropy(model.transformer.ln_f(x), model.lm_head.weight, targets, model.config.loss_chunks,
                                 reduction="sum")


@torch.no_grad()
def init_gpt2_style(model: nn.Module, n_layer: int) -> None:
    """GPT-2's init: every Linear and Embedding weight ~ N(0, 0.02), biases 0, norms 1; then the residual branches'
    output projections (`c_proj`) ~ N(0, 0.02 / sqrt(2·n_layer)): each block adds two branches, and shrinking them
    keeps the variance of the residual stream from growing with depth (GPT-2 paper, section 2.3)."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            module.reset_parameters()
    std = 0.02 / math.sqrt(2 * n_layer)
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):
            nn.init.normal_(p, mean=0.0, std=std)
