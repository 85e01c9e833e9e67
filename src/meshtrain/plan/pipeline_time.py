"""How long one pass of a pipeline schedule takes, played out action by action.

Each pipeline rank runs its forwards (F) and backwards (B) in the fixed order torch's schedule gives it and waits
where an action's input has not arrived: F of stage j for a micro-batch after F of stage j - 1, B after B of stage
j + 1 (the last stage's B after its own F). On devices of their own the result is the textbook bubble,
(pp - 1) / (microbatches × virtual stages) of the work (tests/unit/test_pipeline_time.py). Where ranks share
cores (a CPU node running more ranks than it has cores), a rank waiting for its input leaves its cores to the
others, so the busy ones run faster: with k of the pp stages busy a rank runs max(1, slowdown × k / pp) times
slower than alone, the calibrated slowdown (all ranks busy) scaled by the share of ranks that want the cores.
Every other mesh dimension runs in step with its stage. Sends are priced apart (cost.py's pp communication).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.parallel.pipeline_schedules import V_SHAPED, stage_ids

Action = tuple[bool, int, int]  # (is_forward, global stage, micro-batch)


@dataclass(frozen=True)
class PipelineTime:
    """One pass of the schedule (one micro-step's micro-batches), in seconds."""

    makespan: float  # from the first forward to the last backward
    busy: float  # the busiest rank's time at work; makespan - busy is its bubble


def rank_order(schedule: str, pp: int, virtual: int, microbatches: int, rank: int) -> list[Action]:
    """The order pipeline rank `rank` runs its actions in. GPipe and looped BFS: every forward, then every backward;
    1F1B: pp - rank forwards, then a backward before each further forward; interleaved and the zero-bubble
    schedules: micro-batches in rounds, each round through the rank's chunks ((v - 1)·round + 2·(pp - 1 - rank)
    forwards first), then one forward and one backward in turn (plan/backward.starts reads the micro-batches held and
    the blocks gathered at each backward from this order). The zero-bubble schedules' split backward is played as one
    backward (their bubble is smaller than this counts)."""
    chunks = stage_ids(rank, pp, virtual, schedule)
    per_round = microbatches // max(1, microbatches // pp) if virtual > 1 else microbatches
    forwards, backwards = [], []
    for start in range(0, microbatches, per_round):
        batch = range(start, min(start + per_round, microbatches))
        forwards += [(True, stage, m) for stage in chunks for m in batch]
        backwards += [(False, stage, m) for stage in reversed(chunks) for m in batch]
    if schedule in ("gpipe", "looped_bfs"):
        return forwards + backwards
    if schedule == "1f1b":
        warm = min(microbatches, pp - rank)
    else:
        warm = min(len(forwards), (virtual - 1) * per_round + 2 * (pp - 1 - rank) + 1)
    order = forwards[:warm]
    for forward, backward in zip(forwards[warm:], backwards, strict=False):
        order += [backward, forward]
    return order + backwards[len(forwards) - warm:]


def pipeline_time(schedule: str, pp: int, virtual: int, microbatches: int, forward_s: float, backward_s: float,
                  slowdown: float = 1.0) -> PipelineTime:
    """Play the schedule: `forward_s` and `backward_s` are one micro-batch's time on one rank's whole share of
    blocks, alone on its cores (a chunk takes 1/virtual of it); `slowdown` is how much slower every rank runs when
    all of them are busy."""
    todo = [rank_order(schedule, pp, virtual, microbatches, r) for r in range(pp)]
    last = pp * virtual - 1
    done: set[Action] = set()
    running: list[Action | None] = [None] * pp
    left, busy, now = [0.0] * pp, [0.0] * pp, 0.0  # left: seconds of work (alone) left of the running action

    def ready(action: Action) -> bool:
        forward, stage, m = action
        if forward:
            return stage == 0 or (True, stage - 1, m) in done
        return (False, stage + 1, m) in done if stage < last else (True, stage, m) in done

    def pick(actions: list[Action]) -> Action | None:
        if schedule not in V_SHAPED:  # a fixed order: the next action or nothing
            return actions[0] if actions and ready(actions[0]) else None
        # The V's own order is not modelled: its ranks take a ready backward first, else a ready forward.
        return next((a for a in actions if not a[0] and ready(a)), None) or next(
            (a for a in actions if a[0] and ready(a)), None)

    while True:
        for r in range(pp):  # start what can start
            if running[r] is None and (action := pick(todo[r])) is not None:
                todo[r].remove(action)
                running[r], left[r] = action, (forward_s if action[0] else backward_s) / virtual
        working = [r for r in range(pp) if running[r] is not None]
        if not working:
            if any(todo):
                raise RuntimeError(f"pipeline schedule {schedule} deadlocks in this model's order: pp={pp}, "
                                   f"virtual={virtual}, microbatches={microbatches}")
            return PipelineTime(makespan=now, busy=max(busy))
        slower = max(1.0, slowdown * len(working) / pp)
        step = min(left[r] for r in working)  # until the first of them finishes, in seconds of work alone
        now += step * slower
        for r in working:
            busy[r] += step * slower
            left[r] -= step
            if left[r] <= 1e-12 * step:
                done.add(running[r])
                running[r] = None
