"""A decoder's output layer and cross-entropy over a few tokens at a time, so that the [tokens, vocabulary] logits
and their fp32 loss tensors never exist whole (`train.loss_chunks`).

    loss = chunked_cross_entropy(hidden, head.weight, targets, chunk_tokens=256)

equals `F.cross_entropy(hidden @ weight.T, targets, ignore_index=-1)` (the mean over the targets that are not -1;
reduction="sum": their sum) and its gradients, to fp32 rounding. For GPT-2's vocabulary of 50,304 a token's logits,
their fp32 probabilities and its gradient take 491 KiB under autocast (bf16 logits, fp32 loss tensors); 12,288
tokens of a micro-batch, 5.9 GiB that the whole-logits loss holds through backward. Here only one chunk's are
alive, in the forward, which also computes the chunk's gradients with respect to the hidden states and the weight
(the loss's gradient is known there, up to the scale backward brings): backward only scales them. Liger-Kernel's
fused linear cross-entropy does the same in Triton; this is plain PyTorch, so it runs (and compiles) on any device.
With compiled=True each chunk's logits, softmax and gradient are one torch.compile graph (its element-wise passes
over the chunk's fp32 logits fused), for a whole vocabulary (no tp).

Under tensor parallelism the output layer's weight is a DTensor sharded over the vocabulary (Shard(0) on the tp
mesh): each rank then takes its own vocabulary slice of every chunk's logits and the softmax is put together with
the three small all-reduces of torch's loss_parallel (the rows' maximum, their sum of exponentials, the target's
logit), so the chunks are also vocabulary-sharded whether or not `parallel.loss_parallel` is on; the hidden states'
gradient is summed over the tp ranks once, after the last chunk.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int, *,
                          reduction: str = "mean", compiled: bool = False) -> torch.Tensor:
    """Cross-entropy of `hidden` [..., C] through the output layer `weight` [V, C] (a plain tensor, or a DTensor
    sharded over the vocabulary) against `targets` [...] (-1: ignored), `chunk_tokens` tokens at a time; the mean
    over the counted targets, or their sum (reduction="sum"). Returns a plain 0-dim tensor, the same on every tp
    rank. compiled: each chunk's softmax and gradient as a torch.compile graph (a whole weight only)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    hidden, weight, group, first = _vocabulary_slice(hidden, weight)
    if compiled and group is not None:
        raise ValueError("chunked_cross_entropy(compiled=True) takes a whole output layer: a vocabulary-sharded one "
                         "all-reduces inside each chunk's softmax")
    chunk_step = compiled_function(_chunk_gradient) if compiled else _chunk_gradient
    return _ChunkedCrossEntropy.apply(hidden, weight, targets, chunk_tokens, reduction == "sum", group, first,
                                      chunk_step)


@functools.cache
def compiled_function(function):
    """torch.compile(function), made once a process on first use; a graph per shape (a micro-batch's last chunk may
    be shorter than the others: its own graph, rather than one dynamic graph for all of them)."""
    return torch.compile(function, dynamic=False)


