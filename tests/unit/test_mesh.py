"""ParallelDims without processes: validation messages, rank arithmetic, and a property over layouts."""

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.config import load_config
from meshtrain.errors import MeshtrainError
from meshtrain.parallel.mesh import DIMS, FLATTENED, MeshError, ParallelDims, parse_order


@pytest.mark.parametrize("kwargs, numbers", [
    (dict(world_size=4, dp_shard=3, tp=2), ["dp_replicate=1", "dp_shard=3", "tp=2", "= 6", "4 ranks", "product 4"]),
    (dict(world_size=8, dp_replicate=2, dp_shard=2, pp=4), ["dp_replicate=2", "dp_shard=2", "pp=4", "= 16", "8 ranks"]),
    (dict(world_size=6, tp=4), ["dp_shard=-1", "6 ranks", "tp=4", "= 4", "does not divide 6"]),
    (dict(world_size=8, tp=3, pp=2), ["tp=3", "pp=2", "= 6", "does not divide 8"]),
    (dict(world_size=4, tp=0), ["parallel.tp=0", "positive"]),
    (dict(world_size=4, dp_shard=-2), ["parallel.dp_shard=-2", "-1"]),
    (dict(world_size=0), ["world_size=0"]),
    (dict(world_size=4, order="tp-cp-dp"), ["'tp-cp-dp'", "missing pp"]),
    (dict(world_size=4, order="tp-tp-dp-pp"), ["repeated tp", "missing cp"]),
    (dict(world_size=4, order="tp-cp-dp-pp-ep"), ["unknown or repeated ep"]),
    (dict(world_size=4, order="tp,cp,dp,pp"), ["exactly once"]),
])
def test_invalid_layouts_name_their_numbers(kwargs, numbers):
    with pytest.raises(MeshError) as e:
        ParallelDims(**kwargs)
    assert isinstance(e.value, MeshtrainError) and isinstance(e.value, ValueError)
    for number in numbers:
        assert number in str(e.value), (number, str(e.value))


def test_minus_one_fills_what_is_left():
    dims = ParallelDims.resolve(16, dp_replicate=2, tp=2, pp=2)
    assert dims.dp_shard == 2 and dims.dp_size == 4
    assert ParallelDims().dp_shard == 1 and ParallelDims().mesh_dims == ("dp_shard",)
    assert ParallelDims(world_size=6, dp_shard=6).dp_shard == 6


GPT = ["preset=cpu", "model.n_head=6", "model.n_embd=48", "model.block_size=100", "model.batch_size=6"]


@pytest.mark.parametrize("workload, overrides, world, node, numbers", [
    ("gpt", ["parallel.tp=8", "model.n_head=8"], 8, 4, ["parallel.tp=8", "4 ranks of a node"]),
    ("gpt", ["parallel.tp=4", "train.backend=fsdp"], 4, 4, ["model.n_head=6", "parallel.tp=4", "divides 6"]),
    ("gpt", ["parallel.cp=4"], 4, 4, ["model.block_size=100", "divisible by 8", "cp=4", "2·cp chunks"]),
    ("gpt", ["parallel.cp=4", "parallel.cp_impl=ulysses", "model.block_size=128"], 4, 4,
     ["cp_impl=ulysses", "cp=4", "6 of model.n_head=6"]),
    ("gpt", ["parallel.cp=2", "model.dropout=0.1"], 2, 2, ["model.dropout=0.1", "cp_impl=ring"]),
    ("gpt", ["parallel.pp=4", "parallel.microbatches=2", "model.batch_size=4"], 4, 4,
     ["parallel.microbatches=2", "pp=4"]),
    ("gpt", ["parallel.pp=2", "parallel.microbatches=4"], 2, 2, ["model.batch_size=6", "microbatches=4"]),
    ("gpt", ["parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.virtual_stages=2", "model.n_layer=4",
             "model.batch_size=4"], 2, 2, ["parallel.pp_schedule=gpipe", "virtual_stages=2"]),
    ("gpt", ["parallel.pp=4", "parallel.virtual_stages=2", "parallel.pp_schedule=interleaved_1f1b",
             "model.n_layer=6", "parallel.microbatches=6"], 4, 4, ["8 stages", "model.n_layer=6"]),
    ("gpt", ["parallel.tp=2"], 4, 4, ["train.backend=ddp", "parallel.tp=2", "2 data- or context-parallel"]),
    ("vit", ["preset=tiny", "parallel.tp=2", "parallel.cp=2"], 4, 4, ["train.backend=ddp", "parallel.tp=2",
                                                                        "2 data- or context-parallel"]),
    ("gpt", ["train.backend=fsdp", "parallel.tp=2", "parallel.order=dp-cp-tp-pp"], 4, 2,
     ["train.backend=fsdp", "parallel.tp=2", "order=dp-cp-tp-pp", "inner to dp", "parallel.order=tp-cp-dp-pp"]),
    ("gpt", ["train.backend=zero3", "parallel.tp=2", "parallel.order=cp-dp-tp-pp"], 4, 2,
     ["train.backend=zero3", "order=cp-dp-tp-pp", "inner to dp"]),
    ("vit", ["preset=tiny", "parallel.pp=2"], 2, 2, ["parallel.pp=2", "the vit model", "supports cp, tp"]),
    ("vit", ["preset=tiny", "train.backend=deepspeed"], 2, 2, ["train.backend=deepspeed", "the vit model"]),
    ("vit", ["preset=tiny", "parallel.tp=8", "train.backend=fsdp"], 8, 8, ["model.num_heads=4", "parallel.tp=8"]),
    ("vit", ["preset=tiny", "parallel.cp=3"], 3, 3, ["the patch grid", "=200 tokens", "divisible by 3"]),
])
def test_layout_rules_name_the_keys_and_numbers(workload, overrides, world, node, numbers):
    """Every rule that needs the world size or the model's shape, in one place, before any process group."""
    cfg = load_config([*(GPT if workload == "gpt" else []), *overrides], workload)
    with pytest.raises(MeshError) as e:
        ParallelDims.from_config(cfg, world, node)
    for number in numbers:
        assert number in str(e.value), (number, str(e.value))


