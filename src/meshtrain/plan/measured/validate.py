"""Predictions against measurements: each layout run for a few steps on this machine (plan/measured/measure.py under
torchrun, one job per layout), its figures set beside what plan/cost.py predicted for it, with the errors
`plan --validate` reports:

    params, grads, optimizer   bytes per rank, predicted exactly or not
    peak                       relative error of the peak (target: within 15%)
    step time                  median absolute percentage error over the layouts (target: at most 25%), and
                               Spearman's rank correlation of predicted and measured times (target: at least 0.8)

The machine's terms (matmul curve, bandwidths, fixed costs, collective timings) come from measurements of the
machine alone, never from these runs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from meshtrain.plan.measured import measure
from meshtrain.plan.search import Candidate
from meshtrain.runtime.results import run_ranks

STATES = ("params", "grads", "optimizer")


@dataclass
class Check:
    candidate: Candidate
    measured: dict | None  # params, grads, optimizer of rank 0 of the predicted stage, the largest peak and
    # step_s over the ranks; None if it failed
    error: str = ""

    @property
    def predicted(self) -> dict:
        m = self.candidate.cost.memory
        return {"params": m["params"], "grads": m["grads"], "optimizer": m["optimizer"], "peak": m["peak"],
                "step_s": self.candidate.cost.step_s}

    def relative(self, key: str) -> float:
        return self.predicted[key] / self.measured[key] - 1

    @property
    def states_exact(self) -> bool:
        return all(round(self.predicted[k]) == self.measured[k] for k in STATES)


def run(model: str, overrides: list[str], candidates: list[Candidate], ranks: int, *, steps: int = 5,
        timeout: float = 600, progress=print) -> list[Check]:
    """Measure each candidate (the run config `overrides` give, with its layout) on `ranks` ranks of this machine."""
    checks = []
    for candidate in candidates:
        job = run_ranks(Path(measure.__file__), ranks, model, *overrides, *candidate.overrides, "--steps", str(steps),
                        timeout=timeout)
        rows = [fields for result in job.results.values() for fields in result.values()]
        if job.returncode or len(rows) != ranks:
            tail = job.output.strip().splitlines()[-1:] or ["no output"]
            checks.append(Check(candidate, None, f"exit {job.returncode}: {tail[0][:200]}"))
        else:
            stage = candidate.cost.memory_stage  # the stage whose states were predicted; peak and time: the worst
            fullest = min((r for r in rows if candidate.dims.coords(r["rank"]).get("pp", 0) == stage),
                          key=lambda r: r["rank"])
            fullest = dict(fullest, peak=max(r["peak"] for r in rows), step_s=max(r["step_s"] for r in rows))
            checks.append(Check(candidate, fullest))
        progress(checks[-1])
    return checks


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                result[order[k]] = (i + j) / 2
            i = j + 1
        return result
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    norm = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / norm if norm else float("nan")


def summary(checks: list[Check]) -> dict:
    done = [c for c in checks if c.measured]
    if not done:
        return {"layouts": 0}
    time_errors = [abs(c.relative("step_s")) for c in done]
    return {"layouts": len(done), "failed": len(checks) - len(done),
            "states_exact": sum(c.states_exact for c in done),
            "peak_max_error": max(abs(c.relative("peak")) for c in done),
            "peak_within_15": sum(abs(c.relative("peak")) <= 0.15 for c in done),
            "step_mdape": statistics.median(time_errors),
            "spearman": spearman([c.predicted["step_s"] for c in done], [c.measured["step_s"] for c in done])}
