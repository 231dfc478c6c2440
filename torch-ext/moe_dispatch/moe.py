"""The MoE layer composed from the stages (no kernels here), as torch custom operators with a backward:

  fused_moe_forward = routing's `route` operator -> the experts operator
  fused_experts     = operator `fused_experts`: dispatch.segments.dispatch -> GEMM1 (gather + gate/up + activation, the
                      pre-activations saved when a gradient is needed) -> GEMM2 (down, routed weight) -> combine;
                      at a few tokens in inference, decode.decode_experts instead (two launches, no dispatch)
                      backward: operator `fused_experts_backward` (kernels in backward/experts.py)
  fused_expert_ffn / expert_ffn_triton: the v1 functions that start from already-permuted rows (forward only).

Nothing here reads device data on the host: every size is known from shapes, so a forward (and a backward) can be
captured in a CUDA graph and replayed with new inputs, and torch.compile traces the operators through their fake
implementations with symbolic token counts.
"""

import dataclasses
import inspect
from typing import Literal

import torch

from .backward.experts import ExpertsGrads, experts_backward
from .dispatch.binned import drop_over_capacity, expert_capacity
from .dispatch.combine import combine
from .dispatch.segments import dispatch, segment_dispatch
from .formats.fp8 import (DEFAULT_FP8_BLOCK_SHAPE, FP8_COMPUTE, GATE_UP_SCALE_LAYOUTS, WeightScale, check_block_shape,
                          check_fp8_dtype_on_device, check_fp8_weight, check_gate_up_scale_layout, check_input_scale,
                          gate_up_row_offset, infer_scheme, input_scale_problems, is_fp8, kernel_scale)
from .formats.mxfp4 import MXFP4_GROUP, check_mxfp4_weight, is_mxfp4, mxfp4_k, mxfp4_weight_scale
from .formats.quant import ExpertsQuant, resolve_quant
from .formats.scale_codes import WeightScaleCode
from .gemm import gluon_fp8
from .gemm.args import weight_k
from .gemm.decode import decode_experts
from .gemm.gluon_experts import gluon_w8a8_experts
from .gemm.grouped import check_segmented_rows, expert_gemm
from .gemm.mxfp4_dequant import dequantize_mxfp4_experts
from .gemm.planner import (ExpertsPath, choose_fp8_compute, mxfp4_dequantizes_first, plan_experts, plan_segments,
                           plan_w8a8_engine)
from .gemm.w8a8 import w8a8_experts
from .host.checks import (ROUTING_WEIGHT_DTYPES, check_bool, check_choice, check_dim, check_float, check_ids_in_range,
                          check_index, check_int, check_kernel_device, check_real, check_same_device, check_tensor,
                          check_token_weights, index_map_problems, raise_problems, reads_values, segment_rows_problems,
                          validate_option, warn_if_gradient_cut)
from .host.device import call_scope
from .host.library import call, custom_op, needs_operator
from .host.replay import PlanCache
from .host.tiles import DecodeTiles, MoeTiles, check_forced_tiles, tiles_from_list
from .routing.router import check_router_args, check_router_options, route_with_grad

EXPERT_ACTIVATIONS = ("silu", "swiglu_oai")


@dataclasses.dataclass(frozen=True)
class ExpertsSpec:
    """How the experts compute, apart from their tensors, tiles and FP8 scales: the weights' layout and the
    activation (see `fused_experts`). Crosses the operator boundary as five slots (`to_args`)."""

    activation: str = "silu"  # EXPERT_ACTIVATIONS
    interleaved: bool = False  # gate and up alternate along 2F (gate first); else gate rows, then up rows
    transposed: bool = False  # [E, H, 2F] / [E, F, H] weights (GPT-OSS) instead of [E, 2F, H] / [E, H, F]
    alpha: float = 1.702  # swiglu_oai: sigmoid(alpha * gate)
    limit: float = 7.0  # swiglu_oai: the clamp of gate (above) and up (both sides)

    def to_args(self) -> tuple:
        return self.activation, self.interleaved, self.transposed, float(self.alpha), float(self.limit)


@dataclasses.dataclass(frozen=True)
class Fp8Scales:
    """The scales of float8 expert weights and how a call computes with them (formats/fp8.py; the arguments of the same
    names of `fused_experts`). `compute` is resolved ("w8a8" or "dequant", planner.choose_fp8_compute). Crosses the
    operator boundary as seven slots (`to_args`)."""

    w_gate_up_scale: torch.Tensor | None
    w_down_scale: torch.Tensor | None
    block_shape: tuple[int, int] = DEFAULT_FP8_BLOCK_SHAPE
    gate_up_input_scale: torch.Tensor | None = None
    down_input_scale: torch.Tensor | None = None
    compute: str = "dequant"
    gate_up_scale_layout: str = "fused"

    def detached(self) -> "Fp8Scales":
        """The same scales cut from autograd (the FP8 path is forward only)."""
        cut = {f: getattr(self, f) for f in _SCALES}
        return dataclasses.replace(self, **{f: t.detach() if t is not None else None for f, t in cut.items()})

    def to_args(self) -> tuple:
        return (self.w_gate_up_scale, self.w_down_scale, list(self.block_shape), self.gate_up_input_scale,
                self.down_input_scale, self.compute, self.gate_up_scale_layout)


_SCALES = ("w_gate_up_scale", "w_down_scale", "gate_up_input_scale", "down_input_scale")  # Fp8Scales' tensors


def _check_weight_dtype(name, weight, dtype):
    if weight is not None and weight.dtype != dtype:
        raise TypeError(f"{name} has dtype {weight.dtype} but hidden_states has {dtype}; they must match")


def _split_gate_up(w, num_ffn, interleaved, axis):
    """Gate and up views of a gate_up tensor along `axis` (no copy)."""
    if interleaved:
        lead = (slice(None),) * axis
        return w[lead + (slice(0, None, 2),)], w[lead + (slice(1, None, 2),)]
    return w.narrow(axis, 0, num_ffn), w.narrow(axis, num_ffn, num_ffn)


def _gate_up_views(w_gate_up, w_up, num_ffn, interleaved, axis):
    """(gate, up) of the first projection: w_gate_up itself split along `axis`, or the pair when w_up is given."""
    if w_up is not None:
        return w_gate_up, w_up
    return _split_gate_up(w_gate_up, num_ffn, interleaved, axis)


def _ffn_size(w_down, transposed):
    return weight_k(w_down, transposed)


