"""GPU checks of FP8 expert weights: real layer sizes per format on both compute paths (w8a8 on FP8 tensor cores, and
the dequant path forced as on an SM80 or MI300X), static activation scales, CUDA-graph capture, and transformers' own
FP8 experts path where its Hub kernel loads. Skipped without a GPU; the w8a8 cases also without FP8 tensor cores.

tests/test_fp8.py checks the same paths through the interpreter at tiny sizes. This file runs in the GPU suite
(scripts/gpu_suite.sh; docs/performance.md's "GPU test suite" section has its latest H200 run).

Each w8a8 output is held twice, as on the CPU: to the float64 model of its own arithmetic (reference.
fused_experts_w8a8_ref, the bf16 tolerance: what remains is bf16 rounding of y and out, and the rare intermediate
element rounded to the neighbouring e4m3 value because fp32 and float64 sums differ), and to the float64 experts on
the dequantized weights within reference.W8A8_TOLERANCE. Weights are quantized and references computed a few experts
at a time, so DeepSeek-V3's 256 experts fit.
"""

import pytest
import torch
from helpers import TOLERANCE, assert_close, capture_cuda_graph, needs_gpu
from model_shapes import MODEL_SHAPES

import moe_dispatch as md
from moe_dispatch.host.device import fp8_dtype, has_fp8_tensor_cores
from moe_dispatch.formats.fp8 import quantize_experts_fp8
from moe_dispatch.gemm.w8a8 import w8a8_groups
from moe_dispatch.reference import W8A8_TOLERANCE, fused_experts_fp8_ref, fused_experts_w8a8_ref
from moe_dispatch.host.tiles import select_fp8_tiles

pytestmark = needs_gpu
DTYPE = torch.bfloat16
CHUNK = 16  # experts quantized / dequantized at a time


def _needs_fp8_cores():
    if not has_fp8_tensor_cores(torch.device("cuda")):
        pytest.skip("no FP8 tensor cores (w8a8 needs NVIDIA SM89+)")


def _quantized(E, d1, d2, scheme, block_shape, dtype):
    """Random [E, d1, d2] bf16 expert weights (scale 0.02) quantized CHUNK experts at a time."""
    q = torch.empty(E, d1, d2, device="cuda", dtype=dtype)
    scales = []
    for start in range(0, E, CHUNK):
        stop = min(E, start + CHUNK)
        w = torch.randn(stop - start, d1, d2, device="cuda", dtype=DTYPE) * 0.02
        q[start:stop], scale = quantize_experts_fp8(w, scheme, block_shape=block_shape, dtype=dtype)
        scales.append(scale)
    return q, torch.cat(scales)


def _fp8_experts(shape, scheme, *, experts=None, block_shape=(128, 128), dtype=None):
    """Quantized weights of `experts` of the model's experts (all of them by default)."""
    E = experts or shape.num_experts
    dtype = dtype or fp8_dtype(torch.device("cuda"))
    q_gate_up, s_gate_up = _quantized(E, 2 * shape.ffn, shape.hidden, scheme, block_shape, dtype)
    q_down, s_down = _quantized(E, shape.hidden, shape.ffn, scheme, block_shape, dtype)
    return q_gate_up, q_down, dict(w_gate_up_scale=s_gate_up, w_down_scale=s_down, fp8_block_shape=block_shape)


def _routing(T, E, top_k):
    ids = torch.stack([torch.randperm(E, device="cuda")[:top_k] for _ in range(T)])
    return ids, torch.rand(T, top_k, device="cuda")


def _check_w8a8(out, x, q_gate_up, q_down, ids, weights, scales, num_tokens=None):
    """out (rows of a call with num_tokens tokens, default all) against the model and the dequantized weights."""
    shape_args = (num_tokens or x.shape[0], ids.shape[1], q_gate_up.shape[0], q_down.shape[2], x.shape[1])
    groups = w8a8_groups(select_fp8_tiles(x.device, *shape_args), scales["w_gate_up_scale"], scales["w_down_scale"],
                         scales["fp8_block_shape"])
    model = fused_experts_w8a8_ref(x, q_gate_up, q_down, ids, weights, groups=groups, **scales)
    assert_close(out, model, DTYPE, "w8a8 vs its model")
    weight_scales = {k: v for k, v in scales.items() if not k.endswith("input_scale")}
    ref = fused_experts_fp8_ref(x, q_gate_up, q_down, ids, weights, experts_per_chunk=CHUNK, **weight_scales)
    assert_close(out, ref, DTYPE, "w8a8 vs dequantized weights", tolerance=W8A8_TOLERANCE)


