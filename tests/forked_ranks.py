"""`torchrun --standalone --nproc-per-node N` for the suite's own jobs, with ranks forked from a process that has
imported torch and meshtrain once:

    python tests/forked_ranks.py N -m meshtrain train gpt ...
    python tests/forked_ranks.py N tests/distributed/layout_check.py CASES...
    python tests/forked_ranks.py N --max-restarts=R -m meshtrain train gpt ...     (torchrun's --max-restarts=R)

Why: each rank of a torchrun job is a fresh interpreter that imports torch, DTensor, DCP and torch._dynamo (about
2.3 CPU seconds of the 3 a small training rank costs), and the suite starts hundreds of ranks on two cores. The ranks
are started by torch's own elastic agent (torch.distributed.launcher.api, what torchrun runs), with its rendezvous,
its environment (RANK, WORLD_SIZE, TORCHELASTIC_*, MASTER_ADDR/PORT) and its failure reporting; only the start
method differs: "forkserver", whose server imports PRELOAD once and forks every rank, where torchrun starts a new
interpreter for each. Not "fork" from the agent itself: the agent has threads by then (its rendezvous keep-alive, the
store's server), and a rank forked while one of them held a lock of the C library's waits on it for ever (seen:
getaddrinfo's resolver lock, 1 job in 16). The server is single-threaded: multiprocessing's own (forkserver.main),
started as a fork of this process as it begins, before the agent has a thread, not as multiprocessing starts it (a
fresh interpreter importing PRELOAD again: 2.5 CPU seconds a job here). Run by tests/preloaded.py, this process was
forked from a server that had imported PRELOAD, so a job's ranks import nothing.

Tests whose subject is the launcher itself (signals and restarts, hangs, the documented `torchrun ... test-dist` and
`meshtrain launch ... test-dist` lines) run real torchrun (tests/conftest.py: torchrun_cmd); the docs' other
`meshtrain launch` lines run here the torchrun command that launch's --dry-run prints.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import runpy
import socket
import sys
import uuid
from multiprocessing import connection, forkserver, resource_tracker

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

# What the forkserver imports before it forks the ranks: every module a training rank or a parity driver reaches
# for (one that a job does not use costs the server only).
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "torch.distributed.pipelining", "torch.distributed.tensor", "meshtrain.commands.train",
           "meshtrain.plan.measured.auto", "meshtrain.train.trainer", "meshtrain.models.vit.workload",
           "torch.distributed.optim"]


def rank_main(argv: list[str]) -> None:
    """One rank: `python -m MODULE ARGS` or `python SCRIPT ARGS`, as the interpreter would run it. An exit of 0 (or
    None) returns, as the elastic agent expects of a finished rank; any other exit code is the rank's failure."""
    # A forkserver's child inherits its parent's start method as the default: a fresh interpreter has none (fork on
    # Linux), and a DataLoader's workers started by a forkserver of their own cost a new interpreter each epoch.
    multiprocessing.set_start_method(None, force=True)
    try:
        run_as_main(argv)
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise


_KEPT: list = []  # what each run_as_main left: never finalized (its docstring)


def run_as_main(argv: list[str]) -> None:
    """`python -m MODULE ARGS` or `python SCRIPT ARGS` in this process, sys.argv and sys.path[0] as the interpreter
    sets them (SystemExit and errors propagate). What the code made stays referenced until the process ends, as it
    does here, by os._exit: unreferenced in the middle of a process (runpy's returned namespace dropped), a script's
    DDP frees its reducer and with it a gloo process group, whose destructor joins its worker thread while holding
    the GIL, and a worker still freeing a finished collective's tensors waits for the GIL: both wait for ever (seen
    in 2 of about 43 runs of a documented 2-rank script on a loaded box; its rank's native stack: ~Reducer,
    ~ProcessGroupGloo, std::thread::join, against AsyncAllgatherWork's destructor in gil_scoped_acquire). An
    interpreter that exits lets no thread take the GIL once it finalizes, so a real run ends there."""
    try:
        if argv[0] == "-m":
            sys.argv, sys.path[0] = argv[1:], os.getcwd()  # as `python -m` sets them
            _KEPT.append(runpy.run_module(argv[1], run_name="__main__", alter_sys=True))
        else:
            sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))  # as `python SCRIPT`
            _KEPT.append(runpy.run_path(argv[0], run_name="__main__"))
    except BaseException as ended:  # its traceback's frames hold the namespace
        _KEPT.append(ended)
        raise


def fork_the_forkserver() -> None:
    """Start multiprocessing's forkserver for this process as a fork of it (module docstring): what
    ForkServer.ensure_running does, with os.fork where it spawns an interpreter. Call it while single-threaded."""
    for name in PRELOAD:  # imported already where tests/preloaded.py forked this process
        importlib.import_module(name)
    resource_tracker.ensure_running()  # its own small interpreter, as ensure_running starts it
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()  # the server exits when its read end sees every client gone
    sys.stdout.flush()  # else the server and every rank would write what is buffered once more
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        try:
            forkserver.main(listener.fileno(), alive_r, [])
        finally:
            os._exit(0)
    os.close(alive_r)
    listener.close()
    server = forkserver._forkserver
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid


def _method_name(depth: int = 2) -> str:
    """dynamic_rendezvous.get_method_name's answer (the name of the function `depth` frames up) without its two
    inspect.stack() calls, which read the source line of every frame on the stack: 0.25 CPU seconds a job here, in
    the agent, on the job's critical path. The name only labels the rendezvous's logged events."""
    return sys._getframe(depth).f_code.co_name


def main() -> int:
    dynamic_rendezvous.get_method_name = _method_name
    ranks, argv = int(sys.argv[1]), sys.argv[2:]
    restarts = int(argv.pop(0).split("=")[1]) if argv[0].startswith("--max-restarts=") else 0  # torchrun's option
    fork_the_forkserver()
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=ranks, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=restarts,
                          start_method="forkserver", monitor_interval=0.1)
    try:
        elastic_launch(config, rank_main)(argv)
    except ChildFailedError as failed:  # the agent has logged each rank's error; the job's exit says it failed
        print(failed.format_msg(), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
