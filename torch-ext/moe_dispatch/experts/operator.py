"""The experts forward as one custom operator, `fused_experts`: its schema, its fake and its launches.

    x [T, H] -> (out [T, H], preact [N, 2F], expert_offsets [E + 1], gather_idx [N], scatter_idx [N])

dispatch.segments.dispatch -> GEMM1 (gather + gate/up + activation, the pre-activations saved when a gradient is
needed) -> GEMM2 (down, routed weight) -> combine; at a few tokens in inference, gemm/decode.py instead (two launches,
no dispatch); float8 weights on the w8a8 path run the portable w8a8 kernels or the SM90 Gluon engine
(planner.plan_w8a8_engine), MXFP4 weights at prefill the portable grouped GEMMs or the SM90 Gluon MXFP4 engine
(planner.plan_mxfp4_engine). The last four outputs are what the backward needs; without save_preact they are empty [0].

The operator is planned (host/replay.py) only where no plan stands above it: a training step's forward, whose
inputs require gradients, cannot replay at the public entry and replays here, below autograd; an eager inference call
replays at its public entry, and while that entry records, the operator runs in full inside its record (a call is
planned at one level).
"""

import torch

from ..dispatch.combine import combine
from ..dispatch.segments import dispatch
from ..formats.fp8 import infer_scheme, is_fp8, kernel_scale
from ..formats.mxfp4 import is_mxfp4
from ..gemm import gluon_fp8, gluon_mxfp4
from ..gemm.decode import decode_experts
from ..gemm.gluon_experts import gluon_mxfp4_experts, gluon_w8a8_experts
from ..gemm.grouped import expert_gemm
from ..gemm.planner import ExpertsPath, choose_fp8_compute, plan_experts, plan_mxfp4_engine, plan_w8a8_engine
from ..gemm.w8a8 import w8a8_experts
from ..host.library import custom_op
from ..host.replay import PlanCache
from ..host.tiles import fp8_auto_takes_w8a8
from .call import ExpertsCall, ffn_size, split_gate_up, weight_scales

FORWARD_PLANS = PlanCache("fused_experts operator")


