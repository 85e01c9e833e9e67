"""`meshtrain doctor`'s checks of this host and this job: each a function returning a Check, whose status is ok,
warning or error and whose fix says what to do. The network's checks are in runtime/network.py; the shipped data's
and the machine profile's beside what they check (data/text.py, machine/profile.py); commands/doctor.py runs them all.

Every check takes what it reads (environment, limits, free bytes) as arguments with the live values as defaults, so
that each is tested by handing it a broken value rather than by breaking the machine.
"""

from __future__ import annotations

import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from meshtrain.runtime.device import device_count
from meshtrain.runtime.env import LaunchEnv, LaunchEnvError, detect, scheduler_info
from meshtrain.runtime.launch import Machine, build_command, mpi_flavor

OK, WARNING, ERROR = "ok", "warning", "error"
GiB = 2**30
# Docker's default /dev/shm is 64 MiB: NCCL's shared-memory transport and DataLoader workers fail in it.
SHM_MIN_BYTES = 1 * GiB
# gloo opens a socket to every peer, NCCL a few per peer and channel, each loader worker its files: 1024, a common
# default soft limit, runs out at a few hundred ranks.
OPEN_FILES_MIN = 4096
CHECKPOINT_MIN_FREE_BYTES = 10 * GiB
PROBE_S = 20.0  # the longest mpi4py's import may take (an MPI library on a slow shared file system loads slowly)


@dataclass(frozen=True)
class Check:
    """One row of the doctor's table."""

    name: str
    status: str  # ok | warning | error
    found: str
    fix: str = ""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def any_error(checks: list[Check]) -> bool:
    return any(check.status == ERROR for check in checks)


def python_check(path_python: str | None = None) -> Check:
    """This interpreter, and whether a bare `python` on PATH (what job scripts and launchers on other nodes run)
    is the same one."""
    version = ".".join(map(str, sys.version_info[:3]))
    found = f"{version} ({sys.executable})"
    on_path = shutil.which("python") if path_python is None else path_python
    if on_path and Path(on_path).parent != Path(sys.executable).parent:
        return Check("python", WARNING, f"{found}; but `python` on PATH is {on_path}",
                     "activate meshtrain's environment in the job script, or start ranks with `meshtrain launch`, "
                     "which runs this interpreter")
    return Check("python", OK, found)


def torch_check(nvidia_driver: bool | None = None) -> Check:
    """torch's version and build (CUDA, ROCm, XPU or CPU-only), against the GPUs this host has."""
    if nvidia_driver is None:
        nvidia_driver = Path("/proc/driver/nvidia/version").exists()
    cuda, hip, xpu = torch.version.cuda, getattr(torch.version, "hip", None), getattr(torch.version, "xpu", None)
    build = (f"CUDA {cuda}" if cuda else f"ROCm {hip}" if hip else f"XPU {xpu}" if xpu else "CPU-only") + " build"
    found = f"torch {torch.__version__}, {build}"
    if nvidia_driver and not (cuda or hip):
        return Check("torch", ERROR, f"{found}, on a host with an NVIDIA driver",
                     "install a CUDA build of torch (pip install torch --index-url "
                     "https://download.pytorch.org/whl/cuXXX)")
    if cuda and nvidia_driver and not torch.cuda.is_available():
        return Check("torch", ERROR, f"{found}, but torch.cuda.is_available() is False",
                     "the driver is older than this build's CUDA: load a newer driver module or install an older build")
    return Check("torch", OK, found)


def _gpus_asked(environ: Mapping[str, str]) -> int | None:
    """GPUs per node as a SLURM job asked for them (`--gpus-per-node 4` or `a100:4`); PBS does not export it."""
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        count = re.search(r"(\d+)$", environ.get(name, ""))
        if count:
            return int(count.group(1))
    return None


