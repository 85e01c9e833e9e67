"""`meshtrain submit [options] -- COMMAND`: write a PBS or SLURM job script that runs `meshtrain launch -- COMMAND`,
check a training command before anything is queued, and queue the script (qsub, sbatch); or ask for an interactive
job of the same resources (--interactive).

    meshtrain submit --system polaris --nodes 2 --account myproj -- meshtrain train gpt preset=gpt2
    meshtrain submit --system perlmutter --nodes 4 --time 02:00:00 --dry-run -- python -m meshtrain train llama
    meshtrain submit --system polaris --nodes 1 --account myproj --interactive

Settings come from the command line, else the site file (--site FILE, else ~/.config/meshtrain/submit.yaml), else
the system's entry in plan/systems.py (its scheduler, nodes, GPUs and CPUs per node, queues, filesystems).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import yaml

from meshtrain import registry
from meshtrain.commands.launch import train_arguments
from meshtrain.config import ConfigError, load_config, with_global_batch
from meshtrain.data.shards import is_sharded
from meshtrain.data.streams import dataset_meta
from meshtrain.data.text import check_split
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.plan import machines, search, systems
from meshtrain.plan.measured.preflight import shortfall
from meshtrain.plan.search import label
from meshtrain.plan.workload import ModelFacts
from meshtrain.runtime import jobscript
from meshtrain.runtime.jobscript import Job, SubmitError
from meshtrain.runtime.launch import PYTHON_NAMES

SITE_KEYS = ("system", "scheduler", "queue", "account", "time", "filesystems", "constraint")
DEFAULT_TIME = "01:00:00"
RESUME = "train.init_from=auto"  # a requeued job's run goes on from its last checkpoint
GIB = 2**30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scheduler", default=None, help="pbs or slurm (default: the system's, else the one whose "
                                                          "qsub or sbatch is on PATH)")
    parser.add_argument("--system", default=None, help=f"one of {', '.join(systems.names())}: its nodes, GPUs, CPUs, "
                                                       "queues, and the memory check of a train command")
    parser.add_argument("--site", default=None, metavar="FILE",
                        help=f"a YAML file of this site's defaults ({', '.join(SITE_KEYS)}); default: "
                             "~/.config/meshtrain/submit.yaml where it exists")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--time", default=None, metavar="HH:MM:SS", help=f"walltime (default {DEFAULT_TIME})")
    parser.add_argument("--queue", default=None, help="PBS queue, or SLURM QOS or partition (the system's kind)")
    parser.add_argument("--account", default=None, help="the project the job is charged to")
    parser.add_argument("--filesystems", default=None, metavar="A:B", help="PBS -l filesystems= (ALCF's sites)")
    parser.add_argument("--constraint", default=None, help="SLURM --constraint (Perlmutter's gpu is the default)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="default: the system's devices per node, else 0")
    parser.add_argument("--ranks-per-node", type=int, default=None, help="default: GPUs per node, else 1")
    parser.add_argument("--name", default=None, help="the job's name (default: meshtrain-MODEL)")
    parser.add_argument("--dry-run", action="store_true", help="print the script (or the interactive request); queue "
                                                               "nothing")
    parser.add_argument("--interactive", action="store_true", help="ask for an interactive job (qsub -I, salloc)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command each rank runs")


def run(args: argparse.Namespace) -> int:
    site = site_settings(args.site)
    system_name = args.system or site.get("system")
    system = systems.get(system_name) if system_name else None
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else list(args.cmd)
    job = build_job(args, site, system, command)
    if args.interactive:
        return _interactive(job, args.dry_run)
    if not command:
        raise SubmitError("nothing to run: put the command after `--`, e.g. meshtrain submit --nodes 2 -- meshtrain "
                          "train gpt preset=gpt2")
    train = train_arguments(list(job.command))
    if train is not None:  # a bad config, missing data or a layout that cannot fit: refused before it waits in a queue
        job = replace(job, notes=tuple(check_training(train, job, system)))
    if args.dry_run:
        print(jobscript.script(job), end="")
        return 0
    path = jobscript.write(job, job.workdir / ".meshtrain" / "jobs", time.strftime("%Y%m%d-%H%M%S"))
    queued_as = _queue(job, path)
    print(f"queued job {queued_as} ({job.scheduler}): script {path}\nlog: {jobscript.log_path(job, queued_as)}",
          flush=True)
    return 0


def site_settings(path: str | None) -> dict:
    """A site's own defaults: --site FILE, else ~/.config/meshtrain/submit.yaml where it exists; unknown keys refused."""
    if path is None:
        path = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "meshtrain" / "submit.yaml"
        if not path.is_file():
            return {}
    elif not Path(path).is_file():
        raise SubmitError(f"--site {path}: no such file")
    try:
        values = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise SubmitError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(values, dict):
        raise SubmitError(f"{path} must hold keys and values ({', '.join(SITE_KEYS)}), not {type(values).__name__}")
    unknown = sorted(str(key) for key in set(values) - set(SITE_KEYS))
    if unknown:
        raise SubmitError(f"{path}: unknown key(s) {', '.join(unknown)}: a site file sets {', '.join(SITE_KEYS)}")
    if isinstance(values.get("time"), int):  # YAML 1.1 reads an unquoted 01:30:00 as 5400 seconds
        seconds = values["time"]
        values["time"] = f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
    return values


