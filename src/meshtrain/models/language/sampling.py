"""Sampling from a decoder: the loop every language model here shares (GPT.generate, Llama.generate)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


@torch.no_grad()
def generate(model: nn.Module, idx: torch.Tensor, max_new_tokens: int, *, block_size: int, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Append max_new_tokens sampled tokens to idx [B, T]; returns [B, T + max_new_tokens]. `model(idx)` must return
    (logits [B, >=1, V] whose last position predicts the next token, anything).

    temperature 0 means greedy. Call model.eval() first, or dropout will be on while sampling.
    The generator, if given, must live on idx's device.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -block_size:])  # the model sees at most block_size
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
