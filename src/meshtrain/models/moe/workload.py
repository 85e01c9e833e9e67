"""The mixture-of-experts decoder as a workload: every language model's (token windows in, text samples out), plus
what its routing needs from outside the model, where the ranks are known.

    after each optimizer step   the assignments each expert took in the step, summed over the micro-steps (in the
                                layers' tallies) and over the data- and context-parallel ranks (one all-reduce over
                                routing_group), move the routers' biases (router.update_bias, when
                                model.bias_update_rate > 0): every rank then holds the bias one process with the same
                                global batch would; under a pipeline each stage moves its own layers'; under
                                expert parallelism, the bytes the step's all-to-alls sent are added up
    at each evaluation          the routing of the evaluation's batches (both splits), summed the same way and
                                gathered from every pipeline stage: balance loss (of all those tokens
                                together, whatever forwards a layout cut them into), the experts' shares (min, max,
                                entropy; per layer × expert under `expert_share`, which the report draws), dropped
                                assignments; and `a2a_mib`, what a training step's all-to-alls sent since the last
                                evaluation, per step and mean per rank (what `meshtrain plan` counts as `sent per
                                iteration: ep`)

A tally is reset after each step and around each evaluation, so each figure covers exactly its own batches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from meshtrain.models.language.workload import LanguageModelWorkload
from meshtrain.models.moe.model import MoE
from meshtrain.models.moe.router import balance_of_totals, load_entropy
from meshtrain.parallel.expert_parallel import sent_bytes
from meshtrain.parallel.mesh import submesh
from meshtrain.runtime.setup import collective


def routing_group(mesh):
    """The ranks whose routing counts add up to one process's (None on one): the data-parallel ranks, and the
    context-parallel ones, which route other positions of the same sequences. tp ranks route the same tokens, and
    each pipeline stage counts its own layers: neither is summed over."""
    routed = submesh(mesh, "dp_cp") if mesh is not None else None
    return routed.get_group() if routed is not None else None


def update_biases(moe_layers: list[MoE], rate: float, summed: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """The bias update of the step just taken (module docstring): the loads of `moe_layers` (this rank's, or this
    pipeline stage's) summed by `summed` over routing_group's ranks, each router's bias moved by `rate`."""
    if not moe_layers:  # a pipeline stage of dense layers only (its dp/cp peers hold the same stage)
        return
    load = summed(torch.stack([assigned(m) for m in moe_layers]))
    for moe, layer_load in zip(moe_layers, load, strict=True):
        moe.router.update_bias(layer_load, rate)


def assigned(moe: MoE) -> torch.Tensor:
    """The assignments each expert of `moe` took since its tally's last reset: int64 [E]."""
    if moe.tally.assigned is not None:
        return moe.tally.assigned
    return torch.zeros(moe.router.n_experts, dtype=torch.int64, device=moe.router.expert_bias.device)


class MoEWorkload(LanguageModelWorkload):
    def build_layout(self, model, mesh):
        layout = super().build_layout(model, mesh)
        self.moe = [m for m in layout.model.modules() if isinstance(m, MoE)]
        self.layers = [int(i) for i, block in layout.model.transformer.h.items() if any(isinstance(m, MoE) for m in
                                                                                   block.modules())]
        self.routed_group = routing_group(mesh)
        pp_mesh = submesh(mesh, "pp") if mesh is not None else None
        self.pp_group = pp_mesh.get_group() if pp_mesh is not None else None  # each stage holds its own layers
        self.model, self.a2a_mark, self.a2a_steps = layout.model, 0, 0  # the tally at the last evaluation's end
        layout.after_step.append(self.after_step)
        return layout

    def after_step(self) -> None:
        """The bias update of the step just taken (module docstring), then fresh tallies."""
        rate = self.cfg.model.bias_update_rate
        if rate > 0:
            update_biases(self.moe, rate, lambda load: self._summed(load, "the experts' load of the step"))
        self.a2a_steps += 1
        self._reset()

    def evaluate(self, layout, autocast, it: int) -> dict[str, float]:
        self._reset()
        sent = self.all_to_all_figure()
        out = super().evaluate(layout, autocast, it)
        out |= self.routing_figures() | sent
        self._reset()
        self.a2a_mark = sent_bytes(self.model)  # the evaluation's own exchanges are not a training step's
        return out

    def all_to_all_figure(self) -> dict[str, float]:
        """The training steps' all-to-all MiB since the last evaluation, per step, mean over the ranks that route
        (none without expert parallelism or steps)."""
        if self.dims.ep == 1:
            return {}
        # the tallies only grow (a measurement may reset them: then count from zero)
        trained = sent_bytes(self.model) - self.a2a_mark
        trained = trained if trained >= 0 else sent_bytes(self.model)
        figures = self._summed(torch.tensor([float(trained), float(self.a2a_steps)], dtype=torch.float64,
                                            device=self.device), "the all-to-all bytes of the steps")
        self.a2a_steps = 0
        if figures[1] == 0:
            return {}
        return {"a2a_mib": (figures[0] / figures[1]).item() / 2**20}

    def routing_figures(self) -> dict:
        """The tallies since the last reset, summed over routing_group's ranks and gathered from every pipeline
        stage, as the figures the legend names."""
        packed = self._summed(tallied(self.moe, self.cfg.model.n_experts).to(self.device),
                              "the routing figures of the evaluation").cpu()
        layers = self.layers
        if self.pp_group is not None:  # each stage holds its own layers
            with collective("all_gather of the stages' routing figures", self.info.timeout_s):
                layers, packed = from_every_stage(layers, packed, self.pp_group)
        return figures_of(layers, packed, self.cfg.model.top_k)

    def _summed(self, values: torch.Tensor, what: str) -> torch.Tensor:
        """values summed over routing_group's ranks (itself on one)."""
        if self.routed_group is None:
            return values
        values = values.clone()
        with collective(f"all_reduce of {what}", self.info.timeout_s):
            dist.all_reduce(values, group=self.routed_group)
        return values

    def _reset(self) -> None:
        for moe in self.moe:
            moe.tally.reset()


def tallied(moe_layers: list[MoE], n_experts: int) -> torch.Tensor:
    """The layers' tallies as float64 rows on the host, one per layer: [assigned (E) | probability sums (E) | tokens |
    dropped], each a total that adds up over ranks (what routing_group's all-reduce sums); n_experts: the width of
    none (a pipeline stage without MoE layers)."""
    rows = [torch.cat([assigned(m).double().cpu(), _vector(m.tally.probability, m.router.n_experts),
                       torch.tensor([m.tally.tokens], dtype=torch.float64), _vector(m.tally.dropped, 1)])
            for m in moe_layers]
    return torch.stack(rows) if rows else torch.zeros(0, 2 * n_experts + 2, dtype=torch.float64)


def from_every_stage(layers: list[int], packed: torch.Tensor, pp_group) -> tuple[list[int], torch.Tensor]:
    """Under a pipeline (pp_group), every stage's (layers, tallied rows) gathered and put in layer order; as they are
    without one."""
    if pp_group is None:
        return layers, packed
    stages = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(stages, (layers, packed), group=pp_group)
    pairs = sorted((layer, row) for stage_layers, rows in stages for layer, row in zip(stage_layers, rows, strict=True))
    return [layer for layer, _ in pairs], torch.stack([row for _, row in pairs]) if pairs else packed


def figures_of(layers: list[int], packed: torch.Tensor, top_k: int) -> dict:
    """The legend's figures from every layer's tallied rows, summed over the ranks. Each layer's balance loss is that
    of all the tokens counted (router.balance_of_totals), not a mean over forwards: it then does not depend on how a
    layout cut the tokens into forwards (a pipeline's microbatches, the ranks' batches). Means over the layers."""
    n_experts = (packed.shape[1] - 2) // 2
    assigned_, probability = packed[:, :n_experts], packed[:, n_experts:2 * n_experts]
    tokens, dropped = packed[:, -2], packed[:, -1]
    if tokens.numel() == 0 or tokens.min() == 0:  # nothing routed (no evaluation batch reached a layer)
        return {}
    share = assigned_ / (tokens[:, None] * top_k)
    return {"balance_loss": balance_of_totals(assigned_, probability, tokens, top_k).mean().item(),
            "expert_share_min": share.min().item(), "expert_share_max": share.max().item(),
            "expert_entropy": load_entropy(share).mean().item(),
            "dropped_tokens": int(dropped.sum().item()),
            "dropped_frac": (dropped.sum() / (tokens.sum() * top_k)).item(),
            # nested: the JSONL keeps it for the report's picture, the console line and TensorBoard skip it
            "expert_share": {"layers": layers, "share": share.tolist()}}


def _vector(value: torch.Tensor | None, size: int) -> torch.Tensor:
    """A tally's tensor as a float64 host vector of `size` (zeros where the layer has not routed yet)."""
    return value.double().cpu().reshape(size) if value is not None else torch.zeros(size, dtype=torch.float64)
