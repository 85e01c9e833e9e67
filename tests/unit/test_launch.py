"""`meshtrain launch` command building under synthetic PBS / SLURM / local environments."""

import os
import sys
import time
from pathlib import Path

import pytest
from tests import preloaded
from tests.conftest import clean_env

from meshtrain.runtime import launch
from meshtrain.runtime.env import LaunchEnvError
from meshtrain.runtime.launch import Machine, build_command, relaunch
from meshtrain.train import faults

GPU_NODE = Machine(accelerators=4, cpus=64)
CPU_BOX = Machine(accelerators=0, cpus=2)
USER = ["python", "-m", "meshtrain", "test-dist"]
PY = sys.executable


@pytest.fixture
def pbs(tmp_path):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("x1\nx2\n")
    return {"PBS_JOBID": "1.polaris", "PBS_NODEFILE": str(nodefile)}


def test_pbs_pals_mpiexec_uses_hostfile_ppn_and_depth_binding(pbs):
    argv = build_command(USER, environ=pbs, machine=GPU_NODE, flavor="pals")
    assert argv == ["mpiexec", "-n", "8", "--ppn", "4", "--hostfile", pbs["PBS_NODEFILE"], "--depth", "16",
                    "--cpu-bind", "depth", "--envall", PY, "-m", "meshtrain", "test-dist"]


def test_pbs_ranks_per_node_come_from_the_nodefile_slots_on_a_cpu_node(tmp_path):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("x1\n" * 4 + "x2\n" * 4)  # select=2:mpiprocs=4: one line per slot
    env = {"PBS_JOBID": "2.pbs", "PBS_NODEFILE": str(nodefile)}
    argv = build_command(USER, environ=env, machine=CPU_BOX, flavor="pals")
    assert argv[:5] == ["mpiexec", "-n", "8", "--ppn", "4"]
    assert build_command(USER, nproc=8, environ=env, machine=CPU_BOX, flavor="pals")[:5] == argv[:5]
    with pytest.raises(LaunchEnvError, match="-n 9 needs 3 nodes at --ppn 4"):
        build_command(USER, nproc=9, environ=env, machine=CPU_BOX, flavor="pals")
    # accelerators, where a node has them, say how many ranks it runs
    assert build_command(USER, environ=env, machine=Machine(accelerators=2, cpus=8), flavor="pals")[:5] == \
        ["mpiexec", "-n", "4", "--ppn", "2"]


def test_pbs_explicit_n_and_ppn(pbs):
    argv = build_command(USER, nproc=4, ppn=2, environ=pbs, machine=GPU_NODE, flavor="pals")
    assert argv[:5] == ["mpiexec", "-n", "4", "--ppn", "2"] and argv[argv.index("--depth") + 1] == "32"


def test_pbs_openmpi_and_mpich_flavours(pbs):
    ompi = build_command(USER, environ=pbs, machine=GPU_NODE, flavor="openmpi")
    assert ompi[:7] == ["mpiexec", "-n", "8", "--map-by", "ppr:4:node:PE=16", "--bind-to", "core"]
    assert ompi[ompi.index("--hostfile") + 1] == pbs["PBS_NODEFILE"]
    forwarded = build_command(USER, environ={**pbs, "PATH": "/bin", "PYTHONPATH": "/src"}, machine=GPU_NODE,
                              flavor="openmpi")
    assert [forwarded[i + 1] for i, arg in enumerate(forwarded) if arg == "-x"] == ["PATH", "PYTHONPATH"]
    mpich = build_command(USER, environ=pbs, machine=GPU_NODE, flavor="mpich")
    assert mpich[:7] == ["mpiexec", "-n", "8", "-ppn", "4", "-f", pbs["PBS_NODEFILE"]]


def test_more_ranks_than_the_job_holds_is_an_error(pbs):
    with pytest.raises(LaunchEnvError, match="-n 16 needs 4 nodes at --ppn 4, but the job has 2"):
        build_command(USER, nproc=16, environ=pbs, machine=GPU_NODE, flavor="pals")


