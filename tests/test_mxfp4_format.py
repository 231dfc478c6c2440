"""MXFP4 expert weights, host side (formats/mxfp4.py): decoding against the float64 reference and against values written
out by hand (every e2m1 code, the nibble order, the e8m0 scale codes), the quantizer's rules (nearest value, ties to the
even mantissa, saturation, zero and non-finite groups, the e8m0 range), both block forms and both scale dtypes, and
every error of `check_mxfp4_weight` naming its argument. CPU only: no kernel runs here.
"""

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch

import moe_dispatch as md
from moe_dispatch.formats import mxfp4
from moe_dispatch.formats.mxfp4 import (E2M1_MAX, E8M0_BIAS, E8M0_NAN, MXFP4_GROUP, SCALE_DTYPES, check_mxfp4_weight,
                                dequantize_experts_mxfp4, is_mxfp4, mxfp4_k, quantize_experts_mxfp4)
from moe_dispatch.reference import dequantize_mxfp4_ref, quantize_mxfp4_ref

# e2m1 by code, written out from the OCP spec (not taken from either table under test).
E2M1_BY_CODE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
DEQUANT_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _blocks_of_codes(codes):
    """e2m1 codes [E, N, K] (ints 0-15) -> blocks uint8 [E, N, K/32, 16], byte by byte: low nibble the even K index."""
    E, N, K = codes.shape
    out = torch.zeros(E, N, K // 2, dtype=torch.uint8)
    for j in range(K // 2):
        out[:, :, j] = codes[:, :, 2 * j] + 16 * codes[:, :, 2 * j + 1]
    return out.view(E, N, K // 32, 16)


def _scales(codes, E=1, N=1):
    """Scale codes (a list, one per group) as uint8 [E, N, groups]."""
    return torch.tensor(codes, dtype=torch.uint8).expand(E, N, len(codes)).contiguous()


def _random_weights(shape, seed=0):
    """Gaussian weights with a different magnitude (2^-20 .. 2^20) per group of 32, so scale codes vary."""
    g = torch.Generator().manual_seed(seed)
    E, N, K = shape
    spread = torch.randint(-20, 21, (E, N, K // 32, 1), generator=g).float().exp2()
    return (torch.randn(E, N, K // 32, 32, generator=g) * spread).reshape(shape)


def test_every_e2m1_code_decodes_to_its_value():
    """Codes 0-15 (scale 2^0) decode to the spec's values, code 8 to -0.0 and code 0 to +0.0."""
    codes = torch.tensor(list(range(16)) * 2).view(1, 1, 32)
    blocks = _blocks_of_codes(codes)
    expected = torch.tensor(E2M1_BY_CODE * 2, dtype=torch.float64).view(1, 1, 32)
    ref = dequantize_mxfp4_ref(blocks, _scales([E8M0_BIAS]))
    assert torch.equal(ref, expected) and torch.equal(torch.signbit(ref), torch.signbit(expected))
    for dtype in DEQUANT_DTYPES:
        out = dequantize_experts_mxfp4(blocks, _scales([E8M0_BIAS]), dtype)
        assert out.dtype == dtype and torch.equal(out.double(), expected), dtype
        assert torch.equal(torch.signbit(out), torch.signbit(expected)), dtype


def test_low_nibble_holds_the_even_k_index():
    """Byte 0x71: K index 0 is code 1 (0.5), index 1 code 7 (6). Byte j of group g holds indices 32g + 2j, +1."""
    blocks = torch.zeros(1, 1, 2, 16, dtype=torch.uint8)
    blocks[0, 0, 0, 0] = 0x71
    blocks[0, 0, 1, 5] = 0xA3  # group 1, byte 5: index 32 + 10 = 42 is code 3 (1.5), index 43 code 10 (-1)
    for out in (dequantize_mxfp4_ref(blocks, _scales([127, 127])),
                dequantize_experts_mxfp4(blocks, _scales([127, 127]), torch.float64)):
        nonzero = {k: out[0, 0, k].item() for k in range(64) if out[0, 0, k] != 0}
        assert nonzero == {0: 0.5, 1: 6.0, 42: 1.5, 43: -1.0}


def test_random_bytes_decode_nibble_by_nibble():
    """Every byte value, read index by index: value k is the nibble k % 2 of byte k // 2, times its group's scale."""
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (2, 3, 4, 16), dtype=torch.uint8, generator=g)
    scale = torch.randint(100, 150, (2, 3, 4), dtype=torch.uint8, generator=g)
    packed = blocks.view(2, 3, 64).long()
    nibbles = torch.stack((packed % 16, packed // 16), dim=-1).view(2, 3, 128)
    table = torch.tensor(E2M1_BY_CODE, dtype=torch.float64)
    expected = table[nibbles] * torch.tensor(2.0).double().pow(scale.double() - 127).repeat_interleave(32, -1)
    assert torch.equal(dequantize_mxfp4_ref(blocks, scale), expected)
    assert torch.equal(dequantize_experts_mxfp4(blocks, scale, torch.float64), expected)
    assert torch.equal(dequantize_experts_mxfp4(blocks, scale, torch.float32), expected.float())


# (scale code, its value, why). The e2m1 values 0.5 and 1 (codes 1, 2) are multiplied by it.
SCALE_CODES = [
    (0, 2.0**-127, "the smallest scale: 2^-127, subnormal in float32 (and bf16), normal in float64"),
    (1, 2.0**-126, "the smallest normal float32"),
    (127, 1.0, "the bias: 2^0"),
    (254, 2.0**127, "the largest scale: 2^127"),
    (255, math.nan, "NaN: the whole group, its zero codes included"),
]


@pytest.mark.parametrize("code,value,why", SCALE_CODES, ids=[str(c[0]) for c in SCALE_CODES])
def test_scale_codes(code, value, why):
    codes = torch.zeros(1, 1, 32, dtype=torch.int64)
    codes[0, 0, :2] = torch.tensor([1, 2])  # 0.5, 1; the other 30 values are +0
    blocks = _blocks_of_codes(codes)
    expected = torch.zeros(1, 1, 32, dtype=torch.float64)
    expected[0, 0, :2] = torch.tensor([0.5, 1.0])
    expected = expected * value if not math.isnan(value) else torch.full_like(expected, math.nan)
    for scale in (_scales([code]), _scales([code]).view(torch.float8_e8m0fnu)):
        torch.testing.assert_close(dequantize_mxfp4_ref(blocks, scale), expected, rtol=0, atol=0, equal_nan=True)
        for dtype in DEQUANT_DTYPES:
            out = dequantize_experts_mxfp4(blocks, scale, dtype)
            torch.testing.assert_close(out, expected.to(dtype), rtol=0, atol=0, equal_nan=True)


def test_largest_scale_overflows_to_inf_outside_float64():
    """6 * 2^127 exceeds float32's and bf16's range: inf there, finite in float64 and in the reference."""
    codes = torch.full((1, 1, 32), 7)
    blocks, scale = _blocks_of_codes(codes), _scales([254])
    assert (dequantize_mxfp4_ref(blocks, scale) == 6 * 2.0**127).all()
    assert (dequantize_experts_mxfp4(blocks, scale, torch.float64) == 6 * 2.0**127).all()
    assert torch.isposinf(dequantize_experts_mxfp4(blocks, scale, torch.float32)).all()


# Shapes for the quantizer against the reference: (E, N, K, why).
QUANTIZE_SHAPES = [
    (1, 1, 32, "one group"),
    (2, 3, 64, "two groups per row"),
    (3, 5, 160, "odd E, N and five groups"),
]


@pytest.mark.parametrize("E,N,K,why", QUANTIZE_SHAPES, ids=[f"{s[0]}x{s[1]}x{s[2]}" for s in QUANTIZE_SHAPES])
def test_quantize_matches_reference_and_dequantizes_exactly(E, N, K, why):
    """Same bytes as the float64 reference quantizer; the dequantizer equals the reference dequantization bit for bit;
    each group's largest value lands on 4 or 6 (scaled amax in [4, 8)); quantizing the result again changes nothing."""
    w = _random_weights((E, N, K))
    blocks, scale = quantize_experts_mxfp4(w)
    assert blocks.shape == (E, N, K // 32, 16) and blocks.dtype == torch.uint8
    assert scale.shape == (E, N, K // 32) and scale.dtype == torch.uint8
    ref_blocks, ref_scale = quantize_mxfp4_ref(w)
    assert torch.equal(blocks, ref_blocks) and torch.equal(scale, ref_scale)
    ref = dequantize_mxfp4_ref(blocks, scale)
    assert torch.equal(dequantize_experts_mxfp4(blocks, scale, torch.float64), ref)
    assert torch.equal(dequantize_experts_mxfp4(blocks, scale, torch.float32), ref.float())
    group_max = (ref.abs().view(E, N, K // 32, 32).amax(-1) / torch.tensor(2.0).double().pow(scale.double() - 127))
    assert ((group_max == 4) | (group_max == 6)).all()
    again = quantize_experts_mxfp4(ref)
    assert torch.equal(again[0], blocks) and torch.equal(again[1], scale)


def test_round_trip_error_bounds():
    """|w - dq(q(w))| <= max(|w| / 4, 2^(e - 2)) per value, e the group's exponent: half a step of e2m1 (0.25 below 2,
    0.5 in [2, 4), 1 in [4, 6)) and saturation from (6, 8) to 6 all fit. Gaussian groups lose ~10% RMS."""
    w = _random_weights((4, 8, 256), seed=2)
    blocks, scale = quantize_experts_mxfp4(w)
    back = dequantize_experts_mxfp4(blocks, scale, torch.float64)
    exponent = scale.double().repeat_interleave(32, -1) - 127
    bound = torch.maximum(w.double().abs() / 4, torch.tensor(2.0).double().pow(exponent - 2))
    assert ((back - w.double()).abs() <= bound).all()
    groups = lambda t: t.double().view(-1, 32)  # noqa: E731
    rms = ((groups(back) - groups(w)).norm(dim=-1) / groups(w).norm(dim=-1)).mean()
    assert 0.05 < rms < 0.15, rms


def _quantize_value(value, exponent=0, dtype=torch.float32):
    """One value quantized in a group whose largest magnitude is 4 * 2^exponent (the shared exponent is then
    `exponent`) -> (its dequantized value / 2^exponent, the group's scale code), by the package and by the reference."""
    w = torch.zeros(1, 1, 32, dtype=torch.float64)
    w[0, 0, 0] = 4.0 * 2.0**exponent
    w[0, 0, 1] = value * 2.0**exponent
    w = w.to(dtype)
    results = []
    for blocks, scale in (quantize_experts_mxfp4(w), quantize_mxfp4_ref(w)):
        back = dequantize_mxfp4_ref(blocks, scale)[0, 0, 1] / 2.0**exponent
        results.append((back.item(), int(scale[0, 0, 0]), bool(torch.signbit(back))))
    assert results[0] == results[1], results
    return results[0]


# (scaled value, expected e2m1 value, why): nearest value, ties to the even mantissa bit, saturation.
ROUNDING = [
    (0.25, 0.0, "midpoint 0 | 0.5: to 0 (code 0, even)"),
    (0.75, 1.0, "midpoint 0.5 | 1: to 1 (code 2)"),
    (1.25, 1.0, "midpoint 1 | 1.5: to 1 (code 2)"),
    (1.75, 2.0, "midpoint 1.5 | 2: to 2 (code 4)"),
    (2.5, 2.0, "midpoint 2 | 3: to 2 (code 4)"),
    (3.5, 4.0, "midpoint 3 | 4: to 4 (code 6)"),
    (5.0, 4.0, "midpoint 4 | 6: to 4 (code 6)"),
    (-2.5, -2.0, "ties to even with the sign kept"),
    (-5.0, -4.0, "ties to even with the sign kept"),
    (0.25 + 2**-20, 0.5, "just above a midpoint that ties down: up"),
    (0.75 - 2**-20, 0.5, "just below a midpoint that ties up: down"),
    (5.0 + 2**-20, 6.0, "just above the last midpoint: 6"),
    (0.1, 0.0, "below 0.25: +0"),
    (-0.1, -0.0, "below 0.25, negative: -0 (code 8, the sign kept as IEEE rounding keeps it)"),
    (2.9, 3.0, "nearest"),
    (4.0, 4.0, "exact"),
    (6.0, 6.0, "exact, the largest e2m1 value"),
]


@pytest.mark.parametrize("value,expected,why", ROUNDING, ids=[str(r[0]) for r in ROUNDING])
@pytest.mark.parametrize("exponent", [0, -10, 40])
def test_rounding(value, expected, why, exponent):
    back, code, negative = _quantize_value(value, exponent)
    assert back == expected and code == exponent + 127 and negative == (math.copysign(1, expected) < 0)


# (group's largest value, expected scale code, its dequantized value, why): the shared exponent and saturation.
SATURATION = [
    (7.99, 127, 6.0, "amax in (6, 8): exponent floor(log2) - 2 = 0, saturates to 6"),
    (8.0, 128, 8.0, "amax 8: exponent 1, exactly 4 * 2"),
    (6.5, 127, 6.0, "just past 6: 6, not rounded up to 8 (no exponent bump)"),
    (2.0**-128, 0, 2.0**-128, "float32 subnormal: exponent clamped to -127, 0.5 * 2^-127"),
    (2.0**-140, 0, 0.0, "far below 2^-127 * 0.25: rounds to 0 with code 0"),
]


@pytest.mark.parametrize("amax,code,value,why", SATURATION, ids=[str(s[0]) for s in SATURATION])
def test_shared_exponent_and_saturation(amax, code, value, why):
    w = torch.zeros(1, 1, 32)
    w[0, 0, 3] = amax
    for blocks, scale in (quantize_experts_mxfp4(w), quantize_mxfp4_ref(w)):
        assert int(scale[0, 0, 0]) == code
        assert dequantize_experts_mxfp4(blocks, scale, torch.float64)[0, 0, 3].item() == value


def test_exponent_clamped_above_for_float64_weights():
    """A float64 group beyond e8m0's range (amax 2^200) takes code 254 (2^127) and saturates to 6 * 2^127."""
    w = torch.zeros(1, 1, 32, dtype=torch.float64)
    w[0, 0, :2] = torch.tensor([2.0**200, -(2.0**126)], dtype=torch.float64)
    for blocks, scale in (quantize_experts_mxfp4(w), quantize_mxfp4_ref(w)):
        back = dequantize_experts_mxfp4(blocks, scale, torch.float64)[0, 0, :2]
        assert int(scale[0, 0, 0]) == 254 and back.tolist() == [6 * 2.0**127, -0.5 * 2.0**127]


def test_zero_groups():
    """An all-zero group: scale code 0 and zero bytes; -0.0 values keep their sign (code 8) and decode to -0.0."""
    w = torch.zeros(1, 2, 64)
    w[0, 1, :32] = -0.0
    w[0, 1, 32:] = torch.randn(32)  # a live group next to the zero ones
    for blocks, scale in (quantize_experts_mxfp4(w), quantize_mxfp4_ref(w)):
        assert scale[0, 0].tolist() == [0, 0] and scale[0, 1, 0] == 0 and scale[0, 1, 1] != 0
        assert (blocks[0, 0] == 0).all() and (blocks[0, 1, 0] == 0x88).all()
        back = dequantize_experts_mxfp4(blocks, scale, torch.float32)
        assert (back[0, :, :32] == 0).all() and torch.signbit(back[0, 1, :32]).all()
        assert not torch.signbit(back[0, 0]).any()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_value_marks_its_group_nan(bad):
    """One NaN or inf: its group gets scale code 0xFF and zero codes (all 32 values dequantize to NaN); the other
    groups of the row are quantized as usual."""
    w = _random_weights((1, 2, 96), seed=3)
    clean = quantize_experts_mxfp4(w)
    w[0, 1, 40] = bad
    for blocks, scale in (quantize_experts_mxfp4(w), quantize_mxfp4_ref(w)):
        assert int(scale[0, 1, 1]) == E8M0_NAN and (blocks[0, 1, 1] == 0).all()
        assert torch.isnan(dequantize_experts_mxfp4(blocks, scale, torch.float32)[0, 1, 32:64]).all()
        keep = torch.ones(2, 3, dtype=torch.bool)
        keep[1, 1] = False
        assert torch.equal(scale[0][keep], clean[1][0][keep]) and torch.equal(blocks[0][keep], clean[0][0][keep])


def test_input_dtypes_and_chunks_agree(monkeypatch):
    """bf16 weights quantize as their float32 and float64 copies do (the rounding is exact in either), and expert
    chunks (forced to one expert each) give what one chunk gives."""
    w = _random_weights((3, 4, 64), seed=4).bfloat16()
    whole = quantize_experts_mxfp4(w)
    for copy in (w.float(), w.double()):
        assert all(torch.equal(a, b) for a, b in zip(quantize_experts_mxfp4(copy), whole))
    monkeypatch.setattr(mxfp4, "_CHUNK_VALUES", 4 * 64)
    assert all(torch.equal(a, b) for a, b in zip(quantize_experts_mxfp4(w), whole))
    assert torch.equal(dequantize_experts_mxfp4(*whole, torch.float64), dequantize_mxfp4_ref(*whole))


def test_scale_dtypes_and_block_forms_agree():
    """float8_e8m0fnu scales hold the uint8 codes bit for bit; [E, N, K/32, 16] and [E, N, K/2] blocks with either scale
    dtype dequantize identically; check_mxfp4_weight returns views of the same memory for all four."""
    w = _random_weights((2, 3, 128), seed=5)
    blocks, scale = quantize_experts_mxfp4(w)
    blocks_e8, scale_e8 = quantize_experts_mxfp4(w, scale_dtype=torch.float8_e8m0fnu)
    assert scale_e8.dtype == torch.float8_e8m0fnu and torch.equal(scale_e8.view(torch.uint8), scale)
    assert torch.equal(blocks_e8, blocks)
    assert torch.equal(scale_e8.double(), torch.tensor(2.0).double().pow(scale.double() - 127))  # torch's own reading
    flat = blocks.view(2, 3, 64)
    expected = dequantize_experts_mxfp4(blocks, scale, torch.float32)
    for b in (blocks, flat):
        for s in (scale, scale_e8):
            assert torch.equal(dequantize_experts_mxfp4(b, s, torch.float32), expected)
            assert torch.equal(dequantize_mxfp4_ref(b, s), expected.double())
            packed, codes = check_mxfp4_weight("w", b, "w_scale", s)
            assert packed.shape == (2, 3, 64) and packed.dtype == torch.uint8 and codes.dtype == torch.uint8
            assert packed.data_ptr() == blocks.data_ptr() and codes.data_ptr() == s.data_ptr()
            assert torch.equal(packed, flat) and torch.equal(codes, scale)


def test_rows_may_be_strided():
    """Only the bytes along K need to be contiguous: every other row (a gate view of interleaved gate/up rows) passes
    as a view of the same memory."""
    blocks, scale = quantize_experts_mxfp4(_random_weights((2, 6, 64), seed=6))
    packed, codes = check_mxfp4_weight("w_gate", blocks[:, ::2], "w_gate_scale", scale[:, ::2], rows=3, k=64)
    assert packed.data_ptr() == blocks.data_ptr() and packed.stride() == (6 * 32, 2 * 32, 1)
    assert torch.equal(packed, blocks[:, ::2].reshape(2, 3, 32)) and torch.equal(codes, scale[:, ::2])


def test_small_helpers():
    assert MXFP4_GROUP == 32 and E2M1_MAX == 6.0 and E8M0_BIAS == 127 and E8M0_NAN == 0xFF
    assert SCALE_DTYPES == (torch.uint8, torch.float8_e8m0fnu)
    assert is_mxfp4(torch.zeros(1, dtype=torch.uint8))
    assert not any(is_mxfp4(x) for x in (torch.zeros(1), torch.zeros(1, dtype=torch.float8_e4m3fn), b"\x00", None))
    assert mxfp4_k(torch.zeros(2, 3, 4, 16, dtype=torch.uint8)) == 128
    assert mxfp4_k(torch.zeros(2, 3, 64, dtype=torch.uint8)) == 128
    with pytest.raises(ValueError, match="MXFP4 blocks must be"):
        mxfp4_k(torch.zeros(3, 64, dtype=torch.uint8))
    assert md.quantize_experts_mxfp4 is quantize_experts_mxfp4
    assert md.dequantize_experts_mxfp4 is dequantize_experts_mxfp4
    assert md.mxfp4 is mxfp4 and {"quantize_experts_mxfp4", "dequantize_experts_mxfp4"} <= set(md.__all__)


@dataclasses.dataclass(frozen=True)
class Bad:
    """A broken (blocks, scale) pair for check_mxfp4_weight("w_gate_up", ..., "w_gate_up_scale", ...) and the error
    it must raise; `make` turns the good pair (blocks [2, 6, 2, 16], scale [2, 6, 2], K = 64) into the bad one."""

    id: str
    why: str
    make: Callable
    error: type
    match: str
    options: tuple = ()  # keyword arguments of the check, as (name, value) pairs


def _strided_k(blocks, scale):
    wide = torch.zeros(2, 6, 2, 32, dtype=torch.uint8)
    return wide[..., ::2], scale


def _groups_apart(blocks, scale):
    return torch.zeros(2, 2, 6, 16, dtype=torch.uint8).transpose(1, 2), scale


BAD = [
    Bad("not-a-tensor", "a list of bytes", lambda b, s: (b.tolist(), s), TypeError, "w_gate_up must be a torch.Tensor"),
    Bad("meta", "shapes without data", lambda b, s: (b.to("meta"), s), ValueError, "w_gate_up is on meta"),
    Bad("float-blocks", "an unquantized weight with a scale", lambda b, s: (b.float(), s), TypeError,
        "w_gate_up must be uint8"),
    Bad("int8-blocks", "signed bytes", lambda b, s: (b.view(torch.int8), s), TypeError, "w_gate_up must be uint8"),
    Bad("rank-2", "one expert's one row", lambda b, s: (b[0, 0], s), ValueError,
        r"w_gate_up must be MXFP4 blocks \[E, N, K/32, 16\] or their bytes"),
    Bad("rank-5", "an extra dimension", lambda b, s: (b[None], s), ValueError, "w_gate_up must be MXFP4 blocks"),
    Bad("block-of-8", "8 bytes per block (16 values): not MXFP4's 32", lambda b, s: (b.view(2, 6, 4, 8), s),
        ValueError, r"w_gate_up must be MXFP4 blocks \[E, N, K/32, 16\] \(16 bytes"),
    Bad("k-not-multiple-of-32", "[E, N, K/2] bytes with K = 48", lambda b, s: (b.view(2, 6, 32)[..., :24], s),
        ValueError, "w_gate_up packs K = 48 values per row .*multiple of 32"),
    Bad("k-zero", "no values", lambda b, s: (b[:, :, :0], s[:, :, :0]), ValueError,
        "w_gate_up packs K = 0 values per row .*positive multiple of 32"),
    Bad("missing-scale", "blocks without scales", lambda b, s: (b, None), ValueError,
        "w_gate_up_scale is missing"),
    Bad("scale-not-a-tensor", "a float", lambda b, s: (b, 1.0), TypeError, "w_gate_up_scale must be a torch.Tensor"),
    Bad("float32-scale", "decoded scales (2^(c-127)) in float32", lambda b, s: (b, s.float()), TypeError,
        "w_gate_up_scale must be e8m0 scales of dtype uint8 or float8_e8m0fnu"),
    Bad("fp8-scale", "an e4m3 scale", lambda b, s: (b, s.view(torch.float8_e4m3fn)), TypeError,
        "w_gate_up_scale must be e8m0"),
    Bad("scale-one-group", "one scale per row", lambda b, s: (b, s[:, :, :1]), ValueError,
        r"w_gate_up_scale has shape \(2, 6, 1\) but w_gate_up \(2, 6, 2, 16\) .* needs \(2, 6, 2\)"),
    Bad("scale-transposed", "[E, K/32, N]", lambda b, s: (b, s.transpose(1, 2)), ValueError,
        r"w_gate_up_scale has shape \(2, 2, 6\) but w_gate_up"),
    Bad("scale-per-16", "scales per 16 values (NVFP4-like) on the 3-D form", lambda b, s: (b.view(2, 6, 32),
        torch.zeros(2, 6, 4, dtype=torch.uint8)), ValueError, r"w_gate_up_scale has shape \(2, 6, 4\) but w_gate_up "
        r"\(2, 6, 32\)"),
    Bad("experts", "E = 2 but 3 expected", lambda b, s: (b, s), ValueError,
        "w_gate_up holds E = 2 experts but num_experts = 3", (("num_experts", 3),)),
    Bad("rows", "N = 6 but 8 expected", lambda b, s: (b, s), ValueError,
        "w_gate_up has N = 6 rows per expert but 8 were expected", (("rows", 8),)),
    Bad("rows-named", "the message says where N comes from", lambda b, s: (b, s), ValueError,
        r"w_gate_up has N = 6 rows per expert but 2 \* intermediate_size = 8",
        (("rows", 8), ("rows_source", "2 * intermediate_size"))),
    Bad("k", "K = 64 but 2880 expected", lambda b, s: (b, s), ValueError,
        "w_gate_up packs K = 64 values per row but K = 2880 was expected", (("k", 2880),)),
    Bad("k-named", "the example of the interface", lambda b, s: (b, s), ValueError,
        "^w_gate_up packs K = 64 values per row but hidden_states has H = 2880$",
        (("k", 2880), ("k_source", "hidden_states has H"))),
    Bad("strided-k", "every other byte along K", _strided_k, ValueError,
        r"w_gate_up must have the bytes of each row contiguous along K .* never copied"),
    Bad("groups-apart", "K/32 stride 96, not 16: blocks of a row not adjacent", _groups_apart, ValueError,
        r"w_gate_up must have the bytes of each row contiguous .*got strides \(192, 16, 96, 1\)"),
    Bad("transposed-3d", "[E, K/2, N] bytes transposed to [E, N, K/2]", lambda b, s: (b.view(2, 6, 32).transpose(1, 2)
        .contiguous().transpose(1, 2), s), ValueError, "w_gate_up must have the bytes of each row contiguous"),
]


@pytest.mark.parametrize("bad", BAD, ids=[b.id for b in BAD])
def test_check_mxfp4_weight_errors_name_the_argument(bad):
    blocks = torch.zeros(2, 6, 2, 16, dtype=torch.uint8)
    scale = torch.full((2, 6, 2), 127, dtype=torch.uint8)
    check_mxfp4_weight("w_gate_up", blocks, "w_gate_up_scale", scale, num_experts=2, rows=6, k=64)
    bad_blocks, bad_scale = bad.make(blocks, scale)
    with pytest.raises(bad.error, match=bad.match):
        check_mxfp4_weight("w_gate_up", bad_blocks, "w_gate_up_scale", bad_scale, **dict(bad.options))


# (w, scale_dtype, error, match): the quantizer's own argument errors.
QUANTIZE_BAD = [
    (torch.zeros(2, 4, 48), torch.uint8, ValueError, r"w has K = 48 values per row .*multiple of 32"),
    (torch.zeros(4, 64), torch.uint8, ValueError, "w must have 3 dimensions"),
    (torch.zeros(1, 4, 64, dtype=torch.int32), torch.uint8, TypeError, "w must have dtype in"),
    (torch.zeros(1, 4, 64), torch.float32, TypeError, "scale_dtype must be torch.uint8 or torch.float8_e8m0fnu"),
]


@pytest.mark.parametrize("w,scale_dtype,error,match", QUANTIZE_BAD, ids=["k48", "rank2", "int32", "float32-scales"])
def test_quantize_argument_errors(w, scale_dtype, error, match):
    with pytest.raises(error, match=match):
        quantize_experts_mxfp4(w, scale_dtype=scale_dtype)


def test_dequantize_checks_its_arguments():
    blocks, scale = quantize_experts_mxfp4(torch.randn(1, 2, 32))
    with pytest.raises(ValueError, match="scale is missing"):
        dequantize_experts_mxfp4(blocks, None)
    with pytest.raises(TypeError, match="blocks must be uint8"):
        dequantize_experts_mxfp4(blocks.view(torch.int8), scale)
    with pytest.raises(TypeError, match="dtype must be a floating-point dtype"):
        dequantize_experts_mxfp4(blocks, scale, torch.int32)
