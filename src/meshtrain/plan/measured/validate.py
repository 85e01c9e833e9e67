"""Predictions against measurements: each layout run for a few steps on this machine (plan/measured/measure.py under
torchrun: on a CPU the layouts of a repeat in one job, on a GPU one job per layout), its figures set beside what
plan/cost.py predicted for it, with the errors `plan --validate` reports:

    params, grads, optimizer   bytes per rank, predicted exactly or not
    all-to-all bytes           under expert parallelism, what a step's dispatch and combine sent, mean per rank over
                               the ranks (exact: the ep group's received rows add up to its sent ones)
    peak                       relative error of the peak (target: within 10%, in fp32 and under autocast)
    step time                  median absolute percentage error over the layouts (target: at most 15%), and
                               Spearman's rank correlation of predicted and measured times (target: at least 0.8)
    spread                     each layout is measured `repeats` times (2 by default), the layouts interleaved
                               (A B C, then A B C again), so that a drift of the machine's speed falls on all of them;
                               the measured step time is the mean, and the spread ((max - min) / mean) says how much
                               of an error the machine itself makes: an error inside it is not the model's
    drift                      on a CPU, where ranks share cores and a VM's speed moves by a fifth between hours,
                               each repeat's job first runs the slowdown's own reference (calibrate.speed_reference)
                               again: its step against what it took when calibrated says how much slower the machine
                               is now, and the step MdAPE at that speed (each prediction times it) tells the model's
                               error from the machine's
    regret                     how much slower, in measured samples/s, the layout the planner ranks first ran
                               than the fastest of those measured (target: 0, at most 5%); the same for
                               parallel.plan=auto's choice, the planner's first of all layouts, always measured

The machine's terms (matmul curve, bandwidths, fixed costs, collective timings) come from measurements of the
machine alone, never from these runs.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from meshtrain import registry
from meshtrain.data import prepare_text, text
from meshtrain.plan import search
from meshtrain.plan.cost import fixed_kind, kinds_of, predict
from meshtrain.plan.machines import Machine
from meshtrain.plan.measured import calibrate, measure
from meshtrain.plan.search import Candidate
from meshtrain.plan.workload import ModelFacts
from meshtrain.runtime import heartbeat
from meshtrain.runtime.device import pick_device
from meshtrain.runtime.results import first_error, run_ranks

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig

STATES = ("params", "grads", "optimizer")


@dataclass
class Check:
    candidate: Candidate
    measured: dict | None  # params, grads, optimizer of rank 0 of the predicted stage, the largest peak and
    # step_s over the ranks (the mean step_s of the repeats); None if it failed
    error: str = ""
    step_times: tuple[float, ...] = ()  # each repeat's measured step_s, in the order they ran
    drift: float = 1.0  # how much slower than calibrated the machine ran while this was measured (speed reference)

    @property
    def spread(self) -> float:
        """The run-to-run spread of the step time: (max - min) / mean over the repeats; 0 for one measurement."""
        times = self.step_times or ((self.measured or {}).get("step_s", 0.0),)
        mean = statistics.fmean(times)
        return (max(times) - min(times)) / mean if mean else 0.0

    @property
    def predicted(self) -> dict:
        m = self.candidate.cost.memory
        return {"params": m["params"], "grads": m["grads"], "optimizer": m["optimizer"], "peak": m["peak"],
                "step_s": self.candidate.cost.step_s}

    @property
    def all_to_all_exact(self) -> bool:
        """Whether the all-to-all bytes a step sent (mean per rank, measured) are the planner's count."""
        return round(self.candidate.cost.comm_bytes.get("ep", 0.0)) == round(self.measured.get("a2a_bytes", 0))

    def relative(self, key: str) -> float:
        return self.predicted[key] / self.measured[key] - 1

    @property
    def step_error_at_measured_speed(self) -> float:
        """The step time's error with the prediction scaled by the machine's drift: the model's own error."""
        return self.predicted["step_s"] * self.drift / self.measured["step_s"] - 1

    @property
    def states_exact(self) -> bool:
        return all(round(self.predicted[k]) == self.measured[k] for k in STATES)


