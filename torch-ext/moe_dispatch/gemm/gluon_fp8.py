"""Warp-specialized Hopper (SM90) FP8 GEMMs with DeepSeek-style block scales, written in Gluon.

    out[M, N] (bf16) = (A[M, K] * a_scale[M, K/128]) @ (B[N, K] * b_scale[N/128, K/128])^T

A and B are float8_e4m3fn, K-contiguous; a_scale holds one fp32 scale per row and 128-wide K block, b_scale one per
128 x 128 block of B (the `weight_scale_inv` convention, w ~ w_fp8 * scale). The sum runs in fp32 with per-K-block
promotion: the tensor cores sum one K block (BLOCK_K = 128, four k32 wgmma steps, in the hardware's FP8 accumulator),
then that partial sum is multiplied by a_scale[m, kb] * b_scale[n / 128, kb] and added to an fp32 accumulator in
registers. The grouped form runs the same kernel over expert-sorted rows: rows of expert e are A[offsets[e]:
offsets[e + 1]] and meet B[e] [N, K] with scales b_scale[e] [N/128, K/128].

Why Gluon: in the portable Triton kernel the promotion after every K block waits for the block's wgmma, so one warp
group alternates between tensor-core work and CUDA-core work and the tensor cores idle during the latter. Here one
CTA per SM (persistent over output tiles) runs three partitions:

    producer  (1 warp, few registers)   TMA loads of A [BLOCK_M, BLOCK_K] and B [BLOCK_N, BLOCK_K] tiles into a ring of
                                        NUM_STAGES shared-memory stages; ready[s] completes when a stage has landed
                                        (expect-tx), empty[s] when both consumers are done with it
    consumer 0 (4 warps = warp group)   rows [0, BLOCK_M/2) of each tile: per K block wait ready[s], async wgmma of
    consumer 1 (4 warps = warp group)   rows [BLOCK_M/2, BLOCK_M): its A half against the whole B stage, wait for it,
                                        release the stage (arrive on empty[s]), promote with the scales (loaded one
                                        K block ahead); after the K loop, the bf16 epilogue (masked stores)

The two consumer warp groups split each 128-row tile into 64-row halves (cooperative, not ping-pong): they share
each B stage, are not synchronised with each other, and so drift apart, and while one promotes its partial sum
the other's wgmma keeps the tensor cores busy. Each consumer holds a 64 x 128 fp32 accumulator and a 64 x 128
partial sum (64 + 64 registers per thread). Registers: the kernel is built for 3 warp groups x 128 threads x
MAXNREG 168 (64512 of the SM's 65536); inside the partitions setmaxnreg moves them to 240 per consumer thread and 24
per producer-warp-group thread (240 + 240 + 24 = 3 x 168).

Tiles: BLOCK_M 128 (two 64-row halves), BLOCK_N 128, BLOCK_K 128, NUM_STAGES 4: 4 x 32 KiB of fp8 stages. Tile order:
grouped along M by GROUP_M (tiles that share B columns run together, for L2 reuse). The grouped form walks a tile map
over (expert, 128-row block) built on the device (`grouped_tile_map`: no host sync, sized by an upper bound, -1
sentinels past the last tile); a tile never straddles two experts (TMA may read the next expert's rows, which the
epilogue's row mask never writes).

Needs Triton 3.6's Gluon (`available()` says whether it can run here); importing this module never needs it.
"""

# String annotations: the kernels' `gl.constexpr` parameters need no Gluon at import (Triton reads "constexpr" from
# the string).
from __future__ import annotations

import dataclasses

import torch
import triton

from ..host.device import num_sms

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    _GLUON_ERROR: Exception | None = None
except ImportError as exc:  # a Triton without Gluon, or with its Hopper API elsewhere
    gluon = gl = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = None
    _GLUON_ERROR = exc

# Triton versions whose Gluon API this module was written and compiled against (the API changes between releases).
TESTED_TRITON = ("3.6",)
SCALE_BLOCK = 128  # the side of a DeepSeek scale block, along K for A and along N and K for B


