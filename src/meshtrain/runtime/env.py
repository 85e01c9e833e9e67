"""Who am I? Rank, sizes, hosts and rendezvous from the launcher's and the scheduler's environment.

Everything here is a pure function of an environment mapping (and, for PBS, the hostfile it names),
so it is tested table-driven without starting a process. Nothing here imports torch.

Launcher variables win over scheduler variables: inside a SLURM allocation `mpiexec` sets
OMPI_COMM_WORLD_RANK while SLURM_PROCID stays 0 for every rank, so SLURM_PROCID is only believed
when no launcher of its own spoke.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from meshtrain.errors import MeshtrainError

DEFAULT_PORT = 29500


class LaunchEnvError(MeshtrainError, RuntimeError):
    """The environment describes a distributed job that cannot be made sense of."""


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as the launcher and scheduler describe it."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    num_nodes: int = 1
    launcher: str = "none"  # torchrun | openmpi | mpich | pmix | pals | srun | none
    scheduler: str = "none"  # slurm | pbs | none
    job_id: str | None = None
    hosts: tuple[str, ...] = field(default_factory=tuple)  # the job's nodes, in order, when known
    master_addr: str | None = None  # set only when the environment names it
    master_port: int | None = None

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


# Rank variables in the order they are believed; each launcher's own size/local variables go with it.
_LAUNCHERS = (
    # name,      rank,                   world size,             local rank,                    local size
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("pals", "PALS_RANKID", "PMI_SIZE", "PALS_LOCAL_RANKID", "PALS_LOCAL_SIZE"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("pmix", "PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
    ("srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE"),
)
# Where a launcher leaves a size unset, these (from MPI layers underneath or the scheduler) fill in.
_WORLD_FALLBACKS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
_LOCAL_RANK_FALLBACKS = ("MPI_LOCALRANKID", "PMI_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
_LOCAL_SIZE_FALLBACKS = ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "PALS_LOCAL_SIZE")


def detect(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read rank, sizes, hosts and rendezvous hints from `environ` (default: os.environ)."""
    env = os.environ if environ is None else environ
    scheduler, job_id, hosts = scheduler_info(env)
    launcher = _launcher(env)
    if launcher == "none":
        return LaunchEnv(scheduler=scheduler, job_id=job_id, hosts=hosts[:1],
                         master_addr=env.get("MASTER_ADDR"), master_port=_port(env))

    _, rank_var, size_var, local_var, local_size_var = next(x for x in _LAUNCHERS if x[0] == launcher)
    rank = _int(env, rank_var)
    world = _first_int(env, (size_var, *_WORLD_FALLBACKS))
    if world is None:
        raise LaunchEnvError(
            f"{launcher} set {rank_var}={env[rank_var]} but no world size was found in any of "
            f"{', '.join((size_var, *_WORLD_FALLBACKS))}. Launch with torchrun, mpiexec or srun, or export WORLD_SIZE."
        )
    local_rank = _first_int(env, (local_var, *_LOCAL_RANK_FALLBACKS))
    local_size = _first_int(env, (local_size_var, *_LOCAL_SIZE_FALLBACKS))
    num_nodes = _first_int(env, ("SLURM_STEP_NUM_NODES", "SLURM_NNODES")) if launcher == "srun" else None
    if num_nodes is None:
        num_nodes = len(hosts) if hosts and scheduler != "none" else None
    if local_size is None:
        local_size = world // num_nodes if num_nodes else world
    if num_nodes is None:
        num_nodes = max(1, -(-world // local_size))
    if local_rank is None:
        # Block placement (ranks 0..p-1 on the first node) is every launcher's default.
        local_rank = rank % local_size
    if not 0 <= rank < world:
        raise LaunchEnvError(f"{rank_var}={rank} is outside the world of {world} ranks ({size_var}).")
    return LaunchEnv(
        rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_size,
        num_nodes=num_nodes, launcher=launcher, scheduler=scheduler, job_id=job_id, hosts=hosts,
        master_addr=env.get("MASTER_ADDR"), master_port=_port(env),
    )


def _launcher(env: Mapping[str, str]) -> str:
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torchrun"
    for name, rank_var, *_ in _LAUNCHERS[1:-1]:
        if rank_var in env:
            return name
    # SLURM_PROCID is 0 in a batch script too; only a job step (srun) sets SLURM_STEP_ID.
    if "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        return "srun"
    return "none"


def output_goes_to_a_log(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs under an MPI launcher, srun or a PBS/SLURM job, whose output goes to a log file
    even where stdout is a terminal (Open MPI gives each rank a pseudo-terminal): no progress bars, no colours."""
    env = os.environ if environ is None else environ
    return _launcher(env) not in ("none", "torchrun") or any(name in env for name in ("SLURM_JOB_ID", "SLURM_JOBID",
                                                                                     "PBS_JOBID"))


def scheduler_info(env: Mapping[str, str]) -> tuple[str, str | None, tuple[str, ...]]:
    """(scheduler, job id, the job's hosts) for SLURM, PBS or none."""
    if "SLURM_JOB_ID" in env or "SLURM_JOBID" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        hosts = tuple(expand_nodelist(nodelist)) if nodelist else ()
        return "slurm", env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"), hosts
    if "PBS_JOBID" in env:
        nodefile = env.get("PBS_NODEFILE")
        hosts = tuple(read_hostfile(nodefile)) if nodefile else ()
        return "pbs", env["PBS_JOBID"], hosts
    return "none", None, ()


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise LaunchEnvError(f"environment variable {name}={value!r} is not an integer") from None


def _first_int(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        if env.get(name, "") != "":
            if name.endswith("TASKS_PER_NODE"):  # SLURM writes "4(x2)" or "4,4"
                return int(re.match(r"\d+", env[name]).group())
            return _int(env, name)
    return None


def _port(env: Mapping[str, str]) -> int | None:
    return _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else None


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list: 'nid[001-003,007],login1' -> nid001 nid002 nid003 nid007 login1.

    Several bracket groups in one name expand as a product ('r[1-2]n[1-2]' -> r1n1 r1n2 r2n1 r2n2),
    and zero padding is kept.
    """
    names, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            if nodelist[start:i].strip():
                names.extend(_expand_name(nodelist[start:i].strip()))
            start = i + 1
    if depth != 0:
        raise LaunchEnvError(f"unbalanced brackets in SLURM node list {nodelist!r}")
    return names


def _expand_name(name: str) -> list[str]:
    parts = re.split(r"(\[[^\]]*\])", name)
    choices = [_expand_range(p[1:-1]) if p.startswith("[") else [p] for p in parts]
    return ["".join(combo) for combo in itertools.product(*choices)]


def _expand_range(spec: str) -> list[str]:
    out = []
    for item in spec.split(","):
        lo, _, hi = item.partition("-")
        if not hi:
            out.append(lo)
            continue
        if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
            raise LaunchEnvError(f"bad range {item!r} in SLURM node list")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def read_hostfile(path: str | os.PathLike) -> list[str]:
    """Unique hosts of a PBS/MPI hostfile in order of first appearance (PBS repeats a host per slot)."""
    return list(hostfile_slots(path))


def hostfile_slots(path: str | os.PathLike) -> dict[str, int]:
    """Each host of a PBS/MPI hostfile, in order of first appearance, with its slots: the lines naming it (PBS
    writes one per MPI rank a chunk asked for with mpiprocs)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise LaunchEnvError(f"cannot read the hostfile {path} (PBS_NODEFILE): {e.strerror}") from None
    slots: dict[str, int] = {}
    for line in text.splitlines():
        host = line.split("#", 1)[0].split()
        if host:
            slots[host[0]] = slots.get(host[0], 0) + 1
    return slots


def derived_port(job_id: str) -> int:
    """A port every rank of one job computes alike, spread over 20000-29999 so jobs sharing a node differ."""
    digest = hashlib.sha256(job_id.encode()).digest()
    return 20000 + int.from_bytes(digest[:4], "big") % 10000


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job_key(env: Mapping[str, str], launch: LaunchEnv) -> str | None:
    """An identifier shared by every rank of this launch: the scheduler's job id, else the MPI job's."""
    if launch.job_id:
        step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or ""
        return f"{launch.job_id}.{step}"
    for name in ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PMI_KVSNAME", "PALS_APID"):
        if env.get(name):
            return env[name]
    return None


def rendezvous(launch: LaunchEnv, environ: Mapping[str, str] | None = None) -> tuple[str, int, str] | None:
    """(MASTER_ADDR, MASTER_PORT, where they came from) that every rank computes alike without talking.

    The environment wins; otherwise the job's first host (loopback on one node) and a port derived
    from the job id. None when nothing shared is known (several ranks, no job id, or several nodes
    with no host list): then the ranks must talk, over MPI when they can (see setup.py).
    """
    env = os.environ if environ is None else environ
    if launch.master_addr and launch.master_port:
        return launch.master_addr, launch.master_port, "MASTER_ADDR/MASTER_PORT"
    if not launch.is_distributed:
        return launch.master_addr or "127.0.0.1", launch.master_port or free_port(), "single process"
    if launch.master_addr:
        addr, addr_from = launch.master_addr, "MASTER_ADDR"
    elif launch.num_nodes == 1:
        addr, addr_from = "127.0.0.1", "one node"
    elif launch.hosts:
        addr, addr_from = launch.hosts[0], f"first host of the {launch.scheduler} job"
    else:
        return None
    if launch.master_port:
        return addr, launch.master_port, f"{addr_from}, MASTER_PORT"
    key = _job_key(env, launch)
    if key is None:
        return None
    return addr, derived_port(key), f"{addr_from}, port derived from job {key}"
