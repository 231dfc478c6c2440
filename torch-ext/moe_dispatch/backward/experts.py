"""Backward of the experts path (`fused_experts`): every gradient a grouped GEMM or a fixed-order reduction, no atomics.

Forward, per kept assignment a at sorted position p (token t, expert e, routing weight w):
    h = x_t @ W_gate_up[e]^T + b_gate_up[e]       preact [N, 2F], saved by the forward (see below)
    y = act(h_gate, h_up) @ W_down[e]^T + b_down[e],   out_t = sum over t's assignments of w * y
Backward from dout [T, H], in launch order:

  _down_grad_kernel         g = dout_t @ W_down[e] (a grouped GEMM over the tile map, rows gathered by token); its
                            epilogue recomputes act from preact and writes d_preact = w * g * act'(h) [N, 2F],
                            act [N, F] (for dW_down) and, per column tile, sum_f g * act (for dw)
  _topk_weights_grad_kernel dw_a = sum of those column-tile partials in tile order (+ dout_t . b_down[e])
  _gate_up_grad_kernel      dx rows = d_preact @ W_gate_up[e] [N, H], one K loop over the 2F columns (two over F for
                            separate gate and up weights); combine.combine sums each token's rows in assignment
                            order -> dx [T, H]
  row_copies._gather_kernel x[token] in sorted order, later w * dout[token], into one [N, H] buffer (dX's rows, free
                            again after the combine)
  _expert_weight_grad_kernel  per expert: dW_gate_up[e] = d_preact^T x[token] (one GEMM over the 2F rows),
                            dW_down[e] = (w * dout[token])^T act, the bias gradients as the same loops' column sums
                            (d b_down weighted by w); weight_grads.py holds it, its persistent variant and their
                            launcher `_weight_grad`

preact and d_preact keep their 2F columns in the order of the gate/up weight's 2F rows: gate then up, or, for an
interleaved weight (GPT-OSS), gate and up alternating. So dX and dW_gate_up are single GEMMs against the weight (and
into its gradient) as it is stored, reading and writing whole contiguous tiles in every layout.

The weight-gradient GEMMs reduce over an expert's rows, so a row gather would sit inside their reduction loop: an
index load that feeds the next step's addresses, which leaves Triton's software pipeliner (3.6 - 3.9, sm90) two
buffers and a full wait per step. Sorted copies of the two gathered operands (2 x N x H elements read and written,
about 1% of those GEMMs' time at Mixtral-8x7B's shapes) give them plain strided loads pipelined num_stages deep.

Every output element is written by one program that sums in a fixed order, so two backward passes are bit-identical.
What is saved for backward: x, the weights and topk_weights (already alive), the dispatch (expert_offsets, gather_idx,
scatter_idx: int32 [E + 1] and 2 x [N]) and the pre-activations [N, 2F] in the activations' dtype. Saving them costs
N * 2F elements and saves recomputing the gate/up GEMM (a third of the forward's FLOPs) in the backward. An eager
backward that frees the graph after it writes d_preact over them (moe._may_reuse_preact): the backward's transients
are then the activated rows [N, F] and dX's rows [N, H], not another [N, 2F].
"""

import dataclasses

import torch
import triton
import triton.language as tl

from ..dispatch.combine import combine
from ..dispatch.row_copies import PLAIN, Layout, launch_gather
from ..dispatch.segments import segment_dispatch
from ..formats.fp8 import WeightScale
from ..formats.mxfp4 import MXFP4_GROUP
from ..formats.scale_codes import WeightScaleCode
from ..gemm.args import NO_SCALE, dequant_scale_code, dot_options, same_strides, scale_args, weight_strides
from ..gemm.jit import ACT_SILU, Activation, expert_tile_dot, gathered_rows, split_pairs, tile_dot, tile_setup
from ..gemm.planner import plan_backward
from ..host.host_math import cdiv
from ..host.replay import launch
from ..host.tiles import MoeTiles, WeightGradTile
from .weight_grads import _weight_grad


