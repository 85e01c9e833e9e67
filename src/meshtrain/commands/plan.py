"""`meshtrain plan`: which layout should this run use? Every valid layout, its predicted memory and speed, ranked.

    meshtrain plan gpt preset=gpt2 --system polaris --nodes 2                  the 8 GPUs of two Polaris nodes
    meshtrain plan vit preset=mp --system perlmutter --nodes 4 --top 5
    meshtrain plan gpt preset=cpu --system this --gpus-per-node 4 --explain 1  the first row, term by term
    meshtrain plan gpt preset=cpu --system this --gpus-per-node 4 --validate 12   run 12 layouts here and compare
    meshtrain plan gpt preset=gpt2 --system polaris --nodes 4 --trace 1        the first row built in this process
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import TYPE_CHECKING

from meshtrain import config as config_mod
from meshtrain.parallel import backends
from meshtrain.plan import machines, search, systems
from meshtrain.plan.measured import fixed_costs, validate
from meshtrain.plan.measured.auto import TRACED
from meshtrain.plan.measured.this_machine import this_machine
from meshtrain.plan.search import Candidate
from meshtrain.plan.workload import ModelFacts
from meshtrain.runtime.log import configure_logging, get_logger, print_rich
from meshtrain.runtime.progress import said_while_quiet

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig

log = get_logger("plan")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="gpt, vit, llama, or a package.module:SPEC of your own")
    parser.add_argument("overrides", nargs="*", default=[], help="preset=NAME and group.key=value, as for `meshtrain train`")
    parser.add_argument("--system", default="this", help=f"this (measured here), or one of {', '.join(systems.names())}")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=None, help="default: the system's devices per node")
    parser.add_argument("--device-memory", type=float, default=None, help="GiB per device, replacing the system's")
    parser.add_argument("--intra-node-bw", type=float, default=None, help="GB/s per device inside a node")
    parser.add_argument("--inter-node-bw", type=float, default=None, help="GB/s per device between nodes")
    parser.add_argument("--expert-imbalance", type=float, default=None, metavar="X",
                        help="a mixture of experts under ep: the rows the busiest rank's experts receive, as a multiple "
                             "of the balanced N·top_k (default 1.25; capped by the all-tokens-to-one-rank worst case; "
                             "a model.capacity_factor bounds them exactly instead)")
    parser.add_argument("--top", type=int, default=10, help="rows to print (default 10)")
    parser.add_argument("--explain", default=None, help="a row number or layout label: its terms, one by one")
    parser.add_argument("--trace", default=None, metavar="ROW",
                        help="a row number or layout label: build that layout at full size in this one process (a fake "
                             "process group, fake tensors), step it, and print its bytes beside the prediction; "
                             "`all`: the first three rows that fit")
    parser.add_argument("--json", action="store_true", help="every candidate as JSON")
    parser.add_argument("--validate", type=int, default=None, metavar="N",
                        help="run N layouts on this machine (a spread of the ranked ones) and compare")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per layout with --validate")
    parser.add_argument("--repeats", type=int, default=2, help="with --validate: measurements of each layout, "
                        "the layouts interleaved; the spread of their step times is printed beside each error")
    parser.add_argument("--recalibrate", action="store_true",
                        help="with --validate: measure this machine's fixed costs and the slowdown of ranks sharing "
                             "cores again, not the cached ones (a machine's speed drifts)")


def machine_of(args) -> machines.Machine:
    if args.system == "this":
        machine = this_machine(args.gpus_per_node or 1, model=args.model)
    else:
        system = systems.get(args.system)
        if any(v is not None for v in (args.device_memory, args.intra_node_bw, args.inter_node_bw)):
            system = systems.custom(system, device_memory_gib=args.device_memory, intra_node_gbs=args.intra_node_bw,
                                    inter_node_gbs=args.inter_node_bw)
        machine = machines.from_system(system)
    if args.system == "this" and args.device_memory:
        machine.device_memory_bytes = args.device_memory * 2**30
    return machine


def run(args) -> int:
    configure_logging()
    if args.repeats < 1:
        raise systems.PlanError(f"--repeats {args.repeats}: measure each layout at least once (2 shows the spread)")
    if args.recalibrate and not args.validate:
        raise systems.PlanError("--recalibrate measures this machine again for --validate: add --validate N")
    cfg = config_mod.load_config(args.overrides, args.model)
    machine = machine_of(args)
    if cfg.train.dtype == "auto":  # what train.dtype=auto picks there: bf16 on every shipped system
        cfg = replace(cfg, train=replace(cfg.train, dtype="bf16" if args.system != "this" else _auto_dtype()))
    per_node = args.gpus_per_node or machine.devices_per_node
    facts = ModelFacts.of(cfg)
    if args.expert_imbalance is not None:
        if not args.expert_imbalance >= 1:
            raise systems.PlanError(f"--expert-imbalance {args.expert_imbalance}: the busiest rank receives at least "
                                    "the mean, so give 1 or more (1: perfectly balanced routing, 1.25: the default)")
        facts = replace(facts, expert_imbalance=args.expert_imbalance)
    ranked, refused = search.search(cfg, args.nodes, per_node, machine, facts)
    if args.json:
        print(json.dumps([as_dict(c) for c in ranked], indent=1))
        return 0
    where = f"{args.nodes} node(s) × {per_node} on {machine.name}"
    print_rich(table(ranked[:args.top], f"{facts.spec.name}: {facts.num_params / 1e6:.1f}M parameters, "
                                        f"{len(ranked)} valid layouts on {where}"))
    if refused:
        log.info("refused %d layout(s), for these reasons (one example of each):\n%s", sum(refused.values()),
                 "\n".join(f"{n:>5} × {why}" for why, n in refused.most_common()))
    for i, candidate in enumerate(ranked[:3], 1):
        log.info("%d. %s: %s", i, candidate.label, reason(candidate, ranked, machine))
    if ranked:
        log.info("train the first with: meshtrain train %s %s", args.model,
                 " ".join([*args.overrides, *ranked[0].overrides]))
    if args.explain:
        print_rich(explain(pick(ranked, args.explain, "--explain"), machine))
    if args.trace == "all":  # what parallel.plan_trace would trace
        for candidate in [c for c in ranked if c.fits][:TRACED]:
            _trace(candidate, machine, facts)
    elif args.trace:
        _trace(pick(ranked, args.trace, "--trace"), machine, facts)
    if args.validate:
        return _validate(args, cfg, ranked, per_node * args.nodes, facts)
    return 0


def _auto_dtype() -> str:
    from meshtrain.machine.precision import choose
    from meshtrain.runtime.device import pick_device

    return choose("auto", pick_device(0)).dtype


def pick(ranked: list[Candidate], which: str, option: str = "--explain") -> Candidate:
    if which.isdigit() and 1 <= int(which) <= len(ranked):
        return ranked[int(which) - 1]
    found = [c for c in ranked if c.label == which.strip()]
    if not found:
        raise systems.PlanError(f"{option} {which!r}: no such layout; give a row number (1-{len(ranked)}) or a "
                                "label as the table prints it")
    return found[0]


def as_dict(c: Candidate) -> dict:
    return {"layout": c.label, "overrides": c.overrides, "fits": c.fits, "memory_bytes": c.cost.memory,
            "time_s": c.cost.time, "comm_bytes": c.cost.comm_bytes, "samples_per_s": c.throughput,
            "tokens_per_s": c.cost.tokens_per_iteration / c.cost.step_s, "bottleneck": c.cost.bottleneck}


def _mfu(c: Candidate, machine: machines.Machine) -> float:
    label = "bf16" if c.cfg.train.dtype in ("bf16", "fp16") else "fp32"
    peak = machine.peak.get(label) or machine.peak["fp32"]
    return c.cost.flops_per_iteration / c.cost.step_s / (peak * c.dims.world_size)


def table(rows: list[Candidate], title: str):
    from rich.table import Table

    out = Table(title=title, title_justify="left")
    for column in ("#", "layout", "fits", "peak GiB", "step ms", "samples/s", "tokens/s", "bottleneck"):
        out.add_column(column, justify="left" if column in ("layout", "bottleneck") else "right")
    for i, c in enumerate(rows, 1):
        out.add_row(str(i), c.label, "yes" if c.fits else "NO", f"{c.cost.peak_bytes / 2**30:.3f}",
                    f"{c.cost.step_s * 1e3:.1f}", f"{c.throughput:,.1f}",
                    f"{c.cost.tokens_per_iteration / c.cost.step_s:,.0f}", c.cost.bottleneck)
    return out


def explain(c: Candidate, machine: machines.Machine):
    from rich.table import Table

    out = Table(title=f"{c.label}: the terms, rank 0 of the fullest (memory) and slowest (time) pipeline stage",
                title_justify="left")
    for column in ("term", "value"):
        out.add_column(column)
    for key, value in c.cost.memory.items():
        out.add_row(f"memory: {key}", f"{value / 2**20:,.2f} MiB")
    for key, value in c.cost.time.items():
        out.add_row(f"time: {key}", f"{value * 1e3:,.2f} ms")
    for key, value in c.cost.comm_bytes.items():
        out.add_row(f"sent per iteration: {key}", f"{value / 2**20:,.2f} MiB")
    out.add_row("MFU", f"{_mfu(c, machine):.1%}")
    for key, source in machine.sources.items():
        out.add_row(f"source: {key}", source)
    return out


def reason(c: Candidate, ranked: list[Candidate], machine: machines.Machine) -> str:
    """Why this layout, in the terms of the usual advice: DDP when the model fits, sharding when it does not,
    tensor parallel inside a node, pipelines across nodes, context parallel for long sequences."""
    p, t, dims = c.cfg.parallel, c.cfg.train, c.dims
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    plain = next((r for r in ranked if backends.get(r.cfg.train.backend).shards == "nothing"
                  and dims.world_size == r.dims.dp_size and r.cfg.train.activation_checkpointing == "none"), None)
    said = []
    if backends.get(t.backend).all_reduces and dims.dp_size == dims.world_size:
        said.append("the model fits on one device, so data parallelism alone: one gradient all-reduce per step")
    elif plain is not None and not plain.fits:
        said.append(f"plain DDP would need {gib(plain.cost.peak_bytes)} per device (more than "
                    f"{gib(machine.device_memory_bytes)}); {t.backend} holds {gib(c.cost.peak_bytes)}")
    elif plain is not None:
        said.append(f"{c.throughput / plain.throughput:.2f}× plain DDP's throughput")
    if dims.tp > 1:
        said.append(f"tensor parallel over {dims.tp} ranks of one node (its all-reduces per block stay on the fast "
                    "links)")
    if dims.pp > 1:
        said.append(f"pipeline of {dims.pp} stages, the bubble {c.cost.time['bubble'] / c.cost.step_s:.0%} of a step")
    if dims.cp > 1:
        said.append(f"{p.cp_impl} context parallel: {c.cost.tokens_per_iteration // c.cost.samples_per_iteration} "
                    f"tokens per sample split over {dims.cp} ranks")
    if dims.ep > 1:
        nodes = len({r // machine.devices_per_node for r in dims.group_of(0, "ep")})
        said.append(f"experts sharded over {dims.ep} ranks ({'inside a node' if nodes == 1 else f'across {nodes} nodes'}"
                    f"): {c.cost.comm_bytes.get('ep', 0) / 2**20:,.0f} MiB of all-to-all per step, "
                    f"taking {c.cost.time.get('comm ep', 0) / c.cost.step_s:.0%} of the step")
    if t.activation_checkpointing != "none":
        said.append(f"{t.activation_checkpointing} activation checkpointing: recomputes to save activations")
    said.append(f"bound by {c.cost.bottleneck}")
    return "; ".join(said)


def _trace(c: Candidate, machine: machines.Machine, facts: ModelFacts) -> None:
    """Trace `c`'s layout in this process (plan/measured/trace.py) and print its bytes beside the prediction."""
    from meshtrain.plan.cost import stage_memory
    from meshtrain.plan.measured.trace import check_traceable, trace, traced_config

    check_traceable(c.cfg, c.dims)
    log.info("tracing %s: %d ranks on a fake process group, in %s", c.label, c.dims.world_size, c.cfg.train.dtype)
    cfg = traced_config(c.cfg, facts, machine)
    predicted = stage_memory(facts, cfg, c.dims, machine)  # each stage's own terms, beside its traced rank
    on_cpu = None  # the trace runs the CPU's kernels: under autocast its attention and logits' gradient keep fp32
    if cfg.train.dtype != "fp32" and not machine.cpu:
        on_cpu = stage_memory(facts, cfg, c.dims, replace(machine, cpu=True))
    for traced in trace(cfg, c.dims):
        print_rich(trace_table(c, traced, predicted[traced.stage], on_cpu and on_cpu[traced.stage]))
        log.info("rank %d traced in %.1f s (this process's largest resident set: %.0f MiB)", traced.rank,
                 traced.seconds, traced.max_rss / 2**20)


