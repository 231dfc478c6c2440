"""Warp-specialized Hopper (SM90) bf16 / fp16 GEMMs, written in Gluon: gemm/gluon_ws.py's skeleton with an
accumulator kept in registers across the K loop.

    out[M, N] = A[M, K] @ B[N, K]^T        (A and B bf16, or both fp16; fp32 sums; out in A's dtype)

The grouped form runs the same kernel over expert-sorted rows: rows of expert e are A[offsets[e]:offsets[e + 1]] and
meet B[e] [N, K] (B viewed as one [E * N, K] matrix); the dense form is one expert over all rows (for probing the
kernel against torch.matmul). The gated form (`bf16_gated_grouped_gemm`, the experts' GEMM1) reads B[e] as [2F, K],
gate rows then up rows: each stage holds a gate and an up tile of BLOCK_N rows, each consumer sums them into two
accumulators (two wgmma per K block, one K block's pair in flight), and the epilogue stores act(gate + bias,
up + bias) [rows, F] (gemm.jit's `add_bias` and `apply_activation`: the portable kernels' epilogue arithmetic).

One CTA per SM, persistent over output tiles (gluon_ws's module docstring draws the partitions): the TMA producer warp
(`gluon_ws.load_partition`) fills a ring of NUM_STAGES stages of A [128, 64] and B [BLOCK_N, 64]; each consumer warp
group (`_mma_partition`) owns one 64-row half of every 128-row tile and keeps its [64, BLOCK_N] fp32 accumulator in
registers for the whole K loop: per K block it waits ready[s], issues an async wgmma of its A half against the whole
B stage into the accumulator and waits until at most one wgmma is in flight, i.e. until the previous K block's has
retired, whose stage it then releases (arrives on empty[s]); after the loop it waits for the last wgmma, releases its
stage and stores the tile (masked: rows < the expert's end, columns < N). Holding one wgmma in flight keeps the tensor
cores fed across K blocks (the next one is queued before the previous one drains) while the consumer stays at most
two stages behind the producer.

Tiles: BLOCK_M 128 (two 64-row halves), BLOCK_K 64 (rows of 128 bytes: the 128-byte swizzle), BLOCK_N 256, chosen by
registers: a consumer's accumulator is 64 x 256 fp32 over 128 threads = 128 registers per thread of the 240 setmaxnreg
gives it (64 at BLOCK_N 128, which would leave half the register file idle and halve the work per byte of A read from
shared memory: m64n256k16 is the widest wgmma). NUM_STAGES 4: 4 x (16 + 32) KiB = 192 KiB of stages. The epilogue
stores straight from the wgmma layout (each thread 4-byte pairs of columns, so a warp's store covers 16 bytes of 8
rows): no shared memory beside the stages. `GluonBf16Config.COALESCED_STORES` stages the tile through shared memory
instead (a layout conversion: 16-byte vectors along whole rows), 32 KiB more; which is faster is not measured yet.

Needs Triton 3.6's Gluon (`available()`: gluon_ws's answer, shared with gemm/gluon_fp8.py); importing this module
never needs it.
"""

# String annotations: the kernels' `gl.constexpr` parameters need no Gluon at import (Triton reads "constexpr" from
# the string).
from __future__ import annotations

import dataclasses

import torch
import triton

from ..dispatch.segments import segment_tile_map
from ..host.device import num_sms
from ..host.replay import unrecorded_launch
# available, unavailable_reason and TESTED_TRITON are gluon_ws's (one answer for both Gluon GEMMs), named here too:
# the bf16 engine's callers ask this module whether its GEMM runs.
from .gluon_ws import (NO_GATE, TESTED_TRITON, Gate, TensorDescriptor, available, check_activation,  # noqa: F401
                       check_device, check_expert_offsets, check_operand, check_stacked_weight, consumer_stage, gl,
                       gluon_jit, load_partition, mbarrier, needs_launch, stage_ring, store_layout, store_tile,
                       tile_at, tile_counts, unavailable_reason, warpgroup_mma, warpgroup_mma_wait)
