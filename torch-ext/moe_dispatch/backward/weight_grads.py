"""The experts backward's weight gradients (`experts.experts_backward` calls `_weight_grad`): per expert e,
out[e] = left_e^T right_e over e's rows in sorted order, and the bias gradient as the same loop's column sums.

  dW_gate_up[e] = d_preact^T x[token]        one GEMM over the 2F rows (their order is the weight's), or one per half
                                             for separate up weights
  dW_down[e]    = (w * dout[token])^T act    d b_down weighted by w

  _expert_weight_grad_kernel      one program per output tile, rows read by pointer (gathered by token with
                                  GATHER_*; BIAS_ONLY: a bias gradient without its weight's)
  _persistent_weight_grad_kernel  operands already in sorted order through tensor descriptors, a persistent grid
                                  (where planner.weight_grad_kernel allows it)

Every output element is written by one program that sums its expert's rows in a fixed order, so two backward passes
are bit-identical. Why the operands come as sorted copies: `experts.py`'s docstring.
"""

import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..gemm.args import dot_options, rows_fit_descriptor
from ..gemm.jit import gathered_rows
from ..gemm.persistent import num_programs
from ..gemm.planner import weight_grad_kernel
from ..host.host_math import cdiv
from ..host.replay import launch
from ..host.tiles import WeightGradTile


