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
    assert cfg.data.name == "shakespeare_char" and cfg.train.compile == "off" and cfg.train.dtype == "bf16"


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
    # the overrides merge in one go; the one at fault is still the one named, among good ones before and after it
    (["model.n_layer=2", "train.max_iter=3", "train.max_iters=5"], "unknown key 'train.max_iter': did you mean"),
    (["trian.max_iters=3"], "unknown key 'trian': did you mean train?"),
    (["model.n_layer=abc"], "model.n_layer=abc: Value 'abc'"),
    (["model.n_head=5"], "model.n_embd=128 is not divisible by model.n_head=5"),
    (["train.grad_accum=0"], "train.grad_accum=0: must be at least 1"),
    (["train.straggler_ratio=0.9"], "train.straggler_ratio=0.9: a ratio to the median step, above 1"),
    (["train.straggler_intervals=0"], "train.straggler_intervals=0: must be at least 1"),
    (["train.dtype=fp8"], "train.dtype='fp8': choose one of auto, fp32, bf16, fp16"),
    (["train.activation_checkpointing=ops"],
     "train.activation_checkpointing='ops': choose one of none, full, selective, op"),
    (["preset=nope"], "preset=nope: no such preset"),
    (["max_iters"], "overrides are key=value"),
    (["optimizer.min_lr=1"], "need 0 <= min_lr <= lr"),
    (["model.dropout=1.5"], "model.dropout=1.5: must be in [0, 1)"),
    # what a backend does not compose with (parallel/backends/), refused from the config alone
    (["train.backend=zero1", "parallel.tp=2"], "train.backend=zero1 with tp=2 cp=1 pp=1: ZeroRedundancyOptimizer"),
    (["train.backend=hsdp", "parallel.dp_replicate=2", "parallel.cp=2"],
     "train.backend=hsdp with tp=1 cp=2 pp=1: context parallelism under hsdp"),
    (["train.backend=deepspeed", "parallel.pp=2"], "train.backend=deepspeed with tp=1 cp=1 pp=2: meshtrain runs "
                                                   "DeepSpeed's ZeRO as data parallelism only"),
    (["train.backend=deepspeed", "train.float8=rowwise"], "train.float8=rowwise with deepspeed"),
    (["train.backend=hsdp"], "parallel.dp_replicate=1 with train.backend=hsdp: replicas of shards are hsdp's"),
    (["train.backend=zero4"], "train.backend='zero4': choose one of ddp, zero1, zero2, fsdp, zero3, hsdp, deepspeed"),
    # compile: the blocks compose with every layout; the whole model has no pipeline, DeepSpeed's engine neither
    (["train.compile=model", "parallel.pp=2"], "train.compile=model with parallel.pp > 1: each rank runs its pipeline "
                                               "stages apart"),
    (["train.compile=true", "train.backend=deepspeed"], "train.compile=blocks with train.backend=deepspeed"),
    (["train.compile=fast"], "train.compile='fast': choose one of off, blocks, model"),
])
def test_mistakes_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_overrides_apply_in_order_the_last_of_a_key_winning():
    cfg = load_config(["train.max_iters=3", "preset=cpu", "model.n_layer=3", "train.max_iters=9", "model.n_layer=5"])
    assert (cfg.train.max_iters, cfg.model.n_layer) == (9, 5)


def test_round_trip_through_a_saved_dict_and_yaml():
    cfg = load_config(["preset=cpu", "train.seed=7"])
    assert from_dict(to_dict(cfg)) == cfg
    assert "seed: 7" in to_yaml(cfg)