# (model, T, experts): one layer at real H and F; T covers decode and prefill buckets of the tile table
REAL = [("deepseek-v3", 64, None), ("qwen3-30b-a3b", 256, None), ("mixtral-8x7b", 16, None),
        ("gpt-oss-120b", 33, 16)]  # GPT-OSS: H = F = 2880, not a multiple of 128


@pytest.mark.whole_gpu  # 10-15 GiB each (the float64 reference's experts): four at once overflowed an 80 GiB H100
@pytest.mark.parametrize("compute", ["w8a8", "dequant"])
@pytest.mark.parametrize("scheme", ["block", "channel", "tensor"])
@pytest.mark.parametrize("name,T,experts", REAL, ids=[r[0] for r in REAL])
def test_fp8_real_sizes(name, T, experts, scheme, compute):
    """Every format at real layer sizes on both paths ("dequant" forced: what an SM80 or MI300X runs)."""
    if compute == "w8a8":
        _needs_fp8_cores()
    shape = MODEL_SHAPES[name]
    q_gate_up, q_down, scales = _fp8_experts(shape, scheme, experts=experts)
    E = q_gate_up.shape[0]
    x = torch.randn(T, shape.hidden, device="cuda", dtype=DTYPE)
    ids, weights = _routing(T, E, shape.top_k)
    out = md.fused_experts(x, q_gate_up, q_down, ids, weights, fp8_compute=compute, **scales)
    if compute == "w8a8":
        _check_w8a8(out, x, q_gate_up, q_down, ids, weights, scales)
    else:
        assert_close(out, fused_experts_fp8_ref(x, q_gate_up, q_down, ids, weights, experts_per_chunk=CHUNK,
                                                **scales), DTYPE)


@pytest.mark.parametrize("static", ["tensor", "expert"])
@pytest.mark.parametrize("name,T", [("mixtral-8x7b", 4096), ("deepseek-v3", 16), ("qwen3-30b-a3b", 2048)])
def test_fp8_static_input_scales(name, T, static):
    """Static activation scales (per tensor, per expert) at real sizes, decode and prefill tiles (the prefill ones
    quantize x in a pass first, per-tensor scales only)."""
    _needs_fp8_cores()
    shape = MODEL_SHAPES[name]
    q_gate_up, q_down, scales = _fp8_experts(shape, "block")
    E = q_gate_up.shape[0]
    x = torch.randn(T, shape.hidden, device="cuda", dtype=DTYPE)
    ids, weights = _routing(T, E, shape.top_k)
    x_scale = x.float().abs().amax() / 448 * 1.25
    if static == "tensor":
        scales.update(gate_up_input_scale=x_scale, down_input_scale=torch.tensor([0.2], device="cuda"))
    else:  # the intermediate stays below ~64 on these random experts: 448 * 0.15 covers it
        scales.update(gate_up_input_scale=x_scale * (1 + torch.rand(E, device="cuda")),
                      down_input_scale=0.15 * (1 + torch.rand(E, device="cuda")))
    out = md.fused_experts(x, q_gate_up, q_down, ids, weights, fp8_compute="w8a8", **scales)
    rows = torch.randperm(T, device="cuda")[:256].sort().values  # the reference on a row sample
    _check_w8a8(out[rows], x[rows], q_gate_up, q_down, ids[rows], weights[rows], scales, num_tokens=T)


def test_fp8_auto_picks_w8a8_here():
    """On this GPU "auto" is w8a8 exactly when it has FP8 tensor cores (bit-identical to the forced path)."""
    shape = MODEL_SHAPES["qwen3-30b-a3b"]
    q_gate_up, q_down, scales = _fp8_experts(shape, "block", experts=16)
    x = torch.randn(8, shape.hidden, device="cuda", dtype=DTYPE)
    ids, weights = _routing(8, 16, shape.top_k)
    auto = md.fused_experts(x, q_gate_up, q_down, ids, weights, **scales)
    expected = "w8a8" if has_fp8_tensor_cores(torch.device("cuda")) and q_gate_up.dtype == torch.float8_e4m3fn \
        else "dequant"
    assert torch.equal(auto, md.fused_experts(x, q_gate_up, q_down, ids, weights, fp8_compute=expected, **scales))


