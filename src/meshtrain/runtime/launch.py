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
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from meshtrain.runtime.env import LaunchEnvError, hostfile_slots, scheduler_info
from meshtrain.runtime.rundir import PREEMPTED

PYTHON_NAMES = ("python", "python3", f"python3.{sys.version_info.minor}")
MPI_FLAVORS = ("pals", "openmpi", "mpich")
# An elastic job's rendezvous, tighter than torch's defaults (a 30 s last call, a node dead after 3 × 5 s without a
# heartbeat), which made a restart on the nodes left wait 46 s here for a few seconds of work. The agents of one job
# start within seconds of each other, and one that comes later still joins: the agents restart to admit it.
RENDEZVOUS_CONF = "last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"
# torch 2.13's agents share one store between rendezvous rounds, and an agent that stays rank 0 does not publish
# the new round's address: a node joining later waits for it until it times out, and the job fails (as a job grown
# by a node in tests/distributed/test_multinode.py did). With this, each round makes a store of its own.
ELASTIC_ENV = ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"]
PROBE_S = 30.0  # how long a host has to run `true` through the job's launcher before it counts as lost


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
        head = [*ELASTIC_ENV, *head, f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rendezvous}",
                f"--rdzv-id={job_id}", f"--rdzv-conf={RENDEZVOUS_CONF}"]
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


