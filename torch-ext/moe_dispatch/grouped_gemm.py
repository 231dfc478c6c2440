"""Grouped GEMMs over expert-sorted rows: one Triton kernel for both MoE projections and the v1 `grouped_gemm`.

Each program owns a BLOCK_M x BLOCK_N output tile of one expert (tiles come from `dispatch.DispatchInfo`: a tile never
spans two experts, tiles past the real work exit at once). Variants are constexpr flags:

  GATHER_A           A row of sorted position p is x[gather_idx[p] // TOP_K]: the permutation happens in the loads
  ACTIVATION         0 none; 1 silu(gate) * up; 2 GPT-OSS clamped SwiGLU. Gated variants load two weight tiles per
                     K step (gate columns and up columns) against the same A tile and combine them in the epilogue
  HAS_BIAS           per-expert bias added to the accumulator(s) before the activation
  MUL_ROUTED_WEIGHT  multiply each output row by its assignment's routing weight (GEMM2's epilogue)

Weights are addressed through strides, so the transformers layout ([E, N, K]) and GPT-OSS's transposed one
([E, K, N]) run without copies. Gated variants take the gate and up weights as two views with equal strides:
`w[:, :F]` and `w[:, F:]` of a concatenated gate_up weight, `w[:, 0::2]` and `w[:, 1::2]` of an interleaved one.
"""

import torch
import triton
import triton.language as tl

from ._checks import (check_dim, check_float, check_index, check_same_device, expert_offsets_problems, raise_problems,
                      reads_values, warn_if_gradient_cut)
from ._device import dot_needs_fp32, fp32_dot_precision
from .tiles import GemmTile

ACTIVATIONS = {"none": 0, "silu": 1, "swiglu_oai": 2}


@triton.jit
def _apply_activation(b_gate, b_up, alpha, limit, ACTIVATION: tl.constexpr):
    if ACTIVATION == 1:
        return b_gate * tl.sigmoid(b_gate) * b_up
    else:
        b_gate = tl.minimum(b_gate, limit)
        b_up = tl.minimum(tl.maximum(b_up, -limit), limit)
        return (b_up + 1.0) * b_gate * tl.sigmoid(alpha * b_gate)


