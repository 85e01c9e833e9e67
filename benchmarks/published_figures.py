"""Published training figures a cost model can be checked against, read from data/published_figures.yaml (each run
with its source, the line it was read from, and the configuration it was measured in; the file's header says what
every key means and where a source was ambiguous). benchmarks/plan_published.py compares them with the planner.

    from published_figures import load
    runs = load()            # checked: one PublishedFiguresError naming the run and the key for anything off
"""

from __future__ import annotations

from pathlib import Path

import yaml

FILE = Path(__file__).with_name("data") / "published_figures.yaml"

REQUIRED = {"id": str, "what": str, "source": str, "system": str, "gpus": int, "gpus_per_node": int, "model": dict,
            "layout": dict, "figures": dict, "quote": str}
OPTIONAL = {"notes": str}
MODEL_KINDS = ("gpt", "llama", "vit")
BACKENDS = ("ddp", "zero1", "fsdp")  # plain data parallel, a sharded optimizer, FSDP
DTYPES = ("fp32", "tf32", "fp16", "bf16", "bf16+float8", "mixed16")
LAYOUT = {"backend": str, "tp": int, "pp": int, "cp": int, "sequence_parallel": bool, "activation_checkpointing":
          (str, type(None)), "micro_batch": (int, type(None)), "global_batch": int, "dtype": str}
LAYOUT_OPTIONAL = {"dp": int, "compile": bool, "fused_optimizer": bool, "data_loader": str, "pp_schedule": str,
                   "overlap": str, "grad_accum": int, "async_tp": bool, "parallel_order": str, "iterations": int}
FIGURES = ("samples_per_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "aggregate_pflops", "mfu",
           "memory_gib_per_gpu", "memory_gib_before_training", "iter_time_s", "iter_time_s_without_compile",
           "train_days")


class PublishedFiguresError(ValueError):
    """A run in the published-figures file that does not fit its schema."""


def load(path: Path = FILE) -> list[dict]:
    """Every run of the file, checked against the schema above."""
    try:
        runs = yaml.safe_load(path.read_text())["runs"]
    except (OSError, yaml.YAMLError, KeyError, TypeError) as e:
        raise PublishedFiguresError(f"{path}: cannot read its `runs` list ({e}); it is a YAML file with one") from None
    seen = set()
    for index, run in enumerate(runs):
        name = run.get("id", f"run {index}") if isinstance(run, dict) else f"run {index}"
        check(run, name)
        if run["id"] in seen:
            raise PublishedFiguresError(f"{path}: {name}: the id appears twice")
        seen.add(run["id"])
    return runs


def check(run, name: str) -> None:
    """Raise PublishedFiguresError naming `name` and the key, if `run` does not fit the schema."""
    def fail(what: str):
        raise PublishedFiguresError(f"published run {name}: {what}")

    if not isinstance(run, dict):
        fail("is not a mapping of keys")
    _keys(run, REQUIRED, OPTIONAL, "", fail)
    _keys(run["layout"], LAYOUT, LAYOUT_OPTIONAL, "layout.", fail)
    if run["gpus"] < 1 or run["gpus_per_node"] < 1:
        fail("gpus and gpus_per_node must be at least 1")
    if run["model"].get("kind") not in MODEL_KINDS:
        fail(f"model.kind={run['model'].get('kind')!r}: one of {', '.join(MODEL_KINDS)}")
    layout = run["layout"]
    if layout["backend"] not in BACKENDS or layout["dtype"] not in DTYPES:
        fail(f"layout.backend={layout['backend']!r} / layout.dtype={layout['dtype']!r}: backends "
             f"{', '.join(BACKENDS)}; dtypes {', '.join(DTYPES)}")
    if not run["figures"]:
        fail("figures is empty: a run is here for a number")
    for key, value in run["figures"].items():
        if key not in FIGURES:
            fail(f"figures.{key}: unknown; figures are {', '.join(FIGURES)}")
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            fail(f"figures.{key}={value!r}: a positive number")
    if run["figures"].get("mfu", 0) > 1:
        fail(f"figures.mfu={run['figures']['mfu']}: a fraction (0.41 for 41%)")


def _keys(mapping: dict, required: dict, optional: dict, prefix: str, fail) -> None:
    for key in required:
        if key not in mapping:
            fail(f"{prefix}{key} is missing")
    for key, value in mapping.items():
        kind = required.get(key, optional.get(key))
        if kind is None:
            fail(f"{prefix}{key}: unknown key; known are {', '.join([*required, *optional])}")
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            fail(f"{prefix}{key}={value!r}: expected {getattr(kind, '__name__', kind)}")


PUBLISHED = load()
