"""Typed run configuration: dataclass defaults <- a YAML preset <- dotted command-line overrides.

    meshtrain train gpt preset=shakespeare_char data=shakespeare train.dtype=fp32 model.n_layer=6
    meshtrain train vit preset=tiny parallel.tp=2 amp_mode=bf16 num_data_workers=2

`preset=NAME` merges the model's `presets/NAME.yaml` (shipped in its folder) or a YAML path; `data=VALUE` is
short for the model's data key (the GPT's data.name, the ViT's data.root); everything else is
`group.key=value`, or one of NERSC's flag names (ALIASES) for the same key. OmegaConf checks keys
and types against the dataclasses; `validate` checks that values fit together. Every problem is one
ConfigError that names the key and what to do.

Every model shares the optimizer, train and parallel groups defined here; its own run config (in its
folder, found through meshtrain.registry) adds its model and data sections and its own rules. The
rules that need the world size are parallel/mesh.py's ParallelDims.from_config, run before any
process group work.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol, get_args, get_origin, get_type_hints

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from meshtrain import registry
from meshtrain.errors import MeshtrainError
from meshtrain.parallel import backends
from meshtrain.runtime.log import get_logger

# A choice is a field `key: Annotated[str, SomeLiteral] = default`: a plain str to OmegaConf (2.3 refuses Literal
# annotations), its values declared once, by the Literal below. check_choices checks every choice of every section of a
# run config, a model's own included, and its error names the key and the values.
Dtype = Literal["auto", "fp32", "bf16", "fp16"]  # auto: machine/precision.py chooses
Profiler = Literal["none", "torch", "nsys"]  # train/profiling.py
CpImpl = Literal["ring", "ulysses"]  # parallel/context_parallel.py
Float8 = Literal["off", "tensorwise", "rowwise"]  # parallel/float8.py
Compile = Literal["off", "blocks", "model"]  # parallel/compose.py; true is blocks, false off (_compile_words)
Checkpointing = Literal["none", "full", "selective", "op"]  # parallel/checkpointing.py
Wandb = Literal["off", "offline", "online"]  # train/sinks.py
PlanMode = Literal["manual", "auto"]  # auto: plan/search.py picks the layout
MemoryCheck = Literal["error", "warn", "off"]  # plan/measured/preflight.py
InitFrom = Literal["scratch", "resume", "auto"]  # the starts every model has; a model's own rules may add others
DTYPES, PROFILERS, CP_IMPLS, FLOAT8 = get_args(Dtype), get_args(Profiler), get_args(CpImpl), get_args(Float8)


class ConfigError(MeshtrainError, ValueError):
    """A configuration key, type or value that cannot be used; the message says which and how to fix it."""

    same_on_every_rank = True


@dataclass
class OptimizerSection:  # AdamW with linear warm-up, then cosine decay (train/optim.py)
    lr: float = 1e-3  # the peak learning rate, reached at the end of warm-up
    min_lr: float = 1e-4  # where the cosine decay ends
    weight_decay: float = 0.1  # AdamW's, on matrices only (not on biases, norms)
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.99  # AdamW's second-moment decay
    warmup_iters: int = 100  # iterations of linear warm-up to lr
    lr_decay_iters: int | None = None  # the iteration the decay reaches min_lr; default: train.max_iters
    decay_lr: bool = True  # false: lr stays flat after warm-up
    grad_clip: float = 1.0  # the gradients' global norm is clipped to this; 0 disables clipping
    fused: bool | None = None  # AdamW's fused kernel (NERSC's enable_fused); default: on CUDA and CPU
    # Square-root rule: lr (and min_lr) are for this global batch and scale by sqrt(global / base_batch_size).
    base_batch_size: int | None = None  # null: lr is used as given


@dataclass
class TrainSection:
    # data parallelism: a row of parallel/backends/ (ddp, zero1, zero2, fsdp, zero3, hsdp, deepspeed)
    backend: str = "ddp"
    # auto (what the device computes natively) | fp32 | bf16 (autocast) | fp16 (autocast + GradScaler, GPU)
    dtype: Annotated[str, Dtype] = "auto"
    # torch.compile (NERSC's enable_jit): off | blocks (each block on its own; true says the same: composes with every
    # layout) | model (the whole model at once, around DDP or FSDP2; no pipeline)
    compile: Annotated[str, Compile] = "off"
    # none | full (every block recomputed in the backward) | selective (every ac_every-th block)
    activation_checkpointing: Annotated[str, Checkpointing] = "none"
    ac_every: int = 2  # selective: every ac_every-th block is recomputed
    max_iters: int = 2000  # optimizer steps of the run (replaced by max_epochs when that is set)
    grad_accum: int = 1  # micro-steps per iteration; only the last one synchronises gradients
    # samples per iteration over all ranks: when set, grad_accum follows from it (global / (micro-batch × data-
    # parallel ranks)), so a run resumed on other ranks keeps its batch, learning rate and data
    global_batch_size: int | None = None
    sample_ledger: bool = False  # write the samples every iteration read (all ranks') to the run's ledger.txt
    # before the first step, the planner's predicted peak per rank against the memory this rank has: error | warn | off
    memory_check: Annotated[str, MemoryCheck] = "error"
    eval_interval: int = 250  # iterations between evaluations (and checkpoints)
    eval_iters: int = 20  # global batches per split in one evaluation (the ViT: at most, of its validation split)
    log_interval: int = 10  # iterations between log lines (and the timings they show)
    # a rank that reaches its step's first collective later than the median rank by more than (straggler_ratio - 1)
    # × the median step, for straggler_intervals log intervals in a row, is named in one warning (train/rank_stats.py)
    straggler_ratio: float = 1.2
    straggler_intervals: int = 3
    report: bool = False  # write the run's report page (`meshtrain report`) when it ends
    max_minutes: float | None = None  # stop (with a checkpoint) once this wall-clock budget is spent
    seed: int = 1337  # of the initial weights (the same on every rank); each rank's data and dropout seeds derive from it
    max_epochs: int | None = None  # passes over the data (ViT); when set, it replaces max_iters and eval_interval
    # InitFrom: scratch | resume | auto (resume if the run has a checkpoint, else scratch: for job scripts that
    # re-queue) | what else a model's own rules accept (the GPT: GPT-2 weights)
    init_from: str = "scratch"
    out_dir: str = "outputs/runs"  # runs go to out_dir/<model>/<backend>/<run>/
    run_dir: str | None = None  # the run to resume (default: the latest run of this workload/backend)
    save_checkpoints: bool = True  # a checkpoint at each evaluation (after the first iteration)
    async_checkpoint: bool = False  # write checkpoints from a background thread while training goes on
    keep_checkpoints: int = 2  # step directories kept per run (0: all)
    peak_flops: float | None = None  # FLOP/s per device for MFU; default: the device table or a measurement
    tensorboard: bool = False  # also write TensorBoard event files (the [tensorboard] extra)
    wandb: Annotated[str, Wandb] = "off"  # Weights & Biases: off | offline (no network; `wandb sync` later) | online
    # with compile=model: capture steps as CUDA graphs (torch.compile mode reduce-overhead); null (auto): on one CUDA rank
    # for a small model, whose step is launch-bound (parallel/compose.py: use_cuda_graphs)
    cuda_graphs: bool | None = None
    # off | tensorwise | rowwise: the blocks' linears in float8 (torchao; GPUs of sm89+)
    float8: Annotated[str, Float8] = "off"
    # none | torch (Chrome trace of the window) | nsys (cudaProfilerStart/Stop around it)
    profile: Annotated[str, Profiler] = "none"
    profile_start: int = 10  # the first iteration of the profiled window
    profile_steps: int = 5  # iterations in the profiled window


@dataclass
class ParallelSection:
    dp_replicate: int = 1  # hsdp: replicas, each sharded over dp_shard ranks
    dp_shard: int = -1  # data-parallel ranks (hsdp: within a replica); -1: the ranks left over
    tp: int = 1  # tensor parallel: heads and MLP columns sharded; keep it within a node
    ep: int = 1  # expert parallel (models with experts): routed experts sharded over ep of the dp_shard ranks
    sequence_parallel: bool = True  # tp: norms and dropout on sequence shards (activations / tp)
    loss_parallel: bool = True  # tp: cross-entropy on vocabulary shards, the logits never gathered
    cp: int = 1  # context parallel: the sequence sharded
    # ring (K/V passed around, any head count) | ulysses (all-to-all, heads % cp == 0)
    cp_impl: Annotated[str, CpImpl] = "ring"
    pp: int = 1  # pipeline stages
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | looped_bfs | interleaved_zero_bubble | ...
    microbatches: int | None = None  # per pipeline step (model.batch_size splits into them); default: pp x virtual_stages
    virtual_stages: int = 1  # stages per pipeline rank (interleaved/looped schedules need 2 or more)
    order: str = "tp-cp-dp-pp"  # the first dim's ranks are adjacent (on one node)
    cpu_offload: bool = False  # fsdp/zero2/zero3/hsdp: parameters and optimizer state live in host memory
    # manual: the sizes above | auto: the fastest layout that fits, by `meshtrain plan`'s model
    plan: Annotated[str, PlanMode] = "manual"
    # with plan=auto: trace the best few layouts first (plan --trace: one process, fake ranks) and never pick one
    # whose traced peak does not fit
    plan_trace: bool = False
    zero_stage: int = 2  # train.backend=deepspeed: ZeRO stage 1 (optimizer), 2 (+ gradients) or 3 (+ parameters)


class RunConfig(Protocol):
    """A run config, as everything but the model's own code reads it: each model's run config dataclass (the GPT's
    GPTRunConfig, ...) has these five sections; the model and data sections are the model's own."""

    model: Any
    data: Any
    optimizer: OptimizerSection
    train: TrainSection
    parallel: ParallelSection


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


