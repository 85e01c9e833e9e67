"""Atomic checkpoints of a run (the run directory around them: runtime/rundir.py).

    <run_dir>/checkpoints/step-0000250/   a distributed checkpoint (DCP): every rank's shards, .metadata,
                                          trainer_state.pt (iteration, config, RNG and sampler streams)
    <run_dir>/checkpoints/latest          the name of the last complete step directory
    <run_dir>/model.pt                    `meshtrain export`: the whole model in one file

A checkpoint is published only once complete (see Checkpointer), so a kill at any moment leaves the
previous one usable. Everything in it loads with `weights_only=True`.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from meshtrain import registry
from meshtrain.config import from_dict
from meshtrain.parallel.backends import deepspeed
from meshtrain.parallel.state_dict import load_model_and_optimizer_state, model_and_optimizer_state
from meshtrain.runtime import rundir
from meshtrain.runtime.log import get_logger
from meshtrain.runtime.rundir import CHECKPOINTS, LATEST, CheckpointError

log = get_logger("train")
TRAINER_STATE, EXPORT = "trainer_state.pt", "model.pt"


def resumable_run(out_dir: str | Path, workload: str, backend: str, run_dir: str | Path | None = None) -> Path | None:
    """The run train.init_from=auto continues: `run_dir` if it has saved a checkpoint, else the newest run that has
    (a later run killed before its first checkpoint costs no earlier run's progress: it is passed over, and the
    log says so); None when no run saved one yet. A checkpoint pointer that names a missing step is an error, not
    a fresh start: starting over would silently throw the run's progress away."""
    if run_dir:
        candidates = [Path(run_dir)]
    else:
        latest = rundir.last_run(out_dir, workload, backend)
        candidates = list(dict.fromkeys(([latest] if latest else []) + rundir.runs(out_dir, workload, backend)))
    for number, run in enumerate(candidates):
        if (run / CHECKPOINTS / LATEST).is_file():
            latest_checkpoint(run)  # complete, or a clear error
            if number:
                log.warning("train.init_from=auto: the newer run(s) %s saved no checkpoint; resuming %s",
                            ", ".join(str(r) for r in candidates[:number]), run)
            return run
    return None


class Checkpointer:
    """Saves distributed checkpoints of one run: `checkpoints/step-NNNNNNN/` directories and a `latest`
    file naming the last complete one.

    Every rank writes its own shards (DCP) into a hidden `.step-NNNNNNN.partial/` directory; only
    when all have finished does rank 0 add the trainer state, rename the directory and move
    `latest`. A kill mid-save leaves a partial directory that nothing points at, and the previous
    checkpoint stays the one a resume finds. With `async_save`, the copy to host memory happens
    in the step and the writing in a background thread, on a gloo group of its own so that its
    collectives never interleave with training's.
    """

    def __init__(self, run_dir: Path, *, is_main: bool, keep: int = 2, async_save: bool = False):
        self.root = Path(run_dir) / CHECKPOINTS
        self.is_main, self.keep = is_main, keep
        self.async_group = dist.new_group(backend="gloo") if async_save else None
        self._pending = None  # (future, partial dir, final dir, trainer state) of an async save in flight

    def save(self, iteration: int, state: dict, trainer_state: dict) -> Path:
        """Start saving `state` (from parallel.state_dict, on every rank) and rank 0's `trainer_state`
        (iteration, config, RNG streams: plain tensors and Python values)."""
        if self.async_group is None:  # dcp.save returns once every rank's shards and the metadata are written
            return self.save_with(iteration, lambda path: dcp.save(state, checkpoint_id=str(path)), trainer_state)
        self.wait()  # one save in flight at a time
        partial, final = self._paths(iteration)
        future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self.async_group)
        self._pending = (future, partial, final, trainer_state)
        return final

    def save_with(self, iteration: int, write, trainer_state: dict) -> Path:
        """Save through `write(directory)`, which every rank calls and which returns once all ranks have
        written (a DeepSpeed engine's own save, say); then publish it like any other."""
        self.wait()
        partial, final = self._paths(iteration)
        write(partial)
        dist.barrier()  # rank 0 publishes only once every rank's files are there
        self._finish(partial, final, trainer_state)
        return final

    def _paths(self, iteration: int) -> tuple[Path, Path]:
        final = self.root / f"step-{iteration:07d}"
        partial = self.root / f".{final.name}.partial"
        if self.is_main:
            shutil.rmtree(partial, ignore_errors=True)  # left by a killed run
        dist.barrier()  # nobody writes into it before it is cleared
        return partial, final

    def wait(self) -> Path | None:
        """Block until the save in flight (if any) is complete and published."""
        if self._pending is None:
            return None
        future, partial, final, trainer_state = self._pending
        self._pending = None
        future.result()  # on rank 0 this also means every rank's writes are done: rank 0 writes the metadata last
        self._finish(partial, final, trainer_state)
        return final

    def _finish(self, partial: Path, final: Path, trainer_state: dict) -> None:
        if not self.is_main:
            return
        _atomic_torch_save(partial / TRAINER_STATE, trainer_state)
        shutil.rmtree(final, ignore_errors=True)  # an earlier run saved this step and was resumed from before it
        os.replace(partial, final)
        rundir.write_atomically(self.root / LATEST, f"{final.name}\n")
        steps = sorted(p for p in self.root.glob("step-*") if p.is_dir())
        for old in steps[:-self.keep] if self.keep > 0 else ():
            shutil.rmtree(old, ignore_errors=True)


