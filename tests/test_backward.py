"""Gradients of fused_experts, fused_moe_forward and moe_router against float64 autograd of moe_dispatch.reference.

The reference of a gradient is `torch.autograd.grad` through the float64 reference forward (which is written from the
documented semantics, not from the kernels), so each case checks the backward kernels against an independent
derivation. Output buffers are poisoned (NaN floats) so a gradient element the kernels forget to write fails the test.
"""

import dataclasses

import pytest
import torch
from cases import GRAD_CASES
from helpers import DEVICE, TOLERANCE, assert_close

import moe_dispatch as md
from moe_dispatch.dispatch import segments as dispatch_module
from moe_dispatch.reference import fused_experts_ref, fused_moe_forward_ref, moe_router_ref

# Gradients go through one more rounding of the half-precision intermediates than the forward (the saved
# pre-activations, d_preact and the activations are stored in the input dtype), hence twice the forward's bound.
GRAD_TOLERANCE = {dtype: 2 * tol for dtype, tol in TOLERANCE.items()}


def assert_grad_close(got, ref, dtype, what):
    assert_close(got, ref, dtype, what, tolerance=GRAD_TOLERANCE[dtype])


def _ids(case, generator):
    T, E, k = case.T, case.E, case.top_k
    high = 3 if case.ids == "few-experts" else E
    ids = torch.stack([torch.randperm(high, generator=generator)[:k] for _ in range(T)]) if k <= high else None
    if case.ids == "sentinels":
        ids[::3, 0] = E  # whole rows and single slots outside [0, E)
        ids[1::4, -1] = E + 5
    return ids


def _experts_inputs(case, device=DEVICE):
    generator = torch.Generator().manual_seed(hash(case.id) % 2**31)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device, case.dtype).requires_grad_()

    gate_up_shape = (case.E, case.H, 2 * case.F) if case.transposed else (case.E, 2 * case.F, case.H)
    down_shape = (case.E, case.F, case.H) if case.transposed else (case.E, case.H, case.F)
    inputs = dict(
        hidden_states=rand(case.T, case.H),
        w_gate_up=rand(*gate_up_shape, scale=0.2),
        w_down=rand(*down_shape, scale=0.2),
        topk_weights=torch.rand(case.T, case.top_k, generator=generator).to(device).requires_grad_(),
    )
    if case.bias:
        inputs.update(gate_up_bias=rand(case.E, 2 * case.F, scale=0.3), down_bias=rand(case.E, case.H, scale=0.3))
    ids = _ids(case, generator).to(device)
    options = dict(activation=case.activation, interleaved=case.interleaved, transposed=case.transposed,
                   swiglu_limit=case.limit)
    return inputs, ids, options


def _run_experts(inputs, ids, options, grad_out):
    out = md.fused_experts(inputs["hidden_states"], inputs["w_gate_up"], inputs["w_down"], ids,
                           inputs["topk_weights"], gate_up_bias=inputs.get("gate_up_bias"),
                           down_bias=inputs.get("down_bias"), validate=False, **options)
    return out, dict(zip(inputs, torch.autograd.grad(out, list(inputs.values()), grad_out)))


def _reference_grads(inputs, ids, options, grad_out):
    leaves = {name: t.detach().double().requires_grad_() for name, t in inputs.items()}
    out = fused_experts_ref(leaves["hidden_states"], leaves["w_gate_up"], leaves["w_down"], ids,
                            leaves["topk_weights"], gate_up_bias=leaves.get("gate_up_bias"),
                            down_bias=leaves.get("down_bias"), **options)
    return out, dict(zip(leaves, torch.autograd.grad(out, list(leaves.values()), grad_out.double())))


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.id)
def test_fused_experts_gradients(case, poison_empty, monkeypatch):
    if case.chunked:
        monkeypatch.setattr(dispatch_module, "SINGLE_MAX", 0)
    inputs, ids, options = _experts_inputs(case)
    grad_out = torch.randn(case.T, case.H).to(DEVICE, case.dtype)
    out, grads = _run_experts(inputs, ids, options, grad_out)
    ref_out, ref_grads = _reference_grads(inputs, ids, options, grad_out)
    assert_grad_close(out, ref_out, case.dtype, "forward")
    for name, grad in grads.items():
        assert grad.dtype == inputs[name].dtype and grad.shape == inputs[name].shape, name
        assert_grad_close(grad, ref_grads[name], case.dtype, f"d {name}")
    if case.ids == "sentinels":
        outside = (ids < 0) | (ids >= case.E)
        assert outside.any() and torch.equal(grads["topk_weights"][outside].cpu(),
                                             torch.zeros(int(outside.sum()), dtype=torch.float32))
    if case.ids == "few-experts":  # experts 3.. have no rows: their gradients are exact zeros, not merely small
        for name in ("w_gate_up", "w_down", "gate_up_bias", "down_bias"):
            assert not grads[name][3:].any(), name


