"""Metrics sinks: console, JSONL, TensorBoard and W&B (offline) read back; rank 0 only; progress bars."""

import io
import json
import logging
import os
import sys
import time
import types

import numpy as np
import pytest
import torch
from tests.wandb_offline import wandb_history as _wandb_history

from meshtrain.runtime.progress import progress_bar, progress_enabled, track
from meshtrain.runtime.rundir import read_jsonl
from meshtrain.train.sinks import (
    ConsoleSink,
    JsonlSink,
    MetricsSink,
    MultiSink,
    TensorBoardSink,
    WandbSink,
    build_sinks,
)

# the variables of the launchers and schedulers whose output goes to a log (runtime/env.py)
LAUNCHER_PREFIXES = ("OMPI_", "PMI", "PALS_", "SLURM_", "PBS_")
ROWS = {1: {"loss": 3.5, "dt": 0.25, "lr": torch.tensor(1e-3)}, 2: {"loss": 3.25, "dt": 0.2, "lr": 9e-4}}


def test_console_sink_logs_the_formatted_line(caplog):
    logger = logging.getLogger("test_sinks.console")
    with caplog.at_level(logging.INFO, logger=logger.name):
        sink = ConsoleSink(logger)
        sink.log(10, {"dt": 0.5, "loss": 2.0, "step": 999})
        sink.log_text(10, "sample", "What is an LLM?\nA model.")
    assert caplog.messages[0] == "step=10 loss=2.000000 dt=0.500000"
    assert caplog.messages[1] == "sample at step 10:\nWhat is an LLM?\nA model."


# ----------------------------------------------------------------------------------------------- JSONL
def test_jsonl_lines_are_flushed_as_written_and_appended_on_resume(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    sink = JsonlSink(path)
    for step, row in ROWS.items():
        sink.log(step, row)
    lines = path.read_text().splitlines()  # before close: what a killed run would leave
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["step"] == 1 and first["loss"] == 3.5 and first["lr"] == pytest.approx(1e-3)
    assert isinstance(first["time"], float)
    sink.close()
    with JsonlSink(path) as resumed:
        resumed.log(3, {"loss": 3.0, "val_loss": float("nan")})
        resumed.log_text(3, "sample", "to be or not")
    records = read_jsonl(path)
    assert [r["step"] for r in records] == [1, 2, 3, 3]
    assert records[2]["val_loss"] != records[2]["val_loss"]  # NaN survives the round trip
    assert records[3] == {"step": 3, "time": records[3]["time"], "tag": "sample", "text": "to be or not"}


def test_a_line_cut_by_a_kill_does_not_spoil_the_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.5}\n{"step": 2, "lo')
    with JsonlSink(path) as sink:
        sink.log(2, {"loss": 3.25})
    assert [(r["step"], r["loss"]) for r in read_jsonl(path)] == [(1, 3.5), (2, 3.25)]


def test_read_jsonl_drops_what_a_resume_from_an_earlier_checkpoint_replaced(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with JsonlSink(path) as sink:
        for step in (10, 20, 30, 40):  # checkpoint at 20, killed after 40
            sink.log(step, {"loss": float(step)})
    with JsonlSink(path) as sink:
        for step in (30, 40, 50):
            sink.log(step, {"loss": step + 0.5})
    assert [(r["step"], r["loss"]) for r in read_jsonl(path)] == [(10, 10.0), (20, 20.0), (30, 30.5),
                                                                  (40, 40.5), (50, 50.5)]


# ------------------------------------------------------------------------------------- rank 0, fan-out
def test_non_main_ranks_get_a_sink_that_writes_nothing(tmp_path):
    sinks = build_sinks(tmp_path / "run", is_main=False, tensorboard=True, wandb="offline", config={})
    sinks.log(1, {"loss": 1.0})
    sinks.log_text(1, "sample", "x")
    sinks.close()
    assert sinks.sinks == [] and not (tmp_path / "run").exists()


def test_main_rank_gets_console_and_jsonl(tmp_path):
    with build_sinks(tmp_path, is_main=True) as sinks:
        assert [type(s) for s in sinks.sinks] == [ConsoleSink, JsonlSink]
        sinks.log(5, {"loss": 1.0})
    assert read_jsonl(tmp_path / "metrics.jsonl")[0]["loss"] == 1.0


def test_multisink_closes_every_sink_even_when_one_fails():
    closed = []

    class Broken(MetricsSink):
        def close(self):
            raise OSError("disk full")

    class Good(MetricsSink):
        def close(self):
            closed.append(True)

    with pytest.raises(OSError, match="disk full"):
        MultiSink([Broken(), Good()]).close()
    assert closed == [True]


# ----------------------------------------------------------------------------------------- TensorBoard
def test_tensorboard_scalars_and_text_read_back(tmp_path):
    pytest.importorskip("tensorboard", reason="TensorBoard sink needs the [tensorboard] extra")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with TensorBoardSink(tmp_path / "tb") as sink:
        for step, row in ROWS.items():
            sink.log(step, {**row, "note": "not a number"})
        sink.log_text(2, "sample", "What is an LLM?")
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["dt", "loss", "lr"]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 3.5), (2, 3.25)]
    assert [e.value for e in events.Scalars("lr")] == pytest.approx([1e-3, 9e-4])
    (text,) = events.Tensors("sample/text_summary")
    assert text.step == 2 and b"What is an LLM?" in text.tensor_proto.string_val[0]


