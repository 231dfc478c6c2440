"""The package's torch custom operators: names under the build's namespace, `torch.library.opcheck` (schema, fake
implementation, autograd registration, AOT dispatch with dynamic shapes) for each, and torch.compile of the public
functions with fullgraph=True (no graph break) and symbolic token counts."""

import pytest
import torch
import torch._dynamo
from helpers import DEVICE
from torch._dynamo.utils import counters

import moe_dispatch as md
from moe_dispatch import _ops, moe
from moe_dispatch.experts.autograd import fused_experts_backward_op
from moe_dispatch.experts.call import ExpertsCall
from moe_dispatch.experts.operator import fused_experts_op
from moe_dispatch.dispatch import binned as binned_ops
from moe_dispatch.routing import router
from moe_dispatch.formats.fp8 import quantize_experts_fp8
from moe_dispatch.gemm.grouped import _grouped_gemm_op
from moe_dispatch.dispatch.row_copies import BINNED, PADDED
from moe_dispatch.host.tiles import select_tiles

E, TOP_K, H, F = 4, 2, 16, 8


def _ids(T):
    return torch.stack([torch.randperm(E)[:TOP_K] for _ in range(T)]).to(DEVICE)


def _experts_args(T, *, requires_grad, save_preact, scales=(None, None, None, None), **call):
    """The experts operator's arguments: tensors, the four scale slots, save_preact, then an ExpertsCall's options."""
    def rand(*shape):
        return (torch.randn(*shape, device=DEVICE) * 0.3).requires_grad_(requires_grad)

    return (rand(T, H), rand(E, 2 * F, H), None, rand(E, H, F), _ids(T), rand(T, TOP_K), rand(E, 2 * F), rand(E, H),
            *scales, save_preact, *ExpertsCall(**call).op_options())


def _quantized_experts_args(T, gate_up_scheme, down_scheme, input_scales=(None, None), **call):
    """Forward-only arguments with float8 weights quantized per `gate_up_scheme` / `down_scheme`."""
    args = list(_experts_args(T, requires_grad=False, save_preact=False, **call))
    block_shape = call.get("block_shape", (128, 128))
    args[1], gate_up_scale = quantize_experts_fp8(args[1], gate_up_scheme, block_shape=block_shape)
    args[3], down_scale = quantize_experts_fp8(args[3], down_scheme, block_shape=block_shape)
    args[8:12] = gate_up_scale, down_scale, *input_scales
    return tuple(args)


def _fp8_experts_args(T):
    """Block-scaled gate_up (8 x 8 blocks) and per-channel down, forward only."""
    return _quantized_experts_args(T, "block", "channel", block_shape=(8, 8))


def _w8a8_experts_args(T):
    """Per-channel gate_up and per-tensor down on the w8a8 path, static input scales (per expert, per tensor)."""
    return _quantized_experts_args(T, "channel", "tensor", (torch.full((E,), 0.01, device=DEVICE),
                                                            torch.tensor(0.02, device=DEVICE)), compute="w8a8")


def _segments(T):
    permuted, offsets, sorted_idx, _ = md.permute_tokens(torch.randn(T, H, device=DEVICE), _ids(T), E)
    return permuted, offsets, sorted_idx


OPERATOR_CASES = ["fused_experts", "fused_experts-inference", "fused_experts-inference-general", "fused_experts-fp8",
                  "fused_experts-w8a8", "fused_experts_backward", "route", "grouped_gemm", "expert_ffn",
                  "fused_expert_ffn", "row_gather-binned", "row_scatter-binned", "row_wgrad-padded"]


