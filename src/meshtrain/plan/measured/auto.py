"""parallel.plan=auto: the layout `train` runs, chosen before the Trainer is built (the trainer knows nothing of
the planner): the fastest layout that fits on this machine by `meshtrain plan`'s model."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING

from meshtrain import config as config_mod
from meshtrain import registry
from meshtrain.errors import MeshtrainError
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.plan import search
from meshtrain.plan.measured.this_machine import this_machine
from meshtrain.plan.workload import ModelFacts
from meshtrain.runtime.log import get_logger
from meshtrain.runtime.setup import DistInfo, broadcast_object
from meshtrain.train.trainer import resolve_precision

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig

log = get_logger("plan")


def resolve(cfg: RunConfig, info: DistInfo):
    """cfg with its layout keys set by the planner when parallel.plan=auto; any other cfg as it is. Rank 0 plans for
    every rank, in the dtype the run will compute in (the machine's figures are measured, and must not differ
    between ranks)."""
    if cfg.parallel.plan != "auto":
        if not restarted() or _formed(cfg, info):
            return cfg
        if info.is_main:
            log.warning("this restart has %d rank(s) (%d per node), where the run's layout (%s) cannot be formed: "
                        "re-planning as parallel.plan=auto would", info.world_size, info.local_world_size,
                        _layout_keys(cfg))
        cfg = replace(cfg, parallel=replace(cfg.parallel, plan="auto"))
    cfg, _ = resolve_precision(cfg, info)
    layout = None
    if info.is_main:
        machine = this_machine(info.local_world_size, str(info.torch_device), registry.spec_of(cfg).name)
        try:
            chosen = search.best(cfg, info.world_size // info.local_world_size, info.local_world_size, machine)
            if cfg.parallel.plan_trace:
                facts = ModelFacts.of(cfg)
                ranked, _ = search.search(cfg, info.world_size // info.local_world_size, info.local_world_size,
                                          machine, facts)
                chosen = traced_choice(ranked, search.HEADROOM * machine.device_memory_bytes, machine, facts)
        except MeshtrainError as e:  # every rank raises it, none waits for a layout that never comes
            layout = {"error": str(e)}
        else:
            layout = search.layout_of(chosen)
            log.info("parallel.plan=auto chose %s: predicted %.1f ms per step, %.3f GiB peak per rank (`meshtrain "
                     "plan` lists the alternatives)", chosen.label, chosen.cost.step_s * 1e3,
                     chosen.cost.peak_bytes / 2**30)
    layout = broadcast_object(layout, "broadcast of the planned layout", info.timeout_s)
    if "error" in layout:
        raise config_mod.ConfigError(layout["error"])
    return search.with_layout(cfg, layout)


TRACED = 3  # the ranked layouts parallel.plan_trace traces, at most (each takes seconds: docs/plan.md)


def traced_choice(ranked: list, memory: float, machine, facts, count: int = TRACED):
    """The first of the `count` best fitting layouts of `ranked` whose traced peak (plan --trace: every distinct
    rank role, in a fork of this process) fits in `memory` bytes of a `machine`'s device; a layout the trace cannot
    build is taken on its prediction. An error when none of them fits."""
    from meshtrain.plan.measured.trace import check_traceable, trace, traced_config
    from meshtrain.plan.systems import PlanError

    tried = []
    for c in [c for c in ranked if c.fits][:count]:
        try:
            check_traceable(c.cfg, c.dims)
        except PlanError as e:
            log.info("parallel.plan_trace: %s taken on its prediction (%s)", c.label, e)
            return c
        peak = max(t.peak for t in trace(traced_config(c.cfg, facts, machine), c.dims))
        if peak <= memory:
            log.info("parallel.plan_trace: %s traced at %.3f GiB peak per rank (predicted %.3f GiB): fits", c.label,
                     peak / 2**30, c.cost.peak_bytes / 2**30)
            return c
        log.warning("parallel.plan_trace: %s passed over: traced at %.3f GiB peak per rank (predicted %.3f GiB), "
                    "more than the %.3f GiB a device has", c.label, peak / 2**30, c.cost.peak_bytes / 2**30,
                    memory / 2**30)
        tried.append(f"{c.label} ({peak / 2**30:.3f} GiB)")
    raise config_mod.ConfigError(f"parallel.plan_trace: none of the {len(tried)} best layouts fits in "
                                 f"{memory / 2**30:.3f} GiB per device when traced: {', '.join(tried)}; use more "
                                 "devices or a smaller model.batch_size")


def restarted() -> bool:
    """Whether this job is a restart: torchrun's agent (after a failure, an elastic job on the nodes left) or
    `meshtrain launch --max-restarts` under mpiexec/srun say so."""
    return any(int(os.environ.get(name, "0") or 0) > 0 for name in ("TORCHELASTIC_RESTART_COUNT",
                                                                    "MESHTRAIN_RESTART_COUNT"))


def _formed(cfg: RunConfig, info: DistInfo) -> bool:
    """Whether cfg's layout (and its global batch) can be formed on these ranks."""
    try:
        dims = ParallelDims.from_config(cfg, info.world_size, info.local_world_size)
        config_mod.with_global_batch(cfg, dims.dp_size)
    except MeshtrainError:
        return False
    return True


def _layout_keys(cfg: RunConfig) -> str:
    p = cfg.parallel
    return " ".join(f"parallel.{k}={getattr(p, k)}" for k in ("tp", "cp", "pp", "dp_replicate", "dp_shard"))
