"""w8a8 grouped GEMMs: float8 activations times float8 weights on FP8 tensor cores, fp32 sums (formats/fp8.py: "w8a8").

The experts path on this kernel (moe.py runs it when `planner.choose_fp8_compute` says "w8a8")::

    x [T, H] bf16 / fp16 / fp32
      -> GEMM1  rows gathered as in gemm/grouped.py and quantized to e4m3 per token and G1 columns, one scale per
                row and K step (amax / 448: dynamic, as DeepSeek-V3 does; or the static input scale): in GEMM1's
                loads for decode-sized tiles (BLOCK_M < planner.PREQUANTIZE_MIN_BLOCK_M) that do not swap their
                operands, by `quantize_fp8_rows`, a pass over x, for prefill tiles and swapped ones (see below and
                planner.w8a8_input); tl.dot(fp8, fp8) per K step, that partial sum times
                a_scale[row] (and, block scales, the weight scale of the block the K step and the column lie in)
                added to the fp32 accumulator; channel / tensor weight scales and static activation scales multiply
                it once after the K loop.
                Epilogue: bias, activation, then the intermediate quantized per row and G2 columns
                -> h [N, F] float8 + h_scale [N, cdiv(F, G2)] fp32 (a static down input scale: h alone); where
                GEMM1's output tile is not a multiple of G2 columns (persistent tiles, whose gate and up rows
                pair into one dot twice the output's width), h in x's dtype, then `quantize_fp8_rows` per G2
      -> GEMM2  h read as it is (no quantization pass), its scale per K step of G2 columns; routed weight in the
                epilogue -> y [N, H] in x's dtype -> dispatch/combine.py

Groups are K steps: G1 = GEMM1's BLOCK_K, G2 = GEMM2's BLOCK_K, powers of two >= 32 that divide the weight's K block
(block scales; `w8a8_tiles` picks them from the tile table). Because GEMM1's epilogue must see whole groups of the
intermediate, GEMM1's BLOCK_N is a multiple of G2 when the intermediate is quantized dynamically.

Prefill tiles with `persistent` set (tiles.GemmTile) run both GEMMs on `_persistent_w8a8_gemm_kernel`
(gemm/w8a8_persistent.py) where the device has TMA and the layouts allow descriptors: the pass over x then also gathers
the rows into expert-sorted order (A of a descriptor is contiguous rows), and both kernels share this module's K-step
arithmetic and `w8a8_epilogue`, so the choice changes speed, not results.

Why two places for x's quantization: in the loads, every column tile of GEMM1 quantizes its A tiles again (F / BLOCK_N
times per row), which costs CUDA-core work of the order of the FP8 tensor-core work of the tile at prefill sizes
(amax, scale, clamp and convert of each A element per K step against 2 * BLOCK_N multiply-adds on tensor cores that
run ~30x faster), and it takes registers; the pass costs one launch and a read and write of x, nothing at prefill
sizes but a few microseconds at decode, where the loads' recomputation is free (weight-bound).

Every accumulation is in fp32 and the partial sum of each K step (at most 128 products on the tile tables) is
scaled into it, so the tensor cores never sum more than one K step in their own precision (DeepSeek-V3's
promotion interval).

Triton's interpreter rounds fp32 -> e4m3 wrongly (half up, and a carry into the exponent is lost: 31.1 -> 16), so
under the interpreter values are first rounded to the e4m3 grid in fp32 (ROUND_IN_FP32); GPUs convert in hardware
(round to nearest even, saturating). The interpreter knows no e4m3 NaN either (its conversions and dots read NaN's
code as 480), so there `gemm.w8a8_jit.to_fp8` writes the code itself and the dots decode their operands to fp32 first
(`gemm.w8a8_jit.dot_operand`): NaN and inf in the activations come out NaN on both, as on bf16 dots.
"""

import dataclasses

import torch
import triton
import triton.language as tl

