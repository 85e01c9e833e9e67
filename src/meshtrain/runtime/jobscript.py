"""A batch job's script for PBS or SLURM, and the commands that queue it (`meshtrain submit` fills a Job in).

    PBS    #PBS -l select=N:ncpus=C:ngpus=G, walltime, -q, -A, filesystems; qsub SCRIPT; qsub -I ... (interactive)
    SLURM  #SBATCH --nodes, --ntasks-per-node, --gpus-per-node, --time, --qos|--partition, --account,
           --constraint, --signal=USR1@120 --requeue; sbatch SCRIPT; salloc ... (interactive)

The script changes to the directory `submit` ran in, activates the Python environment that ran it, and runs
`meshtrain launch -- COMMAND`: launch writes the mpiexec or srun line from the job's own variables (launch.py), so
nothing here repeats the launcher's flags. Only the standard library: the planner's table of systems
(plan/systems.py) holds each system's SchedulerFacts beside its figures.
"""

from __future__ import annotations

import re
import shlex
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from meshtrain.errors import MeshtrainError
from meshtrain.runtime.rundir import PREEMPTED

SUBMIT = {"pbs": "qsub", "slurm": "sbatch"}  # the program that queues a script, by scheduler
SCHEDULERS = tuple(SUBMIT)
# SLURM sends USR1 this many seconds before the time limit: one iteration and a checkpoint must fit in it
WARNING_S = 120


class SubmitError(MeshtrainError, ValueError):
    """A job that cannot be written or queued as asked; the message names the input and the fix."""


@dataclass(frozen=True)
class SchedulerFacts:
    """How a site's batch system takes jobs on one system: kept beside the system's figures in plan/systems.py."""

    kind: str  # "pbs" | "slurm"
    nodes: int  # nodes of this type the machine has: a job asking for more can never start
    cpus_per_node: int  # as the scheduler counts them (hardware threads)
    queues: tuple[str, ...]  # PBS queues, or SLURM QOS or partitions (queue_option says which)
    default_queue: str | None
    source: str  # where the queue names and CPU counts are documented
    queue_option: str = "queue"  # SLURM: "qos" (Perlmutter) or "partition" (Frontier)
    constraint: str | None = None  # SLURM --constraint that picks this node type
    filesystems: tuple[str, ...] = ()  # PBS -l filesystems=, where the site requires it (ALCF)


@dataclass(frozen=True)
class Job:
    """One batch job as `submit` asks for it: resources, where it runs, and the command it runs."""

    scheduler: str
    name: str
    nodes: int
    ranks_per_node: int
    gpus_per_node: int  # 0: a CPU job (no GPU request)
    cpus_per_node: int | None  # None: the scheduler's default
    walltime: str  # HH:MM:SS
    queue: str | None
    account: str | None
    workdir: Path
    command: tuple[str, ...]  # what each rank runs, after `meshtrain launch --`
    activate: Path | None  # the environment's bin/activate; None: none found (the script says so)
    launcher: tuple[str, ...] = ("meshtrain", "launch")
    queue_option: str = "queue"
    constraint: str | None = None
    filesystems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # comment lines: what was checked, the plan's pick


def check_name(name: str) -> str:
    """A job name both schedulers take: a letter, then letters, digits, '.', '_' or '-' (PBS's rule; 15 characters
    is the most some PBS servers keep)."""
    if not re.fullmatch(r"[A-Za-z][\w.-]{0,14}", name):
        raise SubmitError(f"--name {name!r}: a job name is a letter, then up to 14 letters, digits, '.', '_' or '-'")
    return name


def parse_walltime(text: str) -> str:
    """`text` as the HH:MM:SS both schedulers read; an error for anything else (90m, 1:5, 00:61:00)."""
    match = re.fullmatch(r"(\d{1,3}):(\d{2}):(\d{2})", str(text).strip())
    if not match or int(match[2]) >= 60 or int(match[3]) >= 60 or not any(int(g) for g in match.groups()):
        raise SubmitError(f"--time {text!r}: give the walltime as HH:MM:SS, e.g. 01:30:00 (minutes and seconds "
                          "below 60, more than zero in all)")
    return f"{int(match[1]):02d}:{match[2]}:{match[3]}"


def find_scheduler(named: str | None, which: Callable[[str], str | None] = shutil.which) -> str:
    """The scheduler named, else the one whose submit program is on PATH (sbatch first: SLURM sites often ship a
    qsub wrapper, PBS sites no sbatch)."""
    if named:
        if named not in SCHEDULERS:
            raise SubmitError(f"unknown scheduler {named!r}: choose {' or '.join(SCHEDULERS)}")
        return named
    for kind in ("slurm", "pbs"):
        if which(SUBMIT[kind]):
            return kind
    raise SubmitError("no scheduler found: neither qsub (PBS) nor sbatch (SLURM) is on PATH; run this on the "
                      "machine's login node, or name one with --scheduler pbs|slurm (with --dry-run to only see the "
                      "script)")


# --------------------------------------------------------------------------------------------- resources
def pbs_resources(job: Job) -> list[str]:
    """PBS's -l resources: one chunk per node (select=N:ncpus=C:ngpus=G), the walltime, the filesystems."""
    chunk = f"select={job.nodes}"
    chunk += f":ncpus={job.cpus_per_node}" if job.cpus_per_node else ""
    chunk += f":ngpus={job.gpus_per_node}" if job.gpus_per_node else ""
    if job.ranks_per_node != job.gpus_per_node:  # launch counts a node's ranks by its GPUs, else by its nodefile's
        chunk += f":mpiprocs={job.ranks_per_node}"  # lines, which mpiprocs sets
    resources = [chunk, f"walltime={job.walltime}"]
    return resources + ([f"filesystems={':'.join(job.filesystems)}"] if job.filesystems else [])


