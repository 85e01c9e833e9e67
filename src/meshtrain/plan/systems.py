"""Real machines a plan can be made for: one node type each, with every figure's source.

A System is what a parallel-layout cost model needs to know about one node type of a machine: the torch
device it runs on, how many of them a node holds, their memory and peak FLOP/s, how fast they talk inside a
node and across nodes, and how long the shortest collective takes. Each figure carries its source (a
document title and address, or the derivation from one) in `System.sources`.

Units and conventions:

- Everything is per *torch device*. Frontier's MI250X holds two GCDs and torch sees each as a device, so a
  Frontier node has 8; Aurora's Max 1550 holds two stacks and torch sees each as a device in FLAT mode (the
  default there), so an Aurora node has 12.
- Memory is in bytes, in whole GiB (2**30 bytes). HBM and DIMMs come in binary sizes that vendors market as
  "GB" (an "A100 40GB" holds 40 GiB, of which torch shows a little less after the driver's share).
- Peak FLOP/s are dense (no 2:4 sparsity) per dtype, taken from machine/datasheet.py's entry for the device
  so the planner and MFU read one table; None where the device has no hardware path for the dtype.
- Bandwidths are in GB/s = 1e9 bytes/s, one direction.
- `intra_node_gbs` is an *achievable* all-reduce bus bandwidth per device inside a node, what nccl-tests
  reports as busbw: a published busbw where one was found (DGX H100), a measured copy bandwidth of the hop
  that bounds a ring (Aurora), or else the peak one-direction link bandwidth of that hop times 0.8, the
  share NCCL gets past its protocol overhead ("~20%", NCCL's maintainer in NVIDIA/nccl-tests#212).
- `inter_node_gbs` is the device's share of the node's network injection bandwidth, one direction, at line
  rate: NICs x rate / devices. No efficiency is applied to it.
- Latencies are per *step* of a ring collective (alpha in alpha + bytes/bandwidth): a ring all-reduce over
  n devices takes 2(n-1) steps, all at the inter-node latency once its group spans nodes. No centre
  publishes these, so they come from NCCL's own cost model (src/graph/tuning.cc): its estimate for a
  smallest all-reduce over one node (intra) or two nodes (inter), fixed costs included, divided by that
  ring's steps, so that counting steps reproduces it. NCCL's model stands in for RCCL and oneCCL on
  Frontier and Aurora, and the source says so. (The measured profile's `latency_s` is instead the time of
  a whole smallest collective.)

`meshtrain plan --system this` uses none of this table: it plans for the machine it runs on from the
machine profile `meshtrain machine --ranks N` measured (built elsewhere). `custom()` puts explicit figures
given on the command line (--device-memory, --intra-node-bw, --inter-node-bw) in place of a table entry's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from meshtrain.errors import MeshtrainError
from meshtrain.machine.datasheet import match_device
from meshtrain.runtime.jobscript import SchedulerFacts

GiB = 2**30


class PlanError(MeshtrainError, ValueError):
    """A plan cannot be made as asked: an unknown system, a figure that is not a positive number."""


# The fields that are figures about the machine, each of which must have a source.
FIGURES = ("device", "devices_per_node", "device_memory_bytes", "peak_flops", "intra_node_gbs",
           "inter_node_gbs", "intra_node_latency_s", "inter_node_latency_s", "host_memory_bytes", "memory_gbs")


@dataclass(frozen=True)
class System:
    """One node type of a real machine, per torch device (see the module docstring for units)."""

    name: str
    title: str
    device: str
    devices_per_node: int
    device_memory_bytes: int
    peak_flops: Mapping[str, float | None]
    intra_node_gbs: float
    inter_node_gbs: float
    intra_node_latency_s: float
    inter_node_latency_s: float
    host_memory_bytes: int | None
    sources: Mapping[str, str]
    note: str = ""
    memory_gbs: float = 0.0  # HBM bandwidth per torch device, GB/s (elementwise work runs at this): HBM_GBS
    scheduler: SchedulerFacts | None = None  # how its batch system takes jobs (`meshtrain submit`); None: site's own

    def __post_init__(self):
        missing = [figure for figure in FIGURES if not self.sources.get(figure)]
        if missing:
            raise PlanError(f"system {self.name!r} gives no source for {', '.join(missing)}")
        # Read-only copies: a System is shared by every caller of get(), so nobody may edit its tables.
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))


# ------------------------------------------------------------------------------------------------ sources
ALCF_POLARIS = ("ALCF, Polaris Machine Overview, "
                "https://docs.alcf.anl.gov/polaris/hardware-overview/machine-overview/")
NERSC_ARCH = "NERSC, Perlmutter Architecture, https://docs.nersc.gov/systems/perlmutter/architecture/"
NERSC_NODES = "NERSC, Node Types at NERSC, https://docs.nersc.gov/beginner-guide/nodetypesfig/"
ALCF_AURORA = ("ALCF, Aurora Machine Overview, "
               "https://docs.alcf.anl.gov/aurora/hardware-overview/machine-overview/")
ALCF_AURORA_PEAK = ("ALCF, Aurora single node 'GPU-Peak' benchmarks (pre-production system), "
                    "https://docs.alcf.anl.gov/aurora/node-performance-overview/node-performance-overview/")
OLCF_FRONTIER = ("OLCF, Frontier User Guide, System Overview, "
                 "https://docs.olcf.ornl.gov/systems/frontier_user_guide.html")
AMD_MI250 = ("AMD, ROCm documentation, AMD Instinct MI250 microarchitecture, "
             "https://rocm.docs.amd.com/en/latest/conceptual/gpu-arch/mi250.html")
DGX_GUIDE = ("NVIDIA DGX H100 User Guide, 1.2.3 Network Modules, "
             "https://docs.nvidia.com/dgx/dgxh100-user-guide/")
DGX_SHEET = "NVIDIA DGX H100 datasheet (not retrieved here)"
NCCL_TESTS_212 = ("NCCL maintainer's answer in NVIDIA/nccl-tests#212 (H100 all reduce performance), "
                  "https://github.com/NVIDIA/nccl-tests/issues/212")
NCCL_TUNING = ("NCCL's cost model, NVIDIA/nccl src/graph/tuning.cc (baseLat, hwLat; commit b647562), "
               "https://github.com/NVIDIA/nccl")
SLINGSHOT_NIC = ("an HPE Slingshot-11 (Cassini) NIC runs at 200 Gb/s = 25 GB/s per direction (OLCF's Crusher "
                 "overview, as quoted by the press: 'four HPE Slingshot 200 Gbps (25 GB/s) NICs providing a "
                 "node-injection bandwidth of 800 Gbps (100 GB/s)', not retrieved from OLCF here; "
                 "https://glennklockwood.com/garden/slingshot: 'Slingshot-11 introduced 200G Slingshot NICs "
                 "(codenamed Cassini)')")

# NCCL gets about 80% of a link's line rate as bus bandwidth: "450GB/s is the line rate. With the protocol
# overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s" (NCCL_TESTS_212). Applied to a
# link's peak where no all-reduce busbw was published for the machine.
LINK_EFFICIENCY = 0.8
NIC_GBS = 25.0  # one Slingshot-11 NIC, GB/s per direction (SLINGSHOT_NIC)


# ---------------------------------------------------------------------------------- derived figures
def _peak_flops(device: str) -> tuple[Mapping[str, float | None], str]:
    """The datasheet table's peaks for `device`, and their source: one table for the planner and for MFU."""
    entry = match_device(device)
    if entry is None:  # a table entry naming a device the datasheet lacks is a bug in this file
        raise PlanError(f"no datasheet entry in meshtrain.machine.datasheet matches {device!r}")
    return entry.flops, f"{entry.source} (meshtrain.machine.datasheet entry {entry.name!r})"


