"""The data-parallel backends are rows of one registry (parallel/backends/): config, the mesh checks, the planner's
search and cost model and the calibration kinds follow a row, and nothing else in meshtrain names a backend."""

from __future__ import annotations

import dataclasses
import re

import pytest
from tests.conftest import REPO

from meshtrain.config import ConfigError, load_config
from meshtrain.parallel import backends
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.plan import machines, search, systems
from meshtrain.plan.cost import kinds_of, predict
from meshtrain.plan.measured import calibrate
from meshtrain.plan.workload import ModelFacts

GPT = ["preset=cpu", "data.root=/nonexistent"]  # the planner builds the model on the meta device: no data read


@pytest.fixture
def zero2_twin(monkeypatch):
    """One new row, a copy of zero2 under another name: all a backend of an existing family needs."""
    twin = dataclasses.replace(backends.get("zero2"), name="zero2_twin")
    monkeypatch.setitem(backends.REGISTRY, twin.name, twin)
    monkeypatch.setitem(calibrate.KINDS, twin.kind, ([f"train.backend={twin.name}"], None))
    return twin


def test_a_new_row_is_a_backend_everywhere(zero2_twin):
    facts = ModelFacts.of(load_config(GPT, "gpt"), {"meta": {"vocab_size": 65}})
    machine = machines.from_system(systems.get("polaris"))
    costs = {}
    for name in ("zero2", zero2_twin.name):
        cfg = load_config([*GPT, f"train.backend={name}"], "gpt")  # config accepts it
        dims = ParallelDims.from_config(cfg, 4, 4)  # the mesh checks take it
        cost = predict(facts, cfg, dims, machine)
        costs[name] = (cost.peak_bytes, cost.step_s, cost.comm_bytes)
        assert kinds_of(cfg, dims) == [f"backend:{name}"]
    assert costs["zero2"] == costs[zero2_twin.name]  # the cost model reads the row, not the name
    planned = {c.train.backend for c in search.layouts(load_config(GPT, "gpt"), 4)}
    assert planned == set(backends.names(planned=True)) and zero2_twin.name in planned


def test_what_a_backend_does_not_compose_with_is_refused_by_its_row(zero2_twin, monkeypatch):
    alone = dataclasses.replace(zero2_twin, composes_with=frozenset(), alone_because="it shards alone")
    monkeypatch.setitem(backends.REGISTRY, alone.name, alone)
    with pytest.raises(ConfigError, match=r"train.backend=zero2_twin with tp=1 cp=1 pp=2: it shards alone"):
        load_config([*GPT, f"train.backend={alone.name}", "parallel.pp=2"], "gpt")


def test_no_module_outside_the_registry_names_a_backend():
    names = "|".join(backends.REGISTRY)
    pattern = re.compile(rf"""(==|!=|\bin)\s*[(\[{{]?\s*["']({names})["']|["']({names})["']\s*(==|!=|\bin\b)""")
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
             for path in (REPO / "src" / "meshtrain").rglob("*.py") if "backends" not in path.parts
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "backend names compared outside parallel/backends/:\n" + "\n".join(found)
