"""A GPT-2-style decoder in plain PyTorch: no distributed code.

Parameter names follow nanoGPT / Hugging Face GPT-2 (`transformer.wte`, `transformer.h.0.mlp.c_fc`,
`lm_head`, ...) because `from_pretrained` maps HF weights by name and parallel plans refer to these
names. One departure: q, k and v are three projections (`attn.q_proj`, ...), not GPT-2's fused
`c_attn`, so that sharding each one by output features gives every tensor-parallel rank whole heads.

The blocks are nn/transformer.py's (causal attention), whose seams let the parallel plans change
the layout without changing this file; `forward` takes the positions of the tokens it is given (a
context-parallel rank holds a slice of the sequence).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from meshtrain.models.language import sampling
from meshtrain.nn.transformer import ACTIVATIONS, Block, decoder_loss_sum, decoder_output, init_gpt2_style

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
    loss_chunks: int | None = None  # the head and loss over this many tokens at a time (nn/chunked_loss.py)

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
            h=nn.ModuleDict({str(i): Block(c.n_embd, c.n_head, 4 * c.n_embd, causal=True, dropout=c.dropout, bias=c.bias,
                                            activation=c.activation) for i in range(c.n_layer)}),
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
        init_gpt2_style(self, self.config.n_layer)

    # ---- the steps of forward, which a pipeline stage also calls ------------------------------------------------
    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [B, T] at `positions` [T] (0..T-1 unless given) -> the residual stream [B, T, C]."""
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        if positions is None:
            positions = torch.arange(T, dtype=torch.long, device=idx.device)
        return self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer.ln_f(x))

    loss_sum = decoder_loss_sum  # a pipeline's last stage under train.loss_chunks
    compile_loss = False  # output layer and loss compiled (parallel/compose.py: compile=blocks on a GPU)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None):
        """idx [B, T] token ids -> (logits, loss).

        With targets: logits [B, T, V] and the mean cross-entropy (targets of -1 are ignored).
        Without: logits [B, 1, V] of the last position only, which is all sampling needs.
        positions [T]: where in the sequence the tokens of idx sit; 0..T-1 unless given.
        """
        x = self.embed(idx, positions)
        for block in self.transformer.h.values():
            x = block(x)
        return decoder_output(self.logits, x, targets, head=self.lm_head, norm=self.transformer.ln_f,
                              chunk_tokens=self.config.loss_chunks, compiled=self.compile_loss)

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

    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Append max_new_tokens sampled tokens to idx [B, T] (models/language/sampling.generate)."""
        return sampling.generate(self, idx, max_new_tokens, block_size=self.config.block_size,
                                 temperature=temperature, top_k=top_k, generator=generator)

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
