"""The data-parallel backends: each is one row of this registry, the one place that says what it is. Config, the mesh
checks, the composition, the optimizer, the planner's cost model and its calibration all read these rows; none of
them compares backend names.

    ddp      DistributedDataParallel: every rank holds everything; gradients all-reduced
    zero1    DDP + ZeroRedundancyOptimizer: the optimizer state sharded over the data-parallel ranks
    zero2    FSDP2, parameters kept gathered between forward and backward (no reshard after forward)
    fsdp     FSDP2, parameters re-sharded after forward (= zero3): the least memory, the most traffic
    zero3    fsdp by DeepSpeed's name
    hsdp     FSDP2 on a 2-D mesh: shard within dp_shard, replicate across dp_replicate
    deepspeed  DeepSpeed's engine, ZeRO stage parallel.zero_stage: it owns forward, backward and step

Each family's module does the work (imported only when used, so that config stays free of torch): ddp.py wraps in
DistributedDataParallel and builds zero1's optimizer, fsdp.py shards with FSDP2, deepspeed.py runs DeepSpeed's engine.
A new backend is a row here and, for a new family, a module beside them (docs/architecture.md, "Where a change goes").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

ALL = frozenset({"tp", "cp", "pp", "ep", "float8"})


@dataclass(frozen=True)
class Backend:
    name: str
    family: str  # the module that wraps it: ddp | fsdp | deepspeed
    shards: str  # what is split over the data-parallel ranks: nothing | optimizer | everything
    reshard_after_forward: bool = True  # FSDP2: gather the parameters again for backward (zero2 keeps them)
    replicas: bool = False  # a 2-D data-parallel mesh, replicate × shard (parallel.dp_replicate)
    # what else a layout may use with it (a rule on the config alone), and why not the rest
    composes_with: frozenset[str] = ALL
    alone_because: str = ""
    planned: bool = True  # `meshtrain plan` enumerates it: not an alias, and the cost model covers it
    calibrate_with: tuple[str, ...] = ()  # overrides its calibration run needs beyond train.backend

    @property
    def all_reduces(self) -> bool:
        """DDP: every rank holds the whole parameters, gradients are all-reduced (zero1 shards only the optimizer)."""
        return self.family == "ddp"

    @property
    def sharded(self) -> bool:
        """Parameters, gradients and optimizer state sharded by FSDP2."""
        return self.family == "fsdp"

    @property
    def engine(self) -> bool:
        """An engine of its own runs forward, backward and the optimizer step."""
        return self.family == "deepspeed"

    @property
    def kind(self) -> str:
        """The kind of layout whose fixed costs plan/measured/calibrate.py measures for it."""
        return f"backend:{self.name}"

    def module(self):
        return importlib.import_module(f"meshtrain.parallel.backends.{self.family}")


REGISTRY = {b.name: b for b in (
    Backend("ddp", "ddp", "nothing"),
    Backend("zero1", "ddp", "optimizer", composes_with=frozenset({"float8"}),
            alone_because="ZeroRedundancyOptimizer shards plain tensors over one group; use train.backend=zero2 or "
                          "fsdp to combine sharding with tp/cp/pp/ep"),
    Backend("zero2", "fsdp", "everything", reshard_after_forward=False),
    Backend("fsdp", "fsdp", "everything"),
    Backend("zero3", "fsdp", "everything", planned=False),
    Backend("hsdp", "fsdp", "everything", replicas=True, composes_with=ALL - {"cp"},
            alone_because="context parallelism under hsdp is not supported in this version; use fsdp",
            calibrate_with=("parallel.dp_replicate=2",)),
    Backend("deepspeed", "deepspeed", "everything", composes_with=frozenset(), planned=False,
            alone_because="meshtrain runs DeepSpeed's ZeRO as data parallelism only; use fsdp/zero2 to combine "
                          "with tp/cp/pp/ep (float8 likewise)"),
)}


def names(*, planned: bool = False) -> tuple[str, ...]:
    return tuple(n for n, b in REGISTRY.items() if b.planned or not planned)


def get(name: str) -> Backend:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown data-parallel backend {name!r}: choose one of {', '.join(REGISTRY)}") from None
