"""The README's Python and shell blocks run as written, so the README cannot drift from the code.

Convention: every ```python block of README.md runs on a CPU checkout as the README's quickstart says (PYTHONPATH=
torch-ext, TRITON_INTERPRET=1, from the repository root; the suite on a GPU machine skips them), and every ```bash
block runs in bash from the root of a copy of the checkout (its .venv linked in) with a reader's environment (no
PYTHONPATH, no TRITON_INTERPRET: the block sets what it needs), unless the line just above its fence is an HTML
comment naming what else it needs:

    <!-- needs: gpu -->          a CUDA GPU (runs here only when torch sees one, without the interpreter)
    <!-- needs: 2 gpus -->       two CUDA GPUs (shell blocks: torchrun with NCCL)
    <!-- needs: hub -->          the network: the Hugging Face Hub or the git remote (never run by the tests)
    <!-- needs: minutes -->      runs the test suite or a benchmark itself (never run by the tests)
    <!-- needs: gpu, hub -->     several of them

The comment is invisible on the rendered page, so the README says the same in words next to the block. Each Python
block runs in its own python process (a reader pastes it into a fresh interpreter), so it must import what it uses.
Blocks that do not run are still checked: every command of a shell block names a script or file that exists, and a
bare program (`torchrun`, `kernels`) must be on the reader's PATH, which the project's .venv/bin is not.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from helpers import INTERPRETED

README = os.path.join(ROOT, "README.md")
KNOWN_NEEDS = {"gpu", "2 gpus", "hub", "minutes"}
_BLOCK = re.compile(r"(?:^<!--\s*needs:\s*(?P<needs>[^>]*?)\s*-->\n)?^```(?P<lang>python|bash)\n(?P<code>.*?)^```$",
                    re.M | re.S)
VENV_PYTHON = Path(ROOT) / ".venv" / "bin" / "python"
# What the copy of the checkout leaves out: git's data, outputs, caches (the venv is linked in instead).
TOP_IGNORE = {".git", ".venv", "build", "gpu-out", ".whl", ".pytest_cache"}


def copy_ignore(folder, names):
    top = TOP_IGNORE if Path(folder) == Path(ROOT) else set()
    return {n for n in names if n in top or n == "__pycache__" or n.endswith(".pyc")}


def readme_blocks(lang):
    """(line number, needs, code) of every block in `lang`, in order."""
    with open(README) as f:
        text = f.read()
    blocks = []
    for match in _BLOCK.finditer(text):
        if match["lang"] != lang:
            continue
        needs = frozenset(n.strip() for n in (match["needs"] or "").split(",") if n.strip())
        line = text.count("\n", 0, match.start("code"))
        blocks.append((line, needs, match["code"]))
    return blocks


BLOCKS = readme_blocks("python")
SHELL_BLOCKS = readme_blocks("bash")


def _missing(needs):
    if "hub" in needs:
        return "needs the Hub (downloads are not part of the test suite)"
    if "minutes" in needs:
        return "runs the suite or a benchmark itself (its commands are checked by test_shell_commands_exist)"
    if "2 gpus" in needs and torch.cuda.device_count() < 2:
        return "needs two GPUs"
    if "gpu" in needs and not torch.cuda.is_available():
        return "needs a GPU"
    if not needs & {"gpu", "2 gpus"} and not INTERPRETED:
        return "is the CPU set-up (Triton's interpreter on CPU tensors), run by the CPU suite"
    return None


def test_blocks_are_found_and_marked_with_known_needs():
    assert sum(1 for _, needs, _ in BLOCKS if not needs) >= 2, "the CPU quickstart and the binned example run on CPU"
    assert sum(1 for _, needs, _ in SHELL_BLOCKS if not needs) >= 2, "the quickstart and the local build run"
    with open(README) as f:
        text = f.read()
    assert text.count("```python") == len(BLOCKS) and text.count("```bash") == len(SHELL_BLOCKS)
    fences = set(re.findall(r"^```(\w+)", text, re.M))
    assert fences <= {"python", "bash"}, f"README.md has blocks the tests do not run: {sorted(fences)}"
    for line, needs, _ in BLOCKS + SHELL_BLOCKS:
        assert needs <= KNOWN_NEEDS, f"README.md:{line}: unknown needs {sorted(needs - KNOWN_NEEDS)}"


@pytest.mark.parametrize("line,needs,code", BLOCKS, ids=[f"line{line}" for line, _, _ in BLOCKS])
def test_readme_block_runs(line, needs, code):
    reason = _missing(needs)
    if reason:
        pytest.skip(f"README.md:{line} {reason}")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "torch-ext"))
    if "gpu" in needs:
        env.pop("TRITON_INTERPRET", None)
    else:
        env["TRITON_INTERPRET"] = "1"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"README.md:{line} failed (rc {run.returncode}):\n{run.stderr[-3000:]}"


def shell_commands(code):
    """The commands of a shell block: (argv without leading VAR=value assignments, assignments), comments dropped."""
    commands = []
    for logical in code.replace("\\\n", " ").splitlines():
        words = shlex.split(logical, comments=True)
        assignments = {}
        while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
            key, _, value = words.pop(0).partition("=")
            assignments[key] = value
        if words:
            commands.append((words, assignments))
    return commands


def reader_path():
    """PATH as a reader's shell has it: without the project's .venv/bin (which `bash scripts/test` does not add
    either, but a developer's activated venv might)."""
    venv_bin = str(Path(ROOT) / ".venv" / "bin")
    return os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv_bin)


