"""The w8a8 grouped GEMM as a persistent kernel fed by tensor descriptors (TMA on Hopper): the FP8 prefill variant.

`_w8a8_gemm_kernel` (gemm/w8a8.py) launches one program per output tile and loads both float8 operands through
pointers; on an H200 it stays at 345-615 TFLOP/s at prefill sizes, about what the bf16 path reaches, where FP8 tensor
cores have twice the rate. This kernel is to it what gemm/persistent.py's is to the bf16 pointer kernel: one program
per SM walks the output tiles in grouped order, and both operands arrive as descriptor tiles:

- A: float8 rows in expert-sorted order [num_a_rows, K] (Hopper's TMA has no row gather, so GEMM1's rows are
  gathered and quantized by one pass first, `gemm.w8a8.quantize_fp8_rows(..., info=...)`; GEMM2's A is the
  intermediate GEMM1 wrote, already sorted). A tile's [BLOCK_M, BLOCK_K] box starts at its first row; rows of the next
  expert it reaches are computed and never stored (the epilogue's row mask), rows past the end read the zero fill.
- Weights: [BLOCK_N, BLOCK_K] tiles of the expert-stacked [E, n, K] float8 weight through gemm/persistent.py's
  `weight_descriptors` (expert e's row j is descriptor row e * rows_per_expert + j; see gemm/persistent.py).
- Gate and up paired (PAIRING, `pair_descriptor`): where the gate and up views are two halves of one [E, 2F, K]
  weight (concatenated or interleaved rows), one 3-D descriptor tile brings the BLOCK_N gate rows and the BLOCK_N up
  rows of the output tile together as one [2 BLOCK_N, BLOCK_K] operand, and each K step is one dot of N = 2 BLOCK_N
  (one wait for the tensor cores and one scale multiply per K step instead of two of half the width: on an H200 the
  scale multiply after each dot is what holds the FP8 loop at ~820 TFLOP/s against ~1150 without scales; see
  docs/versions.md, v16). The accumulator's gate and up columns are split for the epilogue.
- Per K step (= the activation group): acc += (A_fp8 @ W_fp8^T) * a_scale[row] (* the weight's block scale of that
  K step), exactly `_w8a8_gemm_kernel`'s `scaled_dot`; channel / tensor weight scales, static activation scales,
  bias, activation, routing weight and the (quantizing) store are the shared `w8a8_epilogue`. So the two kernels give
  the same e4m3 intermediate and the same output up to fp32 summation order.

A per-expert static input scale of GEMM1 keeps the pointer kernel for GEMM1 (the pass does not know the rows' experts
to divide them by their scale); GEMM2 runs here with static scales of either kind.
"""

import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..formats.fp8 import W8A8_DTYPE, WeightScale, fp8_max
from ..host.device import TMA_ALIGN
from ..host.host_math import cdiv
from ..host.pdl import wait_for_producer
from ..host.replay import launch
from .args import GemmWeights, routing_args, scale_args
from .jit import ACT_NONE, SCALE_BLOCK, scale_values, tile_coords, tile_rows, tile_setup_at
from .persistent import num_programs, weight_descriptors
from .w8a8_jit import A_FP8_GROUPS, A_FP8_STATIC, block_scale_offsets, load_block_scale, scaled_dot, w8a8_epilogue

PAIR_NONE = tl.constexpr(0)  # gate and up through their own descriptors, two dots per K step (or not gated)
PAIR_CONCAT = tl.constexpr(1)  # [E, 2F, K] gate rows then up rows: a [2, BLOCK_N, BLOCK_K] tile of a [2E, F, K] view
PAIR_INTERLEAVED = tl.constexpr(2)  # rows alternate gate, up: a [BLOCK_N, 2, BLOCK_K] tile of an [E * R, 2, K] view


