"""MetricsRecorder: what a logged iteration reports, for the trainer and for a training loop of one's own.

    recorder = MetricsRecorder(run_dir, info, batch_size=32, tokens_per_sample=256, flops_per_token=6 * n_params)
    for step in range(1, steps + 1):
        with recorder.section("dt"):                           # the whole iteration: its sections end with it
            with recorder.section("data"): x, y = next(batches)
            with recorder.section("dtf"): loss = loss_fn(model(x), y)
            with recorder.section("dtb"): loss.backward()
            with recorder.section("opt"): optimizer.step(); optimizer.zero_grad()
        if step % 10 == 0:
            recorder.log(step, loss, lr=lr)                        # every rank calls it: it gathers
    recorder.close()

A logged row is the trainer's: the console line (metrics.LEGEND's keys), and on rank 0 a row of run_dir/metrics.jsonl
with the loss averaged over the ranks that hold one, samples and tokens per second of the whole job, MFU against
the device's peak (when the FLOPs per token are given), this rank's memory high watermark, and every rank's section
times and memory as their spread (rank_stats). A rank that keeps arriving late to the step is named once (the
straggler rule of rank_stats.StragglerWatch). `meshtrain report RUN_DIR` draws the page from what it wrote.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

from meshtrain import machine
from meshtrain.errors import MeshtrainError
from meshtrain.runtime.log import get_logger
from meshtrain.runtime.setup import DistInfo, collective, gather_objects, reduce_scalar
from meshtrain.train import metrics, rank_stats
from meshtrain.train.sinks import MetricsSink, build_sinks

log = get_logger("train")
SPREAD_ONLY = ("data", "opt")  # sections in the ranks' spread, not on the console line (it keeps its columns)


class TrainingDiverged(MeshtrainError, RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is left as it was."""


def check_finite(row: Mapping[str, float], step: int, run_dir: Path, suspect: str = "") -> None:
    """Raise TrainingDiverged if a loss in `row` (training, or an evaluation's *_loss) is NaN or infinite;
    `suspect` names a cause other than the optimisation itself, where the run has one."""
    bad = {k: v for k, v in row.items() if k.endswith("loss") and not math.isfinite(v)}
    if bad:
        what = f"training loss is {bad['loss']}" if "loss" in bad else f"evaluation gave {bad}"
        raise TrainingDiverged(f"{what} at iteration {step}: the model diverged. The last good checkpoint in {run_dir} "
                               "is left as it was; lower the learning rate (optimizer.lr) or lengthen its warm-up "
                               f"(optimizer.warmup_iters) and resume from it{suspect}")


