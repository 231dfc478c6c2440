"""The persistent descriptor-fed w8a8 GEMM (gemm/w8a8_persistent.py) against the model of its arithmetic, the
dequantized float64 experts and the pointer kernel, and the gathering quantization pass that feeds it.

Tiles are forced through `fused_experts(tiles=...)` with block_m 64 and `Persistent.ON` on both GEMMs; a spy records
which GEMMs ran the persistent kernel, so a silent fallback to the pointer kernel fails the test instead of passing it.
The interpreter emulates descriptors, so the CPU suite runs the kernel the H200 runs at prefill; it must equal the
pointer kernel within the model's tolerance (same e4m3 operands, same K steps, same epilogue; GEMM1's paired gate/up
dot is twice as wide as the pointer kernel's two, and numpy may sum a wider product in another order: 1-ulp fp32
differences seen). H = 96 with K blocks of 64 and F = 80 with GEMM1 column tiles of 64: a partial K step in GEMM1,
partial column tiles, and a partial group of the intermediate.
"""

import dataclasses

import pytest
import torch
from helpers import DEVICE, ON_GPU, assert_close

import moe_dispatch as md
from moe_dispatch.gemm import w8a8, w8a8_persistent
from moe_dispatch.host.device import has_tma
from moe_dispatch.dispatch.segments import dispatch
from moe_dispatch.formats.fp8 import quantize_experts_fp8
from moe_dispatch.gemm.w8a8 import quantize_fp8_rows, w8a8_groups
from moe_dispatch.reference import (W8A8_TOLERANCE, w8a8_model_tolerance, fused_experts_fp8_ref, fused_experts_w8a8_ref,
                                    quantize_fp8_groups_ref)
from moe_dispatch.host.tiles import GemmTile, MoeTiles, Persistent

MODEL_TOLERANCE = w8a8_model_tolerance(DEVICE)  # the tight bound against fused_experts_w8a8_ref here


@dataclasses.dataclass(frozen=True)
class FCase:
    id: str
    why: str
    scheme: str = "block"
    T: int = 30
    E: int = 4
    H: int = 96
    F: int = 80
    block_shape: tuple = (32, 64)  # N side 32, K side 64: G1 = 64 (H = 1.5 K steps), G2 = 32 (F = 2.5)
    dtype: torch.dtype = torch.float32  # the model check is tight for fp32 activations
    static: str = "dynamic"  # or "static-tensor", "static-expert": the checkpoint's input scales
    layout: dict = dataclasses.field(default_factory=dict)
    persistent_gemms: tuple = ("gemm1", "gemm2")  # which GEMMs must run the persistent kernel
    pairing: int = w8a8_persistent.PAIR_CONCAT.value  # how the persistent GEMM1 reads gate and up (pair_descriptor)
    gate_up_block_n: int = 64  # GEMM1's output tile (with G2 = 32, a multiple: quantized in the epilogue)
    down_block_k: int = 32


