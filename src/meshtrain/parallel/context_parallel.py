"""Context parallelism: split every sequence over the `cp` ranks of a replica, so long sequences fit.

All cp ranks of a replica load the same batch and keep their own slice of its sequence dimension
(`shard_sequence`); everything in the model but attention is per token, so only attention has to talk.
Two ways to make causal attention see the whole sequence, swapped in as `block.attn.attend`:

    ulysses  all-to-all turns [B, H, T/cp, D] (sequence-sharded) into [B, H/cp, T, D] (head-sharded),
             ordinary causal attention runs on whole sequences of a few heads, and a second all-to-all
             turns the result back. Two all-to-alls per layer (q, k, v go in one) whatever the length, each
             moving 1/cp of the activations; needs heads % cp == 0.
    ring     keys and values travel round the ring of cp ranks, one block per step, and each rank folds
             every block into its queries' output with an online softmax (a running log-sum-exp). The
             memory for scores is per block, so it scales to any length; any head count works.

Causal attention done on contiguous slices would leave the last rank 2·cp-1 times the first rank's
work. The ring therefore uses the "zigzag" layout: the sequence is cut into 2·cp chunks and rank r keeps
chunks r and 2·cp-1-r, so every rank holds one early and one late chunk. Against any other rank's block
that makes exactly one of two cases hold (see `_RingAttention`): either both of our chunks see the
other's early chunk in full, or our late chunk sees both of its chunks in full; either is half a block,
so each ring step costs every rank the same.

Gradients: each cp rank's loss is the mean over its own tokens, all ranks have equally many, so the
global loss is the mean over cp ranks, and parameter gradients must be averaged over cp as data
parallelism would (DDP/FSDP over the flattened dp_cp / dp_shard_cp mesh does exactly that). With
ignored targets (-1) spread unevenly over the sequence that mean of means is only an approximation.
Everything here runs on gloo/CPU as well as NCCL: Ulysses uses the autograd-aware functional all-to-all,
the ring is a custom autograd.Function whose backward runs the ring again (K/V go round once more, and
their gradients travel with them back to the rank that owns them).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from meshtrain.errors import MeshtrainError
from meshtrain.nn.transformer import causal_attention, full_attention

CP_IMPLS = ("ulysses", "ring")


class ContextParallelError(MeshtrainError, ValueError):
    """The sequence, the heads or the options do not fit context parallelism; the message says how to fix it."""


# ---- the sequence layout (pure arithmetic) ----------------------------------------------------------------------
def sequence_positions(seq_len: int, cp_rank: int, cp_size: int, impl: str) -> torch.Tensor:
    """The global positions (long, ascending) of the tokens cp rank `cp_rank` holds of a length-`seq_len` sequence."""
    if impl not in CP_IMPLS:
        raise ContextParallelError(f"context parallel impl {impl!r}: choose one of {', '.join(CP_IMPLS)}")
    if not isinstance(cp_size, int) or cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ContextParallelError(f"cp_rank={cp_rank} must be in 0..cp_size-1 with cp_size={cp_size} >= 1")
    chunks = cp_size if impl == "ulysses" else 2 * cp_size
    if seq_len % chunks:
        why = ("each cp rank keeps one contiguous slice" if impl == "ulysses"
               else "the ring balances causal work by cutting the sequence into 2·cp chunks")
        raise ContextParallelError(
            f"sequence length {seq_len} is not divisible by {chunks} ({why}, cp={cp_size}): "
            f"use a sequence length that is a multiple of {chunks}")
    size = seq_len // chunks
    if impl == "ulysses":
        return torch.arange(cp_rank * size, (cp_rank + 1) * size)
    early, late = cp_rank, 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(early * size, (early + 1) * size), torch.arange(late * size, (late + 1) * size)])


def shard_sequence(idx: torch.Tensor, targets: torch.Tensor | None, cp_rank: int, cp_size: int,
                   impl: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """This cp rank's share of a batch: (idx[:, mine], targets[:, mine], positions), positions [T/cp] global.

    Pass positions to GPT.forward so the position embedding sees where the tokens really sit.
    """
    positions = sequence_positions(idx.shape[1], cp_rank, cp_size, impl).to(idx.device)
    local_targets = None if targets is None else targets.index_select(1, positions)
    return idx.index_select(1, positions), local_targets, positions


# ---- process group plumbing -------------------------------------------------------------------------------------
def _as_group(cp_group_or_mesh) -> dist.ProcessGroup:
    if isinstance(cp_group_or_mesh, dist.ProcessGroup):
        return cp_group_or_mesh
    if getattr(cp_group_or_mesh, "ndim", None) != 1:
        raise ContextParallelError(
            f"context parallelism needs the 1-D cp mesh (submesh(mesh, 'cp')) or its process group, "
            f"got {cp_group_or_mesh!r}")
    return cp_group_or_mesh.get_group()


def _cpu_bf16(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.bfloat16


# ---- Ulysses ------------------------------------------------------------------------------------------------------
def ulysses_attention(cp_group_or_mesh, attention=causal_attention):
    """attend(q, k, v, dropout_p) for the contiguous layout: all-to-all to whole sequences of H/cp heads, the
    model's own `attention` kernel on them (causal for the GPT, full for the ViT), and back."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    group = _as_group(cp_group_or_mesh)
    cp = dist.get_world_size(group)

    # all_to_all exchanges slices of dim 0, so each layout change first moves the slice bound for rank j there.
    def to_heads(qkv: torch.Tensor) -> torch.Tensor:
        """[3, B, H, T/cp, D] sequence-sharded -> [3, B, H/cp, T, D] head-sharded; q, k, v in one collective."""
        n, B, H, T, D = qkv.shape
        send = qkv.reshape(n, B, cp, H // cp, T, D).permute(2, 0, 1, 3, 4, 5).contiguous()
        got = all_to_all_single_autograd(send, None, None, group)  # dim 0 is now the source rank = its chunk
        return got.permute(1, 2, 3, 0, 4, 5).reshape(n, B, H // cp, cp * T, D)

    def to_sequence(y: torch.Tensor) -> torch.Tensor:
        """[B, H/cp, T, D] head-sharded -> [B, H, T/cp, D] sequence-sharded."""
        B, H, T, D = y.shape
        send = y.reshape(B, H, cp, T // cp, D).permute(2, 0, 1, 3, 4).contiguous()
        got = all_to_all_single_autograd(send, None, None, group)  # dim 0 is now the source rank = its heads
        return got.permute(1, 0, 2, 3, 4).reshape(B, cp * H, T // cp, D)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        if cp == 1:
            return attention(q, k, v, dropout_p)
        if q.shape[1] % cp:
            raise ContextParallelError(
                f"Ulysses context parallelism gives each of the cp={cp} ranks whole heads, but this rank has "
                f"{q.shape[1]} heads: use a cp that divides the head count (per tensor-parallel rank), or impl 'ring'")
        q, k, v = to_heads(torch.stack([q, k, v])).unbind(0)
        return to_sequence(attention(q, k, v, dropout_p))

    return attend


# ---- Ring ---------------------------------------------------------------------------------------------------------
class _Ring:
    """Point-to-point with the ring neighbours: send to cp rank r+1, receive from r-1 (works on gloo and NCCL)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, send: torch.Tensor, tag: int) -> tuple[torch.Tensor, _Pending]:
        """Start passing `send` one rank on; returns the buffer the previous rank's tensor lands in, and the transfer."""
        recv = torch.empty_like(send)
        # Distinct tags keep K/V and their gradients apart on gloo, which matches messages by tag (NCCL ignores it).
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, self.next, self.group, tag),
                                        dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)])
        return recv, _Pending(works, send)