# NCCL's tuning model (NCCL_TUNING) for a small ring all-reduce, LL protocol: a base 6.6 us, then 0.6 us per
# NVLink step inside one node; across nodes each of its 2 x nodes network steps costs 2.7 us and every
# other step max(0.6 us, the CPU's network overhead: 1.0 us on Intel, 2.0 us on AMD), the network plugin's
# own latency taken as 0. Per step = that time / the ring's 2(n-1) steps.
NET_OVERHEAD_US = {"Intel": 1.0, "AMD": 2.0}


def _intra_latency(ranks: int, stand_in: str = "") -> tuple[float, str]:
    steps = 2 * (ranks - 1)
    us = 6.6 + steps * 0.6
    return us / steps * 1e-6, (f"{stand_in}derived from {NCCL_TUNING}: ring all-reduce, LL protocol, one "
                               f"node of {ranks}: 6.6 us + {steps} x 0.6 us = {us:.1f} us over {steps} steps "
                               f"= {us / steps:.2f} us per step")


def _inter_latency(per_node: int, cpu: tuple[str, str], stand_in: str = "") -> tuple[float, str]:
    """`cpu`: the vendor NCCL keys its network overhead on, and where the node's CPUs are documented."""
    vendor, documented = cpu
    steps, network = 2 * (2 * per_node - 1), 2 * 2
    other = max(0.6, NET_OVERHEAD_US[vendor])
    us = 6.6 + (steps - network) * other + network * 2.7
    return us / steps * 1e-6, (f"{stand_in}derived from {NCCL_TUNING}: ring all-reduce, LL protocol, two "
                               f"nodes of {per_node} with {vendor} CPUs ({documented}): 6.6 us + "
                               f"{steps - network} x {other} us + {network} x 2.7 us = {us:.1f} us over "
                               f"{steps} steps = {us / steps:.2f} us per step")


