"""`meshtrain doctor`: each check handed a broken value (environment, limit, free bytes, files) and its status and fix
asserted; one run of the command itself, as JSON, for the exit code."""

import json
import os
import resource
import socket
import sys
import time

import numpy as np
import pytest
import torch
from tests import preloaded
from tests.conftest import REPO, clean_env

from meshtrain.data.text import shipped_data_check
from meshtrain.machine.profile import profile_age_check
from meshtrain.runtime import doctor, network
from meshtrain.runtime.doctor import ERROR, OK, WARNING
from meshtrain.runtime.env import detect
from meshtrain.runtime.launch import Machine

GiB = 2**30
CPU_NODE = Machine(accelerators=0, cpus=8)


# ------------------------------------------------------------------------------------------------ software, devices
def test_python_warns_when_python_on_path_is_another_interpreter():
    assert doctor.python_check(path_python=sys.executable).status == OK
    check = doctor.python_check(path_python="/elsewhere/bin/python")
    assert check.status == WARNING and "/elsewhere/bin/python" in check.found and "meshtrain launch" in check.fix


def test_torch_without_cuda_on_a_host_with_an_nvidia_driver_is_an_error():
    assert torch.version.cuda is None, "this test describes the CPU build the unit tier runs on"
    assert doctor.torch_check(nvidia_driver=False) == doctor.Check("torch", OK, f"torch {torch.__version__}, "
                                                                                "CPU-only build")
    check = doctor.torch_check(nvidia_driver=True)
    assert check.status == ERROR and "CUDA build of torch" in check.fix


def test_asking_for_4_gpus_per_node_on_a_cpu_box_is_an_error():
    check = doctor.devices_check(4, None, {})  # the live count: none on the unit tier's CPU box
    assert check.status == ERROR and "no GPU" in check.found and "asks for 4 per node" in check.found
    assert doctor.devices_check(None, None, {}).status == OK


def test_the_gpus_a_slurm_job_asked_for_count_and_ranks_sharing_gpus_warn():
    none_here = {"cuda": 0, "xpu": 0}
    assert doctor.devices_check(None, None, {"SLURM_GPUS_PER_NODE": "a100:4"}, none_here).status == ERROR
    four = {"cuda": 4, "xpu": 0}
    assert doctor.devices_check(None, None, {"SLURM_GPUS_ON_NODE": "4"}, four).found == ("4 cuda devices; the job "
                                                                                          "asks for 4 per node")
    crowded = detect({"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"})
    check = doctor.devices_check(None, crowded, {}, four)
    assert check.status == WARNING and "8 ranks on this node share them" in check.found


# ------------------------------------------------------------------------------------------------ launcher, scheduler
SLURM_JOB = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "nid[001-002]", "SLURM_NNODES": "2",
             "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4"}


def test_a_slurm_batch_script_names_the_job_its_nodes_and_the_srun_layout():
    check = doctor.launcher_check(SLURM_JOB, machine=CPU_NODE)
    assert check.status == OK
    assert "slurm job 77 on 2 nodes; one process" in check.found
    assert "srun --nodes=2 --ntasks=8 --ntasks-per-node=4 --cpus-per-task=2" in check.found


def test_asking_for_more_nodes_than_the_job_has_is_an_error():
    check = doctor.launcher_check(SLURM_JOB, nodes=4, machine=CPU_NODE)
    assert check.status == ERROR and "--nodes 4 asked for, the job has 2" in check.found
    assert "ask the scheduler for 4 nodes" in check.fix
    login_node = doctor.launcher_check({}, nodes=4, machine=CPU_NODE)  # the job is not there yet to count
    assert login_node.status == OK and login_node.found.startswith("no scheduler")
    assert "torchrun --standalone --nproc-per-node=2 -m meshtrain" in login_node.found


def test_a_pbs_job_names_its_hostfile_and_the_mpiexec_layout(tmp_path):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("x1\n" * 4 + "x2\n" * 4)
    env = {"PBS_JOBID": "9.polaris", "PBS_NODEFILE": str(nodefile)}
    check = doctor.launcher_check(env, machine=CPU_NODE, flavor="pals")
    assert check.status == OK and "pbs job 9.polaris on 2 nodes" in check.found
    assert f"mpiexec -n 8 --ppn 4 --hostfile {nodefile} --depth 2" in check.found