CASES = [
    FCase("block", "block scales, one per (32 rows, 64 columns): a column scale vector per K step, the transformers "
          "layout (the up view's scale rows start at F)"),
    FCase("block-uniform", "F = H = 64 with 64-row blocks: every column tile reads one scale per K step (the scalar "
          "path of load_block_scale)", H=64, F=64, block_shape=(64, 32)),
    FCase("channel-interleaved", "per-channel scales after the K loop; gate/up rows alternate (descriptor row stride "
          "2H, scale rows 2j and 2j + 1): the [E * F, 2, K] pair view", scheme="channel", layout={"interleaved": True},
          pairing=w8a8_persistent.PAIR_INTERLEAVED.value),
    FCase("block-interleaved", "block scales with alternating gate/up rows: a paired tile's scales alternate column by "
          "column (rows 2j and 2j + 1 in blocks of 32)", layout={"interleaved": True},
          pairing=w8a8_persistent.PAIR_INTERLEAVED.value),
    FCase("intermediate-pass", "GEMM1's output tile of 32 columns under GEMM2's group of 64: the intermediate is "
          "written in x's dtype and quantized by the pass (the pointer kernel, its tile widened to 64, quantizes in "
          "its epilogue)", gate_up_block_n=32, down_block_k=64),
    FCase("tensor-swiglu-bias", "per-tensor scales, GPT-OSS's clamped SwiGLU and both biases in the epilogue",
          scheme="tensor", layout={"activation": "swiglu_oai", "bias": True}),
    FCase("skewed", "expert 0 in every token (70 rows: two row tiles, the second partial), expert 2 in none (zero "
          "rows), E = 5", T=70, E=5, layout={"skewed": True}),
    FCase("static-tensor", "per-tensor static input scales: the pass divides x by it, GEMM1 stores h / scale, both "
          "GEMMs apply it after the K loop", static="static-tensor"),
    FCase("static-expert", "per-expert static input scales: GEMM1 keeps the pointer kernel (the pass cannot know the "
          "rows' experts), GEMM2 runs persistent with its expert's scale", static="static-expert",
          persistent_gemms=("gemm2",), pairing=None),
    FCase("unaligned-H", "H = 40: GEMM1's weight rows are not 16 bytes apart, so it runs the pointer kernel on the "
          "sorted rows the pass wrote (no gather); GEMM2 (rows of F = 32 bytes) runs persistent", H=40, F=32,
          persistent_gemms=("gemm2",), pairing=None),
    FCase("bf16", "bf16 activations in and out (the model check within bf16 rounding)", dtype=torch.bfloat16),
]


class _Spy:
    """Records "gemm1" / "gemm2" for each launch of the persistent w8a8 kernel, and how GEMM1 read gate and up."""

    def __init__(self, monkeypatch):
        self.calls = []
        self.pairing = None
        real = w8a8.persistent_w8a8_gemm  # the launcher's own reference to w8a8_persistent's function

        def spy(a, a_scale_args, w, ws, c, c_scale_args, info, topk_weights, alpha, limit, tile, meta):
            gemm = "gemm2" if meta["MUL_ROUTED_WEIGHT"] else "gemm1"
            self.calls.append(gemm)
            if gemm == "gemm1":
                self.pairing = w8a8_persistent.pair_descriptor(w, a.shape[1], tile)[0]
            return real(a, a_scale_args, w, ws, c, c_scale_args, info, topk_weights, alpha, limit, tile, meta)

        monkeypatch.setattr(w8a8, "persistent_w8a8_gemm", spy)


def _tiles(persistent, block_m=64, case=None):
    gate_up_block_n, down_block_k = (case.gate_up_block_n, case.down_block_k) if case is not None else (64, 32)
    return MoeTiles(block_m, GemmTile(gate_up_block_n, 64, group_m=2, persistent=persistent),
                    GemmTile(32, down_block_k, group_m=2, persistent=persistent))


