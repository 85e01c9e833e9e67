"""Which device this rank drives, which backend talks between ranks, and how many threads it may use."""

from __future__ import annotations

import os

import torch

from meshtrain.errors import MeshtrainError

# Accelerators in the order they are preferred, with the collective backend that serves each.
_BACKENDS = {"cuda": "nccl", "xpu": "xccl", "mps": "gloo", "cpu": "gloo"}
_KNOWN_BACKENDS = {"nccl", "xccl", "ccl", "gloo", "mpi", "ucc"}


class DeviceError(MeshtrainError, RuntimeError):
    """A requested device or backend does not exist here or does not fit together."""


def _available(kind: str) -> bool:
    if kind == "cuda":
        return torch.cuda.is_available()
    if kind == "xpu":
        return hasattr(torch, "xpu") and torch.xpu.is_available()
    if kind == "mps":
        return torch.backends.mps.is_available()
    return kind == "cpu"


def device_count(kind: str) -> int:
    if kind in ("cuda", "xpu") and _available(kind):
        return getattr(torch, kind).device_count()
    return 1 if _available(kind) else 0


def pick_device(local_rank: int = 0, requested: str | None = None) -> torch.device:
    """cuda -> xpu -> mps -> cpu, or what `requested` / MESHTRAIN_DEVICE names ('cpu', 'cuda', 'cuda:1').

    With one process per accelerator, local rank r drives accelerator r; where the scheduler shows
    each rank only its own (CUDA_VISIBLE_DEVICES of one), r wraps to that one.
    """
    name = (requested or os.environ.get("MESHTRAIN_DEVICE") or "auto").strip().lower()
    if name == "auto":
        kind = next(k for k in _BACKENDS if _available(k))
    else:
        kind = name.split(":")[0]
        if kind not in _BACKENDS:
            raise DeviceError(f"unknown device {name!r}: choose one of auto, {', '.join(_BACKENDS)}")
        if not _available(kind):
            raise DeviceError(
                f"device {name!r} was requested (MESHTRAIN_DEVICE or the config) but torch {torch.__version__} "
                f"sees no {kind} here; use MESHTRAIN_DEVICE=cpu or auto"
            )
    if kind in ("cpu", "mps"):
        return torch.device(kind)
    if ":" in name:
        return torch.device(name)
    return torch.device(kind, local_rank % device_count(kind))


def pick_backend(device: torch.device, requested: str | None = None) -> str:
    """nccl for cuda, xccl for xpu, gloo for cpu/mps; MESHTRAIN_BACKEND or `requested` overrides."""
    name = (requested or os.environ.get("MESHTRAIN_BACKEND") or "auto").strip().lower()
    if name == "auto":
        return _BACKENDS[device.type]
    if name.split(":")[0] not in _KNOWN_BACKENDS and ":" not in name:
        raise DeviceError(f"unknown backend {name!r}: choose one of auto, {', '.join(sorted(_KNOWN_BACKENDS))}")
    if name == "nccl" and device.type != "cuda":
        raise DeviceError(f"backend nccl needs CUDA devices but this rank drives {device}; use gloo")
    return name


def cpus_available() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def threads_per_rank(local_world_size: int, environ=None) -> int:
    """OMP_NUM_THREADS when the user (or torchrun) set it; else this node's CPUs shared among its ranks."""
    env = os.environ if environ is None else environ
    if env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        return int(env["OMP_NUM_THREADS"])
    return max(1, cpus_available() // max(1, local_world_size))


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels so a wall-clock timer measures the work, not its launch."""
    if device.type in ("cuda", "xpu", "mps"):
        getattr(torch, device.type).synchronize()
