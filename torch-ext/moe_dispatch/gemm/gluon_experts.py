"""The experts paths on the warp-specialized Gluon GEMMs (Hopper, Triton 3.6): w8a8 on gemm/gluon_fp8.py's FP8 GEMM,
MXFP4 weights on gemm/gluon_mxfp4.py's (`gluon_mxfp4_experts`, at the end: the same passes around its two GEMMs, in
bf16). No host sync anywhere.

The engine (`gluon_w8a8_experts`): float8_e4m3fn weights with 128 x 128 block scales, run where
planner.plan_w8a8_engine says so (SM90 with Triton's Gluon, from planner.GLUON_FP8_MIN_ROWS rows per expert unless
MOE_DISPATCH_GLUON_FP8 says otherwise; everywhere else gemm/w8a8.py's portable kernels run)::

    x [T, H] bf16
      -> quantize_fp8_rows (gemm/w8a8.py)  rows gathered into expert-sorted order (the pass the persistent w8a8 path
                                           runs), e4m3 per row and 128 columns -> a [N, H], a_scale [N, cdiv(H, 128)]
      -> fp8_block_gated_grouped_gemm      GEMM1 against the whole w_gate_up [E, 2F, H] (gate rows then up rows, F a
                                           multiple of 128; 128 x 128 tiles), bias, activation (silu / swiglu_oai)
                                           and e4m3 per row and 128 columns in its epilogue -> h [N, F], h_scale
                                           [N, F / 128]
         (interleaved rows or another F: fp8_block_grouped_gemm -> gate_up [N, 2F] bf16, then
         _gated_activation_fp8_kernel, the same in a pass (gemm.w8a8_jit.w8a8_epilogue) on bf16-rounded sums)
      -> fp8_block_grouped_gemm            GEMM2 against w_down [E, H, F] -> y [N, H] bf16
      -> _bias_routing_weight_kernel       with a down bias only: bias and routing weight, in place
                                           (gemm.jit.tile_epilogue)
      -> y [N, H] bf16 -> dispatch/combine.py, which applies the routing weights where the pass did not (one pass
                          over y less: 1-12% of the call at T = 16384, Mixtral to Qwen3-30B widths)

The plain FP8 GEMMs (GEMM2, and GEMM1 before the separate pass) take 64 x 256 tiles below ROWS64_BELOW_ROWS rows per
expert and 128 x 128 from there (`fp8_gemm_config`). What runs follows from the call's shapes and layout alone, which
a plan's key holds (host/replay.py): the engine has no module-level switch; its alternatives (the separate pass
everywhere, other tiles) are keywords of `gluon_w8a8_experts`, for the probe and the tests.

N = T * top_k; row p of every [N, .] buffer is sorted position p of the dispatch (DispatchInfo); rows past
expert_offsets[E] (dropped assignments) are never written past the quantization pass, and combine never reads them.

The engine's arithmetic is the portable w8a8 path's with its groups at 128 (one K step per weight block,
DeepSeek-V3's activation group), except that on the separate pass GEMM1's sums reach the activation as bf16 (the plain
Gluon GEMM writes bf16; the portable kernel and the gated GEMM activate their fp32 accumulators) and y is rounded to
bf16 before the routing weight multiplies it: about
2^-9 relative, which moves a few of h's e4m3 roundings by one step (reference.W8A8_MODEL_TOLERANCE_GPU bounds the
difference from the w8a8 model).
"""

import torch
import triton
import triton.language as tl

from ..formats.fp8 import W8A8_DTYPE, fp8_max
from ..host.device import is_interpreter
from ..host.host_math import cdiv
from ..host.replay import launch
from .jit import (ACT_NONE, SCALE_NONE, Activation, pair_columns, split_pairs, tile_epilogue, tile_rows,
                  tile_setup)
