"""The kernel as a user gets it, for the tests that need a build: scripts/build's noarch variants in a temporary
folder, made once per test process, and `kernels.get_kernel(repo_id, version=1)` through LOCAL_KERNELS.

Import by name (pytest.ini puts tests/ on the path): tests/test_packaging.py checks the build itself, and
tests/test_kernels_ci.py (the kernels CI's short tests) runs the loaded kernel; both take the same folder, so a process
running both builds once and loads each variant directory once.
"""

import atexit
import functools
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# The variant the loader picks from a full build on this machine: torch's own backend.
PREFERRED_VARIANT = ("torch-cuda" if torch.version.cuda is not None else "torch-rocm" if torch.version.hip is not None
                     else "torch-cpu")


def checkout_head() -> str | None:
    """HEAD's first 7 hex digits, or None outside a git checkout (e.g. a copy of the tree on a GPU machine)."""
    if shutil.which("git") is None:
        return None
    result = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    return result.stdout.strip()[:7] if result.returncode == 0 else None


@functools.cache
def build_variants() -> tuple[Path, frozenset[str] | None]:
    """scripts/build run on this checkout into a temporary folder (removed at exit), once per process ->
    (the folder, the HEADs it may have been built from, or None outside git: others may commit while it runs)."""
    out = Path(tempfile.mkdtemp(prefix="moe-dispatch-build-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    before = checkout_head()
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "build"), "--out", str(out)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"scripts/build failed (exit {result.returncode}):\n{result.stderr}")
    return out, None if before is None else frozenset({before, checkout_head()})


def hub_repo_id() -> str:
    """The kernel's Hub repository id, written once in build.toml ([general.hub] repo-id)."""
    with open(ROOT / "build.toml", "rb") as f:
        return tomllib.load(f)["general"]["hub"]["repo-id"]


def get_kernel_from(folder: Path, repo_id: str | None = None):
    """`kernels.get_kernel(repo_id, version=1)` with LOCAL_KERNELS mapping repo_id (default build.toml's) to `folder`
    (a build root, which gives this machine's variant, or one variant directory), as a user loads a local build; no
    network. LOCAL_KERNELS is restored afterwards."""
    from kernels import get_kernel

    repo_id = repo_id or hub_repo_id()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LOCAL_KERNELS", f"{repo_id}={folder}")
        return get_kernel(repo_id, version=1)
