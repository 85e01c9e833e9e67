"""The memory check before a run's first step (train.memory_check): the planner's predicted peak per rank of the
layout the run trains (plan/cost.py; within 10% of the measured peak in fp32 and under bf16 autocast, docs/plan.md)
against what the rank has: a GPU's free memory, or on a CPU the host's available memory shared by the ranks of this
node. A run that cannot fit stops before it starts, with both figures and the nearest settings that do fit, rather
than minutes later under the kernel's OOM killer with nothing but "exited on signal 9" (`error`, the default);
`warn` says so and trains anyway; `off` skips the check."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

import torch

from meshtrain import config as config_mod
from meshtrain import registry
from meshtrain.errors import MeshtrainError
from meshtrain.machine import hardware
from meshtrain.parallel import backends
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.plan.cost import predict_peak
from meshtrain.plan.machines import Machine
from meshtrain.plan.search import HEADROOM, label
from meshtrain.plan.workload import ModelFacts
from meshtrain.runtime.log import get_logger
from meshtrain.runtime.setup import DistInfo, broadcast_object
from meshtrain.train.trainer import resolve_precision

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig

log = get_logger("plan")
GIB = 2**30


def check_memory(cfg: RunConfig, info: DistInfo) -> None:
    """Rank 0 predicts, every rank acts alike: a ConfigError under memory_check=error when the run will not fit."""
    if cfg.train.memory_check == "off":
        return
    # A layout that cannot be formed fails on every rank alike, before any collective (rank 0 alone would leave the
    # others waiting in the broadcast below).
    dims = ParallelDims.from_config(cfg, info.world_size, info.local_world_size)
    cfg = config_mod.with_global_batch(cfg, dims.dp_size)
    cfg, _ = resolve_precision(cfg, info)
    verdict = _verdict(cfg, dims, info) if info.is_main else None
    verdict = broadcast_object(verdict, "broadcast of the memory check", info.timeout_s)
    if verdict and cfg.train.memory_check == "error":
        raise config_mod.ConfigError(verdict + "; train.memory_check=warn trains anyway")
    if verdict and info.is_main:
        log.warning("%s (train.memory_check=warn: training anyway)", verdict)


def available_bytes(device: torch.device, local_ranks: int) -> float:
    """What one rank can use: its GPU's free memory, or its share of the host's available memory."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    return hardware.available_memory_bytes() / local_ranks


def _verdict(cfg: RunConfig, dims: ParallelDims, info: DistInfo) -> str | None:
    """None when the run fits; else why not, and what would."""
    if cfg.train.init_from not in ("scratch", "resume", "auto"):  # pretrained weights bring their own shapes
        log.info("memory check skipped: the model's shapes come from train.init_from=%s", cfg.train.init_from)
        return None
    try:
        facts, device = ModelFacts.of(cfg), info.torch_device
    except (registry.RegistryError, ValueError) as e:  # a model the planner cannot build: the run's own checks
        log.info("memory check skipped: %s", e)  # say why, with the fix, as it starts
        return None
    machine = Machine("this", info.local_world_size, 0.0, {}, 0.0, 0.0, 0.0, 0.0, 0.0, overlap=False,
                      cpu=device.type == "cpu")
    # What the rank holds already (the runtime, on a CPU) plus the predicted peak of its tensors, against the
    # share of the memory that fits as plan=auto counts it (search.HEADROOM: allocator slack).
    have = HEADROOM * available_bytes(device, info.local_world_size)
    where = f"{HEADROOM:.0%} of {device}'s free memory" if device.type == "cuda" else \
        f"{HEADROOM:.0%} of this host's available memory shared by {info.local_world_size} rank(s)"
    need, verdict = shortfall(facts, cfg, dims, machine, have, where,
                              held=0 if device.type == "cuda" else _resident_bytes())
    log.info("memory check: %s needs about %s per rank at its peak; %s gives %s", label(cfg, dims), _size(need),
             where, _size(have))
    return verdict


def shortfall(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, machine: Machine, have: float, where: str,
              held: float = 0.0) -> tuple[float, str | None]:
    """The layout's predicted peak per rank plus the `held` bytes a rank holds already, and None when that fits in
    `have` bytes (`where` says whose), else both figures and the nearest settings that fit. `meshtrain submit` asks
    it for a shipped system's devices before a job is queued."""
    need = predict_peak(facts, cfg, dims, machine) + held
    if need <= have:
        return need, None
    fits = [change for change, peak in _alternatives(facts, cfg, dims, machine) if peak + held <= have]
    return need, (f"out of memory ahead: {label(cfg, dims)} needs about {need / GIB:.2f} GiB per rank at its peak "
                  f"(`meshtrain plan`'s prediction, {cfg.train.dtype}), but {where} gives {have / GIB:.2f} GiB"
                  + (f"; these fit: {'; '.join(fits[:4])}" if fits else "; no single change of batch, activation "
                     "checkpointing or backend fits: use more or larger devices"))


def _alternatives(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, machine: Machine):
    """(the change, its predicted peak) for the nearest settings: a smaller micro-batch (the same global batch
    through accumulation; where the config gives the global batch, data.global_batch_size, accumulation alone
    makes the micro-batch smaller), full activation checkpointing, a sharded backend, and all three together."""
    key, accum = facts.shape.keys["batch_size"], cfg.train.grad_accum
    batch = facts.for_dp(dims.dp_size, accum).batch_size  # the micro-batch a rank takes
    smaller = [([] if facts.global_batch else [(key, b)]) + [("train.grad_accum", accum * batch // b)]
               for b in (batch // 2, batch // 4, batch // 8) if b >= 1 and batch % b == 0]
    recompute = [("train.activation_checkpointing", "full")] if cfg.train.activation_checkpointing != "full" else []
    shard = [("train.backend", "fsdp")] if not backends.get(cfg.train.backend).sharded and dims.dp_size > 1 else []
    for change in [*smaller, recompute, shard, recompute + shard + (smaller[-1] if smaller else [])]:
        if not change:
            continue
        changed, changed_facts = cfg, facts
        for dotted, value in change:
            section, name = dotted.split(".")
            changed = dataclasses.replace(changed, **{section: dataclasses.replace(getattr(changed, section),
                                                                                   **{name: value})})
            if dotted == key:
                changed_facts = dataclasses.replace(facts, configured_batch=value, batch_size=value)
        try:
            config_mod.validate(changed)
            changed_dims = ParallelDims.from_config(changed, dims.world_size, machine.devices_per_node)
        except MeshtrainError:
            continue
        yield " ".join(f"{k}={v}" for k, v in change), predict_peak(changed_facts, changed, changed_dims, machine)


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def _resident_bytes() -> int:
    """This process's resident memory now (Linux: /proc/self/statm; 0 where not known)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
