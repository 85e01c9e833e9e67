"""What this device is, read without timing anything: name, instruction sets or compute capability, memory,
and whether it computes bf16 and fp16 in hardware.

On a CPU, "in hardware" means bf16 dot-product units (x86 avx512_bf16 or AMX, Arm's BF16 extension) that
the kernels torch runs may use. Without them torch converts every bf16 element to fp32 and back, which on
an AVX2-only CPU makes a bf16 matmul ~45-100× slower than fp32. The caps a user sets to make a big CPU
behave like a small one (ATEN_CPU_CAPABILITY for torch's own kernels, ONEDNN_MAX_CPU_ISA for oneDNN's)
count as taking the units away: they are how the AVX2 path is exercised on any box.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from meshtrain.runtime.device import cpus_available

# CPU flags that decide precision; /proc/cpuinfo's names (x86 "flags", Arm "Features").
_X86_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")
_ARM_FLAGS = ("asimd", "sve", "bf16", "fphp", "asimdhp")
# oneDNN's ISA caps, lowest first: bf16 compute needs AVX512_CORE_BF16 or above.
_ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
                "AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX10_1_512_AMX", "AVX512_CORE_AMX",
                "AVX10_1_512_AMX_FP16", "AVX512_CORE_AMX_FP16", "ALL", "DEFAULT")


@dataclass(frozen=True)
class Hardware:
    kind: str  # cpu | cuda | xpu | mps
    name: str
    isa: str  # cpu: torch's kernel capability (AVX2, AVX512, DEFAULT, ...); cuda: sm80, gfx90a, ...
    features: tuple[str, ...]  # cpu: the precision-relevant flags present (see _X86_FLAGS, _ARM_FLAGS)
    caps: tuple[str, ...]  # environment caps in force, e.g. ("ATEN_CPU_CAPABILITY=avx2",)
    bf16: bool  # bf16 computed in hardware
    fp16: bool  # fp16 computed in hardware
    why_bf16: str  # why bf16 is (not) native: "avx512_bf16 + amx_bf16", "AVX2 without avx512_bf16 or AMX", ...
    cores: int  # CPUs this process may use
    host_memory_bytes: int
    device_memory_bytes: int | None  # accelerators only


def device_name(device: torch.device) -> str:
    if device.type in ("cuda", "xpu"):
        return getattr(torch, device.type).get_device_name(device)
    if device.type == "cpu":
        return _cpu_model_name()
    return device.type


def _cpu_model_name() -> str:
    if sys.platform == "darwin":
        name = _sysctl("machdep.cpu.brand_string")
        if name:
            return name
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _sysctl(name: str) -> str:
    try:
        return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags (x86 "flags", Arm "Features"), lower case; macOS asks sysctl for Arm's BF16."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.lower().split())
            break  # every core lists the same flags
    if not cpuinfo and sys.platform == "darwin" and _sysctl("hw.optional.arm.FEAT_BF16") == "1":
        flags.add("bf16")
    return flags


def cpu_caps(environ=None) -> tuple[str, ...]:
    """The environment caps that keep torch or oneDNN below the CPU's own instruction sets."""
    env = os.environ if environ is None else environ
    caps = []
    aten = env.get("ATEN_CPU_CAPABILITY", "").strip()
    if aten:
        caps.append(f"ATEN_CPU_CAPABILITY={aten}")
    onednn = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "").strip()
    if onednn:
        caps.append(f"ONEDNN_MAX_CPU_ISA={onednn}")
    return tuple(caps)


def cpu_bf16(flags: set[str], capability: str, caps: tuple[str, ...]) -> tuple[bool, str]:
    """(bf16 computed in hardware, why) from the flags, torch's kernel capability and the caps in force."""
    arm = "asimd" in flags or platform.machine().lower() in ("arm64", "aarch64")
    units = [f for f in ("avx512_bf16", "amx_bf16") if f in flags] if not arm else (["bf16"] if "bf16" in flags
                                                                                       else [])
    if not units:
        return False, ("Arm without the BF16 extension" if arm else
                       "AVX-512 without avx512_bf16 or AMX" if "avx512f" in flags else
                       "AVX2 without avx512_bf16 or AMX" if "avx2" in flags else "no AVX-512 or bf16 units")
    onednn = next((c.split("=", 1)[1].upper() for c in caps if c.startswith("ONEDNN_MAX_CPU_ISA=")), "")
    onednn_low = onednn in _ONEDNN_ISAS and _ONEDNN_ISAS.index(onednn) < _ONEDNN_ISAS.index("AVX512_CORE_BF16")
    if not arm and (capability.upper() in ("DEFAULT", "AVX2") or onednn_low):
        return False, f"{' + '.join(units)} capped by {', '.join(caps) or 'torch capability ' + capability}"
    return True, " + ".join(units)


