"""One layout traced at full size in this one process (`meshtrain plan ... --trace ROW`): a rank of a world of any size,
built and stepped by meshtrain's own code (the model's build_model and build_layout, the trainer's optimizer, the
layout's micro-step and optimizer step, as train/trainer.py calls them), on torch's fake process group (every
collective returns at once, moving no data) with fake tensors (sizes and dtypes, no storage). What is counted:

    params, grads, optimizer   the rank's shares after its step (parallel.data_parallel.bytes_held, as measured)
    peak                       the most bytes of tensor storages alive at once during the second step (the first
                               makes AdamW's state, which a steady step holds throughout), counted as measure.py's
                               TensorBytes counts real ones, and the part of the step it falls in

Each distinct rank role is traced (rank 0; under a pipeline rank 0 of the first, a middle and the last stage, each
stepped through torch's own schedule), each in a fork of this process; a mixture of experts routes balanced
(balanced_routing.py). Nothing is timed: a fake collective takes no time and a fake op does no arithmetic. The ops
are CPU ops whatever the system planned for (attention is the CPU kernel's); torchtitan's dry run (a fake backend)
and torch's MemTracker under FakeTensorMode rest on the same two pieces.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import resource
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from unittest import mock

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel import distributed as ddp_module
from torch.utils._python_dispatch import _disable_current_modes

from meshtrain import config as config_mod
from meshtrain import registry
from meshtrain.parallel import pipeline as pipeline_module
from meshtrain.parallel.data_parallel import bytes_held
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.plan.activations import fsdp_mixed
from meshtrain.plan.measured.balanced_routing import balanced_routing
from meshtrain.plan.measured.measure import TensorBytes
from meshtrain.plan.systems import PlanError
from meshtrain.plan.workload import ModelFacts
from meshtrain.train.optim import build_optimizer
from meshtrain.train.trainer import AUTOCAST

# What the trace can build today; the rest is refused with this list rather than traced wrongly.
BACKENDS = ("ddp", "zero1", "fsdp", "zero2", "hsdp")
SUPPORTED = (f"train.backend {', '.join(BACKENDS)}, with tensor, context, pipeline and expert parallelism (experts "
             "routed balanced), in fp32 or bf16, without float8, compile or CPU offload")
STATES = ("params", "grads", "optimizer")
PHASES = {"dtf": "forward", "dtb": "backward", "dtfb": "forward+backward"}


@dataclass
class Traced:
    """One rank's figures from a trace (bytes) and what the trace took."""

    rank: int
    stage: int  # its pp rank (0 without a pipeline): the planner prices each stage's rank 0
    held: dict[str, int]  # params, grads, optimizer
    peak: int
    peak_phase: str  # forward | backward | optimizer
    phase_peaks: dict[str, int] = field(default_factory=dict)  # the most alive in each part of the step
    seconds: float = 0.0
    max_rss: int = 0  # this process's largest resident set so far, bytes: fake tensors take none


class PhaseBytes(TensorBytes):
    """TensorBytes over fake tensors, which also says in which part of the step (forward, backward, optimizer)
    the peak falls, and the most alive in each part."""

    counted = FakeTensor

    def __init__(self):
        super().__init__()
        # "data": outside the three parts (where the batch is made, and between micro-steps)
        self.phase, self.peak_phase, self.phase_peaks = "data", "data", {}

    @contextlib.contextmanager
    def during(self, phase: str):
        before, self.phase = self.phase, phase
        self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), self.alive)
        try:
            yield
        finally:
            self.phase = before

    def mark(self) -> None:
        super().mark()
        self.peak_phase, self.phase_peaks = self.phase, {}

    def _add(self, nbytes: int) -> None:
        super()._add(nbytes)
        if nbytes > 0 and self.alive == self.peak_bytes:
            self.peak_phase = self.phase
        self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), self.alive)


def check_traceable(cfg, dims) -> None:
    """One clear error for a layout the trace cannot build yet, naming what it can."""
    t, p = cfg.train, cfg.parallel
    unsupported = [why for why, bad in (
        (f"train.backend={t.backend}", t.backend not in BACKENDS),
        (f"train.dtype={t.dtype}", t.dtype not in ("fp32", "bf16")),
        (f"train.float8={t.float8}", t.float8 != "off"), (f"train.compile={t.compile}", t.compile != "off"),
        ("parallel.cpu_offload", p.cpu_offload)) if bad]
    if unsupported:
        raise PlanError(f"--trace cannot trace {', '.join(unsupported)} yet; it traces {SUPPORTED}")
    if registry.spec_of(cfg).build_layout is None:
        raise PlanError(f"--trace: model {registry.spec_of(cfg).name!r} gives no build_layout in its ModelSpec")


