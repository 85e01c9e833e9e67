"""Config: defaults <- preset <- overrides, and one clear error per mistake."""

import pytest

from meshtrain.config import ConfigError, from_dict, load_config, presets, to_dict, to_yaml


def test_presets_ship_with_the_package():
    assert {"cpu", "cpu_fast", "shakespeare_char", "gpt2"} <= set(presets("gpt"))


def test_seed_command_line_resolves():
    cfg = load_config(["train.backend=ddp", "data=shakespeare_char", "train.dtype=bf16", "model.batch_size=64",
                       "model.block_size=1024", "train.max_iters=1000", "train.eval_interval=100",
                       "train.log_interval=10", "train.compile=false"])
    assert (cfg.model.batch_size, cfg.model.block_size, cfg.train.max_iters) == (64, 1024, 1000)
    assert cfg.data.name == "shakespeare_char" and cfg.train.compile is False and cfg.train.dtype == "bf16"


def test_preset_then_overrides_in_order():
    cfg = load_config(["preset=shakespeare_char", "model.n_layer=3"])
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.block_size) == (3, 6, 384, 256)
    assert cfg.model.dropout == 0.2
    gpt2 = load_config(["preset=gpt2"])
    assert (gpt2.model.n_layer, gpt2.model.n_embd, gpt2.model.block_size, gpt2.data.name) == (12, 768, 1024,
                                                                                                "shakespeare")


def test_preset_from_a_yaml_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("model: {n_layer: 2}\ntrain: {max_iters: 7}\n")
    cfg = load_config([f"preset={path}"])
    assert (cfg.model.n_layer, cfg.train.max_iters) == (2, 7)


@pytest.mark.parametrize("overrides,message", [
    (["train.max_iter=3"], "unknown key 'train.max_iter': did you mean train.max_iters?"),
    (["trian.max_iters=3"], "unknown key 'trian': did you mean train?"),
    (["model.n_layer=abc"], "model.n_layer=abc: Value 'abc'"),
    (["model.n_head=5"], "model.n_embd=128 is not divisible by model.n_head=5"),
    (["train.grad_accum=0"], "train.grad_accum=0: must be at least 1"),
    (["train.dtype=fp8"], "train.dtype='fp8': choose one of fp32, bf16, fp16"),
    (["preset=nope"], "preset=nope: no such preset"),
    (["max_iters"], "overrides are key=value"),
    (["optimizer.min_lr=1"], "need 0 <= min_lr <= lr"),
    (["model.dropout=1.5"], "model.dropout=1.5: must be in [0, 1)"),
])
def test_mistakes_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_round_trip_through_a_saved_dict_and_yaml():
    cfg = load_config(["preset=cpu", "train.seed=7"])
    assert from_dict(to_dict(cfg)) == cfg
    assert "seed: 7" in to_yaml(cfg)
