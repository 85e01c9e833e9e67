"""Every pipeline schedule trains like one process on the whole batch, alone and under FSDP2 / DDP.

Each test is one torchrun launch of pipeline_check.py running several schedules (process-group set-up is
the slow part); the driver prints one "-> EQUAL" line per schedule per rank when loss, clipping norm,
gradients and parameters of everything the rank owns are within 1e-5 of the single-process reference.
"""

import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, clean_env, output

CHECK = str(Path(__file__).with_name("pipeline_check.py"))
ALL = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"]
# Lower case only: ranks print concurrently, and a line may follow another's "-> EQUAL" without a newline.
HOLDS = re.compile(r"([a-z0-9_]+@[a-z]+) rank (\d+) dp (\d+) holds (\d+) of (\d+) parameters")
EMBEDDING = 65 * 32  # vocab × n_embd: the second copy of the tied weight on the last stage


def run(ranks: int, *flags: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", CHECK, *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), cwd=REPO, timeout=240)
    text = output(out)
    assert out.returncode == 0, text[-4000:]
    return text


def assert_equal(text: str, cases: list[str], ranks: int) -> None:
    for case in cases:  # ranks print concurrently: a verdict may share a line with another rank's output
        verdicts = dict(re.findall(rf"{re.escape(case)} rank (\d+) \(pp rank[^\n]*?-> (EQUAL|DIFFERENT)", text))
        assert sorted(map(int, verdicts)) == list(range(ranks)), f"{case}: one verdict per rank\n{text[-3000:]}"
        assert set(verdicts.values()) == {"EQUAL"}, [line for line in text.splitlines() if case in line]


def held_per_replica(text: str, case: str) -> dict[int, int]:
    """dp replica -> parameters its pp ranks hold together beyond the whole model's (counted before sharding)."""
    held: dict[int, int] = {}
    for m in HOLDS.finditer(text):
        if m[1] == case:
            held[int(m[3])] = held.get(int(m[3]), 0) + int(m[4])
            whole = int(m[5])
    return {dp: total - whole for dp, total in held.items()}


def test_every_schedule_on_two_ranks_and_clear_errors():
    cases = [f"{schedule}@pp" for schedule in ALL]
    text = run(2, *cases, "--errors")
    assert_equal(text, cases, 2)
    for case in cases:  # each rank keeps only its stages: together the model plus one embedding copy
        assert held_per_replica(text, case) == {0: EMBEDDING}, case
    assert "error microbatches: schedule '1f1b' needs at least as many microbatches as stages: got " \
           "microbatches=1 for 2 stages" in text
    assert "error dualpipev: schedule 'dualpipev' needs at least as many microbatches as stages: got " \
           "microbatches=3 for 4 stages" in text
    assert "error layers: 4 blocks cannot fill 6 pipeline stages" in text
    assert "error virtual: schedule 'zbv_zero_bubble' places exactly 2 stages per rank" in text
    assert "error batch: batch of 6 sequences does not split into 4 microbatches" in text


def test_four_stages_and_ddp_over_dp2_times_pp2():
    cases = ["1f1b@pp", "1f1b@ddp", "looped_bfs@ddp"]  # pp=4; then pp=2 × dp=2 with DDP-wrapped stages
    text = run(4, *cases, "--errors")
    assert_equal(text, cases, 4)
    assert held_per_replica(text, "1f1b@pp") == {0: EMBEDDING}
    assert held_per_replica(text, "looped_bfs@ddp") == {0: EMBEDDING, 1: EMBEDDING}
    assert "error ddp: schedule 'zbv_zero_bubble' computes weight gradients outside autograd's backward" in text


def test_fsdp_over_dp2_times_pp2():
    cases = ["1f1b@fsdp", "interleaved_1f1b@fsdp", "zbv_zero_bubble@fsdp"]  # one-stage, looped, V + split backward
    text = run(4, *cases)
    assert_equal(text, cases, 4)
    for case in cases:  # before sharding, each replica's pp ranks hold the model once (+ embedding copy)
        assert held_per_replica(text, case) == {0: EMBEDDING, 1: EMBEDDING}, case
