"""`ExpertsQuant` (formats/quant.py), the quantization of a call's expert weights as one object: `fused_experts` with
`quant=` computes what the v1 keywords compute (bit for bit, on a first and on a replayed call, and within tolerance
of the float64 reference), a format that does not match the weights is refused naming both, and the object checks its
own fields by kind. Shapes are tiny: the interpreter runs every kernel on the CPU."""

import dataclasses

import pytest
import torch
from helpers import DEVICE, assert_close

import moe_dispatch as md
from moe_dispatch.reference import fused_experts_fp8_ref, fused_experts_ref

E, TOP_K, H, F, T = 4, 2, 64, 32, 5


def _routing():
    ids = torch.stack([torch.randperm(E)[:TOP_K] for _ in range(T)]).to(DEVICE)
    return torch.randn(T, H, device=DEVICE).bfloat16(), ids, torch.rand(T, TOP_K, device=DEVICE)


def _fp8(scheme):
    """float8 weights and their v1 keywords (16 x 32 blocks: each weight spans several, the last partial on N)."""
    block = (16, 32)
    gate_up, gate_up_scale = md.quantize_experts_fp8(torch.randn(E, 2 * F, H, device=DEVICE) * 0.2, scheme,
                                                     block_shape=block)
    down, down_scale = md.quantize_experts_fp8(torch.randn(E, H, F, device=DEVICE) * 0.2, scheme, block_shape=block)
    return gate_up, down, dict(w_gate_up_scale=gate_up_scale, w_down_scale=down_scale, fp8_block_shape=block)


def _mxfp4():
    gate_up, gate_up_scale = md.quantize_experts_mxfp4(torch.randn(E, 2 * F, H, device=DEVICE) * 0.2)
    down, down_scale = md.quantize_experts_mxfp4(torch.randn(E, H, F, device=DEVICE) * 0.2)
    return gate_up, down, dict(w_gate_up_scale=gate_up_scale, w_down_scale=down_scale)


@pytest.mark.parametrize("scheme", ["block", "channel", "tensor"])
def test_fp8_quant_object_computes_what_the_keywords_compute(scheme):
    """Each scale scheme: the object and the keywords take the same path, twice (the second call replays a plan)."""
    x, ids, weights = _routing()
    gate_up, down, keywords = _fp8(scheme)
    quant = md.ExpertsQuant.fp8(keywords["w_gate_up_scale"], keywords["w_down_scale"],
                                block_shape=keywords["fp8_block_shape"], compute="dequant")
    expected = md.fused_experts(x, gate_up, down, ids, weights, fp8_compute="dequant", **keywords)
    for _ in range(2):
        assert torch.equal(md.fused_experts(x, gate_up, down, ids, weights, quant=quant), expected)
    assert_close(expected, fused_experts_fp8_ref(x, gate_up, down, ids, weights, **keywords))


def test_mxfp4_quant_object_computes_what_the_keywords_compute():
    x, ids, weights = _routing()
    gate_up, down, keywords = _mxfp4()
    quant = md.ExpertsQuant.mxfp4(keywords["w_gate_up_scale"], keywords["w_down_scale"])
    expected = md.fused_experts(x, gate_up, down, ids, weights, **keywords)
    for _ in range(2):
        assert torch.equal(md.fused_experts(x, gate_up, down, ids, weights, quant=quant), expected)
    dequantized = [md.dequantize_experts_mxfp4(w, s, torch.float32) for w, s in
                   ((gate_up, keywords["w_gate_up_scale"]), (down, keywords["w_down_scale"]))]
    assert_close(expected, fused_experts_ref(x, *dequantized, ids, weights))


def _fp8_call(when):
    """A valid fp8 call's operands, its keywords and its ExpertsQuant; run once first when `when` says so (a refusal
    must then come from the replayed, planned call as from the first)."""
    x, ids, weights = _routing()
    gate_up, down, keywords = _fp8("channel")
    quant = md.ExpertsQuant.fp8(keywords["w_gate_up_scale"], keywords["w_down_scale"])
    if when == "after a valid call":
        md.fused_experts(x, gate_up, down, ids, weights, quant=quant)
    return x, ids, weights, gate_up, down, keywords, quant


