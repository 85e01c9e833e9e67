"""The training loop: one loop for every workload (GPT, ViT) and every layout (the layout lives in parallel/).

Per iteration: `grad_accum` micro-steps (only the last synchronises gradients), clip, step, log.
Every `eval_interval` (with train.max_epochs: every epoch): the workload's evaluation, reduced over
the ranks, a summary of the interval since the previous one (time, samples/s, mean training loss,
evaluation time, memory high watermark), what the workload shows (a text sample, a forecast plot)
and a distributed checkpoint. A checkpoint holds everything a bit-exact resume needs: model,
optimizer, scaler, iteration, and every rank's RNG and data-stream states; it loads into any other
layout too (then the data and RNG streams restart from the seed).

A workload (gpt_workload.py, vit_workload.py) supplies the model, its layout, the batch stream, the
evaluation and what follows it; the loop never asks which one it drives.
"""

from __future__ import annotations

import contextlib
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from meshtrain import config as config_mod
from meshtrain import machine
from meshtrain.dist.device import synchronize
from meshtrain.dist.log import get_logger, print_rich
from meshtrain.dist.setup import DistInfo, broadcast_object, collective, gather_objects, reduce_scalar
from meshtrain.errors import MeshtrainError
from meshtrain.parallel.data_parallel import bytes_held
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.train import checkpoint, metrics, profiling
from meshtrain.train.optim import build_optimizer, learning_rate, scaled_learning_rates
from meshtrain.train.sinks import build_sinks, progress_bar

log = get_logger("train")
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
RANGES = {"dtf": "forward", "dtb": "backward", "dtfb": "forward_backward"}  # timer section -> profiler range


