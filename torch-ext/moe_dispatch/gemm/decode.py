"""The decode path of the experts forward: two launches, no sort, no dispatch metadata.

At a few tokens the four launches of the general path (dispatch, GEMM1, GEMM2, combine) cost more in launch latency
and round trips through memory than the arithmetic they order. Here the assignments stay in their given order
(a = t * top_k + j, N = T * top_k of them):

  _decode_gate_up_kernel  one program per (assignment, F tile), in one of two forms (constexpr GEMV). The dot form:
                          the program of the FIRST assignment naming an expert owns that expert, the others exit. It
                          multiplies all T rows of x (read densely) by the expert's gate and up tiles, applies the
                          activation, and stores the rows of the tokens that picked the expert into
                          intermediate[t * top_k + j] (both slots when a token lists it twice). Each expert hit is
                          streamed from memory exactly once. The GEMV form, where the tile table says `gemv`
                          (DecodeTile.gemv): every program works, whatever its expert, as a GEMV over the tile's gate
                          and up rows together (`rows_gemv`). MXFP4 bytes go from memory to registers 16 at a time and
                          are multiplied there: no 16-row padded MMA and no trip through shared memory into the MMA
                          operand layout.
  _decode_down_kernel     one program per (assignment, H tile): the GEMV intermediate[t * top_k + j] @ W_down[e]^T
                          (+ down bias) times topk_weights[t, j] in fp32, written to a partial row; the last of a
                          token's top_k programs to arrive (an atomic counter per (token, H tile)) sums the top_k
                          partial rows in the order j = 0..top_k-1 and stores the token's output tile once. The sum's
                          order does not depend on which program arrives last: reruns are bit-identical. One program
                          per assignment rather than per token keeps top_k times more weight loads in flight, which
                          is what a weight-bound GEMV at a few tokens needs to cover the GPU.
  _decode_down_dot_kernel the down kernel where the tile table says `dot` (DecodeTile.dot): one program per (expert
                          hit, K split, H tile), as the gate/up kernel owns experts, whose tl.dot takes the rows of
                          every token that picked the expert. Once tokens share experts the GEMV converts and
                          multiplies each expert's weights once per assignment (ALU-bound: Mixtral at 16 tokens
                          reads each expert 4 times); the dot does it once. Same partial rows, counters and sum order.

Ids outside [0, E) (other ranks' experts, dropped assignments) own nothing and add nothing; their intermediate rows are
never written nor read, and a token whose ids are all outside stores zeros. Only experts some token picked are read.

MXFP4 weights (formats/mxfp4.py) run in every kernel here, decoded in registers after their loads (gemm.jit's
`mxfp4_weight_tile`). Where a tile says `mma` (DecodeTile.mma) and the Gluon kernels run, bf16 activations against
MXFP4 weights take gemm/gluon_mxfp4_decode.py's kernels instead: the same two launches, intermediate rows, partial rows
and counters, each expert's weights decoded once for all its tokens and multiplied on mma.sync.

float8 weights (formats/fp8.py) run here too, dequantized in the loads as gemm/grouped.py's dequant path does (same
WEIGHT_SCALE codes; the activations are not quantized): at a few tokens the GEMMs are weight-bound, so reading half the
bytes is the whole gain and quantizing the activations would add work without saving any. From F16_DOTS_FROM_TOKENS
tokens the gate/up kernel dots the unscaled tiles in fp16 with x's rows rescaled per K step (gemm.jit.StepDot,
`step_dot`).

The path applies to inference with at most MAX_DECODE_ASSIGNMENTS assignments (the gate/up program compares
its id with every earlier one); `moe._fused_experts_op` chooses between it and the general path (host/tiles.py:
`select_decode_tiles`, the `decode` entries of the tile tables). Weights are addressed through strides as in
gemm/grouped.py, so every layout `fused_experts` takes (concatenated, interleaved, separate up, transposed) runs without
copies.
"""

import math

import torch
import triton
import triton.language as tl

from ..formats.scale_codes import WeightScaleCode
from ..host.device import smem_per_program
from ..host.host_math import cdiv, next_power_of_2
from ..host.pdl import pdl_options, release_dependents, wait_for_producer
from ..host.replay import launch
from ..host.tiles import MAX_DECODE_ASSIGNMENTS, DecodeTiles
from . import gluon_mxfp4_decode
from .args import NO_SCALE, dequant_scale_code, dot_options, same_strides, scale_args, weight_k, weight_strides
from .jit import (MXFP4_GROUP, SCALE_BLOCK, SCALE_BLOCK_STEP, SCALE_MXFP4, SCALE_MXFP4_BF16X2, SCALE_NONE, Activation,
                  StepDot, add_bias, apply_activation, expert_tile_dot, gate_up_tile_dot, mxfp4_weight_tile,
                  pair_columns, paired_bias_and_preact, scale_sums, scale_values, split_pairs, weight_scale_ptrs)

COUNTER_BLOCK = tl.constexpr(1024)  # counters the gate/up kernel zeroes per store
# From this many tokens the gate/up kernel dots float8 tiles in fp16 (`step_dot`)
F16_DOTS_FROM_TOKENS = 4