def run(model: str, overrides: list[str], candidates: list[Candidate], ranks: int, *, steps: int = 5,
        repeats: int = 2, timeout: float = 600, progress=print,
        speed: tuple[str, list[str], float] | None = None) -> list[Check]:
    """Measure each candidate (the run config `overrides` give, with its layout) on `ranks` ranks of this machine,
    `repeats` times, the candidates interleaved; a candidate that fails once is not run again. On a CPU a repeat's
    layouts run in one job (one_job_per_repeat), first the `speed` reference (model, overrides, its calibrated step
    seconds) where given, whose drift every Check then carries; on a GPU each has a job of its own."""
    found: list[list[dict] | str] = [[] for _ in candidates]
    speeds = []
    for repeat in range(repeats):
        live = [i for i, measured in enumerate(found) if not isinstance(measured, str)]
        which = f"measurement {repeat + 1} of {repeats}"
        together = _in_one_job(model, overrides, [candidates[i] for i in live], ranks, steps, timeout,
                               f"{len(live)} layouts in one job ({which})", speed) \
            if one_job_per_repeat() and len(live) > 1 else None
        if speed and isinstance(together, list):
            speeds.append(max(row["step_s"] for row in together.pop(0)) / speed[2])
        for n, i in enumerate(live):
            # no shared job, or it failed: a job of the layout's own, which names a layout that fails
            rows = together[n] if isinstance(together, list) else _in_its_own_job(
                model, overrides, candidates[i], ranks, steps, timeout, f"layout {i + 1} of {len(candidates)}, {which}")
            if isinstance(rows, str):
                found[i] = rows
            else:
                found[i].append(measured_of(candidates[i], rows))
            if repeat == repeats - 1 or isinstance(found[i], str):
                progress(_check(candidates[i], found[i]))
    drift = statistics.fmean(speeds) if speeds else 1.0
    return [replace(_check(candidate, measured), drift=drift) for candidate, measured in zip(candidates, found,
                                                                                             strict=True)]


def one_job_per_repeat() -> bool:
    """Whether a repeat's layouts share one job (measure --cases): on a CPU, where each case's storages are counted
    from its own start and a start-up of the ranks is seconds of the cores the layouts share (a fresh interpreter
    per rank importing torch); not on a GPU, where a layout's peak wants the CUDA allocator's cache empty."""
    return pick_device(0).type == "cpu"


def _in_its_own_job(model: str, overrides: list[str], candidate: Candidate, ranks: int, steps: int, timeout: float,
                    which: str) -> list[dict] | str:
    """What each rank recorded for `candidate` (a row a rank) in a job of its own, or the job's error."""
    rows = _in_one_job(model, overrides, [candidate], ranks, steps, timeout, f"{candidate.label} ({which})")
    return rows if isinstance(rows, str) else rows[0]


def _in_one_job(model: str, overrides: list[str], candidates: list[Candidate], ranks: int, steps: int,
                timeout: float, what: str, speed: tuple[str, list[str], float] | None = None) -> list[list[dict]] | str:
    """Each candidate's rows (a row a rank) from one job of `measure --cases` that runs them in turn, after the
    `speed` reference's (its rows first) where given; or the job's error."""
    heartbeat.note(phase=f"measuring {what} on {ranks} ranks")
    cases = {"speed": {"model": speed[0], "overrides": speed[1]}} if speed else {}
    cases |= {str(n): list(candidate.overrides) for n, candidate in enumerate(candidates)}
    job = run_ranks(Path(measure.__file__), ranks, model, *overrides, "--steps", str(steps), "--cases",
                    json.dumps(cases), timeout=timeout * len(candidates))
    rows = [[result[case] for result in job.results.values() if case in result] for case in cases]
    if job.returncode or any(len(r) != ranks for r in rows):
        return f"exit {job.returncode}: {first_error(job.output)}"
    return rows


