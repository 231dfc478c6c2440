"""Warp-specialized Hopper (SM90) FP8 GEMMs with DeepSeek-style block scales, written in Gluon.

    out[M, N] (bf16) = (A[M, K] * a_scale[M, K/128]) @ (B[N, K] * b_scale[N/128, K/128])^T

A and B are float8_e4m3fn, K-contiguous; a_scale holds one fp32 scale per row and 128-wide K block, b_scale one per
128 x 128 block of B (the `weight_scale_inv` convention, w ~ w_fp8 * scale). The sum runs in fp32 with per-K-block
promotion: the tensor cores sum one K block (BLOCK_K = 128, four k32 wgmma steps, in the hardware's FP8 accumulator),
then that partial sum is multiplied by a_scale[m, kb] * b_scale[n / 128, kb] and added to an fp32 accumulator in
registers. The grouped form runs the same kernel over expert-sorted rows: rows of expert e are A[offsets[e]:
offsets[e + 1]] and meet B[e] [N, K] with scales b_scale[e] [N/128, K/128].

Why Gluon: in the portable Triton kernel the promotion after every K block waits for the block's wgmma, so one warp
group alternates between tensor-core work and CUDA-core work and the tensor cores idle during the latter. Here the
kernel is gemm/gluon_ws.py's warp-specialized skeleton (one CTA per SM, persistent over output tiles; a TMA producer
warp filling a ring of NUM_STAGES stages; two consumer warp groups on the two 64-row halves of each 128-row tile)
with this consumer (`_mma_partition`): per K block wait ready[s], async wgmma of its A half against the whole B
stage into a fresh fp32 partial sum, wait for it, release the stage (arrive on empty[s]), promote with the scales
(loaded one K block ahead); after the K loop, the bf16 epilogue (masked stores).

The two consumers drift apart, so while one promotes its partial sum the other's wgmma keeps the tensor cores busy.
Each consumer holds a 64 x 128 fp32 accumulator and a 64 x 128 partial sum (64 + 64 registers per thread).
Registers: 3 warp groups x 128 threads x MAXNREG 168; inside the partitions setmaxnreg moves them to 240 per consumer
thread and 24 per producer-warp-group thread (240 + 240 + 24 = 3 x 168).

Tiles: BLOCK_M 128 (two 64-row halves), BLOCK_N 128, BLOCK_K 128, NUM_STAGES 4: 4 x 32 KiB of fp8 stages. Tile order:
grouped along M by GROUP_M (tiles that share B columns run together, for L2 reuse). The grouped form walks the tile
map of dispatch.segments.segment_tile_map.

Needs Triton 3.6's Gluon (`available()` says whether it can run here); importing this module never needs it.
"""

# String annotations: the kernels' `gl.constexpr` parameters need no Gluon at import (Triton reads "constexpr" from
# the string).
from __future__ import annotations

import dataclasses

import torch
import triton

from ..formats.fp8 import W8A8_DTYPE, fp8_max
from ..dispatch.segments import segment_tile_map
from ..host.device import num_sms
from ..host.replay import unrecorded_launch
# available, unavailable_reason and TESTED_TRITON are gluon_ws's, named here too: the FP8 engine's callers ask this
# module whether its GEMM runs.
from .gluon_ws import (NO_GATE, TESTED_TRITON, Gate, TensorDescriptor, available, check_activation,  # noqa: F401
                       check_device, check_expert_offsets, check_operand, check_stacked_weight, consumer_stage, gl,
                       gluon_jit, load_partition, mbarrier, needs_launch, stage_ring, store_layout, store_tile,
                       tile_at, tile_counts, unavailable_reason, warpgroup_mma, warpgroup_mma_wait)
from .jit import ACT_NONE, Activation, add_bias, apply_activation
from .w8a8 import fp8_rows
from .w8a8_jit import quantize_rows

SCALE_BLOCK = 128  # the side of a DeepSeek scale block, along K for A and along N and K for B
OPERAND_DTYPES = (W8A8_DTYPE, )  # what both operands are: e4m3fn only (not AMD's e4m3fnuz of formats.fp8.FP8_DTYPES)
GEMM_NAME = "Gluon FP8 GEMM"