def pbs_options(job: Job) -> list[str]:
    """qsub's options for the job's resources, queue and account (the script's directives, or `qsub -I`)."""
    options = [word for resource in pbs_resources(job) for word in ("-l", resource)]
    options += ["-q", job.queue] if job.queue else []
    return options + (["-A", job.account] if job.account else [])


def slurm_options(job: Job) -> list[str]:
    """sbatch's (and salloc's) options for the job's nodes, tasks, GPUs, CPUs, time, queue, account, constraint."""
    options = [f"--nodes={job.nodes}", f"--ntasks-per-node={job.ranks_per_node}"]
    options += [f"--gpus-per-node={job.gpus_per_node}"] if job.gpus_per_node else []
    if job.cpus_per_node:  # else one CPU per task: launch's --cpus-per-task asks for what the job holds
        options.append(f"--cpus-per-task={max(1, job.cpus_per_node // job.ranks_per_node)}")
    options.append(f"--time={job.walltime}")
    options += [f"--{job.queue_option}={job.queue}"] if job.queue else []
    options += [f"--account={job.account}"] if job.account else []
    return options + ([f"--constraint={job.constraint}"] if job.constraint else [])


# ------------------------------------------------------------------------------------------------ script
def script(job: Job) -> str:
    """The whole job script: the scheduler's directives, then the body that runs the command."""
    if job.scheduler == "pbs":
        directives = [f"#PBS -N {job.name}"]
        directives += [f"#PBS {flag} {value}" for flag, value in zip(*[iter(pbs_options(job))] * 2, strict=True)]
        directives += ["#PBS -j oe"]  # one log, NAME.oJOBID in the submit directory
    else:
        directives = [f"#SBATCH --job-name={job.name}", *(f"#SBATCH {option}" for option in slurm_options(job)),
                      f"#SBATCH --output={job.workdir / job.name}-%j.out",
                      "#SBATCH --open-mode=append",  # a requeued run's lines follow its first start's
                      f"#SBATCH --signal=USR1@{WARNING_S}", "#SBATCH --requeue"]
    header = ["#!/bin/bash", f"# Written by `meshtrain submit`: {job.nodes} node(s) x {job.ranks_per_node} rank(s)."]
    notes = [f"# {note}" for note in job.notes]  # after the directives: the scheduler reads those first
    return "\n".join([*header, *directives, *notes, "", *_body(job)]) + "\n"


def _body(job: Job) -> list[str]:
    """Where the job runs, in which environment, the launch line and what an exit of a preempted run does."""
    lines = [f"cd {shlex.quote(str(job.workdir))}"]
    if job.activate:
        lines.append(f"source {shlex.quote(str(job.activate))}  # the environment that ran `meshtrain submit`")
    else:
        lines.append("# no virtual environment ran `meshtrain submit`: the job runs the python it finds on PATH")
    if job.scheduler == "slurm":
        # `scancel --signal=USR1 --full` and `--signal=B:USR1@...` signal this shell too, which USR1 kills (the job
        # FAILED, ExitCode 0:10) before the requeue below; trapped, bash runs the no-op once srun has exited
        lines.append("trap : USR1  # the ranks get SLURM's USR1 from their own step")
    lines += [shlex.join([*job.launcher, "--", *job.command]), "status=$?"]
    if job.scheduler == "slurm":
        lines += [f"# exit {PREEMPTED}: the run saved a checkpoint after SLURM's USR1 ({WARNING_S} s before the end); "
                  "queued again, train.init_from=auto resumes it",
                  f'if [ "$status" -eq {PREEMPTED} ]; then scontrol requeue "$SLURM_JOB_ID"; fi']
    else:
        lines += [f"# PBS sends no warning before the walltime, only its SIGTERM: the run then saves and exits {PREEMPTED}.",
                  "# PBS has no requeue a job can ask for itself: submit this script again (qsub); train.init_from=auto "
                  "resumes"]
    return [*lines, 'exit "$status"']


def write(job: Job, directory: Path, stamp: str) -> Path:
    """The script written to `directory`/NAME-STAMP.sh (the scheduler keeps no copy a user can read later)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{job.name}-{stamp}.sh"
    path.write_text(script(job))
    return path


# ------------------------------------------------------------------------------------------ queue it
def submit_argv(job: Job, path: Path) -> list[str]:
    return [SUBMIT[job.scheduler], str(path)]


def interactive_argv(job: Job) -> list[str]:
    """The scheduler's request for an interactive job of the same resources: qsub -I, or salloc."""
    if job.scheduler == "pbs":
        return ["qsub", "-I", *pbs_options(job)]
    return ["salloc", *slurm_options(job)]


def job_id(scheduler: str, output: str) -> str:
    """The job id in what qsub (`1234.server`) or sbatch (`Submitted batch job 1234`) printed."""
    text = output.strip()
    found = re.search(r"Submitted batch job (\d+)", text) if scheduler == "slurm" else \
        re.fullmatch(r"(\d+(?:\[\])?(?:\.[\w.-]+)?)", text.splitlines()[-1].strip() if text else "")
    if not found:
        raise SubmitError(f"{SUBMIT[scheduler]} printed no job id: {text!r}")
    return found[1]


def log_path(job: Job, queued_as: str) -> Path:
    """Where the job's output goes: SLURM's --output, or PBS's NAME.oNUMBER (copied there when the job ends)."""
    if job.scheduler == "slurm":
        return job.workdir / f"{job.name}-{queued_as}.out"
    return job.workdir / f"{job.name}.o{queued_as.split('.')[0]}"