@triton.jit
def _rows_dot(b_acc, b_left_t, b_right, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """b_acc + left^T [BLOCK_I, BLOCK_P] @ right [BLOCK_P, BLOCK_J] (fp32 operands on the interpreter)."""
    if DOT_FP32:  # see host.device.dot_needs_fp32
        b_left_t = b_left_t.to(tl.float32)
        b_right = b_right.to(tl.float32)
    return tl.dot(b_left_t, b_right, b_acc, input_precision=DOT_PRECISION)


@triton.jit
def _bias_dot(b_cols, b_left_t, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """b_cols [BLOCK_I, 16] + left^T @ ones: every column the rows' sums of left^T [BLOCK_I, BLOCK_P] (`_first_column`
    reads one). The bias gradient as an MMA rather than a sum in registers: a pipelined operand that is also read
    into registers gets one shared-memory buffer fewer from Triton's pipeliner (3.6 - 3.9, sm90) while the async MMA
    still reads the buffer the next copy overwrites, which made the weight gradients of biased experts differ from
    run to run."""
    b_ones = tl.full((b_left_t.shape[1], 16), 1.0, b_left_t.dtype)
    if DOT_FP32:  # see host.device.dot_needs_fp32
        return tl.dot(b_left_t.to(tl.float32), b_ones.to(tl.float32), b_cols, input_precision=DOT_PRECISION)
    return tl.dot(b_left_t, b_ones, b_cols, input_precision=DOT_PRECISION)


@triton.jit
def _first_column(b_cols):
    """Column 0 of [rows, 16] sums (selected, not added to the others: an inf stays inf)."""
    return tl.sum(tl.where(tl.arange(0, 16)[None, :] == 0, b_cols, 0.0), axis=1)


@triton.jit
def _store_weight_grad(b_acc, b_bias_acc, expert, pid_j, offs_i, mask_i, offs_j, mask_j, out_ptr, stride_out_e,
                       stride_out_i, stride_out_j, bias_grad_ptr, stride_bias_grad_e, stride_bias_grad_i,
                       HAS_BIAS_GRAD: tl.constexpr, STORE_OUT: tl.constexpr):
    """Masked store of one dW[e] tile (with STORE_OUT) and, from the first column tile, of its bias gradient."""
    if STORE_OUT:
        out_ptrs = (out_ptr + expert.to(tl.int64) * stride_out_e + offs_i[:, None].to(tl.int64) * stride_out_i
                    + offs_j[None, :] * stride_out_j)
        tl.store(out_ptrs, b_acc.to(out_ptr.dtype.element_ty), mask=mask_i[:, None] & mask_j[None, :])
    if HAS_BIAS_GRAD:
        if pid_j == 0:
            tl.store(bias_grad_ptr + expert.to(tl.int64) * stride_bias_grad_e + offs_i * stride_bias_grad_i,
                     b_bias_acc.to(bias_grad_ptr.dtype.element_ty), mask=mask_i)


@triton.jit
def _expert_weight_grad_kernel(
    # left [rows, n_i] and right [rows, n_j]: row of sorted position p is p, or its token with GATHER_*
    left_ptr, stride_left_m, stride_left_i,
    right_ptr, stride_right_m, stride_right_j,
    # out [E, n_i, n_j] and bias_grad [E, n_i] by strides
    out_ptr, stride_out_e, stride_out_i, stride_out_j,
    bias_grad_ptr, stride_bias_grad_e, stride_bias_grad_i,
    expert_offsets_ptr, gather_idx_ptr, topk_weights_ptr, stride_topk_t, stride_topk_k,
    num_tokens, n_i, n_j,
    TOP_K: tl.constexpr,
    GATHER_LEFT: tl.constexpr,
    GATHER_RIGHT: tl.constexpr,
    HAS_BIAS_GRAD: tl.constexpr,
    BIAS_ONLY: tl.constexpr,
    WEIGHT_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Grid: (E * cdiv(n_i, BLOCK_I) * cdiv(n_j, BLOCK_J),). out[e, i, j] = sum over expert e's sorted positions p, in
    order, of left[p, i] * right[p, j]; bias_grad[e, i] = the same sum of left[p, i] (times the routing weight with
    WEIGHT_BIAS). An expert without rows gets zeros. BIAS_ONLY (a bias gradient without its weight's): no dot, out
    not written, the sums in registers (no MMA reads the operand, see `_bias_dot`)."""
    pid = tl.program_id(0)
    num_i = tl.cdiv(n_i, BLOCK_I)
    num_j = tl.cdiv(n_j, BLOCK_J)
    expert = pid // (num_i * num_j)
    pid_i = (pid % (num_i * num_j)) // num_j
    pid_j = pid % num_j
    row_start = tl.load(expert_offsets_ptr + expert)
    row_end = tl.load(expert_offsets_ptr + expert + 1)
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    offs_j = pid_j * BLOCK_J + tl.arange(0, BLOCK_J)
    mask_i = offs_i < n_i
    mask_j = offs_j < n_j
    b_acc = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)
    b_bias_acc = tl.zeros((BLOCK_I,), dtype=tl.float32)
    b_bias_cols = tl.zeros((BLOCK_I, 16), dtype=tl.float32)
    for p0 in range(row_start, row_end, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        mask_p = offs_p < row_end
        b_token, b_assignment, mask_token = gathered_rows(gather_idx_ptr, offs_p, mask_p, num_tokens, TOP_K)
        left_rows = b_token if GATHER_LEFT else offs_p
        right_rows = b_token if GATHER_RIGHT else offs_p
        mask_left = mask_token if GATHER_LEFT else mask_p
        mask_right = mask_token if GATHER_RIGHT else mask_p
        # left^T read directly as [BLOCK_I, BLOCK_P] (the dot's A operand, no transpose in registers)
        b_left_t = tl.load(left_ptr + offs_i[:, None] * stride_left_i
                           + left_rows[None, :].to(tl.int64) * stride_left_m,
                           mask=mask_i[:, None] & mask_left[None, :], other=0.0)
        b_right = tl.load(right_ptr + right_rows[:, None].to(tl.int64) * stride_right_m
                          + offs_j[None, :] * stride_right_j,
                          mask=mask_right[:, None] & mask_j[None, :], other=0.0)  # [BLOCK_P, BLOCK_J]
        if BIAS_ONLY:
            if WEIGHT_BIAS:
                b_topk = tl.load(topk_weights_ptr + b_token.to(tl.int64) * stride_topk_t
                                 + (b_assignment % TOP_K) * stride_topk_k, mask=mask_token, other=0.0)
                b_bias_acc += tl.sum(b_left_t.to(tl.float32) * b_topk.to(tl.float32)[None, :], axis=1)
            else:
                b_bias_acc += tl.sum(b_left_t.to(tl.float32), axis=1)
        else:
            if HAS_BIAS_GRAD:
                b_bias_cols = _bias_dot(b_bias_cols, b_left_t, DOT_FP32, DOT_PRECISION)
            b_acc = _rows_dot(b_acc, b_left_t, b_right, DOT_FP32, DOT_PRECISION)
    if HAS_BIAS_GRAD and not BIAS_ONLY:
        b_bias_acc = _first_column(b_bias_cols)
    _store_weight_grad(b_acc, b_bias_acc, expert, pid_j, offs_i, mask_i, offs_j, mask_j, out_ptr, stride_out_e,
                       stride_out_i, stride_out_j, bias_grad_ptr, stride_bias_grad_e, stride_bias_grad_i,
                       HAS_BIAS_GRAD, not BIAS_ONLY)


@triton.jit
def _persistent_weight_grad_kernel(
    # left [rows, n_i] and right [rows, n_j] in sorted order: descriptors of [BLOCK_P, BLOCK_I] / [BLOCK_P, BLOCK_J]
    # tiles for an expert's whole blocks of rows, the pointers (column stride 1) for its last, partial block
    left_desc, right_desc, left_ptr, stride_left_m, right_ptr, stride_right_m,
    # out [E, n_i, n_j] by strides, or a descriptor of [BLOCK_I, BLOCK_J] tiles over it as [E * n_i, n_j] with OUT_DESC
    out_ptr, out_desc, stride_out_e, stride_out_i, stride_out_j,
    bias_grad_ptr, stride_bias_grad_e, stride_bias_grad_i,
    expert_offsets_ptr,
    n_i, n_j, E,
    HAS_BIAS_GRAD: tl.constexpr,
    OUT_DESC: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_P: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """Grid: (NUM_PROGRAMS,). `_expert_weight_grad_kernel`'s sums for operands already in sorted order (no gather),
    over the same blocks of rows in the same order; program q computes tiles q, q + NUM_PROGRAMS, ... of the
    E * cdiv(n_i, BLOCK_I) * cdiv(n_j, BLOCK_J) tiles (expert-major, then i, then j: consecutive programs share the
    left block and walk one expert's right rows). A descriptor load never reaches the next expert's rows: only whole
    blocks inside [row_start, row_end) go through descriptors, the last partial block through masked loads."""
    num_i = tl.cdiv(n_i, BLOCK_I)
    num_j = tl.cdiv(n_j, BLOCK_J)
    num_tiles = E * num_i * num_j
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
        expert = tile_id // (num_i * num_j)
        pid_i = (tile_id % (num_i * num_j)) // num_j
        pid_j = tile_id % num_j
        row_start = tl.load(expert_offsets_ptr + expert)
        row_end = tl.load(expert_offsets_ptr + expert + 1)
        i0 = pid_i * BLOCK_I
        j0 = pid_j * BLOCK_J
        offs_i = i0 + tl.arange(0, BLOCK_I)
        offs_j = j0 + tl.arange(0, BLOCK_J)
        mask_i = offs_i < n_i
        mask_j = offs_j < n_j
        b_acc = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)
        b_bias_cols = tl.zeros((BLOCK_I, 16), dtype=tl.float32)
        whole_end = row_start + ((row_end - row_start) // BLOCK_P) * BLOCK_P
        for p0 in range(row_start, whole_end, BLOCK_P):
            b_left = left_desc.load([p0, i0])  # [BLOCK_P, BLOCK_I]
            b_right = right_desc.load([p0, j0])  # [BLOCK_P, BLOCK_J]
            if HAS_BIAS_GRAD:
                b_bias_cols = _bias_dot(b_bias_cols, b_left.T, DOT_FP32, DOT_PRECISION)
            if DOT_FP32:  # the interpreter (see host.device.dot_needs_fp32)
                b_left = b_left.to(tl.float32)
                b_right = b_right.to(tl.float32)
            b_acc = tl.dot(b_left.T, b_right, b_acc, input_precision=DOT_PRECISION)
        if whole_end < row_end:
            offs_p = whole_end + tl.arange(0, BLOCK_P)
            mask_p = offs_p < row_end
            b_left_t = tl.load(left_ptr + offs_i[:, None] + offs_p[None, :].to(tl.int64) * stride_left_m,
                               mask=mask_i[:, None] & mask_p[None, :], other=0.0)  # [BLOCK_I, BLOCK_P]
            b_right = tl.load(right_ptr + offs_p[:, None].to(tl.int64) * stride_right_m + offs_j[None, :],
                              mask=mask_p[:, None] & mask_j[None, :], other=0.0)
            if HAS_BIAS_GRAD:
                b_bias_cols = _bias_dot(b_bias_cols, b_left_t, DOT_FP32, DOT_PRECISION)
            b_acc = _rows_dot(b_acc, b_left_t, b_right, DOT_FP32, DOT_PRECISION)
        b_bias_acc = _first_column(b_bias_cols)
        if OUT_DESC:  # n_i is a whole number of BLOCK_I, so a tile never reaches the next expert's rows
            out_desc.store([expert * n_i + i0, j0], b_acc.to(out_desc.dtype))
        _store_weight_grad(b_acc, b_bias_acc, expert, pid_j, offs_i, mask_i, offs_j, mask_j, out_ptr, stride_out_e,
                           stride_out_i, stride_out_j, bias_grad_ptr, stride_bias_grad_e, stride_bias_grad_i,
                           HAS_BIAS_GRAD, not OUT_DESC)


def _weight_grad(left, right, out, bias_grad, info, topk_weights, tile: WeightGradTile, *, gather_left=False,
                 gather_right=False, weight_bias=False, bias_only=False):
    """out[e] (a [n_i, n_j] view per expert, any strides) = left_e^T right_e over expert e's rows; see the kernels
    (the persistent one where planner.weight_grad_kernel allows it)."""
    E, n_i, n_j = out.shape
    dot_fp32, precision = dot_options(left.dtype)
    if not (gather_left or gather_right or bias_only) and weight_grad_kernel(left, right, out, tile):
        _persistent_weight_grad(left, right, out, bias_grad, info, tile, dot_fp32, precision)
        return
    grid = (E * cdiv(n_i, tile.block_i) * cdiv(n_j, tile.block_j),)
    topk_t, topk_k = topk_weights.stride()
    launch(_expert_weight_grad_kernel, grid,
        left, left.stride(0), left.stride(1),
        right, right.stride(0), right.stride(1),
        out, out.stride(0), out.stride(1), out.stride(2),
        bias_grad, *(bias_grad.stride() if bias_grad is not None else (0, 0)),
        info.expert_offsets, info.gather_idx, topk_weights, topk_t, topk_k,
        info.num_tokens, n_i, n_j,
        TOP_K=info.top_k,
        GATHER_LEFT=gather_left,
        GATHER_RIGHT=gather_right,
        HAS_BIAS_GRAD=bias_grad is not None,
        BIAS_ONLY=bias_only,
        WEIGHT_BIAS=weight_bias,
        DOT_FP32=dot_fp32,
        DOT_PRECISION=precision,
        BLOCK_I=tile.block_i,
        BLOCK_J=tile.block_j,
        BLOCK_P=tile.block_p,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )


def _persistent_weight_grad(left, right, out, bias_grad, info, tile: WeightGradTile, dot_fp32, precision):
    """Launch `_persistent_weight_grad_kernel` (operands checked by planner.weight_grad_kernel)."""
    E, n_i, n_j = out.shape
    rows = left.shape[0]
    left_desc = TensorDescriptor(left, [rows, n_i], [left.stride(0), 1], [tile.block_p, tile.block_i])
    right_desc = TensorDescriptor(right, [rows, n_j], [right.stride(0), 1], [tile.block_p, tile.block_j])
    out_desc = out_descriptor(out, tile)
    programs = num_programs(left.device, E * cdiv(n_i, tile.block_i) * cdiv(n_j, tile.block_j))
    launch(_persistent_weight_grad_kernel, (programs,),
        left_desc, right_desc, left, left.stride(0), right, right.stride(0),
        out, out_desc if out_desc is not None else left_desc, *out.stride(),
        bias_grad, *(bias_grad.stride() if bias_grad is not None else (0, 0)),
        info.expert_offsets,
        n_i, n_j, E,
        HAS_BIAS_GRAD=bias_grad is not None,
        OUT_DESC=out_desc is not None,
        DOT_FP32=dot_fp32,
        DOT_PRECISION=precision,
        BLOCK_I=tile.block_i,
        BLOCK_J=tile.block_j,
        BLOCK_P=tile.block_p,
        NUM_PROGRAMS=programs,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )


def out_descriptor(out, tile: WeightGradTile):
    """A descriptor of [block_i, block_j] tiles over out [E, n_i, n_j] viewed as [E * n_i, n_j], or None where a
    masked pointer store is needed: out not row-contiguous, or a tile that would reach the next expert's rows
    (n_i not a multiple of block_i)."""
    E, n_i, n_j = out.shape
    if (E == 0 or n_i % tile.block_i or out.stride(2) != 1 or out.stride(0) != n_i * out.stride(1)
            or not rows_fit_descriptor(out[0])):
        return None
    return TensorDescriptor(out, [E * n_i, n_j], [out.stride(1), 1], [tile.block_i, tile.block_j])
