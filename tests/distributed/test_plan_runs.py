"""The planner against real ranks: what it predicts each rank holds is what the ranks hold (exactly), its peak is
near the tensors' own peak, and parallel.plan=auto trains with the layout it picks."""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import replace

import pytest
from tests.conftest import fork_ranks, forked_job, job_end, output, prepare_data

from meshtrain import config as config_mod
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.plan import machines, systems
from meshtrain.plan.cost import predict
from meshtrain.plan.measured import validate
from meshtrain.plan.search import Candidate
from meshtrain.plan.workload import ModelFacts

LAYOUTS = {  # one of each way of holding a model: replicated, sharded, tensor-parallel, pipelined; (ranks, overrides)
    "ddp": (2, ["train.backend=ddp"]),
    "zero1": (2, ["train.backend=zero1"]),
    "fsdp": (2, ["train.backend=fsdp"]),
    "fsdp tp2": (4, ["train.backend=fsdp", "parallel.tp=2"]),  # dp 2 × tp 2: FSDP2 shards over 2
    "ddp tp2": (2, ["train.backend=ddp", "parallel.tp=2"]),  # tp alone: its norms' gradients summed by the step
    "ddp pp2": (2, ["train.backend=ddp", "parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.microbatches=4"]),
    # dp 2 × pp 2: FSDP2 keeps each stage's whole gradients between the schedule's micro-batches
    "fsdp pp2": (4, ["train.backend=fsdp", "parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.microbatches=4"]),
    "ddp op": (2, ["train.backend=ddp", "train.activation_checkpointing=op"]),  # op-level checkpointing's cache
    # ring attention: its backward inside a block holds more than the block's start (plan/backward.ring_point)
    "ddp cp2 ring": (2, ["train.backend=ddp", "parallel.cp=2", "parallel.cp_impl=ring"]),
}
BF16 = ("ddp", "fsdp", "fsdp tp2", "ddp op", "ddp cp2 ring")  # also measured under bf16 autocast
BASE = ["preset=cpu", "model.dropout=0.0", "model.batch_size=8"]
# The ViT's layouts, in the same launches (a case of its own model, measure.py --cases): its fields as the batch,
# the head's whole field; fsdp tp2 gathers the field from sequence-parallel patches. 4 channels of 32 × 64, patches of
# 4 (128 tokens), width 32.
VIT_LAYOUTS = {"vit ddp": (2, ["train.backend=ddp"]),
               "vit fsdp tp2": (4, ["train.backend=fsdp", "parallel.tp=2"])}
VIT = ["preset=tiny", "model.patch_size=4", "model.embed_dim=32", "model.depth=2", "model.num_heads=4",
       "data.crop=[32,64]", "data.batch_size=4"]
RANK_ROWS: dict[tuple[str, str], list[dict]] = {}  # (layout, dtype): what each rank measured (the checks' job)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return prepare_data(tmp_path_factory.mktemp("plan-data"))


@pytest.fixture(scope="module")
def era5_root(tmp_path_factory):
    from meshtrain.data.era5_synthetic import generate

    root = tmp_path_factory.mktemp("plan-era5")
    generate(root, years=[2010, 2011, 2012], samples_per_year=16, grid=(34, 66), channels=4, seed=0)
    return root


def case_of(name: str, data_root, era5_root) -> tuple[str, list[str]]:
    """(model, overrides) of a layout here, its dtype last in the name: a GPT's, or the ViT's (VIT_LAYOUTS)."""
    layout, dtype = name.rsplit(" ", 1)
    if layout in VIT_LAYOUTS:
        return "vit", [*VIT, f"data.root={era5_root}", *VIT_LAYOUTS[layout][1], f"train.dtype={dtype}"]
    return "gpt", [*BASE, f"data.root={data_root}", *LAYOUTS[layout][1], f"train.dtype={dtype}"]


