"""The fixed costs of each kind of layout on this machine: what a step costs beyond the arithmetic and the bytes the
cost model counts (operator and DTensor dispatch, FSDP's and DDP's hooks and copies, the pipeline's scheduling),
measured by training the model made tiny (its ModelSpec's `tiny` overrides, e.g. a language model of width 32, 16
tokens, batch 4: next to no arithmetic) at two depths under each kind, on as many ranks as the plan is
for, less what the model predicts for that run without fixed costs (its matmuls, its attention kernel, its
collectives' measured times, latency included).

    kind                      measured as                       cost added to a layout of that kind
    backend:ddp|zero1|...     that backend over all ranks       per block and micro-step, and per step
    tp:N                      fsdp with tp=N                    the difference from fsdp alone
    cp:ring | cp:ulysses      ddp with cp=2                     the difference from ddp alone
    pp:1f1b | pp:gpipe | ...  ddp with pp=2
    ep:N                      ddp with ep=N                     the difference from ddp alone (dispatch and combine:
                              (at least N experts)              index arithmetic, host reads, all-to-all waits)

Before them, the collectives' times on these ranks are recorded where the machine profile has none
(`meshtrain collectives --bench --record`), so that what is left as fixed cost is not a link the model assumed.
Each kind is measured in the dtype the plan runs in (train.dtype=bf16 adds autocast's casts to every op), and
cached under that name ("bf16:backend:ddp"). Two depths (4 and 8 blocks) separate the cost per block from the
cost per step. The tiny models are never a size `plan --validate` scores: the costs are fitted on them and
scored on the layouts' own sizes. Results are cached in the machine profile (~/.cache/meshtrain/machine.json,
"plan_fixed") under this device, thread count, torch, rank count and tiny model.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

import meshtrain
from meshtrain import config as config_mod
from meshtrain import registry
from meshtrain.data.prepare_text import prepare
from meshtrain.errors import MeshtrainError
from meshtrain.machine import profile
from meshtrain.machine.hardware import describe
from meshtrain.parallel import backends
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.plan.cost import fixed_kind, fixed_kinds, predict
from meshtrain.plan.measured import measure
from meshtrain.plan.measured.fixed_costs import (
    SLOWDOWN_REFERENCE,
    cached,
    cached_slowdown,
    calibrated,
    key,
    slowdown_key,
)
from meshtrain.plan.measured.this_machine import recorded_collectives, this_machine
from meshtrain.plan.workload import ModelFacts
from meshtrain.runtime import heartbeat
from meshtrain.runtime.device import pick_device
from meshtrain.runtime.results import first_error, run_ranks

DEPTHS = (4, 8)
# Mostly arithmetic (SLOWDOWN_REFERENCE's), for the slowdown of ranks sharing cores; neither a tiny size nor a
# scored one.
COMPUTE = ["model.n_embd=192", "model.n_head=4", "model.block_size=48", "model.batch_size=8", "model.n_layer=4",
           "model.dropout=0.0", "train.grad_accum=1", "parallel.microbatches=null", "train.backend=ddp"]
KINDS = {  # kind -> (layout overrides on the tiny model, the kind it is measured against)
    **{backends.get(name).kind: ([f"train.backend={name}", *backends.get(name).calibrate_with], None)
       for name in backends.names(planned=True)},
    # cp against ddp, whose own cost is the smallest (the difference of two noisy FSDP runs is noisier); tp (in
    # runs_of, at each size) against fsdp, as DDP does not replicate tensor-parallel parameters
    "cp:ring": (["train.backend=ddp", "parallel.cp=2", "parallel.cp_impl=ring"], "backend:ddp"),
    "cp:ulysses": (["train.backend=ddp", "parallel.cp=2", "parallel.cp_impl=ulysses"], "backend:ddp"),
    "pp:1f1b": (["train.backend=ddp", "parallel.pp=2", "parallel.pp_schedule=1f1b"], "backend:ddp"),
    "pp:gpipe": (["train.backend=ddp", "parallel.pp=2", "parallel.pp_schedule=gpipe"], "backend:ddp"),
    "pp:interleaved_1f1b": (["train.backend=ddp", "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
                             "parallel.virtual_stages=2"], "backend:ddp"),
}


def runs_of(kind: str, model: str) -> tuple[list[str], str | None]:
    """(the tiny model's layout overrides, the kind it is measured against) for `kind`. Tensor parallel is measured
    at the size the layout uses ("tp:4"): its collectives and their waits grow with the group, and a tiny model
    gets as many heads as ranks so that it can be split."""
    if kind.startswith("ep:"):  # at its size, like tp: the all-to-all's waits grow with the group
        size, keys = int(kind[3:]), registry.get(model).shape(config_mod.load_config([], model)).keys
        experts = [f"{keys['experts']}={max(8, size)}"] if "experts" in keys else []
        return ["train.backend=ddp", f"parallel.ep={size}", *experts], "backend:ddp"
    if not kind.startswith("tp:"):
        return KINDS[kind]
    size, keys = int(kind[3:]), registry.get(model).shape(config_mod.load_config([], model)).keys
    heads = [f"{keys[k]}={size}" for k in ("heads", "kv_heads") if keys.get(k, "").startswith("model.")]
    return ["train.backend=fsdp", f"parallel.tp={size}", *dict.fromkeys(heads)], "backend:fsdp"


def calibrate(ranks: int, kinds: list[str], model: str, data_root: str | None = None,
              progress=print, dtype: str = "fp32") -> dict[str, list[float]]:
    """[seconds per block and micro-step, seconds per step] of each kind on `ranks` ranks for `model`, measuring
    those not cached (and the kinds they are measured against), and the slowdown of ranks sharing cores. A language
    model is calibrated on the shipped corpus; any other reads `data_root` (e.g. the ViT's prepared ERA5). A model
    whose spec gives no tiny configuration is not calibrated (empty)."""
    # first the collectives: the fixed costs are what is left beyond them (one rank has no collective to time: the
    # cost model prices none). A layout's groups are as large as any divisor of the ranks, and a call of a smaller
    # group costs less (here 2 ranks of 4 sharing 2 cores: 1.9-2.5 ms; all 4: 5.7 ms; 2 ranks alone: 2.2 ms)
    recorded = {world for _, world in recorded_collectives(describe(pick_device(0)), pick_device(0))}
    for group in (size for size in range(2, ranks + 1) if ranks % size == 0 and size not in recorded):
        _record_collectives(group, progress)
    missing = {}  # model -> the kinds to measure
    if calibrated(model):
        wanted = dict.fromkeys(k for kind in kinds for k in (runs_of(kind, model)[1], kind) if k)
        missing[model] = [k for k in wanted if fixed_kind(k, dtype) not in cached(ranks, model)]
    else:
        progress(f"no calibration for the {model} model: its ModelSpec gives no tiny configuration (`tiny`)")
    slowdown = pick_device(0).type == "cpu" and cached_slowdown(ranks, dtype) is None
    if slowdown and fixed_kind("backend:ddp", dtype) not in cached(ranks, SLOWDOWN_REFERENCE):
        # the slowdown is read off the reference's ddp step, beyond ddp's own fixed costs
        missing[SLOWDOWN_REFERENCE] = list(dict.fromkeys(["backend:ddp", *missing.get(SLOWDOWN_REFERENCE, [])]))
    missing = {name: missing_kinds for name, missing_kinds in missing.items() if missing_kinds}
    if missing or slowdown:
        _measure(ranks, missing, slowdown, data_root, progress, dtype)
    return cached(ranks, model) if calibrated(model) else {}


def _measure(ranks: int, missing: dict[str, list[str]], slowdown: bool, data_root: str | None, progress,
             dtype: str) -> None:
    """Every tiny run the `missing` kinds need and, where `slowdown`, the runs that measure it: all in one job (the
    ranks start once), then fitted in the order each rests on the last: the reference's ddp, the slowdown, the rest."""
    with tempfile.TemporaryDirectory(prefix="meshtrain-calibrate-") as root:
        if slowdown or any(registry.get(name).text for name in missing):
            prepare("shakespeare_char", Path(root))  # the shipped corpus, which needs no network
        # a step of ranks sharing cores moves by a quarter between runs here: the median of three, first in the job
        runs = {(SLOWDOWN_REFERENCE, "slowdown", i): _reference_overrides(root, dtype)
                for i in range(3 if slowdown else 0)}
        runs.update({(name, kind, depth): overrides for name, missing_kinds in missing.items()
                     for (kind, depth), overrides in _tiny_runs(name, missing_kinds, root, data_root, dtype).items()})
        what = [f"the fixed costs of {', '.join(fixed_kind(k, dtype) for k in kinds)} ({name})"
                for name, kinds in missing.items()] + ["how much slower ranks sharing cores compute"] * slowdown
        heartbeat.note(phase=f"measuring {' and '.join(what)} on {ranks} ranks ({len(runs)} runs in one job)")
        measured = dict(zip(runs, _step_times(ranks, [(name, o) for (name, _, _), o in runs.items()]), strict=True))
        if slowdown:
            if "backend:ddp" in missing.get(SLOWDOWN_REFERENCE, []):
                _fit(ranks, SLOWDOWN_REFERENCE, ["backend:ddp"], runs, measured, progress, dtype)
            _fit_slowdown(ranks, [measured[key] for key in runs if key[1] == "slowdown"], runs, progress, dtype)
        for name, missing_kinds in missing.items():
            known = cached(ranks, name)
            _fit(ranks, name, [k for k in missing_kinds if fixed_kind(k, dtype) not in known], runs, measured,
                 progress, dtype)


def _tiny_runs(model: str, kinds: list[str], root: str, data_root: str | None,
               dtype: str) -> dict[tuple[str, int], list[str]]:
    """(kind, depth) -> the overrides of `model` made tiny, under that kind's layout, at that depth."""
    spec = registry.get(model)
    if not spec.text and data_root is None:
        raise ValueError(f"calibrating the {model} needs its data: pass data_root")
    depth_key = spec.shape(config_mod.load_config(list(spec.tiny), model)).keys["layers"]
    # a language model on the corpus prepared in `root`, whatever its own default data (the Llama's and the MoE's is
    # GPT-2 BPE Shakespeare, which needs a download)
    corpus = [f"{spec.data_key}=shakespeare_char"] if spec.text else []
    return {(kind, depth): [*spec.tiny, f"data.root={root if spec.text else data_root}", f"{depth_key}={depth}",
                            *corpus, *runs_of(kind, model)[0], f"train.dtype={dtype}"]
            for kind in kinds for depth in DEPTHS}


def _fit(ranks: int, model: str, kinds: list[str], runs: dict, measured: dict, progress, dtype: str) -> None:
    """Each kind's cost per block and per step, beyond the modelled arithmetic and bytes and beyond what it is
    measured against, from its two depths; kept in the machine profile."""
    known, times = cached(ranks, model), {}
    for kind in kinds:
        times[kind] = [measured[model, kind, depth] - _modelled_s(ranks, model, runs[model, kind, depth])
                       for depth in DEPTHS]
        progress(f"fixed costs of {fixed_kind(kind, dtype)} on {ranks} ranks ({model}): "
                 f"{[f'{s * 1e3:.1f} ms' for s in times[kind]]} beyond the modelled arithmetic and bytes at "
                 f"{DEPTHS} blocks")
    for kind in kinds:  # absolute first, then the differences from what each is measured against
        (short, long), base = times[kind], runs_of(kind, model)[1]
        per_block = (long - short) / (DEPTHS[1] - DEPTHS[0])
        per_step = short - DEPTHS[0] * per_block
        if base:
            base_block, base_step = known.get(fixed_kind(base, dtype)) or _absolute(times[base])
            per_block, per_step = per_block - base_block, per_step - base_step
        # no kind saves time: a negative cost is the model over-counting the tiny run (a collective priced at the
        # bench's latency, which ranks waiting for each other at a tiny size do not always pay), or noise; carried
        # over to a layout's own size it took more from it than it had (zero2 with dp 1 predicted at half its time)
        known[fixed_kind(kind, dtype)] = [max(0.0, per_block), max(0.0, per_step)]
    profile.remember("plan_fixed", key(ranks, model), known)


COLLECTIVES = "all_reduce,all_gather,reduce_scatter,all_to_all,broadcast"  # what the cost model prices


def _record_collectives(ranks: int, progress) -> None:
    """`meshtrain collectives --bench --record` on `ranks` ranks: each collective's time by message size on this
    machine, which the cost model reads in place of an assumed link (on a CPU, gloo's latency is hundreds of
    microseconds between ranks that share cores, not the 50 µs a link would take)."""
    progress(f"recording the collectives' times on {ranks} ranks (meshtrain collectives --bench --record)")
    heartbeat.note(phase=f"recording the collectives' times on {ranks} ranks")
    command = Path(meshtrain.__file__).parent / "__main__.py"  # `python -m meshtrain` as torchrun's script
    job = run_ranks(command, ranks, "collectives", "--bench", "--record", "--ops", COLLECTIVES, "--max-bytes", "16M",
                    "--time-per-size", "0.1", timeout=900)
    if job.returncode:
        raise MeshtrainError(f"calibration: the collectives bench on {ranks} ranks failed (exit {job.returncode}): "
                             f"{job.output.strip().splitlines()[-1:]}; run it yourself to see why: "
                             f"torchrun --nproc-per-node {ranks} -m meshtrain collectives --bench --record")


def _fit_slowdown(ranks: int, step_s: list[float], runs: dict, progress, dtype: str) -> float:
    """How many times slower than alone a rank computes while the others do, in training, in `dtype`: a mid-size
    SLOWDOWN_REFERENCE (COMPUTE, mostly arithmetic) under ddp, its measured steps (the median) against the model's,
    whose step time is linear in the slowdown (a × slowdown + b, b: its bytes and ddp's fixed costs)."""
    reference, ddp_kind = SLOWDOWN_REFERENCE, fixed_kind("backend:ddp", dtype)
    measured = statistics.median(step_s)
    cfg = config_mod.load_config(runs[reference, "slowdown", 0], reference)
    dims, facts = ParallelDims.from_config(cfg, ranks), ModelFacts.of(cfg)
    machine = replace(this_machine(ranks), fixed={ddp_kind: cached(ranks, reference)[ddp_kind]},
                      slowdown_under_autocast=None)
    one, two = (predict(facts, cfg, dims, replace(machine, slowdown=s)).step_s for s in (1.0, 2.0))
    slowdown = max(1.0, (measured - (2 * one - two)) / (two - one))
    progress(f"ranks sharing cores: {ranks} ranks compute {slowdown:.2f}× slower than one alone in {dtype} (a "
             f"{reference} of {facts.num_params / 1e6:.1f}M parameters under ddp: {measured * 1e3:.1f} ms a step)")
    profile.remember("plan_slowdown", slowdown_key(ranks, dtype), slowdown)
    return slowdown


def _reference_overrides(root: str, dtype: str) -> list[str]:
    """The slowdown's reference run (COMPUTE) in `dtype`, on the shipped corpus prepared in `root`: what calibration
    fits the slowdown on, and what `plan --validate` runs again to see how the machine's speed moved since."""
    return [*COMPUTE, f"data.root={root}", f"train.dtype={dtype}"]


def speed_reference(ranks: int, dtype: str, root: str) -> tuple[str, list[str], float] | None:
    """(model, overrides, predicted step seconds) of the run the slowdown of ranks sharing cores was fitted on
    (COMPUTE, on the corpus prepared now in `root`), as this machine was calibrated; None where it was not. Run again
    beside the layouts `plan --validate` measures, its step against this prediction is how much slower the machine
    is now than when it was calibrated."""
    ddp_kind = fixed_kind("backend:ddp", dtype)
    fixed = cached(ranks, SLOWDOWN_REFERENCE).get(ddp_kind)
    if fixed is None or cached_slowdown(ranks, dtype) is None:
        return None
    prepare("shakespeare_char", Path(root))  # the shipped corpus, which needs no network
    overrides = _reference_overrides(root, dtype)
    cfg = config_mod.load_config(overrides, SLOWDOWN_REFERENCE)
    machine = replace(this_machine(ranks), fixed={ddp_kind: fixed})
    predicted = predict(ModelFacts.of(cfg), cfg, ParallelDims.from_config(cfg, ranks), machine).step_s
    return SLOWDOWN_REFERENCE, overrides, predicted


def _absolute(times: list[float]) -> list[float]:
    per_block = (times[1] - times[0]) / (DEPTHS[1] - DEPTHS[0])
    return [per_block, times[0] - DEPTHS[0] * per_block]


def _modelled_s(ranks: int, model: str, overrides: list[str]) -> float:
    """The step time the cost model gives this run without fixed costs: its arithmetic, its bytes, its bubble."""
    cfg = config_mod.load_config(overrides, model)
    dims = ParallelDims.from_config(cfg, ranks)
    machine = replace(this_machine(ranks, model=model), fixed=dict.fromkeys(fixed_kinds(cfg, dims), [0.0, 0.0]))
    return predict(ModelFacts.of(cfg), cfg, dims, machine).step_s


def _step_times(ranks: int, runs: list[tuple[str, list[str]]]) -> list[float]:
    """The step time of each run (a model and its overrides), measured one after another in one job of `ranks`
    ranks: the slowest rank's median of 8 steps after 3 of warm-up."""
    cases = {f"run {i}": {"model": model, "overrides": overrides} for i, (model, overrides) in enumerate(runs)}
    job = run_ranks(Path(measure.__file__), ranks, runs[0][0], "--cases", json.dumps(cases), "--steps", "8",
                    "--warmup", "3", timeout=120 + 60 * len(runs))
    times = [[fields["step_s"] for result in job.results.values() if (fields := result.get(case))] for case in cases]
    incomplete = [i for i, t in enumerate(times) if len(t) < ranks]  # the runs go in order: the first failed
    if job.returncode or incomplete:
        model, failed = runs[incomplete[0] if incomplete else -1]
        raise MeshtrainError(f"calibration on {ranks} rank(s) failed (exit {job.returncode}) in the run "
                             f"`{' '.join(failed)}`: {first_error(job.output)}; run it yourself to see all: "
                             f"torchrun --nproc-per-node {ranks} -m meshtrain.plan.measured.measure {model} "
                             f"{' '.join(failed)}")
    return [max(t) for t in times]