@gluon_jit
def _mma_partition(a_bufs, b_bufs, ready_bars, empty_bars, out_ptr, a_scale_ptr, b_scale_ptr, M, N, K, num_pid_m,
                   num_pid_n, num_tiles, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, stride_out_m,
                   stride_a_scale_m, stride_a_scale_k, stride_b_scale_e, stride_b_scale_n, stride_b_scale_k,
                   out_scale_ptr, stride_out_scale_m, up_scale_offset, bias_ptr, bias_up_ptr, stride_bias_e,
                   stride_bias_n, alpha, limit, fp8_max, WARP_GROUP: gl.constexpr, GROUP_M: gl.constexpr,
                   GROUPED: gl.constexpr, ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr, acc_layout: gl.constexpr,
                   out_layout: gl.constexpr):
    """Consumer warp group WARP_GROUP (0 or 1): rows [WARP_GROUP * BLOCK_M/2, +BLOCK_M/2) of every tile of this
    program. Per K block: wgmma of its A half and B into a fresh fp32 partial sum, the scales' loads under it, wait,
    release the stage, acc += partial * a_scale[rows, kb] * b_scale[n block, kb]. Epilogue: bf16, coalesced masked
    stores of rows < row_end (the expert's end in the grouped form) and columns < N.

    Gated (ACTIVATION not NONE, two B tiles: gate and up): the stage's gate tile, then its up tile, each into the
    partial sum and promoted into its own accumulator (the up tile's scales up_scale_offset blocks of b_scale
    further); the epilogue adds the biases, activates and quantizes the tile's row to e4m3 with one scale per row
    (BLOCK_N = 128: one scale group; gemm.jit's `add_bias` and `apply_activation`, gemm.w8a8_jit's `quantize_rows`,
    the portable kernels' arithmetic), stored to out (e4m3) and out_scale [rows, N / 128] (fp32). BLOCK_M 64
    (SPLIT_N, with two B tiles): each consumer takes the whole 64-row A tile against its own B tile, the 128-column
    half WARP_GROUP of a 64 x 256 output tile, with the single-accumulator loop above."""
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    # BLOCK_M 64 (`GluonFp8Config.BLOCK_M`): the consumers split the 64 x 2 BLOCK_N tile's columns, each the whole
    # A tile against its own B tile; otherwise each takes a 64-row half of the 128-row tile
    SPLIT_N: gl.constexpr = BLOCK_M == 64
    HALF_M: gl.constexpr = BLOCK_M if SPLIT_N else BLOCK_M // 2  # a consumer's rows
    SCALE_BLOCK: gl.constexpr = 128
    # columns of an output tile: the gated tile's are act(gate, up) of BLOCK_N pairs, the 64-row tile's two B tiles'
    TILE_N: gl.constexpr = 2 * BLOCK_N if SPLIT_N else BLOCK_N
    k_blocks = gl.cdiv(K, BLOCK_K)
    b_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, acc_layout)
    it = 0
    for tile_id in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        row_start, row_end, expert, pid_n = tile_at(tile_id, num_pid_m, num_pid_n, M, tile_expert_ptr, tile_row_ptr,
                                                    expert_offsets_ptr, BLOCK_M, GROUP_M, GROUPED)
        if SPLIT_N:
            row_half = row_start
            col_start = pid_n * TILE_N + WARP_GROUP * BLOCK_N  # this consumer's columns
            # a last tile's second half may lie past N: it reads the last scale row instead (and is never stored)
            scale_row = gl.minimum(col_start, N - 1) // SCALE_BLOCK
        else:
            row_half = row_start + WARP_GROUP * HALF_M
            col_start = pid_n * TILE_N
            scale_row = col_start // SCALE_BLOCK
        offs_m = row_half + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, acc_layout))
        mask_m = offs_m < row_end
        a_s_ptrs = a_scale_ptr + offs_m.to(gl.int64) * stride_a_scale_m
        b_s_ptr = b_scale_ptr + expert * stride_b_scale_e + scale_row * stride_b_scale_n

        # The scales of K block kb are loaded one block ahead, under the wgmma of block kb - 1.
        b_a_s = gl.load(a_s_ptrs, mask=mask_m, other=0.0)  # [HALF_M]
        b_b_s = gl.load(b_s_ptr)
        b_acc = b_zero  # [HALF_M, BLOCK_N]
        if ACTIVATION == ACT_NONE:
            for kb in range(k_blocks):
                stage, a_tile = consumer_stage(a_bufs, ready_bars, it, WARP_GROUP, SPLIT_N)  # [HALF_M, BLOCK_K]
                b_index = 2 * stage + WARP_GROUP if SPLIT_N else stage
                b_tile = b_bufs.index(b_index).permute((1, 0))  # [BLOCK_K, BLOCK_N], a K-major view
                b_part = warpgroup_mma(a_tile, b_tile, b_zero, use_acc=False, is_async=True)
                # The last block reloads its own scales rather than reading past the row.
                k_next = gl.minimum(kb + 1, k_blocks - 1) * BLOCK_K // SCALE_BLOCK
                b_a_s_next = gl.load(a_s_ptrs + k_next * stride_a_scale_k, mask=mask_m, other=0.0)
                b_b_s_next = gl.load(b_s_ptr + k_next * stride_b_scale_k)
                b_part = warpgroup_mma_wait(num_outstanding=0, deps=(b_part, ))
                mbarrier.arrive(empty_bars.index(stage), count=1)
                b_acc = b_acc + b_part * gl.expand_dims(b_a_s * b_b_s, 1)
                b_a_s = b_a_s_next
                b_b_s = b_b_s_next
                it += 1
            b_out = gl.convert_layout(b_acc.to(out_ptr.dtype.element_ty), out_layout)  # [HALF_M, BLOCK_N]
        else:
            b_s_up_ptr = b_s_ptr + up_scale_offset * stride_b_scale_n
            b_up = b_zero
            # Three 64 x 128 fp32 tiles (gate, up, the partial sum). Promoting as (partial * b scale) * a scale,
            # one more multiply per element than partial * (a scale * b scale), is what ptxas allocates without
            # spills (the product form spills 120-208 bytes in the K loop at any register count up to 256).
            b_part = b_zero
            for kb in range(k_blocks):
                stage, a_tile = consumer_stage(a_bufs, ready_bars, it, WARP_GROUP, False)  # [HALF_M, BLOCK_K]
                b_part = warpgroup_mma(a_tile, b_bufs.index(2 * stage).permute((1, 0)), b_part, use_acc=False,
                                       is_async=True)
                k_scale = kb * BLOCK_K // SCALE_BLOCK
                rows_k = row_half + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, acc_layout))
                b_a_s = gl.load(a_scale_ptr + k_scale * stride_a_scale_k + rows_k * stride_a_scale_m,
                                mask=rows_k < row_end, other=0.0)
                b_g_s = gl.load(b_s_ptr + k_scale * stride_b_scale_k)
                b_u_s = gl.load(b_s_up_ptr + k_scale * stride_b_scale_k)
                b_part = warpgroup_mma_wait(num_outstanding=0, deps=(b_part, ))
                b_acc = gl.fma(b_part * b_g_s, gl.expand_dims(b_a_s, 1), b_acc)
                b_part = warpgroup_mma(a_tile, b_bufs.index(2 * stage + 1).permute((1, 0)), b_part, use_acc=False,
                                       is_async=True)
                b_part = warpgroup_mma_wait(num_outstanding=0, deps=(b_part, ))
                mbarrier.arrive(empty_bars.index(stage), count=1)
                b_up = gl.fma(b_part * b_u_s, gl.expand_dims(b_a_s, 1), b_up)
                it += 1
            offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
            if HAS_BIAS:
                b_acc, b_up = add_bias(b_acc, b_up, expert, offs_n, offs_n < N, bias_ptr, bias_up_ptr, stride_bias_e,
                                       stride_bias_n, ACTIVATION)
            b_q, b_q_s = quantize_rows(apply_activation(b_acc, b_up, alpha, limit, ACTIVATION), fp8_max, False)
            gl.store(out_scale_ptr + offs_m.to(gl.int64) * stride_out_scale_m + pid_n, b_q_s, mask=mask_m)
            b_out = gl.convert_layout(b_q, out_layout)  # [HALF_M, BLOCK_N] e4m3
        store_tile(out_ptr, stride_out_m, b_out, row_half, row_end, col_start, N, out_layout)


