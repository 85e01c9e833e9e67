"""Every composed layout the trainer builds equals one process, and checkpoints move between layouts.

Each launch runs several layouts in turn (starting the processes is the slow part); every rank of
layout_check.py records per layout whether loss, gathered gradients, the clipped norm, parameters after each
step and the eval loss are within 1e-5 of a single-process reference (a compiled case, `compile=blocks`: within 1e-4,
at a width torch's CPU inductor compiles right).
"""

from __future__ import annotations

import re
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from tests.conftest import assert_all_equal, run_driver

CHECK = Path(__file__).with_name("layout_check.py")
EQUAL = "loss, gathered gradients, clipped norm, parameters and eval loss within 1e-5 (compiled: 1e-4) of one process"


def launch(ranks: int, cases: list[str], *flags: str, timeout: float = 420) -> dict[int, dict[str, dict]]:
    return run_driver(CHECK, ranks, *cases, *flags, timeout=timeout)


LAYOUTS = {
    2: ["ddp:tp=2,sequence_parallel=false,loss_parallel=false",  # tensor parallel alone
        # tp + sequence parallel + loss parallel, FSDP2 over dp 1, each block compiled around selective checkpointing
        # (the eager path of the same layout: fsdp 2 × tp 2 in LAYOUTS[4]; compiled on 2 ranks, as on 4 it costs two
        # more ranks' cold compile)
        "fsdp:tp=2,ac=selective,compile=blocks",
        "ddp:pp=2,pp_schedule=1f1b",
        "ddp:pp=2,pp_schedule=interleaved_1f1b,virtual_stages=2,ac=full",
        # each stage's blocks compiled around AC, by dynamo and AOT autograd (inductor's code generation is the
        # fsdp × tp case's above: what a pipeline adds is the stage's graphs, not their kernels)
        "ddp:pp=2,pp_schedule=1f1b,ac=full,compile=blocks,inductor=false",
        "ddp:cp=2,cp_impl=ring",
        "ddp:cp=2,cp_impl=ulysses",
        # The Llama-style decoder (GQA, RoPE, SwiGLU, untied head) through the same layouts, from its own folder.
        "fsdp:model=llama",
        "ddp:tp=2,sequence_parallel=false,loss_parallel=false,model=llama",
        "fsdp:tp=2,model=llama",
        "ddp:pp=2,pp_schedule=1f1b,model=llama",
        "ddp:cp=2,cp_impl=ring,model=llama",
        "ddp:cp=2,cp_impl=ulysses,model=llama",
        # the mixture of experts, each rank holding half of the experts, its blocks compiled (the dispatch eager
        # between their graphs) by dynamo and AOT autograd, without inductor's code generation (layout_check's
        # _without_inductor); the eager ep path is the 4-rank launch's ddp/fsdp × ep2/ep4 cases
        "ddp:ep=2,model=moe,compile=blocks,inductor=false",
        # float8 (torchao's tensorwise linears in the blocks, their weights gathered by FSDP2 in float8) beside
        # the experts over ep, against one process with the same float8 linears (where the float8 extra is installed)
        *(["fsdp:ep=2,model=moe,float8=tensorwise"] if find_spec("torchao") else []),
        # tp 2 + SP + LP without ep: every routed and the shared expert cut over tp (each rank half of each hidden
        # width), the router whole on each rank, its plain weights beside tp's
        "ddp:tp=2,model=moe,shared=true"],
    4: ["ddp:pp=2,pp_schedule=gpipe",  # dp 2 x pp 2
        "fsdp:pp=2,pp_schedule=1f1b",  # fsdp 2 x pp 2
        "ddp:tp=2,pp=2,pp_schedule=1f1b",  # tp 2 x pp 2
        "ddp:cp=2,cp_impl=ring",  # dp 2 x cp 2
        "fsdp:cp=2,cp_impl=ulysses",  # fsdp 2 x cp 2
        "fsdp:tp=2,cp=2,cp_impl=ring,ac=selective",  # tp 2 x cp 2, activation checkpointing
        "fsdp:pp=2,pp_schedule=1f1b,model=llama",  # the Llama-style decoder: fsdp 2 x pp 2
        "fsdp:tp=2,cp=2,cp_impl=ulysses,model=llama",  # tp 2 x cp 2
        # the mixture of experts: ep 2 (2 ranks hold each expert: their gradients averaged over that pair) and ep 4
        # (each rank alone holds its experts), under DDP and under FSDP2 (the experts sharded over their own pair);
        # idle: the upper half of the experts is never chosen, so their ranks receive no rows (and must not hang)
        "ddp:ep=2,model=moe",
        "ddp:ep=4,model=moe,idle=true",
        "fsdp:ep=2,model=moe,idle=true",
        "fsdp:ep=4,model=moe",
        # ep composed with model parallelism (dp 2 × ep 2 in each): tp 2 + SP + LP, each expert cut over the (ep, tp)
        # mesh (a rank holds half of each of its experts); ring cp 2, each cp rank routing its own positions (the
        # experts sharded by FSDP2 over their cp pair); pp 2 under DDP, each stage's balance loss through its output
        "fsdp:tp=2,ep=2,model=moe",
        "fsdp:cp=2,ep=2,model=moe",
        "ddp:pp=2,pp_schedule=1f1b,ep=2,model=moe",
        # train.loss_chunks (24 tokens: not a divisor of a micro-step's 64 or a microbatch's 32) against the whole
        # loss: vocabulary-sharded chunks under fsdp 2 × tp 2 + SP + LP, and in the last stage's forward under tp 2
        # × pp 2 (FSDP2 over dp 1: the head's weight gathered only inside the stage's forward)
        "fsdp:tp=2,loss_chunks=24",
        "fsdp:tp=2,pp=2,pp_schedule=1f1b,loss_chunks=24",
        "fsdp:tp=2"],  # fsdp 2 x tp 2, last: the launch saves its checkpoint for the resharding test
    8: ["fsdp:tp=2,pp=2,pp_schedule=1f1b",  # 3-D: fsdp 2 x tp 2 x pp 2
        "hsdp:dp_replicate=2,tp=2",  # 3-D: replicate 2 x shard 2 x tp 2
        "fsdp:tp=2,cp=2,pp=2,pp_schedule=gpipe",  # 4-D: tp 2 x cp 2 x pp 2 (dp 1)
        "hsdp:dp_replicate=2,ep=2,model=moe",  # 2 replicas x 4 shards, ep pairs within a replica
        "fsdp:tp=2,cp=2,cp_impl=ulysses,ep=2,model=moe"],  # tp 2 x cp 2 x fsdp 2, ep pairs across the dp ranks
}


