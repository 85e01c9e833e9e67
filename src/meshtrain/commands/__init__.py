"""The `meshtrain` command: one entry point, a subcommand per job.

Each subcommand lives in its own module of this package, which offers `add_arguments(parser)` and `run(args) -> int`:
the arguments and what is printed live there; the libraries below take typed arguments and return values.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
import time
from importlib import metadata

from meshtrain import __version__

# name -> (module, one-line help, description shown by `meshtrain NAME --help`, takes the dist options)
SUBCOMMANDS = {
    "launch": (
        "meshtrain.commands.launch",
        "start a command on every rank with the launcher this machine uses (torchrun, mpiexec, srun)",
        "Build the launcher command for this machine and run it: mpiexec with the job's hostfile under PBS, "
        "srun under SLURM, torchrun --standalone elsewhere. Put the command to run after `--`; a leading "
        "`python` runs the interpreter meshtrain is installed in.",
        False,
    ),
    "submit": (
        "meshtrain.commands.submit",
        "write a PBS or SLURM job script that runs `meshtrain launch -- COMMAND`, check it, and queue it",
        "Write the job script for the scheduler on PATH (qsub: PBS, sbatch: SLURM) or named, with the resources of "
        "--system's nodes, and queue it; a train command is checked first (config, data, memory on the system). "
        "--dry-run prints the script; --interactive asks for an interactive job (qsub -I, salloc).",
        False,
    ),
    "test-dist": (
        "meshtrain.commands.test_dist",
        "check the distributed set-up: DistInfo, a short DDP run, bit-identical parameters on every rank",
        "Print the set-up table, train a small MLP with DDP for a few iterations on different data per rank, "
        "then verify that every rank holds bit-identical parameters. Exits non-zero, naming the differing "
        "ranks, if not. Run it under a launcher: `meshtrain launch -- python -m meshtrain test-dist`.",
        True,
    ),
    "prepare": (
        "meshtrain.commands.prepare",
        "prepare a dataset: shakespeare_char, shakespeare, your own text, a tokenizer, or synthetic ERA5 weather data",
        "Write data/<name>/train.bin, val.bin (uint16 tokens, 90/10 split; uint32 shards past 65,536 ids) and "
        "meta.json. shakespeare_char and "
        "shakespeare (GPT-2 BPE) use the corpus shipped with meshtrain and need no network; `text PATH` "
        "tokenizes your own file with any tokenizer (--tokenizer: char, gpt2, cl100k_base, a tokenizer.json, a "
        "tiktoken ranks file); `text PATH…` with folders, globs, jsonl, parquet or .gz/.zst (or --workers, "
        "--shard-tokens) writes a sharded corpus: shards + manifest.json, in worker processes; `tokenizer PATH... "
        "--vocab-size N --out FILE.json` trains a byte-level BPE. `era5-synthetic` writes ERA5-format h5 files "
        "(train/valid/test, one per "
        "year) of smooth, evolving fields with their normalisation stats.",
        False,
    ),
    "train": (
        "meshtrain.commands.train",
        "train a model: meshtrain train gpt [preset=NAME] [data=NAME] [group.key=value ...]",
        "Train under any launcher (run it with `meshtrain launch -- python -m meshtrain train gpt ...`). "
        "Configuration: typed defaults, then a YAML preset, then dotted overrides; an unknown key or bad "
        "value stops at once with the key named.",
        True,
    ),
    "sample": (
        "meshtrain.commands.sample",
        "generate text from a run's checkpoint",
        "Load a run's latest checkpoint (any layout) or an exported model.pt, with its config and tokenizer, "
        "and print samples from a prompt.",
        False,
    ),
    "export": (
        "meshtrain.commands.export",
        "consolidate a run's latest distributed checkpoint into one model.pt",
        "Read every shard of the run's latest checkpoint, whatever layout wrote it, and write the whole model "
        "with its config and tokenizer description to one file (torch.load(weights_only=True) reads it).",
        False,
    ),
    "plan": (
        "meshtrain.commands.plan",
        "which layout? every valid layout's predicted memory and speed on a machine, ranked (--validate: measured)",
        "Enumerate every layout of a run config (dp × tp × cp × pp, backend, activation checkpointing, pipeline "
        "schedule) that `train` would accept on N nodes of a system (this machine, measured, or a shipped one: "
        "Polaris, Perlmutter, Aurora, Frontier, DGX H100), predict each one's memory per rank and step time, and "
        "rank them. --explain shows one layout's terms; --validate runs layouts here and prints predicted against "
        "measured.",
        False,
    ),
    "report": (
        "meshtrain.commands.report",
        "one or more runs as an HTML page of plots and tables (and the plots as PNGs)",
        "Read each run directory (metrics.jsonl, config.yaml, run.json, checkpoints) as far as the run got and write "
        "report.html, a single file that opens offline: loss, learning rate, gradient norm, throughput and MFU, "
        "where a step's time goes, memory per rank, the ranks' spread of step time with the straggler marked, the "
        "workload's own evaluation, the config and the environment. Several runs overlay and get a comparison table.",
        False,
    ),
    "machine": (
        "meshtrain.commands.machine",
        "measure and print what this machine can do: matmul peak per dtype, memory, bandwidth, collectives",
        "Measure this device once and cache it (~/.cache/meshtrain/machine.json): instruction set or compute "
        "capability, whether bf16 is native and the dtype train.dtype=auto picks, matmul peak per dtype (best of "
        "several timings, load average recorded), host and device memory, memory bandwidth; with --ranks N also "
        "collective latency and bus bandwidth per message size. Training reads the same profile for MFU.",
        False,
    ),
    "collectives": (
        "meshtrain.commands.collectives",
        "show each collective at work (--demo) or measure their bandwidth (--bench)",
        "--demo runs every collective on small tensors, prints each rank's before/after and checks it "
        "against the analytic answer. --bench sweeps message sizes and prints time, algorithm bandwidth "
        "and bus bandwidth (nccl-tests' definitions) per collective.",
        True,
    ),
    "doctor": (
        "meshtrain.commands.doctor",
        "check this host and job: torch, devices, launcher, network, limits, data, profile; each with its fix",
        "One table of checks, each ok / warning / error with the fix: Python and torch's build; devices against "
        "--gpus-per-node; the launcher and scheduler and the rank layout they imply (--nodes); the rendezvous "
        "address and port; the interface gloo and NCCL would use (*_SOCKET_IFNAME); /dev/shm, open files, free "
        "disk where checkpoints go; the shipped data; the machine profile's age; mpi4py against mpiexec. Exits 1 "
        "on an error; --json for scripts.",
        False,
    ),
}


def _add_dist_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("distributed set-up")
    group.add_argument("--device", default=None,
                       help="auto (cuda > xpu > mps > cpu), cpu, cuda, cuda:N ... (default: $MESHTRAIN_DEVICE or auto)")
    group.add_argument("--backend", default=None,
                       help="auto (nccl/xccl/gloo to match the device), gloo, nccl ... (default: $MESHTRAIN_BACKEND or auto)")
    group.add_argument("--timeout", type=float, default=None,
                       help="seconds a collective may wait for its peers before failing (default: $MESHTRAIN_TIMEOUT or 600)")


def version_line() -> str:
    """`meshtrain 0.2.0 (torch 2.13.0+cpu)`: torch's version comes from its installed metadata, so that
    `--version` answers without the seconds an import of torch takes."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    return f"meshtrain {__version__} (torch {torch_version})"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only `command`'s module is imported (and its options added), so --help stays quick."""
    parser = argparse.ArgumentParser(
        prog="meshtrain",
        description="Parallel training of AI models on PyTorch's distributed engine, from a laptop to a supercomputer.",
    )
    parser.add_argument("--version", action="version", version=version_line())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, summary, description, takes_dist) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=summary, description=description)
        if name != command:
            continue
        module = importlib.import_module(module_name)
        module.add_arguments(sub)
        if takes_dist:
            _add_dist_arguments(sub)
        sub.set_defaults(handler=module.run)
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line's arguments. Overrides after an option (`plan vit --nodes 4 parallel.tp=4`) are overrides
    still: argparse takes a positional list in one run only."""
    command = next((word for word in argv if not word.startswith("-")), None)
    parser = build_parser(command)
    args, unknown = parser.parse_known_args(argv)
    late = [word for word in unknown if "=" in word and not word.startswith("-")]
    if late and isinstance(getattr(args, "overrides", None), list):
        args.overrides += late
        unknown = [word for word in unknown if word not in late]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def _launched_as() -> tuple[int, int]:
    """(rank, world size) as the launcher's variables give them, before any process group; (0, 1) alone."""
    from meshtrain.runtime.env import LaunchEnvError, detect

    try:
        launch = detect()
    except LaunchEnvError:
        return 0, 1
    return launch.rank, launch.world_size


