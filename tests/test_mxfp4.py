"""MXFP4 experts through `fused_experts` (formats/mxfp4.py's format, gemm.jit.mxfp4_tile_dot in the loads): every path
against the float64 reference of the dequantized weights, non-finite values where they must propagate, replays, and
every bad input refused with the argument named. The CPU suite runs small widths through the interpreter; on a GPU
the same cases run compiled, and the real GPT-OSS widths too."""

import pytest
import torch
from helpers import DEVICE, assert_close, needs_gpu

import moe_dispatch as md
from moe_dispatch import moe
from moe_dispatch.gemm import planner
from moe_dispatch.gemm.mxfp4_dequant import dequantize_mxfp4_experts
from moe_dispatch.host import replay
from moe_dispatch.moe import _FUSED_EXPERTS_PLANS
from moe_dispatch.reference import dequantize_mxfp4_ref, fused_experts_ref
from moe_dispatch.host.tiles import DecodeTile, DecodeTiles, GemmTile, MoeTiles

# Forced tiles, so each path runs whatever the device's table says: the decode path (its down GEMM the dot kernel,
# split in two along F) and the grouped path; BLOCK_K 32 / 64 against K = 96 leaves a masked tail step.
DECODE = DecodeTiles(DecodeTile(32, 64), DecodeTile(32, 32, split_k=2, dot=True))
# the decode path's GEMVs (gate/up per assignment, DecodeTile.gemv; down per assignment, split in two along F): the
# weight bytes multiplied in registers
DECODE_GEMV = DecodeTiles(DecodeTile(16, 64, gemv=True), DecodeTile(32, 32, split_k=2))
GROUPED = MoeTiles(16, GemmTile(32, 64), GemmTile(32, 32))


def _experts(E, H, F, *, T, top_k, dtype=torch.float32, scale_dtype=torch.uint8, bias=True, seed=0):
    """x, MXFP4 (blocks, scales) of gate/up [E, 2F, H] and down [E, H, F], ids, weights, biases."""
    torch.manual_seed(seed)
    x = torch.randn(T, H).to(DEVICE, dtype)
    gate_up, gate_up_scale = md.quantize_experts_mxfp4(torch.randn(E, 2 * F, H, device=DEVICE) * 0.2,
                                                       scale_dtype=scale_dtype)
    down, down_scale = md.quantize_experts_mxfp4(torch.randn(E, H, F, device=DEVICE) * 0.2, scale_dtype=scale_dtype)
    ids = torch.stack([torch.randperm(E)[:top_k] for _ in range(T)] or [torch.zeros(0, top_k, dtype=torch.int64)])
    ids = ids.reshape(T, top_k).to(DEVICE)
    weights = torch.rand(T, top_k, device=DEVICE)
    biases = {}
    if bias:
        biases = dict(gate_up_bias=(torch.randn(E, 2 * F, device=DEVICE) * 0.1).to(dtype),
                      down_bias=(torch.randn(E, H, device=DEVICE) * 0.1).to(dtype))
    return x, (gate_up, gate_up_scale), (down, down_scale), ids, weights, biases


def _reference(x, gate_up, down, ids, weights, **kwargs):
    kwargs = {k: v for k, v in kwargs.items() if k not in ("tiles", "validate")}
    return fused_experts_ref(x.double(), dequantize_mxfp4_ref(*gate_up), dequantize_mxfp4_ref(*down), ids,
                             weights.double(), **kwargs)


def _run(x, gate_up, down, ids, weights, **kwargs):
    return md.fused_experts(x, gate_up[0], down[0], ids, weights, w_gate_up_scale=gate_up[1],
                            w_down_scale=down[1], validate=False, **kwargs)