def _gluon_jit(fn):
    """gluon.jit where Gluon imports; elsewhere the plain function (never launched: `available()` is False)."""
    return gluon.jit(fn) if gluon is not None else fn


@_gluon_jit
def _tile_at(tile_id, num_pid_m, num_pid_n, M, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
             BLOCK_M: gl.constexpr, GROUP_M: gl.constexpr, GROUPED: gl.constexpr):
    """Output tile `tile_id` of the persistent order -> (row_start, row_end, expert, pid_n).

    Grouped along M: GROUP_M consecutive row blocks sweep the column blocks together. Dense: row block pid_m starts
    at pid_m * BLOCK_M and rows run to M. Grouped: row block pid_m is tile map entry pid_m, rows run to the end of
    its expert.
    """
    tiles_per_group = GROUP_M * num_pid_n
    group_id = tile_id // tiles_per_group
    first_pid_m = group_id * GROUP_M
    group_rows = gl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % tiles_per_group) % group_rows
    pid_n = (tile_id % tiles_per_group) // group_rows
    if GROUPED:
        expert = gl.load(tile_expert_ptr + pid_m)
        row_start = gl.load(tile_row_ptr + pid_m)
        row_end = gl.load(expert_offsets_ptr + expert + 1)
    else:
        expert = 0
        row_start = pid_m * BLOCK_M
        row_end = M
    return row_start, row_end, expert, pid_n


@_gluon_jit
def _load_partition(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, M, N, K, num_pid_m, num_pid_n, num_tiles,
                    tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, GROUP_M: gl.constexpr, GROUPED: gl.constexpr):
    """Producer (1 warp): for every tile of this program and every K block, wait until stage s is empty, then TMA
    A[row_start:+BLOCK_M, k:+BLOCK_K] and B[expert * N + off_n:+BLOCK_N, k:+BLOCK_K] into it (rows and columns
    past the tensors read as zeros), completing ready[s] when both have landed."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    STAGE_BYTES: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    k_blocks = gl.cdiv(K, BLOCK_K)
    it = 0
    for tile_id in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        row_start, row_end, expert, pid_n = _tile_at(tile_id, num_pid_m, num_pid_n, M, tile_expert_ptr, tile_row_ptr,
                                                     expert_offsets_ptr, BLOCK_M, GROUP_M, GROUPED)
        row_b = expert * N + pid_n * BLOCK_N
        for kb in range(k_blocks):
            stage = it % NUM_STAGES
            # A fresh mbarrier counts as having completed the phase before phase 0, so the first pass waits on
            # parity 1 and goes straight through.
            mbarrier.wait(empty_bars.index(stage), ((it // NUM_STAGES) & 1) ^ 1)
            ready = ready_bars.index(stage)
            mbarrier.expect(ready, STAGE_BYTES)
            tma.async_copy_global_to_shared(a_desc, [row_start, kb * BLOCK_K], ready, a_bufs.index(stage))
            tma.async_copy_global_to_shared(b_desc, [row_b, kb * BLOCK_K], ready, b_bufs.index(stage))
            it += 1


@_gluon_jit
def _mma_partition(a_bufs, b_bufs, ready_bars, empty_bars, out_ptr, a_scale_ptr, b_scale_ptr, M, N, K, num_pid_m,
                   num_pid_n, num_tiles, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, stride_out_m,
                   stride_a_scale_m, stride_a_scale_k, stride_b_scale_e, stride_b_scale_n, stride_b_scale_k,
                   WARP_GROUP: gl.constexpr, GROUP_M: gl.constexpr, GROUPED: gl.constexpr, acc_layout: gl.constexpr,
                   out_layout: gl.constexpr):
    """Consumer warp group WARP_GROUP (0 or 1): rows [WARP_GROUP * BLOCK_M/2, +BLOCK_M/2) of every tile of this
    program. Per K block: wgmma of its A half and B into a fresh fp32 partial sum, the scales' loads under it, wait,
    release the stage, acc += partial * a_scale[rows, kb] * b_scale[n block, kb]. Epilogue: bf16, coalesced masked
    stores of rows < row_end (the expert's end in the grouped form) and columns < N."""
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    HALF_M: gl.constexpr = BLOCK_M // 2
    SCALE_BLOCK: gl.constexpr = 128
    k_blocks = gl.cdiv(K, BLOCK_K)
    b_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, acc_layout)
    it = 0
    for tile_id in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        row_start, row_end, expert, pid_n = _tile_at(tile_id, num_pid_m, num_pid_n, M, tile_expert_ptr, tile_row_ptr,
                                                     expert_offsets_ptr, BLOCK_M, GROUP_M, GROUPED)
        row_half = row_start + WARP_GROUP * HALF_M
        offs_m = row_half + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, acc_layout))
        mask_m = offs_m < row_end
        a_s_ptrs = a_scale_ptr + offs_m.to(gl.int64) * stride_a_scale_m
        b_s_ptr = b_scale_ptr + expert * stride_b_scale_e + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_b_scale_n

        # The scales of K block kb are loaded one block ahead, under the wgmma of block kb - 1.
        b_a_s = gl.load(a_s_ptrs, mask=mask_m, other=0.0)  # [HALF_M]
        b_b_s = gl.load(b_s_ptr)
        b_acc = b_zero  # [HALF_M, BLOCK_N]
        for kb in range(k_blocks):
            stage = it % NUM_STAGES
            mbarrier.wait(ready_bars.index(stage), (it // NUM_STAGES) & 1)
            a_tile = a_bufs.index(stage).slice(WARP_GROUP * HALF_M, HALF_M)  # [HALF_M, BLOCK_K]
            b_tile = b_bufs.index(stage).permute((1, 0))  # [BLOCK_K, BLOCK_N], a K-major view
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
        offs_om = row_half + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, out_layout))
        offs_on = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, out_layout))
        mask_out = gl.expand_dims(offs_om < row_end, 1) & gl.expand_dims(offs_on < N, 0)
        out_ptrs = out_ptr + gl.expand_dims(offs_om.to(gl.int64) * stride_out_m, 1) + gl.expand_dims(offs_on, 0)
        gl.store(out_ptrs, b_out, mask=mask_out)


