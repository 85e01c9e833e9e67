"""The mixture-of-experts decoder as a workload: every language model's (token windows in, text samples out), plus
what its routing needs from outside the model, where the ranks are known.

    after each optimizer step   the assignments each expert took in the step, summed over the micro-steps (in the
                                layers' tallies) and over the data-parallel ranks (one all-reduce on the mesh's dp
                                dims), move the routers' biases (router.update_bias, when model.bias_update_rate > 0):
                                every rank then holds the bias one process with the same global batch would
    at each evaluation          the routing of the evaluation's batches (both splits), summed over the data-parallel
                                ranks: balance loss, the experts' shares (min, max, entropy; per layer × expert under
                                `expert_share`, which the report draws), dropped assignments

A tally is reset after each step and around each evaluation, so each figure covers exactly its own batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshtrain.models.language.workload import LanguageModelWorkload
from meshtrain.models.moe.model import MoE
from meshtrain.models.moe.router import load_entropy
from meshtrain.parallel.mesh import submesh
from meshtrain.runtime.setup import collective


class MoEWorkload(LanguageModelWorkload):
    def build_layout(self, model, mesh):
        layout = super().build_layout(model, mesh)
        self.moe = [m for m in layout.model.modules() if isinstance(m, MoE)]
        self.layers = [i for i, block in layout.model.transformer.h.items() if any(isinstance(m, MoE) for m in
                                                                                   block.modules())]
        dp_mesh = submesh(mesh, "dp") if mesh is not None else None
        self.dp_group = dp_mesh.get_group() if dp_mesh is not None else None
        layout.after_step.append(self.after_step)
        return layout

    def after_step(self) -> None:
        """The bias update of the step just taken (module docstring), then fresh tallies."""
        rate = self.cfg.model.bias_update_rate
        if rate > 0:
            load = self._summed(torch.stack([self._assigned(m) for m in self.moe]), "the experts' load of the step")
            for moe, layer_load in zip(self.moe, load, strict=True):
                moe.router.update_bias(layer_load, rate)
        self._reset()

    def evaluate(self, layout, autocast, it: int) -> dict[str, float]:
        self._reset()
        out = super().evaluate(layout, autocast, it)
        out |= self.routing_figures()
        self._reset()
        return out

    def routing_figures(self) -> dict:
        """The tallies since the last reset, summed over the data-parallel ranks, as the figures the legend names."""
        k = self.cfg.model.top_k
        assigned = torch.stack([self._assigned(m) for m in self.moe]).double()  # [layers, E]
        scalars = torch.tensor([[float(m.tally.tokens), float(m.tally.forwards)] for m in self.moe],
                               dtype=torch.float64, device=assigned.device)
        dropped = torch.stack([m.tally.dropped if m.tally.dropped is not None else torch.zeros((), device=self.device)
                               for m in self.moe]).double()
        balance = torch.stack([m.tally.balance if m.tally.balance is not None else torch.zeros((), device=self.device)
                               for m in self.moe]).double()
        packed = self._summed(torch.cat([assigned, scalars, dropped[:, None], balance[:, None]], dim=1),
                              "the routing figures of the evaluation").cpu()
        assigned, tokens, forwards = packed[:, :-4], packed[:, -4], packed[:, -3]
        if tokens.min() == 0:  # nothing routed (no evaluation batch reached a layer): nothing to report
            return {}
        share = assigned / (tokens[:, None] * k)
        return {"balance_loss": (packed[:, -1] / forwards).mean().item(),
                "expert_share_min": share.min().item(), "expert_share_max": share.max().item(),
                "expert_entropy": load_entropy(share).mean().item(),
                "dropped_tokens": int(packed[:, -2].sum().item()),
                "dropped_frac": (packed[:, -2].sum() / (tokens.sum() * k)).item(),
                # nested: the JSONL keeps it for the report's picture, the console line and TensorBoard skip it
                "expert_share": {"layers": [int(i) for i in self.layers], "share": share.tolist()}}

    def _assigned(self, moe: MoE) -> torch.Tensor:
        if moe.tally.assigned is not None:
            return moe.tally.assigned
        return torch.zeros(moe.router.n_experts, dtype=torch.int64, device=moe.router.expert_bias.device)

    def _summed(self, values: torch.Tensor, what: str) -> torch.Tensor:
        """values summed over the data-parallel ranks (itself on one)."""
        if self.dp_group is None:
            return values
        values = values.clone()
        with collective(f"all_reduce of {what}", self.info.timeout_s):
            dist.all_reduce(values, group=self.dp_group)
        return values

    def _reset(self) -> None:
        for moe in self.moe:
            moe.tally.reset()