def _problem(case, gen):
    """(x, ids, routing weights, fp8 gate_up, fp8 down, fused_experts keyword arguments)."""
    E, H, F, T = case.E, case.H, case.F, case.T
    w_gate_up = torch.randn(E, 2 * F, H, generator=gen) * 0.1
    w_down = torch.randn(E, H, F, generator=gen) * 0.1
    q_gate_up, s_gate_up = quantize_experts_fp8(w_gate_up.to(DEVICE), case.scheme, block_shape=case.block_shape)
    q_down, s_down = quantize_experts_fp8(w_down.to(DEVICE), case.scheme, block_shape=case.block_shape)
    x = torch.randn(T, H, generator=gen).to(DEVICE, case.dtype)
    x[1] = 0  # an all-zero token: its groups take the amax floor, never 0 / 0
    ids = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :2]
    if case.layout.get("skewed"):
        ids = torch.stack([torch.zeros(T, dtype=torch.long), 1 + 2 * torch.randint(0, 2, (T,), generator=gen)], 1)
    weights = torch.rand(T, 2, generator=gen).to(DEVICE)
    kwargs = dict(w_gate_up_scale=s_gate_up, w_down_scale=s_down, fp8_block_shape=case.block_shape)
    kwargs.update({k: v for k, v in case.layout.items() if k in ("interleaved", "activation")})
    if case.layout.get("bias"):
        kwargs["gate_up_bias"] = torch.randn(E, 2 * F, generator=gen).to(DEVICE, case.dtype)
        kwargs["down_bias"] = torch.randn(E, H, generator=gen).to(DEVICE, case.dtype)
    x_scale = x.float().abs().amax() / 448 * 1.25  # covers x: no saturation, so the dequantized check holds too
    if case.static == "static-tensor":
        kwargs.update(gate_up_input_scale=x_scale.reshape(()), down_input_scale=torch.full((1,), 0.06, device=DEVICE))
    elif case.static == "static-expert":
        kwargs.update(gate_up_input_scale=x_scale * (1 + torch.rand(E, generator=gen).to(DEVICE)),
                      down_input_scale=0.05 + 0.05 * torch.rand(E, generator=gen).to(DEVICE))
    return x, ids.to(DEVICE), weights, q_gate_up, q_down, kwargs


@pytest.mark.skipif(not has_tma(torch.device(DEVICE)), reason="no tensor descriptors (TMA): the pointer kernel runs")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_persistent_w8a8_matches_model_and_pointer_kernel(case, monkeypatch, poison_empty):
    """Buffers start as NaN (poison_empty): no row of A, scale or intermediate is read before it is written."""
    gen = torch.Generator().manual_seed(0)
    x, ids, weights, q_gate_up, q_down, kwargs = _problem(case, gen)
    spy = _Spy(monkeypatch)
    tiles = _tiles(Persistent.ON, case=case)
    out = md.fused_experts(x, q_gate_up, q_down, ids, weights, fp8_compute="w8a8", tiles=tiles, **kwargs)
    assert spy.calls == list(case.persistent_gemms)
    assert spy.pairing == case.pairing
    assert out.dtype == case.dtype
    groups = w8a8_groups(tiles, kwargs["w_gate_up_scale"], kwargs["w_down_scale"], case.block_shape)
    model = fused_experts_w8a8_ref(x, q_gate_up, q_down, ids, weights, groups=groups, **kwargs)
    exact_model = case.dtype == torch.float32
    assert_close(out, model, what="persistent w8a8 vs its model",
                 tolerance=MODEL_TOLERANCE if exact_model else None)
    weight_only = {k: v for k, v in kwargs.items() if not k.endswith("input_scale")}
    assert_close(out, fused_experts_fp8_ref(x, q_gate_up, q_down, ids, weights, **weight_only),
                 what="persistent w8a8 vs dequantized weights", tolerance=W8A8_TOLERANCE)

    pointer = md.fused_experts(x, q_gate_up, q_down, ids, weights, fp8_compute="w8a8",
                               tiles=_tiles(Persistent.OFF, case=case), **kwargs)
    assert spy.calls == list(case.persistent_gemms), "Persistent.OFF must keep the pointer kernel"
    assert_close(out, pointer, what="persistent vs pointer kernel", tolerance=MODEL_TOLERANCE if exact_model else None)