def test_a_rank_inside_an_srun_step_reports_its_place_and_a_bad_rank_is_an_error():
    step = {**SLURM_JOB, "SLURM_PROCID": "5", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8",
            "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "4"}
    inside = doctor.launcher_check(step, machine=CPU_NODE).found
    assert inside == "slurm job 77 on 2 nodes; launched by srun: rank 5 of 8, local rank 1 of 4, 2 node(s)"
    check = doctor.launcher_check({"RANK": "9", "WORLD_SIZE": "4"}, machine=CPU_NODE)
    assert check.status == ERROR and "RANK=9 is outside the world of 4" in check.found


# ------------------------------------------------------------------------------------------------ rendezvous, network
def test_a_master_addr_that_does_not_resolve_is_an_error():
    env = {"MASTER_ADDR": "nosuchhost.invalid", "MASTER_PORT": "29500"}
    [check] = network.rendezvous_checks(detect(env), env)
    assert check.status == ERROR and "nosuchhost.invalid (MASTER_ADDR/MASTER_PORT) does not resolve" in check.found


def test_a_rendezvous_port_held_by_another_socket_is_an_error_unless_torchrun_holds_it():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        address, held = network.rendezvous_checks(detect(env), env)
        assert address.status == OK and address.found == "127.0.0.1 -> 127.0.0.1 (MASTER_ADDR/MASTER_PORT)"
        assert held.status == ERROR and f"127.0.0.1:{port}: in use" in held.found and "MASTER_PORT" in held.fix
        torchrun = {**env, "TORCHELASTIC_USE_AGENT_STORE": "True"}
        assert network.rendezvous_checks(detect(torchrun), torchrun)[1].status == OK
    assert network.rendezvous_checks(detect(env), env)[1].found == f"127.0.0.1:{port}: free to bind"


def test_a_rendezvous_on_another_host_is_not_bound_here_and_none_at_all_warns():
    env = {"MASTER_ADDR": "10.9.8.7", "MASTER_PORT": "29500"}
    assert "not on this host" in network.rendezvous_checks(detect(env), env, addresses={"lo": "127.0.0.1"})[1].found
    two_nodes = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    [check] = network.rendezvous_checks(detect(two_nodes), two_nodes)
    assert check.status == WARNING and "mpi4py" in check.fix
    [over_mpi] = network.rendezvous_checks(detect(two_nodes), two_nodes, mpi4py=True)
    assert over_mpi.status == OK and "over MPI" in over_mpi.found


def test_a_job_script_checks_where_the_ranks_it_launches_will_meet():
    env = {**SLURM_JOB, "SLURM_JOB_NODELIST": "nid[001-002].invalid"}  # .invalid: never resolves (RFC 2606)
    [unresolved] = network.rendezvous_checks(detect(env), env)
    assert unresolved.status == ERROR and unresolved.found.startswith("nid001.invalid (the slurm job's first host")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        here_first = {**SLURM_JOB, "SLURM_JOB_NODELIST": "localhost,nid002",
                      "MASTER_PORT": str(holder.getsockname()[1])}
        address, port = network.rendezvous_checks(detect(here_first), here_first)
        assert address.found.startswith("localhost -> 127.0.0.1") and port.status == ERROR
        [loopback] = network.rendezvous_checks(detect(here_first), here_first, multi_node=True)
        assert loopback.status == ERROR and "loopback" in loopback.found and "MASTER_ADDR" in loopback.fix
    derived = {**SLURM_JOB, "SLURM_JOB_NODELIST": "localhost,nid002"}
    assert "derives its port" in network.rendezvous_checks(detect(derived), derived)[1].found


NICS = ["lo", "eth0", "ib0", "docker0"]
ADDRESSES = {"lo": "127.0.0.1", "eth0": "10.0.0.5", "docker0": "172.17.0.1"}


def test_gloo_socket_ifname_naming_a_missing_interface_is_an_error():
    check = network.gloo_interface_check({"GLOO_SOCKET_IFNAME": "nosuchif"}, False, NICS, ADDRESSES)
    assert check.status == ERROR and "nosuchif" in check.found and "GLOO_SOCKET_IFNAME" in check.fix
    fine = network.gloo_interface_check({"GLOO_SOCKET_IFNAME": "eth0"}, True, NICS, ADDRESSES)
    assert fine.status == OK and fine.found == "GLOO_SOCKET_IFNAME=eth0: eth0 (10.0.0.5)"
    assert network.gloo_interface_check({"GLOO_SOCKET_IFNAME": "lo"}, True, NICS, ADDRESSES).status == ERROR
    live = network.gloo_interface_check({"GLOO_SOCKET_IFNAME": "nosuchif"}, False)  # this host's own interfaces
    assert live.status == ERROR and "names nosuchif" in live.found


def test_gloo_on_loopback_is_an_error_only_across_nodes():
    loopback_name = dict(names=NICS, addresses=ADDRESSES, hostname=lambda: "localhost")
    one = network.gloo_interface_check({}, False, **loopback_name)
    assert one.status == OK and "falls back to loopback" in one.found
    several = network.gloo_interface_check({}, True, **loopback_name)
    assert several.status == ERROR and several.fix.startswith("export GLOO_SOCKET_IFNAME=eth0")
    routed = network.gloo_interface_check({}, True, NICS, ADDRESSES, hostname=lambda: "10.0.0.5")
    assert routed.status == OK and routed.found.startswith("eth0 (10.0.0.5)")


def test_nccl_socket_ifname_is_matched_as_nccl_matches_it():
    def status(value):
        return network.nccl_interface_check({"NCCL_SOCKET_IFNAME": value}, True, NICS).status

    assert status("eth") == OK and status("^docker,lo") == OK and status("=eth0") == OK
    assert status("=eth") == ERROR and status("eth,hsn") == ERROR
    check = network.nccl_interface_check({"NCCL_SOCKET_IFNAME": "nosuchif"}, True, NICS)
    assert "nosuchif" in check.found and "NCCL_SOCKET_IFNAME" in check.fix
    assert network.nccl_interface_check({}, True, NICS).found.startswith("ib0 (NCCL's default")
    assert network.nccl_interface_check({}, False, NICS).found == "not used: this torch drives no CUDA device"


# ------------------------------------------------------------------------------------------------ limits, disk
def test_a_small_shm_warns_and_no_shm_is_fine(tmp_path):
    check = doctor.shm_check(str(tmp_path), min_bytes=2**60)
    assert check.status == WARNING and "--shm-size" in check.fix
    assert doctor.shm_check(str(tmp_path), min_bytes=1).status == OK
    assert doctor.shm_check(str(tmp_path / "absent")).found.startswith("no ")


def test_a_low_open_file_limit_warns_with_the_ulimit_that_fixes_it():
    check = doctor.open_files_check((1024, 65536))
    assert check.status == WARNING and check.found.startswith("soft 1024, hard 65536") and check.fix.startswith(
        "ulimit -n 65536")
    assert "ask the admins" in doctor.open_files_check((1024, 1024)).fix
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # this process's own limit, lowered for the check
    try:
        lowered = doctor.open_files_check()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert lowered.status == WARNING and lowered.found.startswith("soft 256")


def test_too_little_free_disk_where_checkpoints_go_warns(tmp_path):
    not_yet_made = tmp_path / "outputs" / "runs"
    check = doctor.disk_check(not_yet_made, min_free_bytes=10 * GiB, free_bytes=GiB)
    assert check.status == WARNING and check.found == f"{not_yet_made}: 1.0 GiB free, under 10 GiB"
    assert "train.out_dir" in check.fix
    assert doctor.disk_check(not_yet_made, min_free_bytes=0).status == OK


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_checkpoint_dir_that_cannot_be_written_is_an_error(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert doctor.disk_check(locked / "runs").status == ERROR


# ------------------------------------------------------------------------------------------------ data, profile, MPI
def _prepared(root, name, train=900, val=100):
    """A dataset folder as prepare writes it, small: meta.json and the two token files."""
    folder = root / name
    folder.mkdir(parents=True)
    for split, n in (("train", train), ("val", val)):
        np.arange(n, dtype="<u2").__mod__(65).astype("<u2").tofile(folder / f"{split}.bin")
    (folder / "meta.json").write_text(json.dumps({"tokenizer": "char", "vocab_size": 65, "train_tokens": train,
                                                 "val_tokens": val}))


def test_a_data_root_without_the_shipped_data_warns_with_the_prepare_command(tmp_path):
    check = shipped_data_check(tmp_path)
    assert check.status == WARNING and "shakespeare_char not prepared" in check.found
    assert check.fix == (f"meshtrain prepare shakespeare_char --data-root {tmp_path} && "
                         f"meshtrain prepare shakespeare --data-root {tmp_path}")
    _prepared(tmp_path, "shakespeare_char")
    _prepared(tmp_path, "shakespeare")
    assert shipped_data_check(tmp_path).found == (f"{tmp_path}: shakespeare_char (900 train / 100 val tokens); "
                                                  "shakespeare (900 train / 100 val tokens)")
    (tmp_path / "shakespeare" / "val.bin").write_bytes(b"\0\0")  # a prepare cut short
    broken = shipped_data_check(tmp_path)
    assert broken.status == ERROR and "val.bin" in broken.found and broken.fix.endswith("--force")


def test_a_stale_or_missing_machine_profile_warns(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path))
    missing = profile_age_check()
    assert missing.status == WARNING and missing.fix == "meshtrain machine"
    profile = tmp_path / "machine.json"
    profile.write_text(json.dumps({"devices": {f"cpu|X|AVX2|caps=none|threads=1|torch={torch.__version__}": {}}}))
    assert profile_age_check().status == OK
    forty_days_ago = time.time() - 40 * 86400
    os.utime(profile, (forty_days_ago, forty_days_ago))
    stale = profile_age_check()
    assert stale.status == WARNING and "written 40 days ago" in stale.found and stale.fix == "meshtrain machine --refresh"
    profile.write_text(json.dumps({"devices": {"cpu|X|AVX2|caps=none|threads=1|torch=1.0": {}}}))
    assert "none for torch" in profile_age_check().found


def test_mpi4py_against_another_familys_mpiexec_warns():
    assert "not installed" in doctor.mpi_check(None, "/usr/bin/mpiexec").found
    cray = doctor.mpi_check("MPI VERSION: CRAY MPICH version 8.1.28", "/opt/cray/pals/bin/mpiexec", "pals")
    assert cray.status == OK
    mixed = doctor.mpi_check("Open MPI v4.1.4, package: Debian", "/opt/cray/pals/bin/mpiexec", "pals")
    assert mixed.status == WARNING and "different MPI families" in mixed.found and "MPICC=" in mixed.fix
    assert doctor.mpi_check("MPICH Version: 4.1", None).status == WARNING
    assert doctor.mpi_check("unloadable: libmpi.so.40", "/usr/bin/mpiexec").status == ERROR


def test_an_mpi4py_whose_library_fails_to_load_is_reported_as_such(tmp_path, monkeypatch):
    broken = tmp_path / "mpi4py"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('libmpi.so.40: cannot open shared object file')\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    library = doctor.mpi_library()
    assert library == "unloadable: ImportError: libmpi.so.40: cannot open shared object file"
    check = doctor.mpi_check(library, "/usr/bin/mpiexec", "openmpi")
    assert check.status == ERROR and "libmpi.so.40" in check.found


# ------------------------------------------------------------------------------------------------ the command
def test_doctor_json_lists_every_check_and_exits_1_on_an_error(tmp_path):
    env = clean_env(MESHTRAIN_CACHE_DIR=str(tmp_path), GLOO_SOCKET_IFNAME="nosuchif")
    out = preloaded.run([sys.executable, "-m", "meshtrain", "doctor", "--json", "--gpus-per-node", "4",
                         "--checkpoint-dir", str(tmp_path / "runs"), "--data-root", str(tmp_path / "data")],
                        env=env, cwd=REPO, timeout=120)
    assert out.returncode == 1, out.stderr
    rows = {row["name"]: row for row in json.loads(out.stdout)}
    assert list(rows) == ["python", "torch", "devices", "launcher", "rendezvous address", "rendezvous port",
                          "network (gloo)", "network (nccl)", "/dev/shm", "open files", "checkpoint disk",
                          "shipped data", "machine profile", "mpi4py"]
    assert {name for name, row in rows.items() if row["status"] == ERROR} == {"devices", "network (gloo)"}
    assert rows["shipped data"]["status"] == rows["machine profile"]["status"] == WARNING
    assert set(rows["launcher"]) == {"name", "status", "found", "fix"}
