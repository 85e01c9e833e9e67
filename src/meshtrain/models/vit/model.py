"""A Vision Transformer that steps the weather forward: fields [B, C, H, W] at t -> fields at t + dt. No distributed code.

The architecture follows NERSC's dl-at-scale-training ViT: cut the grid into p x p patches, embed each patch as a
token, add a learned position embedding, run pre-LN transformer blocks with full (non-causal) self-attention, and
map every token back to the p x p x C_out values of its patch. There is no class token and no pooling: the model is
image-to-image.

Patch embedding is a Linear over flattened patches rather than NERSC's Conv2d(kernel=stride=p). The two compute the
same thing (a Conv2d weight [D, C, p, p] reshaped to [D, C*p*p] is this Linear's weight), but as a Linear the model
is made only of Linears, LayerNorms and attention, which DTensor's tensor-parallel styles shard directly, and
patchify / unpatchify are plain reshapes that invert each other exactly. A patch flattens as (channel, row, column),
Conv2d's weight order; tokens are numbered row-major over the patch grid, like Conv2d's output flattened.

Seams for meshtrain.parallel: the blocks are nn/transformer.py's, with full (non-causal) attention, so the
block-level tensor- and context-parallel plans are the GPT's; besides,
  * the forward pass is four public steps, forward(x) = unpatchify(head(forward_tokens(embed(x)))), and
    forward(x, token_positions) stops before unpatchify with the patches of those tokens only:
        embed(x, token_positions=None)  patchify, Linear, + position embedding -> tokens [B, N, D]
        forward_tokens(tokens)          the blocks and the final LayerNorm, per token except in attention
        head(tokens)                    Linear per token -> patches [B, N, C_out*p*p]
        unpatchify(patches)             all N patches -> fields [B, C_out, H, W]
    A context-parallel rank calls forward(x, its token_positions) (a slice, or any [N_local] long tensor) and
    either gathers the patches before unpatchify or compares them with patchify(target)[:, token_positions]: with
    equal shards the mean of the ranks' MSEs is the global MSE. Because it is forward, wrappers (DDP, FSDP2) run
    their machinery around it as for any call.
  * blocks live in an nn.ModuleDict "0".."depth-1" (`self.blocks`), so a pipeline stage can drop the ones it does
    not own and the rest keep their checkpoint names.

Loss: mean squared error over every element, in normalised units (`ViTConfig.loss = "mse"`). NERSC's `l2_loss` is
FourCastNet's relative L2 instead, mean over samples of ||pred - target||_2 / ||target||_2 over each whole sample;
it is here as `relative_l2_loss` (loss="relative_l2"). MSE is the default because it is a plain mean: shards of
equal size (data, context parallel) average to the global value, whereas the relative L2 needs each sample's global
norms before it can divide. On per-channel normalised fields ||target||^2 is about C*H*W for every sample, so the two
differ mostly by a constant factor and a square root.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtrain.nn.transformer import Block

LOSSES = ("mse", "relative_l2")
LAYER_NORM_EPS = 1e-6  # NERSC's (timm's ViT) value; torch's default is 1e-5


@dataclass
class ViTConfig:
    img_size: tuple[int, int] = (360, 720)  # (H, W) of the (cropped) grid; both divisible by patch_size
    patch_size: int = 8
    in_channels: int = 20
    out_channels: int = 20
    embed_dim: int = 384
    depth: int = 12
    num_heads: int = 8
    mlp_ratio: float = 4.0
    dropout: float = 0.0  # after the position embedding, on attention weights and on both residual branches
    drop_path: float = 0.0  # stochastic depth, rising linearly from 0 in the first block to this in the last
    bias: bool = True  # biases in the Linears (not the output head, as NERSC) and LayerNorms
    loss: str = "mse"

    def __post_init__(self) -> None:
        size = self.img_size
        if not isinstance(size, (tuple, list)) or len(size) != 2:
            raise ValueError(f"ViTConfig.img_size must be (height, width), got {size!r}")
        self.img_size = tuple(size)  # YAML gives a list
        for name in ("patch_size", "in_channels", "out_channels", "embed_dim", "depth", "num_heads"):
            _check_positive_int(f"ViTConfig.{name}", getattr(self, name))
        for axis, value in zip(("height", "width"), self.img_size, strict=True):
            _check_positive_int(f"ViTConfig.img_size {axis}", value)
            if value % self.patch_size:
                raise ValueError(f"ViTConfig.img_size {axis} ({value}) must be divisible by patch_size "
                                 f"({self.patch_size}): crop the grid to {value - value % self.patch_size}")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"ViTConfig.embed_dim ({self.embed_dim}) must be divisible by num_heads ({self.num_heads})")
        if not (self.mlp_ratio > 0 and int(self.embed_dim * self.mlp_ratio) >= 1):
            raise ValueError(f"ViTConfig.mlp_ratio must be > 0 and give a hidden width >= 1, got {self.mlp_ratio!r}")
        for name in ("dropout", "drop_path"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"ViTConfig.{name} must be in [0, 1), got {getattr(self, name)!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"ViTConfig.loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")

    @property
    def grid(self) -> tuple[int, int]:
        """Patches per column and per row: (H / p, W / p)."""
        return self.img_size[0] // self.patch_size, self.img_size[1] // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def mlp_hidden(self) -> int:
        return int(self.embed_dim * self.mlp_ratio)


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def mse_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over all elements of (pred - target)^2."""
    return F.mse_loss(pred, target)


