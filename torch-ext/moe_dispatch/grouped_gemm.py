"""Grouped GEMMs over expert-sorted rows: the two MoE projections, their input gradients, and the v1 `grouped_gemm`.

Each program owns a BLOCK_M x BLOCK_N output tile of one expert (tiles come from `dispatch.DispatchInfo`: a tile never
spans two experts, tiles past the real work exit at once). The forward kernel's variants are constexpr flags:

  GATHER_A           A row of sorted position p is x[gather_idx[p] // TOP_K]: the permutation happens in the loads
  ACTIVATION         0 none; 1 silu(gate) * up; 2 GPT-OSS clamped SwiGLU. Gated variants load two weight tiles per
                     K step (gate columns and up columns) against the same A tile and combine them in the epilogue
  HAS_BIAS           per-expert bias added to the accumulator(s) before the activation
  STORE_PREACT       also store the gate/up pre-activations [rows, 2F] (saved for the backward)
  MUL_ROUTED_WEIGHT  multiply each output row by its assignment's routing weight (GEMM2's epilogue)
  WEIGHT_SCALE       float8 weights on the dequant path (see fp8.py; the w8a8 path is fp8_gemm.py): 0 none (float
                     weights); 1 per-tensor and 2 per-channel scales, the fp8 tile converted to the activation dtype
                     for the dot and the fp32 accumulator scaled after the K loop; 3 block scales, each tile element
                     multiplied in fp32 by its block's scale before the conversion (any BLOCK_N / BLOCK_K against any
                     block shape); 4 the same when each K step lies inside one scale block (the launcher narrows
                     BLOCK_K to a divisor of the block's K side, >= 16): one scale per column per step, so no
                     [BLOCK_K, BLOCK_N] fp32 scale tile takes shared memory

The backward of the experts path (see `experts_backward.py`) reuses the same tile walk and K loop:
  _down_grad_kernel     dA = dout[token] @ W_down[e] with the activation's backward in its epilogue
  _gate_up_grad_kernel  dX rows = d_gate @ W_gate[e] + d_up @ W_up[e]

Weights are addressed through strides, so the transformers layout ([E, n, K]) and GPT-OSS's transposed one
([E, K, n]) run without copies. Gated variants take the gate and up weights as two views with equal strides:
`w[:, :F]` and `w[:, F:]` of a concatenated gate_up weight, `w[:, 0::2]` and `w[:, 1::2]` of an interleaved one.

Indices are bounded before they address memory: a tile's expert must lie in [0, E), its rows in [0, rows of C), and a
gathered row in [0, rows of A); anything else is masked out, so caller-provided offsets or permutations cannot make a
kernel read or write outside its tensors.
"""

import dataclasses

import torch
import triton
import triton.language as tl

from ._checks import (check_dim, check_float, check_index, check_same_device, expert_offsets_problems, raise_problems,
                      reads_values, warn_if_gradient_cut)
from ._device import dot_input_precision, dot_needs_fp32
from ._host_math import cdiv
from ._library import call, custom_op
from .dispatch import segment_dispatch
from .fp8 import WeightScale
from .pdl import pdl_options, release_dependents, wait_for_producer
from .row_copies import PLAIN, Layout, launch_gather
from .tiles import GATHER_FIRST, GemmTile, select_tiles
from ._plan import launch

ACTIVATIONS = {"none": 0, "silu": 1, "swiglu_oai": 2}
NO_SCALE = WeightScale(None, 0, (0, 0, 0))  # float weights: WEIGHT_SCALE = 0, the scale arguments unused


