"""The README's Python blocks run as written, so the README cannot drift from the code.

Convention: every ```python block of README.md runs on a CPU checkout as the README's quickstart says (PYTHONPATH=
torch-ext, TRITON_INTERPRET=1, from the repository root; the suite on a GPU machine skips them), unless the line
just above its fence is an HTML comment naming what else it needs:

    <!-- needs: gpu -->          a CUDA GPU (runs here only when torch sees one, without the interpreter)
    <!-- needs: hub -->          the Hugging Face Hub (a download; never run by the tests)
    <!-- needs: gpu, hub -->     both

The comment is invisible on the rendered page, so the README says the same in words next to the block. Each block
runs in its own python process (a reader pastes it into a fresh interpreter), so it must import what it uses.
"""

import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from helpers import INTERPRETED

README = os.path.join(ROOT, "README.md")
KNOWN_NEEDS = {"gpu", "hub"}
_BLOCK = re.compile(r"(?:^<!--\s*needs:\s*(?P<needs>[^>]*?)\s*-->\n)?^```python\n(?P<code>.*?)^```$", re.M | re.S)


def readme_blocks():
    """(line number, needs, code) of every python block, in order."""
    with open(README) as f:
        text = f.read()
    blocks = []
    for match in _BLOCK.finditer(text):
        needs = frozenset(n.strip() for n in (match["needs"] or "").split(",") if n.strip())
        line = text.count("\n", 0, match.start("code"))
        blocks.append((line, needs, match["code"]))
    return blocks


BLOCKS = readme_blocks()


def _missing(needs):
    if "hub" in needs:
        return "needs the Hub (downloads are not part of the test suite)"
    if "gpu" in needs and not torch.cuda.is_available():
        return "needs a GPU"
    if "gpu" not in needs and not INTERPRETED:
        return "is the CPU set-up (Triton's interpreter on CPU tensors), run by the CPU suite"
    return None


def test_blocks_are_found_and_marked_with_known_needs():
    assert sum(1 for _, needs, _ in BLOCKS if not needs) >= 2, "the CPU quickstart and the binned example run on CPU"
    with open(README) as f:
        assert f.read().count("```python") == len(BLOCKS)
    for line, needs, _ in BLOCKS:
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
