"""`meshtrain report` on a run directory whose every figure is known: the totals, the page's plots and tables, and
that the page holds everything it shows (no network)."""

from __future__ import annotations

import base64
import json
import re

import pytest

from meshtrain.report.page import write_report
from meshtrain.report.runs import ReportError, read_run
from meshtrain.report.summary import sparkline, summary
from meshtrain.runtime.rundir import write_facts


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": sorted(values)[len(values) // 2], "max": max(values),
            "slowest": values.index(max(values)), "each": values}


def make_run(path, *, steps=4, lr_only=False, val=(4.0, 3.0, 3.5)):
    """A 2-rank GPT-like run: logged steps 10..10·steps, evaluations at 0, 20, 40, a sample, two checkpoints."""
    path.mkdir(parents=True)
    rows = []  # in the order a run writes them: each evaluation after the step row of its iteration
    for i, v in enumerate(val):
        rows.append({"step": 20 * i, "time": 1000.0 + 20 * i + 0.5, "train_loss": v + 0.1, "val_loss": v})
    rows.append({"step": 20, "time": 1020.5, "tag": "sample", "text": "What is an LLM? <b>bold</b>"})
    for i in range(1, steps + 1):
        rows.append({"step": 10 * i, "time": 1000.0 + 10 * i, "loss": 5.0 - i, "dt": 0.5, "dtf": 0.1, "dtb": 0.2,
                     "tps": 1000.0 * i, "mfu": 10.0 + i, "lr": 1e-3, "grad_norm": 1.0 / i, "mem_gb": 0.5,
                     "ranks": {"dt": spread([0.5, 0.5]), "dtf": spread([0.1, 0.1]), "dtb": spread([0.2, 0.2]),
                               "data": spread([0.01, 0.05]), "opt": spread([0.02, 0.02]),
                               "lead_in": spread([0.11, 0.15]), "mem_gb": spread([0.5, 0.4 + 0.01 * i])}})
    rows.sort(key=lambda r: r["time"])
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 99, "lo')  # cut short
    (path / "config.yaml").write_text("model:\n  n_layer: 2\n")
    for step in (20, 40):
        (path / "checkpoints" / f"step-{step:07d}").mkdir(parents=True)
    write_facts(path, {"model": "gpt", "layout": "ddp over 2 rank(s) (dp 2)",
                       "holds": [{"params": 2**20, "grads": 2**20, "optimizer": 2**21}] * 2,
                       "environment": {"world_size": 2, "hostname": "node0", "torch_version": "2.13.0"}})
    return path


def test_a_run_reads_back_with_its_totals(tmp_path):
    run = read_run(make_run(tmp_path / "gpt/ddp/2026-11-23/09-00-00"))
    assert run.name == "gpt/ddp/2026-11-23/09-00-00"
    assert [r["step"] for r in run.steps] == [10, 20, 30, 40] and [r["step"] for r in run.evals] == [0, 20, 40]
    assert run.best_val == 3.0 and run.last_step == 40 and run.wall_s == 40.0
    assert run.checkpoints == ["step-0000020", "step-0000040"] and run.facts["layout"].startswith("ddp over 2")
    totals = run.totals()
    assert totals["median tokens/s"] == "2500" and totals["median MFU %"] == "12.5" and totals["checkpoints"] == 2


def test_the_page_holds_every_plot_and_table_and_nothing_from_the_network(tmp_path):
    run = read_run(make_run(tmp_path / "a/b/c/d"))
    page = write_report([run], tmp_path / "out")
    text = page.read_text()
    pngs = sorted(p.stem for p in (tmp_path / "out").glob("*.png"))
    assert pngs == sorted(["loss", "loss_time", "lr", "grad_norm", "throughput", "step_breakdown", "memory",
                           "rank_spread"])  # no skill figure: no forecast evaluated
    assert text.count('src="data:image/png;base64,') == len(pngs)
    assert text.count("<table>") == 3  # totals, what each rank holds, environment
    assert not re.search(r"(src|href)=\"(https?:)?//", text), "everything the page shows is in the page"
    assert "What is an LLM? &lt;b&gt;bold&lt;/b&gt;" in text  # the sample, escaped
    assert "ddp over 2 rank(s) (dp 2)" in text and "n_layer: 2" in text and "step-0000040" in text