def _check(candidate: Candidate, measured: list[dict] | str) -> Check:
    """One candidate's Check from its repeats' figures (or its error): the states and peak of the first (the same
    tensors every time), the mean step time."""
    if isinstance(measured, str):
        return Check(candidate, None, measured)
    times = tuple(m["step_s"] for m in measured)
    return Check(candidate, dict(measured[0], step_s=statistics.fmean(times)), step_times=times)


def measured_of(candidate: Candidate, rows: list[dict]) -> dict:
    """What the ranks of one measured layout recorded (one row a rank), as a Check compares it: the states of the
    first rank of the stage whose states were predicted; the peak and step time of the worst rank; the all-to-all
    bytes, mean per rank (exact: the ep group's received rows add up to its sent ones)."""
    stage = candidate.cost.memory_stage
    fullest = min((r for r in rows if candidate.dims.coords(r["rank"]).get("pp", 0) == stage), key=lambda r: r["rank"])
    return dict(fullest, peak=max(r["peak"] for r in rows), step_s=max(r["step_s"] for r in rows),
                a2a_bytes=sum(r.get("a2a_bytes", 0) for r in rows) / len(rows))


def spread(ranked: list[Candidate], count: int) -> list[Candidate]:
    """`count` layouts across the meshes (tp, cp and its impl, pp and its schedule), in turns: the best of each mesh,
    then the next best of each, ...; meshes of one kind of parallelism before combinations, so that a validation
    spans the kinds of layout, not the top rows alone."""
    by_mesh: dict[tuple, list[Candidate]] = {}
    for c in ranked:
        p = c.cfg.parallel
        by_mesh.setdefault((c.dims.tp, c.dims.cp, p.cp_impl, c.dims.pp, p.pp_schedule, c.dims.ep), []).append(c)
    kinds = lambda mesh: sum(size > 1 for size in (mesh[0], mesh[1], mesh[3], mesh[5]))  # noqa: E731
    by_mesh = dict(sorted(by_mesh.items(), key=lambda item: kinds(item[0])))  # stable: ranked order within
    chosen, depth = [], 0
    while len(chosen) < count and any(len(group) > depth for group in by_mesh.values()):
        chosen += [group[depth] for group in by_mesh.values() if len(group) > depth][:count - len(chosen)]
        depth += 1
    return chosen


AUTO_CANDIDATES = 8  # ranked layouts whose kinds are calibrated up front (auto's pick is usually among them)


def ensure_data(model: str, cfg: RunConfig, progress=print) -> None:
    """The measured runs train on the data `cfg` names: a language model's shipped corpus not prepared there is
    prepared now (offline, seconds); any other dataset missing is one error saying what to run, before calibrating."""
    if not registry.get(model).text:
        return
    data_dir = Path(cfg.data.root) / cfg.data.name
    try:
        text.load_meta(data_dir)
    except text.DataError as missing:
        if data_dir.name not in text.BUILTIN_TOKENIZER:
            raise text.DataError(f"--validate trains the layouts on {data_dir}: {missing}") from None
        progress(f"preparing {data_dir} (the shipped corpus) for the measured runs: `{text.prepare_command(data_dir)}`")
        prepare_text.prepare(data_dir.name, data_dir.parent)


