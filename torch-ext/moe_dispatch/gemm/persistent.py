"""The grouped GEMM as a persistent kernel fed by tensor descriptors (TMA on Hopper): the prefill variant.

`_grouped_gemm_kernel` (gemm/grouped.py) launches one program per output tile and loads every operand through
pointers; on an H200 that shape of kernel stays near 70% of the tensor cores on a plain GEMM, while a persistent
kernel (one program per SM walking tiles in grouped order) whose operands arrive through descriptors matches cuBLAS.
This kernel is that variant of the same computation (where it runs: the large-T buckets of docs/performance.md,
"Tile tables"; what it gained: docs/versions.md, v2):

- Weight tiles [BLOCK_N, BLOCK_K] come through a 2-D descriptor over the expert-stacked weight, viewed as
  [(E - 1) * rows_per_expert + n_cols, K] with row stride stride_n: expert e's row j is descriptor row
  e * rows_per_expert + j. A tile that runs past the view's n_cols reads the next rows of the same allocation (the up
  half after the gate half, the next expert) or the descriptor's zero fill past the last expert: those columns are
  masked at the store. K past the end is zero-filled.
- Transposed weights ([E, K, n], n contiguous: GPT-OSS's layout) come through a 3-D descriptor over [E, K, n] in
  [1, BLOCK_K, BLOCK_N] tiles (W_K_OUTER): the expert is a dimension of its own, so a K tail reads the zero fill,
  and the tile enters the dot as it is (wgmma reads an N-major B from shared memory).
- An interleaved gate/up weight (gate and up rows alternating, PAIRED) comes whole, 2 BLOCK_N rows (or columns) per
  tile, into one accumulator that the epilogue splits (gemm/grouped.py's PAIRED).
- A rows: gathered through gather_idx with pointer loads when GATHER_A (Hopper's TMA has no row gather), else
  [BLOCK_M, BLOCK_K] descriptor tiles of the expert-sorted rows starting at the tile's first row; rows of the next
  expert that such a tile reaches are computed and never stored (the epilogue's row mask).
- The epilogue (bias, saved pre-activations, activation, routing weight, masked pointer store) is gemm/grouped.py's.

It takes the same tile map (dispatch.segments.DispatchInfo) and the same flags as `_grouped_gemm_kernel` minus float8
weights, and requires what descriptors require: K contiguous (stride 1), the other strides and the base 16-byte aligned,
and rows_per_expert = stride_e / stride_n an integer (or, transposed, n contiguous and the other strides and the base
aligned); `expert_gemm` falls back to the pointer kernel otherwise.
"""

import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..host.device import num_sms, on_gpu
from ..host.host_math import cdiv
from ..host.pdl import wait_for_producer
from ..host.replay import launch
from .args import GemmWeights, descriptor_rows, dot_options, routing_args, tile_meta
from .jit import ACT_NONE, pair_columns, tile_coords, tile_epilogue, tile_rows, tile_setup_at

INTERPRETER_PROGRAMS = 3  # the interpreter: a few programs, so each walks several tiles


