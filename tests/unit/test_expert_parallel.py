"""Expert parallelism without processes: which ranks hold which experts and exchange tokens, for several layouts (the
arithmetic of ParallelDims, the one object that describes the mesh), a property over layouts, and the refusals, each
one clear error naming the key and the fix, before any process group exists."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.config import ConfigError, load_config
from meshtrain.parallel.expert_parallel import arrival_order, scale_grad
from meshtrain.parallel.mesh import MeshError, ParallelDims


def holders(dims: ParallelDims, n_experts: int) -> list[list[int]]:
    """Per rank, the experts it holds."""
    return [list(dims.experts_of(r, n_experts)) for r in range(dims.world_size)]


def groups(dims: ParallelDims, dim: str) -> list[list[int]]:
    return sorted({tuple(dims.group_of(r, dim)) for r in range(dims.world_size)})


@pytest.mark.parametrize("kwargs, experts, ep_groups, edp_groups", [
    # 4 ranks, ep 2: neighbours split the 8 experts; ranks 0 and 2 hold the same half
    (dict(world_size=4, ep=2), [[0, 1, 2, 3], [4, 5, 6, 7]] * 2, [(0, 1), (2, 3)], [(0, 2), (1, 3)]),
    # 4 ranks, ep 4: each holds 2 experts of its own, none shared
    (dict(world_size=4, ep=4), [[0, 1], [2, 3], [4, 5], [6, 7]], [(0, 1, 2, 3)], [(0,), (1,), (2,), (3,)]),
    # 8 ranks of hsdp (2 replicas × 4 shards), ep 2: ep pairs inside each replica; a quarter of the ranks per half
    (dict(world_size=8, dp_replicate=2, ep=2), [[0, 1, 2, 3], [4, 5, 6, 7]] * 4,
     [(0, 1), (2, 3), (4, 5), (6, 7)], [(0, 2, 4, 6), (1, 3, 5, 7)]),
    # 8 ranks, ep 4: two groups of four, each holding all 8 experts
    (dict(world_size=8, ep=4), [[0, 1], [2, 3], [4, 5], [6, 7]] * 2, [(0, 1, 2, 3), (4, 5, 6, 7)],
     [(0, 4), (1, 5), (2, 6), (3, 7)]),
])
def test_which_ranks_hold_which_experts(kwargs, experts, ep_groups, edp_groups):
    dims = ParallelDims(**kwargs)
    assert holders(dims, 8) == experts
    assert groups(dims, "ep") == ep_groups
    assert groups(dims, "edp") == edp_groups
    assert dims.size("ep") * dims.size("edp") == dims.dp_size  # ep borrows ranks: the world does not grow


def test_ep_is_inner_to_dp_shard_and_tp_stays_innermost():
    """Under pp 2 the ep ranks are dp_shard's neighbours within one stage."""
    dims = ParallelDims(world_size=8, pp=2, ep=2)
    assert dims.expert_layout == ("pp", "dp_replicate", "efsdp", "ep", "cp", "tp")
    assert groups(dims, "ep") == [(0, 1), (2, 3), (4, 5), (6, 7)] and dims.group_of(5, "edp") == [5, 7]
    assert dims.expert_coords(6) == {"pp": 1, "dp_replicate": 0, "efsdp": 1, "ep": 0, "cp": 0, "tp": 0}


