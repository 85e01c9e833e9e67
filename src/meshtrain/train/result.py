"""What a run ends with (TrainResult), and its last line in words: the iterations done and the losses of the
evaluation they come from. A run's last iteration is not always evaluated (a signal leaves no time for it; a start
that resumes the run's final checkpoint has nothing left to do), and its line says so, with the last evaluation
there was, rather than a NaN that reads as a diverged model."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class TrainResult:
    run_dir: Path
    iterations: int
    train_loss: float = math.nan
    val_loss: float = math.nan
    samples: list[str] = field(default_factory=list)  # a language model's text samples
    preempted: bool = False  # stopped by a signal (SIGTERM, SIGUSR1), with a checkpoint
    evaluated_at: int | None = None  # the iteration train_loss and val_loss were evaluated at; None: never
    resumed_at: int | None = None  # the checkpoint's iteration this start resumed; None: a new run

    def evaluated(self, iteration: int, row: dict) -> None:
        """Note an evaluation's figures (the row the evaluation logged, or the one a checkpoint kept)."""
        self.train_loss = row.get("train_loss", row.get("avg_loss", math.nan))
        self.val_loss = row.get("val_loss", math.nan)
        self.evaluated_at = iteration

    def outcome(self) -> str:
        """`30 iterations, train loss 3.6912, val loss 3.7056`, or what stands in for it and why."""
        done = f"{self.iterations} iterations"
        if self.resumed_at == self.iterations and self.preempted:
            done += ", all of them before this start (stopped by a signal before its first iteration)"
        elif self.resumed_at == self.iterations:
            done += (f", all of them before this start (it resumed the checkpoint of iteration {self.iterations}, "
                     "the run's last: nothing was left to train)")
        if self.evaluated_at is None:
            return f"{done}; not evaluated (no evaluation in this run yet)"
        losses = ", ".join(f"{name} {value:.4f}" for name, value in
                           (("train loss", self.train_loss), ("val loss", self.val_loss)) if not math.isnan(value)) \
            or "no loss figures"
        if self.evaluated_at == self.iterations:
            return f"{done}, {losses}"
        why = " (stopped by a signal: no time for an evaluation)" if self.preempted else ""
        return (f"{done}; iteration {self.iterations} was not evaluated{why}: the last evaluation, at iteration "
                f"{self.evaluated_at}: {losses}")
