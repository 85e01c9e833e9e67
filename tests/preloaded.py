"""Python commands of the suite run as processes forked from a server that imported torch and meshtrain once:

    done = preloaded.run([sys.executable, "-m", "meshtrain", "prepare", ...], env=clean_env(), cwd=REPO, timeout=120)

gives what `subprocess.run(argv, capture_output=True, text=True, ...)` gives (a CompletedProcess with the exit code,
stdout and stderr, or TimeoutExpired), for `python -m MODULE ARGS` and `python SCRIPT ARGS`. The process is a child of
multiprocessing's forkserver, which imports PRELOAD when a pytest worker first asks for one: a fresh interpreter
spends about 2.3 CPU seconds importing torch, DTensor, DCP and torch._dynamo before a meshtrain command does anything,
and the suite runs a few hundred of them on two cores. Each command still has a process of its own (its pid, its
environment, its working directory, its exit code), started with nothing from the tests in it.

Not for what needs an interpreter of its own: a `sitecustomize` or `-c` code, a launcher (torchrun, mpirun, srun:
forked_ranks.py is the exception, run here, whose ranks fork from it), or a process the test signals or reads while
it runs (those use subprocess).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from tests.forked_ranks import PRELOAD as RANK_MODULES
from tests.forked_ranks import run_as_main

PRELOAD = [*RANK_MODULES, "torch.distributed.launcher.api", "tests.forked_ranks", "tests.preloaded"]
_server: multiprocessing.context.BaseContext | None = None


def _context():
    global _server
    if _server is None:
        _server = multiprocessing.get_context("forkserver")
        _server.set_forkserver_preload(PRELOAD)
    return _server


def run(argv: list[str], *, env: dict[str, str], cwd: str | Path, timeout: float) -> subprocess.CompletedProcess:
    """`argv` ([sys.executable, "-m", MODULE, ...] or [sys.executable, SCRIPT, ...]) in a forked process; the whole
    process group is killed at `timeout` (then TimeoutExpired, with what it had written)."""
    with tempfile.TemporaryDirectory(prefix="meshtrain-preloaded-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        process = _context().Process(target=_child, args=(argv[1:], env, str(cwd), str(out), str(err)))
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.join()
            raise subprocess.TimeoutExpired(argv, timeout, _read(out), _read(err))
        return subprocess.CompletedProcess(argv, process.exitcode, _read(out), _read(err))


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _child(args: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """The interpreter's own run of `python ARGS`, in the state a fresh one would be in: its own process group (so a
    timeout kills whatever it starts), the environment and directory asked for, stdout and stderr to files."""
    os.setsid()
    multiprocessing.set_start_method(None, force=True)  # the server's "forkserver" default is not a fresh interpreter's
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # OpenMP read the server's environment when torch loaded: the thread count this environment would give
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.stdin = open(os.devnull)  # noqa: SIM115
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
    os._exit(_main(args))


def _main(args: list[str]) -> int:
    """`python -m MODULE ARGS` or `python SCRIPT ARGS` as the interpreter runs it (forked_ranks.run_as_main); the exit
    code it would end with (an uncaught exception: its traceback, then 1)."""
    try:
        run_as_main(args)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else _said(stop.code))
    except BaseException:  # noqa: BLE001  (what the interpreter does with it)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _said(message) -> int:
    print(message, file=sys.stderr)  # sys.exit("text"): the interpreter prints it and exits 1
    return 1