# (id, T, E, top_k, H, F, fused_experts options, why)
CASES = [
    ("decode-gpt-oss", 3, 4, 2, 64, 96, dict(tiles=DECODE, activation="swiglu_oai", interleaved=True),
     "GPT-OSS's layout (interleaved rows read whole) on the decode path; F = 96 leaves a masked K step in the down "
     "GEMM and its second split"),
    ("decode-concatenated", 3, 4, 2, 96, 64, dict(tiles=DECODE),
     "gate rows then up rows (two views, the up scales F rows on), silu; H = 96 a masked K step of gate/up"),
    ("decode-gemv-gpt-oss", 3, 4, 2, 64, 96, dict(tiles=DECODE_GEMV, activation="swiglu_oai", interleaved=True),
     "the GEMVs on GPT-OSS's layout: gate and up rows of a tile read as alternate rows; F = 96 a masked K step of the "
     "down GEMV and its second split"),
    ("decode-gemv-concatenated", 3, 4, 2, 96, 64, dict(tiles=DECODE_GEMV),
     "the GEMVs on two views (the up rows and their scales F rows on), silu; H = 96 a masked K step of gate/up"),
    ("grouped-gpt-oss", 37, 5, 3, 64, 96, dict(tiles=GROUPED, activation="swiglu_oai", interleaved=True),
     "the grouped path: dispatch, the pointer GEMMs dequantizing in their loads, combine; prime E, top-3"),
    ("grouped-concatenated", 37, 5, 2, 96, 64, dict(tiles=GROUPED), "the grouped path on concatenated rows"),
    ("table", 5, 4, 2, 64, 64, dict(activation="swiglu_oai", interleaved=True), "whatever the device's table picks"),
]


# Every case with uint8 scale codes; float8_e8m0fnu scales on the two decode cases. fused_experts views e8m0 scales as
# their uint8 codes (mxfp4.check_mxfp4_weight) before it picks a path, so every kernel reads the same bytes either way:
# what the e8m0 cases add is that view, on both gate/up layouts.
SCALE_CASES = [(case, torch.uint8) for case in CASES] + [(case, torch.float8_e8m0fnu) for case in CASES
                                                         if case[0].startswith("decode")]


@pytest.mark.parametrize("case,scale_dtype", SCALE_CASES,
                         ids=[f"{'u8' if dtype == torch.uint8 else 'e8m0'}-{case[0]}" for case, dtype in SCALE_CASES])
def test_fused_experts_mxfp4_matches_float64(case, scale_dtype, poison_empty):
    name, T, E, top_k, H, F, options, _ = case
    x, gate_up, down, ids, weights, biases = _experts(E, H, F, T=T, top_k=top_k, scale_dtype=scale_dtype)
    out = _run(x, gate_up, down, ids, weights, **options, **biases)
    assert_close(out, _reference(x, gate_up, down, ids, weights, **options, **biases), torch.float32)


def test_both_block_forms_give_the_same_bits():
    """[E, N, K/32, 16] blocks and their [E, N, K/2] bytes are one weight."""
    x, gate_up, down, ids, weights, biases = _experts(4, 64, 64, T=3, top_k=2)
    first = _run(x, gate_up, down, ids, weights, **biases)
    flat = tuple((blocks.flatten(2), scale) for blocks, scale in (gate_up, down))
    assert torch.equal(_run(x, *flat[:1], flat[1], ids, weights, **biases), first)


@pytest.mark.parametrize("tiles", [DECODE, DECODE_GEMV, GROUPED], ids=["decode", "decode-gemv", "grouped"])
def test_non_finite_values_propagate(tiles):
    """A NaN in x makes its token's row NaN and no other; an e8m0 NaN code (0xFF) makes every token routed to that
    expert NaN and no other; inf in x stays non-finite."""
    E, H, F, T = 4, 64, 64, 6
    x, gate_up, down, ids, weights, biases = _experts(E, H, F, T=T, top_k=1, bias=False)
    ids = torch.tensor([[0], [1], [2], [3], [0], [1]], device=DEVICE)
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    gate_up_scale = gate_up[1].clone()
    gate_up_scale[3, 0, 1] = 0xFF
    out = _run(x, (gate_up[0], gate_up_scale), down, ids, weights, tiles=tiles)
    nan_rows = out.isnan().any(dim=1)
    assert nan_rows[1] and nan_rows[3], "a NaN input or a NaN scale lost"
    assert not nan_rows[[0, 4, 5]].any(), "NaN reached tokens of other experts"
    assert not out[2].isfinite().all()