def relative_l2_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """NERSC's / FourCastNet's l2_loss: mean over the batch of ||pred_b - target_b||_2 / ||target_b||_2."""
    b = pred.shape[0]
    diff = torch.linalg.vector_norm((pred - target).reshape(b, -1), dim=1)
    return (diff / torch.linalg.vector_norm(target.reshape(b, -1), dim=1)).mean()


class ViT(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.config = c = dataclasses.replace(config)  # own copy, checked again
        p2 = c.patch_size * c.patch_size
        self.patch_embed = nn.Linear(c.in_channels * p2, c.embed_dim, bias=c.bias)
        self.pos_embed = nn.Parameter(torch.zeros(1, c.num_patches, c.embed_dim))
        self.pos_drop = nn.Dropout(c.dropout)
        rates = [c.drop_path * i / max(c.depth - 1, 1) for i in range(c.depth)]
        # "0".."depth-1" give a ModuleList's names, but a pipeline stage can delete blocks and keep the others'.
        self.blocks = nn.ModuleDict({str(i): Block(c.embed_dim, c.num_heads, c.mlp_hidden, causal=False, dropout=c.dropout,
                                                   bias=c.bias, norm_eps=LAYER_NORM_EPS, drop_path=rates[i])
                                     for i in range(c.depth)})
        self.norm = nn.LayerNorm(c.embed_dim, eps=LAYER_NORM_EPS, bias=c.bias)
        # No bias, as NERSC: called on tokens, this *is* the head(tokens) -> patches step of forward.
        self.head = nn.Linear(c.embed_dim, c.out_channels * p2, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """NERSC's (timm's) ViT init: Linear weights and the position embedding ~ N(0, 0.02), biases 0, LayerNorms
        1 and 0. Public so a model built on the meta device can be initialised after to_empty().

        Like NERSC's trunc_normal_, the cut is at +-2 absolute, which at std 0.02 (100 std) removes nothing: the
        draw is in effect a plain normal of std 0.02. Kept so for parity with NERSC's runs.
        """
        nn.init.trunc_normal_(self.pos_embed, std=0.02, a=-2.0, b=2.0)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02, a=-2.0, b=2.0)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    # ---- the four steps of forward --------------------------------------------------------------------------------
    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        """Fields [B, C, H, W] -> patches [B, N, C*p*p], any C; token n = row-major patch, features (c, py, px)."""
        if x.dim() != 4 or tuple(x.shape[-2:]) != self.config.img_size:
            raise ValueError(f"expected fields [B, C, {self.config.img_size[0]}, {self.config.img_size[1]}], got "
                             f"{list(x.shape)}: crop the data to the model's img_size")
        B, C, H, W = x.shape
        p = self.config.patch_size
        x = x.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(B, (H // p) * (W // p), C * p * p)

    def unpatchify(self, patches: torch.Tensor) -> torch.Tensor:
        """Patches [B, N, C*p*p] of all N tokens in order -> fields [B, C, H, W]; the inverse of patchify."""
        gh, gw = self.config.grid
        p = self.config.patch_size
        if patches.dim() != 3 or patches.shape[1] != gh * gw or patches.shape[2] % (p * p):
            raise ValueError(f"expected patches [B, {gh * gw}, C*{p * p}] (every token of the {gh}x{gw} patch grid), "
                             f"got {list(patches.shape)}; a context-parallel rank must gather all tokens first")
        B, C = patches.shape[0], patches.shape[2] // (p * p)
        x = patches.reshape(B, gh, gw, C, p, p).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(B, C, gh * p, gw * p)

    def embed(self, x: torch.Tensor, token_positions: torch.Tensor | slice | None = None) -> torch.Tensor:
        """Fields [B, C_in, H, W] -> tokens [B, N, D], or only the tokens at token_positions (patch indices [N_local],
        or a slice of them)."""
        if x.dim() == 4 and x.shape[1] != self.config.in_channels:
            raise ValueError(f"expected {self.config.in_channels} input channels, got {x.shape[1]} "
                             f"(input shape {list(x.shape)}): set ViTConfig.in_channels to match the data")
        patches = self.patchify(x)
        pos = self.pos_embed
        if token_positions is not None:
            patches, pos = patches[:, token_positions], pos[:, token_positions]
        return self.pos_drop(self.patch_embed(patches) + pos)

    def forward_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The transformer blocks and the final LayerNorm, on tokens [B, N_local, D]."""
        for block in self.blocks.values():
            tokens = block(tokens)
        return self.norm(tokens)

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor | slice | None = None) -> torch.Tensor:
        """Fields at t [B, C_in, H, W] (normalised) -> predicted fields at t + dt [B, C_out, H, W]; given
        token_positions, only those tokens' predicted patches [B, N_local, C_out*p*p] (see the module docstring)."""
        patches = self.head(self.forward_tokens(self.embed(x, token_positions)))
        return patches if token_positions is not None else self.unpatchify(patches)

    def loss(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The configured loss (MSE by default; see the module docstring)."""
        if pred.shape != target.shape:
            raise ValueError(f"prediction {list(pred.shape)} and target {list(target.shape)} differ in shape")
        return mse_loss(pred, target) if self.config.loss == "mse" else relative_l2_loss(pred, target)

    # ---- counts and optimiser groups --------------------------------------------------------------------------------
    def num_params(self) -> int:
        """All parameters, the position embedding included."""
        return sum(p.numel() for p in self.parameters())

    def num_matmul_params(self) -> int:
        """Weights of the Linears: each costs 2 flops per token forward (patch_embed and head are per token too)."""
        return sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))

    def flops_per_sample(self) -> int:
        """Training (forward + backward) flops of one sample: 6*P*N + 12*depth*N^2*D.

        P = num_matmul_params(), N = tokens (patches), D = embed_dim. Each weight does one multiply-add (2 flops)
        per token forward and two backward (input and weight gradients), hence 6*P*N (Kaplan et al. 2020, table 1;
        PaLM appendix B). Attention has no weights but two matmuls per layer, scores Q K^T and the weighted sum
        A V, each 2*N^2*D flops forward and twice that backward: 12*N^2*D per layer, the 12*L*H*Q*T per token of
        PaLM times N tokens. Biases, norms, GELU and softmax are left out (O(N*D) per layer). Unlike a causal
        GPT, nothing is masked, so the whole N x N square is counted. At base (N = 4050) attention is 63% of it.
        """
        c = self.config
        n = c.num_patches
        return 6 * self.num_matmul_params() * n + 12 * c.depth * n * n * c.embed_dim

    def flops_per_token(self) -> int:
        """flops_per_sample() / num_patches, exact: what the train loop's MFU multiplies by tokens per second."""
        return self.flops_per_sample() // self.config.num_patches

    def configure_optimizer_groups(self, weight_decay: float) -> list[dict]:
        """AdamW parameter groups: decay the Linear weights; not biases, norms or the position embedding.

        The position embedding is left undecayed as in timm's ViT (`no_weight_decay`): it is a table added to the
        tokens, not a matrix that multiplies them, and shrinking it towards zero only blurs where each patch is.
        """
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2 and p is not self.pos_embed]
        return [
            {"params": decay, "weight_decay": weight_decay},
            {"params": [p for p in params if all(p is not q for q in decay)], "weight_decay": 0.0},
        ]