@gluon_jit
def _fp8_block_scaled_gemm_kernel(a_desc, b_desc, out_ptr, a_scale_ptr, b_scale_ptr, tile_expert_ptr, tile_row_ptr,
                                  num_m_tiles_ptr, expert_offsets_ptr, M, N, K, stride_out_m, stride_a_scale_m,
                                  stride_a_scale_k, stride_b_scale_e, stride_b_scale_n, stride_b_scale_k,
                                  b_rows_per_expert, up_offset, out_scale_ptr, stride_out_scale_m, up_scale_offset,
                                  bias_ptr, bias_up_ptr, stride_bias_e, stride_bias_n, alpha, limit, fp8_max,
                                  NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr, GROUPED: gl.constexpr,
                                  ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr, N_TILES: gl.constexpr,
                                  CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, acc_layout: gl.constexpr,
                                  out_layout: gl.constexpr, num_warps: gl.constexpr):
    """FP8 x FP8 -> bf16 GEMM with block-scale promotion, persistent and warp-specialized (module docstring); gated
    (ACTIVATION not NONE): GEMM1 with its activation, out e4m3 with out_scale (`fp8_block_gated_grouped_gemm`);
    N_TILES 2 (plain, BLOCK_M 64 only): output tiles of 2 BLOCK_N columns, two B tiles per stage.

    Grid: (min(#SMs, #tiles),). Program p owns tiles p, p + grid, ... of the grouped-M order over
    cdiv(M, BLOCK_M) x cdiv(N, TILE_N) tiles (TILE_N = N_TILES x BLOCK_N); GROUPED: over num_m_tiles[0] x
    cdiv(N, TILE_N) tiles, row block i being (tile_expert[i], tile_row[i]), the B rows of expert e starting at
    e * b_rows_per_expert (the second B tile's up_offset further: gated, its up rows; 64-row tiles, BLOCK_N). num_warps
    = 4:
    the default partition is consumer 0; consumer 1 (4 warps) and the producer (1 warp) are workers.
    """
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    B_TILES: gl.constexpr = 1 if ACTIVATION == ACT_NONE and N_TILES == 1 else 2
    TILE_N: gl.constexpr = N_TILES * BLOCK_N
    gl.static_assert(num_warps == 4, "each consumer is one warp group")
    gl.static_assert((BLOCK_M == 128 and N_TILES == 1)
                     or (BLOCK_M == 64 and N_TILES == 2 and ACTIVATION == ACT_NONE),
                     "two 64-row consumer halves, or (64 rows) two column halves")
    gl.static_assert(128 % BLOCK_N == 0, "one b_scale block per B tile")
    gl.static_assert(ACTIVATION == ACT_NONE or (BLOCK_N == 128 and N_TILES == 1),
                     "gated: one 128-column scale group per tile")
    gl.static_assert(N_TILES == 1 or BLOCK_N == 128, "64 rows: the second B tile starts on a b_scale block")
    gl.static_assert(128 % a_desc.block_type.shape[1] == 0, "one scale per K block")

    a_bufs, b_bufs, ready_bars, empty_bars = stage_ring(a_desc, b_desc, NUM_STAGES, B_TILES)
    num_pid_m, num_pid_n, num_tiles = tile_counts(M, N, num_m_tiles_ptr, BLOCK_M, TILE_N, GROUPED)

    gl.warp_specialize([
        (_mma_partition, (a_bufs, b_bufs, ready_bars, empty_bars, out_ptr, a_scale_ptr, b_scale_ptr, M, N, K,
                          num_pid_m, num_pid_n, num_tiles, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
                          stride_out_m, stride_a_scale_m, stride_a_scale_k, stride_b_scale_e, stride_b_scale_n,
                          stride_b_scale_k, out_scale_ptr, stride_out_scale_m, up_scale_offset, bias_ptr, bias_up_ptr,
                          stride_bias_e, stride_bias_n, alpha, limit, fp8_max, 0, GROUP_M, GROUPED, ACTIVATION,
                          HAS_BIAS, acc_layout, out_layout)),
        (_mma_partition, (a_bufs, b_bufs, ready_bars, empty_bars, out_ptr, a_scale_ptr, b_scale_ptr, M, N, K,
                          num_pid_m, num_pid_n, num_tiles, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
                          stride_out_m, stride_a_scale_m, stride_a_scale_k, stride_b_scale_e, stride_b_scale_n,
                          stride_b_scale_k, out_scale_ptr, stride_out_scale_m, up_scale_offset, bias_ptr, bias_up_ptr,
                          stride_bias_e, stride_bias_n, alpha, limit, fp8_max, 1, GROUP_M, GROUPED, ACTIVATION,
                          HAS_BIAS, acc_layout, out_layout)),
        (load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, M, K, num_pid_m, num_pid_n,
                          num_tiles, b_rows_per_expert, up_offset, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
                          GROUP_M, GROUPED, B_TILES, TILE_N)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@dataclasses.dataclass(frozen=True)
class GluonFp8Config:
    """Launch parameters of `_fp8_block_scaled_gemm_kernel`.

    BLOCK_M is 128 (two 64-row warp-group halves), or 64 with N_TILES 2 (the warp groups on the two column halves);
    BLOCK_N (the rows of a B tile) and BLOCK_K must divide the 128 scale block. Registers: 3 warp groups x 128
    threads x MAXNREG = 64512 of the SM's 65536; the producer's warp group drops to PRODUCER_REGS, consumer 1 asks
    CONSUMER_REGS and consumer 0 (the default partition) gets what is left.
    """
    BLOCK_M: int = 128
    BLOCK_N: int = 128
    BLOCK_K: int = 128
    NUM_STAGES: int = 4  # 4 x (16 + 16) KiB of fp8 operands
    GROUP_M: int = 8  # row blocks that sweep the columns together (L2 reuse of B)
    MAXNREG: int = 168  # 65536 / (3 * 128), rounded down to a multiple of 8
    CONSUMER_REGS: int = 240
    PRODUCER_REGS: int = 24  # the floor of setmaxnreg
    # The plain GEMM's output tile in B tiles: 1 (128 x BLOCK_N), or 2 with BLOCK_M 64 (64 x 256, BLOCK_N 128: two B
    # tiles per stage, one per consumer)
    N_TILES: int = 1


DEFAULT_CONFIG = GluonFp8Config()
# 64 x 256 tiles, the consumers on the two column halves: the w8a8 engine's plain GEMMs below
# gluon_experts.ROWS64_BELOW_ROWS rows per expert, where it measured faster
ROWS64_CONFIG = GluonFp8Config(BLOCK_M=64, N_TILES=2)


def kernel_layouts(cfg: GluonFp8Config = DEFAULT_CONFIG, gated: bool = False):
    """-> (acc_layout, out_layout): the wgmma accumulator of a consumer's 64 rows (m64 n128 k32 steps over one warp
    group) and the epilogue's store layout: 16-byte vectors of bf16 (a warp writing two 256-byte rows) or, gated,
    of e4m3."""
    acc_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cfg.BLOCK_N, 32])
    return acc_layout, store_layout(64, cfg.BLOCK_N, 1 if gated else 2)


