"""Start and stop the process group: DistInfo, init with a timeout, clear failures, clean teardown.

    with distributed() as info:          # or: info = setup(); ...; cleanup()
        with collective("all_reduce of the loss"):
            dist.all_reduce(loss)

A collective waiting on a rank that died or stopped calling collectives fails after `timeout`
(gloo and NCCL both honour it) and `collective()` turns the backend's terse message into one that
names the operation and says what probably happened; the CLI then exits non-zero.
"""

from __future__ import annotations

import datetime
import gc
import os
import shlex
import socket
import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from meshtrain.errors import MeshtrainError
from meshtrain.runtime import env as launch_env
from meshtrain.runtime import heartbeat
from meshtrain.runtime.device import pick_backend, pick_device, threads_per_rank
from meshtrain.runtime.log import configure_logging, get_logger, print_rich

DEFAULT_TIMEOUT_S = 600.0
log = get_logger("dist")


class CollectiveError(MeshtrainError, RuntimeError):
    """A collective (or the rendezvous) could not complete: a peer died, hung, or never arrived."""


@dataclass(frozen=True)
class DistInfo:
    """Who this process is in the job and what it runs on, as `setup` found it: ranks from whichever launcher
    started it (torchrun, mpiexec, srun, PBS), the device and backend it picked, where the ranks met and the
    process-group timeout. `table()` is the set-up table rank 0 prints."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    num_nodes: int
    launcher: str
    scheduler: str
    job_id: str | None
    hostname: str
    hosts: tuple[str, ...]
    master_addr: str
    master_port: int
    rendezvous: str
    device: str
    backend: str
    timeout_s: float
    torch_version: str
    threads_per_rank: int
    command: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def table(self):
        from rich.table import Table

        table = Table(title="meshtrain distributed set-up", show_header=False, title_justify="left")
        table.add_column(style="bold cyan")
        table.add_column()
        for key, value in asdict(self).items():
            if key == "hosts":
                value = ", ".join(value) if len(value) <= 8 else f"{', '.join(value[:8])}, … ({len(value)} hosts)"
            table.add_row(key, str(value))
        return table


def default_timeout() -> float:
    raw = os.environ.get("MESHTRAIN_TIMEOUT", "")
    try:
        return float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"MESHTRAIN_TIMEOUT={raw!r} is not a number of seconds") from None


def _mpi_rendezvous(launch: launch_env.LaunchEnv) -> tuple[str, int, str] | None:
    """Rank 0's host and a free port, broadcast over MPI; None without mpi4py or an MPI launcher."""
    if launch.launcher not in ("openmpi", "mpich", "pmix", "pals"):
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    mine = (socket.gethostname(), launch_env.free_port()) if comm.Get_rank() == 0 else None
    addr, port = comm.bcast(mine, root=0)
    return addr, port, "broadcast from rank 0 over MPI (mpi4py)"


