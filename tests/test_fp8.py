"""FP8 expert weights: the quantize / dequantize helpers against the float64 reference of the format, `fused_experts`
with float8 weights on both compute paths for every scale scheme and weight layout, the path choice, and the argument
checks.

The dequant path (weights converted to the activation dtype in the loads) is held to the activation dtype's
tolerance against the float64 experts on the same dequantized weights (helpers.TOLERANCE). The w8a8 path also
quantizes the activations, so it is held twice: tightly against `fused_experts_w8a8_ref`, the float64 model of its
own arithmetic (same quantization of x per token and K step and of the intermediate per row and K step of GEMM2),
and within reference.W8A8_TOLERANCE (the error e4m3 activations add, derived there) against the dequantized-weight
reference. The interpreter runs the w8a8 kernels when forced (fp8_compute="w8a8"; "auto" takes "dequant" on the CPU).

Block shapes of 16 / 32 make tiny weights span several blocks, partial ones included (sizes not multiples of the
block); one case keeps the default 128 x 128. w8a8 needs the block's K side to be a power of two >= 32. The w8a8
path's own tests and non-finite tokens on every FP8 path are in tests/test_fp8_w8a8.py (a file each, so that the two
halves run on two workers).
"""

import copy
import dataclasses

import pytest
import torch
from helpers import DEVICE, assert_close

import moe_dispatch as md
from moe_dispatch.experts import operator
from moe_dispatch.formats import fp8 as fp8_module
from moe_dispatch.gemm import decode, planner
from moe_dispatch.gemm.jit import StepDot
from moe_dispatch.formats.fp8 import FP8_DTYPES, dequantize_experts_fp8, fp8_max, quantize_experts_fp8
from moe_dispatch.gemm.w8a8 import w8a8_groups
from moe_dispatch.reference import (W8A8_TOLERANCE, w8a8_model_tolerance, dequantize_fp8_ref, fused_experts_fp8_ref,
                                    fused_experts_ref, fused_experts_w8a8_ref, relative_error)
from moe_dispatch.host.tiles import DecodeTile, DecodeTiles, GemmTile, MoeTiles

MODEL_TOLERANCE = w8a8_model_tolerance(DEVICE)  # the tight bound against fused_experts_w8a8_ref here
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


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantize_keeps_non_finite_weights_alone(scheme):
    """A NaN or +-inf weight quantizes to NaN (float8 has no inf) and alone: its block, channel or expert keeps the
    scale of its finite values, so every other weight is what it is without the bad ones (a bf16 weight keeps its
    neighbours too)."""
    w = torch.randn(2, 32, 48, device=DEVICE)
    bad_at = ((0, 3, 5), (1, 20, 40), (1, 21, 41))
    for at in bad_at:
        w[at] = 0
    clean_q, clean_scale = quantize_experts_fp8(w, scheme, block_shape=(16, 16))
    bad = w.clone()
    for at, value in zip(bad_at, (float("nan"), float("inf"), float("-inf"))):
        bad[at] = value
    q, scale = quantize_experts_fp8(bad, scheme, block_shape=(16, 16))
    assert torch.equal(scale, clean_scale)
    back = dequantize_experts_fp8(q, scale, scheme, (16, 16))
    good = torch.ones_like(w, dtype=torch.bool)
    for at in bad_at:
        assert torch.isnan(back[at])
        good[at] = False
    assert torch.equal(back[good], dequantize_experts_fp8(clean_q, clean_scale, scheme, (16, 16))[good])


def test_dequantize_matches_transformers():
    """The block convention equals transformers' own FP8 dequantization (`weight_scale_inv`, FP8Experts)."""
    finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")
    if not hasattr(finegrained, "_dequantize_fp8_weight"):  # older transformers (the GPU image's 5.17) lack it
        pytest.skip("this transformers has no _dequantize_fp8_weight to compare with")
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
    out = md.fused_experts(x, q_gate_up, q_down, ids, weights, fp8_compute="dequant", **scales, **options)
    assert out.dtype == torch.bfloat16
    assert_close(out, fused_experts_fp8_ref(x, q_gate_up, q_down, ids, weights, **scales, **options))


DECODE = DecodeTiles(DecodeTile(32, 32, 4, 1), DecodeTile(16, 32, 4, 1))
DECODE_DOT = DecodeTiles(DECODE.gate_up, DecodeTile(16, 16, 4, 1, dot=True))  # the down GEMM once per expert hit
PREFILL = MoeTiles(64, GemmTile(64, 32), GemmTile(32, 32))


# (scheme, block shape): a K side of 24 has no power-of-two divisor >= 16, so the gate/up kernel scales each element
# by its block (WeightScaleCode.BLOCK) and the down GEMV steps 8 columns at a time; the block shape matters to block
# scales only
DECODE_SCALES = [("block", (16, 16)), ("block", (16, 24)), ("channel", (16, 16)), ("tensor", (16, 16))]


