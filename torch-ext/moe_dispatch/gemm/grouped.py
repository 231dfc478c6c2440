"""Grouped GEMMs over expert-sorted rows: the two MoE projections, their input gradients, and the v1 `grouped_gemm`.

Each program owns a BLOCK_M x BLOCK_N output tile of one expert (tiles come from `dispatch.segments.DispatchInfo`: a
tile never spans two experts, tiles past the real work exit at once). The forward kernel's variants are constexpr flags:

  GATHER_A           A row of sorted position p is x[gather_idx[p] // TOP_K]: the permutation happens in the loads
  ACTIVATION         gemm.jit.Activation: NONE; SILU, silu(gate) * up; SWIGLU_OAI, GPT-OSS's clamped SwiGLU. Gated
                     variants load two weight tiles per K step (gate columns and up columns) against the same A tile
                     and combine them in the epilogue
  PAIRED             the gate/up weight is one interleaved tensor (gate and up rows alternating, GPT-OSS): one
                     [BLOCK_K, 2 BLOCK_N] tile of it per K step into one accumulator, whose columns the epilogue splits
                     into gate and up (two strided views would read every other element: uncoalesced, unvectorized);
                     the pre-activations are then saved in the weight's interleaved order
  HAS_BIAS           per-expert bias added to the accumulator(s) before the activation
  STORE_PREACT       also store the gate/up pre-activations [rows, 2F] (saved for the backward)
  MUL_ROUTED_WEIGHT  multiply each output row by its assignment's routing weight (GEMM2's epilogue)
  WEIGHT_SCALE       float8 weights on the dequant path (see formats/fp8.py; the w8a8 path is gemm/w8a8.py), a
                     scale_codes.WeightScaleCode: NONE (float weights); TENSOR and CHANNEL scales, the fp8 tile
                     converted to the activation dtype for the dot and the fp32 accumulator scaled after the K loop;
                     BLOCK scales, each tile element multiplied in fp32 by its block's scale before the conversion (any
                     BLOCK_N / BLOCK_K against any block shape); BLOCK_STEP the same when each K step lies inside one
                     scale block (the launcher narrows BLOCK_K to a divisor of the block's K side, >= 16): one scale
                     per column per step, so no [BLOCK_K, BLOCK_N] fp32 scale tile takes shared memory

The backward of the experts path (see `backward/experts.py`) reuses the same tile walk and K loop:
  _down_grad_kernel     dA = dout[token] @ W_down[e] with the activation's backward in its epilogue
  _gate_up_grad_kernel  dX rows = d_gate @ W_gate[e] + d_up @ W_up[e]

Weights are addressed through strides, so the transformers layout ([E, n, K]) and GPT-OSS's transposed one
([E, K, n]) run without copies. Gated variants take the gate and up weights as two views with equal strides
(`w[:, :F]` and `w[:, F:]` of a concatenated gate_up weight), or an interleaved weight whole (PAIRED).

Indices are bounded before they address memory: a tile's expert must lie in [0, E), its rows in [0, rows of C), and a
gathered row in [0, rows of A); anything else is masked out, so caller-provided offsets or permutations cannot make a
kernel read or write outside its tensors.
"""

import torch
import triton
import triton.language as tl

from ..dispatch.segments import segment_dispatch
from ..formats.fp8 import WeightScale
from ..host.checks import (check_bool, check_dim, check_float, check_index, check_int, check_kernel_device,
                           check_same_device, expert_offsets_problems, raise_problems, reads_values,
                           warn_if_gradient_cut)
from ..host.device import call_scope
from ..host.host_math import cdiv
from ..host.library import call, custom_op
from ..host.pdl import release_dependents, wait_for_producer
from ..host.replay import launch
from ..host.tiles import GemmTile
from . import persistent
from .args import NO_SCALE, dequant_scale_code, dot_options, gemm_weights, routing_args, scale_args, tile_meta
from .jit import ACT_NONE, gate_up_tile_dot, tile_epilogue, tile_rows, tile_setup
from .planner import GemmKernel, expert_gemm_kernel, plan_segments