from .gluon_fp8 import DEFAULT_CONFIG as DEFAULT_FP8_CONFIG
from .gluon_fp8 import ROWS64_CONFIG, SCALE_BLOCK, fp8_block_gated_grouped_gemm, fp8_block_grouped_gemm
from .gluon_mxfp4 import gemm_tile, mxfp4_grouped_gemm
from .w8a8 import fp8_rows, gather_rows, quantize_fp8_rows
from .w8a8_jit import A_FP8_GROUPS, OUT_DYNAMIC, w8a8_epilogue

# 64 x 256 below this many rows per expert: H200 speedup over 128 x 128 1.04-1.13x at 128-512, 0.97-1.02x from 1024
ROWS64_BELOW_ROWS = 1024
# GEMM1's fused activation (128 x 128 only) from this many rows per expert: at 128 the separate pass on 64 x 256 tiles
# was faster (DeepSeek-V3 T = 4096: 1.12x on an H100, 1.09x on the H200), at 256 and above the fused GEMM1 (1.03-1.06x)
FUSED_FROM_ROWS = 256
ELEMENTWISE_WARPS = 8  # the passes hold [BLOCK_M <= 128, 128] fp32 tiles (two for the activation's gate and up)
ELEMENTWISE_BLOCK_N = 128  # columns per program of the passes (the FP8 ones: one 128-column scale group)