@pytest.mark.parametrize("gate_up", ["dot", "gemv"])
@pytest.mark.parametrize("scheme,block_shape", DECODE_SCALES, ids=["block", "block-k-side-24", "channel", "tensor"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_fp8_decode_path(layout, scheme, block_shape, gate_up, poison_empty, monkeypatch):
    """The two-launch decode path dequantizes float8 weights in its loads: every layout and scale scheme against the
    float64 experts on the dequantized weights, with either gate/up kernel (the gate/up GEMV, DecodeTile.gemv: block
    scales step inside one block, a K side of 24 8 columns a step; channel and tensor scales after the loop)."""
    _, options, _ = layout
    options = dict(options)
    q_gate_up, q_down, scales = _fp8_experts(scheme, transposed=options.get("transposed", False),
                                             block_shape=block_shape)
    if options.get("activation") == "swiglu_oai":
        options.update(gate_up_bias=torch.randn(E, 2 * F, device=DEVICE).bfloat16(),
                       down_bias=torch.randn(E, H, device=DEVICE).bfloat16())
    launched = []
    monkeypatch.setattr(operator, "decode_experts", lambda *a, **k: launched.append(1) or decode.decode_experts(*a, **k))
    x = torch.randn(3, H, device=DEVICE).bfloat16()
    ids, weights = _ids(3), torch.rand(3, TOP_K, device=DEVICE)
    tiles = DecodeTiles(dataclasses.replace(DECODE.gate_up, gemv=gate_up == "gemv"), DECODE.down)
    out = md.fused_experts(x, q_gate_up, q_down, ids, weights, tiles=tiles, **scales, **options)
    assert launched == [1]
    assert_close(out, fused_experts_fp8_ref(x, q_gate_up, q_down, ids, weights, **scales, **options))


@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_fp8_decode_path_fp16_dots(layout, poison_empty):
    """From decode.F16_DOTS_FROM_TOKENS tokens the gate/up kernel dots in fp16 (decode.step_dot's choice, not
    forced here): every layout with block scales against the float64 experts on the dequantized weights."""
    _, options, _ = layout
    options = dict(options)
    T = decode.F16_DOTS_FROM_TOKENS + 3
    assert decode.step_dot(T, torch.bfloat16, torch.float8_e4m3fn) is StepDot.F16_SUMS
    q_gate_up, q_down, scales = _fp8_experts("block", transposed=options.get("transposed", False))
    if options.get("activation") == "swiglu_oai":
        options.update(gate_up_bias=torch.randn(E, 2 * F, device=DEVICE).bfloat16(),
                       down_bias=torch.randn(E, H, device=DEVICE).bfloat16())
    x = torch.randn(T, H, device=DEVICE).bfloat16()
    ids, weights = _ids(T), torch.rand(T, TOP_K, device=DEVICE)
    out = md.fused_experts(x, q_gate_up, q_down, ids, weights, tiles=DECODE, **scales, **options)
    assert_close(out, fused_experts_fp8_ref(x, q_gate_up, q_down, ids, weights, **scales, **options))


@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_fp8_decode_down_dot(layout, poison_empty):
    """The decode path's down GEMM as one dot per expert hit (DecodeTile.dot) on float8 weights, every layout with
    block scales, at T = 5 (the dots in fp16 by decode.step_dot's choice) with duplicate experts across tokens."""
    _, options, _ = layout
    options = dict(options)
    q_gate_up, q_down, scales = _fp8_experts("block", transposed=options.get("transposed", False))
    if options.get("activation") == "swiglu_oai":
        options.update(gate_up_bias=torch.randn(E, 2 * F, device=DEVICE).bfloat16(),
                       down_bias=torch.randn(E, H, device=DEVICE).bfloat16())
    x = torch.randn(5, H, device=DEVICE).bfloat16()
    ids, weights = _ids(5), torch.rand(5, TOP_K, device=DEVICE)
    out = md.fused_experts(x, q_gate_up, q_down, ids, weights, tiles=DECODE_DOT, **scales, **options)
    assert_close(out, fused_experts_fp8_ref(x, q_gate_up, q_down, ids, weights, **scales, **options))


@pytest.mark.parametrize("T", [2, 5], ids=["scaled-tile", "fp16-dots"])
@pytest.mark.parametrize("scheme,block_shape", DECODE_SCALES, ids=["block", "block-k-side-24", "channel", "tensor"])
def test_fp8_decode_down_dot_splits(scheme, block_shape, T, poison_empty):
    """The down dot kernel split along F = 96 in three: each split's scales start at its first scale block (a K side
    of 24 steps 16 columns at a time, so its splits are whole multiples of 48), every scale scheme, both ways of
    dotting a step (decode.step_dot by T)."""
    ffn = 96
    q_gate_up, q_down, scales = _fp8_experts(scheme, block_shape=block_shape, ffn=ffn)
    tiles_split = DecodeTiles(DECODE_DOT.gate_up, dataclasses.replace(DECODE_DOT.down, split_k=3))
    x = torch.randn(T, H, device=DEVICE).bfloat16()
    ids, weights = _ids(T), torch.rand(T, TOP_K, device=DEVICE)
    out = md.fused_experts(x, q_gate_up, q_down, ids, weights, tiles=tiles_split, **scales)
    assert_close(out, fused_experts_fp8_ref(x, q_gate_up, q_down, ids, weights, **scales))


@pytest.mark.parametrize("decode_tiles", [DECODE, DECODE_DOT], ids=["gemv", "dot"])
@pytest.mark.parametrize("scheme,block_shape", [("block", (16, 16)), ("tensor", (16, 16))], ids=["block", "tensor"])
@pytest.mark.parametrize("step_dot", list(StepDot), ids=lambda d: d.name.lower())
def test_fp8_decode_dots_any_range(step_dot, scheme, block_shape, decode_tiles, monkeypatch):
    """Each way the decode kernels dot float8 tiles (decode.step_dot picks by T; the down GEMM too when it is a dot),
    on rows far outside fp16's range (x 1e6: the intermediate near 1e12), far below it (x 1e-6), exactly zero and
    ordinary, each row against the float64 experts on its own (a shared bound would hide the small rows behind the
    large one); the fp16 dots rescale each row per K step."""
    q_gate_up, q_down, scales = _fp8_experts(scheme, block_shape=block_shape)
    monkeypatch.setattr(decode, "step_dot", lambda *_: step_dot)
    x = torch.randn(4, H, device=DEVICE)
    x = (x * torch.tensor([1e6, 1e-6, 0.0, 1.0], device=DEVICE)[:, None]).bfloat16()
    ids, weights = _ids(4), torch.rand(4, TOP_K, device=DEVICE)
    out = md.fused_experts(x, q_gate_up, q_down, ids, weights, tiles=decode_tiles, **scales)
    ref = fused_experts_fp8_ref(x, q_gate_up, q_down, ids, weights, **scales)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    for row in (0, 1, 3):
        assert_close(out[row], ref[row], what=f"row {row}")


# (id, fp8_compute, T, forced tiles, expected), why: "auto" on a device with FP8 tensor cores (stood in for) takes
# the decode path, weight-only, wherever it runs for float8 weights (the interpreter table's fp8 decode bucket ends
# at N = 12 assignments)
AUTO_CASES = [
    ("decode-bucket", "auto", 6, None, "dequant"),  # N = 12
    ("past-the-bucket", "auto", 7, None, "w8a8"),  # N = 14
    ("forced-decode-tiles", "auto", 7, DECODE, "dequant"),
    ("forced-general-tiles", "auto", 2, MoeTiles(16, GemmTile(32, 32), GemmTile(32, 32)), "w8a8"),
    ("forced-w8a8", "w8a8", 2, None, "w8a8"),  # never overridden
]


@pytest.mark.parametrize("case", AUTO_CASES, ids=[c[0] for c in AUTO_CASES])
def test_auto_takes_the_decode_path_at_decode_sizes(case, monkeypatch):
    """The planner's plan of the call with float8 weights says whether the decode path runs it; "auto" then takes
    "dequant" (the weights allowed w8a8 here: the refusal is stood in for)."""
    _, choice, T, forced, expected = case
    monkeypatch.setattr(md.tiles, "device_key", lambda device: "interpreter")  # its bucket boundary, on any device
    monkeypatch.setattr(planner, "w8a8_refusal", lambda *args: None)
    q_gate_up, q_down, _ = _fp8_experts("block")
    plan = planner.plan_experts(torch.device(DEVICE), T, TOP_K, E, F, H, torch.bfloat16, forced=forced, fp8=True)
    chosen = planner.choose_fp8_compute(choice, torch.device("cuda"), q_gate_up, q_down, ["block", "block"], (16, 16),
                                        False, runs_decode=lambda: plan.path is planner.ExpertsPath.DECODE)
    assert chosen == expected


# (id, the bucket's "auto", fp8_compute, forced tiles, expected): a table's FP8 decode bucket that says
# "auto": "w8a8" sends "auto" to w8a8 and keeps its tiles for "dequant" and for forced decode tiles
BUCKET_AUTO_CASES = [
    ("bucket-without-auto", None, "auto", None, "dequant"),
    ("bucket-auto-w8a8", "w8a8", "auto", None, "w8a8"),
    ("bucket-auto-w8a8-forced-decode-tiles", "w8a8", "auto", DECODE, "dequant"),
    ("bucket-auto-w8a8-dequant-forced", "w8a8", "dequant", None, "dequant"),
]


@pytest.mark.parametrize("case", BUCKET_AUTO_CASES, ids=[c[0] for c in BUCKET_AUTO_CASES])
def test_decode_bucket_can_send_auto_to_w8a8(case, monkeypatch):
    """`operator.resolve_fp8_compute` on the interpreter table with its FP8 decode bucket (N <= 12) given `auto` or
    not, T = 6 (N = 12, in the bucket), a device with FP8 tensor cores stood in for; the decode path's plan for
    "dequant" is unchanged by the bucket's "auto"."""
    _, auto, choice, forced, expected = case
    table = copy.deepcopy(md.tiles.load_table("interpreter"))
    if auto is not None:
        table["fp8"]["decode"]["buckets"][0]["auto"] = auto
    monkeypatch.setattr(md.tiles, "device_key", lambda device: "interpreter")
    monkeypatch.setattr(md.tiles, "load_table", lambda key: table)
    monkeypatch.setattr(planner, "w8a8_refusal", lambda *args: None)
    monkeypatch.setattr(planner, "on_gpu", lambda device: True)
    q_gate_up, q_down, scales = _fp8_experts("block")
    x = torch.randn(6, H, device=DEVICE).bfloat16()
    chosen = operator.resolve_fp8_compute(choice, forced, x, TOP_K, q_gate_up, q_down,
                                          [scales["w_gate_up_scale"], scales["w_down_scale"]], (16, 16), False)
    assert chosen == expected
    plan = planner.plan_experts(torch.device(DEVICE), 6, TOP_K, E, F, H, torch.bfloat16, forced=forced, fp8=True)
    assert plan.path is planner.ExpertsPath.DECODE
    assert md.tiles.fp8_auto_takes_w8a8(torch.device(DEVICE), 6, TOP_K, E, F, H) == (auto == "w8a8")
    assert not md.tiles.fp8_auto_takes_w8a8(torch.device(DEVICE), 7, TOP_K, E, F, H)  # past the bucket


@pytest.mark.parametrize("act_dtype", [torch.float16, torch.float32])
def test_fused_experts_fp8_e4m3fnuz_default_block(act_dtype):
    """AMD's e4m3fnuz with the default 128 x 128 blocks over a weight of several partial blocks (2F = 160, H = 136),
    fp16 and fp32 activations (out in their dtype)."""
    q_gate_up, q_down, scales = _fp8_experts("block", block_shape=(128, 128), dtype=torch.float8_e4m3fnuz, ffn=80,
                                             hidden=136)
    x = torch.randn(5, 136, device=DEVICE).to(act_dtype)
    ids, weights = _ids(5), torch.rand(5, TOP_K, device=DEVICE)
    if DEVICE == "cuda" and torch.version.hip is None:  # NVIDIA: no e4m3fnuz in Triton, refused naming the weight
        with pytest.raises(TypeError, match="w_gate_up is torch.float8_e4m3fnuz"):
            md.fused_experts(x, q_gate_up, q_down, ids, weights, w_gate_up_scale=scales["w_gate_up_scale"],
                             w_down_scale=scales["w_down_scale"])
        return
    out = md.fused_experts(x, q_gate_up, q_down, ids, weights, w_gate_up_scale=scales["w_gate_up_scale"],
                           w_down_scale=scales["w_down_scale"])
    assert out.dtype == act_dtype
    assert_close(out, fused_experts_fp8_ref(x, q_gate_up, q_down, ids, weights, **scales))


def test_fused_experts_fp8_mixed_weights_and_gradients():
    """Only w_down in fp8 (gate_up stays float and trainable): the frozen fp8 weight gets no gradient (a one-time
    warning when it asks for one), hidden_states, the routing weights and the float gate/up weight get theirs,
    against float64 autograd on the dequantized weights."""
    _, q_down, scales = _fp8_experts("channel")
    w_gate_up = (torch.randn(E, 2 * F, H, device=DEVICE) * 0.2).requires_grad_()
    x = torch.randn(T, H, device=DEVICE).requires_grad_()
    ids, weights = _ids(T), torch.rand(T, TOP_K, device=DEVICE).requires_grad_()
    out = md.fused_experts(x, w_gate_up, q_down, ids, weights, w_down_scale=scales["w_down_scale"])
    grad_out = torch.randn(T, H, device=DEVICE)
    grads = torch.autograd.grad(out, [x, weights, w_gate_up], grad_out)
    leaves = [t.detach().double().requires_grad_() for t in (x, weights, w_gate_up)]
    ref = fused_experts_fp8_ref(leaves[0], leaves[2], q_down, ids, leaves[1], w_down_scale=scales["w_down_scale"])
    assert_close(out, ref, torch.float32)
    for what, g, r in zip(("d hidden_states", "d topk_weights", "d w_gate_up"), grads,
                          torch.autograd.grad(ref, leaves, grad_out.double())):
        assert_close(g, r, torch.float32, what=what)
    with pytest.warns(UserWarning, match="frozen"):
        md.fused_experts(x, w_gate_up, q_down.float().requires_grad_().to(q_down.dtype), ids, weights,
                         w_down_scale=scales["w_down_scale"])


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


LAYOUT_FFN = 96  # not a multiple of the 128-row block: "fused" and "merged" scales have one shape, two meanings


def _gate_up_scales(layout, *, transposed=False, ffn=LAYOUT_FFN, block_shape=(128, 128)):
    """(float8 w_gate_up, its block scales in `layout`, the float64 dequantized weight): "fused" quantizes the
    [E, 2F, H] weight as one, "merged" gate and up each on its own (a checkpoint's separate projections), their
    scales stacked along the N axis, gate's blocks first. Up's values are 4x gate's, so are its scales."""
    axis = 2 if transposed else 1
    w_gate_up = torch.randn(E, 2 * ffn, H, device=DEVICE) * 0.2
    w_gate_up[:, ffn:] *= 4
    if transposed:
        w_gate_up = w_gate_up.transpose(1, 2).contiguous()
    if layout == "fused":
        q, scale = quantize_experts_fp8(w_gate_up, block_shape=block_shape, n_axis=axis)
        return q, scale, dequantize_fp8_ref(q, scale, block_shape, n_axis=axis)
    halves = [quantize_experts_fp8(half, block_shape=block_shape, n_axis=axis)
              for half in w_gate_up.split(ffn, dim=axis)]
    q = torch.cat([half[0] for half in halves], dim=axis)
    scale = torch.cat([half[1] for half in halves], dim=axis)
    dequantized = torch.cat([dequantize_fp8_ref(*half, block_shape, n_axis=axis) for half in halves], dim=axis)
    return q, scale, dequantized


# (id, layout, fp8_compute, transposed, tiles): every path that reads w_gate_up's block scales
SCALE_LAYOUT_CASES = [
    ("fused-dequant", "fused", "dequant", False, None),
    ("merged-dequant", "merged", "dequant", False, None),
    ("merged-dequant-transposed", "merged", "dequant", True, None),
    ("merged-decode", "merged", "dequant", False, DECODE),
    ("fused-w8a8", "fused", "w8a8", False, None),
    ("merged-w8a8", "merged", "w8a8", False, None),
    ("merged-w8a8-transposed", "merged", "w8a8", True, None),
    ("merged-w8a8-prefill", "merged", "w8a8", False, PREFILL),
]


@pytest.mark.parametrize("case", SCALE_LAYOUT_CASES, ids=[c[0] for c in SCALE_LAYOUT_CASES])
def test_gate_up_scale_layouts(case):
    """F = 96 with 128 x 128 blocks: fused scales (ceil(2F/128) = 2 row blocks over the 2F rows) and merged ones (gate's
    one block, then up's) have the same shape; each, declared, matches the float64 experts on its dequantized weights
    (dequant and decode paths at fp32 rounding, w8a8 tightly against the model of its arithmetic on those weights),
    and the merged scales read as fused are wrong (the positive control: up's first 32 rows then take gate's 4x
    smaller scale)."""
    _, layout, compute, transposed, tiles = case
    axis = 2 if transposed else 1
    q_gate_up, s_gate_up, w_gate_up = _gate_up_scales(layout, transposed=transposed)
    w_down = torch.randn(E, H, LAYOUT_FFN, device=DEVICE) * 0.2
    if transposed:
        w_down = w_down.transpose(1, 2).contiguous()
    q_down, s_down = quantize_experts_fp8(w_down, block_shape=(128, 128), n_axis=axis)
    T_ = 3 if tiles is DECODE else T
    x = torch.randn(T_, H, device=DEVICE)
    ids, weights = _ids(T_), torch.rand(T_, TOP_K, device=DEVICE)
    options = dict(w_gate_up_scale=s_gate_up, w_down_scale=s_down, transposed=transposed, fp8_compute=compute,
                   tiles=tiles)
    out = md.fused_experts(x, q_gate_up, q_down, ids, weights, w_gate_up_scale_layout=layout, **options)
    w_down64 = dequantize_fp8_ref(q_down, s_down, (128, 128), n_axis=axis)
    reference = fused_experts_ref(x, w_gate_up, w_down64, ids, weights, transposed=transposed)
    if compute == "dequant":
        assert_close(out, reference)
    else:
        # the w8a8 model on the dequantized weights, given as "float8" weights with unit per-tensor scales
        tiles_ = tiles or md.host.tiles.select_fp8_tiles(torch.device(DEVICE), T_, TOP_K, E, LAYOUT_FFN, H)
        groups = w8a8_groups(tiles_, s_gate_up, s_down, transposed=transposed)
        ones = torch.ones(E, device=DEVICE)
        model = fused_experts_w8a8_ref(x, w_gate_up, w_down64, ids, weights, w_gate_up_scale=ones, w_down_scale=ones,
                                       groups=groups, transposed=transposed)
        assert_close(out, model, what="w8a8 vs its model", tolerance=MODEL_TOLERANCE)
        assert_close(out, reference, what="w8a8 vs dequantized weights", tolerance=W8A8_TOLERANCE)
    if layout == "merged":
        misread = md.fused_experts(x, q_gate_up, q_down, ids, weights, w_gate_up_scale_layout="fused", **options)
        assert relative_error(misread, reference) > 0.1


def test_transformers_fp8_experts_pass_their_scale_layout(monkeypatch):
    """transformers' FP8Experts: merged gate/up scales (what loading a checkpoint makes) where the counts of the two
    layouts agree (F = 96, b = 128) or where only merged has its count; fused where only fused has it (transformers
    quantizing the merged weight on load: F = 48, b = 32); the experts function runs them as the float64 experts on
    the dequantized weights. The weight-only path on every device (on an FP8 GPU "auto" would take w8a8, whose
    activation rounding is as large as a misread layout's error): the layout still comes from the integration."""
    finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")
    from transformers import MixtralConfig

    from moe_dispatch.integrations import transformers_experts

    options_of = transformers_experts.fp8_experts_options
    monkeypatch.setattr(transformers_experts, "fp8_experts_options",
                        lambda experts: {**options_of(experts), "fp8_compute": "dequant"})

    class TinyFP8Experts(finegrained.FP8Experts):  # a subclass, so that nothing of FP8Experts itself is changed
        pass

    for layout, ffn, block in (("merged", 96, 128), ("merged", 48, 32), ("fused", 48, 32)):
        config = MixtralConfig(hidden_size=H, intermediate_size=ffn, num_local_experts=E, num_experts_per_tok=TOP_K)
        experts = TinyFP8Experts(config, block_size=(block, 32))
        q_gate_up, s_gate_up, w_gate_up = _gate_up_scales(layout, ffn=ffn, block_shape=(block, 32))
        q_down, s_down = quantize_experts_fp8(torch.randn(E, H, ffn, device=DEVICE) * 0.2, block_shape=(block, 32))
        for name, value in (("gate_up_proj", q_gate_up), ("gate_up_proj_scale_inv", s_gate_up),
                            ("down_proj", q_down), ("down_proj_scale_inv", s_down)):
            setattr(experts, name, torch.nn.Parameter(value, requires_grad=False))
        assert transformers_experts.fp8_experts_options(experts).get("w_gate_up_scale_layout", "fused") == layout
        x = torch.randn(T, H, device=DEVICE)
        ids, weights = _ids(T), torch.rand(T, TOP_K, device=DEVICE)
        out = transformers_experts.moe_dispatch_experts(experts, x, ids, weights)
        reference = fused_experts_ref(x, w_gate_up, dequantize_fp8_ref(q_down, s_down, (block, 32)), ids, weights)
        assert_close(out, reference, what=f"{layout} F = {ffn}")


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU 'auto' follows the device (test_choose_fp8_compute)")
def test_fp8_compute_auto_is_dequant_on_the_cpu():
    q_gate_up, q_down, scales = _fp8_experts("block", block_shape=(16, 32))
    x = torch.randn(T, H, device=DEVICE).bfloat16()
    ids, weights = _ids(T), torch.rand(T, TOP_K, device=DEVICE)
    auto = md.fused_experts(x, q_gate_up, q_down, ids, weights, **scales)
    assert torch.equal(auto, md.fused_experts(x, q_gate_up, q_down, ids, weights, fp8_compute="dequant", **scales))
    assert not torch.equal(auto, md.fused_experts(x, q_gate_up, q_down, ids, weights, fp8_compute="w8a8", **scales))


def _weights(dtype):
    return torch.zeros(2, 64, 64, dtype=dtype)


# (id, fp8_compute, weight dtype, schemes, block shape, transposed, device has FP8 tensor cores, expected), why
CHOICES = [
    ("auto-h200", "auto", torch.float8_e4m3fn, ["block"], (128, 128), False, True, "w8a8"),
    ("auto-sm80", "auto", torch.float8_e4m3fn, ["block"], (128, 128), False, False, "dequant"),  # A100: no FP8 cores
    ("auto-mi300x", "auto", torch.float8_e4m3fnuz, ["channel"], (128, 128), False, True, "dequant"),
    ("auto-k-side-96", "auto", torch.float8_e4m3fn, ["block"], (128, 96), False, True, "dequant"),  # not a power of 2
    ("auto-k-side-16", "auto", torch.float8_e4m3fn, ["block"], (128, 16), False, True, "dequant"),  # below a K step
    ("auto-transposed-k-side", "auto", torch.float8_e4m3fn, ["block"], (64, 96), True, True, "w8a8"),  # K side is 64
    ("auto-channel-any-block", "auto", torch.float8_e4m3fn, ["channel", "tensor"], (128, 96), False, True, "w8a8"),
    ("dequant-forced", "dequant", torch.float8_e4m3fn, ["block"], (128, 128), False, True, "dequant"),
    ("w8a8-forced", "w8a8", torch.float8_e4m3fn, ["tensor"], (128, 128), False, True, "w8a8"),
    ("w8a8-sm80", "w8a8", torch.float8_e4m3fn, ["block"], (128, 128), False, False, "no FP8 tensor cores"),
    ("w8a8-mi300x", "w8a8", torch.float8_e4m3fnuz, ["block"], (128, 128), False, True, "float8_e4m3fnuz"),
    ("w8a8-k-side", "w8a8", torch.float8_e4m3fn, ["block"], (128, 96), False, True, "K side of fp8_block_shape"),
    ("w8a8-bf16", "w8a8", torch.bfloat16, [], (128, 128), False, True, "needs both expert weights in float8"),
]


@pytest.mark.parametrize("case", CHOICES, ids=[c[0] for c in CHOICES])
def test_choose_fp8_compute(case, monkeypatch):
    """The path choice from device facts (a CUDA device stood in by its FP8 tensor-core flag), never a crash for
    "auto"; a forced "w8a8" that cannot run raises ValueError saying why."""
    _, choice, dtype, schemes, block_shape, transposed, fp8_cores, expected = case
    monkeypatch.setattr(fp8_module, "has_fp8_tensor_cores", lambda device: fp8_cores)
    args = (choice, torch.device("cuda"), _weights(dtype), _weights(dtype), schemes, block_shape, transposed)
    if expected in ("w8a8", "dequant"):
        assert planner.choose_fp8_compute(*args) == expected
    else:
        with pytest.raises(ValueError, match=expected):
            planner.choose_fp8_compute(*args)


def _fnuz():
    q_gate_up, q_down, scales = _fp8_experts("block", block_shape=(16, 32), dtype=torch.float8_e4m3fnuz)
    return dict(w_gate_up=q_gate_up, w_down=q_down, **scales)


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
    ("fp8-compute-value", lambda: _bad(fp8_compute="fp8"), ValueError, "fp8_compute must be one of"),
    ("w8a8-k-side-16", lambda: _bad(fp8_compute="w8a8"), ValueError, "fp8_compute='w8a8' cannot run: the K side"),
    # NVIDIA GPUs refuse e4m3fnuz weights before the w8a8 path's own check (the weight's TypeError, as above)
    ("w8a8-e4m3fnuz", lambda: _bad(fp8_compute="w8a8", **_fnuz()),
     TypeError if DEVICE == "cuda" and torch.version.hip is None else ValueError, "float8_e4m3fnuz"),
    ("w8a8-float-gate-up", lambda: _bad(fp8_compute="w8a8", w_gate_up_scale=None,
                                        w_gate_up=torch.randn(E, 2 * F, H, device=DEVICE).bfloat16()),
     ValueError, "w8a8 needs both expert weights"),
    ("input-scale-dtype", lambda: _bad(gate_up_input_scale=torch.ones((), dtype=torch.float64, device=DEVICE)),
     TypeError, "gate_up_input_scale must be float32"),
    ("input-scale-shape", lambda: _bad(down_input_scale=torch.ones(E + 1, device=DEVICE)), ValueError,
     r"down_input_scale must hold one scale per tensor \(shape \[\] or \[1\]\) or per expert \(\[E\] = \[4\]\)"),
    ("input-scale-not-tensor", lambda: _bad(down_input_scale=0.5), TypeError,
     "down_input_scale must be a torch.Tensor"),
    ("input-scale-float-weight", lambda: _bad(w_down=torch.randn(E, H, F, device=DEVICE).bfloat16(), w_down_scale=None,
                                              down_input_scale=torch.ones(E, device=DEVICE)),
     ValueError, "down_input_scale was given but w_down has dtype"),
    ("input-scale-device", lambda: _bad(gate_up_input_scale=torch.ones(1, device="meta")), ValueError,
     "gate_up_input_scale is on meta"),
    ("input-scale-zero", lambda: _bad(down_input_scale=torch.zeros(E, device=DEVICE), validate=True), ValueError,
     "down_input_scale must be positive and finite"),
    # F = 24 with 16-row blocks: fused scales have ceil(48/16) = 3 row blocks, merged 2 * ceil(24/16) = 4
    ("fused-scale-declared-merged", lambda: _bad(w_gate_up_scale_layout="merged"), ValueError,
     r"w_gate_up_scale has shape \(4, 3, 3\) but w_gate_up \(4, 48, 40\) needs \(4, 4, 3\) for block scales with "
     r"fp8_block_shape \(16, 16\) and w_gate_up_scale_layout='merged' \(its shape is that of "
     r"w_gate_up_scale_layout='fused'\)"),
    ("merged-scale-declared-fused", lambda: _bad(w_gate_up_scale=torch.ones(E, 4, 3, device=DEVICE)), ValueError,
     r"w_gate_up_scale has shape \(4, 4, 3\) but w_gate_up \(4, 48, 40\) needs \(4, 3, 3\) for block scales with "
     r"fp8_block_shape \(16, 16\) and w_gate_up_scale_layout='fused' \(its shape is that of "
     r"w_gate_up_scale_layout='merged'\)"),
    ("scale-layout-neither", lambda: _bad(w_gate_up_scale=torch.ones(E, 5, 3, device=DEVICE),
                                          w_gate_up_scale_layout="merged"), ValueError,
     r"needs \(4, 4, 3\) for block scales with fp8_block_shape \(16, 16\) and w_gate_up_scale_layout='merged'$"),
    ("scale-layout-value", lambda: _bad(w_gate_up_scale_layout="concatenated"), ValueError,
     "w_gate_up_scale_layout must be one of"),
    ("merged-scale-interleaved", lambda: _bad(w_gate_up_scale_layout="merged", interleaved=True), ValueError,
     "w_gate_up_scale_layout='merged' .* needs concatenated gate/up rows"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_fp8_bad_inputs(case):
    _, make, error, message = case
    with pytest.raises(error, match=message):
        md.fused_experts(**make())


def test_e4m3fnuz_is_refused_on_nvidia(monkeypatch):
    """AMD's format on an NVIDIA GPU (a CUDA device without HIP, stood in for: no tensor is allocated there) raises
    naming the weight instead of failing in Triton's compiler; e4m3fn there, and e4m3fnuz on the CPU or on AMD, pass."""
    monkeypatch.setattr(fp8_module, "is_hip", lambda: False)
    fnuz, fn = torch.zeros(1, dtype=torch.float8_e4m3fnuz), torch.zeros(1, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="w_down is torch.float8_e4m3fnuz"):
        fp8_module.check_fp8_dtype_on_device("w_down", fnuz, torch.device("cuda"))
    fp8_module.check_fp8_dtype_on_device("w_down", fn, torch.device("cuda"))
    fp8_module.check_fp8_dtype_on_device("w_down", fnuz, torch.device("cpu"))
    monkeypatch.setattr(fp8_module, "is_hip", lambda: True)
    fp8_module.check_fp8_dtype_on_device("w_down", fnuz, torch.device("cuda"))


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


# (id, fused_experts options, why)
E8M0_PATHS = [
    ("dequant-grouped", dict(fp8_compute="dequant", tiles=MoeTiles(16, GemmTile(32, 32), GemmTile(32, 32))),
     "the grouped GEMMs' per-element block scales (BLOCK_STEP)"),
    ("dequant-decode", dict(fp8_compute="dequant", tiles=DECODE), "the decode gate/up kernel and the down GEMV"),
    ("dequant-decode-dot", dict(fp8_compute="dequant", tiles=DECODE_DOT), "the decode down dot kernel"),
    ("auto", {}, "w8a8 where the device has FP8 tensor cores (its block scales per K step), else dequant"),
]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("path", E8M0_PATHS, ids=lambda p: p[0])
def test_e8m0_weight_scales_read_as_their_fp32_values(path, scheme):
    """float8_e8m0fnu scales (powers of two, UE8M0 checkpoints) give the bits the same scales in float32 give, on
    every path, and the e8m0 NaN code makes the rows of that expert NaN."""
    _, options, _ = path
    q_gate_up, q_down, scales = _fp8_experts(scheme, block_shape=(16, 32))
    e8m0 = {k: (v.to(torch.float8_e8m0fnu) if k.endswith("_scale") else v) for k, v in scales.items()}
    as_fp32 = {k: (v.float() if k.endswith("_scale") else v) for k, v in e8m0.items()}
    x = torch.randn(4, H, device=DEVICE).bfloat16()
    ids, weights = _ids(4), torch.rand(4, TOP_K, device=DEVICE)
    out = md.fused_experts(x, q_gate_up, q_down, ids, weights, **e8m0, **options)
    assert torch.equal(out, md.fused_experts(x, q_gate_up, q_down, ids, weights, **as_fp32, **options))
    poisoned = e8m0["w_down_scale"].view(torch.uint8).clone()
    poisoned[int(ids[0, 0])] = 0xFF
    out = md.fused_experts(x, q_gate_up, q_down, ids, weights, **{**e8m0, "w_down_scale": poisoned.view(
        torch.float8_e8m0fnu)}, **options)
    hit = (ids == ids[0, 0]).any(dim=1)
    assert out[hit].isnan().all() and not out[~hit].isnan().any()


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_gradients_through_frozen_fp8_experts(layout, scheme):
    """Frozen float8 weights (QLoRA-style fine-tuning around them): hidden_states, the routing weights and the biases
    get the gradients of the experts with the dequantized weights (the backward's dX and dA GEMMs dequantize in
    their loads, block scales with their sides swapped, channel scales along K), on the dequant path that "auto"
    takes when a gradient is needed."""
    _, options, _ = layout
    options = dict(options)
    q_gate_up, q_down, scales = _fp8_experts(scheme, transposed=options.get("transposed", False),
                                             block_shape=(16, 32))
    x = torch.randn(T, H, device=DEVICE)
    ids, weights = _ids(T), torch.rand(T, TOP_K, device=DEVICE)
    leaves = [x, weights, torch.randn(E, 2 * F, device=DEVICE) * 0.1, torch.randn(E, H, device=DEVICE) * 0.1]
    for t in leaves:
        t.requires_grad_(True)
    out = md.fused_experts(x, q_gate_up, q_down, ids, weights, gate_up_bias=leaves[2], down_bias=leaves[3],
                           **scales, **options)
    grad_out = torch.randn(T, H, device=DEVICE)
    grads = torch.autograd.grad(out, leaves, grad_out)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    ref = fused_experts_fp8_ref(ref_leaves[0], q_gate_up, q_down, ids, ref_leaves[1], gate_up_bias=ref_leaves[2],
                                down_bias=ref_leaves[3], **scales, **options)
    assert_close(out, ref, torch.float32)
    names = ("d hidden_states", "d topk_weights", "d gate_up_bias", "d down_bias")
    for name, g, r in zip(names, grads, torch.autograd.grad(ref, ref_leaves, grad_out.double())):
        assert_close(g, r, torch.float32, what=name)
