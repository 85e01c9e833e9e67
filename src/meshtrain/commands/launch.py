"""`meshtrain launch [options] -- CMD`: print the launcher command this machine wants (runtime/launch.py builds it)
and hand the process over to it, or run it again while it fails (--max-restarts under mpiexec or srun: on the hosts
that still answer)."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil

from meshtrain.runtime.env import LaunchEnvError
from meshtrain.runtime.launch import MPI_FLAVORS, build_command, mpi_flavor, program, relaunch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--nproc", type=int, default=None,
                        help="total ranks (default: nodes x ppn; locally the accelerators here, or 2 on a CPU-only box)")
    parser.add_argument("--ppn", type=int, default=None,
                        help="ranks per node (default: accelerators per node, else SLURM's tasks per node or the slots "
                             "PBS_NODEFILE lists per host, else 1)")
    parser.add_argument("--launcher", choices=("auto", "torchrun", "mpiexec", "srun"), default="auto",
                        help="auto: mpiexec under PBS, srun under SLURM, torchrun --standalone elsewhere")
    parser.add_argument("--mpi", dest="flavor", choices=("auto", *MPI_FLAVORS), default="auto",
                        help="which mpiexec's flags to write (auto: ask `mpiexec --version`; PALS if it cannot tell)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="restart the whole job up to N times when a rank fails (torchrun's elastic restarts; "
                             "under mpiexec or srun, launch runs it again on the hosts that answer); pair with "
                             "train.init_from=auto")
    parser.add_argument("--nnodes", default=None, metavar="MIN:MAX",
                        help="an elastic torchrun job, run on each node: it goes on with as few as MIN nodes, its "
                             "agents restarting the ranks on the nodes left (with --max-restarts and "
                             "train.init_from=auto; train.global_batch_size keeps the batch)")
    parser.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                        help="with --nnodes: where the nodes' agents meet (c10d rendezvous), the same on every node")
    parser.add_argument("--dry-run", action="store_true", help="print the command and exit")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command each rank runs")


def run(args: argparse.Namespace) -> int:
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if args.max_restarts < 0:
        raise LaunchEnvError(f"--max-restarts {args.max_restarts}: give 0 (no restarts) or more")
    check_training_config(command)
    argv = build_command(command, nproc=args.nproc, ppn=args.ppn, launcher=args.launcher, flavor=args.flavor,
                         max_restarts=args.max_restarts, nnodes=args.nnodes, rendezvous=args.rdzv_endpoint)
    print(shlex.join(argv), flush=True)
    if args.dry_run:
        return 0
    if shutil.which(argv[0]) is None:
        raise LaunchEnvError(f"{argv[0]} is not on PATH here: load the module that provides it, or pick --launcher")
    if args.max_restarts == 0 or program(argv) == "torchrun":  # torchrun restarts by itself
        os.execvp(argv[0], argv)  # the launcher takes over this process: its exit code and signals are the job's
    flavor = mpi_flavor() if args.flavor == "auto" and program(argv) == "mpiexec" else args.flavor
    # a restart goes on with the hosts that answer, each with its ranks per node: -n was for the whole job
    return relaunch(argv, args.max_restarts, flavor=flavor, rebuild=lambda env: build_command(
        command, ppn=args.ppn, launcher=args.launcher, flavor=flavor, environ=env, max_restarts=args.max_restarts,
        restart=True))


def check_training_config(command: list[str]) -> None:
    """Load the configuration of a `meshtrain train` command here, once: a bad key or value fails before any rank
    starts, rather than once in every rank and then in the launcher's own traceback."""
    from meshtrain.config import load_config

    args = train_arguments(command)
    if args is not None:
        load_config(args.overrides, args.workload)


def train_arguments(command: list[str]) -> argparse.Namespace | None:
    """The parsed arguments of `command` when it runs `meshtrain train` (as `meshtrain ...` or `python -m meshtrain
    ...`); None for any other command."""
    from meshtrain.commands import parse

    for i, word in enumerate(command):
        if (i == 0 and os.path.basename(word) == "meshtrain") or (word == "meshtrain" and command[i - 1] == "-m"):
            inner = command[i + 1:]
            if next((w for w in inner if not w.startswith("-")), None) == "train":
                return parse(inner)
            return None
    return None