class TrainingDiverged(MeshtrainError, RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is left as it was."""


@dataclass
class TrainResult:
    run_dir: Path
    iterations: int
    train_loss: float = math.nan
    val_loss: float = math.nan
    samples: list[str] = field(default_factory=list)  # gpt: the text samples


def make_workload(cfg, info: DistInfo, dims: ParallelDims):
    if config_mod.workload_of(cfg) == "vit":
        from meshtrain.train.vit_workload import ViTWorkload

        return ViTWorkload(cfg, info, dims)
    from meshtrain.train.gpt_workload import GPTWorkload

    return GPTWorkload(cfg, info, dims)


def train(cfg, info: DistInfo) -> TrainResult:
    name = config_mod.workload_of(cfg)
    t, o = cfg.train, cfg.optimizer
    device = info.torch_device
    if t.dtype == "fp16" and device.type != "cuda":
        raise config_mod.ConfigError(f"train.dtype=fp16 needs a GPU (GradScaler); this rank runs on {device}: "
                                     "use train.dtype=auto (or bf16, fp32)")
    profiling.cuda_graphs_check(t.cuda_graphs, device)
    # Rank 0 chooses for all: nodes of different kinds must still compute in one dtype.
    precision = machine.choose(t.dtype, device) if info.is_main else None
    dtype = broadcast_object(precision and precision.dtype, "broadcast of the training dtype", info.timeout_s)
    cfg = replace(cfg, train=replace(t, dtype=dtype))
    t = cfg.train

    resumed = None
    if t.init_from == "resume":
        run_dir = Path(t.run_dir) if t.run_dir else checkpoint.latest_run(t.out_dir, name, t.backend)
        checkpoint_dir = checkpoint.latest_checkpoint(run_dir)
        resumed = checkpoint.load_trainer_state(checkpoint_dir)
        cfg = replace(cfg, model=config_mod.from_dict(resumed["config"], name).model)  # the saved architecture
    else:
        run_dir = None
        if info.is_main:
            run_dir = checkpoint.new_run_dir(t.out_dir, name, t.backend)
            checkpoint.record_run(t.out_dir, name, t.backend, run_dir)
        run_dir = Path(broadcast_object(str(run_dir) if run_dir else None, "broadcast of the run directory",
                                        info.timeout_s))

    p = cfg.parallel
    dims = ParallelDims.resolve(info.world_size, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp, tp=p.tp,
                                pp=p.pp, order=p.order)
    workload = make_workload(cfg, info, dims)
    cfg = workload.cfg  # with what the data decided (the ViT's local batch from a global one)
    torch.manual_seed(t.seed)  # the same initial weights on every rank
    model = workload.build_model().to(device)
    num_params, flops_per_token = model.num_params(), model.flops_per_token()
    batches = workload.batches

    autocast = (torch.autocast(device_type=device.type, dtype=AUTOCAST[t.dtype]) if AUTOCAST[t.dtype]
                else nullcontext())
    layout = workload.build_layout(model)
    model = layout.model  # this rank's share of the model
    # Dropout masks differ where the data does (dp and cp ranks); tp ranks must draw the same masks on the stream
    # they all hold, and pp ranks hold different layers anyway.
    torch.manual_seed(t.seed + dims.dp_rank(info.rank) * dims.cp + dims.coords(info.rank)["cp"])
    samples_per_iter = workload.batch_size * t.grad_accum * dims.dp_size
    lr, min_lr, lr_factor = scaled_learning_rates(cfg, samples_per_iter)
    fused = {} if o.fused is None else {"fused": o.fused}
    optimizer = layout.attach_optimizer(build_optimizer(model.configure_optimizer_groups(o.weight_decay), device,
                                                        t.backend, info.world_size, lr=lr, betas=(o.beta1, o.beta2),
                                                        **fused))
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

    epochs = workload.iters_per_epoch if t.max_epochs else None  # iterations per epoch, when counting epochs
    max_iters = t.max_epochs * epochs if epochs else t.max_iters
    eval_interval = epochs or t.eval_interval
    decay_iters = o.lr_decay_iters or max_iters
    timer = metrics.StepTimer(device)
    profiler = profiling.StepProfiler(t.profile, start=t.profile_start, steps=t.profile_steps,
                                      out_dir=run_dir / "profile", rank=info.rank, device=device)
    if info.is_main:  # MFU is rank 0's figure: only it needs the peak (and only it measures one)
        peak = machine.peak_flops(device, AUTOCAST[t.dtype] or torch.float32, t.peak_flops)
        mfu_meter = metrics.MFUMeter(flops_per_token, peak, remeasure=(
            lambda: machine.measured_peak(device, peak.label, again=True)) if peak.kind == "measured" else None)
    sinks = build_sinks(run_dir, info.is_main, tensorboard=t.tensorboard,
                        wandb=False if t.wandb == "off" else t.wandb, config=config_mod.to_dict(cfg),
                        resume_step=start_iter if resumed else None)
    if info.is_main:
        (run_dir / "config.yaml").write_text(config_mod.to_yaml(cfg))
        log.info("resolved config:\n%s", config_mod.to_yaml(cfg).rstrip())
        log.info("run directory: %s%s", run_dir, f" (resuming at iteration {start_iter})" if resumed else "")
        log.info("precision: %s (%s)", t.dtype, precision.reason)
        if precision.warning:
            log.warning("%s", precision.warning)
        log.info("model: %.2fM parameters, %.3g FLOPs per token; peak %.4g TFLOP/s per device (%s)",
                 num_params / 1e6, flops_per_token, peak.flops / 1e12, peak.source)
        log.info("layout: %s over %d rank(s) (%s); %s; %d data-parallel rank(s) × accumulation %d: global batch %d "
                 "samples (%d tokens) per iteration", t.backend, info.world_size, _describe(dims),
                 workload.describe(), dims.dp_size, t.grad_accum, samples_per_iter,
                 samples_per_iter * workload.tokens_per_sample)
        if o.base_batch_size:
            log.info("learning rate: %.4g = optimizer.lr %.4g × sqrt(global batch %d / base batch %d) = × %.4f",
                     lr, o.lr, samples_per_iter, o.base_batch_size, lr_factor)
        if epochs:
            log.info("%d epochs of %d iterations: %d iterations, evaluating after each epoch", t.max_epochs, epochs,
                     max_iters)
        print_rich(metrics.legend_table([k for k, meaning in metrics.LEGEND.items()
                                         if not meaning.startswith("vit:") or name == "vit"]))

    def mean_loss(value: torch.Tensor, what: str) -> float:
        """The mean over the ranks that hold a loss (under pp, those with the last stage; the others add 0)."""
        return reduce_scalar(value, "sum", what, info.timeout_s) / layout.loss_ranks

    def evaluate(it: int) -> dict[str, float]:
        model.eval()
        started_eval = time.perf_counter()
        row = workload.evaluate(layout, autocast, it)
        row["eval_s"] = time.perf_counter() - started_eval
        model.train()
        return row

    def save(it: int, row: dict[str, float]) -> None:
        ranks = gather_objects(_rank_state(batches, device), "all_gather_object of RNG and data states for the "
                               "checkpoint", info.timeout_s)
        trainer_state = {"scaler": scaler.state_dict(), "iteration": it, "config": config_mod.to_dict(cfg),
                         "workload": name, "ranks": ranks, "layout": _describe(dims), **workload.trainer_state(),
                         **row}
        with collective("saving the distributed checkpoint", info.timeout_s):
            path = layout.save_checkpoint(checkpointer, it, optimizer, trainer_state)
        log.info("checkpoint: %s (iteration %d)%s", path, it, " writing in the background" if t.async_checkpoint else "")

    def log_bytes_held() -> None:
        held = gather_objects(bytes_held(model, optimizer), "all_gather_object of per-rank memory", info.timeout_s)
        if info.is_main:
            rows = [f"rank {r:>3}: params {_mib(h['params'])}, grads {_mib(h['grads'])}, optimizer "
                    f"{_mib(h['optimizer'])}" for r, h in enumerate(held)]
            log.info("what each rank holds after its first step (%s):\n%s", t.backend, "\n".join(rows))

    def ranged(section: str):
        """A timer section that is also a profiler range (torch trace, NVTX under nsys)."""
        stack = contextlib.ExitStack()
        stack.enter_context(timer(section))
        stack.enter_context(profiling.record(RANGES.get(section, section), device))
        return stack

    result = TrainResult(run_dir=run_dir, iterations=start_iter)
    started = time.perf_counter()
    interval = _Interval(device)
    it = start_iter
    with progress_bar(max_iters - start_iter, "train", is_main=info.is_main) as bar, contextlib.closing(profiler):
        while True:
            stop = it >= max_iters or _out_of_time(started, t.max_minutes, info)
            if it % eval_interval == 0 or stop:
                if not (resumed and it == start_iter):  # that evaluation was done before the checkpoint was written
                    row = {**interval.summary(mean_loss, samples_per_iter, info), **evaluate(it)}
                    if epochs:
                        row["epoch"] = it / epochs
                    _check_finite(row, it, run_dir)
                    result.train_loss = row.get("train_loss", row.get("avg_loss", math.nan))
                    result.val_loss = row.get("val_loss", math.nan)
                    sinks.log(it, row)
                    workload.after_eval(it, layout, autocast, sinks, result)
                    if t.save_checkpoints and it > start_iter:
                        save(it, row)
                interval.restart()
            if stop:
                break

            profiler.step(it)
            # Synchronising the device stalls its queue: a GPU step of a few ms then waits on the CPU's launches.
            # Only the iterations whose times are logged (or profiled) pay for exact section times.
            timer.sync = (it + 1) % t.log_interval == 0 or profiler.active
            lr_now = learning_rate(it, lr, min_lr, o.warmup_iters, decay_iters, o.decay_lr)
            for group in optimizer.param_groups:
                group["lr"] = lr_now
            loss_sum = torch.zeros((), device=device)
            with timer("dt"):
                for micro in range(t.grad_accum):
                    x, y = batches.next_batch()
                    with collective("forward and backward (gradient reduction)", info.timeout_s):
                        loss_sum += layout.train_micro_step(x, y, accum=t.grad_accum, sync=micro == t.grad_accum - 1,
                                                            autocast=autocast, scaler=scaler, timer=ranged)
                with collective("the gradient all-reduce of the tied embedding across stages", info.timeout_s):
                    layout.finish_backward()
                with profiling.record("optimizer", device):
                    grad_norm = layout.optimizer_step(optimizer, scaler, o.grad_clip)
                if it == start_iter:
                    log_bytes_held()
                optimizer.zero_grad(set_to_none=True)
            times = timer.pop()
            interval.add(loss_sum)
            it += 1
            result.iterations = it
            bar.update()

            if it % t.log_interval == 0:
                loss_value = mean_loss(loss_sum, "all_reduce of the training loss for logging")
                _check_finite({"loss": loss_value}, it, run_dir)
                rates = metrics.throughput(workload.batch_size, t.grad_accum, dims.dp_size, info.world_size,
                                           workload.tokens_per_sample, times["dt"])
                mfu, impossible = mfu_meter(rates["tps_per_gpu"]) if info.is_main else (None, None)
                row = {"loss": loss_value, **times, **rates, "mfu": mfu, "lr": lr_now,
                       "mem_gb": metrics.peak_memory_bytes(device) / 2**30}
                if grad_norm is not None:
                    row["grad_norm"] = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
                sinks.log(it, row)
                if impossible:
                    log.warning("%s", impossible)
    checkpointer.wait()
    batches.close()  # loader workers
    sinks.close()
    return result


class _Interval:
    """What happened since the previous evaluation (an epoch, when counting epochs): training time (wall time
    between two synchronised ends, so unsynchronised iterations count in full), iterations, the sum of their
    losses, and the memory high watermark."""

    def __init__(self, device: torch.device):
        self.device = device
        self.restart()

    def restart(self) -> None:
        self.iterations = 0
        self.loss_sum = torch.zeros((), device=self.device)
        metrics.reset_peak_memory(self.device)
        synchronize(self.device)
        self.started = time.perf_counter()

    def add(self, loss: torch.Tensor) -> None:
        self.loss_sum += loss
        self.iterations += 1

    def summary(self, mean_loss, samples_per_iter: int, info: DistInfo) -> dict[str, float]:
        if not self.iterations:
            return {}
        synchronize(self.device)
        seconds = time.perf_counter() - self.started
        peak = reduce_scalar(metrics.peak_memory_bytes(self.device), "max", "all_reduce of the memory high "
                             "watermark", info.timeout_s, self.device)
        return {"avg_loss": mean_loss(self.loss_sum / self.iterations, "all_reduce of the interval's training loss"),
                "train_s": seconds, "avg_sps": samples_per_iter * self.iterations / seconds,
                "peak_gb": peak / 2**30}


def _check_finite(row: dict[str, float], it: int, run_dir: Path) -> None:
    bad = {k: v for k, v in row.items() if k.endswith("loss") and not math.isfinite(v)}
    if bad:
        what = f"training loss is {bad['loss']}" if "loss" in bad else f"evaluation gave {bad}"
        raise TrainingDiverged(f"{what} at iteration {it}: the model diverged. The last good checkpoint in {run_dir} "
                               "is left as it was; lower optimizer.lr or raise optimizer.warmup_iters and resume "
                               "from it")


def _rank_state(batches, device: torch.device) -> dict:
    state = {"torch_rng": torch.get_rng_state(), "data": batches.state_dict()}
    if device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(device)
    return state


def _restore_rank_state(state: dict, batches, device: torch.device) -> None:
    torch.set_rng_state(state["torch_rng"])
    if "cuda_rng" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda_rng"], device)
    batches.load_state_dict(state["data"])


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
