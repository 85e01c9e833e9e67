"""The report's figures, each a function of the runs (several runs overlay, one colour each), drawn with matplotlib's
Agg backend (no display). A figure whose figures no run has (a pipeline has no dtf, a run of one rank no spread)
is None."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import matplotlib

matplotlib.use("Agg")
from matplotlib import pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from meshtrain.report.runs import Run  # noqa: E402

PARTS = (("dtf", "forward"), ("dtb", "backward"), ("comm", "waiting for the gradient all-reduce (DDP)"),
         ("dtfb", "forward + backward (pipeline)"), ("opt", "optimizer"), ("data", "waiting for data"))


def figures(runs: list[Run]) -> dict[str, Figure]:
    """Every figure the runs have, by file stem, in the page's order."""
    made = {"loss": loss_by_iteration(runs), "loss_time": loss_by_time(runs), "lr": _line(runs, "lr", "learning rate"),
            "grad_norm": _line(runs, "grad_norm", "gradient norm", log=True), "throughput": throughput(runs),
            "step_breakdown": step_breakdown(runs), "memory": memory_per_rank(runs), "rank_spread": rank_spread(runs),
            "skill": skill(runs), "experts": experts(runs)}
    return {name: fig for name, fig in made.items() if fig is not None}


def loss_by_iteration(runs: list[Run]) -> Figure | None:
    return _losses(runs, lambda run, rows: [r["step"] for r in rows], "iteration")


def loss_by_time(runs: list[Run]) -> Figure | None:
    def seconds(run: Run, rows: list[dict]) -> list[float]:
        start = min(r["time"] for r in run.steps + run.evals)
        return [r["time"] - start for r in rows]

    return _losses(runs, seconds, "wall time (s)")


def throughput(runs: list[Run]) -> Figure | None:
    if not any(r.steps for r in runs):
        return None
    fig, (rate, mfu) = plt.subplots(1, 2, figsize=(11, 3.6))
    for colour, run in _coloured(runs):
        key = run.rate_key
        rate.plot(*_xy(run.steps, key), color=colour, label=run.name)
        mfu.plot(*_xy(run.steps, "mfu"), color=colour, label=run.name)
    rate.set(xlabel="iteration", ylabel="tokens/s" if all(r.rate_key == "tps" for r in runs) else "samples/s",
             title="throughput")
    mfu.set(xlabel="iteration", ylabel="MFU %", title="model FLOPs utilisation")
    rate.legend(fontsize=7)
    return _done(fig)


def step_breakdown(runs: list[Run]) -> Figure | None:
    """Stacked seconds of a step: forward, backward, optimizer, data and the rest of dt (the median rank's figures).
    One run: a bar per logged iteration; several: one bar per run (the medians over its iterations)."""
    rows = [(run, r) for run in runs for r in run.steps if "ranks" in r]
    if not rows:
        return None
    if len(runs) == 1:
        labels, bars = [str(r["step"]) for _, r in rows], [_parts(r) for _, r in rows]
    else:
        labels, bars = [], []
        for run in runs:
            mine = [_parts(r) for r in run.steps if "ranks" in r]
            if mine:
                labels.append(run.name)
                bars.append({k: statistics.median(p[k] for p in mine) for k in mine[0]})
    fig, ax = plt.subplots(figsize=(11, 3.8))
    bottom = [0.0] * len(bars)
    for key, name in (*PARTS, ("other", "other (communication not overlapped, synchronisation)")):
        heights = [b.get(key, 0.0) for b in bars]
        if any(heights):
            ax.bar(range(len(bars)), heights, bottom=bottom, label=name)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_xticks(range(len(bars)), labels, rotation=45 if len(runs) > 1 else 0, fontsize=7, ha="right")
    ax.set(ylabel="seconds", title="where a step's time goes (the median rank)",
           xlabel="iteration" if len(runs) == 1 else "")
    ax.legend(fontsize=7)
    return _done(fig)


def memory_per_rank(runs: list[Run]) -> Figure | None:
    """One line per rank (one run), or the largest rank's per run (several)."""
    if not any("mem_gb" in r.get("ranks", {}) for run in runs for r in run.steps):
        return None
    fig, ax = plt.subplots(figsize=(11, 3.6))
    if len(runs) == 1:
        rows = [r for r in runs[0].steps if "mem_gb" in r.get("ranks", {})]
        each = [r["ranks"]["mem_gb"].get("each") for r in rows]
        if all(each):
            for rank in range(len(each[0])):
                ax.plot([r["step"] for r in rows], [e[rank] for e in each], label=f"rank {rank}")
        ax.set_title("peak memory per rank (GiB, since the previous evaluation)")
    else:
        for colour, run in _coloured(runs):
            rows = [r for r in run.steps if "mem_gb" in r.get("ranks", {})]
            ax.plot([r["step"] for r in rows], [r["ranks"]["mem_gb"]["max"] for r in rows], color=colour,
                    label=run.name)
        ax.set_title("peak memory of the fullest rank (GiB)")
    ax.set(xlabel="iteration", ylabel="GiB")
    ax.legend(fontsize=7, ncol=4)
    return _done(fig)