def _fused_experts_impl(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_up: torch.Tensor | None, w_down: torch.Tensor, topk_ids: torch.Tensor,
    topk_weights: torch.Tensor, gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None, activation: str,
    interleaved: bool, transposed: bool, alpha: float, limit: float, tiles: list[int] | None, save_preact: bool,
    w_gate_up_scale: torch.Tensor | None = None, w_down_scale: torch.Tensor | None = None,
    fp8_block_shape: list[int] | None = None, gate_up_input_scale: torch.Tensor | None = None,
    down_input_scale: torch.Tensor | None = None, fp8_compute: str = "dequant", w_gate_up_scale_layout: str = "fused",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H] -> (out [T, H], preact [N, 2F], expert_offsets [E + 1], gather_idx [N], scatter_idx [N]); preact's
    columns in the order of w_gate_up's 2F (interleaved weights: gate and up alternating).

    w_up given: w_gate_up is the gate weight alone (seed layout [E, F, H]); else the concatenated or interleaved
    [E, 2F, H] ([E, H, 2F] transposed). The last four outputs are what the backward needs; without save_preact they
    are empty ([0]) and the decode path (gemm/decode.py) may run instead of the four launches (planner.plan_experts).
    `tiles`: None (the device's tables choose), or a forced `MoeTiles` / `DecodeTiles` as flat ints.
    The slots are the flattening of `ExpertsSpec` (activation .. limit) and `Fp8Scales` (w_gate_up_scale ..
    w_gate_up_scale_layout; `_experts_op_args` builds them). float8 weights come with their fp32 scales (formats/fp8.py;
    checked by `fused_experts`), forward only: the caller passes inputs that need no gradient and save_preact False.
    `fp8_compute` is already resolved to "w8a8" (gemm/w8a8.py, with the static input scales if any) or "dequant"
    (gemm/grouped.py).

    The operator's launches are planned (`host/replay.py`) like the entry points': a training step's forward (which
    cannot replay at `fused_experts`, its inputs requiring gradients) replays them here, below autograd, where the
    operator's inputs are plain tensors under no-grad.
    """
    tensors = (x, w_gate_up, w_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias, w_gate_up_scale,
               w_down_scale, gate_up_input_scale, down_input_scale)
    options = (activation, interleaved, transposed, alpha, limit, None if tiles is None else tuple(tiles), save_preact,
               None if fp8_block_shape is None else tuple(fp8_block_shape), fp8_compute, w_gate_up_scale_layout)
    return _OPERATOR_PLANS.run(_fused_experts_launches, tensors, options)


def _fused_experts_launches(x, w_gate_up, w_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias,
                            w_gate_up_scale, w_down_scale, gate_up_input_scale, down_input_scale, activation,
                            interleaved, transposed, alpha, limit, tiles, save_preact, fp8_block_shape, fp8_compute,
                            w_gate_up_scale_layout):
    """`_fused_experts_impl` in full (tensors first, then options: what `PlanCache.run` calls)."""
    T, H = x.shape
    top_k = topk_ids.shape[1]
    E = w_down.shape[0]
    F = _ffn_size(w_down, transposed)
    axis = 2 if transposed else 1
    # An interleaved gate/up weight goes to the pointer kernels whole (PAIRED: whole tiles, split in registers); the
    # w8a8 path reads the two strided views.
    paired = interleaved and w_up is None
    separate_up = w_up is not None
    w_gate, w_up = _gate_up_views(w_gate_up, w_up, F, interleaved, axis)
    gate_bias, up_bias = _split_gate_up(gate_up_bias, F, interleaved, 1) if gate_up_bias is not None else (None, None)
    forced = tiles_from_list(tiles) if tiles is not None else None
    float_weights = w_gate_up_scale is None and w_down_scale is None and not (is_fp8(w_gate_up) or is_fp8(w_down))
    plan = plan_experts(x.device, T, top_k, E, F, H, x.dtype, forced=forced, save_preact=save_preact,
                        fp8=not float_weights, w8a8=not float_weights and fp8_compute == "w8a8", transposed=transposed,
                        mxfp4=is_mxfp4(w_gate_up))
    fp8 = Fp8Scales(kernel_scale(w_gate_up_scale), kernel_scale(w_down_scale),
                    tuple(fp8_block_shape or DEFAULT_FP8_BLOCK_SHAPE), gate_up_input_scale, down_input_scale,
                    fp8_compute, w_gate_up_scale_layout)
    if plan.path is ExpertsPath.W8A8:
        plan = plan_w8a8_engine(plan, x, w_gate_up, w_down, fp8.w_gate_up_scale, fp8.w_down_scale,
                                separate_up=separate_up, block_shape=fp8.block_shape,
                                scale_layout=fp8.gate_up_scale_layout,
                                static_input_scales=gate_up_input_scale is not None or down_input_scale is not None,
                                transposed=transposed, top_k=top_k, available=gluon_fp8.available)
    paired &= plan.path not in (ExpertsPath.W8A8, ExpertsPath.W8A8_GLUON)
    gate_up_scale, down_scale = _weight_scales(fp8, F, interleaved, transposed, paired, mxfp4=is_mxfp4(w_gate_up))
    if paired:
        w_gate, w_up, gate_bias, up_bias = w_gate_up, None, gate_up_bias, None
    if plan.path is ExpertsPath.DECODE:
        out = decode_experts(x, w_gate, w_up, w_down, topk_ids, topk_weights, plan.tiles, transposed=transposed,
                             activation=activation, gate_bias=gate_bias, up_bias=up_bias, down_bias=down_bias,
                             alpha=alpha, limit=limit, gate_up_scale=gate_up_scale, down_scale=down_scale,
                             paired=paired)
        return (out, *_no_backward_outputs(x))
    moe_tiles = plan.tiles
    info = dispatch(topk_ids, E, moe_tiles.block_m)
    preact = torch.empty((T * top_k, 2 * F), device=x.device, dtype=x.dtype) if save_preact else None
    combine_weights = None  # routing weights still to apply: the paths below apply them in their last GEMM's epilogue
    if plan.path is ExpertsPath.W8A8_GLUON:
        y, combine_weights = gluon_w8a8_experts(
            x, w_gate_up, w_down, info, fp8.w_gate_up_scale, fp8.w_down_scale, topk_weights=topk_weights,
            interleaved=interleaved, activation=activation, gate_bias=gate_bias, up_bias=up_bias, down_bias=down_bias,
            alpha=alpha, limit=limit)
    elif plan.path is ExpertsPath.W8A8:
        y = w8a8_experts(x, w_gate, w_up, w_down, info, moe_tiles, gate_up_scale, down_scale,
                         topk_weights=topk_weights, transposed=transposed, activation=activation, gate_bias=gate_bias,
                         up_bias=up_bias, down_bias=down_bias, alpha=alpha, limit=limit,
                         gate_up_input_scale=gate_up_input_scale, down_input_scale=down_input_scale)
    else:
        intermediate = expert_gemm(x, w_gate, info, moe_tiles.gate_up, weight_up=w_up, transposed=transposed,
                                   gather_a=True, activation=activation, bias=gate_bias, bias_up=up_bias,
                                   alpha=alpha, limit=limit, preact=preact,
                                   weight_scale=gate_up_scale, paired=paired)
        y = expert_gemm(intermediate, w_down, info, moe_tiles.down, transposed=transposed, bias=down_bias,
                        topk_weights=topk_weights, weight_scale=down_scale)
    out = combine(y, info.scatter_idx, T, top_k, weights=combine_weights)
    if not save_preact:
        return (out, *_no_backward_outputs(x))
    return out, preact, info.expert_offsets, info.gather_idx, info.scatter_idx


_OPERATOR_PLANS = PlanCache("fused_experts operator")
_fused_experts_op = custom_op("fused_experts")(_fused_experts_impl)
# The operator's slots in schema order, read once: the one place that knows where each input sits.
_EXPERTS_SLOTS = tuple(inspect.signature(_fused_experts_impl).parameters)


def _experts_op_args(x, w_gate_up, w_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias, spec: ExpertsSpec,
                     tiles: MoeTiles | DecodeTiles | None, save_preact: bool, fp8: Fp8Scales | None) -> tuple:
    """The experts operator's positional arguments (the one flattening of the call's objects); without `fp8` the
    float8 slots keep their defaults."""
    return (x, w_gate_up, w_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias, *spec.to_args(),
            tiles.to_list() if tiles is not None else None, save_preact, *(fp8.to_args() if fp8 is not None else ()))


def _choose_fp8_compute(choice, tiles, x, top_k, w_gate_up, w_down, scales, block_shape, transposed):
    """planner.choose_fp8_compute for this call: whether the decode path would run it with float8 weights comes
    from the planner's plan of the call."""
    T, H = x.shape
    E, F = w_down.shape[0], _ffn_size(w_down, transposed)

    def runs_decode():
        plan = plan_experts(x.device, T, top_k, E, F, H, x.dtype, forced=tiles, fp8=True)
        return plan.path is ExpertsPath.DECODE

    return choose_fp8_compute(choice, x.device, w_gate_up, w_down, [infer_scheme(s) for s in scales if s is not None],
                              block_shape, transposed, runs_decode=runs_decode)


def _no_backward_outputs(x):
    """The four outputs only the backward reads, when none will run: empty tensors (no launch, no copy)."""
    index = dict(dtype=torch.int32, device=x.device)
    return x.new_empty((0,)), torch.empty(0, **index), torch.empty(0, **index), torch.empty(0, **index)


