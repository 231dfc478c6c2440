"""The persistent descriptor-fed grouped GEMM (gemm/persistent.py) against the float64 reference and the pointer kernel.

The interpreter emulates tensor descriptors, so the CPU suite runs the same kernel the H200 runs at prefill. Tiles are
forced through `fused_experts(tiles=...)` with `persistent=1` on both GEMMs; a spy records which launcher ran, so a
silent fallback to the pointer kernel fails the test instead of passing it.
"""

import dataclasses

import pytest
import torch
from helpers import DEVICE, ON_GPU, assert_close

import moe_dispatch as md
from moe_dispatch.gemm import persistent
from moe_dispatch.experts.autograd import run_experts  # the seed layout's entry (fused_moe_forward routes first)
from moe_dispatch.experts.call import ExpertsCall
from moe_dispatch.reference import fused_experts_ref
from moe_dispatch.host.tiles import GemmTile, MoeTiles, Persistent


@dataclasses.dataclass(frozen=True)
class PCase:
    id: str
    why: str
    T: int = 37
    E: int = 5
    top_k: int = 2
    H: int = 96
    F: int = 80
    dtype: torch.dtype = torch.bfloat16
    block_m: int = 16
    layout: dict = dataclasses.field(default_factory=dict)


CASES = [
    PCase("concat", "the transformers layout: gate and up halves of one [E, 2F, H] weight, two descriptors on it"),
    PCase("interleaved", "gate/up rows alternate: a descriptor row stride of 2H", layout={"interleaved": True}),
    PCase("bias-swiglu", "GPT-OSS's epilogue (biases, clamped SwiGLU) after descriptor loads",
          layout={"activation": "swiglu_oai", "bias": True}),
    PCase("seed-layout", "separate gate and up weights: two descriptors over two tensors", layout={"w_up": True}),
    PCase("bm32-fp16", "fp16, 32-row tiles: a tile's rows reach into the next expert's rows (masked at the store)",
          dtype=torch.float16, block_m=32),
    PCase("one-expert", "every token on one expert: most tiles of the map are sentinels the loop skips", E=4,
          layout={"one_expert": True}),
    PCase("K-tail", "H and F not multiples of BLOCK_K: the descriptors' zero fill past K", H=72, F=40),
    PCase("transposed", "[E, H, 2F] / [E, F, H] weights: 3-D descriptors, N-major weight tiles; H, F not multiples "
          "of BLOCK_K (a K tail must read the zero fill, not the next expert)", H=72, F=40,
          layout={"transposed": True}),
    PCase("interleaved-paired", "interleaved rows read whole (PAIRED): 2 BLOCK_N rows per descriptor tile, split in "
          "the epilogue; F not a multiple of BLOCK_N", F=40, layout={"interleaved": True, "bias": True}),
    PCase("gpt-oss", "GPT-OSS as transformers stores it: transposed, interleaved, biases, clamped SwiGLU",
          H=72, F=40, layout={"transposed": True, "interleaved": True, "activation": "swiglu_oai", "bias": True}),
]


class _Spy:
    def __init__(self, monkeypatch):
        self.calls = []
        real = persistent.persistent_expert_gemm

        def spy(*args, **kwargs):
            self.calls.append(kwargs["gather_a"])
            return real(*args, **kwargs)

        monkeypatch.setattr(persistent, "persistent_expert_gemm", spy)


def _problem(case, gen):
    E, H, F, dtype = case.E, case.H, case.F, case.dtype
    x = torch.randn(case.T, H, generator=gen).to(DEVICE, dtype)
    w_gate_up = (torch.randn(E, 2 * F, H, generator=gen) * 0.1).to(DEVICE, dtype)
    w_down = (torch.randn(E, H, F, generator=gen) * 0.1).to(DEVICE, dtype)
    ids = torch.rand(case.T, E, generator=gen).argsort(dim=1)[:, :case.top_k].to(DEVICE)
    if case.layout.get("one_expert"):
        ids = torch.stack([torch.full((case.T,), 1), torch.full((case.T,), 3)], dim=1)[:, :case.top_k].to(DEVICE)
    weights = torch.rand(case.T, case.top_k, generator=gen).to(DEVICE)
    kwargs = {k: v for k, v in case.layout.items() if k in ("interleaved", "activation", "transposed")}
    if case.layout.get("transposed"):  # laid out as stored, not a transposed view
        w_gate_up, w_down = w_gate_up.transpose(1, 2).contiguous(), w_down.transpose(1, 2).contiguous()
    if case.layout.get("bias"):
        kwargs["gate_up_bias"] = (torch.randn(E, 2 * F, generator=gen) * 0.1).to(DEVICE, dtype)
        kwargs["down_bias"] = (torch.randn(E, H, generator=gen) * 0.1).to(DEVICE, dtype)
    return x, w_gate_up, w_down, ids, weights, kwargs


