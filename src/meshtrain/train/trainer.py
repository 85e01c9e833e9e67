"""The trainer: one loop for every model (found through its ModelSpec) and every layout (parallel/).

    result = Trainer(cfg, info).run()

Set-up: the precision, the run directory, the model's workload, the model on the run's one mesh (its layout), the
optimizer and, when resuming, everything the checkpoint holds. Per iteration (`step`): `grad_accum` micro-steps
(only the last synchronises gradients), clip, step, log. Every `eval_interval` (with train.max_epochs: every epoch,
`evaluate`): the workload's evaluation, reduced over the ranks, a summary of the interval since the previous one
(time, samples/s, mean training loss, evaluation time, memory high watermark), what the workload shows (a text
sample, a forecast plot) and a distributed checkpoint (`save`). A checkpoint holds everything a bit-exact resume
needs: model, optimizer, scaler, iteration and every rank's RNG state; the data stream's position is the iteration
itself (its samples depend on the global batch number, not on the layout). It loads into any other layout too:
the data goes on exactly (same global batch: train.global_batch_size keeps it when the ranks change), only dropout's
masks differ (they are drawn per rank).

The workload supplies the model, its layout, the batch stream, the evaluation and what follows it; the trainer
never asks which model it drives.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from contextlib import nullcontext
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from meshtrain import config as config_mod
from meshtrain import machine, registry
from meshtrain.parallel import backends, float8
from meshtrain.parallel.data_parallel import bytes_held
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.runtime import heartbeat, rundir
from meshtrain.runtime.log import get_logger, print_rich
from meshtrain.runtime.progress import progress_bar
from meshtrain.runtime.setup import DistInfo, broadcast_object, collective, gather_objects, reduce_scalar
from meshtrain.train import checkpoint, faults, metrics, profiling
from meshtrain.train.ledger import SampleLedger
from meshtrain.train.optim import build_optimizer, learning_rate, scaled_learning_rates
from meshtrain.train.recorder import MetricsRecorder, check_finite
from meshtrain.train.result import TrainResult
from meshtrain.train.sinks import build_sinks
from meshtrain.train.stopping import Stopping

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig

log = get_logger("train")
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# torch 2.13's inductor can store a whole vector into a reduction's tail on CPU, past its buffer (pytorch/pytorch
# #196681, open): heap corruption or NaN from a healthy model. Seen here on a 2-layer GPT with GELU, n_embd 32.
COMPILED_ON_CPU = (". This model is compiled on CPU (train.compile=true), where torch's inductor has a known bug "
                   "that can produce NaN (pytorch/pytorch#196681): run once with train.compile=false to tell the two "
                   "apart")
RANGES = {"dtf": "forward", "dtb": "backward", "dtfb": "forward_backward"}  # timer section -> profiler range


def train(cfg: RunConfig, info: DistInfo) -> TrainResult:
    return Trainer(cfg, info).run()


def divergence_suspect(compiled: bool, device: torch.device) -> str:
    """What a NaN loss message names beside the optimisation itself: torch's inductor bug, for a model compiled on
    CPU; nothing otherwise."""
    return COMPILED_ON_CPU if compiled and device.type == "cpu" else ""


def resolve_precision(cfg: RunConfig, info: DistInfo) -> tuple[object, machine.Precision | None]:
    """cfg with train.dtype the one this run computes in (and, on rank 0, why), after the checks of what the
    device can do. Rank 0 chooses for all: nodes of different kinds must still compute in one dtype."""
    t, device = cfg.train, info.torch_device
    if t.dtype == "fp16" and device.type != "cuda":
        raise config_mod.ConfigError(f"train.dtype=fp16 needs a GPU (GradScaler); this rank runs on {device}: "
                                     "use train.dtype=auto (or bf16, fp32)")
    profiling.cuda_graphs_check(t.cuda_graphs, device)
    float8.check(t.float8, device)
    precision = machine.choose(t.dtype, device) if info.is_main else None
    dtype = broadcast_object(precision and precision.dtype, "broadcast of the training dtype", info.timeout_s)
    return replace(cfg, train=replace(t, dtype=dtype)), precision


class Trainer:
    def __init__(self, cfg: RunConfig, info: DistInfo):
        self.info, self.device = info, info.torch_device
        self.spec = registry.spec_of(cfg)
        if cfg.parallel.plan == "auto":
            raise config_mod.ConfigError("parallel.plan=auto is chosen before the Trainer is built: pass the config "
                                         "through meshtrain.plan.measured.auto.resolve(cfg, info) first (`meshtrain "
                                         "train` does)")
        # Every rule that needs the world size, before any collective: all ranks fail alike, at once.
        self.dims = ParallelDims.from_config(cfg, info.world_size, info.local_world_size)
        self.cfg, self.precision = resolve_precision(cfg, info)
        self.resumed, self.checkpoint_dir = None, None
        self.run_dir = self._open_run_dir()
        try:
            self._build()
            self.start_iter = self._resume() if self.resumed else 0
            self.batches.seek(self.start_iter)  # the data's position is the iteration, in any layout
            self.ledger = SampleLedger(self.run_dir, self.start_iter) if self.cfg.train.sample_ledger and \
                info.is_main else None
            self._start_reporting()
        except BaseException:
            if info.is_main and not self.resumed:  # a run that never started leaves nothing behind
                shutil.rmtree(self.run_dir, ignore_errors=True)
            raise
        if info.is_main:  # only now is it the run that `latest` names: the one that trains, new or resumed
            rundir.record_run(self.cfg.train.out_dir, self.spec.name, self.cfg.train.backend, self.run_dir)

    # ---- set-up ------------------------------------------------------------------------------------------------
    def _open_run_dir(self) -> Path:
        """The run to resume (its saved architecture replaces cfg.model), or a new run directory; init_from=auto
        becomes resume where the run (train.run_dir, else the latest) has a checkpoint, else scratch."""
        t, name, info = self.cfg.train, self.spec.name, self.info
        if t.init_from == "auto":  # a re-queued job continues; rank 0 looks, so that every rank decides alike
            found = checkpoint.resumable_run(t.out_dir, name, t.backend, t.run_dir) if info.is_main else None
            found = broadcast_object(found and str(found), "broadcast of the run to resume", info.timeout_s)
            t = replace(t, init_from="resume" if found else "scratch", run_dir=found or t.run_dir)
            self.cfg = replace(self.cfg, train=t)
            if info.is_main:
                log.info("train.init_from=auto: %s", f"resuming {found}" if found else "no checkpoint yet, from scratch")
        if t.init_from == "resume":
            run_dir = Path(t.run_dir) if t.run_dir else rundir.latest_run(t.out_dir, name, t.backend)
            self.checkpoint_dir = checkpoint.latest_checkpoint(run_dir)
            self.resumed = checkpoint.load_trainer_state(self.checkpoint_dir)
            saved = config_mod.from_dict(self.resumed["config"], name).model
            if info.is_main and (given := _differences(self.cfg.model, saved)):  # a run resumes its own model
                log.warning("resuming %s: its saved model replaces what was given here: %s", run_dir, given)
            self.cfg = replace(self.cfg, model=saved)
            return run_dir
        run_dir = rundir.new_run_dir(t.out_dir, name, t.backend) if info.is_main else None
        return Path(broadcast_object(str(run_dir) if run_dir else None, "broadcast of the run directory",
                                     info.timeout_s))

    def _build(self) -> None:
        """The workload, the model on the run's one mesh, the optimizer, the scaler and the checkpointer."""
        info, dims, device = self.info, self.dims, self.device
        self.cfg = config_mod.with_global_batch(self.cfg, dims.dp_size)
        self.workload = self.spec.workload(self.cfg, info, dims)
        self.cfg = cfg = self.workload.cfg  # with what the data decided (the ViT's local batch from a global one)
        t, o = cfg.train, cfg.optimizer
        torch.manual_seed(t.seed)  # the same initial weights on every rank
        model = self.workload.build_model().to(device)
        self.num_params, self.flops_per_token = model.num_params(), model.flops_per_token()
        # A model whose tokens each use part of it (a mixture of experts) says how much: its FLOPs count only that.
        self.active_params = model.num_active_params() if hasattr(model, "num_active_params") else None
        self.batches = self.workload.batches
        self.autocast = (torch.autocast(device_type=device.type, dtype=AUTOCAST[t.dtype]) if AUTOCAST[t.dtype]
                         else nullcontext())
        mesh = dims.build_mesh(device.type) if dims.world_size > 1 else None  # the one mesh of the run
        self.layout = self.workload.build_layout(model, mesh)
        self.model = self.layout.model  # this rank's share of the model
        # Dropout masks differ where the data does (dp and cp ranks); tp ranks must draw the same masks on the stream
        # they all hold, and pp ranks hold different layers anyway.
        torch.manual_seed(_dropout_seed(t.seed, 0, self._place()))
        self.samples_per_iter = self.workload.batch_size * t.grad_accum * dims.dp_size
        self.lr, self.min_lr, self.lr_factor = scaled_learning_rates(cfg, self.samples_per_iter)
        fused = {} if o.fused is None else {"fused": o.fused}
        groups = self.model.configure_optimizer_groups(o.weight_decay)
        self.optimizer = self.layout.attach_optimizer(build_optimizer(
            groups, device, t.backend, info.world_size, lr=self.lr, betas=(o.beta1, o.beta2), **fused))
        self.scaler = torch.amp.GradScaler(device.type, enabled=t.dtype == "fp16")
        self.checkpointer = checkpoint.Checkpointer(self.run_dir, is_main=info.is_main, keep=t.keep_checkpoints,
                                                    async_save=t.async_checkpoint)

    def _place(self) -> int:
        """This rank's place among the ranks that read different data: its dp rank × cp + its cp rank."""
        return self.dims.dp_rank(self.info.rank) * self.dims.cp + self.dims.coords(self.info.rank)["cp"]

    def _resume(self) -> int:
        """Load the checkpoint into this layout; returns the iteration it was written at."""
        resumed, dims = self.resumed, self.dims
        with collective(f"loading the checkpoint {self.checkpoint_dir}", self.info.timeout_s):
            self.layout.load_checkpoint(self.checkpoint_dir, self.optimizer, checkpoint.dcp_loader(self.checkpoint_dir))
        self.scaler.load_state_dict(resumed["scaler"])
        # A rank's RNG stream (dropout) belongs to its place in the layout (its dp and cp rank): carry it over only
        # into the same layout. The data stream's position is the iteration, the same in any layout.
        if resumed.get("layout") == _describe(dims):
            _restore_rank_state(resumed["ranks"][self.info.rank], self.device)
        else:
            torch.manual_seed(_dropout_seed(self.cfg.train.seed, resumed["iteration"], self._place()))
            log.info("checkpoint written under %s, resumed under %s: model, optimizer and data go on exactly; dropout "
                     "masks are drawn per rank, so they differ from the uninterrupted run's", resumed.get("layout"),
                     _describe(dims))
        if resumed.get("global_batch", self.samples_per_iter) != self.samples_per_iter:
            log.warning("the checkpoint's run read %d samples per iteration, this one %d: the data from here on is "
                        "not what that run would have read (train.global_batch_size=%d keeps its batch on any ranks)",
                        resumed["global_batch"], self.samples_per_iter, resumed["global_batch"])
        cost = faults.restart_cost(self.run_dir / rundir.METRICS, resumed["iteration"]) if self.info.is_main else None
        if cost:
            log.info("restart: the previous attempt had done %d iteration(s) past this checkpoint, to be done again, "
                     "and last logged %.1f s ago", *cost)
        return resumed["iteration"]

    def _start_reporting(self) -> None:
        """The schedule in iterations, the timers, the profiler, the MFU meter (rank 0), the sinks and the header."""
        cfg, info, device = self.cfg, self.info, self.device
        t = cfg.train
        self.epochs = self.workload.iters_per_epoch if t.max_epochs else None  # iterations per epoch, if counted
        self.max_iters = t.max_epochs * self.epochs if self.epochs else t.max_iters
        self.eval_interval = self.epochs or t.eval_interval
        self.decay_iters = cfg.optimizer.lr_decay_iters or self.max_iters
        self.drill = faults.Drill(info.rank)  # MESHTRAIN_FAULT: rehearsed failures
        self.interval = metrics.Interval(device)
        dims = self.dims
        self.config_dict = config_mod.to_dict(cfg)  # as every checkpoint records it: the config is final here
        self.profiler = profiling.StepProfiler(t.profile, start=t.profile_start, steps=t.profile_steps,
                                               out_dir=self.run_dir / "profile", rank=info.rank, device=device)
        self.sinks = build_sinks(self.run_dir, info.is_main, tensorboard=t.tensorboard,
                                 wandb=False if t.wandb == "off" else t.wandb, config=self.config_dict,
                                 resume_step=self.start_iter if self.resumed else None)
        self.recorder = MetricsRecorder(
            self.run_dir, info, batch_size=self.workload.batch_size, grad_accum=t.grad_accum, dp_size=dims.dp_size,
            tokens_per_sample=self.workload.tokens_per_sample, flops_per_token=self.flops_per_token,
            dtype=AUTOCAST[t.dtype] or torch.float32, peak_flops=t.peak_flops, loss_ranks=self.layout.loss_ranks,
            local_forward=backends.get(t.backend).all_reduces and dims.tp == dims.cp == dims.pp == dims.ep == 1,
            sinks=self.sinks,
            straggler_ratio=t.straggler_ratio, straggler_intervals=t.straggler_intervals)
        self.layout.time_gradient_reduction(every=t.log_interval)
        self.recorder.divergence_suspect = divergence_suspect(t.compile != "off", self.device)
        if info.is_main:
            self._log_header()

    def _log_header(self) -> None:
        cfg, dims, workload = self.cfg, self.dims, self.workload
        t, o = cfg.train, cfg.optimizer
        peak = self.recorder.mfu_meter.peak
        resolved = config_mod.to_yaml(cfg)
        (self.run_dir / rundir.CONFIG).write_text(resolved)
        log.info("resolved config:\n%s", resolved.rstrip())
        log.info("run directory: %s%s", self.run_dir,
                 f" (resuming at iteration {self.start_iter})" if self.resumed else "")
        log.info("precision: %s (%s)", t.dtype, self.precision.reason)
        if self.precision.warning:
            log.warning("%s", self.precision.warning)
        active = "" if self.active_params is None else f" ({self.active_params / 1e6:.2f}M active per token)"
        log.info("model: %.2fM parameters%s, %.3g FLOPs per token; peak %.4g TFLOP/s per device (%s)",
                 self.num_params / 1e6, active, self.flops_per_token, peak.flops / 1e12, peak.source)
        log.info("layout: %s over %d rank(s) (%s); %s; %d data-parallel rank(s) × accumulation %d: global batch %d "
                 "samples (%d tokens) per iteration", t.backend, self.info.world_size, _describe(dims),
                 workload.describe(), dims.dp_size, t.grad_accum, self.samples_per_iter,
                 self.samples_per_iter * workload.tokens_per_sample)
        if o.base_batch_size:
            log.info("learning rate: %.4g = optimizer.lr %.4g × sqrt(global batch %d / base batch %d) = × %.4f",
                     self.lr, o.lr, self.samples_per_iter, o.base_batch_size, self.lr_factor)
        if self.epochs:
            log.info("%d epochs of %d iterations: %d iterations, evaluating after each epoch", t.max_epochs,
                     self.epochs, self.max_iters)
        print_rich(metrics.legend_table(extra=self.spec.legend))

    # ---- the loop ----------------------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        t = self.cfg.train
        self.result = result = TrainResult(run_dir=self.run_dir, iterations=self.start_iter)
        if self.resumed:  # what the checkpoint's run had evaluated stands until this one evaluates
            result.resumed_at = self.start_iter
            if "val_loss" in self.resumed:
                result.evaluated(self.start_iter, self.resumed)
        with progress_bar(self.max_iters - self.start_iter, "train", is_main=self.info.is_main) as bar, \
                contextlib.closing(self.profiler), Stopping(t.max_minutes, self.info, self.max_iters) as stopping:
            it = self._loop(bar, stopping)
            # Still under Stopping's handler: a signal now (torchrun's, as it restarts the ranks to admit a node) is
            # noted, not fatal, so that the last checkpoint, written in the background, is published before exit.
            self._where = {"step": it, "micro": None}
            self._phase("finish")
            self.checkpointer.wait()
            self.batches.close()  # loader workers
            if self.ledger:
                self.ledger.close()
            self.sinks.close()
        result.preempted = stopping.say_how_it_ended(it, complete=it >= self.max_iters)
        return result

    def _loop(self, bar, stopping: Stopping) -> int:
        """The iterations from start_iter, each evaluation and checkpoint; returns the iteration it stopped after."""
        it = self.start_iter
        while True:
            # Asked at every iteration, the last included (a collective: every rank asks as often), so that a signal
            # in the last iteration is known: the run completes then, and says so.
            stop = stopping.check() is not None or it >= self.max_iters
            if it % self.eval_interval == 0 or stop:
                if not (self.resumed and it == self.start_iter):  # done before that checkpoint was written
                    self._where = {"step": it, "micro": None}
                    if stopping.reason == "signal" and it < self.max_iters and it % self.eval_interval:
                        self.save_before_leaving(it)  # a scheduler's grace is short: no evaluation
                    else:
                        self._phase("evaluate")
                        self.evaluate(it)
                self.interval.restart()
            if stop:
                return it
            self.step(it)
            it += 1
            self.drill.after(it)
            self.result.iterations = it
            bar.update()

    def step(self, it: int) -> None:
        """Iteration `it`: its micro-steps, the optimizer step, and its log line if it is a logged one."""
        t, o, device, layout = self.cfg.train, self.cfg.optimizer, self.device, self.layout
        # Synchronising the device stalls its queue: a GPU step of a few ms then waits on the CPU's launches.
        # Only the iterations whose times are logged (or profiled) pay for exact section times.
        self.profiler.step(it)
        logged = (it + 1) % t.log_interval == 0 or it + 1 == self.max_iters  # a short run logs its last step
        self.recorder.timer.sync = logged or self.profiler.active
        lr_now = learning_rate(it, self.lr, self.min_lr, o.warmup_iters, self.decay_iters, o.decay_lr)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_now
        loss_sum = torch.zeros((), device=device)
        with self.recorder.section("dt"):
            for micro in range(t.grad_accum):
                self._where = {"step": it + 1, "micro": micro}
                with self.recorder.section("data"):
                    self._phase("data")
                    x, y = self.batches.next_batch()
                with collective("forward and backward (gradient reduction)", self.info.timeout_s):
                    loss_sum += layout.train_micro_step(x, y, accum=t.grad_accum, sync=micro == t.grad_accum - 1,
                                                        autocast=self.autocast, scaler=self.scaler,
                                                        timer=self._ranged)
            with collective("the gradient all-reduce of the tied embedding across stages", self.info.timeout_s):
                layout.finish_backward()
            self._where["micro"] = None
            self._phase("optimizer")
            with profiling.record("optimizer", device), self.recorder.section("opt"):
                grad_norm = layout.optimizer_step(self.optimizer, self.scaler, o.grad_clip)
            if it == self.start_iter:
                self._log_bytes_held()
            self.optimizer.zero_grad(set_to_none=True)
        self.interval.add(loss_sum)
        if self.ledger:
            self.ledger.write(it, self.batches.global_ids(it))
        if logged:
            self.recorder.log(it + 1, loss_sum, comm=layout.gradient_reduction_wait(), lr=lr_now, grad_norm=grad_norm)

    def evaluate(self, it: int) -> None:
        """The interval's summary and the workload's evaluation, logged; what the workload shows; a checkpoint."""
        t = self.cfg.train
        row = self.interval.summary(self._mean_loss, self.samples_per_iter, self.info)
        self.model.eval()
        started = time.perf_counter()
        row |= self.workload.evaluate(self.layout, self.autocast, it)
        row["eval_s"] = time.perf_counter() - started
        self.model.train()
        if self.epochs:
            row["epoch"] = it / self.epochs
        check_finite(row, it, self.run_dir, self.recorder.divergence_suspect)
        self.result.evaluated(it, row)
        self.sinks.log(it, row)
        self.workload.after_eval(it, self.layout, self.autocast, self.sinks, self.result)
        if t.save_checkpoints and it > self.start_iter:
            self.save(it, row)

    def save_before_leaving(self, it: int) -> None:
        """Stopped by a signal between evaluations: the interval's figures logged (nothing measured is lost) and a
        checkpoint, without the evaluation."""
        row = self.interval.summary(self._mean_loss, self.samples_per_iter, self.info)
        self.sinks.log(it, row)
        if self.cfg.train.save_checkpoints and it > self.start_iter:
            self.save(it, row)

    def save(self, it: int, row: dict[str, float]) -> None:
        """A distributed checkpoint of iteration `it`, with every rank's RNG state (collective)."""
        info = self.info
        self._phase("checkpoint")
        ranks = gather_objects(_rank_state(self.device), "all_gather_object of RNG states for the checkpoint",
                               info.timeout_s)
        trainer_state = {"scaler": self.scaler.state_dict(), "iteration": it, "config": self.config_dict,
                         "workload": self.spec.name, "spec": self.spec.source,
                         "data_facts": self.workload.data_facts(), "ranks": ranks, "layout": _describe(self.dims),
                         "global_batch": self.samples_per_iter,
                         **row}
        with collective("saving the distributed checkpoint", info.timeout_s):
            path = self.layout.save_checkpoint(self.checkpointer, it, self.optimizer, trainer_state)
        log.info("checkpoint: %s (iteration %d)%s", path, it,
                 " writing in the background" if self.cfg.train.async_checkpoint else "")

    # ---- helpers -----------------------------------------------------------------------------------------------
    def _mean_loss(self, value: torch.Tensor, what: str) -> float:
        """The mean over the ranks that hold a loss (under pp, those with the last stage; the others add 0)."""
        return reduce_scalar(value, "sum", what, self.info.timeout_s) / self.layout.loss_ranks

    def _phase(self, phase: str) -> None:
        """Note where this rank is in its heartbeat (step and micro-batch from `_where`), and carry out a drill's
        fault meant for here."""
        heartbeat.note(phase=phase, **self._where)
        self.drill.during(self._where["step"], phase)

    def _ranged(self, section: str):
        """A timer section that is also a profiler range (torch trace, NVTX under nsys) and a heartbeat phase."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.recorder.section(section))
        self._phase(RANGES.get(section, section))  # in the section's time: a drilled slow phase counts there
        stack.enter_context(profiling.record(RANGES.get(section, section), self.device))
        return stack

    def _log_bytes_held(self) -> None:
        info = self.info
        held = gather_objects(bytes_held(self.model, self.optimizer), "all_gather_object of per-rank memory",
                              info.timeout_s)
        if info.is_main:
            rows = [f"rank {r:>3}: params {_mib(h['params'])}, grads {_mib(h['grads'])}, optimizer "
                    f"{_mib(h['optimizer'])}" for r, h in enumerate(held)]
            log.info("what each rank holds after its first step (%s):\n%s", self.cfg.train.backend, "\n".join(rows))
            layout = f"{self.cfg.train.backend} over {info.world_size} rank(s) ({_describe(self.dims)})"
            rundir.write_facts(self.run_dir, {"model": self.spec.name, "layout": layout, "holds": held,
                                       "environment": asdict(info)})  # for `meshtrain report`


def _rank_state(device: torch.device) -> dict:
    state = {"torch_rng": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(device)
    return state


def _restore_rank_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch_rng"])
    if "cuda_rng" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda_rng"], device)


def _dropout_seed(seed: int, iteration: int, place: int) -> int:
    """The RNG seed of a rank's dropout from `iteration` on, at its place (dp and cp rank): different places draw
    different masks, tp ranks (one stream, held by all) the same; a new place after a layout change, new masks."""
    return seed + place + 1_000_003 * iteration


def _differences(given, saved) -> str:
    """The model keys whose value given here differs from the saved run's, as `model.n_layer=6 (saved: 4)`."""
    return ", ".join(f"model.{f.name}={getattr(given, f.name)!r} (saved: {getattr(saved, f.name)!r})"
                     for f in fields(saved) if getattr(given, f.name) != getattr(saved, f.name))


def _describe(dims: ParallelDims) -> str:
    experts = f", ep={dims.ep} (experts over ep of the dp_shard ranks)" if dims.ep > 1 else ""
    return " × ".join(f"{d}={getattr(dims, d)}" for d in dims.mesh_dims) + experts + f", order {dims.order}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
