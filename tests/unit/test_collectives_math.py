"""The arithmetic behind `meshtrain collectives`: bus-bandwidth factors, size sweeps, formatting."""

from __future__ import annotations

import argparse

import pytest

from meshtrain.runtime.collectives import (
    BENCH_OPS,
    adapt_iterations,
    bus_bandwidth_factor,
    element_count,
    fmt_sig,
    human_bytes,
    parse_bytes,
    sweep_sizes,
)

# nccl-tests' PERFORMANCE.md, worked out by hand for n = 1, 2, 4, 8.
ANALYTIC = {
    "all_reduce": {1: 0.0, 2: 1.0, 4: 1.5, 8: 1.75},  # 2(n-1)/n
    "all_gather": {1: 0.0, 2: 0.5, 4: 0.75, 8: 0.875},  # (n-1)/n
    "reduce_scatter": {1: 0.0, 2: 0.5, 4: 0.75, 8: 0.875},
    "all_to_all": {1: 0.0, 2: 0.5, 4: 0.75, 8: 0.875},
    "broadcast": {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0},
    "reduce": {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0},
}


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("op", sorted(ANALYTIC))
def test_bus_bandwidth_factor_matches_nccl_tests(op, n):
    assert bus_bandwidth_factor(op, n) == pytest.approx(ANALYTIC[op][n], abs=1e-12)


def test_every_bench_op_has_a_factor():
    assert set(BENCH_OPS) == set(ANALYTIC)


def test_bus_bandwidth_factor_rejects_nonsense():
    with pytest.raises(ValueError):
        bus_bandwidth_factor("all_reduce", 0)
    with pytest.raises(ValueError):
        bus_bandwidth_factor("barrier", 4)


def test_sweep_is_powers_of_two_from_min_to_max():
    assert sweep_sizes(8, 65536) == [8 << k for k in range(14)]
    assert sweep_sizes(8, 100) == [8, 16, 32, 64]  # stops below a max that is not on the grid
    assert sweep_sizes(4096, 4096) == [4096]
    assert sweep_sizes(8, 256 << 20)[-1] == 256 << 20 and len(sweep_sizes(8, 256 << 20)) == 26


@pytest.mark.parametrize("low, high", [(0, 8), (16, 8), (-1, 8)])
def test_sweep_rejects_bad_bounds(low, high):
    with pytest.raises(ValueError):
        sweep_sizes(low, high)


def test_element_count_splits_evenly_or_skips():
    assert element_count("all_reduce", 8, 4, 4) == 2  # no split: any count will do
    assert element_count("broadcast", 6, 4, 2) == 1
    assert element_count("all_gather", 8, 4, 2) == 2
    assert element_count("all_gather", 8, 4, 4) == 0  # 2 elements cannot give 4 ranks a part each
    assert element_count("reduce_scatter", 64, 4, 3) == 15  # rounded down to a multiple of n
    assert element_count("all_to_all", 65536, 2, 8) == 32768


@pytest.mark.parametrize("nbytes, text", [
    (0, "0 B"), (8, "8 B"), (1000, "1000 B"), (1023, "1023 B"), (1024, "1 KiB"), (1536, "1.5 KiB"),
    (65536, "64 KiB"), (60 << 10, "60 KiB"), (1 << 20, "1 MiB"), (256 << 20, "256 MiB"), (1 << 30, "1 GiB"),
    (3 << 40, "3 TiB"),
])
def test_human_bytes(nbytes, text):
    assert human_bytes(nbytes) == text


@pytest.mark.parametrize("text, nbytes", [
    ("65536", 65536), ("64K", 65536), ("64KiB", 65536), ("64 kb", 65536), ("256M", 256 << 20),
    ("1G", 1 << 30), ("1.5K", 1536), ("8", 8), ("8B", 8),
])
def test_parse_bytes(text, nbytes):
    assert parse_bytes(text) == nbytes


@pytest.mark.parametrize("text", ["", "lots", "64X", "-8", "1e6"])
def test_parse_bytes_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes(text)


def test_human_bytes_and_parse_bytes_round_trip():
    for nbytes in sweep_sizes(8, 1 << 30):
        assert parse_bytes(human_bytes(nbytes)) == nbytes


@pytest.mark.parametrize("x, text", [
    (0.0, "0"), (0.00002172, "0.00002172"), (1.0914, "1.091"), (0.9858, "0.9858"), (12.3456, "12.35"),
    (368.44, "368.4"), (1234.56, "1235"), (257799.2, "257799"),
])
def test_fmt_sig_keeps_four_significant_digits_without_exponent(x, text):
    assert fmt_sig(x) == text


def test_adapt_iterations():
    assert adapt_iterations(1e-4, 5, 20, 0.5) == (5, 20)  # small messages: as asked
    assert adapt_iterations(0.05, 5, 20, 0.5) == (5, 10)  # ten fit in the budget
    assert adapt_iterations(0.3, 5, 20, 0.5) == (1, 2)  # large ones: at least one warm-up and two timed
    assert adapt_iterations(10.0, 0, 20, 0.5) == (1, 2)  # the first call is always a warm-up
    assert adapt_iterations(1e-4, 5, 1, 0.5) == (5, 1)  # never more than asked for
