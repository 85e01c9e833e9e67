"""The planner's arithmetic against analytic counts: what a rank holds under each parallelism, the activation and
bubble terms, collective times on a described machine, and that every layout it lists is one `train` accepts."""

from __future__ import annotations

import functools
import json
import math
import re
import sys
import threading
from dataclasses import replace

import pytest
import torch
from tests import preloaded
from tests.conftest import REPO, clean_env, prepare_data

from meshtrain import config as config_mod
from meshtrain.errors import MeshtrainError
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.plan import machines, search, systems
from meshtrain.plan.cost import FP32, predict
from meshtrain.plan.measured import measure, this_machine
from meshtrain.plan.shares import chunk, stage_shares, tp_local_shape
from meshtrain.plan.workload import ModelFacts


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return prepare_data(tmp_path_factory.mktemp("plan-data"))


def gpt_config(data_root, *overrides):
    return config_mod.load_config(["preset=cpu", f"data.root={data_root}", "model.dropout=0.0", *overrides], "gpt")


def polaris():
    return machines.from_system(systems.get("polaris"))


@pytest.mark.parametrize("size,parts", [(65, 2), (64, 4), (10, 4), (3, 4), (1024, 3)])
def test_chunk_is_torch_chunk(size, parts):
    pieces = [len(p) for p in torch.arange(size).chunk(parts)] + [0] * parts
    assert [chunk(size, parts, i) for i in range(parts)] == pieces[:parts]


def test_tp_local_shapes_follow_the_plans():
    assert tp_local_shape("transformer.h.0.attn.q_proj.weight", (128, 128), 4) == (32, 128)  # colwise: out
    assert tp_local_shape("transformer.h.0.attn.q_proj.bias", (128,), 4) == (32,)
    assert tp_local_shape("transformer.h.0.mlp.c_proj.weight", (128, 512), 4) == (128, 128)  # rowwise: in
    assert tp_local_shape("transformer.h.0.mlp.c_proj.bias", (128,), 4) == (128,)  # rowwise bias: replicated
    assert tp_local_shape("transformer.wte.weight", (65, 128), 2) == (33, 128)  # vocab, chunked like torch
    assert tp_local_shape("transformer.h.0.ln_1.weight", (128,), 4) == (128,)
    assert tp_local_shape("blocks.3.mlp.c_fc.weight", (512, 128), 2) == (256, 128)  # the ViT's blocks too


def test_shares_of_data_parallel_backends(data_root):
    cfg = gpt_config(data_root)
    facts = ModelFacts.of(cfg)
    params = dict(facts.model.named_parameters())
    total = sum(p.numel() for p in params.values())
    dims = ParallelDims.resolve(4)
    ddp, = stage_shares(facts.model, facts.split, dims, "ddp")
    assert (ddp.params, ddp.grads, ddp.optimizer) == (total, total, 2 * total)
    fsdp, = stage_shares(facts.model, facts.split, dims, "fsdp")
    assert fsdp.params == sum(chunk(p.shape[0], 4) * math.prod(p.shape[1:]) for p in params.values())
    zero1, = stage_shares(facts.model, facts.split, dims, "zero1")
    assert zero1.params == total and total / 2 < zero1.optimizer < 2 * total  # about a quarter of the moments
    hsdp, = stage_shares(facts.model, facts.split, ParallelDims.resolve(4, dp_replicate=2), "hsdp")
    assert hsdp.params == sum(chunk(p.shape[0], 2) * math.prod(p.shape[1:]) for p in params.values())


def test_pipeline_stages_hold_their_blocks_and_a_copy_of_the_tie(data_root):
    cfg = gpt_config(data_root)
    facts = ModelFacts.of(cfg)
    total = sum(p.numel() for p in facts.model.parameters())
    wte = facts.model.transformer.wte.weight.numel()
    first, last = stage_shares(facts.model, facts.split, ParallelDims.resolve(2, pp=2), "ddp", schedule="1f1b")
    assert first.first and not first.last and last.last and not last.first
    assert first.blocks + last.blocks == cfg.model.n_layer
    assert first.params + last.params == total + wte  # lm_head's own copy of the tied embedding


