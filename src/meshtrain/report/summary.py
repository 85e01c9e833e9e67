"""The few lines `train` ends with: the run's totals and small text plots of its loss and throughput."""

from __future__ import annotations

from meshtrain.report.runs import Run

BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 60) -> str:
    """`values` as one line of block characters, averaged into at most `width` columns, lowest to highest."""
    values = [v for v in values if v is not None]
    if not values:
        return ""
    columns = min(width, len(values))
    means = [sum(chunk) / len(chunk) for chunk in
             (values[i * len(values) // columns:(i + 1) * len(values) // columns] for i in range(columns))]
    low, high = min(means), max(means)
    scale = (len(BARS) - 1) / (high - low) if high > low else 0.0
    return "".join(BARS[round((m - low) * scale)] for m in means)


def summary(run: Run, report: str | None) -> str:
    """The end-of-run summary of `run`; `report`: where its page is, or how to write one."""
    lines = ["summary: " + ", ".join(f"{k} {v}" for k, v in run.totals().items())]
    losses = [r["loss"] for r in run.steps]
    if losses:
        lines.append(f"  loss       {sparkline(losses)}  {losses[0]:.4g} → {losses[-1]:.4g}")
    rates = [r.get(run.rate_key) for r in run.steps][1:]  # the first logged interval holds the warm-up
    if any(rates):
        unit = "tokens/s" if run.rate_key == "tps" else "samples/s"
        lines.append(f"  {unit:<10} {sparkline(rates)}  {min(r for r in rates if r):.4g} to "
                     f"{max(r for r in rates if r):.4g}")
    lines.append(f"  report: {report}")
    return "\n".join(lines)
