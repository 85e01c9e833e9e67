"""An auxiliary loss computed inside a model (a router's balance loss), brought into the gradient without passing
through the model's loss: under a pipeline schedule only the last stage computes a loss, and a stage's forward hands
the next one its hidden states alone; under tensor parallelism's loss parallel the loss is a DTensor, whose gradient
a plain auxiliary loss added to it cannot take. Generic: no model names.

    out = attach_loss(out, aux, weight)     # forward: out unchanged; backward: out's gradient, and aux's of `weight`

Backward of `out` (which the schedule runs for this stage's microbatch) then also runs aux's backward, as if
`weight · aux` had been added to the loss: Megatron's MoEAuxLossAutoScaler. The weight is the one the loss of the
same forward gets: the micro-step's scale (1 / accumulation; lm_layout's `loss_scale`), over the pipeline's
microbatches, so each microbatch's auxiliary loss counts as one forward's does when one process runs them in turn.
"""

from __future__ import annotations

import torch


class _AttachedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight, ctx.aux_shape, ctx.aux_dtype = weight, aux.shape, aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        aux_grad = torch.full(ctx.aux_shape, ctx.weight, dtype=ctx.aux_dtype, device=grad.device)
        return grad, aux_grad, None


def attach_loss(out: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
    """`out`, whose backward also backpropagates `weight · aux` (module docstring)."""
    return _AttachedLoss.apply(out, aux, weight)
