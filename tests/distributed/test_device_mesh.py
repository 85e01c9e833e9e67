"""The DeviceMesh built by ParallelDims, on real processes: its groups are the ones the arithmetic predicts."""

import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, clean_env, output

DRIVER = str(Path(__file__).with_name("mesh_check.py"))


def run_mesh_check(nproc: int, *layouts: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", DRIVER,
           *layouts]
    out = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), cwd=REPO, timeout=180)
    text = output(out)
    assert out.returncode == 0, text[-3000:]
    assert "MISMATCH" not in text, text[-3000:]
    return text


def assert_ok(text: str, nproc: int, layout: str):
    # Ranks share one stdout, so a line may run into the next rank's: match up to whitespace or "[".
    ranks = sorted(int(r) for r in re.findall(rf"\[rank (\d+)\] MESH OK {re.escape(layout)}(?=\s|\[|$)", text))
    assert ranks == list(range(nproc)), text[-3000:]


def test_mesh_groups_match_the_arithmetic_on_4_ranks():
    layouts = ["tp=2,dp_shard=2", "dp_replicate=2,dp_shard=2", "dp_shard=2,cp=2,order=dp-cp-tp-pp",
               "dp_shard=1,pp=2,tp=2"]
    text = run_mesh_check(4, *layouts)
    for layout in layouts:
        assert_ok(text, 4, layout)


def test_mesh_groups_match_the_arithmetic_on_8_ranks():  # ~11 s on 2 cores
    layouts = ["dp_shard=2,tp=2,pp=2", "dp_replicate=2,dp_shard=2,tp=2,order=dp-tp-cp-pp"]
    text = run_mesh_check(8, *layouts)
    for layout in layouts:
        assert_ok(text, 8, layout)
