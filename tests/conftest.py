"""Shared helpers: run meshtrain under a real launcher (torchrun / mpirun) on this machine."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[\d;]*m")


def output(proc: subprocess.CompletedProcess) -> str:
    """stdout + stderr without colour codes (under mpirun, rich sees a terminal and colours its tables)."""
    return ANSI.sub("", proc.stdout + proc.stderr)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment minus any launcher/scheduler variables the test runner itself might carry."""
    prefixes = ("SLURM_", "PBS_", "OMPI_", "PMI_", "PMIX_", "PALS_", "MPI_LOCAL", "TORCHELASTIC_")
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in names}
    env.update(PYTHONUNBUFFERED="1", MESHTRAIN_DEVICE="cpu", OMP_NUM_THREADS="1", **extra)
    return env


def torchrun(nproc: int, *args: str, timeout: float = 120, env: dict[str, str] | None = None):
    """`torchrun --standalone --nproc-per-node nproc -m meshtrain ARGS`; returns the CompletedProcess."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "meshtrain", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or clean_env(), cwd=REPO)


def mpirun(nproc: int, *args: str, timeout: float = 120, env: dict[str, str] | None = None):
    """`mpirun -n nproc python -m meshtrain ARGS` (Open MPI flags; runs as root in CI)."""
    cmd = ["mpirun", "-n", str(nproc), "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += [sys.executable, "-m", "meshtrain", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or clean_env(), cwd=REPO)


requires_mpirun = pytest.mark.skipif(
    shutil.which("mpirun") is None, reason="mpirun not found: install Debian's openmpi-bin (.ci/run does)"
)


# A parity driver prints one line per case per rank, "CASE rank R: ... -> EQUAL|DIFFERENT". Rank outputs
# interleave, so each line is parsed wherever it lands.
VERDICT = re.compile(r"^(\S+) rank (\d+): .* -> (EQUAL|DIFFERENT)$", re.MULTILINE)


def assert_driver_equal(script: str | Path, cases: list[str], ranks: int, what: str, timeout: float) -> None:
    """torchrun the parity driver `script` over `cases` on `ranks` ranks; every rank of every case must be EQUAL
    (`what` says what EQUAL means, for the failure message)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(script),
           *cases]
    out = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), cwd=REPO, timeout=timeout)
    text = output(out)
    assert out.returncode == 0, text[-3000:]
    seen = {(case, int(rank)): verdict for case, rank, verdict in VERDICT.findall(text)}
    for case in cases:
        for rank in range(ranks):
            assert seen.get((case, rank)) == "EQUAL", f"{case} on rank {rank}: {what}\n" + text[-3000:]

