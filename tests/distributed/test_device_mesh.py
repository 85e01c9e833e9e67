"""The DeviceMesh built by ParallelDims, on real processes: its groups are the ones the arithmetic predicts."""

from pathlib import Path

from tests.conftest import assert_all_equal, run_driver

DRIVER = Path(__file__).with_name("mesh_check.py")
MATCH = "every sub-mesh's process group and local rank as ParallelDims.group_of says, and the dp all_reduce sums"


def test_mesh_groups_match_the_arithmetic_on_4_ranks():
    layouts = ["tp=2,dp_shard=2", "dp_replicate=2,dp_shard=2", "dp_shard=2,cp=2,order=dp-cp-tp-pp",
               "dp_shard=1,pp=2,tp=2"]
    assert_all_equal(run_driver(DRIVER, 4, *layouts), layouts, 4, MATCH)


def test_mesh_groups_match_the_arithmetic_on_8_ranks():  # ~11 s on 2 cores
    layouts = ["dp_shard=2,tp=2,pp=2", "dp_replicate=2,dp_shard=2,tp=2,order=dp-tp-cp-pp"]
    assert_all_equal(run_driver(DRIVER, 8, *layouts), layouts, 8, MATCH)