def trace_table(c: Candidate, traced, predicted: dict, on_cpu: dict | None = None):
    """Predicted (the terms of the traced rank's stage) against traced, term by term; `on_cpu`: the prediction for
    CPU kernels too (a 16-bit layout planned for GPUs, traced with the CPU's ops), with the difference from it."""
    from rich.table import Table

    from meshtrain.plan.measured.trace import compare

    stage = f", pipeline stage {traced.stage}" if c.dims.pp > 1 else ""
    out = Table(title=f"{c.label}: predicted / traced, rank {traced.rank}{stage} (peak during {traced.peak_phase})",
                title_justify="left")
    columns = ("term", "predicted MiB", "traced MiB", "difference", *["predicted, CPU kernels", "difference"] * bool(on_cpu))
    for column in columns:
        out.add_column(column, justify="left" if column == "term" else "right")
    mib = lambda v: "—" if v is None else f"{v / 2**20:,.2f}"  # noqa: E731
    differs = lambda p, m: f"{(m - p) / p:+.1%}" if p and m is not None else ""  # noqa: E731
    for term, expected, measured in compare(traced, predicted):
        cpu = [mib(on_cpu.get(term)), differs(on_cpu.get(term), measured)] if on_cpu else []
        out.add_row(term, mib(expected), mib(measured), differs(expected, measured), *cpu)
    return out


