"""A run directory read back for a report: what `train` left there (runtime/rundir.py), as far as the run got."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from meshtrain.errors import MeshtrainError
from meshtrain.runtime import rundir


class ReportError(MeshtrainError, ValueError):
    """A path that is not a run directory."""


@dataclass
class Run:
    path: Path
    name: str
    config: str  # config.yaml as written
    steps: list[dict]  # rows with a training loss, one per logged iteration
    evals: list[dict]  # rows of an evaluation (val_loss, train_loss, the workload's own)
    texts: list[dict]  # {"step", "tag", "text"}: the GPT's samples
    images: list[dict]  # {"step", "tag", "image": path}: the ViT's forecast figures
    checkpoints: list[str]
    facts: dict = field(default_factory=dict)  # run.json: environment, layout, what each rank holds

    @property
    def last_step(self) -> int:
        return max((r["step"] for r in self.steps + self.evals), default=0)

    @property
    def wall_s(self) -> float:
        times = [r["time"] for r in self.steps + self.evals if "time" in r]
        return max(times) - min(times) if len(times) > 1 else 0.0

    @property
    def best_val(self) -> float | None:
        values = [r["val_loss"] for r in self.evals if r.get("val_loss") is not None]
        return min(values) if values else None

    @property
    def rate_key(self) -> str:
        """Tokens per second for a language model, samples per second otherwise."""
        return "tps" if any("tps" in r for r in self.steps) else "sps"

    def totals(self) -> dict[str, object]:
        """The run's totals for the header: as far as it got."""
        rates = [r[self.rate_key] for r in self.steps if r.get(self.rate_key)]
        mfus = [r["mfu"] for r in self.steps if r.get("mfu") is not None]
        memory = [r["mem_gb"] for r in self.steps if r.get("mem_gb") is not None]
        return {"iterations logged": self.last_step, "wall time": f"{self.wall_s:.1f} s",
                "best val loss": _fmt(self.best_val), "last train loss": _fmt(self.steps[-1]["loss"] if self.steps
                                                                                else None),
                f"median {'tokens' if self.rate_key == 'tps' else 'samples'}/s": _fmt(_median(rates)),
                "median MFU %": _fmt(_median(mfus)), "peak memory GiB (rank 0)": _fmt(max(memory, default=None)),
                "checkpoints": len(self.checkpoints)}


def read_run(path: str | Path) -> Run:
    """The run at `path` (a run directory: the one holding metrics.jsonl, or a `latest` naming one)."""
    path = rundir.named_run(path)
    metrics = path / rundir.METRICS
    if not metrics.is_file():
        raise ReportError(f"{path} is not a run directory: it has no metrics.jsonl (a run directory is "
                          f"<out_dir>/<model>/<backend>/<date>/<time>, e.g. outputs/runs/gpt/ddp/latest)")
    rows = rundir.read_jsonl(metrics)
    config = path / rundir.CONFIG
    checkpoints = sorted(p.name for p in (path / rundir.CHECKPOINTS).glob("step-*"))
    return Run(path=path, name=_name(path), config=config.read_text() if config.is_file() else "",
               steps=[r for r in rows if "loss" in r], evals=[r for r in rows if _is_eval(r)],
               texts=[r for r in rows if "text" in r], images=[r for r in rows if "image" in r],
               checkpoints=checkpoints, facts=rundir.read_facts(path))


def check_not_empty(run: Run, given: str | Path) -> None:
    """A ReportError for a run that logged no iteration (a start killed before its first, whose `latest` a report
    would otherwise draw as a page of nothing), naming the newest run beside it that did."""
    if run.last_step > 0:
        return
    named = f"{given} (which names {run.path})" if Path(given) != run.path else str(run.path)
    other = rundir.newest_run_with(run.path, rundir.has_iterations)
    instead = f"; the newest run that did is {other}: meshtrain report {other}" if other else ""
    raise ReportError(f"nothing to report in {named}: it logged no iteration (a start stopped before its first)"
                      f"{instead}")


def _is_eval(row: dict) -> bool:
    return "loss" not in row and "tag" not in row and any(k.endswith("_loss") for k in row)


def _name(path: Path) -> str:
    """model/backend/date/time from the end of a run directory's path, the way runs are laid out."""
    parts = path.resolve().parts
    return "/".join(parts[-4:]) if len(parts) >= 4 else path.name


def _median(values: list[float]) -> float | None:
    import statistics

    return statistics.median(values) if values else None


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4g}"