def _weight_scales(fp8: Fp8Scales, num_ffn, interleaved, transposed, paired=False, mxfp4=False):
    """fp8.WeightScale of each GEMM (None for a float weight). The gate and up views of w_gate_up read the one scale
    tensor of the unsplit weight: view column j is row 2j (+1 for up) interleaved, j (+F for up) concatenated (+F
    rounded up to whole blocks for "merged" block scales: fp8.gate_up_row_offset). `paired`: the interleaved weight
    is read whole, column j is row j. `mxfp4`: MXFP4 weights, their scales uint8 e8m0 codes."""
    gate_up = down = None
    if mxfp4:
        # interleaved rows are read whole (paired); concatenated ones as two views, up's rows F further on
        return (mxfp4_weight_scale(fp8.w_gate_up_scale, up_row_offset=0 if paired else num_ffn),
                mxfp4_weight_scale(fp8.w_down_scale))
    if fp8.w_gate_up_scale is not None:
        scheme = infer_scheme(fp8.w_gate_up_scale)
        if paired:
            row_step, up_row_offset = 1, 0
        elif interleaved:
            row_step, up_row_offset = 2, 1
        else:
            row_step, up_row_offset = 1, gate_up_row_offset(num_ffn, scheme, fp8.block_shape, transposed=transposed,
                                                            layout=fp8.gate_up_scale_layout)
        gate_up = WeightScale.of(fp8.w_gate_up_scale, scheme, fp8.block_shape, transposed=transposed,
                                 row_step=row_step, up_row_offset=up_row_offset)
    if fp8.w_down_scale is not None:
        down = WeightScale.of(fp8.w_down_scale, infer_scheme(fp8.w_down_scale), fp8.block_shape,
                              transposed=transposed)
    return gate_up, down


@_fused_experts_op.register_fake
def _(*args, **kwargs):
    a = dict(zip(_EXPERTS_SLOTS, args), **kwargs)
    x, topk_ids, w_down = a["x"], a["topk_ids"], a["w_down"]
    T, H = x.shape
    if not a["save_preact"]:
        return (x.new_empty((T, H)), *_no_backward_outputs(x))
    N = T * topk_ids.shape[1]
    F = _ffn_size(w_down, a["transposed"])
    index = dict(dtype=torch.int32, device=x.device)
    return (x.new_empty((T, H)), x.new_empty((N, 2 * F)), torch.empty(w_down.shape[0] + 1, **index),
            torch.empty(N, **index), torch.empty(N, **index))


# Gradient slots of `_fused_experts_backward_op`: the experts operator's inputs that can have one.
_GRAD_INPUTS = ("x", "w_gate_up", "w_up", "w_down", "topk_weights", "gate_up_bias", "down_bias")
_GRAD_SLOTS = tuple(_EXPERTS_SLOTS.index(name) for name in _GRAD_INPUTS)


