"""The training dtype: `train.dtype=auto` picks what the device computes natively, and says why.

    bf16  where the hardware computes it: CUDA sm80+ (and ROCm parts with bf16 units), Intel GPUs, MPS
          where macOS accepts it, a CPU with avx512_bf16, AMX or Arm's BF16 extension whose bf16 matmuls
          measure at least as fast as its fp32 ones (the machine profile's peaks, measured once per thread count);
    fp16  with a GradScaler on a CUDA GPU without bf16 (V100, T4);
    fp32  everywhere else: an AVX2-only CPU, where a bf16 matmul runs ~45-100× slower than fp32, and a CPU whose
          bf16 units are slower than its fp32 ones (a 2-core Intel Xeon with avx512_bf16 and no AMX here: bf16
          matmuls at 0.46-0.56× fp32's, and the CPU recipe 0.76× as fast under bf16 autocast as in fp32).

An explicit dtype is kept as given; bf16 on a device that only emulates it also gets one warning that
quotes the measured bf16 / fp32 matmul ratio, so the cost of the choice is in the log.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshtrain.machine import profile
from meshtrain.machine.hardware import Hardware, describe

COMPUTE_DTYPES = ("fp32", "bf16", "fp16")  # what a run computes in; train.dtype is one of them, or auto


@dataclass(frozen=True)
class Precision:
    dtype: str  # one of COMPUTE_DTYPES
    reason: str
    warning: str | None = None


def auto_dtype(hw: Hardware, rate: Callable[[str], float] | None = None) -> Precision:
    """What train.dtype=auto picks on `hw` (module docstring). `rate(label)`: the device's measured matmul FLOP/s in
    a dtype; given, a CPU's bf16 units must also be at least as fast as its fp32 ones (choose gives it from the
    machine profile)."""
    if hw.bf16 and hw.kind == "cpu" and rate is not None:
        bf16, fp32 = rate("bf16"), rate("fp32")
        if bf16 < fp32:
            return Precision("fp32", f"auto: {hw.name} has bf16 units ({hw.why_bf16}), but its bf16 matmuls run at "
                                     f"{profile.format_flops(bf16)} against {profile.format_flops(fp32)} in fp32 "
                                     f"(measured: {bf16 / fp32:.2f}×), so fp32")
    if hw.bf16:
        return Precision("bf16", f"auto: {hw.name} computes bf16 natively ({hw.why_bf16})")
    if hw.kind == "cuda":
        return Precision("fp16", f"auto: {hw.name} has no bf16 units ({hw.why_bf16}), so fp16 autocast with a "
                                 "GradScaler")
    return Precision("fp32", f"auto: {hw.name} has no native bf16 ({hw.why_bf16}: torch would emulate it through "
                             "fp32), so fp32")


def measured_rate(device: torch.device | str) -> Callable[[str], float] | None:
    """A CPU's measured matmul FLOP/s by dtype label, from the machine profile (measured there once, when missing,
    and kept even if the cores were busy then: the choice compares two figures the load lowers alike, and must not
    cost every run a measurement on a loaded box), for auto_dtype; None elsewhere (an accelerator's bf16 units are
    its fastest)."""
    device = torch.device(device)
    return (lambda label: profile.measured(device, label, busy_ok=True)["flops"]) if device.type == "cpu" else None


def bf16_cost(device: torch.device) -> str:
    """'bf16 matmuls run at X against Y in fp32 here (r×)', from the machine profile (measured once)."""
    bf16, fp32 = (profile.measured(device, label)["flops"] for label in ("bf16", "fp32"))
    return (f"bf16 matmuls run at {profile.format_flops(bf16)} against {profile.format_flops(fp32)} in fp32 "
            f"here ({bf16 / fp32:.3g}×)")


def choose(requested: str, device: torch.device | str, hw: Hardware | None = None) -> Precision:
    """The dtype to train in for `requested` (train.dtype) on `device`, with the reason to log."""
    if requested not in ("auto", *COMPUTE_DTYPES):
        raise ValueError(f"train.dtype={requested!r}: choose one of auto, {', '.join(COMPUTE_DTYPES)}")
    device = torch.device(device)
    hw = hw or describe(device)
    if requested == "auto":
        return auto_dtype(hw, measured_rate(device))
    warning = None
    if requested == "bf16" and not hw.bf16 and hw.kind in ("cpu", "cuda"):
        warning = (f"train.dtype=bf16 on {hw.name}, which has no native bf16 ({hw.why_bf16}): {bf16_cost(device)}; "
                   f"train.dtype=auto would pick {auto_dtype(hw, measured_rate(device)).dtype}")
    return Precision(requested, f"train.dtype={requested} as set", warning)
