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
from helpers import h200_tile_table, poison_empty  # noqa: E402,F401  (fixtures every test can ask for)


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


@pytest.fixture
def device():
    """The device a test's tensors and kernels live on (helpers.DEVICE): the GPU where there is one, else the CPU
    through Triton's interpreter. Tests that must run on the CPU on any host say "cpu" instead."""
    from helpers import DEVICE

    return torch.device(DEVICE)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the package's `fused_experts` calls from its transformers integration (proof the kernel ran): the
    number of rows of each call, in order."""
    import moe_dispatch

    calls = []
    original = moe_dispatch.transformers_experts.fused_experts

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(moe_dispatch.transformers_experts, "fused_experts", counted)
    return calls


# Time is reported, never a verdict: a slow or loaded machine runs the same tests slower, and a run that passes its
# tests passes. The report lists each test file's summed durations (setup + call + teardown), slowest first, so the
# files to shrink or split are named where a reader looks: at the end of the output.
FILES_REPORTED = 12


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

    def slowest(self, count=FILES_REPORTED):
        """[(file, seconds)] of the `count` slowest files, slowest first (ties by name)."""
        return sorted(self.seconds.items(), key=lambda item: (-item[1], item[0]))[:count]

    def report_lines(self, count=FILES_REPORTED):
        """The summary's lines: the slowest files and the sum of all, with the machine's load beside them."""
        if not self.seconds:
            return []
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        lines = [f"{s:8.1f} s  {f}" for f, s in self.slowest(count)]
        lines.append(f"{sum(self.seconds.values()):8.1f} s  summed over {len(self.seconds)} files "
                     f"({os.cpu_count()} cores, load average {load:.1f} at the end; a report, not a verdict)")
        return lines


_FILE_TIMES = "moe_dispatch_file_times"


def pytest_configure(config):
    config.pluginmanager.register(FileTimes(), _FILE_TIMES)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The per-file times, printed where every report arrived (not on an xdist worker)."""
    times = config.pluginmanager.get_plugin(_FILE_TIMES)
    if times is None or hasattr(config, "workerinput"):
        return
    lines = times.report_lines()
    if lines:
        terminalreporter.section("test seconds per file, slowest first")
        for line in lines:
            terminalreporter.write_line(line)


def pytest_runtest_logreport(report):
    """Logs written as the run goes (scripts/gpu_suite.sh sets both): a GPU run cut by its time limit never reaches
    pytest's summary, and then still says which tests failed and why, and where the time went.
    MOE_DISPATCH_FAILURE_LOG: each failure's test id and message. MOE_DISPATCH_TIMES_LOG: each test's seconds
    (setup + call + teardown), one line per test when its teardown ends. Written where every report arrives once: by
    the pytest-xdist controller, not its workers."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    times_path = os.environ.get("MOE_DISPATCH_TIMES_LOG")
    if times_path:
        _TEST_SECONDS[report.nodeid] += report.duration
        if report.when == "teardown":
            with open(times_path, "a") as f:
                f.write(f"{_TEST_SECONDS.pop(report.nodeid):8.2f} {report.nodeid}\n")
    path = os.environ.get("MOE_DISPATCH_FAILURE_LOG")
    if not path or not report.failed:
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    message = crash.message if crash is not None else str(report.longrepr).strip().splitlines()[-1]
    with open(path, "a") as f:
        f.write(f"{report.nodeid} ({report.when}): {' '.join(message.split())[:400]}\n")


_TEST_SECONDS = collections.defaultdict(float)
