"""Expert parallelism: the routed experts of a mixture-of-experts layer sharded over the ep ranks, tokens sent to the
rank that holds their expert and brought back, by all-to-all with variable splits. Generic: no model names.

A module it applies to ("experts") holds stacked parameters, one expert per index of dim 0 ([E, ...] each), and
offers two calls (models/moe/experts.py's GroupedExperts does):

    forward(rows, counts)              rows [M, dim] sorted by expert, counts [E] rows per expert (rows after the last
                                       expert's are dropped ones, returned as zeros) -> [M, dim]
    compute(rows, counts, *weights)    the same on given stacked weights, in the module's parameter order

apply_expert_parallel turns every parameter into a DTensor sharded Shard(0) over the ep mesh (the rank at ep
coordinate i holds experts i·E/ep .. (i+1)·E/ep - 1; DCP saves them with their global shape, so a checkpoint loads
under any ep) and replaces the module's forward by one that

    1. exchanges the row counts (an all-to-all of [ep, E/ep] counts: what each rank sends to each other's experts),
    2. sends each rank's rows to the owners of their experts (all_to_all_single_autograd, the splits from 1),
    3. orders what arrived by local expert and runs `compute` on this rank's slice of the weights,
    4. sends the outputs back the same way (the backward of 2 and 4 is the mirrored all-to-all) and appends zeros
       for the dropped rows.

Expert tensor parallelism (ETP = tp, as Megatron-Core's). With a 2-D (ep, tp) mesh, apply_expert_parallel also cuts
every expert over tp: each parameter Shard(hidden dim) on the tp dim (`hidden_dims`, the model's: the SwiGLU's gate
and up by their hidden rows, its down projection by its hidden columns), so a rank holds 1/tp of each of its E/ep
experts and DCP still saves the global [E, ...] shape. The tp ranks of an ep group exchange the same whole rows among
the ranks with their tp coordinate (the ep group), and `compute` on a rank's slices gives each row's output as a part
of a sum over tp, which the caller's layout sums (tensor_parallel.PartialSum). apply_expert_tensor_parallel does the
same without ep (1-D tp mesh, no dispatch). The gradient scale below is unchanged: the tp slices are disjoint.

Bytes sent. Each exchange adds what this rank passes to all_to_all (its part for itself included) to the module's
`Sent` tally: the row counts, the rows, the outputs, and in backward the gradients of both (counted where autograd
hands them to the mirrored all-to-all), so a run reports the bytes it really exchanged (`sent_bytes`, read by
`plan --validate` and logged by the MoE workload) and the planner's count (plan/experts.py) can be held to it.

Gradients. Each rank's loss is the mean over its own tokens, and data parallelism averages over the dp ranks, so one
process with the whole batch has dL/dW = (1/dp) Σ_r dL_r/dW. An expert's owner receives the rows of all ep ranks of
its group, so autograd leaves it Σ_{r in its ep group} dL_r/dW; the ranks that hold the same experts (the edp
group, dp/ep of them) then average that (DDP-style mean, or FSDP2's reduce-scatter over them), giving
(ep/dp) Σ_all dL_r/dW: ep times too much. So the local weights pass through a gradient scale of 1/ep on the way in
(`scale_grad`), whatever the backend: the mean over edp then gives the one-process gradient.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

EXPERT_PARALLEL = "_expert_parallel"  # the attribute that marks a module whose experts are sharded over ep
SENT = "_all_to_all_sent"  # the attribute holding that module's Sent tally
UNSENT = "_all_to_all_unsent"  # the attribute that, while True, keeps that module's forward from communicating


class Sent:
    """Bytes one module's dispatch and combine passed to all_to_all since the last reset (a host number: the split
    sizes are host numbers already, so counting costs no device sync)."""

    def __init__(self) -> None:
        self.bytes = 0


class _CountGrad(torch.autograd.Function):
    """Identity forward; backward adds the bytes of the gradient that the all-to-all before it sends back."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, sent: Sent) -> torch.Tensor:
        ctx.sent = sent
        # The all-to-all's result is torch's AsyncCollectiveTensor, waited for by the first op that reads it. Waited
        # here, a plain tensor leaves: a compiled graph (train.compile) that takes it as an input unwraps it without
        # waiting, and its gradient then differed from one process's (by 10% in layout_check's ep 2 case).
        waited = tensor.trigger_wait() if hasattr(tensor, "trigger_wait") else tensor
        return waited.view_as(waited)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.sent.bytes += grad.numel() * grad.element_size()
        return grad, None