@custom_op("fused_experts")
def fused_experts_op(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_up: torch.Tensor | None, w_down: torch.Tensor, topk_ids: torch.Tensor,
    topk_weights: torch.Tensor, gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
    w_gate_up_scale: torch.Tensor | None, w_down_scale: torch.Tensor | None,
    gate_up_input_scale: torch.Tensor | None, down_input_scale: torch.Tensor | None, save_preact: bool,
    activation: str, interleaved: bool, transposed: bool, alpha: float, limit: float, tiles: list[int] | None,
    block_shape: list[int], compute: str, gate_up_scale_layout: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The experts forward (module docstring). w_up given: w_gate_up is the gate weight alone (seed layout
    [E, F, H]); else the concatenated or interleaved [E, 2F, H] ([E, H, 2F] transposed). The trailing slots are an
    `ExpertsCall` (`op_options`), its `compute` resolved. Quantized weights come with their scales, forward only
    (their caller passes inputs that need no gradient through them)."""
    tensors = (x, w_gate_up, w_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias, w_gate_up_scale,
               w_down_scale, gate_up_input_scale, down_input_scale)
    call = ExpertsCall(activation, interleaved, transposed, alpha, limit, tiles, block_shape, compute,
                       gate_up_scale_layout)
    return FORWARD_PLANS.run(launch_experts, tensors, (save_preact, call))


def launch_experts(x, w_gate_up, w_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias, w_gate_up_scale,
                   w_down_scale, gate_up_input_scale, down_input_scale, save_preact: bool, call: ExpertsCall):
    """The operator in full: the planner's choice of path and tiles, then the launches."""
    T, H = x.shape
    top_k = topk_ids.shape[1]
    E = w_down.shape[0]
    F = ffn_size(w_down, call.transposed)
    w_gate_up_scale, w_down_scale = kernel_scale(w_gate_up_scale), kernel_scale(w_down_scale)
    separate_up = w_up is not None
    # An interleaved gate/up weight goes to the pointer kernels whole (paired: whole tiles, split in registers); the
    # w8a8 path reads the two strided views.
    paired = call.interleaved and not separate_up
    w_gate, w_up = (w_gate_up, w_up) if separate_up else split_gate_up(w_gate_up, F, call.interleaved,
                                                                       2 if call.transposed else 1)
    gate_bias, up_bias = (split_gate_up(gate_up_bias, F, call.interleaved, 1) if gate_up_bias is not None
                          else (None, None))
    quantized = w_gate_up_scale is not None or w_down_scale is not None or is_fp8(w_gate_up) or is_fp8(w_down)
    mxfp4 = is_mxfp4(w_gate_up)
    plan = plan_experts(x.device, T, top_k, E, F, H, x.dtype, forced=call.forced_tiles(), save_preact=save_preact,
                        fp8=quantized, w8a8=quantized and call.compute == "w8a8", transposed=call.transposed,
                        mxfp4=mxfp4)
    if plan.path is ExpertsPath.W8A8:
        static_input_scales = gate_up_input_scale is not None or down_input_scale is not None
        plan = plan_w8a8_engine(plan, x, w_gate_up, w_down, w_gate_up_scale, w_down_scale, separate_up=separate_up,
                                block_shape=call.block_shape, scale_layout=call.gate_up_scale_layout,
                                static_input_scales=static_input_scales, transposed=call.transposed, top_k=top_k,
                                available=gluon_fp8.available)
    if mxfp4:
        plan = plan_mxfp4_engine(plan, x, w_gate_up, w_down, w_gate_up_scale, w_down_scale, separate_up=separate_up,
                                 transposed=call.transposed, save_preact=save_preact,
                                 forced_tiles=call.forced_tiles() is not None, top_k=top_k,
                                 available=gluon_mxfp4.available)
    paired &= plan.path not in (ExpertsPath.W8A8, ExpertsPath.W8A8_GLUON, ExpertsPath.MXFP4_GLUON)
    gate_up_scale, down_scale = weight_scales(call, w_gate_up_scale, w_down_scale, F, paired=paired, mxfp4=mxfp4)
    if paired:
        w_gate, w_up, gate_bias, up_bias = w_gate_up, None, gate_up_bias, None
    activation = dict(activation=call.activation, alpha=call.alpha, limit=call.limit)
    if plan.path is ExpertsPath.DECODE:
        out = decode_experts(x, w_gate, w_up, w_down, topk_ids, topk_weights, plan.tiles, transposed=call.transposed,
                             gate_bias=gate_bias, up_bias=up_bias, down_bias=down_bias, gate_up_scale=gate_up_scale,
                             down_scale=down_scale, paired=paired, **activation)
        return (out, *no_backward_outputs(x))
    info = dispatch(topk_ids, E, plan.tiles.block_m)
    preact = torch.empty((T * top_k, 2 * F), device=x.device, dtype=x.dtype) if save_preact else None
    combine_weights = None  # routing weights still to apply: the paths below apply them in their last GEMM's epilogue
    if plan.path is ExpertsPath.W8A8_GLUON:
        y, combine_weights = gluon_w8a8_experts(
            x, w_gate_up, w_down, info, w_gate_up_scale, w_down_scale, topk_weights=topk_weights,
            interleaved=call.interleaved, gate_bias=gate_bias, up_bias=up_bias, down_bias=down_bias, **activation)
    elif plan.path is ExpertsPath.MXFP4_GLUON:
        y, combine_weights = gluon_mxfp4_experts(
            x, w_gate_up, w_down, info, w_gate_up_scale, w_down_scale, topk_weights=topk_weights,
            interleaved=call.interleaved, gate_up_bias=gate_up_bias, down_bias=down_bias, **activation)
    elif plan.path is ExpertsPath.W8A8:
        y = w8a8_experts(x, w_gate, w_up, w_down, info, plan.tiles, gate_up_scale, down_scale,
                         topk_weights=topk_weights, transposed=call.transposed, gate_bias=gate_bias, up_bias=up_bias,
                         down_bias=down_bias, gate_up_input_scale=gate_up_input_scale,
                         down_input_scale=down_input_scale, **activation)
    else:
        intermediate = expert_gemm(x, w_gate, info, plan.tiles.gate_up, weight_up=w_up, transposed=call.transposed,
                                   gather_a=True, bias=gate_bias, bias_up=up_bias, preact=preact,
                                   weight_scale=gate_up_scale, paired=paired, **activation)
        y = expert_gemm(intermediate, w_down, info, plan.tiles.down, transposed=call.transposed, bias=down_bias,
                        topk_weights=topk_weights, weight_scale=down_scale)
    out = combine(y, info.scatter_idx, T, top_k, weights=combine_weights)
    if not save_preact:
        return (out, *no_backward_outputs(x))
    return out, preact, info.expert_offsets, info.gather_idx, info.scatter_idx


@fused_experts_op.register_fake
def _(x, w_gate_up, w_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias, w_gate_up_scale, w_down_scale,
      gate_up_input_scale, down_input_scale, save_preact, activation, interleaved, transposed, *_):
    T, H = x.shape
    if not save_preact:
        return (x.new_empty((T, H)), *no_backward_outputs(x))
    N = T * topk_ids.shape[1]
    F = ffn_size(w_down, transposed)
    index = dict(dtype=torch.int32, device=x.device)
    return (x.new_empty((T, H)), x.new_empty((N, 2 * F)), torch.empty(w_down.shape[0] + 1, **index),
            torch.empty(N, **index), torch.empty(N, **index))


def no_backward_outputs(x):
    """The four outputs only the backward reads, when none will run: empty tensors (no launch, no copy)."""
    index = dict(dtype=torch.int32, device=x.device)
    return x.new_empty((0,)), torch.empty(0, **index), torch.empty(0, **index), torch.empty(0, **index)


def resolve_fp8_compute(choice, tiles, x, top_k, w_gate_up, w_down, scales, block_shape, transposed) -> str:
    """planner.choose_fp8_compute for this call: whether the decode path would run it with float8 weights comes
    from the planner's plan of the call, unless the table's FP8 decode bucket sends "auto" to w8a8
    (tiles.fp8_auto_takes_w8a8; decode tiles the caller forced run as forced)."""
    T, H = x.shape
    E, F = w_down.shape[0], ffn_size(w_down, transposed)

    def runs_decode():
        plan = plan_experts(x.device, T, top_k, E, F, H, x.dtype, forced=tiles, fp8=True)
        if plan.path is not ExpertsPath.DECODE:
            return False
        return tiles is not None or not fp8_auto_takes_w8a8(x.device, T, top_k, E, F, H)  # forced decode tiles run

    return choose_fp8_compute(choice, x.device, w_gate_up, w_down, [infer_scheme(s) for s in scales if s is not None],
                              block_shape, transposed, runs_decode=runs_decode)