LAYOUTS = [(world, replicate, ep) for world in range(1, 17) for replicate in (1, 2) for ep in range(1, 17)
           if world % replicate == 0 and (world // replicate) % ep == 0]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(LAYOUTS), st.sampled_from([1, 2, 4, 8, 16]))
def test_every_ep_group_holds_every_expert_once_and_edp_groups_hold_the_same(layout, per_rank):
    world, replicate, ep = layout
    dims = ParallelDims(world_size=world, dp_replicate=replicate, ep=ep)
    n_experts = ep * per_rank
    for group in groups(dims, "ep"):
        assert sorted(e for r in group for e in dims.experts_of(r, n_experts)) == list(range(n_experts))
    for group in groups(dims, "edp"):
        assert len({tuple(dims.experts_of(r, n_experts)) for r in group}) == 1
    for dim in ("ep", "edp", "efsdp"):
        assert sorted(r for g in groups(dims, dim) for r in g) == list(range(world)), f"{dim} partitions the world"
        assert all(len(g) == dims.size(dim) for g in groups(dims, dim))
    assert all(set(dims.group_of(r, "ep")) <= set(dims.group_of(r, "dp_shard")) for r in range(world))


MOE = ["preset=cpu", "model.n_layer=2"]


@pytest.mark.parametrize("workload, overrides, world, numbers", [
    ("moe", ["parallel.ep=3"], 4, ["parallel.ep=3 does not divide the 4 data-parallel ranks", "dp_shard"]),
    ("moe", ["parallel.ep=4", "model.n_experts=6", "model.top_k=2"], 4,
     ["model.n_experts=6 is not divisible by parallel.ep=4", "pick an ep that divides 6"]),
    ("gpt", ["parallel.ep=2"], 4, ["parallel.ep=2: the gpt model has no experts", "set parallel.ep=1"]),
    ("llama", ["parallel.ep=2"], 4, ["parallel.ep=2: the llama model has no experts"]),
    # under hsdp ep comes from within a replica's shards: 4 here, though dp is 8
    ("moe", ["parallel.ep=8", "train.backend=hsdp", "parallel.dp_replicate=2"], 8,
     ["parallel.ep=8 does not divide the 4 data-parallel ranks of parallel.dp_shard", "pick an ep that divides 4"]),
])
def test_bad_ep_is_one_clear_error_before_any_process_group(workload, overrides, world, numbers):
    cfg = load_config([*(MOE if workload == "moe" else []), *overrides], workload)
    with pytest.raises(MeshError) as e:
        ParallelDims.from_config(cfg, world, world)
    for number in numbers:
        assert number in str(e.value), (number, str(e.value))


@pytest.mark.parametrize("overrides, message", [
    (["train.backend=zero1"], "ep=2: ZeroRedundancyOptimizer shards plain tensors over one group; use "
                              "train.backend=zero2 or fsdp to combine sharding with tp/cp/pp/ep"),
    (["train.backend=deepspeed"], "meshtrain runs DeepSpeed's ZeRO as data parallelism only"),
    (["parallel.ep=0"], "parallel.ep=0: must be at least 1"),
])
def test_ep_with_what_it_does_not_compose_with_is_refused_by_the_config(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config([*MOE, "parallel.ep=2", *overrides], "moe")


@pytest.mark.parametrize("other, world, ep_groups, edp_groups", [
    # tp 2 (adjacent ranks): ep pairs among the dp ranks of one tp coordinate; tp peers are not in edp
    ("tp", 4, [(0, 2), (1, 3)], [(0,), (1,), (2,), (3,)]),
    # cp 2: the cp peers route other positions of the same sequences, so they average the experts' gradients (edp)
    ("cp", 8, [(0, 2), (1, 3), (4, 6), (5, 7)], [(0, 1, 4, 5), (2, 3, 6, 7)]),
    # pp 2: each stage's ep pairs, its experts averaged within the stage
    ("pp", 8, [(0, 1), (2, 3), (4, 5), (6, 7)], [(0, 2), (1, 3), (4, 6), (5, 7)]),
])
def test_ep_composes_with_model_parallelism(other, world, ep_groups, edp_groups):
    """ep with tp, cp or pp passes the mesh's rules and borrows its ranks from dp_shard within each model replica."""
    cfg = load_config([*MOE, "parallel.ep=2", "train.backend=fsdp", f"parallel.{other}=2"], "moe")
    dims = ParallelDims.from_config(cfg, world, world)
    assert (dims.ep, dims.world_size, getattr(dims, other)) == (2, world, 2)
    assert groups(dims, "ep") == ep_groups and groups(dims, "edp") == edp_groups
    assert dims.size("ep") * dims.size("edp") == dims.dp_size * dims.cp


def test_ep_with_ddp_and_tp_is_refused_naming_the_fix():
    cfg = load_config([*MOE, "parallel.ep=2", "parallel.tp=2"], "moe")
    with pytest.raises(MeshError, match="use train.backend=fsdp"):
        ParallelDims.from_config(cfg, 4, 4)


def test_good_ep_layouts_pass_and_leave_the_world_and_data_ranks_alone():
    for backend, world, ep in (("ddp", 4, 2), ("fsdp", 4, 4), ("zero2", 2, 2)):
        cfg = load_config([*MOE, f"parallel.ep={ep}", f"train.backend={backend}"], "moe")
        dims = ParallelDims.from_config(cfg, world, world)
        assert (dims.ep, dims.dp_size, dims.world_size) == (ep, world, world)
        assert [dims.dp_rank(r) for r in range(world)] == list(range(world))  # every rank still reads its own batch
    hsdp = load_config([*MOE, "parallel.ep=2", "train.backend=hsdp", "parallel.dp_replicate=2"], "moe")
    assert ParallelDims.from_config(hsdp, 8, 4).size("edp") == 4


def test_scale_grad_is_the_identity_forward_and_scales_the_gradient():
    w = torch.randn(3, 4, requires_grad=True)
    out = scale_grad(w, 0.25)
    assert torch.equal(out, w)
    out.sum().backward()
    assert torch.equal(w.grad, torch.full_like(w, 0.25))


def test_arrived_rows_are_put_in_expert_major_order_keeping_each_sources_order():
    # 2 sources × 2 local experts: source 0 sends 1 row to expert 0 and 2 to expert 1, source 1 sends 3 to expert 0
    incoming = torch.tensor([[1, 2], [3, 0]])
    # arrived: [s0e0, s0e1, s0e1, s1e0, s1e0, s1e0] -> expert 0's rows (source 0's, then source 1's), then expert 1's
    assert arrival_order(incoming).tolist() == [0, 3, 4, 5, 1, 2]
    assert arrival_order(torch.zeros(4, 2, dtype=torch.int64)).numel() == 0


@pytest.mark.parametrize("kwargs", [dict(world_size=4, ep=2), dict(world_size=4, ep=4), dict(world_size=8, ep=4),
                                    dict(world_size=8, dp_replicate=2, ep=2)])
def test_the_real_meshs_expert_view_has_the_groups_the_arithmetic_says(kwargs):
    """build_mesh as each rank under torch's fake process group (one process, no communication): the DeviceMesh's ep
    and edp dims hold exactly the ranks group_of computes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshtrain.parallel.mesh import submesh

    dims = ParallelDims(**kwargs)
    for rank in range(dims.world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
        try:
            mesh = dims.build_mesh("cpu")
            for dim in ("ep", "edp"):
                sub = submesh(mesh, dim)
                ranks = sorted(sub.mesh.flatten().tolist()) if sub is not None else [rank]
                assert ranks == dims.group_of(rank, dim), (rank, dim)
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_under_tp_a_moe_layer_is_a_partial_sum_and_the_dense_layers_are_split(sequence_parallel):
    """The moe model's tp plan, block by block: a dense layer's SwiGLU column/row-parallel as the Llama's, an MoE
    layer's mlp one PartialSum (the whole stream in, the parts summed out), its own parameters left to its model."""
    from meshtrain.models.moe.model import MoEConfig, MoEDecoder
    from meshtrain.parallel.tensor_parallel import PartialSum, _blocks_plan

    model = MoEDecoder(MoEConfig(block_size=16, vocab_size=65, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                                 ffn_hidden=64, n_experts=4, top_k=2, expert_hidden=16, moe_layers=(1,)))
    plan = _blocks_plan(model.transformer.h, sequence_parallel, {"mlp.c_gate": object()}, {"1"})
    dense, moe = ({path.split(".", 3)[3] for path in plan if path.startswith(f"transformer.h.{i}.")} for i in (0, 1))
    assert {"mlp.c_fc", "mlp.c_gate", "mlp.c_proj", "attn.q_proj", "attn.c_proj"} <= dense
    assert not any(path.startswith("mlp.") for path in moe) and {"attn.q_proj", "attn.c_proj"} <= moe
    style = plan["transformer.h.1.mlp"]
    assert isinstance(style, PartialSum) and style.sequence_parallel == sequence_parallel


def test_the_experts_mesh_under_tp_is_ep_beside_tp():
    """fsdp 2 × tp 2 with ep 2, as each rank under torch's fake process group: the experts are cut over a 2-D (ep, tp)
    mesh whose ep dim holds the ranks group_of says and whose tp dim is the rank's tp group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshtrain.parallel.mesh import expert_mesh, submesh

    dims = ParallelDims(world_size=4, tp=2, ep=2)
    for rank in range(dims.world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
        try:
            mesh = dims.build_mesh("cpu")
            experts = expert_mesh(mesh)
            assert experts.mesh_dim_names == ("ep", "tp")
            assert sorted(experts["ep"].mesh.tolist()) == dims.group_of(rank, "ep")
            assert experts["tp"].mesh.tolist() == submesh(mesh, "tp").mesh.tolist()
        finally:
            dist.destroy_process_group()


def test_dispatch_and_combine_count_the_bytes_they_pass_to_all_to_all():
    """On a one-rank gloo group (in this process): the row counts (E int64), the rows sent (dropped ones are not),
    the outputs sent back, and in backward both gradients: 8 of 10 rows of 4 fp32 kept by 3 experts."""
    from meshtrain.parallel.expert_parallel import Sent, combine, dispatch

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rows = torch.randn(10, 4, requires_grad=True)
        tally = Sent()
        local, _, route = dispatch(rows, torch.tensor([3, 5, 0]), dist.group.WORLD, 1, tally)
        out = combine(local * 2, route, 10)
        assert tally.bytes == 3 * 8 + 2 * 8 * 4 * 4
        out.sum().backward()
        assert tally.bytes == 3 * 8 + 4 * 8 * 4 * 4
        assert rows.grad[:8].eq(2).all() and rows.grad[8:].eq(0).all()
    finally:
        dist.destroy_process_group()


def test_shape_inference_keeps_the_rows_on_their_rank(monkeypatch):
    """Under torch's fake process group, rank 0 of ep 2: while keep_to_this_rank is on (a pipeline's shape inference),
    the experts' forward dispatches nothing and gives what this rank's first expert makes of every row, with the
    dispatched forward's shape, dtype and gradients; switched off, it dispatches again."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshtrain.models.moe.experts import GroupedExperts
    from meshtrain.parallel import expert_parallel
    from meshtrain.parallel.mesh import expert_mesh

    dims = ParallelDims(world_size=2, ep=2)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        experts = GroupedExperts(4, dim=8, hidden=16, matmul="loop")
        expert_parallel.apply_expert_parallel(experts, expert_mesh(dims.build_mesh("cpu")))

        def refused(*_args, **_kwargs):
            raise AssertionError("dispatched")

        monkeypatch.setattr(expert_parallel, "dispatch", refused)
        rows, counts = torch.randn(6, 8, requires_grad=True), torch.tensor([1, 2, 0, 3])
        expert_parallel.keep_to_this_rank([experts], True)
        out = experts(rows, counts)
        local = [p.to_local() for p in experts.parameters()]
        assert local[0].shape[0] == 2  # this rank's half of the experts
        torch.testing.assert_close(out, experts.compute(rows, torch.tensor([6, 0]), *local), rtol=0, atol=0)
        out.sum().backward()
        assert rows.grad.shape == rows.shape and all(p.grad is not None for p in experts.parameters())
        assert expert_parallel.sent_bytes(experts) == 0
        expert_parallel.keep_to_this_rank([experts], False)
        with pytest.raises(AssertionError, match="dispatched"):
            experts(rows, counts)
    finally:
        dist.destroy_process_group()
