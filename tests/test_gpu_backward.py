"""GPU-only checks of the backward: real model sizes in bf16 against float64 autograd of the reference, CUDA-graph
capture of forward + backward, bit-identical reruns, and torch.compile with inductor. Skipped without a GPU."""

import pytest
import torch
from helpers import capture_cuda_graph, needs_gpu
from model_shapes import MODEL_SHAPES

import moe_dispatch as md
from moe_dispatch.reference import fused_experts_ref

pytestmark = needs_gpu
DTYPE = torch.bfloat16
# bf16 gradients: the saved pre-activations, d_preact and the activations are rounded to bf16 once each, and every
# weight-gradient element sums T*k/E products; norm-wise error against float64.
GRAD_TOLERANCE = 3e-2


def _rel(got, ref):
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _experts_problem(name, T, *, gpt_oss=False):
    shape = MODEL_SHAPES[name]
    E, k, H, F = shape.num_experts, shape.top_k, shape.hidden, shape.ffn

    def leaf(*size, scale):
        return (torch.randn(*size, device="cuda") * scale).to(DTYPE).requires_grad_()

    inputs = dict(hidden_states=leaf(T, H, scale=1.0),
                  w_gate_up=leaf(*((E, H, 2 * F) if gpt_oss else (E, 2 * F, H)), scale=0.02),
                  w_down=leaf(*((E, F, H) if gpt_oss else (E, H, F)), scale=0.02),
                  topk_weights=torch.rand(T, k, device="cuda").requires_grad_())
    options = {}
    if gpt_oss:
        inputs.update(gate_up_bias=leaf(E, 2 * F, scale=0.1), down_bias=leaf(E, H, scale=0.1))
        options = dict(activation="swiglu_oai", interleaved=True, transposed=True)
    ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
    return inputs, ids, options


def _forward(inputs, ids, options, fn=md.fused_experts):
    return fn(inputs["hidden_states"], inputs["w_gate_up"], inputs["w_down"], ids, inputs["topk_weights"],
              gate_up_bias=inputs.get("gate_up_bias"), down_bias=inputs.get("down_bias"), **options)


@pytest.mark.whole_gpu  # GPT-OSS-120B's experts and their gradients: ~68 GiB at once
@pytest.mark.parametrize("name,T,gpt_oss", [("mixtral-8x7b", 256, False), ("qwen2-57b-a14b", 512, False),
                                            ("qwen3-30b-a3b", 1024, False), ("gpt-oss-120b", 96, True),
                                            ("gpt-oss-120b", 2048, True)])
def test_real_model_sizes_bf16_gradients(name, T, gpt_oss):
    inputs, ids, options = _experts_problem(name, T, gpt_oss=gpt_oss)
    # per input element: its bf16 gradient, the float64 copy and its gradient, the reference's transients (an 80 GB
    # H100 ran out at GPT-OSS-120B's 3.2e9 weight elements with 67.5 GB in use; the H200 runs it)
    need = sum(t.numel() for t in inputs.values()) * (2 + 8 + 8 + 8)
    free = torch.cuda.mem_get_info()[0]
    if free < need:
        pytest.skip(f"{name}'s float64 gradient reference needs about {need / 2**30:.0f} GiB of free GPU memory; "
                    f"this GPU has {free / 2**30:.0f} GiB free")
    grad_out = torch.randn(T, inputs["hidden_states"].shape[1], device="cuda", dtype=DTYPE)
    grads = torch.autograd.grad(_forward(inputs, ids, options), list(inputs.values()), grad_out)
    leaves = {k: v.detach().double().requires_grad_() for k, v in inputs.items()}
    ref = _forward(leaves, ids, options, fused_experts_ref)
    ref_grads = torch.autograd.grad(ref, list(leaves.values()), grad_out.double())
    errors = {k: _rel(g, r) for k, g, r in zip(inputs, grads, ref_grads)}
    assert all(e <= GRAD_TOLERANCE for e in errors.values()), errors
    del leaves, ref, ref_grads
    torch.cuda.empty_cache()


@pytest.mark.parametrize("name,T,gpt_oss", [("qwen3-30b-a3b", 4096, False), ("gpt-oss-120b", 64, True)])
def test_backward_bit_identical_reruns(name, T, gpt_oss):
    """Reruns give the same bits. GPT-OSS (biases, 2 rows per expert) once lost them in most reruns: its bias
    gradient read the weight-gradient GEMM's pipelined operand into registers (backward.weight_grads._bias_dot)."""
    inputs, ids, options = _experts_problem(name, T, gpt_oss=gpt_oss)
    grad_out = torch.randn(T, inputs["hidden_states"].shape[1], device="cuda", dtype=DTYPE)
    first = torch.autograd.grad(_forward(inputs, ids, options), list(inputs.values()), grad_out)
    for _ in range(4):
        again = torch.autograd.grad(_forward(inputs, ids, options), list(inputs.values()), grad_out)
        for key, a, b in zip(inputs, first, again):
            assert torch.equal(a, b), key