# Datasheet HBM bandwidth per torch device, GB/s: what elementwise work (norms, activations, the optimizer) runs at.
HBM_GBS = {
    "NVIDIA A100-SXM4-40GB": (1555.0, "NVIDIA A100 Tensor Core GPU datasheet: 1,555 GB/s (40GB SXM)"),
    "NVIDIA A100-SXM4-80GB": (2039.0, "NVIDIA A100 Tensor Core GPU datasheet: 2,039 GB/s (80GB SXM)"),
    "NVIDIA H100 80GB HBM3": (3350.0, "NVIDIA H100 Tensor Core GPU datasheet: 3.35 TB/s (SXM)"),
    "AMD Instinct MI250X (one GCD)": (1638.4, "AMD Instinct MI250X datasheet: 3.2768 TB/s per package / 2 GCDs"),
    "Intel(R) Data Center GPU Max 1550 (one stack)": (
        1638.4, "Intel Data Center GPU Max Series product brief: 3.2768 TB/s per card / 2 stacks"),
}


def _system(name: str, title: str, device: str, devices_per_node: int, memory_gib: int, intra_gbs: float,
            inter_gbs: float, host_gib: int | None, cpu: tuple[str, str], sources: dict[str, str],
            note: str = "", library: str = "NCCL", scheduler: SchedulerFacts | None = None) -> System:
    """A System whose peaks come from the datasheet table and whose latencies come from NCCL's model (a
    stand-in, and labelled one, where the machine's collective library is not NCCL)."""
    peaks, peak_source = _peak_flops(device)
    stand_in = "" if library == "NCCL" else (f"stand-in ({library} publishes no cost model and no "
                                             "small-message figure was found): ")
    intra_s, intra_source = _intra_latency(devices_per_node, stand_in)
    inter_s, inter_source = _inter_latency(devices_per_node, cpu, stand_in)
    hbm, hbm_source = HBM_GBS[device]
    sources = {"peak_flops": peak_source, "intra_node_latency_s": intra_source,
               "inter_node_latency_s": inter_source, "memory_gbs": hbm_source, **sources}
    return System(name, title, device, devices_per_node, memory_gib * GiB, peaks, intra_gbs, inter_gbs,
                  intra_s, inter_s, None if host_gib is None else host_gib * GiB, sources, note, hbm, scheduler)


# ------------------------------------------------------------------------------------- batch systems
ALCF_POLARIS_JOBS = "ALCF, Running Jobs on Polaris, https://docs.alcf.anl.gov/polaris/running-jobs/"
ALCF_AURORA_JOBS = "ALCF, Running Jobs on Aurora, https://docs.alcf.anl.gov/aurora/running-jobs-aurora/"
NERSC_QOS = "NERSC, Queue Policies, https://docs.nersc.gov/jobs/policy/"
OLCF_FRONTIER_JOBS = ("OLCF, Frontier User Guide, Running Jobs (Slurm partitions), "
                      "https://docs.olcf.ornl.gov/systems/frontier_user_guide.html")

# CPUs per node as the schedulers count them, hardware threads: Polaris 32 cores x 2, Aurora 2 x 52 x 2, Perlmutter
# 64 x 2 (ALCF_POLARIS, ALCF_AURORA, NERSC_ARCH); Frontier's SLURM hands out 56 of its 64 cores (low-noise mode keeps
# 8 for the system: OLCF's examples give each of 8 tasks -c 7, OLCF_FRONTIER). ALCF's PBS refuses a job that does
# not name the filesystems it reads (-l filesystems=...).
POLARIS_JOBS = SchedulerFacts("pbs", 560, 64, ("debug", "debug-scaling", "prod", "preemptable", "demand"), "prod",
                              f"{ALCF_POLARIS_JOBS}; 560 nodes: {ALCF_POLARIS}", filesystems=("home", "eagle"))
