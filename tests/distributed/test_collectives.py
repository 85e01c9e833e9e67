"""`meshtrain collectives` on real process groups (torchrun / mpirun, gloo on CPU), and its checker."""

from __future__ import annotations

import re
import sys
import textwrap

import pytest
import torch
from tests import preloaded
from tests.conftest import ANSI, REPO, clean_env, fork_ranks, forked_cmd, mpirun, requires_mpirun

from meshtrain.runtime.collectives import (
    BENCH_OPS,
    DEMO_CASES,
    bus_bandwidth_factor,
    check_result,
    demo_expected,
    demo_input,
    human_bytes,
    sweep_sizes,
)


def _rows(stdout: str, ncells: int) -> list[list[str]]:
    """Body rows of the rich tables in `stdout` that have `ncells` cells."""
    rows = []
    for line in ANSI.sub("", stdout).splitlines():
        line = line.strip()
        if line.startswith("│") and line.endswith("│"):
            cells = [cell.strip() for cell in line[1:-1].split("│")]
            if len(cells) == ncells:
                rows.append(cells)
    return rows


def _demo_rows(stdout: str) -> dict[tuple[str, int], tuple[str, str, str]]:
    """(case, rank) -> (before, after, check) from the demo's table."""
    table, case = {}, None
    for label, rank, before, after, check in _rows(stdout, 5):
        if label:
            case = re.sub(r" \(\d+\)$", "", label)  # drop the footnote mark
        table[(case, int(rank))] = (before, after, check)
    return table


def _show(t: torch.Tensor | None) -> str:
    return "—" if t is None else "[" + " ".join(f"{v:g}" for v in t.tolist()) + "]"


def _assert_demo_passed(result, n: int) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"collectives demo: {len(DEMO_CASES)}/{len(DEMO_CASES)} passed on {n} ranks (gloo)" in result.stdout
    assert "ERROR" not in result.stdout and "WRONG" not in result.stdout
    table = _demo_rows(result.stdout)
    assert set(table) == {(case, r) for case in DEMO_CASES for r in range(n)}, result.stdout
    for (case, r), (before, after, check) in table.items():
        assert check == "ok", (case, r)
        want = demo_expected(case, r, n)
        if want is not None:  # the picture shows the analytic answer, not just "ok"
            assert after == _show(want), (case, r, after)
        if case != "scatter(from 0)" or r == 0:
            assert before == _show(demo_input(r, n)), (case, r, before)


@pytest.mark.parametrize("n", [4])  # 2 ranks: README's `meshtrain launch -- … collectives --demo` (test_docs_run.py)
def test_demo_passes_and_shows_every_collective(n):
    _assert_demo_passed(fork_ranks(n, "collectives", "--demo"), n)