@pytest.mark.parametrize("gpt_oss", [False, True])
def test_cuda_graph_capture_forward_backward(gpt_oss):
    """Forward + backward have no host sync: capture both in one graph, replay with new inputs, equal to eager."""
    T, name = 64, "gpt-oss-120b" if gpt_oss else "qwen3-30b-a3b"
    E = MODEL_SHAPES[name].num_experts
    inputs, ids, options = _experts_problem(name, T, gpt_oss=gpt_oss)
    grad_out = torch.randn(T, inputs["hidden_states"].shape[1], device="cuda", dtype=DTYPE)

    def step():
        return torch.autograd.grad(_forward(inputs, ids, options), list(inputs.values()), grad_out)

    graph, static_grads = capture_cuda_graph(step)
    for _ in range(2):
        with torch.no_grad():
            inputs["hidden_states"].copy_(torch.randn_like(inputs["hidden_states"]))
            inputs["topk_weights"].copy_(torch.rand_like(inputs["topk_weights"]))
            grad_out.copy_(torch.randn_like(grad_out))
        ids.copy_(torch.stack([torch.randperm(E, device="cuda")[:ids.shape[1]] for _ in range(T)]))
        graph.replay()
        torch.cuda.synchronize()
        for name, got, ref in zip(inputs, static_grads, step()):
            assert torch.equal(got, ref), f"replayed d {name} differs from eager"


def test_inductor_compile_forward_backward():
    """torch.compile with the default backend (inductor) on the GPU, fullgraph, two token counts."""
    shape = MODEL_SHAPES["qwen3-30b-a3b"]
    inputs, _, options = _experts_problem("qwen3-30b-a3b", 8)
    w_gate_up, w_down = inputs["w_gate_up"], inputs["w_down"]

    def layer(x, ids, weights):
        return md.fused_experts(x, w_gate_up, w_down, ids, weights)

    compiled = torch.compile(layer, fullgraph=True)
    for T in (100, 300):
        x = torch.randn(T, shape.hidden, device="cuda", dtype=DTYPE, requires_grad=True)
        ids = torch.stack([torch.randperm(shape.num_experts, device="cuda")[:shape.top_k] for _ in range(T)])
        weights = torch.rand(T, shape.top_k, device="cuda", requires_grad=True)
        got = compiled(x, ids, weights)
        got_grads = torch.autograd.grad(got.float().square().sum(), [x, weights, w_gate_up, w_down])
        ref = layer(x, ids, weights)
        ref_grads = torch.autograd.grad(ref.float().square().sum(), [x, weights, w_gate_up, w_down])
        assert torch.equal(got, ref)
        for a, b in zip(got_grads, ref_grads):
            assert _rel(a, b) < 1e-2


def test_backward_offsets_past_32_bits():
    """T*k*H > 2^31: the backward's row offsets (dout gathers, dX rows, weight-gradient row loads) must be 64-bit.
    Checked on sampled rows of dx and on the gradient of topk_weights against float64."""
    T, E, k, H, F = 2**18 + 1000, 8, 2, 4096, 128
    assert T * k * H > 2**31
    x = torch.randn(T, H, device="cuda", dtype=DTYPE, requires_grad=True)
    w_gate_up = (torch.randn(E, 2 * F, H, device="cuda") * 0.02).to(DTYPE).requires_grad_()
    w_down = (torch.randn(E, H, F, device="cuda") * 0.02).to(DTYPE).requires_grad_()
    ids = torch.randint(0, E, (T, k), device="cuda")
    weights = torch.rand(T, k, device="cuda", requires_grad=True)
    grad_out = torch.randn(T, H, device="cuda", dtype=DTYPE)
    d_x, d_weights = torch.autograd.grad(md.fused_experts(x, w_gate_up, w_down, ids, weights), [x, weights], grad_out)
    rows = torch.cat([torch.arange(64), torch.randint(0, T, (128,)), torch.arange(T - 64, T)]).cuda()
    leaves = [x.detach()[rows].double().requires_grad_(), weights.detach()[rows].double().requires_grad_()]
    ref = fused_experts_ref(leaves[0], w_gate_up.detach(), w_down.detach(), ids[rows], leaves[1])
    ref_d_x, ref_d_weights = torch.autograd.grad(ref, leaves, grad_out[rows].double())
    assert _rel(d_x[rows], ref_d_x) <= GRAD_TOLERANCE and _rel(d_weights[rows], ref_d_weights) <= GRAD_TOLERANCE
