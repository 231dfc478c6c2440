"""GPU-only: GPT-OSS's experts in the layout transformers stores them ([E, H, 2F] with gate and up columns
alternating, [E, F, H], biases, clamped SwiGLU) at the real width, through every forward path the planner picks by T
(decode, the pointer and the persistent grouped GEMMs), against float64 and against the same values laid [E, 2F, H].
Its gradients at real width are in test_gpu_backward.py. Skipped without a GPU."""

import pytest
import torch
from helpers import assert_close, needs_gpu
from model_shapes import MODEL_SHAPES

import moe_dispatch as md
from moe_dispatch.gemm import persistent
from moe_dispatch.reference import fused_experts_fp8_ref, fused_experts_ref

pytestmark = needs_gpu
DTYPE = torch.bfloat16
OPTIONS = dict(activation="swiglu_oai", swiglu_alpha=1.702, swiglu_limit=7.0)


def _gpt_oss(T, seed=0):
    """GPT-OSS-120B's experts laid as stored (gpt_oss) and as [E, 2F, H] gate-then-up rows (reference), same values."""
    shape = MODEL_SHAPES["gpt-oss-120b"]
    E, k, H, F = shape.num_experts, shape.top_k, shape.hidden, shape.ffn
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, device="cuda", generator=gen).to(DTYPE)
    gate_up = (torch.randn(E, H, 2 * F, device="cuda", generator=gen) * 0.02).to(DTYPE)  # interleaved columns
    down = (torch.randn(E, F, H, device="cuda", generator=gen) * 0.02).to(DTYPE)
    gate_up_bias = (torch.randn(E, 2 * F, device="cuda", generator=gen) * 0.1).to(DTYPE)
    down_bias = (torch.randn(E, H, device="cuda", generator=gen) * 0.1).to(DTYPE)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, device="cuda", generator=gen)
    stored = dict(w_gate_up=gate_up, w_down=down, gate_up_bias=gate_up_bias, down_bias=down_bias, interleaved=True,
                  transposed=True)
    concat = torch.cat([gate_up[:, :, 0::2], gate_up[:, :, 1::2]], dim=2)  # [E, H, 2F] gate columns, then up
    reference = dict(w_gate_up=concat.transpose(1, 2).contiguous(), w_down=down.transpose(1, 2).contiguous(),
                     gate_up_bias=torch.cat([gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]], dim=1), down_bias=down_bias)
    return x, ids, weights, stored, reference


def _run(x, ids, weights, laid):
    laid = dict(laid)
    return md.fused_experts(x, laid.pop("w_gate_up"), laid.pop("w_down"), ids, weights, **laid, **OPTIONS)


@pytest.mark.parametrize("T", [1, 16, 33, 4096], ids=lambda T: f"T{T}")
def test_gpt_oss_stored_layout_forward(T, monkeypatch, h200_tile_table):
    """T = 1, 16: the decode path; 33: the pointer grouped GEMMs; 4096: the persistent gate/up GEMM (3-D descriptors over the
    transposed weights, the interleaved pair read whole)."""
    x, ids, weights, stored, reference = _gpt_oss(T)
    persistent_calls = []
    real = persistent.persistent_expert_gemm
    monkeypatch.setattr(persistent, "persistent_expert_gemm",
                        lambda *a, **kw: persistent_calls.append(kw.get("transposed")) or real(*a, **kw))
    out = _run(x, ids, weights, stored)
    if T == 4096:
        assert persistent_calls and all(persistent_calls), "the prefill GEMMs must take the transposed descriptors"
    rows = slice(0, min(T, 64))  # float64 on a sample of rows
    ref = fused_experts_ref(x[rows].double(), stored["w_gate_up"].double(), stored["w_down"].double(), ids[rows],
                            weights[rows].double(), gate_up_bias=stored["gate_up_bias"].double(),
                            down_bias=stored["down_bias"].double(), interleaved=True, transposed=True, **OPTIONS)
    assert_close(out[rows], ref, DTYPE)
    assert_close(out, _run(x, ids, weights, reference), DTYPE)
    assert torch.isfinite(out).all()


def test_gpt_oss_stored_layout_nan_row():
    """A NaN row of x is NaN in its own output row only, on the decode and the grouped paths."""
    for T in (4, 512):
        x, ids, weights, stored, _ = _gpt_oss(T, seed=1)
        x[2] = float("nan")
        out = _run(x, ids, weights, stored)
        assert torch.isnan(out[2]).all()
        assert not torch.isnan(torch.cat([out[:2], out[3:]])).any()


def _gpt_oss_fp8(T, E, H, F, k, device="cuda", seed=2):
    """GPT-OSS's stored layout in block FP8 (128 x 128 over the stored [E, H, 2F] / [E, F, H] weights), biases."""
    gen = torch.Generator(device=device).manual_seed(seed)
    quantized = {}
    for name, size in (("w_gate_up", (E, H, 2 * F)), ("w_down", (E, F, H))):
        w = (torch.randn(*size, device=device, generator=gen) * 0.02).to(DTYPE)
        quantized[name], quantized[name + "_scale"] = md.quantize_experts_fp8(w, "block", block_shape=(128, 128),
                                                                             n_axis=2)
        del w
    x = torch.randn(T, H, device=device, generator=gen).to(DTYPE)
    ids = torch.stack([torch.randperm(E, device=device, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, device=device, generator=gen)
    options = dict(gate_up_bias=(torch.randn(E, 2 * F, device=device, generator=gen) * 0.1).to(DTYPE),
                   down_bias=(torch.randn(E, H, device=device, generator=gen) * 0.1).to(DTYPE), interleaved=True,
                   transposed=True, fp8_block_shape=(128, 128), **OPTIONS)
    return x, ids, weights, quantized, options


def check_gpt_oss_fp8(T, E, H, F, k, device="cuda", rows=64, experts_per_chunk=16):
    """The dequant path (decode or grouped by T; PAIRED over the interleaved float8 weight, its block scales read
    whole) against float64 on the dequantized weights, on a sample of rows."""
    x, ids, weights, q, options = _gpt_oss_fp8(T, E, H, F, k, device)
    out = md.fused_experts(x, q["w_gate_up"], q["w_down"], ids, weights, w_gate_up_scale=q["w_gate_up_scale"],
                           w_down_scale=q["w_down_scale"], fp8_compute="dequant", **options)
    sample = slice(0, min(T, rows))
    ref = fused_experts_fp8_ref(x[sample], q["w_gate_up"], q["w_down"], ids[sample], weights[sample],
                                w_gate_up_scale=q["w_gate_up_scale"], w_down_scale=q["w_down_scale"],
                                experts_per_chunk=experts_per_chunk, **options)
    assert_close(out[sample], ref, DTYPE)


@pytest.mark.parametrize("T", [1, 33, 1024], ids=lambda T: f"T{T}")
def test_gpt_oss_stored_layout_fp8_dequant(T):
    """GPT-OSS-120B's widths (H = F = 2880, not a multiple of 128: partial scale blocks) in block FP8, as stored."""
    shape = MODEL_SHAPES["gpt-oss-120b"]
    check_gpt_oss_fp8(T, shape.num_experts, shape.hidden, shape.ffn, shape.top_k)
