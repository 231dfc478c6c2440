"""The kernels CI's short tests (`pytest -m kernels_ci`): the kernel as built and loaded by a user, run once.

scripts/build writes the noarch variants into a temporary folder (kernel_build.build_variants, shared with
tests/test_packaging.py), LOCAL_KERNELS maps build.toml's repo id to it, and `kernels.get_kernel(repo_id, version=1)`
loads this machine's variant (torch-cpu on a CPU-only torch, torch-cuda on CUDA). Each test calls a public function of
the loaded module on helpers.DEVICE at a tiny shape and checks it against the float64 reference that module ships
(`module.reference`): routing ids exactly, floats within the reference's tolerance table. Under a minute together on a
CPU through Triton's interpreter; no timing.
"""

import re
from pathlib import Path

import kernel_build
import pytest
import torch
from helpers import DEVICE
from packaging.version import Version

pytestmark = pytest.mark.kernels_ci

# bf16 on a GPU (what users run), fp32 in the interpreter (numpy has no bf16 arithmetic to speak of).
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


@pytest.fixture(scope="module")
def built() -> Path:
    return kernel_build.build_variants()[0]


@pytest.fixture(scope="module")
def kernel(built):
    """The package as `get_kernel(<build.toml's repo id>, version=1)` returns it from the local build."""
    return kernel_build.get_kernel_from(built)


def _weights(gen, E, H, F):
    """[E, 2F, H] gate rows then up rows, [E, H, F]: transformers' experts layout."""
    w_gate_up = torch.randn(E, 2 * F, H, generator=gen) * 0.1
    w_down = torch.randn(E, H, F, generator=gen) * 0.1
    return w_gate_up.to(DEVICE, DTYPE), w_down.to(DEVICE, DTYPE)


def test_get_kernel_loads_this_machines_variant_of_the_build(kernel, built):
    """The loader took the variant of this machine's torch from the build, under the build's id, and it says the
    checkout's version (public part; the build adds +g<commit>)."""
    variant = built / kernel_build.PREFERRED_VARIANT
    assert Path(kernel.__file__).parent == variant
    assert kernel.__name__ == re.search(r'"id": "([^"]+)"', (variant / "metadata.json").read_text())[1]
    source = re.search(r'__version__ = "([^"]+)"',
                       (kernel_build.ROOT / "torch-ext" / "moe_dispatch" / "_version.py").read_text())[1]
    assert Version(kernel.__version__).public == source, (kernel.__version__, source)
    assert kernel.fused_experts is not None and "fused_experts" in kernel.__all__


def test_fused_experts_matches_the_float64_reference(kernel):
    """fused_experts with the caller's routing: T = 5 (a tile mostly padding), E = 4, top_k = 2, one expert unused."""
    gen = torch.Generator().manual_seed(0)
    T, E, top_k, H, F = 5, 4, 2, 32, 16
    x = torch.randn(T, H, generator=gen).to(DEVICE, DTYPE)
    w_gate_up, w_down = _weights(gen, E, H, F)
    topk_ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0]], device=DEVICE)  # expert 3 gets no token
    topk_weights = torch.rand(T, top_k, generator=gen).to(DEVICE)
    out = kernel.fused_experts(x, w_gate_up, w_down, topk_ids, topk_weights)
    ref = kernel.reference.fused_experts_ref(x, w_gate_up, w_down, topk_ids, topk_weights)
    assert out.shape == (T, H) and out.dtype == DTYPE and out.device.type == DEVICE
    kernel.reference.assert_close(out, ref, what="fused_experts")


def test_fused_moe_forward_routes_exactly_and_matches_the_reference(kernel):
    """The whole layer (softmax top-k, renormalised): ids equal the reference's, weights and output within tolerance."""
    gen = torch.Generator().manual_seed(1)
    T, E, top_k, H, F = 7, 4, 2, 32, 16
    x = torch.randn(T, H, generator=gen).to(DEVICE, DTYPE)
    router_weight = (torch.randn(E, H, generator=gen) * 0.5).to(DEVICE, DTYPE)
    w_gate, w_up = ((torch.randn(E, F, H, generator=gen) * 0.1).to(DEVICE, DTYPE) for _ in range(2))
    w_down = (torch.randn(E, H, F, generator=gen) * 0.1).to(DEVICE, DTYPE)
    out, ids, weights = kernel.fused_moe_forward(x, router_weight, w_gate, w_up, w_down, E, top_k, renormalize=True)
    ref_out, ref_ids, ref_weights = kernel.reference.fused_moe_forward_ref(x, router_weight, w_gate, w_up, w_down, E,
                                                                            top_k, renormalize=True)
    assert torch.equal(ids.long().cpu(), ref_ids.long().cpu()), (ids, ref_ids)
    kernel.reference.assert_close(weights.float(), ref_weights, DTYPE, what="routing weights")
    kernel.reference.assert_close(out, ref_out, what="fused_moe_forward")