RANK_0_SAYS_IT_WITHIN_S = 30.0


def _leave_it_to_rank_0(error: Exception, log) -> None:
    """An error every rank meets alike is rank 0's to say. A launcher stops the whole job when its first rank exits
    (torchrun, mpiexec): were this rank to exit first, rank 0, slower to start, would be stopped before it said why.
    So this one waits for rank 0 to fail and the launcher to end it; past RANK_0_SAYS_IT_WITHIN_S (a launcher that
    lets the other ranks run on, srun without --kill-on-bad-exit), it says the error itself."""
    time.sleep(RANK_0_SAYS_IT_WITHIN_S)
    log.error("%s", error)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    # Imported once the arguments are parsed: meshtrain.runtime brings torch in, which --version and --help skip.
    from meshtrain.errors import MeshtrainError
    from meshtrain.runtime.log import configure_logging, get_logger

    rank, world_size = _launched_as()
    configure_logging(rank, world_size)  # until setup() has checked: under torchrun, rank 0 tells the story
    try:
        return int(args.handler(args) or 0)
    except MeshtrainError as e:
        if rank == 0 or not e.same_on_every_rank:  # a bad config fails every rank alike: say it once
            get_logger().error("%s", e)
        else:
            _leave_it_to_rank_0(e, get_logger())
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        # The interpreter's last collections walk torch's whole object graph: 0.5 s a process on a 2-core box. The
        # young garbage is collected here (its finalizers run): the old generation holds torch's modules, walked
        # for 0.2 s a process by a full collection, and the trainer's cycles, which runtime.cleanup() collected
        # before leaving the process group. What is left lives until the process ends.
        gc.collect(1)
        gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