def _store_prefix() -> str:
    """Under torchrun, each restart's ranks meet in the agent's store, which still holds the previous attempt's keys
    (its ranks' gloo addresses): a restarted rank reads them and dials a dead process ("connection refused"). A
    prefix per attempt keeps the attempts apart."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return "meshtrain/" if attempt is None else f"meshtrain/attempt_{attempt}/"


def _attempt_store(addr: str, port: int, rank: int, world_size: int, timeout: float, alone: bool):
    """Under torchrun, the agent's store under this attempt's prefix. A single process with no MASTER_PORT given, an
    in-memory store: a port probed free can be taken by another process before this one binds it (seen with 8 GPU
    tests starting at once: EADDRINUSE). Otherwise None: init_process_group makes its own store (rank 0 keeps it)
    at the same address."""
    if alone:
        return dist.HashStore()
    if os.environ.get("TORCHELASTIC_RESTART_COUNT") is None:
        return None
    hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0
    store = dist.TCPStore(addr, port, world_size, is_master=hosts_store, timeout=datetime.timedelta(seconds=timeout))
    return dist.PrefixStore(_store_prefix().rstrip("/"), store)


def setup(device: str | None = None, backend: str | None = None, timeout: float | None = None) -> DistInfo:
    """Find this rank, pick its device, join the process group, and log the set-up table on rank 0."""
    # What is alive before the process group (torch's and meshtrain's modules, some 300k objects) lives as long as
    # the process: frozen, no collection walks it again, neither cleanup()'s full one nor those the steps' garbage
    # sets off. cleanup()'s took 0.19-0.24 s in a rank forked from a process that had imported torch (a collection
    # writes each object's header, so the fork's pages are copied), 2-3 ms once frozen.
    gc.freeze()
    launch = launch_env.detect()
    configure_logging(launch.rank, launch.world_size)
    timeout = default_timeout() if timeout is None else float(timeout)

    rdzv = launch_env.rendezvous(launch) or _mpi_rendezvous(launch)
    if rdzv is None:
        raise launch_env.LaunchEnvError(
            f"rank {launch.rank} of {launch.world_size} ({launch.launcher}) cannot tell where to meet the other "
            "ranks: export MASTER_ADDR (a host every rank can reach) and MASTER_PORT, or install mpi4py "
            "(pip install 'meshtrain[mpi]') so rank 0 can broadcast them"
        )
    master_addr, master_port, rdzv_source = rdzv
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master_addr, str(master_port)

    torch_device = pick_device(launch.local_rank, device)
    if torch_device.type in ("cuda", "xpu"):
        getattr(torch, torch_device.type).set_device(torch_device)  # before init: one device per rank
    backend = pick_backend(torch_device, backend)
    threads = threads_per_rank(launch.local_world_size)
    torch.set_num_threads(threads)

    kwargs = {"device_id": torch_device} if torch_device.type == "cuda" else {}
    dumps = None
    if backend == "nccl":  # where a timed-out collective's history goes; the job's id (or port) keeps jobs apart
        dumps = heartbeat.flight_recorder_env(os.path.join("outputs", "flight_recorder",
                                                           launch.job_id or f"port_{master_port}"))
    try:
        alone = rdzv_source == "single process" and launch.master_port is None  # no port asked for: bind none
        store = _attempt_store(master_addr, master_port, launch.rank, launch.world_size, timeout, alone)
        kwargs |= {"store": store} if store is not None else {}
        dist.init_process_group(
            backend=backend, rank=launch.rank, world_size=launch.world_size,
            timeout=datetime.timedelta(seconds=timeout), **kwargs,
        )
    except RuntimeError as e:
        raise CollectiveError(
            f"rank {launch.rank} could not join the other {launch.world_size - 1} rank(s) at "
            f"{master_addr}:{master_port} within {timeout:g} s ({rdzv_source}): {_first_line(e)}. "
            "Check that every rank was started, that MASTER_ADDR is reachable from every node and the port is "
            "free; under SLURM start ranks with srun (or `meshtrain launch`), not directly from the batch script."
        ) from e

    hostname = socket.gethostname()
    hosts = tuple(dict.fromkeys(gather_objects(hostname, "all_gather_object of host names at start-up", timeout)))
    info = DistInfo(
        rank=launch.rank, local_rank=launch.local_rank, world_size=launch.world_size,
        local_world_size=launch.local_world_size, num_nodes=len(hosts), launcher=launch.launcher,
        scheduler=launch.scheduler, job_id=launch.job_id, hostname=hostname, hosts=hosts,
        master_addr=master_addr, master_port=master_port, rendezvous=rdzv_source, device=str(torch_device),
        backend=backend, timeout_s=timeout, torch_version=torch.__version__, threads_per_rank=threads,
        command=_command_line(),
    )
    if info.world_size > 1:
        heartbeat.start(heartbeat.store_client(master_addr, master_port, _store_prefix(), timeout), info.rank,
                        info.world_size, hostname, timeout, dumps)
    if info.is_main:
        print_rich(info.table())
    return info


def _command_line() -> str:
    program = sys.argv[0]
    program = "python -m meshtrain" if program.endswith(os.path.join("meshtrain", "__main__.py")) else program
    return " ".join([program, shlex.join(sys.argv[1:])]).strip()


def cleanup(clean: bool = True) -> None:
    """Leave the process group. After an error, skip the barrier: a peer may be the reason for it."""
    heartbeat.stop()
    if not dist.is_initialized():
        return
    # DDP/FSDP wrappers sit in reference cycles and hold the group; left to the interpreter's final
    # collection, the group dies during shutdown and its threads abort the process (seen under mpirun).
    gc.collect()
    if clean:
        with collective("barrier before destroy_process_group"):
            dist.barrier()
    dist.destroy_process_group()


@contextmanager
def distributed(device: str | None = None, backend: str | None = None, timeout: float | None = None):
    """setup() ... cleanup(); on an exception the group is torn down without waiting for the others."""
    info = setup(device=device, backend=backend, timeout=timeout)
    try:
        yield info
    except BaseException:
        cleanup(clean=False)
        raise
    cleanup(clean=True)


def cpu_group():
    """A gloo group of every rank (the default group when that is gloo): small flags reduced on it never wait for a
    GPU's queue to drain. Creating one is a collective. None in a one-process job."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def reduce_scalar(value: float | torch.Tensor, op: str, what: str, timeout: float | None = None,
                  device: torch.device | str = "cpu", group=None) -> float:
    """`value` combined over every rank (of `group`, if given): op is "sum", "mean", "max" or "min"; one process
    gives it back."""
    t = value.detach().double().clone() if torch.is_tensor(value) else torch.tensor(float(value), dtype=torch.float64,
                                                                                      device=device)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return t.item()
    reduce_op = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                 "min": dist.ReduceOp.MIN}[op]
    with collective(what, timeout):
        dist.all_reduce(t, op=reduce_op, group=group)
    return t.item() / (dist.get_world_size(group) if op == "mean" else 1)


