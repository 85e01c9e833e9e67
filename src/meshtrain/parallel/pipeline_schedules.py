"""Pipeline layout arithmetic, no processes: which blocks form each stage, which stages each pp rank
holds under each of torch's schedules, and whether a schedule can run a layout (torch's own rules,
stated with our names). parallel/pipeline.py builds and runs the pipeline from these answers. Plain arithmetic: torch is
imported only to find its schedule classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshtrain.errors import MeshtrainError

# Our config names -> the names torch's get_schedule_class knows.
SCHEDULES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved_1f1b": "Interleaved1F1B",
    "looped_bfs": "LoopedBFS",
    "interleaved_zero_bubble": "InterleavedZeroBubble",
    "zbv_zero_bubble": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}
SINGLE_STAGE = ("gpipe", "1f1b")  # one stage per rank
V_SHAPED = ("zbv_zero_bubble", "dualpipev")  # two stages per rank, the first and last on rank 0
SPLIT_BACKWARD = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")  # input and weight grads apart


@dataclass(frozen=True)
class StageSplit:
    """How a model comes apart into pipeline stages, by its own module paths. The model provides embed(idx,
    positions), logits(hidden) and, if its blocks take more than the hidden states, block_kwargs(positions)."""

    blocks: str  # the nn.ModuleDict of blocks "0".."L-1", e.g. "transformer.h"
    first: tuple[str, ...]  # the modules only the first stage holds (the embeddings)
    last: tuple[str, ...]  # the modules only the last stage holds (the final norm, the head)
    tied: tuple[str, str] | None = None  # (the last stage's parameter, the first stage's) that the model ties


class PipelineError(MeshtrainError, ValueError):
    """The pipeline layout does not fit the model, the mesh, the batch or this torch; the message says how."""


# ---- pure layout arithmetic -----------------------------------------------------------------------------
def split_layers(n_layer: int, n_stages: int, *, embed_weight: float = 1.0,
                 head_weight: float = 1.0) -> list[list[int]]:
    """Contiguous block indices for each stage, balancing blocks + embedding (stage 0) + head (last stage).

    Stage s ends where the cumulative work reaches (s + 1) / n_stages of the total, rounded to the nearest
    block (halves up), while every stage keeps at least one block.
    """
    for name, value in (("n_layer", n_layer), ("n_stages", n_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PipelineError(f"{name} must be a positive integer, got {value!r}")
    for name, value in (("embed_weight", embed_weight), ("head_weight", head_weight)):
        if not math.isfinite(value) or value < 0:
            raise PipelineError(f"{name} must be a finite number >= 0 (work in units of one block), got {value!r}")
    if n_layer < n_stages:
        raise PipelineError(f"{n_layer} blocks cannot fill {n_stages} pipeline stages (pp × virtual_stages): "
                            f"every stage needs at least one block; use at most {n_layer} stages")
    total = n_layer + embed_weight + head_weight
    ends, previous = [], 0
    for s in range(n_stages - 1):
        end = math.floor((s + 1) * total / n_stages - embed_weight + 0.5 + 1e-9)
        end = min(max(end, previous + 1), n_layer - (n_stages - 1 - s))
        ends.append(end)
        previous = end
    ends.append(n_layer)
    return [list(range(start, end)) for start, end in zip([0] + ends[:-1], ends, strict=True)]


def _check_name(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise PipelineError(f"unknown pipeline schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")


def _check_virtual_stages(schedule: str, virtual_stages: int) -> None:
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise PipelineError(f"virtual_stages must be a positive integer, got {virtual_stages!r}")
    if schedule in SINGLE_STAGE and virtual_stages != 1:
        raise PipelineError(f"schedule {schedule!r} runs one stage per rank, got virtual_stages={virtual_stages}: "
                            "use virtual_stages=1, or interleaved_1f1b / looped_bfs / interleaved_zero_bubble")
    if schedule in V_SHAPED and virtual_stages != 2:
        raise PipelineError(f"schedule {schedule!r} places exactly 2 stages per rank in a V, got "
                            f"virtual_stages={virtual_stages}: use virtual_stages=2")


def stage_ids(pp_rank: int, pp_size: int, virtual_stages: int, schedule: str) -> list[int]:
    """The global stage indices pp rank `pp_rank` holds, in pipeline order."""
    _check_name(schedule)
    _check_virtual_stages(schedule, virtual_stages)
    if not 0 <= pp_rank < pp_size:
        raise PipelineError(f"pp rank {pp_rank} is outside the pipeline's {pp_size} ranks")
    if schedule in V_SHAPED:  # down the ranks and back up: rank 0 holds the first and the last stage
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + i * pp_size for i in range(virtual_stages)]


def check_schedule(schedule: str, pp_size: int, virtual_stages: int, microbatches: int) -> None:
    """Raise PipelineError if `schedule` cannot run this layout (torch's rules, stated with our names)."""
    _check_name(schedule)
    _check_virtual_stages(schedule, virtual_stages)
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise PipelineError(f"microbatches must be a positive integer, got {microbatches!r}")
    n_stages = pp_size * virtual_stages
    if schedule == "1f1b" and microbatches < n_stages or schedule == "dualpipev" and microbatches < n_stages:
        raise PipelineError(f"schedule {schedule!r} needs at least as many microbatches as stages: got "
                            f"microbatches={microbatches} for {n_stages} stages; use microbatches >= {n_stages}")
    if schedule in ("interleaved_1f1b", "interleaved_zero_bubble"):
        rounds = max(1, microbatches // pp_size)
        if microbatches % rounds:
            raise PipelineError(f"schedule {schedule!r} runs microbatches in rounds of pp={pp_size}: "
                                f"microbatches={microbatches} is not; use a multiple of {pp_size} "
                                f"(or fewer than {pp_size})")


def schedule_class(schedule: str) -> type:
    """torch's class for one of our schedule names, or a clear error if this torch lacks it."""
    _check_name(schedule)
    import torch  # here, not at the top: a model's spec imports this module, and `launch` reads specs without torch
    from torch.distributed.pipelining import schedules

    try:
        return schedules.get_schedule_class(SCHEDULES[schedule])
    except (ValueError, KeyError, AttributeError):
        available = []
        for ours, theirs in SCHEDULES.items():
            try:
                schedules.get_schedule_class(theirs)
                available.append(ours)
            except (ValueError, KeyError, AttributeError):
                pass
        raise PipelineError(f"pipeline schedule {schedule!r} needs torch's {SCHEDULES[schedule]}, which torch "
                            f"{torch.__version__} does not have: upgrade torch or choose one of "
                            f"{', '.join(available)}") from None