def _exchange(tensor: torch.Tensor, output_split: list[int], input_split: list[int], group, sent: Sent) -> torch.Tensor:
    """all_to_all_single_autograd of `tensor`, its bytes (and in backward its gradient's) added to `sent`."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    sent.bytes += tensor.numel() * tensor.element_size()
    return _CountGrad.apply(all_to_all_single_autograd(tensor, output_split, input_split, group), sent)


def sent_bytes(model: nn.Module, reset: bool = False) -> int:
    """Bytes `model`'s expert-parallel modules passed to all_to_all since the last reset (module docstring)."""
    tallies = [getattr(m, SENT) for m in expert_parallel_modules(model)]
    total = sum(t.bytes for t in tallies)
    if reset:
        for t in tallies:
            t.bytes = 0
    return total


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` (the 1/ep of the module docstring)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def scale_grad(tensor: torch.Tensor, scale: float) -> torch.Tensor:
    return _ScaleGrad.apply(tensor, scale)


def apply_expert_parallel(experts: nn.Module, mesh, hidden_dims: dict[str, int] | None = None) -> None:
    """Shard `experts`' stacked parameters Shard(0) over the "ep" dim of `mesh` and make its forward dispatch (module
    docstring); a 2-D (ep, tp) `mesh` also cuts each expert over tp (`hidden_dims`: parameter name -> its hidden dim:
    expert tensor parallelism). Every rank built the same weights, so each keeps its own slice: nothing is sent."""
    ep_mesh = mesh["ep"] if mesh.ndim > 1 else mesh
    ep = ep_mesh.size()
    for name, param in experts.named_parameters(recurse=False):
        if param.shape[0] % ep:
            raise ValueError(f"{name}: {param.shape[0]} experts do not split over ep={ep} ranks")
    _distribute(experts, mesh, hidden_dims or {})
    setattr(experts, EXPERT_PARALLEL, ep_mesh)
    setattr(experts, SENT, Sent())
    experts.forward = eager(partial(_dispatched_forward, experts, ep_mesh.get_group(), ep))


def apply_expert_tensor_parallel(experts: nn.Module, tp_mesh, hidden_dims: dict[str, int]) -> None:
    """Cut every expert of `experts` over the 1-D `tp_mesh` (without ep): each parameter Shard(hidden_dims[name]),
    the forward run on this rank's slices, each row's output a partial sum over tp (module docstring)."""
    _distribute(experts, tp_mesh, hidden_dims)
    experts.forward = eager(partial(_local_forward, experts))


def _distribute(experts: nn.Module, mesh, hidden_dims: dict[str, int]) -> None:
    """Each parameter a DTensor on `mesh`: Shard(0) (the experts) on its "ep" dim, Shard(hidden) on its "tp" dim."""
    from torch.distributed.tensor import Shard, distribute_tensor

    names = mesh.mesh_dim_names
    tp = mesh["tp"].size() if "tp" in names else 1
    for name, param in list(experts.named_parameters(recurse=False)):
        placements = [Shard(hidden_dims[name]) if dim == "tp" else Shard(0) for dim in names]
        if tp > 1 and param.shape[hidden_dims[name]] % tp:
            raise ValueError(f"{name}: hidden width {param.shape[hidden_dims[name]]} does not split over tp={tp}")
        sharded = distribute_tensor(param.detach(), mesh, placements, src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def keep_to_this_rank(modules: list[nn.Module], on: bool) -> None:
    """While `on`, each expert-parallel module of `modules` runs every row through its first local expert and sends
    nothing: for torch's pipeline shape inference (pipeline.shape_inference_hooks), which runs a stage's forward and
    backward on uninitialised tensors and reads only the shapes, dtypes and requires_grad of what comes out. Those
    are the dispatched forward's (the same compute on the same local weights), and the garbage never reaches the ep
    peers: a count exchange and two all-to-alls fewer per layer, forward and backward (a rank aborted inside gloo's
    variable-split all-to-all there, in the backward of a CI run's shape inference)."""
    for module in modules:
        if hasattr(module, EXPERT_PARALLEL):
            setattr(module, UNSENT, on)


def expert_parallel_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` whose experts apply_expert_parallel sharded."""
    return [m for m in model.modules() if hasattr(m, EXPERT_PARALLEL)]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in expert_parallel_modules(model) for p in m.parameters(recurse=False)]


def average_gradients(params: list[nn.Parameter], group) -> None:
    """Each gradient (its local shard) averaged over `group`, in one all-reduce: what DDP would do for the experts
    over the ranks that hold them (the edp group)."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    for g, averaged in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(averaged.view_as(g))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def eager(forward):
    """`forward`, left out of torch.compile's graphs: it runs eager between them. Applied where a layout binds a
    forward, not as a decorator: torch.compiler.disable imports torch._dynamo, a second of CPU in every process
    that imports this module, the planner's among them, compiled or not."""
    return torch.compiler.disable(forward)


