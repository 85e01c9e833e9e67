"""The whole profile of one device as one dict: what it is, what train.dtype=auto picks there, its matmul peak per
dtype, memory and bandwidth, the collectives recorded for it and, on a CUDA GPU, the planner's rate tables.
Measured where the cache (profile.py) lacks a figure; `meshtrain machine` prints it or dumps it as JSON."""

from __future__ import annotations

import dataclasses

import torch

from meshtrain.machine import datasheet, profile
from meshtrain.machine.hardware import Hardware, describe
from meshtrain.machine.precision import auto_dtype


def dtypes_for(hw: Hardware) -> list[str]:
    """The matmul dtypes worth a figure on this device: tf32 only where fp32 can run on tensor cores."""
    labels = ["fp32", "tf32", "bf16", "fp16"] if hw.kind == "cuda" and hw.bf16 else ["fp32", "bf16", "fp16"]
    return labels if hw.kind != "mps" or hw.bf16 else ["fp32", "fp16"]


def collect(device: torch.device, refresh: bool = False) -> dict:
    """The profile of `device` at this process's thread count, measuring what the cache lacks."""
    hw = describe(device)
    entry = datasheet.match_device(hw.name) if hw.kind != "cpu" else None
    matmul = {}
    for label in dtypes_for(hw):
        peak = profile.datasheet_peak(device, label)
        matmul[label] = {"measured": profile.measured(device, label, refresh=refresh),
                         "datasheet": peak.flops if peak else None}
    auto = auto_dtype(hw, lambda label: matmul[label]["measured"]["flops"])
    data = profile.read_cache()
    collectives = {key: value for key, value in data.get("collectives", {}).items()
                   if key.split("|")[1:3] == [hw.kind, hw.name]}
    p = {"key": profile.profile_key(hw, profile.threads_of(device)),
         "hardware": dataclasses.asdict(hw),
         "datasheet": entry.name if entry else None, "auto_dtype": {"dtype": auto.dtype, "reason": auto.reason},
         "matmul": matmul, "memory": profile.measured(device, "memory", refresh=refresh),
         "collectives": collectives, "cache": str(profile.cache_path())}
    if hw.kind == "cuda":
        p["curves"] = profile.curves(device, refresh=refresh)
    return p