def test_tensorboard_resume_purges_the_steps_it_replaces(tmp_path):
    pytest.importorskip("tensorboard", reason="TensorBoard sink needs the [tensorboard] extra")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with TensorBoardSink(tmp_path) as sink:
        for step in (1, 2, 3, 4):
            sink.log(step, {"loss": float(step)})
    with TensorBoardSink(tmp_path, purge_step=3) as sink:
        sink.log(3, {"loss": 30.0})
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_missing_extras_say_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"meshtrain\[tensorboard\]"):
        TensorBoardSink(tmp_path)
    monkeypatch.delenv("WANDB_DISABLED", raising=False)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"meshtrain\[wandb\]"):
        WandbSink(dir=tmp_path, mode="offline")


# ------------------------------------------------------------------------------------------------- W&B
@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    pytest.importorskip("wandb", reason="W&B sink needs the [wandb] extra")
    monkeypatch.delenv("WANDB_DISABLED", raising=False)
    # Offline, quiet, no console capture (pytest owns stdout), and nothing written outside tmp_path.
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
                        "WANDB_CONFIG_DIR": tmp_path / "config", "WANDB_CACHE_DIR": tmp_path / "cache",
                        "WANDB_DATA_DIR": tmp_path / "data", "WANDB_API_KEY": ""}.items():
        monkeypatch.setenv(name, str(value))
    return tmp_path / "run"


def test_wandb_offline_run_writes_what_was_logged(wandb_offline):
    sink = WandbSink(project="meshtrain-test", run_name="unit", config={"n_layer": 2}, dir=wandb_offline,
                     mode="offline")
    for step, row in ROWS.items():
        sink.log(step, row)
    sink.log_text(2, "sample", "What is an LLM?")
    run_id = sink.run.id
    sink.close()
    (run_dir,) = (wandb_offline / "wandb").glob(f"offline-run-*-{run_id}*")
    history, config = _wandb_history(run_dir)
    assert history[1]["loss"] == 3.5 and history[1]["lr"] == pytest.approx(1e-3)
    assert history[2]["loss"] == 3.25 and history[2]["sample/_type"] == "table-file"
    assert config["n_layer"] == 2
    table = json.loads((run_dir / "files" / history[2]["sample/path"]).read_text())
    assert table["columns"] == ["step", "text"] and table["data"] == [[2, "What is an LLM?"]]
    assert (wandb_offline / "wandb_run_id").read_text() == run_id


def test_wandb_resume_continues_the_same_run(wandb_offline):
    with WandbSink(dir=wandb_offline, mode="offline") as first:
        first.log(1, {"loss": 1.0})
        first_id = first.run.id
    with WandbSink(dir=wandb_offline, mode="offline") as second:
        second.log(2, {"loss": 0.5})
        assert second.run.id == first_id
    assert len(list((wandb_offline / "wandb").glob(f"offline-run-*-{first_id}*"))) == 2


def test_build_sinks_with_every_sink(wandb_offline):
    pytest.importorskip("tensorboard", reason="TensorBoard sink needs the [tensorboard] extra")
    with build_sinks(wandb_offline, True, tensorboard=True, wandb="offline", config={"a": 1}) as sinks:
        assert [type(s) for s in sinks.sinks] == [ConsoleSink, JsonlSink, TensorBoardSink, WandbSink]
        sinks.log(1, {"loss": 2.0})
    assert list((wandb_offline / "tensorboard").glob("events.out.tfevents.*"))
    assert list((wandb_offline / "wandb").glob("offline-run-*"))


