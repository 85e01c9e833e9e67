"""Choice fields (`key: Annotated[str, SomeLiteral]`): their values declared once, each one taken, anything else
refused by one error that names the key and every value, for every built-in model."""

import pytest

from meshtrain.config import ConfigError, choices, load_config

PRESETS = {"gpt": "cpu", "llama": "cpu", "vit": "tiny"}


def choice_keys(workload: str) -> dict[str, tuple]:
    cfg = load_config([], workload)
    return {f"{group}.{key}": allowed for group in ("model", "data", "optimizer", "train", "parallel")
            for key, allowed in choices(type(getattr(cfg, group))).items()}


def test_the_closed_sets_are_choices():
    shared = {"train.dtype", "train.activation_checkpointing", "train.wandb", "train.float8", "train.profile",
              "parallel.cp_impl", "parallel.plan", "train.memory_check", "train.compile"}
    assert set(choice_keys("gpt")) == set(choice_keys("llama")) == shared | {"data.order"}
    assert set(choice_keys("vit")) == shared | {"model.loss", "data.loader"}
    assert choice_keys("gpt")["train.dtype"] == ("auto", "fp32", "bf16", "fp16")


@pytest.mark.parametrize("workload", list(PRESETS))
def test_every_value_of_a_choice_is_taken_and_a_bad_one_names_them_all(workload):
    preset = f"preset={PRESETS[workload]}"
    for key, allowed in choice_keys(workload).items():
        group, name = key.split(".")
        for value in allowed:  # as typed: `off` too, which YAML 1.1 alone would read as false
            assert getattr(getattr(load_config([preset, f"{key}={value}"], workload), group), name) == value
        with pytest.raises(ConfigError) as err:
            load_config([preset, f"{key}=bogus"], workload)
        message = str(err.value)
        assert message.startswith(f"{key}='bogus': choose "), message
        assert all(f" {value}" in message for value in allowed), message


def test_a_yes_or_no_word_stays_a_word_only_where_the_key_holds_text():
    cfg = load_config(["train.wandb=off", "train.float8=off", "train.compile=off", "train.tensorboard=yes"], "gpt")
    assert (cfg.train.wandb, cfg.train.float8, cfg.train.compile, cfg.train.tensorboard) == ("off", "off", "off", True)