from .jit import ACT_NONE, Activation, add_bias, apply_activation

DTYPES = (torch.bfloat16, torch.float16)  # what both operands are (one of them for both)
GEMM_NAME = "Gluon bf16 GEMM"


@gluon_jit
def _mma_partition(a_bufs, b_bufs, ready_bars, empty_bars, out_ptr, M, N, K, num_pid_m, num_pid_n, num_tiles,
                   tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, stride_out_m, bias_ptr, bias_up_ptr,
                   stride_bias_e, stride_bias_n, alpha, limit, WARP_GROUP: gl.constexpr, GROUP_M: gl.constexpr,
                   GROUPED: gl.constexpr, ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr, acc_layout: gl.constexpr,
                   out_layout: gl.constexpr):
    """Consumer warp group WARP_GROUP (0 or 1): rows [WARP_GROUP * BLOCK_M/2, +BLOCK_M/2) of every tile of this
    program. The K loop keeps one K block's async wgmma in flight and releases each stage once the wgmma that read it
    has retired; the epilogue stores out's dtype with masked stores of rows < row_end (the expert's end in the grouped
    form) and columns < N, in out_layout (`kernel_layouts`). Gated (ACTIVATION not NONE): each stage holds a gate and
    an up B tile, summed into two accumulators by two wgmma per K block; the epilogue adds the biases (HAS_BIAS) and
    stores act(gate, up) (gemm.jit's `add_bias` and `apply_activation`, the portable epilogue's)."""
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    HALF_M: gl.constexpr = BLOCK_M // 2
    k_blocks = gl.cdiv(K, BLOCK_K)
    it = 0
    for tile_id in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        row_start, row_end, expert, pid_n = tile_at(tile_id, num_pid_m, num_pid_n, M, tile_expert_ptr, tile_row_ptr,
                                                    expert_offsets_ptr, BLOCK_M, GROUP_M, GROUPED)
        b_acc = gl.zeros([HALF_M, BLOCK_N], gl.float32, acc_layout)
        if ACTIVATION == ACT_NONE:
            for kb in range(k_blocks):
                stage, a_tile = consumer_stage(a_bufs, ready_bars, it, WARP_GROUP, False)  # a_tile [HALF_M, BLOCK_K]
                b_tile = b_bufs.index(stage).permute((1, 0))  # [BLOCK_K, BLOCK_N], a K-major view
                b_acc = warpgroup_mma(a_tile, b_tile, b_acc, is_async=True)
                # At most one wgmma in flight: this one. The previous K block's has retired, so its stage is free
                # (the first block of a tile has none: the last stage of the previous tile was released after its
                # loop).
                b_acc, a_tile, b_tile = warpgroup_mma_wait(num_outstanding=1, deps=(b_acc, a_tile, b_tile))
                if kb > 0:
                    mbarrier.arrive(empty_bars.index((it + NUM_STAGES - 1) % NUM_STAGES), count=1)
                it += 1
            b_acc = warpgroup_mma_wait(num_outstanding=0, deps=(b_acc, ))
        else:
            b_up = gl.zeros([HALF_M, BLOCK_N], gl.float32, acc_layout)
            for kb in range(k_blocks):
                stage, a_tile = consumer_stage(a_bufs, ready_bars, it, WARP_GROUP, False)  # a_tile [HALF_M, BLOCK_K]
                gate_tile = b_bufs.index(2 * stage).permute((1, 0))  # [BLOCK_K, BLOCK_N]
                up_tile = b_bufs.index(2 * stage + 1).permute((1, 0))
                b_acc = warpgroup_mma(a_tile, gate_tile, b_acc, is_async=True)
                b_up = warpgroup_mma(a_tile, up_tile, b_up, is_async=True)
                # This block's two wgmma in flight; the previous block's have retired and its stage is free.
                b_acc, b_up, a_tile, gate_tile, up_tile = warpgroup_mma_wait(
                    num_outstanding=2, deps=(b_acc, b_up, a_tile, gate_tile, up_tile))
                if kb > 0:
                    mbarrier.arrive(empty_bars.index((it + NUM_STAGES - 1) % NUM_STAGES), count=1)
                it += 1
            b_acc, b_up = warpgroup_mma_wait(num_outstanding=0, deps=(b_acc, b_up))
        mbarrier.arrive(empty_bars.index((it + NUM_STAGES - 1) % NUM_STAGES), count=1)
        if ACTIVATION != ACT_NONE:
            offs_bias = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
            if HAS_BIAS:
                b_acc, b_up = add_bias(b_acc, b_up, expert, offs_bias, offs_bias < N, bias_ptr, bias_up_ptr,
                                       stride_bias_e, stride_bias_n, ACTIVATION)
            b_acc = apply_activation(b_acc, b_up, alpha, limit, ACTIVATION)

        # out_layout is acc_layout (stores straight from the registers: no conversion) or a coalesced store layout
        # (the tile passes through shared memory first)
        b_out = gl.convert_layout(b_acc.to(out_ptr.dtype.element_ty), out_layout)  # [HALF_M, BLOCK_N]
        store_tile(out_ptr, stride_out_m, b_out, row_start + WARP_GROUP * HALF_M, row_end, pid_n * BLOCK_N, N,
                   out_layout)


