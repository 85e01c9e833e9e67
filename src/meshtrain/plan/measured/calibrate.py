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
    # first the collectives and the slowed arithmetic: the fixed costs are what is left beyond them (one rank has no
    # collective to time: the cost model prices none)
    if ranks > 1 and not any(world == ranks for _, world in recorded_collectives(describe(pick_device(0)),
                                                                               pick_device(0))):
        _record_collectives(ranks, progress)
    if pick_device(0).type == "cpu" and cached_slowdown(ranks, dtype) is None:
        _measure_slowdown(ranks, progress, dtype)
    if not calibrated(model):
        progress(f"no calibration for the {model} model: its ModelSpec gives no tiny configuration (`tiny`)")
        return {}
    known = cached(ranks, model)
    wanted = list(dict.fromkeys(k for kind in kinds for k in (runs_of(kind, model)[1], kind) if k))
    missing = [k for k in wanted if fixed_kind(k, dtype) not in known]
    if missing:
        known = _measure_kinds(ranks, model, missing, data_root, known, progress, dtype)
    return known


def _measure_kinds(ranks: int, model: str, missing: list[str], data_root: str | None, known: dict,
                   progress, dtype: str = "fp32") -> dict[str, list[float]]:
    spec = registry.get(model)
    if not spec.text and data_root is None:
        raise ValueError(f"calibrating the {model} needs its data: pass data_root")
    depth_key = spec.shape(config_mod.load_config(list(spec.tiny), model)).keys["layers"]
    with tempfile.TemporaryDirectory(prefix="meshtrain-calibrate-") as root:
        if spec.text:  # the shipped corpus, which needs no network
            prepare("shakespeare_char", Path(root))
        # a language model on the corpus prepared here, whatever its own default data (the Llama's and the MoE's
        # is GPT-2 BPE Shakespeare, which needs a download)
        corpus = [f"{spec.data_key}=shakespeare_char"] if spec.text else []
        runs = {(kind, depth): [*spec.tiny, f"data.root={root if spec.text else data_root}", f"{depth_key}={depth}",
                                *corpus, *runs_of(kind, model)[0], f"train.dtype={dtype}"]
                for kind in missing for depth in DEPTHS}
        heartbeat.note(phase=f"measuring the fixed costs of {', '.join(fixed_kind(k, dtype) for k in missing)} on "
                             f"{ranks} ranks ({model}, {len(runs)} tiny runs in one job)")
        measured = dict(zip(runs, _step_times(ranks, model, list(runs.values())), strict=True))
    times = {}
    for kind in missing:
        times[kind] = [measured[kind, depth] - _modelled_s(ranks, model, runs[kind, depth]) for depth in DEPTHS]
        progress(f"fixed costs of {fixed_kind(kind, dtype)} on {ranks} ranks ({model}): "
                 f"{[f'{s * 1e3:.1f} ms' for s in times[kind]]} beyond the modelled arithmetic and bytes at "
                 f"{DEPTHS} blocks")
    for kind in missing:  # absolute first, then the differences from what each is measured against
        (short, long), base = times[kind], runs_of(kind, model)[1]
        per_block = (long - short) / (DEPTHS[1] - DEPTHS[0])
        per_step = short - DEPTHS[0] * per_block
        if base:
            base_block, base_step = known.get(fixed_kind(base, dtype)) or _absolute(times[base])
            per_block, per_step = per_block - base_block, per_step - base_step
        known[fixed_kind(kind, dtype)] = [per_block, per_step]
    profile.remember("plan_fixed", key(ranks, model), known)
    return known


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


def _measure_slowdown(ranks: int, progress, dtype: str = "fp32") -> float:
    """How many times slower than alone a rank computes while the others do, in training, in `dtype`: a mid-size
    SLOWDOWN_REFERENCE (COMPUTE, mostly arithmetic) under ddp, its measured step against the model's, whose step
    time is linear in the slowdown (a × slowdown + b, b: its bytes and ddp's fixed costs)."""
    reference, ddp_kind = SLOWDOWN_REFERENCE, fixed_kind("backend:ddp", dtype)
    ddp = cached(ranks, reference).get(ddp_kind) or _measure_kinds(
        ranks, reference, ["backend:ddp"], None, cached(ranks, reference), progress, dtype)[ddp_kind]
    heartbeat.note(phase=f"measuring how much slower {ranks} ranks sharing cores compute")
    with tempfile.TemporaryDirectory(prefix="meshtrain-calibrate-") as root:
        prepare("shakespeare_char", Path(root))
        overrides = [*COMPUTE, f"data.root={root}", f"train.dtype={dtype}"]
        # a step of ranks sharing cores moves by a quarter between runs here: the median of three
        measured = statistics.median(_step_times(ranks, reference, [overrides] * 3))
        cfg = config_mod.load_config(overrides, reference)
        dims, facts = ParallelDims.from_config(cfg, ranks), ModelFacts.of(cfg)
    machine = replace(this_machine(ranks), fixed={ddp_kind: ddp}, slowdown_under_autocast=None)
    one, two = (predict(facts, cfg, dims, replace(machine, slowdown=s)).step_s for s in (1.0, 2.0))
    slowdown = max(1.0, (measured - (2 * one - two)) / (two - one))
    progress(f"ranks sharing cores: {ranks} ranks compute {slowdown:.2f}× slower than one alone in {dtype} (a "
             f"{reference} of {facts.num_params / 1e6:.1f}M parameters under ddp: {measured * 1e3:.1f} ms a step)")
    profile.remember("plan_slowdown", slowdown_key(ranks, dtype), slowdown)
    return slowdown


def _absolute(times: list[float]) -> list[float]:
    per_block = (times[1] - times[0]) / (DEPTHS[1] - DEPTHS[0])
    return [per_block, times[0] - DEPTHS[0] * per_block]


def _modelled_s(ranks: int, model: str, overrides: list[str]) -> float:
    """The step time the cost model gives this run without fixed costs: its arithmetic, its bytes, its bubble."""
    cfg = config_mod.load_config(overrides, model)
    dims = ParallelDims.from_config(cfg, ranks)
    machine = replace(this_machine(ranks, model=model), fixed=dict.fromkeys(fixed_kinds(cfg, dims), [0.0, 0.0]))
    return predict(ModelFacts.of(cfg), cfg, dims, machine).step_s


def _step_times(ranks: int, model: str, runs: list[list[str]]) -> list[float]:
    """The step time of each run (overrides of `model`), measured one after another in one job of `ranks` ranks: the
    slowest rank's median of 8 steps after 3 of warm-up."""
    cases = {f"run {i}": overrides for i, overrides in enumerate(runs)}
    job = run_ranks(Path(measure.__file__), ranks, model, "--cases", json.dumps(cases), "--steps", "8", "--warmup", "3",
                    timeout=120 + 60 * len(runs))
    times = [[fields["step_s"] for result in job.results.values() if (fields := result.get(case))] for case in cases]
    incomplete = [i for i, t in enumerate(times) if len(t) < ranks]  # the runs go in order: the first failed
    if job.returncode or incomplete:
        failed = runs[incomplete[0] if incomplete else -1]
        raise MeshtrainError(f"calibration on {ranks} rank(s) failed (exit {job.returncode}) in the run "
                             f"`{' '.join(failed)}`: {first_error(job.output)}; run it yourself to see all: "
                             f"torchrun --nproc-per-node {ranks} -m meshtrain.plan.measured.measure {model} "
                             f"{' '.join(failed)}")
    return [max(t) for t in times]
