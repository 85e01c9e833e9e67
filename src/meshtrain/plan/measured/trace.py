"""One layout traced at full size in this one process (`meshtrain plan ... --trace ROW`): a rank of a world of any size,
built and stepped by meshtrain's own code (the model's build_model and build_layout, the trainer's optimizer, the
layout's micro-step and optimizer step, as train/trainer.py calls them), on torch's fake process group (every
collective returns at once, moving no data) with fake tensors (sizes and dtypes, no storage), on micro-batches of zeros
shaped as the workload's (the spec's micro_batch: the ViT's fields; else token windows), with stand_ins.py's answers
where a fake tensor or group holds no data. What is counted:

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
import weakref
from dataclasses import asdict, dataclass, field
from unittest import mock

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from meshtrain import config as config_mod
from meshtrain import registry
from meshtrain.models.language import with_loss_chunks
from meshtrain.parallel.data_parallel import bytes_held
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.plan.measured.balanced_routing import balanced_routing
from meshtrain.plan.measured.measure import TensorBytes, case_run
from meshtrain.plan.measured.stand_ins import fake_ddp_parts, stand_ins
from meshtrain.plan.systems import PlanError
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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not torch.ops._c10d_functional.wait_tensor.default:
            return super().__torch_dispatch__(func, types, args, kwargs)
        # A functional collective's wait returns its buffer itself on a real group, but a fake tensor of its own
        # here: the buffer's bytes pass to it, not counted twice (under sequence parallel the ViT's gathered field
        # was, at its forward's peak: +1 field, 9% of that peak)
        out = func(*args, **(kwargs or {}))
        source, storage = args[0].untyped_storage(), out.untyped_storage()
        size = self.sizes.pop(id(source), None) if source is not storage else None
        if size is None:
            self._count(out)
            return out
        key = id(storage)
        self.refs.pop(id(source), None)
        self.sizes[key] = size
        self.refs[key] = weakref.ref(storage, lambda _: self._gone(key))
        return out


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


def traced_config(cfg, facts, machine):
    """The cfg a trace of a layout planned for `machine` builds: the loss in the chunks auto takes on the machine's
    devices (a GPU's are larger than the CPU's whose kernels the trace runs), as its prediction counts them."""
    return with_loss_chunks(cfg, facts.head_features, "cpu" if machine.cpu else "cuda")


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
        data_facts = registry.spec_of(cfg).data_facts(cfg)  # outside the fake mode: it may read the data's files
        batch = micro_batch(cfg, dims, data_facts)
        # non-fake inputs allowed: the mesh's real rank maps meet the fake tensors in DTensor's and FSDP2's set-up
        with stand_ins(cfg, dims), FakeTensorMode(allow_non_fake_inputs=True), balanced_routing(), \
                PhaseBytes() as tracker, _stage_phases(tracker):
            layout, optimizer = _build(cfg, dims, mesh, rank, data_facts)
            _step(cfg, layout, optimizer, tracker, batch, micro_steps=1)  # makes AdamW's state
            tracker.mark()
            _step(cfg, layout, optimizer, tracker, batch, micro_steps=min(cfg.train.grad_accum, 2), keep_grads=True)
            held = bytes_held(layout.model, optimizer)
    finally:
        dist.destroy_process_group()
    return Traced(rank=rank, stage=dims.coords(rank)["pp"], held=held, peak=tracker.peak(),
                  peak_phase=tracker.peak_phase,
                  phase_peaks=dict(tracker.phase_peaks), seconds=time.perf_counter() - started,
                  max_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


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


def micro_batch(cfg, dims, data_facts: dict):
    """What makes one micro-batch (inputs, targets) of zeros, shaped as the model's workload hands it to the layout:
    its spec's micro_batch (the ViT's fields), else token windows [batch, tokens], inputs and targets alike."""
    spec = registry.spec_of(cfg)
    if spec.micro_batch is not None:
        return lambda: spec.micro_batch(cfg, dims, data_facts)
    shape = spec.shape(cfg)

    def tokens():
        x = torch.zeros(shape.batch_size, shape.tokens, dtype=torch.long)
        return x, x

    return tokens


def _build(cfg, dims, mesh, rank: int, data_facts: dict):
    """The model, its layout and the optimizer, as Trainer._build makes them."""
    spec, t, o = registry.spec_of(cfg), cfg.train, cfg.optimizer
    device = torch.device("cpu")
    model = spec.build_model(cfg, data_facts)  # on the CPU, as fake tensors: no .to() (it swaps them)
    layout = spec.build_layout(model, cfg, dims, mesh, device, rank)
    fake_ddp_parts(layout)
    fused = {} if o.fused is None else {"fused": o.fused}
    optimizer = layout.attach_optimizer(build_optimizer(
        layout.model.configure_optimizer_groups(o.weight_decay), device, t.backend, dims.world_size, lr=o.lr,
        betas=(o.beta1, o.beta2), **fused))
    return layout, optimizer


def _step(cfg, layout, optimizer, tracker: PhaseBytes, batch, micro_steps: int, keep_grads: bool = False) -> None:
    """One iteration as Trainer.step runs it: `micro_steps` micro-steps (the second and later of an accumulation
    hold the same bytes: gradients already there, or kept unreduced, and one micro-batch's activations; so two stand
    for any number, and a fake op still costs ~0.3 ms of Python), the after-backward hooks, the optimizer step, then
    zero_grad (left out of the counted step, whose gradients bytes_held then counts)."""
    t = cfg.train
    dtype = AUTOCAST[t.dtype]
    autocast = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for micro in range(micro_steps):
        x, y = batch()
        layout.train_micro_step(x, y, accum=micro_steps, sync=micro == micro_steps - 1, autocast=autocast,
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
    parser.add_argument("--cases", type=json.loads, default=None, metavar="JSON",
                        help='{"case": [overrides], ...}; a case {"model": NAME, "overrides": [...]}: another model\'s')
    args = parser.parse_args(argv)
    per_node = args.per_node or args.world
    for case, own in (args.cases or {"layout": []}).items():
        model, overrides = case_run(args.model, args.overrides, own)
        cfg = config_mod.load_config(overrides, registry.get(model).name)
        dims = ParallelDims.from_config(cfg, args.world, per_node)
        for traced in trace(config_mod.with_global_batch(cfg, dims.dp_size), dims):
            print(json.dumps({"case": case, **asdict(traced)}), flush=True)


if __name__ == "__main__":
    main()