def test_several_runs_overlay_and_compare(tmp_path):
    runs = [read_run(make_run(tmp_path / f"r{i}/gpt/ddp/day/t{i}", val=(4.0, 3.0 - i))) for i in range(3)]
    text = write_report(runs, tmp_path / "out").read_text()
    comparison = text.split("<h2>comparison</h2>")[1].split("</section>")[0]
    assert comparison.count("<tr>") == 4  # the header and a row per run
    assert "gpt/ddp/day/t2" in comparison and ">1<" in comparison  # best val of the third run: 3.0 - 2
    assert comparison.count("ddp over 2 rank(s) (dp 2)") == 3  # each run's layout


def test_a_run_still_going_is_reported_as_far_as_it_got(tmp_path):
    path = make_run(tmp_path / "run", steps=1, val=(4.0,))
    (path / "run.json").unlink()
    text = write_report([read_run(path)], tmp_path / "out").read_text()
    assert text.count("<table>") == 1 and "iterations logged</td><td>10<" in text


def test_a_directory_without_metrics_is_named_with_the_fix(tmp_path):
    with pytest.raises(ReportError, match=r"has no metrics.jsonl .* outputs/runs/gpt/ddp/latest"):
        read_run(tmp_path)


def test_sparkline_and_summary():
    assert sparkline([1, 2, 3, 4, 5, 6, 7, 8]) == "▁▂▃▄▅▆▇█"
    assert sparkline([5.0] * 3) == "▁▁▁" and sparkline([]) == ""
    assert len(sparkline(list(range(1000)), width=60)) == 60


def test_summary_names_the_report(tmp_path):
    text = summary(read_run(make_run(tmp_path / "run")), "/x/report.html")
    assert text.startswith("summary: iterations logged 40, wall time 40.0 s, best val loss 3")
    assert "loss       ▁" not in text and "4 → 1" in text and "tokens/s" in text and "report: /x/report.html" in text


def test_a_forecaster_shows_its_skill_and_its_latest_forecast(tmp_path):
    path = make_run(tmp_path / "vit/ddp/day/time")
    (path / "forecasts").mkdir()
    from matplotlib import pyplot as plt

    for step in (20, 40):
        fig, ax = plt.subplots(figsize=(2, 1))
        ax.set_title(f"forecast {step}")
        fig.savefig(path / "forecasts" / f"step{step}.png")
        plt.close(fig)
    rows = [{"step": 20, "time": 1020.7, "val_loss": 2.0, "val_rmse_u10": 1.5, "persistence_rmse_u10": 2.5},
            {"step": 20, "time": 1020.8, "tag": "forecast", "image": "forecasts/step20.png"},
            {"step": 40, "time": 1040.7, "val_loss": 1.0, "val_rmse_u10": 1.2, "persistence_rmse_u10": 2.5},
            {"step": 40, "time": 1040.8, "tag": "forecast", "image": str(path / "forecasts/step40.png")}]
    written = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()[:-1]]  # not the cut
    rows = sorted(written + rows, key=lambda r: r["time"])  # in the order a run writes them
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = read_run(path)
    assert [r["step"] for r in run.steps] == [10, 20, 30, 40] and len(run.images) == 2
    page = write_report([run], tmp_path / "out").read_text()
    assert (tmp_path / "out" / "skill.png").is_file()
    forecast = (path / "forecasts/step40.png").read_bytes()
    assert "forecast at iteration 40" in page and base64.b64encode(forecast).decode() in page  # the latest
