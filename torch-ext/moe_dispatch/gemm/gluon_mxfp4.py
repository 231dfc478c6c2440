"""A warp-specialized grouped GEMM with MXFP4 weights in Gluon (Hopper, SM90; Triton 3.6), on gemm/gluon_ws.py's
skeleton: out [M, N] bf16 = a_seg @ dequant(w_e)^T over expert-sorted rows, bf16 activations against MXFP4 weights
as checkpoints store them ([E, N, K / 2] bytes, byte j of a row holding K values 2j and 2j + 1; e8m0 scale codes
[E, N, K / 32]). The MXFP4 experts path runs both of its GEMMs on it at prefill on SM90 (gemm/gluon_experts.py's
`gluon_mxfp4_experts`, chosen by planner.plan_mxfp4_engine).

One CTA per SM walks the 64 x 256 output tiles of the tile map (dispatch.segments.segment_tile_map, built on the
device: no host sync) in gluon_ws's grouped-M order, in three partitions:

    producer  (1 warp)       gluon_ws's load_partition: TMA loads of A [64, 64] bf16 and the weight's two packed
                             tiles [128, 32] uint8 (the output tile's two 128-column halves; 64 K values as 32 bytes
                             a row) into a ring of stages
    consumer c (warp group)  its 128 columns: per K step the packed bytes from shared memory into registers (16 a
                             thread: one scale group), their two scale codes from global memory, the PTX decode of
                             gemm/jit.py (E2M1_BF16X2_PTX: two values per 32-bit operation, the scale applied) joined
                             back into K order, stored to one of its two bf16 [128, 64] buffers, then an asynchronous
                             wgmma (m64n128k16) of the stage's A tile against that buffer. The decode of step i + 1
                             runs while the wgmma of step i is in flight (one left outstanding); a stage goes back to
                             the producer once the wgmma that read its A tile has completed.

Why: the portable kernels decode each weight tile on the MMA's critical path (registers -> shared memory -> wgmma, no
overlap); here the decode of one step overlaps the MMA of the step before. Measured on an H100 at GPT-OSS-120B's GEMM1
(docs/performance.md, "MXFP4 experts"): 1.43-1.83x faster than the portable MXFP4 GEMM from T = 1024.

Tile edges: TMA reads past a tensor's rows or K as zeros and a tile never straddles two experts (rows of the next
expert that a tile load reaches are never stored); the scale codes of a K step past K // 32 read as 0 (2^-127, times
zero bytes). A 0xFF scale code decodes to NaN, so a NaN scale reaches every output of its column in its expert's rows.
Importing this module never needs Gluon (gluon_ws's guarded import).
"""

from __future__ import annotations

import torch
import triton

from ..dispatch.segments import segment_tile_map
from ..host.device import num_sms
from ..host.replay import unrecorded_launch
from .gluon_ws import (TensorDescriptor, available, check_device, check_expert_offsets, check_operand,  # noqa: F401
                       check_stacked_weight, e8m0_bf16, gl, gluon_jit, load_partition, mbarrier, stage_ring,
                       store_layout, store_tile, tile_at, tile_counts, unavailable_reason, warpgroup_mma,
                       warpgroup_mma_wait)
from .jit import E2M1_BF16X2_PTX, Activation, apply_activation

try:
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared
except ImportError:  # a Triton without Gluon: `available()` is False and nothing here launches
    fence_async_shared = None

MXFP4_GROUP = 32  # K values per e8m0 scale (formats.mxfp4.MXFP4_GROUP)
BLOCK_M, HALF_N, BLOCK_K = 64, 128, 64  # a consumer's wgmma: m64 n128, K steps of 64 values (32 bytes, 2 scales)
NUM_STAGES = 4  # 6 measured the same (H100, GPT-OSS GEMM1, T = 128-16384, 64-row tiles: within 1%)
# 128-row tiles (each consumer's wgmma over two 64-row slabs: half the decode per MMA) from this many rows per expert:
# H100, GPT-OSS GEMM1, 128-row against 64-row tiles: 1.16-1.47x faster at 128-512 rows per expert (GPT-OSS-20B T = 1024
# to GPT-OSS-120B T = 16384), 0.78-0.79x at 4-32; the whole layer through fused_experts at 64 rows per expert
# 1.10-1.15x faster, at 32 0.80x (docs/performance.md, "MXFP4 experts")
ROWS128_FROM = 64
# The swapped form (FORM_SWAP): the weights are the wgmma's A operand, decoded into registers (no shared-memory round
# trip, no fence), the activation tile its B; a consumer's wgmma is SWAP_W_ROWS weight rows x the tile's 256 tokens,
# so the decode of a weight tile serves 256 tokens (the split form's 128 columns serve 64 or 128 rows). Tiles of 16-128
# tokens ran correctly and slower than the split form wherever they could run (H100, through fused_experts at 4-64
# rows per expert 1.03-3.03x the time of the split form's 64-row tiles; GEMM1 alone at 128 rows per expert 128-token
# tiles 1.13-1.15x the time of its 128-row ones; docs/versions.md, v37), and again with one wgmma left in flight
# (every partition at MAXNREG registers, no setmaxnreg split: 128-token tiles 1.01-1.09x the split form's time at
# 64-256 rows per expert and 1.30-1.45x at 4-32, 64-token tiles 1.18-1.24x at 4-32 and wrong in the activated and
# routed epilogues; docs/versions.md, v38): not offered
FORM_SPLIT, FORM_SWAP = "split", "swap"
SWAP_W_ROWS = 64
SWAP_TOKENS = (256, )
# The engine's swapped form (256 tokens) from this many rows per expert: H100, GPT-OSS GEMM1, against the split form's
# 128-row tiles, 1.05-1.19x faster at 512-2048 rows per expert (GPT-OSS-120B T = 16384, 20B T = 4096 / 16384),
# 0.94-0.99x at 128, 0.62x at 32; the whole layer at 256 rows per expert 1.02-1.08x faster, at 128 0.96-0.97x
# (docs/performance.md, "MXFP4 experts")
SWAP_FROM = 256
GROUP_M = 8
MAXNREG, CONSUMER_REGS, PRODUCER_REGS = 168, 232, 24  # as gluon_fp8's kernel: 3 warp groups x 128 threads x 168
GEMM_NAME = "Gluon MXFP4 GEMM"
# What a consumer's epilogue does with its [rows, 128] fp32 tile (the EPILOGUE constexpr)
EPILOGUE_PLAIN = 0  # store it (bf16)
EPILOGUE_PAIRS = 1  # gate and up alternating (GPT-OSS's rows): the bias, the activation of each pair -> 64 columns
EPILOGUE_ROUTED = 2  # GEMM2's: the bias, then each row times its assignment's routing weight


