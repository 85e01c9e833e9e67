"""Two nodes for real: network namespaces with their own addresses and host names (tests/netns.py), started as users
start jobs on a cluster: one torchrun per node meeting through c10d rendezvous, or `meshtrain launch` in a PBS job
writing mpiexec's command. Skipped, saying why, where namespaces cannot be made (they need root: CI runs as root)."""

from __future__ import annotations

import re
import sys
import time

import pytest
from tests.conftest import (
    ANSI,
    REPO,
    RESUMABLE_GPT,
    assert_follows_the_uninterrupted_run,
    clean_env,
    lines_until_iteration,
    prepare_data,
    requires_mpirun,
)
from tests.netns import Cluster, why_not

pytestmark = pytest.mark.skipif(why_not() is not None, reason=f"no network namespaces here: {why_not()}")
GPT = ["model.n_layer=2", "model.n_head=4", "model.n_embd=64", "model.block_size=64", "model.dropout=0.0",
       "train.eval_iters=1", "train.dtype=fp32", "train.log_interval=1"]


@pytest.fixture(scope="module")
def cluster():
    with Cluster(2) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return prepare_data(tmp_path_factory.mktemp("data"))


def torchrun_on(cluster: Cluster, node: int, job: str, *args: str):
    return cluster.torchrun(node, job, list(args), clean_env(MESHTRAIN_TIMEOUT="60"), REPO)


