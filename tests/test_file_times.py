"""What tests/conftest.py reports about a run: the per-file time report (how it sums the reports and orders the files;
a report only, no hook of it sees the exit status) and the logs scripts/gpu_suite.sh asks for, written as the run goes.
"""

from types import SimpleNamespace

import conftest
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



def test_failures_and_test_seconds_are_logged_as_they_happen(tmp_path, monkeypatch):
    """A failed report appends its id and crash message at once, passes add nothing; each test's seconds are written
    when its teardown ends; without the variables nothing is written, and on a pytest-xdist worker nothing either (the
    controller, which sees the same reports, writes them once)."""
    failures, seconds = tmp_path / "failures.txt", tmp_path / "seconds.txt"
    crash = SimpleNamespace(message="AssertionError: rms rel err 3e-02 > 1e-05\n  (torch.float32)")
    failed = SimpleNamespace(failed=True, nodeid="tests/test_x.py::test_y[a]", when="call", duration=1.5,
                             longrepr=SimpleNamespace(reprcrash=crash))
    passed = [SimpleNamespace(failed=False, nodeid="tests/test_x.py::test_z", when=when, duration=duration,
                              longrepr=None) for when, duration in (("setup", 0.25), ("call", 2.0), ("teardown", 0.5))]
    for name in ("MOE_DISPATCH_FAILURE_LOG", "MOE_DISPATCH_TIMES_LOG", "PYTEST_XDIST_WORKER"):
        monkeypatch.delenv(name, raising=False)  # a suite run's own logs stay out of this test
    conftest.pytest_runtest_logreport(failed)
    assert not failures.exists() and not seconds.exists()
    monkeypatch.setenv("MOE_DISPATCH_FAILURE_LOG", str(failures))
    monkeypatch.setenv("MOE_DISPATCH_TIMES_LOG", str(seconds))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    conftest.pytest_runtest_logreport(failed)
    assert not failures.exists() and not seconds.exists()
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    for report in passed[:2]:
        conftest.pytest_runtest_logreport(report)
    assert not seconds.exists()  # not before the teardown
    conftest.pytest_runtest_logreport(passed[2])
    conftest.pytest_runtest_logreport(failed)
    assert failures.read_text() == ("tests/test_x.py::test_y[a] (call): AssertionError: rms rel err 3e-02 > 1e-05 "
                                    "(torch.float32)\n")
    assert seconds.read_text() == "    2.75 tests/test_x.py::test_z\n"
