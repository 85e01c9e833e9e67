"""What calibrate.py measured, as this_machine reads it back: the fixed costs per kind of layout and the slowdown of
ranks sharing cores, cached in the machine profile (~/.cache/meshtrain/machine.json, "plan_fixed" and
"plan_slowdown") under this device, thread count, torch, rank count, cost-model version and tiny model."""

from __future__ import annotations

import torch

from meshtrain import registry
from meshtrain.machine import hardware, profile
from meshtrain.runtime.device import pick_device, threads_per_rank

MODEL_VERSION = 9  # what the fixed costs are measured beyond: a new cost model invalidates the cached ones
# The slowdown of ranks sharing cores is the machine's, measured once on this workload (calibrate.COMPUTE).
SLOWDOWN_REFERENCE = "gpt"


def calibrated(model: str) -> bool:
    """Whether `model` can be calibrated: its ModelSpec says how to make it tiny."""
    return bool(registry.get(model).tiny)


def key(ranks: int, model: str) -> str:
    device = pick_device(0)
    threads = threads_per_rank(ranks) if device.type == "cpu" else 0
    return (f"{profile.profile_key(hardware.describe(device), threads)}|ranks={ranks}|torch={torch.__version__}"
            f"|model={MODEL_VERSION}|{model}")


def cached(ranks: int, model: str) -> dict[str, list[float]]:
    """kind -> [seconds per block and micro-step, seconds per step], as far as measured."""
    return profile.read_cache().get("plan_fixed", {}).get(key(ranks, model), {})


def cached_slowdown(ranks: int, dtype: str = "fp32") -> float | None:
    return profile.read_cache().get("plan_slowdown", {}).get(slowdown_key(ranks, dtype))


def slowdown_key(ranks: int, dtype: str) -> str:
    """The slowdown of ranks sharing cores is measured in the dtype they compute in: bf16 kernels contend otherwise."""
    return key(ranks, SLOWDOWN_REFERENCE) + ("" if dtype == "fp32" else f"|{dtype}")


def forget(ranks: int, model: str, dtype: str) -> None:
    """Drop what calibrate.py measured for `model` on `ranks` ranks, and the slowdown of ranks sharing cores in
    `dtype` with the reference's own fixed costs it stands on: a VM's speed drifts between hours (a slowdown here
    read 2.07× at one calibration and 2.70× at another), and a calibration is a snapshot of it."""
    for model_key in {key(ranks, model), key(ranks, SLOWDOWN_REFERENCE)}:
        profile.forget("plan_fixed", model_key)
    profile.forget("plan_slowdown", slowdown_key(ranks, dtype))