def traced_ranks(dims) -> list[int]:
    """The ranks whose roles differ in what they hold: rank 0 of the first, a middle and the last pipeline stage
    (each holds its own blocks, the embedding or the head, and its schedule keeps its own count of micro-batches in
    flight: 1F1B's first stage the most, the last the fewest; a middle stage stands for the others), or rank 0 alone
    without a pipeline, where every rank holds alike (rank 0 holds FSDP2's largest shards, as the planner predicts)."""
    coords = {dim: 0 for dim in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
    return sorted({dims.rank_of(coords | {"pp": stage}) for stage in (0, dims.pp // 2, dims.pp - 1)})


def trace(cfg, dims) -> list[Traced]:
    """Each distinct rank role of `cfg`'s layout `dims` (a checked plan candidate's), each traced in a fork of this
    process."""
    check_traceable(cfg, dims)
    return [_forked(trace_rank, cfg, dims, rank) for rank in traced_ranks(dims)]


def _forked(fn, *args):
    """fn(*args) in a fork of this process, which has torch imported already (a fork takes milliseconds): a trace
    leaves state behind that the next would meet, DTensor's caches of sharding plans among it, keyed by meshes that
    compare equal across process groups (one rank's tp mesh is another's): a second trace reused the first's specs,
    naming groups destroyed since. What the fork returns or raises comes back pickled."""
    sys.stdout.flush()
    sys.stderr.flush()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read)
        _forget_process_groups()
        try:
            result = (True, fn(*args))
        except BaseException as e:  # noqa: BLE001 (re-raised in the parent)
            result = (False, e if _picklable(e) else RuntimeError("".join(traceback.format_exception(e))))
        with os.fdopen(write, "wb") as out:
            pickle.dump(result, out)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        data = answer.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        raise RuntimeError(f"the trace's fork ended with status {status} and no answer")
    ok, value = pickle.loads(data)
    if not ok:
        raise value
    return value


def _forget_process_groups() -> None:
    """In a fork of a running job (parallel.plan=auto traces on rank 0): the job's process groups left to the parent,
    never destroyed here (their sockets are the parent's; the fork ends without cleaning up), so that the trace can
    start a fake world of its own."""
    from torch.distributed import distributed_c10d

    if dist.is_initialized():  # the parent's world kept referenced: its groups' destructors would join threads
        _PARENT_WORLDS.append(distributed_c10d._world)  # that a fork does not have (and abort)
        distributed_c10d._world = distributed_c10d._World()


_PARENT_WORLDS: list = []


def _picklable(value) -> bool:
    try:
        pickle.loads(pickle.dumps(value))
        return True
    except Exception:  # noqa: BLE001
        return False


def trace_rank(cfg, dims, rank: int) -> Traced:
    """Rank `rank`'s share, built and stepped twice on a fake process group of dims.world_size ranks."""
    started = time.perf_counter()
    # torch 2.13 gives the fake backend a store of its own (torch.testing's FakeStore) when given none
    dist.init_process_group("fake", rank=rank, world_size=dims.world_size)
    try:
        mesh = dims.build_mesh("cpu") if dims.world_size > 1 else None  # real: its rank map is read as data
        # non-fake inputs allowed: the mesh's real rank maps meet the fake tensors in DTensor's and FSDP2's set-up
        with _fake_ddp(), _fake_pipeline(cfg, dims), _real_meshes(), _fused_attention(), \
                FakeTensorMode(allow_non_fake_inputs=True), balanced_routing(), PhaseBytes() as tracker, \
                _stage_phases(tracker):
            layout, optimizer = _build(cfg, dims, mesh, rank)
            _step(cfg, layout, optimizer, tracker, micro_steps=1)  # makes AdamW's state
            tracker.mark()
            _step(cfg, layout, optimizer, tracker, micro_steps=min(cfg.train.grad_accum, 2), keep_grads=True)
            held = bytes_held(layout.model, optimizer)
    finally:
        dist.destroy_process_group()
    return Traced(rank=rank, stage=dims.coords(rank)["pp"], held=held, peak=tracker.peak(),
                  peak_phase=tracker.peak_phase,
                  phase_peaks=dict(tracker.phase_peaks), seconds=time.perf_counter() - started,
                  max_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


@contextlib.contextmanager
def _fake_ddp():
    """DDP's constructor checks every rank's parameter shapes and broadcasts rank 0's weights through data it reads
    on the host; a fake tensor has none, and the fake group returns no data, so both are skipped (every rank builds
    the same model from the same seed: there is nothing to check or copy)."""
    with mock.patch.object(ddp_module, "_verify_param_shape_across_processes", lambda *a, **k: None), \
            mock.patch.object(ddp_module, "_sync_module_states", lambda *a, **k: None):
        yield


@contextlib.contextmanager
def _fake_pipeline(cfg, dims):
    """What a pipeline's ranks tell each other as data, told here without a message (a fake group returns none):
    the embedding group ({first-stage rank, last-stage rank}: agreed by an all_gather_object) made from this rank's
    own pair; torch's start-up vote on static or dynamic shapes (always dynamic: meshtrain gives no static shapes);
    and the metadata of the tensors a stage receives, which a neighbouring rank sends pickled: forward, the
    previous stage's output, a micro-batch's hidden states [samples, tokens / cp, width] in the dtype the blocks
    compute their stream in (16-bit under FSDP2's mixed precision, fp32 otherwise, as autocast leaves the stream);
    backward, the gradient of this stage's own output, whose metadata torch already holds."""
    from torch.distributed.pipelining import schedules, stage
    from torch.distributed.pipelining._utils import (
        InferenceMode,
        _derive_grad_metas,
        _StageBackwardMeta,
        _StageForwardMeta,
        extract_tensor_meta,
    )

    facts = ModelFacts.of(cfg)
    microbatches = cfg.parallel.microbatches or dims.pp * cfg.parallel.virtual_stages
    shape = (facts.batch_size // microbatches, facts.tokens // dims.cp, facts.shape.width)
    dtype = AUTOCAST[cfg.train.dtype] if fsdp_mixed(cfg, dims) else torch.float32

    def own_group(pair):
        if pair is None:
            return None
        with _disable_current_modes():
            return dist.new_group(list(pair))

    def vote(self, stages, has_backward, p2p_done):
        for one in stages:
            one._inference_mode = InferenceMode.DYNAMIC

    def recv_meta(self, src_stage):
        if src_stage < self.stage_index:
            hidden = torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)
            return _StageForwardMeta(forward_metas=(extract_tensor_meta(hidden),))
        return _StageBackwardMeta(backward_metas=_derive_grad_metas(self._stage_meta.outputs))

    with mock.patch.object(pipeline_module, "_embedding_group", own_group), \
            mock.patch.object(schedules._PipelineSchedule, "_warmup_p2p", vote), \
            mock.patch.object(stage.PipelineStage, "_recv_meta", recv_meta), \
            mock.patch.object(stage.PipelineStage, "_send_meta", lambda *a, **k: None):
        yield


@contextlib.contextmanager
def _stage_phases(tracker: PhaseBytes):
    """A pipeline schedule runs forward and backward in one call, chunk by chunk: each stage's chunk is counted in
    its own part of the step, so that the peak says whether a forward or a backward reached it."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    def counted(method, phase):
        def run(self, *args, **kwargs):
            with tracker.during(phase):
                return method(self, *args, **kwargs)
        return run

    with contextlib.ExitStack() as stack:
        for name, phase in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
                            ("backward_weight_one_chunk", "backward")):
            stack.enter_context(mock.patch.object(_PipelineStageBase, name,
                                                  counted(getattr(_PipelineStageBase, name), phase)))
        yield


@contextlib.contextmanager
def _fused_attention():
    """Attention without its dropout: a CPU's fused (flash) attention takes no dropout, and with dropout torch's SDPA
    falls back to its math path, which keeps every score matrix for the backward (a 6.7B decoder at 4,096 tokens:
    2 GiB a layer). A GPU's fused kernels apply dropout inside and keep none, and the planner counts attention as
    fused: the trace counts it so too (docs/plan.md)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def without_dropout(query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
        return sdpa(query, key, value, attn_mask, 0.0, *args, **kwargs)

    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", without_dropout):
        yield


@contextlib.contextmanager
def _real_meshes():
    """DeviceMeshes made during the trace (FSDP2 joins its dp mesh to tp's) from real tensors: a mesh reads its rank
    map as data, which a fake tensor has not (and the tensors' bytes are not the model's)."""
    init = DeviceMesh.__init__

    def real_init(*args, **kwargs):
        with _disable_current_modes():
            init(*args, **kwargs)

    with mock.patch.object(DeviceMesh, "__init__", real_init):
        yield


def _all_reduce_in_place(group, bucket):
    """DDP's default hook, less what the fake group cannot give: a future holding the reduced bucket (the fake
    all-reduce returns none). The bucket is reduced in place, as the default does, so its bytes are the same."""
    buffer = bucket.buffer()
    dist.all_reduce(buffer, group=group)
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


class _KeepBuckets:
    """DDP's reducer, less the one re-bucketing at the second forward (buckets reordered as the first backward made
    gradients ready): the ranks agree on the order by broadcasting it and reading it back, which a fake group cannot.
    The buckets keep their first order, and their bytes (the gradients' once over) are the same."""

    def __init__(self, reducer):
        self._reducer = reducer

    def __getattr__(self, name):
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        return False


def _build(cfg, dims, mesh, rank: int):
    """The model, its layout and the optimizer, as Trainer._build makes them."""
    spec, t, o = registry.spec_of(cfg), cfg.train, cfg.optimizer
    device = torch.device("cpu")
    model = spec.build_model(cfg, spec.data_facts(cfg))  # on the CPU, as fake tensors: no .to() (it swaps them)
    layout = spec.build_layout(model, cfg, dims, mesh, device, rank)
    for part in layout.parts:
        if isinstance(part, DistributedDataParallel):
            part.register_comm_hook(part.process_group, _all_reduce_in_place)
            part.reducer = _KeepBuckets(part.reducer)
    fused = {} if o.fused is None else {"fused": o.fused}
    optimizer = layout.attach_optimizer(build_optimizer(
        layout.model.configure_optimizer_groups(o.weight_decay), device, t.backend, dims.world_size, lr=o.lr,
        betas=(o.beta1, o.beta2), **fused))
    return layout, optimizer


def _step(cfg, layout, optimizer, tracker: PhaseBytes, micro_steps: int, keep_grads: bool = False) -> None:
    """One iteration as Trainer.step runs it: `micro_steps` micro-steps (the second and later of an accumulation
    hold the same bytes: gradients already there, or kept unreduced, and one micro-batch's activations; so two stand
    for any number, and a fake op still costs ~0.3 ms of Python), the after-backward hooks, the optimizer step, then
    zero_grad (left out of the counted step, whose gradients bytes_held then counts)."""
    t, m = cfg.train, cfg.model
    dtype = AUTOCAST[t.dtype]
    autocast = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for micro in range(micro_steps):
        x = torch.zeros(m.batch_size, m.block_size, dtype=torch.long)
        layout.train_micro_step(x, x, accum=micro_steps, sync=micro == micro_steps - 1, autocast=autocast,
                                scaler=scaler, timer=lambda name: tracker.during(PHASES[name]))
    with tracker.during("optimizer"):
        layout.finish_backward()
        layout.optimizer_step(optimizer, scaler, cfg.optimizer.grad_clip)
    if not keep_grads:
        optimizer.zero_grad(set_to_none=True)


def compare(traced: Traced, predicted: dict[str, float]) -> list[tuple[str, float | None, float | None]]:
    """(term, predicted bytes, traced bytes) for every memory term the planner gives (`--explain`'s), the traced
    figure where the trace measures that term, and each part of the step's most bytes alive."""
    rows = [(k, v, traced.held.get(k) if k in STATES else traced.peak if k == "peak" else None)
            for k, v in predicted.items()]
    rows += [(f"most alive in {phase}", None, float(b)) for phase, b in traced.phase_peaks.items()]
    return rows


def main(argv: list[str] | None = None) -> None:
    """`python -m meshtrain.plan.measured.trace MODEL OVERRIDES... --world W [--per-node G] [--cases JSON]`: the
    traced figures of the layout the overrides set (or of each case's, after them), as JSON, one line per traced rank
    (for tests: traces in a process of their own, which starts and ends process groups)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("model")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--per-node", type=int, default=None)
    parser.add_argument("--cases", type=json.loads, default=None, metavar="JSON", help='{"case": [overrides], ...}')
    args = parser.parse_args(argv)
    per_node = args.per_node or args.world
    for case, own in (args.cases or {"layout": []}).items():
        cfg = config_mod.load_config([*args.overrides, *own], registry.get(args.model).name)
        dims = ParallelDims.from_config(cfg, args.world, per_node)
        for traced in trace(config_mod.with_global_batch(cfg, dims.dp_size), dims):
            print(json.dumps({"case": case, **asdict(traced)}), flush=True)


if __name__ == "__main__":
    main()
