"""FP8 expert weights on the portable path (dequantize in the loads): the quantize / dequantize helpers against the
float64 reference of the format, `fused_experts` with float8 weights for every scale scheme and weight layout against
the float64 experts on the dequantized weights, and the argument checks.

The reference dequantizes the same fp8 weights, so the tolerance is the activation dtype's alone (helpers.TOLERANCE).
Block shapes of 16 / 32 make tiny weights span several blocks, partial ones included (sizes not multiples of the
block); one case keeps the default 128 x 128.
"""

import pytest
import torch
from helpers import DEVICE, assert_close
from reference import dequantize_fp8_ref, fused_experts_fp8_ref

import moe_dispatch as md
from moe_dispatch.fp8 import FP8_DTYPES, dequantize_experts_fp8, fp8_max, quantize_experts_fp8

E, TOP_K, H, F, T = 4, 2, 40, 24, 9
SCHEMES = ("block", "channel", "tensor")


def _ids(T, E=E, top_k=TOP_K):
    return torch.stack([torch.randperm(E)[:top_k] for _ in range(T)]).to(DEVICE)


@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape,block_shape", [((3, 48, 40), (16, 16)),   # 40 = 2.5 blocks along K
                                               ((2, 50, 37), (32, 16)),   # partial blocks on both axes
                                               ((2, 130, 200), (128, 128))])  # the default, one full + one partial
