"""How the ranks differ: every rank's timings and memory at a logged iteration, gathered so that the log can carry
their spread and name a straggler.

At each log interval every rank contributes one row of FIGURES (one all_gather of a few floats); rank 0 writes,
for each figure, the minimum, median and maximum over the ranks and the rank that had the most, under "ranks"
in the metrics row (the JSONL keeps it; the console line and the plotting sinks do not show it):

    "ranks": {"dt": {"min": 0.21, "median": 0.22, "max": 0.31, "slowest": 3, "each": [...]}, "data": {...}, ...}

"each" (the per-rank values) is kept up to EACH_UP_TO ranks.

A straggler cannot be told by its step time: the others wait for it inside the step's collectives, so every rank's
step takes as long as the slowest one's. It is told by `lead_in`, the work a rank does before the step's first
collective, where nobody waits for anybody yet: fetching its batches, and its forward passes when they hold no
collective (ddp or zero1 without tensor, context or pipeline parallelism). A rank whose lead-in exceeds the median
rank's by more than (ratio - 1) × the median step, for `intervals` log intervals in a row, delays every step by
that much: StragglerWatch names it once, with its host.

Communication is told apart where it can be: `comm`, DDP's wait for its gradient all-reduce after backward's own
compute ended (its reducer times both; Layout.gradient_reduction_wait, one log interval behind), a part of dtb.
FSDP2 reduces in hooks and streams of its own, so its wait stays inside dtb.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

# dt: the iteration; dtf, dtb (dtfb under a pipeline): forward and backward; data: waiting for batches; opt: the
# optimizer step; comm: the gradient all-reduce's wait (above); lead_in: before the first collective (above); mem_gb:
# the peak memory since the last evaluation
FIGURES = ("dt", "dtf", "dtb", "dtfb", "data", "opt", "comm", "lead_in", "mem_gb")
EACH_UP_TO = 64


def gather(values: Mapping[str, float], device: torch.device) -> list[list[float]]:
    """Every rank's FIGURES (NaN where a rank has none), in rank order; a collective over the default group."""
    local = torch.tensor([float(values.get(k, math.nan)) for k in FIGURES], dtype=torch.float64, device=device)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [local.tolist()]
    rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, local)
    return [row.tolist() for row in rows]


def spread(rows: Sequence[Sequence[float]]) -> dict[str, dict]:
    """For each figure some rank has: min, median and max over the ranks that have it, the rank with the most
    ("slowest"), and each rank's value (NaN as None) up to EACH_UP_TO ranks."""
    out = {}
    for column, name in enumerate(FIGURES):
        values = [row[column] for row in rows]
        present = [(v, rank) for rank, v in enumerate(values) if not math.isnan(v)]
        if not present:
            continue
        numbers = [v for v, _ in present]
        figure = {"min": min(numbers), "median": statistics.median(numbers), "max": max(numbers),
                  "slowest": max(present)[1]}
        if len(values) <= EACH_UP_TO:
            figure["each"] = [None if math.isnan(v) else v for v in values]
        out[name] = figure
    return out


class StragglerWatch:
    """Names a rank whose lead-in has exceeded the median rank's by more than (ratio - 1) × the median step for
    `intervals` log intervals in a row: once per rank, so a persistent straggler is one warning, not one each
    interval."""

    def __init__(self, ratio: float, intervals: int, hosts: Sequence[str]):
        self.ratio, self.intervals, self.hosts = ratio, intervals, list(hosts)
        self.rank: int | None = None  # the rank found slow at the last interval
        self.count = 0
        self.named: set[int] = set()

    def update(self, step: int, ranks: Mapping[str, Mapping]) -> str | None:
        """`ranks`: the spread() at `step`. The warning to log, if this interval makes one."""
        lead, dt = ranks.get("lead_in"), ranks["dt"]
        late = lead["max"] - lead["median"] if lead else 0.0
        if len(self.hosts) < 2 or not dt["median"] or late <= (self.ratio - 1) * dt["median"]:
            self.rank, self.count = None, 0
            return None
        slowest = lead["slowest"]
        self.count = self.count + 1 if slowest == self.rank else 1
        self.rank = slowest
        if self.count < self.intervals or slowest in self.named:
            return None
        self.named.add(slowest)
        return (f"straggler: rank {slowest} (host {self.hosts[slowest]}) has been the last to reach its step's "
                f"first collective for {self.count} log intervals in a row, {late:.3f} s after the median rank at "
                f"step {step}: {late / dt['median']:.0%} of the median step ({dt['median']:.3f} s), which every "
                f"rank waits out. Its batches took {_of(ranks, 'data', slowest)} against a median of "
                f"{_median(ranks, 'data')}; look at that host's load, its device and its data reads "
                f"(train.straggler_ratio and train.straggler_intervals set when this warns)")


def _of(ranks: Mapping, figure: str, rank: int) -> str:
    each = ranks.get(figure, {}).get("each")
    return f"{each[rank]:.3f} s" if each and each[rank] is not None else "?"


def _median(ranks: Mapping, figure: str) -> str:
    return f"{ranks[figure]['median']:.3f} s" if figure in ranks else "?"