def _spec(workload: str):
    try:
        return registry.get(workload)
    except registry.RegistryError as e:
        raise ConfigError(str(e)) from None


def presets(workload: str = "gpt") -> list[str]:
    return sorted(p.stem for p in _spec(workload).presets.glob("*.yaml"))


def _preset_path(workload: str, name: str) -> Path:
    path = Path(name) if name.endswith((".yaml", ".yml")) else _spec(workload).presets / f"{name}.yaml"
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


@functools.cache  # read, never changed: each load copies it
def _schema(workload: str) -> DictConfig:
    return OmegaConf.structured(_spec(workload).run_config)


def load_config(overrides: list[str] = (), workload: str = "gpt"):
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
            dotted.append(f"{_spec(workload).data_key}={value}")
        elif key in ALIASES:
            target, translate = ALIASES[key]
            dotted.append(f"{target}={translate(value) if translate else value}")
        else:
            dotted.append(item)
    run = OmegaConf.to_object(_merge_overrides(cfg, schema, dotted))
    _compile_words(run)
    _choices_in_lower_case(run)
    _stop_condition_given_wins(run, {item.partition("=")[0] for item in dotted})
    validate(run)
    return run


def _merge_overrides(cfg: DictConfig, schema: DictConfig, dotted: list[str]) -> DictConfig:
    """The dotted overrides merged in order, in one merge: each merge copies the whole config first (a dozen
    overrides merged one by one: 38 ms a load here; in one, with the schema built once: 9 ms). Only where that
    fails, one by one again, to name the override at fault."""
    try:
        return OmegaConf.merge(cfg, *(_override(schema, item) for item in dotted))
    except OmegaConfBaseException:
        for item in dotted:
            try:
                cfg = OmegaConf.merge(cfg, _override(schema, item))
            except OmegaConfBaseException as e:
                raise _explain(e, schema, item) from None
        raise