def test_quantize_round_trip(shape, block_shape, scheme, dtype):
    """Scale shapes, w ≈ dequantize(quantize(w)) within fp8 rounding (3 mantissa bits: 2^-4 relative per element, and
    2^-9 of the scale absolute where an element lands among the subnormals),
    helper dequantization equal to the float64 reference, every group's largest value on the fp8 maximum."""
    w = torch.randn(shape, device=DEVICE) * torch.rand(shape[0], shape[1], 1, device=DEVICE)
    q, scale = quantize_experts_fp8(w, scheme, block_shape=block_shape, dtype=dtype)
    E_, d1, d2 = shape
    expected = {"block": (E_, -(-d1 // block_shape[0]), -(-d2 // block_shape[1])), "channel": (E_, d1),
                "tensor": (E_,)}[scheme]
    assert q.dtype == dtype and q.shape == w.shape
    assert scale.dtype == torch.float32 and tuple(scale.shape) == expected
    ref = dequantize_fp8_ref(q, scale, block_shape)
    back = dequantize_experts_fp8(q, scale, scheme, block_shape)
    torch.testing.assert_close(back.double(), ref, rtol=1e-6, atol=0)
    assert ((back.double() - w.double()).abs() <= 2**-4 * ref.abs() + 2**-9 * scale.max()).all()
    assert q.float().abs().amax() == fp8_max(dtype)


def test_quantize_zero_group_and_channel_of_transposed():
    """An all-zero expert gets scale 1 (no 0/0); n_axis=2 quantizes per output channel of a transposed weight."""
    w = torch.randn(2, 16, 8, device=DEVICE)
    w[1] = 0
    q, scale = quantize_experts_fp8(w, "tensor")
    assert scale[1] == 1 and (q[1].float() == 0).all()
    q, scale = quantize_experts_fp8(w.transpose(1, 2), "channel", n_axis=2)
    assert scale.shape == (2, 16)
    assert_close(dequantize_experts_fp8(q, scale, n_axis=2), w.transpose(1, 2), tolerance=0.05)


def test_dequantize_matches_transformers():
    """The block convention equals transformers' own FP8 dequantization (`weight_scale_inv`, FP8Experts)."""
    finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")
    w = torch.randn(2, 40, 72, device=DEVICE)
    q, scale = quantize_experts_fp8(w, "block", block_shape=(16, 32))
    theirs = finegrained._dequantize_fp8_weight(q, scale, [16, 32], torch.float32)
    torch.testing.assert_close(dequantize_experts_fp8(q, scale, "block", (16, 32)), theirs)


def _fp8_experts(scheme, *, transposed=False, block_shape=(16, 16), dtype=torch.float8_e4m3fn, ffn=F, hidden=H):
    w_gate_up = torch.randn(E, 2 * ffn, hidden, device=DEVICE) * 0.2
    w_down = torch.randn(E, hidden, ffn, device=DEVICE) * 0.2
    if transposed:
        w_gate_up, w_down = w_gate_up.transpose(1, 2).contiguous(), w_down.transpose(1, 2).contiguous()
    n_axis = 2 if transposed else 1
    q_gate_up, s_gate_up = quantize_experts_fp8(w_gate_up, scheme, block_shape=block_shape, dtype=dtype, n_axis=n_axis)
    q_down, s_down = quantize_experts_fp8(w_down, scheme, block_shape=block_shape, dtype=dtype, n_axis=n_axis)
    return q_gate_up, q_down, dict(w_gate_up_scale=s_gate_up, w_down_scale=s_down, fp8_block_shape=block_shape)


# (id, options, why)
LAYOUTS = [
    ("concatenated", {}, "the transformers layout: gate rows, then up rows; the up view's scale rows start at F"),
    ("interleaved", {"interleaved": True}, "gate/up alternate: view column j reads scale row 2j (+1)"),
    ("transposed", {"transposed": True}, "GPT-OSS [E, H, 2F]: block scales over the stored weight, N on axis 2"),
    ("interleaved-transposed-bias-swiglu", {"interleaved": True, "transposed": True, "activation": "swiglu_oai"},
     "GPT-OSS as shipped, with both biases"),
]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_fused_experts_fp8(layout, scheme):
    _, options, _ = layout
    options = dict(options)
    q_gate_up, q_down, scales = _fp8_experts(scheme, transposed=options.get("transposed", False))
    if options.get("activation") == "swiglu_oai":
        options.update(gate_up_bias=torch.randn(E, 2 * F, device=DEVICE).bfloat16(),
                       down_bias=torch.randn(E, H, device=DEVICE).bfloat16())
    x = torch.randn(T, H, device=DEVICE).bfloat16()
    ids, weights = _ids(T), torch.rand(T, TOP_K, device=DEVICE)
    out = md.fused_experts(x, q_gate_up, q_down, ids, weights, **scales, **options)
    assert out.dtype == torch.bfloat16
    assert_close(out, fused_experts_fp8_ref(x, q_gate_up, q_down, ids, weights, **scales, **options))


@pytest.mark.parametrize("act_dtype", [torch.float16, torch.float32])
def test_fused_experts_fp8_e4m3fnuz_default_block(act_dtype):
    """AMD's e4m3fnuz with the default 128 x 128 blocks over a weight of several partial blocks (2F = 160, H = 136),
    fp16 and fp32 activations (out in their dtype)."""
    q_gate_up, q_down, scales = _fp8_experts("block", block_shape=(128, 128), dtype=torch.float8_e4m3fnuz, ffn=80,
                                             hidden=136)
    x = torch.randn(5, 136, device=DEVICE).to(act_dtype)
    ids, weights = _ids(5), torch.rand(5, TOP_K, device=DEVICE)
    out = md.fused_experts(x, q_gate_up, q_down, ids, weights, w_gate_up_scale=scales["w_gate_up_scale"],
                           w_down_scale=scales["w_down_scale"])
    assert out.dtype == act_dtype
    assert_close(out, fused_experts_fp8_ref(x, q_gate_up, q_down, ids, weights, **scales))


def test_fused_experts_fp8_mixed_and_no_gradient():
    """Only w_down in fp8 (gate_up stays bf16); inputs that require grad give an output without grad_fn and a
    one-time warning (FP8 weights are forward-only)."""
    _, q_down, scales = _fp8_experts("channel")
    w_gate_up = (torch.randn(E, 2 * F, H, device=DEVICE) * 0.2).bfloat16()
    x = torch.randn(T, H, device=DEVICE).bfloat16().requires_grad_()
    ids, weights = _ids(T), torch.rand(T, TOP_K, device=DEVICE)
    with pytest.warns(UserWarning, match="forward-only"):
        out = md.fused_experts(x, w_gate_up, q_down, ids, weights, w_down_scale=scales["w_down_scale"])
    assert out.grad_fn is None
    assert_close(out, fused_experts_fp8_ref(x, w_gate_up, q_down, ids, weights, w_down_scale=scales["w_down_scale"]))


def test_fused_experts_fp8_matches_bf16_weights():
    """The point of the format: FP8 block-scaled experts stay close to the bf16 experts they were quantized from."""
    w_gate_up = torch.randn(E, 2 * F, H, device=DEVICE) * 0.2
    w_down = torch.randn(E, H, F, device=DEVICE) * 0.2
    q_gate_up, s_gate_up = quantize_experts_fp8(w_gate_up, block_shape=(16, 16))
    q_down, s_down = quantize_experts_fp8(w_down, block_shape=(16, 16))
    x = torch.randn(T, H, device=DEVICE)
    ids, weights = _ids(T), torch.rand(T, TOP_K, device=DEVICE)
    out = md.fused_experts(x, q_gate_up, q_down, ids, weights, w_gate_up_scale=s_gate_up, w_down_scale=s_down,
                           fp8_block_shape=(16, 16))
    assert_close(out, md.fused_experts(x, w_gate_up, w_down, ids, weights), tolerance=0.05)


def _bad(**changes):
    q_gate_up, q_down, scales = _fp8_experts("block")
    args = dict(hidden_states=torch.randn(T, H, device=DEVICE).bfloat16(), w_gate_up=q_gate_up, w_down=q_down,
                topk_ids=_ids(T), topk_weights=torch.rand(T, TOP_K, device=DEVICE), **scales)
    args.update(changes)
    return args


BAD_INPUTS = [
    ("no-scale", lambda: _bad(w_gate_up_scale=None), ValueError, "w_gate_up_scale is missing"),
    ("scale-not-fp32", lambda: _bad(w_down_scale=_bad()["w_down_scale"].half()), TypeError, "w_down_scale must be"),
    ("block-shape-mismatch", lambda: _bad(fp8_block_shape=(32, 32)), ValueError, "w_gate_up_scale has shape"),
    ("channel-wrong-size", lambda: _bad(w_down_scale=torch.ones(E, F, device=DEVICE)), ValueError,
     "w_down_scale has shape"),
    ("scale-rank", lambda: _bad(w_down_scale=torch.ones(E, 1, 1, 1, device=DEVICE)), ValueError, "w_down_scale must"),
    ("scale-for-float-weight", lambda: _bad(w_down=torch.randn(E, H, F, device=DEVICE).bfloat16()), ValueError,
     "w_down_scale was given but w_down"),
    ("bad-block-shape", lambda: _bad(fp8_block_shape=(0, 16)), ValueError, "fp8_block_shape"),
    ("float-weight-wrong-dtype", lambda: _bad(w_down=torch.randn(E, H, F, device=DEVICE), w_down_scale=None),
     TypeError, "w_down has dtype"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_fp8_bad_inputs(case):
    _, make, error, message = case
    with pytest.raises(error, match=message):
        md.fused_experts(**make())


def test_quantize_bad_inputs():
    w = torch.randn(2, 8, 8)
    with pytest.raises(ValueError, match="scheme"):
        quantize_experts_fp8(w, "row")
    with pytest.raises(TypeError, match="dtype"):
        quantize_experts_fp8(w, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="3 dimensions"):
        quantize_experts_fp8(w[0])
    q, scale = quantize_experts_fp8(w, "channel")
    with pytest.raises(ValueError, match="scheme='block'"):
        dequantize_experts_fp8(q, scale, "block")
