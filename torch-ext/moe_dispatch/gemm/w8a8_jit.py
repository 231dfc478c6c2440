"""The w8a8 kernels' shared jit pieces (gemm/w8a8.py's pointer kernel and gemm/w8a8_persistent.py's descriptor kernel):
e4m3 rounding and quantization of tiles, the scaled per-K-step dot, block-scale addressing, the pointer K loop, and
the epilogue after it. gemm/w8a8.py's docstring describes the arithmetic they implement.

Also the codes of the w8a8 kernels' own constexprs, A_QUANT (`AQuant`) and QUANT_OUT (`QuantOut`), with `tl.constexpr`
aliases for jit code as gemm/jit.py has for ACTIVATION and WEIGHT_SCALE.
"""

import enum

import triton
import triton.language as tl

from .jit import (ACT_NONE, NAN_BITS, SCALE_BLOCK, SCALE_CHANNEL, SCALE_TENSOR, activate_and_weight, add_bias,
                  scale_values, step_masks)


class AQuant(enum.IntEnum):
    """The A_QUANT constexpr: how the GEMM's A tiles become float8."""

    DYNAMIC = 0  # float rows, one scale per row and K step computed in the loads (amax / fp8 max)
    STATIC = 1  # float rows, quantized with a static scale per expert (or one per tensor)
    FP8_GROUPS = 2  # float8 rows with a scale per row and K step (written by GEMM1's epilogue or the quantization pass)
    FP8_STATIC = 3  # float8 rows with a static scale per expert (or one per tensor)


class QuantOut(enum.IntEnum):
    """The QUANT_OUT constexpr: how the GEMM stores its output tile."""

    FLOAT = 0  # in C's float dtype
    DYNAMIC = 1  # float8, one scale per row and OUT_GROUP columns (GEMM1 writing GEMM2's FP8_GROUPS input)
    STATIC = 2  # float8 with a static scale per expert (or one per tensor)


A_DYNAMIC = tl.constexpr(AQuant.DYNAMIC.value)
A_STATIC = tl.constexpr(AQuant.STATIC.value)
A_FP8_GROUPS = tl.constexpr(AQuant.FP8_GROUPS.value)
A_FP8_STATIC = tl.constexpr(AQuant.FP8_STATIC.value)
OUT_DYNAMIC = tl.constexpr(QuantOut.DYNAMIC.value)
OUT_STATIC = tl.constexpr(QuantOut.STATIC.value)

MIN_AMAX = tl.constexpr(1e-10)  # floor of a group's amax: an all-zero group gets a tiny scale, never 0 / 0
E4M3_NAN = tl.constexpr(0x7F)  # e4m3fn's NaN code (with its sign bit: 0xFF); e4m3fn has no inf


