"""Every layout of a run config on a job of N nodes × G devices, each checked by the rules `train` applies
(config.validate, ParallelDims.from_config) and costed (plan/cost.py), ranked: those that fit first, then by
throughput.

A candidate is the run config with its `parallel` and `train` layout keys set, so a chosen one trains as it is
(`parallel.plan=auto`, or the overrides `plan` prints).
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from meshtrain import config as config_mod
from meshtrain.errors import MeshtrainError
from meshtrain.parallel import backends
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.plan.cost import Cost, predict
from meshtrain.plan.machines import Machine
from meshtrain.plan.workload import ModelFacts

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig

CHECKPOINTING = ("none", "selective", "full", "op")
SCHEDULES = (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2))  # (schedule, virtual stages per rank)
HEADROOM = 0.9  # a layout "fits" when its predicted peak is under this share of device memory (allocator slack)


@dataclass
class Candidate:
    cfg: object  # the run config with this layout's keys set
    dims: ParallelDims
    cost: Cost
    fits: bool

    @property
    def label(self) -> str:
        return label(self.cfg, self.dims)

    @property
    def overrides(self) -> list[str]:
        """The command-line overrides that give `train` this layout."""
        p, t = self.cfg.parallel, self.cfg.train
        items = [f"train.backend={t.backend}", f"train.activation_checkpointing={t.activation_checkpointing}",
                 f"parallel.dp_replicate={p.dp_replicate}", f"parallel.dp_shard={self.dims.dp_shard}",
                 f"parallel.tp={p.tp}", f"parallel.cp={p.cp}", f"parallel.pp={p.pp}"]
        if self.dims.ep > 1:
            items.append(f"parallel.ep={p.ep}")
        if p.cp > 1:
            items.append(f"parallel.cp_impl={p.cp_impl}")
        if p.pp > 1:
            items += [f"parallel.pp_schedule={p.pp_schedule}", f"parallel.virtual_stages={p.virtual_stages}",
                      f"parallel.microbatches={p.microbatches}"]
        return items

    @property
    def throughput(self) -> float:
        """Samples per second of the whole job."""
        return self.cost.samples_per_iteration / self.cost.step_s


def label(cfg: RunConfig, dims: ParallelDims) -> str:
    """A layout in one short line: backend, mesh, schedule, checkpointing."""
    p, t = cfg.parallel, cfg.train
    mesh = [f"dp{dims.dp_replicate}×{dims.dp_shard}" if backends.get(t.backend).replicas else f"dp{dims.dp_size}"]
    mesh += [f"tp{dims.tp}"] * (dims.tp > 1) + [f"cp{dims.cp}:{p.cp_impl}"] * (dims.cp > 1) + \
        [f"ep{dims.ep}"] * (dims.ep > 1)
    if dims.pp > 1:
        mesh.append(f"pp{dims.pp}:{p.pp_schedule}" + (f"×{p.virtual_stages}" if p.virtual_stages > 1 else "")
                    + f"/mb{p.microbatches}")
    return f"{t.backend} {' '.join(mesh)} ac={t.activation_checkpointing}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(base, world: int, experts: int = 0) -> list:
    """Every combination of layout keys for `world` ranks, as run configs (not yet checked); with `experts` (a mixture
    of experts), every ep that divides both the ranks and the experts too (what else ep needs, `check` decides with
    the trainer's own rules)."""
    found = []
    eps = [e for e in _divisors(world) if experts % e == 0] if experts else [1]
    for tp in _divisors(world):
        for cp in _divisors(world // tp):
            for pp in _divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                for backend in backends.names(planned=True):
                    replicas = [r for r in _divisors(dp) if 1 < r < dp] if backends.get(backend).replicas else [1]
                    for dp_replicate, ep in itertools.product(replicas, eps):
                        for impl in ("ring", "ulysses") if cp > 1 else (base.parallel.cp_impl,):
                            for schedule, virtual in SCHEDULES if pp > 1 else ((base.parallel.pp_schedule, 1),):
                                for ac in CHECKPOINTING:
                                    parallel = replace(base.parallel, tp=tp, cp=cp, pp=pp, dp_replicate=dp_replicate,
                                                       dp_shard=-1, cp_impl=impl, pp_schedule=schedule,
                                                       virtual_stages=virtual, ep=ep,
                                                       microbatches=pp * virtual if pp > 1 else None)
                                    train = replace(base.train, backend=backend, activation_checkpointing=ac)
                                    found.append(replace(base, parallel=parallel, train=train))
    return found


def check(cfg: RunConfig, world: int, ranks_per_node: int) -> ParallelDims:
    """The layout's dims, or the error `train` would raise for it."""
    config_mod.validate(cfg)
    return ParallelDims.from_config(cfg, world, ranks_per_node)


def search(base, nodes: int, per_node: int, machine: Machine, facts: ModelFacts | None = None
           ) -> tuple[list[Candidate], Counter]:
    """Every valid layout of `base` on nodes × per_node ranks, costed and ranked; and why the others were refused:
    each kind of error (its message with the numbers left out) counted, under its first message, whole."""
    facts = facts or ModelFacts.of(base)
    world = nodes * per_node
    ranked, refused, first_of_kind = [], Counter(), {}
    for cfg in layouts(base, world, facts.shape.experts):
        try:
            dims = check(cfg, world, per_node)
            cfg = config_mod.with_global_batch(cfg, dims.dp_size)  # its accumulation, where the global batch is set
        except MeshtrainError as e:
            refused[first_of_kind.setdefault(re.sub(r"\d+", "N", str(e)), str(e))] += 1
            continue
        cost = predict(facts, cfg, dims, machine)
        ranked.append(Candidate(cfg, dims, cost, fits=cost.peak_bytes <= HEADROOM * machine.device_memory_bytes))
    ranked.sort(key=lambda c: (not c.fits, -c.throughput, c.cost.peak_bytes))
    return ranked, refused


def best(base, nodes: int, per_node: int, machine: Machine) -> Candidate:
    """The fastest layout that fits; an error naming the smallest peak when none does."""
    ranked, _ = search(base, nodes, per_node, machine)
    if not ranked:
        raise config_mod.ConfigError(f"parallel.plan=auto: no layout of this model is valid on {nodes * per_node} "
                                     "ranks; run `meshtrain plan` to see why each was refused")
    if not ranked[0].fits:
        smallest = min(ranked, key=lambda c: c.cost.peak_bytes)
        raise config_mod.ConfigError(
            f"parallel.plan=auto: no layout fits in {machine.device_memory_bytes / 2**30:.1f} GiB per device; the "
            f"smallest, {smallest.label}, needs {smallest.cost.peak_bytes / 2**30:.2f} GiB: use more devices, a "
            "smaller model.batch_size, or train.dtype=bf16")
    return ranked[0]


LAYOUT_KEYS = ("tp", "cp", "pp", "ep", "dp_replicate", "dp_shard", "cp_impl", "pp_schedule", "virtual_stages",
               "microbatches")


def layout_of(chosen: Candidate) -> dict:
    """The layout keys of a candidate, as plain values (what rank 0 broadcasts under parallel.plan=auto)."""
    p, t = chosen.cfg.parallel, chosen.cfg.train
    return {"parallel": {**{k: getattr(p, k) for k in LAYOUT_KEYS}, "dp_shard": chosen.dims.dp_shard},
            "train": {"backend": t.backend, "activation_checkpointing": t.activation_checkpointing}}


def with_layout(cfg: RunConfig, layout: dict):
    """`cfg` with `layout`'s keys (layout_of); everything else as the user set it."""
    return replace(cfg, parallel=replace(cfg.parallel, plan="manual", **layout["parallel"]),
                   train=replace(cfg.train, **layout["train"]))
