"""Rank/size/host detection from synthetic launcher and scheduler environments (no processes)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshtrain.runtime.env import (
    LaunchEnvError,
    derived_port,
    detect,
    expand_nodelist,
    read_hostfile,
    rendezvous,
)

# (case, environment, expected fields); hosts/job ids are checked in the scheduler tests below.
CASES = [
    ("plain process", {}, dict(rank=0, local_rank=0, world_size=1, local_world_size=1, num_nodes=1,
                                launcher="none", scheduler="none")),
    ("torchrun", {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                  "MASTER_ADDR": "node0", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "x"},
     dict(rank=5, local_rank=1, world_size=8, local_world_size=4, num_nodes=2, launcher="torchrun",
          master_addr="node0", master_port=29400)),
    ("open mpi", {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                  "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
     dict(rank=3, local_rank=1, world_size=4, local_world_size=2, num_nodes=2, launcher="openmpi")),
    ("mpich hydra", {"PMI_RANK": "6", "PMI_SIZE": "8", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"},
     dict(rank=6, local_rank=2, world_size=8, local_world_size=4, num_nodes=2, launcher="mpich")),
    ("intel mpi, no local size", {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "3"},
     dict(rank=3, local_rank=3, world_size=4, local_world_size=4, num_nodes=1, launcher="mpich")),
    ("pmix rank, sizes from open mpi", {"PMIX_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                               "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
     dict(rank=2, local_rank=0, world_size=4, local_world_size=2, num_nodes=2, launcher="pmix")),
    ("pmix alone", {"PMIX_RANK": "2", "PMI_SIZE": "3"},
     dict(rank=2, local_rank=2, world_size=3, local_world_size=3, launcher="pmix")),
    ("cray pals (polaris)", {"PALS_RANKID": "9", "PALS_LOCAL_RANKID": "1", "PMI_SIZE": "16", "PMI_RANK": "9",
                             "PALS_LOCAL_SIZE": "4"},
     dict(rank=9, local_rank=1, world_size=16, local_world_size=4, num_nodes=4, launcher="pals")),
    ("srun", {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
              "SLURM_NTASKS": "8", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[01-02]",
              "SLURM_STEP_TASKS_PER_NODE": "4(x2)"},
     dict(rank=5, local_rank=1, world_size=8, local_world_size=4, num_nodes=2, launcher="srun", scheduler="slurm",
          job_id="77", hosts=("gpu01", "gpu02"))),
    ("sbatch script, no srun step: one process", {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_NTASKS": "8",
                                                  "SLURM_JOB_NODELIST": "gpu[01-02]"},
     dict(rank=0, world_size=1, launcher="none", scheduler="slurm", job_id="77")),
    ("mpiexec inside slurm: mpi's rank wins over SLURM_PROCID",
     {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4",
      "SLURM_JOB_NODELIST": "n1", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"},
     dict(rank=3, world_size=4, launcher="openmpi", scheduler="slurm", num_nodes=1)),
    ("pbs + pals", {"PBS_JOBID": "123.polaris", "PALS_RANKID": "4", "PALS_LOCAL_RANKID": "0", "PMI_SIZE": "8"},
     dict(rank=4, local_rank=0, world_size=8, launcher="pals", scheduler="pbs", job_id="123.polaris")),
]


@pytest.mark.parametrize("case,environ,expected", CASES, ids=[c[0] for c in CASES])
def test_detect(case, environ, expected):
    launch = detect(environ)
    for name, value in expected.items():
        assert getattr(launch, name) == value, f"{case}: {name}"


def test_pbs_hosts_and_node_count_from_hostfile(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("x3001c0s1b0n0\nx3001c0s1b0n0\nx3001c0s7b1n0\nx3001c0s7b1n0\n# comment\n\n")
    env = {"PBS_JOBID": "9.pbs", "PBS_NODEFILE": str(nodefile), "PMI_RANK": "3", "PMI_SIZE": "8"}
    launch = detect(env)
    assert launch.hosts == ("x3001c0s1b0n0", "x3001c0s7b1n0")
    assert (launch.num_nodes, launch.local_world_size, launch.local_rank) == (2, 4, 3)


def test_missing_hostfile_names_the_path(tmp_path):
    with pytest.raises(LaunchEnvError, match="nodes-gone.*PBS_NODEFILE"):
        detect({"PBS_JOBID": "1", "PBS_NODEFILE": str(tmp_path / "nodes-gone")})


@pytest.mark.parametrize("nodelist,hosts", [
    ("nid[001-004,007]", ["nid001", "nid002", "nid003", "nid004", "nid007"]),
    ("login1", ["login1"]),
    ("a[1-2],b3,c[08-10]-ib", ["a1", "a2", "b3", "c08-ib", "c09-ib", "c10-ib"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("gpu[9-11]", ["gpu9", "gpu10", "gpu11"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["nid[001-004", "nid[5-2]", "nid[a-b]"])
def test_bad_nodelist_is_an_error(bad):
    with pytest.raises(LaunchEnvError):
        expand_nodelist(bad)


def test_read_hostfile_keeps_first_appearance_order(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("b slots=4\na\nb\n")
    assert read_hostfile(f) == ["b", "a"]


def test_rank_outside_world_and_non_integer_are_clear_errors():
    with pytest.raises(LaunchEnvError, match="outside the world of 4"):
        detect({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(LaunchEnvError, match="RANK='one'"):
        detect({"RANK": "one", "WORLD_SIZE": "4"})


def test_rank_without_any_world_size_says_what_is_missing():
    with pytest.raises(LaunchEnvError, match="no world size"):
        detect({"PMIX_RANK": "1"})


class TestRendezvous:
    def test_environment_wins(self):
        launch = detect({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1234"})
        assert rendezvous(launch, {})[:2] == ("h", 1234)

    def test_slurm_first_host_and_job_port_agree_on_every_rank(self):
        base = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8", "SLURM_NNODES": "2",
                "SLURM_JOB_NODELIST": "nid[007-008]"}
        answers = {rendezvous(detect(env := {**base, "SLURM_PROCID": str(r)}), env)[:2] for r in range(8)}
        assert answers == {("nid007", derived_port("4242.0"))}
        assert 20000 <= derived_port("4242.0") < 30000

    def test_pbs_first_host_of_hostfile(self, tmp_path):
        f = tmp_path / "nodes"
        f.write_text("h1\nh1\nh2\nh2\n")
        env = {"PBS_JOBID": "7.server", "PBS_NODEFILE": str(f), "PALS_RANKID": "2", "PMI_SIZE": "4"}
        addr, port, _ = rendezvous(detect(env), env)
        assert (addr, port) == ("h1", derived_port("7.server."))

    def test_one_node_uses_loopback_and_the_mpi_job_id(self):
        env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
               "PMIX_NAMESPACE": "prterun-vm-123@1"}
        assert rendezvous(detect(env), env)[:2] == ("127.0.0.1", derived_port("prterun-vm-123@1"))

    def test_single_process_gets_a_free_port(self):
        addr, port, _ = rendezvous(detect({}), {})
        assert addr == "127.0.0.1" and 0 < port < 65536

    def test_multi_node_without_hosts_or_job_cannot_agree(self):
        env = {"PMI_RANK": "0", "PMI_SIZE": "8", "MPI_LOCALNRANKS": "4"}
        assert rendezvous(detect(env), env) is None


def _compress(prefix: str, numbers: list[int], width: int) -> str:
    """The way SLURM writes a host list: runs of consecutive numbers as lo-hi inside brackets."""
    runs, start = [], numbers[0]
    for prev, cur in zip(numbers, numbers[1:] + [None], strict=True):
        if cur is None or cur != prev + 1:
            runs.append(f"{start:0{width}d}" if start == prev else f"{start:0{width}d}-{prev:0{width}d}")
            start = cur
    return f"{prefix}[{','.join(runs)}]"


@given(prefix=st.from_regex(r"[a-z]{1,5}", fullmatch=True),
       numbers=st.lists(st.integers(0, 999), min_size=1, max_size=40, unique=True), width=st.integers(1, 4),
       suffix_host=st.from_regex(r"login[0-9]", fullmatch=True))
def test_expand_nodelist_inverts_slurms_compression(prefix, numbers, width, suffix_host):
    numbers = sorted(numbers)
    width = max(width, len(str(numbers[-1])))  # SLURM pads every number in a range to one width
    compressed = f"{_compress(prefix, numbers, width)},{suffix_host}"
    assert expand_nodelist(compressed) == [f"{prefix}{n:0{width}d}" for n in numbers] + [suffix_host]