def test_replay_gives_each_calls_result():
    """The second call of a signature replays the first's launches (the byte and scale views included) on new
    values."""
    replay.clear()
    x, gate_up, down, ids, weights, biases = _experts(4, 64, 64, T=3, top_k=2)
    _run(x, gate_up, down, ids, weights, **biases)
    x2, gate_up2, down2, _, _, _ = _experts(4, 64, 64, T=3, top_k=2, seed=1)
    replays = _FUSED_EXPERTS_PLANS.replays
    out = _run(x2, gate_up2, down2, ids, weights, **biases)
    assert _FUSED_EXPERTS_PLANS.replays == replays + 1, _FUSED_EXPERTS_PLANS.last_reason
    assert_close(out, _reference(x2, gate_up2, down2, ids, weights, **biases), torch.float32)


def _dequantizing_first(monkeypatch):
    """Every MXFP4 call without gradients decodes its weights first (gemm/mxfp4_dequant.py): the "buffer" switch."""
    monkeypatch.setenv("MOE_DISPATCH_MXFP4_PREFILL", "buffer")
    replay.clear()


def _spy_dequantize(monkeypatch):
    calls = []
    real = moe.dequantize_mxfp4_experts
    monkeypatch.setattr(moe, "dequantize_mxfp4_experts", lambda *a: calls.append(a[0].shape) or real(*a))
    return calls


def test_the_prefill_switch_takes_effect_on_the_next_call(monkeypatch):
    """MOE_DISPATCH_MXFP4_PREFILL, read once per call and part of every plan's key: at T = 3 ("auto": the loads'
    path) the first call after setting "buffer" decodes the weights first, the first after "loads" does not, with no
    plan cleared in between; a value seen before replays its own plan (the same bits), never another value's. Every
    output is the float64 experts'."""
    calls = _spy_dequantize(monkeypatch)
    x, gate_up, down, ids, weights, biases = _experts(4, 64, 64, T=3, top_k=2)
    reference = _reference(x, gate_up, down, ids, weights, **biases)
    outs, decoded, start = {}, [], len(_FUSED_EXPERTS_PLANS)
    for value in ("auto", "buffer", "loads"):
        monkeypatch.setenv("MOE_DISPATCH_MXFP4_PREFILL", value)
        before = len(calls)
        outs[value] = _run(x, gate_up, down, ids, weights, **biases)
        assert_close(outs[value], reference, torch.float32, what=value)
        decoded.append(len(calls) > before)
    assert decoded == [False, True, False], decoded
    assert len(_FUSED_EXPERTS_PLANS) == start + 3, "a value's first call did not record a plan of its own"
    for value in ("buffer", "auto"):  # replayed: the value's own plan (its own record), the same bits
        monkeypatch.setenv("MOE_DISPATCH_MXFP4_PREFILL", value)
        replays, plans = _FUSED_EXPERTS_PLANS.replays, len(_FUSED_EXPERTS_PLANS)
        again = _run(x, gate_up, down, ids, weights, **biases)
        assert _FUSED_EXPERTS_PLANS.replays == replays + 1 and len(_FUSED_EXPERTS_PLANS) == plans, value
        assert torch.equal(again, outs[value]), value