def devices_check(gpus_per_node: int | None, launch: LaunchEnv | None, environ: Mapping[str, str],
                  counts: Mapping[str, int] | None = None) -> Check:
    """The accelerators torch sees here against those the job asked for per node and the ranks that share them."""
    live = counts is None
    counts = {kind: device_count(kind) for kind in ("cuda", "xpu")} if live else counts
    kind, count = max(counts.items(), key=lambda item: item[1])
    asked = gpus_per_node if gpus_per_node is not None else _gpus_asked(environ)
    visible = environ.get("CUDA_VISIBLE_DEVICES") or environ.get("ZE_AFFINITY_MASK")
    found = f"{count} {kind} device{'s' * (count != 1)}" if count else "no GPU: ranks run on the CPU"
    found += f" ({getattr(torch, kind).get_device_name(0)})" if live and count else ""
    found += f" (visible: {visible})" if visible else ""
    if asked and count < asked:
        return Check("devices", ERROR, f"{found}; the job asks for {asked} per node",
                     "run on a node with the GPUs (a compute node, not the login node), or ask for fewer "
                     "(--gpus-per-node); CUDA_VISIBLE_DEVICES / ZE_AFFINITY_MASK may hide some")
    ranks_here = launch.local_world_size if launch else 1
    if count and ranks_here > count:
        return Check("devices", WARNING, f"{found}; {ranks_here} ranks on this node share them",
                     "start one rank per GPU: `meshtrain launch` does")
    return Check("devices", OK, found + (f"; the job asks for {asked} per node" if asked else ""))


def job_nodes(launch: LaunchEnv, environ: Mapping[str, str]) -> int:
    """The nodes of the whole job: its scheduler's host list (detect() keeps one host for a lone process), SLURM's
    count where the list is missing, or the launcher's."""
    return max(len(scheduler_info(environ)[2]), int(environ.get("SLURM_NNODES") or 0), launch.num_nodes, 1)


def launcher_check(environ: Mapping[str, str], nodes: int | None = None, machine: Machine | None = None,
                   flavor: str = "auto") -> Check:
    """The launcher and scheduler env.py finds, this rank's place, and the command `meshtrain launch` would run."""
    try:
        launch = detect(environ)
        nodes_held = job_nodes(launch, environ)
        argv = build_command(["python", "-m", "meshtrain"], environ=environ, machine=machine, flavor=flavor)
    except LaunchEnvError as e:
        return Check("launcher", ERROR, str(e), "fix the launcher's variables, or start the job with "
                                                "`meshtrain launch`")
    if launch.scheduler == "none":
        found = "no scheduler (a login node or a workstation)"
    else:
        found = f"{launch.scheduler} job {launch.job_id} on {nodes_held} node{'s' * (nodes_held != 1)}"
    if launch.launcher == "none":  # a job script or a login shell: what the launch would start
        found += f"; one process; `meshtrain launch` would run: {_shown(argv)} ..."
    else:
        found += (f"; launched by {launch.launcher}: rank {launch.rank} of {launch.world_size}, local rank "
                  f"{launch.local_rank} of {launch.local_world_size}, {launch.num_nodes} node(s)")
    if nodes and launch.scheduler != "none" and nodes_held < nodes:
        return Check("launcher", ERROR, f"{found}; --nodes {nodes} asked for, the job has {nodes_held}",
                     f"ask the scheduler for {nodes} nodes (SLURM --nodes, PBS select=) or lower --nodes")
    return Check("launcher", OK, found + (f"; --nodes {nodes}: the scheduler's to give" if nodes and
                                          launch.scheduler == "none" else ""))


def _shown(argv: list[str]) -> str:
    """A launcher's command as a person would type it: `python` for the long path of this interpreter."""
    return shlex.join("python" if word == sys.executable else word for word in argv)


def shm_check(path: str = "/dev/shm", min_bytes: int = SHM_MIN_BYTES) -> Check:
    """The size of shared memory, which NCCL's intra-node transport and DataLoader workers fill."""
    try:
        stat = os.statvfs(path)
    except OSError:
        return Check("/dev/shm", OK, f"no {path} here (not Linux): nothing uses it")
    size = stat.f_blocks * stat.f_frsize
    found = f"{path}: {size / GiB:.1f} GiB, {stat.f_bavail * stat.f_frsize / GiB:.1f} GiB free"
    if size < min_bytes:
        return Check("/dev/shm", WARNING, f"{found}, under {min_bytes / GiB:.0f} GiB",
                     "in a container: docker run --shm-size=16g (or --ipc=host); elsewhere ask for a larger tmpfs")
    return Check("/dev/shm", OK, found)