@custom_op("fused_experts_backward")
def _fused_experts_backward_op(
    grad_out: torch.Tensor, x: torch.Tensor, w_gate_up: torch.Tensor, w_up: torch.Tensor | None, w_down: torch.Tensor,
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None, preact: torch.Tensor, expert_offsets: torch.Tensor, gather_idx: torch.Tensor,
    scatter_idx: torch.Tensor, activation: str, interleaved: bool, transposed: bool, alpha: float, limit: float,
    needs: list[bool], w_gate_up_scale: torch.Tensor | None = None, w_down_scale: torch.Tensor | None = None,
    fp8_block_shape: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for the inputs named in `_GRAD_INPUTS` where `needs` says so; an empty [0] tensor elsewhere. The
    operator reads `preact` only (`_experts_grads` with reuse_preact=False). Quantized (frozen) weights come with
    their scales and get no gradient."""
    return _experts_grads(grad_out, x, w_gate_up, w_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias, preact,
                          expert_offsets, gather_idx, scatter_idx, activation, interleaved, transposed, alpha, limit,
                          needs, w_gate_up_scale, w_down_scale, fp8_block_shape, reuse_preact=False)


@call_scope  # run by autograd after the forward's call returned: the backward reads the switches once for itself
def _experts_grads(grad_out, x, w_gate_up, w_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias, preact,
                   expert_offsets, gather_idx, scatter_idx, activation, interleaved, transposed, alpha, limit, needs,
                   w_gate_up_scale=None, w_down_scale=None, fp8_block_shape=None, *, reuse_preact):
    """The backward operator's work; `reuse_preact` lets the backward write d_preact over `preact`
    (backward/experts.py), which only a caller that never reads `preact` again may ask for (`_may_reuse_preact`).
    Planned per signature (`host/replay.py`): every training step repeats the same launches."""
    tensors = (grad_out, x, w_gate_up, w_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias, preact,
               expert_offsets, gather_idx, scatter_idx, w_gate_up_scale, w_down_scale)
    options = (activation, interleaved, transposed, alpha, limit, tuple(bool(need) for need in needs), reuse_preact,
               None if fp8_block_shape is None else tuple(fp8_block_shape))
    return _BACKWARD_PLANS.run(_experts_grads_launches, tensors, options)


_BACKWARD_PLANS = PlanCache("fused_experts backward")


def _experts_grads_launches(grad_out, x, w_gate_up, w_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias,
                            preact, expert_offsets, gather_idx, scatter_idx, w_gate_up_scale, w_down_scale, activation,
                            interleaved, transposed, alpha, limit, needs, reuse_preact, fp8_block_shape):
    """`_experts_grads` in full (tensors first, then options)."""
    gate_up_scale, down_scale = _backward_weight_scales(w_gate_up, w_down, kernel_scale(w_gate_up_scale),
                                                        kernel_scale(w_down_scale), fp8_block_shape, transposed)
    needs = _needed(x, w_gate_up, w_up, w_down, topk_weights, gate_up_bias, down_bias, needs)
    grads = _allocate_grads(x, w_gate_up, w_up, w_down, topk_weights, gate_up_bias, down_bias, needs)
    experts_backward(
        grad_out, x, w_gate_up, w_up, w_down, topk_ids, topk_weights, down_bias, preact, expert_offsets,
        gather_idx, scatter_idx,
        ExpertsGrads(*(g if need else None for g, need in zip(grads, needs))),
        activation=activation, transposed=transposed, interleaved=interleaved, alpha=alpha, limit=limit,
        reuse_preact=reuse_preact, gate_up_scale=gate_up_scale, down_scale=down_scale)
    return grads


def _backward_weight_scales(w_gate_up, w_down, w_gate_up_scale, w_down_scale, block_shape, transposed):
    """fp8.WeightScale of each quantized weight as the backward's GEMMs read it (dX: the whole gate/up weight with K
    along its 2F rows; dA: the down weight with K along H): the forward's [E, n, K] read the other way round, so
    block scales swap their sides, a per-channel scale becomes a per-K-column one (a block scale of 1 x all rows) and
    MXFP4 is read along its packed axis (WeightScaleCode.MXFP4_N). None for float weights."""
    scales = []
    for weight, scale in ((w_gate_up, w_gate_up_scale), (w_down, w_down_scale)):
        if scale is None:
            scales.append(None)
        elif is_mxfp4(weight):
            stride_e, stride_row, stride_group = scale.stride()
            scales.append(WeightScale(scale, WeightScaleCode.MXFP4_N, (stride_e, stride_group, stride_row), 1,
                                      MXFP4_GROUP))
        elif infer_scheme(scale) == "channel":
            scales.append(WeightScale(scale, WeightScaleCode.BLOCK, (scale.stride(0), 0, scale.stride(1))))
        else:
            scales.append(WeightScale.of(scale, infer_scheme(scale), tuple(block_shape or DEFAULT_FP8_BLOCK_SHAPE),
                                         transposed=not transposed))
    return tuple(scales)


def _needed(*inputs_and_needs):
    """`needs` with the slots of absent (None) inputs switched off."""
    *inputs, needs = inputs_and_needs
    return [bool(need) and t is not None for t, need in zip(inputs, needs)]


def _allocate_grads(x, w_gate_up, w_up, w_down, topk_weights, gate_up_bias, down_bias, needs):
    like = (x, w_gate_up, w_up, w_down, topk_weights, gate_up_bias, down_bias)
    needs = _needed(*like, needs)
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) if need else x.new_empty((0,))
                 for t, need in zip(like, needs))


@_fused_experts_backward_op.register_fake
def _(grad_out, x, w_gate_up, w_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias, preact, expert_offsets,
      gather_idx, scatter_idx, activation, interleaved, transposed, alpha, limit, needs, w_gate_up_scale=None,
      w_down_scale=None, fp8_block_shape=None):
    return _allocate_grads(x, w_gate_up, w_up, w_down, topk_weights, gate_up_bias, down_bias, needs)


_SAVED = ("x", "w_gate_up", "w_up", "w_down", "topk_ids", "topk_weights", "gate_up_bias", "down_bias")
_SAVED_SCALES = ("w_gate_up_scale", "w_down_scale")  # saved after the forward's outputs (None for float weights)


def _fused_experts_setup_context(ctx, inputs, output):
    a = dict(zip(_EXPERTS_SLOTS, inputs))
    _, preact, expert_offsets, gather_idx, scatter_idx = output
    ctx.save_for_backward(*(a[name] for name in _SAVED), preact, expert_offsets, gather_idx, scatter_idx,
                          *(a[name] for name in _SAVED_SCALES))
    ctx.fp8_block_shape = a["fp8_block_shape"]
    ctx.spec = ExpertsSpec(a["activation"], a["interleaved"], a["transposed"], a["alpha"], a["limit"])
    ctx.save_preact = a["save_preact"]


def _fused_experts_backward(ctx, grad_out, *_):
    if not ctx.save_preact:
        raise RuntimeError("fused_experts ran without saving its pre-activations (no input required grad at the time); "
                           "cannot backward through it")
    needs = [bool(ctx.needs_input_grad[i]) for i in _GRAD_SLOTS]
    saved = ctx.saved_tensors
    args = (grad_out, *saved[:-len(_SAVED_SCALES)], *ctx.spec.to_args(), needs, *saved[-len(_SAVED_SCALES):],
            ctx.fp8_block_shape)
    if getattr(ctx, "preact_private", False) and _may_reuse_preact(args):
        grads = _experts_grads(*args, reuse_preact=True)
    else:
        grads = _fused_experts_backward_op(*args)
    by_slot = {slot: g if need else None for slot, g, need in zip(_GRAD_SLOTS, grads, needs)}
    return tuple(by_slot.get(slot) for slot in range(len(_EXPERTS_SLOTS)))  # None for every other input


def _may_reuse_preact(args) -> bool:
    """Whether this backward may write the pre-activations' gradient over the saved pre-activations (one [N, 2F]
    buffer fewer at the backward's peak): only where nothing can read them again, i.e. a call of `fused_experts`,
    which hands the operator's `preact` output to no one (`_mark_preact_private`), run eagerly (not traced by
    torch.compile), on plain tensors (the operator would be needed otherwise), with a backward that frees the graph
    after it (no retain_graph, no create_graph: autograd then drops the saved tensors). Anywhere else the backward
    operator runs, which only reads them."""
    if torch.compiler.is_compiling() or needs_operator(args):
        return False
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return keep_graph is not None and not keep_graph()


_fused_experts_op.register_autograd(_fused_experts_backward, setup_context=_fused_experts_setup_context)


def _run_experts(x, w_gate_up, w_up, w_down, topk_ids, topk_weights, gate_up_bias=None, down_bias=None, *,
                 spec: ExpertsSpec = ExpertsSpec(), tiles: MoeTiles | DecodeTiles | None = None,
                 fp8: Fp8Scales | None = None):
    """The experts operator on validated 2-D x; saves the pre-activations only when a gradient will be needed.

    Quantized weights (float8 or MXFP4; `fp8` their scales, its `compute` resolved by planner.choose_fp8_compute)
    are frozen: they and their scales are detached (a weight or a scale that requires grad is warned about once),
    and on the dequant path the other inputs (hidden_states, routing weights, biases) get their gradients, those of
    the experts with the dequantized weights. The w8a8 path is forward only: every input is detached (warned once)."""
    quantized = is_fp8(w_gate_up) or is_fp8(w_down) or is_mxfp4(w_gate_up)
    if quantized:
        scales = {name: getattr(fp8, name) for name in _SCALES} if fp8 is not None else {}
        fp8 = (fp8 or Fp8Scales(None, None)).detached()
        if fp8.compute == "w8a8":
            warn_if_gradient_cut("fused_experts with fp8_compute='w8a8'", hidden_states=x, topk_weights=topk_weights,
                                 gate_up_bias=gate_up_bias, down_bias=down_bias)
            x, topk_weights, gate_up_bias, down_bias = (t.detach() if t is not None else None
                                                        for t in (x, topk_weights, gate_up_bias, down_bias))
        frozen = {name: w for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)) if is_fp8(w) or is_mxfp4(w)}
        # their scales are frozen with them (transformers keeps `*_scale_inv` as Parameters that require grad)
        warn_if_gradient_cut("fused_experts with quantized (float8 or MXFP4) weights (frozen)", **frozen, **scales)
        w_gate_up, w_down = (w.detach() if name in frozen else w for name, w in (("w_gate_up", w_gate_up),
                                                                              ("w_down", w_down)))
    else:
        fp8 = None
    inputs = (x, w_gate_up, w_up, w_down, topk_weights, gate_up_bias, down_bias)
    save_preact = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    args = _experts_op_args(x, w_gate_up, w_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias, spec, tiles,
                            save_preact, fp8)
    out = call(_fused_experts_op, *args)[0]
    if save_preact and not torch.compiler.is_compiling():
        _mark_preact_private(out)
    return out


def _mark_preact_private(out):
    """Tell the backward of the operator call that made `out` that its saved pre-activations belong to this call
    alone (the caller gets `out` only), so that it may write over them (`_may_reuse_preact`). The mark sits on the
    autograd node, which for an operator with a registered autograd is the context its backward receives; a node of
    any other kind is left unmarked (the backward then only reads them)."""
    node = out.grad_fn
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        node.preact_private = True


def check_experts_args(hidden_states, w_gate_up, w_down, topk_ids, topk_weights, *, activation, gate_up_bias,
                       down_bias, transposed, suffix="", w_gate_up_scale=None, w_down_scale=None,
                       fp8_block_shape=DEFAULT_FP8_BLOCK_SHAPE, gate_up_input_scale=None, down_input_scale=None,
                       interleaved=False, w_gate_up_scale_layout="fused"):
    """Shape, dtype and device checks of `fused_experts`' arguments (host only, no value read) -> (T, H, E, F).

    `suffix` is appended to the weight and bias names in messages (expert parallelism: "_local"). float8 weights
    need their scales (see fp8.check_fp8_weight; w_gate_up's in `w_gate_up_scale_layout`); float weights match
    hidden_states' dtype; static input scales go with float8 weights (fp8.check_input_scale).
    """
    w_gate_up_name, w_down_name = "w_gate_up" + suffix, "w_down" + suffix
    gate_up_bias_name, down_bias_name = "gate_up_bias" + suffix, "down_bias" + suffix
    check_float("hidden_states", hidden_states, min_ndim=1)
    mxfp4 = is_mxfp4(w_gate_up) or is_mxfp4(w_down)
    for name, w in ((w_gate_up_name, w_gate_up), (w_down_name, w_down)):
        check_tensor(name, w, ndim=None if mxfp4 else 3)
        if not is_fp8(w) and not mxfp4:
            check_float(name, w)
    check_index("topk_ids", topk_ids, ndim=2)
    check_tensor("topk_weights", topk_weights, ndim=2, dtypes=ROUTING_WEIGHT_DTYPES)
    check_choice("activation", activation, EXPERT_ACTIVATIONS)
    H = hidden_states.shape[-1]
    if mxfp4:
        E, F = _check_mxfp4_experts(w_gate_up, w_down, w_gate_up_scale, w_down_scale, H, transposed=transposed,
                                    suffix=suffix, input_scales=(gate_up_input_scale, down_input_scale))
    else:
        E = w_gate_up.shape[0]
        h_axis, f_axis = (1, 2) if transposed else (2, 1)
        layout = "[E, H, 2F]" if transposed else "[E, 2F, H]"
        check_dim(w_gate_up_name, w_gate_up, h_axis, H, f"hidden size H of hidden_states, layout {layout}")
        if w_gate_up.shape[f_axis] % 2:
            raise ValueError(f"{w_gate_up_name} dimension {f_axis} (2F, layout {layout}) must be even, "
                             f"got {w_gate_up.shape[f_axis]}")
        F = w_gate_up.shape[f_axis] // 2
        check_dim(w_down_name, w_down, 0, E, f"number of experts E of {w_gate_up_name}")
        down_h_axis, down_f_axis = (2, 1) if transposed else (1, 2)
        check_dim(w_down_name, w_down, down_h_axis, H, "hidden size H")
        _check_gate_up_rows(w_gate_up_name, 2 * F, f"dimension {f_axis} (layout {layout})", w_down_name,
                            w_down.shape[down_f_axis], f"dimension {down_f_axis}")
    T = hidden_states.shape[:-1].numel()
    check_dim("topk_ids", topk_ids, 0, T, "number of tokens T")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights has shape {tuple(topk_weights.shape)} but topk_ids has {tuple(topk_ids.shape)}")
    if topk_ids.shape[1] < 1:
        raise ValueError("topk_ids must have at least one column (top_k >= 1)")
    for name, bias, size in ((gate_up_bias_name, gate_up_bias, 2 * F), (down_bias_name, down_bias, H)):
        if bias is not None:
            check_float(name, bias, ndim=2)
            check_dim(name, bias, 0, E, "number of experts E")
            check_dim(name, bias, 1, size, "output size of the projection")
    for name, w in ((w_gate_up_name, w_gate_up), (w_down_name, w_down), (gate_up_bias_name, gate_up_bias),
                    (down_bias_name, down_bias)):
        if not is_fp8(w) and not is_mxfp4(w):
            _check_weight_dtype(name, w, hidden_states.dtype)
    check_gate_up_scale_layout(w_gate_up_scale_layout, interleaved, w_gate_up_scale)
    if not mxfp4 and (is_fp8(w_gate_up) or is_fp8(w_down) or w_gate_up_scale is not None
                      or w_down_scale is not None):
        block_shape = check_block_shape(fp8_block_shape)
        check_fp8_weight(w_gate_up_name, w_gate_up, "w_gate_up_scale" + suffix, w_gate_up_scale, block_shape,
                         n_axis=f_axis, gate_up_layout=w_gate_up_scale_layout)
        check_fp8_weight(w_down_name, w_down, "w_down_scale" + suffix, w_down_scale, block_shape, n_axis=down_h_axis)
        for name, w in ((w_gate_up_name, w_gate_up), (w_down_name, w_down)):
            check_fp8_dtype_on_device(name, w, hidden_states.device)
    check_input_scale("gate_up_input_scale", gate_up_input_scale, w_gate_up_name, w_gate_up, E)
    check_input_scale("down_input_scale", down_input_scale, w_down_name, w_down, E)
    check_same_device(hidden_states=hidden_states, **{w_gate_up_name: w_gate_up, w_down_name: w_down},
                      topk_ids=topk_ids, topk_weights=topk_weights,
                      **{gate_up_bias_name: gate_up_bias, down_bias_name: down_bias,
                         "w_gate_up_scale" + suffix: w_gate_up_scale, "w_down_scale" + suffix: w_down_scale},
                      gate_up_input_scale=gate_up_input_scale, down_input_scale=down_input_scale)
    check_kernel_device("hidden_states", hidden_states)
    return T, H, E, F


def _check_gate_up_rows(w_gate_up_name, two_f, where, w_down_name, num_ffn, down_where):
    """w_gate_up's 2F rows (gate and up) are twice the F of w_down: a gate/up weight holding only F rows (gate alone)
    is w_gate_up's fault, not w_down's, and the message says so first."""
    if two_f != 2 * num_ffn:
        raise ValueError(f"{w_gate_up_name} has {two_f} in {where} but must hold 2F = {2 * num_ffn} there (gate and "
                         f"up, for the F = {num_ffn} of {w_down_name}'s {down_where}); a gate-only weight has F")


def check_experts_options(*, activation, interleaved, transposed, swiglu_alpha, swiglu_limit, validate,
                          validate_ids=None, tiles=None, fp8_block_shape=DEFAULT_FP8_BLOCK_SHAPE, fp8_compute="auto",
                          w_gate_up_scale_layout="fused"):
    """The non-tensor options of `fused_experts` (and of `ep_fused_experts`, under the same names), checked by kind
    before anything else runs, a plan lookup included (host/checks.py): a TypeError or ValueError naming the option."""
    check_choice("activation", activation, EXPERT_ACTIVATIONS)
    check_bool("interleaved", interleaved)
    check_bool("transposed", transposed)
    check_real("swiglu_alpha", swiglu_alpha)
    check_real("swiglu_limit", swiglu_limit, minimum=0)
    check_bool("validate", validate, none=True)
    check_bool("validate_ids", validate_ids, none=True)
    check_forced_tiles("tiles", tiles)
    check_block_shape(fp8_block_shape)
    check_choice("fp8_compute", fp8_compute, FP8_COMPUTE)
    check_choice("w_gate_up_scale_layout", w_gate_up_scale_layout, GATE_UP_SCALE_LAYOUTS)


def _check_mxfp4_experts(w_gate_up, w_down, w_gate_up_scale, w_down_scale, H, *, transposed, suffix, input_scales):
    """MXFP4 expert weights (formats/mxfp4.py: uint8 blocks with e8m0 scales, as checkpoints store them) -> (E, F): both
    weights MXFP4, [E, 2F, H] and [E, H, F] unpacked, not transposed, no static input scales."""
    w_gate_up_name, w_down_name = "w_gate_up" + suffix, "w_down" + suffix
    for name, w, other in ((w_gate_up_name, w_gate_up, w_down_name), (w_down_name, w_down, w_gate_up_name)):
        if not is_mxfp4(w):
            raise TypeError(f"{other} holds MXFP4 blocks (uint8) but {name} has dtype "
                            f"{str(w.dtype).replace('torch.', '')}; both expert weights must be MXFP4")
    if transposed:
        raise ValueError("MXFP4 weights are [E, N, K] with K packed last, as checkpoints store them; transposed=True "
                         "is not supported for them")
    if any(scale is not None for scale in input_scales):
        raise ValueError("gate_up_input_scale / down_input_scale are static activation scales of float8 weights; "
                         "MXFP4 weights take none (the activations stay in hidden_states' dtype)")
    check_mxfp4_weight(w_gate_up_name, w_gate_up, "w_gate_up_scale" + suffix, w_gate_up_scale, k=H,
                       k_source="hidden_states has H")
    E, two_f = w_gate_up.shape[:2]
    if two_f % 2:
        raise ValueError(f"{w_gate_up_name} has {two_f} rows per expert (2F: gate and up) but that must be even")
    F = two_f // 2
    check_mxfp4_weight(w_down_name, w_down, "w_down_scale" + suffix, w_down_scale, num_experts=E, rows=H,
                       rows_source="hidden_states has H")
    _check_gate_up_rows(w_gate_up_name, two_f, "dimension 1 (rows per expert)", w_down_name, mxfp4_k(w_down),
                        "values per row (K)")
    return E, F


@call_scope
def fused_experts(hidden_states: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, *, activation: Literal["silu", "swiglu_oai"] = "silu",
                  gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                  interleaved: bool = False, transposed: bool = False, swiglu_alpha: float = 1.702,
                  swiglu_limit: float = 7.0, validate: bool | None = None, validate_ids: bool | None = None,
                  tiles: MoeTiles | DecodeTiles | None = None, w_gate_up_scale: torch.Tensor | None = None,
                  w_down_scale: torch.Tensor | None = None,
                  fp8_block_shape: tuple[int, int] | list[int] = DEFAULT_FP8_BLOCK_SHAPE,
                  gate_up_input_scale: torch.Tensor | None = None, down_input_scale: torch.Tensor | None = None,
                  fp8_compute: Literal["auto", "w8a8", "dequant"] = "auto",
                  w_gate_up_scale_layout: Literal["fused", "merged"] = "fused",
                  quant: ExpertsQuant | None = None) -> torch.Tensor:
    """Experts path for callers with their own router: out[t] = sum_j topk_weights[t, j] * expert_{ids[t, j]}(x_t).

    hidden_states [..., H]; w_gate_up [E, 2F, H] (gate rows then up rows, the transformers layout) and w_down [E, H, F];
    with `transposed`, [E, H, 2F] and [E, F, H] (GPT-OSS); with `interleaved`, gate and up alternate along 2F (gate
    first). expert(x) = down(act(gate_up(x) + gate_up_bias)) + down_bias with act "silu" (silu(gate) * up) or
    "swiglu_oai" (GPT-OSS: gate clamped above at limit, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)).
    topk_ids [T, k] int32/int64; topk_weights [T, k] any float dtype (applied in fp32).
    Ids outside [0, E) contribute nothing. Checking for them costs a device-to-host sync, so `validate=None` raises
    only when the ids are on the CPU; True always checks, False never (expert-parallel sentinels). `validate_ids` is
    the deprecated v1.0 spelling of `validate`.
    `tiles` forces a tile configuration (tuning and tests): a `tiles.MoeTiles` the four-launch path (dispatch, two
    grouped GEMMs, combine), a `tiles.DecodeTiles` the two-launch decode path (gemm/decode.py) wherever that applies (no
    gradient needed, fp8_compute not "w8a8", T * top_k <= tiles.MAX_DECODE_ASSIGNMENTS = 256; elsewhere the tables' tiles
    run); by default the device's tile table chooses. Returns out [..., H] in hidden_states' dtype.

    Differentiable in hidden_states, w_gate_up, w_down, topk_weights and both biases (Triton backward, see
    backward/experts.py; only the gradients asked for are computed); ids outside [0, E) get no gradient. When a
    gradient will be needed the forward also saves the [T * top_k, 2F] pre-activations (input dtype).

    FP8 expert weights (v1.x addition, forward only; see formats/fp8.py and docs/usage.md, "FP8 expert weights"):
    w_gate_up and/or w_down in float8_e4m3fn / float8_e4m3fnuz with fp32 (or float8_e8m0fnu: powers of two) scales
    `w_gate_up_scale` / `w_down_scale` (w ≈ w_fp8 * scale), the scheme read from the scale's shape: [E, ceil(d1/b1),
    ceil(d2/b2)] block scales over the weight as stored ([E, d1, d2]) with `fp8_block_shape` (b1, b2); [E, N] per
    output channel (N = 2F for w_gate_up, H for w_down); [E] per tensor. hidden_states and the output stay
    bf16/fp16/fp32. Quantized weights are frozen: they get no gradient (a warning says so once when one requires
    grad), while hidden_states, topk_weights and the biases get the gradients of the experts with the dequantized
    weights (fine-tuning around frozen quantized experts); "auto" then takes "dequant", and a forced "w8a8" is
    forward only (its output carries no gradient, warned once).
    `w_gate_up_scale_layout` says how w_gate_up_scale's block scales cover the 2F rows (the layouts differ where F is
    not a multiple of the block's N side b, and are never guessed from shapes): "fused" (default) ceil(2F/b) blocks over
    the rows as stored; "merged" gate's ceil(F/b) blocks, then up's, each over its own F rows (a checkpoint's separate
    gate and up scales stacked, as transformers' FP8Experts holds them; concatenated gate/up rows only). Channel and
    tensor scales read alike in both. A scale whose shape does not match the declared layout raises ValueError.
    `fp8_compute` picks how they are computed (formats/fp8.py): "w8a8" quantizes the activations to e4m3 too and runs
    FP8 tensor-core dots (activations per token and K step of 128 columns, amax / 448, dynamically; the intermediate
    quantized in GEMM1's epilogue), "dequant" converts the weights to the activation dtype in the loads; "auto"
    (default) takes "w8a8" on NVIDIA GPUs with FP8 tensor cores (SM89+) for float8_e4m3fn weights whose block K side
    is a power of two >= 32, and "dequant" elsewhere. Forcing "w8a8" where it cannot run raises ValueError.
    `gate_up_input_scale` / `down_input_scale`: static activation scales of the checkpoint (x ≈ x_fp8 * scale for
    hidden_states and for the intermediate), fp32 of shape [] or [1] (per tensor) or [E] (per expert), used by
    "w8a8" instead of the dynamic scales (values beyond 448 * scale saturate); "dequant" does not quantize
    activations and ignores them.

    `quant` (since 1.1.0): the weights' quantization as one `ExpertsQuant` (formats/quant.py), e.g.
    `ExpertsQuant.fp8(w_gate_up_scale, w_down_scale, block_shape=(128, 128))` or `ExpertsQuant.mxfp4(w_gate_up_scale,
    w_down_scale)`, in place of the seven keywords above and below (passing both is a TypeError); its format is
    declared and checked against the weights' dtypes.

    MXFP4 expert weights (v1.x addition; formats/mxfp4.py): w_gate_up and w_down as uint8 blocks, as GPT-OSS checkpoints
    store them ([E, 2F, H/32, 16] and [E, H, F/32, 16], or those bytes as [E, 2F, H/2] and [E, H, F/2]: two e2m1
    values per byte, low nibble first), with their e8m0 scales `w_gate_up_scale` [E, 2F, H/32] and `w_down_scale`
    [E, H, F/32] (uint8 or float8_e8m0fnu); not transposed; interleaved or concatenated gate/up rows. They are
    dequantized in the loads and dotted in hidden_states' dtype ("dequant"; "w8a8" raises); frozen like float8
    weights above.

    Eager inference calls are planned (`host/replay.py`): the first call of an input signature runs in full and is
    recorded, later ones replay its launches through Triton's compiled launcher (same results, a fraction of the host
    time).

    Every option is checked before anything runs (`check_experts_options`): a bool is True or False (the string
    "False" is refused, not taken as true), a number a real number, a choice one of its strings, forced tiles what the
    kernels take; the environment switches are read once per call (host/device.py: `call_scope`).
    """
    if quant is not None:  # the one quantization object, in the v1 keywords the experts path reads
        (w_gate_up_scale, w_down_scale, fp8_block_shape, gate_up_input_scale, down_input_scale, fp8_compute,
         w_gate_up_scale_layout) = resolve_quant(quant, w_gate_up, w_down, dict(
             w_gate_up_scale=w_gate_up_scale, w_down_scale=w_down_scale, fp8_block_shape=fp8_block_shape,
             gate_up_input_scale=gate_up_input_scale, down_input_scale=down_input_scale, fp8_compute=fp8_compute,
             w_gate_up_scale_layout=w_gate_up_scale_layout)).values()
    check_experts_options(activation=activation, interleaved=interleaved, transposed=transposed,
                          swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit, validate=validate,
                          validate_ids=validate_ids, tiles=tiles, fp8_block_shape=fp8_block_shape,
                          fp8_compute=fp8_compute, w_gate_up_scale_layout=w_gate_up_scale_layout)
    tensors = (hidden_states, w_gate_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias, w_gate_up_scale,
               w_down_scale, gate_up_input_scale, down_input_scale)
    options = (activation, interleaved, transposed, swiglu_alpha, swiglu_limit, validate, validate_ids, tiles,
               tuple(fp8_block_shape) if type(fp8_block_shape) is list else fp8_block_shape, fp8_compute,
               w_gate_up_scale_layout)
    if torch.compiler.is_compiling() or not _checks_read_no_values(validate, validate_ids, topk_ids):
        out = _fused_experts_full(*tensors, *options)
    else:
        out = _FUSED_EXPERTS_PLANS.run(_fused_experts_full, tensors, options)
    return out if out.dim() == hidden_states.dim() else out.reshape(hidden_states.shape)


_FUSED_EXPERTS_PLANS = PlanCache("fused_experts")


def _checks_read_no_values(validate, validate_ids, topk_ids) -> bool:
    """Whether a call's checks read only shapes, dtypes and devices (what a plan's key holds), so that a replay may
    skip them: validate False, or None with ids on a GPU; the deprecated `validate_ids` always runs in full."""
    if validate_ids is not None or validate is True:
        return False
    return validate is False or (validate is None and isinstance(topk_ids, torch.Tensor)
                                 and topk_ids.device.type != "cpu")


def _fused_experts_full(hidden_states, w_gate_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias,
                        w_gate_up_scale, w_down_scale, gate_up_input_scale, down_input_scale, activation,
                        interleaved, transposed, swiglu_alpha, swiglu_limit, validate, validate_ids, tiles,
                        fp8_block_shape, fp8_compute, w_gate_up_scale_layout):
    """`fused_experts` in full: checks, the choice of path and tiles, the launches. Returns out [T, H]."""
    T, H, E, _ = check_experts_args(hidden_states, w_gate_up, w_down, topk_ids, topk_weights, activation=activation,
                                    gate_up_bias=gate_up_bias, down_bias=down_bias, transposed=transposed,
                                    w_gate_up_scale=w_gate_up_scale, w_down_scale=w_down_scale,
                                    fp8_block_shape=fp8_block_shape, gate_up_input_scale=gate_up_input_scale,
                                    down_input_scale=down_input_scale, interleaved=interleaved,
                                    w_gate_up_scale_layout=w_gate_up_scale_layout)
    validate = validate_option(validate, validate_ids, "fused_experts")
    check_ids_in_range("topk_ids", topk_ids, E, validate)
    x = hidden_states.reshape(T, H)
    if is_mxfp4(w_gate_up):  # the [E, N, K / 2] byte views and uint8 scale codes the kernels read (no copy)
        if fp8_compute == "w8a8":
            raise ValueError("fp8_compute='w8a8' cannot run MXFP4 weights: they are dequantized in the loads "
                             "(fp8_compute 'auto' or 'dequant')")
        check_choice("fp8_compute", fp8_compute, ("auto", "dequant"))
        w_gate_up, w_gate_up_scale = check_mxfp4_weight("w_gate_up", w_gate_up, "w_gate_up_scale", w_gate_up_scale)
        w_down, w_down_scale = check_mxfp4_weight("w_down", w_down, "w_down_scale", w_down_scale)
        fp8_compute = "dequant"
        if mxfp4_dequantizes_first(T, topk_ids.shape[1], E, 2 * w_down.shape[2], H, x.dtype,
                                   forced_tiles=tiles is not None,
                                   grad=_needs_grad(hidden_states, topk_weights, gate_up_bias, down_bias)):
            w_gate_up = dequantize_mxfp4_experts(w_gate_up, w_gate_up_scale, x.dtype)
            w_down = dequantize_mxfp4_experts(w_down, w_down_scale, x.dtype)
            w_gate_up_scale = w_down_scale = None
    if _needs_grad(hidden_states, topk_weights, gate_up_bias, down_bias):
        # gradients through frozen quantized weights: the dequant path (the w8a8 path is forward only)
        fp8_compute = "dequant" if fp8_compute == "auto" else fp8_compute
        if (w_gate_up_scale_layout == "merged" and w_gate_up_scale is not None and w_gate_up_scale.dim() == 3
                and (w_gate_up.shape[2 if transposed else 1] // 2) % fp8_block_shape[0 if not transposed else 1]):
            raise ValueError("w_gate_up_scale_layout='merged' with F not a multiple of the block's N side has no "
                             "backward: run it without gradients, or pass the scales of the fused weight")
    fp8_compute = _choose_fp8_compute(fp8_compute, tiles, x, topk_ids.shape[1], w_gate_up, w_down,
                                      (w_gate_up_scale, w_down_scale), tuple(fp8_block_shape), transposed)
    for name, scale in (("gate_up_input_scale", gate_up_input_scale), ("down_input_scale", down_input_scale)):
        if scale is not None and reads_values(validate, scale):
            raise_problems(input_scale_problems(name, scale))

    spec = ExpertsSpec(activation, interleaved, transposed, swiglu_alpha, swiglu_limit)
    fp8 = Fp8Scales(w_gate_up_scale, w_down_scale, tuple(fp8_block_shape), gate_up_input_scale, down_input_scale,
                    fp8_compute, w_gate_up_scale_layout)
    return _run_experts(x, w_gate_up, None, w_down, topk_ids, topk_weights, gate_up_bias, down_bias, spec=spec,
                        tiles=tiles, fp8=fp8)


def _needs_grad(*tensors):
    """Whether autograd will ask for gradients of any of `tensors` (None ones skipped)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _check_expert_weights(w_gate, w_up, w_down, num_experts, hidden, dtype):
    """Seed layout: w_gate, w_up [E, F, H]; w_down [E, H, F]. Returns F."""
    check_float("w_gate", w_gate, ndim=3)
    check_float("w_up", w_up, ndim=3)
    check_float("w_down", w_down, ndim=3)
    check_dim("w_gate", w_gate, 0, num_experts, "num_experts")
    check_dim("w_gate", w_gate, 2, hidden, "hidden size H")
    if w_up.shape != w_gate.shape:
        raise ValueError(f"w_up has shape {tuple(w_up.shape)} but w_gate has {tuple(w_gate.shape)}")
    F = w_gate.shape[1]
    check_dim("w_down", w_down, 0, num_experts, "num_experts")
    check_dim("w_down", w_down, 1, hidden, "hidden size H")
    check_dim("w_down", w_down, 2, F, "ffn size F of w_gate")
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        _check_weight_dtype(name, w, dtype)
    return F


