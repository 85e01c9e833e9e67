"""A Llama-style decoder in plain PyTorch: no distributed code.

What makes it Llama rather than GPT-2: RMSNorm instead of LayerNorm, rotary position embedding (RoPE) on queries
and keys instead of a learned position table, a SwiGLU MLP (silu(gate(x)) * up(x), then down), grouped-query
attention (n_kv_head key/value heads shared by n_head query heads), no biases, and an output head of its own (not
tied to the token embedding).

Names follow meshtrain's transformer parts (nn/transformer.py), so the shared tensor- and context-parallel
plans apply: `transformer.h.N.attn.{q,k,v,c}_proj`, `ln_1`, `ln_2`, and the MLP's `c_fc` (up), `c_gate` (gate)
and `c_proj` (down). The seams are the GPT's: attention reads its local head counts from the projections'
widths, `attn.attend` is the swappable kernel, and `forward` takes the positions of the tokens it is given, from
which the rotary tables are computed (a context-parallel rank holds a slice; a pipeline stage recomputes them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtrain.models.language import sampling
from meshtrain.nn.transformer import Attention, decoder_loss_sum, decoder_output, init_gpt2_style, rope_tables


@dataclass
class LlamaConfig:
    block_size: int = 256
    vocab_size: int = 50304
    n_layer: int = 8
    n_head: int = 8
    n_kv_head: int = 4  # n_head / n_kv_head query heads share each key/value head; n_head: plain multi-head
    n_embd: int = 512
    ffn_hidden: int = 1408  # the SwiGLU's hidden width (config.ffn_hidden gives Llama's 8/3 × n_embd rule)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0
    loss_chunks: int | None = None  # the head and loss over this many tokens at a time (nn/chunked_loss.py)

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "ffn_hidden"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"LlamaConfig.n_embd ({self.n_embd}) must be n_head ({self.n_head}) × an even head size: "
                             "rotary embedding turns channel pairs")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"LlamaConfig.n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LlamaConfig.dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, dropout: float):
        super().__init__()
        self.c_fc = nn.Linear(dim, hidden, bias=False)  # up
        self.c_gate = nn.Linear(dim, hidden, bias=False)
        self.c_proj = nn.Linear(hidden, dim, bias=False)  # down
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.silu(self.c_gate(x)) * self.c_fc(x)))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(rmsnorm(x), rope), then x + swiglu(rmsnorm(x))."""

    def __init__(self, c: LlamaConfig, mlp: nn.Module | None = None):
        """`mlp`: the feed-forward branch, when not the dense SwiGLU (the mixture of experts, models/moe)."""
        super().__init__()
        self.ln_1 = nn.RMSNorm(c.n_embd, eps=c.norm_eps)
        self.attn = Attention(c.n_embd, c.n_head, n_kv_head=c.n_kv_head, causal=True, dropout=c.dropout, bias=False)
        self.ln_2 = nn.RMSNorm(c.n_embd, eps=c.norm_eps)
        self.mlp = mlp if mlp is not None else SwiGLU(c.n_embd, c.ffn_hidden, c.dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rope=rope)
        return x + self.mlp(self.ln_2(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = c = dataclasses.replace(config)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c.vocab_size, c.n_embd),
            drop=nn.Dropout(c.dropout),
            # "0".."L-1": a ModuleList's names, but a pipeline stage can drop blocks and keep the others' names.
            h=nn.ModuleDict({str(i): self.make_block(i) for i in range(c.n_layer)}),
            ln_f=nn.RMSNorm(c.n_embd, eps=c.norm_eps),
        ))
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.init_weights()

    def make_block(self, layer: int) -> nn.Module:
        """Block `layer` (0-based); a decoder built on this one (models/moe) chooses its feed-forward per layer."""
        return Block(self.config)

    def init_weights(self) -> None:
        """GPT-2's init (nn/transformer.init_gpt2_style), norms at 1. Public for meta-device builds."""
        init_gpt2_style(self, self.config.n_layer)

    # ---- the three steps of forward, which a pipeline stage also calls -------------------------------------------
    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if idx.shape[1] > self.config.block_size:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds block_size {self.config.block_size}")
        return self.transformer.drop(self.transformer.wte(idx))

    def block_kwargs(self, positions: torch.Tensor) -> dict:
        """What every block takes besides the hidden states: the rotary tables of the tokens' positions."""
        return {"rope": rope_tables(positions, self.config.head_dim, self.config.rope_theta)}

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer.ln_f(x))

    loss_sum = decoder_loss_sum  # a pipeline's last stage under train.loss_chunks
    compile_loss = False  # output layer and loss compiled (parallel/compose.py: compile=blocks on a GPU)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None):
        """idx [B, T] token ids -> (logits, loss), as GPT.forward: with targets, logits [B, T, V] and the mean
        cross-entropy (targets of -1 ignored); without, the logits of the last position. positions [T]: where the
        tokens sit in the sequence; 0..T-1 unless given."""
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.embed(idx, positions)
        kwargs = self.block_kwargs(positions)
        for block in self.transformer.h.values():
            x = block(x, **kwargs)
        return decoder_output(self.logits, x, targets, head=self.lm_head, norm=self.transformer.ln_f,
                              chunk_tokens=self.config.loss_chunks, compiled=self.compile_loss)

    # ---- counts, optimizer groups, sampling --------------------------------------------------------------------
    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; non_embedding leaves out the token embedding (a lookup, no matmul). The untied output
        head is a matmul and counts."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wte.weight.numel() if non_embedding else n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training flops per token, PaLM appendix B: 6N + 12·L·H·Q·T (N: num_params(non_embedding=True); the
        attention term counts query heads, which grouped-query attention does not reduce)."""
        c = self.config
        T = c.block_size if seq_len is None else seq_len
        return 6 * self.num_params(non_embedding=True) + 12 * c.n_layer * c.n_head * c.head_dim * T

    def configure_optimizer_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups: decay matrices and embeddings (>= 2-D), not norms (1-D)."""
        params = [p for p in self.parameters() if p.requires_grad]
        return [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]

    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        return sampling.generate(self, idx, max_new_tokens, block_size=self.config.block_size,
                                 temperature=temperature, top_k=top_k, generator=generator)