@pytest.mark.parametrize("wanted", [("hidden_states",), ("w_gate_up",), ("w_down",), ("topk_weights",),
                                    ("gate_up_bias",), ("down_bias",), ("w_down", "topk_weights")])
def test_only_the_requested_gradients(wanted, poison_empty):
    """Each gradient is computed alone correctly (the backward skips the others: a missing one would be NaN)."""
    case = GRAD_CASES[1]
    inputs, ids, options = _experts_inputs(case)
    for name, t in inputs.items():
        t.requires_grad_(name in wanted)
    grad_out = torch.randn(case.T, case.H).to(DEVICE, case.dtype)
    requested = {name: inputs[name] for name in wanted}
    out = md.fused_experts(inputs["hidden_states"], inputs["w_gate_up"], inputs["w_down"], ids, inputs["topk_weights"],
                           gate_up_bias=inputs["gate_up_bias"], down_bias=inputs["down_bias"], **options)
    grads = torch.autograd.grad(out, list(requested.values()), grad_out)
    _, ref_grads = _reference_grads(inputs, ids, options, grad_out)
    for name, grad in zip(requested, grads):
        assert_grad_close(grad, ref_grads[name], case.dtype, f"d {name} alone")


def test_backward_is_deterministic():
    """No float atomics: two backward passes over the same inputs are bit-identical, the second replaying the plan the
    first recorded. The bf16 case with biases (every gradient kernel, the bias sums included): the interpreter runs
    programs one after another, so a race could only show on a GPU, where tests/test_gpu_backward.py reruns real
    model sizes."""
    case = GRAD_CASES[8]
    inputs, ids, options = _experts_inputs(case)
    grad_out = torch.randn(case.T, case.H).to(DEVICE, case.dtype)
    _, first = _run_experts(inputs, ids, options, grad_out)
    _, second = _run_experts(inputs, ids, options, grad_out)
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_eager_training_call_runs_without_the_operator(monkeypatch):
    """An eager training call on plain tensors runs the operator's forward and backward as a plain autograd.Function
    (experts.autograd.EagerExperts: no dispatcher round trip); through the operator (host.library.eager_autograd
    answering no) the forward and every gradient are the same bits. The bf16 case with biases."""
    from moe_dispatch.experts import autograd
    from moe_dispatch.host import library

    case = GRAD_CASES[8]
    inputs, ids, options = _experts_inputs(case)
    grad_out = torch.randn(case.T, case.H).to(DEVICE, case.dtype)
    ran = []
    function_forward = autograd.EagerExperts.forward
    monkeypatch.setattr(autograd.EagerExperts, "forward",
                        staticmethod(lambda ctx, *a: ran.append("function") or function_forward(ctx, *a)))
    out, eager = _run_experts(inputs, ids, options, grad_out)
    assert ran == ["function"]
    monkeypatch.setattr(library, "eager_autograd", lambda args: False)
    out_op, through_op = _run_experts(inputs, ids, options, grad_out)
    assert ran == ["function"], "the operator's call ran the autograd.Function"
    assert torch.equal(out, out_op)
    for name in eager:
        assert torch.equal(eager[name], through_op[name]), name


def _reuse_spy(monkeypatch):
    """The reuse_preact of every experts backward from here on (replayed ones too: the spy sits above the plans)."""
    from moe_dispatch.experts import autograd

    seen = []
    grads = autograd.experts_grads
    monkeypatch.setattr(autograd, "experts_grads",
                        lambda *a, reuse_preact: seen.append(reuse_preact) or grads(*a, reuse_preact=reuse_preact))
    return seen


