"""The warp-specialized persistent skeleton of the Gluon GEMM (Hopper, SM90; Triton 3.6's Gluon): the guarded import
of Gluon, where the kernels can run, the tile order, the TMA producer and the expert tile map, and the launch checks.
The GEMM itself is gemm/gluon_fp8.py (FP8 with block-scale promotion), which adds its consumer partition, kernel,
config and launchers.

One CTA per SM walks the output tiles of a grouped-M order (`tile_at`) and runs three partitions:

    producer  (1 warp, few registers)   `load_partition`: TMA loads of A [BLOCK_M, BLOCK_K] and B [BLOCK_N, BLOCK_K]
                                        tiles into a ring of NUM_STAGES shared-memory stages; ready[s] completes when
                                        a stage has landed (expect-tx), empty[s] when both consumers are done with it
    consumer 0 (4 warps = warp group)   rows [0, BLOCK_M/2) of each tile
    consumer 1 (4 warps = warp group)   rows [BLOCK_M/2, BLOCK_M): each consumer's wgmma reads its A half and the
                                        whole B stage and releases the stage (arrives on empty[s]) when done with it

The two consumers split each 128-row tile into 64-row halves (cooperative, not ping-pong): they share each B stage
and are not synchronised with each other. Registers: a kernel is built for 3 warp groups x 128 threads x MAXNREG 168
(64512 of the SM's 65536); inside the partitions setmaxnreg moves them to the consumers and away from the producer.

The grouped form walks a tile map over (expert, 128-row block) that the launchers build on the device in one launch
(dispatch.segments.segment_tile_map, the dispatch's own builder: no host sync, sized by an upper bound, -1 sentinels
past the last tile, num_m_tiles real tiles, the caller's offsets clamped before anything reads them); a tile never
straddles two experts (TMA may read the next expert's
rows, which the consumers' row mask never writes), and the B rows of expert e start at e * N of B viewed as one
[E * N, K] matrix.

Importing this module never needs Gluon: where it does not import, the jit functions stay plain functions and
`available()` says False.
"""

# String annotations: the kernels' `gl.constexpr` parameters need no Gluon at import (Triton reads "constexpr" from
# the string).
from __future__ import annotations

import dataclasses

import torch
import triton

from ..host.device import TMA_ALIGN, tma_readable
from .jit import Activation

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    _GLUON_ERROR: Exception | None = None
except ImportError as exc:  # a Triton without Gluon, or with its Hopper API elsewhere
    gluon = gl = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = None
    _GLUON_ERROR = exc
# The TMA load into shared memory: `tma.async_load` from Triton 3.7 (where the 3.6 name raises), the same operation
# as 3.6's `tma.async_copy_global_to_shared`.
tma_load = None if tma is None else getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# The barrier of a CTA's threads: `gl.barrier` from Triton 3.9 (3.6 names it `thread_barrier`)
cta_barrier = None if gl is None else getattr(gl, "barrier", None) or gl.thread_barrier

# Triton versions the kernels have run under on a GPU: where the engines may choose them
TESTED_TRITON = ("3.6", )
# Triton versions the kernels compile under for sm_90 without spills (tests/test_gluon_compile.py runs under any of
# them, the CPU suite's pinned one included): the Gluon API each of them names (`tma_load`)
COMPILED_TRITON = ("3.6", "3.9")


def gluon_jit(fn):
    """gluon.jit where Gluon imports; elsewhere the plain function (never launched: `available()` is False)."""
    return gluon.jit(fn) if gluon is not None else fn


@gluon_jit
def e8m0_bf16(codes):
    """e8m0 scale codes (uint8) -> bf16 2^(code - 127): code 0 gives 2^-127 (a bf16 subnormal), 0xFF NaN."""
    codes = codes.to(gl.uint16)
    bits = gl.where(codes == 0, 0x0040, gl.where(codes == 255, 0x7FC0, codes << 7)).to(gl.uint16)
    return bits.to(gl.bfloat16, bitcast=True)