def _operator_case(name):
    """(operator, arguments) for one opcheck case; built inside the test, not at collection."""
    permuted, offsets, sorted_idx = _segments(5)
    w_gate, w_up = torch.randn(E, F, H, device=DEVICE), torch.randn(E, F, H, device=DEVICE)
    w_down = torch.randn(E, H, F, device=DEVICE)
    weights = torch.rand(5, TOP_K, device=DEVICE)
    x, w_gate_up, _, w_down_t, ids, topk_weights, gate_up_bias, down_bias = _experts_args(
        5, requires_grad=False, save_preact=True)[:8]
    forward = fused_experts_op._init_fn(x, w_gate_up, None, w_down_t, ids, topk_weights, gate_up_bias, down_bias,
                                        None, None, None, None, True, *ExpertsCall().op_options())
    flat = _ids(5).reshape(-1).int()
    _, indices = md.sort(flat)
    bins = md.inclusive_cumsum(md.histogram(flat, E), 0)
    padded_bins = md.inclusive_cumsum((md.histogram(flat, E) + 3) // 4 * 4, 0)
    x_rows = torch.randn(5, H, device=DEVICE, requires_grad=True)
    copy_weights = torch.rand(5 * TOP_K, device=DEVICE, requires_grad=True)
    capacity = 3
    binned = torch.randn(E * capacity, H, device=DEVICE, requires_grad=True)
    padded = torch.randn(int(padded_bins[-1]), H, device=DEVICE)
    cases = [
        ("row_gather-binned", binned_ops._row_gather_op,
         (x_rows, copy_weights, indices, bins, None, BINNED.value, TOP_K, capacity, E * capacity)),
        ("row_scatter-binned", binned_ops._row_scatter_op,
         (binned, copy_weights, indices, bins, None, BINNED.value, TOP_K, capacity, 5)),
        ("row_wgrad-padded", binned_ops._row_wgrad_op,
         (padded, torch.randn(5, H, device=DEVICE), indices, bins, padded_bins, PADDED.value, TOP_K, 0,
          torch.float32)),
        ("fused_experts", fused_experts_op, _experts_args(5, requires_grad=True, save_preact=True)),
        # at T = 5 the interpreter's table picks the decode path; the general one is forced by its tiles
        ("fused_experts-inference", fused_experts_op, _experts_args(5, requires_grad=False, save_preact=False)),
        ("fused_experts-inference-general", fused_experts_op,
         _experts_args(5, requires_grad=False, save_preact=False,
                       tiles=select_tiles(torch.device(DEVICE), 5, TOP_K, E, F, H))),
        ("fused_experts-fp8", fused_experts_op, _fp8_experts_args(5)),
        ("fused_experts-w8a8", fused_experts_op, _w8a8_experts_args(5)),
        ("fused_experts_backward", fused_experts_backward_op,
         (torch.randn(5, H, device=DEVICE), x, w_gate_up, None, w_down_t, ids, topk_weights, gate_up_bias, down_bias,
          *forward[1:], "silu", False, False, 1.702, 7.0, [True] * 7)),
        ("route", router._route_op, (torch.randn(5, H, device=DEVICE, requires_grad=True),
                                      torch.randn(E, H, device=DEVICE, requires_grad=True), None, None, TOP_K,
                                      "softmax", True, 1, 1, 1.0)),
        ("grouped_gemm", _grouped_gemm_op, (permuted, w_gate, offsets)),
        ("expert_ffn", moe._expert_ffn_op, (permuted, w_gate, w_up, w_down, offsets, None, 1, None)),
        ("fused_expert_ffn", moe._fused_expert_ffn_op, (permuted, w_gate, w_up, w_down, offsets, weights, sorted_idx,
                                                        5, TOP_K)),
    ]
    return {case[0]: case[1:] for case in cases}[name]


@pytest.mark.parametrize("name", OPERATOR_CASES)
def test_opcheck(name):
    op, args = _operator_case(name)
    assert op._qualname == _ops.add_op_namespace_prefix(op._name)
    # torch's schema check compares inputs with allclose, which float8 tensors do not implement (torch's gap, not the
    # op's: "mul_cuda" on a GPU); the fp8 cases run the other three checks, and the schema's promise that no input is
    # written is checked here, bit for bit.
    fp8 = name.endswith(("-fp8", "-w8a8"))
    test_utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic") if fp8 else None
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    before = [_bytes(t).clone() for t in tensors]
    torch.library.opcheck(op, args, **({"test_utils": test_utils} if test_utils else {}))
    if fp8:
        assert all(torch.equal(_bytes(t), b) for t, b in zip(tensors, before)), "an input was written"


def _bytes(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _compile(fn):
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=None)


def test_compile_fused_experts_forward_backward():
    """fullgraph: no graph break; new token counts reuse one dynamic graph (at most 2 graphs: static, then dynamic)."""
    w_gate_up = (torch.randn(E, 2 * F, H, device=DEVICE) * 0.3).requires_grad_()
    w_down = (torch.randn(E, H, F, device=DEVICE) * 0.3).requires_grad_()

    def layer(x, ids, weights):
        return md.fused_experts(x, w_gate_up, w_down, ids, weights)

    compiled = _compile(layer)
    for T in (3, 5, 9, 17):
        x = torch.randn(T, H, device=DEVICE, requires_grad=True)
        ids, weights = _ids(T), torch.rand(T, TOP_K, device=DEVICE, requires_grad=True)
        out = compiled(x, ids, weights)
        grads = torch.autograd.grad(out.square().sum(), [x, weights, w_gate_up, w_down])
        eager = layer(x, ids, weights)
        eager_grads = torch.autograd.grad(eager.square().sum(), [x, weights, w_gate_up, w_down])
        assert torch.equal(out, eager)
        for got, ref in zip(grads, eager_grads):
            assert torch.equal(got, ref)
    assert counters["stats"]["unique_graphs"] <= 2


def test_compile_mxfp4_experts_with_the_quant_object():
    """MXFP4 experts passed as transformers' integration passes them (one ExpertsQuant, GPT-OSS's layout): fullgraph,
    equal to eager. Dynamo traces the entry's description (`ExpertsCall.of`) without hashing it."""
    gate_up, gate_up_scale = md.quantize_experts_mxfp4(torch.randn(E, 2 * 64, 64, device=DEVICE) * 0.3)
    down, down_scale = md.quantize_experts_mxfp4(torch.randn(E, 64, 64, device=DEVICE) * 0.3)
    quant = md.ExpertsQuant.mxfp4(gate_up_scale, down_scale)

    def layer(x, ids, weights):
        return md.fused_experts(x, gate_up, down, ids, weights, quant=quant, activation="swiglu_oai",
                                interleaved=True)

    compiled = _compile(layer)
    for T in (3, 5):
        x, ids, weights = torch.randn(T, 64, device=DEVICE), _ids(T), torch.rand(T, TOP_K, device=DEVICE)
        assert torch.equal(compiled(x, ids, weights), layer(x, ids, weights))


def test_compile_fused_experts_inference():
    """Inference compiles across the decode path's limit (N <= 64 on the interpreter's table, then the general path):
    fullgraph, one dynamic graph, equal to eager."""
    w_gate_up = torch.randn(E, 2 * F, H, device=DEVICE) * 0.3
    w_down = torch.randn(E, H, F, device=DEVICE) * 0.3

    def layer(x, ids, weights):
        return md.fused_experts(x, w_gate_up, w_down, ids, weights)

    compiled = _compile(layer)
    with torch.no_grad():
        for T in (3, 5, 9, 40):
            x, ids, weights = torch.randn(T, H, device=DEVICE), _ids(T), torch.rand(T, TOP_K, device=DEVICE)
            assert torch.equal(compiled(x, ids, weights), layer(x, ids, weights))
    assert counters["stats"]["unique_graphs"] <= 2


@pytest.mark.parametrize("fp8_compute", ["auto", "w8a8"])
def test_compile_fused_experts_fp8(fp8_compute):
    """FP8 weights compile too (fullgraph, one dynamic graph), equal to eager; "w8a8" with a static input scale."""
    block_shape = (8, 8) if fp8_compute == "auto" else (8, 32)
    w_gate_up, w_gate_up_scale = quantize_experts_fp8(torch.randn(E, 2 * F, H, device=DEVICE),
                                                      block_shape=block_shape)
    w_down, w_down_scale = quantize_experts_fp8(torch.randn(E, H, F, device=DEVICE), "tensor")
    static = {"down_input_scale": torch.tensor(0.05, device=DEVICE)} if fp8_compute == "w8a8" else {}

    def layer(x, ids, weights):
        return md.fused_experts(x, w_gate_up, w_down, ids, weights, w_gate_up_scale=w_gate_up_scale,
                                w_down_scale=w_down_scale, fp8_block_shape=block_shape, fp8_compute=fp8_compute,
                                **static)

    compiled = _compile(layer)
    with torch.no_grad():
        for T in (3, 5, 9):
            x, ids, weights = torch.randn(T, H, device=DEVICE), _ids(T), torch.rand(T, TOP_K, device=DEVICE)
            assert torch.equal(compiled(x, ids, weights), layer(x, ids, weights))
    assert counters["stats"]["unique_graphs"] <= 2


def test_compile_fused_moe_forward_forward_backward():
    router_weight = torch.randn(E, H, device=DEVICE, requires_grad=True)
    w_gate, w_up = (torch.randn(E, F, H, device=DEVICE).mul(0.3).requires_grad_() for _ in range(2))
    w_down = (torch.randn(E, H, F, device=DEVICE) * 0.3).requires_grad_()

    def layer(x):
        out, _, weights = md.fused_moe_forward(x, router_weight, w_gate, w_up, w_down, E, TOP_K, renormalize=True)
        return out, weights

    compiled = _compile(layer)
    for T in (4, 6, 11):
        x = torch.randn(T, H, device=DEVICE, requires_grad=True)
        out, weights = compiled(x)
        params = [x, router_weight, w_gate, w_up, w_down]
        grads = torch.autograd.grad(out.sum() + weights.sum(), params)
        eager_out, eager_weights = layer(x)
        eager_grads = torch.autograd.grad(eager_out.sum() + eager_weights.sum(), params)
        assert torch.equal(out, eager_out)
        for got, ref in zip(grads, eager_grads):
            torch.testing.assert_close(got, ref)
    assert counters["stats"]["unique_graphs"] <= 2


def test_compile_inference_v1_functions():
    """The forward-only v1 functions compile too (their operators have fake implementations)."""
    permuted, offsets, sorted_idx = _segments(6)
    w_gate, w_up = torch.randn(E, F, H, device=DEVICE), torch.randn(E, F, H, device=DEVICE)
    w_down = torch.randn(E, H, F, device=DEVICE)
    weights = torch.rand(6, TOP_K, device=DEVICE)

    def v1(permuted, offsets, sorted_idx, weights):
        return (md.grouped_gemm(permuted, w_gate, offsets, E),
                md.expert_ffn_triton(permuted, w_gate, w_up, w_down, offsets, E),
                md.fused_expert_ffn(permuted, w_gate, w_up, w_down, offsets, E, weights, sorted_idx, 6, TOP_K))

    with torch.no_grad():
        for got, ref in zip(_compile(v1)(permuted, offsets, sorted_idx, weights),
                            v1(permuted, offsets, sorted_idx, weights)):
            assert torch.equal(got, ref)


def test_compile_binned_routing_forward_backward():
    """MegaBlocks-style copies compile too: sort, histogram, cumsum, binned gather and scatter, with gradients."""
    T, capacity = 8, 3

    def layer(x, weights, ids):
        flat = ids.reshape(-1).int()
        _, indices = md.sort(flat)
        bins = md.inclusive_cumsum(md.histogram(flat, E), 0)
        buffer = md.binned_gather(x, indices, None, bins, capacity, TOP_K)
        return md.binned_scatter(buffer * 2.0, indices, weights, bins, TOP_K)

    x = torch.randn(T, H, device=DEVICE, requires_grad=True)
    weights = torch.rand(T * TOP_K, device=DEVICE, requires_grad=True)
    ids = _ids(T)
    out = _compile(layer)(x, weights, ids)
    grads = torch.autograd.grad(out.square().sum(), [x, weights])
    eager = layer(x, weights, ids)
    eager_grads = torch.autograd.grad(eager.square().sum(), [x, weights])
    assert torch.equal(out, eager)
    for got, ref in zip(grads, eager_grads):
        assert torch.equal(got, ref)