def _cpu() -> tuple[str, tuple[str, ...], tuple[str, ...], bool, bool, str]:
    flags = cpu_flags()
    capability = torch.backends.cpu.get_cpu_capability()
    caps = cpu_caps()
    bf16, why = cpu_bf16(flags, capability, caps)
    fp16 = bool(flags & {"avx512_fp16", "amx_fp16", "fphp", "asimdhp"})
    features = tuple(f for f in (*_X86_FLAGS, *_ARM_FLAGS) if f in flags)
    return capability, features, caps, bf16, fp16, why


def _cuda(device: torch.device) -> tuple[str, bool, bool, str]:
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip:
        arch = getattr(props, "gcnArchName", "rocm").split(":")[0]
        bf16 = arch.startswith(("gfx908", "gfx90a", "gfx94", "gfx95", "gfx11", "gfx12"))  # torch says yes on any ROCm part
        return arch, bf16, True, f"{arch} matrix cores" if bf16 else f"{arch} has no bf16 matrix units"
    major, minor = props.major, props.minor
    bf16 = _cuda_bf16_support(major >= 8)
    why = f"sm{major}{minor} tensor cores" if bf16 else f"sm{major}{minor}: bf16 units start at sm80"
    return f"sm{major}{minor}", bf16, major >= 6, why


def _cuda_bf16_support(by_arch: bool) -> bool:
    """Native bf16 on the current device (the nodes of a job hold one kind of GPU)."""
    try:  # torch >= 2.4 tells emulated bf16 (which it allows on older parts) from native
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:
        return by_arch


def _mps_bf16() -> bool:
    try:  # macOS 14+ computes bf16 on the GPU; older releases refuse the dtype
        x = torch.ones(2, 2, device="mps", dtype=torch.bfloat16)
        return bool(torch.isfinite((x @ x).float().cpu()).all())
    except (RuntimeError, TypeError):
        return False


def inductor_safe_width() -> int:
    """A GPT width (n_embd) whose CPU kernels torch 2.13's inductor compiles right at this CPU's vector width: for the
    tests and benchmarks that compile a small GPT on CPU. Its inductor stores a whole vector into some reductions'
    tails (pytorch/pytorch#196681, open; train/trainer.py names it beside a NaN): at 1 thread, a 2-layer GPT compiled
    whole gave NaN at n_embd 32 with 256-bit vectors (AVX2) and corrupted the heap at 48, 64, 96 and 128 with 512-bit
    ones (AVX-512); 32 and 48 are the widths seen right."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return 48 if pick_vec_isa().bit_width() == 256 else 32


def host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def available_memory_bytes(meminfo: str | None = None) -> int:
    """What the host can still give processes (Linux's MemAvailable: free memory and what caches would release);
    its total memory where that is not known."""
    try:
        text = Path("/proc/meminfo").read_text() if meminfo is None else meminfo
    except OSError:
        return host_memory_bytes()
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # kB
    return host_memory_bytes()


def describe(device: torch.device | str) -> Hardware:
    """The Hardware record of `device` (cheap: flags, properties and environment only)."""
    device = torch.device(device)
    name, features, caps, device_memory = device_name(device), (), (), None
    if device.type == "cpu":
        isa, features, caps, bf16, fp16, why = _cpu()
    elif device.type == "cuda":
        isa, bf16, fp16, why = _cuda(device)
        device_memory = torch.cuda.get_device_properties(device).total_memory
    elif device.type == "xpu":
        isa, bf16, fp16, why = "xpu", True, True, "XMX matrix engines"
        device_memory = torch.xpu.get_device_properties(device).total_memory
    elif device.type == "mps":
        bf16 = _mps_bf16()
        isa, fp16, why = "mps", True, "Apple GPU, macOS 14+" if bf16 else "this macOS refuses bf16 on the GPU"
    else:
        isa, bf16, fp16, why = device.type, False, False, f"unknown device type {device.type}"
    return Hardware(kind=device.type, name=name, isa=isa, features=features, caps=caps, bf16=bf16, fp16=fp16,
                    why_bf16=why, cores=cpus_available(), host_memory_bytes=host_memory_bytes(),
                    device_memory_bytes=device_memory)