def validate_plan(model: str, overrides: list[str], cfg: RunConfig, ranked: list[Candidate], count: int, nodes: int,
                  per_node: int, machine: Callable[[], Machine], *, steps: int = 5, repeats: int = 2,
                  progress=print, facts: ModelFacts | None = None) -> tuple[list[Check], Check]:
    """`meshtrain plan --validate`: calibrate this machine's fixed costs for the kinds a spread of `count` ranked
    layouts needs, predict them again with those (`machine()` builds the machine afresh), add the layout
    parallel.plan=auto would train now if the spread lacks it, and measure each. Returns the checks and auto's."""
    ensure_data(model, cfg, progress)
    chosen, facts = spread(ranked, count), facts or ModelFacts.of(cfg)
    # with the kinds of the first ranked layouts, among which auto's pick will be once they are calibrated: in one
    # calibration job, where each kind found missing later would start the ranks again
    kinds = sorted({k for c in [*chosen, *ranked[:AUTO_CANDIDATES]] for k in kinds_of(c.cfg, c.dims)})
    for _ in range(4):  # auto's pick must stand on measured fixed costs too, not on an uncalibrated kind's guess
        calibrate.calibrate(nodes * per_node, kinds, model, cfg.data.root, progress=progress, dtype=cfg.train.dtype)
        calibrated = machine()
        auto = search.search(cfg, nodes, per_node, calibrated, facts)[0][0]
        kinds = [k for k in kinds_of(auto.cfg, auto.dims) if fixed_kind(k, cfg.train.dtype) not in calibrated.fixed]
        if not kinds or not calibrate.calibrated(model):
            break
    chosen = [replace(c, cost=predict(facts, c.cfg, c.dims, calibrated)) for c in chosen]
    if auto.label not in {c.label for c in chosen}:
        chosen.append(auto)
    with tempfile.TemporaryDirectory(prefix="meshtrain-speed-") as root:
        # ranks sharing cores: the reference of their slowdown, run again
        speed = calibrate.speed_reference(nodes * per_node, cfg.train.dtype, root) \
            if one_job_per_repeat() and nodes * per_node > 1 else None
        checks = run(model, overrides, chosen, nodes * per_node, steps=steps, repeats=repeats, speed=speed,
                     progress=lambda c: progress(f"measured {c.candidate.label}"
                                                 f"{': failed, ' + c.error if c.error else ''}"))
    return checks, next(c for c in checks if c.candidate.label == auto.label)


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


def measured_throughput(check: Check) -> float:
    """Samples per second the layout ran at (layouts of one plan may differ in samples per step)."""
    return check.candidate.cost.samples_per_iteration / check.measured["step_s"]


def regret(checks: list[Check]) -> float:
    """How much slower the layout the planner ranks first among `checks` ran than the fastest of them, measured:
    1 - its samples/s over the best samples/s (0 when the pick was the fastest)."""
    done = [c for c in checks if c.measured]
    pick = max(done, key=lambda c: c.candidate.throughput)
    return 1 - measured_throughput(pick) / max(measured_throughput(c) for c in done)


def summary(checks: list[Check], auto: Check | None = None) -> dict:
    """The errors over the layouts that ran; regret of the planner's pick among them, and of `auto` (the layout
    parallel.plan=auto trains here) when it ran."""
    done = [c for c in checks if c.measured]
    if not done:
        return {"layouts": 0}
    time_errors = [abs(c.relative("step_s")) for c in done]
    out = {"layouts": len(done), "failed": len(checks) - len(done),
           "states_exact": sum(c.states_exact for c in done),
           "all_to_all_exact": sum(c.all_to_all_exact for c in done),
           "peak_max_error": max(abs(c.relative("peak")) for c in done),
           "peak_within_10": sum(abs(c.relative("peak")) <= 0.10 for c in done),
           "step_mdape": statistics.median(time_errors), "step_max_error": max(time_errors),
           "step_spread_median": statistics.median(c.spread for c in done),
           "machine_drift": statistics.fmean(c.drift for c in done) - 1,
           "step_mdape_at_measured_speed": statistics.median(abs(c.step_error_at_measured_speed) for c in done),
           "spearman": spearman([c.predicted["step_s"] for c in done], [c.measured["step_s"] for c in done]),
           "regret": regret(done)}
    if auto is not None and auto.measured:
        out["auto_regret"] = 1 - measured_throughput(auto) / max(measured_throughput(c) for c in done)
    return out