@pytest.mark.parametrize("compute", ["w8a8", "dequant"])
@pytest.mark.parametrize("T", [1, 8, 512, 2048])
def test_fp8_cuda_graph_capture_and_replay(T, compute):
    """Capture once, replay with new inputs: equal to eager and to the reference (T = 2048: the prefill tiles, with
    x quantized by its own pass inside the graph)."""
    if compute == "w8a8":
        _needs_fp8_cores()
    shape = MODEL_SHAPES["qwen3-30b-a3b"]
    q_gate_up, q_down, scales = _fp8_experts(shape, "block")
    E, k = shape.num_experts, shape.top_k
    x = torch.randn(T, shape.hidden, device="cuda", dtype=DTYPE)
    ids = torch.randint(0, E, (T, k), device="cuda")
    weights = torch.rand(T, k, device="cuda")

    def run():
        return md.fused_experts(x, q_gate_up, q_down, ids, weights, fp8_compute=compute, **scales)

    graph, static_out = capture_cuda_graph(run)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        ids.copy_(torch.randint(0, E, (T, k), device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, run()), "replay differs from eager"
    rows = torch.arange(min(T, 256), device="cuda")
    ref = fused_experts_fp8_ref(x[rows], q_gate_up, q_down, ids[rows], weights[rows], **scales)
    assert_close(static_out[rows], ref, DTYPE, tolerance=W8A8_TOLERANCE if compute == "w8a8" else TOLERANCE[DTYPE])


@pytest.mark.parametrize("compute", ["w8a8", "dequant"])
def test_fp8_matches_transformers_fp8_experts(compute):
    """transformers' FP8Experts (grouped_mm over the finegrained-fp8 Hub kernel, activations quantized per token and
    128 columns) against moe_dispatch on the same weights: within FP8 activation error (5e-2 RMS). Skipped when the
    Hub kernel cannot be loaded (no network, and no LOCAL_KERNELS or HF cache copy of
    kernels-community/finegrained-fp8), checked before the comparison, which is never turned into a skip."""
    if compute == "w8a8":
        _needs_fp8_cores()
    finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")
    try:  # the precondition only: the comparison below runs outside any try
        finegrained.load_finegrained_fp8_kernel()
    except Exception as error:  # noqa: BLE001 (offline: OSError, or kernels' ValueError when trust cannot be checked)
        pytest.skip(f"transformers' FP8 experts kernel cannot be loaded: {type(error).__name__}: {error}"[:300])
    shape = MODEL_SHAPES["mixtral-8x7b"]
    q_gate_up, q_down, scales = _fp8_experts(shape, "block", experts=2)
    if q_gate_up.dtype != torch.float8_e4m3fn:
        pytest.skip("transformers' FP8 experts take e4m3fn")
    T, H = 64, shape.hidden
    x = torch.randn(T, H, device="cuda", dtype=DTYPE)
    ids = torch.randint(0, 2, (T, 2), device="cuda")
    weights = torch.rand(T, 2, device="cuda")

    class Experts(torch.nn.Module):
        gate_up_proj, down_proj = q_gate_up, q_down
        gate_up_proj_scale_inv, down_proj_scale_inv = scales["w_gate_up_scale"], scales["w_down_scale"]
        block_size, activation_scheme, has_gate, has_bias = (128, 128), "dynamic", True, False
        num_experts, _is_expert_parallel = 2, False
        act_fn = torch.nn.SiLU()
        _apply_gate = finegrained.FP8Experts._apply_gate
        swiglu_alpha = swiglu_limit = limit = None

    theirs = finegrained.fp8_grouped_mm_experts_forward(Experts(), x, ids, weights)
    ours = md.fused_experts(x, q_gate_up, q_down, ids, weights, fp8_compute=compute, **scales)
    assert_close(ours, theirs, tolerance=5e-2)