# ---------------------------------------------------------------------------------------------- the job
def build_job(args: argparse.Namespace, site: dict, system: systems.System | None, command: list[str]) -> Job:
    """The job as asked: the command line over the site file over the system's entry; bad input refused here."""
    facts = system.scheduler if system else None
    scheduler = _scheduler(args.scheduler or site.get("scheduler"), system)
    if args.nodes < 1:
        raise SubmitError(f"--nodes {args.nodes}: give 1 or more")
    if facts and args.nodes > facts.nodes:
        raise SubmitError(f"--nodes {args.nodes}: {system.name} has {facts.nodes} nodes")
    gpus = args.gpus_per_node if args.gpus_per_node is not None else (system.devices_per_node if system else 0)
    ranks = args.ranks_per_node if args.ranks_per_node is not None else (gpus or 1)
    if system and gpus > system.devices_per_node:
        raise SubmitError(f"--gpus-per-node {gpus}: a {system.name} node has {system.devices_per_node}")
    if gpus < 0 or ranks < 1:
        raise SubmitError(f"--gpus-per-node {gpus} --ranks-per-node {ranks}: give 0 or more GPUs and 1 or more ranks")
    if _runs_launch(command):
        raise SubmitError(f"`{shlex.join(command)}`: the job script runs `meshtrain launch` itself; give what follows "
                          "launch's `--`")
    train = train_arguments(command)
    if train is not None and not any(word.startswith("train.init_from=") for word in train.overrides):
        command = [*command, RESUME]
    activate, launcher = _environment()
    filesystems = args.filesystems or site.get("filesystems") or (facts.filesystems if facts else ())
    name = jobscript.check_name(args.name or (f"meshtrain-{train.workload}"[:15] if train else "meshtrain"))
    return Job(scheduler=scheduler, name=name,
               nodes=args.nodes, ranks_per_node=ranks, gpus_per_node=gpus,
               cpus_per_node=facts.cpus_per_node if facts else None,
               walltime=jobscript.parse_walltime(args.time or site.get("time") or DEFAULT_TIME),
               queue=_queue_name(args.queue or site.get("queue"), system), account=args.account or site.get("account"),
               workdir=Path.cwd(), command=tuple(command), activate=activate, launcher=launcher,
               queue_option=facts.queue_option if facts else "queue",
               constraint=args.constraint or site.get("constraint") or (facts.constraint if facts else None),
               filesystems=tuple(filesystems.split(":") if isinstance(filesystems, str) else filesystems))


def _scheduler(named: str | None, system: systems.System | None) -> str:
    """The scheduler named, or the system's, or the one on PATH; a system's own scheduler may not be contradicted."""
    facts = system.scheduler if system else None
    scheduler = jobscript.find_scheduler(named or (facts.kind if facts else None))
    if facts and scheduler != facts.kind:
        raise SubmitError(f"--scheduler {scheduler}: {system.name} runs {facts.kind.upper()} ({facts.source})")
    return scheduler


def _queue_name(queue: str | None, system: systems.System | None) -> str | None:
    facts = system.scheduler if system else None
    if facts is None:
        return queue
    if queue is None:
        return facts.default_queue
    if queue not in facts.queues:
        raise SubmitError(f"--queue {queue}: {system.name}'s {facts.queue_option} names are {', '.join(facts.queues)}")
    return queue


def _runs_launch(command: list[str]) -> bool:
    """Whether `command` is `meshtrain launch ...` or `python -m meshtrain launch ...` (launched twice, it would
    start a launcher on every rank)."""
    words = command[2:] if command[:1] and command[0] in PYTHON_NAMES and command[1:2] == ["-m"] else command
    return [os.path.basename(word) for word in words[:2]] == ["meshtrain", "launch"]


def _environment() -> tuple[Path | None, tuple[str, ...]]:
    """The activate script of the virtual environment running this, with its `meshtrain launch`; without one, no
    activation and this interpreter's `-m meshtrain launch` (the nodes' PATH may find another python)."""
    activate = Path(sys.prefix) / "bin" / "activate"
    if sys.prefix != sys.base_prefix and activate.is_file():
        return activate, ("meshtrain", "launch")
    return None, (sys.executable, "-m", "meshtrain", "launch")


