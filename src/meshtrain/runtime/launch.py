"""The launcher command this machine wants, built from the scheduler's environment (`meshtrain launch` runs it).

    PBS    mpiexec -n N --ppn P --hostfile $PBS_NODEFILE --depth D --cpu-bind depth --envall CMD   (PALS)
    SLURM  srun --nodes M --ntasks N --ntasks-per-node P --cpus-per-task D --cpu-bind=cores ... CMD
    local  torchrun --standalone --nproc-per-node N CMD
    elastic  torchrun --nnodes MIN:MAX --rdzv-backend c10d --rdzv-endpoint HOST:PORT --nproc-per-node P CMD (each node)

The launcher does the launching; meshtrain only writes its command line. The ranks then find
themselves from the launcher's variables (env.py), so no wrapper process sits between them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

from meshtrain.runtime.env import LaunchEnvError, hostfile_slots, scheduler_info
from meshtrain.runtime.rundir import PREEMPTED

PYTHON_NAMES = ("python", "python3", f"python3.{sys.version_info.minor}")
MPI_FLAVORS = ("pals", "openmpi", "mpich")


@dataclass(frozen=True)
class Machine:
    """What `launch` needs to know about the node it runs on (probed, or given in tests)."""

    accelerators: int  # per node
    cpus: int  # per node

    @classmethod
    def probe(cls) -> Machine:
        from meshtrain.runtime.device import cpus_available, device_count

        return cls(accelerators=max(device_count("cuda"), device_count("xpu")), cpus=cpus_available())


def mpi_flavor(mpiexec: str = "mpiexec") -> str:
    """Which mpiexec is installed: Open MPI, MPICH/Intel MPI (Hydra) or Cray PALS (the default on PBS)."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=10)
        text = (out.stdout + out.stderr).lower()
    except (OSError, subprocess.TimeoutExpired):
        return "pals"
    if "open mpi" in text or "openrte" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text or "intel" in text:
        return "mpich"
    return "pals"


def _as_interpreter(command: list[str]) -> list[str]:
    """A leading `python` means the interpreter meshtrain runs in, whatever PATH says on the nodes."""
    if command and command[0] in PYTHON_NAMES:
        return [sys.executable, *command[1:]]
    return command


def _torchrun(nproc: int, command: list[str], max_restarts: int = 0, nnodes: str | None = None,
              rendezvous: str | None = None, job_id: str = "meshtrain") -> list[str]:
    """torchrun's command: on this node alone (--standalone), or one node of an elastic job (`nnodes` MIN:MAX,
    meeting at `rendezvous` HOST:PORT through c10d), whose agents restart the ranks on the nodes that are left."""
    beside = os.path.join(os.path.dirname(sys.executable), "torchrun")
    head = [beside if os.path.exists(beside) else "torchrun"]
    if nnodes:
        if not rendezvous:
            raise LaunchEnvError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT: where the nodes' agents meet "
                                 "(a port on the first node, the same on every node)")
        head += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rendezvous}", f"--rdzv-id={job_id}"]
    else:
        head.append("--standalone")
    head.append(f"--nproc-per-node={nproc}")
    head += [f"--max-restarts={max_restarts}"] if max_restarts else []
    if len(command) >= 3 and command[0] in PYTHON_NAMES and command[1] == "-m":
        return [*head, "-m", *command[2:]]
    if len(command) >= 2 and command[0] in PYTHON_NAMES and not command[1].startswith("-"):
        return [*head, *command[1:]]
    return [*head, "--no-python", *command]


def _scheduler_ppn(scheduler: str, env: Mapping[str, str]) -> int | None:
    """Ranks per node as the job asked for them: SLURM's tasks per node, or the slots PBS wrote per host in its
    nodefile (the fewest, should the chunks differ)."""
    if scheduler == "slurm":
        tasks = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        return int(tasks) if tasks.isdigit() else None
    if scheduler == "pbs" and env.get("PBS_NODEFILE"):
        return min(hostfile_slots(env["PBS_NODEFILE"]).values(), default=None)
    return None