def test_demo_runs_as_one_plain_process():
    """No launcher at all: a world of one, where every collective is the identity (and the ring is empty)."""
    result = preloaded.run([sys.executable, "-m", "meshtrain", "collectives", "--demo"], env=clean_env(), cwd=REPO,
                           timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "collectives demo: 12/12 passed on 1 rank (gloo)" in result.stdout
    assert "send/recv ring: one rank: nothing to send" in result.stdout


def test_demo_fallbacks_are_right_on_three_ranks():
    """The hand-built AVG, reduce_scatter and all_to_all (for backends without them) on a world that is
    not a power of two."""
    result = fork_ranks(3, "collectives", "--demo", "--force-fallbacks")
    _assert_demo_passed(result, 3)
    assert "hand-built fallback for avg, reduce_scatter, all_to_all (forced)" in result.stdout
    assert "fallback: one scatter from each rank in turn" in result.stdout


def test_demo_fails_when_a_rank_gets_a_wrong_answer(tmp_path):
    """Corrupt rank 1's all_to_all result inside a real run: every rank must exit non-zero, naming it."""
    script = tmp_path / "wrong_demo.py"
    script.write_text(textwrap.dedent("""
        import sys

        from meshtrain import commands
        from meshtrain.runtime import collectives

        real = collectives._demo_case

        def corrupted(case, x, rank, n, native):
            after, note = real(case, x, rank, n, native)
            if case == "all_to_all" and rank == 1:
                after = after + 1
            return after, note

        collectives._demo_case = corrupted
        sys.exit(commands.main(["collectives", "--demo"]))
    """))
    result = preloaded.run(forked_cmd(2, str(script)), env=clean_env(), cwd=REPO, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "collectives demo: 11/12 passed on 2 ranks (gloo); wrong: all_to_all on rank(s) 1" in out
    assert "all_to_all: rank 1 holds [3 4 13 14], expected [2 3 12 13]" in out  # rank 1's own warning
    table = _demo_rows(result.stdout)
    assert table[("all_to_all", 1)][2] == "WRONG" and table[("all_to_all", 0)][2] == "ok"


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_checker_accepts_right_and_rejects_wrong_results(n):
    for case in DEMO_CASES:
        for rank in range(n):
            want = demo_expected(case, rank, n)
            if want is None:  # nothing defined on this rank: anything passes
                assert check_result(case, rank, n, None)
                continue
            assert check_result(case, rank, n, want.clone())
            wrong = want.clone()
            wrong[-1] += 1
            assert not check_result(case, rank, n, wrong), (case, rank)
            assert not check_result(case, rank, n, torch.cat([want, want])), (case, rank)  # wrong shape
            assert not check_result(case, rank, n, None), (case, rank)


def test_expected_values_are_the_analytic_ones():
    # Rank r holds [10r, 10r+1, 10r+2, 10r+3] on 4 ranks; the answers below are worked out by hand.
    assert demo_expected("all_reduce(SUM)", 2, 4).tolist() == [60, 64, 68, 72]
    assert demo_expected("all_reduce(MIN)", 2, 4).tolist() == [0, 1, 2, 3]
    assert demo_expected("all_reduce(MAX)", 0, 4).tolist() == [30, 31, 32, 33]
    assert demo_expected("all_reduce(AVG)", 1, 4).tolist() == [15, 16, 17, 18]
    assert demo_expected("reduce(SUM, to 0)", 1, 4) is None
    assert demo_expected("reduce_scatter(SUM)", 3, 4).tolist() == [72]
    assert demo_expected("all_to_all", 1, 4).tolist() == [1, 11, 21, 31]
    assert demo_expected("scatter(from 0)", 2, 4).tolist() == [2]
    assert demo_expected("send/recv ring", 0, 4).tolist() == [30, 31, 32, 33]  # from rank n-1
    # On 2 ranks each holds 4 numbers, 2 for each destination.
    assert demo_expected("all_to_all", 0, 2).tolist() == [0, 1, 10, 11]
    assert demo_expected("reduce_scatter(SUM)", 1, 2).tolist() == [14, 16]


def test_bench_reports_every_size_of_every_op_with_nccl_tests_bandwidths():
    n = 2
    result = fork_ranks(n, "collectives", "--bench", "--max-bytes", "65536", "--iters", "3", "--warmup", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    tables, op = {}, None
    for line in result.stdout.splitlines():
        title = re.match(r"(\w+): busbw = algbw × \S+ = ([\d.]+)", line.strip())
        if title:
            op = title[1]
            assert float(title[2]) == pytest.approx(bus_bandwidth_factor(op, n))
            tables[op] = []
        elif op and len(cells := _rows(line, 6)) == 1:
            tables[op].append(cells[0])
    assert list(tables) == list(BENCH_OPS)
    sizes = [human_bytes(b) for b in sweep_sizes(8, 65536)]
    assert sizes[0] == "8 B" and sizes[-1] == "64 KiB"
    for op, rows in tables.items():
        assert [row[0] for row in rows] == sizes, op
        factor = bus_bandwidth_factor(op, n)
        for (size, count, iters, time_us, algbw, busbw), nbytes in zip(rows, sweep_sizes(8, 65536), strict=True):
            assert int(count) == nbytes // 4  # float32
            assert 2 <= int(iters) <= 3
            alg, bus = float(algbw), float(busbw)
            assert alg > 0
            # Both are printed to 4 significant digits: each off by at most half a unit in the 4th.
            assert bus == pytest.approx(alg * factor, rel=1.5e-3), (op, size)
            assert alg == pytest.approx(nbytes / (float(time_us) * 1e-6) / 1e9, rel=1.5e-3), (op, size)
        assert re.search(rf"\] {op} +peak busbw [\d.]+ GB/s at [\d.]+ (B|KiB)", result.stdout), op
    assert f"collectives bench: {len(BENCH_OPS)} op(s) × {len(sizes)} size(s) on 2 rank(s) (gloo)" in result.stdout


def test_bench_skips_ops_without_a_native_collective():
    result = fork_ranks(2, "collectives", "--bench", "--ops", "all_reduce,all_to_all", "--force-fallbacks",
                      "--max-bytes", "64", "--iters", "2", "--warmup", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "skipping all_to_all: --force-fallbacks" in result.stdout
    assert "all_reduce: busbw" in result.stdout and "all_to_all: busbw" not in result.stdout
    assert [row[0] for row in _rows(result.stdout, 6)] == ["8 B", "16 B", "32 B", "64 B"]


def test_unknown_op_is_refused_before_any_process_group(capsys):
    from meshtrain.commands import main

    assert main(["collectives", "--bench", "--ops", "all_reduce,scatter"]) == 2  # scatter: demo only
    assert "unknown op(s) scatter" in capsys.readouterr().err


@requires_mpirun
@pytest.mark.mpi
def test_demo_under_mpirun():
    result = mpirun(2, "collectives", "--demo")
    _assert_demo_passed(result, 2)
    assert ["launcher", "openmpi"] in _rows(result.stdout, 2)  # really ranks of mpirun, not torchrun