def _stop_condition_given_wins(cfg: RunConfig, given: set[str]) -> None:
    """train.max_iters and train.max_epochs both say when a run stops (and max_epochs when it evaluates): the one
    given on the command line wins over a preset's, and says so; both given at once is one error."""
    t = cfg.train
    if t.max_epochs is None:
        return
    if "train.max_iters" not in given:
        if "train.eval_interval" in given:
            raise ConfigError(f"train.eval_interval={t.eval_interval}: with train.max_epochs={t.max_epochs} (from the "
                              "preset) the run evaluates after each epoch; give train.max_iters=N to count iterations "
                              "instead (it replaces max_epochs), or leave eval_interval out")
        return
    if "train.max_epochs" in given:
        raise ConfigError(f"train.max_iters={t.max_iters} and train.max_epochs={t.max_epochs} both given: a run "
                          "stops at one of them; give one (train.max_epochs=null counts iterations)")
    get_logger("config").info("train.max_iters=%d given: it replaces the preset's train.max_epochs=%d (and its "
                              "evaluation after each epoch: train.eval_interval=%d)", t.max_iters, t.max_epochs,
                              t.eval_interval)
    t.max_epochs = None


def _compile_words(cfg: RunConfig) -> None:
    """train.compile=true (enable_jit=true, a preset's or an older run's `compile: true`) compiles the blocks; false is
    off. OmegaConf hands a boolean to the text field as 'True' or 'False'."""
    word = str(cfg.train.compile).lower()
    cfg.train.compile = {"true": "blocks", "false": "off"}.get(word, cfg.train.compile)


