"""The report page: one HTML file that opens with no network (the figures are embedded as PNG data, the style is
inline, there is no script), and the same figures as PNG files beside it."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

from meshtrain.report import plots
from meshtrain.report.runs import Run

STYLE = """body{font-family:sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.2em}td,th{border:1px solid #ccc;padding:.2em .6em;text-align:left;
font-size:.9em}th{background:#f0f0f0}img{max-width:100%;display:block;margin:.4em 0 1.2em}
pre{background:#f7f7f7;padding:.6em;overflow-x:auto;font-size:.8em}h2{border-bottom:1px solid #ccc}"""
SAMPLES_SHOWN = 3


def write_report(runs: list[Run], out: Path) -> Path:
    """out/report.html and out/<figure>.png for `runs`; returns the page's path."""
    out.mkdir(parents=True, exist_ok=True)
    sections = [f"<h1>meshtrain report: {_e(', '.join(r.name for r in runs))}</h1>"]
    if len(runs) > 1:
        sections.append(_section("comparison", _table(["run", "layout", *runs[0].totals()],
                                                      [[r.name, r.facts.get("layout", "-"), *r.totals().values()]
                                                       for r in runs])))
    for run in runs:
        sections.append(_run_header(run, several=len(runs) > 1))
    figures = []
    for name, fig in plots.figures(runs).items():
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=110)
        plots.plt.close(fig)
        (out / f"{name}.png").write_bytes(png.getvalue())
        figures.append(f'<img alt="{name}" src="data:image/png;base64,{base64.b64encode(png.getvalue()).decode()}">')
    sections.append(_section("figures", "\n".join(figures)))
    for run in runs:
        sections.append(_evaluation(run, several=len(runs) > 1))
    page = out / "report.html"
    page.write_text(f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>meshtrain report</title>'
                    f"<style>{STYLE}</style></head><body>\n" + "\n".join(s for s in sections if s) + "\n</body></html>\n")
    return page


def _run_header(run: Run, several: bool) -> str:
    parts = [_table(["", ""], [[k, v] for k, v in run.totals().items()])]
    facts = run.facts
    if facts.get("layout"):
        parts.append(f"<p><b>layout</b>: {_e(facts['layout'])}</p>")
    if facts.get("holds"):
        parts.append(_table(["rank", "parameters MiB", "gradients MiB", "optimizer MiB"],
                            [[rank, *(f"{h[k] / 2**20:.2f}" for k in ("params", "grads", "optimizer"))]
                             for rank, h in enumerate(facts["holds"])]))
    if facts.get("environment"):
        parts.append(_table(["environment", ""], [[k, v] for k, v in facts["environment"].items()]))
    if run.checkpoints:
        parts.append(f"<p><b>checkpoints</b>: {_e(', '.join(run.checkpoints))} in {_e(str(run.path / 'checkpoints'))}"
                     "</p>")
    if run.config:
        parts.append(f"<details><summary>config (resolved)</summary><pre>{_e(run.config)}</pre></details>")
    return _section(run.name if several else f"run {run.name}", "\n".join(parts))


def _evaluation(run: Run, several: bool) -> str:
    """The workload's own evaluation: the latest text samples (a language model), the latest forecast figure."""
    parts = []
    for row in run.texts[-SAMPLES_SHOWN:]:
        parts.append(f"<p>{_e(row.get('tag', 'sample'))} at iteration {row['step']}:</p><pre>{_e(row['text'])}</pre>")
    if run.images:
        latest = run.images[-1]
        image = Path(latest["image"])
        image = image if image.is_absolute() else run.path / image
        if image.is_file():
            data = base64.b64encode(image.read_bytes()).decode()
            parts.append(f"<p>{_e(latest.get('tag', 'image'))} at iteration {latest['step']}:</p>"
                         f'<img alt="{_e(latest.get("tag", "image"))}" src="data:image/png;base64,{data}">')
    title = "evaluation" + (f": {run.name}" if several else "")
    return _section(title, "\n".join(parts)) if parts else ""


def _section(title: str, body: str) -> str:
    return f"<section><h2>{_e(title)}</h2>\n{body}\n</section>"


def _table(header: list, rows: list[list]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _e(value) -> str:
    return html.escape(str(value))
