"""The model registry: built-in models, a model of one's own by path or entry point, and clear errors."""

import dataclasses
import sys
import types

import pytest

from meshtrain import registry
from meshtrain.config import ConfigError, load_config, workload_of


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
        assert isinstance(cfg, spec.run_config) and workload_of(cfg) == name
        assert spec.data_key.split(".")[1] in dataclasses.asdict(cfg.data)


def test_a_model_of_ones_own_by_path(own_model):
    spec = registry.get("my_models:SPEC")
    assert spec is own_model.SPEC and spec.source == "my_models:SPEC"
    cfg = load_config(["preset=cpu", "data=tinytext"], "my_models:SPEC")  # the GPT's presets and data key
    assert type(cfg).__name__ == "MyRunConfig" and cfg.data.name == "tinytext" and workload_of(cfg) == "mine"
    assert registry.get("mine") is spec  # by its name, once loaded


def test_a_model_of_ones_own_by_entry_point(own_model, monkeypatch):
    monkeypatch.setattr(registry, "_entry_points", lambda: {"plugged": "my_models:SPEC"})
    assert "plugged" in registry.names()
    assert registry.get("plugged") is own_model.SPEC


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