AURORA_JOBS = SchedulerFacts("pbs", 10624, 208, ("debug", "debug-scaling", "prod"), "prod",
                             f"{ALCF_AURORA_JOBS}; 10,624 nodes: {ALCF_AURORA}", filesystems=("home", "flare"))


def _perlmutter_jobs(nodes: int, constraint: str) -> SchedulerFacts:
    return SchedulerFacts("slurm", nodes, 128, ("regular", "debug", "shared", "preempt", "premium", "overrun"),
                          "regular", f"{NERSC_QOS}; -C {constraint}: {NERSC_NODES}", queue_option="qos",
                          constraint=constraint)


FRONTIER_JOBS = SchedulerFacts("slurm", 9408, 56, ("batch", "extended"), "batch",
                               f"{OLCF_FRONTIER_JOBS}; 9,408 nodes: {OLCF_FRONTIER}", queue_option="partition")


# -------------------------------------------------------------------------------------------- the table
# An A100 SXM4 has 12 NVLink-3 links, 600 GB/s both directions together; on a 4-GPU board every pair of
# GPUs shares 4 of them (NV4), so NCCL's rings can keep all 12 busy: 300 GB/s out of each GPU.
A100_INTRA_GBS = 300 * LINK_EFFICIENCY


def _a100_intra_source(topology: str) -> str:
    return (f"derived: 300 GB/s NVLink-3 per A100 per direction ({ALCF_POLARIS}: 'NVLink 600 GB/s', both "
            f"directions together; {topology}) x {LINK_EFFICIENCY} ({NCCL_TESTS_212}) = {A100_INTRA_GBS:g} "
            "GB/s; an older NCCL's model (2020, commit 01afd20) capped A100 busbw at 235 GB/s "
            f"({NCCL_TUNING})")


def _polaris() -> System:
    return _system(
        "polaris", "ALCF Polaris (HPE Apollo 6500 Gen10+)", "NVIDIA A100-SXM4-40GB", 4, 40, A100_INTRA_GBS,
        2 * NIC_GBS / 4, 512, ("AMD", f"one AMD EPYC 7543P per node, {ALCF_POLARIS}"),
        {"device": f"{ALCF_POLARIS}: four NVIDIA A100 (HGX board, NVLink) per node",
         "devices_per_node": f"{ALCF_POLARIS}: 4 NVIDIA A100 per node",
         "device_memory_bytes": f"{ALCF_POLARIS}: 40 GiB HBM2 per A100",
         "intra_node_gbs": _a100_intra_source("NV4 between every GPU pair, same page"),
         "inter_node_gbs": f"derived: 2 Slingshot-11 NICs x 25 GB/s / 4 GPUs = 12.5 GB/s ({ALCF_POLARIS}: "
                           f"'a pair of Slingshot 11 network adapters'; {SLINGSHOT_NIC})",
         "host_memory_bytes": f"{ALCF_POLARIS}: 512 GiB DDR4 per node"},
        note="intra_node_gbs is derived, not measured: `meshtrain machine --ranks 4` on a node measures it.",
        scheduler=POLARIS_JOBS)


def _perlmutter(name: str, memory_gb: int, nodes: int, constraint: str) -> System:
    return _system(
        name, f"NERSC Perlmutter GPU nodes, A100 {memory_gb}GB (HPE Cray EX)",
        f"NVIDIA A100-SXM4-{memory_gb}GB", 4, memory_gb, A100_INTRA_GBS, 4 * NIC_GBS / 4, 256,
        ("AMD", f"one AMD EPYC 7763 per GPU node, {NERSC_ARCH}"),
        {"device": f"{NERSC_ARCH}: {nodes} GPU nodes with 4x NVIDIA A100 ({memory_gb}GB)",
         "devices_per_node": f"{NERSC_ARCH}: 4x NVIDIA A100 per GPU node",
         "device_memory_bytes": f"{NERSC_ARCH}: NVIDIA A100 ({memory_gb}GB), taken as {memory_gb} GiB",
         "intra_node_gbs": _a100_intra_source(f"each GPU is connected to each other GPU, {NERSC_NODES}"),
         "inter_node_gbs": f"derived: 4 Slingshot-11 NICs x 25 GB/s / 4 GPUs = 25 GB/s ({NERSC_ARCH}: "
                           f"'Each GPU-accelerated compute node is connected to 4 NICs'; {SLINGSHOT_NIC})",
         "host_memory_bytes": f"{NERSC_NODES}: GPU nodes, 'Memory per Node: 256 GB', taken as 256 GiB"},
        note="Perlmutter has 1536 GPU nodes with A100 40GB (`perlmutter`) and 256 with A100 80GB "
             "(`perlmutter-80`): plan for the kind the job is queued on. intra_node_gbs is derived, not "
             "measured.",
        scheduler=_perlmutter_jobs(nodes, constraint))