@pytest.mark.parametrize("env,mode", [("1", None), ("true", "offline"), ("", "disabled")])
def test_wandb_disabled_is_a_no_op_that_never_imports_wandb(monkeypatch, tmp_path, env, mode):
    monkeypatch.setenv("WANDB_DISABLED", env)
    monkeypatch.setitem(sys.modules, "wandb", None)  # an import would raise
    with WandbSink(dir=tmp_path, mode=mode) as sink:
        sink.log(1, {"loss": 1.0})
        sink.log_text(1, "sample", "x")
        assert sink.run is None
    assert not list(tmp_path.iterdir())


# -------------------------------------------------------------------------------------------- progress
def test_progress_shows_only_on_rank_0_at_a_terminal(monkeypatch):

    monkeypatch.delenv("MESHTRAIN_PROGRESS", raising=False)
    for name in list(os.environ):
        if name.startswith(LAUNCHER_PREFIXES):
            monkeypatch.delenv(name)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    assert progress_enabled(True) and not progress_enabled(False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")  # Open MPI's pseudo-terminal: a TTY, but a log file behind it
    assert not progress_enabled(True)
    monkeypatch.delenv("OMPI_COMM_WORLD_RANK")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert not progress_enabled(True)
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False, raising=False)
    assert not progress_enabled(True)  # a batch job's log file
    monkeypatch.setenv("MESHTRAIN_PROGRESS", "1")
    assert progress_enabled(True) and not progress_enabled(False)
    monkeypatch.setenv("MESHTRAIN_PROGRESS", "0")
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    assert not progress_enabled(True)


def test_a_quiet_log_says_what_rank_0_is_doing(monkeypatch, caplog):
    """A first step of minutes or a long evaluation: a line each QUIET_S seconds without one, saying what is under
    way and for how long; nothing on other ranks, nothing while lines come."""
    from meshtrain.runtime import heartbeat, progress

    monkeypatch.setattr(progress, "QUIET_S", 0.2)
    heartbeat.note(step=7, phase="evaluate", collective="all_reduce of the validation loss")
    try:
        with caplog.at_level(logging.INFO, logger="meshtrain"):
            with progress.said_while_quiet(is_main=False):
                time.sleep(0.5)
            assert not caplog.records
            with progress.said_while_quiet(is_main=True):
                time.sleep(0.5)
        said = [r.getMessage() for r in caplog.records]
        assert said and all(m.startswith("still evaluating at step 7, in all_reduce of the validation loss (")
                            for m in said), said
        assert len(said) <= 3  # one a quiet period
    finally:
        heartbeat.note(step=0, phase="start-up", collective=None)


def test_tables_carry_no_colour_codes_under_an_mpi_launcher(monkeypatch, capsys):
    """Open MPI gives each rank a pseudo-terminal: rich would colour a table that goes to the user's log file."""
    from rich.table import Table

    from meshtrain.runtime.log import print_rich

    for name in list(os.environ):
        if name.startswith(LAUNCHER_PREFIXES):
            monkeypatch.delenv(name)
    monkeypatch.setenv("FORCE_COLOR", "1")  # stands for the terminal: rich colours what it prints
    table = Table("key", "value", header_style="bold red")
    table.add_row("ranks", "2")
    print_rich(table)
    assert "\x1b[" in capsys.readouterr().out  # at a terminal, colours (the test can fail)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    print_rich(table)
    text = capsys.readouterr().out
    assert "ranks" in text and "\x1b[" not in text


@pytest.mark.parametrize("forced", ["0", "1"])
def test_progress_bar_and_track_pass_everything_through(monkeypatch, forced):
    monkeypatch.setenv("MESHTRAIN_PROGRESS", forced)
    logger = logging.getLogger("meshtrain")
    handler = logging.StreamHandler(sys.stdout)
    logger.addHandler(handler)
    try:
        with progress_bar(3, "train") as bar:
            for _ in range(3):
                bar.update()
        assert list(track(range(4), "eval")) == [0, 1, 2, 3]
        assert list(track(iter("ab"), "eval", is_main=False)) == ["a", "b"]
        assert handler.stream is sys.stdout  # the log handler got its stream back
    finally:
        logger.removeHandler(handler)


def test_without_a_bar_a_long_task_logs_plain_lines(monkeypatch):
    from meshtrain.runtime import progress

    monkeypatch.setenv("MESHTRAIN_PROGRESS", "0")
    clock = iter([0.0, 10.0, 31.0, 40.0, 62.0, 70.0])
    monkeypatch.setattr(progress, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))  # progress's clock
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    level = progress.log.level
    progress.log.setLevel(logging.INFO)
    progress.log.addHandler(handler)
    try:
        assert list(track(range(5), "eval val")) == [0, 1, 2, 3, 4]  # clock: start, then one reading per item
    finally:
        progress.log.removeHandler(handler)
        progress.log.setLevel(level)
    assert lines == ["eval val: 2/5 (31 s)", "eval val: 4/5 (62 s)"]


