"""The published figures the planner is checked against are data (benchmarks/data/published_figures.yaml): every run
fits the schema, and a run that does not is refused naming the run and the key."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import yaml
from tests.conftest import REPO


@pytest.fixture(scope="module")
def figures():
    spec = importlib.util.spec_from_file_location("published_figures", REPO / "benchmarks" / "published_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_published_run_fits_the_schema_once(figures):
    runs = figures.load()
    assert len(runs) == 56 and len({r["id"] for r in runs}) == 56
    assert {r["model"]["kind"] for r in runs} == {"gpt", "llama", "vit"}
    sc24 = next(r for r in runs if r["id"] == "nersc-sc24-vit-base-1gpu-baseline")
    assert sc24["figures"] == {"samples_per_s": 8.808822} and "8.808822 samples/sec" in sc24["quote"]
    # a model several runs share is written once in the file and is one object once loaded
    same = [r["model"] for r in runs if r["model"].get("embed_dim") == 384 and r["model"]["kind"] == "vit"]
    assert len(same) > 1 and all(m is same[0] for m in same)


@pytest.mark.parametrize(("change", "message"), [
    (lambda r: r["figures"].update(mfu=41.0), "figures.mfu=41.0: a fraction"),
    (lambda r: r["figures"].update(tokens=3.0), "figures.tokens: unknown"),
    (lambda r: r.pop("quote"), "quote is missing"),
    (lambda r: r["layout"].update(backend="megatron"), "layout.backend='megatron'"),
    (lambda r: r["layout"].update(tp="2"), "layout.tp='2': expected int"),
    (lambda r: r.update(gpu=4), "gpu: unknown key"),
])
def test_a_run_off_the_schema_is_refused_by_name(figures, tmp_path, change, message):
    data = yaml.safe_load(figures.FILE.read_text())
    run = copy.deepcopy(data["runs"][3])
    change(run)
    data["runs"][3] = run
    broken = tmp_path / "figures.yaml"
    broken.write_text(yaml.safe_dump(data))
    with pytest.raises(figures.PublishedFiguresError, match=f"published run {run.get('id')}: .*") as error:
        figures.load(broken)
    assert message in str(error.value)
