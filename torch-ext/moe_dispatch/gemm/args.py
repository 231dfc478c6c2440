"""Host-side argument packing shared by the grouped-GEMM launchers (gemm/grouped.py, gemm/persistent.py,
backward/experts.py, backward/weight_grads.py, gemm/w8a8.py, gemm/w8a8_persistent.py, gemm/decode.py): weight strides
as [E, n, K], the weight-side operands (`GemmWeights`), routing and scale arguments, and the constexprs every
grouped-GEMM kernel shares."""

import dataclasses

import torch

from ..formats.fp8 import WeightScale
from ..formats.mxfp4 import MXFP4_GROUP, is_mxfp4
from ..formats.scale_codes import WeightScaleCode
from ..host.device import (decodes_mxfp4_bf16x2, dot_input_precision, dot_needs_fp32, is_cuda, is_interpreter,
                           tma_readable)
from ..host.pdl import pdl_options
from ..host.tiles import GemmTile
from .jit import Activation

NO_SCALE = WeightScale(None, WeightScaleCode.NONE, (0, 0, 0))  # float weights: the scale arguments unused


def weight_k(weight, transposed=False):
    """K of a per-expert weight used as [E, n, K] ([E, K, n] when `transposed`); MXFP4 bytes [E, n, K / 2] hold two
    values each."""
    if transposed:
        return weight.shape[1]
    return weight.shape[2] * 2 if is_mxfp4(weight) else weight.shape[2]


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
    with the same strides), its (stride_e, stride_n, stride_k) as [E, n, K], n, and the biases with equal strides.

    `paired`: a gated GEMM over one interleaved gate/up weight (rows 2j gate, 2j + 1 up of [E, 2n, K]), passed whole
    with its strides and its whole [E, 2n] bias; `weight_up` and `bias_up` are then None and the pointer kernels read
    [BLOCK_K, 2 BLOCK_N] tiles of it (gemm/grouped.py's PAIRED)."""

    weight: torch.Tensor
    weight_up: torch.Tensor | None  # None unless the activation is gated (and not paired)
    strides: tuple
    n_cols: int
    bias: torch.Tensor | None
    bias_up: torch.Tensor | None
    paired: bool = False

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


def gemm_weights(weight, weight_up, bias, bias_up, *, transposed, activation, paired=False) -> GemmWeights:
    """`GemmWeights` of [E, n, K] weights ([E, K, n] when `transposed`); views copied only when gate and up strides
    differ (see `same_strides`). `paired`: `weight` is a whole interleaved gate/up weight [E, 2n, K] ([E, K, 2n])
    and `bias` its whole [E, 2n] bias (`weight_up`, `bias_up` unused)."""
    gated = Activation.of(activation) != Activation.NONE
    if paired:
        if not gated:
            raise ValueError("paired gate/up weights need a gated activation")
        n_cols = (weight.shape[2] if transposed else weight.shape[1]) // 2
        return GemmWeights(weight, None, weight_strides(weight, transposed), n_cols, bias, None, paired=True)
    if gated:
        weight, weight_up = same_strides(weight, weight_up)
    if bias is not None and bias_up is not None:
        bias, bias_up = same_strides(bias, bias_up)
    n_cols = weight.shape[2] if transposed else weight.shape[1]
    return GemmWeights(weight, weight_up if gated else None, weight_strides(weight, transposed), n_cols, bias,
                       bias_up)


def dequant_scale_code(ws: WeightScale, block_k, min_block_k=16, *, dtype=None, device=None):
    """(WEIGHT_SCALE, BLOCK_K) of the dequant path for weight scales `ws` and a tile's BLOCK_K (MXFP4 weights: at least
    one 32-value scale group per step, decoded by PTX, MXFP4_BF16X2, for activations of `dtype` on `device` where
    `decodes_mxfp4_bf16x2` says so): block scales whose K
    side has a power-of-two divisor >= min_block_k take WeightScaleCode.BLOCK_STEP with BLOCK_K narrowed to divide it
    (K steps inside one scale block: one scale vector per step instead of a [BLOCK_K, BLOCK_N] fp32 scale tile per
    stage, which overflowed the H200's shared memory with DeepSeek-V3's 128 x 128 tiles)."""
    if ws.code == WeightScaleCode.BLOCK and (ws.block_k & -ws.block_k) >= min_block_k:
        return WeightScaleCode.BLOCK_STEP, min(block_k, ws.block_k & -ws.block_k)
    if ws.code == WeightScaleCode.MXFP4:  # whole scale groups per K step (tiles' BLOCK_K are powers of two)
        fast = dtype is not None and decodes_mxfp4_bf16x2(dtype, device)
        return WeightScaleCode.MXFP4_BF16X2 if fast else ws.code, max(block_k, MXFP4_GROUP)
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
    return dict(TOP_K=info.top_k, GATHER_A=gather_a, ACTIVATION=int(Activation.of(activation)),
                HAS_BIAS=w.bias is not None, MUL_ROUTED_WEIGHT=topk_weights is not None, BLOCK_M=info.block_m,
                BLOCK_N=tile.block_n, GROUP_M=tile.group_m, num_warps=tile.num_warps, num_stages=tile.num_stages,
                **pdl_options(info.tile_expert.device), **register_cap(tile))


def register_cap(tile: GemmTile) -> dict:
    """The `maxnreg` launch option of a tile that sets one, on NVIDIA GPUs (the option is theirs; AMD and the
    interpreter run without it)."""
    return {"maxnreg": tile.maxnreg} if tile.maxnreg and is_cuda() and not is_interpreter() else {}


# The descriptor views of the operands (what TMA needs of a layout, host.device.tma_readable, and what each view's
# shape adds): gemm/planner.py decides with them, gemm/persistent.py builds the descriptors.


def descriptor_rows(weight, n_cols):
    """Rows of the 2-D descriptor view of an [E, n_cols, K] weight (see gemm/persistent.py's docstring) and rows per
    expert; None when the layout does not allow one (not TMA-readable, or experts not a whole number of rows
    apart)."""
    stride_e, stride_n, _ = weight.stride()
    if not tma_readable(weight) or stride_n <= 0 or stride_e % stride_n:
        return None
    rows_per_expert = stride_e // stride_n
    return (weight.shape[0] - 1) * rows_per_expert + n_cols, rows_per_expert


def fits_k_outer_descriptor(weight):
    """Whether an [E, K, n] weight (a transposed layout: n contiguous) can be read through a 3-D descriptor of
    [1, BLOCK_K, BLOCK_N] tiles: as it is (tma_readable). The expert is the descriptor's own dimension, so a K tile
    past K reads the zero fill, never the next expert's rows."""
    return tma_readable(weight)


def weights_fit_descriptors(w: GemmWeights, transposed=False):
    """Whether the weights (and the up view of a gated GEMM) of a GemmWeights can be read through
    gemm.persistent.weight_descriptors: [E, n, K] rows (a paired weight's 2n rows), or, `transposed`, [E, K, n]
    through 3-D descriptors (`fits_k_outer_descriptor`)."""
    if w.weight.shape[0] == 0:
        return False
    if transposed:
        return fits_k_outer_descriptor(w.weight) and (not w.gated or (fits_k_outer_descriptor(w.weight_up)
                                                                      and w.weight_up.stride() == w.weight.stride()))
    if descriptor_rows(w.weight, 2 * w.n_cols if w.paired else w.n_cols) is None:
        return False
    return not w.gated or (tma_readable(w.weight_up) and w.weight_up.stride() == w.weight.stride())


def rows_fit_descriptor(a):
    """Whether [rows, K] A can be read as descriptor tiles: K > 0 and tma_readable."""
    return a.shape[1] > 0 and tma_readable(a)
