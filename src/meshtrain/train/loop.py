"""The training loop: one loop for every layout (the layout lives in parallel/, never here).

Per iteration: `grad_accum` micro-steps (only the last synchronises gradients), clip, step, log.
Every `eval_interval`: mean train/val loss over `eval_iters` batches on every rank, a sample on
rank 0, a distributed checkpoint. A checkpoint holds everything a bit-exact resume needs: model,
optimizer, scaler, iteration, and every rank's RNG and data-sampler states; it loads into any
other layout too (then the data and RNG streams restart from the seed).
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from meshtrain import config as config_mod
from meshtrain.config import GPTRunConfig
from meshtrain.data.text import TokenBatches, load_meta, tokenizer_from_meta
from meshtrain.dist.log import get_logger, print_rich
from meshtrain.dist.setup import DistInfo, broadcast_object, collective, gather_objects, reduce_scalar
from meshtrain.errors import MeshtrainError
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.parallel.data_parallel import build_optimizer, bytes_held
from meshtrain.parallel.gpt_layout import build_gpt_layout
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.train import checkpoint, metrics
from meshtrain.train.optim import learning_rate
from meshtrain.train.sinks import build_sinks, progress_bar, track

log = get_logger("train")
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class TrainingDiverged(MeshtrainError, RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is left as it was."""


@dataclass
class TrainResult:
    run_dir: Path
    iterations: int
    train_loss: float = math.nan
    val_loss: float = math.nan
    samples: list[str] = field(default_factory=list)


