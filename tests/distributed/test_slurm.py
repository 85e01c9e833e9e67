"""`meshtrain launch` under a real SLURM: slurmctld and a slurmd per node on the network-namespace nodes of
tests/netns.py (tests/slurm.py), jobs asked for with salloc from node 0 as a user asks from a login node, and srun
starting the ranks on both nodes. Skipped, saying why, where SLURM or namespaces cannot run (root; .ci/run installs
Debian's SLURM and munge)."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
from tests.conftest import (
    ANSI,
    RESUMABLE_GPT,
    assert_follows_the_uninterrupted_run,
    lines_until_iteration,
    prepare_data,
)
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


def test_a_job_written_by_submit_runs_under_sbatch_on_the_nodes_slurm_gives_it(slurm, tmp_path):
    """`meshtrain submit --scheduler slurm --nodes 2 --ranks-per-node 2` from node 0, as from a login node: it checks
    the train command, writes the script and queues it with the real sbatch, printing the job id and its log. In the
    job, `meshtrain launch` writes srun's command from SLURM's variables, and the 4 ranks train a short GPT on both
    nodes: the world, the hosts and the job id the ranks find are those SLURM reports for the job."""
    data_root = prepare_data(tmp_path / "data")
    submitted = slurm.cluster.start(0, [sys.executable, "-m", "meshtrain", "submit", "--scheduler", "slurm",
                                        "--nodes", "2", "--ranks-per-node", "2", "--time", "00:10:00", "--",
                                        "python", "-m", "meshtrain", *RESUMABLE_GPT, f"data.root={data_root}",
                                        f"train.out_dir={tmp_path}", "train.max_iters=10"],
                                    slurm.env(MESHTRAIN_TIMEOUT="60"), tmp_path)
    said = ANSI.sub("", submitted.communicate(timeout=120)[0])
    queued = re.search(r"^queued job (\d+) \(slurm\): script (\S+)\nlog: (\S+)$", said, re.MULTILINE)
    assert submitted.returncode == 0 and queued, said + slurm.logs()
    job_id, log = queued[1], Path(queued[3])
    assert log == tmp_path / f"meshtrain-gpt-{job_id}.out"
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n" in Path(queued[2]).read_text()
    state = wait_for_job(slurm, job_id, tmp_path, timeout=400)
    text = ANSI.sub("", log.read_text()) if log.exists() else "(no log)"
    assert state["JobState"] == "COMPLETED", f"{state}\n{text[-4000:]}{slurm.logs()}"
    assert (state["NumNodes"], state["NumTasks"], state["NodeList"]) == ("2", "4", "node[0-1]"), state
    assert re.search(r"^srun --nodes=2 --ntasks=4 --ntasks-per-node=2 ", text, re.MULTILINE), text[:2000]
    for key, value in (("world_size", "4"), ("num_nodes", "2"), ("hosts", "node0, node1"), ("job_id", job_id),
                       ("scheduler", "slurm"), ("launcher", "srun")):
        assert re.search(rf"│ {key}\s+│ {re.escape(value)}\s+│", text), (key, text[:3000])
    assert re.search(r"\] step=10 ", text) and "done: 10 iterations" in text, text[-3000:]


def wait_for_job(slurm: Slurm, job_id: str, cwd, timeout: float) -> dict[str, str]:
    """`scontrol show job`'s fields once the job has left PENDING, RUNNING and COMPLETING (or AssertionError)."""
    deadline = time.monotonic() + timeout
    while True:
        shown = slurm.cluster.start(0, ["scontrol", "show", "job", job_id], slurm.env(), cwd).communicate(timeout=30)[0]
        fields = dict(re.findall(r"(\w+)=(\S+)", shown))
        if fields.get("JobState") not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", None):
            return fields
        assert time.monotonic() < deadline, f"job {job_id} still {fields.get('JobState')} after {timeout:.0f} s"
        time.sleep(2)