def _cpus_per_node(scheduler: str, env: Mapping[str, str], machine: Machine) -> int:
    """The CPUs a job's ranks share on each node: under SLURM those the job holds there (the fewest, should its
    nodes differ: SLURM_JOB_CPUS_PER_NODE reads "2(x2)" or "8,4"), all of the node only with --exclusive; srun
    refuses a step that asks for more. Elsewhere the node's."""
    if scheduler == "slurm":
        held = [int(cpus) for cpus in re.findall(r"(\d+)(?:\(x\d+\))?", env.get("SLURM_JOB_CPUS_PER_NODE", ""))]
        if held:
            return min(held)
    return machine.cpus


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
    restart: bool = False,
) -> list[str]:
    """The full launcher argv for `command` on this machine (see the module docstring); `restart`: for a job run
    again after it failed (see _srun)."""
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
    depth = max(1, _cpus_per_node(scheduler, env, machine) // ppn)
    command = _as_interpreter(command)

    if launcher == "srun":
        return [*_srun(nodes, nproc, ppn, depth, machine, restart), *command]
    if launcher != "mpiexec":
        raise LaunchEnvError(f"unknown launcher {launcher!r}: choose auto, torchrun, mpiexec or srun")
    return [*_mpiexec(mpi_flavor() if flavor == "auto" else flavor, nproc, ppn, depth, env), *command]


def _srun(nodes: int, nproc: int, ppn: int, depth: int, machine: Machine, restart: bool = False) -> list[str]:
    """srun's options; a restart's step shares the CPUs with the failed one (--overlap): a step that ran on a node
    that died stays RUNNING in slurmctld, holding its CPUs on the nodes left, since the dead node never reports its
    end; a step without --overlap would wait for those CPUs for ever."""
    argv = ["srun", f"--nodes={nodes}", f"--ntasks={nproc}", f"--ntasks-per-node={ppn}",
            f"--cpus-per-task={depth}", "--cpu-bind=cores", "--kill-on-bad-exit=1", *(["--overlap"] if restart else [])]
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


def program(argv: list[str]) -> str:
    """The launcher `argv` runs (torchrun, mpiexec, srun), past an `env VAR=value` prefix."""
    words = argv[1:] if argv[0] == "env" else argv
    return os.path.basename(next(word for word in words if "=" not in word))


Rebuild = Callable[[Mapping[str, str]], list[str]]  # the launcher's argv for a job environment


def relaunch(argv: list[str], max_restarts: int, rebuild: Rebuild | None = None, flavor: str = "pals") -> int:
    """Run `argv` (mpiexec or srun) again while it fails, up to `max_restarts` more times, telling the ranks which
    attempt they are (MESHTRAIN_RESTART_COUNT, as torchrun's TORCHELASTIC_RESTART_COUNT). Before each restart of a
    job over several hosts, each host is asked to run `true` through the launcher, and the job goes on with those
    that answer (`rebuild` writes the launcher's command for them). A job stopped by a preemption signal (exit
    PREEMPTED) is not restarted here: its nodes are going away; the job script re-queues it."""
    env = dict(os.environ)
    for attempt in range(max_restarts + 1):
        started = time.monotonic()
        code = subprocess.run(argv, env={**env, "MESHTRAIN_RESTART_COUNT": str(attempt)}).returncode
        if code in (0, PREEMPTED) or attempt == max_restarts:
            return code
        print(f"meshtrain launch: attempt {attempt} failed with exit code {code} after "
              f"{time.monotonic() - started:.1f} s; restarting ({max_restarts - attempt} restart(s) left)", flush=True)
        if rebuild is not None and len(scheduler_info(env)[2]) > 1:
            env = on_hosts_that_answer(env, program(argv), flavor, attempt + 1)
            argv = rebuild(env)
            print(shlex.join(argv), flush=True)
    return code


def on_hosts_that_answer(env: Mapping[str, str], launcher: str, flavor: str, attempt: int) -> dict[str, str]:
    """The job's environment narrowed to the hosts that run `true` through `launcher` within PROBE_S seconds: a PBS
    job's nodefile written again without the others (in ./.meshtrain/, which the nodes share as they share the job's
    directory), a SLURM job's node list. The ranks find each other from it as at the start."""
    scheduler, job_id, hosts = scheduler_info(env)
    alive = answering(hosts, lambda host: _probe(launcher, flavor, host))
    lost = [host for host in hosts if host not in alive]
    if not lost:
        return dict(env)
    if not alive:
        raise LaunchEnvError(f"none of the job's hosts ({', '.join(hosts)}) runs `true` through {launcher} within "
                             f"{PROBE_S:.0f} s: nothing is left to restart on")
    print(f"meshtrain launch: {', '.join(lost)} did not answer {launcher} within {PROBE_S:.0f} s; going on with "
          f"{', '.join(alive)}", flush=True)
    if scheduler == "pbs":
        slots = hostfile_slots(env["PBS_NODEFILE"])
        nodefile = Path(".meshtrain") / f"nodefile-{job_id}-attempt{attempt}"
        nodefile.parent.mkdir(exist_ok=True)
        nodefile.write_text("".join(f"{host}\n" * slots[host] for host in alive))
        return {**env, "PBS_NODEFILE": str(nodefile.resolve())}
    # srun rewrites the step's own variables (SLURM_NODELIST, SLURM_NNODES, SLURM_NTASKS, SLURM_TASKS_PER_NODE, ...)
    # for the ranks, but hands the job's on as it finds them: the ranks' SLURM_JOB_* name the hosts left.
    narrowed = {k: v for k, v in env.items() if k not in ("SLURM_STEP_NODELIST", "SLURM_NODELIST")}
    return {**narrowed, "SLURM_JOB_NODELIST": ",".join(alive), "SLURM_NNODES": str(len(alive)),
            "SLURM_JOB_NUM_NODES": str(len(alive))}


def answering(hosts: tuple[str, ...] | list[str], probe: Callable[[str], list[str]]) -> list[str]:
    """The hosts on which the command `probe(host)` succeeds within PROBE_S seconds, asked all at once."""
    jobs = {host: subprocess.Popen(probe(host), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for host in hosts}
    deadline, alive = time.monotonic() + PROBE_S, []
    for host, job in jobs.items():
        try:
            if job.wait(timeout=max(0.0, deadline - time.monotonic())) == 0:
                alive.append(host)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()
    return alive


def _probe(launcher: str, flavor: str, host: str) -> list[str]:
    """One task running `true` on `host`, through the launcher the job uses."""
    if launcher == "srun":  # --overlap: beside whatever of the failed step is still being cleaned up
        return ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "true"]
    return ["mpiexec", "-n", "1", {"openmpi": "--host", "mpich": "-hosts", "pals": "--hosts"}[flavor], host, "true"]