class _Batches:
    """The three samplers of one rank: training windows, and separate ones for evaluation so that
    evaluating never shifts what training sees next."""

    def __init__(self, data_dir: Path, cfg: GPTRunConfig, dp_rank: int, dp_size: int, device: torch.device):
        common = dict(block_size=cfg.model.block_size, batch_size=cfg.model.batch_size, dp_rank=dp_rank,
                      dp_size=dp_size, device=device)
        seed = cfg.train.seed
        self.train = TokenBatches(data_dir, "train", seed=seed, **common)
        self.eval = {"train": TokenBatches(data_dir, "train", seed=seed + 1, **common),
                     "val": TokenBatches(data_dir, "val", seed=seed + 2, **common)}

    def state_dict(self) -> dict:
        return {"train": self.train.state_dict(), **{f"eval_{k}": v.state_dict() for k, v in self.eval.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.train.load_state_dict(state["train"])
        for split, batches in self.eval.items():
            batches.load_state_dict(state[f"eval_{split}"])


def _rank_state(batches: _Batches, device: torch.device) -> dict:
    state = {"torch_rng": torch.get_rng_state(), "data": batches.state_dict()}
    if device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(device)
    return state


def _restore_rank_state(state: dict, batches: _Batches, device: torch.device) -> None:
    torch.set_rng_state(state["torch_rng"])
    if "cuda_rng" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda_rng"], device)
    batches.load_state_dict(state["data"])


def _build_model(cfg: GPTRunConfig, vocab_size: int) -> GPT:
    m = cfg.model
    if cfg.train.init_from not in ("scratch", "resume"):
        model = GPT.from_pretrained(cfg.train.init_from, override_args={"dropout": m.dropout})
        if m.block_size < model.config.block_size:
            model.crop_block_size(m.block_size)
        return model
    return GPT(GPTConfig(block_size=m.block_size, vocab_size=vocab_size, n_layer=m.n_layer, n_head=m.n_head,
                         n_embd=m.n_embd, dropout=m.dropout, bias=m.bias, activation=m.activation))


def train_gpt(cfg: GPTRunConfig, info: DistInfo) -> TrainResult:
    t, o = cfg.train, cfg.optimizer
    device = info.torch_device
    if t.dtype == "fp16" and device.type != "cuda":
        raise config_mod.ConfigError(f"train.dtype=fp16 needs a GPU (GradScaler); this rank runs on {device}: "
                                     "use train.dtype=bf16 (or fp32)")

    resumed = None
    if t.init_from == "resume":
        run_dir = Path(t.run_dir) if t.run_dir else checkpoint.latest_run(t.out_dir, "gpt", t.backend)
        checkpoint_dir = checkpoint.latest_checkpoint(run_dir)
        resumed = checkpoint.load_trainer_state(checkpoint_dir)
        cfg = replace(cfg, model=config_mod.from_dict(resumed["config"]).model)  # the saved architecture
    else:
        run_dir = None
        if info.is_main:
            run_dir = checkpoint.new_run_dir(t.out_dir, "gpt", t.backend)
            checkpoint.record_run(t.out_dir, "gpt", t.backend, run_dir)
        run_dir = Path(broadcast_object(str(run_dir) if run_dir else None, "broadcast of the run directory",
                                        info.timeout_s))

    data_dir = Path(cfg.data.root) / cfg.data.name
    meta = load_meta(data_dir)
    tokenizer = tokenizer_from_meta(meta)
    try:  # the prompt is first used at the first evaluation: find a bad one now
        prompt_ids = tokenizer.encode(t.prompt)
    except ValueError as e:
        raise config_mod.ConfigError(f"train.prompt={t.prompt!r} cannot be encoded for {cfg.data.name}: {e}") from None
    torch.manual_seed(t.seed)  # the same initial weights on every rank
    model = _build_model(cfg, meta["vocab_size"]).to(device)
    model_config, num_params, flops_per_token = model.config, model.num_params(), model.flops_per_token()
    p = cfg.parallel
    dims = ParallelDims.resolve(info.world_size, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp, tp=p.tp,
                                pp=p.pp, order=p.order)
    batches = _Batches(data_dir, cfg, dims.dp_rank(info.rank), dims.dp_size, device)

    autocast = (torch.autocast(device_type=device.type, dtype=AUTOCAST[t.dtype]) if AUTOCAST[t.dtype]
                else nullcontext())
    layout = build_gpt_layout(model, cfg, dims, device, info.rank, info.local_world_size)
    model = layout.model  # this rank's share of the GPT
    # Dropout masks differ where the tokens do (dp and cp ranks); tp ranks must draw the same masks on the stream
    # they all hold, and pp ranks hold different layers anyway.
    torch.manual_seed(t.seed + dims.dp_rank(info.rank) * dims.cp + dims.coords(info.rank)["cp"])
    optimizer = layout.attach_optimizer(build_optimizer(model.configure_optimizer_groups(o.weight_decay), device,
                                                        t.backend, info.world_size, lr=o.lr, betas=(o.beta1, o.beta2)))
    scaler = torch.amp.GradScaler(device.type, enabled=t.dtype == "fp16")
    checkpointer = checkpoint.Checkpointer(run_dir, is_main=info.is_main, keep=t.keep_checkpoints,
                                           async_save=t.async_checkpoint)
    start_iter = 0
    if resumed:
        with collective(f"loading the checkpoint {checkpoint_dir}", info.timeout_s):
            layout.load_checkpoint(checkpoint_dir, optimizer)
        scaler.load_state_dict(resumed["scaler"])
        start_iter = resumed["iteration"]
        # A rank's data and RNG streams belong to its place in the layout (its dp and cp rank): carry them over
        # only into the same layout. In another, the ranks of one replica would read different batches.
        if resumed.get("layout") == _describe(dims):
            _restore_rank_state(resumed["ranks"][info.rank], batches, device)
        else:
            log.warning("checkpoint was written under %s, this run is %s: data and RNG streams restart from the "
                        "seed (the model and optimizer state carry over exactly; the run is not bit-exact)",
                        resumed.get("layout"), _describe(dims))

    decay_iters = o.lr_decay_iters or t.max_iters
    sample_generator = torch.Generator(device=device)
    timer = metrics.StepTimer(device)

    peak, peak_source = metrics.peak_flops(device, AUTOCAST[t.dtype] or torch.float32, t.peak_flops)
    tokens_per_iter_per_rank = cfg.model.batch_size * t.grad_accum * cfg.model.block_size
    sinks = build_sinks(run_dir, info.is_main, tensorboard=t.tensorboard,
                        wandb=False if t.wandb == "off" else t.wandb, config=config_mod.to_dict(cfg),
                        resume_step=start_iter if resumed else None)
    if info.is_main:
        (run_dir / "config.yaml").write_text(config_mod.to_yaml(cfg))
        log.info("resolved config:\n%s", config_mod.to_yaml(cfg).rstrip())
        log.info("run directory: %s%s", run_dir, f" (resuming at iteration {start_iter})" if resumed else "")
        log.info("model: %.2fM parameters, %.3g FLOPs per token (6N + 12·L·H·Q·T); peak %.4g TFLOP/s per device (%s)",
                 num_params / 1e6, flops_per_token, peak / 1e12, peak_source)
        log.info("layout: %s over %d rank(s) (%s); %d data-parallel rank(s) × batch %d × accumulation %d × block %d "
                 "= %d tokens per iteration", t.backend, info.world_size, _describe(dims), dims.dp_size,
                 cfg.model.batch_size, t.grad_accum, cfg.model.block_size, tokens_per_iter_per_rank * dims.dp_size)
        print_rich(metrics.legend_table())

    def mean_loss(value: torch.Tensor, what: str) -> float:
        """The mean over the ranks that hold a loss (under pp, those with the last stage; the others add 0)."""
        return reduce_scalar(value, "sum", what, info.timeout_s) / layout.loss_ranks

    def evaluate() -> dict[str, float]:
        model.eval()
        out = {}
        for split, split_batches in batches.eval.items():
            total = torch.zeros((), device=device)
            for _ in track(range(t.eval_iters), f"eval {split}", is_main=info.is_main):
                total += layout.eval_loss(*split_batches.next_batch(), autocast)
            out[f"{split}_loss"] = mean_loss(total / t.eval_iters, f"all_reduce of the {split} loss")
        model.train()
        return out

    sampler = None  # rank 0's whole copy of the model, refreshed from the shards before each sample

    def sample(it: int) -> str:
        nonlocal sampler
        with collective("gathering the model for sampling", info.timeout_s):
            weights = layout.full_state_for_sampling()
        text = None
        if info.is_main:
            if sampler is None:  # built on the meta device: a real init would draw from the RNG that drives dropout
                with torch.device("meta"):
                    sampler = GPT(replace(model_config, dropout=0.0)).eval()
                sampler.to_empty(device=device)
            sampler.load_state_dict(weights)
            sample_generator.manual_seed(t.seed + it)
            prompt = torch.tensor([prompt_ids], dtype=torch.long, device=device)
            with autocast:
                tokens = sampler.generate(prompt, t.sample_tokens, temperature=t.temperature, top_k=t.top_k,
                                          generator=sample_generator)
            text = tokenizer.decode(tokens[0].tolist())
        return broadcast_object(text, "broadcast of the sample", info.timeout_s)

    def save(it: int, losses: dict[str, float]) -> None:
        ranks = gather_objects(_rank_state(batches, device), "all_gather_object of RNG and sampler states for the "
                               "checkpoint", info.timeout_s)
        trainer_state = {"scaler": scaler.state_dict(), "iteration": it, "config": config_mod.to_dict(cfg),
                         "meta": meta, "ranks": ranks, "layout": _describe(dims), **losses}
        with collective("saving the distributed checkpoint", info.timeout_s):
            path = layout.save_checkpoint(checkpointer, it, optimizer, trainer_state)
        log.info("checkpoint: %s (iteration %d)%s", path, it, " writing in the background" if t.async_checkpoint else "")

    def log_bytes_held() -> None:
        held = gather_objects(bytes_held(model, optimizer), "all_gather_object of per-rank memory", info.timeout_s)
        if info.is_main:
            rows = [f"rank {r:>3}: params {_mib(h['params'])}, grads {_mib(h['grads'])}, optimizer "
                    f"{_mib(h['optimizer'])}" for r, h in enumerate(held)]
            log.info("what each rank holds after its first step (%s):\n%s", t.backend, "\n".join(rows))

    result = TrainResult(run_dir=run_dir, iterations=start_iter)
    started = time.perf_counter()
    it = start_iter
    with progress_bar(t.max_iters - start_iter, "train", is_main=info.is_main) as bar:
        while True:
            stop = it >= t.max_iters or _out_of_time(started, t.max_minutes, info)
            if it % t.eval_interval == 0 or stop:
                if not (resumed and it == start_iter):  # that evaluation was done before the checkpoint was written
                    losses = evaluate()
                    result.train_loss, result.val_loss = losses["train_loss"], losses["val_loss"]
                    if not all(map(math.isfinite, losses.values())):
                        raise TrainingDiverged(f"evaluation at iteration {it} gave {losses}: the model diverged. "
                                               f"The last good checkpoint in {run_dir} is left as it was; lower "
                                               "optimizer.lr or raise optimizer.warmup_iters and resume from it")
                    sinks.log(it, losses)
                    text = sample(it)  # on every rank: a sharded model gathers its layers for each token
                    result.samples.append(text)
                    sinks.log_text(it, "sample", text)
                    if t.save_checkpoints and it > start_iter:
                        save(it, losses)
            if stop:
                break

            lr = learning_rate(it, o.lr, o.min_lr, o.warmup_iters, decay_iters, o.decay_lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            with timer("dt"):
                for micro in range(t.grad_accum):
                    x, y = batches.train.next_batch()
                    with collective("forward and backward (gradient reduction)", info.timeout_s):
                        loss_sum += layout.train_micro_step(x, y, accum=t.grad_accum, sync=micro == t.grad_accum - 1,
                                                            autocast=autocast, scaler=scaler, timer=timer)
                with collective("the gradient all-reduce of the tied embedding across stages", info.timeout_s):
                    layout.finish_backward()
                grad_norm = layout.optimizer_step(optimizer, scaler, o.grad_clip)
                if it == start_iter:
                    log_bytes_held()
                optimizer.zero_grad(set_to_none=True)
            times = timer.pop()
            it += 1
            result.iterations = it
            bar.update()

            if it % t.log_interval == 0:
                loss_value = mean_loss(loss_sum, "all_reduce of the training loss for logging")
                if not math.isfinite(loss_value):
                    raise TrainingDiverged(f"training loss is {loss_value} at iteration {it}: the model diverged. The "
                                           f"last good checkpoint in {run_dir} is left as it was; lower optimizer.lr "
                                           "or raise optimizer.warmup_iters and resume from it")
                rates = metrics.throughput(cfg.model.batch_size, t.grad_accum, dims.dp_size, info.world_size,
                                           cfg.model.block_size, times["dt"])
                row = {"loss": loss_value, **times, **rates,
                       "mfu": metrics.mfu(flops_per_token, rates["tps_per_gpu"], peak), "lr": lr,
                       "mem_gb": metrics.peak_memory_bytes(device) / 2**30}
                if grad_norm is not None:
                    row["grad_norm"] = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
                sinks.log(it, row)
    checkpointer.wait()
    sinks.close()
    return result


def _describe(dims: ParallelDims) -> str:
    return " × ".join(f"{d}={getattr(dims, d)}" for d in dims.mesh_dims) + f", order {dims.order}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _out_of_time(started: float, max_minutes: float | None, info: DistInfo) -> bool:
    """Every rank must stop at the same iteration, so the slowest clock decides for all."""
    if max_minutes is None:
        return False
    over = float(time.perf_counter() - started > max_minutes * 60)
    return reduce_scalar(over, "max", "all_reduce of the time-budget flag", info.timeout_s, info.torch_device) > 0
