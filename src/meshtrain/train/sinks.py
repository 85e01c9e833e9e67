"""Where metrics go: the console, a JSONL file, TensorBoard, Weights & Biases (progress bars: runtime/progress.py).

Only rank 0 writes: `build_sinks` gives every other rank a sink that does nothing, so the loop calls
`sinks.log(step, metrics)` on every rank without asking who it is. The JSONL file is the record that
reports and plots read; TensorBoard and W&B are optional views (extras `[tensorboard]`, `[wandb]`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from meshtrain.runtime import rundir
from meshtrain.runtime.log import get_logger
from meshtrain.runtime.progress import OFF_VALUES
from meshtrain.train.metrics import format_line

log = get_logger("train")



def _plain(value: Any) -> Any:
    """Tensors and numpy scalars as Python numbers, so every sink sees the same values."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    return value


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numeric metrics (step excluded: it is the x axis), for sinks that plot numbers only."""
    out = {}
    for key, value in metrics.items():
        value = _plain(value)
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    return out


class MetricsSink:
    """A destination for metrics. This base class does nothing: it is what non-zero ranks get."""

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        pass

    def log_text(self, step: int, tag: str, text: str) -> None:
        pass

    def log_image(self, step: int, tag: str, path: str | os.PathLike) -> None:
        """An image already saved as a PNG file (a forecast plot, say) under `tag` at `step`."""

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ConsoleSink(MetricsSink):
    """`step=10 loss=… dt=…` through the rank-aware logger (INFO shows on rank 0)."""

    def __init__(self, logger: logging.Logger | None = None):
        self.logger = logger or log

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.logger.info(format_line({**metrics, "step": step}))

    def log_text(self, step: int, tag: str, text: str) -> None:
        self.logger.info("%s at step %d:\n%s", tag, step, text)

    def log_image(self, step: int, tag: str, path: str | os.PathLike) -> None:
        self.logger.info("image %s: %s", tag, path)


class JsonlSink(MetricsSink):
    """One JSON object per line: {"step", "time", …metrics}, {"step", "time", "tag", "text"} for a text
    sample, or {"step", "time", "tag", "image": the PNG's path} for an image.

    Each line is flushed, so a killed run keeps its history up to its last log; a resumed run appends.
    (No fsync: that guards against a node crash, not a killed process, and costs a round trip on Lustre.)
    NaN and inf are written as Python's json writes them (NaN, Infinity): a diverged loss stays visible."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        if self._file.tell() > 0 and not _ends_with_newline(self.path):
            self._file.write("\n")  # a run killed mid-line: start on a fresh line so ours stay parseable

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._write({"step": int(step), "time": time.time(),
                     **{k: _plain(v) for k, v in metrics.items() if k != "step"}})

    def log_text(self, step: int, tag: str, text: str) -> None:
        self._write({"step": int(step), "time": time.time(), "tag": tag, "text": text})

    def log_image(self, step: int, tag: str, path: str | os.PathLike) -> None:
        self._write({"step": int(step), "time": time.time(), "tag": tag, "image": str(path)})

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


class TensorBoardSink(MetricsSink):
    """add_scalar per numeric metric, add_text per sample, add_image per PNG; flushed at each log so a
    killed run keeps it.
    purge_step: on resume, drop events at and after it that a previous attempt wrote."""

    def __init__(self, log_dir: str | os.PathLike, purge_step: int | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError("TensorBoard logging needs the tensorboard package: "
                              "pip install 'meshtrain[tensorboard]'") from err
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for key, value in _scalars(metrics).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_text(self, step: int, tag: str, text: str) -> None:
        # TensorBoard renders text as markdown; a code block keeps the sample's line breaks and spaces.
        self.writer.add_text(tag, f"```\n{text}\n```", step)
        self.writer.flush()

    def log_image(self, step: int, tag: str, path: str | os.PathLike) -> None:
        try:
            from matplotlib.image import imread
        except ImportError as err:
            raise ImportError("images in TensorBoard are read with matplotlib: pip install matplotlib") from err
        pixels = imread(path)  # a PNG reads as floats in [0, 1]: [H, W] grey, [H, W, 3] RGB or [H, W, 4] RGBA
        if pixels.ndim == 3 and pixels.shape[2] == 4:
            pixels = pixels[:, :, :3]  # TensorBoard's RGB; our plots are opaque, so the alpha says nothing
        self.writer.add_image(tag, pixels, step, dataformats="HWC" if pixels.ndim == 3 else "HW")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def wandb_disabled(mode: str | None = None) -> bool:
    return mode == "disabled" or os.environ.get("WANDB_DISABLED", "").strip().lower() not in OFF_VALUES


class WandbSink(MetricsSink):
    """A Weights & Biases run. mode: "online", "offline" (no network; `wandb sync` later), "disabled",
    or None for wandb's own choice (WANDB_MODE, else online). WANDB_DISABLED=1 or mode "disabled" makes
    this a no-op that never imports wandb. With `dir`, the run id is kept in dir/wandb_run_id so that a
    resumed training continues the same W&B run."""

    def __init__(self, project: str = "meshtrain", run_name: str | None = None, config: Mapping | None = None,
                 dir: str | os.PathLike | None = None, mode: str | None = None, **init_kwargs):
        self.run = None
        self._tables: dict[str, list] = {}
        if wandb_disabled(mode):
            log.info("W&B logging disabled (%s)", "mode=disabled" if mode == "disabled" else "WANDB_DISABLED")
            return
        try:
            import wandb
        except ImportError as err:
            raise ImportError("W&B logging needs the wandb package: pip install 'meshtrain[wandb]'") from err
        self._wandb = wandb
        id_file, run_id = None, None
        if dir is not None:
            Path(dir).mkdir(parents=True, exist_ok=True)
            id_file = Path(dir) / "wandb_run_id"
            run_id = id_file.read_text().strip() if id_file.exists() else None
        self.run = wandb.init(project=project, name=run_name, config=dict(config or {}),
                              dir=None if dir is None else str(dir), mode=mode, id=run_id,
                              resume="allow" if run_id else None, **init_kwargs)
        if id_file is not None and run_id is None:
            id_file.write_text(self.run.id)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self.run is not None:
            self.run.log(_scalars(metrics), step=step)

    def log_text(self, step: int, tag: str, text: str) -> None:
        # One table per tag holding every sample so far: W&B shows the latest table, so all steps stay
        # side by side. A new Table each time because W&B tables are frozen once logged.
        if self.run is not None:
            rows = self._tables.setdefault(tag, [])
            rows.append([step, text])
            self.run.log({tag: self._wandb.Table(columns=["step", "text"], data=list(rows))}, step=step)

    def log_image(self, step: int, tag: str, path: str | os.PathLike) -> None:
        if self.run is not None:
            self.run.log({tag: self._wandb.Image(str(path))}, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class MultiSink(MetricsSink):
    """Fans out to several sinks; with none it is the no-op sink."""

    def __init__(self, sinks: Iterable[MetricsSink] = ()):
        self.sinks = list(sinks)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def log_text(self, step: int, tag: str, text: str) -> None:
        for sink in self.sinks:
            sink.log_text(step, tag, text)

    def log_image(self, step: int, tag: str, path: str | os.PathLike) -> None:
        for sink in self.sinks:
            sink.log_image(step, tag, path)

    def close(self) -> None:
        errors = []
        for sink in self.sinks:  # close them all, so one failing does not leave another's file open
            try:
                sink.close()
            except Exception as err:  # noqa: BLE001 - re-raised below
                errors.append(err)
        if errors:
            raise errors[0]


def build_sinks(run_dir: str | os.PathLike, is_main: bool, tensorboard: bool = False,
                wandb: bool | str = False, config: Mapping | None = None, *, project: str = "meshtrain",
                run_name: str | None = None, resume_step: int | None = None) -> MultiSink:
    """Rank 0: console + run_dir/metrics.jsonl (+ run_dir/tensorboard, + W&B under run_dir/wandb).
    Other ranks: a no-op sink. wandb: True (wandb's own mode choice) or a mode string ("offline", …)."""
    if not is_main:
        return MultiSink()
    run_dir = Path(run_dir)
    sinks: list[MetricsSink] = [ConsoleSink(), JsonlSink(run_dir / rundir.METRICS)]
    if tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard",
                                     purge_step=None if resume_step is None else resume_step + 1))
    if wandb:
        sinks.append(WandbSink(project, run_name or run_dir.name, config, dir=run_dir,
                               mode=wandb if isinstance(wandb, str) else None))
    return MultiSink(sinks)
