"""What the planner knows of a model before any layout: built once on the meta device (free at any size) from the
run config and the data's facts, through the model's own ModelSpec, so that it plans the very model `train` builds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from meshtrain import registry
from meshtrain.nn.meta import on_meta
from meshtrain.parallel.pipeline_schedules import StageSplit, split_layers, stage_ids
from meshtrain.plan.systems import PlanError

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig


@dataclass
class ModelFacts:
    spec: registry.ModelSpec
    shape: registry.ModelShape
    model: nn.Module  # the whole model, on the meta device
    split: StageSplit | None
    tokens: int  # per sample
    configured_batch: int  # samples per data-parallel rank and micro-step, as the config says
    global_batch: int | None  # data.global_batch_size, when the config fixes the global batch instead
    head_features: int  # the output layer's width per token (a vocabulary, or a patch of fields)
    num_params: int
    flops_per_token: float
    linears: list[tuple[str, tuple[int, int]]]  # (module path, (out, in)) of every nn.Linear

    batch_size: int = 0  # per data-parallel rank, once a layout sets dp (for_dp)
    # A mixture of experts under ep > 1: the rows the busiest rank's experts receive, as a multiple of the balanced
    # expectation (tokens × top_k); plan/experts.py, `meshtrain plan --expert-imbalance`
    expert_imbalance: float = 1.25

    @classmethod
    def of(cls, cfg: RunConfig, data_facts: dict | None = None) -> ModelFacts:
        """The facts of `cfg`'s model; `data_facts` (e.g. {"meta": {"vocab_size": 50304}}) stands in for the data's
        own when planning for data that is not on this machine."""
        spec = registry.spec_of(cfg)
        shape = spec.shape(cfg)
        if shape.experts and shape.moe is None:  # its experts' matmuls are not nn.Linears: priced from ModelShape.moe
            raise PlanError(f"model {spec.name!r} has experts but its ModelShape gives no `moe` (registry.ExpertShape): "
                            "the planner prices the routed experts from it; add it, or choose the layout yourself "
                            "(parallel.plan=manual, the default)")
        if spec.build_model is None or spec.data_facts is None:
            raise registry.RegistryError(f"model {spec.name!r} gives no build_model or data_facts in its ModelSpec: "
                                         "the planner builds the model from them (see docs/models.md)")
        with on_meta():
            model = spec.build_model(cfg, data_facts or spec.data_facts(cfg))
        config = getattr(model, "config", None)
        tokens = shape.tokens or getattr(config, "num_patches", None) or config.block_size
        linears = [(name, tuple(m.weight.shape)) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
        data = getattr(cfg, "data", None)
        return cls(spec=spec, shape=shape, model=model, split=spec.stage_split, tokens=tokens,
                   configured_batch=shape.batch_size, global_batch=getattr(data, "global_batch_size", None),
                   head_features=linears[-1][1][0], num_params=sum(p.numel() for p in model.parameters()),
                   flops_per_token=float(model.flops_per_token()), linears=linears, batch_size=shape.batch_size)

    def for_dp(self, dp: int, accum: int = 1) -> ModelFacts:
        """These facts with the per-rank batch of a layout with `dp` data-parallel ranks and `accum` micro-steps an
        iteration (a global batch is split over both, as the ViT's workload splits data.global_batch_size)."""
        batch = self.global_batch // (dp * accum) if self.global_batch else self.configured_batch
        return _replace(self, batch_size=batch)

    @functools.lru_cache(maxsize=64)  # noqa: B019  (facts live as long as one plan)
    def stage_linears(self, pp: int, pp_rank: int, schedule: str, virtual_stages: int) -> frozenset[str]:
        """The linears pp rank `pp_rank` runs."""
        n_stages = pp * virtual_stages
        blocks = split_layers(self.shape.layers, n_stages)
        mine = stage_ids(pp_rank, pp, virtual_stages, schedule)
        owned = tuple(f"{self.split.blocks}.{i}." for s in mine for i in blocks[s])
        ends = (self.split.first if 0 in mine else ()) + (self.split.last if n_stages - 1 in mine else ())
        return frozenset(n for n, _ in self.linears if n.startswith(owned) or n in ends
                         or n.startswith(tuple(f"{e}." for e in ends)))

    __hash__ = object.__hash__


def _replace(facts: ModelFacts, **changes) -> ModelFacts:
    from dataclasses import replace

    return replace(facts, **changes)