def operand_layouts(cfg: GluonFp8Config = DEFAULT_CONFIG):
    """-> (a_layout, b_layout): the NVMMA shared layouts (128-byte swizzle) of the A and B stages."""
    a_layout = gl.NVMMASharedLayout.get_default_for([cfg.BLOCK_M, cfg.BLOCK_K], gl.float8e4nv)
    b_layout = gl.NVMMASharedLayout.get_default_for([cfg.BLOCK_N, cfg.BLOCK_K], gl.float8e4nv)
    return a_layout, b_layout


def _check_config(cfg: GluonFp8Config) -> None:
    if (cfg.BLOCK_M, cfg.N_TILES) not in ((128, 1), (64, 2)):
        raise ValueError(f"BLOCK_M must be 128 with N_TILES 1 (two 64-row warp groups), or 64 with N_TILES 2 (the two "
                         f"warp groups on the two column halves), got {cfg.BLOCK_M} (N_TILES {cfg.N_TILES})")
    for name in ("BLOCK_N", "BLOCK_K"):
        value = getattr(cfg, name)
        if value not in (64, 128):
            raise ValueError(f"{name} must be 64 or 128 (a divisor of the 128 scale block), got {value}")
    if cfg.N_TILES == 2 and cfg.BLOCK_N != SCALE_BLOCK:
        raise ValueError(f"N_TILES must be 1, or 2 with BLOCK_N {SCALE_BLOCK}, got {cfg.N_TILES} (BLOCK_N "
                         f"{cfg.BLOCK_N})")