# Left out of torch.compile (train.compile=blocks|model; `eager` where the layout binds it): the dispatch reads its
# split sizes on the host and the all-to-all's shapes follow them, and torch 2.13's dynamo cannot trace the local
# views of the sharded weights (it sees them as replicated DTensors: "aten.mm.default got mixed torch.Tensor and
# DTensor"). The rest of the block (attention, router, norms) is still compiled; this runs eager between its graphs.
def _dispatched_forward(experts: nn.Module, group, ep: int, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """forward(rows, counts) over the ep group: each row computed on the rank holding its expert."""
    weights = [scale_grad(_local(p), 1.0 / ep) for p in experts.parameters(recurse=False)]
    if getattr(experts, UNSENT, False):  # keep_to_this_rank: the shapes and dtypes of the forward below, unsent
        first_only = counts.new_zeros(weights[0].shape[0])
        first_only[0] = rows.shape[0]
        return experts.compute(rows, first_only, *weights)
    local_rows, local_counts, route = dispatch(rows, counts, group, ep, getattr(experts, SENT))
    out = experts.compute(local_rows, local_counts, *weights)
    if local_rows.shape[0] == 0:
        # No row reached this rank's experts. Keep what arrived (nothing) and the weights in the graph anyway: else
        # this rank's backward would skip the dispatch's all-to-all that its ep peers wait in, and leave no gradient
        # where its edp peers have one (their reductions would not line up).
        out = out + (local_rows.sum() + sum(w.reshape(-1)[:1].sum() for w in weights)) * 0
    return combine(out, route, rows.shape[0])


# eager, as _dispatched_forward: dynamo cannot trace the sharded weights' local views
def _local_forward(experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """forward(rows, counts) on this rank's tp slice of every expert: partial sums of the outputs."""
    return experts.compute(rows, counts, *[_local(p) for p in experts.parameters(recurse=False)])


class Route:
    """How one dispatch moved the rows, for the combine that brings them back."""

    def __init__(self, group, sent: list[int], received: list[int], order: torch.Tensor, tally: Sent):
        self.group, self.sent, self.received, self.order, self.tally = group, sent, received, order, tally


def exchange_counts(counts: torch.Tensor, group, ep: int) -> torch.Tensor:
    """counts [E] (rows per global expert on this rank) -> [ep, E/ep]: row s holds what rank s of the group sends
    to each of this rank's experts."""
    outgoing = counts.view(ep, -1).contiguous()
    incoming = torch.empty_like(outgoing)
    dist.all_to_all_single(incoming, outgoing, group=group)
    return incoming


def dispatch(rows: torch.Tensor, counts: torch.Tensor, group, ep: int, tally: Sent | None = None):
    """rows [M, dim] sorted by global expert, counts [E] -> (the rows this rank's experts take, grouped by local
    expert; their counts [E/ep]; the Route back). Dropped rows (past sum(counts)) are not sent. `tally`: where the
    bytes sent are added (module docstring)."""
    tally = tally if tally is not None else Sent()
    incoming = exchange_counts(counts, group, ep)
    tally.bytes += counts.numel() * counts.element_size()
    local_experts = incoming.shape[1]
    # the split sizes are host numbers (the one host read of a dispatch)
    sizes = torch.cat([counts.view(ep, local_experts).sum(1), incoming.sum(1)]).tolist()
    sent, received = sizes[:ep], sizes[ep:]
    arrived = _exchange(rows[:sum(sent)].contiguous(), received, sent, group, tally)
    order = arrival_order(incoming)
    return arrived[order], incoming.sum(0), Route(group, sent, received, order, tally)


def arrival_order(incoming: torch.Tensor) -> torch.Tensor:
    """What arrives is source-major (rank 0's rows for local experts 0, 1, ..., then rank 1's, ...), as counted by
    incoming [ep, E/ep]; the experts want it expert-major: the permutation that sorts it so (stable, so each
    source's rows keep their order)."""
    ep, local_experts = incoming.shape
    segment = torch.repeat_interleave(torch.arange(incoming.numel(), device=incoming.device), incoming.flatten())
    source, expert = segment // local_experts, segment % local_experts
    return torch.argsort(expert * ep + source, stable=True)


def combine(out: torch.Tensor, route: Route, rows: int) -> torch.Tensor:
    """This rank's experts' outputs (in dispatch's order) back to the ranks the rows came from, in their order, with
    zeros for the rows that were dropped: [rows, dim]."""
    inverse = torch.empty_like(route.order)
    inverse[route.order] = torch.arange(route.order.numel(), device=route.order.device)
    returned = _exchange(out[inverse].contiguous(), route.sent, route.received, route.group, route.tally)
    dropped = rows - sum(route.sent)
    if dropped:
        returned = torch.cat([returned, returned.new_zeros(dropped, returned.shape[1])])
    return returned
