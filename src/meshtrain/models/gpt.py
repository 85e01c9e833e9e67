"""A GPT-2-style decoder in plain PyTorch: no distributed code.

Parameter names follow nanoGPT / Hugging Face GPT-2 (`transformer.wte`, `transformer.h.0.mlp.c_fc`,
`lm_head`, ...) because `from_pretrained` maps HF weights by name and parallel plans refer to these
names. One departure: q, k and v are three projections (`attn.q_proj`, ...), not GPT-2's fused
`c_attn`, so that sharding each one by output features gives every tensor-parallel rank whole heads.

Three seams let meshtrain.parallel change the layout without changing this file: attention reads its
local head count from the projection's width (tensor parallel shards heads), `attn.attend` is the
attention kernel (context parallel swaps in Ulysses or ring attention), and `forward` takes the
positions of the tokens it is given (a context-parallel rank holds a slice of the sequence).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

ACTIVATIONS = {
    "gelu": lambda: nn.GELU(),
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),  # HF GPT-2's "gelu_new"
    "relu": lambda: nn.ReLU(),
    "silu": lambda: nn.SiLU(),
}
# HF config.activation_function -> ours; anything else is refused by from_pretrained.
_HF_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                   "relu": "relu", "silu": "silu", "swish": "silu"}
# HF GPT-2 stores these as Conv1D, i.e. weight [in, out]; nn.Linear wants [out, in].
_HF_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_QKV = ("q_proj", "k_proj", "v_proj")


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for faster matmuls
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm; False is slightly faster and no worse
    activation: str = "gelu"

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"GPTConfig.activation must be one of {sorted(ACTIVATIONS)}, got {self.activation!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Causal scaled-dot-product attention over [B, heads, T, head_dim].

    On CPU, bf16 attention runs in fp32: torch's CPU flash-attention backward is ~4x slower in bf16 than
    in fp32 (torch 2.13), while the matmuls around it are 2x faster in bf16, so this split is the fast one.
    """
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        with torch.autocast("cpu", enabled=False):
            y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), dropout_p=dropout_p, is_causal=True)
        return y.to(torch.bfloat16)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.dropout = cfg.dropout
        self.head_dim = cfg.n_embd // cfg.n_head  # fixed; the number of heads is not (see forward)
        self.attend = causal_attention  # (q, k, v, dropout_p) -> y, all [B, heads, T, head_dim]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        B, T, _ = q.shape
        # Heads present on this rank: all of them serially, n_head / tp under tensor parallelism.
        n_head = q.shape[-1] // self.head_dim
        q, k, v = (t.view(B, T, n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = self.attend(q, k, v, self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, n_head * self.head_dim)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.act = ACTIVATIONS[cfg.activation]()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = dataclasses.replace(config)  # own copy: crop_block_size edits it
        c = self.config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c.vocab_size, c.n_embd),
            wpe=nn.Embedding(c.block_size, c.n_embd),
            drop=nn.Dropout(c.dropout),
            # A ModuleDict keyed "0".."L-1" gives the same names as a ModuleList, but a pipeline
            # stage can delete the blocks it does not own and the rest keep their names, so
            # checkpoints stay loadable across layouts. Iterate it with .values() / .items().
            h=nn.ModuleDict({str(i): Block(c) for i in range(c.n_layer)}),
            ln_f=nn.LayerNorm(c.n_embd, bias=c.bias),
        ))
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        # Weight tying: one [vocab, n_embd] matrix both embeds and un-embeds (saves V*C params).
        self.lm_head.weight = self.transformer.wte.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 init. Public so a model built on the meta device can be initialised after to_empty()."""
        # A plain to_empty() gives each module its own new tensor, untying lm_head from wte (FSDP2
        # keeps the tie); tie them again so the meta-device path builds the same model.
        if self.lm_head.weight is not self.transformer.wte.weight:
            self.lm_head.weight = self.transformer.wte.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        # Each block adds two residual branches; shrinking their output projections keeps the
        # variance of the residual stream from growing with depth (GPT-2 paper, section 2.3).
        std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None):
        """idx [B, T] token ids -> (logits, loss).

        With targets: logits [B, T, V] and the mean cross-entropy (targets of -1 are ignored).
        Without: logits [B, 1, V] of the last position only, which is all sampling needs.
        positions [T]: where in the sequence the tokens of idx sit; 0..T-1 unless given.
        """
        T = idx.shape[1]
        if positions is None:
            if T > self.config.block_size:
                raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
            positions = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))
        for block in self.transformer.h.values():
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, -1:, :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count, the tied embedding counted once.

        non_embedding leaves out the position embedding only (nanoGPT's convention): the token
        embedding is also the output layer, whose matmul does cost flops.
        """
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training (forward + backward) flops per token, PaLM appendix B: 6N + 12*L*H*Q*T.

        6N covers the weight matmuls (2 forward + 4 backward per parameter), with N as in nanoGPT's
        estimate_mfu (num_params(non_embedding=True)); 12*L*H*Q*T the attention scores and the
        weighted sum over T positions. T defaults to block_size; pass the trained length if shorter.
        """
        c = self.config
        T = c.block_size if seq_len is None else seq_len
        return 6 * self.num_params(non_embedding=True) + 12 * c.n_layer * c.n_head * (c.n_embd // c.n_head) * T

    def flops_per_iteration(self, tokens: int, seq_len: int | None = None) -> int:
        """Training flops for `tokens` tokens (e.g. batch * seq_len * grad_accum * dp)."""
        return self.flops_per_token(seq_len) * tokens

    def configure_optimizer_groups(self, weight_decay: float) -> list[dict]:
        """AdamW parameter groups: decay matrices and embeddings (>= 2-D), not biases or norms (1-D)."""
        params = [p for p in self.parameters() if p.requires_grad]  # the tied weight appears once
        return [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Append max_new_tokens sampled tokens to idx [B, T]; returns [B, T + max_new_tokens].

        temperature 0 means greedy. Call model.eval() first, or dropout will be on while sampling.
        The generator, if given, must live on idx's device.
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size:])  # the model sees at most block_size
            logits = logits[:, -1, :]
            if temperature == 0:
                next_tok = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                next_tok = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, next_tok), dim=1)
        return idx

    def crop_block_size(self, block_size: int) -> None:
        """Shrink the context, e.g. to fine-tune a pretrained 1024-token model on shorter blocks."""
        if not 0 < block_size <= self.config.block_size:
            raise ValueError(f"block_size must be in 1..{self.config.block_size}, got {block_size}")
        wpe = self.transformer.wpe
        wpe.weight = nn.Parameter(wpe.weight.detach()[:block_size].clone())
        wpe.num_embeddings = block_size
        self.config.block_size = block_size

    @classmethod
    def from_pretrained(cls, name_or_path: str, override_args: dict | None = None) -> GPT:
        """Load GPT-2 weights from a Hugging Face directory or hub name (gpt2, gpt2-medium, ...).

        Only `dropout` may be overridden; everything else comes from the checkpoint's config.
        """
        override_args = dict(override_args or {})
        unknown = set(override_args) - {"dropout"}
        if unknown:
            raise ValueError(f"from_pretrained can only override 'dropout', got {sorted(unknown)}")
        try:
            from transformers import GPT2LMHeadModel
        except ImportError as e:
            raise ImportError(
                "GPT.from_pretrained needs Hugging Face transformers: pip install 'meshtrain[hf]'"
            ) from e

        hf_model = GPT2LMHeadModel.from_pretrained(name_or_path)
        hc = hf_model.config
        _check_hf_config(hc, name_or_path)
        config = GPTConfig(
            block_size=hc.n_positions, vocab_size=hc.vocab_size, n_layer=hc.n_layer,
            n_head=hc.n_head, n_embd=hc.n_embd, bias=True,
            activation=_HF_ACTIVATIONS[hc.activation_function],
            dropout=override_args.get("dropout", 0.0),
        )
        model = cls(config)

        ours = model.state_dict()
        # Older transformers keep causal-mask buffers (attn.bias, attn.masked_bias); SDPA needs none.
        theirs = {}
        for k, v in hf_model.state_dict().items():
            if k.endswith((".attn.bias", ".attn.masked_bias")):
                continue
            if ".attn.c_attn." in k:  # GPT-2's fused q|k|v -> our three projections
                v = v.t() if k.endswith("weight") else v
                for name, part in zip(_QKV, v.chunk(3, dim=0), strict=True):
                    theirs[k.replace("c_attn", name)] = part
                continue
            theirs[k] = v.t() if k.endswith(_HF_CONV1D) else v
        if set(ours) != set(theirs):
            raise ValueError(
                f"{name_or_path}: parameter names differ from GPT's; "
                f"missing {sorted(set(ours) - set(theirs))}, unexpected {sorted(set(theirs) - set(ours))}"
            )
        with torch.no_grad():
            for k, dst in ours.items():
                src = theirs[k]
                if src.shape != dst.shape:
                    raise ValueError(f"{name_or_path}: {k} has shape {tuple(src.shape)}, GPT expects {tuple(dst.shape)}")
                dst.copy_(src)
        return model


def _check_hf_config(hc, where: str) -> None:
    """Refuse GPT-2 variants whose maths this model does not reproduce, rather than load them wrong."""
    problems = []
    if hc.activation_function not in _HF_ACTIVATIONS:
        problems.append(f"activation_function={hc.activation_function!r}")
    if getattr(hc, "n_inner", None) not in (None, 4 * hc.n_embd):
        problems.append(f"n_inner={hc.n_inner} (only 4*n_embd is supported)")
    if not math.isclose(getattr(hc, "layer_norm_epsilon", 1e-5), 1e-5):
        problems.append(f"layer_norm_epsilon={hc.layer_norm_epsilon} (only 1e-5)")
    if not getattr(hc, "scale_attn_weights", True) or getattr(hc, "scale_attn_by_inverse_layer_idx", False):
        problems.append("non-standard attention scaling")
    if not getattr(hc, "tie_word_embeddings", True):
        problems.append("untied lm_head (GPT ties it to wte)")
    if problems:
        raise ValueError(f"{where}: unsupported GPT-2 config: " + "; ".join(problems))
