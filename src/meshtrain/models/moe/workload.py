"""The mixture-of-experts decoder as a workload: every language model's (token windows in, text samples out), plus
what its routing needs from outside the model, where the ranks are known.

    after each optimizer step   the assignments each expert took in the step, summed over the micro-steps (in the
                                layers' tallies) and over the data-parallel ranks (one all-reduce on the mesh's dp
                                dims), move the routers' biases (router.update_bias, when model.bias_update_rate > 0):
                                every rank then holds the bias one process with the same global batch would; under
                                expert parallelism, the bytes the step's all-to-alls sent are added up
    at each evaluation          the routing of the evaluation's batches (both splits), summed over the data-parallel
                                ranks: balance loss, the experts' shares (min, max, entropy; per layer × expert under
                                `expert_share`, which the report draws), dropped assignments; and `a2a_mib`, what a
                                training step's all-to-alls sent since the last evaluation, per step and mean per rank
                                (what `meshtrain plan` counts as `sent per iteration: ep`)

A tally is reset after each step and around each evaluation, so each figure covers exactly its own batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshtrain.models.language.workload import LanguageModelWorkload
from meshtrain.models.moe.model import MoE
from meshtrain.models.moe.router import load_entropy
from meshtrain.parallel.expert_parallel import sent_bytes
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
        self.model, self.a2a_mark, self.a2a_steps = layout.model, 0, 0  # the tally at the last evaluation's end
        return layout

    def after_step(self) -> None:
        """The bias update of the step just taken (module docstring), then fresh tallies."""
        rate = self.cfg.model.bias_update_rate
        if rate > 0:
            load = self._summed(torch.stack([self._assigned(m) for m in self.moe]), "the experts' load of the step")
            for moe, layer_load in zip(self.moe, load, strict=True):
                moe.router.update_bias(layer_load, rate)
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
        """The training steps' all-to-all MiB since the last evaluation, per step, mean over the dp ranks (none
        without expert parallelism or steps)."""
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