@pytest.mark.parametrize("fallback", ["transposed", "block_m32"])
def test_persistent_w8a8_falls_back_to_the_pointer_kernel(fallback, monkeypatch):
    """Transposed weights (GPT-OSS's [E, K, n]: K not contiguous) and 32-row tiles (below wgmma's 64) run the pointer
    kernel although the tile asks for persistent, with the same result as a tile that does not."""
    case = CASES[0]
    gen = torch.Generator().manual_seed(1)
    x, ids, weights, q_gate_up, q_down, kwargs = _problem(case, gen)
    block_m = 64
    if fallback == "transposed":
        # the stored weight [E, K, n]; block scales transposed with it (fp8_block_shape names the stored axes)
        q_gate_up, q_down = q_gate_up.transpose(1, 2).contiguous(), q_down.transpose(1, 2).contiguous()
        kwargs.update(transposed=True, w_gate_up_scale=kwargs["w_gate_up_scale"].transpose(1, 2).contiguous(),
                      w_down_scale=kwargs["w_down_scale"].transpose(1, 2).contiguous(),
                      fp8_block_shape=case.block_shape[::-1])
    else:
        block_m = 32
    spy = _Spy(monkeypatch)
    out = md.fused_experts(x, q_gate_up, q_down, ids, weights, fp8_compute="w8a8",
                           tiles=_tiles(Persistent.ON, block_m), **kwargs)
    assert spy.calls == []
    pointer = md.fused_experts(x, q_gate_up, q_down, ids, weights, fp8_compute="w8a8",
                               tiles=_tiles(Persistent.OFF, block_m), **kwargs)
    assert torch.equal(out, pointer)
    groups = w8a8_groups(_tiles(Persistent.ON, block_m), kwargs["w_gate_up_scale"], kwargs["w_down_scale"],
                         kwargs["fp8_block_shape"], transposed=fallback == "transposed")
    assert_close(out, fused_experts_w8a8_ref(x, q_gate_up, q_down, ids, weights, groups=groups, **kwargs),
                 tolerance=MODEL_TOLERANCE)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_quantize_fp8_rows_gathers_sorted_rows(static, poison_empty):
    """The pass with `info`: row p holds the e4m3 bytes (and scales) of x[gather_idx[p] // top_k] exactly as the
    plain pass quantizes that token, and equals the model bit for bit; rows past the kept assignments (ids outside
    [0, E), sorted last with gather_idx -1) are zeros with the amax floor's scale. Every row is written (NaN poison).
    x spans magnitudes 1e-6 to 1e4 with a partial last group (K = 100, group 32)."""
    T, E, top_k, K, group = 11, 3, 2, 100, 32
    x = torch.randn(T, K, device=DEVICE) * torch.logspace(-6, 4, T, device=DEVICE)[:, None]
    x[3] = 0
    ids = torch.randint(0, E, (T, top_k), device=DEVICE)
    ids[2, 1] = ids[7, 0] = E  # dropped (expert-parallel sentinels)
    info = dispatch(ids, E, 64)
    static_scale = torch.tensor(0.02, device=DEVICE) if static else None
    q, scale = quantize_fp8_rows(x, group, static_scale, info=info)
    assert q.shape == (T * top_k, K) and q.dtype == torch.float8_e4m3fn
    kept = int(info.expert_offsets[-1])
    assert kept == T * top_k - 2
    token = info.gather_idx[:kept].long() // top_k
    plain_q, plain_scale = quantize_fp8_rows(x, group, static_scale)
    assert torch.equal(q[:kept].view(torch.uint8), plain_q[token].view(torch.uint8))
    assert (q[kept:].float() == 0).all()
    model = quantize_fp8_groups_ref(x, group, static_scale)[token]
    if static:
        assert scale is None
        torch.testing.assert_close(q[:kept].double() * static_scale.double(), model, rtol=0, atol=0)
    else:
        assert scale.shape == (T * top_k, 4)
        assert torch.equal(scale[:kept], plain_scale[token])
        # the amax floor over the fp8 maximum (a GPU's fp32 division may differ in the last bit)
        floor = torch.tensor(1e-10, dtype=torch.float32, device=scale.device) / 448
        torch.testing.assert_close(scale[kept:], floor.expand_as(scale[kept:]), rtol=1e-6, atol=0)
        expanded = scale[:kept].double().repeat_interleave(group, dim=1)[:, :K]
        torch.testing.assert_close(q[:kept].double() * expanded, model, rtol=0, atol=0)