# ---- the vit workload ---------------------------------------------------------------------------------------------
def test_vit_presets_mirror_nersc_and_the_square_root_rule_gives_their_learning_rates():
    import math

    from meshtrain.train.optim import scaled_learning_rates

    assert {"tiny", "short", "base", "bs64_opt", "bs256_opt", "bs1024_opt", "mp"} <= set(presets("vit"))
    base, short = load_config(["preset=base"], "vit"), load_config(["preset=short"], "vit")
    assert (base.model.embed_dim, base.model.depth, base.model.num_heads, base.model.patch_size) == (384, 12, 8, 8)
    assert (base.data.crop, base.data.global_batch_size, base.optimizer.lr) == ([360, 720], 16, 5e-4)
    assert (short.data.limit_train, short.data.limit_valid, short.train.max_iters) == (512, 128, 128)
    assert short.model == base.model  # short extends base (defaults_from)
    # NERSC's hand-set rates for batches 64, 256 and 1024 are 1e-3, 2e-3 and 4e-3.
    for name, batch, lr in (("bs64_opt", 64, 1e-3), ("bs256_opt", 256, 2e-3), ("bs1024_opt", 1024, 4e-3)):
        cfg = load_config([f"preset={name}"], "vit")
        assert cfg.data.global_batch_size == batch and (cfg.train.compile, cfg.optimizer.fused) == ("blocks", True)
        assert scaled_learning_rates(cfg, batch)[0] == pytest.approx(lr)
    mp = load_config(["preset=mp"], "vit")
    assert (mp.model.embed_dim, mp.parallel.tp, mp.train.backend) == (1024, 4, "fsdp")
    assert scaled_learning_rates(mp, 64) == pytest.approx((1e-3, 0.0, 2.0))
    assert scaled_learning_rates(load_config(["preset=tiny"], "vit"), 64)[2] == 1.0  # no base batch: as given
    assert math.isclose(scaled_learning_rates(base, 32)[0], 5e-4 * math.sqrt(2))


def test_no_preset_hard_codes_bf16_the_hardware_chooses():
    dtypes = {(w, name): load_config([f"preset={name}"], w).train.dtype for w in ("gpt", "vit") for name in presets(w)}
    # NERSC's baseline rungs are fp32 by definition; everything else leaves the choice to the hardware
    assert {key for key, dtype in dtypes.items() if dtype != "auto"} == {("vit", "base"), ("vit", "short")}
    assert load_config([], "gpt").train.dtype == load_config([], "vit").train.dtype == "auto"
    assert load_config(["preset=bs256_opt", "amp_mode=fp16"], "vit").train.dtype == "fp16"  # NERSC's flag overrides


def test_vit_takes_nersc_flag_names():
    cfg = load_config(["preset=tiny", "amp_mode=none", "num_data_workers=4", "enable_fused=true", "enable_jit=true",
                       "global_batch_size=32", "data=/somewhere/era5", "data_loader_config=dali"], "vit")
    assert (cfg.train.dtype, cfg.data.num_workers, cfg.optimizer.fused, cfg.train.compile) == ("fp32", 4, True, "blocks")
    assert (cfg.data.global_batch_size, cfg.data.root, cfg.data.loader) == (32, "/somewhere/era5", "dali")
    assert load_config(["amp_mode=bf16"], "vit").train.dtype == "bf16"
    assert from_dict(to_dict(cfg), "vit") == cfg


@pytest.mark.parametrize("overrides,message", [
    (["model.embed_dim=100", "model.num_heads=8"], "model.embed_dim=100 is not divisible by model.num_heads=8"),
    (["data.crop=[90,180]"], "data.crop=[90, 180]: give [rows, columns], both multiples of model.patch_size=8"),
    (["parallel.cp=2", "model.loss=relative_l2"], "model.loss=relative_l2 with parallel.cp=2"),
    (["train.cuda_graphs=true"], "set train.compile=model (not off"),
    (["train.cuda_graphs=true", "train.compile=true"], "set train.compile=model (not blocks"),
    (["train.profile=nvprof"], "train.profile='nvprof': choose one of none, torch, nsys"),
    (["model.n_layer=2"], "unknown key 'model.n_layer'"),
    (["train.prompt=hi"], "unknown key 'train.prompt'"),
    (["data.limit_train=0"], "data.limit_train=0: must be at least 1"),
    (["data.loader=ffcv"], "data.loader='ffcv': choose pytorch or dali"),
])
def test_vit_mistakes_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(["preset=tiny", *overrides], "vit")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_gpt_has_no_epochs_and_presets_cannot_loop(tmp_path):
    with pytest.raises(ConfigError, match="train.max_epochs is for the vit workload"):
        load_config(["train.max_epochs=3"])
    (tmp_path / "a.yaml").write_text(f"defaults_from: {tmp_path / 'b.yaml'}\n")
    (tmp_path / "b.yaml").write_text(f"defaults_from: {tmp_path / 'a.yaml'}\n")
    with pytest.raises(ConfigError, match="defaults_from loops"):
        load_config([f"preset={tmp_path / 'a.yaml'}"])