def test_backward_writes_d_preact_over_preact_only_when_the_graph_is_freed(monkeypatch):
    """A plain backward writes the pre-activations' gradient over the saved pre-activations (one [N, 2F] buffer
    fewer); one that keeps the graph (retain_graph) runs the operator, which only reads them, so a second backward
    over the same graph is still right. All three give the same bits. The bf16 case with biases: the buffer reused is
    in the input dtype (the half-precision case), every gradient is asked for."""
    case = GRAD_CASES[8]
    inputs, ids, options = _experts_inputs(case)
    grad_out = torch.randn(case.T, case.H).to(DEVICE, case.dtype)
    seen = _reuse_spy(monkeypatch)
    _, reused = _run_experts(inputs, ids, options, grad_out)
    assert seen == [True]
    out = md.fused_experts(inputs["hidden_states"], inputs["w_gate_up"], inputs["w_down"], ids,
                           inputs["topk_weights"], gate_up_bias=inputs.get("gate_up_bias"),
                           down_bias=inputs.get("down_bias"), validate=False, **options)
    leaves = list(inputs.values())
    kept = torch.autograd.grad(out, leaves, grad_out, retain_graph=True)
    again = torch.autograd.grad(out, leaves, grad_out)
    assert seen == [True, False, True]
    for name, first, second in zip(inputs, kept, again):
        assert torch.equal(first, reused[name]), name
        assert torch.equal(second, reused[name]), name


@pytest.mark.filterwarnings("ignore:Input #:UserWarning")  # fp32 inputs: the kernels have no float64 path
def test_gradcheck_hidden_states_and_weights():
    """torch.autograd.gradcheck by finite differences (fp32 kernels, so loose tolerances; few inputs for speed). Fast
    mode: the finite differences and the backward are compared along random directions of the inputs and outputs
    (v^T J u) rather than entry by entry: 6 forwards and 4 backwards instead of 62 and 50 (two forwards per input
    element, a backward per output element); a wrong Jacobian entry still moves the projection."""
    E, top_k, H, F = 3, 2, 8, 4
    w_gate_up = torch.randn(E, 2 * F, H, device=DEVICE) * 0.3
    w_down = torch.randn(E, H, F, device=DEVICE) * 0.3
    ids = torch.tensor([[0, 2], [1, 0], [2, 1]], device=DEVICE)

    def fn(x, weights):
        return md.fused_experts(x, w_gate_up, w_down, ids, weights)

    x = torch.randn(3, H, device=DEVICE, requires_grad=True)
    weights = torch.rand(3, top_k, device=DEVICE, requires_grad=True)
    assert torch.autograd.gradcheck(fn, (x, weights), eps=1e-2, atol=5e-3, rtol=5e-2, fast_mode=True)


def test_zero_tokens_and_all_dropped():
    """T = 0 gives empty gradients; ids all outside [0, E) give zero gradients everywhere."""
    case = GRAD_CASES[0]
    for T, fill in ((0, None), (5, case.E)):
        inputs, _, options = _experts_inputs(dataclasses.replace(case, T=max(T, 1)))
        inputs["hidden_states"] = inputs["hidden_states"].detach()[:T].requires_grad_()
        inputs["topk_weights"] = inputs["topk_weights"].detach()[:T].requires_grad_()
        ids = torch.full((T, case.top_k), fill if fill is not None else 0, device=DEVICE)
        out, grads = _run_experts(inputs, ids, options, torch.ones(T, case.H, device=DEVICE))
        assert out.shape == (T, case.H)
        for name, grad in grads.items():
            assert grad.shape == inputs[name].shape and not grad.any(), name


ROUTINGS = [
    ("softmax-renorm", "Mixtral: softmax top-2, renormalised", "softmax", dict(renormalize=True)),
    ("softmax", "Qwen2-MoE: softmax, not renormalised, router bias", "softmax", dict(router_bias=True)),
    ("sigmoid-groups", "DeepSeek-V3: sigmoid, correction bias, groups, scaling", "sigmoid",
     dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, correction=True)),
]