@triton.jit
def _load_gate_up(gate_up_ptr, stride_gate_up_m, offs_m, mask_m, pid_n, offs_n, mask_n, n_cols,
                  BLOCK_N: tl.constexpr, PAIRED: tl.constexpr):
    """The gate and up sums [BLOCK_M, BLOCK_N] each of output tile [rows offs_m, columns offs_n] from GEMM1's gate_up
    [rows, 2 n_cols] in fp32, zeros outside the masks. Concatenated: columns j and n_cols + j. PAIRED (gate and up
    alternating): the tile's 2 BLOCK_N interleaved columns read as one contiguous block and split in registers (two
    stride-2 reads hold a 64-bit address per element: 255 registers and spills at BLOCK_M 128)."""
    rows = gate_up_ptr + offs_m[:, None].to(tl.int64) * stride_gate_up_m  # [BLOCK_M, 1]
    if PAIRED:
        offs_pair, mask_pair = pair_columns(pid_n, n_cols, BLOCK_N)
        b_pairs = tl.load(rows + offs_pair[None, :], mask=mask_m[:, None] & mask_pair[None, :],
                          other=0.0).to(tl.float32)  # [BLOCK_M, 2 BLOCK_N]
        return split_pairs(b_pairs)
    else:
        mask = mask_m[:, None] & mask_n[None, :]
        b_gate = tl.load(rows + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        b_up = tl.load(rows + (offs_n + n_cols)[None, :], mask=mask, other=0.0).to(tl.float32)
        return b_gate, b_up


@triton.jit
def _gated_activation_fp8_kernel(
    # gate_up: [num_rows, 2 n_cols] GEMM1's output in sorted order: gate columns then up columns, or (PAIRED) gate and
    # up alternating, gate first
    gate_up_ptr, stride_gate_up_m,
    bias_ptr, bias_up_ptr, stride_bias_e, stride_bias_n,
    # h: [num_rows, n_cols] e4m3 with h_scale [num_rows, cdiv(n_cols, GROUP)] fp32
    h_ptr, stride_h_m, h_scale_ptr, stride_h_scale_m,
    # dispatch metadata (DispatchInfo's tile map)
    tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
    num_rows, n_cols, E, max_tiles,
    alpha, limit, fp8_max,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PAIRED: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GROUP: tl.constexpr,
):
    """Grid: (max_tiles * cdiv(n_cols, GROUP),). Each program reads the gate and up columns of one [BLOCK_M, GROUP]
    tile of the tile map (rows of one expert), adds the expert's biases, activates, and writes the tile as e4m3 with
    one scale per row (one group): GEMM2's A (`_load_gate_up` reads PAIRED columns). Sentinel tiles exit."""
    expert, offs_m, mask_m, pid_n, offs_n, mask_n = tile_setup(tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
                                                               num_rows, n_cols, E, max_tiles, BLOCK_M, GROUP, 1)
    if expert < 0:
        return
    b_gate, b_up = _load_gate_up(gate_up_ptr, stride_gate_up_m, offs_m, mask_m, pid_n, offs_n, mask_n, n_cols, GROUP,
                                 PAIRED)  # [BLOCK_M, GROUP] each
    # Columns past n_cols are zeros (their bias too), so they never raise a group's amax.
    w8a8_epilogue(b_gate, b_up, expert, offs_m, mask_m, pid_n, offs_n, mask_n, offs_m, 1.0, None, 0, 1, 0,
                  bias_ptr, bias_up_ptr, stride_bias_e, stride_bias_n, h_ptr, stride_h_m, 1, h_scale_ptr, 0,
                  stride_h_scale_m, n_cols, None, 0, 0, alpha, limit, fp8_max, 1, ACTIVATION, HAS_BIAS, False,
                  A_FP8_GROUPS, SCALE_NONE, OUT_DYNAMIC, GROUP, ROUND_IN_FP32, BLOCK_M, GROUP)


@triton.jit
def _gated_activation_kernel(
    # gate_up: [num_rows, 2 n_cols] GEMM1's output in sorted order (concatenated or, PAIRED, alternating columns)
    gate_up_ptr, stride_gate_up_m,
    bias_ptr, bias_up_ptr, stride_bias_e, stride_bias_n,
    # h: [num_rows, n_cols] in gate_up's dtype
    h_ptr, stride_h_m,
    tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
    num_rows, n_cols, E, max_tiles,
    alpha, limit,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PAIRED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid: (max_tiles * cdiv(n_cols, BLOCK_N),). `_gated_activation_fp8_kernel`'s pass writing h in gate_up's dtype
    (GEMM2's A on the MXFP4 engine): the expert's biases, the activation, one rounding. Sentinel tiles exit."""
    expert, offs_m, mask_m, pid_n, offs_n, mask_n = tile_setup(tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
                                                               num_rows, n_cols, E, max_tiles, BLOCK_M, BLOCK_N, 1)
    if expert < 0:
        return
    b_gate, b_up = _load_gate_up(gate_up_ptr, stride_gate_up_m, offs_m, mask_m, pid_n, offs_n, mask_n, n_cols, BLOCK_N,
                                 PAIRED)
    tile_epilogue(b_gate, b_up, expert, offs_m, mask_m, offs_n, mask_n, offs_m, bias_ptr, bias_up_ptr, stride_bias_e,
                  stride_bias_n, h_ptr, stride_h_m, 1, None, 0, n_cols, None, 0, 0, alpha, limit, 1, ACTIVATION,
                  HAS_BIAS, False, False)


@triton.jit
def _bias_routing_weight_kernel(
    # y: [num_rows, n_cols] GEMM2's output in sorted order, rewritten in place
    y_ptr, stride_y_m,
    bias_ptr, stride_bias_e, stride_bias_n,
    # dispatch metadata (DispatchInfo's tile map) and the routing weights [num_tokens, TOP_K]
    tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, gather_idx_ptr,
    topk_weights_ptr, stride_topk_t, stride_topk_k, num_tokens,
    num_rows, n_cols, E, max_tiles,
    TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid: (max_tiles * cdiv(n_cols, BLOCK_N),). Each program rewrites one [BLOCK_M, BLOCK_N] tile of y as
    (y + down_bias[expert]) * routing weight of each row's assignment, rounded once to y's dtype. Sentinel tiles
    exit."""
    expert, offs_m, mask_m, pid_n, offs_n, mask_n = tile_setup(tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
                                                               num_rows, n_cols, E, max_tiles, BLOCK_M, BLOCK_N, 1)
    if expert < 0:
        return
    _, b_assignment, mask_m = tile_rows(offs_m, mask_m, gather_idx_ptr, num_tokens, num_rows, TOP_K, False, True)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_y_m + offs_n[None, :]  # [BLOCK_M, BLOCK_N]
    b_y = tl.load(y_ptrs, mask=mask_m[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
    tile_epilogue(b_y, b_y, expert, offs_m, mask_m, offs_n, mask_n, b_assignment, bias_ptr, bias_ptr, stride_bias_e,
                  stride_bias_n, y_ptr, stride_y_m, 1, None, 0, n_cols, topk_weights_ptr, stride_topk_t,
                  stride_topk_k, 1.0, 0.0, TOP_K, ACT_NONE, HAS_BIAS, False, True)


def _gated_activation_fp8(gate_up, info, *, interleaved, activation, gate_bias, up_bias, alpha, limit):
    """gate_up [N, 2F] (sorted rows) -> (h [N, F] e4m3 from `fp8_rows`, h_scale [N, cdiv(F, 128)] fp32)."""
    num_rows, num_ffn = gate_up.shape[0], gate_up.shape[1] // 2
    h = fp8_rows(num_rows, num_ffn, gate_up.device)
    h_scale = torch.empty((num_rows, cdiv(num_ffn, SCALE_BLOCK)), device=gate_up.device, dtype=torch.float32)
    if num_rows == 0 or num_ffn == 0 or info.max_tiles == 0:
        return h, h_scale
    bias = gate_bias is not None
    launch(_gated_activation_fp8_kernel, (info.max_tiles * cdiv(num_ffn, SCALE_BLOCK),),
        gate_up, gate_up.stride(0),
        gate_bias, up_bias, gate_bias.stride(0) if bias else 0, gate_bias.stride(1) if bias else 0,
        h, h.stride(0), h_scale, h_scale.stride(0),
        info.tile_expert, info.tile_row_start, info.expert_offsets,
        num_rows, num_ffn, info.num_experts, info.max_tiles,
        float(alpha), float(limit), fp8_max(W8A8_DTYPE),
        ACTIVATION=int(Activation.of(activation)), HAS_BIAS=bias, PAIRED=interleaved,
        ROUND_IN_FP32=is_interpreter(), BLOCK_M=info.block_m, GROUP=SCALE_BLOCK, num_warps=ELEMENTWISE_WARPS)
    return h, h_scale


def _gated_activation(gate_up, info, *, interleaved, activation, gate_bias, up_bias, alpha, limit):
    """gate_up [N, 2F] (sorted rows) -> h [N, F] in gate_up's dtype (rows past the kept assignments unwritten)."""
    num_rows, num_ffn = gate_up.shape[0], gate_up.shape[1] // 2
    h = torch.empty((num_rows, num_ffn), device=gate_up.device, dtype=gate_up.dtype)
    if num_rows == 0 or num_ffn == 0 or info.max_tiles == 0:
        return h
    bias = gate_bias is not None
    launch(_gated_activation_kernel, (info.max_tiles * cdiv(num_ffn, ELEMENTWISE_BLOCK_N),),
        gate_up, gate_up.stride(0),
        gate_bias, up_bias, gate_bias.stride(0) if bias else 0, gate_bias.stride(1) if bias else 0,
        h, h.stride(0),
        info.tile_expert, info.tile_row_start, info.expert_offsets,
        num_rows, num_ffn, info.num_experts, info.max_tiles,
        float(alpha), float(limit),
        ACTIVATION=int(Activation.of(activation)), HAS_BIAS=bias, PAIRED=interleaved, BLOCK_M=info.block_m,
        BLOCK_N=ELEMENTWISE_BLOCK_N, num_warps=ELEMENTWISE_WARPS)
    return h


def _bias_routing_weight(y, info, down_bias, topk_weights):
    """y [N, H] (sorted rows) <- (y + down_bias[expert]) * routing weight, in place; returns y."""
    num_rows, hidden = y.shape
    if num_rows == 0 or hidden == 0 or info.max_tiles == 0:
        return y
    bias = down_bias is not None
    launch(_bias_routing_weight_kernel, (info.max_tiles * cdiv(hidden, ELEMENTWISE_BLOCK_N),),
        y, y.stride(0),
        down_bias, down_bias.stride(0) if bias else 0, down_bias.stride(1) if bias else 0,
        info.tile_expert, info.tile_row_start, info.expert_offsets, info.gather_idx,
        topk_weights, topk_weights.stride(0), topk_weights.stride(1), info.num_tokens,
        num_rows, hidden, info.num_experts, info.max_tiles,
        TOP_K=info.top_k, HAS_BIAS=bias, BLOCK_M=info.block_m, BLOCK_N=ELEMENTWISE_BLOCK_N,
        num_warps=ELEMENTWISE_WARPS)
    return y


def fuses_activation(num_tokens, top_k, num_experts) -> bool:
    """Whether GEMM1 activates in its epilogue (where the layout allows it) for a call of `num_tokens` tokens routed
    to `top_k` of `num_experts` experts: from FUSED_FROM_ROWS rows per expert on average."""
    return num_tokens * top_k >= FUSED_FROM_ROWS * max(num_experts, 1)


def fp8_gemm_config(num_tokens, top_k, num_experts):
    """The tiles of the w8a8 engine's plain FP8 GEMMs for a call of `num_tokens` tokens routed to `top_k` of
    `num_experts` experts, by its rows per expert on average (T * top_k / E): gluon_fp8.ROWS64_CONFIG below
    ROWS64_BELOW_ROWS, gluon_fp8.DEFAULT_CONFIG from there."""
    return ROWS64_CONFIG if num_tokens * top_k < ROWS64_BELOW_ROWS * max(num_experts, 1) else DEFAULT_FP8_CONFIG


def gluon_w8a8_experts(x, w_gate_up, w_down, info, w_gate_up_scale, w_down_scale, *, topk_weights,
                       interleaved=False, activation="silu", gate_bias=None, up_bias=None, down_bias=None,
                       alpha=1.702, limit=7.0, fused_activation=None, plain_gemm_cfg=None):
    """Both GEMMs of the w8a8 path on the Gluon GEMM -> (y [N, H] bf16 with rows in the dispatch's sorted order, the
    routing weights combine must still apply): with a down bias, y's rows carry bias and routing weight (the second
    item None), as `gemm.w8a8.w8a8_experts`' do; without one, y is GEMM2's output and the second item is
    `topk_weights`, which combine multiplies in as it sums (module docstring). For what planner.gluon_fp8_refusal
    accepts.

    x [T, H] bf16; w_gate_up [E, 2F, H] float8_e4m3fn, contiguous, gate rows then up rows (`interleaved`: alternating,
    gate first), w_gate_up_scale [E, cdiv(2F, 128), cdiv(H, 128)] fp32; w_down [E, H, F] with w_down_scale
    [E, cdiv(H, 128), cdiv(F, 128)]; info the dispatch (dispatch.segments.DispatchInfo; any block_m); gate_bias,
    up_bias [E, F] views with equal strides, down_bias [E, H]. GEMM1 activates and quantizes h in its epilogue
    (`fp8_block_gated_grouped_gemm`) where the gate and up rows are concatenated, F is a multiple of 128 and
    `fuses_activation` says so (`fused_activation` None); elsewhere the separate pass does. The package calls this
    with the defaults; the probe (benchmarks/gluon_fp8_probe.py) and the tests pass the alternatives explicitly:
    `fused_activation` True or False fuses wherever the layout allows or nowhere, `plain_gemm_cfg` (a gluon_fp8.GluonFp8Config) replaces `fp8_gemm_config`'s choice as the plain GEMMs'
    tiles."""
    a, a_scale = quantize_fp8_rows(x, SCALE_BLOCK, info=info)
    cfg = fp8_gemm_config(info.num_tokens, info.top_k, info.num_experts) if plain_gemm_cfg is None else plain_gemm_cfg
    if fused_activation is None:
        fused_activation = fuses_activation(info.num_tokens, info.top_k, info.num_experts)
    if fused_activation and not interleaved and w_down.shape[2] % SCALE_BLOCK == 0:
        h, h_scale = fp8_block_gated_grouped_gemm(a, a_scale, w_gate_up, w_gate_up_scale, info.expert_offsets,
                                                  activation=activation, gate_bias=gate_bias, up_bias=up_bias,
                                                  alpha=alpha, limit=limit)
    else:
        gate_up = fp8_block_grouped_gemm(a, a_scale, w_gate_up, w_gate_up_scale, info.expert_offsets, cfg=cfg)
        h, h_scale = _gated_activation_fp8(gate_up, info, interleaved=interleaved, activation=activation,
                                           gate_bias=gate_bias, up_bias=up_bias, alpha=alpha, limit=limit)
    y = fp8_block_grouped_gemm(h, h_scale, w_down, w_down_scale, info.expert_offsets, cfg=cfg)
    if down_bias is None:
        return y, topk_weights
    return _bias_routing_weight(y, info, down_bias, topk_weights), None


def gluon_mxfp4_experts(x, w_gate_up, w_down, info, w_gate_up_scale, w_down_scale, *, topk_weights,
                        interleaved=False, activation="silu", gate_up_bias=None, down_bias=None, alpha=1.702,
                        limit=7.0, tile=None):
    """Both GEMMs of the MXFP4 experts path on the Gluon MXFP4 GEMM (gemm/gluon_mxfp4.py) -> (y [N, H] bf16 in the
    dispatch's sorted order, the routing weights combine must still apply: None where GEMM2 applied them), as
    `gluon_w8a8_experts` returns them. For what planner.gluon_mxfp4_refusal accepts.

    x [T, H] bf16; w_gate_up uint8 [E, 2F, H / 2] contiguous MXFP4 bytes, gate rows then up rows (`interleaved`:
    alternating, gate first), w_gate_up_scale uint8 [E, 2F, H / 32]; w_down uint8 [E, H, F / 2] with w_down_scale
    [E, H, F / 32]; info the dispatch (any block_m); gate_up_bias [E, 2F] in the weight's row order, down_bias [E, H].
    x's rows are gathered into sorted order (`gemm.w8a8.gather_rows`); GEMM1 activates in its epilogue where gate and
    up alternate (with the bias), else writes gate_up [N, 2F] for the activation pass (`_gated_activation`); GEMM2
    adds the down bias and applies the routing weights in its epilogue where there is a down bias (else combine
    applies them). Both GEMMs in gluon_mxfp4.gemm_tile's form and tile, or `tile` = (form, block_m)."""
    a = gather_rows(x, info)
    form, block_m = gemm_tile(info.num_tokens, info.top_k, info.num_experts) if tile is None else tile
    if interleaved:
        h = mxfp4_grouped_gemm(a, w_gate_up, w_gate_up_scale, info.expert_offsets, bias=gate_up_bias,
                               activation=activation, alpha=alpha, limit=limit, block_m=block_m, form=form)
    else:
        num_ffn = w_gate_up.shape[1] // 2
        gate_bias, up_bias = ((gate_up_bias[:, :num_ffn], gate_up_bias[:, num_ffn:]) if gate_up_bias is not None
                              else (None, None))
        gate_up = mxfp4_grouped_gemm(a, w_gate_up, w_gate_up_scale, info.expert_offsets, block_m=block_m,
                                     form=form)
        h = _gated_activation(gate_up, info, interleaved=False, activation=activation, gate_bias=gate_bias,
                              up_bias=up_bias, alpha=alpha, limit=limit)
    if down_bias is None:
        return (mxfp4_grouped_gemm(h, w_down, w_down_scale, info.expert_offsets, block_m=block_m, form=form),
                topk_weights)
    y = mxfp4_grouped_gemm(h, w_down, w_down_scale, info.expert_offsets, bias=down_bias,
                           routing=(info.gather_idx, topk_weights), block_m=block_m, form=form)
    return y, None