def open_files_check(limits: tuple[int, int] | None = None, minimum: int = OPEN_FILES_MIN) -> Check:
    """The soft and hard RLIMIT_NOFILE of this process, which its ranks inherit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE) if limits is None else limits
    spell = lambda n: "unlimited" if n == resource.RLIM_INFINITY else str(n)  # noqa: E731
    found = f"soft {spell(soft)}, hard {spell(hard)}"
    if soft != resource.RLIM_INFINITY and soft < minimum:
        if hard == resource.RLIM_INFINITY or hard >= minimum:
            fix = f"ulimit -n {minimum if hard == resource.RLIM_INFINITY else hard} in the job script"
        else:
            fix = f"the hard limit is {hard} as well: ask the admins to raise it"
        return Check("open files", WARNING, f"{found}: under {minimum}, too few for many ranks' sockets", fix)
    return Check("open files", OK, found)


def disk_check(directory: str | os.PathLike, min_free_bytes: int = CHECKPOINT_MIN_FREE_BYTES,
               free_bytes: int | None = None) -> Check:
    """Free space and write access where checkpoints go (its nearest existing parent, if not made yet)."""
    directory = Path(directory)
    existing = directory.absolute()
    while not existing.exists():
        existing = existing.parent
    if not os.access(existing, os.W_OK):
        return Check("checkpoint disk", ERROR, f"{directory}: {existing} cannot be written",
                     "point train.out_dir at a directory you can write (a scratch file system)")
    free = shutil.disk_usage(existing).free if free_bytes is None else free_bytes
    found = f"{directory}: {free / GiB:.1f} GiB free"
    if free < min_free_bytes:
        return Check("checkpoint disk", WARNING, f"{found}, under {min_free_bytes / GiB:.0f} GiB",
                     "free space, lower train.keep_checkpoints, or point train.out_dir at a scratch file system")
    return Check("checkpoint disk", OK, found)


def _mpi_family(version_text: str) -> str | None:
    """openmpi or mpich (MPICH, Intel MPI, Cray MPICH: one ABI family) from a library's or mpiexec's own words."""
    text = version_text.lower()
    if "open mpi" in text or "openrte" in text:
        return "openmpi"
    if any(word in text for word in ("mpich", "intel", "cray", "hydra")):
        return "mpich"
    return None


def mpi_library() -> str | None:
    """The version line of the MPI library mpi4py was built against; None without mpi4py. Asked in a child process:
    a broken MPI library can crash its loader, and loading it here would tie this process to it."""
    probe = ("import mpi4py\nmpi4py.rc.initialize = False\nfrom mpi4py import MPI\n"
             "print(MPI.Get_library_version().splitlines()[0])")
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=PROBE_S)
    except subprocess.TimeoutExpired:
        return f"unloadable: its import took more than {PROBE_S:.0f} s"
    if "No module named 'mpi4py'" in out.stderr:
        return None
    if out.returncode != 0:
        return "unloadable: " + (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
    return out.stdout.strip()


def mpi_loads(library: str | None) -> bool:
    """Whether mpi4py, as mpi_library found it, can carry the ranks' rendezvous (setup.py's fallback)."""
    return library is not None and not library.startswith("unloadable")


def mpi_check(library: str | None, mpiexec: str | None, mpiexec_flavor: str | None = None) -> Check:
    """mpi4py (optional) against the `mpiexec` on PATH: a library of one family under the other's launcher sees
    every rank as rank 0 of its own world."""
    if library is None:
        return Check("mpi4py", OK, "not installed (optional: it lets MPI-launched ranks agree on a rendezvous "
                                   "without MASTER_ADDR)")
    if library.startswith("unloadable"):
        return Check("mpi4py", ERROR, f"installed, but its MPI library fails to load: {library}",
                     "load the MPI module mpi4py was built with, or reinstall it: pip install --no-binary mpi4py mpi4py")
    if mpiexec is None:
        return Check("mpi4py", WARNING, f"built against {library}; no mpiexec on PATH",
                     "load the MPI module that provides mpiexec")
    flavor = mpiexec_flavor or mpi_flavor(mpiexec)
    family = "openmpi" if flavor == "openmpi" else "mpich"  # PALS launches Cray MPICH
    found = f"built against {library.split(',')[0]}; {mpiexec} is {flavor}"
    if _mpi_family(library) not in (None, family):
        return Check("mpi4py", WARNING, found + ": different MPI families",
                     f"put the MPI mpi4py was built with first on PATH, or rebuild it against this one: "
                     f"MPICC=$(dirname {mpiexec})/mpicc pip install --no-binary mpi4py --force-reinstall mpi4py")
    return Check("mpi4py", OK, found)