@call_scope
def fused_moe_forward(hidden_states: torch.Tensor, router_weight: torch.Tensor, w_gate: torch.Tensor,
                      w_up: torch.Tensor, w_down: torch.Tensor, num_experts: int, top_k: int,
                      gating: Literal["softmax", "sigmoid"] = "softmax", *, renormalize: bool | None = None,
                      router_bias: torch.Tensor | None = None, n_group: int | None = None,
                      topk_group: int | None = None, e_score_correction_bias: torch.Tensor | None = None,
                      routed_scaling_factor: float = 1.0, capacity_factor: float | None = None,
                      tiles: MoeTiles | DecodeTiles | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Whole MoE layer (v1 API): route, then run the experts.

    hidden_states [..., H], router_weight [E, H], w_gate and w_up [E, F, H], w_down [E, H, F]. Routing semantics are
    those of `moe_router`. With `capacity_factor`, each expert takes at most C = int(capacity_factor * T * top_k / E)
    assignments, the earliest in order t * top_k + j (MegaBlocks' rule; C = 0 drops nothing, as MegaBlocks falls back
    to the largest count); dropped assignments contribute nothing to `out` but are still reported in the returned ids
    and weights (`binned.capacity_keep_mask` tells which were kept). Returns (out [..., H] in the input dtype,
    top_k_indices [T, top_k] int64, top_k_weights [T, top_k] in the input dtype) with T the product of the leading dims.
    Differentiable in hidden_states, router_weight, router_bias and the three expert weights (see `fused_experts`; the
    routing weights' gradient flows through the softmax / sigmoid, the top-k choice is not differentiated).
    """
    check_int("num_experts", num_experts, 1)
    check_router_options(top_k, gating, renormalize, n_group, topk_group, routed_scaling_factor)
    check_real("capacity_factor", capacity_factor, none=True, minimum=0)
    check_forced_tiles("tiles", tiles)
    tensors = (hidden_states, router_weight, w_gate, w_up, w_down, router_bias, e_score_correction_bias)
    options = (num_experts, top_k, gating, renormalize, n_group, topk_group, routed_scaling_factor, capacity_factor,
               tiles)
    if torch.compiler.is_compiling():
        out, topk_ids, topk_weights = _fused_moe_forward_full(*tensors, *options)
    else:
        out, topk_ids, topk_weights = _FUSED_MOE_PLANS.run(_fused_moe_forward_full, tensors, options)
    return out.reshape(hidden_states.shape), topk_ids, topk_weights.to(hidden_states.dtype)


_FUSED_MOE_PLANS = PlanCache("fused_moe_forward")


def _fused_moe_forward_full(hidden_states, router_weight, w_gate, w_up, w_down, router_bias, e_score_correction_bias,
                            num_experts, top_k, gating, renormalize, n_group, topk_group, routed_scaling_factor,
                            capacity_factor, tiles):
    """`fused_moe_forward` in full -> (out [T, H], topk_ids, topk_weights in fp32)."""
    E = check_router_args(hidden_states, router_weight, top_k, gating, router_bias, n_group, topk_group,
                          e_score_correction_bias)
    check_int("num_experts", num_experts, 1)
    if num_experts != E:
        raise ValueError(f"num_experts={num_experts!r} but router_weight has {E} rows")
    H = hidden_states.shape[-1]
    _check_expert_weights(w_gate, w_up, w_down, E, H, hidden_states.dtype)
    check_same_device(hidden_states=hidden_states, w_gate=w_gate, w_up=w_up, w_down=w_down)
    x = hidden_states.reshape(-1, H)
    if capacity_factor is not None:
        expert_capacity(x.shape[0], top_k, E, capacity_factor)  # checks capacity_factor before anything runs
    topk_ids, topk_weights, _ = route_with_grad(
        x, router_weight, top_k, gating, router_bias, renormalize=renormalize, n_group=n_group,
        topk_group=topk_group, e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=routed_scaling_factor)
    expert_ids = topk_ids if capacity_factor is None else drop_over_capacity(topk_ids, E, capacity_factor)
    out = _run_experts(x, w_gate, w_up, w_down, expert_ids, topk_weights, tiles=tiles)
    return out, topk_ids, topk_weights


@custom_op("expert_ffn")
def _expert_ffn_op(permuted_tokens: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                   expert_offsets: torch.Tensor, sorted_idx: torch.Tensor | None, top_k: int,
                   top_k_weights: torch.Tensor | None) -> torch.Tensor:
    """SwiGLU FFN of each expert on its segment of already-permuted rows -> [M, H] (zero past expert_offsets[-1]); with
    top_k_weights, row p is scaled by the weight of assignment sorted_idx[p]."""
    M, H = permuted_tokens.shape
    E, F, _ = w_gate.shape
    tiles = plan_segments(permuted_tokens.device, M, E, F, H, permuted_tokens.dtype)
    info = segment_dispatch(expert_offsets, M, E, tiles.block_m, gather_idx=sorted_idx, top_k=top_k)
    intermediate = expert_gemm(permuted_tokens, w_gate, info, tiles.gate_up, weight_up=w_up, activation="silu")
    out = torch.zeros((M, H), device=permuted_tokens.device, dtype=permuted_tokens.dtype)
    return expert_gemm(intermediate, w_down, info, tiles.down, topk_weights=top_k_weights, out=out)


@_expert_ffn_op.register_fake
def _(permuted_tokens, w_gate, w_up, w_down, expert_offsets, sorted_idx, top_k, top_k_weights):
    return permuted_tokens.new_empty(permuted_tokens.shape)


@custom_op("fused_expert_ffn")
def _fused_expert_ffn_op(permuted_tokens: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                         w_down: torch.Tensor, expert_offsets: torch.Tensor, top_k_weights: torch.Tensor,
                         sorted_idx: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    y = _expert_ffn_op._init_fn(permuted_tokens, w_gate, w_up, w_down, expert_offsets, sorted_idx, top_k,
                                top_k_weights)
    # restore[a] = row of assignment a; rows without a valid assignment land in a discarded extra slot.
    N = sorted_idx.shape[0]
    slots = torch.where((sorted_idx >= 0) & (sorted_idx < N), sorted_idx, N).long()
    restore = torch.full((N + 1,), -1, device=sorted_idx.device, dtype=torch.int64)
    restore.scatter_(0, slots, torch.arange(N, device=sorted_idx.device))
    return combine(y, restore[:N], num_tokens, top_k)


@_fused_expert_ffn_op.register_fake
def _(permuted_tokens, w_gate, w_up, w_down, expert_offsets, top_k_weights, sorted_idx, num_tokens, top_k):
    return permuted_tokens.new_empty((num_tokens, permuted_tokens.shape[1]))


def _check_segment_ffn_args(permuted_tokens, w_gate, w_up, w_down, expert_offsets, num_experts, validate,
                            more_problems=None):
    check_int("num_experts", num_experts, 1)  # a TypeError for 4.0 or True (check_segmented_rows takes True for 1)
    check_segmented_rows("permuted_tokens", permuted_tokens, expert_offsets, num_experts, validate,
                         more_problems=more_problems)
    _check_expert_weights(w_gate, w_up, w_down, num_experts, permuted_tokens.shape[1], permuted_tokens.dtype)
    check_same_device(permuted_tokens=permuted_tokens, w_gate=w_gate, w_up=w_up, w_down=w_down)
    check_kernel_device("permuted_tokens", permuted_tokens)


@call_scope
def expert_ffn_triton(permuted_tokens: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                      expert_offsets: torch.Tensor, num_experts: int, *, validate: bool | None = None) -> torch.Tensor:
    """v1 API: per-expert SwiGLU FFN on rows already in expert order. Returns [M, H]; rows past expert_offsets[-1]
    are zero. `validate` as in grouped_gemm. Forward-only."""
    check_bool("validate", validate, none=True)
    _check_segment_ffn_args(permuted_tokens, w_gate, w_up, w_down, expert_offsets, num_experts, validate)
    warn_if_gradient_cut("expert_ffn_triton", permuted_tokens=permuted_tokens, w_gate=w_gate, w_up=w_up, w_down=w_down)
    return call(_expert_ffn_op, permuted_tokens, w_gate, w_up, w_down, expert_offsets, None, 1, None)


@call_scope
def fused_expert_ffn(permuted_tokens: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                     expert_offsets: torch.Tensor, num_experts: int, top_k_weights: torch.Tensor,
                     sorted_idx: torch.Tensor, num_tokens: int, top_k: int, *,
                     validate: bool | None = None) -> torch.Tensor:
    """v1 API: expert FFN on permuted rows, then the weighted combine back to token order -> [num_tokens, H].

    sorted_idx[p] is the assignment id (t * top_k + j) of row p, as returned by permute_tokens (-1: no assignment).
    `validate`: check expert_offsets (as in grouped_gemm) and sorted_idx (ids in [0, num_tokens * top_k), none twice,
    none negative inside a segment); None checks CPU tensors only, True also on a GPU (one sync), False never.
    Forward-only.
    """
    check_bool("validate", validate, none=True)
    check_float("permuted_tokens", permuted_tokens, ndim=2)
    check_index("sorted_idx", sorted_idx, ndim=1)
    check_token_weights(top_k_weights, num_tokens, top_k)
    check_dim("sorted_idx", sorted_idx, 0, permuted_tokens.shape[0], "rows of permuted_tokens")
    check_same_device(permuted_tokens=permuted_tokens, top_k_weights=top_k_weights, sorted_idx=sorted_idx)
    if permuted_tokens.shape[0] != num_tokens * top_k:
        raise ValueError(f"permuted_tokens has {permuted_tokens.shape[0]} rows, expected num_tokens * top_k = "
                         f"{num_tokens * top_k}")
    _check_segment_ffn_args(
        permuted_tokens, w_gate, w_up, w_down, expert_offsets, num_experts, validate,
        more_problems=lambda: (index_map_problems("sorted_idx", sorted_idx, num_tokens * top_k,
                                                  "assignments t * top_k + j")
                               + segment_rows_problems("sorted_idx", sorted_idx, expert_offsets)))
    warn_if_gradient_cut("fused_expert_ffn", permuted_tokens=permuted_tokens, w_gate=w_gate, w_up=w_up,
                         w_down=w_down, top_k_weights=top_k_weights)
    return call(_fused_expert_ffn_op, permuted_tokens, w_gate, w_up, w_down, expert_offsets, top_k_weights,
                sorted_idx, num_tokens, top_k)