# ---------------------------------------------------------------------------------------------- images
@pytest.fixture
def png(tmp_path):
    """A 3 x 5 RGBA PNG with 8-bit colours and a half-transparent pixel; returns (path, its RGB as uint8)."""
    pytest.importorskip("matplotlib", reason="images are read with matplotlib")
    from matplotlib.image import imsave

    rgba = np.random.default_rng(0).integers(0, 256, size=(3, 5, 4), dtype=np.uint8)
    rgba[..., 3] = 255
    rgba[1, 1, 3] = 128
    path = tmp_path / "plots" / "forecast_step_7.png"
    path.parent.mkdir()
    imsave(path, rgba)
    return path, rgba[..., :3]


def test_console_sink_names_the_image(caplog, png):
    path, _ = png
    logger = logging.getLogger("test_sinks.console_image")
    with caplog.at_level(logging.INFO, logger=logger.name):
        ConsoleSink(logger).log_image(7, "forecast/u10", path)
    assert caplog.messages == [f"image forecast/u10: {path}"]


def test_jsonl_image_record_sits_with_the_metrics(tmp_path, png):
    path, _ = png
    with JsonlSink(tmp_path / "metrics.jsonl") as sink:
        sink.log(7, {"loss": 1.5})
        sink.log_image(7, "forecast/u10", path)
        sink.log(8, {"loss": 1.25})
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [7, 7, 8]
    assert records[1] == {"step": 7, "time": records[1]["time"], "tag": "forecast/u10", "image": str(path)}


def test_multisink_hands_the_image_to_every_sink(tmp_path, png):
    path, _ = png
    jsonl = JsonlSink(tmp_path / "metrics.jsonl")
    with MultiSink([MetricsSink(), jsonl]) as sinks:
        sinks.log_image(3, "forecast", path)
    assert [(r["step"], r["tag"], r["image"]) for r in read_jsonl(jsonl.path)] == [(3, "forecast", str(path))]


def test_tensorboard_image_reads_back_as_its_rgb_pixels(tmp_path, png):
    pytest.importorskip("tensorboard", reason="TensorBoard sink needs the [tensorboard] extra")
    from matplotlib.image import imread
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path, rgb = png
    with TensorBoardSink(tmp_path / "tb") as sink:
        sink.log_image(7, "forecast/u10", path)
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0})
    events.Reload()
    assert events.Tags()["images"] == ["forecast/u10"]
    (image,) = events.Images("forecast/u10")
    assert (image.step, image.height, image.width) == (7, 3, 5)
    decoded = imread(io.BytesIO(image.encoded_image_string), format="png")
    assert decoded.shape == (3, 5, 3)  # alpha dropped
    np.testing.assert_array_equal(np.round(decoded * 255).astype(np.uint8), rgb)


def test_wandb_image_is_logged_as_an_image_file(wandb_offline, png):
    path, _ = png
    sink = WandbSink(dir=wandb_offline, mode="offline")
    sink.log_image(7, "forecast", path)
    run_id = sink.run.id
    sink.close()
    (run_dir,) = (wandb_offline / "wandb").glob(f"offline-run-*-{run_id}*")
    history, _ = _wandb_history(run_dir)
    assert 7 in history, f"no history record at step 7; steps written: {sorted(history)}"
    assert history[7]["forecast/_type"] == "image-file"
    assert (history[7]["forecast/height"], history[7]["forecast/width"]) == (3, 5)


def test_torch_warnings_show_once_on_rank_0_and_not_on_the_others():
    """DTensor logs its "suboptimal" redistribution at every step and FSDP2 warns once per module: rank 0 shows each
    message once, the other ranks none (they would repeat it world-size times)."""
    import warnings

    from meshtrain.runtime.log import TORCH_REPEATING, configure_logging

    torch_log, records = logging.getLogger(TORCH_REPEATING[0]), []
    handler = logging.Handler()
    handler.emit = records.append
    torch_log.addHandler(handler)
    try:
        for rank, shown in ((0, 1), (1, 0)):
            records.clear()
            with warnings.catch_warnings(record=True) as caught:
                configure_logging(rank, 2)
                warnings.warn(f"a view tensor, rank {rank}", UserWarning, stacklevel=1)
                warnings.warn(f"a view tensor, rank {rank}", UserWarning, stacklevel=1)  # another line, same message
                for _ in range(3):
                    torch_log.warning("%d sequential operations: suboptimal, rank %d", 2, rank)
            assert (len(caught), len(records)) == (shown, shown), rank
    finally:
        torch_log.removeHandler(handler)
        configure_logging()