class _Pending:
    """A started transfer; holds the sent buffer so it outlives the send even if the caller drops it."""

    def __init__(self, works: list | tuple = (), sent: torch.Tensor | None = None):
        self.works, self.sent = list(works), sent

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    s = (q @ k.transpose(-1, -2)).float() * scale
    if causal:  # q and k are the same positions here, ascending, so the plain triangle is the causal mask
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _block_forward(q, k, v, scale, causal):
    """One block pair: its normalised output and log-sum-exp (fp32), to be merged with the others."""
    s = _scores(q, k, scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.exp(s - lse.unsqueeze(-1)).to(v.dtype) @ v
    return out.float(), lse


def _merge(out, lse, block_out, block_lse):
    """Online softmax: fold a block's (output, log-sum-exp) into the running ones, in place."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)


def _block_backward(q, k, v, dout, lse, delta, scale, causal):
    """Gradients of one block pair given the FINAL lse and delta = rowsum(dout * out) (flash-attention's backward)."""
    p = torch.exp(_scores(q, k, scale, causal) - lse.unsqueeze(-1))  # this block's share of the final softmax
    dv = p.to(dout.dtype).transpose(-1, -2) @ dout
    ds = p * ((dout @ v.transpose(-1, -2)).float() - delta.unsqueeze(-1))
    ds = ds.to(q.dtype)
    return (ds @ k).float() * scale, (ds.transpose(-1, -2) @ q).float() * scale, dv.float()


def _ring_pair(step: int, ring: _Ring, chunk: int, causal: bool) -> tuple[slice, slice, bool]:
    """Which of our query rows meet which rows of the K/V held at `step`, and whether that pair needs a mask.

    Not causal: every query sees every key. Causal, zigzag (local tokens are [early chunk | late chunk], `chunk`
    tokens each; at step s this rank holds the K/V of cp rank src = r - s): step 0 (own K/V) is plain causal
    attention. If src < r, its early chunk precedes both of ours and its late chunk follows both: all our
    queries against its early half, unmasked. If src > r, our early chunk precedes both of its chunks and our
    late chunk follows both: our late queries against all its keys, unmasked.
    """
    everything = slice(None)
    if not causal:
        return everything, everything, False
    if step == 0:
        return everything, everything, True
    if (ring.rank - step) % ring.size < ring.rank:
        return everything, slice(None, chunk), False
    return slice(chunk, None), everything, False


class _RingAttention(torch.autograd.Function):
    """Ring attention: K/V blocks go round the cp ranks, each folded into our queries' output by online softmax;
    the backward sends them round again with their gradients, which end on the block's owner."""

    @staticmethod
    def forward(ctx, q, k, v, ring, causal):
        chunk, scale = q.shape[2] // 2, 1.0 / math.sqrt(q.shape[-1])
        with torch.autocast(q.device.type, enabled=False):
            kv = torch.stack([k, v])
            for step in range(ring.size):
                if step + 1 < ring.size:  # start the next K/V on its way while this block computes
                    next_kv, kv_transfer = ring.shift(kv, tag=0)
                rows, cols, masked = _ring_pair(step, ring, chunk, causal)
                block = _block_forward(q[:, :, rows], kv[0, :, :, cols], kv[1, :, :, cols], scale, masked)
                if step == 0:  # every pair at step 0 covers all our queries
                    out, lse = block
                else:
                    _merge(out[:, :, rows], lse[:, :, rows], *block)
                if step + 1 < ring.size:
                    kv_transfer.wait()
                    kv = next_kv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.causal = ring, causal
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        chunk, scale = q.shape[2] // 2, 1.0 / math.sqrt(q.shape[-1])
        with torch.autocast(q.device.type, enabled=False):
            dout = dout.to(q.dtype).contiguous()
            delta = (dout.float() * out).sum(-1)
            dq = torch.zeros_like(out)
            kv, incoming, dkv_transfer = torch.stack([k, v]), None, _Pending()
            for step in range(ring.size):
                if step + 1 < ring.size:  # start the next K/V on its way while this block computes
                    next_kv, kv_transfer = ring.shift(kv, tag=0)
                rows, cols, masked = _ring_pair(step, ring, chunk, ctx.causal)
                dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
                dq_b, dkv[0, :, :, cols], dkv[1, :, :, cols] = _block_backward(
                    q[:, :, rows], kv[0, :, :, cols], kv[1, :, :, cols], dout[:, :, rows], lse[:, :, rows],
                    delta[:, :, rows], scale, masked)
                dq[:, :, rows] += dq_b
                if step > 0:  # what the ranks before us added to this block's gradient
                    dkv_transfer.wait()
                    dkv += incoming
                # The gradient goes on with its block; after the last step it lands on the block's owner.
                incoming, dkv_transfer = ring.shift(dkv, tag=1)
                if step + 1 < ring.size:
                    kv_transfer.wait()
                    kv = next_kv
            dkv_transfer.wait()
        return dq.to(q.dtype), incoming[0].to(k.dtype), incoming[1].to(v.dtype), None, None


def ring_attention(cp_group_or_mesh, attention=causal_attention, causal: bool = True):
    """attend(q, k, v, dropout_p): K/V go round the ring, merged by online softmax. Causal: for the zigzag
    layout; not causal (the ViT): any contiguous layout. `attention` is the model's kernel, used on one rank."""
    ring = _Ring(_as_group(cp_group_or_mesh))
    cp = ring.size

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        if dropout_p:
            raise ContextParallelError(
                f"ring attention does not implement attention dropout (dropout_p={dropout_p}): set the model's "
                f"dropout to 0 or use impl 'ulysses'")
        if cp == 1:
            return attention(q, k, v, 0.0)
        if causal and q.shape[2] % 2:
            raise ContextParallelError(
                f"ring attention expects each rank's {q.shape[2]} tokens to be two zigzag chunks (an even count): "
                f"shard the batch with shard_sequence(..., impl='ring')")
        if _cpu_bf16(q):  # as the model's own kernel: CPU bf16 attention is faster (and exacter) in fp32
            return _RingAttention.apply(q.float(), k.float(), v.float(), ring, causal).to(torch.bfloat16)
        return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), ring, causal)

    return attend