def _validate(args, cfg: RunConfig, ranked: list[Candidate], ranks: int, facts: ModelFacts) -> int:
    """Run a spread of the ranked layouts here, and parallel.plan=auto's choice, and print predicted against
    measured, with the dtype they ran in."""
    if args.system != "this":
        raise systems.PlanError("--validate runs layouts on this machine: use --system this")
    log.info("validating in %s (%s)", cfg.train.dtype, "as set" if "train.dtype=" in " ".join(args.overrides)
             else "what train.dtype=auto picks on this machine")
    overrides = [*args.overrides, f"train.dtype={cfg.train.dtype}"]
    if args.recalibrate:
        fixed_costs.forget(ranks, args.model, cfg.train.dtype)
    with said_while_quiet():  # calibration and each layout's run take seconds to minutes: never a silent wait
        checks, auto = validate.validate_plan(args.model, overrides, cfg, ranked, args.validate, args.nodes,
                                              ranks // args.nodes, lambda: machine_of(args), steps=args.steps,
                                              repeats=args.repeats, progress=log.info, facts=facts)
    print_rich(validation_table(checks))
    summary = validate.summary(checks, auto)
    log.info("summary: %s", summary)
    if summary.get("machine_drift"):
        log.info("the machine ran its speed reference %+.1f%% against its calibration: step MdAPE %.1f%%, at the "
                 "measured speed %.1f%% (the model's own error)", 100 * summary["machine_drift"],
                 100 * summary["step_mdape"], 100 * summary["step_mdape_at_measured_speed"])
    log.info("parallel.plan=auto here trains %s: %s", auto.candidate.label,
             f"{summary['auto_regret']:.1%} slower than the fastest measured" if auto.measured else "it failed to run")
    return 0