def _check_scale(name: str, s: torch.Tensor, shape: tuple[int, ...]) -> None:
    if s.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {s.dtype}")
    if tuple(s.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(s.shape)}")


def _launch(a, b_rows, a_scale, b_scale, out, K, N, tile_expert, tile_row, num_m_tiles, expert_offsets, bound_tiles,
            stride_b_scale, grouped, cfg, b_rows_per_expert=0, gate=None, out_scale=None):
    gated = gate is not None
    gate = NO_GATE if gate is None else gate
    out_scale = out if out_scale is None else out_scale
    up_offset = N if gated else cfg.BLOCK_N
    a_layout, b_layout = operand_layouts(cfg)
    acc_layout, out_layout = kernel_layouts(cfg, gated)
    a_desc = TensorDescriptor.from_tensor(a, [cfg.BLOCK_M, cfg.BLOCK_K], a_layout)
    b_desc = TensorDescriptor.from_tensor(b_rows, [cfg.BLOCK_N, cfg.BLOCK_K], b_layout)
    grid = (max(1, min(num_sms(a.device), bound_tiles)), )
    # Launched directly, not through host.replay.launch: a replay of its TMA descriptors and warp-specialized
    # launch has not run on a GPU, so a call that reaches here keeps no plan (the whole host path every call).
    unrecorded_launch(GEMM_NAME)
    _fp8_block_scaled_gemm_kernel[grid](
        a_desc, b_desc, out, a_scale, b_scale, tile_expert, tile_row, num_m_tiles, expert_offsets,
        a.shape[0], N, K, out.stride(0), a_scale.stride(0), a_scale.stride(1), *stride_b_scale,
        # the second B tile: gated, the up rows (F = N further); 64-row tiles, the next BLOCK_N rows
        b_rows_per_expert, up_offset, out_scale, out_scale.stride(0), up_offset // SCALE_BLOCK, *gate.bias_args(out),
        gate.alpha, gate.limit, fp8_max(W8A8_DTYPE),
        NUM_STAGES=cfg.NUM_STAGES, GROUP_M=cfg.GROUP_M, GROUPED=grouped, ACTIVATION=gate.activation,
        HAS_BIAS=gate.bias is not None, N_TILES=cfg.N_TILES, CONSUMER_REGS=cfg.CONSUMER_REGS,
        PRODUCER_REGS=cfg.PRODUCER_REGS, acc_layout=acc_layout, out_layout=out_layout, num_warps=4,
        maxnreg=cfg.MAXNREG)
    return out