def test_the_stop_condition_given_on_the_command_line_wins_over_the_presets(caplog):
    """vit preset=tiny sets train.max_epochs=30: a train.max_iters given replaces it (and says so), never the
    reverse in silence; both given, or an eval_interval the epochs would ignore, is one error."""
    import logging

    with caplog.at_level(logging.INFO, logger="meshtrain"):
        cfg = load_config(["preset=tiny", "train.max_iters=20"], "vit")
    assert cfg.train.max_epochs is None and cfg.train.max_iters == 20
    assert "train.max_iters=20 given: it replaces the preset's train.max_epochs=30" in caplog.text
    assert load_config(["preset=tiny"], "vit").train.max_epochs == 30  # the preset alone: its epochs
    assert load_config(["preset=tiny", "train.max_epochs=2"], "vit").train.max_epochs == 2
    with pytest.raises(ConfigError, match=r"train.max_iters=20 and train.max_epochs=2 both given: .*give one"):
        load_config(["preset=tiny", "train.max_iters=20", "train.max_epochs=2"], "vit")
    with pytest.raises(ConfigError, match=r"train.eval_interval=5: with train.max_epochs=30 \(from the preset\)"):
        load_config(["preset=tiny", "train.eval_interval=5"], "vit")
    assert load_config(["preset=tiny", "train.max_iters=20", "train.eval_interval=5"], "vit").train.eval_interval == 5


def test_compile_true_is_blocks_and_they_compose_with_every_layout():
    assert load_config(["train.compile=true"]).train.compile == "blocks"
    cfg = load_config(["train.compile=true", "parallel.pp=2", "parallel.tp=2", "train.backend=fsdp",
                       "train.activation_checkpointing=full"])
    assert (cfg.train.compile, cfg.parallel.pp) == ("blocks", 2)
    assert from_dict({**to_dict(cfg), "train": {**to_dict(cfg)["train"], "compile": True}}).train.compile == "blocks"


def test_choices_are_read_in_any_case():
    cfg = load_config(["train.backend=DDP", "train.dtype=BF16", "parallel.cp_impl=Ulysses"])
    assert (cfg.train.backend, cfg.train.dtype, cfg.parallel.cp_impl) == ("ddp", "bf16", "ulysses")


def test_the_global_batch_sets_the_accumulation_on_any_number_of_ranks():
    from meshtrain.config import with_global_batch

    cfg = load_config(["train.global_batch_size=48", "model.batch_size=12"])
    assert [with_global_batch(cfg, dp).train.grad_accum for dp in (1, 2, 4)] == [4, 2, 1]
    assert with_global_batch(load_config(["train.grad_accum=3"]), 4).train.grad_accum == 3  # unset: as given
    with pytest.raises(ConfigError) as err:
        with_global_batch(cfg, 3)  # 3 ranks × 12 = 36 samples a micro-step: 48 is not a whole number of them
    assert str(err.value) == ("train.global_batch_size=48 is not a whole number of micro-steps of 3 data-parallel "
                              "rank(s) × model.batch_size=12 (36 samples): use a multiple of 36 (36, 72), or "
                              "model.batch_size = one of 1, 2, 4, 8")
    with pytest.raises(ConfigError, match="train.grad_accum=3 and train.global_batch_size=48 disagree"):
        with_global_batch(load_config(["train.global_batch_size=48", "model.batch_size=12", "train.grad_accum=3"]), 1)
    with pytest.raises(ConfigError, match="train.global_batch_size=16 and data.global_batch_size=16"):
        load_config(["train.global_batch_size=16", "data.global_batch_size=16"], "vit")


def test_overrides_may_follow_the_options():
    from meshtrain.commands import parse

    args = parse(["plan", "vit", "--nodes", "4", "parallel.tp=4", "--top", "3", "train.dtype=fp32"])
    assert (args.model, args.nodes, args.top, args.overrides) == ("vit", 4, 3, ["parallel.tp=4", "train.dtype=fp32"])
    assert parse(["train", "gpt", "--device", "cpu", "preset=cpu"]).overrides == ["preset=cpu"]
    with pytest.raises(SystemExit):  # what is neither an option nor key=value is still refused
        parse(["plan", "vit", "--nodes", "4", "tp4"])
