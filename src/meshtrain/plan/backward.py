"""What a rank holds while backward runs through its blocks, past the point where it starts (plan/cost.py's peak).

Backward frees each block's saved tensors as it leaves the block and makes its gradients there, so the bytes it
holds move block by block, from the last block back to the first:

    at block j    what the blocks before j keep (checkpointed ones only their input) + block j's whole saved set (a
                  checkpointed block recomputed) + the gradients made so far: the head's and final norm's, then those
                  of every block after j (Share.block_grads; all of them already where earlier micro-steps made them)
    as j ends     what the blocks before j keep + the gradients through j + FSDP2's fp32 unsharded gradients of j,
                  which it reduce-scatters (they exist only once j's backward is done and its saved tensors are freed,
                  and until the next block's are issued: at block j also those of the block after it)

Ring attention's backward is one point inside a block (ring_point): the MLP done and its activations freed, the
ring's K/V blocks, their gradients and its score blocks held.

Where backward starts, no block's gradient exists yet; by the first block all but the embeddings' do. Which point is
higher depends on the two rates: a block whose gradients outweigh what it keeps (an MoE block's experts under full
checkpointing: each block keeps only its input) raises the holding as backward proceeds,
and the peak is near the first block. A dense model with its activations kept peaks where backward starts.

Under a pipeline, FSDP2 neither reshards a block after its backward nor reduce-scatters its gradients until the
last micro-batch (torch's schedules switch both off before): the gradients are made unsharded in fp32
(Share.block_local), and each block stays gathered from its backward until its chunk's next forward. So a backward
that follows a forward gathers block after block as it goes (at block j, those after j, j and the next), and one
that follows a backward finds them all gathered (`starts`, from the schedule's own order). Counting two gathered
blocks put the 70B decoder's last stage (9 blocks, fsdp × tp × pp 8 × cp) 6% under its trace.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from meshtrain.parallel import backends
from meshtrain.parallel.pipeline_schedules import stage_ids
from meshtrain.plan import experts
from meshtrain.plan.activations import autocast, fsdp_mixed, op_block_bytes
from meshtrain.plan.pipeline_time import rank_order

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig
    from meshtrain.parallel.mesh import ParallelDims
    from meshtrain.plan.machines import Machine
    from meshtrain.plan.shares import Share
    from meshtrain.plan.workload import ModelFacts

FP32 = 4


def block_list(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, share: Share, tokens: int, dense_block: float,
               block_input: float, machine: Machine) -> list[tuple[float, float, float, float]]:
    """(what each block of the stage keeps for backward for one micro-batch, what it holds while its own backward
    runs, and at ring attention's backward inside it (`ring_point`): what it holds there and the gradients made by
    then), in forward order: a checkpointed block keeps its input and holds its whole saved set again; under `op`
    a block keeps its matmuls' and attention's outputs and holds besides what recomputing its element-wise ops adds
    (cost._blocks_kept's count for the block backward starts with, here for each)."""
    moe = facts.shape.moe
    moe_layers = set(moe.layers) if moe else set()
    moe_block = experts.moe_block_bytes(facts, cfg, dims, tokens, machine) if moe else 0.0
    rows = experts.routed_rows(facts, dims, tokens) if moe else 0.0
    transients = experts.weight_grad_transients(facts, cfg, dims) if moe else 0.0
    parts = share.parts or experts.whole_model(facts)
    checkpointed = experts.checkpointed_layers(cfg, parts)
    op = cfg.train.activation_checkpointing == "op"
    out = []
    for index, i in enumerate(i for part in parts for i in part):  # index: into the share's per-block tuples
        own = moe_block if i in moe_layers else dense_block
        extra = transients if i in moe_layers else 0.0
        if op:
            kept = op_block_bytes(facts, cfg, dims, tokens, machine, i, rows if i in moe_layers else 0.0)
            keeps, holds = kept, kept + max(0.0, own - (kept - block_input)) + extra
        else:
            keeps, holds = block_input if i in checkpointed else own, own + extra
        ring = (0.0, 0.0)
        if dims.cp > 1 and cfg.parallel.cp_impl == "ring":
            freed = _freed_before_attention(facts, cfg, dims, tokens, machine, i, own, holds)
            local = share.block_local[index] if index < len(share.block_local) else 0
            ring = ring_point(facts, cfg, dims, tokens, machine, holds - freed, local)
        out.append((keeps, holds, *ring))
    return out


def _freed_before_attention(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, tokens: int, machine: Machine,
                            layer: int, own: float, holds: float) -> float:
    """What block `layer`'s sublayers after attention saved, freed by the time attention's backward runs: a dense
    MLP's hidden activations before and after the nonlinearity (cut over tp) and, under autocast, the 16-bit casts
    of its input (whole on every tp rank) and of attention's output projection's input (cut over tp); an MoE block's
    all but its attention half. Under `op` only an MoE block's experts' part: the checkpoint keeps what it recomputed
    until the block's backward ends (traced op-mode GPT ring layouts: within 3% of this count but one pipeline
    stage, 5.1% below it; 3-8% above a count that frees a dense MLP's)."""
    shape, moe = facts.shape, facts.shape.moe
    if cfg.train.activation_checkpointing == "op":
        return holds - op_block_bytes(facts, cfg, dims, tokens, machine, layer) if moe and layer in moe.layers else 0.0
    if moe and layer in moe.layers:
        return own - experts.attention_half(facts, cfg, dims, machine) * tokens
    if not autocast(cfg):
        return 2 * shape.mlp_hidden / dims.tp * tokens * FP32
    return (2 * shape.mlp_hidden / dims.tp + shape.width * (1 + 1 / dims.tp)) * tokens * 2


def ring_point(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, tokens: int, machine: Machine, holds: float,
               local: int) -> tuple[float, float]:
    """(what a block holds while ring attention's backward runs in it, beyond the blocks before it and the gradients
    made before it, less cost.py's working set that peaks() adds throughout; the block's gradient bytes made by
    then). By then the block's MLP is done: `holds` is the block's holding without what the sublayers after attention
    saved (_freed_before_attention), the MLP's hidden gradient is freed, and every weight gradient but the q, k, v
    projection's is made (unsharded, fp32). At every ring step the ring's backward holds, for E elements of a
    query-shaped tensor (K and V are repeated to every head before it) and a bytes an attention element: K and V
    stacked and the next pair arriving (4a), the output's gradient made contiguous (a), the query's gradient, the
    step's K/V gradient and the block pair's fp32 gradients (4 + 8 + 8): E·(5a + 20); at step 0 the whole score
    blocks of our own K/V (cost.py's three), at a later step the previous step's K/V gradient still being sent and
    the next arriving (fp32: 16E) beside score blocks half as large under the causal zigzag. Traced: the CPU recipe
    (fp32, ddp cp 4) peaks at a later step (E·56 and the score blocks: 1.50 MiB), the 16-layer 70B decoder's last
    stage at step 0 (three 1 GiB score blocks beside E·40 = 320 MiB)."""
    shape = facts.shape
    attention = FP32 if machine.cpu or not autocast(cfg) else 2  # a CPU's ring runs bf16 attention in fp32
    query = tokens * shape.width / dims.tp
    scores = score_blocks(facts, dims, tokens)  # cost.py's, added by peaks()
    later_step = 16 * query - scores * (0.5 if shape.causal else 0.0)  # beyond step 0's
    # of the gradients flowing through the block (cost.py's, added by peaks()) only the stream's enters attention
    entering = shape.width * tokens * (2 if autocast(cfg) else FP32)
    beyond = entering - flowing_gradients(facts, cfg, dims, tokens)
    qkv = shape.width * (shape.heads + 2 * shape.kv_heads) * (shape.width // shape.heads) / dims.tp
    return holds + (5 * attention + 20) * query + max(0.0, later_step) + beyond, max(0.0, local - qkv) * FP32


def flowing_gradients(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, tokens: int) -> float:
    """The gradients flowing through one block's backward for `tokens` of this rank's, in the activations' dtype:
    its MLP's hidden one (cut over tp) and the residual stream's (cost.py's working set)."""
    shape = facts.shape
    return (shape.mlp_hidden / dims.tp + shape.width) * tokens * (2 if autocast(cfg) else FP32)


def score_blocks(facts: ModelFacts, dims: ParallelDims, tokens: int) -> float:
    """The fp32 score blocks ring attention's backward makes for one K/V block (s, p and ds) for `tokens` of this
    rank's: its queries against as many keys, its heads (cut over tp)."""
    samples = tokens / (facts.tokens / dims.cp)
    return 3 * samples * facts.shape.heads / dims.tp * (facts.tokens / dims.cp) ** 2 * FP32


def gathered_beyond_two(share: Share, gathered: float, element_bytes: float) -> float:
    """Bytes of the blocks FSDP2 holds gathered where `gathered` of the stage's blocks were already when a block's
    backward runs (the last ones backward visits), with the one running and the next (prefetched), beyond the two
    largest blocks counted throughout (an MoE stage's dense blocks gather more than its MoE ones)."""
    if not element_bytes or not share.block_gathered:
        return 0.0
    held = list(reversed(share.block_gathered))[:min(len(share.block_gathered), round(gathered) + 2)]
    return max(0.0, sum(held) - 2 * share.block_params) * element_bytes


@dataclass(frozen=True)
class Start:
    """Where one of a pipeline rank's backwards starts, as its schedule orders the work."""

    held: float  # micro-batches' saved tensors held, in units of the rank's whole share of blocks
    later: float  # of the rank's blocks, the share whose chunk ran a backward before: this step's gradients exist
    gathered: float  # of the rank's blocks, the share FSDP2 holds gathered as it starts (module docstring)
    heads: float = 1.0  # micro-batches held whose last stage's forward (the head, the loss) ran on this rank
    chunk: int = 0  # which of the rank's chunks (Share.parts) it runs
    own: tuple[bool, bool] = (False, False)  # whether that chunk's gradients exist, its blocks are gathered
    grads_of: tuple[int, ...] = ()  # the chunks whose gradients exist (unsharded: not yet reduced)


def starts(schedule: str, pp: int, virtual: int, microbatches: int, stage: int) -> list[Start]:
    """Each distinct start of a backward on pipeline rank `stage`, in the order torch's schedule runs them
    (pipeline_time.rank_order). A chunk's blocks are gathered from its backward on (torch's schedules keep FSDP2 from
    resharding after backward until the chunk's last micro-batch) until its next forward reshards them: a backward
    that follows the chunk's backward (GPipe's, 1F1B's cool-down) starts with all of them gathered, one that follows
    a forward with none. A chunk's gradients are unsharded from its first backward to its last, which reduces them
    and reshards its blocks (interleaved 1F1B's last rank: its last chunk's, before its first chunk's backwards; the
    70B decoder's interleaved last rank, counted unsharded and gathered to the step's end: 39% over its trace; 0.3%
    with this and a walk through one chunk's blocks, `_inside`)."""
    if pp == 1:
        return [Start(1.0, 0.0, 0.0)]
    chunks = stage_ids(stage, pp, virtual, schedule)
    last_was_backward = dict.fromkeys(chunks, False)
    done, ran = dict.fromkeys(chunks, 0), dict.fromkeys(chunks, 0)  # backwards and forwards per chunk
    head = pp * virtual - 1  # the model's last stage: its micro-batches hold the head
    out: list[Start] = []
    for forward, chunk, _ in rank_order(schedule, pp, virtual, microbatches, stage):
        if not forward:
            active = [c for c in chunks if done[c] < microbatches]
            start = Start((sum(ran.values()) - sum(done.values())) / virtual,
                          sum(0 < done[c] for c in active) / virtual,
                          sum(last_was_backward[c] for c in active) / virtual,
                          float(ran.get(head, 0) - done.get(head, 0)), chunks.index(chunk),
                          (done[chunk] > 0, last_was_backward[chunk]),
                          tuple(i for i, c in enumerate(chunks) if c in active and done[c] > 0))
            out += [start] if start not in out else []
        (ran if forward else done)[chunk] += 1
        last_was_backward[chunk] = not forward
    return out


def deepest(blocks: list[tuple[float, float, float, float]], share: Share, earlier: float, reduced: float = 0.0,
            gathering: tuple[float, float] = (0.0, 0.0), local: bool = False, entry: float = 0.0) -> float:
    """The most bytes one micro-batch's backward holds inside the stage's blocks beyond what is held throughout (the
    states, buffers, other micro-batches): the saved tensors still kept, the block being run, and the gradients made
    so far (module docstring); `earlier`: gradient bytes that exist from the start (earlier micro-steps');
    `reduced`: bytes held only as a block's backward ends, its saved tensors freed (FSDP2's reduce-scatter input);
    `gathering`: (blocks FSDP2 holds gathered where backward starts, bytes of a gathered element) under a pipeline,
    where each block stays gathered once its backward has run, beyond the two (the one running and the next,
    prefetched) counted throughout; `local`: the gradients are made unsharded (FSDP2 not reducing); `entry`: the bytes
    of the gradient the stage's embeddings make after its blocks, a fresh tensor that exists beside the one earlier
    micro-batches left before it is added to it (the Llama's 50k-word embedding on a pipeline's first stage: traced
    10.9-21.7% above a walk without it)."""
    grads = share.block_local if local else share.block_grads
    if not blocks or len(blocks) != len(grads):
        return 0.0
    kept = sum(block[0] for block in blocks)
    made = (share.head_local if local else share.head_grads) * FP32
    most = pending = 0.0
    gathered_at_start, element_bytes = gathering
    for visited, ((keeps, holds, at_ring, made_by_ring), block) in enumerate(zip(reversed(blocks), reversed(grads),
                                                                                 strict=True)):
        gathered = gathered_beyond_two(share, gathered_at_start + visited, element_bytes)
        kept -= keeps
        most = max(most, kept + holds + max(earlier, made) + pending + gathered)
        if at_ring:  # ring attention's backward, inside the block (ring_point)
            most = max(most, kept + at_ring + max(earlier, made + made_by_ring) + pending + gathered)
        made += block * FP32
        most = max(most, kept + max(earlier, made) + reduced + gathered)
        pending = reduced  # FSDP2 frees a reduce-scatter's input only as it issues the next block's
    if entry and earlier:
        most = max(most, max(earlier, made) + pending + entry)
    return most


def peaks(cfg: RunConfig, dims: ParallelDims, share: Share, microbatches: int, blocks: list, *,
          held_throughout: float, per_batch: tuple[float, tuple[float, float], float],
          working: tuple[float, float, float], grads: tuple[float, float],
          reduced: float) -> tuple[float, float, tuple[float, float, float]]:
    """(the most bytes where a backward starts, the most inside one, and at the fullest start the micro-batches held,
    the heads held and the pipeline-gathered blocks' bytes beyond the two counted throughout), over every start the
    schedule makes
    (`starts`): its first (gradients only from earlier accumulation micro-steps), later ones (the step's
    gradients too, perhaps fewer micro-batches held, perhaps every block still gathered). Inside a backward, block
    by block (`deepest`): the other micro-batches held and this one's chunk inputs stay, its head's tensors
    are gone. Where the walk is made, a start holds the head's tensors beside the gradient entering the blocks, not
    the working set of a block (recomputed, ring attention's score blocks): the walk counts that without the head
    (both together put the 70B decoder's 16-layer last stage, one block and the head, 10% over its trace)."""
    kept, head, inputs = per_batch
    stream, flowing, whole = working
    if blocks and len(blocks) == len(share.block_grads):
        whole = stream
    earlier, between = grads
    p = cfg.parallel
    virtual = p.virtual_stages if dims.pp > 1 else 1
    element_bytes = pipeline_gathered(cfg, dims)  # FSDP2 under a pipeline: no reduce-scatter until the last
    best, inside = (0.0, 0.0, 0.0, 0.0), 0.0  # (bytes, micro-batches held, heads held, gathered bytes): fullest start
    for start in starts(p.pp_schedule, dims.pp, virtual, microbatches, share.stage):
        gradients = max(earlier, start.later * between)
        gathered_at_start = start.gathered * share.blocks
        gathered = gathered_beyond_two(share, gathered_at_start, element_bytes)
        at_start = held_throughout + start.held * kept + heads_held(start.heads, *head) + gradients + whole + gathered
        best = max(best, (at_start, start.held, start.heads, gathered))
        inside = max(inside, held_throughout + flowing + _inside(start, share, blocks, virtual, per_batch,
                                                                 (earlier, between), reduced, element_bytes))
    return best[0], inside, best[1:]


def _inside(start: Start, share: Share, blocks: list, virtual: int, per_batch: tuple[float, tuple[float, float], float],
            grads: tuple[float, float], reduced: float, element_bytes: float) -> float:
    """What one backward holds inside its chunk's blocks, with the rest held beside it (peaks): the other micro-batches'
    saved tensors and heads, this one's chunk input, and the rank's other chunks' gradients and gathered blocks where
    they exist (an interleaved rank walks one chunk's blocks, not all of them)."""
    kept, head, inputs = per_batch
    earlier, between = grads
    part = share.parts[start.chunk] if share.parts and len(share.parts) > start.chunk else ()
    offset = sum(len(p) for p in share.parts[:start.chunk])
    whole = virtual == 1 or len(blocks) != len(share.block_grads) or not part
    mine = slice(offset, offset + len(part)) if not whole else slice(None)
    last = whole or start.chunk == len(share.parts) - 1 and share.last
    chunk_share = replace(share, block_grads=share.block_grads[mine], block_local=share.block_local[mine],
                          block_gathered=share.block_gathered[mine], head_grads=share.head_grads * last,
                          head_local=share.head_local * last)
    own_later, own_gathered = start.own if not whole else (start.later > 0, start.gathered > 0)
    own_grads = (between if whole else _chunk_grads(share, start.chunk, between)) if own_later else 0.0
    other_grads = 0.0 if whole else sum(_chunk_grads(share, i, between) for i in start.grads_of if i != start.chunk)
    if earlier >= between:  # every gradient exists from the start (earlier accumulation micro-steps)
        own_grads, other_grads = earlier, 0.0
    gathered_own = len(chunk_share.block_gathered) if own_gathered else 0
    other_gathered = max(0.0, start.gathered * share.blocks - gathered_own) * element_bytes * \
        sum(share.block_gathered) / max(1, len(share.block_gathered)) if not whole else 0.0
    # the embeddings (the first stage's first chunk; beside an untied head on a stage that has both)
    entry = (share.root_params - share.head_local * share.last) * FP32 if share.first and (whole or start.chunk == 0) \
        else 0.0
    walk = deepest(blocks[mine], chunk_share, own_grads, 0.0 if element_bytes else reduced,
                   (gathered_own if not whole else start.gathered * share.blocks, element_bytes),
                   local=bool(element_bytes), entry=max(0.0, entry))
    others = (start.held - 1 / virtual) * kept + max(0.0, start.heads - last) * head[1]  # waiting micro-batches'
    return others + inputs / virtual + walk + other_grads + other_gathered


def heads_held(heads: float, running: float, waiting: float) -> float:
    """The head's bytes where a backward starts with `heads` micro-batches' loss computed on the rank: the one
    starting holds `running` (its loss's gradients too), each of the others what it keeps until its backward."""
    return running + (heads - 1) * waiting if heads >= 1 else heads * running


def _chunk_grads(share: Share, index: int, between: float) -> float:
    """The unsharded gradient bytes of the rank's chunk `index` (of `between`, the whole stage's): its blocks', the
    head's on the model's last stage, and the rest (the embeddings', a vocab-parallel one whole) on its first."""
    offset = sum(len(p) for p in share.parts[:index])
    blocks = sum(share.block_local[offset:offset + len(share.parts[index])]) * FP32
    last = share.last and index == len(share.parts) - 1
    rest = max(0.0, between - sum(share.block_local) * FP32 - share.head_local * FP32)
    return blocks + last * share.head_local * FP32 + (share.first and index == 0) * rest


def pipeline_gathered(cfg: RunConfig, dims: ParallelDims) -> float:
    """The bytes of a gathered element of the blocks FSDP2 keeps gathered after their backward under a pipeline
    (torch's schedules switch its resharding after backward off until the last micro-batch), or 0: no pipeline, no
    FSDP2, or one that keeps every block gathered anyway (zero2, counted in the buffers)."""
    chosen = backends.get(cfg.train.backend)
    if dims.pp == 1 or not chosen.sharded or not chosen.reshard_after_forward or dims.size("dp_shard_cp") == 1:
        return 0.0
    return 2.0 if fsdp_mixed(cfg, dims) else FP32