def pbs_job_env(cluster: Cluster, tmp_path, job_id: str) -> dict[str, str]:
    """A PBS job of 2 nodes × 2 slots (its nodefile: one line per slot, as PBS writes it with mpiprocs=2), whose
    Open MPI starts node 1's ranks through its remote agent (here `ip netns exec` in place of ssh)."""
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("node0\nnode0\nnode1\nnode1\n")
    return clean_env(MESHTRAIN_TIMEOUT="60", PBS_NODEFILE=str(nodefile), PBS_JOBID=job_id,
                     OMPI_MCA_plm_rsh_agent=str(cluster.remote_shell(tmp_path / "rsh")),
                     OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def elastic_launch(cluster: Cluster, data_root, out_dir) -> list[str]:
    """`meshtrain launch --nnodes 1:2` of RESUMABLE_GPT, resuming with init_from=auto: the same on each node."""
    return [sys.executable, "-m", "meshtrain", "launch", "--nnodes", "1:2", "--ppn", "2", "--max-restarts", "1",
            "--rdzv-endpoint", f"{cluster.host(0)}:29400", "--", "python", "-m", "meshtrain", *RESUMABLE_GPT,
            f"data.root={data_root}", "train.init_from=auto", f"train.out_dir={out_dir}"]


def test_test_dist_across_two_nodes(cluster):
    jobs = [torchrun_on(cluster, node, "testdist", "test-dist") for node in (0, 1)]
    outs = [job.communicate(timeout=240)[0] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert re.search(r"│ num_nodes\s+│ 2 ", outs[0]) and re.search(r"│ hosts\s+│ node0, node1 ", outs[0]), outs[0]
    assert "test-dist passed: 4 rank(s) on 2 node(s) hold bit-identical parameters" in outs[0]


@requires_mpirun
def test_launch_under_pbs_starts_mpiexec_across_two_nodes(cluster, tmp_path):
    """A PBS job of 2 nodes × 2 slots: `meshtrain launch` reads the nodefile and writes mpiexec's command, Open MPI
    starts node 1's ranks, and the ranks meet at the nodefile's first host on a port derived from the job id,
    without talking first."""
    env = pbs_job_env(cluster, tmp_path, "4242.pbs01")
    nodefile = env["PBS_NODEFILE"]
    job = cluster.start(0, [sys.executable, "-m", "meshtrain", "launch", "--", "python", "-m", "meshtrain",
                            "test-dist"], env, REPO)
    out = ANSI.sub("", job.communicate(timeout=240)[0])
    assert job.returncode == 0, out[-3000:]
    assert re.match(rf"mpiexec -n 4 --map-by ppr:2:node:PE=\d+ --bind-to core --hostfile {nodefile} ", out), out[:500]
    assert re.search(r"│ rendezvous\s+│ first host of the pbs job, port derived from job 4242", out), out[:3000]
    assert "test-dist passed: 4 rank(s) on 2 node(s) hold bit-identical parameters" in out


def test_fsdp_x_tp_keeps_tensor_parallel_traffic_inside_a_node(cluster, data_root, tmp_path):
    """fsdp × tp=2 on 2 nodes × 2 ranks, tp named first in the order: each node holds a whole tp group, and only
    FSDP's traffic crosses: per iteration, each of the 2 cross-node dp pairs all-gathers its half of the weights
    twice (forward, backward) and reduce-scatters the gradients. That is 3 × the model's parameter bytes with a
    native reduce-scatter, 4 × where gloo does it as an all-reduce, plus TCP/IP headers. The tensor-parallel
    all-reduces of activations would add about 4 × batch × block × n_embd × 4 bytes per all-reduce (8 of them a
    step), far more than that (benchmarks/cross_node_bytes.py: 20 × with tp across the nodes)."""
    args = ["train", "gpt", *GPT, "model.batch_size=16", f"data.root={data_root}", f"train.out_dir={tmp_path}",
            "train.backend=fsdp", "parallel.tp=2", "parallel.order=tp-cp-dp-pp", "train.max_iters=14",
            "train.eval_interval=1000", "train.save_checkpoints=false"]
    jobs = [torchrun_on(cluster, node, "fsdptp", *args) for node in (0, 1)]
    text, sent = cluster.sent_at_steps(jobs[0], {4, 14})  # the steady state between
    other = jobs[1].communicate(timeout=120)[0]
    assert [job.returncode for job in jobs] == [0, 0], text[-3000:] + other[-2000:]
    from meshtrain.config import load_config
    from meshtrain.plan.workload import ModelFacts

    param_bytes = 4 * ModelFacts.of(load_config(args[2:], "gpt")).num_params
    per_iteration = (sent[14] - sent[4]) / 10  # 4.5 × here (headers: ~5% more on a 1500-byte MTU)
    tensor_parallel = 8 * 4 * 16 * 64 * 64 * 4  # what tp's all-reduces would add, were tp across the nodes
    assert 3 * param_bytes < per_iteration < 6 * param_bytes < tensor_parallel, (per_iteration, param_bytes)


def test_an_elastic_job_that_loses_a_node_goes_on_on_the_one_left_as_if_uninterrupted(cluster, uninterrupted_gpt,
                                                                                      tmp_path):
    """`meshtrain launch --nnodes 1:2` on each of 2 nodes × 2 ranks; node 1 dies at iteration 12. Node 0's ranks name
    the lost peer, torchrun's agent there restarts them on the node left, and train.init_from=auto resumes the
    checkpoint of iteration 10 on 2 ranks, with the accumulation doubled (train.global_batch_size). The losses follow
    a 4-rank run that was never interrupted (within 1e-4), and the sample ledger is identical."""
    data_root, uninterrupted = uninterrupted_gpt
    launch = elastic_launch(cluster, data_root, tmp_path)
    # node 1's ranks (whichever ranks the rendezvous gives them) wait as iteration 13 fetches its batch until they
    # die: node 0 cannot finish 13, so the attempt has done iterations 11 and 12 past the checkpoint of 10 however
    # late this test reads iteration 12's line (under load it read it as the job went on to 14)
    held = ",".join(f"hold:rank={rank}:step=13:phase=data" for rank in range(4))
    jobs = [cluster.start(node, launch, clean_env(MESHTRAIN_TIMEOUT="60", **({"MESHTRAIN_FAULT": held} if node else {})),
                          REPO) for node in (0, 1)]
    lines = lines_until_iteration(jobs[0], 12)
    cluster.kill(1)  # node 1 and every process on it die at once
    lost = time.monotonic()
    lines += jobs[0].stdout.readlines()
    jobs[0].wait(timeout=300)
    text = ANSI.sub("", "".join(lines))
    assert jobs[0].returncode == 0, text[-4000:]
    assert "lost its connection to a peer rank, which most likely died" in text, text[-3000:]
    assert re.search(r"resuming at iteration 10\b", text) and "× accumulation 2: global batch 16" in text, text[-3000:]
    assert re.search(r"restart: the previous attempt had done 2 iteration\(s\) past this checkpoint", text), text[-3000:]

    assert_follows_the_uninterrupted_run(tmp_path, uninterrupted)
    print(f"node lost at iteration 12: done on the node left {time.monotonic() - lost:.1f} s later")


def test_an_elastic_job_grows_when_a_node_joins_later(cluster, uninterrupted_gpt, tmp_path):
    """Node 0 starts an elastic job alone (2 ranks, accumulation 2); node 1 joins once iteration 6 is logged: the
    agents restart the ranks to admit it (torchrun stops them with SIGTERM, so they checkpoint the iteration they
    are in), and the job goes on over both nodes from that checkpoint (4 ranks, accumulation 1), following the
    uninterrupted 4-rank run. Rank 1 holds iteration 7 until that signal (a fault drill, `hold`), so the join
    lands mid-run however long node 1 takes to start on this machine, under any load (a lag per batch derived
    from a measured rendezvous was once outrun: the join came after the last iteration). The held ranks wait in
    a collective meanwhile: MESHTRAIN_TIMEOUT=120 only bounds a join that never comes."""
    data_root, uninterrupted = uninterrupted_gpt
    launch = elastic_launch(cluster, data_root, tmp_path)
    env = clean_env(MESHTRAIN_TIMEOUT="120", MESHTRAIN_FAULT="hold:rank=1:step=7:phase=data")
    first = cluster.start(0, launch, env, REPO)
    lines = lines_until_iteration(first, 6)
    joined = time.monotonic()
    second = cluster.start(1, launch, env, REPO)
    lines += first.stdout.readlines()
    first.wait(timeout=300)
    second_text = second.communicate(timeout=60)[0]
    text = ANSI.sub("", "".join(lines))
    assert [first.returncode, second.returncode] == [0, 0], text[-3000:] + second_text[-2000:]
    assert re.findall(r"layout: ddp over (\d) rank\(s\)", text) == ["2", "4"], text[-3000:]
    assert "stopped by a signal (SIGTERM on this rank) after iteration 7, with a checkpoint" in text, text[-3000:]
    assert "resuming at iteration 7" in text, text[-3000:]  # nothing done twice
    assert "× accumulation 2: global batch 16" in text and "× accumulation 1: global batch 16" in text
    assert re.search(r"done: 30 iterations, train loss [\d.]+, val loss [\d.]+\n", text), text[-3000:]
    assert_follows_the_uninterrupted_run(tmp_path, uninterrupted)
    print(f"node 1 joined after iteration 6; stopped at 7, resumed over both nodes, done "
          f"{time.monotonic() - joined:.1f} s later")


@requires_mpirun
def test_an_mpiexec_job_that_loses_a_node_is_run_again_on_the_one_left(cluster, uninterrupted_gpt, tmp_path):
    """A PBS job of 2 nodes × 2 slots under `meshtrain launch --max-restarts 1` (mpiexec has no restarts of its own);
    node 1 is lost for good at iteration 12. Launch asks each host to run `true` through mpiexec, writes the job's
    nodefile again with node 0 alone, and runs the job there: 2 ranks resume the checkpoint of iteration 10 with the
    accumulation doubled, following the uninterrupted 4-rank run. This test's last use of node 1."""
    data_root, uninterrupted = uninterrupted_gpt
    env = pbs_job_env(cluster, tmp_path, "4343.pbs01")
    job = cluster.start(0, [sys.executable, "-m", "meshtrain", "launch", "--max-restarts", "1", "--", "python", "-m",
                            "meshtrain", *RESUMABLE_GPT, f"data.root={data_root}", "train.init_from=auto",
                            f"train.out_dir={tmp_path}"], env, tmp_path)  # the job's directory: it keeps the nodefile
    lines = lines_until_iteration(job, 12)
    cluster.lose(1)
    lines += job.stdout.readlines()
    job.wait(timeout=300)
    text = ANSI.sub("", "".join(lines))
    assert job.returncode == 0, text[-4000:]
    assert "meshtrain launch: node1 did not answer mpiexec within 30 s; going on with node0" in text, text[-3000:]
    rewritten = tmp_path / ".meshtrain" / "nodefile-4343.pbs01-attempt1"
    assert rewritten.read_text() == "node0\nnode0\n" and f"--hostfile {rewritten}" in text
    assert "resuming at iteration 10" in text and "× accumulation 2: global batch 16" in text, text[-3000:]
    assert_follows_the_uninterrupted_run(tmp_path, uninterrupted)