@_gluon_jit
def _fp8_block_scaled_gemm_kernel(a_desc, b_desc, out_ptr, a_scale_ptr, b_scale_ptr, tile_expert_ptr, tile_row_ptr,
                                  num_m_tiles_ptr, expert_offsets_ptr, M, N, K, stride_out_m, stride_a_scale_m,
                                  stride_a_scale_k, stride_b_scale_e, stride_b_scale_n, stride_b_scale_k,
                                  NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr, GROUPED: gl.constexpr,
                                  CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, acc_layout: gl.constexpr,
                                  out_layout: gl.constexpr, num_warps: gl.constexpr):
    """FP8 x FP8 -> bf16 GEMM with block-scale promotion, persistent and warp-specialized (module docstring).

    Grid: (min(#SMs, #tiles),). Program p owns tiles p, p + grid, ... of the grouped-M order over
    cdiv(M, BLOCK_M) x cdiv(N, BLOCK_N) tiles; GROUPED: over num_m_tiles[0] x cdiv(N, BLOCK_N) tiles, row block i
    being (tile_expert[i], tile_row[i]), the B rows of expert e starting at e * N. num_warps = 4: the default
    partition is consumer 0; consumer 1 (4 warps) and the producer (1 warp) are workers.
    """
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    gl.static_assert(num_warps == 4, "each consumer is one warp group")
    gl.static_assert(BLOCK_M == 128, "two 64-row consumer halves")
    gl.static_assert(128 % BLOCK_N == 0, "one b_scale block per column tile")
    gl.static_assert(128 % a_desc.block_type.shape[1] == 0, "one scale per K block")

    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready_bars.index(i), count=1)  # the producer's expect, then the TMA bytes
        mbarrier.init(empty_bars.index(i), count=2)  # one arrive per consumer warp group

    num_pid_n = gl.cdiv(N, BLOCK_N)
    if GROUPED:
        num_pid_m = gl.load(num_m_tiles_ptr)
    else:
        num_pid_m = gl.cdiv(M, BLOCK_M)
    num_tiles = num_pid_m * num_pid_n

    gl.warp_specialize([
        (_mma_partition, (a_bufs, b_bufs, ready_bars, empty_bars, out_ptr, a_scale_ptr, b_scale_ptr, M, N, K,
                          num_pid_m, num_pid_n, num_tiles, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
                          stride_out_m, stride_a_scale_m, stride_a_scale_k, stride_b_scale_e, stride_b_scale_n,
                          stride_b_scale_k, 0, GROUP_M, GROUPED, acc_layout, out_layout)),
        (_mma_partition, (a_bufs, b_bufs, ready_bars, empty_bars, out_ptr, a_scale_ptr, b_scale_ptr, M, N, K,
                          num_pid_m, num_pid_n, num_tiles, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
                          stride_out_m, stride_a_scale_m, stride_a_scale_k, stride_b_scale_e, stride_b_scale_n,
                          stride_b_scale_k, 1, GROUP_M, GROUPED, acc_layout, out_layout)),
        (_load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, M, N, K, num_pid_m, num_pid_n,
                           num_tiles, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, GROUP_M, GROUPED)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@dataclasses.dataclass(frozen=True)
class GluonFp8Config:
    """Launch parameters of `_fp8_block_scaled_gemm_kernel`.

    BLOCK_M is fixed at 128 (two 64-row warp-group halves); BLOCK_N and BLOCK_K must divide the 128 scale block.
    Registers: 3 warp groups x 128 threads x MAXNREG = 64512 of the SM's 65536; the producer's warp group drops to
    PRODUCER_REGS, consumer 1 asks CONSUMER_REGS and consumer 0 (the default partition) gets what is left.
    """
    BLOCK_M: int = 128
    BLOCK_N: int = 128
    BLOCK_K: int = 128
    NUM_STAGES: int = 4  # 4 x (16 + 16) KiB of fp8 operands
    GROUP_M: int = 8  # row blocks that sweep the columns together (L2 reuse of B)
    MAXNREG: int = 168  # 65536 / (3 * 128), rounded down to a multiple of 8
    CONSUMER_REGS: int = 240
    PRODUCER_REGS: int = 24  # the floor of setmaxnreg


DEFAULT_CONFIG = GluonFp8Config()


def unavailable_reason(device: torch.device | str | None = None) -> str | None:
    """None where the Gluon kernels can run on `device` (default: the current CUDA device); else why not."""
    if _GLUON_ERROR is not None:
        return f"triton.experimental.gluon (Hopper) does not import: {_GLUON_ERROR}"
    if not triton.__version__.startswith(TESTED_TRITON):
        return f"Triton {triton.__version__}: the kernels are written against Gluon in Triton {TESTED_TRITON}"
    if not torch.cuda.is_available() or torch.version.hip is not None:
        return "needs an NVIDIA GPU"
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda":
        return f"needs a CUDA device, got {device}"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "needs a Hopper GPU (SM90: wgmma, setmaxnreg)"
    return None


def available(device: torch.device | str | None = None) -> bool:
    """Whether the Gluon FP8 GEMMs can run on `device` (Triton 3.6 Gluon, an SM90 GPU)."""
    return unavailable_reason(device) is None


def kernel_layouts(cfg: GluonFp8Config = DEFAULT_CONFIG):
    """-> (acc_layout, out_layout): the wgmma accumulator of one 64-row half (m64 n128 k32 steps over one warp
    group) and the epilogue's store layout (16-byte bf16 vectors, a warp writing two 256-byte rows)."""
    half_m = cfg.BLOCK_M // 2
    acc_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cfg.BLOCK_N, 32])
    vec = 8
    threads_n = min(32, cfg.BLOCK_N // vec)
    out_layout = gl.BlockedLayout([1, vec], [32 // threads_n, threads_n], [4, 1], [1, 0])
    assert half_m % (4 * (32 // threads_n)) == 0
    return acc_layout, out_layout


def operand_layouts(cfg: GluonFp8Config = DEFAULT_CONFIG):
    """-> (a_layout, b_layout): the NVMMA shared layouts (128-byte swizzle) of the A and B stages."""
    a_layout = gl.NVMMASharedLayout.get_default_for([cfg.BLOCK_M, cfg.BLOCK_K], gl.float8e4nv)
    b_layout = gl.NVMMASharedLayout.get_default_for([cfg.BLOCK_N, cfg.BLOCK_K], gl.float8e4nv)
    return a_layout, b_layout


def _check_config(cfg: GluonFp8Config) -> None:
    if cfg.BLOCK_M != 128:
        raise ValueError(f"BLOCK_M must be 128 (two 64-row warp groups), got {cfg.BLOCK_M}")
    for name in ("BLOCK_N", "BLOCK_K"):
        value = getattr(cfg, name)
        if value not in (64, 128):
            raise ValueError(f"{name} must be 64 or 128 (a divisor of the 128 scale block), got {value}")


def _check_operand(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name} must be float8_e4m3fn, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1 or any(s % 16 for s in t.stride()[:-1]) or t.data_ptr() % 16:
        raise ValueError(f"{name} must be K-contiguous with 16-byte aligned rows and base (TMA), got strides "
                         f"{t.stride()}")


def _check_scale(name: str, s: torch.Tensor, shape: tuple[int, ...]) -> None:
    if s.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {s.dtype}")
    if tuple(s.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(s.shape)}")


def _check_device(*tensors: torch.Tensor) -> torch.device:
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got {device} and {t.device}")
    reason = unavailable_reason(device)
    if reason is not None:
        raise RuntimeError(f"Gluon FP8 GEMM unavailable: {reason}")
    return device


def _launch(a, b_rows, a_scale, b_scale, out, K, N, tile_expert, tile_row, num_m_tiles, expert_offsets, bound_tiles,
            stride_b_scale, grouped, cfg):
    a_layout, b_layout = operand_layouts(cfg)
    acc_layout, out_layout = kernel_layouts(cfg)
    a_desc = TensorDescriptor.from_tensor(a, [cfg.BLOCK_M, cfg.BLOCK_K], a_layout)
    b_desc = TensorDescriptor.from_tensor(b_rows, [cfg.BLOCK_N, cfg.BLOCK_K], b_layout)
    grid = (max(1, min(num_sms(a.device), bound_tiles)), )
    _fp8_block_scaled_gemm_kernel[grid](
        a_desc, b_desc, out, a_scale, b_scale, tile_expert, tile_row, num_m_tiles, expert_offsets,
        a.shape[0], N, K, out.stride(0), a_scale.stride(0), a_scale.stride(1), *stride_b_scale,
        NUM_STAGES=cfg.NUM_STAGES, GROUP_M=cfg.GROUP_M, GROUPED=grouped, CONSUMER_REGS=cfg.CONSUMER_REGS,
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
    _check_operand("a", a, 2)
    _check_operand("b", b, 2)
    M, K = a.shape
    N = b.shape[0]
    if b.shape[1] != K:
        raise ValueError(f"a is [M, K] = {tuple(a.shape)} but b is [N, K] = {tuple(b.shape)}")
    k_scales = triton.cdiv(K, SCALE_BLOCK)
    _check_scale("a_scale", a_scale, (M, k_scales))
    _check_scale("b_scale", b_scale, (triton.cdiv(N, SCALE_BLOCK), k_scales))
    device = _check_device(a, a_scale, b, b_scale)
    out = torch.empty(M, N, device=device, dtype=torch.bfloat16)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    tiles = triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N)
    return _launch(a, b, a_scale, b_scale, out, K, N, out, out, out, out, tiles,
                   (0, b_scale.stride(0), b_scale.stride(1)), False, cfg)


def grouped_tile_map(expert_offsets: torch.Tensor, num_rows: int, block_m: int = 128):
    """-> (tile_expert, tile_row, num_m_tiles): the row blocks of expert-sorted rows, on the device, no host sync.

    Row block i covers rows [tile_row[i], min(tile_row[i] + block_m, expert_offsets[e + 1])) of expert
    e = tile_expert[i]; experts in order, an expert of c rows taking cdiv(c, block_m) blocks (none when empty).
    Both int32 [num_rows // block_m + E] (sum_e cdiv(c_e, block_m) <= sum_e (c_e // block_m + 1)), -1 past the
    last block; num_m_tiles int32 [1] holds the number of blocks.
    """
    num_experts = expert_offsets.numel() - 1
    bound = num_rows // block_m + num_experts
    offsets = expert_offsets.to(torch.int64)
    counts = offsets[1:] - offsets[:-1]  # [E]
    blocks = (counts + block_m - 1) // block_m  # [E]
    ends = torch.cumsum(blocks, 0)  # [E], inclusive
    idx = torch.arange(bound, device=expert_offsets.device)
    expert = torch.searchsorted(ends, idx, right=True).clamp_(max=num_experts - 1)  # [bound]
    first = ends[expert] - blocks[expert]
    valid = idx < ends[-1]
    tile_expert = torch.where(valid, expert, -1).to(torch.int32)
    tile_row = torch.where(valid, offsets[expert] + (idx - first) * block_m, -1).to(torch.int32)
    num_m_tiles = ends[-1:].to(torch.int32)
    return tile_expert, tile_row, num_m_tiles


def fp8_block_grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                           expert_offsets: torch.Tensor, *, cfg: GluonFp8Config = DEFAULT_CONFIG) -> torch.Tensor:
    """out [M, N] bf16: rows of expert e, out[o_e:o_{e+1}] = (a * a_scale)[o_e:o_{e+1}] @ (b[e] * b_scale[e])^T.

    a [M, K] float8_e4m3fn sorted by expert, expert_offsets int32 [E + 1] (o_0 = 0, nondecreasing, o_E <= M: rows past
    o_E are left unwritten, as torch.empty leaves them); b [E, N, K] float8_e4m3fn (contiguous), b_scale
    [E, cdiv(N, 128), cdiv(K, 128)] and a_scale [M, cdiv(K, 128)] float32. No host sync: the launch is sized by
    M // 128 + E row blocks.
    """
    _check_config(cfg)
    _check_operand("a", a, 2)
    _check_operand("b", b, 3)
    if not b.is_contiguous():
        raise ValueError("b must be contiguous [E, N, K] (its rows are addressed as one [E * N, K] matrix)")
    M, K = a.shape
    E, N = b.shape[0], b.shape[1]
    if b.shape[2] != K:
        raise ValueError(f"a is [M, K] = {tuple(a.shape)} but b is [E, N, K] = {tuple(b.shape)}")
    if expert_offsets.dtype != torch.int32 or tuple(expert_offsets.shape) != (E + 1, ):
        raise ValueError(f"expert_offsets must be int32 [E + 1] = [{E + 1}], got {expert_offsets.dtype} "
                         f"{tuple(expert_offsets.shape)}")
    k_scales = triton.cdiv(K, SCALE_BLOCK)
    _check_scale("a_scale", a_scale, (M, k_scales))
    _check_scale("b_scale", b_scale, (E, triton.cdiv(N, SCALE_BLOCK), k_scales))
    device = _check_device(a, a_scale, b, b_scale, expert_offsets)
    out = torch.empty(M, N, device=device, dtype=torch.bfloat16)
    if M == 0 or N == 0 or E == 0:
        return out
    if K == 0:
        return out.zero_()
    tile_expert, tile_row, num_m_tiles = grouped_tile_map(expert_offsets, M, cfg.BLOCK_M)
    bound_tiles = tile_expert.numel() * triton.cdiv(N, cfg.BLOCK_N)
    return _launch(a, b.view(E * N, K), a_scale, b_scale, out, K, N, tile_expert, tile_row, num_m_tiles,
                   expert_offsets, bound_tiles, b_scale.stride(), True, cfg)