@pytest.mark.parametrize("line,needs,code", SHELL_BLOCKS, ids=[f"line{line}" for line, _, _ in SHELL_BLOCKS])
def test_shell_commands_exist(line, needs, code):
    """Every command names what exists: `bash X` and script arguments are files of the checkout, programs given by
    path exist, and a bare program is on the reader's PATH (a run block would otherwise fail; a marked one is
    checked here only)."""
    for words, _ in shell_commands(code):
        program = words[0]
        if program in ("bash", "sh"):
            assert (Path(ROOT) / words[1]).is_file(), f"README.md:{line}: {words[1]} does not exist"
            continue
        if "/" in program:
            if program.startswith(".venv/") and not VENV_PYTHON.exists():
                continue  # a machine without the project's venv (a GPU image): the CPU suite checks these
            assert (Path(ROOT) / program).exists(), f"README.md:{line}: {program} does not exist"
        elif not needs & {"gpu", "2 gpus"}:  # a GPU machine's python and PATH are its own
            assert shutil.which(program, path=reader_path()), \
                f"README.md:{line}: `{program}` is not on a reader's PATH (the venv's is .venv/bin/{program})"
        scripts = [w for w in words[1:] if w.endswith((".py", ".sh")) or w.startswith("scripts/")]
        for script in scripts:
            assert (Path(ROOT) / script).exists(), f"README.md:{line}: {script} does not exist"


@pytest.fixture(scope="module")
def checkout_copy(tmp_path_factory):
    """A copy of the checkout to run shell blocks in (they build, write outputs, `cd ..`), its .venv linked in."""
    copy = tmp_path_factory.mktemp("readme") / "checkout"
    shutil.copytree(ROOT, copy, ignore=copy_ignore, symlinks=True)
    (copy / ".venv").symlink_to(Path(ROOT) / ".venv", target_is_directory=True)
    return copy


@pytest.mark.parametrize("line,needs,code", SHELL_BLOCKS, ids=[f"line{line}" for line, _, _ in SHELL_BLOCKS])
def test_readme_shell_block_runs(line, needs, code, request):
    reason = _missing(needs)
    if reason:
        pytest.skip(f"README.md:{line} {reason}")
    if not needs & {"gpu", "2 gpus"} and not VENV_PYTHON.exists():
        pytest.skip(f"README.md:{line} uses the project's .venv (bash scripts/setup-env), absent here")
    copy = request.getfixturevalue("checkout_copy")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET", "LOCAL_KERNELS")}
    env["PATH"] = reader_path()
    run = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], cwd=copy, env=env, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, \
        f"README.md:{line} failed (rc {run.returncode}):\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