@pytest.mark.parametrize("name,why,gating,options", ROUTINGS, ids=[r[0] for r in ROUTINGS])
def test_fused_moe_forward_gradients(name, why, gating, options, poison_empty):
    """Gradients reach router_weight (and router_bias) through the gating weights, and every expert weight."""
    T, E, top_k, H, F = 9, 8, 2, 32, 24
    options = dict(options)
    leaves = dict(hidden_states=torch.randn(T, H), router_weight=torch.randn(E, H) * 0.3,
                  w_gate=torch.randn(E, F, H) * 0.2, w_up=torch.randn(E, F, H) * 0.2, w_down=torch.randn(E, H, F) * 0.2)
    if options.pop("router_bias", False):
        leaves["router_bias"] = torch.randn(E) * 0.2
    kwargs = dict(options)
    if kwargs.pop("correction", False):
        kwargs["e_score_correction_bias"] = (torch.randn(E) * 0.1).to(DEVICE)
    leaves = {k: v.to(DEVICE).requires_grad_() for k, v in leaves.items()}
    grad_out, grad_weights = torch.randn(T, H, device=DEVICE), torch.randn(T, top_k, device=DEVICE)

    def loss(fn, tensors):
        bias = {"router_bias": tensors["router_bias"]} if "router_bias" in tensors else {}
        out, ids, weights = fn(tensors["hidden_states"], tensors["router_weight"], tensors["w_gate"], tensors["w_up"],
                               tensors["w_down"], E, top_k, gating, **bias, **kwargs)
        return (out * grad_out.to(out.dtype)).sum() + (weights * grad_weights.to(weights.dtype)).sum(), ids

    got, ids = loss(md.fused_moe_forward, leaves)
    grads = torch.autograd.grad(got, list(leaves.values()))
    ref_leaves = {k: v.detach().double().requires_grad_() for k, v in leaves.items()}
    ref, ref_ids = loss(fused_moe_forward_ref, ref_leaves)
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    ref_grads = torch.autograd.grad(ref, list(ref_leaves.values()))
    for name, grad, ref_grad in zip(leaves, grads, ref_grads):
        assert_grad_close(grad, ref_grad, torch.float32, f"{name} d {name}")


def test_moe_router_gradients_through_weights_and_logits():
    T, E, H, top_k = 7, 6, 16, 3
    x = torch.randn(T, H, device=DEVICE, requires_grad=True)
    router_weight = (torch.randn(E, H, device=DEVICE) * 0.5).requires_grad_()
    ids, weights, logits = md.moe_router(x, router_weight, top_k, "softmax", renormalize=True)
    g_weights, g_logits = torch.randn_like(weights), torch.randn_like(logits)
    grads = torch.autograd.grad((weights * g_weights).sum() + (logits * g_logits).sum(), [x, router_weight])
    x64, w64 = x.detach().double().requires_grad_(), router_weight.detach().double().requires_grad_()
    _, ref_weights, ref_logits = moe_router_ref(x64, w64, top_k, "softmax", renormalize=True)
    ref_grads = torch.autograd.grad((ref_weights * g_weights.double()).sum() + (ref_logits * g_logits.double()).sum(),
                                    [x64, w64])
    for name, grad, ref_grad in zip(("x", "router_weight"), grads, ref_grads):
        assert_grad_close(grad, ref_grad, torch.float32, f"d {name}")


def test_capacity_drops_get_no_gradient():
    """fused_moe_forward(capacity_factor=...): dropped assignments contribute nothing, so their expert rows get no
    gradient; the result equals the reference on the kept ids."""
    T, E, top_k, H, F = 12, 4, 2, 16, 16
    x = torch.randn(T, H, device=DEVICE, requires_grad=True)
    router_weight = torch.randn(E, H, device=DEVICE)
    w_gate, w_up, w_down = (torch.randn(*s, device=DEVICE).mul(0.2).requires_grad_()
                            for s in ((E, F, H), (E, F, H), (E, H, F)))
    out, ids, weights = md.fused_moe_forward(x, router_weight, w_gate, w_up, w_down, E, top_k, capacity_factor=0.5)
    kept_ids = md.dispatch.binned.drop_over_capacity(ids, E, 0.5)
    assert (kept_ids == E).any()
    grads = torch.autograd.grad(out.sum(), [x, w_gate, w_up, w_down])
    leaves = [t.detach().double().requires_grad_() for t in (x, w_gate, w_up, w_down)]
    _, ref_weights, _ = moe_router_ref(leaves[0], router_weight, top_k)
    ref = fused_experts_ref(leaves[0], torch.cat(leaves[1:3], dim=1), leaves[3], kept_ids, ref_weights)
    ref_grads = torch.autograd.grad(ref.sum(), leaves)
    for name, grad, ref_grad in zip(("x", "w_gate", "w_up", "w_down"), grads, ref_grads):
        assert_grad_close(grad, ref_grad, torch.float32, f"d {name}")