def test_activations_without_parallelism_are_the_shape_s(data_root):
    cfg = gpt_config(data_root, "train.dtype=fp32")
    facts = ModelFacts.of(cfg)
    cost = predict(facts, cfg, ParallelDims.resolve(1), polaris())
    m = cfg.model
    tokens = m.batch_size * m.block_size
    blocks = facts.shape.activations_per_token * tokens * m.n_layer * FP32
    embedding = m.n_embd * tokens * FP32  # the first block's input
    assert cost.memory["activations"] == pytest.approx(blocks + embedding)
    assert cost.memory["head"] == pytest.approx(3 * tokens * facts.head_features * FP32)
    assert facts.head_features == 65  # the shakespeare_char vocabulary


def test_checkpointing_sharding_and_pipelines_move_the_terms(data_root):
    cfg = gpt_config(data_root, "train.dtype=fp32")
    facts, machine = ModelFacts.of(cfg), polaris()

    def cost(**changes):
        train = {k: v for k, v in changes.items() if k in ("backend", "activation_checkpointing")}
        parallel = {k: v for k, v in changes.items() if k not in train}
        run = config_mod.load_config(["preset=cpu", f"data.root={cfg.data.root}", "model.dropout=0.0",
                                      "train.dtype=fp32", *(f"train.{k}={v}" for k, v in train.items()),
                                      *(f"parallel.{k}={v}" for k, v in parallel.items())], "gpt")
        return predict(facts, run, ParallelDims.from_config(run, 4, 4), machine)

    ddp, full = cost(backend="ddp"), cost(backend="ddp", activation_checkpointing="full")
    assert full.memory["activations"] < ddp.memory["activations"] / 3
    assert full.time["compute"] > ddp.time["compute"]
    fsdp = cost(backend="fsdp")
    assert fsdp.memory["params"] < ddp.memory["params"] / 3 and fsdp.comm_bytes["dp"] > ddp.comm_bytes["dp"]
    pipeline = cost(backend="ddp", pp=2, pp_schedule="gpipe", microbatches=4)
    assert pipeline.time["bubble"] > 0 and "pp" in pipeline.comm_bytes
    tp = cost(backend="fsdp", tp=2)
    assert "tp" in tp.comm_bytes and tp.memory["activations"] < fsdp.memory["activations"]


def test_op_level_checkpointing_keeps_the_matmul_outputs_and_recomputes_the_element_wise_ops(data_root):
    """`op`: each block keeps its input, its linears' outputs and attention's output and log-sum-exp (the count
    tests/unit/test_activation_checkpointing.py checks against autograd), less than `none` and more than `full`; its
    recomputation is the element-wise traffic's forward third, less than `full`'s forward. The search lists it."""
    modes = {}
    for mode in ("none", "op", "full"):
        cfg = gpt_config(data_root, "train.dtype=fp32", f"train.activation_checkpointing={mode}")
        modes[mode] = predict(ModelFacts.of(cfg), cfg, ParallelDims.resolve(1), polaris())
    m = cfg.model
    tokens = m.batch_size * m.block_size
    # q, k, v and the two projections (5w), the MLP's hidden (4w), attention's output (w) and heads, the input (w)
    per_block = (11 * m.n_embd + m.n_head) * tokens * FP32
    embedding = m.n_embd * tokens * FP32
    assert modes["op"].memory["activations"] == pytest.approx(m.n_layer * per_block + embedding)
    assert modes["full"].memory["activations"] < modes["op"].memory["activations"] < \
        modes["none"].memory["activations"]
    assert modes["none"].time["compute"] < modes["op"].time["compute"] < modes["full"].time["compute"]
    assert {c.train.activation_checkpointing for c in search.layouts(cfg, 2)} == {"none", "selective", "full", "op"}


def test_tensor_bytes_counts_each_storage_until_it_dies_in_any_thread():
    tracker = measure.TensorBytes()
    with tracker:
        a = torch.ones(1024)  # 4 KiB
        view = a[:10] * 0 + a[:10]  # a new 40-byte storage; a[:10] itself is a view of a, not counted again
        b = torch.empty(2048)  # 8 KiB
        assert tracker.alive == 4096 + 40 + 8192
        del a, view
        tracker.mark()  # peaks from here
        assert tracker.peak() == 8192
        b.untyped_storage().resize_(0)  # how FSDP2 frees a gathered parameter
        assert tracker.alive == 0
        c = torch.zeros(256)
        holder = [c]
        del c
        # the last reference goes in another thread, as gloo drops a collective's buffers
        other = threading.Thread(target=holder.clear)
        other.start()
        other.join()
        assert tracker.alive == 0 and tracker.peak() == 8192