@gluon_jit
def _bf16_gemm_kernel(a_desc, b_desc, out_ptr, tile_expert_ptr, tile_row_ptr, num_m_tiles_ptr, expert_offsets_ptr, M,
                      N, K, stride_out_m, b_rows_per_expert, up_offset, bias_ptr, bias_up_ptr, stride_bias_e,
                      stride_bias_n, alpha, limit, NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                      GROUPED: gl.constexpr, ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr,
                      CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, acc_layout: gl.constexpr,
                      out_layout: gl.constexpr, num_warps: gl.constexpr):
    """bf16 / fp16 GEMM with fp32 sums, persistent and warp-specialized (module docstring). The grid, the tile order
    (gluon_ws.tile_counts, tile_at) and the partitions (consumer 0 the default partition, consumer 1 and the producer
    workers) are gluon_fp8's kernel's; only the consumers differ. Gated (ACTIVATION not NONE): out's N columns are
    act(gate, up) of the B rows [off_n, +BLOCK_N) and [up_offset + off_n, +BLOCK_N) of each expert's
    b_rows_per_expert rows; the stages hold both B tiles."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    B_TILES: gl.constexpr = 1 if ACTIVATION == ACT_NONE else 2
    gl.static_assert(num_warps == 4, "each consumer is one warp group")
    gl.static_assert(BLOCK_M == 128, "two 64-row consumer halves")

    a_bufs, b_bufs, ready_bars, empty_bars = stage_ring(a_desc, b_desc, NUM_STAGES, B_TILES)
    num_pid_m, num_pid_n, num_tiles = tile_counts(M, N, num_m_tiles_ptr, BLOCK_M, BLOCK_N, GROUPED)

    gl.warp_specialize([
        (_mma_partition, (a_bufs, b_bufs, ready_bars, empty_bars, out_ptr, M, N, K, num_pid_m, num_pid_n, num_tiles,
                          tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, stride_out_m, bias_ptr, bias_up_ptr,
                          stride_bias_e, stride_bias_n, alpha, limit, 0, GROUP_M, GROUPED, ACTIVATION, HAS_BIAS,
                          acc_layout, out_layout)),
        (_mma_partition, (a_bufs, b_bufs, ready_bars, empty_bars, out_ptr, M, N, K, num_pid_m, num_pid_n, num_tiles,
                          tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, stride_out_m, bias_ptr, bias_up_ptr,
                          stride_bias_e, stride_bias_n, alpha, limit, 1, GROUP_M, GROUPED, ACTIVATION, HAS_BIAS,
                          acc_layout, out_layout)),
        (load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, M, K, num_pid_m, num_pid_n,
                          num_tiles, b_rows_per_expert, up_offset, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
                          GROUP_M, GROUPED, B_TILES, BLOCK_N)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@dataclasses.dataclass(frozen=True)
class GluonBf16Config:
    """Launch parameters of `_bf16_gemm_kernel` (the module docstring says why these).

    BLOCK_M is fixed at 128 (two 64-row warp-group halves) and BLOCK_K at 64 (one 128-byte swizzled row of 2-byte
    elements); BLOCK_N is 64, 128 or 256 (a wgmma's N): the output tile's columns, the rows of a B tile (the gated
    form's stages hold two B tiles, gate and up: GATED_CONFIG). Registers: 3 warp groups x 128 threads x MAXNREG =
    64512 of the SM's 65536; the producer's warp group drops to PRODUCER_REGS, consumer 1 asks CONSUMER_REGS and
    consumer 0 (the default partition) gets what is left.
    """
    BLOCK_M: int = 128
    BLOCK_N: int = 256
    BLOCK_K: int = 64
    NUM_STAGES: int = 4  # 4 x (16 + 32) KiB of bf16 operands
    GROUP_M: int = 8  # row blocks that sweep the columns together (L2 reuse of B)
    MAXNREG: int = 168  # 65536 / (3 * 128), rounded down to a multiple of 8
    CONSUMER_REGS: int = 240  # 128 of them the 64 x 256 fp32 accumulator (gated: two 64 x 128)
    PRODUCER_REGS: int = 24  # the floor of setmaxnreg
    # The epilogue through shared memory (16-byte coalesced stores; 32 KiB beside the stages, 229448 bytes in all at
    # the default tiles, within the 232448 an H200 program may use) instead of straight from the registers
    COALESCED_STORES: bool = False


DEFAULT_CONFIG = GluonBf16Config()
# The gated form's: a gate and an up tile of 128 rows per stage, the shared memory and the accumulator registers
# (two 64 x 128) of the plain form's 256-row tile
GATED_CONFIG = GluonBf16Config(BLOCK_N=128)


def kernel_layouts(cfg: GluonBf16Config = DEFAULT_CONFIG):
    """-> (acc_layout, out_layout): the wgmma accumulator of one 64-row half (m64 nBLOCK_N k16 steps over one warp
    group) and the epilogue's store layout: the accumulator's own, or with COALESCED_STORES 16-byte vectors along
    the rows (gluon_ws.store_layout)."""
    acc_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cfg.BLOCK_N, 16])
    return acc_layout, store_layout(cfg.BLOCK_M // 2, cfg.BLOCK_N) if cfg.COALESCED_STORES else acc_layout


def operand_layouts(dtype: torch.dtype, cfg: GluonBf16Config = DEFAULT_CONFIG):
    """-> (a_layout, b_layout): the NVMMA shared layouts (128-byte swizzle) of the A and B tiles of a stage."""
    gl_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    a_layout = gl.NVMMASharedLayout.get_default_for([cfg.BLOCK_M, cfg.BLOCK_K], gl_dtype)
    b_layout = gl.NVMMASharedLayout.get_default_for([cfg.BLOCK_N, cfg.BLOCK_K], gl_dtype)
    return a_layout, b_layout


def _check_config(cfg: GluonBf16Config) -> None:
    if cfg.BLOCK_M != 128:
        raise ValueError(f"BLOCK_M must be 128 (two 64-row warp groups), got {cfg.BLOCK_M}")
    if cfg.BLOCK_K != 64:
        raise ValueError(f"BLOCK_K must be 64 (one 128-byte swizzled row of 2-byte elements), got {cfg.BLOCK_K}")
    if cfg.BLOCK_N not in (64, 128, 256):
        raise ValueError(f"BLOCK_N must be 64, 128 or 256 (a wgmma's N), got {cfg.BLOCK_N}")
    if cfg.NUM_STAGES < 2:
        raise ValueError(f"NUM_STAGES must be at least 2 (one wgmma in flight holds two stages), got "
                         f"{cfg.NUM_STAGES}")


def _check_operands(a: torch.Tensor, b: torch.Tensor, b_ndim: int) -> None:
    check_operand("a", a, 2, DTYPES)
    check_operand("b", b, b_ndim, DTYPES)
    if b.dtype != a.dtype:
        raise TypeError(f"a and b must have one dtype, got {a.dtype} and {b.dtype}")
    if b.shape[-1] != a.shape[1]:
        raise ValueError(f"a is [M, K] = {tuple(a.shape)} but b is {'[E, N, K]' if b_ndim == 3 else '[N, K]'} = "
                         f"{tuple(b.shape)}")


def _launch(a, b_rows, out, K, N, tile_expert, tile_row, num_m_tiles, expert_offsets, bound_tiles, grouped, cfg,
            b_rows_per_expert=0, gate=None):
    gate = NO_GATE if gate is None else gate
    a_layout, b_layout = operand_layouts(a.dtype, cfg)
    acc_layout, out_layout = kernel_layouts(cfg)
    a_desc = TensorDescriptor.from_tensor(a, [cfg.BLOCK_M, cfg.BLOCK_K], a_layout)
    b_desc = TensorDescriptor.from_tensor(b_rows, [cfg.BLOCK_N, cfg.BLOCK_K], b_layout)
    grid = (max(1, min(num_sms(a.device), bound_tiles)), )
    # Launched directly, not through host.replay.launch: a replay of its TMA descriptors and warp-specialized
    # launch has not run on a GPU, so a call that reaches here keeps no plan (the whole host path every call).
    unrecorded_launch(GEMM_NAME)
    _bf16_gemm_kernel[grid](
        a_desc, b_desc, out, tile_expert, tile_row, num_m_tiles, expert_offsets, a.shape[0], N, K, out.stride(0),
        b_rows_per_expert, N, *gate.bias_args(out), gate.alpha, gate.limit,
        NUM_STAGES=cfg.NUM_STAGES, GROUP_M=cfg.GROUP_M, GROUPED=grouped, ACTIVATION=gate.activation,
        HAS_BIAS=gate.bias is not None, CONSUMER_REGS=cfg.CONSUMER_REGS, PRODUCER_REGS=cfg.PRODUCER_REGS,
        acc_layout=acc_layout, out_layout=out_layout, num_warps=4, maxnreg=cfg.MAXNREG)
    return out


def bf16_gemm(a: torch.Tensor, b: torch.Tensor, *, cfg: GluonBf16Config = DEFAULT_CONFIG) -> torch.Tensor:
    """out [M, N] = a @ b^T in a's dtype, fp32 sums (module docstring).

    a [M, K] and b [N, K] both bfloat16 or both float16, K-contiguous with 16-byte aligned rows and bases
    (K % 8 == 0).
    """
    _check_config(cfg)
    _check_operands(a, b, 2)
    M, K = a.shape
    N = b.shape[0]
    device = check_device(GEMM_NAME, a, b)
    out = torch.empty(M, N, device=device, dtype=a.dtype)
    if not needs_launch(out, K):
        return out
    tiles = triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N)
    return _launch(a, b, out, K, N, out, out, out, out, tiles, False, cfg)


def bf16_grouped_gemm(a: torch.Tensor, b: torch.Tensor, expert_offsets: torch.Tensor, *,
                      cfg: GluonBf16Config = DEFAULT_CONFIG) -> torch.Tensor:
    """out [M, N] in a's dtype: rows of expert e, out[o_e:o_{e+1}] = a[o_e:o_{e+1}] @ b[e]^T, fp32 sums.

    a [M, K] sorted by expert, b [E, N, K] (contiguous), both bfloat16 or both float16 with 16-byte aligned rows;
    expert_offsets int32 [E + 1] (o_0 = 0, nondecreasing, o_E <= M: rows past o_E are left unwritten, as torch.empty
    leaves them; offsets outside that are clamped into it on the device, never read as given). No host sync: the
    launch is sized by the tile map's bound (M + E * 127) // 128.
    """
    _check_config(cfg)
    _check_operands(a, b, 3)
    E, N = check_stacked_weight(b)
    M, K = a.shape
    check_expert_offsets(expert_offsets, E)
    device = check_device(GEMM_NAME, a, b, expert_offsets)
    out = torch.empty(M, N, device=device, dtype=a.dtype)
    if not needs_launch(out, K, E):
        return out
    offsets, tile_expert, tile_row, num_m_tiles = segment_tile_map(expert_offsets, M, E, cfg.BLOCK_M,
                                                                  count_tiles=True)
    bound_tiles = tile_expert.numel() * triton.cdiv(N, cfg.BLOCK_N)  # sizes the persistent grid
    return _launch(a, b.view(E * N, K), out, K, N, tile_expert, tile_row, num_m_tiles, offsets, bound_tiles, True,
                   cfg, N)


def bf16_gated_grouped_gemm(a: torch.Tensor, b: torch.Tensor, expert_offsets: torch.Tensor, *,
                            activation: str = "silu", bias: torch.Tensor | None = None, alpha: float = 1.702,
                            limit: float = 7.0, cfg: GluonBf16Config = GATED_CONFIG) -> torch.Tensor:
    """GEMM1 with its activation: out [M, F] in a's dtype, rows of expert e
    out[o_e:o_{e+1}] = act(a[o_e:o_{e+1}] @ b[e, :F]^T + bias[e, :F], a[o_e:o_{e+1}] @ b[e, F:]^T + bias[e, F:]),
    the sums and the activation in fp32 (gemm.jit.apply_activation: "silu" or "swiglu_oai" with alpha and limit).

    b [E, 2F, K] (contiguous) holds each expert's gate rows then its up rows, a [M, K] is sorted by expert, both
    bfloat16 or both float16 with 16-byte aligned rows; bias [E, 2F] in b's row order (any strides) or None;
    expert_offsets as in `bf16_grouped_gemm`. A stage holds BLOCK_N gate and BLOCK_N up rows for an output tile of
    BLOCK_N columns; the last tile's rows past F read rows of up (or of the next expert), whose columns are never
    stored.
    """
    _check_config(cfg)
    _check_operands(a, b, 3)
    E, two_f = check_stacked_weight(b)
    if two_f % 2:
        raise ValueError(f"b must be [E, 2F, K] (gate rows then up rows), got {two_f} rows per expert")
    check_activation(activation)
    F = two_f // 2
    M, K = a.shape
    if K == 0:
        raise ValueError("a must have K > 0 columns (the gated GEMM has no empty-sum form)")
    check_expert_offsets(expert_offsets, E)
    if bias is not None and (bias.dtype != a.dtype or tuple(bias.shape) != (E, two_f)):
        raise ValueError(f"bias must be {a.dtype} [E, 2F] = [{E}, {two_f}], got {bias.dtype} {tuple(bias.shape)}")
    device = check_device(GEMM_NAME, a, b, expert_offsets, *(() if bias is None else (bias, )))
    out = torch.empty(M, F, device=device, dtype=a.dtype)
    if out.numel() == 0 or E == 0:
        return out
    offsets, tile_expert, tile_row, num_m_tiles = segment_tile_map(expert_offsets, M, E, cfg.BLOCK_M,
                                                                  count_tiles=True)
    bound_tiles = tile_expert.numel() * triton.cdiv(F, cfg.BLOCK_N)  # sizes the persistent grid
    gate_bias, up_bias = (None, None) if bias is None else (bias[:, :F], bias[:, F:])
    gate = Gate(int(Activation.of(activation)), gate_bias, up_bias, float(alpha), float(limit))
    return _launch(a, b.view(E * two_f, K), out, K, F, tile_expert, tile_row, num_m_tiles, offsets, bound_tiles,
                   True, cfg, two_f, gate)