def rank_spread(runs: list[Run]) -> Figure | None:
    """The ranks' step times (min to max band, median line) and their lead-in, with the last rank to its first
    collective marked: the straggler, when one rank keeps being it."""
    have = [run for run in runs if any(len(r.get("ranks", {}).get("dt", {}).get("each") or []) > 1 for r in run.steps)]
    if not have:
        return None
    fig, (steps, lead) = plt.subplots(1, 2, figsize=(11, 3.6))
    for colour, run in _coloured(have):
        rows = [r for r in run.steps if "dt" in r.get("ranks", {})]
        x = [r["step"] for r in rows]
        dt = [r["ranks"]["dt"] for r in rows]
        steps.fill_between(x, [d["min"] for d in dt], [d["max"] for d in dt], color=colour, alpha=0.25)
        steps.plot(x, [d["median"] for d in dt], color=colour, label=run.name)
        late = [r["ranks"].get("lead_in") for r in rows]
        if all(late):
            lead.plot(x, [d["max"] - d["median"] for d in late], color=colour, marker="o", ms=3, label=run.name)
            for xi, d in zip(x, late, strict=True):
                lead.annotate(str(d["slowest"]), (xi, d["max"] - d["median"]), fontsize=6, xytext=(0, 3),
                              textcoords="offset points", ha="center")
    steps.set(xlabel="iteration", ylabel="seconds", title="step time over the ranks (min-max band, median)")
    lead.set(xlabel="iteration", ylabel="seconds", title="the last rank's lead-in over the median (its rank above)")
    steps.legend(fontsize=7)
    return _done(fig)


def skill(runs: list[Run]) -> Figure | None:
    """The ViT's forecast against persistence (validation RMSE of u10), where a run evaluates it."""
    have = [run for run in runs if any("val_rmse_u10" in r for r in run.evals)]
    if not have:
        return None
    fig, ax = plt.subplots(figsize=(11, 3.6))
    for colour, run in _coloured(have):
        ax.plot(*_xy(run.evals, "val_rmse_u10"), color=colour, marker="o", label=f"{run.name}: forecast")
        ax.plot(*_xy(run.evals, "persistence_rmse_u10"), color=colour, ls="--", label=f"{run.name}: persistence")
    ax.set(xlabel="iteration", ylabel="RMSE u10", title="forecast against persistence (validation)")
    ax.legend(fontsize=7)
    return _done(fig)


def experts(runs: list[Run]) -> Figure | None:
    """A mixture of experts' routing at each evaluation (models/moe/workload.py): the smallest and largest share of a
    layer's assignments one expert took against the even share, and the load's normalised entropy; then each
    layer × expert share at the last evaluation of the first run that has them, as a heatmap."""
    have = [run for run in runs if any("expert_share" in r for r in run.evals)]
    if not have:
        return None
    fig, (shares, heat) = plt.subplots(1, 2, figsize=(11, 3.8))
    for colour, run in _coloured(have):
        shares.plot(*_xy(run.evals, "expert_share_max"), color=colour, marker="o", label=f"{run.name}: max")
        shares.plot(*_xy(run.evals, "expert_share_min"), color=colour, marker="v", ls="--", label=f"{run.name}: min")
        shares.plot(*_xy(run.evals, "expert_entropy"), color=colour, ls=":", label=f"{run.name}: entropy")
    last = [r for r in have[0].evals if "expert_share" in r][-1]
    table = last["expert_share"]
    shares.axhline(1 / len(table["share"][0]), color="grey", lw=0.8, label="even share")
    shares.set(xlabel="iteration", ylabel="share of assignments", title="expert load at evaluation")
    shares.legend(fontsize=7)
    image = heat.imshow(table["share"], aspect="auto", cmap="viridis", vmin=0)
    heat.set_yticks(range(len(table["layers"])), [str(i) for i in table["layers"]], fontsize=7)
    heat.set(xlabel="expert", ylabel="layer", title=f"share per layer and expert, iteration {last['step']}"
             + (f" ({have[0].name})" if len(runs) > 1 else ""))
    fig.colorbar(image, ax=heat)
    return _done(fig)


# ---------------------------------------------------------------------------------------------------- helpers
def _parts(row: dict) -> dict[str, float]:
    ranks = row["ranks"]
    parts = {key: ranks[key]["median"] for key, _ in PARTS if key in ranks}
    if "comm" in parts and "dtb" in parts:  # the wait is a part of backward's time: shown once, beside it
        parts["dtb"] = max(0.0, parts["dtb"] - parts["comm"])
    parts["other"] = max(0.0, ranks["dt"]["median"] - sum(parts.values()))
    return parts


def _losses(runs: list[Run], x_of: Callable[[Run, list[dict]], list[float]], xlabel: str) -> Figure | None:
    if not any(r.steps or r.evals for r in runs):
        return None
    fig, ax = plt.subplots(figsize=(11, 3.8))
    for colour, run in _coloured(runs):
        if run.steps:
            ax.plot(x_of(run, run.steps), [r["loss"] for r in run.steps], color=colour, alpha=0.6,
                    label=f"{run.name}: train")
        evals = [r for r in run.evals if r.get("val_loss") is not None]
        if evals:
            ax.plot(x_of(run, evals), [r["val_loss"] for r in evals], color=colour, marker="o",
                    label=f"{run.name}: val")
    ax.set(xlabel=xlabel, ylabel="loss", title=f"loss by {xlabel.split(' (')[0]}")
    ax.legend(fontsize=7)
    return _done(fig)


def _line(runs: list[Run], key: str, title: str, log: bool = False) -> Figure | None:
    if not any(key in r for run in runs for r in run.steps):
        return None
    fig, ax = plt.subplots(figsize=(5.4, 3.4))
    for colour, run in _coloured(runs):
        ax.plot(*_xy(run.steps, key), color=colour, label=run.name)
    ax.set(xlabel="iteration", title=title, yscale="log" if log else "linear")
    return _done(fig)


def _xy(rows: list[dict], key: str) -> tuple[list, list]:
    have = [r for r in rows if r.get(key) is not None]
    return [r["step"] for r in have], [r[key] for r in have]


def _coloured(runs: list[Run]):
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return [(colours[i % len(colours)], run) for i, run in enumerate(runs)]


def _done(fig: Figure) -> Figure:
    fig.tight_layout()
    return fig