@gluon_jit
def _epilogue(acc, out_ptr, stride_out_m, row_start, row_end, col_start, expert, N, bias_ptr, stride_bias_e,
              stride_bias_n, gather_idx_ptr, topk_weights_ptr, stride_topk_t, stride_topk_k, alpha, limit,
              EPILOGUE: gl.constexpr, ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr, TOP_K: gl.constexpr,
              acc_layout: gl.constexpr, out_layout: gl.constexpr, pair_layout: gl.constexpr,
              half_layout: gl.constexpr):
    """A consumer's store of its tile acc [ROWS, COLS] (fp32, rows row_start.. of the expert, columns col_start..):
    EPILOGUE_PLAIN as bf16; EPILOGUE_PAIRS: bias [E, N] added, columns (2j, 2j + 1) the gate and up of output column
    col_start / 2 + j, activated (gemm.jit's apply_activation) and stored to out [M, N / 2]; EPILOGUE_ROUTED: bias
    added, each row times topk_weights[t, k] of its assignment t * TOP_K + k = gather_idx[row]. Rows >= row_end and
    columns past N (N / 2) are never written."""
    ROWS: gl.constexpr = acc.type.shape[0]
    COLS: gl.constexpr = acc.type.shape[1]
    if EPILOGUE == 1:  # EPILOGUE_PAIRS
        b_pairs = gl.convert_layout(acc, pair_layout)
        if HAS_BIAS:
            offs_n = col_start + gl.arange(0, COLS, layout=gl.SliceLayout(0, pair_layout))
            b_bias = gl.load(bias_ptr + expert.to(gl.int64) * stride_bias_e + offs_n * stride_bias_n, mask=offs_n < N,
                             other=0.0)
            b_pairs = b_pairs + gl.expand_dims(b_bias.to(gl.float32), 0)
        b_gate, b_up = gl.split(gl.reshape(b_pairs, [ROWS, COLS // 2, 2]))
        b_h = apply_activation(gl.convert_layout(b_gate, half_layout), gl.convert_layout(b_up, half_layout), alpha,
                               limit, ACTIVATION)
        store_tile(out_ptr, stride_out_m, b_h.to(gl.bfloat16), row_start, row_end, col_start // 2, N // 2,
                   half_layout)
    else:
        b_out = acc
        if EPILOGUE == 2:  # EPILOGUE_ROUTED
            offs_m = row_start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
            mask_m = offs_m < row_end
            if HAS_BIAS:
                offs_n = col_start + gl.arange(0, COLS, layout=gl.SliceLayout(0, acc_layout))
                b_bias = gl.load(bias_ptr + expert.to(gl.int64) * stride_bias_e + offs_n * stride_bias_n,
                                 mask=offs_n < N, other=0.0)
                b_out = b_out + gl.expand_dims(b_bias.to(gl.float32), 0)
            assignment = gl.load(gather_idx_ptr + offs_m, mask=mask_m, other=0)
            b_w = gl.load(topk_weights_ptr + (assignment // TOP_K).to(gl.int64) * stride_topk_t
                          + (assignment % TOP_K) * stride_topk_k, mask=mask_m, other=0.0)
            b_out = b_out * gl.expand_dims(b_w.to(gl.float32), 1)
        store_tile(out_ptr, stride_out_m, gl.convert_layout(b_out.to(gl.bfloat16), out_layout), row_start, row_end,
                   col_start, N, out_layout)


@gluon_jit
def _consumer_steps(K, W_ROWS: gl.constexpr, A_K: gl.constexpr, split_layout: gl.constexpr):
    """A consumer's K walk: (the aranges of its W_ROWS weight rows and of a step's scale groups, in the scale codes'
    layout (the slice of split_layout), the K steps of A_K values, the scale groups along K)."""
    scale_layout: gl.constexpr = gl.SliceLayout(2, split_layout)
    offs_r = gl.arange(0, W_ROWS, layout=gl.SliceLayout(1, scale_layout))
    offs_g = gl.arange(0, A_K // 32, layout=gl.SliceLayout(0, scale_layout))
    return offs_r, offs_g, gl.cdiv(K, A_K), K // 32


@gluon_jit
def _consumer_tile(tile_id, num_pid_m, num_pid_n, M, N, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, scale_ptr,
                   stride_s_e, stride_s_n, stride_s_k, offs_r, offs_g, TILE_ROWS: gl.constexpr,
                   W_ROWS: gl.constexpr, WARP_GROUP: gl.constexpr, GROUP_M: gl.constexpr):
    """Consumer WARP_GROUP's part of output tile `tile_id` (TILE_ROWS rows x 2 W_ROWS weight rows): (row_start, row_end,
    expert, col_start (its first weight row), the e8m0 code pointers of its W_ROWS weight rows at K step 0 [W_ROWS,
    GROUPS] (offs_r, offs_g their aranges), the mask of its weight rows below N [W_ROWS, 1])."""
    row_start, row_end, expert, pid_n = tile_at(tile_id, num_pid_m, num_pid_n, M, tile_expert_ptr, tile_row_ptr,
                                                expert_offsets_ptr, TILE_ROWS, GROUP_M, True)
    col_start = pid_n * (2 * W_ROWS) + WARP_GROUP * W_ROWS
    cols = col_start + offs_r
    s_ptrs = (scale_ptr + expert.to(gl.int64) * stride_s_e + gl.expand_dims(cols.to(gl.int64) * stride_s_n, 1)
              + gl.expand_dims(offs_g * stride_s_k, 0))
    return row_start, row_end, expert, col_start, s_ptrs, gl.expand_dims(cols < N, 1)


@gluon_jit
def _scale_codes(s_ptrs, mask_cols, kb, k_groups, offs_g, stride_s_k):
    """The e8m0 codes of K step kb of a consumer's weight rows: s_ptrs [ROWS, GROUPS] at step 0, masked by mask_cols
    and by K (a step past K // 32 groups reads 0) -> [ROWS, GROUPS] uint8. The consumers load step kb + 1's while
    they decode step kb: a global load's latency is not waited for inside the step."""
    GROUPS: gl.constexpr = s_ptrs.type.shape[1]
    return gl.load(s_ptrs + kb * GROUPS * stride_s_k,
                   mask=mask_cols & gl.expand_dims(kb * GROUPS + offs_g < k_groups, 0), other=0)


@gluon_jit
def _decode_step(packed_tile, codes, bytes_layout: gl.constexpr, split_layout: gl.constexpr):
    """A K step of a consumer's weight rows: packed_tile [ROWS, A_K / 2] uint8 in shared memory (the stage's bytes)
    and the rows' e8m0 codes [ROWS, GROUPS] (`_scale_codes`) -> [ROWS, A_K] bf16 in K order, scaled
    (E2M1_BF16X2_PTX; a 0xFF code gives NaN, a 0 code 2^-127)."""
    ROWS: gl.constexpr = packed_tile.type.shape[0]
    A_K: gl.constexpr = packed_tile.type.shape[1] * 2
    GROUPS: gl.constexpr = A_K // 32  # scale groups per K step (16 bytes each)
    packed = packed_tile.load(bytes_layout)
    packed = gl.convert_layout(gl.reshape(packed, [ROWS, GROUPS, 16]), split_layout)
    scale = gl.expand_dims(e8m0_bf16(codes), 2)  # [ROWS, GROUPS, 1]
    scale, packed = gl.broadcast(scale, packed)
    lo, hi = gl.inline_asm_elementwise(E2M1_BF16X2_PTX, "=r,=r,=r,=r,r,r,r", [packed, scale],
                                       dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
    return gl.reshape(gl.join(lo, hi), [ROWS, A_K])  # K order: byte j's low nibble is value 2j


# E2M1_BF16X2_PTX with its outputs repacked by byte: $0 = (low, high nibble) of byte 0, $1 of byte 1, $2 of byte 2, $3
# of byte 3, each register one bf16 pair of consecutive K values: the pair a wgmma register operand holds (k_width 2),
# so the operand is these registers as they are (a repacked operand is a new register that ptxas may reuse while the
# wgmma reading it is in flight, and then serializes the wgmmas, C7512)
E2M1_BF16X2_PAIRS_PTX = triton.language.constexpr("""
{
.reg .b32 t0, t1, u, v, c126, nz, l0, l1, h0, h1;
mov.b32 c126, 0x7E807E80;
mov.b32 nz, 0x80008000;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
and.b32 u, t0, 0x00070007; shl.b32 u, u, 6; and.b32 v, t0, 0x00080008; shl.b32 v, v, 12; or.b32 u, u, v;
fma.rn.bf16x2 u, u, c126, nz; fma.rn.bf16x2 l0, u, $5, nz;
and.b32 u, t1, 0x00070007; shl.b32 u, u, 6; and.b32 v, t1, 0x00080008; shl.b32 v, v, 12; or.b32 u, u, v;
fma.rn.bf16x2 u, u, c126, nz; fma.rn.bf16x2 l1, u, $6, nz;
and.b32 u, t0, 0x00700070; shl.b32 u, u, 2; and.b32 v, t0, 0x00800080; shl.b32 v, v, 8; or.b32 u, u, v;
fma.rn.bf16x2 u, u, c126, nz; fma.rn.bf16x2 h0, u, $5, nz;
and.b32 u, t1, 0x00700070; shl.b32 u, u, 2; and.b32 v, t1, 0x00800080; shl.b32 v, v, 8; or.b32 u, u, v;
fma.rn.bf16x2 u, u, c126, nz; fma.rn.bf16x2 h1, u, $6, nz;
prmt.b32 $0, l0, h0, 0x5410;
prmt.b32 $1, l0, h0, 0x7632;
prmt.b32 $2, l1, h1, 0x5410;
prmt.b32 $3, l1, h1, 0x7632;
}
""")


@gluon_jit
def _decode_operand(packed_tile, codes, rows_layout: gl.constexpr, split_layout: gl.constexpr,
                    operand_layout: gl.constexpr):
    """The swapped form's K step: packed_tile [ROWS, A_K / 2] uint8 in shared memory, the rows' e8m0 codes [ROWS,
    GROUPS] -> the weight operand [ROWS, A_K] bf16 in K order, scaled, in operand_layout (the wgmma's A registers).

    rows_layout has each thread read bytes q = 4 i + c (i = 0..3) of a row's 16-byte group (c = lane % 4), four
    registers in a row: one E2M1_BF16X2_PAIRS_PTX block, whose first output holds bytes i = 0, 1 (K values 2q, 2q + 1
    of each: element 2 m + n is byte i = m, nibble n) and its second bytes i = 2, 3. Joined and permuted into K order
    (K = 32 g + 16 h + 8 m + 2 c + n, h the output), the values sit where the operand layout wants them."""
    ROWS: gl.constexpr = packed_tile.type.shape[0]
    A_K: gl.constexpr = packed_tile.type.shape[1] * 2
    GROUPS: gl.constexpr = A_K // 32
    packed = gl.convert_layout(gl.reshape(packed_tile.load(rows_layout), [ROWS, GROUPS, 16]), split_layout)
    scale = gl.expand_dims(e8m0_bf16(codes), 2)  # [ROWS, GROUPS, 1]
    scale, packed = gl.broadcast(scale, packed)
    first, second = gl.inline_asm_elementwise(E2M1_BF16X2_PAIRS_PTX, "=r,=r,=r,=r,r,r,r", [packed, scale],
                                              dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
    # q = 4 i + c = 8 m + 4 n + c: [rows, g, m, n, c] each, then the output h last
    both = gl.join(gl.reshape(first, [ROWS, GROUPS, 2, 2, 4]), gl.reshape(second, [ROWS, GROUPS, 2, 2, 4]))
    both = gl.permute(both, (0, 1, 5, 2, 4, 3))  # [rows, g, h, m, c, n]: K order
    return gl.convert_layout(gl.reshape(both, [ROWS, A_K]), operand_layout)


@gluon_jit
def _mma_partition(consumer_args, dec_bufs, stride_bias_n, stride_topk_k, WARP_GROUP: gl.constexpr,
                   GROUP_M: gl.constexpr, EPILOGUE: gl.constexpr, ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr,
                   TOP_K: gl.constexpr, acc_layout: gl.constexpr, out_layout: gl.constexpr,
                   bytes_layout: gl.constexpr, split_layout: gl.constexpr, pair_layout: gl.constexpr,
                   half_layout: gl.constexpr):
    """Consumer WARP_GROUP: columns [WARP_GROUP * HALF_N, +HALF_N) of every A_ROWS x 2 HALF_N tile (module
    docstring), stored by `_epilogue`; consumer_args the kernel's tuple of what both consumers read, unpacked below."""
    (a_bufs, w_bufs, ready_bars, empty_bars, scale_ptr, out_ptr, M, N, K, num_pid_m, num_pid_n, num_tiles,
     tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, stride_s_e, stride_s_n, stride_s_k, stride_out_m, bias_ptr,
     stride_bias_e, gather_idx_ptr, topk_weights_ptr, stride_topk_t, alpha, limit) = consumer_args
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    A_ROWS: gl.constexpr = a_bufs.type.shape[1]
    A_K: gl.constexpr = a_bufs.type.shape[2]
    W_ROWS: gl.constexpr = w_bufs.type.shape[1]
    offs_r, offs_g, k_blocks, k_groups = _consumer_steps(K, W_ROWS, A_K, split_layout)
    zero = gl.zeros([A_ROWS, W_ROWS], gl.float32, acc_layout)
    it = 0
    for tile_id in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        row_start, row_end, expert, col_start, s_ptrs, mask_cols = _consumer_tile(
            tile_id, num_pid_m, num_pid_n, M, N, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, scale_ptr,
            stride_s_e, stride_s_n, stride_s_k, offs_r, offs_g, A_ROWS, W_ROWS, WARP_GROUP, GROUP_M)
        acc = zero
        codes = _scale_codes(s_ptrs, mask_cols, 0, k_groups, offs_g, stride_s_k)
        for kb in range(k_blocks):
            stage = it % STAGES
            next_codes = _scale_codes(s_ptrs, mask_cols, kb + 1, k_groups, offs_g, stride_s_k)
            mbarrier.wait(ready_bars.index(stage), (it // STAGES) & 1)
            w = _decode_step(w_bufs.index(2 * stage + WARP_GROUP), codes, bytes_layout, split_layout)
            codes = next_codes
            dec = dec_bufs.index(2 * WARP_GROUP + it % 2)
            dec.store(w)
            fence_async_shared()
            acc = warpgroup_mma(a_bufs.index(stage), dec.permute((1, 0)), acc, is_async=True)
            # the wgmma of the step before has completed: its stage (A tile) goes back to the producer, and its
            # decode buffer may be written at the next step
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            if kb > 0:
                mbarrier.arrive(empty_bars.index((it - 1) % STAGES), count=1)
            it += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty_bars.index((it - 1) % STAGES), count=1)
        _epilogue(acc, out_ptr, stride_out_m, row_start, row_end, col_start, expert, N, bias_ptr, stride_bias_e,
                  stride_bias_n, gather_idx_ptr, topk_weights_ptr, stride_topk_t, stride_topk_k, alpha, limit,
                  EPILOGUE, ACTIVATION, HAS_BIAS, TOP_K, acc_layout, out_layout, pair_layout, half_layout)


@gluon_jit
def _swap_partition(consumer_args, stride_bias_n, stride_topk_k, WARP_GROUP: gl.constexpr, GROUP_M: gl.constexpr,
                    EPILOGUE: gl.constexpr, ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr, TOP_K: gl.constexpr,
                    acc_layout: gl.constexpr, operand_layout: gl.constexpr, rows_layout: gl.constexpr,
                    split_layout: gl.constexpr, out_layout: gl.constexpr, pair_layout: gl.constexpr,
                    half_layout: gl.constexpr):
    """Consumer WARP_GROUP of the swapped form (FORM_SWAP): weight rows [WARP_GROUP * SWAP_W_ROWS, +SWAP_W_ROWS) of
    every TOKENS x 2 SWAP_W_ROWS tile as the wgmma's A operand in registers, the stage's activation tile as its B
    (module docstring); the transposed sums are stored by `_epilogue`; consumer_args as `_mma_partition`'s."""
    (a_bufs, w_bufs, ready_bars, empty_bars, scale_ptr, out_ptr, M, N, K, num_pid_m, num_pid_n, num_tiles,
     tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, stride_s_e, stride_s_n, stride_s_k, stride_out_m, bias_ptr,
     stride_bias_e, gather_idx_ptr, topk_weights_ptr, stride_topk_t, alpha, limit) = consumer_args
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    TOKENS: gl.constexpr = a_bufs.type.shape[1]
    A_K: gl.constexpr = a_bufs.type.shape[2]
    W_ROWS: gl.constexpr = w_bufs.type.shape[1]
    offs_r, offs_g, k_blocks, k_groups = _consumer_steps(K, W_ROWS, A_K, split_layout)
    zero = gl.zeros([W_ROWS, TOKENS], gl.float32, acc_layout)
    it = 0
    for tile_id in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        row_start, row_end, expert, col_start, s_ptrs, mask_cols = _consumer_tile(
            tile_id, num_pid_m, num_pid_n, M, N, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, scale_ptr,
            stride_s_e, stride_s_n, stride_s_k, offs_r, offs_g, TOKENS, W_ROWS, WARP_GROUP, GROUP_M)
        acc = zero
        codes = _scale_codes(s_ptrs, mask_cols, 0, k_groups, offs_g, stride_s_k)
        # Each K step's wgmma is waited for before the next decode: with the partitions' registers moved by setmaxnreg
        # (CONSUMER_REGS / PRODUCER_REGS) ptxas serializes register-operand wgmmas left in flight across a step
        # (C7512), so the overlap is between the two consumers, one decoding while the other's wgmma runs
        for kb in range(k_blocks):
            stage = it % STAGES
            next_codes = _scale_codes(s_ptrs, mask_cols, kb + 1, k_groups, offs_g, stride_s_k)
            mbarrier.wait(ready_bars.index(stage), (it // STAGES) & 1)
            w = _decode_operand(w_bufs.index(2 * stage + WARP_GROUP), codes, rows_layout, split_layout,
                                operand_layout)
            codes = next_codes
            acc = warpgroup_mma(w, a_bufs.index(stage).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty_bars.index(stage), count=1)
            it += 1
        sums = gl.convert_layout(gl.permute(acc, (1, 0)), out_layout)  # [TOKENS, W_ROWS]: rows are tokens
        _epilogue(sums, out_ptr, stride_out_m, row_start, row_end, col_start, expert, N, bias_ptr, stride_bias_e,
                  stride_bias_n, gather_idx_ptr, topk_weights_ptr, stride_topk_t, stride_topk_k, alpha, limit,
                  EPILOGUE, ACTIVATION, HAS_BIAS, TOP_K, out_layout, out_layout, pair_layout, half_layout)


@gluon_jit
def _mxfp4_gemm_kernel(a_desc, w_desc, scale_ptr, out_ptr, tile_expert_ptr, tile_row_ptr, num_m_tiles_ptr,
                       expert_offsets_ptr, M, N, K, n_per_expert, stride_s_e, stride_s_n, stride_s_k, stride_out_m,
                       bias_ptr, stride_bias_e, stride_bias_n, gather_idx_ptr, topk_weights_ptr, stride_topk_t,
                       stride_topk_k, alpha, limit, NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                       EPILOGUE: gl.constexpr, ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr, TOP_K: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, acc_layout: gl.constexpr,
                       out_layout: gl.constexpr, split_layout: gl.constexpr, pair_layout: gl.constexpr,
                       half_layout: gl.constexpr, bytes_layout: gl.constexpr, dec_layout: gl.constexpr,
                       operand_layout: gl.constexpr, rows_layout: gl.constexpr, SWAP: gl.constexpr,
                       num_warps: gl.constexpr):
    """out = a_seg @ dequant(w_e)^T over the tile map's tiles of A_ROWS x 2 W_ROWS (module docstring): the split form
    (`_mma_partition`; bytes_layout and dec_layout its own), or with SWAP the swapped form (`_swap_partition`, A_ROWS
    the tile's tokens; operand_layout and rows_layout its own). Grid: (min(#SMs, bound on the tiles),); num_warps 4:
    the default partition is consumer 0, consumer 1 (4 warps) and the producer (1 warp) are workers."""
    A_ROWS: gl.constexpr = a_desc.block_type.shape[0]
    A_K: gl.constexpr = a_desc.block_type.shape[1]
    W_ROWS: gl.constexpr = w_desc.block_type.shape[0]
    gl.static_assert(num_warps == 4, "each consumer is one warp group")
    a_bufs, w_bufs, ready_bars, empty_bars = stage_ring(a_desc, w_desc, NUM_STAGES, 2)
    num_pid_m, num_pid_n, num_tiles = tile_counts(M, N, num_m_tiles_ptr, A_ROWS, 2 * W_ROWS, True)
    # What both consumers of either form read, as one tuple. Outside it: the bias's and routing weights' inner strides
    # (inside it the epilogues that read them compiled to longer PTX under Triton 3.6: a launch specializes them to
    # 1), and each consumer's constexprs and layouts (Gluon 3.6-3.9 drops the constexprs of a tuple built by
    # concatenation, and cannot name one holding layouts or functions)
    consumer_args = (a_bufs, w_bufs, ready_bars, empty_bars, scale_ptr, out_ptr, M, N, K, num_pid_m, num_pid_n,
                     num_tiles, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, stride_s_e, stride_s_n, stride_s_k,
                     stride_out_m, bias_ptr, stride_bias_e, gather_idx_ptr, topk_weights_ptr, stride_topk_t, alpha,
                     limit)
    if SWAP:
        gl.warp_specialize([
            (_swap_partition, (consumer_args, stride_bias_n, stride_topk_k, 0, GROUP_M, EPILOGUE, ACTIVATION,
                               HAS_BIAS, TOP_K, acc_layout, operand_layout, rows_layout, split_layout, out_layout,
                               pair_layout, half_layout)),
            (_swap_partition, (consumer_args, stride_bias_n, stride_topk_k, 1, GROUP_M, EPILOGUE, ACTIVATION,
                               HAS_BIAS, TOP_K, acc_layout, operand_layout, rows_layout, split_layout, out_layout,
                               pair_layout, half_layout)),
            (load_partition, (a_desc, w_desc, a_bufs, w_bufs, ready_bars, empty_bars, M, K, num_pid_m, num_pid_n,
                              num_tiles, n_per_expert, W_ROWS, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
                              GROUP_M, True, 2, 2 * W_ROWS, 2)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        dec_bufs = gl.allocate_shared_memory(gl.bfloat16, [4, W_ROWS, A_K], dec_layout)  # two per consumer
        gl.warp_specialize([
            (_mma_partition, (consumer_args, dec_bufs, stride_bias_n, stride_topk_k, 0, GROUP_M, EPILOGUE,
                              ACTIVATION, HAS_BIAS, TOP_K, acc_layout, out_layout, bytes_layout, split_layout,
                              pair_layout, half_layout)),
            (_mma_partition, (consumer_args, dec_bufs, stride_bias_n, stride_topk_k, 1, GROUP_M, EPILOGUE,
                              ACTIVATION, HAS_BIAS, TOP_K, acc_layout, out_layout, bytes_layout, split_layout,
                              pair_layout, half_layout)),
            (load_partition, (a_desc, w_desc, a_bufs, w_bufs, ready_bars, empty_bars, M, K, num_pid_m, num_pid_n,
                              num_tiles, n_per_expert, W_ROWS, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
                              GROUP_M, True, 2, 2 * W_ROWS, 2)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def kernel_layouts(block_m: int = BLOCK_M):
    """Register and shared layouts of the kernel with output tiles of `block_m` rows: (acc, out, bytes, split, dec,
    a_smem, w_smem, pair, half)."""
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF_N, 16])
    out = store_layout(block_m, HALF_N)
    # a consumer's [128, 32] packed tile: 16 bytes (one scale group) a thread, two threads a row, 16 rows a warp
    bytes_layout = gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0])
    split = gl.BlockedLayout([1, 1, 16], [16, 2, 1], [4, 1, 1], [2, 1, 0])  # the same as [rows, groups, 16 bytes]
    dec = gl.NVMMASharedLayout.get_default_for([HALF_N, BLOCK_K], gl.bfloat16)
    a_smem = gl.NVMMASharedLayout.get_default_for([block_m, BLOCK_K], gl.bfloat16)
    w_smem = gl.NVMMASharedLayout.get_default_for([HALF_N, BLOCK_K // 2], gl.uint8)
    # EPILOGUE_PAIRS: 8 columns (4 pairs) a thread, a warp two rows; its [rows, 64] output, 4 columns a thread
    pair = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    half = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])
    return acc, out, bytes_layout, split, dec, a_smem, w_smem, pair, half


def swap_layouts(tokens: int):
    """Register and shared layouts of the swapped form with `tokens` rows a tile: (acc [SWAP_W_ROWS, tokens], operand
    (the wgmma's A: the decoded weights [SWAP_W_ROWS, BLOCK_K] bf16), rows (the stage's packed bytes [SWAP_W_ROWS,
    BLOCK_K / 2] as each thread reads them from shared memory), split (the same as [rows, groups, 16 bytes]), out,
    pair, half (the epilogue's [tokens, SWAP_W_ROWS] and [tokens, SWAP_W_ROWS / 2]), a_smem, w_smem)."""
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, tokens, 16])
    operand = gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)
    # A thread of the operand holds K values 2c, 2c + 1 (+ 8, + 16, + 32) of rows r and r + 8 (c = lane % 4, r = lane
    # / 4 + 16 * warp): bytes c, c + 4, .., c + 28 of those rows. Byte p = 16 g + 4 i + c (g the scale group, i its
    # step of 4 bytes): the registers run over i first (four bytes of one group: one E2M1_BF16X2_PTX block), then g,
    # then the row r + 8
    rows = gl.DistributedLinearLayout(reg_bases=[[0, 4], [0, 8], [0, 16], [8, 0]],
                                      lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[SWAP_W_ROWS, BLOCK_K // 2])
    split = gl.DistributedLinearLayout(reg_bases=[[0, 0, 4], [0, 0, 8], [0, 1, 0], [8, 0, 0]],
                                       lane_bases=[[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
                                       warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[],
                                       shape=[SWAP_W_ROWS, BLOCK_K // 32, 16])
    out = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # [tokens, 64]: 8 columns a thread, a warp 4 rows
    pair = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    half = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    a_smem = gl.NVMMASharedLayout.get_default_for([tokens, BLOCK_K], gl.bfloat16)
    w_smem = gl.NVMMASharedLayout.get_default_for([SWAP_W_ROWS, BLOCK_K // 2], gl.uint8)
    return acc, operand, rows, split, out, pair, half, a_smem, w_smem


def mxfp4_grouped_gemm(a: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, expert_offsets: torch.Tensor, *,
                       bias: torch.Tensor | None = None, activation: str | None = None, alpha: float = 1.702,
                       limit: float = 7.0, routing: tuple[torch.Tensor, torch.Tensor] | None = None,
                       stages: int = NUM_STAGES, block_m: int = BLOCK_M, form: str = FORM_SPLIT) -> torch.Tensor:
    """Rows of expert e: s[o_e:o_{e+1}] = a[o_e:o_{e+1}] @ dequant(blocks[e], scales[e])^T (+ bias[e]), fp32; out bf16:

      plain (no activation, no routing; no bias)  out [M, N] = s
      activation ("silu" or "swiglu_oai")         out [M, N / 2] = act(gate, up) with gate and up the columns 2j and
                                                  2j + 1 of s (GPT-OSS's alternating gate/up rows; bias optional)
      routing = (gather_idx, topk_weights)         out [M, N] = s * topk_weights[t, k] of each row's assignment
                                                  t * top_k + k = gather_idx[row] (GEMM2's; bias optional)

    a [M, K] bf16 sorted by expert (K-contiguous, 16-byte aligned rows), blocks uint8 [E, N, K / 2] contiguous (the
    checkpoint's byte order), scales uint8 [E, N, K / 32] e8m0 codes (any strides), K a multiple of 32; bias [E, N]
    (any float dtype and strides); gather_idx int32 [M], topk_weights [T, top_k]; expert_offsets int32 [E + 1] (o_0 =
    0, nondecreasing, o_E <= M: rows past o_E are left unwritten; offsets outside that are clamped on the device, never
    read as given). No host sync: the launch is sized by the tile map's bound. `stages` and `block_m` (64, or 128:
    each consumer's wgmma over two 64-row slabs) are the engine's choice (`gemm_tile`) and the probe's
    (benchmarks/gluon_mxfp4_probe.py)."""
    if form not in (FORM_SPLIT, FORM_SWAP):
        raise ValueError(f"form must be {FORM_SPLIT!r} or {FORM_SWAP!r}, got {form!r}")
    if block_m not in ((64, 128) if form == FORM_SPLIT else SWAP_TOKENS):
        raise ValueError(f"block_m must be one of {(64, 128) if form == FORM_SPLIT else SWAP_TOKENS} for form "
                         f"{form!r}, got {block_m}")
    check_operand("a", a, 2, (torch.bfloat16, ))
    check_operand("blocks", blocks, 3, (torch.uint8, ))
    E, N = check_stacked_weight(blocks)
    M, K = a.shape
    if K % MXFP4_GROUP or blocks.shape[2] * 2 != K:
        raise ValueError(f"a is [M, K] = {tuple(a.shape)} (K a multiple of {MXFP4_GROUP}) but blocks is "
                         f"[E, N, K / 2] = {tuple(blocks.shape)}")
    if scales.dtype != torch.uint8 or tuple(scales.shape) != (E, N, K // MXFP4_GROUP):
        raise ValueError(f"scales must be uint8 [E, N, K / 32] = {(E, N, K // MXFP4_GROUP)}, got {scales.dtype} "
                         f"{tuple(scales.shape)}")
    check_expert_offsets(expert_offsets, E)
    if activation is not None and routing is not None:
        raise ValueError("activation (GEMM1) and routing (GEMM2) do not come together")
    if activation is not None and N % 2:
        raise ValueError(f"an activated GEMM needs gate/up pairs: N = {N} is odd")
    if bias is not None and (tuple(bias.shape) != (E, N) or not bias.is_floating_point()):
        raise ValueError(f"bias must be a float [E, N] = {(E, N)}, got {bias.dtype} {tuple(bias.shape)}")
    if bias is not None and activation is None and routing is None:
        raise ValueError("bias comes with an activation or with routing (the plain GEMM stores the sums)")
    tensors = [a, blocks, scales, expert_offsets] + ([bias] if bias is not None else [])
    if routing is not None:
        gather_idx, topk_weights = routing
        if gather_idx.dtype != torch.int32 or tuple(gather_idx.shape) != (M, ):
            raise ValueError(f"gather_idx must be int32 [M] = [{M}], got {gather_idx.dtype} {tuple(gather_idx.shape)}")
        if topk_weights.dim() != 2 or not topk_weights.is_floating_point():
            raise ValueError(f"topk_weights must be a float [T, top_k], got {topk_weights.dtype} "
                             f"{tuple(topk_weights.shape)}")
        tensors += [gather_idx, topk_weights]
    device = check_device(GEMM_NAME, *tensors)
    out = torch.empty(M, N // 2 if activation is not None else N, device=device, dtype=torch.bfloat16)
    if out.numel() == 0 or E == 0:
        return out
    w_rows = HALF_N if form == FORM_SPLIT else SWAP_W_ROWS
    offsets, tile_expert, tile_row, num_m_tiles = segment_tile_map(expert_offsets, M, E, block_m, count_tiles=True)
    bound_tiles = tile_expert.numel() * triton.cdiv(N, 2 * w_rows)  # sizes the persistent grid
    grid = (max(1, min(num_sms(a.device), bound_tiles)), )
    epilogue = EPILOGUE_PAIRS if activation is not None else EPILOGUE_ROUTED if routing is not None else EPILOGUE_PLAIN
    gather_idx, topk_weights = routing if routing is not None else (out, out)
    bias_args = (bias, bias.stride(0), bias.stride(1)) if bias is not None else (out, 0, 0)
    args = (scales, out, tile_expert, tile_row, num_m_tiles, offsets, M, N, K, N, scales.stride(0), scales.stride(1),
            scales.stride(2), out.stride(0), *bias_args, gather_idx, topk_weights, topk_weights.stride(0),
            topk_weights.stride(-1), float(alpha), float(limit))
    common = dict(NUM_STAGES=stages, GROUP_M=GROUP_M, EPILOGUE=epilogue,
                  ACTIVATION=int(Activation.of(activation if activation is not None else "none")),
                  HAS_BIAS=bias is not None, TOP_K=topk_weights.shape[1] if routing is not None else 1,
                  CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4, maxnreg=MAXNREG)
    # Launched directly, as gluon_fp8's GEMM: a call that reaches here keeps no plan (host/replay.py)
    unrecorded_launch(GEMM_NAME)
    if form == FORM_SWAP:
        acc, operand_l, rows_l, split_l, out_l, pair_l, half_l, a_smem, w_smem = swap_layouts(block_m)
        bytes_l = dec_l = None
    else:
        acc, out_l, bytes_l, split_l, dec_l, a_smem, w_smem, pair_l, half_l = kernel_layouts(block_m)
        operand_l = rows_l = None
    a_desc = TensorDescriptor.from_tensor(a, [block_m, BLOCK_K], a_smem)
    w_desc = TensorDescriptor.from_tensor(blocks.view(E * N, K // 2), [w_rows, BLOCK_K // 2], w_smem)
    _mxfp4_gemm_kernel[grid](a_desc, w_desc, *args, acc_layout=acc, out_layout=out_l, split_layout=split_l,
                             pair_layout=pair_l, half_layout=half_l, bytes_layout=bytes_l, dec_layout=dec_l,
                             operand_layout=operand_l, rows_layout=rows_l, SWAP=form == FORM_SWAP, **common)
    return out


def gemm_tile(num_tokens: int, top_k: int, num_experts: int) -> tuple[str, int]:
    """The engine's (form, block_m) for a call, by rows per expert (T * top_k / E): the swapped form's 256-token tiles
    from SWAP_FROM, the split form's 128-row tiles from ROWS128_FROM, else its 64-row tiles."""
    rows = num_tokens * top_k
    experts = max(num_experts, 1)
    if rows >= SWAP_FROM * experts:
        return FORM_SWAP, 256
    return FORM_SPLIT, 128 if rows >= ROWS128_FROM * experts else 64