def _choices_in_lower_case(cfg: RunConfig) -> None:
    """Choices typed in another case (`train.backend=DDP`, as some seeds spell them) become the names they match."""
    for group in dataclasses.fields(cfg):
        section = getattr(cfg, group.name)
        if not dataclasses.is_dataclass(section):
            continue
        named = {key: [str(a) for a in allowed] for key, allowed in choices(type(section)).items()}
        if group.name == "train":
            named["backend"] = list(backends.REGISTRY)
        for key, allowed in named.items():
            value = getattr(section, key)
            if isinstance(value, str) and value not in allowed and value.lower() in allowed:
                setattr(section, key, value.lower())


def with_global_batch(cfg: RunConfig, dp_size: int):
    """cfg with train.grad_accum following from train.global_batch_size, where it is set: the global batch over
    (micro-batch × data-parallel ranks). A size that does not divide gets one error naming sizes that would."""
    t = cfg.train
    if t.global_batch_size is None:
        return cfg
    micro, key = registry.spec_of(cfg).shape(cfg).batch_size, registry.spec_of(cfg).shape(cfg).keys["batch_size"]
    share = micro * dp_size
    accum, rest = divmod(t.global_batch_size, share)
    if rest or not accum:
        per_rank = t.global_batch_size / dp_size
        batches = [b for b in range(1, micro + 1) if per_rank == int(per_rank) and int(per_rank) % b == 0]
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is not a whole number of micro-steps of "
                          f"{dp_size} data-parallel rank(s) × {key}={micro} ({share} samples): use a multiple of "
                          f"{share} ({', '.join(str(share * k) for k in (accum, accum + 1) if k)})"
                          + (f", or {key} = one of {', '.join(map(str, batches[-6:]))}" if batches else ""))
    if t.grad_accum not in (1, accum):
        raise ConfigError(f"train.grad_accum={t.grad_accum} and train.global_batch_size={t.global_batch_size} "
                          f"disagree on {dp_size} data-parallel rank(s) × {key}={micro} (that global batch needs "
                          f"grad_accum={accum}): set one of them")
    return dataclasses.replace(cfg, train=dataclasses.replace(t, grad_accum=accum))


def _override(schema: DictConfig, item: str) -> DictConfig:
    """`key=value` as a config of that one key; `key=off` as the text typed where the key holds text: YAML reads off,
    on, yes and no as booleans, which would make train.float8=off the string 'False'."""
    key, _, value = item.partition("=")
    if value.lower() in ("off", "on", "yes", "no") and isinstance(OmegaConf.select(schema, key, default=None), str):
        item = f"{key}='{value}'"
    return OmegaConf.from_dotlist([item])


def check_positive(values: dict[str, int | None]) -> None:
    for key, value in values.items():
        if value is not None and value < 1:
            raise ConfigError(f"{key}={value}: must be at least 1")


@functools.cache
def choices(section: type) -> dict[str, tuple]:
    """The choice fields of a section dataclass (`key: Annotated[str, Literal[...]]`) and the values of each."""
    return {key: get_args(meta) for key, hint in get_type_hints(section, include_extras=True).items()
            if get_origin(hint) is Annotated for meta in hint.__metadata__ if get_origin(meta) is Literal}


def check_choices(cfg: RunConfig) -> None:
    """Each choice field of each section of the run config `cfg` holds one of its values."""
    for group in dataclasses.fields(cfg):
        section = getattr(cfg, group.name)
        if not dataclasses.is_dataclass(section):
            continue
        for key, allowed in choices(type(section)).items():
            value = getattr(section, key)
            if value not in allowed:
                names = [str(a) for a in allowed]
                listed = " or ".join(names) if len(names) == 2 else f"one of {', '.join(names)}"
                raise ConfigError(f"{group.name}.{key}={value!r}: choose {listed}")


