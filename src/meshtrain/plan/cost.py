"""The cost of one layout on one machine, per rank: memory (what a rank holds at its peak) and step time (compute,
the communication it cannot hide, the pipeline's bubble), each term kept so that `plan --explain` can show it.

Memory, in bytes of rank 0 of the heaviest pipeline stage (checked against the tensors' own peak on real ranks:
plan/measured/measure.py, docs/plan.md):

    states       parameters, gradients, AdamW's two moments: plan/shares.py, exact (fp32 master copies; experts by ep)
    activations  what the blocks save for backward: ModelShape.activations_per_token (exact for fp32 eager, tp=1)
                 × the tokens a micro-batch puts on this rank (batch / microbatches × tokens / cp) × the blocks on
                 the stage, plus each chunk's input; under tp, the parts of a block the plan shards divide by tp
                 (with sequence parallel all but the two gathered inputs of attention and MLP, without it all but
                 the four norm inputs and outputs); a mixture of experts' MoE blocks by their routed rows
                 (plan/experts.py; plan/activations.py cuts a block over tp); activation checkpointing keeps a
                 block's input instead (`op`: its input, matmul and attention outputs, activations.op_block_bytes);
                 under autocast all but the two norms' inputs are 16-bit. Times the
                 micro-batches the stage holds when a backward starts (`held`: the pipeline schedule's own order)
    head         the last stage's output, what the loss saves of it and its gradient: 3 × tokens × output width × 4
                 bytes (a decoder's logits on this rank's tokens, vocabulary-sharded under loss parallel), or 4 ×
                 for the ViT's whole field on every rank (its patches are copied once more into the field)
    buffers      DDP's gradient buckets (a second copy of the gradients); FSDP2's gathered parameters (the blocks in
                 use and the root's; zero2 keeps every gathered block from forward to backward; under a pipeline
                 each block from its backward to its next forward: plan/backward.py) and, as a block's backward
                 ends, its fp32 gradients to reduce-scatter; a pipeline's receive buffers (one per micro-batch for
                 each stage's input and its output's gradient)
    working set  what backward holds beside the saved tensors: the gradients flowing through one block (its MLP's
                 hidden one and the stream's), the block being recomputed under checkpointing, ring attention's
                 score blocks
    peak         max(each backward's start the schedule makes (plan/backward.starts): states without gradients,
                 buffers, activations and head, the gradient entering the blocks, and the gradients that exist by
                 then: from earlier accumulation micro-steps at the first backward, all of them at a later one, which
                 may hold fewer micro-batches; inside each backward, block by block: the blocks not yet run, the one
                 running with its working set, the gradients made so far, the blocks gathered so far
                 (plan/backward.py); the optimizer step: states, buffers)

Step time, seconds per iteration:

    compute      per linear: 6 × tokens × in × out FLOPs at the machine's matmul rate for that size (a measured curve
                 on `this`, a fraction of the datasheet peak elsewhere), attention (on `this` the kernel the layout
                 runs, timed at its shapes; elsewhere 12 × heads × head_dim × context FLOPs per token), elementwise
                 traffic (activations written and read, the optimizer's 10 passes over the states) at memory
                 bandwidth, all times the slowdown of ranks sharing cores, and the fixed costs per block and
                 micro-step and per step (calibrated on `this`); activation checkpointing adds a forward per
                 recomputed block, `op` the forward's third of the element-wise traffic (not the Python cost of its
                 per-op policy, which shows on small models: docs/parallelism.md)
    comm         each collective's bytes over the bus bandwidth of the link its group crosses (inside a node or
                 between nodes, by the mesh order), plus its latency: data parallel once per iteration, tensor and
                 context parallel per block and micro-step, pipeline sends per micro-batch and stage boundary
    exposed      what compute does not hide: on accelerators the data-parallel traffic overlaps backward; tp, cp and
                 pipeline traffic sits on the critical path; on a CPU (gloo shares the cores) nothing overlaps
    bubble       the time the busiest pipeline rank waits for its input, the schedule played out action by action
                 (plan/pipeline_time.py): on devices of their own (pp - 1) / (microbatches × virtual stages) of the
                 pipelined work; where ranks share cores the waiting ones leave them to the busy ones
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from meshtrain.models.language import resolve_loss_chunks
from meshtrain.parallel import backends
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.plan import backward, experts
from meshtrain.plan.activations import autocast, block_bytes, fsdp_mixed, op_block_bytes
from meshtrain.plan.communication import communication
from meshtrain.plan.machines import Machine
from meshtrain.plan.pipeline_time import pipeline_time
from meshtrain.plan.shares import Share, stage_shares, tp_local_shape
from meshtrain.plan.workload import ModelFacts

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig

FP32 = 4


@dataclass
class Cost:
    """Predicted figures of one layout on one machine (bytes and seconds), with the terms they are made of."""

    memory: dict[str, float] = field(default_factory=dict)  # params, grads, optimizer, activations, head, buffers, peak
    memory_stage: int = 0  # the pipeline stage `memory` is of: the fullest
    time: dict[str, float] = field(default_factory=dict)  # compute, comm (per kind), exposed, bubble, step
    comm_bytes: dict[str, float] = field(default_factory=dict)  # bytes this rank sends per iteration, per kind
    comm_calls: dict[str, float] = field(default_factory=dict)  # collective calls per iteration, per op
    tokens_per_iteration: int = 0
    samples_per_iteration: int = 0
    flops_per_iteration: float = 0.0  # the model's (6N + attention) × tokens: what MFU counts
    bottleneck: str = ""

    @property
    def peak_bytes(self) -> float:
        return self.memory["peak"]

    @property
    def step_s(self) -> float:
        return self.time["step"]


def predict_peak(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, machine: Machine) -> float:
    """The peak bytes per rank of the fullest pipeline stage: predict's memory alone (of `machine` it reads only
    whether attention runs in fp32), for the memory check before a run (plan/measured/preflight.py)."""
    facts = facts.for_dp(dims.dp_size, cfg.train.grad_accum)
    micro = _Micro.of(facts, cfg, dims)
    return max(_memory(facts, cfg, dims, share, micro, machine)["peak"] for share in _shares(facts, cfg, dims))


def stage_memory(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims,
                 machine: Machine) -> dict[int, dict[str, float]]:
    """predict's memory terms of every pipeline stage's rank 0, by pp rank (what `plan --trace` sets beside each
    traced stage; predict keeps the fullest's)."""
    facts = facts.for_dp(dims.dp_size, cfg.train.grad_accum)
    micro = _Micro.of(facts, cfg, dims)
    return {share.stage: _memory(facts, cfg, dims, share, micro, machine) for share in _shares(facts, cfg, dims)}


def _shares(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims) -> tuple[Share, ...]:
    p = cfg.parallel
    return _stage_shares(facts.model, facts.split, dims, cfg.train.backend, p.pp_schedule,
                         p.virtual_stages if dims.pp > 1 else 1,
                         tuple(facts.shape.token_sharded_grads.items()) if p.sequence_parallel else (),
                         facts.shape.moe.module if facts.shape.moe else None)


# A plan prices each layout under several checkpointing modes, micro-batch counts and dtypes, whose shares are the
# same: walking every parameter of the model once per layout, not per candidate (a third of GPT-2's plan's time).
@functools.lru_cache(maxsize=512)
def _stage_shares(model, split, dims: ParallelDims, backend: str, schedule: str, virtual_stages: int,
                  token_sharded_grads: tuple[tuple[str, int], ...], experts: str | None) -> tuple[Share, ...]:
    return tuple(stage_shares(model, split, dims, backend, schedule=schedule, virtual_stages=virtual_stages,
                              token_sharded_grads=dict(token_sharded_grads), experts=experts))


def predict(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, machine: Machine) -> Cost:
    """Memory and step time of `cfg`'s layout `dims` (already checked by ParallelDims.from_config) on `machine`."""
    t = cfg.train
    facts = facts.for_dp(dims.dp_size, cfg.train.grad_accum)
    shares = _shares(facts, cfg, dims)
    micro = _Micro.of(facts, cfg, dims)
    cost = Cost()
    stage_costs = [(_memory(facts, cfg, dims, share, micro, machine), _time(facts, cfg, dims, share, micro, machine))
                   for share in shares]
    fullest = max(range(len(shares)), key=lambda i: stage_costs[i][0]["peak"])
    cost.memory, cost.memory_stage = stage_costs[fullest][0], shares[fullest].stage
    cost.time, cost.comm_bytes, cost.comm_calls = max((tm for _, tm in stage_costs),
                                                      key=lambda tm: tm[0]["step"])  # the slowest stage's
    cost.samples_per_iteration = facts.batch_size * t.grad_accum * dims.dp_size
    cost.tokens_per_iteration = cost.samples_per_iteration * facts.tokens
    cost.flops_per_iteration = float(facts.flops_per_token) * cost.tokens_per_iteration
    terms = {k: v for k, v in cost.time.items() if k in ("compute", "exposed", "bubble")}
    cost.bottleneck = max(terms, key=terms.get)
    return cost


@dataclass(frozen=True)
class _Micro:
    """One micro-batch as a rank sees it."""

    samples: int  # per micro-batch (a pipeline's microbatch)
    count: int  # micro-batches per iteration (grad_accum × pipeline microbatches)
    microbatches: int  # the pipeline's micro-batches per micro-step (1 without a pipeline)
    tokens: int  # tokens a micro-batch puts on this rank (after cp)

    @classmethod
    def of(cls, facts: ModelFacts, cfg: RunConfig, dims: ParallelDims) -> _Micro:
        p, t = cfg.parallel, cfg.train
        microbatches = (p.microbatches or dims.pp * p.virtual_stages) if dims.pp > 1 else 1
        samples = facts.batch_size // microbatches
        return cls(samples=samples, count=t.grad_accum * microbatches, microbatches=microbatches,
                   tokens=samples * facts.tokens // dims.cp)


def _weight_copies(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, share: Share) -> float:
    """Autocast's 16-bit copy of every linear weight this rank runs, cached for the forward and saved for backward
    (none under FSDP2, whose gathered parameters are already 16-bit). Under op-level checkpointing a block's matmuls
    save their casts into the checkpoint, which drops them: only the linears outside the blocks keep theirs, and the
    one block backward recomputes first (counting them all put a bf16 peak 7.4% over the measured one: docs/plan.md)."""
    if not autocast(cfg) or fsdp_mixed(cfg, dims):
        return 0.0
    outside = in_blocks = 0
    for name, shape in facts.linears:
        if _on_stage(name, facts, share, dims, cfg.parallel):
            out_features, in_features = tp_local_shape(name + ".weight", shape, dims.tp)
            if facts.split and name.startswith(f"{facts.split.blocks}."):
                in_blocks += out_features * in_features
            else:
                outside += out_features * in_features
    if cfg.train.activation_checkpointing == "op" and share.blocks:
        in_blocks /= share.blocks  # one block's (the blocks are alike)
    return 2.0 * (outside + in_blocks)


def _head_bytes(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, micro: _Micro,
                cpu: bool) -> tuple[float, float]:
    """(what one micro-batch's output layer and loss hold where its backward starts, what they keep of it while the
    micro-batch waits for its backward: a pipeline's last stage holds the second for each micro-batch in flight
    beside the first). A decoder's logits on this rank's tokens (vocabulary-sharded under loss parallel); or, where
    the ViT's backward starts, the gradient of its whole field on every rank and its copy back into patches (the
    field and its patches of the forward are gone by then; `plan --trace` counts two fields there, beside the
    micro-batch's own, _batch_bytes), held alike."""
    if facts.shape.whole_output:
        field = 2 * micro.samples * facts.tokens * facts.head_features * FP32
        return field, field
    sharded = dims.tp if cfg.parallel.loss_parallel and dims.pp == 1 else 1
    chunks = getattr(cfg.train, "loss_chunks", "off")  # a decoder's; the ViT has none
    chunk = resolve_loss_chunks(chunks, facts.head_features, "cpu" if cpu else "cuda")  # auto's, for the device
    if chunk:  # nn/chunked_loss.py: a chunk's fp32 logits, made into their probabilities and gradient in place
        # (under autocast: their fp32 copy and the 16-bit gradient made from it), beside the gradients the forward
        # makes for backward, which are all a waiting micro-batch keeps: the hidden states' (fp32: the final norm's
        # output) and the output layer's, kept in its weight's dtype (16-bit under FSDP2's mixed precision: GPipe's
        # last stage holds one per micro-batch, 196 MiB for the 70B decoder's, not 393); under tp, of this rank's
        # vocabulary slice, loss parallel or not
        per_feature = FP32 + 2 if autocast(cfg) else FP32
        words = facts.head_features / dims.tp
        weight_bytes = 2 if fsdp_mixed(cfg, dims) else FP32
        kept = (words * weight_bytes + micro.tokens * FP32) * facts.shape.width
        return min(chunk, micro.tokens) * words * per_feature + kept, kept
    # where backward starts: the loss's fp32 log-softmax (saved) and its gradient, and the logits' gradient: fp32 on
    # a CPU, 16-bit under autocast on a GPU (measured: docs/plan.md). The logits themselves are gone (the loss kept
    # the log-softmax of its fp32 copy, not them), but for a pipeline's, which its stage keeps as the output its
    # backward starts from (in autocast's dtype) until that backward has run; a waiting micro-batch keeps its
    # log-softmax and those logits (traced: GPipe's last stage holds them for each micro-batch in flight)
    logits = micro.tokens * facts.head_features / sharded
    output = logits * (2 if autocast(cfg) else FP32) if dims.pp > 1 else 0.0
    return logits * (2 * FP32 + (2 if autocast(cfg) and not cpu else FP32)) + output, logits * FP32 + output


def _batch_bytes(facts: ModelFacts, micro: _Micro) -> float:
    """A micro-batch of whole fields (a model whose loss reads its whole output, the ViT): its inputs and targets in
    fp32, held from its arrival to past the optimizer step; a decoder's token ids are too small to count."""
    if not facts.shape.whole_output or not facts.split:
        return 0.0
    inputs = sum(shape[1] for name, shape in facts.linears if name in facts.split.first)  # the patch embedding's
    return micro.samples * facts.tokens * (inputs + facts.head_features) * FP32


def _blocks_kept(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, share: Share, micro: _Micro,
                 machine: Machine) -> tuple[float, float, float]:
    """(what the stage's blocks keep for backward for one micro-batch, what recomputing the block backward starts
    with adds to it, one block's input)."""
    t = cfg.train
    block, block_input = block_bytes(facts, cfg, dims, micro.tokens, machine)
    checkpointed = {"none": 0, "full": share.blocks, "op": 0,
                    "selective": math.ceil(share.blocks / t.ac_every)}[t.activation_checkpointing]
    kept = (share.blocks - checkpointed) * block + checkpointed * block_input
    op_block = op_block_bytes(facts, cfg, dims, micro.tokens, machine) if t.activation_checkpointing == "op" else 0.0
    if op_block:  # every block keeps its matmuls' and attention's outputs and its input
        kept = share.blocks * op_block
    if facts.shape.moe is not None:  # dense and MoE blocks differ (plan/experts.py: the routed rows' bound)
        kept, block = experts.kept_activations(facts, cfg, dims, micro.tokens, block, block_input, machine, share.parts)
    blocks_per_chunk = share.blocks // (cfg.parallel.virtual_stages if dims.pp > 1 else 1)
    step = 1 if t.activation_checkpointing == "full" else t.ac_every
    recomputing = 0.0
    if checkpointed and (blocks_per_chunk - 1) % step == 0:  # backward starts by recomputing the last block
        recomputing = block - block_input
    elif op_block:  # ... or its element-wise ops, beside the outputs it kept (the input among them)
        recomputing = max(0.0, block - (op_block - block_input))
    return kept, recomputing, block_input


def _data_parallel_buffers(cfg: RunConfig, dims: ParallelDims, share: Share) -> tuple[float, float, float]:
    """(what data parallelism holds beside the states from forward to the optimizer step, what it holds only from
    where a block's backward ends, what it holds only after backward): DDP's buckets, a flat copy of the gradients it
    reduces (under ep > 1 the experts' own flat copy, averaged over edp after backward); FSDP2's gathered parameters,
    and the fp32 unsharded gradients of one block that it reduce-scatters once that block's backward is done (its
    saved tensors freed by then) until the next block's are issued (plan/backward.py): counting them where backward
    starts put the MoE's fsdp cp2 x ep2 peak 13.8% over."""
    chosen = backends.get(cfg.train.backend)
    if chosen.all_reduces and dims.size("dp_cp") > 1:
        buckets = (share.grads - share.expert_params) * FP32
        return buckets, 0.0, share.expert_params * FP32 if dims.ep > 1 and dims.size("edp") > 1 else 0.0
    if chosen.sharded and dims.size("dp_shard_cp") > 1:
        blocks_gathered = 2 if chosen.reshard_after_forward else share.blocks  # in use + prefetched, or all
        gathered_bytes = 2 if fsdp_mixed(cfg, dims) else FP32  # gathered in the compute dtype, reduced in fp32
        return (share.root_params + blocks_gathered * share.block_params) * gathered_bytes, \
            share.block_params * FP32, 0.0
    return 0.0, 0.0, 0.0


def _accumulated_grads(cfg: RunConfig, dims: ParallelDims, share: Share) -> float:
    """The gradient bytes an accumulation's earlier micro-steps leave to the next: the rank's own share, but under
    FSDP2 the stage's whole gradients (after tp), which it keeps unsharded in fp32 (its reduce dtype) between
    micro-steps (set_requires_gradient_sync(False): the reduce-scatter waits for the last one). Found by
    `plan --trace`: GPT-2 124M on fsdp dp8 with grad_accum 2 holds 475 MiB more than its 1/8 share; a vocab-parallel
    embedding's among them whole (DTensor hands it back Replicate: the 70B decoder's first stage, 1.5 GiB)."""
    chosen = backends.get(cfg.train.backend)
    if chosen.sharded and dims.size("dp_shard_cp") > 1:
        return share.unsharded_grads * FP32
    return share.grads * FP32


def _memory(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, share: Share, micro: _Micro,
            machine: Machine) -> dict[str, float]:
    t, p = cfg.train, cfg.parallel
    kept, recomputing, block_input = _blocks_kept(facts, cfg, dims, share, micro, machine)
    # each chunk of blocks keeps its input (the embedding's output, or what the previous stage sent), and a linear
    # embedding keeps its own input
    virtual = p.virtual_stages if dims.pp > 1 else 1
    inputs = virtual * block_input
    if share.first and facts.split:
        inputs += sum(shape[1] for name, shape in facts.linears if name in facts.split.first) * micro.tokens * FP32
    kept += inputs
    head, waiting_head = _head_bytes(facts, cfg, dims, micro, machine.cpu) if share.last else (0.0, 0.0)
    # Backward's working set: the gradients in flight through one block (its MLP's hidden one and the stream's:
    # what autograd holds beside the saved tensors, measured by plan/measured/measure.py), the block being recomputed under
    # checkpointing, and for ring attention the score blocks its backward makes (s, p, ds for one K/V block);
    # `stream` without those score blocks: what a backward's start holds beside the head (backward.peaks)
    stream = backward.flowing_gradients(facts, cfg, dims, micro.tokens) if share.blocks else 0.0
    flowing = stream
    if dims.cp > 1 and p.cp_impl == "ring" and share.blocks:
        flowing += backward.score_blocks(facts, dims, micro.tokens)
    working = flowing + recomputing if share.blocks else 0.0
    params, grads, optimizer = share.params * FP32, share.grads * FP32, share.optimizer * FP32
    buffers, reduced, expert_copy = _data_parallel_buffers(cfg, dims, share)
    if dims.pp > 1:  # a receive buffer per micro-batch for each stage's input and its output's gradient
        stages = [share.stage + k * dims.pp for k in range(virtual)]
        ends = sum((s > 0) + (s < dims.pp * virtual - 1) for s in stages)
        buffers += ends * micro.microbatches * block_input
    between = _accumulated_grads(cfg, dims, share)
    earlier = between if t.grad_accum > 1 else 0.0
    copies = _weight_copies(facts, cfg, dims, share)
    blocks = backward.block_list(facts, cfg, dims, share, micro.tokens, *block_bytes(facts, cfg, dims, micro.tokens,
                                                                                     machine), machine)
    batch = _batch_bytes(facts, micro) if share.first else 0.0
    peaks = backward.peaks(cfg, dims, share, micro.microbatches, blocks,
                           held_throughout=params + optimizer + buffers + copies + batch,
                           per_batch=(kept, (head, waiting_head), inputs), working=(stream, flowing, working),
                           grads=(earlier, between), reduced=reduced)
    start, inside, (in_flight, heads, gathered) = peaks
    activations, head = in_flight * kept, backward.heads_held(heads, head, waiting_head)
    optimizer_step = params + grads + optimizer + buffers + reduced + expert_copy + batch
    out = {"params": params, "grads": grads, "optimizer": optimizer, "activations": activations, "head": head,
           "buffers": buffers + reduced, "backward working set": working, "16-bit weight copies": copies,
           **({"pipeline-gathered blocks": gathered} if gathered else {}),
           "peak": max(start, inside, optimizer_step)}
    return out | ({"expert gradient copy": expert_copy} if expert_copy else {}) | \
        ({"accumulated gradients": earlier} if earlier else {}) | ({"batch": batch} if batch else {}) | \
        ({"inside backward": inside} if inside > start else {})


def _time(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, share: Share, micro: _Micro,
          machine: Machine) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    t, p = cfg.train, cfg.parallel
    label = "bf16" if autocast(cfg) else "fp32"
    tokens = micro.tokens
    # compute of one micro-batch on this stage
    matmul = 0.0
    for name, shape in facts.linears:
        if not _on_stage(name, facts, share, dims, p):
            continue
        out_features, in_features = tp_local_shape(name + ".weight", shape, dims.tp)
        matmul += 6 * tokens * in_features * out_features / machine.matmul_rate(label, tokens, in_features,
                                                                                 out_features)
    if facts.shape.moe is not None:  # the routed experts' matmuls (not nn.Linears), on the busiest rank's rows
        matmul += experts.expert_matmul_s(facts, cfg, dims, tokens, machine, label, share.parts)
    heads, head_dim = facts.shape.heads // dims.tp, facts.shape.width // facts.shape.heads
    causal = facts.shape.causal
    if dims.cp > 1 and p.cp_impl == "ring":  # this rank's queries against every rank's keys, a block at a time
        one = machine.attention_s(label, micro.samples, heads, facts.tokens // dims.cp, head_dim, causal=causal,
                                  ring=dims.cp)
    else:  # Ulysses: the whole sequence on 1/cp of the heads
        one = machine.attention_s(label, micro.samples, heads // dims.cp, facts.tokens, head_dim, causal=causal)
    attention = share.blocks * one
    block, _ = block_bytes(facts, cfg, dims, tokens, machine)
    elementwise = 4 * share.blocks * block / machine.memory_bps
    forward = matmul + attention + elementwise  # a forward and a backward: a forward is a third of it
    # what backward runs again: a checkpointed block's whole forward; under `op` only its element-wise ops, whose
    # traffic (the saved bytes written and read, forward and backward) is `elementwise`, a third of it the forward's
    recompute = {"none": 0.0, "full": forward / 3, "selective": forward / 3 / t.ac_every,
                 "op": elementwise / 3}[t.activation_checkpointing]
    per_micro = forward + recompute
    optimizer_s = 10 * share.params * FP32 / machine.memory_bps
    slowdown = machine.slowdown_under_autocast if autocast(cfg) and machine.slowdown_under_autocast else \
        machine.slowdown
    pipelined, bubble = per_micro * micro.count * slowdown, 0.0
    if dims.pp > 1:  # the schedule played out: ranks waiting for their input leave shared cores to the busy ones
        one_pass = pipeline_time(p.pp_schedule, dims.pp, p.virtual_stages, micro.microbatches, forward / 3,
                                 forward * 2 / 3 + recompute, slowdown)
        pipelined, bubble = one_pass.busy * t.grad_accum, (one_pass.makespan - one_pass.busy) * t.grad_accum
    compute = pipelined + optimizer_s * slowdown + _fixed_costs(facts, cfg, dims, share, micro, machine)

    sent, seconds, calls = communication(facts, cfg, dims, share, micro, machine)
    dp_time = seconds.get("dp", 0.0)
    critical = sum(v for k, v in seconds.items() if k != "dp")
    backward = per_micro * micro.count * slowdown * 2 / 3
    hidden = min(dp_time, 0.8 * backward) if machine.overlap else 0.0
    exposed = critical + dp_time - hidden
    step = compute + exposed + bubble
    return ({"compute": compute, **{f"comm {k}": v for k, v in seconds.items()}, "exposed": exposed,
             "bubble": bubble, "step": step}, sent, calls)


def kinds_of(cfg: RunConfig, dims: ParallelDims) -> list[str]:
    """The kinds of layout whose fixed costs a layout pays (plan/measured/calibrate.py measures each)."""
    p, t = cfg.parallel, cfg.train
    kinds = [backends.get(t.backend).kind]
    if dims.tp > 1:
        kinds.append(f"tp:{dims.tp}")  # measured at its size: its collectives' waits grow with the group
    if dims.cp > 1:
        kinds.append(f"cp:{p.cp_impl}")
    if dims.pp > 1:
        kinds.append(f"pp:{p.pp_schedule}")
    if dims.ep > 1:
        kinds.append(f"ep:{dims.ep}")  # measured at its size (calibrate.runs_of)
    return kinds


def fixed_kinds(cfg: RunConfig, dims: ParallelDims) -> list[str]:
    """The names of the fixed costs this layout pays, in its dtype (calibrate.py measures each)."""
    return [fixed_kind(k, cfg.train.dtype) for k in kinds_of(cfg, dims)]


def fixed_kind(kind: str, dtype: str) -> str:
    """The name a kind's fixed costs go by for a run in `dtype`: under autocast every op pays for its casts, so they
    are calibrated in the dtype the layout runs in ("bf16:tp:2"; fp32's keep the bare kind)."""
    return kind if dtype == "fp32" else f"{dtype}:{kind}"


def _fixed_costs(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, share: Share, micro: _Micro, machine: Machine) -> float:
    """What a step costs beyond arithmetic and bytes: calibrated per kind of layout where calibrate.py measured
    this machine (with ranks sharing cores already in it), else the dispatch of one block per micro-step."""
    kinds = fixed_kinds(cfg, dims)
    if machine.fixed and all(k in machine.fixed for k in kinds):
        accum = cfg.train.grad_accum
        return sum(machine.fixed[k][0] * facts.shape.layers * accum + machine.fixed[k][1] for k in kinds)
    dispatch = share.blocks * machine.block_overhead_s * micro.count + share.tensors * machine.optimizer_tensor_s
    return dispatch * machine.slowdown


def _on_stage(name: str, facts: ModelFacts, share: Share, dims: ParallelDims, p) -> bool:
    """Whether linear `name` runs on this rank's stage."""
    if dims.pp == 1 or facts.split is None:
        return True
    return name in facts.stage_linears(dims.pp, share.stage, p.pp_schedule, p.virtual_stages)
