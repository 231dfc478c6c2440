"""The per-file time budget of the interpreter suite (tests/conftest.py): how it sums the reports, when it is on, and
that a file past it fails a passing run and is named, while a run already failing keeps its own status."""

from types import SimpleNamespace

import pytest
from conftest import FILE_BUDGET_S, FILE_BUDGET_VARIABLE, FileTimes, file_budget_s


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
    assert times.over(100) == [("tests/test_c.py", 200.0), ("tests/test_a.py", 111.5)]
    assert times.over(200) == []  # at the budget is within it


def test_a_file_past_the_budget_fails_a_passing_session_and_is_named():
    times = _times(("tests/test_a.py::test_x", 151.0), ("tests/test_b.py::test_y", 20.0))
    session = SimpleNamespace(exitstatus=pytest.ExitCode.OK)
    lines = times.judge(session, 150.0)
    assert session.exitstatus == pytest.ExitCode.TESTS_FAILED
    assert [line for line in lines if line.startswith("FAILED")] == [
        "FAILED: tests/test_a.py took 151.0 s, past the 150 s budget of a test file"]
    assert FILE_BUDGET_VARIABLE in lines[-1]
    failing = SimpleNamespace(exitstatus=pytest.ExitCode.INTERRUPTED)  # another status is kept
    times.judge(failing, 150.0)
    assert failing.exitstatus == pytest.ExitCode.INTERRUPTED
    within = SimpleNamespace(exitstatus=pytest.ExitCode.OK)
    assert not any(line.startswith("FAILED") for line in times.judge(within, 160.0))
    assert within.exitstatus == pytest.ExitCode.OK
    assert times.judge(within, None) == [] and within.exitstatus == pytest.ExitCode.OK


def test_the_budget_is_on_in_interpreter_runs_only_and_the_variable_sets_it():
    interpreted = {"TRITON_INTERPRET": "1"}
    assert file_budget_s(interpreted) == FILE_BUDGET_S
    assert file_budget_s({**interpreted, FILE_BUDGET_VARIABLE: "300"}) == 300.0
    assert file_budget_s({**interpreted, FILE_BUDGET_VARIABLE: "0"}) is None
    assert file_budget_s({}) is None and file_budget_s({"TRITON_INTERPRET": "0"}) is None  # a GPU run
    with pytest.raises(pytest.UsageError, match=FILE_BUDGET_VARIABLE):
        file_budget_s({**interpreted, FILE_BUDGET_VARIABLE: "fast"})
