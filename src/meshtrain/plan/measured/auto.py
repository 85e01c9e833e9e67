"""parallel.plan=auto: the layout `train` runs, chosen before the Trainer is built (the trainer knows nothing of
the planner): the fastest layout that fits on this machine by `meshtrain plan`'s model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshtrain import config as config_mod
from meshtrain import registry
from meshtrain.errors import MeshtrainError
from meshtrain.plan import search
from meshtrain.plan.measured.this_machine import this_machine
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
        return cfg
    cfg, _ = resolve_precision(cfg, info)
    layout = None
    if info.is_main:
        machine = this_machine(info.local_world_size, str(info.torch_device), registry.spec_of(cfg).name)
        try:
            chosen = search.best(cfg, info.world_size // info.local_world_size, info.local_world_size, machine)
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
