"""scripts/gpu_suite.sh on the CPU, with cheap stages: it exits non-zero when a stage fails, says which python it
runs, ends with its one-screen summary, and runs pytest on pytest-xdist workers (or in one process).

The pytest stage runs tiny test files written here (no GPU needed); the benchmarks are skipped, except where a
benchmark's failure is the point (an unknown flag makes scripts/bench.py exit 2 at once).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
needs_bash = pytest.mark.skipif(not os.path.exists("/bin/bash"), reason="needs bash")


def suite(tmp_path, **env):
    out = tmp_path / "out"
    # the knobs of an enclosing suite run (the GPU suite runs this file) must not reach the suite under test
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("SUITE_", "PYTEST_", "BENCH_ARGS"))}
    full_env = {**inherited, "OUT": str(out), "PYTHON": sys.executable, "SUITE_WHEELS": "0", "SUITE_BINNED": "0",
                "SUITE_BENCH": "0", **env}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_suite.sh")], cwd=ROOT, env=full_env,
                            capture_output=True, text=True, timeout=300)
    return result, out


def summary(stdout: str) -> dict[str, tuple[str, str]]:
    """stage -> (rc, result) of the summary table."""
    lines = stdout[stdout.index("== summary"):].splitlines()[2:]
    rows = {}
    for line in lines:
        if line.startswith("suite:"):
            break
        stage, rc, result = line[:22].strip(), line[22:27].strip(), line[29:]
        rows[stage] = (rc, result)
    return rows


def write_tests(folder: Path, **files: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, body in files.items():
        (folder / f"{name}.py").write_text(body)


PASS = "def test_passes():\n    pass\n"
FAIL = "def test_passes():\n    pass\n\n\ndef test_fails():\n    assert 1 == 2\n"


@needs_bash
def test_failing_stages_fail_the_suite_and_the_summary_says_which(tmp_path):
    """A failing test among files run on two workers, and a benchmark that fails: both stages named, the run red."""
    folder = tmp_path / "t"
    write_tests(folder, test_a=PASS, test_b=PASS, test_c=FAIL)
    result, out = suite(tmp_path, SUITE_TEST_PATHS=str(folder), SUITE_PYTEST_WORKERS="2", SUITE_BENCH="1",
                        BENCH_ARGS="--no-such-flag")
    assert result.returncode == 1, result.stdout + result.stderr
    rows = summary(result.stdout)
    assert rows["pytest"] == ("1", "FAILED: 1 failed, 3 passed (pytest.log)")
    rc, note = rows["benchmark (quick)"]
    assert rc == "2" and note.startswith("FAILED"), rows
    assert rows["environment"][0] == "0" and sys.executable in rows["environment"][1]
    assert f"python {sys.executable} ($PYTHON)" in result.stdout  # which python, and why
    assert "suite: FAILED (2 of" in result.stdout
    log = (out / "pytest.log").read_text()
    assert "test_c.py::test_fails" in log and "bringing up nodes" in log  # on xdist workers
    assert "== summary" in (out / "suite.log").read_text()


@needs_bash
def test_a_passing_run_exits_0(tmp_path):
    write_tests(tmp_path / "t", test_good=PASS)
    result, out = suite(tmp_path, SUITE_TEST_PATHS=str(tmp_path / "t"), SUITE_PYTEST_WORKERS="0")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = summary(result.stdout)
    assert rows["pytest"] == ("0", "ok: 1 passed")
    assert rows["benchmark"] == ("-", "skipped (SUITE_BENCH=0)") and "suite: passed" in result.stdout
    assert (out / "pytest.log").is_file()