# ------------------------------------------------------------------------------------- before queueing
def check_training(train: argparse.Namespace, job: Job, system: systems.System | None) -> list[str]:
    """The script's notes on what was checked; a meshtrain error when the config is bad, the data is not prepared
    where the job will look, or (on a known system) the layout will not fit in its devices' memory."""
    cfg = load_config(train.overrides, train.workload)
    notes = [f"checked: the config of `meshtrain train {train.workload}` loads", *_check_data(cfg)]
    if system is not None and job.gpus_per_node:
        notes += _check_memory(cfg, system, job.nodes, job.ranks_per_node)
    return notes


def _check_data(cfg) -> list[str]:
    """A language model's prepared data, found as its workload finds it (models/language/workload.py)."""
    if not registry.spec_of(cfg).text:
        return ["not checked: the data of a model that is not a language model"]
    data_dir = Path(cfg.data.root) / cfg.data.name
    meta = dataset_meta(data_dir)  # a DataError with the `meshtrain prepare` line to run
    if not is_sharded(data_dir):
        check_split(data_dir, "train", getattr(cfg.model, "block_size", None), meta)
    return [f"checked: the data is prepared in {data_dir.resolve()}"]


def _check_memory(cfg, system: systems.System, nodes: int, per_node: int) -> list[str]:
    """The planner's peak per rank of the layout on nodes × per_node of `system`'s devices, or its pick under
    parallel.plan=auto; a ConfigError naming both figures (and a layout that fits) when it cannot fit."""
    if per_node != system.devices_per_node:
        system = systems.custom(system, devices_per_node=per_node)
    machine = machines.from_system(system)
    if cfg.train.dtype == "auto":  # what train.dtype=auto picks on every shipped system, as `meshtrain plan` counts
        cfg = replace(cfg, train=replace(cfg.train, dtype="bf16"))
    where = f"{nodes} node(s) × {per_node} {system.name}"
    if cfg.parallel.plan == "auto":
        chosen = search.best(cfg, nodes, per_node, machine)  # a ConfigError when nothing fits
        return [f"parallel.plan=auto: the planner's pick on {where}: {chosen.label}, predicted "
                f"{chosen.cost.peak_bytes / GIB:.2f} GiB peak per rank, {chosen.cost.step_s * 1e3:.1f} ms per step",
                f"  ({' '.join(chosen.overrides)})"]
    facts = ModelFacts.of(cfg)
    dims = ParallelDims.from_config(cfg, nodes * per_node, per_node)
    have = search.HEADROOM * machine.device_memory_bytes
    device = f"{search.HEADROOM:.0%} of a {system.name} device's {machine.device_memory_bytes / GIB:.0f} GiB"
    need, verdict = shortfall(facts, with_global_batch(cfg, dims.dp_size), dims, machine, have, device)
    if verdict:
        ranked, _ = search.search(cfg, nodes, per_node, machine, facts)
        first = next((c for c in ranked if c.fits), None)
        ranks = (f"; on {where}, `meshtrain plan` ranks first {first.label} ({first.cost.peak_bytes / GIB:.2f} GiB): "
                 f"{' '.join(first.overrides)}" if first else "")
        raise ConfigError(f"{verdict}{ranks}; nothing submitted")
    return [f"checked: it fits on {where}: {label(cfg, dims)} needs about {need / GIB:.2f} GiB per rank at its peak "
            f"(`meshtrain plan`'s prediction, {cfg.train.dtype}); {device} gives {have / GIB:.2f} GiB"]


# ---------------------------------------------------------------------------------------------- queue
def _interactive(job: Job, dry_run: bool) -> int:
    argv = jobscript.interactive_argv(job)
    print(shlex.join(argv), flush=True)
    if dry_run:
        return 0
    if shutil.which(argv[0]) is None:
        raise SubmitError(f"{argv[0]} is not on PATH: run this on {job.scheduler.upper()}'s login node")
    os.execvp(argv[0], argv)  # the scheduler's own interactive session takes over this terminal


def _queue(job: Job, path: Path) -> str:
    """qsub or sbatch the script; the job id it printed."""
    argv = jobscript.submit_argv(job, path)
    if shutil.which(argv[0]) is None:
        raise SubmitError(f"{argv[0]} is not on PATH: run this on the machine's login node (the script is {path}; "
                          "--dry-run prints it without queueing)")
    done = subprocess.run(argv, capture_output=True, text=True, cwd=job.workdir)
    if done.returncode != 0:
        raise SubmitError(f"{shlex.join(argv)} failed (exit {done.returncode}): "
                          f"{(done.stderr or done.stdout).strip()}")
    return jobscript.job_id(job.scheduler, done.stdout)