def test_attention_is_its_flops_on_a_described_machine_and_its_own_kernel_timed_here():
    machine = polaris()
    # ring: this rank's 64 queries against 2 × 64 keys, at the measured SDPA rate (bf16) or the matmul rate (fp32)
    assert machine.attention_s("bf16", 4, 8, 64, 32, causal=True, ring=2) == \
        pytest.approx(12 * 4 * 8 * 32 * 64 * 128 / machine.sdpa["bf16"].rate(64, 32, True))
    assert machine.attention_s("fp32", 4, 8, 64, 32, causal=True, ring=2) == \
        pytest.approx(12 * 4 * 8 * 32 * 64 * 128 / machine.matmul_rate("fp32", 4 * 64, 32, 128))
    here = machines.Machine("this", 1, 1e9, {"fp32": 1e10}, 1e10, 1e9, 1e9, 0.0, 0.0, overlap=False,
                            attention_timer=functools.partial(this_machine.attention_seconds, 1))
    for ring in (1, 2):  # the score matrix 64 times larger (8 × the tokens) takes longer, whatever the kernel
        small = here.attention_s("fp32", 2, 2, 32, 16, causal=True, ring=ring)  # (a wide margin: a timing on a busy box)
        large = here.attention_s("fp32", 2, 2, 256, 16, causal=True, ring=ring)
        assert 0 < small and large > 2 * small, (ring, small, large)


def test_collectives_cross_nodes_by_the_mesh_order():
    machine, system = polaris(), systems.get("polaris")
    dims = ParallelDims.resolve(8, tp=4)  # tp-cp-dp-pp: a tp group is one node's 4 GPUs, dp spans the 2 nodes
    nbytes = 64 * 2**20
    tp = machine.collective_s("all_reduce", nbytes, dims, "tp")
    assert tp == pytest.approx(6 * system.intra_node_latency_s + 1.5 * nbytes / (system.intra_node_gbs * 1e9))
    dp = machine.collective_s("all_reduce", nbytes, dims, "dp")
    assert dp == pytest.approx(2 * system.inter_node_latency_s + 1.0 * nbytes / (system.inter_node_gbs * 1e9))


def _refusal(cfg) -> str | None:
    try:
        config_mod.with_global_batch(cfg, search.check(cfg, 8, 4).dp_size)
    except MeshtrainError as e:
        return str(e)
    return None


def test_every_listed_layout_is_one_train_accepts(data_root):
    cfg = gpt_config(data_root)
    ranked, refused = search.search(cfg, 2, 4, polaris())
    assert ranked and refused  # zero1 with model parallelism, too many stages, ... are refused
    refusals = [_refusal(c) for c in search.layouts(cfg, 8)]
    assert set(refused) <= set(refusals)  # each kind once, under a whole message `train` would print for a layout
    assert sum(refused.values()) == sum(r is not None for r in refusals)
    assert len({re.sub(r"\d+", "N", why) for why in refused}) == len(refused) > 3
    for candidate in ranked:
        chosen = search.with_layout(cfg, search.layout_of(candidate))
        config_mod.validate(chosen)
        assert ParallelDims.from_config(chosen, 8, 4) == candidate.dims
        assert candidate.dims.tp <= 4  # never across nodes
        assert not (chosen.train.backend == "zero1" and max(chosen.parallel.tp, chosen.parallel.pp) > 1)
    fits = [c.fits for c in ranked]
    assert fits == sorted(fits, reverse=True)  # those that fit come first
    throughputs = [c.throughput for c in ranked if c.fits]
    assert throughputs == sorted(throughputs, reverse=True)


def test_no_layout_fits_names_the_smallest(data_root):
    cfg = gpt_config(data_root)
    machine = polaris()
    machine.device_memory_bytes = 1024  # a kilobyte per device
    with pytest.raises(config_mod.ConfigError, match="no layout fits in .* the smallest"):
        search.best(cfg, 1, 4, machine)


