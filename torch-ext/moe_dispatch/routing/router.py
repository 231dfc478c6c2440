"""Routing: router GEMM, then gating (softmax or sigmoid), optional group-limited selection, top-k, renormalisation.

Two kernels, no host sync:
  _router_logits_kernel  [T, H] x [E, H]^T -> fp32 partial logits [SPLIT_H, T, E]; the grid splits E and, when T is
                         small, H too, so that decoding (T = 1) still spreads the router weight over many programs.
  _topk_gating_kernel    sums the SPLIT_H partials in a fixed order (deterministic, no atomics), then
                         -> topk_ids [T, top_k] (int64), topk_weights [T, top_k] (fp32).

Semantics (kept from the v1 seed API, extended with DeepSeek-V3 routing):
  scores  = softmax(logits) or sigmoid(logits)              (logits include `router_bias` when given)
  choice  = scores + e_score_correction_bias                (selection only; the weights stay `scores`)
  groups  : with n_group, each group's score is the sum of its two best `choice` values and only the best
            `topk_group` groups stay eligible
  top-k   : the top_k largest `choice` values; ties go to the lower expert id
  NaN     : a NaN ranks above every number, as in torch.topk / torch.sort (ties between NaNs to the lower id), both
            for experts and for group scores. So ids always lie in [0, E), and a token whose logits hold a NaN (a NaN
            in its hidden state, in router_weight, or a softmax over all -inf logits) gets NaN weights: the NaN reaches
            the layer output, as in eager PyTorch, instead of vanishing.
  weights = scores[top-k]; renormalised when `renormalize` (default: False for softmax, True for sigmoid, as the
            seed) by w / (sum(w) + eps) with eps 0 for softmax and 1e-6 for sigmoid; then times routed_scaling_factor.
"""

from typing import Literal

import torch
import triton
import triton.language as tl

from ..host.checks import (check_bool, check_choice, check_dim, check_float, check_hidden_size, check_int,
                           check_kernel_device, check_real, check_same_device, check_top_k)
from ..host.device import dot_needs_fp32
from ..host.device import call_scope
from ..host.host_math import cdiv, next_power_of_2
from ..host.library import call, custom_op
from ..host.replay import launch

GATINGS = {"softmax": 0, "sigmoid": 1}