@pytest.mark.parametrize("persistent", [True, False])
def test_weight_grad_kernels_against_float64(persistent):
    """The weight-gradient GEMM out[e] = left_e^T right_e over each expert's sorted rows (and the bias gradient as its
    column sums), both kernels: experts with no rows, with fewer rows than block_p and with a partial last block;
    out contiguous with n_i a multiple of block_i (the descriptor store) and not (masked stores), and a transposed
    view. Poisoned outputs: every element must be written."""
    from moe_dispatch.dispatch.segments import segment_dispatch
    from moe_dispatch.backward.experts import _weight_grad
    from moe_dispatch.host.tiles import WeightGradTile

    tile = WeightGradTile(16, 16, 16, persistent=persistent)  # a GPU's dot needs K >= 16
    generator = torch.Generator().manual_seed(5)
    counts = [0, 5, 16, 37, 0]  # block_p 16: none, fewer, one whole block, two whole blocks and a partial one
    offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    N, E = sum(counts), len(counts)
    info = segment_dispatch(offsets, N, E, 16)
    weights = torch.rand(N, 1, generator=generator).to(DEVICE)
    for n_i, n_j, transposed in ((32, 24, False), (20, 16, False), (16, 40, True)):
        left = torch.randn(N, n_i, generator=generator).to(DEVICE, torch.bfloat16)
        right = torch.randn(N, n_j, generator=generator).to(DEVICE, torch.bfloat16)
        ref = torch.stack([left[a:b].double().T @ right[a:b].double() for a, b in zip(offsets[:-1], offsets[1:])])
        base = torch.full((E, n_j, n_i) if transposed else (E, n_i, n_j), float("nan"), device=DEVICE,
                          dtype=torch.bfloat16)
        out = base.transpose(1, 2) if transposed else base
        bias = torch.full((E, n_i), float("nan"), device=DEVICE, dtype=torch.float32)
        _weight_grad(left, right, out, bias, info, weights, tile)
        assert_close(out, ref, torch.bfloat16, f"dW {n_i}x{n_j} transposed={transposed}")
        bias_ref = torch.stack([left[a:b].double().sum(0) for a, b in zip(offsets[:-1], offsets[1:])])
        assert_close(bias, bias_ref, torch.float32, "bias gradient")


def test_weight_grad_kernel_choice():
    """The persistent kernel runs where the tile asks for it and the operands fit descriptors; else the pointer one."""
    from moe_dispatch.host.device import has_tma
    from moe_dispatch.gemm.planner import weight_grad_kernel
    from moe_dispatch.host.tiles import WeightGradTile

    left, right = torch.zeros(8, 16, dtype=torch.bfloat16), torch.zeros(8, 24, dtype=torch.bfloat16)
    out = torch.zeros(2, 16, 24, dtype=torch.bfloat16)
    on, off = WeightGradTile(16, 16, 8, persistent=True), WeightGradTile(16, 16, 8)
    assert weight_grad_kernel(left, right, out, on) == has_tma(left.device)  # the interpreter emulates TMA
    assert not weight_grad_kernel(left, right, out, off)
    assert not weight_grad_kernel(torch.zeros(8, 17, dtype=torch.bfloat16)[:, :16], right, out, on)  # row stride
    assert not weight_grad_kernel(left, right[:, ::2], out, on)  # column stride
    assert not weight_grad_kernel(left[:0], right[:0], out, on)  # no rows