@triton.jit
def _activation_grad(b_gate, b_up, alpha, limit, ACTIVATION: tl.constexpr):
    """(act, d act / d gate, d act / d up) of fp32 pre-activations; clamps pass no gradient where they clamp."""
    if ACTIVATION == ACT_SILU:
        b_sig = tl.sigmoid(b_gate)
        b_silu = b_gate * b_sig
        return b_silu * b_up, b_up * b_sig * (1.0 + b_gate * (1.0 - b_sig)), b_silu
    else:
        b_gate_c = tl.minimum(b_gate, limit, propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN (apply_activation)
        b_up_c = tl.minimum(tl.maximum(b_up, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                            propagate_nan=tl.PropagateNan.ALL)
        b_sig = tl.sigmoid(alpha * b_gate_c)
        b_glu = b_gate_c * b_sig
        b_d_glu = b_sig + alpha * b_gate_c * b_sig * (1.0 - b_sig)
        b_d_gate = tl.where(b_gate <= limit, (b_up_c + 1.0) * b_d_glu, 0.0)
        b_d_up = tl.where((b_up >= -limit) & (b_up <= limit), b_glu, 0.0)
        return (b_up_c + 1.0) * b_glu, b_d_gate, b_d_up


@triton.jit
def _down_grad_kernel(
    # dout [T, H]: the A rows, read at each assignment's token
    grad_out_ptr, stride_grad_t, stride_grad_h,
    # W_down as [E, F, H] by strides (n = F, K = H)
    w_ptr, stride_w_e, stride_w_n, stride_w_k,
    # quantized (frozen) weights: their scales in this GEMM's orientation (fp8.WeightScale, scale_codes.WeightScaleCode)
    scale_ptr, stride_scale_e, stride_scale_n, stride_scale_k, scale_row_step, scale_up_row_offset, scale_block_n,
    scale_block_k,
    # preact [N, 2F] from the forward; d_preact [N, 2F]; act [N, F]; partials [cdiv(F, BLOCK_N), N] fp32
    preact_ptr, stride_preact_m,
    d_preact_ptr, stride_d_preact_m,
    act_ptr, stride_act_m,
    partial_ptr,
    # dispatch metadata
    tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, gather_idx_ptr,
    topk_weights_ptr, stride_topk_t, stride_topk_k,
    # sizes
    num_tokens, num_rows, n_cols, K, E, max_tiles,
    alpha, limit,
    TOP_K: tl.constexpr,
    ACTIVATION: tl.constexpr,
    STORE_D_PREACT: tl.constexpr,
    STORE_ACT: tl.constexpr,
    STORE_PARTIAL: tl.constexpr,
    PAIRED: tl.constexpr,
    WEIGHT_SCALE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Grid: (max_tiles * cdiv(F, BLOCK_N),). Each program owns rows of one expert tile x BLOCK_N of the F columns.
    preact and d_preact hold gate column f at f and up at F + f, or, PAIRED (an interleaved gate/up weight), at 2f
    and 2f + 1: the order of the weight's 2F rows."""
    expert, offs_m, mask_m, pid_n, offs_n, mask_n = tile_setup(tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
                                                               num_rows, n_cols, E, max_tiles, BLOCK_M, BLOCK_N,
                                                               GROUP_M)
    if expert < 0:
        return
    b_token, b_assignment, mask_m = gathered_rows(gather_idx_ptr, offs_m, mask_m, num_tokens, TOP_K)
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = grad_out_ptr + b_token[:, None].to(tl.int64) * stride_grad_t + offs_k[None, :] * stride_grad_h
    b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # g = dout_t @ W_down[e], before the routing weight
    b_acc, _ = expert_tile_dot(b_acc, b_acc, a_ptrs, mask_m, mask_n, expert, offs_n, offs_k, w_ptr, w_ptr,
                               stride_w_e, stride_w_n, stride_w_k, scale_ptr, stride_scale_e, stride_scale_n,
                               stride_scale_k, scale_row_step, scale_up_row_offset, scale_block_n, scale_block_k, K,
                               stride_grad_h, False, DOT_FP32, DOT_PRECISION, EVEN_K, BLOCK_K, WEIGHT_SCALE)

    b_topk = tl.load(topk_weights_ptr + b_token.to(tl.int64) * stride_topk_t + (b_assignment % TOP_K) * stride_topk_k,
                     mask=mask_m, other=0.0).to(tl.float32)
    rows = offs_m[:, None].to(tl.int64)
    # The epilogue in two column halves: the whole tile's act, act' and both pre-activations at once would not fit
    # the registers (ptxas spills 0.8 KB per thread at 128 x 128 with 8 warps, sm90); a half at a time does.
    b_halves = tl.permute(tl.reshape(b_acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
    b_left, b_right = tl.split(b_halves)
    b_sum = _down_grad_epilogue(b_left, b_topk, rows, mask_m, pid_n * BLOCK_N, n_cols, preact_ptr, stride_preact_m,
                                d_preact_ptr, stride_d_preact_m, act_ptr, stride_act_m, alpha, limit, ACTIVATION,
                                STORE_D_PREACT, STORE_ACT, STORE_PARTIAL, PAIRED, BLOCK_N // 2)
    b_sum += _down_grad_epilogue(b_right, b_topk, rows, mask_m, pid_n * BLOCK_N + BLOCK_N // 2, n_cols, preact_ptr,
                                 stride_preact_m, d_preact_ptr, stride_d_preact_m, act_ptr, stride_act_m, alpha, limit,
                                 ACTIVATION, STORE_D_PREACT, STORE_ACT, STORE_PARTIAL, PAIRED, BLOCK_N // 2)
    if STORE_PARTIAL:
        tl.store(partial_ptr + pid_n.to(tl.int64) * num_rows + offs_m, b_sum, mask=mask_m)


@triton.jit
def _down_grad_epilogue(b_g, b_topk, rows, mask_m, col_start, n_cols, preact_ptr, stride_preact_m, d_preact_ptr,
                        stride_d_preact_m, act_ptr, stride_act_m, alpha, limit, ACTIVATION: tl.constexpr,
                        STORE_D_PREACT: tl.constexpr, STORE_ACT: tl.constexpr, STORE_PARTIAL: tl.constexpr,
                        PAIRED: tl.constexpr, WIDTH: tl.constexpr):
    """One column block of `_down_grad_kernel`'s tile: g [rows, WIDTH] = dout_t @ W_down[e] before the routing weight,
    columns col_start + [0, WIDTH). Recomputes act from preact, stores act and d_preact = w * g * act'(h) (as the
    flags ask) and returns the rows' sums of g * act over these columns (zeros without STORE_PARTIAL). PAIRED:
    gate and up columns alternate in preact and d_preact, read and written as one [rows, 2 WIDTH] tile."""
    offs_n = col_start + tl.arange(0, WIDTH)
    mask_n = offs_n < n_cols
    mask_mn = mask_m[:, None] & mask_n[None, :]
    offs_pair = 2 * col_start + tl.arange(0, 2 * WIDTH)
    mask_pair = mask_m[:, None] & (offs_pair < 2 * n_cols)[None, :]
    if PAIRED:
        b_pairs = tl.load(preact_ptr + rows * stride_preact_m + offs_pair[None, :], mask=mask_pair, other=0.0)
        b_gate, b_up = split_pairs(b_pairs.to(tl.float32))
    else:
        preact_ptrs = preact_ptr + rows * stride_preact_m + offs_n[None, :]
        b_gate = tl.load(preact_ptrs, mask=mask_mn, other=0.0).to(tl.float32)
        b_up = tl.load(preact_ptrs + n_cols, mask=mask_mn, other=0.0).to(tl.float32)
    b_act, b_d_gate, b_d_up = _activation_grad(b_gate, b_up, alpha, limit, ACTIVATION)
    b_sum = tl.zeros_like(b_topk)
    if STORE_PARTIAL:
        b_sum = tl.sum(tl.where(mask_mn, b_g * b_act, 0.0), axis=1)
    if STORE_ACT:  # dW_down[e] = sum_p (w dout_t)^T act_p: the routing weight is in the sorted copy of dout
        tl.store(act_ptr + rows * stride_act_m + offs_n[None, :], b_act.to(act_ptr.dtype.element_ty), mask=mask_mn)
    if STORE_D_PREACT:
        b_d_act = b_g * b_topk[:, None]
        if PAIRED:
            b_d_pairs = tl.reshape(tl.join(b_d_act * b_d_gate, b_d_act * b_d_up), (b_g.shape[0], 2 * WIDTH))
            tl.store(d_preact_ptr + rows * stride_d_preact_m + offs_pair[None, :],
                     b_d_pairs.to(d_preact_ptr.dtype.element_ty), mask=mask_pair)
        else:
            d_preact_ptrs = d_preact_ptr + rows * stride_d_preact_m + offs_n[None, :]
            tl.store(d_preact_ptrs, (b_d_act * b_d_gate).to(d_preact_ptr.dtype.element_ty), mask=mask_mn)
            tl.store(d_preact_ptrs + n_cols, (b_d_act * b_d_up).to(d_preact_ptr.dtype.element_ty), mask=mask_mn)
    return b_sum


@triton.jit
def _gate_up_grad_kernel(
    # d_preact [N, 2F] in the order of the gate/up weight's 2F rows (gate then up, or alternating)
    d_preact_ptr, stride_d_preact_m,
    # the whole gate/up weight as [E, H, 2F] by strides (n = H, K = 2F); SEPARATE: W_gate and W_up as [E, H, F], one
    # set of strides for both (d_preact's gate columns [0, F), up columns [F, 2F))
    w_gate_ptr, w_up_ptr, stride_w_e, stride_w_n, stride_w_k,
    # quantized (frozen) weights: their scales in this GEMM's orientation (fp8.WeightScale, scale_codes.WeightScaleCode)
    scale_ptr, stride_scale_e, stride_scale_n, stride_scale_k, scale_row_step, scale_up_row_offset, scale_block_n,
    scale_block_k,
    # dx rows [N, H] in sorted order
    out_ptr, stride_out_m,
    tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
    num_rows, n_cols, K, E, max_tiles,
    SEPARATE: tl.constexpr,
    WEIGHT_SCALE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Grid: (max_tiles * cdiv(H, BLOCK_N),). out[p] = d_preact[p] @ W_gate_up[e] (= d_gate[p] @ W_gate[e] +
    d_up[p] @ W_up[e]) for one tile: one K loop over the 2F columns (K = 2F), or two over F with SEPARATE (K = F)."""
    expert, offs_m, mask_m, pid_n, offs_n, mask_n = tile_setup(tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
                                                               num_rows, n_cols, E, max_tiles, BLOCK_M, BLOCK_N,
                                                               GROUP_M)
    if expert < 0:
        return
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.where(mask_m, offs_m, 0)[:, None].to(tl.int64)

    a_ptrs = d_preact_ptr + rows * stride_d_preact_m + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_acc, _ = expert_tile_dot(b_acc, b_acc, a_ptrs, mask_m, mask_n, expert, offs_n, offs_k, w_gate_ptr, w_gate_ptr,
                               stride_w_e, stride_w_n, stride_w_k, scale_ptr, stride_scale_e, stride_scale_n,
                               stride_scale_k, scale_row_step, scale_up_row_offset, scale_block_n, scale_block_k, K, 1,
                               False, DOT_FP32, DOT_PRECISION, EVEN_K, BLOCK_K, WEIGHT_SCALE)
    if SEPARATE:  # float weights only
        w_offs = expert.to(tl.int64) * stride_w_e + offs_n[None, :] * stride_w_n + offs_k[:, None] * stride_w_k
        b_acc, _ = tile_dot(b_acc, b_acc, a_ptrs + K, w_up_ptr + w_offs, w_up_ptr + w_offs, mask_m, mask_n, K, 1,
                             stride_w_k, False, DOT_FP32, DOT_PRECISION, EVEN_K, BLOCK_K)
    tl.store(out_ptr + rows * stride_out_m + offs_n[None, :], b_acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _topk_weights_grad_kernel(
    partial_ptr, num_partials, scatter_idx_ptr,
    grad_out_ptr, stride_grad_t, stride_grad_h,
    down_bias_ptr, stride_bias_e, stride_bias_h,
    topk_ids_ptr, stride_ids_t, stride_ids_k,
    out_ptr, stride_out_t, stride_out_k,
    num_assignments, H,
    TOP_K: tl.constexpr,
    HAS_DOWN_BIAS: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Grid: (cdiv(N, BLOCK_A),). dw[a] = sum over column tiles n, in order, of partial[n, scatter_idx[a]]
    (+ dout_t . b_down[e]); 0 for dropped assignments."""
    offs_a = tl.program_id(0) * BLOCK_A + tl.arange(0, BLOCK_A)
    mask_a = offs_a < num_assignments
    b_pos = tl.load(scatter_idx_ptr + offs_a, mask=mask_a, other=-1)
    b_kept = mask_a & (b_pos >= 0) & (b_pos < num_assignments)
    b_pos = tl.where(b_kept, b_pos, 0).to(tl.int64)
    b_acc = tl.zeros((BLOCK_A,), dtype=tl.float32)
    for n in range(0, num_partials):
        b_acc += tl.load(partial_ptr + n * num_assignments + b_pos, mask=b_kept, other=0.0)
    offs_t = (offs_a // TOP_K).to(tl.int64)
    offs_j = offs_a % TOP_K
    if HAS_DOWN_BIAS:
        b_expert = tl.load(topk_ids_ptr + offs_t * stride_ids_t + offs_j * stride_ids_k, mask=b_kept, other=0)
        offs_h = tl.arange(0, BLOCK_H)
        for h0 in range(0, H, BLOCK_H):
            mask_ah = b_kept[:, None] & (h0 + offs_h < H)[None, :]
            b_grad = tl.load(grad_out_ptr + offs_t[:, None] * stride_grad_t + (h0 + offs_h)[None, :] * stride_grad_h,
                             mask=mask_ah, other=0.0).to(tl.float32)
            b_bias = tl.load(down_bias_ptr + b_expert[:, None].to(tl.int64) * stride_bias_e
                             + (h0 + offs_h)[None, :] * stride_bias_h, mask=mask_ah, other=0.0).to(tl.float32)
            b_acc += tl.sum(b_grad * b_bias, axis=1)
    tl.store(out_ptr + offs_t * stride_out_t + offs_j * stride_out_k,
             tl.where(b_kept, b_acc, 0.0).to(out_ptr.dtype.element_ty), mask=mask_a)


# The dX GEMM on quantized (frozen) weights decodes each [BLOCK_K, BLOCK_N] weight tile in registers before its dot:
# at the bf16 dX tile's 256 columns (8 warps) that spills on sm_90 (block FP8 8 bytes, MXFP4 296 bytes a thread; the
# compile report), at 128 it does not (171 and 203 registers). Chosen by that check, not timed: the quantized
# backward's tiles are not tuned (docs/performance.md, "Frozen quantized experts").
DEQUANT_DX_MAX_BLOCK_N = 128


def _dequant_dx_tile(tile):
    """The dX GEMM's tile for quantized weights: BLOCK_N at most DEQUANT_DX_MAX_BLOCK_N."""
    return dataclasses.replace(tile, block_n=min(tile.block_n, DEQUANT_DX_MAX_BLOCK_N))


def _mxfp4_n_tile(tile):
    """A GEMM tile whose columns cover whole MXFP4 scale groups (BLOCK_N >= 32; tiles' BLOCK_N are powers of two)."""
    return dataclasses.replace(tile, block_n=max(tile.block_n, MXFP4_GROUP))


@dataclasses.dataclass(frozen=True)
class ExpertsGrads:
    """Output buffers of one backward; None where no gradient was asked for. Weight-shaped buffers have the layout
    of the weights the forward read (`transposed`). A field may also hold a function of no arguments that allocates
    the buffer (`deferred`): `experts_backward` then calls it right before the first launch that writes it, so the
    weight gradients are allocated after the activated rows are freed, and returns the buffers it filled."""

    x: torch.Tensor | None  # [T, H]
    w_gate_up: torch.Tensor | None  # [E, 2F, H] (or [E, H, 2F]); with separate up weights the gate's [E, F, H]
    w_up: torch.Tensor | None  # separate up weights only: [E, F, H] (or [E, H, F])
    w_down: torch.Tensor | None  # [E, H, F] (or [E, F, H])
    topk_weights: torch.Tensor | None  # [T, top_k]
    gate_up_bias: torch.Tensor | None  # [E, 2F], in the order of the gate/up weight's 2F rows
    down_bias: torch.Tensor | None  # [E, H]


def deferred(like: torch.Tensor):
    """An `ExpertsGrads` field allocating a buffer like `like` (shape, dtype, device) when the backward first needs it."""
    return lambda: torch.empty(like.shape, dtype=like.dtype, device=like.device)


def _materialized(grads: ExpertsGrads, name: str) -> ExpertsGrads:
    """`grads` with field `name` allocated (a no-op for a tensor or None)."""
    value = getattr(grads, name)
    if value is None or isinstance(value, torch.Tensor):
        return grads
    return dataclasses.replace(grads, **{name: value()})


def experts_backward(grad_out, x, w_gate_up, w_up, w_down, topk_ids, topk_weights, down_bias, preact, expert_offsets,
                     gather_idx, scatter_idx, grads: ExpertsGrads, *, activation, transposed, interleaved=False, alpha,
                     limit, tiles: MoeTiles | None = None, weight_tile: WeightGradTile | None = None,
                     reuse_preact: bool = False, gate_up_scale: WeightScale | None = None,
                     down_scale: WeightScale | None = None):
    """Fill `grads` from grad_out [T, H]. `w_gate_up` is the forward's whole gate/up weight [E, 2F, H] ([E, H, 2F]
    when `transposed`), gate rows then up rows or, `interleaved`, alternating (gate first); with `w_up` (separate
    up weights, never interleaved) it is the gate weight alone [E, F, H]. `preact` [N, 2F] holds the pre-activations
    in the order of the 2F rows (the forward's), and the dispatch tensors are the forward's (see `moe.fused_experts`).
    `tiles` (the input-gradient GEMMs: gate_up's for dA, down's for dX) and `weight_tile` force launch
    configurations (tuning, tests); by default planner.plan_backward chooses. `reuse_preact`: d_preact is written
    over `preact` (same shape and dtype; each program of `_down_grad_kernel` reads the elements of its own tile
    before it writes them, and nothing reads preact after that kernel), which saves one [N, 2F] buffer; the caller
    must never read `preact` again. Returns `grads` with every deferred buffer allocated.

    Launch order, for the peak memory: the pre-activations' gradient and the activated rows, the routing weights'
    gradient, dW_down (the last reader of the activated rows, which are freed after it), dX, then dW_gate_up: the
    largest weight gradient is allocated while neither the activated rows [N, F] nor the partial sums are live."""
    separate = w_up is not None
    paired = interleaved and not separate
    T, H = x.shape
    E = w_down.shape[0]
    top_k = topk_ids.shape[1]
    F = preact.shape[1] // 2
    N = T * top_k
    grad_out = grad_out if grad_out.stride(1) == 1 else grad_out.contiguous()
    needs_d_preact = any(g is not None for g in (grads.x, grads.w_gate_up, grads.w_up, grads.gate_up_bias))
    needs_act = grads.w_down is not None
    needs_partial = grads.topk_weights is not None
    plan = plan_backward(x.device, T, top_k, E, F, H, x.dtype, tiles=tiles, weight_tile=weight_tile)
    tiles, weight_tile = plan.tiles, plan.weight_tile
    # Quantized weights (frozen: no weight gradient) are dequantized in the dX and dA GEMMs' loads; MXFP4 read along
    # its packed axis needs whole scale groups per column tile
    gate_up_ws, down_ws = gate_up_scale or NO_SCALE, down_scale or NO_SCALE
    if WeightScaleCode.MXFP4_N in (gate_up_ws.code, down_ws.code):
        tiles = dataclasses.replace(tiles, gate_up=_mxfp4_n_tile(tiles.gate_up), down=_mxfp4_n_tile(tiles.down))
    if gate_up_ws.code != WeightScaleCode.NONE:
        tiles = dataclasses.replace(tiles, down=_dequant_dx_tile(tiles.down))
    info = dataclasses.replace(segment_dispatch(expert_offsets, N, E, tiles.block_m, gather_idx=gather_idx,
                                                top_k=top_k), scatter_idx=scatter_idx)
    device = x.device

    reuse_preact = reuse_preact and preact.dtype == x.dtype and preact.is_contiguous()
    if needs_d_preact:
        d_preact = preact if reuse_preact else torch.empty((N, 2 * F), device=device, dtype=x.dtype)
    else:
        d_preact = None
    act = torch.empty((N, F), device=device, dtype=x.dtype) if needs_act else None
    tile = tiles.gate_up
    n_partials = cdiv(F, tile.block_n)
    partial = torch.empty((n_partials, N), device=device, dtype=torch.float32) if needs_partial else None
    if N and F and info.max_tiles and (needs_d_preact or needs_act or needs_partial):
        dot_fp32, precision = dot_options(x.dtype)
        down_code, down_block_k = dequant_scale_code(down_ws, tile.block_k)
        launch(_down_grad_kernel, (info.max_tiles * n_partials,),
            grad_out, grad_out.stride(0), grad_out.stride(1),
            w_down, *weight_strides(w_down, not transposed), *scale_args(down_ws),
            preact, preact.stride(0),
            d_preact, d_preact.stride(0) if needs_d_preact else 0,
            act, act.stride(0) if needs_act else 0,
            partial,
            info.tile_expert, info.tile_row_start, info.expert_offsets, info.gather_idx,
            topk_weights, topk_weights.stride(0), topk_weights.stride(1),
            T, N, F, H, E, info.max_tiles,
            float(alpha), float(limit),
            TOP_K=top_k,
            ACTIVATION=int(Activation.of(activation)),
            STORE_D_PREACT=needs_d_preact,
            STORE_ACT=needs_act,
            STORE_PARTIAL=needs_partial,
            PAIRED=paired,
            WEIGHT_SCALE=int(down_code),
            DOT_FP32=dot_fp32,
            DOT_PRECISION=precision,
            EVEN_K=H % down_block_k == 0,
            BLOCK_M=info.block_m, BLOCK_N=tile.block_n, BLOCK_K=down_block_k, GROUP_M=tile.group_m,
            num_warps=tile.num_warps, num_stages=tile.num_stages,
        )
    elif needs_d_preact:  # nothing kept (or F = 0): every gradient through the experts is zero
        d_preact.zero_()
        if needs_act:
            act.zero_()

    grads = _materialized(grads, "topk_weights")
    if grads.topk_weights is not None and N:
        launch(_topk_weights_grad_kernel, (cdiv(N, 64),),
            partial, n_partials if F and info.max_tiles else 0, scatter_idx,
            grad_out, grad_out.stride(0), grad_out.stride(1),
            down_bias, *(down_bias.stride() if down_bias is not None else (0, 0)),
            topk_ids, topk_ids.stride(0), topk_ids.stride(1),
            grads.topk_weights, grads.topk_weights.stride(0), grads.topk_weights.stride(1),
            N, H,
            TOP_K=top_k, HAS_DOWN_BIAS=down_bias is not None, BLOCK_A=64, BLOCK_H=64,
        )

    partial = None  # read by the routing weights' gradient alone

    needs_w_gate_up = grads.w_gate_up is not None or grads.w_up is not None
    rows = None  # [N, H]: the sorted copy of w * dout, then dX's rows, then the sorted copy of x
    if grads.x is not None or needs_w_gate_up or grads.w_down is not None:
        rows = torch.empty((N, H), device=device, dtype=x.dtype)
    layout = Layout(PLAIN.value, top_k)

    # dW_down[e] = (w * dout[token])^T act over the expert's rows, in the weight's own layout; act is freed after it
    grads = _materialized(_materialized(grads, "w_down"), "down_bias")
    if grads.w_down is not None:
        dout_rows = launch_gather(grad_out.contiguous(), info.gather_idx, topk_weights.contiguous(), None, None,
                                  layout, N, out=rows)  # w * dout[token] in sorted order
        _weight_grad(dout_rows, act, grads.w_down.transpose(1, 2) if transposed else grads.w_down, grads.down_bias,
                     info, topk_weights, weight_tile)
    elif grads.down_bias is not None:
        _weight_grad(grad_out, grad_out[:, :1], torch.empty((E, H, 1), device=device, dtype=torch.float32),
                     grads.down_bias, info, topk_weights, weight_tile, gather_left=True, gather_right=True,
                     weight_bias=True, bias_only=True)
    act = None

    grads = _materialized(grads, "x")
    if grads.x is not None:
        tile = tiles.down
        if N and H and info.max_tiles:
            w_gate_v, w_up_v = same_strides(w_gate_up, w_up) if separate else (w_gate_up, w_gate_up)
            k_size = F if separate else 2 * F
            dot_fp32, precision = dot_options(x.dtype)
            gate_up_code, gate_up_block_k = dequant_scale_code(gate_up_ws, tile.block_k)
            launch(_gate_up_grad_kernel, (info.max_tiles * cdiv(H, tile.block_n),),
                d_preact, d_preact.stride(0),
                w_gate_v, w_up_v, *weight_strides(w_gate_v, not transposed), *scale_args(gate_up_ws),
                rows, rows.stride(0),
                info.tile_expert, info.tile_row_start, info.expert_offsets,
                N, H, k_size, E, info.max_tiles,
                SEPARATE=separate,
                WEIGHT_SCALE=int(gate_up_code),
                DOT_FP32=dot_fp32,
                DOT_PRECISION=precision,
                EVEN_K=k_size % gate_up_block_k == 0,
                BLOCK_M=info.block_m, BLOCK_N=tile.block_n, BLOCK_K=gate_up_block_k, GROUP_M=tile.group_m,
                num_warps=tile.num_warps, num_stages=tile.num_stages,
            )
        combine(rows, scatter_idx, T, top_k, out=grads.x)

    # Weight gradients in the weights' own layout: [E, 2F, H] is (i = row of the 2F, j = h), one GEMM over d_preact's
    # 2F columns (their order is the rows'); transposed [E, H, 2F] is its transpose. Separate up weights: one GEMM per
    # half. A bias gradient without its weight's runs the pointer kernel's BIAS_ONLY loop (out a one-column stand-in,
    # left unwritten).
    grads = _materialized(_materialized(_materialized(grads, "w_gate_up"), "w_up"), "gate_up_bias")
    if needs_w_gate_up:
        x_rows = launch_gather(x.contiguous(), info.gather_idx, None, None, None, layout, N, out=rows)
    d_bias = grads.gate_up_bias
    if separate:
        d_biases = (d_bias[:, :F], d_bias[:, F:]) if d_bias is not None else (None, None)
        parts = ((grads.w_gate_up, d_biases[0], d_preact[:, :F] if needs_d_preact else None),
                 (grads.w_up, d_biases[1], d_preact[:, F:] if needs_d_preact else None))
    else:
        parts = ((grads.w_gate_up, d_bias, d_preact),)
    for d_w, d_b, left in parts:
        if d_w is None and d_b is None:
            continue
        if d_w is not None:
            out, right, gather_right = (d_w.transpose(1, 2) if transposed else d_w), x_rows, False
        else:
            out, right, gather_right = (torch.empty((E, left.shape[1], 1), device=device, dtype=torch.float32),
                                        x[:, :1], True)
        _weight_grad(left, right, out, d_b, info, topk_weights, weight_tile, gather_right=gather_right,
                     bias_only=d_w is None)
    return grads