@triton.jit
def _router_logits_kernel(
    x_ptr, w_ptr, bias_ptr, logits_ptr,
    T, H, E, h_per_split,
    stride_x_t, stride_x_h,
    stride_w_e, stride_w_h,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Grid: (cdiv(T, BLOCK_T), cdiv(E, BLOCK_E), SPLIT_H). Each program owns a [BLOCK_T, BLOCK_E] tile of the fp32
    partial logits of hidden columns [split * h_per_split, +h_per_split); h_per_split is a multiple of BLOCK_H."""
    pid_t = tl.program_id(0)
    pid_e = tl.program_id(1)
    split = tl.program_id(2)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    h_start = split * h_per_split
    offs_h = h_start + tl.arange(0, BLOCK_H)
    h_end = min(H, h_start + h_per_split)
    mask_t = offs_t < T
    mask_e = offs_e < E

    x_ptrs = x_ptr + offs_t[:, None].to(tl.int64) * stride_x_t + offs_h[None, :] * stride_x_h  # [BLOCK_T, BLOCK_H]
    w_ptrs = w_ptr + offs_e[None, :].to(tl.int64) * stride_w_e + offs_h[:, None] * stride_w_h  # [BLOCK_H, BLOCK_E]
    b_acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for h0 in range(h_start, h_end, BLOCK_H):
        mask_h = offs_h < h_end - h0 + h_start
        b_x = tl.load(x_ptrs, mask=mask_t[:, None] & mask_h[None, :], other=0.0)
        b_w = tl.load(w_ptrs, mask=mask_h[:, None] & mask_e[None, :], other=0.0)
        if DOT_FP32:
            b_x = b_x.to(tl.float32)
            b_w = b_w.to(tl.float32)
        b_acc = tl.dot(b_x, b_w, b_acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_H * stride_x_h
        w_ptrs += BLOCK_H * stride_w_h
    if HAS_BIAS:
        if split == 0:
            b_acc += tl.load(bias_ptr + offs_e, mask=mask_e, other=0.0).to(tl.float32)[None, :]
    logits_ptr += split.to(tl.int64) * T * E
    tl.store(logits_ptr + offs_t[:, None].to(tl.int64) * E + offs_e[None, :], b_acc,
             mask=mask_t[:, None] & mask_e[None, :])


@triton.jit
def _first_argmax(b_values, b_available, offs, SENTINEL: tl.constexpr):
    """Row-wise max over the available entries of a [R, C] tile and the lowest column holding it.

    NaN ranks above everything (torch.topk's order): a row with an available NaN returns NaN and its lowest NaN
    column. A row whose available entries are all -inf returns its lowest available column, so a pick is always an
    available column (SENTINEL only for a row with nothing available)."""
    b_nan = b_available & (b_values != b_values)
    b_numbers = tl.where(b_available & ~b_nan, b_values, float("-inf"))
    b_max = tl.max(b_numbers, axis=1)
    b_has_nan = tl.max(b_nan.to(tl.int32), axis=1) > 0
    b_hit = tl.where(b_has_nan[:, None], b_nan, b_available & (b_numbers == b_max[:, None]))
    b_arg = tl.min(tl.where(b_hit, offs[None, :], SENTINEL), axis=1)
    return tl.where(b_has_nan, float("nan"), b_max), b_arg


@triton.jit
def _topk_gating_kernel(
    logits_ptr, correction_ptr, topk_ids_ptr, topk_weights_ptr,
    T, E, group_size,
    renorm_eps, routed_scaling_factor,
    SPLIT_H: tl.constexpr,
    TOP_K: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_CORRECTION: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Grid: (cdiv(T, BLOCK_T),). Each program routes BLOCK_T tokens; all E experts of a token sit in one row."""
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    mask_t = offs_t < T
    mask_e = offs_e < E
    logit_offs = offs_t[:, None].to(tl.int64) * E + offs_e[None, :]
    mask_te = mask_t[:, None] & mask_e[None, :]
    b_logits = tl.load(logits_ptr + logit_offs, mask=mask_te, other=0.0)  # [BLOCK_T, BLOCK_E]
    for split in tl.static_range(1, SPLIT_H):
        b_logits += tl.load(logits_ptr + split * T * E + logit_offs, mask=mask_te, other=0.0)
    if SPLIT_H > 1:
        tl.store(logits_ptr + logit_offs, b_logits, mask=mask_te)  # the caller reads split 0 as the logits
    if SIGMOID:
        b_scores = tl.sigmoid(b_logits)
    else:
        b_shifted = tl.where(mask_e[None, :], b_logits, float("-inf"))
        b_exp = tl.exp(b_shifted - tl.max(b_shifted, axis=1)[:, None])
        b_scores = b_exp / tl.sum(b_exp, axis=1)[:, None]
    b_choice = b_scores
    if HAS_CORRECTION:
        b_choice += tl.load(correction_ptr + offs_e, mask=mask_e, other=0.0).to(tl.float32)[None, :]
    # Which experts a pick may still take: real ones (< E), in an allowed group, not taken yet. A mask rather than
    # -inf values, so that -inf (and NaN) choices stay pickable and a pick is always an id in [0, E).
    b_available = tl.broadcast_to(mask_e[None, :], (BLOCK_T, BLOCK_E))

    if N_GROUP > 1:
        # Group score = sum of the group's two best choices; keep the TOPK_GROUP best groups.
        offs_g = tl.arange(0, BLOCK_G)
        group_of = offs_e // group_size  # [BLOCK_E]
        b_group_scores = tl.full((BLOCK_T, BLOCK_G), float("-inf"), dtype=tl.float32)
        for g in tl.static_range(N_GROUP):
            b_in_group = b_available & (group_of == g)[None, :]
            b_best, b_best_at = _first_argmax(b_choice, b_in_group, offs_e, BLOCK_E)
            b_second, _ = _first_argmax(b_choice, b_in_group & (offs_e[None, :] != b_best_at[:, None]), offs_e,
                                        BLOCK_E)
            b_group_scores = tl.where(offs_g[None, :] == g, (b_best + b_second)[:, None], b_group_scores)
        b_group_open = tl.broadcast_to((offs_g < N_GROUP)[None, :], (BLOCK_T, BLOCK_G))
        b_allowed = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            _, b_group = _first_argmax(b_group_scores, b_group_open, offs_g, BLOCK_G)
            b_allowed = b_allowed | (group_of[None, :] == b_group[:, None])
            b_group_open = b_group_open & (offs_g[None, :] != b_group[:, None])
        b_available = b_available & b_allowed

    b_ids = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int64)
    b_weights = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    for j in range(TOP_K):
        _, b_pick = _first_argmax(b_choice, b_available, offs_e, BLOCK_E)  # [BLOCK_T]
        b_pick = tl.minimum(b_pick, E - 1)  # unreachable (top_k <= allowed experts); keeps ids in range regardless
        b_picked = offs_e[None, :] == b_pick[:, None]  # [BLOCK_T, BLOCK_E]
        b_w = tl.sum(tl.where(b_picked, b_scores, 0.0), axis=1)
        b_ids = tl.where(offs_k[None, :] == j, b_pick[:, None].to(tl.int64), b_ids)
        b_weights = tl.where(offs_k[None, :] == j, b_w[:, None], b_weights)
        b_available = b_available & ~b_picked
    if RENORMALIZE:
        b_weights = b_weights / (tl.sum(b_weights, axis=1)[:, None] + renorm_eps)
    b_weights = b_weights * routed_scaling_factor

    out_offs = offs_t[:, None].to(tl.int64) * TOP_K + offs_k[None, :]
    mask_out = mask_t[:, None] & (offs_k[None, :] < TOP_K)
    tl.store(topk_ids_ptr + out_offs, b_ids, mask=mask_out)
    tl.store(topk_weights_ptr + out_offs, b_weights, mask=mask_out)


def route(x, router_weight, top_k, gating="softmax", router_bias=None, *, renormalize=None, n_group=None,
          topk_group=None, e_score_correction_bias=None, routed_scaling_factor=1.0):
    """Launcher for 2-D `x` [T, H] (validated by the caller's `check_router_args`).

    Returns topk_ids [T, top_k] int64, topk_weights [T, top_k] fp32, logits [T, E] fp32 (split 0 of the partials,
    where the gating kernel leaves the sum).
    """
    T, H = x.shape
    E = router_weight.shape[0]
    device = x.device
    block_t = 16 if T <= 64 else 64
    block_e = min(max(16, next_power_of_2(E)), 32)
    block_h = 128
    # Few token tiles: split H as well, so the router weight is read by ~64+ programs in parallel (decode).
    programs = max(1, cdiv(T, block_t) * cdiv(E, block_e))
    split_h = max(1, min(cdiv(H, 4 * block_h), cdiv(64, programs))) if programs < 64 else 1
    h_per_split = cdiv(cdiv(max(H, 1), split_h), block_h) * block_h
    split_h = max(1, cdiv(H, h_per_split))
    partials = torch.empty((split_h, T, E), device=device, dtype=torch.float32)
    topk_ids = torch.empty((T, top_k), device=device, dtype=torch.int64)
    topk_weights = torch.empty((T, top_k), device=device, dtype=torch.float32)
    if T == 0:
        return topk_ids, topk_weights, partials[0]

    sigmoid = GATINGS[gating] == 1
    if renormalize is None:
        renormalize = sigmoid
    n_group = n_group or 1
    topk_group = topk_group or n_group

    dot_fp32 = dot_needs_fp32(x.dtype)
    launch(_router_logits_kernel, (cdiv(T, block_t), cdiv(E, block_e), split_h),
        x, router_weight, router_bias, partials,
        T, H, E, h_per_split,
        x.stride(0), x.stride(1),
        router_weight.stride(0), router_weight.stride(1),
        HAS_BIAS=router_bias is not None,
        DOT_FP32=dot_fp32,
        # The router is tiny: fp32 callers get full fp32 logits (never tf32), so top-k picks what a float64 router
        # would; half-precision operands are exact products either way.
        DOT_PRECISION="ieee",
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_H=block_h,
        num_warps=4,
    )

    block_e_all = max(16, next_power_of_2(E))
    block_t_gate = 16 if block_e_all <= 128 else 8
    launch(_topk_gating_kernel, (cdiv(T, block_t_gate),),
        partials, e_score_correction_bias, topk_ids, topk_weights,
        T, E, E // n_group,
        1e-6 if sigmoid else 0.0, float(routed_scaling_factor),
        SPLIT_H=split_h,
        TOP_K=top_k,
        SIGMOID=sigmoid,
        RENORMALIZE=bool(renormalize),
        HAS_CORRECTION=e_score_correction_bias is not None,
        N_GROUP=n_group,
        TOPK_GROUP=topk_group,
        BLOCK_T=block_t_gate,
        BLOCK_E=block_e_all,
        BLOCK_G=max(2, next_power_of_2(n_group)),
        BLOCK_K=next_power_of_2(top_k),
        num_warps=4,
    )
    return topk_ids, topk_weights, partials[0]


def check_router_args(hidden_states, router_weight, top_k, gating, router_bias, n_group, topk_group,
                      e_score_correction_bias):
    """Validate router arguments; returns E."""
    check_float("hidden_states", hidden_states, min_ndim=1)
    check_float("router_weight", router_weight, ndim=2)
    check_hidden_size("hidden_states", hidden_states)
    E, H = router_weight.shape
    check_dim("router_weight", router_weight, 1, hidden_states.shape[-1], "hidden size H of hidden_states")
    if router_weight.dtype != hidden_states.dtype:
        raise TypeError(f"router_weight has dtype {router_weight.dtype} but hidden_states has {hidden_states.dtype}; "
                        f"they must match")
    if E < 1:
        raise ValueError("router_weight must have at least one expert row")
    check_top_k(top_k, E)
    check_choice("gating", gating, GATINGS)
    if router_bias is not None:
        check_float("router_bias", router_bias, ndim=1)
        check_dim("router_bias", router_bias, 0, E, "number of experts E")
    if e_score_correction_bias is not None:
        check_float("e_score_correction_bias", e_score_correction_bias, ndim=1)
        check_dim("e_score_correction_bias", e_score_correction_bias, 0, E, "number of experts E")
    if n_group is not None:
        check_int("n_group", n_group, 1)
        if E % n_group:
            raise ValueError(f"n_group must divide num_experts={E}, got {n_group}")
        if n_group > 1 and E // n_group < 2:
            raise ValueError(f"n_group={n_group} leaves fewer than 2 experts per group (num_experts={E})")
        groups = check_int("topk_group", topk_group, 1) if topk_group is not None else n_group
        if not 1 <= groups <= n_group:
            raise ValueError(f"topk_group must be an int in [1, n_group={n_group}], got {topk_group!r}")
        if groups * (E // n_group) < top_k:
            raise ValueError(
                f"topk_group={groups} groups of {E // n_group} experts cannot supply top_k={top_k} experts")
    elif topk_group is not None:
        raise ValueError("topk_group needs n_group")
    check_same_device(hidden_states=hidden_states, router_weight=router_weight, router_bias=router_bias,
                      e_score_correction_bias=e_score_correction_bias)
    check_kernel_device("hidden_states", hidden_states)
    return E


def check_router_options(top_k, gating, renormalize, n_group, topk_group, routed_scaling_factor):
    """The router's non-tensor options by kind, before anything else runs (the ranges that depend on E are
    `check_router_args`'): a TypeError or ValueError naming the option."""
    check_int("top_k", top_k, 1)
    check_choice("gating", gating, GATINGS)
    check_bool("renormalize", renormalize, none=True)
    if n_group is not None:
        check_int("n_group", n_group, 1)
    if topk_group is not None:
        check_int("topk_group", topk_group, 1)
    check_real("routed_scaling_factor", routed_scaling_factor)


@custom_op("route")
def _route_op(x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor | None,
              e_score_correction_bias: torch.Tensor | None, top_k: int, gating: str, renormalize: bool, n_group: int,
              topk_group: int, routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`route` as an operator: (topk_weights [T, k] fp32, logits [T, E] fp32, topk_ids [T, k] int64); the float
    outputs come first (autograd test harnesses sum the outputs in the first one's dtype)."""
    topk_ids, topk_weights, logits = route(
        x, router_weight, top_k, gating, router_bias, renormalize=renormalize, n_group=n_group, topk_group=topk_group,
        e_score_correction_bias=e_score_correction_bias, routed_scaling_factor=routed_scaling_factor)
    return topk_weights, logits, topk_ids


@_route_op.register_fake
def _(x, router_weight, router_bias, e_score_correction_bias, top_k, gating, renormalize, n_group, topk_group,
      routed_scaling_factor):
    T, E = x.shape[0], router_weight.shape[0]
    return (x.new_empty((T, top_k), dtype=torch.float32), x.new_empty((T, E), dtype=torch.float32),
            x.new_empty((T, top_k), dtype=torch.int64))


def _route_setup_context(ctx, inputs, output):
    x, router_weight, router_bias, _, _, gating, renormalize, _, _, routed_scaling_factor = inputs
    _, logits, topk_ids = output
    ctx.save_for_backward(x, router_weight, topk_ids, logits)
    ctx.options = (GATINGS[gating] == 1, renormalize, routed_scaling_factor)
    ctx.bias_dtype = router_bias.dtype if router_bias is not None else None


def _route_backward(ctx, d_topk_weights, d_logits, _):
    """Gradient through the gating weights (the top-k choice itself is not differentiated, as in PyTorch): the
    [T, E] logit gradient, then the router GEMM's input and weight gradients (dense torch matmuls in fp32)."""
    x, router_weight, topk_ids, logits = ctx.saved_tensors
    sigmoid, renormalize, scale = ctx.options
    d_total = torch.zeros_like(logits) if d_logits is None else d_logits.float()
    if d_topk_weights is not None:
        scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
        picked = scores.gather(1, topk_ids)
        d_picked = d_topk_weights.float() * scale
        if renormalize:
            denom = picked.sum(-1, keepdim=True) + (1e-6 if sigmoid else 0.0)
            d_picked = d_picked / denom - (d_picked * picked).sum(-1, keepdim=True) / denom**2
        d_scores = torch.zeros_like(scores).scatter(1, topk_ids, d_picked)  # top-k ids of a row are distinct
        if sigmoid:
            d_total = d_total + d_scores * scores * (1 - scores)
        else:
            d_total = d_total + scores * (d_scores - (d_scores * scores).sum(-1, keepdim=True))
    needs = ctx.needs_input_grad
    d_x = (d_total @ router_weight.float()).to(x.dtype) if needs[0] else None
    d_router_weight = (d_total.T @ x.float()).to(router_weight.dtype) if needs[1] else None
    d_router_bias = d_total.sum(0).to(ctx.bias_dtype) if needs[2] else None
    return (d_x, d_router_weight, d_router_bias) + (None,) * 7


_route_op.register_autograd(_route_backward, setup_context=_route_setup_context)


def route_with_grad(x, router_weight, top_k, gating="softmax", router_bias=None, *, renormalize=None, n_group=None,
                    topk_group=None, e_score_correction_bias=None, routed_scaling_factor=1.0):
    """`route` through its operator (differentiable in x, router_weight and router_bias; compilable). Same returns as
    `route`: (topk_ids, topk_weights, logits)."""
    if renormalize is None:
        renormalize = GATINGS[gating] == 1
    n_group = n_group or 1
    topk_weights, logits, topk_ids = call(_route_op, x, router_weight, router_bias, e_score_correction_bias, top_k,
                                          gating, bool(renormalize), n_group, topk_group or n_group,
                                          float(routed_scaling_factor))
    return topk_ids, topk_weights, logits


@call_scope
def moe_router(hidden_states: torch.Tensor, router_weight: torch.Tensor, top_k: int,
               gating: Literal["softmax", "sigmoid"] = "softmax", router_bias: torch.Tensor | None = None, *,
               renormalize: bool | None = None, n_group: int | None = None, topk_group: int | None = None,
               e_score_correction_bias: torch.Tensor | None = None,
               routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Route tokens to experts.

    hidden_states [..., H], router_weight [E, H]. Returns (top_k_indices [T, top_k] int64, top_k_weights [T, top_k] in
    the input dtype, router_logits [T, E] in the input dtype) with T the product of the leading dims.
    """
    check_router_options(top_k, gating, renormalize, n_group, topk_group, routed_scaling_factor)
    check_router_args(hidden_states, router_weight, top_k, gating, router_bias, n_group, topk_group,
                      e_score_correction_bias)
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    topk_ids, topk_weights, logits = route_with_grad(
        x, router_weight, top_k, gating, router_bias, renormalize=renormalize, n_group=n_group,
        topk_group=topk_group, e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=routed_scaling_factor)
    return topk_ids, topk_weights.to(hidden_states.dtype), logits.to(hidden_states.dtype)