@pytest.fixture(scope="module")
def checks(data_root, era5_root) -> dict[tuple[str, str], validate.Check]:
    """{(layout, dtype): its check}: each layout predicted for CPU ranks and measured here for one step; the cases of
    one size in one job (`measure --cases`: a start-up of the ranks per size, not per case). `plan --validate` gives
    each its own job for the CUDA allocator's cache; on a CPU each case's storages are counted from its own start."""
    from meshtrain.plan.measured import measure

    gpus = machines.from_system(systems.get("polaris"))
    machine = {"fp32": gpus, "bf16": replace(gpus, cpu=True)}  # bf16: as the CPU ranks run it (attention in fp32)
    cases = {(name, dtype): ranks for name, (ranks, _) in {**LAYOUTS, **VIT_LAYOUTS}.items()
             for dtype in ("fp32", "bf16") if dtype == "fp32" or name in BF16}
    found = {}
    for ranks in sorted(set(cases.values())):
        mine = {f"{name} {dtype}": case_of(f"{name} {dtype}", data_root, era5_root)
                for (name, dtype), r in cases.items() if r == ranks}
        job = forked_job(measure.__file__, ranks, "gpt", "--cases", json.dumps(
            {case: {"model": model, "overrides": overrides} for case, (model, overrides) in mine.items()}),
            "--steps", "1", timeout=300)
        assert job.returncode == 0, job_end(job.output)
        for case, (model, overrides) in mine.items():
            cfg = config_mod.load_config(overrides, model)
            dims = ParallelDims.from_config(cfg, ranks, ranks)
            candidate = Candidate(cfg, dims, predict(ModelFacts.of(cfg), cfg, dims, machine[case.split()[-1]]),
                                  fits=True)
            rows = [job.results[rank][case] for rank in range(ranks)]
            RANK_ROWS[tuple(case.rsplit(" ", 1))] = rows
            found[tuple(case.rsplit(" ", 1))] = validate.Check(candidate, validate.measured_of(candidate, rows))
    return found


@pytest.mark.parametrize("name", [*LAYOUTS, *VIT_LAYOUTS])
def test_predicted_bytes_are_what_ranks_hold(checks, name):
    check = checks[name, "fp32"]
    for key in validate.STATES:
        assert round(check.predicted[key]) == check.measured[key], (name, key, check.predicted, check.measured)
    # the planner's promise (docs/plan.md); these four come within 3% on the box that wrote them
    assert abs(check.relative("peak")) <= 0.10, (name, check.predicted["peak"], check.measured["peak"])


@pytest.mark.parametrize("name", ["ddp", "zero1", "fsdp", "fsdp tp2", "ddp tp2"])
def test_the_planner_counts_every_collective_call_of_a_step(checks, name):
    """Each collective call pays its latency, milliseconds on ranks that share cores: the planner counts them as the
    ranks make them, by op (DDP's two buckets, ZeRO-1's broadcast of each parameter, FSDP2's gathers and
    reduce-scatters of each block and the root, sequence parallelism's gathers and reduce-scatters at each sublayer
    and the ends, loss parallelism's sums, the norms' gradients, gradient clipping's sums). gloo runs a
    reduce-scatter as an all-reduce. Before the count was by call, fsdp tp2's 66 calls were priced as 19; and ddp
    tp2 summed each norm's gradient twice, for the norm and again in the optimizer (parallel/clipping.py)."""
    check = checks[name, "fp32"]
    predicted = Counter()
    for op, calls in check.candidate.cost.comm_calls.items():
        predicted["all_reduce" if op == "reduce_scatter" else op] += round(calls)
    assert predicted == Counter(check.measured["calls"]), (name, predicted, check.measured["calls"])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_ring_attentions_peak_inside_a_block_is_the_ranks_peak(checks, dtype):
    """Ring attention's backward holds its K/V blocks, their gradients in flight and its score blocks after the
    block's MLP has freed its activations: the planner's point inside the block, within 3% (1.7% fp32, 0.4% bf16
    on the box that wrote this; 4.5% and 5.2% under without that point)."""
    check = checks["ddp cp2 ring", dtype]
    assert abs(check.relative("peak")) <= 0.03, (dtype, check.predicted["peak"], check.measured["peak"])


@pytest.mark.parametrize("name", BF16)
def test_predicted_peak_under_bf16_autocast_is_the_ranks_peak(checks, name):
    """Under autocast a rank holds what fp32 does not: a 16-bit copy of each weight (DDP) and its own cast of each
    linear's input, or 16-bit gathered weights whose linears share inputs (FSDP2's mixed precision); attention on a
    CPU keeps fp32. Pricing activations at 16 bits, as the planner once did, misses these peaks by 21-29%."""
    check = checks[name, "bf16"]
    assert check.states_exact, (name, check.predicted, check.measured)
    assert abs(check.relative("peak")) <= 0.10, (name, check.predicted["peak"], check.measured["peak"])