def fp8_block_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, *,
                   cfg: GluonFp8Config = DEFAULT_CONFIG) -> torch.Tensor:
    """out [M, N] bf16 = (a * a_scale) @ (b * b_scale)^T with 128-block scales (module docstring).

    a [M, K] and b [N, K] float8_e4m3fn, K-contiguous, K % 16 == 0; a_scale [M, cdiv(K, 128)] and
    b_scale [cdiv(N, 128), cdiv(K, 128)] float32 (any strides).
    """
    _check_config(cfg)
    check_operand("a", a, 2, OPERAND_DTYPES)
    check_operand("b", b, 2, OPERAND_DTYPES)
    M, K = a.shape
    N = b.shape[0]
    if b.shape[1] != K:
        raise ValueError(f"a is [M, K] = {tuple(a.shape)} but b is [N, K] = {tuple(b.shape)}")
    k_scales = triton.cdiv(K, SCALE_BLOCK)
    _check_scale("a_scale", a_scale, (M, k_scales))
    _check_scale("b_scale", b_scale, (triton.cdiv(N, SCALE_BLOCK), k_scales))
    device = check_device(GEMM_NAME, a, a_scale, b, b_scale)
    out = torch.empty(M, N, device=device, dtype=torch.bfloat16)
    if not needs_launch(out, K):
        return out
    tiles = triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N * cfg.N_TILES)
    return _launch(a, b, a_scale, b_scale, out, K, N, out, out, out, out, tiles,
                   (0, b_scale.stride(0), b_scale.stride(1)), False, cfg)


