"""Datasheet peaks of known accelerators: dense (no 2:4 sparsity) FLOP/s per dtype, as torch sees the device.

A device in this table keeps these figures for MFU (a measurement on a busy or throttled part would
flatter the run); every other device, and every CPU, gets a measured peak (machine/measure.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class PeakEntry:
    """Dense peak FLOP/s of one torch device, per dtype ('bf16', 'fp16', 'tf32', 'fp32'); None: no
    hardware path (then the peak is measured). `stacks` > 1: the card holds that many torch devices."""

    name: str
    flops: Mapping[str, float | None]
    source: str
    note: str = ""
    stacks: int = 1


def _entry(name, bf16, fp16, tf32, fp32, source, note="", stacks=1) -> PeakEntry:
    t = 1e12
    flops = {k: None if v is None else v * t for k, v in (("bf16", bf16), ("fp16", fp16), ("tf32", tf32),
                                                          ("fp32", fp32))}
    return PeakEntry(name, MappingProxyType(flops), source, note, stacks)


def _nv(name, bf16, fp16, tf32, fp32, source, note="datasheet tensor figures are 2:4-sparse; these are half"):
    return _entry(name, bf16, fp16, tf32, fp32, source, note)


_NO_BF16 = "no bf16 hardware (torch emulates it): bf16 is measured"
_ENTRIES = [
    # NVIDIA, TFLOP/s:   bf16    fp16    tf32   fp32 (fp32: the FMA units, no tensor cores)
    _nv("NVIDIA GB200",  2500,   2500,   1250,  80, "GB200 NVL72 datasheet, rack / 72"),
    _nv("NVIDIA B200",   2250,   2250,   1125,  75, "HGX B200 datasheet, board / 8"),
    _nv("NVIDIA GH200",  989.4,  989.4,  494.7, 66.9, "GH200 Grace Hopper Superchip datasheet"),
    _nv("NVIDIA H200 NVL", 835.5, 835.5, 417.5, 60, "H200 Tensor Core GPU datasheet (NVL)"),
    _nv("NVIDIA H200",   989.4,  989.4,  494.7, 66.9, "H200 Tensor Core GPU datasheet (SXM)"),
    _nv("NVIDIA H100 NVL", 835.5, 835.5, 417.5, 60, "H100 Tensor Core GPU datasheet (NVL)"),
    _nv("NVIDIA H100 PCIe", 756.5, 756.5, 378,  51.2, "H100 Tensor Core GPU Architecture whitepaper"),
    _nv("NVIDIA H100 SXM", 989.4, 989.4, 494.7, 66.9, "H100 Tensor Core GPU Architecture whitepaper"),
    _nv("NVIDIA A100",   312,    312,    156,   19.5, "A100 Tensor Core GPU datasheet (SXM, PCIe)"),
    _nv("NVIDIA A40",    149.7,  149.7,  74.8,  37.4, "A40 datasheet"),
    _nv("NVIDIA A30",    165,    165,    82,    10.3, "A30 Tensor Core GPU datasheet"),
    _nv("NVIDIA A10",    125,    125,    62.5,  31.2, "A10 Tensor Core GPU datasheet"),
    _nv("NVIDIA L40S",   362.05, 362.05, 183,   91.6, "L40S GPU datasheet"),
    _nv("NVIDIA L40",    181.05, 181.05, 90.5,  90.5, "L40 GPU datasheet"),
    _nv("NVIDIA L4",     121,    121,    60,    30.3, "L4 Tensor Core GPU datasheet"),
    _nv("NVIDIA V100S PCIe", None, 130,  None,  16.4, "V100 Tensor Core GPU datasheet", _NO_BF16),
    _nv("NVIDIA V100 PCIe", None, 112,   None,  14,   "V100 Tensor Core GPU datasheet", _NO_BF16),
    _nv("NVIDIA V100 SXM2", None, 125,   None,  15.7, "V100 Tensor Core GPU datasheet", _NO_BF16),
    _nv("NVIDIA T4",     None,   65,     None,  8.1,  "T4 Tensor Core GPU datasheet", _NO_BF16),
    # AMD: an MI250X/MI250 package holds two GCDs and torch sees each GCD as a device: half the package.
    # fp32 is the matrix (MFMA) rate, which matmuls use; MI200 has no tf32, so fp32 stands in.
    _entry("AMD Instinct MI250X (one GCD)", 191.5, 191.5, None, 47.85,
           "AMD Instinct MI250X datasheet, package / 2", "383 TFLOP/s bf16 per OAM package"),
    _entry("AMD Instinct MI250 (one GCD)", 181.05, 181.05, None, 45.25,
           "AMD Instinct MI250 datasheet, package / 2", "362.1 TFLOP/s bf16 per OAM package"),
    _entry("AMD Instinct MI210", 181, 181, None, 45.3, "AMD Instinct MI210 datasheet"),
    _entry("AMD Instinct MI325X", 1307.4, 1307.4, 653.7, 163.4, "AMD Instinct MI325X datasheet", "SPX mode"),
    _entry("AMD Instinct MI300X", 1307.4, 1307.4, 653.7, 163.4, "AMD Instinct MI300X datasheet", "SPX mode"),
    _entry("AMD Instinct MI300A", 980.6, 980.6, 490.3, 122.6, "AMD Instinct MI300A datasheet"),
    # Intel PVC: 2 stacks × 64 Xe cores × 8 XMX × 512 bf16 FLOP/clk × 1.6 GHz = 839 TFLOP/s per card.
    # Torch sees one stack per device in FLAT mode (the default, Aurora's), the card in COMPOSITE mode.
    _entry("Intel Data Center GPU Max 1550 (one stack)", 419.4, 419.4, 209.7, 26.2,
           "Intel Data Center GPU Max Series product brief, card / 2",
           "839 bf16, 52.4 fp32 TFLOP/s per card", stacks=2),
]
PEAK_FLOPS: Mapping[str, PeakEntry] = MappingProxyType({e.name: e for e in _ENTRIES})

# First match wins, so a specific name precedes the one it contains (GB200 ⊃ B200, GH200 vs H200,
# H100 PCIe/NVL before plain H100 = SXM). Where a name leaves the part open ("gfx942", "MI250X/MI250"),
# the larger peak is chosen: a wrong guess then understates MFU instead of overstating it.
_PATTERNS = [(re.compile(p, re.I), PEAK_FLOPS[n]) for p, n in [
    (r"\bGB200\b", "NVIDIA GB200"), (r"\bB200\b", "NVIDIA B200"), (r"\bGH200\b", "NVIDIA GH200"),
    (r"\bH200 NVL\b", "NVIDIA H200 NVL"), (r"\bH200\b", "NVIDIA H200"),
    (r"\bH100 NVL\b", "NVIDIA H100 NVL"), (r"\bH100\b.*\bPCIe\b", "NVIDIA H100 PCIe"),
    (r"\bH100\b", "NVIDIA H100 SXM"), (r"\bA[18]00\b", "NVIDIA A100"), (r"\bA40\b", "NVIDIA A40"),
    (r"\bA30\b", "NVIDIA A30"), (r"\bA10\b", "NVIDIA A10"),
    (r"\bL40S\b", "NVIDIA L40S"), (r"\bL40\b", "NVIDIA L40"), (r"\bL4\b", "NVIDIA L4"),
    (r"\bV100S\b", "NVIDIA V100S PCIe"), (r"\bV100\b.*\bPCIe\b", "NVIDIA V100 PCIe"),
    (r"\bV100\b", "NVIDIA V100 SXM2"), (r"\bT4\b", "NVIDIA T4"),
    (r"\bMI250X\b", "AMD Instinct MI250X (one GCD)"), (r"\bMI250\b", "AMD Instinct MI250 (one GCD)"),
    (r"\bgfx90a\b", "AMD Instinct MI250X (one GCD)"), (r"\bMI210\b", "AMD Instinct MI210"),
    (r"\bMI325X\b", "AMD Instinct MI325X"), (r"\bMI300X\b", "AMD Instinct MI300X"),
    (r"\bMI300A\b", "AMD Instinct MI300A"), (r"\bgfx942\b", "AMD Instinct MI300X"),
    (r"\bMax 1550\b", "Intel Data Center GPU Max 1550 (one stack)"),
]]


def match_device(name: str) -> PeakEntry | None:
    """The table entry for a torch device name ("NVIDIA H100 80GB HBM3" -> H100 SXM), or None."""
    return next((entry for pattern, entry in _PATTERNS if pattern.search(name or "")), None)
