"""Test set-up: the package (torch-ext/, on pytest.ini's pythonpath), Triton's interpreter whenever there is no GPU."""

import collections
import os
import sys
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Collection draws random tensors (some parametrize ids show them): seeded, every process collects the same test ids,
# which pytest-xdist's workers must (scripts/test runs them); each test is seeded again from its id (_seed below).
torch.manual_seed(0)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402


def _strict_interpreter_launches():
    """Make the interpreter refuse launch keywords a GPU refuses. Triton's interpreter drops keyword arguments that a
    kernel does not declare, while a GPU launch raises on them: a launcher passing a constexpr its kernel lacks (the PDL
    flag once reached the persistent w8a8 kernel that way) passed the CPU suite and failed on the H200. Here a
    launch keyword must be a parameter of the kernel or a compile option of one of Triton's GPU backends."""
    import dataclasses
    import importlib

    from triton.runtime.interpreter import InterpretedFunction

    options = set()
    for module, name in (("triton.backends.nvidia.compiler", "CUDAOptions"), ("triton.backends.amd.compiler",
                                                                              "HIPOptions")):
        try:
            options |= {field.name for field in dataclasses.fields(getattr(importlib.import_module(module), name))}
        except (ImportError, AttributeError, TypeError):  # a Triton without that backend: its options stay unknown
            pass
    options |= {"num_warps", "num_stages", "num_ctas"}
    real_run = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        undeclared = sorted(set(kwargs) - set(self.arg_names) - options)
        if undeclared:
            raise TypeError(f"{self.fn.__name__} is launched with keyword arguments it does not declare: "
                            f"{undeclared} (a GPU launch raises on them; the interpreter would drop them)")
        return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run


if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    _strict_interpreter_launches()


def _load_from_hub_build():
    """MOE_DISPATCH_FROM=hub: build the variants with scripts/build, load the one for this machine through
    LOCAL_KERNELS + kernels.get_kernel(repo, version=1), and make it the `moe_dispatch` every test imports."""
    import subprocess
    import tempfile
    import tomllib

    with open(os.path.join(ROOT, "build.toml"), "rb") as f:
        repo_id = tomllib.load(f)["general"]["hub"]["repo-id"]
    out = tempfile.mkdtemp(prefix="moe-dispatch-build-")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "build"), "--out", out], check=True)
    os.environ["LOCAL_KERNELS"] = f"{repo_id}={out}"
    from kernels import get_kernel

    module = get_kernel(repo_id, version=1)
    for name in [n for n in sys.modules if n == module.__name__ or n.startswith(module.__name__ + ".")]:
        sys.modules["moe_dispatch" + name[len(module.__name__):]] = sys.modules[name]
    return f"moe_dispatch loaded with get_kernel({repo_id!r}, version=1) from {module.__file__}"


LOADED_FROM = _load_from_hub_build() if os.environ.get("MOE_DISPATCH_FROM") == "hub" else "moe_dispatch from torch-ext"

# After LOADED_FROM: helpers imports moe_dispatch.reference, under MOE_DISPATCH_FROM=hub the loaded build's.
from helpers import poison_empty  # noqa: E402,F401  (a fixture every test can ask for)


def pytest_report_header(config):
    return LOADED_FROM


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh random inputs for every test case, reproducible from its id."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _fresh_plans():
    """No test replays a plan another test recorded: tests patch module attributes and functions a path reads
    (tiles, dispatch limits, spies), which a plan's key does not see (moe_dispatch.host.replay)."""
    import moe_dispatch

    moe_dispatch.host.replay.clear()
    yield
    moe_dispatch.host.replay.clear()


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """On a GPU, each test hands its cached blocks back to the driver when it ends: scripts/gpu_suite.sh runs
    several pytest processes on one GPU, and memory one process's allocator keeps cached is memory the others cannot
    get (a run of six processes on the H200 went out of memory that way in tests needing 4-8 GiB at once)."""
    yield
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# The time budget of one test file in the interpreter (CPU) suite: the durations of its tests (setup + call + teardown)
# summed. scripts/test runs the files on pytest-xdist workers (two on CI's two cores), so a file past it holds up a
# worker; 150 s a file keeps the suite near 600 s of wall time on two cores. A file that grows past it fails the run
# with its total: shrink its shapes to what each test checks (the large ones belong to the GPU tests), or split it.
FILE_BUDGET_VARIABLE = "MOE_DISPATCH_FILE_BUDGET_S"
FILE_BUDGET_S = 150.0