def validation_table(checks: list[validate.Check], what: str = ""):
    from rich.table import Table

    out = Table(title=f"{what}predicted / measured, rank 0 of the fullest stage", title_justify="left")
    experts = any(c.candidate.dims.ep > 1 for c in checks)  # the all-to-all bytes a step sent, mean per rank
    for column in ("layout", "params MiB", "grads MiB", "optim MiB", "peak MiB", "peak err", "step ms", "step err",
                   "spread", *["a2a bytes"] * experts):
        out.add_column(column, justify="left" if column == "layout" else "right")
    mib = lambda v: f"{v / 2**20:.2f}"  # noqa: E731
    for c in checks:
        if not c.measured:
            out.add_row(c.candidate.label, *["—"] * (8 + experts))
            continue
        p, m = c.predicted, c.measured
        a2a = [f"{c.candidate.cost.comm_bytes.get('ep', 0):,.0f} / {m.get('a2a_bytes', 0):,.0f}"] * experts
        out.add_row(c.candidate.label, *(f"{mib(p[k])} / {mib(m[k])}" for k in validate.STATES),
                    f"{mib(p['peak'])} / {mib(m['peak'])}", f"{c.relative('peak'):+.1%}",
                    f"{p['step_s'] * 1e3:.1f} / {m['step_s'] * 1e3:.1f}", f"{c.relative('step_s'):+.1%}",
                    f"{c.spread:.1%}", *a2a)
    return out