@gluon_jit
def tile_at(tile_id, num_pid_m, num_pid_n, M, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
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


@gluon_jit
def stage_ring(a_desc, b_desc, NUM_STAGES: gl.constexpr, B_TILES: gl.constexpr = 1):
    """The ring the producer fills and the two consumers drain: NUM_STAGES A tiles and NUM_STAGES x B_TILES B tiles
    in shared memory (the descriptors' block shapes and layouts; B tile t of stage s at index s * B_TILES + t), a
    ready barrier per stage (the producer's expect, then the TMA bytes) and an empty barrier per stage (one arrive
    per consumer warp group). -> (a_bufs, b_bufs, ready_bars, empty_bars)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES * B_TILES] + b_desc.block_type.shape,
                                       b_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=2)
    return a_bufs, b_bufs, ready_bars, empty_bars


@gluon_jit
def consumer_stage(a_bufs, ready_bars, it, WARP_GROUP: gl.constexpr, SPLIT_N: gl.constexpr):
    """A consumer's K step `it` (counted over all its tiles): its stage in the ring, once the stage's ready barrier
    has completed (the producer's TMA bytes landed), and consumer WARP_GROUP's 64-row half of the stage's A tile, or
    with SPLIT_N (the consumers split the tile's columns instead) the whole 64-row A tile.
    -> (stage, a_tile [64, BLOCK_K])."""
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    HALF_M: gl.constexpr = a_bufs.type.shape[1] // 2
    stage = it % NUM_STAGES
    mbarrier.wait(ready_bars.index(stage), (it // NUM_STAGES) & 1)
    if SPLIT_N:
        return stage, a_bufs.index(stage)
    else:
        return stage, a_bufs.index(stage).slice(WARP_GROUP * HALF_M, HALF_M)


@gluon_jit
def store_tile(out_ptr, stride_out_m, b_out, row_half, row_end, col_start, N, out_layout: gl.constexpr):
    """A consumer's epilogue store: b_out [HALF_M, BLOCK_N] (in out_layout) at rows row_half.. and columns
    col_start.. of out, masked to rows < row_end (the expert's end in the grouped form) and columns < N."""
    HALF_M: gl.constexpr = b_out.type.shape[0]
    BLOCK_N: gl.constexpr = b_out.type.shape[1]
    offs_om = row_half + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, out_layout))
    offs_on = col_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, out_layout))
    mask_out = gl.expand_dims(offs_om < row_end, 1) & gl.expand_dims(offs_on < N, 0)
    out_ptrs = out_ptr + gl.expand_dims(offs_om.to(gl.int64) * stride_out_m, 1) + gl.expand_dims(offs_on, 0)
    gl.store(out_ptrs, b_out, mask=mask_out)


@gluon_jit
def tile_counts(M, N, num_m_tiles_ptr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUPED: gl.constexpr):
    """-> (num_pid_m, num_pid_n, num_tiles) of the persistent order: cdiv(M, BLOCK_M) row blocks, or GROUPED the
    tile map's num_m_tiles[0], times cdiv(N, BLOCK_N) column blocks."""
    num_pid_n = gl.cdiv(N, BLOCK_N)
    if GROUPED:
        num_pid_m = gl.load(num_m_tiles_ptr)
    else:
        num_pid_m = gl.cdiv(M, BLOCK_M)
    return num_pid_m, num_pid_n, num_pid_m * num_pid_n


