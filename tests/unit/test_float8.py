"""train.float8: the config's rules, the refusal off float8 hardware, which linears torchao converts, and (emulated on
the CPU) that a converted GPT computes the same loss and gradients within float8's rounding. CUDA graphs' auto rule
and when data parallelism wraps a model, which float8's FSDP path rests on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from meshtrain.config import ConfigError, load_config
from meshtrain.models.gpt.model import GPT, GPTConfig
from meshtrain.parallel import float8
from meshtrain.parallel.compose import CUDA_GRAPHS_AUTO_MAX_PARAMS, use_cuda_graphs
from meshtrain.parallel.data_parallel import wraps


@pytest.mark.parametrize(("overrides", "expected"), [
    (["train.float8=e4m3"], "train.float8='e4m3': choose one of off, tensorwise, rowwise"),
    (["train.float8=tensorwise", "parallel.tp=2", "train.backend=fsdp"], "parallel.tp=2: float8 linears are not"),
    (["train.float8=rowwise", "train.backend=deepspeed"], "with deepspeed: float8 linears are not"),
])
def test_float8_settings_that_cannot_run_are_refused(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(["preset=cpu", *overrides])


def test_float8_on_a_cpu_is_refused_naming_the_device():
    with pytest.raises(float8.Float8Error, match=r"train.float8=tensorwise: .*compute capability 8.9.*runs on cpu"):
        float8.check("tensorwise", torch.device("cpu"))
    float8.check("off", torch.device("cpu"))  # off asks nothing of the device


def _tiny_gpt(width: int = 64) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=width, block_size=32, vocab_size=96, bias=False))


def test_only_the_blocks_linears_of_float8_widths_are_converted():
    pytest.importorskip("torchao.float8", reason="torchao (the float8 extra) is not installed")
    model = _tiny_gpt()
    swapped = float8.convert_blocks(model.transformer.h.values(), "tensorwise", fsdp=True)
    assert swapped == 12  # 2 blocks × (q, k, v, attention out, MLP in, MLP out)
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds.pop("lm_head") == "Linear"  # the head feeds the loss: left in the training dtype
    assert set(kinds.values()) == {"Float8Linear"}
    assert float8.gathers_in_float8(model)  # tensorwise under FSDP gathers float8 weights
    odd = torch.nn.Sequential(torch.nn.Linear(64, 24), torch.nn.Linear(24, 64))  # 24 is no multiple of 16
    assert float8.convert_blocks([odd], "rowwise", fsdp=True) == 0
    assert not float8.gathers_in_float8(odd)


def test_a_mixture_of_experts_router_stays_out_of_float8():
    pytest.importorskip("torchao.float8", reason="torchao (the float8 extra) is not installed")
    from meshtrain.models.moe.model import MoEConfig, MoEDecoder

    model = MoEDecoder(MoEConfig(block_size=16, vocab_size=65, n_layer=1, n_head=4, n_kv_head=2, n_embd=32,
                                 ffn_hidden=64, n_experts=16, top_k=2, expert_hidden=32, n_shared_experts=1))
    assert float8.convert_blocks(model.transformer.h.values(), "tensorwise", fsdp=False) == 7  # q k v o, the shared SwiGLU's 3
    block = model.transformer.h["0"]
    assert type(block.mlp.router.gate).__name__ == "Linear"  # 32 -> 16 would fit float8: the mark keeps it out
    assert type(block.mlp.shared.c_fc).__name__ == "Float8Linear"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_an_emulated_float8_gpt_follows_the_float32_one(recipe):
    pytest.importorskip("torchao.float8", reason="torchao (the float8 extra) is not installed")
    reference, model = _tiny_gpt(), _tiny_gpt()
    float8.convert_blocks(model.transformer.h.values(), recipe, fsdp=False, emulate=True)
    x, y = torch.randint(96, (4, 32)), torch.randint(96, (4, 32))
    loss, want = model(x, y)[1], reference(x, y)[1]
    loss.backward()
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-3)
    for name, p in reference.named_parameters():
        got = model.get_parameter(name).grad
        error = ((got - p.grad).norm() / p.grad.norm()).item()
        # e4m3 keeps 3 bits of mantissa: a few percent per element; the converted matmuls must differ at all
        assert error < 0.25, (name, error)
        if name.endswith("mlp.c_fc.weight"):
            assert error > 1e-4, "the block's linears were not computed in float8"


def _train(**changes):
    return SimpleNamespace(**{"cuda_graphs": None, "compile": "model", "float8": "off", **changes})


@pytest.mark.parametrize(("train", "world", "device", "params", "expected"), [
    (_train(), 1, "cuda", 10_700_000, True),  # the baby GPT: launch-bound
    (_train(), 1, "cuda", 124_000_000, False),  # GPT-2: the GPU is busy already
    (_train(), 2, "cuda", 10_700_000, False),  # collectives are left out of capture
    (_train(float8="tensorwise"), 1, "cuda", 10_700_000, False),
    (_train(compile="off"), 1, "cuda", 10_700_000, False),
    (_train(compile="blocks"), 1, "cuda", 10_700_000, False),  # a graph per block would overwrite its outputs
    (_train(), 1, "cpu", 10_700_000, False),
    (_train(cuda_graphs=True), 2, "cuda", 124_000_000, True),  # asked for: as asked
    (_train(cuda_graphs=False), 1, "cuda", 10_700_000, False),
])
def test_cuda_graphs_auto_captures_small_models_on_one_cuda_rank(train, world, device, params, expected):
    assert CUDA_GRAPHS_AUTO_MAX_PARAMS == 50_000_000
    assert use_cuda_graphs(train, SimpleNamespace(world_size=world), torch.device(device), params) is expected


def test_data_parallelism_wraps_one_rank_only_for_a_sharded_backend_under_a_launcher():
    assert wraps("ddp", 2) and wraps("fsdp", 2)
    assert not torch.distributed.is_initialized()
    assert not wraps("fsdp", 1) and not wraps("ddp", 1)  # one process, no process group: nothing to wrap