def broadcast_object(obj, what: str, timeout: float | None = None):
    """Rank 0's `obj` on every rank (picklable objects)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    with collective(what, timeout):
        dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj, what: str, timeout: float | None = None) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list = [None] * dist.get_world_size()
    with collective(what, timeout):
        dist.all_gather_object(out, obj)
    return out


_DIED = ("connection reset", "connection closed", "broken pipe", "connection refused", "end of file", "eof")


@contextmanager
def collective(operation: str, timeout: float | None = None):
    """Name `operation` in the error if a collective inside this block fails or times out (and in this rank's
    heartbeat while it runs)."""
    outer = heartbeat.entering(operation)
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:
        message = str(e).lower()
        timed_out = "timed out" in message or "timeout" in message
        if not (timed_out or any(word in message for word in _DIED) or isinstance(e, dist.DistError)):
            raise
        rank = dist.get_rank() if dist.is_initialized() else "?"
        world = dist.get_world_size() if dist.is_initialized() else "?"
        if timed_out:
            wait = f" {timeout:g} s" if timeout else ""
            cause = (
                f"timed out after the{wait} process-group timeout: a peer rank is stuck, or did not call the same "
                "collective (every rank must call the same collectives in the same order). If the step is just "
                "slow, raise the timeout (--timeout or MESHTRAIN_TIMEOUT)."
            )
        else:
            gone = heartbeat.departed()  # on this host, a rank whose process is gone; elsewhere, one fallen silent
            cause = ("lost its connection to a peer rank, which most likely died: "
                     + (f"{gone}." if gone else "the first error is in that rank's log."))
        raise CollectiveError(f"{operation} on rank {rank}/{world} {cause} Backend said: {_first_line(e)}") from e
    finally:
        heartbeat.note(collective=outer)


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
