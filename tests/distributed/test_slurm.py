"""`meshtrain launch` under a real SLURM: slurmctld and a slurmd per node on the network-namespace nodes of
tests/netns.py (tests/slurm.py), jobs asked for with salloc from node 0 as a user asks from a login node, and srun
starting the ranks on both nodes. Skipped, saying why, where SLURM or namespaces cannot run (root; .ci/run installs
Debian's SLURM and munge)."""

from __future__ import annotations

import re
import sys
import time

import pytest
from tests.conftest import ANSI, RESUMABLE_GPT, assert_follows_the_uninterrupted_run, lines_until_iteration
from tests.netns import Cluster
from tests.slurm import Slurm, why_not

pytestmark = pytest.mark.skipif(why_not() is not None, reason=f"no SLURM on namespace nodes here: {why_not()}")
LAUNCH = [sys.executable, "-m", "meshtrain", "launch"]


@pytest.fixture(scope="module")
def slurm():
    with Cluster(2) as cluster, Slurm(cluster) as running:
        yield running


def salloc(slurm: Slurm, cwd, *argv: str, options: tuple[str, ...] = ()):
    """`salloc --nodes=2 --ntasks-per-node=2 OPTIONS ARGV` from node 0: ARGV runs there, inside the allocation."""
    return slurm.cluster.start(0, ["salloc", "--nodes=2", "--ntasks-per-node=2", *options, *argv],
                               slurm.env(MESHTRAIN_TIMEOUT="60"), cwd)


def test_an_srun_job_that_loses_a_node_is_run_again_on_the_one_left(slurm, uninterrupted_gpt, tmp_path):
    """An allocation of 2 nodes × 2 tasks kept when a node fails (--no-kill), under `meshtrain launch
    --max-restarts 1`: launch writes srun's command from SLURM's variables and srun starts 2 ranks on each node,
    which meet at the allocation's first node. Node 1 is lost for good at iteration 12 (its slurmd with it). Launch
    asks each host to run `true` through srun, narrows the job's node list to node 0 and runs srun there: 2 ranks
    resume the checkpoint of iteration 10 with the accumulation doubled, following the uninterrupted 4-rank run."""
    data_root, uninterrupted = uninterrupted_gpt
    job = salloc(slurm, tmp_path, *LAUNCH, "--max-restarts", "1", "--", "python", "-m", "meshtrain", *RESUMABLE_GPT,
                 f"data.root={data_root}", "train.init_from=auto", f"train.out_dir={tmp_path}", options=("--no-kill",))
    lines = lines_until_iteration(job, 12)
    slurm.cluster.lose(1)
    lost = time.monotonic()
    lines += job.stdout.readlines()
    job.wait(timeout=300)
    text = ANSI.sub("", "".join(lines))
    assert job.returncode == 0, text[-4000:] + slurm.logs()
    # launch wrote srun's command from SLURM's variables; the ranks met at the allocation's first node
    assert re.search(r"^srun --nodes=2 --ntasks=4 --ntasks-per-node=2 ", text, re.MULTILINE), text[:1000]
    assert re.search(r"│ hosts\s+│ node0, node1 ", text), text[:3000]
    assert re.search(r"│ rendezvous\s+│ first host of the slurm job, port derived from job \d+\.0 ", text), text[:3000]
    assert "meshtrain launch: node1 did not answer srun within 30 s; going on with node0" in text, text[-3000:]
    assert re.search(r"^srun --nodes=1 --ntasks=2 --ntasks-per-node=2 ", text, re.MULTILINE), text[-3000:]
    assert "resuming at iteration 10" in text and "× accumulation 2: global batch 16" in text, text[-3000:]
    assert_follows_the_uninterrupted_run(tmp_path, uninterrupted)
    print(f"node lost at iteration 12: done on the node left {time.monotonic() - lost:.1f} s later")