@triton.jit
def _grouped_gemm_kernel(
    # A: [num_a_rows, K]; with GATHER_A the row of sorted position p is gather_idx[p] // TOP_K
    a_ptr, stride_a_m, stride_a_k, num_a_rows,
    # W: per-expert weights [E, n_cols, K] by strides; up weights (gated variants) share the strides
    w_ptr, w_up_ptr, stride_w_e, stride_w_n, stride_w_k,
    bias_ptr, bias_up_ptr, stride_bias_e, stride_bias_n,
    # fp8 weight scales (WEIGHT_SCALE other than NONE, see fp8.WeightScale): column j of the view reads row
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
    PAIRED: tl.constexpr,
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
    # PAIRED: one [BLOCK_K, 2 BLOCK_N] tile of the interleaved weight per K step, split in the epilogue
    b_acc, b_acc_up, offs_pair, mask_pair = gate_up_tile_dot(
        a_ptrs, mask_m, expert, pid_n, offs_n, mask_n, offs_k, n_cols, w_ptr, w_up_ptr, stride_w_e, stride_w_n,
        stride_w_k, scale_ptr, stride_scale_e, stride_scale_n, stride_scale_k, scale_row_step, scale_up_row_offset,
        scale_block_n, scale_block_k, K, stride_a_k, ACTIVATION != ACT_NONE, PAIRED, DOT_FP32, DOT_PRECISION, EVEN_K,
        BLOCK_M, BLOCK_N, BLOCK_K, WEIGHT_SCALE)
    release_dependents(PDL)
    tile_epilogue(b_acc, b_acc_up, expert, offs_m, mask_m, offs_n, mask_n, b_assignment,
                  bias_ptr, bias_up_ptr, stride_bias_e, stride_bias_n, c_ptr, stride_c_m, stride_c_n,
                  preact_ptr, stride_preact_m, n_cols, topk_weights_ptr, stride_topk_t, stride_topk_k, alpha, limit,
                  TOP_K, ACTIVATION, HAS_BIAS, STORE_PREACT, MUL_ROUTED_WEIGHT, PAIRED, offs_pair, mask_pair)


def expert_gemm(a, weight, info, tile: GemmTile, *, weight_up=None, transposed=False, gather_a=False,
                activation="none", bias=None, bias_up=None, topk_weights=None, alpha=1.702, limit=7.0, out=None,
                preact=None, weight_scale: WeightScale | None = None, paired=False):
    """Launch `_grouped_gemm_kernel` over the rows of `info`; returns C [num_assignments, n] in a's dtype.

    `weight` is [E, n, K] (or [E, K, n] when `transposed`); gated activations also take `weight_up` (same shape) and
    compute act(a @ weight^T, a @ weight_up^T); `preact` [num_assignments, 2n] then receives both pre-activations,
    gate columns then up columns. Biases are [E, n] views. `paired`: `weight` is instead one interleaved gate/up
    weight [E, 2n, K] ([E, K, 2n]; gate at even rows) with its whole [E, 2n] `bias`, read as [BLOCK_K, 2 BLOCK_N]
    tiles (PAIRED), and `preact` receives the pre-activations in that interleaved order. K is a.shape[1]. Rows of C
    past info.expert_offsets[E] are left unwritten. float8 weights come with `weight_scale` (fp8.WeightScale, shared
    by the gate and up views; paired: of the whole weight); the dot then runs in a's dtype.
    """
    num_rows = info.num_assignments
    K = a.shape[1]
    w = gemm_weights(weight, weight_up, bias, bias_up, transposed=transposed, activation=activation, paired=paired)
    c = out if out is not None else torch.empty((num_rows, w.n_cols), device=a.device, dtype=a.dtype)
    if num_rows == 0 or w.n_cols == 0 or info.max_tiles == 0:
        return c
    kernel = expert_gemm_kernel(a, w, tile, transposed=transposed, gather_a=gather_a, weight_scale=weight_scale)
    if kernel is GemmKernel.PERSISTENT:
        return persistent.persistent_expert_gemm(a, w, info, tile, c, gather_a=gather_a, activation=activation,
                                                 topk_weights=topk_weights, alpha=alpha, limit=limit, preact=preact,
                                                 transposed=transposed)
    dot_fp32, precision = dot_options(a.dtype)
    grid = (info.max_tiles * cdiv(w.n_cols, tile.block_n),)
    ws = weight_scale or NO_SCALE
    scale_code, block_k = dequant_scale_code(ws, tile.block_k, dtype=a.dtype, device=a.device)
    launch(_grouped_gemm_kernel, grid,
        a, a.stride(0), a.stride(1), a.shape[0],
        *w.weight_args(), *w.bias_args(), *scale_args(ws),
        c, c.stride(0), c.stride(1), c.shape[0],
        preact, preact.stride(0) if preact is not None else 0,
        *routing_args(info, topk_weights),
        w.n_cols, K, info.num_experts, info.max_tiles,
        float(alpha), float(limit),
        STORE_PREACT=preact is not None,
        WEIGHT_SCALE=int(scale_code),
        PAIRED=w.paired,
        DOT_FP32=dot_fp32,
        DOT_PRECISION=precision,
        EVEN_K=K % block_k == 0,
        BLOCK_K=block_k,
        **tile_meta(info, tile, gather_a=gather_a, activation=activation, w=w, topk_weights=topk_weights),
    )
    return c


def check_segmented_rows(name, rows, expert_offsets, num_experts, validate=None, *, more_problems=None):
    """Validation shared by the v1 functions that take already-permuted rows and `expert_offsets` [E+1]. Offset
    values, and the problems `more_problems()` returns (see host.checks.raise_problems), are read per `validate`
    (host.checks.reads_values), all in one transfer."""
    check_float(name, rows, ndim=2)
    check_index("expert_offsets", expert_offsets, ndim=1)
    check_int("num_experts", num_experts, 1)
    check_dim("expert_offsets", expert_offsets, 0, num_experts + 1, "num_experts + 1")
    check_same_device(**{name: rows, "expert_offsets": expert_offsets})
    if reads_values(validate, expert_offsets):  # value checks cost a sync on a GPU
        raise_problems(expert_offsets_problems(expert_offsets, rows.shape[0], name)
                       + (more_problems() if more_problems is not None else []))


@custom_op("grouped_gemm")
def _grouped_gemm_op(tokens: torch.Tensor, weights: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
    num_experts = weights.shape[0]
    tiles = plan_segments(tokens.device, tokens.shape[0], num_experts, weights.shape[1], tokens.shape[1], tokens.dtype)
    info = segment_dispatch(expert_offsets, tokens.shape[0], num_experts, tiles.block_m)
    out = torch.zeros((tokens.shape[0], weights.shape[1]), device=tokens.device, dtype=tokens.dtype)
    return expert_gemm(tokens, weights, info, tiles.down, out=out)


@_grouped_gemm_op.register_fake
def _(tokens, weights, expert_offsets):
    return tokens.new_empty((tokens.shape[0], weights.shape[1]))


@call_scope
def grouped_gemm(tokens: torch.Tensor, weights: torch.Tensor, expert_offsets: torch.Tensor, num_experts: int, *,
                 validate: bool | None = None) -> torch.Tensor:
    """v1 API: out[r] = tokens[r] @ weights[e].T for every row r of segment e. tokens [M, K], weights [E, N, K].

    `validate`: check expert_offsets' values (start at 0, non-decreasing, end <= M; ValueError otherwise); None checks
    CPU tensors only, True also on a GPU (one sync), False never (bad offsets are clamped into the rows). Rows outside
    every segment are zero. Forward-only.
    """
    check_bool("validate", validate, none=True)
    check_segmented_rows("tokens", tokens, expert_offsets, num_experts, validate)
    check_float("weights", weights, ndim=3)
    check_dim("weights", weights, 0, num_experts, "num_experts")
    check_dim("weights", weights, 2, tokens.shape[1], "K = tokens.shape[1]")
    check_same_device(tokens=tokens, weights=weights)
    if weights.dtype != tokens.dtype:
        raise TypeError(f"weights dtype {weights.dtype} differs from tokens dtype {tokens.dtype}")
    warn_if_gradient_cut("grouped_gemm", tokens=tokens, weights=weights)
    check_kernel_device("tokens", tokens)
    return call(_grouped_gemm_op, tokens, weights, expert_offsets)