def fp8_block_grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                           expert_offsets: torch.Tensor, *, cfg: GluonFp8Config = DEFAULT_CONFIG) -> torch.Tensor:
    """out [M, N] bf16: rows of expert e, out[o_e:o_{e+1}] = (a * a_scale)[o_e:o_{e+1}] @ (b[e] * b_scale[e])^T.

    a [M, K] float8_e4m3fn sorted by expert, expert_offsets int32 [E + 1] (o_0 = 0, nondecreasing, o_E <= M: rows past
    o_E are left unwritten, as torch.empty leaves them; offsets outside that are clamped into it on the device, never
    read as given); b [E, N, K] float8_e4m3fn (contiguous), b_scale [E, cdiv(N, 128), cdiv(K, 128)] and a_scale
    [M, cdiv(K, 128)] float32. No host sync: the launch is sized by the tile map's bound (M + E * 127) // 128.
    """
    _check_config(cfg)
    check_operand("a", a, 2, OPERAND_DTYPES)
    check_operand("b", b, 3, OPERAND_DTYPES)
    E, N = check_stacked_weight(b)
    M, K = a.shape
    if b.shape[2] != K:
        raise ValueError(f"a is [M, K] = {tuple(a.shape)} but b is [E, N, K] = {tuple(b.shape)}")
    check_expert_offsets(expert_offsets, E)
    k_scales = triton.cdiv(K, SCALE_BLOCK)
    _check_scale("a_scale", a_scale, (M, k_scales))
    _check_scale("b_scale", b_scale, (E, triton.cdiv(N, SCALE_BLOCK), k_scales))
    device = check_device(GEMM_NAME, a, a_scale, b, b_scale, expert_offsets)
    out = torch.empty(M, N, device=device, dtype=torch.bfloat16)
    if not needs_launch(out, K, E):
        return out
    offsets, tile_expert, tile_row, num_m_tiles = segment_tile_map(expert_offsets, M, E, cfg.BLOCK_M,
                                                                  count_tiles=True)
    bound_tiles = tile_expert.numel() * triton.cdiv(N, cfg.BLOCK_N * cfg.N_TILES)  # sizes the persistent grid
    return _launch(a, b.view(E * N, K), a_scale, b_scale, out, K, N, tile_expert, tile_row, num_m_tiles, offsets,
                   bound_tiles, b_scale.stride(), True, cfg, N)