def test_plan_command_prints_json_and_explains(data_root):
    argv = [sys.executable, "-m", "meshtrain", "plan", "gpt", "preset=cpu", f"data.root={data_root}",
            "--system", "perlmutter", "--nodes", "1"]
    out = preloaded.run([*argv, "--json"], env=clean_env(), cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)
    assert rows and all(r["fits"] for r in rows[:3]) and {"peak", "params"} <= set(rows[0]["memory_bytes"])
    assert rows[0]["samples_per_s"] >= rows[1]["samples_per_s"]
    out = preloaded.run([*argv, "--top", "3", "--explain", "2"], env=clean_env(), cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout + out.stderr
    assert "memory: peak" in text and "time: step" in text and "train the first with" in text
    bad = preloaded.run([*argv[:-4], "--system", "summit"], env=clean_env(), cwd=REPO, timeout=300)
    assert bad.returncode != 0 and "polaris" in bad.stdout + bad.stderr


def test_a_restart_whose_layout_cannot_be_formed_is_re_planned(data_root, monkeypatch, caplog):
    """An elastic job saved under fsdp × tp4 on 2 nodes × 2 ranks restarts on the node left (2 ranks): tp4 cannot be
    formed there, so the restart plans a layout as parallel.plan=auto would, keeping the global batch, and says so.
    The same config outside a restart is left to fail as given (its error names the fix)."""
    import logging

    from tests.unit.test_api import one_process

    from meshtrain.plan.measured import auto

    cfg = gpt_config(data_root, "train.backend=fsdp", "parallel.tp=4", "train.global_batch_size=48",
                     "train.dtype=fp32")
    two_ranks = replace(one_process(), world_size=2, local_world_size=2)
    monkeypatch.setattr(auto, "this_machine", lambda *args: machines.from_system(systems.get("polaris")))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("MESHTRAIN_RESTART_COUNT", raising=False)
    assert auto.resolve(cfg, two_ranks) is cfg  # a first start: the run's own checks speak
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with caplog.at_level(logging.WARNING, logger="meshtrain"):
        replanned = auto.resolve(cfg, two_ranks)
    assert "this restart has 2 rank(s) (2 per node), where the run's layout" in caplog.text
    dims = ParallelDims.from_config(replanned, 2, 2)
    assert dims.tp <= 2 and dims.world_size == 2
    assert config_mod.with_global_batch(replanned, dims.dp_size).train.grad_accum * \
        replanned.model.batch_size * dims.dp_size == 48


@pytest.mark.parametrize("command,required", [("plan", "model"), ("train", "MODEL")])
def test_without_arguments_only_the_model_is_named_as_required(command, required, capsys):
    """Overrides are optional: `meshtrain plan` alone asks for the model, not for "model, overrides"."""
    from meshtrain import commands

    with pytest.raises(SystemExit):
        commands.parse([command])
    assert capsys.readouterr().err.strip().endswith(f"error: the following arguments are required: {required}")


@pytest.mark.parametrize("backend,sequence_parallel,world,held", [
    ("ddp", True, 4, 1 / 4), ("ddp", False, 4, 1), ("fsdp", True, 8, 1), ("fsdp", True, 4, 1 / 4)])
def test_the_vits_position_gradient_is_counted_as_the_token_shard_it_arrives_as(backend, sequence_parallel, world,
                                                                                  held):
    """Under sequence parallel the ViT's replicated pos_embed meets a token-sharded stream, and its gradient arrives
    as a Shard(1) DTensor of 1/tp of it (seen in a 4-rank run: [1, 50, 128] of [1, 200, 128]); a backend that shards
    gradients itself keeps its own shards, where it wraps the model (dp 2 × tp 4), not on tp ranks alone (`plan
    --trace`). Every other gradient is its parameter's size."""
    from meshtrain.plan.cost import _shares

    cfg = config_mod.load_config(["preset=tiny", f"train.backend={backend}", "parallel.tp=4",
                       f"parallel.sequence_parallel={str(sequence_parallel).lower()}"], "vit")
    facts = ModelFacts.of(cfg, {"img_size": [80, 160], "channels": 4})
    share, = _shares(facts, cfg, ParallelDims.from_config(cfg, world, 4))
    pos_embed = facts.model.pos_embed.numel()
    assert pos_embed == 200 * 128
    assert share.params - share.grads == round(pos_embed * (1 - held))


def test_the_vits_global_batch_is_split_over_the_accumulation_as_its_workload_splits_it():
    """data.global_batch_size over dp ranks × train.grad_accum micro-steps (models/vit/config.local_batch): 16 on
    2 ranks in 2 micro-steps is 4 a micro-step, and an iteration holds the 16, not twice them."""
    from meshtrain.models.vit.config import local_batch

    cfg = config_mod.load_config(["preset=base", "train.grad_accum=2", "train.backend=ddp"], "vit")
    dims = ParallelDims.from_config(cfg, 2, 2)
    facts = ModelFacts.of(cfg, {"img_size": [360, 720], "channels": 20})
    assert facts.for_dp(2, 2).batch_size == local_batch(cfg, 2) == 4
    assert predict(facts, cfg, dims, machines.from_system(systems.get("polaris"))).samples_per_iteration == 16
