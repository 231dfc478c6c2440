"""The Triton device functions every grouped-GEMM kernel of the package is built from (the kernels floor: `@triton.jit`
code only, importing nothing of the package but the WEIGHT_SCALE codes, formats/scale_codes.py): the tile walk
(`tile_coords`, `tile_setup`, `tile_setup_at`), gathered row indices, the K loop with float or float8-dequantized
weights (`tile_dot`, `expert_tile_dot`, `load_weight_tile`, `weight_scale_ptrs`, `scale_sums`, `step_masks`), and the
epilogue (`add_bias`, `apply_activation`, `activate_and_weight`, `tile_epilogue`). The kernels that use them:
gemm/grouped.py, gemm/persistent.py, gemm/decode.py, backward/experts.py, backward/weight_grads.py, gemm/w8a8.py /
gemm/w8a8_jit.py / gemm/w8a8_persistent.py. Index bounds: see gemm/grouped.py's module doc.

Also the codes of the two constexprs every GEMM kernel branches on, ACTIVATION (`Activation`, here) and WEIGHT_SCALE
(`WeightScaleCode`, in formats/scale_codes.py beside the weight formats that name it). Launchers pass `int(member)`; jit
code compares with the `tl.constexpr` aliases below (a kernel may read a module global only when it is a
`tl.constexpr`: Triton's GPU compiler refuses an enum class).
"""

import enum

import triton
import triton.language as tl

from ..formats.scale_codes import WeightScaleCode


class Activation(enum.IntEnum):
    """The ACTIVATION constexpr: what the epilogue makes of the sums. Gated members (all but NONE) load two weight
    tiles per K step, gate columns and up columns, against the same A tile."""

    NONE = 0  # the sums as they are, one weight (GEMM2, the v1 grouped GEMM)
    SILU = 1  # silu(gate) * up
    # GPT-OSS's clamped SwiGLU: (up + 1) * gate * sigmoid(alpha * gate), gate clamped above at limit and up to
    # [-limit, limit] first
    SWIGLU_OAI = 2

    @classmethod
    def of(cls, name: str) -> "Activation":
        """The member of an activation name: "none", "silu" or "swiglu_oai"."""
        return cls[name.upper()]


ACT_NONE = tl.constexpr(Activation.NONE.value)
ACT_SILU = tl.constexpr(Activation.SILU.value)
SCALE_NONE = tl.constexpr(WeightScaleCode.NONE.value)
SCALE_TENSOR = tl.constexpr(WeightScaleCode.TENSOR.value)
SCALE_CHANNEL = tl.constexpr(WeightScaleCode.CHANNEL.value)
SCALE_BLOCK = tl.constexpr(WeightScaleCode.BLOCK.value)
SCALE_BLOCK_STEP = tl.constexpr(WeightScaleCode.BLOCK_STEP.value)
SCALE_MXFP4 = tl.constexpr(WeightScaleCode.MXFP4.value)
SCALE_MXFP4_N = tl.constexpr(WeightScaleCode.MXFP4_N.value)
SCALE_MXFP4_BF16X2 = tl.constexpr(WeightScaleCode.MXFP4_BF16X2.value)
MXFP4_GROUP = tl.constexpr(32)  # K values per e8m0 scale (mxfp4.MXFP4_GROUP)
# fp32 bit pattern of 2^-127 (e8m0 code 0), and 2^126: e2m1's bits placed at fp32's lowest exponent bits read the
# value times 2^-126 (`e2m1_to_f32`)
F32_2_POW_M127_BITS = tl.constexpr(0x00400000)
F32_2_POW_126 = tl.constexpr(2.0 ** 126)
# fp32 NaN as bits: a float NaN constexpr would not equal itself, which Triton's check that every jit function sees
# one value of a global refuses when compiling for a GPU
NAN_BITS = tl.constexpr(0x7FC00000)
# MXFP4 tiles of at least this many rows dot A as the MMA's first operand and the decoded weight as its second (read
# from shared memory); smaller ones swap them (`mxfp4_tile_dot`). H100, GPT-OSS widths, GEMM1: 128-row tiles 1.6x
# faster that way (docs/performance.md, "MXFP4 experts").
MXFP4_A_LHS_MIN_ROWS = tl.constexpr(128)
# Four MXFP4 bytes (eight e2m1 codes) per block, `e2m1_bf16x2`. prmt spreads bytes (0, 1) and (2, 3) into the two
# 16-bit halves of a register; each nibble's magnitude bits go to bf16's two lowest exponent bits and its top mantissa
# bit and its sign to bit 15, which reads as the e2m1 value times 2^-126 (0.5 as a subnormal); an fma by 2^126
# (0x7E80) makes it exact, a second one applies the group's bf16 scale (-0.0 added: the product's sign kept). Outputs
# $0, $1: the low nibbles of bytes (0, 1), (2, 3); $2, $3: the high nibbles. Inputs: $4 the bytes, $5 and $6 the
# scales of bytes (0, 1) and (2, 3).
E2M1_BF16X2_PTX = tl.constexpr("""
{
.reg .b32 t0, t1, u, v, c126, nz;
mov.b32 c126, 0x7E807E80;
mov.b32 nz, 0x80008000;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
and.b32 u, t0, 0x00070007; shl.b32 u, u, 6; and.b32 v, t0, 0x00080008; shl.b32 v, v, 12; or.b32 u, u, v;
fma.rn.bf16x2 u, u, c126, nz; fma.rn.bf16x2 $0, u, $5, nz;
and.b32 u, t1, 0x00070007; shl.b32 u, u, 6; and.b32 v, t1, 0x00080008; shl.b32 v, v, 12; or.b32 u, u, v;
fma.rn.bf16x2 u, u, c126, nz; fma.rn.bf16x2 $1, u, $6, nz;
and.b32 u, t0, 0x00700070; shl.b32 u, u, 2; and.b32 v, t0, 0x00800080; shl.b32 v, v, 8; or.b32 u, u, v;
fma.rn.bf16x2 u, u, c126, nz; fma.rn.bf16x2 $2, u, $5, nz;
and.b32 u, t1, 0x00700070; shl.b32 u, u, 2; and.b32 v, t1, 0x00800080; shl.b32 v, v, 8; or.b32 u, u, v;
fma.rn.bf16x2 u, u, c126, nz; fma.rn.bf16x2 $3, u, $6, nz;
}
""")