def fp8_block_gated_grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                                 expert_offsets: torch.Tensor, *, activation: str = "silu",
                                 gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
                                 alpha: float = 1.702, limit: float = 7.0,
                                 cfg: GluonFp8Config = DEFAULT_CONFIG) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM1 of the w8a8 experts with its activation and GEMM2's quantization in the epilogue -> (h [M, F] e4m3,
    h_scale [M, F / 128] fp32), h * h_scale ~ act(gate + gate_bias, up + up_bias) with one scale per row and 128
    columns, where for the rows of expert e gate = (a * a_scale)[o_e:o_{e+1}] @ (b[e, :F] * b_scale)^T and up likewise
    with b[e, F:] (gemm.jit's activation, "silu" or "swiglu_oai" with alpha and limit; gemm.w8a8_jit's
    quantize_rows). The sums and the activation stay in fp32 (the separate pass reads them rounded to bf16).

    b [E, 2F, K] float8_e4m3fn (contiguous), gate rows then up rows, F a multiple of 128 (each 128-column output tile
    is one scale group, and the up rows start on a b_scale block); b_scale [E, 2F / 128, cdiv(K, 128)]; a, a_scale
    and expert_offsets as in `fp8_block_grouped_gemm`; gate_bias and up_bias [E, F] with equal strides, or None.
    Rows past the experts' last offset are left unwritten in h and h_scale.
    """
    _check_config(cfg)
    if cfg.BLOCK_N != SCALE_BLOCK or cfg.N_TILES != 1 or cfg.BLOCK_M != 128:
        raise ValueError(f"BLOCK_N must be {SCALE_BLOCK}, N_TILES 1 and BLOCK_M 128 for the gated GEMM (one scale "
                         f"group per tile, its two B tiles gate and up), got {cfg.BLOCK_N}, {cfg.N_TILES} and "
                         f"{cfg.BLOCK_M}")
    check_activation(activation)
    check_operand("a", a, 2, OPERAND_DTYPES)
    check_operand("b", b, 3, OPERAND_DTYPES)
    E, two_f = check_stacked_weight(b)
    F = two_f // 2
    if two_f % (2 * SCALE_BLOCK):
        raise ValueError(f"b must be [E, 2F, K] (gate rows then up rows) with F a multiple of {SCALE_BLOCK}, got "
                         f"{two_f} rows per expert")
    M, K = a.shape
    if b.shape[2] != K:
        raise ValueError(f"a is [M, K] = {tuple(a.shape)} but b is [E, 2F, K] = {tuple(b.shape)}")
    if K == 0:
        raise ValueError("a must have K > 0 columns (the gated GEMM has no empty-sum form)")
    check_expert_offsets(expert_offsets, E)
    k_scales = triton.cdiv(K, SCALE_BLOCK)
    _check_scale("a_scale", a_scale, (M, k_scales))
    _check_scale("b_scale", b_scale, (E, two_f // SCALE_BLOCK, k_scales))
    if (gate_bias is None) != (up_bias is None):
        raise ValueError("gate_bias and up_bias come together")
    biases = () if gate_bias is None else (gate_bias, up_bias)
    for name, bias in zip(("gate_bias", "up_bias"), biases):
        if tuple(bias.shape) != (E, F) or bias.stride() != gate_bias.stride():
            raise ValueError(f"{name} must be [E, F] = [{E}, {F}] with gate_bias's strides, got {tuple(bias.shape)} "
                             f"strides {bias.stride()}")
    device = check_device(GEMM_NAME, a, a_scale, b, b_scale, expert_offsets, *biases)
    h = fp8_rows(M, F, device)
    h_scale = torch.empty((M, F // SCALE_BLOCK), device=device, dtype=torch.float32)
    if h.numel() == 0 or E == 0:
        return h, h_scale
    offsets, tile_expert, tile_row, num_m_tiles = segment_tile_map(expert_offsets, M, E, cfg.BLOCK_M,
                                                                  count_tiles=True)
    bound_tiles = tile_expert.numel() * triton.cdiv(F, cfg.BLOCK_N)  # sizes the persistent grid
    gate = Gate(int(Activation.of(activation)), gate_bias, up_bias, float(alpha), float(limit))
    _launch(a, b.view(E * two_f, K), a_scale, b_scale, h, K, F, tile_expert, tile_row, num_m_tiles, offsets,
            bound_tiles, b_scale.stride(), True, cfg, two_f, gate, h_scale)
    return h, h_scale