@gluon_jit
def load_partition(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, M, K, num_pid_m, num_pid_n, num_tiles,
                   b_rows_per_expert, up_offset, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
                   GROUP_M: gl.constexpr, GROUPED: gl.constexpr, B_TILES: gl.constexpr, TILE_N: gl.constexpr,
                   B_PACK: gl.constexpr = 1):
    """Producer (1 warp): for every tile of this program and every K block, wait until stage s is empty, then TMA
    A[row_start:+BLOCK_M, k:+BLOCK_K] and B[expert * b_rows_per_expert + off_n:+BLOCK_N, k / B_PACK:+BLOCK_K / B_PACK]
    into it, off_n = pid_n * TILE_N (rows and columns past the tensors read as zeros), completing ready[s] when all
    have landed. B_TILES 2 loads B tile t from row off_n + t * up_offset of the expert's (a gated GEMM1: gate rows, then
    up rows F further; a 64-row tile of the FP8 GEMM or any tile of the MXFP4 one: its two column halves, BLOCK_N
    apart). B_PACK: K values per B element (MXFP4 bytes: 2)."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    STAGE_BYTES: gl.constexpr = a_desc.block_type.nbytes + B_TILES * b_desc.block_type.nbytes
    k_blocks = gl.cdiv(K, BLOCK_K)
    it = 0
    for tile_id in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        row_start, row_end, expert, pid_n = tile_at(tile_id, num_pid_m, num_pid_n, M, tile_expert_ptr, tile_row_ptr,
                                                    expert_offsets_ptr, BLOCK_M, GROUP_M, GROUPED)
        row_b = expert * b_rows_per_expert + pid_n * TILE_N
        for kb in range(k_blocks):
            stage = it % NUM_STAGES
            # A fresh mbarrier counts as having completed the phase before phase 0, so the first pass waits on
            # parity 1 and goes straight through.
            mbarrier.wait(empty_bars.index(stage), ((it // NUM_STAGES) & 1) ^ 1)
            ready = ready_bars.index(stage)
            mbarrier.expect(ready, STAGE_BYTES)
            tma_load(a_desc, [row_start, kb * BLOCK_K], ready, a_bufs.index(stage))
            for t in gl.static_range(B_TILES):
                tma_load(b_desc, [row_b + t * up_offset, kb * (BLOCK_K // B_PACK)], ready,
                         b_bufs.index(stage * B_TILES + t))
            it += 1


def unavailable_reason(device: torch.device | str | None = None) -> str | None:
    """None where the Gluon kernels can run on `device` (default: the current CUDA device); else why not."""
    if _GLUON_ERROR is not None:
        return f"triton.experimental.gluon (Hopper) does not import: {_GLUON_ERROR}"
    if not triton.__version__.startswith(TESTED_TRITON):
        return (f"Triton {triton.__version__}: the kernels have run on a GPU under Triton {', '.join(TESTED_TRITON)} "
                f"only (they compile under {', '.join(COMPILED_TRITON)})")
    if not torch.cuda.is_available() or torch.version.hip is not None:
        return "needs an NVIDIA GPU"
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda":
        return f"needs a CUDA device, got {device}"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "needs a Hopper GPU (SM90: wgmma, setmaxnreg)"
    return None


def available(device: torch.device | str | None = None) -> bool:
    """Whether the Gluon GEMM can run on `device` (Triton 3.6 Gluon, an SM90 GPU)."""
    return unavailable_reason(device) is None


def check_stacked_weight(b: torch.Tensor) -> tuple[int, int]:
    """-> (E, N) of a grouped GEMM's b [E, N, K], which must be contiguous: its rows are read as one [E * N, K]
    matrix through one descriptor."""
    if not b.is_contiguous():
        raise ValueError("b must be contiguous [E, N, K] (its rows are addressed as one [E * N, K] matrix)")
    return b.shape[0], b.shape[1]


def needs_launch(out: torch.Tensor, K: int, num_experts: int = 1) -> bool:
    """Whether out [M, N] still needs the kernel: not when a side or the experts are empty (out stays as torch.empty
    left it) nor when K = 0 (out is zeroed here, the empty sum)."""
    if out.numel() == 0 or num_experts == 0:
        return False
    if K == 0:
        out.zero_()
        return False
    return True


def store_layout(half_m: int, block_n: int, element_bytes: int = 2):
    """The epilogue's store layout of one warp group's [half_m, block_n] tile: 16-byte vectors along a row, a warp
    writing whole rows (min(32, block_n / vector) threads along a row)."""
    vec = 16 // element_bytes
    threads_n = min(32, block_n // vec)
    assert half_m % (4 * (32 // threads_n)) == 0
    return gl.BlockedLayout([1, vec], [32 // threads_n, threads_n], [4, 1], [1, 0])


GATED_ACTIVATIONS = ("silu", "swiglu_oai")  # what a gated GEMM1's epilogue computes (gemm.jit.apply_activation)


@dataclasses.dataclass(frozen=True)
class Gate:
    """A gated GEMM1's epilogue: the activation (gemm.jit.Activation, not NONE), the gate and up bias rows ([E, F]
    views with one set of strides, or None) and swiglu_oai's alpha and limit."""
    activation: int
    bias: torch.Tensor | None
    bias_up: torch.Tensor | None
    alpha: float
    limit: float

    def bias_args(self, placeholder: torch.Tensor):
        """(gate bias, up bias, stride along E, stride along F) as the kernels take them: `placeholder` for both
        pointers and zero strides without a bias (never read: HAS_BIAS is False)."""
        if self.bias is None:
            return placeholder, placeholder, 0, 0
        return self.bias, self.bias_up, self.bias.stride(0), self.bias.stride(1)


NO_GATE = Gate(int(Activation.NONE), None, None, 1.0, 0.0)  # a plain GEMM's: the epilogue stores the sums


def check_activation(activation: str) -> None:
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"activation must be one of {GATED_ACTIVATIONS} (for none: the plain grouped GEMM), got "
                         f"{activation!r}")


def check_operand(name: str, t: torch.Tensor, ndim: int, dtypes: tuple[torch.dtype, ...]) -> None:
    """`t` has one of `dtypes`, `ndim` dims, and a layout a TMA descriptor reads (host.device.tma_readable: a
    contiguous last dimension, 16-byte aligned strides and base); TypeError for the dtype, ValueError for the rest."""
    if t.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must be {names}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if not tma_readable(t):
        raise ValueError(f"{name} must be K-contiguous with {TMA_ALIGN}-byte aligned rows and base (TMA), got strides "
                         f"{t.stride()}")


def check_expert_offsets(expert_offsets: torch.Tensor, num_experts: int) -> None:
    if expert_offsets.dtype != torch.int32 or tuple(expert_offsets.shape) != (num_experts + 1, ):
        raise ValueError(f"expert_offsets must be int32 [E + 1] = [{num_experts + 1}], got {expert_offsets.dtype} "
                         f"{tuple(expert_offsets.shape)}")


def check_device(what: str, *tensors: torch.Tensor) -> torch.device:
    """The one device of `tensors`, where the Gluon kernels can run (else RuntimeError: "`what` unavailable: ...")."""
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got {device} and {t.device}")
    reason = unavailable_reason(device)
    if reason is not None:
        raise RuntimeError(f"{what} unavailable: {reason}")
    return device