@triton.jit
def _apply_activation(b_gate, b_up, alpha, limit, ACTIVATION: tl.constexpr):
    if ACTIVATION == 1:
        return b_gate * tl.sigmoid(b_gate) * b_up
    else:
        b_gate = tl.minimum(b_gate, limit)
        b_up = tl.minimum(tl.maximum(b_up, -limit), limit)
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
def load_weight_tile(w_ptrs, w_mask, mask_n, s_ptrs, k0, offs_k, stride_s_k, scale_block_k, a_ptrs,
                     DOT_FP32: tl.constexpr, WEIGHT_SCALE: tl.constexpr):
    """A [BLOCK_K, BLOCK_N] weight tile ready for the dot with A: fp8 tiles converted to A's dtype, block-scaled
    ones first multiplied by the scale of their block (s_ptrs [BLOCK_N]: each column's scale row at k = 0). With
    WEIGHT_SCALE 4 the K step lies inside one scale block (BLOCK_K divides the block's K side): one [BLOCK_N] scale
    vector per step; WEIGHT_SCALE 3 loads a scale per element (any block shape)."""
    b_w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    if WEIGHT_SCALE == 4:
        b_s = tl.load(s_ptrs + (k0 // scale_block_k) * stride_s_k, mask=mask_n, other=0.0)
        b_w = (b_w.to(tl.float32) * b_s[None, :]).to(a_ptrs.dtype.element_ty)
    elif WEIGHT_SCALE == 3:
        b_s = tl.load(s_ptrs[None, :] + (offs_k // scale_block_k)[:, None] * stride_s_k, mask=w_mask, other=0.0)
        b_w = (b_w.to(tl.float32) * b_s).to(a_ptrs.dtype.element_ty)
    elif WEIGHT_SCALE != 0:
        b_w = b_w.to(a_ptrs.dtype.element_ty)
    if DOT_FP32:
        b_w = b_w.to(tl.float32)
    return b_w


@triton.jit
def weight_scale_ptrs(scale_ptr, expert, offs_n, stride_scale_e, stride_scale_n, scale_row_step, scale_up_row_offset,
                      scale_block_n, WEIGHT_SCALE: tl.constexpr):
    """(s_ptrs, s_up_ptrs) [BLOCK_N]: each column's scale row of the gate (and up) view at k = 0 for the dequant
    path's WEIGHT_SCALE codes 1-4. Column j of a view is row j * scale_row_step (+ scale_up_row_offset) of the
    unsplit weight; block scales divide it by scale_block_n. Callers with float weights (WEIGHT_SCALE 0, scale_ptr
    None) pass scale_ptr on themselves: Triton 3.6 cannot return None from a jit function (its interpreter can)."""
    scale_rows = offs_n * scale_row_step  # [BLOCK_N] rows of the unsplit weight
    scale_up_rows = scale_rows + scale_up_row_offset
    if WEIGHT_SCALE >= 3:
        scale_rows = scale_rows // scale_block_n
        scale_up_rows = scale_up_rows // scale_block_n
    s_ptrs = scale_ptr + expert.to(tl.int64) * stride_scale_e + scale_rows * stride_scale_n
    s_up_ptrs = scale_ptr + expert.to(tl.int64) * stride_scale_e + scale_up_rows * stride_scale_n
    return s_ptrs, s_up_ptrs


@triton.jit
def scale_sums(b_acc, b_acc_up, s_ptrs, s_up_ptrs, mask_n, GATED: tl.constexpr, WEIGHT_SCALE: tl.constexpr):
    """Per-tensor (stride_scale_n = 0) and per-channel scales (WEIGHT_SCALE 1, 2) multiply the [.., BLOCK_N] sums
    once after the K loop; other codes return them as they are."""
    if WEIGHT_SCALE == 1 or WEIGHT_SCALE == 2:
        b_acc *= tl.load(s_ptrs, mask=mask_n, other=0.0)[None, :]
        if GATED:
            b_acc_up *= tl.load(s_up_ptrs, mask=mask_n, other=0.0)[None, :]
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
              WEIGHT_SCALE: tl.constexpr = 0):
    """The K loop: b_acc += A[rows, :K] @ W[:K, cols] (and b_acc_up with the up weights when GATED).

    a_ptrs [BLOCK_M, BLOCK_K] and w_ptrs [BLOCK_K, BLOCK_N] point at k = 0; rows/columns outside the masks read 0.
    Block-scaled fp8 weights (WEIGHT_SCALE 3) also take s_ptrs / s_up_ptrs, see `load_weight_tile`.
    """
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        a_mask, w_mask = step_masks(offs_k, k0, K, mask_m, mask_n, EVEN_K)
        b_a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        b_w = load_weight_tile(w_ptrs, w_mask, mask_n, s_ptrs, k0, k0 + offs_k, stride_s_k, scale_block_k, a_ptrs,
                               DOT_FP32, WEIGHT_SCALE)
        if DOT_FP32:
            b_a = b_a.to(tl.float32)
        b_acc = tl.dot(b_a, b_w, b_acc, input_precision=DOT_PRECISION)
        if GATED:
            b_wu = load_weight_tile(w_up_ptrs, w_mask, mask_n, s_up_ptrs, k0, k0 + offs_k, stride_s_k, scale_block_k,
                                    a_ptrs, DOT_FP32, WEIGHT_SCALE)
            b_acc_up = tl.dot(b_a, b_wu, b_acc_up, input_precision=DOT_PRECISION)
            w_up_ptrs += BLOCK_K * stride_w_k
        a_ptrs += BLOCK_K * stride_a_k
        w_ptrs += BLOCK_K * stride_w_k
    return b_acc, b_acc_up


@triton.jit
def expert_tile_dot(b_acc, b_acc_up, a_ptrs, mask_m, mask_n, expert, offs_n, offs_k,
                    w_ptr, w_up_ptr, stride_w_e, stride_w_n, stride_w_k,
                    scale_ptr, stride_scale_e, stride_scale_n, stride_scale_k, scale_row_step, scale_up_row_offset,
                    scale_block_n, scale_block_k, K, stride_a_k,
                    GATED: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
                    BLOCK_K: tl.constexpr, WEIGHT_SCALE: tl.constexpr):
    """b_acc (and b_acc_up, GATED) plus A @ W[expert]'s columns offs_n (and W_up's) over all of K, float8 weights
    scaled as the dequant path's WEIGHT_SCALE code says (per element or per K step in the loop, per column after it):
    everything on the weight side of a forward tile, shared by `_grouped_gemm_kernel` and decode.py's gate/up
    kernel. a_ptrs [rows, BLOCK_K] point at A's k = 0; scale_ptr is None for float weights."""
    # One expert's matrix stays below 2^31 elements: 64-bit only for the expert's base offset.
    expert_base = expert.to(tl.int64) * stride_w_e
    w_offs = offs_n[None, :] * stride_w_n + offs_k[:, None] * stride_w_k  # [BLOCK_K, BLOCK_N]
    s_ptrs = scale_ptr
    s_up_ptrs = scale_ptr
    if WEIGHT_SCALE != 0:
        s_ptrs, s_up_ptrs = weight_scale_ptrs(scale_ptr, expert, offs_n, stride_scale_e, stride_scale_n,
                                              scale_row_step, scale_up_row_offset, scale_block_n, WEIGHT_SCALE)
    b_acc, b_acc_up = tile_dot(b_acc, b_acc_up, a_ptrs, w_ptr + expert_base + w_offs, w_up_ptr + expert_base + w_offs,
                               mask_m, mask_n, K, stride_a_k, stride_w_k, GATED, DOT_FP32, DOT_PRECISION, EVEN_K,
                               BLOCK_K, s_ptrs, s_up_ptrs, stride_scale_k, scale_block_k, WEIGHT_SCALE)
    b_acc, b_acc_up = scale_sums(b_acc, b_acc_up, s_ptrs, s_up_ptrs, mask_n, GATED, WEIGHT_SCALE)
    return b_acc, b_acc_up


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
    if ACTIVATION != 0:
        b_acc_up += tl.load(bias_up_ptr + bias_offs, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    return b_acc, b_acc_up


@triton.jit
def activate_and_weight(b_acc, b_acc_up, b_assignment, mask_m, topk_weights_ptr, stride_topk_t, stride_topk_k, alpha,
                        limit, TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr):
    """act(gate, up) when gated, then each row times its assignment's routing weight when MUL_ROUTED_WEIGHT."""
    if ACTIVATION != 0:
        b_acc = _apply_activation(b_acc, b_acc_up, alpha, limit, ACTIVATION)
    if MUL_ROUTED_WEIGHT:
        b_topk = tl.load(topk_weights_ptr + (b_assignment // TOP_K).to(tl.int64) * stride_topk_t
                         + (b_assignment % TOP_K) * stride_topk_k, mask=mask_m, other=0.0)
        b_acc = b_acc * b_topk.to(tl.float32)[:, None]
    return b_acc


@triton.jit
def tile_epilogue(b_acc, b_acc_up, expert, offs_m, mask_m, offs_n, mask_n, b_assignment,
                  bias_ptr, bias_up_ptr, stride_bias_e, stride_bias_n, c_ptr, stride_c_m, stride_c_n,
                  preact_ptr, stride_preact_m, n_cols, topk_weights_ptr, stride_topk_t, stride_topk_k, alpha, limit,
                  TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_PREACT: tl.constexpr,
                  MUL_ROUTED_WEIGHT: tl.constexpr):
    """Bias, saved pre-activations, activation, routing weight, then the masked store of one C tile (rows outside
    mask_m, e.g. the next expert's rows a tile load reached, are never written)."""
    if HAS_BIAS:
        b_acc, b_acc_up = add_bias(b_acc, b_acc_up, expert, offs_n, mask_n, bias_ptr, bias_up_ptr, stride_bias_e,
                                   stride_bias_n, ACTIVATION)
    mask_mn = mask_m[:, None] & mask_n[None, :]
    if STORE_PREACT:
        preact_ptrs = preact_ptr + offs_m[:, None].to(tl.int64) * stride_preact_m + offs_n[None, :]
        tl.store(preact_ptrs, b_acc.to(preact_ptr.dtype.element_ty), mask=mask_mn)
        tl.store(preact_ptrs + n_cols, b_acc_up.to(preact_ptr.dtype.element_ty), mask=mask_mn)
    b_acc = activate_and_weight(b_acc, b_acc_up, b_assignment, mask_m, topk_weights_ptr, stride_topk_t, stride_topk_k,
                                alpha, limit, TOP_K, ACTIVATION, MUL_ROUTED_WEIGHT)
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_c_m + offs_n[None, :] * stride_c_n
    tl.store(c_ptrs, b_acc.to(c_ptr.dtype.element_ty), mask=mask_mn)


@triton.jit
def _grouped_gemm_kernel(
    # A: [num_a_rows, K]; with GATHER_A the row of sorted position p is gather_idx[p] // TOP_K
    a_ptr, stride_a_m, stride_a_k, num_a_rows,
    # W: per-expert weights [E, n_cols, K] by strides; up weights (gated variants) share the strides
    w_ptr, w_up_ptr, stride_w_e, stride_w_n, stride_w_k,
    bias_ptr, bias_up_ptr, stride_bias_e, stride_bias_n,
    # fp8 weight scales (WEIGHT_SCALE != 0, see fp8.WeightScale): column j of the view reads row
    # j * scale_row_step (+ scale_up_row_offset for the up view) of the unsplit weight's scales
    scale_ptr, stride_scale_e, stride_scale_n, stride_scale_k, scale_row_step, scale_up_row_offset,
    scale_block_n, scale_block_k,
    # C: [num_rows, n_cols] in sorted order; preact: [num_rows, 2 * n_cols], gate columns then up columns
    c_ptr, stride_c_m, stride_c_n, num_rows,
    preact_ptr, stride_preact_m,
    # dispatch metadata
    tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, gather_idx_ptr,
    topk_weights_ptr, stride_topk_t, stride_topk_k, num_tokens,
    # sizes
    n_cols, K, E, max_tiles,
    alpha, limit,
    TOP_K: tl.constexpr,
    GATHER_A: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_PREACT: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    WEIGHT_SCALE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid: (max_tiles * cdiv(n_cols, BLOCK_N),). Each program writes one [BLOCK_M, BLOCK_N] tile of C."""
    wait_for_producer(PDL)
    expert, offs_m, mask_m, pid_n, offs_n, mask_n = tile_setup(tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
                                                               num_rows, n_cols, E, max_tiles, BLOCK_M, BLOCK_N,
                                                               GROUP_M)
    if expert < 0:
        return
    a_rows, b_assignment, mask_m = tile_rows(offs_m, mask_m, gather_idx_ptr, num_tokens, num_a_rows, TOP_K,
                                             GATHER_A, MUL_ROUTED_WEIGHT)
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_rows[:, None].to(tl.int64) * stride_a_m + offs_k[None, :] * stride_a_k  # [BLOCK_M, BLOCK_K]
    b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_acc, b_acc_up = expert_tile_dot(b_acc, b_acc, a_ptrs, mask_m, mask_n, expert, offs_n, offs_k,
                                      w_ptr, w_up_ptr, stride_w_e, stride_w_n, stride_w_k,
                                      scale_ptr, stride_scale_e, stride_scale_n, stride_scale_k, scale_row_step,
                                      scale_up_row_offset, scale_block_n, scale_block_k, K, stride_a_k,
                                      ACTIVATION != 0, DOT_FP32, DOT_PRECISION, EVEN_K, BLOCK_K, WEIGHT_SCALE)
    release_dependents(PDL)
    tile_epilogue(b_acc, b_acc_up, expert, offs_m, mask_m, offs_n, mask_n, b_assignment,
                  bias_ptr, bias_up_ptr, stride_bias_e, stride_bias_n, c_ptr, stride_c_m, stride_c_n,
                  preact_ptr, stride_preact_m, n_cols, topk_weights_ptr, stride_topk_t, stride_topk_k, alpha, limit,
                  TOP_K, ACTIVATION, HAS_BIAS, STORE_PREACT, MUL_ROUTED_WEIGHT)


def weight_strides(weight, transposed):
    """(stride_e, stride_n, stride_k) of a per-expert weight used as [E, n, K]; `transposed` means it is [E, K, n]."""
    stride_e, stride_n, stride_k = weight.stride()
    return (stride_e, stride_k, stride_n) if transposed else (stride_e, stride_n, stride_k)


def same_strides(first, second):
    """The two views with one set of strides (the kernels take one set for gate and up); copies only if they differ."""
    if first.stride() == second.stride():
        return first, second
    return first.contiguous(), second.contiguous()


def dot_options(dtype):
    """The constexpr pair (DOT_FP32, DOT_PRECISION) for operands of `dtype`."""
    dot_fp32 = dot_needs_fp32(dtype)
    return dot_fp32, "ieee" if dot_fp32 else dot_input_precision(dtype)


@dataclasses.dataclass(frozen=True)
class GemmWeights:
    """One grouped GEMM's weight-side operands as every launcher passes them: the weight (and, gated, the up view
    with the same strides), its (stride_e, stride_n, stride_k) as [E, n, K], n, and the biases with equal strides."""

    weight: torch.Tensor
    weight_up: torch.Tensor | None  # None unless the activation is gated
    strides: tuple
    n_cols: int
    bias: torch.Tensor | None
    bias_up: torch.Tensor | None

    @property
    def gated(self):
        return self.weight_up is not None

    def weight_args(self):
        """w_ptr, w_up_ptr, stride_w_e, stride_w_n, stride_w_k (w_up_ptr = w_ptr when not gated)."""
        return (self.weight, self.weight_up if self.gated else self.weight, *self.strides)

    def bias_args(self):
        """bias_ptr, bias_up_ptr, stride_bias_e, stride_bias_n."""
        bias = self.bias
        return (bias, self.bias_up if self.bias_up is not None else bias,
                bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0)


def gemm_weights(weight, weight_up, bias, bias_up, *, transposed, activation) -> GemmWeights:
    """`GemmWeights` of [E, n, K] weights ([E, K, n] when `transposed`); views copied only when gate and up strides
    differ (see `same_strides`)."""
    gated = ACTIVATIONS[activation] != 0
    if gated:
        weight, weight_up = same_strides(weight, weight_up)
    if bias is not None and bias_up is not None:
        bias, bias_up = same_strides(bias, bias_up)
    n_cols = weight.shape[2] if transposed else weight.shape[1]
    return GemmWeights(weight, weight_up if gated else None, weight_strides(weight, transposed), n_cols, bias,
                       bias_up)


def dequant_scale_code(ws: WeightScale, block_k, min_block_k=16):
    """(WEIGHT_SCALE, BLOCK_K) of the dequant path for weight scales `ws` and a tile's BLOCK_K: block scales whose K
    side has a power-of-two divisor >= min_block_k take code 4 with BLOCK_K narrowed to divide it (K steps inside one
    scale block: one scale vector per step instead of a [BLOCK_K, BLOCK_N] fp32 scale tile per stage, which
    overflowed the H200's shared memory with DeepSeek-V3's 128 x 128 tiles)."""
    if ws.code == 3 and (ws.block_k & -ws.block_k) >= min_block_k:
        return 4, min(block_k, ws.block_k & -ws.block_k)
    return ws.code, block_k


def scale_args(ws: WeightScale):
    """scale_ptr, its 3 strides, scale_row_step, scale_up_row_offset, scale_block_n, scale_block_k."""
    return (ws.scale, *ws.strides, ws.row_step, ws.up_row_offset, ws.block_n, ws.block_k)


def routing_args(info, topk_weights):
    """tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, gather_idx_ptr, topk_weights_ptr, stride_topk_t,
    stride_topk_k, num_tokens (topk_weights None: no routing weight in the epilogue)."""
    topk_t, topk_k = (topk_weights.stride(0), topk_weights.stride(1)) if topk_weights is not None else (0, 0)
    return (info.tile_expert, info.tile_row_start, info.expert_offsets, info.gather_idx, topk_weights, topk_t, topk_k,
            info.num_tokens)


def tile_meta(info, tile: GemmTile, *, gather_a, activation, w: GemmWeights, topk_weights):
    """The constexprs and launch options every grouped-GEMM kernel shares (BLOCK_K is each launcher's own)."""
    return dict(TOP_K=info.top_k, GATHER_A=gather_a, ACTIVATION=ACTIVATIONS[activation], HAS_BIAS=w.bias is not None,
                MUL_ROUTED_WEIGHT=topk_weights is not None, BLOCK_M=info.block_m, BLOCK_N=tile.block_n,
                GROUP_M=tile.group_m, num_warps=tile.num_warps, num_stages=tile.num_stages,
                **pdl_options(info.tile_expert.device))


def expert_gemm(a, weight, info, tile: GemmTile, *, weight_up=None, transposed=False, gather_a=False,
                activation="none", bias=None, bias_up=None, topk_weights=None, alpha=1.702, limit=7.0, out=None,
                preact=None, weight_scale: WeightScale | None = None):
    """Launch `_grouped_gemm_kernel` over the rows of `info`; returns C [num_assignments, n] in a's dtype.

    `weight` is [E, n, K] (or [E, K, n] when `transposed`); gated activations also take `weight_up` (same shape) and
    compute act(a @ weight^T, a @ weight_up^T); `preact` [num_assignments, 2n] then receives both pre-activations.
    Biases are [E, n] views. K is a.shape[1]. Rows of C past info.expert_offsets[E] are left unwritten.
    float8 weights come with `weight_scale` (fp8.WeightScale, shared by the gate and up views); the dot then runs in
    a's dtype.
    """
    num_rows = info.num_assignments
    K = a.shape[1]
    w = gemm_weights(weight, weight_up, bias, bias_up, transposed=transposed, activation=activation)
    c = out if out is not None else torch.empty((num_rows, w.n_cols), device=a.device, dtype=a.dtype)
    if num_rows == 0 or w.n_cols == 0 or info.max_tiles == 0:
        return c
    if tile.persistent:
        from .persistent_gemm import persistent_expert_gemm, supports  # imports this module's jit helpers

        if gather_a and tile.persistent == GATHER_FIRST and supports(a, w, transposed=transposed, gather_a=True,
                                                                     weight_scale=weight_scale):
            # A in sorted order first (one copy of N rows), so that its tiles too come through a descriptor
            sorted_a = launch_gather(a, info.gather_idx, None, None, None, Layout(PLAIN.value, info.top_k), num_rows)
            if supports(sorted_a, w, transposed=transposed, gather_a=False, weight_scale=weight_scale):
                return persistent_expert_gemm(sorted_a, w, info, tile, c, gather_a=False, activation=activation,
                                              topk_weights=topk_weights, alpha=alpha, limit=limit, preact=preact)
        if supports(a, w, transposed=transposed, gather_a=gather_a, weight_scale=weight_scale):
            return persistent_expert_gemm(a, w, info, tile, c, gather_a=gather_a, activation=activation,
                                          topk_weights=topk_weights, alpha=alpha, limit=limit, preact=preact)
    dot_fp32, precision = dot_options(a.dtype)
    grid = (info.max_tiles * cdiv(w.n_cols, tile.block_n),)
    ws = weight_scale or NO_SCALE
    scale_code, block_k = dequant_scale_code(ws, tile.block_k)
    launch(_grouped_gemm_kernel, grid,
        a, a.stride(0), a.stride(1), a.shape[0],
        *w.weight_args(), *w.bias_args(), *scale_args(ws),
        c, c.stride(0), c.stride(1), c.shape[0],
        preact, preact.stride(0) if preact is not None else 0,
        *routing_args(info, topk_weights),
        w.n_cols, K, info.num_experts, info.max_tiles,
        float(alpha), float(limit),
        STORE_PREACT=preact is not None,
        WEIGHT_SCALE=scale_code,
        DOT_FP32=dot_fp32,
        DOT_PRECISION=precision,
        EVEN_K=K % block_k == 0,
        BLOCK_K=block_k,
        **tile_meta(info, tile, gather_a=gather_a, activation=activation, w=w, topk_weights=topk_weights),
    )
    return c


def check_segmented_rows(name, rows, expert_offsets, num_experts, validate=None, *, more_problems=None):
    """Validation shared by the v1 functions that take already-permuted rows and `expert_offsets` [E+1]. Offset
    values, and the problems `more_problems()` returns (see _checks.raise_problems), are read per `validate`
    (_checks.reads_values), all in one transfer."""
    check_float(name, rows, ndim=2)
    check_index("expert_offsets", expert_offsets, ndim=1)
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    check_dim("expert_offsets", expert_offsets, 0, num_experts + 1, "num_experts + 1")
    check_same_device(**{name: rows, "expert_offsets": expert_offsets})
    if reads_values(validate, expert_offsets):  # value checks cost a sync on a GPU
        raise_problems(expert_offsets_problems(expert_offsets, rows.shape[0], name)
                       + (more_problems() if more_problems is not None else []))


@custom_op("grouped_gemm")
def _grouped_gemm_op(tokens: torch.Tensor, weights: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
    num_experts = weights.shape[0]
    tiles = select_tiles(tokens.device, tokens.shape[0], 1, num_experts, weights.shape[1], tokens.shape[1],
                         tokens.dtype)
    info = segment_dispatch(expert_offsets, tokens.shape[0], num_experts, tiles.block_m)
    out = torch.zeros((tokens.shape[0], weights.shape[1]), device=tokens.device, dtype=tokens.dtype)
    return expert_gemm(tokens, weights, info, tiles.down, out=out)


@_grouped_gemm_op.register_fake
def _(tokens, weights, expert_offsets):
    return tokens.new_empty((tokens.shape[0], weights.shape[1]))


def grouped_gemm(tokens, weights, expert_offsets, num_experts, *, validate=None):
    """v1 API: out[r] = tokens[r] @ weights[e].T for every row r of segment e. tokens [M, K], weights [E, N, K].

    `validate`: check expert_offsets' values (start at 0, non-decreasing, end <= M; ValueError otherwise); None checks
    CPU tensors only, True also on a GPU (one sync), False never (bad offsets are clamped into the rows). Rows outside
    every segment are zero. Forward-only.
    """
    check_segmented_rows("tokens", tokens, expert_offsets, num_experts, validate)
    check_float("weights", weights, ndim=3)
    check_dim("weights", weights, 0, num_experts, "num_experts")
    check_dim("weights", weights, 2, tokens.shape[1], "K = tokens.shape[1]")
    check_same_device(tokens=tokens, weights=weights)
    if weights.dtype != tokens.dtype:
        raise TypeError(f"weights dtype {weights.dtype} differs from tokens dtype {tokens.dtype}")
    warn_if_gradient_cut("grouped_gemm", tokens=tokens, weights=weights)
    return call(_grouped_gemm_op, tokens, weights, expert_offsets)
