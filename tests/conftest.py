"""Test set-up: the package from torch-ext, and Triton's interpreter whenever there is no GPU."""

import os
import sys
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "torch-ext"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh random inputs for every test case, reproducible from its id."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