@triton.jit
def to_fp8(b, fp8_max, ROUND_IN_FP32: tl.constexpr):
    """fp32 -> e4m3 (fn), saturated at +-fp8_max, rounded to nearest even; NaN and +-inf give NaN, so a non-finite
    activation stays non-finite through the fp8 dots, as through bf16 ones (saturated, an inf would become 448)."""
    # b * 0 is +-0 for finite b and NaN for NaN and +-inf: one FMA puts it back after the clamp, whose max / min drop
    # NaN.
    b = tl.fma(b, 0.0, tl.minimum(tl.maximum(b, -fp8_max), fp8_max))
    if ROUND_IN_FP32:
        is_nan = b != b
        # Normals: keep 3 of the 23 mantissa bits, ties to even (the carry may step the exponent). Subnormals
        # (|b| < 2^-6): multiples of 2^-9, rounded by adding and removing 1.5 * 2^14 (whose fp32 ulp is 2^-9).
        bits = b.to(tl.uint32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        subnormal = (b + 24576.0) - 24576.0
        b = tl.where(tl.abs(b) < 0.015625, subnormal, normal)
        # the interpreter converts NaN to a finite e4m3 code: NaN's code is written here
        codes = b.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        return tl.where(is_nan, E4M3_NAN, codes).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    else:
        return b.to(tl.float8e4nv)


@triton.jit
def dot_operand(b, ROUND_IN_FP32: tl.constexpr):
    """An e4m3 tile as the dot reads it: itself on a GPU; under the interpreter (ROUND_IN_FP32), decoded to fp32 by
    hand, since the interpreter's conversions and dots read e4m3fn's NaN code as 480 (finite values are exact in
    fp32, so the sums are those of the e4m3 dot)."""
    if ROUND_IN_FP32:
        codes = b.to(tl.uint8, bitcast=True)
        nan = tl.full(b.shape, NAN_BITS, tl.uint32).to(tl.float32, bitcast=True)
        return tl.where((codes & 0x7F) == E4M3_NAN, nan, b.to(tl.float32))
    else:
        return b


@triton.jit
def quantize_rows(b, fp8_max, ROUND_IN_FP32: tl.constexpr):
    """[M, G] fp32 -> (e4m3 [M, G], scale [M]): one scale per row, amax / fp8_max, so b ≈ q * scale."""
    amax = tl.maximum(tl.max(tl.abs(b), axis=1), MIN_AMAX)
    return to_fp8(b * (fp8_max / amax)[:, None], fp8_max, ROUND_IN_FP32), amax / fp8_max


@triton.jit
def quantize_groups(b, fp8_max, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                    ROUND_IN_FP32: tl.constexpr):
    """[BLOCK_M, BLOCK_N] fp32 -> (e4m3 [BLOCK_M, BLOCK_N], scale [BLOCK_M, BLOCK_N // GROUP]): one scale per row and
    GROUP consecutive columns."""
    b3 = tl.reshape(b, (BLOCK_M, BLOCK_N // GROUP, GROUP))
    amax = tl.maximum(tl.max(tl.abs(b3), axis=2), MIN_AMAX)  # [BLOCK_M, BLOCK_N // GROUP]
    b = tl.reshape(b3 * (fp8_max / amax)[:, :, None], (BLOCK_M, BLOCK_N))
    return to_fp8(b, fp8_max, ROUND_IN_FP32), amax / fp8_max


@triton.jit
def row_scales(b_a_s, SWAP_AB: tl.constexpr):
    """The per-row activation scales b_a_s [BLOCK_M] broadcast over the accumulator: [BLOCK_M, 1], or [1, BLOCK_M]
    when the accumulator is transposed (SWAP_AB)."""
    if SWAP_AB:
        return b_a_s[None, :]
    else:
        return b_a_s[:, None]


@triton.jit
def scaled_dot(b_acc, b_a, b_w, b_a_s, b_w_s, ROW_SCALE: tl.constexpr, COLUMN_SCALE: tl.constexpr,
               BLOCK_K: tl.constexpr, ROUND_IN_FP32: tl.constexpr, SWAP_AB: tl.constexpr):
    """b_acc + (b_a @ b_w) times this K step's scales: b_a_s [BLOCK_M] per row, b_w_s a scalar or [1, BLOCK_N].
    Without scales the dot accumulates in place, its fp8 sums promoted to fp32 every BLOCK_K products. A NaN operand
    (`to_fp8`'s NaN and inf) makes its row or column NaN (`dot_operand` under the interpreter).

    SWAP_AB: b_acc is the transposed tile [BLOCK_N, BLOCK_M], summed as b_w^T @ b_a^T, and b_w_s a scalar or
    [BLOCK_N, 1] (`load_block_scale`'s SWAP_AB form). For tiles of fewer than 64 rows: the weights' columns then fill
    the 64-row side of the Hopper FP8 MMA (wgmma), the few token rows its narrow side (8 to 256 wide), where unswapped
    such a tile runs on the older mma.sync with its fp8 operands converted to fp16. Both operands stay K-major (the
    transposes are views of the loaded tiles), as FP8 wgmma requires; the sums are the same products in the same K
    steps."""
    b_a, b_w = dot_operand(b_a, ROUND_IN_FP32), dot_operand(b_w, ROUND_IN_FP32)
    if SWAP_AB:
        lhs = tl.trans(b_w)
        rhs = tl.trans(b_a)
    else:
        lhs = b_a
        rhs = b_w
    if ROW_SCALE and COLUMN_SCALE:
        return b_acc + tl.dot(lhs, rhs) * (row_scales(b_a_s, SWAP_AB) * b_w_s)
    elif ROW_SCALE:
        return b_acc + tl.dot(lhs, rhs) * row_scales(b_a_s, SWAP_AB)
    elif COLUMN_SCALE:
        return b_acc + tl.dot(lhs, rhs) * b_w_s
    else:
        return tl.dot(lhs, rhs, b_acc, max_num_imprecise_acc=BLOCK_K)


@triton.jit
def block_scale_offsets(pid_n, offs_n, row_step, row_offset, stride_n, block_n, UNIFORM: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """Offsets of each tile column's block-scale row (stride_n units): a scalar when the whole tile lies in one
    block row (UNIFORM), else [BLOCK_N] int32. Column j of the view is row j * row_step + row_offset."""
    if UNIFORM:
        return ((pid_n * BLOCK_N * row_step + row_offset) // block_n) * stride_n
    else:
        return ((offs_n * row_step + row_offset) // block_n) * stride_n


@triton.jit
def load_block_scale(base, offs, mask_n, WEIGHT_SCALE: tl.constexpr, UNIFORM: tl.constexpr,
                     SWAP_AB: tl.constexpr):
    """This K step's block scale of the tile's columns: a scalar (UNIFORM), [1, BLOCK_N] ([BLOCK_N, 1] for the
    transposed accumulator of SWAP_AB), or 1.0 for other schemes."""
    if WEIGHT_SCALE != SCALE_BLOCK:
        return 1.0
    elif UNIFORM:
        return scale_values(tl.load(base + offs))
    elif SWAP_AB:
        return scale_values(tl.load(base + offs, mask=mask_n, other=0))[:, None]
    else:
        return scale_values(tl.load(base + offs, mask=mask_n, other=0))[None, :]


@triton.jit
def w8a8_tile_dot(b_acc, b_acc_up, a_ptrs, a_s_ptrs, a_static, w_ptrs, w_up_ptrs, s_base, s_offs, s_up_offs,
                  mask_m, mask_n, K, stride_a_k, stride_w_k, stride_s_k, scale_block_k, fp8_max,
                  GATED: tl.constexpr, A_QUANT: tl.constexpr, WEIGHT_SCALE: tl.constexpr, SCALE_UNIFORM: tl.constexpr,
                  ROUND_IN_FP32: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr,
                  SWAP_AB: tl.constexpr):
    """The K loop: b_acc += A[rows, :K] @ W[:K, cols] on e4m3 operands (b_acc_up with the up weights when GATED);
    with SWAP_AB the accumulators are the transposed tiles [BLOCK_N, BLOCK_M] (`scaled_dot`).

    a_ptrs [BLOCK_M, BLOCK_K] and w_ptrs [BLOCK_K, BLOCK_N] point at k = 0; a_s_ptrs [BLOCK_M] at each row's first
    group scale (A_QUANT FP8_GROUPS); block scales (WEIGHT_SCALE BLOCK) at s_base + s_offs / s_up_offs
    (`block_scale_offsets`) for the K block at k = 0. Static scales (a_static, channel / tensor weight scales) are
    left for the caller to apply after the loop.
    """
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        a_mask, w_mask = step_masks(offs_k, k0, K, mask_m, mask_n, EVEN_K)
        b_a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        # this K step's row scales [BLOCK_M] (dynamic activations) and column scales [BLOCK_N] (block weights)
        if A_QUANT == A_DYNAMIC:
            b_a, b_a_s = quantize_rows(b_a.to(tl.float32), fp8_max, ROUND_IN_FP32)
        elif A_QUANT == A_STATIC:
            b_a = to_fp8(b_a.to(tl.float32) / a_static, fp8_max, ROUND_IN_FP32)
            b_a_s = 1.0
        elif A_QUANT == A_FP8_GROUPS:
            b_a_s = tl.load(a_s_ptrs + k0 // BLOCK_K, mask=mask_m, other=0.0)
        else:
            b_a_s = 1.0
        # the K step lies inside one weight block: BLOCK_K divides scale_block_k
        b_w_s = load_block_scale(s_base + (k0 // scale_block_k) * stride_s_k, s_offs, mask_n, WEIGHT_SCALE,
                                 SCALE_UNIFORM, SWAP_AB)
        b_w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        b_acc = scaled_dot(b_acc, b_a, b_w, b_a_s, b_w_s, A_QUANT == A_DYNAMIC or A_QUANT == A_FP8_GROUPS,
                           WEIGHT_SCALE == SCALE_BLOCK, BLOCK_K, ROUND_IN_FP32, SWAP_AB)
        if GATED:
            b_wu_s = load_block_scale(s_base + (k0 // scale_block_k) * stride_s_k, s_up_offs, mask_n, WEIGHT_SCALE,
                                      SCALE_UNIFORM, SWAP_AB)
            b_wu = tl.load(w_up_ptrs, mask=w_mask, other=0.0)
            b_acc_up = scaled_dot(b_acc_up, b_a, b_wu, b_a_s, b_wu_s, A_QUANT == A_DYNAMIC or A_QUANT == A_FP8_GROUPS,
                                  WEIGHT_SCALE == SCALE_BLOCK, BLOCK_K, ROUND_IN_FP32, SWAP_AB)
            w_up_ptrs += BLOCK_K * stride_w_k
        a_ptrs += BLOCK_K * stride_a_k
        w_ptrs += BLOCK_K * stride_w_k
    return b_acc, b_acc_up


@triton.jit
def w8a8_epilogue(b_acc, b_acc_up, expert, offs_m, mask_m, pid_n, offs_n, mask_n, b_assignment, a_static, s_base,
                  stride_s_n, scale_row_step, scale_up_row_offset, bias_ptr, bias_up_ptr, stride_bias_e, stride_bias_n,
                  c_ptr, stride_c_m, stride_c_n, c_scale_ptr, stride_c_scale_e, stride_c_scale_m, n_cols,
                  topk_weights_ptr, stride_topk_t, stride_topk_k, alpha, limit, fp8_max,
                  TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
                  MUL_ROUTED_WEIGHT: tl.constexpr, A_QUANT: tl.constexpr, WEIGHT_SCALE: tl.constexpr,
                  QUANT_OUT: tl.constexpr, OUT_GROUP: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """After the K loop of a w8a8 kernel (pointer or persistent, so both round alike): channel / tensor weight scales
    (s_base: the expert's scales) and the static activation scale a_static multiply the sums, then bias, activation,
    routing weight, and the masked store of the C tile in QUANT_OUT's form (rows outside mask_m never written)."""
    if WEIGHT_SCALE == SCALE_TENSOR or WEIGHT_SCALE == SCALE_CHANNEL:  # (stride_s_n = 0 per tensor) after the loop
        scale_rows = offs_n * scale_row_step
        b_acc *= scale_values(tl.load(s_base + scale_rows * stride_s_n, mask=mask_n, other=0))[None, :]
        if ACTIVATION != ACT_NONE:
            b_acc_up *= scale_values(tl.load(s_base + (scale_rows + scale_up_row_offset) * stride_s_n, mask=mask_n,
                                             other=0))[None, :]
    if A_QUANT == A_STATIC or A_QUANT == A_FP8_STATIC:
        b_acc *= a_static
        b_acc_up *= a_static

    if HAS_BIAS:
        b_acc, b_acc_up = add_bias(b_acc, b_acc_up, expert, offs_n, mask_n, bias_ptr, bias_up_ptr, stride_bias_e,
                                   stride_bias_n, ACTIVATION)
    b_acc = activate_and_weight(b_acc, b_acc_up, b_assignment, mask_m, topk_weights_ptr, stride_topk_t, stride_topk_k,
                                alpha, limit, TOP_K, ACTIVATION, MUL_ROUTED_WEIGHT)

    mask_mn = mask_m[:, None] & mask_n[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_c_m + offs_n[None, :] * stride_c_n
    if QUANT_OUT == OUT_DYNAMIC:
        # Columns past n_cols hold zeros (their weights and biases were read as 0), so they never raise an amax.
        b_q, b_q_s = quantize_groups(b_acc, fp8_max, BLOCK_M, BLOCK_N, OUT_GROUP, ROUND_IN_FP32)
        tl.store(c_ptrs, b_q, mask=mask_mn)
        offs_g = pid_n * (BLOCK_N // OUT_GROUP) + tl.arange(0, BLOCK_N // OUT_GROUP)
        c_s_ptrs = c_scale_ptr + offs_m[:, None].to(tl.int64) * stride_c_scale_m + offs_g[None, :]
        tl.store(c_s_ptrs, b_q_s, mask=mask_m[:, None] & (offs_g < tl.cdiv(n_cols, OUT_GROUP))[None, :])
    elif QUANT_OUT == OUT_STATIC:
        c_static = tl.load(c_scale_ptr + expert * stride_c_scale_e)
        tl.store(c_ptrs, to_fp8(b_acc / c_static, fp8_max, ROUND_IN_FP32), mask=mask_mn)
    else:
        tl.store(c_ptrs, b_acc.to(c_ptr.dtype.element_ty), mask=mask_mn)
