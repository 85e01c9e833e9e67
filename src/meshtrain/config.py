"""Typed run configuration: dataclass defaults <- a YAML preset <- dotted command-line overrides.

    meshtrain train gpt preset=shakespeare_char data=shakespeare train.dtype=fp32 model.n_layer=6
    meshtrain train vit preset=tiny parallel.tp=2 amp_mode=bf16 num_data_workers=2

`preset=NAME` merges `configs/<workload>/NAME.yaml` (shipped with the package) or a YAML path;
`data=NAME` is short for `data.name=NAME` (gpt) or `data.root=NAME` (vit); everything else is
`group.key=value`, or one of NERSC's flag names (ALIASES) for the same key. OmegaConf checks keys
and types against the dataclasses; `validate` checks that values fit together. Every problem is one
ConfigError that names the key and what to do.

The two workloads share the optimizer, train and parallel groups and differ in model and data:
GPTRunConfig (token windows) and ViTRunConfig (ERA5 fields).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from meshtrain.errors import MeshtrainError

PRESET_DIR = Path(__file__).parent / "configs"
DTYPES = ("auto", "fp32", "bf16", "fp16")  # auto: machine/precision.py chooses
BACKENDS = ("ddp", "zero1", "zero2", "fsdp", "zero3", "hsdp", "deepspeed")  # parallel/data_parallel.py, deepspeed_backend.py
PROFILERS = ("none", "torch", "nsys")  # train/profiling.py
CP_IMPLS = ("ring", "ulysses")  # parallel/context_parallel.py


class ConfigError(MeshtrainError, ValueError):
    """A configuration key, type or value that cannot be used; the message says which and how to fix it."""


@dataclass
class ModelSection:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    batch_size: int = 12  # sequences per micro-step per data-parallel rank
    dropout: float = 0.0
    bias: bool = False
    activation: str = "gelu"


@dataclass
class DataSection:
    name: str = "shakespeare_char"  # shakespeare_char | shakespeare | the name given to `prepare text`
    root: str = "data"  # where `meshtrain prepare` wrote <name>/train.bin, val.bin, meta.json


@dataclass
class OptimizerSection:
    lr: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    warmup_iters: int = 100
    lr_decay_iters: int | None = None  # default: train.max_iters
    decay_lr: bool = True
    grad_clip: float = 1.0  # 0 disables clipping
    fused: bool | None = None  # AdamW's fused kernel (NERSC's enable_fused); default: on CUDA and CPU
    # Square-root rule: lr (and min_lr) are for this global batch and scale by sqrt(global / base_batch_size).
    base_batch_size: int | None = None  # null: lr is used as given


@dataclass
class TrainSection:
    backend: str = "ddp"
    dtype: str = "auto"  # auto (what the device computes natively) | fp32 | bf16 (autocast) | fp16 (+ GradScaler, GPU)
    compile: bool = False
    activation_checkpointing: str = "none"  # none | full | selective (every ac_every-th block)
    ac_every: int = 2
    max_iters: int = 2000
    grad_accum: int = 1  # micro-steps per iteration; only the last one synchronises gradients
    eval_interval: int = 250
    eval_iters: int = 20
    log_interval: int = 10
    max_minutes: float | None = None  # stop (with a checkpoint) once this wall-clock budget is spent
    seed: int = 1337
    max_epochs: int | None = None  # vit: passes over the data; when set, it replaces max_iters and eval_interval
    init_from: str = "scratch"  # scratch | resume | (gpt) a GPT-2 name or local Hugging Face directory
    out_dir: str = "outputs/runs"
    run_dir: str | None = None  # the run to resume (default: the latest run of this workload/backend)
    save_checkpoints: bool = True
    async_checkpoint: bool = False  # write checkpoints from a background thread while training goes on
    keep_checkpoints: int = 2  # step directories kept per run (0: all)
    peak_flops: float | None = None  # FLOP/s per device for MFU; default: the device table or a measurement
    tensorboard: bool = False
    wandb: str = "off"  # off | offline | online
    cuda_graphs: bool = False  # with compile: capture steps as CUDA graphs (torch.compile mode reduce-overhead)
    profile: str = "none"  # none | torch (Chrome trace of the window) | nsys (cudaProfilerStart/Stop around it)
    profile_start: int = 10  # the first iteration of the profiled window
    profile_steps: int = 5


@dataclass
class GPTTrainSection(TrainSection):
    prompt: str = "What is an LLM?"
    sample_tokens: int = 200
    temperature: float = 0.8
    top_k: int | None = 200


@dataclass
class ParallelSection:
    dp_replicate: int = 1  # hsdp: replicas, each sharded over dp_shard ranks
    dp_shard: int = -1  # -1: the ranks left over
    tp: int = 1  # tensor parallel: heads and MLP columns sharded; keep it within a node
    sequence_parallel: bool = True  # tp: norms and dropout on sequence shards (activations / tp)
    loss_parallel: bool = True  # tp: cross-entropy on vocabulary shards, the logits never gathered
    cp: int = 1  # context parallel: the sequence sharded
    cp_impl: str = "ring"  # ring (K/V passed around, any head count) | ulysses (all-to-all, heads % cp == 0)
    pp: int = 1  # pipeline stages
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | looped_bfs | interleaved_zero_bubble | ...
    microbatches: int | None = None  # per pipeline step (model.batch_size splits into them); default: pp x virtual_stages
    virtual_stages: int = 1  # stages per pipeline rank (interleaved/looped schedules need 2 or more)
    order: str = "tp-cp-dp-pp"  # the first dim's ranks are adjacent (on one node)
    cpu_offload: bool = False  # fsdp/zero2/zero3/hsdp: parameters and optimizer state live in host memory
    zero_stage: int = 2  # train.backend=deepspeed: ZeRO stage 1 (optimizer), 2 (+ gradients) or 3 (+ parameters)


@dataclass
class GPTRunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    train: GPTTrainSection = field(default_factory=GPTTrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)


@dataclass
class ViTModelSection:  # models/vit.py ViTConfig; img_size and channels come from the data
    patch_size: int = 8
    embed_dim: int = 384
    depth: int = 12
    num_heads: int = 8
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    drop_path: float = 0.0
    loss: str = "mse"  # mse | relative_l2 (FourCastNet's; not with context parallel)


@dataclass
class ERA5DataSection:  # data/era5.py
    root: str = "data/era5_synthetic"  # train/ valid/ test/ of YEAR.h5 and stats/ (NERSC's layout)
    dt: int = 1  # forecast step, in time steps of the files
    crop: list[int] | None = field(default_factory=lambda: [360, 720])  # top-left rows x columns; null: whole grid
    channels: list[str] | None = None  # null: all; the first is the one RMSE is reported for (u10)
    limit_train: int | None = None  # NERSC's short: 512
    limit_valid: int | None = None  # NERSC's short: 128
    batch_size: int = 16  # samples per micro-step per data-parallel rank
    global_batch_size: int | None = None  # if set, batch_size = global / (data-parallel ranks x grad_accum)
    loader: str = "pytorch"  # pytorch (DataLoader) | dali (NVIDIA DALI pipeline, the [dali] extra)
    num_workers: int = 0  # loader worker processes per rank (NERSC's num_data_workers)
    pin_memory: bool | None = None  # null: on a GPU
    persistent_workers: bool = True
    prefetch_factor: int = 2


@dataclass
class ViTRunConfig:
    model: ViTModelSection = field(default_factory=ViTModelSection)
    data: ERA5DataSection = field(default_factory=ERA5DataSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)


RUN_CONFIGS = {"gpt": GPTRunConfig, "vit": ViTRunConfig}
# NERSC dl-at-scale-training's flag names -> (meshtrain key, value translation)
ALIASES = {
    "amp_mode": ("train.dtype", lambda v: {"none": "fp32"}.get(v, v)),
    "enable_jit": ("train.compile", None),
    "enable_fused": ("optimizer.fused", None),
    "cuda_graphs": ("train.cuda_graphs", None),
    "num_data_workers": ("data.num_workers", None),
    "data_loader_config": ("data.loader", None),
    "global_batch_size": ("data.global_batch_size", None),
}


def presets(workload: str = "gpt") -> list[str]:
    return sorted(p.stem for p in (PRESET_DIR / workload).glob("*.yaml"))


def _preset_path(workload: str, name: str) -> Path:
    path = Path(name) if name.endswith((".yaml", ".yml")) else PRESET_DIR / workload / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"preset={name}: no such preset; choose one of {', '.join(presets(workload))} "
                          "or give a path to a .yaml file")
    return path


def _preset_chain(workload: str, name: str, seen: tuple[str, ...] = ()) -> list[DictConfig]:
    """The preset's YAML after those it names in `defaults_from` (a preset extends another, as NERSC's YAML
    anchors do), first to last."""
    if name in seen:
        raise ConfigError(f"preset={seen[0]}: defaults_from loops through {' -> '.join((*seen, name))}")
    values = OmegaConf.load(_preset_path(workload, name))
    parent = values.pop("defaults_from", None)
    return [*(_preset_chain(workload, parent, (*seen, name)) if parent else []), values]


def _explain(e: OmegaConfBaseException, schema: DictConfig, origin: str) -> ConfigError:
    key = getattr(e, "full_key", None) or ""
    message = (getattr(e, "msg", None) or str(e)).strip().splitlines()[0]
    if "not in struct" in str(e) or type(e).__name__ == "ConfigKeyError":
        group, _, name = key.rpartition(".")
        known = list(OmegaConf.select(schema, group).keys()) if group and OmegaConf.select(schema, group) else \
            list(schema.keys())
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {group + '.' if group else ''}{close[0]}? " if close else ""
        where = f"the {group} group" if group else "the config"
        return ConfigError(f"{origin}: unknown key {key!r}: {hint}{where} has {', '.join(known)}")
    return ConfigError(f"{origin}: {message}" if key in origin else f"{origin}: {key}: {message}")


def _schema(workload: str) -> DictConfig:
    if workload not in RUN_CONFIGS:
        raise ConfigError(f"unknown workload {workload!r}: choose one of {', '.join(RUN_CONFIGS)}")
    return OmegaConf.structured(RUN_CONFIGS[workload])


def load_config(overrides: list[str] = (), workload: str = "gpt") -> GPTRunConfig | ViTRunConfig:
    """Defaults, then `preset=...`, then the dotted overrides in order; validated."""
    schema = _schema(workload)
    cfg = schema.copy()
    dotted = []
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"{item!r}: overrides are key=value, e.g. train.max_iters=100 or preset=cpu")
        if key == "preset":
            try:
                cfg = OmegaConf.merge(cfg, *_preset_chain(workload, value))
            except OmegaConfBaseException as e:
                raise _explain(e, schema, f"preset {value}") from None
        elif key == "data":
            dotted.append(f"data.{'name' if workload == 'gpt' else 'root'}={value}")
        elif key in ALIASES:
            target, translate = ALIASES[key]
            dotted.append(f"{target}={translate(value) if translate else value}")
        else:
            dotted.append(item)
    for item in dotted:
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as e:
            raise _explain(e, schema, item) from None
    run = OmegaConf.to_object(cfg)
    validate(run)
    return run


def _check_positive(values: dict[str, int | None]) -> None:
    for key, value in values.items():
        if value is not None and value < 1:
            raise ConfigError(f"{key}={value}: must be at least 1")


def validate(cfg: GPTRunConfig | ViTRunConfig) -> None:
    m, t, o = cfg.model, cfg.train, cfg.optimizer
    _check_positive({"train.max_iters": t.max_iters, "train.grad_accum": t.grad_accum,
                     "train.eval_interval": t.eval_interval, "train.eval_iters": t.eval_iters,
                     "train.log_interval": t.log_interval, "train.max_epochs": t.max_epochs,
                     "train.profile_steps": t.profile_steps, "optimizer.base_batch_size": o.base_batch_size})
    if isinstance(cfg, ViTRunConfig):
        _validate_vit(cfg)
    else:
        _validate_gpt(cfg)
    if not 0 <= m.dropout < 1:
        raise ConfigError(f"model.dropout={m.dropout}: must be in [0, 1)")
    if t.profile not in PROFILERS:
        raise ConfigError(f"train.profile={t.profile!r}: choose one of {', '.join(PROFILERS)}")
    if t.profile_start < 0:
        raise ConfigError(f"train.profile_start={t.profile_start}: an iteration number, at least 0")
    if t.cuda_graphs and not t.compile:
        raise ConfigError("train.cuda_graphs=true captures through torch.compile: set train.compile=true "
                          "(enable_jit) as well")
    _validate_layout(cfg)


def _validate_gpt(cfg: GPTRunConfig) -> None:
    m, t = cfg.model, cfg.train
    _check_positive({"model.n_layer": m.n_layer, "model.n_head": m.n_head, "model.n_embd": m.n_embd,
                     "model.block_size": m.block_size, "model.batch_size": m.batch_size})
    if m.n_embd % m.n_head:
        raise ConfigError(f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}: "
                          "each head gets n_embd / n_head channels")
    if t.max_epochs is not None:
        raise ConfigError("train.max_epochs is for the vit workload: the GPT samples random windows, which have no "
                          "epochs; set train.max_iters instead")
    p = cfg.parallel
    microbatches = p.microbatches or p.pp * p.virtual_stages
    if p.pp > 1 and m.batch_size % microbatches:
        raise ConfigError(f"model.batch_size={m.batch_size} does not split into parallel.microbatches={microbatches} "
                          f"for the pipeline: make the batch a multiple of {microbatches} (or change microbatches)")


def _validate_vit(cfg: ViTRunConfig) -> None:
    m, d, t, p = cfg.model, cfg.data, cfg.train, cfg.parallel
    _check_positive({"model.patch_size": m.patch_size, "model.embed_dim": m.embed_dim, "model.depth": m.depth,
                     "model.num_heads": m.num_heads, "data.dt": d.dt, "data.batch_size": d.batch_size,
                     "data.global_batch_size": d.global_batch_size, "data.limit_train": d.limit_train,
                     "data.limit_valid": d.limit_valid, "data.prefetch_factor": d.prefetch_factor})
    if m.embed_dim % m.num_heads:
        raise ConfigError(f"model.embed_dim={m.embed_dim} is not divisible by model.num_heads={m.num_heads}: "
                          "each head gets embed_dim / num_heads channels")
    if m.loss not in ("mse", "relative_l2"):
        raise ConfigError(f"model.loss={m.loss!r}: choose mse or relative_l2")
    if not 0 <= m.drop_path < 1:
        raise ConfigError(f"model.drop_path={m.drop_path}: must be in [0, 1)")
    if d.crop is not None and (len(d.crop) != 2 or min(d.crop) < 1 or any(c % m.patch_size for c in d.crop)):
        raise ConfigError(f"data.crop={d.crop}: give [rows, columns], both multiples of model.patch_size="
                          f"{m.patch_size} (e.g. [360, 720] for ERA5 at 0.5 degrees, [80, 160] for the synthetic "
                          "90x180 grid)")
    if d.loader not in ("pytorch", "dali"):
        raise ConfigError(f"data.loader={d.loader!r}: choose pytorch or dali")
    if d.num_workers < 0:
        raise ConfigError(f"data.num_workers={d.num_workers}: 0 reads in the training process, N > 0 in N workers")
    if p.pp > 1:
        raise ConfigError(f"parallel.pp={p.pp}: the ViT has no pipeline split in this version; use tp, cp and "
                          "data parallelism")
    if t.backend == "deepspeed":
        raise ConfigError("train.backend=deepspeed runs the GPT workload only; for the ViT use zero2 or fsdp "
                          "(ZeRO-2/3 on PyTorch's own FSDP2)")
    if t.init_from not in ("scratch", "resume"):
        raise ConfigError(f"train.init_from={t.init_from!r}: the ViT starts from scratch or resumes its latest run")
    if p.cp > 1 and m.loss != "mse":
        raise ConfigError(f"model.loss={m.loss} with parallel.cp={p.cp}: context parallel ranks each hold a part "
                          "of every image, and the relative L2 needs whole-image norms; use model.loss=mse")


def _validate_layout(cfg: GPTRunConfig | ViTRunConfig) -> None:
    t, o, p = cfg.train, cfg.optimizer, cfg.parallel
    if t.dtype not in DTYPES:
        raise ConfigError(f"train.dtype={t.dtype!r}: choose one of {', '.join(DTYPES)}")
    if t.backend not in BACKENDS:
        raise ConfigError(f"train.backend={t.backend!r}: choose one of {', '.join(BACKENDS)}")
    for key in ("tp", "cp", "pp", "virtual_stages", "dp_replicate"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallel.{key}={getattr(p, key)}: must be at least 1")
    if p.microbatches is not None and p.microbatches < 1:
        raise ConfigError(f"parallel.microbatches={p.microbatches}: must be at least 1 (or null for the default)")
    if p.cp_impl not in CP_IMPLS:
        raise ConfigError(f"parallel.cp_impl={p.cp_impl!r}: choose one of {', '.join(CP_IMPLS)}")
    if t.backend == "zero1" and max(p.tp, p.cp, p.pp) > 1:
        raise ConfigError(f"train.backend=zero1 with tp={p.tp} cp={p.cp} pp={p.pp}: ZeroRedundancyOptimizer "
                          "shards plain tensors over one group; use train.backend=zero2 or fsdp to combine "
                          "sharded data parallelism with model parallelism")
    if p.zero_stage not in (1, 2, 3):
        raise ConfigError(f"parallel.zero_stage={p.zero_stage}: DeepSpeed's ZeRO stages are 1, 2 and 3")
    if p.pp > 1 and t.compile:
        raise ConfigError("train.compile=true with parallel.pp > 1: compiling pipeline stages is not supported in "
                          "this version; set train.compile=false")
    if t.keep_checkpoints < 0:
        raise ConfigError(f"train.keep_checkpoints={t.keep_checkpoints}: 0 keeps all, N keeps the last N")
    if (p.dp_replicate > 1) != (t.backend == "hsdp"):
        raise ConfigError(f"parallel.dp_replicate={p.dp_replicate} with train.backend={t.backend}: replicas of "
                          "shards are hsdp's; use train.backend=hsdp with parallel.dp_replicate > 1, or dp_replicate=1")
    if t.activation_checkpointing not in ("none", "full", "selective") or t.ac_every < 1:
        raise ConfigError(f"train.activation_checkpointing={t.activation_checkpointing!r}, train.ac_every={t.ac_every}: "
                          "choose none, full or selective, and ac_every >= 1")
    if t.wandb not in ("off", "offline", "online"):
        raise ConfigError(f"train.wandb={t.wandb!r}: choose off, offline or online")
    if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
        raise ConfigError(f"optimizer.lr={o.lr}, optimizer.min_lr={o.min_lr}: need 0 <= min_lr <= lr and lr > 0")
    if o.warmup_iters < 0 or o.grad_clip < 0:
        raise ConfigError("optimizer.warmup_iters and optimizer.grad_clip must not be negative")


def workload_of(cfg: GPTRunConfig | ViTRunConfig) -> str:
    return next(name for name, kind in RUN_CONFIGS.items() if isinstance(cfg, kind))


def to_yaml(cfg: GPTRunConfig | ViTRunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: GPTRunConfig | ViTRunConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg))


def from_dict(values: dict[str, Any], workload: str = "gpt") -> GPTRunConfig | ViTRunConfig:
    """A saved config (config.yaml or a checkpoint's dict) back into the typed form, checked again."""
    schema = _schema(workload)
    try:
        run = OmegaConf.to_object(OmegaConf.merge(schema, values))
    except OmegaConfBaseException as e:
        raise _explain(e, schema, "saved config") from None
    validate(run)
    return run
