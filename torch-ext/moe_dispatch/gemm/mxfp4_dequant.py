"""MXFP4 expert weights dequantized into a dense buffer: the prefill strategy for MXFP4 experts.

The grouped GEMMs read MXFP4 weights as checkpoints store them and dequantize each weight tile in their loads
(gemm/jit.py, `mxfp4_tile_dot`). That costs CUDA-core work per weight per M tile: at prefill every weight tile is
decoded again by each of the cdiv(rows, BLOCK_M) tiles that read it, so the decode grows with the tokens as the MMAs
do. Past a number of rows per expert it is cheaper to decode every weight once, into a [E, N, K] buffer in the
activations' dtype (one read of the 4.25-bit weights, one write of 16 bits), run the float path on it and drop it:
`planner.mxfp4_dequantizes_first` decides, `moe.py` calls `dequantize_mxfp4_experts` then.

The buffer lives for one call (the caching allocator keeps its memory for the next layer). The values are those the
loads would compute: each e2m1 value times its group's 2^(code - 127) in fp32, converted to the activations' dtype
(`e2m1_to_f32`, `e8m0_to_f32`: code 0xFF gives NaN for its whole group); the GEMMs then sum the same products.
"""

import torch
import triton
import triton.language as tl

from ..host.host_math import cdiv
from ..host.replay import launch
from .jit import MXFP4_GROUP, e2m1_to_f32, e8m0_to_f32

_BLOCK_ROWS = 16  # weight rows (N) per program
_BLOCK_BYTES = 128  # bytes of a row per program: 256 values, 8 scale groups


@triton.jit
def _dequantize_mxfp4_kernel(blocks_ptr, codes_ptr, out_ptr, num_rows, rows_per_expert, half_k,
                             stride_b_e, stride_b_n, stride_b_k, stride_c_e, stride_c_n, stride_c_k,
                             BLOCK_ROWS: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    """out [E * N, K] (contiguous) = the MXFP4 weight [E, N, K / 2] bytes with their [E, N, K / 32] scale codes,
    rows r = e * N + n; byte j of a row holds K index 2j (low nibble) and 2j + 1 (high)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    offs_byte = tl.program_id(1) * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    mask_rows = rows < num_rows
    mask = mask_rows[:, None] & (offs_byte[None, :] < half_k)
    rows = rows.to(tl.int64)  # E * N * K passes 2^31 at GPT-OSS-120B's widths
    expert = rows // rows_per_expert
    n = rows % rows_per_expert
    b_bytes = tl.load(blocks_ptr + expert[:, None] * stride_b_e + n[:, None] * stride_b_n
                      + offs_byte[None, :] * stride_b_k, mask=mask, other=0)
    b_codes = tl.load(codes_ptr + expert[:, None] * stride_c_e + n[:, None] * stride_c_n
                      + (offs_byte // (MXFP4_GROUP // 2))[None, :] * stride_c_k, mask=mask, other=0)
    b_scale = e8m0_to_f32(b_codes)
    b_values = tl.join(e2m1_to_f32(b_bytes) * b_scale, e2m1_to_f32(b_bytes >> 4) * b_scale)  # [rows, bytes, 2]
    b_values = tl.reshape(b_values, (BLOCK_ROWS, 2 * BLOCK_BYTES))
    offs_k = tl.program_id(1) * (2 * BLOCK_BYTES) + tl.arange(0, 2 * BLOCK_BYTES)
    tl.store(out_ptr + rows[:, None] * (2 * half_k) + offs_k[None, :], b_values.to(out_ptr.dtype.element_ty),
             mask=mask_rows[:, None] & (offs_k[None, :] < 2 * half_k))


def dequantize_mxfp4_experts(blocks: torch.Tensor, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The checked [E, N, K / 2] uint8 view of MXFP4 blocks and their [E, N, K / 32] uint8 scale codes
    (formats/mxfp4.check_mxfp4_weight's results) -> w [E, N, K] in `dtype`, contiguous: one launch, no host sync."""
    num_experts, rows_per_expert, half_k = blocks.shape
    out = torch.empty(num_experts, rows_per_expert, 2 * half_k, dtype=dtype, device=blocks.device)
    num_rows = num_experts * rows_per_expert
    if out.numel() == 0:
        return out
    grid = (cdiv(num_rows, _BLOCK_ROWS), cdiv(half_k, _BLOCK_BYTES))
    launch(_dequantize_mxfp4_kernel, grid, blocks, codes, out, num_rows, rows_per_expert, half_k, *blocks.stride(),
           *codes.stride(), BLOCK_ROWS=_BLOCK_ROWS, BLOCK_BYTES=_BLOCK_BYTES)
    return out