def _tiles(block_m, persistent):
    return MoeTiles(block_m, GemmTile(32, 32, group_m=2, persistent=persistent),
                    GemmTile(32, 64, group_m=2, persistent=persistent))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_persistent_matches_reference_and_pointer_kernel(case, monkeypatch, poison_empty):
    """Both GEMMs on the persistent kernel (GEMM1 gathering its rows in the loads) against float64 and the pointer
    kernel."""
    gen = torch.Generator().manual_seed(0)
    x, w_gate_up, w_down, ids, weights, kwargs = _problem(case, gen)
    F = case.F
    if case.layout.get("w_up"):  # seed layout: gate and up as two tensors
        w_gate, w_up = w_gate_up[:, :F].contiguous(), w_gate_up[:, F:].contiguous()
        def run(tiles):
            options = {k: v for k, v in kwargs.items() if k != "gate_up_bias"}
            return run_experts(x, w_gate, w_up, w_down, ids, weights, kwargs.get("gate_up_bias"),
                               call_options=ExpertsCall(tiles=tiles, **options))
    else:
        run = lambda tiles: md.fused_experts(x, w_gate_up, w_down, ids, weights, tiles=tiles, **kwargs)  # noqa: E731
    spy = _Spy(monkeypatch)
    out = run(_tiles(case.block_m, Persistent.ON))
    assert spy.calls == [True, False], "both GEMMs must run the persistent kernel, GEMM1 gathering its rows"
    ref = fused_experts_ref(x, w_gate_up, w_down, ids, weights, **kwargs)
    assert_close(out, ref)
    pointer = run(_tiles(case.block_m, 0))
    assert_close(out, pointer)


def test_persistent_nan_row_stays_in_its_token(monkeypatch):
    """A NaN token row gives NaN in its own output row only, though descriptor tiles read rows of other tokens."""
    case = CASES[0]
    gen = torch.Generator().manual_seed(1)
    x, w_gate_up, w_down, ids, weights, _ = _problem(case, gen)
    x[5] = float("nan")
    spy = _Spy(monkeypatch)
    out = md.fused_experts(x, w_gate_up, w_down, ids, weights, tiles=_tiles(16, Persistent.ON))
    assert spy.calls == [True, False]
    assert torch.isnan(out[5]).all()
    others = torch.cat([out[:5], out[6:]])
    assert not torch.isnan(others).any()


# the base layout at H = 64, F = 48 (GEMM1: 2 K steps, 2 column tiles per half, the second ragged; GEMM2: one partial
# K step of its 64): the pre-activations are stored per tile, and two backwards at H = 96, F = 80 took a third of the
# file's time
@pytest.mark.parametrize("case", [dataclasses.replace(CASES[0], H=64, F=48), next(c for c in CASES if c.id == "gpt-oss")],
                         ids=lambda c: c.id)
def test_persistent_saves_preactivations_for_training(case, monkeypatch):
    """With a gradient wanted, GEMM1's epilogue also stores the pre-activations (GPT-OSS's: in its interleaved
    order); the gradients match the pointer kernel's forward (the backward kernels are the same)."""
    gen = torch.Generator().manual_seed(2)
    x, w_gate_up, w_down, ids, weights, kwargs = _problem(case, gen)
    grads = []
    spy = _Spy(monkeypatch)
    for persistent in (1, 0):
        inputs = [t.clone().requires_grad_(True) for t in (x, w_gate_up, w_down)]
        md.fused_experts(*inputs, ids, weights, tiles=_tiles(16, persistent), **kwargs).float().sum().backward()
        grads.append([t.grad for t in inputs])
    assert spy.calls == [True, False]
    for persistent_grad, pointer_grad in zip(*grads):
        assert_close(persistent_grad, pointer_grad)


@pytest.mark.parametrize("layout", ["transposed", "fp32"])
def test_layouts_without_descriptors_fall_back(layout, monkeypatch):
    """A transposed view of [E, 2F, H] weights (flagged transposed, its N not contiguous: no descriptor reads it) and
    fp32 run the pointer kernel even when the tile asks for persistent."""
    case = CASES[0]
    gen = torch.Generator().manual_seed(3)
    x, w_gate_up, w_down, ids, weights, _ = _problem(case, gen)
    kwargs = {}
    if layout == "transposed":
        w_gate_up, w_down, kwargs = w_gate_up.transpose(1, 2), w_down.transpose(1, 2), {"transposed": True}
    else:
        x, w_gate_up, w_down = x.float(), w_gate_up.float(), w_down.float()
    spy = _Spy(monkeypatch)
    control = _problem(case, gen)[:5]  # the same tile on the layout it is made for: the spy sees the persistent kernel
    md.fused_experts(*control, tiles=_tiles(16, 1))
    assert spy.calls, "the spy no longer sees persistent launches: this test would pass whatever the fallback does"
    spy.calls.clear()
    out = md.fused_experts(x, w_gate_up, w_down, ids, weights, tiles=_tiles(16, 1), **kwargs)
    assert spy.calls == []
    ref = fused_experts_ref(x, w_gate_up, w_down, ids, weights, **kwargs)
    assert_close(out, ref)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's answer; a GPU answers by its compute capability")
def test_interpreter_reports_descriptor_support():
    from moe_dispatch.host.device import has_tma

    assert has_tma(torch.device("cpu"))