def test_slurm_srun_nodes_tasks_gpus():
    env = {"SLURM_JOB_ID": "55", "SLURM_JOB_NODELIST": "gpu[01-03]", "SLURM_NNODES": "3"}
    argv = build_command(USER, environ=env, machine=GPU_NODE)
    assert argv == ["srun", "--nodes=3", "--ntasks=12", "--ntasks-per-node=4", "--cpus-per-task=16",
                    "--cpu-bind=cores", "--kill-on-bad-exit=1", "--gpus-per-node=4", PY, "-m", "meshtrain",
                    "test-dist"]  # a first attempt takes its CPUs for itself (no --overlap)


def test_slurm_cpu_nodes_take_the_schedulers_tasks_per_node():
    env = {"SLURM_JOB_ID": "55", "SLURM_JOB_NODELIST": "cn[1-2]", "SLURM_NTASKS_PER_NODE": "8"}
    argv = build_command(USER, environ=env, machine=Machine(accelerators=0, cpus=64))
    assert argv[1:6] == ["--nodes=2", "--ntasks=16", "--ntasks-per-node=8", "--cpus-per-task=8", "--cpu-bind=cores"]
    assert not any(a.startswith("--gpus") for a in argv)


def test_slurm_ranks_share_the_cpus_the_job_holds_on_a_node_not_all_of_its_cpus():
    """A job of 2 tasks per node without --exclusive holds 2 CPUs of each node, and srun refuses a step that asks
    for more: each rank gets 1, not half of the node's 64 (the fewest, where the job's nodes differ)."""
    env = {"SLURM_JOB_ID": "55", "SLURM_JOB_NODELIST": "cn[1-2]", "SLURM_NTASKS_PER_NODE": "2",
           "SLURM_JOB_CPUS_PER_NODE": "2(x2)"}
    assert "--cpus-per-task=1" in build_command(USER, environ=env, machine=Machine(accelerators=0, cpus=64))
    env.update(SLURM_JOB_NODELIST="cn[1-3]", SLURM_JOB_CPUS_PER_NODE="16,8(x2)")
    assert "--cpus-per-task=4" in build_command(USER, environ=env, machine=Machine(accelerators=0, cpus=64))


def test_slurm_fewer_ranks_than_nodes_uses_fewer_nodes():
    env = {"SLURM_JOB_ID": "55", "SLURM_JOB_NODELIST": "gpu[01-04]"}
    assert build_command(USER, nproc=4, environ=env, machine=GPU_NODE)[1:3] == ["--nodes=1", "--ntasks=4"]


@pytest.mark.parametrize("machine,nproc,expected_n", [(CPU_BOX, None, 2), (GPU_NODE, None, 4), (CPU_BOX, 3, 3)])
def test_local_torchrun(machine, nproc, expected_n):
    argv = build_command(USER, nproc=nproc, environ={}, machine=machine)
    assert argv[0].endswith("torchrun")
    assert argv[1:] == ["--standalone", f"--nproc-per-node={expected_n}", "-m", "meshtrain", "test-dist"]


def test_local_torchrun_script_and_non_python_commands():
    assert build_command(["python", "train.py", "--x"], environ={}, machine=CPU_BOX)[3:] == ["train.py", "--x"]
    assert build_command(["./run.sh"], environ={}, machine=CPU_BOX)[3:] == ["--no-python", "./run.sh"]


def test_empty_command_and_unknown_launcher_are_errors():
    with pytest.raises(LaunchEnvError, match="nothing to launch"):
        build_command([], environ={}, machine=CPU_BOX)
    with pytest.raises(LaunchEnvError, match="unknown launcher 'aprun'"):
        build_command(USER, launcher="aprun", environ={"SLURM_JOB_ID": "1"}, machine=CPU_BOX)


def _cli(*args, env):
    return preloaded.run([sys.executable, "-m", "meshtrain", *args], env=env, cwd=os.getcwd(), timeout=120)