@triton.jit
def a_step(a_desc, a_s_ptrs, row_start, k0, mask_m, A_QUANT: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K step at k0 of A: (its [BLOCK_M, BLOCK_K] e4m3 tile, its rows' scales [BLOCK_M] with A_QUANT FP8_GROUPS,
    else 1.0: a static scale multiplies after the loop)."""
    b_a = a_desc.load([row_start, k0])
    if A_QUANT == A_FP8_GROUPS:
        b_a_s = tl.load(a_s_ptrs + k0 // BLOCK_K, mask=mask_m, other=0.0)
    else:
        b_a_s = 1.0
    return b_a, b_a_s


@triton.jit
def paired_block_scale(s_step, s_offs, s_up_offs, mask_n, WEIGHT_SCALE: tl.constexpr, UNIFORM: tl.constexpr,
                       PAIRING: tl.constexpr, BLOCK_N: tl.constexpr):
    """This K step's block scales of a paired tile's 2 BLOCK_N columns, [1, 2 BLOCK_N] in the paired operand's
    column order (gate block then up block, or alternating), or 1.0 for other schemes."""
    if WEIGHT_SCALE != SCALE_BLOCK:
        b_scale = 1.0
    elif UNIFORM:
        offs_pair = tl.arange(0, 2 * BLOCK_N)
        if PAIRING == PAIR_CONCAT:
            is_gate = offs_pair < BLOCK_N
        else:
            is_gate = offs_pair % 2 == 0
        b_scale = tl.where(is_gate, scale_values(tl.load(s_step + s_offs)),
                           scale_values(tl.load(s_step + s_up_offs)))[None, :]
    else:
        b_pair = tl.join(scale_values(tl.load(s_step + s_offs, mask=mask_n, other=0)),
                         scale_values(tl.load(s_step + s_up_offs, mask=mask_n, other=0)))  # [BLOCK_N, 2]
        if PAIRING == PAIR_CONCAT:
            b_pair = tl.permute(b_pair, (1, 0))
        b_scale = tl.reshape(b_pair, (2 * BLOCK_N,))[None, :]
    return b_scale


@triton.jit
def split_pair(b_acc, PAIRING: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_M, 2 BLOCK_N] sums of a paired tile -> (gate [BLOCK_M, BLOCK_N], up [BLOCK_M, BLOCK_N])."""
    if PAIRING == PAIR_CONCAT:
        b_acc = tl.permute(tl.reshape(b_acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1))
    else:
        b_acc = tl.reshape(b_acc, (BLOCK_M, BLOCK_N, 2))
    return tl.split(b_acc)



@triton.jit
def _persistent_w8a8_gemm_kernel(
    # A: float8 rows in sorted order [num_a_rows, K] as [BLOCK_M, BLOCK_K] descriptor tiles; A_QUANT FP8_GROUPS:
    # scales [num_a_rows, cdiv(K, BLOCK_K)], one per row and K step; FP8_STATIC: a static scale per expert (stride_e
    # 0: one)
    a_desc, num_a_rows,
    a_scale_ptr, stride_a_scale_e, stride_a_scale_m,
    # weights: descriptors of [BLOCK_N, BLOCK_K] tiles, expert e's row j at descriptor row e * w_rows_per_expert + j;
    # PAIRING: w_pair_desc, gate and up rows together (`pair_descriptor`; PAIR_INTERLEAVED: expert e's pair j at
    # descriptor row e * w_rows_per_expert + j)
    w_desc, w_up_desc, w_pair_desc, w_rows_per_expert,
    bias_ptr, bias_up_ptr, stride_bias_e, stride_bias_n,
    # weight scales (fp8.WeightScale), as in `_w8a8_gemm_kernel`
    scale_ptr, stride_scale_e, stride_scale_n, stride_scale_k, scale_row_step, scale_up_row_offset,
    scale_block_n, scale_block_k,
    # C: [num_rows, n_cols] in sorted order; QUANT_OUT DYNAMIC / STATIC: float8 with its scales, as in
    # `_w8a8_gemm_kernel`
    c_ptr, stride_c_m, stride_c_n, num_rows,
    c_scale_ptr, stride_c_scale_e, stride_c_scale_m,
    # dispatch metadata
    tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, gather_idx_ptr,
    topk_weights_ptr, stride_topk_t, stride_topk_k, num_tokens,
    # sizes
    n_cols, K, E, max_tiles,
    alpha, limit, fp8_max,
    TOP_K: tl.constexpr,
    A_QUANT: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    WEIGHT_SCALE: tl.constexpr,
    SCALE_UNIFORM: tl.constexpr,
    QUANT_OUT: tl.constexpr,
    OUT_GROUP: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
    PAIRING: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid: (NUM_PROGRAMS,). Program p computes output tiles p, p + NUM_PROGRAMS, ... of the
    max_tiles * cdiv(n_cols, BLOCK_N) tiles (in tile_coords' grouped order); sentinel tiles are skipped. K past the
    end reads the descriptors' zero fill in both operands, so the K loop needs no masks."""
    wait_for_producer(PDL)
    num_tiles = max_tiles * tl.cdiv(n_cols, BLOCK_N)
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
        expert, offs_m, mask_m, pid_n, offs_n, mask_n = tile_setup_at(
            tile_id, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, num_rows, n_cols, E, max_tiles,
            BLOCK_M, BLOCK_N, GROUP_M)
        if expert >= 0:
            a_rows = tl.where(mask_m & (offs_m < num_a_rows), offs_m, 0)  # A is sorted: row p is sorted position p
            pid_m, _ = tile_coords(tile_id, n_cols, max_tiles, BLOCK_N, GROUP_M)
            row_start = tl.load(tile_row_start_ptr + pid_m)
            w_row = expert * w_rows_per_expert + pid_n * BLOCK_N
            a_s_ptrs = a_scale_ptr + a_rows.to(tl.int64) * stride_a_scale_m  # [BLOCK_M]: FP8_GROUPS' first group
            a_static = 1.0
            if A_QUANT == A_FP8_STATIC:
                a_static = tl.load(a_scale_ptr + expert * stride_a_scale_e)
            s_base = scale_ptr + expert.to(tl.int64) * stride_scale_e
            s_offs = block_scale_offsets(pid_n, offs_n, scale_row_step, 0, stride_scale_n, scale_block_n,
                                         SCALE_UNIFORM, BLOCK_N)
            s_up_offs = block_scale_offsets(pid_n, offs_n, scale_row_step, scale_up_row_offset, stride_scale_n,
                                            scale_block_n, SCALE_UNIFORM, BLOCK_N)
            if PAIRING != PAIR_NONE:
                b_pair = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    b_a, b_a_s = a_step(a_desc, a_s_ptrs, row_start, k0, mask_m, A_QUANT, BLOCK_K)
                    b_w_s = paired_block_scale(s_base + (k0 // scale_block_k) * stride_scale_k, s_offs, s_up_offs,
                                               mask_n, WEIGHT_SCALE, SCALE_UNIFORM, PAIRING, BLOCK_N)
                    if PAIRING == PAIR_CONCAT:
                        b_w = w_pair_desc.load([2 * expert, pid_n * BLOCK_N, k0])  # [2, BLOCK_N, BLOCK_K]
                    else:
                        b_w = w_pair_desc.load([expert * w_rows_per_expert + pid_n * BLOCK_N, 0, k0])
                    b_w = tl.reshape(b_w, (2 * BLOCK_N, BLOCK_K))
                    b_pair = scaled_dot(b_pair, b_a, b_w.T, b_a_s, b_w_s, A_QUANT == A_FP8_GROUPS,
                                        WEIGHT_SCALE == SCALE_BLOCK, BLOCK_K, ROUND_IN_FP32, False)
                b_acc, b_acc_up = split_pair(b_pair, PAIRING, BLOCK_M, BLOCK_N)
            else:
                b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                b_acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    b_a, b_a_s = a_step(a_desc, a_s_ptrs, row_start, k0, mask_m, A_QUANT, BLOCK_K)
                    # the K step lies inside one weight block: BLOCK_K divides scale_block_k (gemm.w8a8._group)
                    s_step = s_base + (k0 // scale_block_k) * stride_scale_k
                    b_w_s = load_block_scale(s_step, s_offs, mask_n, WEIGHT_SCALE, SCALE_UNIFORM, False)
                    b_w = w_desc.load([w_row, k0])  # [BLOCK_N, BLOCK_K] e4m3, K-major as FP8 wgmma wants it
                    b_acc = scaled_dot(b_acc, b_a, b_w.T, b_a_s, b_w_s, A_QUANT == A_FP8_GROUPS,
                                       WEIGHT_SCALE == SCALE_BLOCK, BLOCK_K, ROUND_IN_FP32, False)
                    if ACTIVATION != ACT_NONE:
                        b_wu_s = load_block_scale(s_step, s_up_offs, mask_n, WEIGHT_SCALE, SCALE_UNIFORM, False)
                        b_wu = w_up_desc.load([w_row, k0])
                        b_acc_up = scaled_dot(b_acc_up, b_a, b_wu.T, b_a_s, b_wu_s, A_QUANT == A_FP8_GROUPS,
                                              WEIGHT_SCALE == SCALE_BLOCK, BLOCK_K, ROUND_IN_FP32, False)
            # The assignments (routing weights) only now: live through the K loop they cost GEMM2's 128 x 128 tile
            # ~130 bytes of register spills (ptxas, sm_90).
            _, b_assignment, mask_m = tile_rows(offs_m, mask_m, gather_idx_ptr, num_tokens, num_a_rows, TOP_K, False,
                                                MUL_ROUTED_WEIGHT)
            w8a8_epilogue(b_acc, b_acc_up, expert, offs_m, mask_m, pid_n, offs_n, mask_n, b_assignment, a_static,
                          s_base, stride_scale_n, scale_row_step, scale_up_row_offset, bias_ptr, bias_up_ptr,
                          stride_bias_e, stride_bias_n, c_ptr, stride_c_m, stride_c_n, c_scale_ptr, stride_c_scale_e,
                          stride_c_scale_m, n_cols, topk_weights_ptr, stride_topk_t, stride_topk_k, alpha, limit,
                          fp8_max, TOP_K, ACTIVATION, HAS_BIAS, MUL_ROUTED_WEIGHT, A_QUANT, WEIGHT_SCALE, QUANT_OUT,
                          OUT_GROUP, ROUND_IN_FP32, BLOCK_M, BLOCK_N)


def pair_descriptor(w: GemmWeights, K, tile):
    """(PAIRING, descriptor) for a gated weight whose gate and up views are halves of one [E, 2F, K] tensor (strides
    (stride_e, stride_n, 1), the up view `up` elements after the gate view), else (PAIR_NONE, None):
    - concatenated rows (up = F * stride_n, stride_e = 2 up): the [2E, F, K] view, strides (up, stride_n, 1), tiles
      [2, BLOCK_N, BLOCK_K] at (2e, n0, k0); rows past F read the descriptor's zero fill;
    - interleaved rows (stride_n = 2 up): the [E * R, 2, K] view (R = stride_e / stride_n, expert e's pair j at row
      e * R + j), strides (stride_n, up, 1), tiles [BLOCK_N, 2, BLOCK_K] at (e * R + n0, 0, k0); pairs past F are the
      next expert's (masked at the store), past the last expert the zero fill."""
    if not w.gated or w.weight_up.dtype != W8A8_DTYPE:
        return PAIR_NONE.value, None
    stride_e, stride_n, stride_k = w.strides
    up = w.weight_up.data_ptr() - w.weight.data_ptr()  # bytes = elements (float8)
    E, F = w.weight.shape[0], w.n_cols
    if stride_k != 1 or up <= 0 or up % TMA_ALIGN or stride_n % TMA_ALIGN:
        return PAIR_NONE.value, None
    if up == F * stride_n and stride_e == 2 * up:
        return PAIR_CONCAT.value, TensorDescriptor(w.weight, [2 * E, F, K], [up, stride_n, 1],
                                                   [2, tile.block_n, tile.block_k])
    if stride_n == 2 * up and stride_e % stride_n == 0:
        rows = (E - 1) * (stride_e // stride_n) + F
        return PAIR_INTERLEAVED.value, TensorDescriptor(w.weight, [rows, 2, K], [stride_n, up, 1],
                                                        [tile.block_n, 2, tile.block_k])
    return PAIR_NONE.value, None


def persistent_w8a8_gemm(a, a_scale_args, w: GemmWeights, ws: WeightScale, c, c_scale_args, info, topk_weights, alpha,
                         limit, tile, meta):
    """Launch `_persistent_w8a8_gemm_kernel` for `gemm.w8a8.w8a8_gemm`, which runs it where planner.w8a8_gemm_kernel
    chose it and prepared the scale arguments (a_scale_args: ptr, stride_e, stride_m; c_scale_args likewise) and the
    constexprs `meta`. Fills c (and the output scales in c_scale_args)."""
    K = a.shape[1]
    w_desc, w_up_desc, rows_per_expert = weight_descriptors(w, K, tile)
    pairing, w_pair_desc = pair_descriptor(w, K, tile)
    a_desc = TensorDescriptor(a, [a.shape[0], K], [a.stride(0), 1], [info.block_m, tile.block_k])
    programs = num_programs(a.device, info.max_tiles * cdiv(w.n_cols, tile.block_n))
    launch(_persistent_w8a8_gemm_kernel, (programs,),
        a_desc, a.shape[0],
        *a_scale_args,
        w_desc, w_up_desc, w_pair_desc if w_pair_desc is not None else w_desc, rows_per_expert,
        *w.bias_args(), *scale_args(ws),
        c, c.stride(0), c.stride(1), c.shape[0],
        *c_scale_args,
        *routing_args(info, topk_weights),
        w.n_cols, K, info.num_experts, info.max_tiles,
        float(alpha), float(limit), fp8_max(W8A8_DTYPE),
        NUM_PROGRAMS=programs,
        PAIRING=pairing,
        **meta,
    )
    return c