# ---- the model ----------------------------------------------------------------------------------------------------
def unwrap(model: nn.Module) -> nn.Module:
    """The plain model under DDP and torch.compile."""
    model = getattr(model, "module", model)  # DDP
    return getattr(model, "_orig_mod", model)  # torch.compile


def apply_context_parallel(blocks, cp_mesh, impl: str, num_heads: int | None = None) -> None:
    """Every block's attention (nn/transformer.Attention) becomes the `impl` kernel over `cp_mesh` (1-D cp
    DeviceMesh or its process group; None: nothing to do), causal or full as the block's `attn.causal` says.

    Works before or after activation checkpointing and FSDP (it only sets an attribute; a block under activation
    checkpointing's wrapper is found inside it). Feed the model batches cut by shard_sequence(..., impl) with the
    same impl (causal), or contiguous token bands (full). num_heads None: Ulysses' kernel checks heads per call.
    """
    if impl not in CP_IMPLS:
        raise ContextParallelError(f"context parallel impl {impl!r}: choose one of {', '.join(CP_IMPLS)}")
    if cp_mesh is None:
        return
    group = _as_group(cp_mesh)
    cp = dist.get_world_size(group)
    if impl == "ulysses" and num_heads is not None and num_heads % cp:
        raise ContextParallelError(
            f"Ulysses gives each of the cp={cp} ranks whole heads, but the model's {num_heads} heads are not "
            f"divisible by {cp}: pick a cp that divides {num_heads}, or impl 'ring'")
    kernels = {}  # one per kind: a causal and a full model share nothing, but blocks of one model share theirs
    for block in blocks:
        attn = getattr(block, "_checkpoint_wrapped_module", block).attn
        if attn.causal not in kernels:
            own = causal_attention if attn.causal else full_attention
            kernels[attn.causal] = (ulysses_attention(group, own) if impl == "ulysses"
                                    else ring_attention(group, own, causal=attn.causal))
        attn.attend = kernels[attn.causal]