@pytest.mark.distributed  # starts `python -m meshtrain`
def test_dry_run_cli_under_slurm_prints_the_srun_line():
    # A CPU node, so the tasks per node come from SLURM (on a GPU node they are its GPUs: CUDA hidden here).
    env = clean_env(SLURM_JOB_ID="9", SLURM_JOB_NODELIST="nid[001-002]", SLURM_NTASKS_PER_NODE="2",
                    CUDA_VISIBLE_DEVICES="")
    out = _cli("launch", "--dry-run", "--", "python", "-m", "meshtrain", "test-dist", env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:4] == ["srun", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2"]
    assert out.stdout.split()[-3:] == ["-m", "meshtrain", "test-dist"]


@pytest.mark.distributed  # starts `python -m meshtrain`
def test_dry_run_cli_under_pbs_prints_the_mpiexec_line(tmp_path):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("h1\nh2\nh3\n")
    env = clean_env(PBS_JOBID="3.pbs", PBS_NODEFILE=str(nodefile))
    out = _cli("launch", "--dry-run", "--mpi", "pals", "--ppn", "4", "--", "python", "-m", "meshtrain", "x", env=env)
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()
    assert words[:7] == ["mpiexec", "-n", "12", "--ppn", "4", "--hostfile", str(nodefile)]


@pytest.mark.distributed  # starts `python -m meshtrain`
def test_cli_error_is_one_clear_line(tmp_path):
    env = clean_env(PBS_JOBID="3.pbs", PBS_NODEFILE=str(tmp_path / "missing"))
    out = _cli("launch", "--dry-run", "--", "python", "x.py", env=env)
    assert out.returncode == 1
    assert "Traceback" not in out.stdout + out.stderr
    assert "cannot read the hostfile" in out.stdout


def test_restarts_torchrun_by_flag_and_mpiexec_by_running_it_again(tmp_path, capsys):
    argv = build_command(USER, environ=clean_env(), machine=CPU_BOX, max_restarts=3)
    assert "--max-restarts=3" in argv and argv.index("--max-restarts=3") < argv.index("-m")
    # attempts 0 and 1 fail, attempt 2 succeeds: each sees its attempt number, as torchrun's workers do
    script = 'echo "$MESHTRAIN_RESTART_COUNT" >> {log}; [ "$MESHTRAIN_RESTART_COUNT" -ge 2 ]'.format(
        log=tmp_path / "attempts")
    assert relaunch(["sh", "-c", script], max_restarts=3) == 0
    assert (tmp_path / "attempts").read_text().split() == ["0", "1", "2"]
    assert "attempt 1 failed with exit code 1" in capsys.readouterr().out
    assert relaunch(["sh", "-c", "exit 4"], max_restarts=1) == 4  # out of restarts: the last failure is the job's
    assert relaunch(["sh", "-c", "echo again >> {}; exit 75".format(tmp_path / "preempted")], max_restarts=3) == 75
    assert (tmp_path / "preempted").read_text().split() == ["again"]  # preempted: not restarted


def test_hosts_that_answer_are_those_whose_probe_succeeds_in_time(monkeypatch):
    monkeypatch.setattr(launch, "PROBE_S", 1.0)
    probes = {"up": ["true"], "refuses": ["false"], "hangs": ["sleep", "30"]}
    started = time.monotonic()
    assert launch.answering(["up", "refuses", "hangs", "up2"], lambda host: probes.get(host, ["true"])) == ["up", "up2"]
    assert time.monotonic() - started < 10, "a host that hangs is given up after PROBE_S"
    assert launch._probe("mpiexec", "openmpi", "x3") == ["mpiexec", "-n", "1", "--host", "x3", "true"]
    assert launch._probe("srun", "auto", "x3") == ["srun", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=x3",
                                                   "true"]


def test_a_restart_goes_on_with_the_hosts_that_answer(tmp_path, monkeypatch, capsys):
    """A PBS job's nodefile is written again with the hosts left (their slots kept) in the job's directory, a SLURM
    job's node list narrowed; the launcher's command is built for them; none left is one clear error."""
    monkeypatch.chdir(tmp_path)
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("x1\nx1\nx2\nx2\nx3\nx3\n")
    pbs = {"PBS_JOBID": "9.pbs", "PBS_NODEFILE": str(nodefile)}
    monkeypatch.setattr(launch, "answering", lambda hosts, probe: [h for h in hosts if h != "x2"])
    env = launch.on_hosts_that_answer(pbs, "mpiexec", "pals", attempt=1)
    assert env["PBS_NODEFILE"] == str(tmp_path / ".meshtrain" / "nodefile-9.pbs-attempt1")
    assert Path(env["PBS_NODEFILE"]).read_text() == "x1\nx1\nx3\nx3\n"
    assert build_command(USER, environ=env, machine=CPU_BOX, flavor="pals")[:5] == ["mpiexec", "-n", "4", "--ppn", "2"]
    assert "x2 did not answer mpiexec within 30 s; going on with x1, x3" in capsys.readouterr().out
    slurm = {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "x[1-3]", "SLURM_NODELIST": "x[1-3]", "SLURM_NNODES": "3",
             "SLURM_JOB_NUM_NODES": "3"}
    narrowed = launch.on_hosts_that_answer(slurm, "srun", "auto", attempt=1)
    assert narrowed["SLURM_JOB_NODELIST"] == "x1,x3" and "SLURM_NODELIST" not in narrowed
    assert narrowed["SLURM_NNODES"] == narrowed["SLURM_JOB_NUM_NODES"] == "2"
    # the restarted step shares the CPUs that the failed step, left RUNNING by the lost node, still holds
    assert build_command(USER, environ=narrowed, machine=GPU_NODE, restart=True)[:8] == [
        "srun", "--nodes=2", "--ntasks=8", "--ntasks-per-node=4", "--cpus-per-task=16", "--cpu-bind=cores",
        "--kill-on-bad-exit=1", "--overlap"]
    monkeypatch.setattr(launch, "answering", lambda hosts, probe: [])
    with pytest.raises(LaunchEnvError, match=r"none of the job's hosts \(x1, x2, x3\) runs `true` through mpiexec"):
        launch.on_hosts_that_answer(pbs, "mpiexec", "pals", attempt=2)


def test_fault_specs_parse_and_fire_in_their_attempt_only(monkeypatch):
    assert faults.parse("kill:rank=1:step=13, kill:rank=0:step=27:attempt=1") == [
        faults.Fault("kill", rank=1, step=13), faults.Fault("kill", rank=0, step=27, attempt=1)]
    for bad in ("kill:rank=1", "stop:rank=1:step=2", "kill:rank=one:step=2", "kill:rank=1:step=2:when=3"):
        with pytest.raises(faults.FaultSpecError, match=r"each fault is kill\|signal:rank=R:step=S"):
            faults.parse(bad)
    monkeypatch.setenv("MESHTRAIN_FAULT", "kill:rank=1:step=13,kill:rank=0:step=27:attempt=1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert [f.step for f in faults.Drill(rank=0).faults] == [27] and faults.Drill(rank=1).faults == []
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert [f.step for f in faults.Drill(rank=1).faults] == [13]


def test_mpiexec_outside_a_scheduler_puts_every_rank_on_this_node():
    argv = build_command(USER, nproc=3, launcher="mpiexec", environ={}, machine=CPU_BOX, flavor="openmpi")
    assert argv[:5] == ["mpiexec", "-n", "3", "--map-by", "ppr:3:node:PE=1"]
    assert build_command(USER, launcher="mpiexec", environ={}, machine=CPU_BOX, flavor="mpich")[:5] == \
        ["mpiexec", "-n", "2", "-ppn", "2"]


def test_an_elastic_job_is_torchrun_with_c10d_rendezvous_on_every_node():
    """--nnodes MIN:MAX: the same torchrun command on each node, meeting at --rdzv-endpoint, under the job's id, with
    a rendezvous that gives up on a silent node after 3 s and waits 10 s for late ones (not torch's 15 s and 30 s),
    each round with a store of its own (torch's shared one fails a node that joins later)."""
    env = {"SLURM_JOB_ID": "77"}
    argv = build_command(USER, ppn=4, launcher="torchrun", environ=env, machine=GPU_NODE, max_restarts=2,
                         nnodes="1:2", rendezvous="node0:29400")
    assert argv[:2] == ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"] and argv[2].endswith("torchrun")
    assert argv[3:] == ["--nnodes=1:2", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29400", "--rdzv-id=77",
                        "--rdzv-conf=last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3",
                        "--nproc-per-node=4", "--max-restarts=2", "-m", "meshtrain", "test-dist"]
    with pytest.raises(LaunchEnvError, match="--nnodes 1:2 needs --rdzv-endpoint HOST:PORT"):
        build_command(USER, launcher="torchrun", environ=env, machine=GPU_NODE, nnodes="1:2")