@triton.jit
def _grouped_gemm_kernel(
    # A: [rows, K]; with GATHER_A the row of sorted position p is gather_idx[p] // TOP_K
    a_ptr, stride_a_m, stride_a_k,
    # B: per-expert weights [E, N, K] by strides; up weights (gated variants) share the strides
    b_ptr, b_up_ptr, stride_b_e, stride_b_n, stride_b_k,
    bias_ptr, bias_up_ptr, stride_bias_e, stride_bias_n,
    # C: [N_assign, N] in sorted order
    c_ptr, stride_c_m, stride_c_n,
    # dispatch metadata
    tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, gather_idx_ptr,
    topk_weights_ptr, stride_w_t, stride_w_k,
    # sizes
    N, K, max_tiles,
    alpha, limit,
    TOP_K: tl.constexpr,
    GATHER_A: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Grid: (max_tiles * cdiv(N, BLOCK_N),). Program -> (row tile, column tile) in GROUP_M-grouped order."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_m = (pid // num_pid_in_group) * GROUP_M
    group_size = min(max_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % num_pid_in_group) % group_size
    pid_n = (pid % num_pid_in_group) // group_size

    expert = tl.load(tile_expert_ptr + pid_m)
    if expert < 0:
        return
    row_start = tl.load(tile_row_start_ptr + pid_m)
    row_end = tl.load(expert_offsets_ptr + expert + 1)
    offs_m = row_start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < row_end
    if GATHER_A:
        b_rows = tl.load(gather_idx_ptr + offs_m, mask=mask_m, other=0) // TOP_K
    else:
        b_rows = offs_m
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + b_rows[:, None].to(tl.int64) * stride_a_m + offs_k[None, :] * stride_a_k  # [BLOCK_M, BLOCK_K]
    # One expert's matrix stays below 2^31 elements: 64-bit only for the expert's base offset.
    expert_base = expert.to(tl.int64) * stride_b_e
    b_offs = offs_n[None, :] * stride_b_n + offs_k[:, None] * stride_b_k
    bg_ptrs = b_ptr + expert_base + b_offs  # [BLOCK_K, BLOCK_N]
    bu_ptrs = b_up_ptr + expert_base + b_offs
    b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:  # no K tail: masks only on rows (and on columns past N)
            a_mask = mask_m[:, None]
            b_mask = mask_n[None, :]
        else:
            mask_k = offs_k < K - k0
            a_mask = mask_m[:, None] & mask_k[None, :]
            b_mask = mask_k[:, None] & mask_n[None, :]
        b_a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        b_b = tl.load(bg_ptrs, mask=b_mask, other=0.0)
        if DOT_FP32:
            b_a = b_a.to(tl.float32)
            b_b = b_b.to(tl.float32)
        b_acc = tl.dot(b_a, b_b, b_acc, input_precision=DOT_PRECISION)
        if ACTIVATION != 0:
            b_u = tl.load(bu_ptrs, mask=b_mask, other=0.0)
            if DOT_FP32:
                b_u = b_u.to(tl.float32)
            b_acc_up = tl.dot(b_a, b_u, b_acc_up, input_precision=DOT_PRECISION)
            bu_ptrs += BLOCK_K * stride_b_k
        a_ptrs += BLOCK_K * stride_a_k
        bg_ptrs += BLOCK_K * stride_b_k

    if HAS_BIAS:
        bias_offs = expert.to(tl.int64) * stride_bias_e + offs_n * stride_bias_n
        b_acc += tl.load(bias_ptr + bias_offs, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if ACTIVATION != 0:
            b_acc_up += tl.load(bias_up_ptr + bias_offs, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION != 0:
        b_acc = _apply_activation(b_acc, b_acc_up, alpha, limit, ACTIVATION)
    if MUL_ROUTED_WEIGHT:
        b_assignment = tl.load(gather_idx_ptr + offs_m, mask=mask_m, other=0)
        b_w = tl.load(topk_weights_ptr + (b_assignment // TOP_K).to(tl.int64) * stride_w_t
                      + (b_assignment % TOP_K) * stride_w_k, mask=mask_m, other=0.0)
        b_acc = b_acc * b_w.to(tl.float32)[:, None]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_c_m + offs_n[None, :] * stride_c_n
    tl.store(c_ptrs, b_acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _dot_precision(dtype):
    return fp32_dot_precision() if dtype == torch.float32 else "tf32"


def grouped_matmul(a, weight, info, tile: GemmTile, *, weight_up=None, transposed=False, gather_a=False,
                   activation="none", bias=None, bias_up=None, topk_weights=None, alpha=1.702, limit=7.0, out=None):
    """Launch `_grouped_gemm_kernel` over the rows of `info`; returns C [N_assign, N] in a's dtype.

    `weight` is [E, N, K] (or [E, K, N] when `transposed`); gated activations also take `weight_up` (same shape and
    strides) and compute act(a @ weight^T, a @ weight_up^T). Biases are [E, N] views. K is a.shape[1]. Rows of C past
    info.expert_offsets[E] are left unwritten.
    """
    N_rows = info.num_assignments
    K = a.shape[1]
    stride_e, stride_n, stride_k = weight.stride()
    if transposed:
        stride_n, stride_k = stride_k, stride_n
    n_out = weight.shape[2] if transposed else weight.shape[1]
    gated = ACTIVATIONS[activation] != 0
    if gated and weight_up.stride() != weight.stride():
        weight_up = weight_up.contiguous()
        weight = weight.contiguous()
        stride_e, stride_n, stride_k = weight.stride()
        if transposed:
            stride_n, stride_k = stride_k, stride_n
    if bias is not None and bias_up is not None and bias_up.stride() != bias.stride():
        bias, bias_up = bias.contiguous(), bias_up.contiguous()
    c = out if out is not None else torch.empty((N_rows, n_out), device=a.device, dtype=a.dtype)
    if N_rows == 0 or n_out == 0 or info.max_tiles == 0:
        return c
    dot_fp32 = dot_needs_fp32(a.dtype)
    grid = (info.max_tiles * triton.cdiv(n_out, tile.block_n),)
    w_t, w_k = (topk_weights.stride(0), topk_weights.stride(1)) if topk_weights is not None else (0, 0)
    _grouped_gemm_kernel[grid](
        a, a.stride(0), a.stride(1),
        weight, weight_up if gated else weight, stride_e, stride_n, stride_k,
        bias, bias_up if bias_up is not None else bias,
        bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0,
        c, c.stride(0), c.stride(1),
        info.tile_expert, info.tile_row_start, info.expert_offsets, info.gather_idx,
        topk_weights, w_t, w_k,
        n_out, K, info.max_tiles,
        float(alpha), float(limit),
        TOP_K=info.top_k,
        GATHER_A=gather_a,
        ACTIVATION=ACTIVATIONS[activation],
        HAS_BIAS=bias is not None,
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        DOT_FP32=dot_fp32,
        DOT_PRECISION="ieee" if dot_fp32 else _dot_precision(a.dtype),
        EVEN_K=K % tile.block_k == 0,
        BLOCK_M=info.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        GROUP_M=tile.group_m,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return c


def check_segmented_rows(name, rows, expert_offsets, num_experts, validate=None, *, more_problems=None):
    """Validation shared by the v1 functions that take already-permuted rows and `expert_offsets` [E+1]. Offset
    values, and the problems `more_problems()` returns (see _checks.raise_problems), are read per `validate`
    (_checks.reads_values), all in one transfer."""
    check_float(name, rows, ndim=2)
    check_index("expert_offsets", expert_offsets, ndim=1)
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    check_dim("expert_offsets", expert_offsets, 0, num_experts + 1, "num_experts + 1")
    check_same_device(**{name: rows, "expert_offsets": expert_offsets})
    if reads_values(validate, expert_offsets):  # value checks cost a sync on a GPU
        raise_problems(expert_offsets_problems(expert_offsets, rows.shape[0], name)
                       + (more_problems() if more_problems is not None else []))


def segments_info(expert_offsets, num_rows, num_experts, block_m):
    """DispatchInfo for rows that are already in expert order (segment e = rows [offsets[e], offsets[e+1]))."""
    from .dispatch import segment_dispatch

    return segment_dispatch(expert_offsets, num_rows, num_experts, block_m)


def grouped_gemm(tokens, weights, expert_offsets, num_experts, *, validate=None):
    """v1 API: out[r] = tokens[r] @ weights[e].T for every row r of segment e. tokens [M, K], weights [E, N, K].

    `validate`: check expert_offsets' values (start at 0, non-decreasing, end <= M; ValueError otherwise); None checks
    CPU tensors only, True also on a GPU (one sync), False never (bad offsets are clamped into the rows). Rows outside
    every segment are zero. Forward-only.
    """
    check_segmented_rows("tokens", tokens, expert_offsets, num_experts, validate)
    check_float("weights", weights, ndim=3)
    check_dim("weights", weights, 0, num_experts, "num_experts")
    check_dim("weights", weights, 2, tokens.shape[1], "K = tokens.shape[1]")
    check_same_device(tokens=tokens, weights=weights)
    if weights.dtype != tokens.dtype:
        raise TypeError(f"weights dtype {weights.dtype} differs from tokens dtype {tokens.dtype}")
    warn_if_gradient_cut("grouped_gemm", tokens=tokens, weights=weights)
    from .tiles import select_tiles

    tiles = select_tiles(tokens.device, tokens.shape[0], 1, num_experts, weights.shape[1], tokens.shape[1],
                         tokens.dtype)
    info = segments_info(expert_offsets, tokens.shape[0], num_experts, tiles.block_m)
    out = torch.zeros((tokens.shape[0], weights.shape[1]), device=tokens.device, dtype=tokens.dtype)
    return grouped_matmul(tokens, weights, info, tiles.down, out=out)