def build_command(
    command: list[str],
    nproc: int | None = None,
    ppn: int | None = None,
    launcher: str = "auto",
    flavor: str = "auto",
    environ: Mapping[str, str] | None = None,
    machine: Machine | None = None,
    max_restarts: int = 0,
    nnodes: str | None = None,
    rendezvous: str | None = None,
) -> list[str]:
    """The full launcher argv for `command` on this machine (see the module docstring)."""
    env = os.environ if environ is None else environ
    machine = machine or Machine.probe()
    if not command:
        raise LaunchEnvError("nothing to launch: put the command after `--`, e.g. meshtrain launch -- python -m meshtrain test-dist")
    scheduler, _, hosts = scheduler_info(env)
    if launcher == "auto":
        launcher = {"pbs": "mpiexec", "slurm": "srun"}.get(scheduler, "torchrun")
    if launcher == "torchrun":
        return _torchrun(ppn or nproc or machine.accelerators or 2, command, max_restarts, nnodes, rendezvous,
                         env.get("SLURM_JOB_ID") or env.get("PBS_JOBID") or "meshtrain")
    if nnodes:
        raise LaunchEnvError(f"--nnodes {nnodes} is torchrun's elastic job: add --launcher torchrun (under "
                             f"{launcher}, --max-restarts runs the job again instead)")

    nodes = len(hosts) or int(env.get("SLURM_NNODES", "0") or 0) or 1
    # Outside a scheduler there is one node, which holds every rank asked for (2 on a CPU-only box, as torchrun's).
    alone = (nproc or 2) if scheduler == "none" else None
    ppn = ppn or machine.accelerators or _scheduler_ppn(scheduler, env) or alone or 1
    nproc = nproc or nodes * ppn
    if nproc > nodes * ppn:
        raise LaunchEnvError(
            f"-n {nproc} needs {-(-nproc // ppn)} nodes at --ppn {ppn}, but the job has {nodes}: "
            "lower -n, raise --ppn, or ask the scheduler for more nodes"
        )
    nodes = -(-nproc // ppn)
    depth = max(1, machine.cpus // ppn)
    command = _as_interpreter(command)

    if launcher == "srun":
        return [*_srun(nodes, nproc, ppn, depth, machine), *command]
    if launcher != "mpiexec":
        raise LaunchEnvError(f"unknown launcher {launcher!r}: choose auto, torchrun, mpiexec or srun")
    return [*_mpiexec(mpi_flavor() if flavor == "auto" else flavor, nproc, ppn, depth, env), *command]


def _srun(nodes: int, nproc: int, ppn: int, depth: int, machine: Machine) -> list[str]:
    argv = ["srun", f"--nodes={nodes}", f"--ntasks={nproc}", f"--ntasks-per-node={ppn}",
            f"--cpus-per-task={depth}", "--cpu-bind=cores", "--kill-on-bad-exit=1"]
    if machine.accelerators:
        argv.append(f"--gpus-per-node={min(ppn, machine.accelerators)}")
    return argv


def _mpiexec(flavor: str, nproc: int, ppn: int, depth: int, env: Mapping[str, str]) -> list[str]:
    """mpiexec's options in the words of its flavour: ranks, ranks per node, the job's hostfile, cores per rank."""
    hostfile = env.get("PBS_NODEFILE")
    if flavor == "pals":
        argv = ["mpiexec", "-n", str(nproc), "--ppn", str(ppn)]
        argv += ["--hostfile", hostfile] if hostfile else []
        argv += ["--depth", str(depth), "--cpu-bind", "depth", "--envall"]
    elif flavor == "openmpi":
        argv = ["mpiexec", "-n", str(nproc), "--map-by", f"ppr:{ppn}:node:PE={depth}", "--bind-to", "core"]
        argv += ["--hostfile", hostfile] if hostfile else []
        # Open MPI warns about each -x of a variable that is not set: forward those that are.
        argv += [arg for name in ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH") if name in env for arg in ("-x", name)]
    elif flavor == "mpich":
        argv = ["mpiexec", "-n", str(nproc), "-ppn", str(ppn)]
        argv += ["-f", hostfile] if hostfile else []
        argv += ["-bind-to", f"core:{depth}"]
    else:
        raise LaunchEnvError(f"unknown MPI flavour {flavor!r}: choose auto, {', '.join(MPI_FLAVORS)}")
    return argv


def relaunch(argv: list[str], max_restarts: int) -> int:
    """Run `argv` (mpiexec or srun) again while it fails, up to `max_restarts` more times, telling the ranks which
    attempt they are (MESHTRAIN_RESTART_COUNT, as torchrun's TORCHELASTIC_RESTART_COUNT). A job stopped by a
    preemption signal (exit PREEMPTED) is not restarted here: its nodes are going away; the job script re-queues it."""
    for attempt in range(max_restarts + 1):
        started = time.monotonic()
        code = subprocess.run(argv, env={**os.environ, "MESHTRAIN_RESTART_COUNT": str(attempt)}).returncode
        if code in (0, PREEMPTED) or attempt == max_restarts:
            return code
        print(f"meshtrain launch: attempt {attempt} failed with exit code {code} after "
              f"{time.monotonic() - started:.1f} s; restarting ({max_restarts - attempt} restart(s) left)", flush=True)
    return code