@triton.jit
def owned_expert(topk_ids_ptr, stride_ids_t, stride_ids_k, pid_a, E, TOP_K: tl.constexpr, BLOCK_A: tl.constexpr):
    """(expert of assignment pid_a, whether pid_a owns it: the id is in [0, E) and no earlier assignment names it).
    Ids are compared in their own width (an int64 id is never wrapped into [0, E)); BLOCK_A >= pid_a."""
    expert = tl.load(topk_ids_ptr + (pid_a // TOP_K) * stride_ids_t + (pid_a % TOP_K) * stride_ids_k)
    offs_a = tl.arange(0, BLOCK_A)
    b_earlier = tl.load(topk_ids_ptr + (offs_a // TOP_K) * stride_ids_t + (offs_a % TOP_K) * stride_ids_k,
                        mask=offs_a < pid_a, other=-1)  # [BLOCK_A]
    num_earlier = tl.sum((b_earlier == expert).to(tl.int32), axis=0)
    return expert, (expert >= 0) & (expert < E) & (num_earlier == 0)


@triton.jit
def zero_counters(counter_ptr, num_counters, pid_n):
    """The slice of the down kernel's arrival counters program (0, pid_n) of a gate/up kernel zeroes (the programs of
    the first assignment do it, before any can exit)."""
    per_program = tl.cdiv(num_counters, tl.num_programs(1))
    end = tl.minimum((pid_n + 1) * per_program, num_counters)
    for c0 in range(pid_n * per_program, end, COUNTER_BLOCK):
        offs_c = c0 + tl.arange(0, COUNTER_BLOCK)
        tl.store(counter_ptr + offs_c, tl.zeros((COUNTER_BLOCK,), dtype=tl.int32), mask=offs_c < end)


@triton.jit
def rows_gemv(row_ptr, stride_row_k, w_row_ptrs, s_ptrs, mask_r, stride_w_k, stride_scale_k, scale_block_k, k_begin,
              k_end, WEIGHT_SCALE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """[R] fp32: sum over k in [k_begin, k_end) of row[k] * W[r, k] for the R weight rows at w_row_ptrs (each row's k
    = 0, rows outside mask_r read as zero) and the activation row at row_ptr (stride_row_k apart); the GEMV of both
    decode GEMV kernels. Float weights and float8 ones under the WEIGHT_SCALE codes NONE, TENSOR, CHANNEL and
    BLOCK_STEP (block scales step inside one block: one scale per row and K step; s_ptrs [R] each row's scale at k =
    0) multiply per step and sum across the tile each step. MXFP4 bytes (WEIGHT_SCALE MXFP4 or MXFP4_BF16X2; k_begin
    and k_end multiples of 32, BLOCK_K at least 32) go from memory straight to registers, 16 bytes of a row to a
    thread, are decoded there (`mxfp4_weight_tile`) and multiplied into an fp32 tile [R, BLOCK_K] summed across
    once, after the loop: no trip through shared memory and no MMA operand layout to meet."""
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = row_ptr + (k_begin + offs_k) * stride_row_k  # [BLOCK_K]
    MXFP4: tl.constexpr = WEIGHT_SCALE == SCALE_MXFP4 or WEIGHT_SCALE == SCALE_MXFP4_BF16X2
    if MXFP4:
        offs_byte = tl.arange(0, BLOCK_K // 2)
        offs_group = tl.arange(0, BLOCK_K // MXFP4_GROUP)
        w_ptrs = w_row_ptrs[:, None] + (k_begin // 2 + offs_byte[None, :]) * stride_w_k  # [R, BLOCK_K / 2]
        s_tile_ptrs = s_ptrs[:, None] + (k_begin // MXFP4_GROUP + offs_group[None, :]) * stride_scale_k
        b_tile = tl.zeros((w_row_ptrs.shape[0], BLOCK_K // MXFP4_GROUP), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            b_w = mxfp4_weight_tile(w_ptrs, s_tile_ptrs, mask_r, k_end - k0, tl.float32,
                                    WEIGHT_SCALE == SCALE_MXFP4_BF16X2, BLOCK_K)
            b_row = tl.load(x_ptrs, mask=offs_k < k_end - k0, other=0.0)
            b_prod = b_w.to(tl.float32) * b_row.to(tl.float32)[None, :]
            b_tile += tl.sum(tl.reshape(b_prod, (w_row_ptrs.shape[0], BLOCK_K // MXFP4_GROUP, MXFP4_GROUP)), axis=2)
            x_ptrs += BLOCK_K * stride_row_k
            w_ptrs += (BLOCK_K // 2) * stride_w_k
            s_tile_ptrs += (BLOCK_K // MXFP4_GROUP) * stride_scale_k
        b_sum = tl.sum(b_tile, axis=1)
    else:
        w_ptrs = w_row_ptrs[:, None] + (k_begin + offs_k[None, :]) * stride_w_k  # [R, BLOCK_K]
        b_sum = tl.zeros((w_row_ptrs.shape[0],), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            if EVEN_K:
                b_row = tl.load(x_ptrs)
                b_w = tl.load(w_ptrs, mask=mask_r[:, None], other=0.0)
            else:
                mask_k = offs_k < k_end - k0
                b_row = tl.load(x_ptrs, mask=mask_k, other=0.0)
                b_w = tl.load(w_ptrs, mask=mask_r[:, None] & mask_k[None, :], other=0.0)
            b_step = tl.sum(b_w.to(tl.float32) * b_row.to(tl.float32)[None, :], axis=1)
            if WEIGHT_SCALE == SCALE_BLOCK_STEP:  # the K step lies inside one scale block: one scale per row
                b_step *= scale_values(tl.load(s_ptrs + (k0 // scale_block_k) * stride_scale_k, mask=mask_r,
                                               other=0))
            b_sum += b_step
            x_ptrs += BLOCK_K * stride_row_k
            w_ptrs += BLOCK_K * stride_w_k
        b_sum, _ = scale_sums(b_sum[None, :], b_sum[None, :], s_ptrs, s_ptrs, mask_r, False, WEIGHT_SCALE)
        b_sum = tl.reshape(b_sum, (w_row_ptrs.shape[0],))
    return b_sum


@triton.jit(do_not_specialize=["num_tokens"])
def _decode_gate_up_kernel(
    # x: [T, H]; the dot form reads every row (no gather), the GEMV form the row of each assignment's token
    x_ptr, stride_x_t, stride_x_h,
    # gate and up weights: per-expert [E, F, H] views by strides (one set for both, see gemm.grouped.same_strides);
    # PAIRED: w_gate_ptr is one interleaved [E, 2F, H] weight (gate at even rows) and bias_gate_ptr its [E, 2F] bias
    w_gate_ptr, w_up_ptr, stride_w_e, stride_w_n, stride_w_k,
    bias_gate_ptr, bias_up_ptr, stride_bias_e, stride_bias_n,
    # float8 weights: their scales as gemm/grouped.py's dequant path reads them (fp8.WeightScale, WEIGHT_SCALE codes)
    scale_ptr, stride_scale_e, stride_scale_n, stride_scale_k, scale_row_step, scale_up_row_offset,
    scale_block_n, scale_block_k,
    # intermediate: [N, F] in assignment order, unit stride along F
    inter_ptr, stride_inter_a,
    # routing: topk_ids [T, TOP_K], any integer dtype and strides
    topk_ids_ptr, stride_ids_t, stride_ids_k,
    # the down kernel's arrival counters, zeroed here (see `_decode_down_kernel`)
    counter_ptr, num_counters,
    # sizes (num_tokens is not specialised on, so every T of one BLOCK_T shares a compiled kernel)
    num_tokens, F, H, E,
    alpha, limit,
    TOP_K: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WEIGHT_SCALE: tl.constexpr,
    PAIRED: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    GEMV: tl.constexpr,
    # the dot form's alone (the GEMV form's launch passes fixed values)
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    STEP_DOT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_A: tl.constexpr,
):
    """Grid: (N, cdiv(F, BLOCK_N)), program (a, n) for columns [n * BLOCK_N, +BLOCK_N) of the intermediate.

    Dot form (GEMV off): program (a, n) works only when assignment a is the first naming its expert e, a valid one;
    it then writes those columns of intermediate[t * TOP_K + j] for every (t, j) with topk_ids[t, j] == e. BLOCK_T
    >= T rows (at least 16 for tl.dot); BLOCK_A >= N.

    GEMV form (the tile table's `gemv`, DecodeTile.gemv): program (a = t * TOP_K + j, n) computes intermediate[a] =
    act(x[t] @ gate^T, x[t] @ up^T) for expert topk_ids[t, j] as one GEMV over the tile's gate and up rows together
    (`rows_gemv`; 2 BLOCK_N rows, gate and up alternating), and exits for an id outside [0, E). Every assignment
    reads its expert's weights (assignments sharing an expert find them in L2: assignment is the grid's fastest
    axis); nothing waits on an owner. What wins at one or two tokens, where the dot form's padded 16-row MMA and the
    MXFP4 weight's trip through shared memory into the MMA operand layout cost more than multiplying in registers."""
    wait_for_producer(PDL)
    pid_a = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_a == 0:  # the first assignment's programs zero the counters, a slice each, before any can exit
        zero_counters(counter_ptr, num_counters, pid_n)
    if GEMV:
        t = pid_a // TOP_K
        expert = tl.load(topk_ids_ptr + t * stride_ids_t + (pid_a % TOP_K) * stride_ids_k)
        if (expert < 0) | (expert >= E):
            return
        # the tile's rows as pairs: pair p is F column offs_pair // 2, its gate row when even, its up row when odd
        offs_pair, mask_pair = pair_columns(pid_n, F, BLOCK_N)
        expert_base = expert.to(tl.int64) * stride_w_e
        if PAIRED:  # one interleaved weight: row p of it
            w_row_ptrs = w_gate_ptr + expert_base + offs_pair * stride_w_n
            s_ptrs = scale_ptr
            if WEIGHT_SCALE != SCALE_NONE:
                s_ptrs, _ = weight_scale_ptrs(scale_ptr, expert, offs_pair, stride_scale_e, stride_scale_n,
                                              scale_row_step, scale_up_row_offset, scale_block_n, WEIGHT_SCALE)
        else:
            is_up = (offs_pair % 2) == 1
            cols = offs_pair // 2
            w_row_ptrs = tl.where(is_up, w_up_ptr, w_gate_ptr) + expert_base + cols * stride_w_n
            s_ptrs = scale_ptr
            if WEIGHT_SCALE != SCALE_NONE:
                s_gate_ptrs, s_up_ptrs = weight_scale_ptrs(scale_ptr, expert, cols, stride_scale_e, stride_scale_n,
                                                           scale_row_step, scale_up_row_offset, scale_block_n,
                                                           WEIGHT_SCALE)
                s_ptrs = tl.where(is_up, s_up_ptrs, s_gate_ptrs)
        b_pairs = rows_gemv(x_ptr + t.to(tl.int64) * stride_x_t, stride_x_h, w_row_ptrs, s_ptrs, mask_pair,
                            stride_w_k, stride_scale_k, scale_block_k, 0, H, WEIGHT_SCALE, EVEN_K, BLOCK_K)[None, :]
        release_dependents(PDL)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < F
        if PAIRED:
            b_pairs = paired_bias_and_preact(b_pairs, expert, offs_n, mask_n, offs_pair, mask_pair, bias_gate_ptr,
                                             stride_bias_e, stride_bias_n, inter_ptr, 0, HAS_BIAS, False)
            b_gate, b_up = split_pairs(b_pairs)
        else:
            b_gate, b_up = split_pairs(b_pairs)
            if HAS_BIAS:
                b_gate, b_up = add_bias(b_gate, b_up, expert, offs_n, mask_n, bias_gate_ptr, bias_up_ptr,
                                        stride_bias_e, stride_bias_n, ACTIVATION)
        b_act = apply_activation(b_gate, b_up, alpha, limit, ACTIVATION).to(inter_ptr.dtype.element_ty)
        tl.store(inter_ptr + pid_a.to(tl.int64) * stride_inter_a + offs_n[None, :], b_act, mask=mask_n[None, :])
    else:
        expert, owner = owned_expert(topk_ids_ptr, stride_ids_t, stride_ids_k, pid_a, E, TOP_K, BLOCK_A)
        if owner == 0:
            return

        offs_t = tl.arange(0, BLOCK_T)
        mask_t = offs_t < num_tokens
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < F
        offs_k = tl.arange(0, BLOCK_K)
        # [BLOCK_T, BLOCK_K]
        a_ptrs = x_ptr + offs_t[:, None].to(tl.int64) * stride_x_t + offs_k[None, :] * stride_x_h
        # PAIRED: one [BLOCK_K, 2 BLOCK_N] tile of the interleaved weight per K step (gemm/grouped.py's PAIRED)
        b_gate, b_up, offs_pair, mask_pair = gate_up_tile_dot(
            a_ptrs, mask_t, expert, pid_n, offs_n, mask_n, offs_k, F, w_gate_ptr, w_up_ptr, stride_w_e, stride_w_n,
            stride_w_k, scale_ptr, stride_scale_e, stride_scale_n, stride_scale_k, scale_row_step,
            scale_up_row_offset, scale_block_n, scale_block_k, H, stride_x_h, True, PAIRED, DOT_FP32, DOT_PRECISION,
            EVEN_K, BLOCK_T, BLOCK_N, BLOCK_K, WEIGHT_SCALE, STEP_DOT)
        release_dependents(PDL)
        if PAIRED:
            b_pairs = paired_bias_and_preact(b_gate, expert, offs_t, mask_t, offs_pair, mask_pair, bias_gate_ptr,
                                             stride_bias_e, stride_bias_n, inter_ptr, 0, HAS_BIAS, False)
            b_gate, b_up = split_pairs(b_pairs)
        elif HAS_BIAS:
            b_gate, b_up = add_bias(b_gate, b_up, expert, offs_n, mask_n, bias_gate_ptr, bias_up_ptr, stride_bias_e,
                                    stride_bias_n, ACTIVATION)
        b_act = apply_activation(b_gate, b_up, alpha, limit, ACTIVATION).to(inter_ptr.dtype.element_ty)

        for j in tl.static_range(TOP_K):
            b_ids = tl.load(topk_ids_ptr + offs_t * stride_ids_t + j * stride_ids_k, mask=mask_t,
                            other=-1)  # [BLOCK_T]
            mask_rows = mask_t & (b_ids == expert)
            inter_ptrs = inter_ptr + (offs_t * TOP_K + j)[:, None].to(tl.int64) * stride_inter_a + offs_n[None, :]
            tl.store(inter_ptrs, b_act, mask=mask_rows[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["num_tokens"])
def _decode_down_kernel(
    # intermediate: [N, F] in assignment order, unit stride along F
    inter_ptr, stride_inter_a,
    # down weights: per-expert [E, H, F] by strides
    w_ptr, stride_w_e, stride_w_n, stride_w_k,
    bias_ptr, stride_bias_e, stride_bias_n,
    # float8 weights: scales (WEIGHT_SCALE NONE, TENSOR, CHANNEL or BLOCK_STEP: block scales always step inside one
    # block here); MXFP4 weights (bytes [E, H, F / 2]): their e8m0 codes [E, H, F / 32] (MXFP4, MXFP4_BF16X2)
    scale_ptr, stride_scale_e, stride_scale_n, stride_scale_k, scale_block_n, scale_block_k,
    # routing: topk_ids, topk_weights [T, TOP_K], any strides; weights of any float dtype (applied in fp32)
    topk_ids_ptr, stride_ids_t, stride_ids_k,
    topk_weights_ptr, stride_tw_t, stride_tw_k,
    # partial: [N * SPLIT_K, H] fp32, each (assignment, K split)'s weighted row; counter: [T * cdiv(H, BLOCK_N)]
    # int32, zero on entry
    partial_ptr, counter_ptr,
    # out: [T, H]
    out_ptr, stride_out_t, stride_out_h,
    num_tokens, H, F, E, split_len,
    TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WEIGHT_SCALE: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid: (N * SPLIT_K * cdiv(H, BLOCK_N),), assignment fastest: the programs of one column tile run side by side,
    so assignments that share an expert find its weight tile in L2. Program (a = t * TOP_K + j, s, n) computes
    topk_weights[t, j] * (intermediate[a, K split s] @ W_down[e, :, K split s]^T (+ bias, split 0))[n-th BLOCK_N
    columns] into partial row a * SPLIT_K + s (K split s: columns [s * split_len, +split_len) of F, split_len a
    multiple of BLOCK_K). The last of token t's TOP_K * SPLIT_K programs to arrive at the tile's counter sums their
    partial rows in index order and stores out[t] (so the sum is the same whichever program arrives last). With one
    program per token and tile (TOP_K = SPLIT_K = 1) it stores out[t] directly. The gate/up kernel, which runs first
    on the stream, zeroes the counters."""
    wait_for_producer(PDL)
    pid = tl.program_id(0)
    num_assignments = num_tokens * TOP_K
    a = pid % num_assignments
    split = (pid // num_assignments) % SPLIT_K
    pid_n = pid // (num_assignments * SPLIT_K)
    t = a // TOP_K
    j = a % TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    k_begin = split * split_len
    k_end = tl.minimum(k_begin + split_len, F)
    b_y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    expert = tl.load(topk_ids_ptr + t * stride_ids_t + j * stride_ids_k)
    if (expert >= 0) & (expert < E):
        s_ptrs = scale_ptr
        if WEIGHT_SCALE != SCALE_NONE:  # the down weight is never split: column j reads scale row j
            s_ptrs, _ = weight_scale_ptrs(scale_ptr, expert, offs_n, stride_scale_e, stride_scale_n, 1, 0,
                                          scale_block_n, WEIGHT_SCALE)
        b_y = rows_gemv(inter_ptr + a.to(tl.int64) * stride_inter_a, 1,
                        w_ptr + expert.to(tl.int64) * stride_w_e + offs_n * stride_w_n, s_ptrs, mask_n, stride_w_k,
                        stride_scale_k, scale_block_k, k_begin, k_end, WEIGHT_SCALE, EVEN_K, BLOCK_K)
        if HAS_BIAS:
            if split == 0:
                b_y += tl.load(bias_ptr + expert.to(tl.int64) * stride_bias_e + offs_n * stride_bias_n, mask=mask_n,
                               other=0.0).to(tl.float32)
        b_y *= tl.load(topk_weights_ptr + t * stride_tw_t + j * stride_tw_k).to(tl.float32)
    out_ptrs = out_ptr + t.to(tl.int64) * stride_out_t + offs_n * stride_out_h
    if TOP_K * SPLIT_K == 1:
        tl.store(out_ptrs, b_y.to(out_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.store(partial_ptr + (a * SPLIT_K + split).to(tl.int64) * H + offs_n, b_y, mask=mask_n)
        # Every thread's partial is written before the arrival is counted (the barrier, then the atomic's release);
        # the last arrival's acquire makes the other programs' partials visible to its loads.
        tl.debug_barrier()
        counter = counter_ptr + t * tl.cdiv(H, BLOCK_N) + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel") == TOP_K * SPLIT_K - 1:
            b_out = tl.zeros((BLOCK_N,), dtype=tl.float32)
            first = t * TOP_K * SPLIT_K
            for i in tl.static_range(TOP_K * SPLIT_K):
                b_out += tl.load(partial_ptr + (first + i).to(tl.int64) * H + offs_n, mask=mask_n, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out_ptrs, b_out.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit(do_not_specialize=["num_tokens"])
def _decode_down_dot_kernel(
    # intermediate: [N, F] in assignment order, unit stride along F
    inter_ptr, stride_inter_a,
    # down weights: per-expert [E, H, F] by strides
    w_ptr, stride_w_e, stride_w_n, stride_w_k,
    bias_ptr, stride_bias_e, stride_bias_n,
    # float8 weights: their scales as the gate/up kernel reads them (scale_args of fp8.WeightScale)
    scale_ptr, stride_scale_e, stride_scale_n, stride_scale_k, scale_row_step, scale_up_row_offset,
    scale_block_n, scale_block_k,
    # routing: topk_ids, topk_weights [T, TOP_K], any strides; weights of any float dtype (applied in fp32)
    topk_ids_ptr, stride_ids_t, stride_ids_k,
    topk_weights_ptr, stride_tw_t, stride_tw_k,
    # partial: [N * SPLIT_K, H] fp32; counter: [T * cdiv(H, BLOCK_N)] int32, zero on entry (the gate/up kernel's)
    partial_ptr, counter_ptr,
    # out: [T, H]
    out_ptr, stride_out_t, stride_out_h,
    num_tokens, H, F, E, split_len,
    TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WEIGHT_SCALE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    STEP_DOT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """The down GEMM once per expert hit (DecodeTile.dot): grid (N, SPLIT_K * cdiv(H, BLOCK_N)), program (a, s, n)
    works only when assignment a is the first naming its expert e, a valid one (as in the gate/up kernel). It gathers
    the intermediate row of every token that picked e (the row of its first slot naming e: a token listing e twice
    has two equal rows, computed by one owner from one x row) into a [BLOCK_T, BLOCK_K] tile per K step, dots it with
    W_down[e]'s tile (the weights read once for all of e's tokens, the dequantization done once, the multiply on
    tensor cores; the GEMV kernel converts and multiplies a whole weight tile per assignment), and writes each row
    times the sum of the token's routing weights on e (+ bias, split 0) to the partial row of that slot. Each token's
    counter then takes one arrival per (distinct valid expert, split); the last arrival sums the token's partial rows
    of first slots in the order j = 0..TOP_K-1, s = 0..SPLIT_K-1 and stores out[t]. A token with no valid id gets
    zeros from the programs of its slot 0 and split 0."""
    wait_for_producer(PDL)
    pid_a = tl.program_id(0)
    pid = tl.program_id(1)
    split = pid % SPLIT_K
    pid_n = pid // SPLIT_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    offs_t = tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_tokens
    offs_j = tl.arange(0, BLOCK_J)
    mask_tj = mask_t[:, None] & (offs_j[None, :] < TOP_K)
    b_ids = tl.load(topk_ids_ptr + offs_t[:, None] * stride_ids_t + offs_j[None, :] * stride_ids_k, mask=mask_tj,
                    other=-1)  # [BLOCK_T, BLOCK_J]
    # the first slot of each valid expert in its token's row (ids compared in their own width)
    b_first = mask_tj & (b_ids >= 0) & (b_ids < E)
    for jj in tl.static_range(TOP_K - 1):
        b_col = tl.load(topk_ids_ptr + offs_t * stride_ids_t + jj * stride_ids_k, mask=mask_t, other=-1)
        b_first = b_first & ((b_ids != b_col[:, None]) | (offs_j[None, :] <= jj))
    b_experts = tl.sum(b_first.to(tl.int32), axis=1)  # [BLOCK_T] distinct valid experts per token
    out_tile_ptrs = out_ptr + offs_t[:, None].to(tl.int64) * stride_out_t + offs_n[None, :] * stride_out_h
    t_own = pid_a // TOP_K
    if (pid_a % TOP_K == 0) & (split == 0):
        b_none = (offs_t == t_own) & (b_experts == 0)
        tl.store(out_tile_ptrs, tl.zeros((BLOCK_T, BLOCK_N), dtype=out_ptr.dtype.element_ty),
                 mask=b_none[:, None] & mask_n[None, :])
    expert, owner = owned_expert(topk_ids_ptr, stride_ids_t, stride_ids_k, pid_a, E, TOP_K, BLOCK_A)
    if owner == 0:
        return

    b_match = mask_tj & (b_ids == expert)
    b_slot = tl.min(tl.where(b_match, offs_j[None, :], BLOCK_J), axis=1)  # [BLOCK_T] first slot naming the expert
    mask_rows = b_slot < TOP_K
    b_rows = offs_t * TOP_K + tl.where(mask_rows, b_slot, 0)  # [BLOCK_T] assignment of each row's first slot
    b_row_weight = tl.sum(tl.load(topk_weights_ptr + offs_t[:, None] * stride_tw_t + offs_j[None, :] * stride_tw_k,
                                  mask=b_match, other=0.0).to(tl.float32), axis=1)
    k_begin = split * split_len
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = inter_ptr + b_rows[:, None].to(tl.int64) * stride_inter_a + (k_begin + offs_k)[None, :]
    # the split's scales start at its first scale block (the launcher makes split_len a multiple of block scales'
    # K side, and of MXFP4's 32-value groups, two to a byte)
    s_base = scale_ptr
    w_base = w_ptr + k_begin * stride_w_k
    MXFP4: tl.constexpr = WEIGHT_SCALE == SCALE_MXFP4 or WEIGHT_SCALE == SCALE_MXFP4_BF16X2
    if WEIGHT_SCALE == SCALE_BLOCK_STEP or WEIGHT_SCALE == SCALE_BLOCK or MXFP4:
        s_base = scale_ptr + (k_begin // scale_block_k) * stride_scale_k
    if MXFP4:
        w_base = w_ptr + (k_begin // 2) * stride_w_k
    b_acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    b_acc, _ = expert_tile_dot(b_acc, b_acc, a_ptrs, mask_rows, mask_n, expert, offs_n, offs_k,
                               w_base, w_base, stride_w_e, stride_w_n, stride_w_k, s_base, stride_scale_e,
                               stride_scale_n, stride_scale_k, scale_row_step, scale_up_row_offset, scale_block_n, scale_block_k, tl.minimum(split_len, F - k_begin),
                               1, False, DOT_FP32, DOT_PRECISION, EVEN_K, BLOCK_K, WEIGHT_SCALE, STEP_DOT)
    if HAS_BIAS:
        if split == 0:
            b_acc += tl.load(bias_ptr + expert.to(tl.int64) * stride_bias_e + offs_n * stride_bias_n, mask=mask_n,
                             other=0.0).to(tl.float32)[None, :]
    b_acc *= b_row_weight[:, None]
    mask_out = mask_rows[:, None] & mask_n[None, :]
    tl.store(partial_ptr + (b_rows * SPLIT_K + split)[:, None].to(tl.int64) * H + offs_n[None, :], b_acc,
             mask=mask_out)
    # As in the GEMV kernel: the partials are written before the arrivals count them (the barrier, then each row's
    # atomic release); a last arrival's acquire, then the block-wide reduction of `b_last`, orders the loads after.
    tl.debug_barrier()
    b_arrived = tl.atomic_add(counter_ptr + offs_t * tl.cdiv(H, BLOCK_N) + pid_n, 1, mask=mask_rows, sem="acq_rel")
    b_last = mask_rows & (b_arrived == b_experts * SPLIT_K - 1)
    if tl.max(b_last.to(tl.int32), axis=0) > 0:
        b_out = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            b_first_j = tl.sum(tl.where(offs_j[None, :] == j, b_first, False).to(tl.int32), axis=1) > 0
            mask_sum = (b_last & b_first_j)[:, None] & mask_n[None, :]
            for s in tl.static_range(SPLIT_K):
                b_out += tl.load(partial_ptr + ((offs_t * TOP_K + j) * SPLIT_K + s)[:, None].to(tl.int64) * H
                                 + offs_n[None, :], mask=mask_sum, other=0.0, cache_modifier=".cg")
        tl.store(out_tile_ptrs, b_out.to(out_ptr.dtype.element_ty), mask=b_last[:, None] & mask_n[None, :])


def step_dot(num_tokens, x_dtype, weight_dtype):
    """The gate/up kernel's gemm.jit.StepDot: float8 weights under half-precision activations dot in fp16 from
    F16_DOTS_FROM_TOKENS tokens (e4m3 -> fp16 is one instruction per two elements, against three conversions and a
    multiply per element for a scaled bf16 tile), the scaled tile below. Measured on the H200 at the table's tiles
    (docs/versions.md, v17): at T = 4 the fp16 dots took 3-7% off the gate/up kernel of five models, at
    T = 16 1-8%; at T = 1 they added up to 21% (the per-step rescaling of x's 16 padded rows, a reduction across
    the tile, costs more than the conversions it saves when few programs share an SM). T = 2, 3: not measured."""
    if (num_tokens >= F16_DOTS_FROM_TOKENS and x_dtype != torch.float32 and weight_dtype.itemsize == 1
            and weight_dtype != torch.uint8):  # float8 only: MXFP4 bytes take their own K loop
        return StepDot.F16_SUMS
    return StepDot.SCALED_TILE


def pipeline_stages(num_stages, stage_bytes, limit):
    """A table's num_stages cut to what `limit` bytes of shared memory hold (at least 1; `limit` None: as it is).
    Tables are measured at each model's own top_k, while BLOCK_T follows T: a bucket measured at 16 tokens of top_k 8
    also serves 128 tokens of top_k 1, whose x tile is 8 times larger."""
    if limit is None:
        return num_stages
    return max(1, min(num_stages, limit // stage_bytes))


def decode_experts(x, w_gate, w_up, w_down, topk_ids, topk_weights, tiles: DecodeTiles, *, transposed=False,
                   activation="silu", gate_bias=None, up_bias=None, down_bias=None, alpha=1.702, limit=7.0,
                   gate_up_scale=None, down_scale=None, paired=False):
    """out [T, H] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) in two launches (see the module doc).

    x [T, H]; w_gate, w_up: the gate and up views [E, F, H] ([E, H, F] when `transposed`); w_down [E, H, F] ([E, F, H]
    transposed); gate_bias, up_bias [E, F] views, down_bias [E, H]. `paired`: w_gate is instead one interleaved
    gate/up weight [E, 2F, H] ([E, H, 2F]; gate at even rows) and gate_bias its whole [E, 2F] bias (w_up, up_bias
    unused), read as [BLOCK_K, 2 BLOCK_N] tiles. float8 weights come with their `gate_up_scale` / `down_scale`
    (fp8.WeightScale; paired: of the whole weight) and are dequantized in the loads (the dots run in x's dtype,
    the activations are not quantized). Needs T * top_k <= MAX_DECODE_ASSIGNMENTS.
    """
    T, H = x.shape
    top_k = topk_ids.shape[1]
    num_assignments = T * top_k
    if num_assignments > MAX_DECODE_ASSIGNMENTS:
        raise ValueError(f"the decode path takes at most {MAX_DECODE_ASSIGNMENTS} assignments, got T * top_k = "
                         f"{num_assignments}")
    E = w_down.shape[0]
    F = weight_k(w_down, transposed)
    if paired:
        w_up, up_bias = w_gate, gate_bias
    out = torch.empty((T, H), device=x.device, dtype=x.dtype)
    if T == 0 or H == 0:
        return out
    down_tile = tiles.down
    # Rows of tokens' slots whose id is outside [0, E) stay unwritten: the down kernel never reads them.
    intermediate = torch.empty((num_assignments, F), device=x.device, dtype=x.dtype)
    down_mma = down_tile.mma and gluon_mxfp4_decode.runs(x, w_down, transposed)
    ws_down = down_scale or NO_SCALE
    if down_mma:  # a partial row per assignment, a counter per (token, row tile)
        partial = (torch.empty((num_assignments, H), device=x.device, dtype=torch.float32) if top_k > 1 else None)
        num_counters = T * cdiv(H, gluon_mxfp4_decode.rows_per_program(down_tile.num_warps)) if top_k > 1 else 0
    else:
        # K splits of the down GEMV: whole BLOCK_K steps each, at most as many as there are steps
        # The GEMV has no dot-size floor: block scales always step inside one block. The dot kernel's splits start on
        # a scale block (its scale pointers step from there), and none is left empty.
        down_code, down_block_k = dequant_scale_code(ws_down, down_tile.block_k,
                                                     min_block_k=16 if down_tile.dot else 1, dtype=x.dtype,
                                                     device=x.device)
        split_step = down_block_k
        if down_tile.dot and down_code in (WeightScaleCode.BLOCK, WeightScaleCode.BLOCK_STEP):
            split_step = math.lcm(down_block_k, ws_down.block_k)
        steps = cdiv(F, split_step)
        split_k = max(1, min(down_tile.split_k, steps))
        split_len = cdiv(steps, split_k) * split_step
        if down_tile.dot and split_len:
            split_k = cdiv(F, split_len)
        reduced = top_k * split_k > 1 or down_tile.dot
        partial = (torch.empty((num_assignments * split_k, H), device=x.device, dtype=torch.float32) if reduced
                   else None)
        num_counters = T * cdiv(H, down_tile.block_n) if reduced else 0
    counters = torch.empty((num_counters,), device=x.device, dtype=torch.int32)
    if F > 0:
        w_gate, w_up = same_strides(w_gate, w_up)
        if gate_bias is not None:
            gate_bias, up_bias = same_strides(gate_bias, up_bias)
        stride_e, stride_n, stride_k = weight_strides(w_gate, transposed)
        tile = tiles.gate_up
        ws = gate_up_scale or NO_SCALE
        if tile.mma and gluon_mxfp4_decode.runs(x, w_gate, transposed):
            views = gluon_mxfp4_decode.gate_up_views(w_gate, w_up, ws.scale, ws.up_row_offset, gate_bias, up_bias,
                                                     paired)
            gluon_mxfp4_decode.gate_up_mma(x, *views, intermediate, topk_ids, counters, activation=activation,
                                           alpha=alpha, limit=limit, num_warps=tile.num_warps)
        else:
            args = (x, x.stride(0), x.stride(1),
                    w_gate, w_up, stride_e, stride_n, stride_k,
                    gate_bias, up_bias, *(gate_bias.stride() if gate_bias is not None else (0, 0)),
                    *scale_args(ws),
                    intermediate, intermediate.stride(0),
                    topk_ids, topk_ids.stride(0), topk_ids.stride(1),
                    counters, num_counters,
                    T, F, H, E,
                    float(alpha), float(limit))
            dot_fp32, precision = dot_options(x.dtype)
            if tile.gemv:  # block scales step inside one block, as in the down GEMV
                scale_code, block_k = dequant_scale_code(ws, tile.block_k, min_block_k=1, dtype=x.dtype,
                                                         device=x.device)
                # the dot form's constexprs at fixed values: one compiled GEMV per specialization whatever T
                form = dict(GEMV=True, DOT_FP32=dot_fp32, DOT_PRECISION=precision, STEP_DOT=0, BLOCK_T=1, BLOCK_A=1,
                            num_stages=tile.num_stages)
            else:
                block_t = max(16, next_power_of_2(T))
                scale_code, block_k = dequant_scale_code(ws, tile.block_k, dtype=x.dtype, device=x.device)
                form = dict(GEMV=False, DOT_FP32=dot_fp32, DOT_PRECISION=precision,
                            STEP_DOT=int(step_dot(T, x.dtype, w_gate.dtype)), BLOCK_T=block_t,
                            # a function of BLOCK_T and TOP_K only (>= N), so it adds no compiled variants of its own
                            BLOCK_A=next_power_of_2(block_t * top_k),
                            num_stages=pipeline_stages(tile.num_stages,
                                                       (block_t * x.element_size()
                                                        + 2 * tile.block_n * w_gate.element_size()) * block_k,
                                                       smem_per_program(x.device)))
            launch(_decode_gate_up_kernel, (num_assignments, cdiv(F, tile.block_n)), *args,
                   TOP_K=top_k, ACTIVATION=int(Activation.of(activation)), HAS_BIAS=gate_bias is not None,
                   WEIGHT_SCALE=int(scale_code), PAIRED=paired, EVEN_K=H % block_k == 0, BLOCK_N=tile.block_n,
                   BLOCK_K=block_k, num_warps=tile.num_warps, **pdl_options(x.device), **form)
    else:
        counters.zero_()  # no gate/up launch to zero them
    if down_mma:
        gluon_mxfp4_decode.down_mma(intermediate, w_down, ws_down.scale, down_bias, topk_ids, topk_weights, partial,
                                    counters, out, num_warps=down_tile.num_warps)
        return out
    # what both down kernels take: operands before the scales, routing and outputs after them, shared constexprs
    operands = (intermediate, intermediate.stride(0), w_down, *weight_strides(w_down, transposed),
                down_bias, *(down_bias.stride() if down_bias is not None else (0, 0)))
    routing = (topk_ids, topk_ids.stride(0), topk_ids.stride(1), topk_weights, topk_weights.stride(0),
               topk_weights.stride(1), partial, counters, out, out.stride(0), out.stride(1), T, H, F, E, split_len)
    meta = dict(TOP_K=top_k, HAS_BIAS=down_bias is not None, WEIGHT_SCALE=int(down_code),
                EVEN_K=F % down_block_k == 0, SPLIT_K=split_k, BLOCK_N=down_tile.block_n, BLOCK_K=down_block_k,
                num_warps=down_tile.num_warps, **pdl_options(x.device))
    if down_tile.dot:
        block_t = max(16, next_power_of_2(T))
        dot_fp32, precision = dot_options(x.dtype)
        launch(_decode_down_dot_kernel, (num_assignments, split_k * cdiv(H, down_tile.block_n)),
            *operands, *scale_args(ws_down), *routing,
            DOT_FP32=dot_fp32,
            DOT_PRECISION=precision,
            STEP_DOT=int(step_dot(T, x.dtype, w_down.dtype)),
            BLOCK_T=block_t,
            BLOCK_A=next_power_of_2(block_t * top_k),
            BLOCK_J=next_power_of_2(top_k),
            num_stages=pipeline_stages(down_tile.num_stages,
                                       (block_t * x.element_size() + down_tile.block_n * w_down.element_size())
                                       * down_block_k, smem_per_program(x.device)),
            **meta,
        )
        return out
    launch(_decode_down_kernel, (num_assignments * split_k * cdiv(H, down_tile.block_n),),
        *operands, ws_down.scale, *ws_down.strides, ws_down.block_n, ws_down.block_k, *routing,
        num_stages=pipeline_stages(down_tile.num_stages, down_tile.block_n * down_block_k * w_down.element_size(),
                                   smem_per_program(x.device)),
        **meta,
    )
    return out