def validate(cfg: RunConfig) -> None:
    """Every section's choices, the shared rules, then the model's own."""
    m, t, o = cfg.model, cfg.train, cfg.optimizer
    check_choices(cfg)
    check_positive({"train.max_iters": t.max_iters, "train.grad_accum": t.grad_accum,
                    "train.global_batch_size": t.global_batch_size,
                     "train.eval_interval": t.eval_interval, "train.eval_iters": t.eval_iters,
                     "train.log_interval": t.log_interval, "train.max_epochs": t.max_epochs,
                     "train.profile_steps": t.profile_steps, "optimizer.base_batch_size": o.base_batch_size,
                     "train.straggler_intervals": t.straggler_intervals, "train.ac_every": t.ac_every})
    if t.global_batch_size is not None and getattr(cfg.data, "global_batch_size", None) is not None:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} and data.global_batch_size="
                          f"{cfg.data.global_batch_size}: the first sets the accumulation, the second the batch per "
                          "rank; set one of them")
    if t.straggler_ratio <= 1:
        raise ConfigError(f"train.straggler_ratio={t.straggler_ratio}: a ratio to the median step, above 1 (1.2: "
                          "warn of a rank that keeps the others waiting 20% of a step)")
    spec = registry.spec_of(cfg)
    if spec.validate:
        spec.validate(cfg)
    if not 0 <= m.dropout < 1:
        raise ConfigError(f"model.dropout={m.dropout}: must be in [0, 1)")
    if t.profile_start < 0:
        raise ConfigError(f"train.profile_start={t.profile_start}: an iteration number, at least 0")
    if t.cuda_graphs and t.compile != "model":
        raise ConfigError(f"train.cuda_graphs=true captures the whole model compiled as one graph: set "
                          f"train.compile=model (not {t.compile}: each block's own graph would overwrite the outputs "
                          "the next block still reads)")
    _validate_layout(cfg)


def _validate_layout(cfg: RunConfig) -> None:
    t, o, p = cfg.train, cfg.optimizer, cfg.parallel
    if t.backend not in backends.REGISTRY:
        raise ConfigError(f"train.backend={t.backend!r}: choose one of {', '.join(backends.names())}")
    chosen = backends.get(t.backend)
    if t.float8 != "off" and (p.tp > 1 or "float8" not in chosen.composes_with):
        raise ConfigError(f"train.float8={t.float8} with {'parallel.tp=' + str(p.tp) if p.tp > 1 else 'deepspeed'}: "
                          "float8 linears are not composed with tensor parallelism or DeepSpeed in this version; "
                          "use data parallelism (ddp, fsdp, zero2, hsdp) or set train.float8=off")
    for key in ("tp", "cp", "pp", "ep", "virtual_stages", "dp_replicate"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallel.{key}={getattr(p, key)}: must be at least 1")
    if p.microbatches is not None and p.microbatches < 1:
        raise ConfigError(f"parallel.microbatches={p.microbatches}: must be at least 1 (or null for the default)")
    if any(getattr(p, dim) > 1 and dim not in chosen.composes_with for dim in ("tp", "cp", "pp", "ep")):
        raise ConfigError(f"train.backend={t.backend} with tp={p.tp} cp={p.cp} pp={p.pp}"
                          + (f" ep={p.ep}" if p.ep > 1 else "") + f": {chosen.alone_because}")
    if p.zero_stage not in (1, 2, 3):
        raise ConfigError(f"parallel.zero_stage={p.zero_stage}: DeepSpeed's ZeRO stages are 1, 2 and 3")
    if t.compile == "model" and p.pp > 1:
        raise ConfigError("train.compile=model with parallel.pp > 1: each rank runs its pipeline stages apart, so "
                          "there is no whole model to compile; use train.compile=blocks (or true), which compiles "
                          "each stage's blocks")
    if t.compile != "off" and chosen.engine:
        raise ConfigError(f"train.compile={t.compile} with train.backend={t.backend}: DeepSpeed's engine runs the "
                          "model itself, and meshtrain compiles nothing inside it; set train.compile=false, or use "
                          "fsdp/zero2 (whose blocks compile)")
    if t.keep_checkpoints < 0:
        raise ConfigError(f"train.keep_checkpoints={t.keep_checkpoints}: 0 keeps all, N keeps the last N")
    if (p.dp_replicate > 1) != chosen.replicas:
        raise ConfigError(f"parallel.dp_replicate={p.dp_replicate} with train.backend={t.backend}: replicas of "
                          "shards are hsdp's; use train.backend=hsdp with parallel.dp_replicate > 1, or dp_replicate=1")
    if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
        raise ConfigError(f"optimizer.lr={o.lr}, optimizer.min_lr={o.min_lr}: need 0 <= min_lr <= lr and lr > 0")
    if o.warmup_iters < 0 or o.grad_clip < 0:
        raise ConfigError("optimizer.warmup_iters and optimizer.grad_clip must not be negative")


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg))


def from_dict(values: dict[str, Any], workload: str = "gpt"):
    """A saved config (config.yaml or a checkpoint's dict) back into the typed form, checked again."""
    schema = _schema(workload)
    try:
        run = OmegaConf.to_object(OmegaConf.merge(schema, values))
    except OmegaConfBaseException as e:
        raise _explain(e, schema, "saved config") from None
    _compile_words(run)
    validate(run)
    return run
