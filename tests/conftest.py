"""Test set-up: the package (torch-ext/, on pytest.ini's pythonpath), Triton's interpreter whenever there is no GPU."""

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