class MetricsRecorder:
    """Times an iteration's sections and logs its row (see the module docstring).

    batch_size: samples per rank per micro-step; grad_accum: micro-steps per iteration; dp_size: the ranks that see
    different batches (default: all); tokens_per_sample: for tokens/s (None: samples only); flops_per_token: for MFU
    (None: no MFU), against the peak of `dtype` on this device (the machine profile's; `peak_flops` overrides it);
    loss_ranks: the ranks that hold a loss (a pipeline's last stage; default: all); local_forward: the forward holds
    no collective (DDP or ZeRO-1 alone), so it counts in the time before the step's first collective, by which a
    straggler is told (rank_stats). sinks: where rows go (default: console and metrics.jsonl on rank 0, with
    TensorBoard and W&B when asked for).
    """

    def __init__(self, run_dir: str | Path, info: DistInfo, *, batch_size: int, grad_accum: int = 1,
                 dp_size: int | None = None, tokens_per_sample: int | None = None,
                 flops_per_token: float | None = None, dtype: torch.dtype = torch.float32,
                 peak_flops: float | None = None, loss_ranks: int | None = None, local_forward: bool = False,
                 sinks: MetricsSink | None = None,
                 tensorboard: bool = False, wandb: bool | str = False, config: Mapping | None = None,
                 straggler_ratio: float = 1.2, straggler_intervals: int = 3):
        self.run_dir, self.info, self.device = Path(run_dir), info, info.torch_device
        self.throughput = metrics.Throughput(batch_size, grad_accum, dp_size or info.world_size, info.world_size,
                                             tokens_per_sample)
        self.loss_ranks = loss_ranks or info.world_size
        self.timer = metrics.StepTimer(self.device)
        self.local_forward = local_forward
        self.iteration: dict[str, float] = {}  # the section times of the last iteration that ended
        self.mfu_meter = None
        self.divergence_suspect = ""  # check_finite's `suspect`: set by a run that knows of one
        if info.is_main and flops_per_token:  # MFU is rank 0's figure: only it needs the peak

            peak = machine.peak_flops(self.device, dtype, peak_flops)
            self.mfu_meter = metrics.MFUMeter(flops_per_token, peak, remeasure=(
                lambda: machine.measured_peak(self.device, peak.label, again=True)) if peak.kind == "measured" else None)
        if sinks is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            sinks = build_sinks(self.run_dir, info.is_main, tensorboard=tensorboard, wandb=wandb, config=config)
        self.sinks = sinks
        self.straggler_ratio, self.straggler_intervals = straggler_ratio, straggler_intervals
        self.stragglers: rank_stats.StragglerWatch | None = None  # made at the first logged step (a collective)

    @contextmanager
    def section(self, name: str):
        """A timed section: dt (the iteration), and inside it dtf, dtb (or dtfb under a pipeline), data, opt; a
        section's times add up over the iteration (its micro-steps), and the iteration ends with its dt."""
        with self.timer(name):
            yield
        if name == "dt":
            self.iteration = self.timer.pop()

    def log(self, step: int, loss: float | torch.Tensor, *, comm: float | None = None, **figures) -> dict:
        """Log iteration `step`, the last that ended (every rank calls it: the loss and the ranks' figures are
        gathered). `loss` is this rank's (0 on a rank without one); `comm`, where it is known, the seconds of its
        backward spent waiting for the gradient reduction (in the ranks' spread); `figures` (lr, grad_norm, ...) go
        into the row as they are. Returns the row."""
        info, times = self.info, self.iteration
        if "dt" not in times:
            raise MeshtrainError(f"MetricsRecorder.log(step={step}) found no iteration: time each one in `with "
                                 "recorder.section('dt'):`")
        loss_value = reduce_scalar(loss, "sum", "all_reduce of the training loss for logging", info.timeout_s,
                                   self.device) / self.loss_ranks
        check_finite({"loss": loss_value}, step, self.run_dir, self.divergence_suspect)
        rates = self.throughput.rates(times["dt"])
        mfu, impossible = self.mfu_meter(rates["tps_per_gpu"]) if self.mfu_meter and "tps" in rates else (None, None)
        mem_gb = metrics.peak_memory_bytes(self.device) / 2**30
        lead_in = times.get("data", 0.0) + (times.get("dtf", 0.0) if self.local_forward else 0.0)
        with collective("all_gather of every rank's timings", info.timeout_s):
            mine = {**times, "lead_in": lead_in, "mem_gb": mem_gb} | ({"comm": comm} if comm is not None else {})
            ranks = rank_stats.spread(rank_stats.gather(mine, self.device))
        row = {"loss": loss_value, **{k: v for k, v in times.items() if k not in SPREAD_ONLY}, **rates, "mfu": mfu,
               "mem_gb": mem_gb, "ranks": ranks}
        for key, value in figures.items():
            if value is not None:
                row[key] = float(value.full_tensor() if hasattr(value, "full_tensor") else value)
        self.sinks.log(step, row)
        if impossible:
            log.warning("%s", impossible)
        if self.stragglers is None:
            hosts = gather_objects(info.hostname, "all_gather_object of host names for the straggler watch")
            self.stragglers = rank_stats.StragglerWatch(self.straggler_ratio, self.straggler_intervals, hosts)
        if info.is_main and (warning := self.stragglers.update(step, ranks)):  # one warning, not one a rank
            log.warning("%s", warning)
        return row

    def close(self) -> None:
        self.sinks.close()

    def __enter__(self) -> MetricsRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