def test_layout_rules_pass_good_layouts():
    cfg = load_config(["preset=cpu", "model.n_head=12", "model.n_embd=96", "model.block_size=1024",
                       "parallel.tp=4", "parallel.cp=2", "parallel.pp=2", "train.backend=fsdp",
                       "model.batch_size=4"], "gpt")
    dims = ParallelDims.from_config(cfg, 16, 4)
    assert (dims.tp, dims.cp, dims.pp, dims.dp_shard) == (4, 2, 2, 1)
    vit = load_config(["preset=tiny", "parallel.tp=2", "parallel.cp=2", "train.backend=fsdp"], "vit")
    assert ParallelDims.from_config(vit, 8, 4).dp_shard == 2


def test_tp_first_gives_consecutive_tp_groups():
    dims = ParallelDims(world_size=8, tp=2, dp_shard=2, pp=2)
    assert dims.layout == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert dims.mesh_dims == ("pp", "dp_shard", "tp")
    assert [dims.group_of(r, "tp") for r in (0, 2, 4, 6)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.group_of(0, "dp") == [0, 2] and dims.group_of(5, "dp_shard") == [5, 7]
    assert dims.group_of(1, "pp") == [1, 5]
    assert dims.group_of(3, "cp") == [3] and dims.group_of(3, "dp_replicate") == [3]
    assert dims.coords(7) == dict(pp=1, dp_replicate=0, dp_shard=1, cp=0, tp=1)
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1], "a tp pair reads one batch"
    assert [r for r in range(8) if dims.is_first_stage(r)] == [0, 1, 2, 3]
    assert [r for r in range(8) if dims.is_last_stage(r)] == [4, 5, 6, 7]
    assert all(dims.enabled(d) for d in ("tp", "pp", "dp", "dp_shard"))
    assert not any(dims.enabled(d) for d in ("cp", "dp_replicate"))


def test_dp_first_gives_consecutive_dp_groups():
    dims = ParallelDims(world_size=8, tp=2, dp_shard=2, pp=2, order="dp-tp-cp-pp")
    assert dims.layout == ("pp", "cp", "tp", "dp_replicate", "dp_shard")
    assert [dims.group_of(r, "dp") for r in (0, 2, 4, 6)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.group_of(0, "tp") == [0, 2]
    assert [dims.dp_rank(r) for r in range(4)] == [0, 1, 0, 1]
    for r in range(8):  # the ranks of one tp group read the same batch
        assert len({dims.dp_rank(q) for q in dims.group_of(r, "tp")}) == 1


def test_hsdp_replicates_outside_shards():
    dims = ParallelDims(world_size=8, dp_replicate=2, dp_shard=2, cp=2)
    assert dims.group_of(0, "dp_shard") == [0, 2] and dims.group_of(0, "dp_replicate") == [0, 4]
    assert dims.group_of(0, "dp") == [0, 2, 4, 6]
    assert dims.group_of(0, "dp_shard_cp") == [0, 1, 2, 3] and dims.group_of(0, "dp_cp") == list(range(8))
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_unknown_dim_and_rank():
    dims = ParallelDims(world_size=4)
    with pytest.raises(MeshError, match="unknown mesh dim 'xp'"):
        dims.group_of(0, "xp")
    with pytest.raises(MeshError, match="rank 4 is outside the job's 4 ranks"):
        dims.coords(4)
    assert parse_order("pp-dp-cp-tp") == ("pp", "dp", "cp", "tp")


def factorizations(n: int, k: int):
    if k == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0 for rest in factorizations(n // d, k - 1)]


LAYOUTS = [(w, f) for w in range(1, 17) for f in factorizations(w, 5)]
ORDERS = ["-".join(p) for p in itertools.permutations(("tp", "cp", "dp", "pp"))]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(LAYOUTS), st.sampled_from(ORDERS))
def test_groups_partition_the_world(layout, order):
    world, (dp_replicate, dp_shard, cp, tp, pp) = layout
    dims = ParallelDims(dp_replicate, dp_shard, cp, tp, pp, order=order, world_size=world)
    all_coords = [tuple(dims.coords(r).values()) for r in range(world)]
    assert len(set(all_coords)) == world, "coords are a bijection"
    assert all(dims.rank_of(dims.coords(r)) == r for r in range(world))
    for dim in (*DIMS, *FLATTENED):
        groups = {tuple(dims.group_of(r, dim)) for r in range(world)}
        assert sorted(r for g in groups for r in g) == list(range(world)), f"{dim} groups partition the world"
        assert all(len(g) == dims.size(dim) for g in groups)
        for g in groups:  # a group varies only `dim`'s parts
            fixed = [d for d in DIMS if d not in FLATTENED.get(dim, (dim,))]
            assert len({tuple(dims.coords(r)[d] for d in fixed) for r in g}) == 1
    first = order.split("-")[0]
    if dims.size(first) > 1:  # NERSC: the first dim named has consecutive ranks
        assert dims.group_of(0, first) == list(range(dims.size(first)))
    assert math.prod(getattr(dims, d) for d in DIMS) == world