class Checkpoints:
    """Checkpoints of a training loop of one's own: every rank's share of a model and its optimizer, saved with
    DCP into run_dir/checkpoints/step-NNNNNNN (atomically, as Checkpointer does), and loaded back under any layout
    (any ParallelDims, any data-parallel backend but DeepSpeed's). Every rank calls every method but `latest`.
    Needs the process group (`meshtrain.setup`), on one process too.

        checkpoints = Checkpoints(run_dir)
        start = checkpoints.load(model, optimizer)["step"] if checkpoints.latest() else 0
        ...
        checkpoints.save(step, model, optimizer, data_position=position)   # anything torch.load(weights_only) reads
    """

    def __init__(self, run_dir: str | Path, *, keep: int = 2, async_save: bool = False):
        self.run_dir = Path(run_dir)
        self._writer = Checkpointer(self.run_dir, is_main=dist.get_rank() == 0, keep=keep, async_save=async_save)

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **extra) -> Path:
        """Save `step`; `extra` (plain values and tensors) comes back from load(). Returns the step's directory,
        complete once save returns (with async_save: once the next save or wait())."""
        return self._writer.save(step, model_and_optimizer_state(_unwrapped(model), optimizer),
                                 {"iteration": step, "extra": extra})

    def wait(self) -> Path | None:
        """Block until an async save in flight is published."""
        return self._writer.wait()

    def latest(self) -> Path | None:
        """The last complete checkpoint's directory, or None when the run has none."""
        return latest_checkpoint(self.run_dir) if (self.run_dir / CHECKPOINTS / LATEST).is_file() else None

    def load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str | Path | None = None) -> dict:
        """Fill `model` and `optimizer` (laid out as they are now) from `path`, by default the latest checkpoint;
        returns {"step": ..., **extra} as saved."""
        path = Path(path) if path else latest_checkpoint(self.run_dir)
        load_model_and_optimizer_state(_unwrapped(model), optimizer, dcp_loader(path))
        saved = load_trainer_state(path)
        return {"step": saved["iteration"], **saved.get("extra", {})}


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """DDP's module: the names a checkpoint keeps are the model's own, whatever wraps it."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def latest_checkpoint(run_dir: Path, given: Path | None = None, retry: str = "train.run_dir={run}") -> Path:
    """The last complete checkpoint directory of a run (`given`: the path the user named, a `latest` say; `retry`:
    how the error says to use another run)."""
    pointer = Path(run_dir) / CHECKPOINTS / LATEST
    if not pointer.is_file():
        raise CheckpointError(no_checkpoint(Path(run_dir), given, retry))
    path = pointer.parent / pointer.read_text().strip()
    if not (path / TRAINER_STATE).is_file():
        raise CheckpointError(f"{pointer} names {path.name}, which is missing or incomplete: delete {pointer} to "
                              "fall back to an earlier step directory by hand, or start again")
    return path


def no_checkpoint(run_dir: Path, given: Path | None, retry: str) -> str:
    """One line: `run_dir` has no checkpoint, and the newest run beside it that has one, as `retry` uses it."""
    named = f"{given} (which names {run_dir})" if given is not None and Path(given) != run_dir else str(run_dir)
    if not run_dir.is_dir():
        return f"no run directory at {named}: the path is wrong"
    other = rundir.newest_run_with(run_dir, rundir.has_checkpoint)
    instead = f"; the newest run with one is {other}: {retry.format(run=other)}" if other else ""
    return (f"no checkpoint in {named}: it saved none (a start stopped before its first checkpoint, or one with "
            f"train.save_checkpoints=false){instead}")


def load_trainer_state(checkpoint_dir: Path) -> dict[str, Any]:
    path = Path(checkpoint_dir) / TRAINER_STATE
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: say which, not a pickle traceback
        raise CheckpointError(f"{path} is not a readable meshtrain trainer state: {e}") from e


def dcp_loader(checkpoint_dir: Path):
    """state -> None: fill a template state dict (this rank's slices, in the current layout) from the checkpoint."""
    def load(state: dict) -> None:
        try:
            with warnings.catch_warnings():  # one process reading every shard is what export and sample mean to do
                warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
                dcp.load(state, checkpoint_id=str(checkpoint_dir))
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            raise CheckpointError(f"{checkpoint_dir} could not be loaded into this model: {e}. Is it a checkpoint of "
                                  "the same architecture (model.*) and optimizer?") from e
    return load


def export_model(run_dir: Path, out: Path | None = None) -> Path:
    """Consolidate the run's latest checkpoint into one file: {"model": full state dict, "config", "workload",
    "data_facts", "iteration"}, loadable by torch.load(weights_only=True) on one process and by `meshtrain sample`."""
    given, run_dir = Path(run_dir), rundir.named_run(run_dir)
    checkpoint_dir = latest_checkpoint(run_dir, given, retry="meshtrain export --run {run}")
    trainer_state = load_trainer_state(checkpoint_dir)
    model, facts = rebuild_model(trainer_state)
    load_whole_model(model, checkpoint_dir)
    out = Path(out) if out else Path(run_dir) / EXPORT
    _atomic_torch_save(out, {"model": model.state_dict(), "config": trainer_state["config"],
                             "workload": trainer_state.get("spec") or trainer_state.get("workload", "gpt"),
                             "data_facts": facts, "iteration": trainer_state["iteration"]})
    return out


def load_language_model(run: Path, device: torch.device) -> tuple[torch.nn.Module, dict]:
    """(the language model of a run's latest checkpoint, whatever layout wrote it, or of an exported file, in eval
    mode on `device`; its tokenizer description), for `meshtrain sample`."""
    given, run = Path(run), rundir.named_run(run)
    if run.is_file():
        try:
            saved = torch.load(run, map_location="cpu", weights_only=True)
            weights = saved["model"]
        except Exception as e:
            raise CheckpointError(f"{run} is not a model file written by `meshtrain export`: {e}") from e
        model, facts = rebuild_model(saved)
        model.load_state_dict(weights)
    else:
        checkpoint_dir = latest_checkpoint(run, given, retry="meshtrain sample --run {run}")
        model, facts = rebuild_model(load_trainer_state(checkpoint_dir))
        load_whole_model(model, checkpoint_dir)
    if "meta" not in facts or not hasattr(model, "generate"):
        raise CheckpointError(f"{run} holds a {type(model).__name__}, not a language model: `meshtrain "
                              "sample` generates text only")
    return model.to(device).eval(), facts["meta"]


def rebuild_model(saved: dict[str, Any]):
    """(a one-process model of a saved run, the data facts it was built from), from a trainer state or an exported
    file: the model's registry spec builds it from the saved config, with dropout off."""
    from dataclasses import replace


    spec = registry.get(saved.get("spec") or saved.get("workload", "gpt"))  # an exported file names its spec
    if spec.build_model is None:
        raise CheckpointError(f"the {spec.name} model has no build_model in its ModelSpec: it cannot be rebuilt on "
                              "one process (export, sample)")
    facts = saved.get("data_facts") or {"meta": saved["meta"]}  # checkpoints before the registry kept meta alone
    cfg = from_dict(saved["config"], spec.name)
    # The saved weights replace whatever the build starts from: never fetch pretrained ones again.
    cfg = replace(cfg, model=replace(cfg.model, dropout=0.0), train=replace(cfg.train, init_from="scratch"))
    return spec.build_model(cfg, facts), facts


def load_whole_model(model, checkpoint_dir: Path) -> None:
    """Fill a one-process model from a checkpoint of any layout: this process reads every shard."""
    if (Path(checkpoint_dir) / deepspeed.TAG).is_dir():
        state = deepspeed.consolidated_state(checkpoint_dir)
        # DeepSpeed lists a tied weight once: give every other name of the same parameter its tensor.
        first_name: dict[int, str] = {}
        for name, tensor in model.state_dict(keep_vars=True).items():
            first_name.setdefault(id(tensor), name)
            if name not in state and first_name[id(tensor)] in state:
                state[name] = state[first_name[id(tensor)]]
        model.load_state_dict(state)
        return
    state = {"model": model.state_dict()}
    dcp_loader(checkpoint_dir)(state)  # fills the model's own tensors in place


def _atomic_torch_save(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        torch.save(obj, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
