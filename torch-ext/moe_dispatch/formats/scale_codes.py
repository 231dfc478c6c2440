"""The WEIGHT_SCALE codes: how a GEMM kernel reads the scales of a quantized weight format (fp8.py, mxfp4.py), one
member per way. Imports nothing of the package, so that the formats (which name their code) and the `@triton.jit`
floor (gemm/jit.py, which compares with it) both sit above it."""

import enum


class WeightScaleCode(enum.IntEnum):
    """The WEIGHT_SCALE constexpr: how a GEMM applies the fp32 scales of float8 weights (fp8.WeightScale.code; the
    dequant path converts the weight tile to A's dtype for the dot, the w8a8 path (gemm/w8a8_jit.py) dots e4m3
    operands)."""

    NONE = 0  # float weights: no scales, the scale arguments unused
    TENSOR = 1  # one scale per expert (stride_scale_n 0): the fp32 sums times it once after the K loop
    CHANNEL = 2  # one scale per output column: the fp32 sums times it once after the K loop
    # one scale per (block_n, block_k) block of the weight: dequant path, each weight tile element times its block's
    # scale in fp32 before the conversion (any tile against any block shape); w8a8, each K step's partial sum times
    # the scale of the block its columns lie in (a K step never spans two blocks there)
    BLOCK = 3
    # dequant path and decode only (gemm.args.dequant_scale_code): BLOCK where each K step lies inside one scale
    # block (BLOCK_K narrowed to divide the block's K side): one [BLOCK_N] scale vector per step, no [BLOCK_K,
    # BLOCK_N] fp32 scale tile in shared memory
    BLOCK_STEP = 4
    # MXFP4 weights (mxfp4.py): uint8 bytes of two e2m1 values each along K, one e8m0 scale (uint8 code) per 32 K
    # values (scale_block_k 32); each K step's [BLOCK_N, BLOCK_K / 2] bytes are unpacked, times 2^(code - 127) in
    # fp32, converted to A's dtype and dotted (`mxfp4_tile_dot`; BLOCK_K a multiple of 32)
    MXFP4 = 5
    # MXFP4 weights read the other way round (the backward's dX and dA GEMMs): the GEMM's K runs along the stored
    # rows, its N along the packed axis (`mxfp4_n_tile_dot`; BLOCK_N a multiple of 32, a tile's columns start on a
    # scale group)
    MXFP4_N = 6
    # MXFP4 as MXFP4 with bf16 activations on NVIDIA sm_80 and later (gemm.args.dequant_scale_code): the bytes decoded
    # two values per 32-bit operation by inline PTX (`e2m1_bf16x2`: bf16 bit patterns, then two bf16x2 fma, one by
    # 2^126 and one by the group's scale), the same values as MXFP4's fp32 decode, bit for bit
    MXFP4_BF16X2 = 7