class StepDot(enum.IntEnum):
    """The STEP_DOT constexpr of `tile_dot`: how a K step of float8 weights meets A's tile (float weights ignore it)."""

    # the weight tile converted to A's dtype, block scales multiplied into it first in fp32 (one chain of dots into
    # the accumulator: what the wgmma kernels need)
    SCALED_TILE = 0
    # float16 dots for mma.sync tiles (decode), which wait on each dot anyway: the weight tile converted to fp16
    # unscaled (exact: e4m3 fits; one instruction per two elements on sm_89+, -> bf16 takes three), each step's A
    # rows scaled by a power of two that brings their largest magnitude to [2^13, 2^14] before the fp16 conversion
    # (11 mantissa bits, no overflow whatever A's range), each step's dot into a fresh fp32 sum times the inverse
    # and the step's column scales (BLOCK_STEP) before it joins the accumulator. (The same with the tile converted to
    # bf16 and A as it is measured slower on the H200 than SCALED_TILE: the bf16 conversion is the costly part.)
    F16_SUMS = 1


STEP_SCALED_TILE = tl.constexpr(StepDot.SCALED_TILE.value)


@triton.jit
def apply_activation(b_gate, b_up, alpha, limit, ACTIVATION: tl.constexpr):
    if ACTIVATION == ACT_SILU:
        return b_gate * tl.sigmoid(b_gate) * b_up
    else:
        # NaN-propagating clamps (Triton's default min / max return the other operand): a NaN stays NaN, as in
        # torch.clamp; +-inf are clamped
        b_gate = tl.minimum(b_gate, limit, propagate_nan=tl.PropagateNan.ALL)
        b_up = tl.minimum(tl.maximum(b_up, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                          propagate_nan=tl.PropagateNan.ALL)
        return (b_up + 1.0) * b_gate * tl.sigmoid(alpha * b_gate)


@triton.jit
def tile_coords(pid, n_cols, max_tiles, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (row tile, column tile), walking GROUP_M row tiles per column tile (L2 reuse of weights)."""
    num_pid_n = tl.cdiv(n_cols, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_m = (pid // num_pid_in_group) * GROUP_M
    group_size = min(max_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % num_pid_in_group) % group_size
    pid_n = (pid % num_pid_in_group) // group_size
    return pid_m, pid_n


@triton.jit
def tile_setup(tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, num_rows, n_cols, E, max_tiles,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output tile over the tile map: (expert, -1 for a sentinel tile or one naming no expert in
    [0, E); sorted positions and their mask, inside the expert and inside C; column tile, columns and their mask)."""
    return tile_setup_at(tl.program_id(0), tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, num_rows, n_cols,
                         E, max_tiles, BLOCK_M, BLOCK_N, GROUP_M)


@triton.jit
def tile_setup_at(tile_id, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, num_rows, n_cols, E, max_tiles,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """`tile_setup` for output tile `tile_id` (persistent kernels walk several)."""
    pid_m, pid_n = tile_coords(tile_id, n_cols, max_tiles, BLOCK_N, GROUP_M)
    expert = tl.load(tile_expert_ptr + pid_m)
    expert = tl.where((expert >= 0) & (expert < E), expert, -1)
    row_start = tl.load(tile_row_start_ptr + pid_m)
    row_end = tl.minimum(tl.load(expert_offsets_ptr + tl.maximum(expert, 0) + 1), num_rows)
    offs_m = row_start + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, offs_m, (offs_m >= 0) & (offs_m < row_end), pid_n, offs_n, offs_n < n_cols


@triton.jit
def gathered_rows(gather_idx_ptr, offs_m, mask_m, num_tokens, TOP_K: tl.constexpr):
    """Token row of each sorted position (gather_idx[p] // TOP_K) and the mask of those inside [0, num_tokens)."""
    b_assignment = tl.load(gather_idx_ptr + offs_m, mask=mask_m, other=-1)
    b_token = b_assignment // TOP_K
    mask = mask_m & (b_assignment >= 0) & (b_token < num_tokens)
    return tl.where(mask, b_token, 0), tl.where(mask, b_assignment, 0), mask


@triton.jit
def scale_values(b_scale):
    """fp32 weight scales as loaded: float32 as they are, e8m0 codes (uint8: float8_e8m0fnu scales, passed as their
    uint8 view) as 2^(code - 127) (`e8m0_to_f32`)."""
    if b_scale.dtype == tl.uint8:
        return e8m0_to_f32(b_scale)
    else:
        return b_scale


@triton.jit
def load_weight_tile(w_ptrs, w_mask, mask_n, s_ptrs, k0, offs_k, stride_s_k, scale_block_k, a_ptrs,
                     DOT_FP32: tl.constexpr, WEIGHT_SCALE: tl.constexpr):
    """A [BLOCK_K, BLOCK_N] weight tile ready for the dot with A: fp8 tiles converted to A's dtype, block-scaled
    ones first multiplied by the scale of their block (s_ptrs [BLOCK_N]: each column's scale row at k = 0). With
    BLOCK_STEP the K step lies inside one scale block (BLOCK_K divides the block's K side): one [BLOCK_N] scale
    vector per step; BLOCK loads a scale per element (any block shape)."""
    b_w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    if WEIGHT_SCALE == SCALE_BLOCK_STEP:
        b_s = scale_values(tl.load(s_ptrs + (k0 // scale_block_k) * stride_s_k, mask=mask_n, other=0))
        b_w = (b_w.to(tl.float32) * b_s[None, :]).to(a_ptrs.dtype.element_ty)
    elif WEIGHT_SCALE == SCALE_BLOCK:
        b_s = scale_values(tl.load(s_ptrs[None, :] + (offs_k // scale_block_k)[:, None] * stride_s_k, mask=w_mask,
                                   other=0))
        b_w = (b_w.to(tl.float32) * b_s).to(a_ptrs.dtype.element_ty)
    elif WEIGHT_SCALE != SCALE_NONE:
        b_w = b_w.to(a_ptrs.dtype.element_ty)
    if DOT_FP32:
        b_w = b_w.to(tl.float32)
    return b_w


@triton.jit
def weight_scale_ptrs(scale_ptr, expert, offs_n, stride_scale_e, stride_scale_n, scale_row_step, scale_up_row_offset,
                      scale_block_n, WEIGHT_SCALE: tl.constexpr):
    """(s_ptrs, s_up_ptrs) [BLOCK_N]: each column's scale row of the gate (and up) view at k = 0 for the dequant
    path's WEIGHT_SCALE codes other than NONE. Column j of a view is row j * scale_row_step (+ scale_up_row_offset) of
    the unsplit weight; block scales divide it by scale_block_n. Callers with float weights (NONE, scale_ptr
    None) pass scale_ptr on themselves: Triton 3.6 cannot return None from a jit function (its interpreter can)."""
    scale_rows = offs_n * scale_row_step  # [BLOCK_N] rows of the unsplit weight
    scale_up_rows = scale_rows + scale_up_row_offset
    if WEIGHT_SCALE == SCALE_BLOCK or WEIGHT_SCALE == SCALE_BLOCK_STEP:
        scale_rows = scale_rows // scale_block_n
        scale_up_rows = scale_up_rows // scale_block_n
    s_ptrs = scale_ptr + expert.to(tl.int64) * stride_scale_e + scale_rows * stride_scale_n
    s_up_ptrs = scale_ptr + expert.to(tl.int64) * stride_scale_e + scale_up_rows * stride_scale_n
    return s_ptrs, s_up_ptrs


@triton.jit
def scale_sums(b_acc, b_acc_up, s_ptrs, s_up_ptrs, mask_n, GATED: tl.constexpr, WEIGHT_SCALE: tl.constexpr):
    """Per-tensor (stride_scale_n = 0) and per-channel scales (WEIGHT_SCALE TENSOR, CHANNEL) multiply the
    [.., BLOCK_N] sums once after the K loop; other codes return them as they are."""
    if WEIGHT_SCALE == SCALE_TENSOR or WEIGHT_SCALE == SCALE_CHANNEL:
        b_acc *= scale_values(tl.load(s_ptrs, mask=mask_n, other=0))[None, :]
        if GATED:
            b_acc_up *= scale_values(tl.load(s_up_ptrs, mask=mask_n, other=0))[None, :]
    return b_acc, b_acc_up


@triton.jit
def step_masks(offs_k, k0, K, mask_m, mask_n, EVEN_K: tl.constexpr):
    """(A's mask [BLOCK_M, 1 or BLOCK_K], W's mask [1 or BLOCK_K, BLOCK_N]) of the K step at k0: rows and columns
    only when K has no tail (EVEN_K), else also the K columns past the end."""
    if EVEN_K:
        a_mask = mask_m[:, None]
        w_mask = mask_n[None, :]
    else:
        mask_k = offs_k < K - k0
        a_mask = mask_m[:, None] & mask_k[None, :]
        w_mask = mask_k[:, None] & mask_n[None, :]
    return a_mask, w_mask


@triton.jit
def tile_dot(b_acc, b_acc_up, a_ptrs, w_ptrs, w_up_ptrs, mask_m, mask_n, K, stride_a_k, stride_w_k,
              GATED: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
              BLOCK_K: tl.constexpr, s_ptrs=None, s_up_ptrs=None, stride_s_k=0, scale_block_k=1,
              WEIGHT_SCALE: tl.constexpr = SCALE_NONE, STEP_DOT: tl.constexpr = STEP_SCALED_TILE):
    """The K loop: b_acc += A[rows, :K] @ W[:K, cols] (and b_acc_up with the up weights when GATED).

    a_ptrs [BLOCK_M, BLOCK_K] and w_ptrs [BLOCK_K, BLOCK_N] point at k = 0; rows/columns outside the masks read 0.
    Block-scaled fp8 weights (WEIGHT_SCALE BLOCK or BLOCK_STEP) also take s_ptrs / s_up_ptrs, see `load_weight_tile`;
    STEP_DOT (`StepDot`) says how a float8 step is dotted (BLOCK takes SCALED_TILE only).
    """
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        a_mask, w_mask = step_masks(offs_k, k0, K, mask_m, mask_n, EVEN_K)
        b_a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        if STEP_DOT == STEP_SCALED_TILE or WEIGHT_SCALE == SCALE_NONE or WEIGHT_SCALE == SCALE_BLOCK:
            b_w = load_weight_tile(w_ptrs, w_mask, mask_n, s_ptrs, k0, k0 + offs_k, stride_s_k, scale_block_k, a_ptrs,
                                   DOT_FP32, WEIGHT_SCALE)
            if DOT_FP32:
                b_a = b_a.to(tl.float32)
            b_acc = tl.dot(b_a, b_w, b_acc, input_precision=DOT_PRECISION)
            if GATED:
                b_wu = load_weight_tile(w_up_ptrs, w_mask, mask_n, s_up_ptrs, k0, k0 + offs_k, stride_s_k,
                                        scale_block_k, a_ptrs, DOT_FP32, WEIGHT_SCALE)
                b_acc_up = tl.dot(b_a, b_wu, b_acc_up, input_precision=DOT_PRECISION)
        else:
            b_acc, b_acc_up = f16_sums_step(b_acc, b_acc_up, b_a, w_ptrs, w_up_ptrs, w_mask, mask_n, s_ptrs, s_up_ptrs,
                                            k0, stride_s_k, scale_block_k, GATED, WEIGHT_SCALE)
        if GATED:
            w_up_ptrs += BLOCK_K * stride_w_k
        a_ptrs += BLOCK_K * stride_a_k
        w_ptrs += BLOCK_K * stride_w_k
    return b_acc, b_acc_up


@triton.jit
def f16_sums_step(b_acc, b_acc_up, b_a, w_ptrs, w_up_ptrs, w_mask, mask_n, s_ptrs, s_up_ptrs, k0, stride_s_k,
                  scale_block_k, GATED: tl.constexpr, WEIGHT_SCALE: tl.constexpr):
    """One K step of float8 weights under StepDot F16_SUMS (see there): the accumulators plus the step's fp16 dots of
    A's tile b_a, its rows rescaled, with the unscaled weight tiles, scaled after the dot by the inverse of A's row
    factors (and BLOCK_STEP's column scales; other scale codes apply theirs after the K loop). The factors come from
    this step's tile: one pass over each row first, to scale the whole loop with one factor per row, measured 4-28%
    slower on the H200's decode shapes."""
    b_af = b_a.to(tl.float32)
    # A NaN in a row keeps the row's dots NaN (it is multiplied, never dropped); an all-zero row takes 2^126
    exponent = tl.clamp(14.0 - tl.ceil(tl.log2(tl.max(tl.abs(b_af), axis=1))), -126.0, 126.0)
    b_a = (b_af * tl.exp2(exponent)[:, None]).to(tl.float16)
    b_row_scale = tl.exp2(-exponent)[:, None]  # [BLOCK_M, 1]
    b_w = tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float16)
    b_step = tl.dot(b_a, b_w) * b_row_scale
    if WEIGHT_SCALE == SCALE_BLOCK_STEP:
        b_step *= scale_values(tl.load(s_ptrs + (k0 // scale_block_k) * stride_s_k, mask=mask_n, other=0))[None, :]
    b_acc += b_step
    if GATED:
        b_wu = tl.load(w_up_ptrs, mask=w_mask, other=0.0).to(tl.float16)
        b_step_up = tl.dot(b_a, b_wu) * b_row_scale
        if WEIGHT_SCALE == SCALE_BLOCK_STEP:
            b_step_up *= scale_values(tl.load(s_up_ptrs + (k0 // scale_block_k) * stride_s_k, mask=mask_n,
                                              other=0))[None, :]
        b_acc_up += b_step_up
    return b_acc, b_acc_up


@triton.jit
def e2m1_to_f32(b_codes):
    """fp32 values of e2m1 codes (the low 4 bits of b_codes, any unsigned int type): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and
    their negatives, in five integer operations and one multiply. The magnitude bits (exponent e, mantissa m) go to
    fp32's two lowest exponent bits and its top mantissa bit, the sign to bit 31: as fp32 that reads
    2^(e - 127) (1 + m / 2) for e >= 1 and, for e = 0, the subnormal m 2^-127, which is the e2m1 value times 2^-126
    in every case; the multiply by 2^126 is exact (no select per value; subnormals are kept: Triton flushes them only
    inside libdevice calls)."""
    b_codes = b_codes.to(tl.uint32)
    b_bits = ((b_codes & 7) << 22) | ((b_codes & 8) << 28)
    return b_bits.to(tl.float32, bitcast=True) * F32_2_POW_126


@triton.jit
def e8m0_to_f32(b_codes):
    """2^(code - 127) in fp32 of e8m0 scale codes (uint8): code << 23 is the fp32 exponent field for codes 1..254,
    code 0 is the subnormal 2^-127, 0xFF is NaN."""
    b_codes = b_codes.to(tl.uint32)
    b_bits = tl.where(b_codes == 0, F32_2_POW_M127_BITS, tl.where(b_codes == 255, NAN_BITS, b_codes << 23))
    return b_bits.to(tl.float32, bitcast=True)


@triton.jit
def e8m0_to_bf16(b_codes):
    """2^(code - 127) in bf16 of e8m0 scale codes (uint8): code << 7 is bf16's exponent field for codes 1..254, code
    0 is the subnormal 2^-127 (0x0040), 0xFF NaN (0x7FC0)."""
    b_codes = b_codes.to(tl.uint16)
    b_bits = tl.where(b_codes == 0, 0x0040, tl.where(b_codes == 255, 0x7FC0, b_codes << 7)).to(tl.uint16)
    return b_bits.to(tl.bfloat16, bitcast=True)


@triton.jit
def e2m1_bf16x2(b_bytes, b_scale):
    """(low-nibble values, high-nibble values) in bf16 of MXFP4 bytes (uint8) times each byte's bf16 scale (same
    shape), four bytes per block of E2M1_BF16X2_PTX (NVIDIA sm_80 and later; never on the interpreter)."""
    return tl.inline_asm_elementwise(E2M1_BF16X2_PTX, "=r,=r,=r,=r,r,r,r", [b_bytes, b_scale],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def mxfp4_weight_tile(w_ptrs, s_ptrs, mask_n, k_left, a_dtype, BF16X2: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight values [BLOCK_N, BLOCK_K] in a_dtype and K order, from MXFP4 bytes w_ptrs [BLOCK_N, BLOCK_K / 2]
    (byte j of a row: K index 2j in the low nibble, 2j + 1 in the high) times the e8m0 scales at s_ptrs [BLOCK_N,
    BLOCK_K / 32] (one per 16 bytes); k_left values of K remain from this step on (a multiple of 32), the rest read as
    zero. BF16X2 (a_dtype bf16): `e2m1_bf16x2`; else each value in fp32 (`e2m1_to_f32`) times its scale, converted."""
    offs_byte = tl.arange(0, BLOCK_K // 2)
    offs_group = tl.arange(0, BLOCK_K // MXFP4_GROUP)
    # masked by whole groups (k_left is a multiple of 32): the mask is constant over each group's 16 bytes, so a
    # thread's 16 bytes of a row load as one 128-bit vector (a mask by bytes allows 8)
    b_bytes = tl.load(w_ptrs, mask=mask_n[:, None] & (offs_byte[None, :] // (MXFP4_GROUP // 2) < k_left // MXFP4_GROUP),
                      other=0)
    b_codes = tl.load(s_ptrs, mask=mask_n[:, None] & (offs_group[None, :] < k_left // MXFP4_GROUP), other=0)
    rows: tl.constexpr = b_bytes.shape[0]
    if BF16X2:
        b_scale = tl.broadcast_to(e8m0_to_bf16(b_codes)[:, :, None], (rows, BLOCK_K // MXFP4_GROUP, MXFP4_GROUP // 2))
        b_lo, b_hi = e2m1_bf16x2(b_bytes, tl.reshape(b_scale, (rows, BLOCK_K // 2)))
    else:
        b_scale = tl.broadcast_to(e8m0_to_f32(b_codes)[:, :, None], (rows, BLOCK_K // MXFP4_GROUP, MXFP4_GROUP // 2))
        b_scale = tl.reshape(b_scale, (rows, BLOCK_K // 2))
        b_lo = (e2m1_to_f32(b_bytes) * b_scale).to(a_dtype)
        b_hi = (e2m1_to_f32(b_bytes >> 4) * b_scale).to(a_dtype)
    return tl.reshape(tl.join(b_lo, b_hi), (rows, BLOCK_K))


@triton.jit
def mxfp4_tile_dot(b_acc, b_acc_up, a_ptrs, w_ptr, w_up_ptr, s_ptrs, s_up_ptrs, offs_n, mask_m, mask_n, K, stride_a_k,
                   stride_w_n, stride_w_k, stride_s_k, GATED: tl.constexpr, DOT_FP32: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, BF16X2: tl.constexpr):
    """`tile_dot` for MXFP4 weights: w_ptr (w_up_ptr) at the expert's bytes [n, K / 2], s_ptrs (s_up_ptrs) [BLOCK_N]
    at each column's first scale code; K a multiple of 32 and of nothing else (the last step masked). Each K step
    decodes the weight tile in registers (`mxfp4_weight_tile`) and dots it whole against A's tile as loaded. Tiles of
    MXFP4_A_LHS_MIN_ROWS rows or more take A as the dot's first operand; smaller ones sum the transposed tile [BLOCK_N,
    rows] with the weight first (its rows fill the MMA's M side where A has few) and add its transpose at the end."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_byte = tl.arange(0, BLOCK_K // 2)
    offs_group = tl.arange(0, BLOCK_K // MXFP4_GROUP)
    w_offs = offs_n[:, None] * stride_w_n + offs_byte[None, :] * stride_w_k  # [BLOCK_N, BLOCK_K / 2]
    w_ptrs = w_ptr + w_offs
    w_up_ptrs = w_up_ptr + w_offs
    s_offs = offs_group[None, :] * stride_s_k
    s_tile_ptrs = s_ptrs[:, None] + s_offs  # [BLOCK_N, BLOCK_K / 32]
    s_up_tile_ptrs = s_up_ptrs[:, None] + s_offs
    a_dtype = tl.float32 if DOT_FP32 else a_ptrs.dtype.element_ty
    A_LHS: tl.constexpr = b_acc.shape[0] >= MXFP4_A_LHS_MIN_ROWS
    if A_LHS:
        b_sum = b_acc
        b_sum_up = b_acc_up
    else:
        b_sum = tl.zeros((b_acc.shape[1], b_acc.shape[0]), dtype=tl.float32)
        b_sum_up = tl.zeros((b_acc_up.shape[1], b_acc_up.shape[0]), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a_mask, _ = step_masks(offs_k, k0, K, mask_m, mask_n, EVEN_K)
        b_a = tl.load(a_ptrs, mask=a_mask, other=0.0).to(a_dtype)  # [rows, BLOCK_K]
        b_w = mxfp4_weight_tile(w_ptrs, s_tile_ptrs, mask_n, K - k0, a_dtype, BF16X2, BLOCK_K)
        if A_LHS:
            b_sum = tl.dot(b_a, tl.trans(b_w), b_sum, input_precision=DOT_PRECISION)
        else:
            b_sum = tl.dot(b_w, tl.trans(b_a), b_sum, input_precision=DOT_PRECISION)
        if GATED:
            b_w_up = mxfp4_weight_tile(w_up_ptrs, s_up_tile_ptrs, mask_n, K - k0, a_dtype, BF16X2, BLOCK_K)
            if A_LHS:
                b_sum_up = tl.dot(b_a, tl.trans(b_w_up), b_sum_up, input_precision=DOT_PRECISION)
            else:
                b_sum_up = tl.dot(b_w_up, tl.trans(b_a), b_sum_up, input_precision=DOT_PRECISION)
            w_up_ptrs += (BLOCK_K // 2) * stride_w_k
            s_up_tile_ptrs += (BLOCK_K // MXFP4_GROUP) * stride_s_k
        a_ptrs += BLOCK_K * stride_a_k
        w_ptrs += (BLOCK_K // 2) * stride_w_k
        s_tile_ptrs += (BLOCK_K // MXFP4_GROUP) * stride_s_k
    if A_LHS:  # one return: Triton builds the statements after a return in a constexpr branch too
        b_acc = b_sum
        b_acc_up = b_sum_up
    else:
        b_acc += tl.trans(b_sum)
        if GATED:
            b_acc_up += tl.trans(b_sum_up)
    return b_acc, b_acc_up


@triton.jit
def mxfp4_n_tile_dot(b_acc, a_ptrs, w_ptr, s_ptr, offs_n, mask_m, mask_n, K, stride_a_k, stride_w_n, stride_w_k,
                     stride_s_n, stride_s_k, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """b_acc + A @ W over all of K for an MXFP4 weight whose packed axis is the GEMM's N (SCALE_MXFP4_N): w_ptr and
    s_ptr at the expert's bytes and scale codes, byte j of row k holding columns 2j and 2j + 1 (stride_w_n per byte,
    stride_w_k per row), scale group g of row k columns [32 g, 32 g + 32); offs_n the tile's columns, starting on a
    scale group, mask_n whole groups (the packed axis is a multiple of 32)."""
    HALF: tl.constexpr = offs_n.shape[0] // 2
    n0 = tl.min(offs_n, axis=0)
    offs_k = tl.arange(0, BLOCK_K)
    offs_byte = n0 // 2 + tl.arange(0, HALF)
    offs_group = n0 // MXFP4_GROUP + tl.arange(0, HALF // (MXFP4_GROUP // 2))
    mask_pairs = tl.reshape(mask_n.to(tl.int32), (HALF, 2))
    mask_byte = tl.max(mask_pairs, axis=1) > 0
    mask_group = tl.max(tl.reshape(mask_pairs, (HALF // (MXFP4_GROUP // 2), MXFP4_GROUP)), axis=1) > 0
    w_ptrs = w_ptr + offs_k[:, None] * stride_w_k + offs_byte[None, :] * stride_w_n  # [BLOCK_K, BLOCK_N / 2]
    s_ptrs = s_ptr + offs_k[:, None] * stride_s_k + offs_group[None, :] * stride_s_n  # [BLOCK_K, BLOCK_N / 32]
    a_dtype = tl.float32 if DOT_FP32 else a_ptrs.dtype.element_ty
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a_mask, _ = step_masks(offs_k, k0, K, mask_m, mask_byte, EVEN_K)
        b_a = tl.load(a_ptrs, mask=a_mask, other=0.0).to(a_dtype)
        b_bytes = tl.load(w_ptrs, mask=mask_k[:, None] & mask_byte[None, :], other=0)
        b_codes = tl.load(s_ptrs, mask=mask_k[:, None] & mask_group[None, :], other=0)
        b_values = tl.join(e2m1_to_f32(b_bytes), e2m1_to_f32(b_bytes >> 4))  # [BLOCK_K, BLOCK_N / 2, 2]
        b_values = tl.reshape(b_values, (BLOCK_K, HALF // (MXFP4_GROUP // 2), MXFP4_GROUP))
        b_values = b_values * e8m0_to_f32(b_codes)[:, :, None]
        b_w = tl.reshape(b_values, (BLOCK_K, 2 * HALF)).to(a_dtype)
        b_acc = tl.dot(b_a, b_w, b_acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_a_k
        w_ptrs += BLOCK_K * stride_w_k
        s_ptrs += BLOCK_K * stride_s_k
    return b_acc


@triton.jit
def expert_tile_dot(b_acc, b_acc_up, a_ptrs, mask_m, mask_n, expert, offs_n, offs_k,
                    w_ptr, w_up_ptr, stride_w_e, stride_w_n, stride_w_k,
                    scale_ptr, stride_scale_e, stride_scale_n, stride_scale_k, scale_row_step, scale_up_row_offset,
                    scale_block_n, scale_block_k, K, stride_a_k,
                    GATED: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
                    BLOCK_K: tl.constexpr, WEIGHT_SCALE: tl.constexpr, STEP_DOT: tl.constexpr = STEP_SCALED_TILE):
    """b_acc (and b_acc_up, GATED) plus A @ W[expert]'s columns offs_n (and W_up's) over all of K, float8 weights
    scaled as the dequant path's WEIGHT_SCALE code says (per element or per K step in the loop, per column after it):
    everything on the weight side of a forward tile, shared by `_grouped_gemm_kernel` and gemm/decode.py's gate/up
    kernel. a_ptrs [rows, BLOCK_K] point at A's k = 0; scale_ptr is None for float weights."""
    # One expert's matrix stays below 2^31 elements: 64-bit only for the expert's base offset.
    expert_base = expert.to(tl.int64) * stride_w_e
    s_ptrs = scale_ptr
    s_up_ptrs = scale_ptr
    if WEIGHT_SCALE != SCALE_NONE:
        s_ptrs, s_up_ptrs = weight_scale_ptrs(scale_ptr, expert, offs_n, stride_scale_e, stride_scale_n,
                                              scale_row_step, scale_up_row_offset, scale_block_n, WEIGHT_SCALE)
    if WEIGHT_SCALE == SCALE_MXFP4_N:  # not gated: the backward's GEMMs
        b_acc = mxfp4_n_tile_dot(b_acc, a_ptrs, w_ptr + expert_base, scale_ptr + expert.to(tl.int64) * stride_scale_e,
                                 offs_n, mask_m, mask_n, K, stride_a_k, stride_w_n, stride_w_k,
                                 stride_scale_n, stride_scale_k, DOT_FP32, DOT_PRECISION, EVEN_K, BLOCK_K)
    elif WEIGHT_SCALE == SCALE_MXFP4 or WEIGHT_SCALE == SCALE_MXFP4_BF16X2:
        b_acc, b_acc_up = mxfp4_tile_dot(b_acc, b_acc_up, a_ptrs, w_ptr + expert_base, w_up_ptr + expert_base, s_ptrs,
                                         s_up_ptrs, offs_n, mask_m, mask_n, K, stride_a_k, stride_w_n, stride_w_k,
                                         stride_scale_k, GATED, DOT_FP32, DOT_PRECISION, EVEN_K, BLOCK_K,
                                         WEIGHT_SCALE == SCALE_MXFP4_BF16X2)
    else:
        w_offs = offs_n[None, :] * stride_w_n + offs_k[:, None] * stride_w_k  # [BLOCK_K, BLOCK_N]
        b_acc, b_acc_up = tile_dot(b_acc, b_acc_up, a_ptrs, w_ptr + expert_base + w_offs,
                                   w_up_ptr + expert_base + w_offs, mask_m, mask_n, K, stride_a_k, stride_w_k, GATED,
                                   DOT_FP32, DOT_PRECISION, EVEN_K, BLOCK_K, s_ptrs, s_up_ptrs, stride_scale_k,
                                   scale_block_k, WEIGHT_SCALE, STEP_DOT)
        b_acc, b_acc_up = scale_sums(b_acc, b_acc_up, s_ptrs, s_up_ptrs, mask_n, GATED, WEIGHT_SCALE)
    return b_acc, b_acc_up


@triton.jit
def gate_up_tile_dot(a_ptrs, mask_m, expert, pid_n, offs_n, mask_n, offs_k, n_cols,
                     w_ptr, w_up_ptr, stride_w_e, stride_w_n, stride_w_k,
                     scale_ptr, stride_scale_e, stride_scale_n, stride_scale_k, scale_row_step, scale_up_row_offset,
                     scale_block_n, scale_block_k, K, stride_a_k,
                     GATED: tl.constexpr, PAIRED: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     WEIGHT_SCALE: tl.constexpr, STEP_DOT: tl.constexpr = STEP_SCALED_TILE):
    """(b_acc, b_acc_up, offs_pair, mask_pair): `expert_tile_dot` over output tile pid_n's columns from fresh
    accumulators. PAIRED (an interleaved gate/up weight, w_ptr whole): b_acc [BLOCK_M, 2 BLOCK_N] holds the sums of
    columns offs_pair, gate and up alternating (`pair_columns`; `split_pairs` parts them), b_acc_up unused; else
    b_acc (and b_acc_up when GATED) [BLOCK_M, BLOCK_N] over columns offs_n, and offs_pair, mask_pair are offs_n,
    mask_n."""
    if PAIRED:
        offs_pair, mask_pair = pair_columns(pid_n, n_cols, BLOCK_N)
        b_acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    else:
        offs_pair, mask_pair = offs_n, mask_n
        b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # a paired weight is one tile of both halves: one dot, w_up_ptr unread
    b_acc, b_acc_up = expert_tile_dot(b_acc, b_acc, a_ptrs, mask_m, mask_pair, expert, offs_pair, offs_k,
                                      w_ptr, w_up_ptr, stride_w_e, stride_w_n, stride_w_k,
                                      scale_ptr, stride_scale_e, stride_scale_n, stride_scale_k, scale_row_step,
                                      scale_up_row_offset, scale_block_n, scale_block_k, K, stride_a_k,
                                      GATED and not PAIRED, DOT_FP32, DOT_PRECISION, EVEN_K, BLOCK_K, WEIGHT_SCALE,
                                      STEP_DOT)
    return b_acc, b_acc_up, offs_pair, mask_pair


@triton.jit
def tile_rows(offs_m, mask_m, gather_idx_ptr, num_tokens, num_a_rows, TOP_K: tl.constexpr, GATHER_A: tl.constexpr,
              NEEDS_ASSIGNMENT: tl.constexpr):
    """(A row of each sorted position, its assignment (0 when not needed), the row mask): gathered rows go through
    gather_idx (`gathered_rows`); otherwise A is in sorted order and row p is p, bounded by A's rows."""
    if GATHER_A or NEEDS_ASSIGNMENT:
        a_rows, b_assignment, mask_m = gathered_rows(gather_idx_ptr, offs_m, mask_m, num_tokens, TOP_K)
    else:
        b_assignment = tl.zeros_like(offs_m)
    if not GATHER_A:
        a_rows = tl.where(mask_m & (offs_m < num_a_rows), offs_m, 0)
    return a_rows, b_assignment, mask_m


@triton.jit
def add_bias(b_acc, b_acc_up, expert, offs_n, mask_n, bias_ptr, bias_up_ptr, stride_bias_e, stride_bias_n,
             ACTIVATION: tl.constexpr):
    """The accumulators plus the expert's bias row (and the up bias when gated)."""
    bias_offs = expert.to(tl.int64) * stride_bias_e + offs_n * stride_bias_n
    b_acc += tl.load(bias_ptr + bias_offs, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION != ACT_NONE:
        b_acc_up += tl.load(bias_up_ptr + bias_offs, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    return b_acc, b_acc_up


@triton.jit
def activate_and_weight(b_acc, b_acc_up, b_assignment, mask_m, topk_weights_ptr, stride_topk_t, stride_topk_k, alpha,
                        limit, TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr):
    """act(gate, up) when gated, then each row times its assignment's routing weight when MUL_ROUTED_WEIGHT."""
    if ACTIVATION != ACT_NONE:
        b_acc = apply_activation(b_acc, b_acc_up, alpha, limit, ACTIVATION)
    if MUL_ROUTED_WEIGHT:
        b_topk = tl.load(topk_weights_ptr + (b_assignment // TOP_K).to(tl.int64) * stride_topk_t
                         + (b_assignment % TOP_K) * stride_topk_k, mask=mask_m, other=0.0)
        b_acc = b_acc * b_topk.to(tl.float32)[:, None]
    return b_acc


@triton.jit
def pair_columns(pid_n, n_cols, BLOCK_N: tl.constexpr):
    """(offs_pair, mask_pair) [2 BLOCK_N]: the columns of an interleaved gate/up weight ([E, 2 n_cols, K], gate j at
    2j, up j at 2j + 1) that hold the gate and up columns of output tile pid_n."""
    offs_pair = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
    return offs_pair, offs_pair < 2 * n_cols


@triton.jit
def split_pairs(b_pairs):
    """(gate, up) [rows, BLOCK_N] of sums over interleaved columns [rows, 2 BLOCK_N] (gate at even columns)."""
    return tl.split(tl.reshape(b_pairs, (b_pairs.shape[0], b_pairs.shape[1] // 2, 2)))


@triton.jit
def paired_bias_and_preact(b_pairs, expert, offs_m, mask_m, offs_pair, mask_pair, bias_ptr, stride_bias_e,
                           stride_bias_n, preact_ptr, stride_preact_m, HAS_BIAS: tl.constexpr,
                           STORE_PREACT: tl.constexpr):
    """Interleaved sums [rows, 2 BLOCK_N] plus the whole gate/up bias's columns offs_pair; stored as they are into
    preact's columns offs_pair (pre-activations in the weight's interleaved order) with STORE_PREACT."""
    if HAS_BIAS:
        b_pairs += tl.load(bias_ptr + expert.to(tl.int64) * stride_bias_e + offs_pair * stride_bias_n, mask=mask_pair,
                           other=0.0).to(tl.float32)[None, :]
    if STORE_PREACT:
        preact_ptrs = preact_ptr + offs_m[:, None].to(tl.int64) * stride_preact_m + offs_pair[None, :]
        tl.store(preact_ptrs, b_pairs.to(preact_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_pair[None, :])
    return b_pairs


@triton.jit
def tile_epilogue(b_acc, b_acc_up, expert, offs_m, mask_m, offs_n, mask_n, b_assignment,
                  bias_ptr, bias_up_ptr, stride_bias_e, stride_bias_n, c_ptr, stride_c_m, stride_c_n,
                  preact_ptr, stride_preact_m, n_cols, topk_weights_ptr, stride_topk_t, stride_topk_k, alpha, limit,
                  TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_PREACT: tl.constexpr,
                  MUL_ROUTED_WEIGHT: tl.constexpr, PAIRED: tl.constexpr = False, offs_pair=None, mask_pair=None):
    """Bias, saved pre-activations, activation, routing weight, then the masked store of one C tile (rows outside
    mask_m, e.g. the next expert's rows a tile load reached, are never written).

    PAIRED: b_acc is [BLOCK_M, 2 BLOCK_N], the columns offs_pair of an interleaved gate/up weight (gate, up
    alternating; b_acc_up unused): the whole bias (bias_ptr [E, 2n]) is added and the pre-activations stored in that
    order (preact's columns offs_pair), then the pairs are split into gate and up."""
    mask_mn = mask_m[:, None] & mask_n[None, :]
    if PAIRED:
        b_acc = paired_bias_and_preact(b_acc, expert, offs_m, mask_m, offs_pair, mask_pair, bias_ptr, stride_bias_e,
                                       stride_bias_n, preact_ptr, stride_preact_m, HAS_BIAS, STORE_PREACT)
        b_acc, b_acc_up = split_pairs(b_acc)
    else:
        if HAS_BIAS:
            b_acc, b_acc_up = add_bias(b_acc, b_acc_up, expert, offs_n, mask_n, bias_ptr, bias_up_ptr, stride_bias_e,
                                       stride_bias_n, ACTIVATION)
        if STORE_PREACT:
            preact_ptrs = preact_ptr + offs_m[:, None].to(tl.int64) * stride_preact_m + offs_n[None, :]
            tl.store(preact_ptrs, b_acc.to(preact_ptr.dtype.element_ty), mask=mask_mn)
            tl.store(preact_ptrs + n_cols, b_acc_up.to(preact_ptr.dtype.element_ty), mask=mask_mn)
    b_acc = activate_and_weight(b_acc, b_acc_up, b_assignment, mask_m, topk_weights_ptr, stride_topk_t, stride_topk_k,
                                alpha, limit, TOP_K, ACTIVATION, MUL_ROUTED_WEIGHT)
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_c_m + offs_n[None, :] * stride_c_n
    tl.store(c_ptrs, b_acc.to(c_ptr.dtype.element_ty), mask=mask_mn)