from ..formats.fp8 import DEFAULT_FP8_BLOCK_SHAPE, W8A8_DTYPE, W8A8_MIN_GROUP, WeightScale, fp8_max, infer_scheme
from ..formats.scale_codes import WeightScaleCode
from ..host.device import is_interpreter
from ..host.host_math import cdiv
from ..host.pdl import wait_for_producer
from ..host.replay import launch
from ..host.tiles import GemmTile, MoeTiles
from .args import gemm_weights, routing_args, scale_args, tile_meta
from .jit import ACT_NONE, gathered_rows, tile_rows, tile_setup
from .planner import GemmKernel, w8a8_gemm_kernel, w8a8_input
from .w8a8_jit import (A_FP8_GROUPS, A_FP8_STATIC, A_STATIC, AQuant, QuantOut, block_scale_offsets, quantize_rows,
                       to_fp8, w8a8_epilogue, w8a8_tile_dot)
from .w8a8_persistent import persistent_w8a8_gemm

QUANTIZE_BLOCK_M = 32  # rows per program of the quantization pass
COPY_BLOCK_K = 128  # columns per program of the same pass copying rows (`gather_rows`)


@triton.jit
def _w8a8_gemm_kernel(
    # A: [num_a_rows, K] float (A_QUANT DYNAMIC, STATIC) or float8 (FP8_GROUPS, FP8_STATIC); GATHER_A: sorted position
    # p reads row gather_idx[p] // TOP_K
    a_ptr, stride_a_m, stride_a_k, num_a_rows,
    # activation scales: A_QUANT STATIC / FP8_STATIC a static scale per expert (stride_a_scale_e 0: one per tensor);
    # FP8_GROUPS [num_rows, cdiv(K, BLOCK_K)], one per row and K step
    a_scale_ptr, stride_a_scale_e, stride_a_scale_m,
    # W: float8 per-expert weights [E, n_cols, K] by strides; up weights (gated) share the strides
    w_ptr, w_up_ptr, stride_w_e, stride_w_n, stride_w_k,
    bias_ptr, bias_up_ptr, stride_bias_e, stride_bias_n,
    # weight scales (fp8.WeightScale): column j of the view reads row j * scale_row_step (+ scale_up_row_offset for
    # the up view) of the unsplit weight's scales
    scale_ptr, stride_scale_e, stride_scale_n, stride_scale_k, scale_row_step, scale_up_row_offset,
    scale_block_n, scale_block_k,
    # C: [num_rows, n_cols] in sorted order; QUANT_OUT DYNAMIC: float8 with c_scale [num_rows, cdiv(n_cols,
    # OUT_GROUP)]; STATIC: float8 with a static scale per expert at c_scale_ptr + e * stride_c_scale_e
    c_ptr, stride_c_m, stride_c_n, num_rows,
    c_scale_ptr, stride_c_scale_e, stride_c_scale_m,
    # dispatch metadata
    tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, gather_idx_ptr,
    topk_weights_ptr, stride_topk_t, stride_topk_k, num_tokens,
    # sizes
    n_cols, K, E, max_tiles,
    alpha, limit, fp8_max,
    TOP_K: tl.constexpr,
    GATHER_A: tl.constexpr,
    A_QUANT: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    WEIGHT_SCALE: tl.constexpr,
    SCALE_UNIFORM: tl.constexpr,
    QUANT_OUT: tl.constexpr,
    OUT_GROUP: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SWAP_AB: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid: (max_tiles * cdiv(n_cols, BLOCK_N),). Each program writes one [BLOCK_M, BLOCK_N] tile of C (and, with
    QUANT_OUT DYNAMIC, the [BLOCK_M, BLOCK_N // OUT_GROUP] scales of its groups). SWAP_AB (planner.w8a8_gemm_kernel:
    tiles of fewer than 64 rows on Hopper) sums the transposed tile W^T A^T on the 64-row side of the FP8 MMA and
    transposes it back for the epilogue (gemm.w8a8_jit.scaled_dot)."""
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
    if A_QUANT == A_FP8_GROUPS:
        a_s_ptrs = a_scale_ptr + a_rows.to(tl.int64) * stride_a_scale_m  # [BLOCK_M]: each row's first group scale
    else:
        a_s_ptrs = a_ptr  # unused
    a_static = 1.0
    if A_QUANT == A_STATIC or A_QUANT == A_FP8_STATIC:
        a_static = tl.load(a_scale_ptr + expert * stride_a_scale_e)

    expert_base = expert.to(tl.int64) * stride_w_e
    w_offs = offs_n[None, :] * stride_w_n + offs_k[:, None] * stride_w_k  # [BLOCK_K, BLOCK_N]
    # Block scales: offsets of each column's scale row, one scalar per tile when SCALE_UNIFORM (see `w8a8_gemm`);
    # a [BLOCK_N] pointer tensor live through the K loop would cost 2 registers per column per thread.
    s_base = scale_ptr + expert.to(tl.int64) * stride_scale_e
    s_offs = block_scale_offsets(pid_n, offs_n, scale_row_step, 0, stride_scale_n, scale_block_n, SCALE_UNIFORM,
                                 BLOCK_N)
    s_up_offs = block_scale_offsets(pid_n, offs_n, scale_row_step, scale_up_row_offset, stride_scale_n,
                                    scale_block_n, SCALE_UNIFORM, BLOCK_N)
    if SWAP_AB:
        b_acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_acc_up = b_acc
    b_acc, b_acc_up = w8a8_tile_dot(b_acc, b_acc_up, a_ptrs, a_s_ptrs, a_static, w_ptr + expert_base + w_offs,
                                    w_up_ptr + expert_base + w_offs, s_base, s_offs, s_up_offs, mask_m, mask_n, K,
                                    stride_a_k, stride_w_k, stride_scale_k, scale_block_k, fp8_max,
                                    ACTIVATION != ACT_NONE, A_QUANT, WEIGHT_SCALE, SCALE_UNIFORM, ROUND_IN_FP32, EVEN_K,
                                    BLOCK_K, SWAP_AB)
    if SWAP_AB:
        b_acc = tl.trans(b_acc)
        b_acc_up = tl.trans(b_acc_up)
    w8a8_epilogue(b_acc, b_acc_up, expert, offs_m, mask_m, pid_n, offs_n, mask_n, b_assignment, a_static, s_base,
                  stride_scale_n, scale_row_step, scale_up_row_offset, bias_ptr, bias_up_ptr, stride_bias_e,
                  stride_bias_n, c_ptr, stride_c_m, stride_c_n, c_scale_ptr, stride_c_scale_e, stride_c_scale_m, n_cols,
                  topk_weights_ptr, stride_topk_t, stride_topk_k, alpha, limit, fp8_max, TOP_K, ACTIVATION, HAS_BIAS,
                  MUL_ROUTED_WEIGHT, A_QUANT, WEIGHT_SCALE, QUANT_OUT, OUT_GROUP, ROUND_IN_FP32, BLOCK_M, BLOCK_N)


@triton.jit
def _quantize_rows_kernel(x_ptr, stride_x_m, q_ptr, stride_q_m, s_ptr, stride_s_m, static_ptr, num_rows, K, fp8_max,
                          gather_idx_ptr, num_tokens, TOP_K: tl.constexpr, GATHER: tl.constexpr,
                          STATIC: tl.constexpr, ROUND_IN_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
                          GROUP: tl.constexpr, COPY: tl.constexpr = False):
    """Grid: (cdiv(num_rows, BLOCK_M), cdiv(K, GROUP)). Each program quantizes a [BLOCK_M, GROUP] block of rows to e4m3:
    one scale per row (s[row, group] = amax / fp8_max), or x / the static scale (STATIC: no scales written); COPY
    stores the rows in q's dtype instead (x's own values: no scales written; `gather_rows`).
    GATHER: row p of q is x[gather_idx[p] // TOP_K] (the expert-sorted order), zeros where gather_idx names no token
    (-1 past the kept assignments), so every row of q is written."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    mask_m = offs_m < num_rows
    if GATHER:
        x_rows, _, mask_x = gathered_rows(gather_idx_ptr, offs_m, mask_m, num_tokens, TOP_K)
    else:
        x_rows, mask_x = offs_m, mask_m
    mask_k = (offs_k < K)[None, :]
    b_x = tl.load(x_ptr + x_rows[:, None].to(tl.int64) * stride_x_m + offs_k[None, :], mask=mask_x[:, None] & mask_k,
                  other=0.0).to(tl.float32)
    if COPY:
        b_q = b_x.to(q_ptr.dtype.element_ty)
    elif STATIC:
        b_q = to_fp8(b_x / tl.load(static_ptr), fp8_max, ROUND_IN_FP32)
    else:
        b_q, b_s = quantize_rows(b_x, fp8_max, ROUND_IN_FP32)
        tl.store(s_ptr + offs_m.to(tl.int64) * stride_s_m + tl.program_id(1), b_s, mask=mask_m)
    tl.store(q_ptr + offs_m[:, None].to(tl.int64) * stride_q_m + offs_k[None, :], b_q, mask=mask_m[:, None] & mask_k)


def fp8_rows(num_rows, K, device):
    """An uninitialized e4m3 [num_rows, K] whose rows start 16 bytes apart or a multiple of that (a view of padded
    rows when K is not a multiple of 16), so the persistent kernel can read it through a descriptor whatever K is."""
    return torch.empty((num_rows, -(-K // 16) * 16), device=device, dtype=W8A8_DTYPE)[:, :K]


def quantize_fp8_rows(x, group, static_scale=None, info=None):
    """x [T, K] (unit column stride) -> (e4m3 [M, K], scales fp32 [M, cdiv(K, group)] or None with a per-tensor
    `static_scale`): the quantization GEMM1 otherwise does in its loads, once per row and group. M = T, rows as in x;
    with `info` (dispatch.segments.DispatchInfo) M = info.num_assignments, rows in its expert-sorted order (row p is
    x[info.gather_idx[p] // top_k], zeros past the kept assignments): A of the persistent kernel, which cannot
    gather. The e4m3 rows come from `fp8_rows`."""
    T, K = x.shape
    M = info.num_assignments if info is not None else T
    q = fp8_rows(M, K, x.device)
    scales = None if static_scale is not None else torch.empty((M, cdiv(K, group)), device=x.device,
                                                               dtype=torch.float32)
    if M == 0 or K == 0:
        return q, scales
    x = x if x.stride(1) == 1 else x.contiguous()
    launch(_quantize_rows_kernel, (cdiv(M, QUANTIZE_BLOCK_M), cdiv(K, group)),
        x, x.stride(0), q, q.stride(0), scales, scales.stride(0) if scales is not None else 0, static_scale, M, K,
        fp8_max(W8A8_DTYPE), info.gather_idx if info is not None else None, T,
        TOP_K=info.top_k if info is not None else 1, GATHER=info is not None, STATIC=static_scale is not None,
        ROUND_IN_FP32=is_interpreter(), BLOCK_M=QUANTIZE_BLOCK_M, GROUP=group)
    return q, scales


def gather_rows(x, info):
    """x [T, K] (unit column stride) -> its rows in the dispatch's expert-sorted order, [info.num_assignments, K] in
    x's dtype: row p is x[info.gather_idx[p] // top_k], zeros past the kept assignments (every row written): A of a
    GEMM that reads rows through descriptors (gemm/gluon_mxfp4.py), in `quantize_fp8_rows`' pass with COPY."""
    T, K = x.shape
    M = info.num_assignments
    out = torch.empty((M, K), device=x.device, dtype=x.dtype)
    if M == 0 or K == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    launch(_quantize_rows_kernel, (cdiv(M, QUANTIZE_BLOCK_M), cdiv(K, COPY_BLOCK_K)),
        x, x.stride(0), out, out.stride(0), None, 0, None, M, K, 0.0, info.gather_idx, T,
        TOP_K=info.top_k, GATHER=True, STATIC=False, ROUND_IN_FP32=False, BLOCK_M=QUANTIZE_BLOCK_M,
        GROUP=COPY_BLOCK_K, COPY=True)
    return out


def _group(tile_block_k, weight_scale: WeightScale):
    """The K step (= activation group) of a GEMM: the tile's BLOCK_K, cut to the weight's K block for block scales
    (both powers of two, so the smaller divides the larger)."""
    group = max(W8A8_MIN_GROUP, tile_block_k)
    if weight_scale.code == WeightScaleCode.BLOCK:
        group = min(group, weight_scale.block_k)
    return group


def w8a8_tiles(tiles: MoeTiles, gate_up_scale: WeightScale, down_scale: WeightScale, *, static_intermediate=False):
    """The tiles `tiles` with w8a8's constraints applied: BLOCK_K of each GEMM is its activation group (`_group`), and
    a pointer GEMM1's BLOCK_N a multiple of GEMM2's group unless the intermediate has a static scale (a persistent
    GEMM1 keeps its BLOCK_N: where it is not a multiple, `w8a8_gemm1` quantizes the intermediate in a pass). block_m
    is kept (the dispatch tile map was built with it), and so are the other fields (warps, stages, group_m,
    persistent)."""
    g1 = _group(tiles.gate_up.block_k, gate_up_scale)
    g2 = _group(tiles.down.block_k, down_scale)
    block_n = tiles.gate_up.block_n
    if not static_intermediate and not tiles.gate_up.persistent:
        block_n = -(-block_n // g2) * g2
    return MoeTiles(tiles.block_m, dataclasses.replace(tiles.gate_up, block_n=block_n, block_k=g1),
                    dataclasses.replace(tiles.down, block_k=g2))


def _uniform_block_scale(ws: WeightScale, block_n, gated):
    """Whether every column tile of the view reads one block-scale row (gate and up views alike). Tile t reads rows
    t * span + offset + i * row_step (i < block_n, span = block_n * row_step) of the unsplit weight; with span
    dividing the scale's block, they stay in one block when offset mod span < row_step."""
    if ws.code != WeightScaleCode.BLOCK:
        return False
    span = block_n * ws.row_step
    offsets = (0, ws.up_row_offset) if gated else (0,)
    return ws.block_n % span == 0 and all(offset % span < ws.row_step for offset in offsets)


def w8a8_groups(tiles: MoeTiles, w_gate_up_scale, w_down_scale, block_shape=DEFAULT_FP8_BLOCK_SHAPE, *,
                transposed=False):
    """(G1, G2), the activation groups (K steps) the w8a8 path uses with `tiles` (before `w8a8_tiles`, e.g. from
    tiles.select_fp8_tiles) for these weight scales: what a model of its arithmetic needs (tests, benchmark)."""
    def weight_scale(scale):
        return WeightScale.of(scale, infer_scheme(scale), tuple(block_shape), transposed=transposed)

    chosen = w8a8_tiles(tiles, weight_scale(w_gate_up_scale), weight_scale(w_down_scale))
    return chosen.gate_up.block_k, chosen.down.block_k


def _static_scale(scale):
    """(tensor, per-expert stride) of a static scale of shape [], [1] or [E]."""
    return scale, (scale.stride(0) if scale.dim() == 1 and scale.numel() > 1 else 0)


def w8a8_gemm(a, weight, info, tile: GemmTile, weight_scale: WeightScale, *, a_scale=None, a_static=None,
              weight_up=None, transposed=False, gather_a=False, activation="none", bias=None, bias_up=None,
              topk_weights=None, alpha=1.702, limit=7.0, out_dtype=None, out_static=None, out_group=None):
    """Launch a w8a8 kernel over the rows of `info`; returns C [num_assignments, n], or (C, C's scales).

    A `a` [rows, K]: float (quantized in the loads: per row and K step, or with `a_static` [] / [1] / [E]) or float8
    with `a_scale` [rows, cdiv(K, tile.block_k)] or `a_static`. `weight` [E, n, K] (`transposed`: [E, K, n]) float8
    with `weight_scale` (shared by the `weight_up` view of gated activations). Output: float in `out_dtype`; float8
    (from `fp8_rows`) with a static scale `out_static`; or, with `out_group`, float8 plus fp32 scales
    [rows, cdiv(n, out_group)] (tile.block_n a multiple of out_group). Rows of C past info.expert_offsets[E] are left
    unwritten.

    The kernel: `_persistent_w8a8_gemm_kernel` (gemm/w8a8_persistent.py) when the tile asks for it (`tile.persistent`)
    and the operands allow it (planner.w8a8_gemm_kernel: float8 A in sorted order, TMA, BLOCK_M >= 64, descriptor
    layouts); else `_w8a8_gemm_kernel`, with its operands swapped (SWAP_AB) for tiles of fewer than 64 rows on
    Hopper. All round alike (same K steps, scales and epilogue), so the choice changes speed only.
    """
    num_rows = info.num_assignments
    K = a.shape[1]
    w = gemm_weights(weight, weight_up, bias, bias_up, transposed=transposed, activation=activation)
    n_cols = w.n_cols
    quantized_out = out_static is not None or out_group is not None
    if quantized_out:
        c = fp8_rows(num_rows, n_cols, a.device)
    else:
        c = torch.empty((num_rows, n_cols), device=a.device, dtype=out_dtype)
    c_scale = None
    if out_group is not None:
        if tile.block_n % out_group:
            raise ValueError(f"BLOCK_N {tile.block_n} of the quantizing GEMM must be a multiple of its output group "
                             f"{out_group}")
        c_scale = torch.empty((num_rows, cdiv(n_cols, out_group)), device=a.device, dtype=torch.float32)
    result = (c, c_scale) if out_group is not None else c
    if num_rows == 0 or n_cols == 0 or info.max_tiles == 0:
        return result

    if a.dtype == W8A8_DTYPE:
        a_quant = AQuant.FP8_STATIC if a_static is not None else AQuant.FP8_GROUPS
    else:
        a_quant = AQuant.STATIC if a_static is not None else AQuant.DYNAMIC
    if a_static is not None:
        a_scale_args = (*_static_scale(a_static), 0)
    elif a_quant == AQuant.FP8_GROUPS:
        a_scale_args = (a_scale, 0, a_scale.stride(0))
    else:
        a_scale_args = (None, 0, 0)
    if out_static is not None:
        quant_out, c_scale_args = QuantOut.STATIC, (*_static_scale(out_static), 0)
    elif out_group is not None:
        quant_out, c_scale_args = QuantOut.DYNAMIC, (c_scale, 0, c_scale.stride(0))
    else:
        quant_out, c_scale_args = QuantOut.FLOAT, (None, 0, 0)
    ws = weight_scale
    meta = dict(
        A_QUANT=int(a_quant),
        WEIGHT_SCALE=int(ws.code),
        SCALE_UNIFORM=_uniform_block_scale(ws, tile.block_n, w.gated),
        QUANT_OUT=int(quant_out),
        OUT_GROUP=out_group or 1,
        ROUND_IN_FP32=is_interpreter(),
        BLOCK_K=tile.block_k,
        **tile_meta(info, tile, gather_a=gather_a, activation=activation, w=w, topk_weights=topk_weights),
    )
    kernel = w8a8_gemm_kernel(a, w, tile, block_m=info.block_m, transposed=transposed, gather_a=gather_a)
    meta["SWAP_AB"] = kernel is GemmKernel.POINTER_SWAPPED
    if kernel is GemmKernel.PERSISTENT:
        del meta["SWAP_AB"]
        del meta["GATHER_A"]
        persistent_w8a8_gemm(a, a_scale_args, w, ws, c, c_scale_args, info, topk_weights, alpha, limit, tile, meta)
        return result
    grid = (info.max_tiles * cdiv(n_cols, tile.block_n),)
    launch(_w8a8_gemm_kernel, grid,
        a, a.stride(0), a.stride(1), a.shape[0],
        *a_scale_args,
        *w.weight_args(), *w.bias_args(), *scale_args(ws),
        c, c.stride(0), c.stride(1), c.shape[0],
        *c_scale_args,
        *routing_args(info, topk_weights),
        n_cols, K, info.num_experts, info.max_tiles,
        float(alpha), float(limit), fp8_max(W8A8_DTYPE),
        EVEN_K=K % tile.block_k == 0,
        **meta,
    )
    return result


def w8a8_gemm1(x, w_gate, w_up, info, tiles: MoeTiles, gate_up_scale: WeightScale, *, transposed=False,
               activation="silu", gate_bias=None, up_bias=None, alpha=1.702, limit=7.0, gate_up_input_scale=None,
               down_input_scale=None):
    """GEMM1 of the w8a8 path: (h [N, F] float8, h_scale [N, cdiv(F, G2)] fp32, or None with a static
    `down_input_scale`); `tiles` already through `w8a8_tiles` (G1 = tiles.gate_up.block_k, G2 =
    tiles.down.block_k). x is quantized in the loads, or first by `quantize_fp8_rows` for prefill tiles (a
    per-expert static scale stays in the loads: the pass does not know the rows' experts); for persistent tiles that
    pass also gathers the rows into expert-sorted order (where descriptors exist: TMA, K-contiguous weights), so the
    persistent kernel reads A through a descriptor (`w8a8_gemm` still takes the pointer kernel, on the sorted rows, when
    the weights' layout does not allow descriptors)."""
    x_scale, gather_a, out_dtype = None, True, x.dtype
    prequantize, sorted_rows = w8a8_input(tiles, x.device, transposed=transposed, input_scale=gate_up_input_scale)
    if prequantize:
        x, x_scale = quantize_fp8_rows(x, tiles.gate_up.block_k, gate_up_input_scale,
                                       info=info if sorted_rows else None)
        gather_a = not sorted_rows
    # An output tile narrower than (or not a multiple of) GEMM2's group cannot see whole groups: the intermediate is
    # then written in the input's float dtype and quantized by a pass (rows in sorted order, no gather).
    group = tiles.down.block_k
    quantize_after = down_input_scale is None and tiles.gate_up.block_n % group != 0
    out = w8a8_gemm(x, w_gate, info, tiles.gate_up, gate_up_scale, a_scale=x_scale, a_static=gate_up_input_scale,
                    weight_up=w_up,
                    transposed=transposed, gather_a=gather_a, activation=activation, bias=gate_bias, bias_up=up_bias,
                    alpha=alpha, limit=limit, out_dtype=out_dtype, out_static=down_input_scale,
                    out_group=None if down_input_scale is not None or quantize_after else group)
    if quantize_after:
        return quantize_fp8_rows(out, group)
    return out if down_input_scale is None else (out, None)


def w8a8_experts(x, w_gate, w_up, w_down, info, tiles: MoeTiles, gate_up_scale: WeightScale, down_scale: WeightScale,
                 *, topk_weights, transposed=False, activation="silu", gate_bias=None, up_bias=None, down_bias=None,
                 alpha=1.702, limit=7.0, gate_up_input_scale=None, down_input_scale=None):
    """Both GEMMs of the w8a8 path -> y [N, H] in x's dtype, each row times its routing weight (for combine)."""
    tiles = w8a8_tiles(tiles, gate_up_scale, down_scale, static_intermediate=down_input_scale is not None)
    h, h_scale = w8a8_gemm1(x, w_gate, w_up, info, tiles, gate_up_scale, transposed=transposed,
                            activation=activation, gate_bias=gate_bias, up_bias=up_bias, alpha=alpha, limit=limit,
                            gate_up_input_scale=gate_up_input_scale, down_input_scale=down_input_scale)
    return w8a8_gemm(h, w_down, info, tiles.down, down_scale, a_scale=h_scale, a_static=down_input_scale,
                     transposed=transposed, bias=down_bias, topk_weights=topk_weights, out_dtype=x.dtype)
