"""A decoder's output layer and cross-entropy over a few tokens at a time, so that the [tokens, vocabulary] logits
and their fp32 loss tensors never exist whole.

    loss = chunked_cross_entropy(hidden, head.weight, targets, chunk_tokens=4096)

equals `F.cross_entropy(hidden @ weight.T, targets, ignore_index=-1)` (the mean over the targets that are not -1)
and its gradients, to fp32 rounding. For GPT-2's vocabulary of 50,304 a token's logits, their fp32 log-softmax and
its gradient take 491 KiB under autocast (bf16 logits, fp32 loss tensors); 12,288 tokens of a micro-batch, 5.9 GiB
that the whole-logits loss holds through backward. Here only one chunk's are alive, in the forward, which also
computes the chunk's gradients with respect to the hidden states and the weight (the loss's gradient is known
there, up to the scale backward brings): backward only scales them. Liger-Kernel's fused linear cross-entropy does
the same in Triton; this is plain PyTorch, so it runs (and compiles) on any device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk_tokens: int) -> torch.Tensor:
    """Mean cross-entropy of `hidden` [..., C] through the output layer `weight` [V, C] against `targets` [...]
    (-1: ignored), computed `chunk_tokens` tokens at a time."""
    return _ChunkedCrossEntropy.apply(hidden, weight, targets, chunk_tokens)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens):
        shape = hidden.shape
        flat, labels = hidden.reshape(-1, shape[-1]), targets.reshape(-1)
        wide = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)  # the loss's dtype
        counted = (labels != -1).sum().clamp(min=1).to(wide)  # the mean's denominator, as cross_entropy's
        loss = torch.zeros((), dtype=wide, device=hidden.device)
        grad_hidden = torch.empty_like(flat)
        grad_weight = torch.zeros(weight.shape, dtype=wide, device=weight.device)
        for start in range(0, flat.size(0), chunk_tokens):
            rows, chunk_labels = flat[start:start + chunk_tokens], labels[start:start + chunk_tokens]
            logits = F.linear(rows, weight)  # under autocast: in its dtype, as the whole-logits head's
            log_probs = torch.log_softmax(logits.to(wide), dim=-1)
            kept = chunk_labels != -1
            picked = chunk_labels.clamp(min=0).unsqueeze(1)
            loss -= (log_probs.gather(1, picked).squeeze(1) * kept).sum()
            # d(loss)/d(logits) = (softmax - one-hot) / counted on the kept rows, 0 on the ignored ones
            grad_logits = log_probs.exp_()
            grad_logits.scatter_add_(1, picked, torch.full_like(picked, -1, dtype=grad_logits.dtype))
            grad_logits *= kept.unsqueeze(1) / counted
            grad_logits = grad_logits.to(logits.dtype)
            grad_hidden[start:start + chunk_tokens] = grad_logits @ weight.to(logits.dtype)
            if grad_logits.dtype == grad_weight.dtype:  # added in place: no product the size of the weight beside it
                grad_weight.addmm_(grad_logits.t(), rows)
            else:  # autocast's 16-bit product, then added
                grad_weight += grad_logits.t() @ rows.to(logits.dtype)
            del logits, log_probs, grad_logits  # before the next chunk's are made, not as they replace these
        ctx.save_for_backward(grad_hidden.reshape(shape), grad_weight.to(weight.dtype))
        return loss / counted

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        # scaled where they are, not copied: a copy of the weight's gradient is the size of the output layer (the
        # graph is not kept for a second backward: retain_graph would scale them twice)
        return grad_hidden.mul_(grad_loss), grad_weight.mul_(grad_loss), None, None
