"""The per-file time report of the suite (tests/conftest.py): how it sums the reports and orders the files. It is a
report only (pytest_terminal_summary prints it; no hook of it sees the exit status)."""

from types import SimpleNamespace

from conftest import FileTimes


def _times(*reports):
    times = FileTimes()
    for nodeid, duration in reports:
        times.add(SimpleNamespace(nodeid=nodeid, duration=duration))
    return times


def test_durations_sum_per_file_over_setup_call_and_teardown():
    times = _times(("tests/test_a.py::test_x[1]", 1.0), ("tests/test_a.py::test_x[1]", 40.0),
                   ("tests/test_a.py::test_x[1]", 0.5), ("tests/test_a.py::test_y", 70.0),
                   ("tests/test_b.py::test_z", 90.0), ("tests/test_c.py::Group::test_w", 200.0))
    assert times.seconds == {"tests/test_a.py": 111.5, "tests/test_b.py": 90.0, "tests/test_c.py": 200.0}


def test_slowest_files_first_and_the_sum_of_all():
    """Slowest first, ties by name, cut at the count asked for; the last line sums every file, the cut ones too."""
    times = _times(("tests/test_b.py::t", 5.0), ("tests/test_a.py::t", 5.0), ("tests/test_c.py::t", 9.0),
                   ("tests/test_d.py::t", 1.0))
    assert times.slowest(3) == [("tests/test_c.py", 9.0), ("tests/test_a.py", 5.0), ("tests/test_b.py", 5.0)]
    lines = times.report_lines(2)
    assert [line.split()[-1] for line in lines[:2]] == ["tests/test_c.py", "tests/test_a.py"]
    assert lines[-1].split()[:2] == ["20.0", "s"] and "4 files" in lines[-1]
    assert _times().report_lines() == []

