"""The model registry: built-in models, a model of one's own by path or entry point, and clear errors."""

import dataclasses
import sys
import types

import pytest

from meshtrain import registry
from meshtrain.config import ConfigError, load_config


@pytest.fixture
def own_model(monkeypatch):
    """A package of one's own exporting a spec: a GPT variant under another name and run config."""
    gpt = registry.get("gpt")
    run_config = dataclasses.make_dataclass("MyRunConfig", [], bases=(gpt.run_config,))
    module = types.ModuleType("my_models")
    module.SPEC = dataclasses.replace(gpt, name="mine", run_config=run_config, source="")
    module.NOT_A_SPEC = object()
    monkeypatch.setitem(sys.modules, "my_models", module)
    yield module
    for key in ("mine", "my_models:SPEC", "plugged"):
        registry._loaded.pop(key, None)


def test_built_in_models_and_their_specs():
    assert registry.names()[:3] == ["gpt", "vit", "llama"]
    for name in registry.names()[:3]:
        spec = registry.get(name)
        assert spec.name == name and spec.presets.is_dir() and any(spec.presets.glob("*.yaml"))
        cfg = load_config([], name)
        assert isinstance(cfg, spec.run_config) and registry.spec_of(cfg).name == name
        assert spec.data_key.split(".")[1] in dataclasses.asdict(cfg.data)


def test_a_model_of_ones_own_by_path(own_model):
    spec = registry.get("my_models:SPEC")
    assert spec is own_model.SPEC and spec.source == "my_models:SPEC"
    cfg = load_config(["preset=cpu", "data=tinytext"], "my_models:SPEC")  # the GPT's presets and data key
    assert type(cfg).__name__ == "MyRunConfig" and cfg.data.name == "tinytext" and registry.spec_of(cfg).name == "mine"
    assert registry.get("mine") is spec  # by its name, once loaded


def test_a_model_of_ones_own_by_entry_point(own_model, monkeypatch):
    monkeypatch.setattr(registry, "_entry_points", lambda: {"plugged": "my_models:SPEC"})
    assert "plugged" in registry.names()
    assert registry.get("plugged") is own_model.SPEC


def test_a_model_by_path_is_found_in_the_working_directory_as_python_m_finds_it(tmp_path, monkeypatch):
    """The `meshtrain` console script's sys.path starts at its bin directory, not at the working directory as
    `python -m meshtrain`'s does: a model package beside the user is found all the same."""
    (tmp_path / "beside_me").mkdir()
    (tmp_path / "beside_me" / "__init__.py").write_text("from meshtrain.models.gpt import SPEC as GPT\n"
                                                       "import dataclasses\nSPEC = dataclasses.replace(GPT, name='beside')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        assert registry.get("beside_me:SPEC").name == "beside" and sys.path[-1] == str(tmp_path)
    finally:
        for key in ("beside", "beside_me:SPEC"):
            registry._loaded.pop(key, None)
        sys.modules.pop("beside_me", None)


@pytest.mark.parametrize("name, message", [
    ("bert", "unknown model 'bert': choose one of gpt, vit, llama"),
    ("no_such_module:SPEC", "cannot load no_such_module:SPEC"),
    ("my_models:NOT_A_SPEC", "is a object, not a meshtrain.registry.ModelSpec"),
])
def test_bad_model_names_are_one_clear_error(own_model, name, message):
    with pytest.raises(registry.RegistryError, match=message):
        registry.get(name)
    with pytest.raises(ConfigError, match=message):  # the same, as the config error `train` prints
        load_config([], name)


@pytest.mark.parametrize("name, overrides", [
    ("gpt", ["preset=cpu", "model.n_head=4", "model.n_embd=64", "model.block_size=32"]),
    ("gpt", ["preset=cpu", "model.n_head=2", "model.n_embd=96", "model.block_size=16"]),
    ("llama", ["preset=cpu", "model.n_kv_head=1", "model.ffn_hidden=160", "model.block_size=32"]),
    ("llama", ["preset=cpu", "model.n_head=8", "model.n_kv_head=4", "model.n_embd=256", "model.block_size=16"]),
    ("vit", ["preset=tiny", "model.mlp_ratio=2.0", "data.crop=[32,64]"]),
    ("moe", ["preset=cpu"]),  # its block 0 is dense (first_dense=1); MoE blocks: tests/unit/test_plan_moe.py
])
def test_activations_per_token_is_what_autograd_saves(name, overrides):
    """The shape's activation count against the bytes autograd keeps for one block's backward (fp32, parameters
    not counted, each storage once)."""
    import torch

    spec = registry.get(name)
    cfg = load_config(overrides, name)
    facts = {"meta": {"vocab_size": 65}, "img_size": [32, 64], "channels": 3}
    torch.manual_seed(0)
    model = spec.build_model(cfg, facts)
    blocks = model.blocks if name == "vit" else model.transformer.h
    block, tokens = blocks["0"], spec.shape(cfg).tokens
    kwargs = model.block_kwargs(torch.arange(tokens)) if hasattr(model, "block_kwargs") else {}
    x = torch.randn(2, tokens, next(block.parameters()).shape[-1], requires_grad=True)
    params, saved = {p.untyped_storage().data_ptr() for p in block.parameters()}, {}

    def keep(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        block(x, **kwargs)
    assert sum(saved.values()) / 4 / (2 * tokens) == spec.shape(cfg).activations_per_token

    def saved_under_autocast(samples: int, dtype: torch.dtype) -> int:
        """Bytes saved by the block's forward in bf16 autocast (on a CPU: attention in fp32), weights included,
        with its parameters and input in `dtype`."""
        kept: dict[int, int] = {}
        weights = {p.untyped_storage().data_ptr() for p in block.parameters()}

        def keep_all(t):
            if t.untyped_storage().data_ptr() not in weights:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        inputs = torch.randn(samples, tokens, x.shape[-1], dtype=dtype, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(keep_all, lambda t: t), torch.autocast("cpu", torch.bfloat16):
            block(inputs, **kwargs)
        return sum(kept.values())

    # what grows with the tokens, against the shape's count; what does not: one bf16 copy of each linear's weight
    saved = spec.shape(cfg).autocast_activations
    one, three = saved_under_autocast(1, torch.float32), saved_under_autocast(3, torch.float32)
    assert (three - one) / (2 * tokens) == saved.fp32 * 4 + saved.low * 2 + saved.attention * 4
    linears = sum(m.weight.numel() for m in block.modules() if isinstance(m, torch.nn.Linear))
    rotary_table = 2 * tokens * cfg.model.n_embd // cfg.model.n_head // 2 * 4 if name in ("llama", "moe") else 0
    assert one - (three - one) / 2 == linears * 2 + rotary_table
    block.to(torch.bfloat16)  # FSDP2's mixed precision: 16-bit weights and input, no copies
    one, three = saved_under_autocast(1, torch.bfloat16), saved_under_autocast(3, torch.bfloat16)
    assert (three - one) / (2 * tokens) == saved.fp32_16bit_weights * 4 + saved.low_16bit_weights * 2 + \
        saved.attention * 4