@pytest.mark.parametrize("interleaved", [True, False], ids=["gpt-oss", "concatenated"])
def test_prefill_dequantizing_first_matches_float64(interleaved, monkeypatch, poison_empty):
    """With MOE_DISPATCH_MXFP4_PREFILL=buffer the weights are decoded once into a float buffer and the float path runs
    on it: the same float64 reference as the loads' path, H = 96 not a multiple of the decode kernel's 256
    values per program, F = 160 not one of 64."""
    _dequantizing_first(monkeypatch)
    calls = _spy_dequantize(monkeypatch)
    options = dict(activation="swiglu_oai", interleaved=True) if interleaved else {}
    x, gate_up, down, ids, weights, biases = _experts(5, 96, 160, T=19, top_k=2)
    out = _run(x, gate_up, down, ids, weights, **options, **biases)
    assert calls == [(5, 320, 48), (5, 96, 80)], "the call did not decode its weights first"
    assert_close(out, _reference(x, gate_up, down, ids, weights, **options, **biases), torch.float32)


def test_dequantize_kernel_gives_the_formats_values():
    """The buffer holds exactly formats/mxfp4.py's dequantized values (fp32: no rounding), every e2m1 code and the
    scale codes 0 (2^-127, subnormal), 254 and 0xFF (NaN for the whole group) among them; blocks as a strided view."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(3, 5, 2)  # [3, 5, 512]: every byte, twice per row
    blocks = codes.view(3, 5, 32, 16).to(DEVICE)
    scale = torch.randint(110, 135, (3, 5, 32), dtype=torch.uint8)
    scale[0, 0, :3] = torch.tensor([0, 254, 0xFF], dtype=torch.uint8)
    scale = scale.to(DEVICE)
    wide = torch.zeros(3, 7, 512, dtype=torch.uint8, device=DEVICE)
    wide[:, 1:6] = codes.to(DEVICE)
    for packed in (blocks.flatten(2), wide[:, 1:6]):  # contiguous bytes, and rows strided inside a larger tensor
        out = dequantize_mxfp4_experts(packed, scale, torch.float32)
        expected = md.dequantize_experts_mxfp4(blocks, scale, torch.float32)
        assert out.shape == (3, 5, 1024) and torch.equal(out.isnan(), expected.isnan())
        assert torch.equal(out.nan_to_num(), expected.nan_to_num()), "a value differs from the format's"
    assert out[0, 0, 64:96].isnan().all() and not out[0, 0, :64].isnan().any()


def test_prefill_dequantizing_first_propagates_non_finite_values(monkeypatch):
    """The decoded buffer keeps the NaN scale code's NaN for its expert's tokens only; NaN in x stays in its row."""
    _dequantizing_first(monkeypatch)
    x, gate_up, down, ids, weights, biases = _experts(4, 64, 64, T=6, top_k=1, bias=False)
    ids = torch.tensor([[0], [1], [2], [3], [0], [1]], device=DEVICE)
    x[1, 5] = float("nan")
    gate_up_scale = gate_up[1].clone()
    gate_up_scale[3, 0, 1] = 0xFF
    nan_rows = _run(x, (gate_up[0], gate_up_scale), down, ids, weights).isnan().any(dim=1)
    assert nan_rows.tolist() == [False, True, False, True, False, False]


def test_planner_dequantizes_first_only_when_asked_without_gradients():
    """The choice reads host facts only: the switch ("auto" and "loads" never, whatever the rows per expert), the
    buffer's bytes against their bound, gradients (autograd would keep the buffer) and forced tiles (the MXFP4 path's)
    rule it out."""
    choose = planner.mxfp4_dequantizes_first
    kwargs = dict(forced_tiles=False, grad=False, prefill="buffer")
    assert choose(1, 4, 32, 2880, 2880, torch.bfloat16, **kwargs)
    for prefill in ("auto", "loads"):
        assert not choose(1 << 20, 4, 32, 2880, 2880, torch.bfloat16, forced_tiles=False, grad=False, prefill=prefill)
    assert not choose(4096, 4, 32, 2880, 2880, torch.bfloat16, forced_tiles=True, grad=False, prefill="buffer")
    assert not choose(4096, 4, 32, 2880, 2880, torch.bfloat16, forced_tiles=False, grad=True, prefill="buffer")
    big = planner.MXFP4_DEQUANTIZE_MAX_BYTES // (3 * 2880 * 2880 * 2) + 1  # experts whose buffer passes the bound
    assert not choose(4096, 4, big, 2880, 2880, torch.bfloat16, **kwargs)
    assert choose(4096, 4, big - 1, 2880, 2880, torch.bfloat16, **kwargs)
    assert not choose(0, 4, 0, 2880, 2880, torch.bfloat16, **kwargs)


def test_gradients_keep_the_loads_path(monkeypatch):
    """With a gradient asked for, the MXFP4 weights stay in the GEMMs' loads even where the switch asks for the
    buffer."""
    _dequantizing_first(monkeypatch)
    calls = _spy_dequantize(monkeypatch)
    x, gate_up, down, ids, weights, biases = _experts(4, 64, 64, T=5, top_k=2)
    x.requires_grad_(True)
    _run(x, gate_up, down, ids, weights, **biases).sum().backward()
    assert calls == [] and x.grad is not None


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "concatenated"])
def test_gradients_through_frozen_mxfp4_experts(interleaved):
    """The weights stay frozen (no gradient); hidden_states, the routing weights and both biases get theirs (the
    backward's dX and dA GEMMs read the MXFP4 weights along their packed axis), against float64 autograd on the
    dequantized weights. T = 37 over prime E: partial row tiles; F = 96 a partial column tile of scale groups."""
    E, H, F = 5, 64, 96
    x, gate_up, down, ids, weights, biases = _experts(E, H, F, T=37, top_k=2)
    leaves = [x, weights, biases["gate_up_bias"], biases["down_bias"]]
    for t in leaves:
        t.requires_grad_(True)
    options = dict(activation="swiglu_oai", interleaved=interleaved)
    out = _run(x, gate_up, down, ids, weights, **options, **biases)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, grad_out)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    ref = fused_experts_ref(ref_leaves[0], dequantize_mxfp4_ref(*gate_up), dequantize_mxfp4_ref(*down), ids,
                            ref_leaves[1], gate_up_bias=ref_leaves[2], down_bias=ref_leaves[3], **options)
    assert_close(out, ref, torch.float32)
    names = ("d hidden_states", "d topk_weights", "d gate_up_bias", "d down_bias")
    for name, g, r in zip(names, grads, torch.autograd.grad(ref, ref_leaves, grad_out.double())):
        assert_close(g, r, torch.float32, what=name)


def _bad(x, gate_up, down, ids, weights, biases, defect):
    """The call's arguments with one defect."""
    args = dict(hidden_states=x, w_gate_up=gate_up[0], w_down=down[0], topk_ids=ids, topk_weights=weights,
                w_gate_up_scale=gate_up[1], w_down_scale=down[1], validate=False, **biases)
    args.update(defect(args))
    return args


# (id, defect, exception, message pattern)
BAD_INPUTS = [
    ("scale-missing", lambda a: dict(w_down_scale=None), ValueError, "w_down_scale is missing"),
    ("scale-dtype", lambda a: dict(w_gate_up_scale=a["w_gate_up_scale"].float()), TypeError, "w_gate_up_scale"),
    ("scale-shape", lambda a: dict(w_down_scale=a["w_down_scale"][:, :-1]), ValueError, "w_down_scale has shape"),
    ("k-not-h", lambda a: dict(hidden_states=torch.randn(3, 96, device=DEVICE)), ValueError, "hidden_states has H"),
    ("odd-packing", lambda a: dict(w_down=a["w_down"][..., :8]), ValueError, "w_down"),
    ("down-rows", lambda a: dict(w_down=a["w_down"][:, :32], w_down_scale=a["w_down_scale"][:, :32]), ValueError,
     "w_down has N = 32 rows"),
    ("mixed-formats", lambda a: dict(w_down=torch.zeros(4, 64, 64, device=DEVICE), w_down_scale=None), TypeError,
     "both expert weights must be MXFP4"),
    ("strided-bytes", lambda a: dict(w_gate_up=torch.zeros(4, 128, 64, dtype=torch.uint8, device=DEVICE)[..., ::2]),
     ValueError, "contiguous"),
    ("transposed", lambda a: dict(transposed=True), ValueError, "transposed"),
    ("w8a8", lambda a: dict(fp8_compute="w8a8"), ValueError, "w8a8"),
    ("input-scale", lambda a: dict(gate_up_input_scale=torch.ones(1, device=DEVICE)), ValueError,
     "MXFP4 weights take none"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=lambda c: c[0])
def test_bad_inputs_are_refused_naming_the_argument(case):
    """Refused on the first call and after a valid call of the same shapes (a planned signature)."""
    _, defect, error, pattern = case
    x, gate_up, down, ids, weights, biases = _experts(4, 64, 64, T=3, top_k=2)
    with pytest.raises(error, match=pattern):
        md.fused_experts(**_bad(x, gate_up, down, ids, weights, biases, defect))
    _run(x, gate_up, down, ids, weights, **biases)  # records the signature's plan
    with pytest.raises(error, match=pattern):
        md.fused_experts(**_bad(x, gate_up, down, ids, weights, biases, defect))


@needs_gpu
@pytest.mark.parametrize("T", [1, 4, 16, 200, 2048], ids=lambda T: f"T{T}")
def test_gpt_oss_width_on_the_gpu(T):
    """GPT-OSS-20B's widths (E 32, top-4, H = F = 2880) in bf16 through whatever the tables pick (decode up to the
    decode bucket, then the grouped path) against float64 on the dequantized weights, rows sampled."""
    E, H, F, top_k = 32, 2880, 2880, 4
    x, gate_up, down, ids, weights, biases = _experts(E, H, F, T=T, top_k=top_k, dtype=torch.bfloat16)
    weights = torch.softmax(torch.randn(T, top_k, device=DEVICE), dim=-1)
    options = dict(activation="swiglu_oai", interleaved=True)
    out = _run(x, gate_up, down, ids, weights, **options, **biases)
    rows = torch.arange(0, T, max(1, T // 64), device=DEVICE)
    ref = _reference(x[rows], gate_up, down, ids[rows], weights[rows], **options,
                     **{k: v.double() for k, v in biases.items()})
    assert_close(out[rows], ref, torch.bfloat16)



@needs_gpu
@pytest.mark.parametrize("T", [1, 2, 7], ids=lambda T: f"T{T}")
def test_gpt_oss_width_decode_gemvs_on_the_gpu(T):
    """The decode GEMVs forced at GPT-OSS-20B's widths (H = F = 2880: a masked tail step of 256 values in both) in bf16
    (the PTX decode) against float64 on the dequantized weights."""
    E, H, F, top_k = 32, 2880, 2880, 4
    x, gate_up, down, ids, weights, biases = _experts(E, H, F, T=T, top_k=top_k, dtype=torch.bfloat16)
    options = dict(activation="swiglu_oai", interleaved=True)
    tiles = DecodeTiles(DecodeTile(16, 256, gemv=True), DecodeTile(16, 256, split_k=2))
    out = _run(x, gate_up, down, ids, weights, tiles=tiles, **options, **biases)
    ref = _reference(x, gate_up, down, ids, weights, **options, **{k: v.double() for k, v in biases.items()})
    assert_close(out, ref, torch.bfloat16)


@needs_gpu
@pytest.mark.parametrize("forced", [False, True], ids=["a-first-tiles", "weight-first-tiles"])
def test_offsets_past_32_bits(forced):
    """T * k * H > 2^31 with MXFP4 weights and bf16 activations (the PTX decode): row offsets into x, the
    intermediate and the output are 64-bit. 16k rows per expert: the table's 128-row tiles, which dot A first (on an
    SM90 GPU with Gluon, mode auto takes the Gluon engine there instead: its own such test is test_gluon_mxfp4's), or
    tiles forced to 64 rows, which dot the weight first. Rows sampled against float64."""
    T, E, k, H, F = 2**18 + 1000, 32, 2, 4096, 64
    assert T * k * H > 2**31
    x, gate_up, down, ids, weights, biases = _experts(E, H, F, T=16, top_k=k, dtype=torch.bfloat16, bias=False)
    torch.manual_seed(1)
    x = torch.randn(T, H, device=DEVICE, dtype=torch.bfloat16)
    ids = torch.randint(0, E, (T, k), device=DEVICE)
    ids[:, 1] = (ids[:, 0] + 1 + torch.randint(0, E - 1, (T,), device=DEVICE)) % E  # two distinct experts a token
    weights = torch.rand(T, k, device=DEVICE)
    tiles = MoeTiles(64, GemmTile(64, 64, 8, 3), GemmTile(128, 64, 8, 3)) if forced else None
    out = _run(x, gate_up, down, ids, weights, tiles=tiles)
    rows = torch.cat([torch.arange(64), torch.randint(0, T, (192,)), torch.arange(T - 64, T)]).to(DEVICE)
    assert_close(out[rows], _reference(x[rows], gate_up, down, ids[rows], weights[rows]), torch.bfloat16)


# The PTX decode (gemm/jit.py `e2m1_bf16x2`, bf16 activations on NVIDIA) in both operand orders of mxfp4_tile_dot:
# 16-row tiles dot the weight first, 128-row tiles (MXFP4_A_LHS_MIN_ROWS) dot A first.
BF16X2_TILES = {"weight-first": MoeTiles(16, GemmTile(32, 128, 4, 4), GemmTile(64, 128, 4, 4)),
                "a-first": MoeTiles(128, GemmTile(64, 64, 8, 3), GemmTile(128, 64, 8, 3)),
                "decode-gemv": DecodeTiles(DecodeTile(16, 128, gemv=True), DecodeTile(32, 128, split_k=2))}


def test_bf16_activations_decode_by_ptx_only_on_nvidia_gpus():
    """The launch code: MXFP4_BF16X2 for bf16 activations on an NVIDIA GPU of sm_80 or later, MXFP4 (the fp32 decode)
    for other dtypes and wherever no PTX runs (the interpreter, AMD)."""
    from moe_dispatch.formats.mxfp4 import mxfp4_weight_scale
    from moe_dispatch.formats.scale_codes import WeightScaleCode
    from moe_dispatch.gemm.args import dequant_scale_code
    from moe_dispatch.host.device import capability, is_cuda, is_interpreter

    ws = mxfp4_weight_scale(torch.full((2, 8, 4), 127, dtype=torch.uint8, device=DEVICE))
    ptx = DEVICE == "cuda" and is_cuda() and not is_interpreter() and capability(torch.device(DEVICE)) >= (8, 0)
    expected = WeightScaleCode.MXFP4_BF16X2 if ptx else WeightScaleCode.MXFP4
    assert dequant_scale_code(ws, 64, dtype=torch.bfloat16, device=torch.device(DEVICE)) == (expected, 64)
    for dtype in (torch.float16, torch.float32):
        assert dequant_scale_code(ws, 64, dtype=dtype, device=torch.device(DEVICE)) == (WeightScaleCode.MXFP4, 64)


@pytest.mark.parametrize("tiles", list(BF16X2_TILES.values()), ids=list(BF16X2_TILES))
def test_bf16_decode_matches_float64_and_keeps_nans(tiles):
    """bf16 activations (on an NVIDIA GPU: the PTX decode; elsewhere the fp32 one) against float64 on odd sizes
    (H = 160: a masked K step of 64 and of 128; F = 96), an expert nobody routes to, ragged rows per expert; then a NaN
    in x reaches its token only and a NaN scale code (0xFF) every token routed to that expert only."""
    E, H, F, top_k = 6, 160, 96, 2
    T = 100 if isinstance(tiles, DecodeTiles) else 300  # the decode path takes at most 256 assignments
    x, gate_up, down, ids, weights, biases = _experts(E, H, F, T=T, top_k=top_k, dtype=torch.bfloat16)
    ids = torch.where(ids == 5, 0, ids)  # expert 5 empty
    ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 1) % 5, ids[:, 1])
    options = dict(activation="swiglu_oai", interleaved=True, tiles=tiles)
    out = _run(x, gate_up, down, ids, weights, **options, **biases)
    ref = _reference(x, gate_up, down, ids, weights, **options, **{k: v.double() for k, v in biases.items()})
    assert_close(out, ref, torch.bfloat16)

    x[7, 3] = float("nan")
    codes = gate_up[1].clone()
    expert = int(ids[11, 0])
    codes[expert, 2, 1] = 0xFF
    out = _run(x, (gate_up[0], codes), down, ids, weights, **options, **biases).isnan().any(dim=1)
    routed = (ids == expert).any(dim=1)
    routed[7] = True
    assert torch.equal(out, routed), "NaN lost, or reached tokens of other experts"


# Compiles (Triton's compiled mode, for sm_90, no GPU) the grouped GEMMs of one MXFP4 call with 128-row tiles whose
# weight tiles are narrower (down: 64 columns) and wider (gate/up: 128 pairs, 256 rows) than A's 128 rows.
_A_FIRST_COMPILE = """
import sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import compile_report as cr
import moe_dispatch
from moe_dispatch.host import device
from moe_dispatch.host.tiles import GemmTile, MoeTiles
recorder, arena = cr.Recorder(cr.TARGETS["h200"]), cr.Arena()
E, H, F, T = 4, 256, 192, 512
with device.compile_target(cr.TARGETS["h200"]), recorder.active(), cr.warnings_off():
    recorder.problem = "a-first tiles"
    moe_dispatch.fused_experts(
        torch.empty(T, H, dtype=torch.bfloat16), arena.empty((E, 2 * F, H // 2), torch.uint8),
        arena.empty((E, H, F // 2), torch.uint8), torch.randint(0, E, (T, 2)), torch.empty(T, 2),
        w_gate_up_scale=torch.empty(E, 2 * F, H // 32, dtype=torch.uint8),
        w_down_scale=torch.empty(E, H, F // 32, dtype=torch.uint8), validate=False, activation="swiglu_oai",
        interleaved=True, tiles=MoeTiles(128, GemmTile(128, 64, 8, 3), GemmTile(64, 64, 4, 4)))
grouped = [launch for launch in recorder.launches.values() if "grouped" in launch.name]
assert len(grouped) == 2, [launch.name for launch in recorder.launches.values()]
for launch in grouped:
    assert "WEIGHT_SCALE=7" in launch.describe(), launch.describe()
    triton.compile(ASTSource(launch.kernel, launch.signature, launch.constexprs, launch.attrs),
                   target=GPUTarget("cuda", 90, 32), options=launch.options.__dict__)
print("compiled", len(grouped))
"""


def test_a_first_tiles_of_any_width_compile_for_sm90(tmp_path):
    """128-row MXFP4 tiles dot A first whatever the weight tile's width: the kernels compile (they once failed to
    where the two differed, on a shape check of the weight-first branch's code)."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join(os.path.join(ROOT, d) for d in ("torch-ext", "scripts", "benchmarks")))
    result = subprocess.run([sys.executable, "-c", _A_FIRST_COMPILE], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and "compiled 2" in result.stdout, result.stderr[-3000:]


def test_expert_parallelism_refuses_mxfp4_naming_the_argument():
    """ep_fused_experts takes float weights only: MXFP4 blocks are refused before any exchange."""
    x, gate_up, down, ids, weights, biases = _experts(4, 64, 64, T=3, top_k=2)
    with pytest.raises(TypeError, match="w_gate_up_local is torch.uint8"):
        md.ep_fused_experts(x, gate_up[0], down[0], ids, weights)