def _vocabulary_slice(hidden: torch.Tensor, weight: torch.Tensor):
    """(hidden whole and plain, this rank's rows of the weight, the process group the vocabulary is sharded over or
    None, the first word of this rank's rows). Differentiable: the gradients go back to the DTensors."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if isinstance(hidden, DTensor):  # a sequence-parallel stream: every rank needs every token
        hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim).to_local()
    if not isinstance(weight, DTensor):
        return hidden, weight, None, 0
    mesh, placements = weight.device_mesh, tuple(weight.placements)
    if placements == (Shard(0),):
        words, ranks = weight.shape[0], mesh.size()
        first = min(mesh.get_local_rank() * -(-words // ranks), words)  # DTensor shards as torch.chunk does
        return hidden, weight.to_local(), mesh.get_group(), first
    if all(p == Replicate() for p in placements):
        return hidden, weight.to_local(), None, 0
    raise ValueError(f"chunked_cross_entropy: the output layer's weight is placed {placements} on mesh dims "
                     f"{mesh.mesh_dim_names}; it takes a whole weight or one sharded over the vocabulary (Shard(0) "
                     "on a 1-D mesh)")


def _all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


# On CUDA the output layer's rows are padded with zeros to a multiple of this in the chunks' matmuls: GPT-2's 50,257
# words make every row of the logits start off a 16-byte boundary, and cuBLAS then falls back to its unaligned
# kernels (measured on an H200, docs/gpu.md: 47% of a GPT-2 step's GPU time, against 0% with 50,304 columns).
CUDA_WORDS_MULTIPLE = 64


def _words_multiple(device: torch.device) -> int:
    return CUDA_WORDS_MULTIPLE if device.type == "cuda" else 1


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens, summed, group, first, chunk_step):
        shape, grads = hidden.shape, any(ctx.needs_input_grad[:2])  # none wanted: evaluation, the loss alone
        flat, labels = hidden.reshape(-1, shape[-1]), targets.reshape(-1)
        wide = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)  # the loss's dtype
        counted = torch.ones((), dtype=wide, device=hidden.device) if summed else \
            (labels != -1).sum().clamp(min=1).to(wide)  # the mean's denominator, as cross_entropy's
        loss = torch.zeros((), dtype=wide, device=hidden.device)
        words, low = weight.shape[0], _matmul_dtype(hidden, weight)
        head, padding = weight.to(low), -words % _words_multiple(weight.device)  # cast once, not per chunk
        head = F.pad(head, (0, 0, 0, padding)) if padding else head  # (a pad of 0 would still copy the weight)
        if grads:
            grad_hidden = torch.empty_like(flat)
            grad_head = torch.zeros(head.shape, dtype=wide, device=weight.device)
        for start in range(0, flat.size(0), chunk_tokens):
            rows, chunk_labels = flat[start:start + chunk_tokens].to(low), labels[start:start + chunk_tokens]
            grad_logits, chunk_loss = chunk_step(rows, head, words, chunk_labels - first, chunk_labels != -1, counted,
                                                 group)
            loss += chunk_loss
            if grads:
                grad_hidden[start:start + chunk_tokens] = grad_logits @ head
                if low == grad_head.dtype:  # in place: no product the size of the weight beside it
                    grad_head.addmm_(grad_logits.t(), rows)
                else:  # autocast's 16-bit product, then added
                    grad_head += grad_logits.t() @ rows
            del grad_logits  # before the next chunk's are made, not as they replace these
        if grads:
            _all_reduce(grad_hidden, group)  # every vocabulary slice's share of the hidden states' gradient
            ctx.save_for_backward(grad_hidden.reshape(shape), grad_head[:words].to(weight.dtype))
        return loss / counted

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        # scaled where they are, not copied: a copy of the weight's gradient is the size of the output layer (the
        # graph is not kept for a second backward: retain_graph would scale them twice)
        return grad_hidden.mul_(grad_loss), grad_weight.mul_(grad_loss), None, None, None, None, None, None


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's where it is on for the device, else the operands'."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _chunk_gradient(rows: torch.Tensor, head: torch.Tensor, words: int, local: torch.Tensor, kept: torch.Tensor,
                    counted: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's (gradient of the loss with respect to its logits, in the rows' dtype; its summed loss): its logits
    `rows @ head.T` in the rows' dtype (autocast's where it is on, as the whole-logits head's), their softmax in the
    loss's dtype (counted's: fp32 or wider)."""
    logits = (rows @ head.t()).to(counted.dtype)
    grad_logits, loss = _softmax_and_gradient(logits, words, local, kept, counted, group)
    return grad_logits.to(rows.dtype), loss


def _softmax_and_gradient(logits: torch.Tensor, words: int, local: torch.Tensor, kept: torch.Tensor,
                          counted: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: (the loss's gradient with respect to this rank's logits [n, V_local + padding], the chunk's summed
    loss). `logits` (fp32, overwritten) are this rank's vocabulary slice, its first `words` columns real and the rest
    padding (left out of the softmax, given no gradient); `local` the targets counted from its first word, `kept` the
    targets that count. The softmax over the whole vocabulary: its maximum, sum and target logit are all-reduced over
    `group` (None: one slice, the whole)."""
    logits[:, words:] = float("-inf")
    logits -= _all_reduce(logits.amax(dim=1), group, dist.ReduceOp.MAX).unsqueeze(1)
    mine = kept & (local >= 0) & (local < words)  # targets in this rank's slice
    picked = local.clamp(0, words - 1).unsqueeze(1)
    target_logit = _all_reduce(logits.gather(1, picked).squeeze(1) * mine, group)
    probs = logits.exp_()  # d(loss)/d(logits) = (softmax - one-hot) / counted on the kept rows, 0 on the others
    total = _all_reduce(probs.sum(dim=1), group)
    loss = ((total.log() - target_logit) * kept).sum()
    probs /= total.unsqueeze(1)
    probs.scatter_add_(1, picked, -mine.unsqueeze(1).to(probs.dtype))
    probs *= (kept / counted).unsqueeze(1)
    return probs, loss
