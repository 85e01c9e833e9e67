"""`meshtrain doctor`: one table of checks of this host and job, each ok / warning / error with its fix.

    meshtrain doctor                                  on a login node or a laptop
    meshtrain doctor --nodes 2 --gpus-per-node 4      ... against what the job will ask for
    meshtrain doctor --json                           a JSON list, for scripts; the exit code is 1 on any error

The checks are runtime/doctor.py's and runtime/network.py's, data/text.py's (the shipped data) and
machine/profile.py's (the profile's age); this module gathers them and prints.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

from meshtrain.config import TrainSection
from meshtrain.data.text import default_data_root, shipped_data_check
from meshtrain.machine.profile import profile_age_check
from meshtrain.runtime import doctor, network
from meshtrain.runtime.device import device_count
from meshtrain.runtime.env import LaunchEnvError, detect
from meshtrain.runtime.launch import mpi_flavor
from meshtrain.runtime.log import print_rich

STATUS_STYLE = {doctor.OK: "green", doctor.WARNING: "yellow", doctor.ERROR: "bold red"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=None,
                        help="nodes the job will run on: an error if the scheduler gave fewer; more than one makes "
                             "a loopback-only network an error")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="GPUs each node must show (default: SLURM's --gpus-per-node in a job, else none)")
    parser.add_argument("--checkpoint-dir", default=TrainSection.out_dir,
                        help=f"where runs and checkpoints go (train.out_dir; default {TrainSection.out_dir})")
    parser.add_argument("--data-root", default=None,
                        help="where prepared datasets live (default: $MESHTRAIN_DATA_ROOT or ./data)")
    parser.add_argument("--json", action="store_true", help="print the checks as a JSON list instead of a table")


def collect(args: argparse.Namespace, environ=None) -> list[doctor.Check]:
    """Every check, in the order a job meets them: software, devices, the job's layout, network, limits, files."""
    env = os.environ if environ is None else environ
    try:
        launch = detect(env)
        nodes_held = doctor.job_nodes(launch, env)
    except LaunchEnvError:
        launch, nodes_held = None, 1  # the launcher row says why
    multi_node = max(args.nodes or 1, nodes_held) > 1
    mpiexec = shutil.which("mpiexec")
    flavor = mpi_flavor(mpiexec) if mpiexec else "pals"
    mpi_library = doctor.mpi_library()
    checks = [doctor.python_check(), doctor.torch_check(),
              doctor.devices_check(args.gpus_per_node, launch, env),
              doctor.launcher_check(env, args.nodes, flavor=flavor)]
    if launch is not None:
        checks += network.rendezvous_checks(launch, env, mpi4py=doctor.mpi_loads(mpi_library), multi_node=multi_node)
    checks += [network.gloo_interface_check(env, multi_node),
               network.nccl_interface_check(env, device_count("cuda") > 0),
               doctor.shm_check(), doctor.open_files_check(), doctor.disk_check(args.checkpoint_dir),
               shipped_data_check(args.data_root or default_data_root()), profile_age_check(),
               doctor.mpi_check(mpi_library, mpiexec, flavor if mpiexec else None)]
    return checks


def table(checks: list[doctor.Check]):
    from rich.table import Table
    from rich.text import Text

    counts = {status: sum(check.status == status for check in checks) for status in STATUS_STYLE}
    out = Table(title=f"meshtrain doctor: {counts['ok']} ok, {counts['warning']} warning(s), {counts['error']} "
                      "error(s)", title_justify="left")
    for column in ("check", "status", "found", "fix"):
        out.add_column(column, overflow="fold")
    for check in checks:
        out.add_row(check.name, Text(check.status, style=STATUS_STYLE[check.status]), check.found, check.fix)
    return out


def run(args: argparse.Namespace) -> int:
    checks = collect(args)
    if args.json:
        print(json.dumps([check.as_dict() for check in checks], indent=1))
    else:
        print_rich(table(checks))
    return 1 if doctor.any_error(checks) else 0