def test_a_trace_in_one_process_holds_what_the_ranks_hold(checks, data_root, era5_root):
    """`plan --trace` against the same measured ranks (no launch of its own): each layout it can build, traced in one
    process on a fake process group, holds the ranks' parameters, gradients and optimizer state to the byte, and its
    peak (fake tensors' storages, counted as the ranks count theirs) is within 5% of theirs: 4,240 bytes under (the
    loss's scalars) on the box that wrote this. A measured step's peak can rise when gloo frees a collective's input
    late under load (the ViT's fsdp × tp 2 once held its 128 KiB field too long, 5.9% over, failing CI), so a rank
    reports the least of two steps' peaks (measure.PEAK_STEPS); the traced one does not move. A pipeline's ranks
    each hold a stage of their own: each traced stage against its own rank (GPipe's two stages: 4,176 bytes under)."""
    from tests import preloaded
    from tests.conftest import REPO, clean_env

    traceable = checks  # every layout measured here
    lines, sizes = [], {**LAYOUTS, **VIT_LAYOUTS}
    for ranks in (2, 4):
        cases = {f"{name} {dtype}": dict(zip(("model", "overrides"), case_of(f"{name} {dtype}", data_root, era5_root),
                                             strict=True))
                 for name, dtype in traceable if sizes[name][0] == ranks}
        out = preloaded.run([sys.executable, "-m", "meshtrain.plan.measured.trace", "gpt", "--world", str(ranks),
                             "--cases", json.dumps(cases)], env=clean_env(), cwd=REPO, timeout=240)
        assert out.returncode == 0, output(out)[-3000:]
        lines += [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(traceable) + sum("pp2" in name for name, _ in traceable)  # a pipeline's two stages
    for row in lines:
        measured = RANK_ROWS[tuple(row["case"].rsplit(" ", 1))][row["rank"]]
        assert row["held"] == {k: measured[k] for k in validate.STATES}, (row, measured)
        assert row["peak"] == pytest.approx(measured["peak"], rel=0.05), (row["case"], row["peak"], measured["peak"])


def test_auto_plan_trains_with_the_layout_it_chose(data_root, tmp_path):
    out = fork_ranks(2, "train", "gpt", "preset=cpu", f"data.root={data_root}", f"train.out_dir={tmp_path}",
                   "parallel.plan=auto", "train.max_iters=4", "train.eval_interval=4", "train.eval_iters=1",
                   "train.save_checkpoints=false", timeout=300)
    assert out.returncode == 0, output(out)
    text = out.stdout + out.stderr
    chosen = next((line for line in text.splitlines() if "parallel.plan=auto chose" in line), None)
    assert chosen, output(out)
    backend = chosen.split("chose ")[1].split()[0]
    assert f"layout: {backend} over 2 rank(s)" in text, output(out)
    config = next(tmp_path.glob("gpt/*/*/*/config.yaml")).read_text()
    assert "plan: manual" in config and f"backend: {backend}" in config


def test_a_chunked_loss_holds_one_chunk_of_the_logits_as_predicted(tmp_path):
    """GPT-2's vocabulary on 512 tokens a micro-batch (width 32): the whole-logits loss holds three fp32 [tokens, 50,304]
    tensors where backward starts (train.loss_chunks=off); train.loss_chunks=64 holds one chunk's, beside the gradients its forward
    made. Both peaks as the planner predicts them (fp32 and bf16), the chunked one a third of the whole's or less."""
    from meshtrain.plan.measured import measure

    data_root = prepare_data(tmp_path, "shakespeare")
    base = ["preset=cpu", f"data.root={data_root}", "data.name=shakespeare", "model.dropout=0.0", "model.batch_size=8",
            "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "train.backend=ddp"]
    cases = {"fp32 whole": ["train.dtype=fp32", "train.loss_chunks=off"],
             "fp32 chunks": ["train.dtype=fp32", "train.loss_chunks=64"], "bf16 chunks": ["train.dtype=bf16", "train.loss_chunks=64"]}
    # one warm-up step: the head's matmuls over 50,304 words are most of this test's time (bf16 on an AVX2 CPU)
    job = forked_job(measure.__file__, 2, "gpt", *base, "--cases", json.dumps(cases), "--steps", "1", "--warmup", "1",
                     timeout=300)
    assert job.returncode == 0, job_end(job.output)
    machine = replace(machines.from_system(systems.get("polaris")), cpu=True)  # the ranks: CPUs
    peaks = {}
    for case, overrides in cases.items():
        cfg = config_mod.load_config([*base, *overrides], "gpt")
        dims = ParallelDims.from_config(cfg, 2, 2)
        predicted = predict(ModelFacts.of(cfg), cfg, dims, machine).memory["peak"]
        peaks[case] = max(job.results[rank][case]["peak"] for rank in (0, 1))
        assert peaks[case] == pytest.approx(predicted, rel=0.02), (case, predicted, peaks[case])
    assert peaks["fp32 chunks"] < peaks["fp32 whole"] / 3, peaks


def test_a_mixture_of_experts_holds_and_sends_what_the_planner_counts(data_root):
    """The MoE decoder on 2 ranks, one job: under ddp × ep 2 and fsdp × ep 2 (full checkpointing: its recomputed
    dispatches count too), and under tp 2 (every expert halved by its hidden width, the router whole on both tp
    ranks; with full checkpointing its peak is inside backward, plan/backward.py), pp 2 (each stage its own MoE layers) and cp 2 (each
    rank routing its half of the positions). Each layout's parameters,
    gradients and optimizer state are the planner's exactly (on the first rank of the stage it predicts), the peak
    within 10%, and the bytes the run's dispatch and combine passed to all_to_all in the step (under ep), mean over
    the ranks, are the planner's count to the byte."""
    from meshtrain.plan.measured import measure

    base = ["preset=cpu", f"data.root={data_root}", "model.dropout=0.0", "train.dtype=fp32", "model.batch_size=8"]
    cases = {"ddp ep2": ["train.backend=ddp", "parallel.ep=2"],
             "fsdp ep2 full": ["train.backend=fsdp", "parallel.ep=2", "train.activation_checkpointing=full"],
             "ddp tp2": ["train.backend=ddp", "parallel.tp=2"],
             # the peak inside backward: the experts' gradients made so far beside the block recomputed
             "ddp tp2 full": ["train.backend=ddp", "parallel.tp=2", "train.activation_checkpointing=full"],
             "ddp pp2": ["train.backend=ddp", "parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.microbatches=4"],
             "fsdp cp2": ["train.backend=fsdp", "parallel.cp=2"]}
    job = forked_job(measure.__file__, 2, "moe", *base, "--cases", json.dumps(cases), "--steps", "1", "--warmup", "1",
                     timeout=300)
    assert job.returncode == 0, job_end(job.output)
    machine = replace(machines.from_system(systems.get("polaris")), cpu=True)  # the ranks: CPUs
    for case, overrides in cases.items():
        cfg = config_mod.load_config([*base, *overrides], "moe")
        dims = ParallelDims.from_config(cfg, 2, 2)
        candidate = Candidate(cfg, dims, predict(ModelFacts.of(cfg), cfg, dims, machine), fits=True)
        check = validate.Check(candidate, validate.measured_of(candidate, [job.results[r][case] for r in (0, 1)]))
        assert check.states_exact, (case, check.predicted, check.measured)
        assert abs(check.relative("peak")) <= 0.10, (case, check.predicted["peak"], check.measured["peak"])
        assert check.all_to_all_exact, (case, candidate.cost.comm_bytes, check.measured)  # 0 == 0 without ep
    _trace_matches_the_ranks("moe", base, {k: cases[k] for k in ("ddp ep2", "fsdp ep2 full", "fsdp cp2")}, job)


def _trace_matches_the_ranks(model: str, base: list[str], cases: dict, job) -> None:
    """`plan --trace` of the same MoE layouts (no launch: one process): the states of rank 0 to the byte, the peak
    within 5% of rank 0's, under ep of the mean of the ep ranks' (the trace routes balanced: plan/measured/
    balanced_routing.py; this run's two ranks 23.36 and 25.76 MiB under ddp × ep 2, traced 24.56, their mean)."""
    from tests import preloaded
    from tests.conftest import REPO, clean_env

    out = preloaded.run([sys.executable, "-m", "meshtrain.plan.measured.trace", model, *base, "--world", "2",
                         "--cases", json.dumps(cases)], env=clean_env(), cwd=REPO, timeout=240)
    assert out.returncode == 0, output(out)[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [row["case"] for row in rows] == list(cases)
    for row in rows:
        ranks = [job.results[r][row["case"]] for r in (0, 1)]
        assert row["held"] == {k: ranks[0][k] for k in validate.STATES}, (row, ranks[0])
        expected = sum(r["peak"] for r in ranks) / 2 if "ep2" in row["case"] else ranks[0]["peak"]
        assert row["peak"] == pytest.approx(expected, rel=0.05), (row["case"], row["peak"], expected)
