"""The pure arithmetic of pipeline layouts: which blocks each stage gets, which stages each rank holds."""

import re

import pytest
import torch

from meshtrain.parallel.pipeline_schedules import (
    SCHEDULES,
    PipelineError,
    check_schedule,
    schedule_class,
    split_layers,
    stage_ids,
)


@pytest.mark.parametrize("n_layer,n_stages,embed,head,expected", [
    (4, 2, 1.0, 1.0, [[0, 1], [2, 3]]),
    (4, 4, 1.0, 1.0, [[0], [1], [2], [3]]),
    (6, 2, 0.0, 0.0, [[0, 1, 2], [3, 4, 5]]),
    (5, 2, 0.0, 0.0, [[0, 1, 2], [3, 4]]),  # halves round up: the extra block goes first
    # 12 blocks + 2 of embedding/head over 4 stages: 3.5 each, so the end stages get fewer blocks
    (12, 4, 1.0, 1.0, [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9], [10, 11]]),
    (8, 3, 0.0, 3.0, [[0, 1, 2, 3], [4, 5, 6], [7]]),  # a heavy head: the last stage keeps one block
    (8, 3, 3.0, 0.0, [[0], [1, 2, 3], [4, 5, 6, 7]]),  # a heavy embedding: the first stage keeps one block
    (2, 2, 5.0, 0.0, [[0], [1]]),  # however heavy, every stage keeps at least one block
    (3, 1, 1.0, 1.0, [[0, 1, 2]]),
])
def test_split_layers(n_layer, n_stages, embed, head, expected):
    split = split_layers(n_layer, n_stages, embed_weight=embed, head_weight=head)
    assert split == expected
    assert [i for stage in split for i in stage] == list(range(n_layer))


def test_split_layers_balances_work():
    split = split_layers(24, 4, embed_weight=2.0, head_weight=2.0)  # 28 units of work, 7 per stage
    work = [len(s) for s in split]
    work[0] += 2
    work[-1] += 2
    assert work == [7, 7, 7, 7]


@pytest.mark.parametrize("kwargs,message", [
    (dict(n_layer=2, n_stages=4), "2 blocks cannot fill 4 pipeline stages"),
    (dict(n_layer=0, n_stages=1), "n_layer must be a positive integer"),
    (dict(n_layer=4, n_stages=0), "n_stages must be a positive integer"),
    (dict(n_layer=4, n_stages=2, embed_weight=-1.0), "embed_weight must be a finite number >= 0"),
    (dict(n_layer=4, n_stages=2, head_weight=float("inf")), "head_weight must be a finite number >= 0"),
])
def test_split_layers_errors(kwargs, message):
    with pytest.raises(PipelineError, match=message):
        split_layers(**kwargs)


@pytest.mark.parametrize("schedule,pp,virtual,expected", [
    ("gpipe", 4, 1, [[0], [1], [2], [3]]),
    ("1f1b", 2, 1, [[0], [1]]),
    ("interleaved_1f1b", 2, 2, [[0, 2], [1, 3]]),
    ("looped_bfs", 4, 2, [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("interleaved_zero_bubble", 2, 3, [[0, 2, 4], [1, 3, 5]]),
    ("zbv_zero_bubble", 2, 2, [[0, 3], [1, 2]]),
    ("dualpipev", 4, 2, [[0, 7], [1, 6], [2, 5], [3, 4]]),
])
def test_stage_ids(schedule, pp, virtual, expected):
    held = [stage_ids(r, pp, virtual, schedule) for r in range(pp)]
    assert held == expected
    assert sorted(s for stages in held for s in stages) == list(range(pp * virtual))


@pytest.mark.parametrize("args,message", [
    ((0, 2, 2, "1f1b"), "schedule '1f1b' runs one stage per rank, got virtual_stages=2"),
    ((0, 2, 1, "zbv_zero_bubble"), "schedule 'zbv_zero_bubble' places exactly 2 stages per rank in a V, got "
                                   "virtual_stages=1"),
    ((0, 2, 3, "dualpipev"), "virtual_stages=3: use virtual_stages=2"),
    ((2, 2, 1, "gpipe"), "pp rank 2 is outside the pipeline's 2 ranks"),
    ((0, 2, 0, "looped_bfs"), "virtual_stages must be a positive integer"),
    ((0, 2, 1, "pipedream"), "unknown pipeline schedule 'pipedream': choose one of gpipe, 1f1b"),
])
def test_stage_ids_errors(args, message):
    with pytest.raises(PipelineError, match=message):
        stage_ids(*args)


@pytest.mark.parametrize("args,message", [
    (("1f1b", 4, 1, 3), "needs at least as many microbatches as stages: got microbatches=3 for 4 stages; "
                        "use microbatches >= 4"),
    (("dualpipev", 2, 2, 3), "got microbatches=3 for 4 stages"),
    (("interleaved_1f1b", 2, 2, 5), "microbatches=5 is not; use a multiple of 2"),
    (("gpipe", 2, 1, 0), "microbatches must be a positive integer, got 0"),
])
def test_check_schedule_errors(args, message):
    with pytest.raises(PipelineError, match=message):
        check_schedule(*args)


@pytest.mark.parametrize("args", [("gpipe", 4, 1, 1), ("1f1b", 2, 1, 2), ("interleaved_1f1b", 2, 2, 6),
                                  ("interleaved_1f1b", 4, 2, 2), ("zbv_zero_bubble", 2, 2, 1),
                                  ("dualpipev", 2, 2, 4), ("looped_bfs", 2, 3, 3)])
def test_check_schedule_accepts(args):
    check_schedule(*args)


def test_every_schedule_maps_to_a_torch_class_or_a_clear_error(monkeypatch):
    from torch.distributed.pipelining import schedules

    for ours, theirs in SCHEDULES.items():
        assert schedule_class(ours).__name__ == "Schedule" + theirs
    # An older torch without DualPipeV: the error names the version and what is available.
    real = schedules.get_schedule_class

    def without_dualpipev(name):
        if name.lower() == "dualpipev":
            raise ValueError(f"Unknown schedule name '{name}'")
        return real(name)

    monkeypatch.setattr(schedules, "get_schedule_class", without_dualpipev)
    expected = (re.escape(f"needs torch's DualPipeV, which torch {torch.__version__} does not have: upgrade torch "
                          "or choose one of gpipe, 1f1b, ") + ".*zbv_zero_bubble$")
    with pytest.raises(PipelineError, match=expected):
        schedule_class("dualpipev")