SAVED_UNDER = LAYOUTS[4][-1]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> tuple[dict[int, dict[str, dict]], Path]:
    """The 4-rank layouts, one launch, which then saves a checkpoint of the last (its results, the folder)."""
    saved = tmp_path_factory.mktemp("checkpoint")
    return launch(4, LAYOUTS[4], "--save", str(saved)), saved


@pytest.mark.parametrize("ranks", [2, 4, pytest.param(8, marks=pytest.mark.slow)])  # 8: ~55 s on 2 cores
def test_layouts_equal_one_process(ranks, request):
    results = request.getfixturevalue("four_ranks")[0] if ranks == 4 else launch(ranks, LAYOUTS[ranks])
    assert_all_equal(results, LAYOUTS[ranks], ranks, EQUAL)


@pytest.mark.slow  # ~7 s: three engines in one launch
def test_deepspeed_zero_stages_equal_one_process():
    pytest.importorskip("deepspeed", reason="needs the [deepspeed] extra")
    cases = ["deepspeed:zero_stage=1", "deepspeed:zero_stage=2", "deepspeed:zero_stage=3"]
    assert_all_equal(launch(2, cases), cases, 2, EQUAL)  # loss, DeepSpeed's clip norm, parameters (gathered under ZeRO-3)


def test_checkpoint_reshards_between_layouts(four_ranks):
    # Saved under fsdp 2 x tp 2 (4 ranks) after two steps ...
    results, saved = four_ranks
    assert_all_equal(results, [SAVED_UNDER], 4, EQUAL)
    # ... loaded under ddp 2, pp 2 and tp 2 + fsdp 1 (2 ranks), and by one process reading every shard.
    loaded_under = ["ddp:", "ddp:pp=2,pp_schedule=1f1b", "fsdp:tp=2"]
    launch(2, loaded_under, "--load", str(saved))

    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from meshtrain.models.gpt.model import GPT
    from meshtrain.parallel.state_dict import load_model_and_optimizer_state
    from meshtrain.train import checkpoint
    from meshtrain.train.optim import build_optimizer

    sys.path.insert(0, str(Path(CHECK).parent))
    from layout_check import CONFIG, SGD

    one = GPT(CONFIG)
    optimizer = build_optimizer(one.configure_optimizer_groups(0.1), torch.device("cpu"), **SGD)
    load_model_and_optimizer_state(one, optimizer, checkpoint.dcp_loader(checkpoint.latest_checkpoint(saved)))
    model_state = one.state_dict()
    momentum = {n: s["momentum_buffer"] for n, s in get_optimizer_state_dict(one, optimizer)["state"].items()}
    assert len(momentum) == len(list(one.parameters())), "the optimizer state was saved and loaded"
    assert not torch.equal(model_state["transformer.h.0.mlp.c_fc.weight"], GPT(CONFIG).transformer.h["0"].mlp.c_fc.weight)
    for case in loaded_under:
        got = torch.load(saved / f"gathered-{re.sub('[:,]', '_', case)}.pt", weights_only=True)
        assert set(got["model"]) == set(model_state), case
        for name, value in model_state.items():
            assert torch.equal(got["model"][name], value), f"{case}: {name} differs after resharding"
        for name, value in momentum.items():
            # under pp the head's copy of the tied weight has state of its own, equal to the embedding's
            assert torch.equal(got["optimizer"][name]["momentum_buffer"], value), f"{case}: momentum of {name}"