@pytest.mark.parametrize("when", ["first call", "after a valid call"])
def test_quant_and_a_v1_keyword_together_are_refused_naming_the_keyword(when):
    x, ids, weights, gate_up, down, keywords, quant = _fp8_call(when)
    for name, value in (("w_down_scale", keywords["w_down_scale"]), ("fp8_compute", "dequant"),
                        ("fp8_block_shape", (16, 32)), ("w_gate_up_scale_layout", "merged")):
        with pytest.raises(TypeError, match=f"quant= and {name}="):
            md.fused_experts(x, gate_up, down, ids, weights, quant=quant, **{name: value})


@pytest.mark.parametrize("when", ["first call", "after a valid call"])
def test_a_format_that_does_not_match_the_weights_is_refused(when):
    """The format is declared, never inferred: fp8 over float weights, mxfp4 over float8 weights."""
    x, ids, weights, gate_up, down, _, fp8 = _fp8_call(when)
    with pytest.raises(TypeError, match="quant.format is 'fp8' but w_gate_up and w_down have dtypes bfloat16"):
        md.fused_experts(x, gate_up.bfloat16(), down.bfloat16(), ids, weights, quant=fp8)
    mx_gate_up, mx_down, mx_keywords = _mxfp4()
    mxfp4 = md.ExpertsQuant.mxfp4(mx_keywords["w_gate_up_scale"], mx_keywords["w_down_scale"])
    with pytest.raises(TypeError, match="quant.format is 'mxfp4' but w_gate_up has dtype float8_e4m3fn"):
        md.fused_experts(x, gate_up, down, ids, weights, quant=mxfp4)
    with pytest.raises(TypeError, match="quant must be a moe_dispatch.ExpertsQuant"):
        md.fused_experts(x, mx_gate_up, mx_down, ids, weights, quant=mx_keywords)


def test_the_object_checks_its_fields_by_kind_naming_them():
    scale = torch.ones(E, device=DEVICE)
    cases = [
        (ValueError, "quant.format", lambda: md.ExpertsQuant("fp4", scale, scale)),
        (ValueError, "quant.compute", lambda: md.ExpertsQuant.mxfp4(scale, scale, compute="w8a8")),
        (ValueError, "quant.compute", lambda: md.ExpertsQuant.fp8(scale, scale, compute="W8A8")),
        (ValueError, "quant.weight_layout", lambda: md.ExpertsQuant("fp8", scale, scale, weight_layout="prepared")),
        (ValueError, "quant.gate_up_scale_layout", lambda: md.ExpertsQuant.fp8(gate_up_scale_layout="split")),
        (ValueError, "quant.block_shape", lambda: md.ExpertsQuant.fp8(block_shape=(128, 0))),
        (ValueError, "quant.w_gate_up_scale and quant.w_down_scale", lambda: md.ExpertsQuant.mxfp4(scale, None)),
        (ValueError, "quant.block_shape is a field of float8 weights",
         lambda: md.ExpertsQuant("mxfp4", scale, scale, block_shape=(64, 64))),
        (ValueError, "quant.gate_up_input_scale is a field of float8 weights",
         lambda: md.ExpertsQuant("mxfp4", scale, scale, gate_up_input_scale=scale)),
        (TypeError, "quant.w_down_scale", lambda: md.ExpertsQuant.fp8(scale, [1.0])),
        (ValueError, "quant.compute", lambda: md.ExpertsQuant.fp8(compute=None)),
    ]
    for error, says, build in cases:
        with pytest.raises(error, match=says.replace(".", r"\.")):
            build()
    with pytest.raises(dataclasses.FrozenInstanceError):
        md.ExpertsQuant.fp8().compute = "w8a8"  # frozen: a plan's key may hold it
