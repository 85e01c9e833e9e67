"""tests/suite_cpu.py's table: the files and the tests that cost the most CPU, summed from the workers' rows."""

from __future__ import annotations

from tests.suite_cpu import summary


def test_the_summary_sums_each_files_tests_and_ranks_both_by_cpu():
    rows = [["tests/a.py::one", 10.0, 4.0], ["tests/b.py::two", 3.5, 30.0], ["tests/a.py::three", 1.5, 1.0]]
    lines = summary(rows, top=2).splitlines()
    assert lines[0] == "15 CPU s over 3 tests (35 s of their wall time)"
    assert lines[2].split() == ["11.5", "5.0", "tests/a.py"] and lines[3].split() == ["3.5", "30.0", "tests/b.py"]
    assert [line.split()[-1] for line in lines[5:]] == ["tests/a.py::one", "tests/b.py::two"]
