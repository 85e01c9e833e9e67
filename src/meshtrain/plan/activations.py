"""What a block saves for backward on one rank, per token, in bytes: the model's own count at tp = 1 (ModelShape's,
exact against autograd's saved tensors) cut as tensor parallelism cuts it. plan/cost.py prices a dense block with it,
plan/experts.py the tensor-parallel half of a mixture-of-experts block (its attention and norms; plan/experts.py cuts
the MoE layer's experts itself).

Under tp, everything a block's plan shards divides by tp; what stays whole on every tp rank is the stream the
column-parallel linears read: with sequence parallel their two gathered inputs (attention's and the MLP's, 2 × width a
token), without it the norms' inputs and outputs (4 × width). Under autocast the same by the dtype each is kept in
(nn.activation_counts.AutocastActivations): the column-parallel linears' 16-bit inputs whole, the rest of the 16-bit part
and attention's tensors divided by tp, the fp32 part (norms, statistics) divided only by sequence parallel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from meshtrain.nn.activation_counts import AutocastActivations
from meshtrain.parallel import backends
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.plan.machines import Machine
from meshtrain.plan.shares import chunk, tp_local_shape

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig
    from meshtrain.plan.workload import ModelFacts

FP32 = 4


def autocast(cfg: RunConfig) -> bool:
    return cfg.train.dtype in ("bf16", "fp16")


def fsdp_mixed(cfg: RunConfig, dims: ParallelDims) -> bool:
    """FSDP2 gathers 16-bit parameters under autocast, and the blocks' inputs are 16-bit (parallel/compose.py's
    param_dtype)."""
    return autocast(cfg) and backends.get(cfg.train.backend).sharded and dims.size("dp_shard_cp") > 1


def sequence_parallel(cfg: RunConfig, dims: ParallelDims) -> bool:
    """Whether the stream between sublayers is cut over tp (a pipeline stage passes plain tensors: never there)."""
    return cfg.parallel.sequence_parallel and dims.pp == 1


def block_input_bytes(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, tokens: int) -> float:
    """A block's input for `tokens` of this rank's tokens (1/tp of it under sequence parallel): fp32 (autocast leaves
    the residual stream fp32), 16-bit under FSDP2's mixed precision (the embedding's gathered 16-bit weight makes the
    stream 16-bit: a pipeline's traced first stage kept 64 MiB a block and micro-batch where fp32 counted 128)."""
    stream = 2 if fsdp_mixed(cfg, dims) else FP32
    return facts.shape.width / (dims.tp if sequence_parallel(cfg, dims) else 1) * tokens * stream


def per_token_bytes(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, machine: Machine, saved: int,
                    saved_autocast: AutocastActivations | None, linears: Callable[[str], bool] = lambda _: True
                    ) -> float:
    """Bytes per token that `saved` elements a block saves at tp = 1 (`saved_autocast` by dtype under autocast) come
    to on tp rank 0 (module docstring); `linears`: which of a block's linears belong to this part of it (their
    column-parallel inputs stay whole)."""
    if autocast(cfg) and saved_autocast:
        return _autocast_per_token(facts, cfg, dims, machine, saved_autocast, linears)
    kept_whole = (2 if sequence_parallel(cfg, dims) else 4) * facts.shape.width if dims.tp > 1 else 0
    return (kept_whole + (saved - kept_whole) / dims.tp) * FP32


def block_bytes(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, tokens: int, machine: Machine
                ) -> tuple[float, float]:
    """(bytes one dense block saves for one micro-batch of `tokens` on this rank, bytes of its input alone)."""
    shape = facts.shape
    per_token = per_token_bytes(facts, cfg, dims, machine, shape.activations_per_token, shape.autocast_activations)
    return per_token * tokens, block_input_bytes(facts, cfg, dims, tokens)


def _autocast_per_token(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, machine: Machine,
                        saved: AutocastActivations, linears: Callable[[str], bool]) -> float:
    """Bytes per token under autocast on tp rank 0: the inputs of column-parallel linears are whole on every tp rank
    (replicated, or gathered under sequence parallel), all else the plan shards is divided by tp; the fp32 part is
    sharded only by sequence parallel. With 16-bit weights (FSDP2's mixed precision) the linears of one module share
    their input, else each keeps its own cast."""
    sixteen_bit_weights = fsdp_mixed(cfg, dims)
    fp32, low = ((saved.fp32_16bit_weights, saved.low_16bit_weights) if sixteen_bit_weights
                 else (saved.fp32, saved.low))
    column_inputs: dict[str, int] = {}  # by the module the linear sits in, or by the linear
    if dims.tp > 1:
        for name, shape in _first_block_linears(facts):
            if linears(name) and tp_local_shape(name + ".weight", shape, dims.tp)[0] != shape[0]:  # column
                column_inputs[name.rpartition(".")[0] if sixteen_bit_weights else name] = shape[1]
    whole = sum(column_inputs.values())
    low_local = whole + (low - whole) / dims.tp
    fp32_local = fp32 / dims.tp if sequence_parallel(cfg, dims) else fp32
    attention_bytes = FP32 if machine.cpu else 2
    return fp32_local * FP32 + low_local * 2 + saved.attention / dims.tp * attention_bytes


def _first_block_linears(facts: ModelFacts) -> list[tuple[str, tuple[int, int]]]:
    prefix = f"{facts.split.blocks}.0." if facts.split else ""
    return [(n, s) for n, s in facts.linears if n.startswith(prefix)] if prefix else []


def op_block_bytes(facts: ModelFacts, cfg: RunConfig, dims: ParallelDims, tokens: int, machine: Machine,
                   layer: int = 0, rows: float = 0.0) -> float:
    """What block `layer` keeps under op-level checkpointing (parallel/checkpointing.py's `op`) for one micro-batch of
    `tokens` on this rank: its input, every matmul's output (each linear's: a column-parallel one's cut over tp, a
    row-parallel one's whole, as its local matmul makes it before the reduction) and attention's output and
    log-sum-exp (cut over tp); an MoE block's experts besides keep their grouped GEMMs' outputs (gate, up: the
    expert's hidden width, cut over tp; down: the width) for each of the `rows` routed rows. Matmul outputs are 16-bit under
    autocast; attention's output is in the dtype attention runs in, its log-sum-exp fp32. Exact at tp = 1, fp32 and
    bf16 autocast, against autograd's saved tensors and the checkpoint's cache
    (tests/unit/test_activation_checkpointing.py); under fsdp × tp2 within 1% of the peak measured."""
    shape = facts.shape
    low = 2 if autocast(cfg) else FP32
    prefix = f"{facts.split.blocks}.{layer}." if facts.split else ""
    outputs = sum(tp_local_shape(name + ".weight", out_in, dims.tp)[0]
                  for name, out_in in facts.linears if prefix and name.startswith(prefix))
    attention = shape.width / dims.tp * (FP32 if machine.cpu or not autocast(cfg) else 2) + shape.heads / dims.tp * FP32
    hidden = chunk(shape.moe.hidden, dims.tp) if shape.moe else 0  # under tp each rank's slice of every expert
    experts = rows * (2 * hidden + shape.width) * low if shape.moe and layer in shape.moe.layers else 0.0
    return (outputs * low + attention) * tokens + experts + block_input_bytes(facts, cfg, dims, tokens)