@triton.jit
def _persistent_grouped_gemm_kernel(
    # A [num_a_rows, K]: a_desc ([BLOCK_M, BLOCK_K] tiles) unless GATHER_A, when rows come through gather_idx
    a_ptr, a_desc, stride_a_m, stride_a_k, num_a_rows,
    # weights through descriptors of [BLOCK_W, BLOCK_K] tiles (expert e's row j is row e * w_rows_per_expert + j),
    # or, W_K_OUTER, 3-D descriptors of [1, BLOCK_K, BLOCK_W] tiles of [E, K, n] weights; BLOCK_W is BLOCK_N, or
    # 2 BLOCK_N for a PAIRED weight (interleaved gate/up, read whole: gemm/grouped.py's PAIRED)
    w_desc, w_up_desc, w_rows_per_expert,
    bias_ptr, bias_up_ptr, stride_bias_e, stride_bias_n,
    c_ptr, stride_c_m, stride_c_n, num_rows,
    preact_ptr, stride_preact_m,
    tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, gather_idx_ptr,
    topk_weights_ptr, stride_topk_t, stride_topk_k, num_tokens,
    n_cols, K, E, max_tiles,
    alpha, limit,
    TOP_K: tl.constexpr,
    GATHER_A: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_PREACT: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    PAIRED: tl.constexpr,
    W_K_OUTER: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid: (NUM_PROGRAMS,). Program p computes output tiles p, p + NUM_PROGRAMS, ... of the
    max_tiles * cdiv(n_cols, BLOCK_N) tiles (in tile_coords' grouped order); sentinel tiles are skipped."""
    wait_for_producer(PDL)
    num_tiles = max_tiles * tl.cdiv(n_cols, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
        expert, offs_m, mask_m, pid_n, offs_n, mask_n = tile_setup_at(
            tile_id, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, num_rows, n_cols, E, max_tiles,
            BLOCK_M, BLOCK_N, GROUP_M)
        if expert >= 0:
            a_rows, b_assignment, mask_m = tile_rows(offs_m, mask_m, gather_idx_ptr, num_tokens, num_a_rows, TOP_K,
                                                     GATHER_A, MUL_ROUTED_WEIGHT)
            pid_m, _ = tile_coords(tile_id, n_cols, max_tiles, BLOCK_N, GROUP_M)
            row_start = tl.load(tile_row_start_ptr + pid_m)
            w_row = expert * w_rows_per_expert + pid_n * BLOCK_W
            w_col = pid_n * BLOCK_W
            a_ptrs = a_ptr + a_rows[:, None].to(tl.int64) * stride_a_m + offs_k[None, :] * stride_a_k
            b_acc = tl.zeros((BLOCK_M, BLOCK_W), dtype=tl.float32)
            b_acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                if GATHER_A:
                    if EVEN_K:
                        b_a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
                    else:
                        b_a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < K - k0), other=0.0)
                    a_ptrs += BLOCK_K * stride_a_k
                else:
                    b_a = a_desc.load([row_start, k0])
                if DOT_FP32:  # the interpreter (see host.device.dot_needs_fp32)
                    b_a = b_a.to(tl.float32)
                b_acc = tl.dot(b_a, _weight_step(w_desc, expert, w_row, w_col, k0, DOT_FP32, W_K_OUTER, BLOCK_K,
                                                 BLOCK_W), b_acc)
                if ACTIVATION != ACT_NONE and not PAIRED:
                    b_acc_up = tl.dot(b_a, _weight_step(w_up_desc, expert, w_row, w_col, k0, DOT_FP32, W_K_OUTER,
                                                        BLOCK_K, BLOCK_W), b_acc_up)
            if PAIRED:
                offs_pair, mask_pair = pair_columns(pid_n, n_cols, BLOCK_N)
            else:
                offs_pair, mask_pair = offs_n, mask_n
            tile_epilogue(b_acc, b_acc_up, expert, offs_m, mask_m, offs_n, mask_n, b_assignment,
                          bias_ptr, bias_up_ptr, stride_bias_e, stride_bias_n, c_ptr, stride_c_m, stride_c_n,
                          preact_ptr, stride_preact_m, n_cols, topk_weights_ptr, stride_topk_t, stride_topk_k,
                          alpha, limit, TOP_K, ACTIVATION, HAS_BIAS, STORE_PREACT, MUL_ROUTED_WEIGHT, PAIRED,
                          offs_pair, mask_pair)


@triton.jit
def _weight_step(w_desc, expert, w_row, w_col, k0, DOT_FP32: tl.constexpr, W_K_OUTER: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr):
    """The [BLOCK_K, BLOCK_W] weight tile of the K step at k0: from a [BLOCK_W, BLOCK_K] tile of the [rows, K] view
    (transposed in the dot), or from a [1, BLOCK_K, BLOCK_W] tile of the [E, K, n] view (W_K_OUTER)."""
    if W_K_OUTER:
        b_w = tl.reshape(w_desc.load([expert, k0, w_col]), (BLOCK_K, BLOCK_W))
    else:
        b_w = w_desc.load([w_row, k0]).T
    if DOT_FP32:
        b_w = b_w.to(tl.float32)
    return b_w


def weight_descriptors(w: GemmWeights, K, tile, transposed=False):
    """(w_desc, w_up_desc, rows_per_expert): descriptors of [block_w, tile.block_k] tiles over the weight and its up
    view (the weight's own again when not gated or paired; block_w is tile.block_n, twice that for a paired weight),
    or, `transposed` ([E, K, n] weights), 3-D descriptors of [1, tile.block_k, block_w] tiles (rows_per_expert 0);
    checked by `weights_fit_descriptors`."""
    n_rows = 2 * w.n_cols if w.paired else w.n_cols
    block_w = 2 * tile.block_n if w.paired else tile.block_n
    if transposed:
        def descriptor(weight):
            return TensorDescriptor(weight, [weight.shape[0], K, n_rows], list(weight.stride()),
                                    [1, tile.block_k, block_w])
        rows_per_expert = 0
    else:
        w_rows, rows_per_expert = descriptor_rows(w.weight, n_rows)

        def descriptor(weight):
            return TensorDescriptor(weight, [w_rows, K], [w.weight.stride(1), 1], [block_w, tile.block_k])
    w_desc = descriptor(w.weight)
    return w_desc, descriptor(w.weight_up) if w.gated else w_desc, rows_per_expert


def num_programs(device, num_tiles):
    """Programs of a persistent launch: one per SM (INTERPRETER_PROGRAMS on the interpreter), at most one per tile."""
    programs = num_sms(device) if on_gpu(device) else INTERPRETER_PROGRAMS
    return max(1, min(programs, num_tiles))


def persistent_expert_gemm(a, w: GemmWeights, info, tile, c, *, gather_a, activation, topk_weights, alpha, limit,
                           preact, transposed=False):
    """Launch `_persistent_grouped_gemm_kernel` (arguments as gemm.grouped.expert_gemm, which runs it where
    planner.expert_gemm_kernel chose it; w.weight is [E, n, K], or [E, K, n] when `transposed`). Returns c."""
    K = a.shape[1]
    w_desc, w_up_desc, rows_per_expert = weight_descriptors(w, K, tile, transposed)
    a_desc = w_desc if gather_a else TensorDescriptor(a, [a.shape[0], K], [a.stride(0), 1], [info.block_m, tile.block_k])
    dot_fp32, _ = dot_options(a.dtype)
    programs = num_programs(a.device, info.max_tiles * cdiv(w.n_cols, tile.block_n))
    launch(_persistent_grouped_gemm_kernel, (programs,),
        a, a_desc, a.stride(0), a.stride(1), a.shape[0],
        w_desc, w_up_desc, rows_per_expert,
        *w.bias_args(),
        c, c.stride(0), c.stride(1), c.shape[0],
        preact, preact.stride(0) if preact is not None else 0,
        *routing_args(info, topk_weights),
        w.n_cols, K, info.num_experts, info.max_tiles,
        float(alpha), float(limit),
        STORE_PREACT=preact is not None,
        PAIRED=w.paired,
        W_K_OUTER=transposed,
        EVEN_K=K % tile.block_k == 0,
        DOT_FP32=dot_fp32,
        BLOCK_W=2 * tile.block_n if w.paired else tile.block_n,
        BLOCK_K=tile.block_k,
        NUM_PROGRAMS=programs,
        **tile_meta(info, tile, gather_a=gather_a, activation=activation, w=w, topk_weights=topk_weights),
    )
    return c