def _aurora() -> System:
    return _system(
        "aurora", "ALCF Aurora (HPE Cray EX, Intel Max Series)",
        "Intel(R) Data Center GPU Max 1550 (one stack)", 12, 64, 15.0, 8 * NIC_GBS / 12, 1024,
        ("Intel", f"two Intel Xeon CPU Max 9470C per node, {ALCF_AURORA}"),
        {"device": f"{ALCF_AURORA}: 6 Intel Data Center GPU Max 1550 per node, 2 stacks each; torch sees "
                   "one stack per device in FLAT mode",
         "devices_per_node": f"derived: 6 GPUs x 2 stacks = 12 torch devices in FLAT mode ({ALCF_AURORA})",
         "device_memory_bytes": f"derived: 768 GiB HBM2e per node / 12 stacks = 64 GiB ({ALCF_AURORA}); "
                                "128 GB per Max 1550 card",
         "intra_node_gbs": "measured: a 12-stack ring crosses between GPUs over Xe Link, where ALCF "
                           "measured 15 GB/s GPU-to-GPU unidirectional from one tile (196 GB/s between the "
                           "two tiles of one GPU); that hop bounds all-reduce busbw at 15 GB/s "
                           f"({ALCF_AURORA_PEAK})",
         "inter_node_gbs": f"derived: 8 Slingshot-11 NICs x 25 GB/s / 12 stacks = 16.7 GB/s ({ALCF_AURORA}: "
                           f"'Each node has 8 HPE Slingshot-11 NICs'; {SLINGSHOT_NIC})",
         "host_memory_bytes": f"{ALCF_AURORA}: DDR5 512x2 GiB per node (the CPUs' 2 x 64 GiB HBM not "
                              "counted)"},
        note="Figures per stack (FLAT mode, 12 devices); in COMPOSITE mode torch sees 6 cards with twice the "
             "memory and FLOP/s each. ALCF measured the Xe Link figure on pre-production hardware; latencies "
             "are NCCL's model standing in for oneCCL's.",
        library="oneCCL", scheduler=AURORA_JOBS)


def _frontier() -> System:
    return _system(
        "frontier", "OLCF Frontier (HPE Cray EX235a)", "AMD Instinct MI250X (one GCD)", 8, 64,
        100 * LINK_EFFICIENCY, 4 * NIC_GBS / 8, 512,
        ("AMD", f"one 64-core AMD 'Optimized 3rd Gen EPYC' per node, {OLCF_FRONTIER}"),
        {"device": f"{OLCF_FRONTIER}: 4 AMD MI250X per node, 2 GCDs each, which show as 8 separate GPUs",
         "devices_per_node": f"{OLCF_FRONTIER}: 8 GCDs per node",
         "device_memory_bytes": f"{OLCF_FRONTIER}: 64 GB HBM2E per GCD (128 GB per MI250X), taken as 64 GiB",
         "intra_node_gbs": "derived: an 8-GCD ring must cross between MI250X packages, where GCDs share "
                           f"one or two Infinity Fabric links, 50-100 GB/s ({OLCF_FRONTIER}; 50 GB/s per "
                           f"link per direction, {AMD_MI250}); 100 GB/s x {LINK_EFFICIENCY} "
                           f"({NCCL_TESTS_212}) = 80 GB/s",
         "inter_node_gbs": f"derived: 4 Slingshot-11 NICs (one per MI250X) x 25 GB/s / 8 GCDs = 12.5 GB/s "
                           f"({OLCF_FRONTIER}; {SLINGSHOT_NIC})",
         "host_memory_bytes": f"{OLCF_FRONTIER}: 512 GB of DDR4 per node, taken as 512 GiB"},
        note="Figures per GCD. intra_node_gbs assumes rings whose cross-package hops have two links; a "
             "ring through single-link pairs gets half (40 GB/s). Latencies are NCCL's model standing in "
             "for RCCL's.",
        library="RCCL", scheduler=FRONTIER_JOBS)