def file_budget_s(environ=os.environ):
    """Seconds one test file may take, or None where the budget is off: GPU runs (compiled kernels, the large shapes)
    and MOE_DISPATCH_FILE_BUDGET_S=0. The variable overrides FILE_BUDGET_S (a slow or loaded machine)."""
    if environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return None
    value = environ.get(FILE_BUDGET_VARIABLE, "").strip()
    try:
        budget = float(value) if value else FILE_BUDGET_S
    except ValueError:
        raise pytest.UsageError(f"{FILE_BUDGET_VARIABLE}={value!r}: seconds a test file may take (0: no budget)")
    return budget if budget > 0 else None


class FileTimes:
    """Each test file's summed durations, from the test reports this process sees: all of them in a plain run and, under
    pytest-xdist, in the controller (every worker's reports reach it; a worker sees only its own files). A plugin
    (pytest_configure registers one), so that its report hook is its own."""

    def __init__(self):
        self.seconds = collections.defaultdict(float)

    def add(self, report):
        self.seconds[report.nodeid.split("::")[0]] += report.duration

    def pytest_runtest_logreport(self, report):
        self.add(report)

    def over(self, budget):
        """[(file, seconds)] of the files past `budget`, slowest first."""
        return sorted(((f, s) for f, s in self.seconds.items() if s > budget), key=lambda item: (-item[1], item[0]))

    def judge(self, session, budget):
        """Fails a passing session (exit status 1) when a file is past `budget`; returns the summary's lines."""
        if budget is None or not self.seconds:
            return []
        over = self.over(budget)
        slowest = sorted(self.seconds.items(), key=lambda item: -item[1])[:5]
        lines = [f"test seconds per file (budget {budget:g} s, {FILE_BUDGET_VARIABLE}): "
                 + ", ".join(f"{os.path.basename(f)} {s:.1f}" for f, s in slowest)]
        if over:
            if session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
            lines += [f"FAILED: {f} took {s:.1f} s, past the {budget:g} s budget of a test file" for f, s in over]
            lines.append("size each interpreted test by what it checks (the large shapes belong to the GPU tests) or "
                         f"split the file; {FILE_BUDGET_VARIABLE}=<seconds> sets the budget, 0 turns it off")
        return lines


_FILE_TIMES = "moe_dispatch_file_times"
_BUDGET_LINES = pytest.StashKey[list]()


def pytest_configure(config):
    config.pluginmanager.register(FileTimes(), _FILE_TIMES)


def pytest_sessionfinish(session, exitstatus):
    """The file budget, judged where every report arrived (not on an xdist worker); printed in the terminal summary,
    which pytest writes after this hook."""
    times = session.config.pluginmanager.get_plugin(_FILE_TIMES)
    if times is not None and not hasattr(session.config, "workerinput"):
        session.config.stash[_BUDGET_LINES] = times.judge(session, file_budget_s())


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = config.stash.get(_BUDGET_LINES, [])
    if lines:
        failed = any(line.startswith("FAILED") for line in lines)
        terminalreporter.section("test file time budget", red=failed, green=not failed)
        for line in lines:
            terminalreporter.write_line(line, red=line.startswith("FAILED"))


def pytest_runtest_logreport(report):
    """With MOE_DISPATCH_FAILURE_LOG set (scripts/gpu_suite.sh sets it), each failure's test id and message are
    appended to that file as it happens: a GPU run cut by its time limit never reaches pytest's summary, and then
    still says which tests failed and why."""
    path = os.environ.get("MOE_DISPATCH_FAILURE_LOG")
    if not path or not report.failed:
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    message = crash.message if crash is not None else str(report.longrepr).strip().splitlines()[-1]
    with open(path, "a") as f:
        f.write(f"{report.nodeid} ({report.when}): {' '.join(message.split())[:400]}\n")