def _dgx_h100() -> System:
    return _system(
        "dgx-h100", "NVIDIA DGX H100", "NVIDIA H100 80GB HBM3", 8, 80, 370.0, 8 * 50.0 / 8, 2048,
        ("Intel", f"two Intel Xeon Platinum 8480C, {DGX_SHEET}"),
        {"device": f"{DGX_SHEET}: 8x NVIDIA H100 SXM Tensor Core GPUs",
         "devices_per_node": f"{DGX_SHEET}: 8 GPUs per system",
         "device_memory_bytes": f"{DGX_SHEET}: 640 GB GPU memory / 8 = 80 GB per H100, taken as 80 GiB",
         "intra_node_gbs": "published: NCCL ring all-reduce busbw 370 GB/s on 8 H100 SXM, whose NVLink-4 "
                           "line rate is 450 GB/s per direction (900 GB/s both); NVLink SHARP reaches "
                           f"~480 GB/s busbw, which is not wire bandwidth ({NCCL_TESTS_212})",
         "inter_node_gbs": f"derived: 8 ConnectX-7 x 400 Gb/s = 8 x 50 GB/s / 8 GPUs = 50 GB/s ({DGX_GUIDE}: "
                           f"eight ConnectX-7 devices, one per GPU; 400 Gb/s per port: {DGX_SHEET})",
         "host_memory_bytes": f"{DGX_SHEET}: 2TB system memory, taken as 2048 GiB"},
        note="One DGX H100 as a node: inter_node_gbs assumes all eight ConnectX-7 ports carry the job's "
             "traffic; a site that cables fewer gets less.")


SYSTEMS: Mapping[str, System] = MappingProxyType({s.name: s for s in [
    _polaris(), _perlmutter("perlmutter", 40, 1536, "gpu"), _perlmutter("perlmutter-80", 80, 256, "gpu&hbm80g"), _aurora(),
    _frontier(), _dgx_h100()]})


# ------------------------------------------------------------------------------------------------ lookup
def names() -> list[str]:
    """The systems this table knows, in table order."""
    return list(SYSTEMS)


def get(name: str) -> System:
    """The table's System for `name`, case-insensitively."""
    key = name.strip().lower()
    if key in SYSTEMS:
        return SYSTEMS[key]
    raise PlanError(f"unknown system {name!r}: the known systems are {', '.join(names())}; use `this` "
                    "for the machine you are on (its measured profile), or give its figures with "
                    "--device-memory, --intra-node-bw and --inter-node-bw")


def _positive(value: float, flag: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (0 < value < math.inf):
        raise PlanError(f"{flag} must be a positive number, got {value!r}")
    return value


def custom(base: System, *, device_memory_gib: float | None = None, intra_node_gbs: float | None = None,
           inter_node_gbs: float | None = None, devices_per_node: int | None = None) -> System:
    """A copy of `base` with the given figures in place of its own, their sources marked as given on the
    command line. Nothing else is rescaled: a new devices_per_node leaves inter_node_gbs (a per-device
    share) as it was unless that is given too."""
    changes: dict[str, float | int] = {}
    if device_memory_gib is not None:
        changes["device_memory_bytes"] = round(_positive(device_memory_gib, "--device-memory") * GiB)
    if intra_node_gbs is not None:
        changes["intra_node_gbs"] = float(_positive(intra_node_gbs, "--intra-node-bw"))
    if inter_node_gbs is not None:
        changes["inter_node_gbs"] = float(_positive(inter_node_gbs, "--inter-node-bw"))
    if devices_per_node is not None:
        whole = isinstance(devices_per_node, int) and not isinstance(devices_per_node, bool)
        if not whole or devices_per_node < 1:
            raise PlanError(f"devices per node must be a whole number >= 1, got {devices_per_node!r}")
        changes["devices_per_node"] = devices_per_node
    sources = {**base.sources, **{figure: "given on the command line" for figure in changes}}
    return dataclasses.replace(base, **changes, sources=sources)
