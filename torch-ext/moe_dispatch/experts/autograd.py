"""The experts operator with its backward: `run_experts` (what the public entries call) and operator
`fused_experts_backward` (kernels in backward/experts.py), planned per signature (host/replay.py): every training step
repeats the same launches.

Quantized weights (float8 or MXFP4) are frozen: they and their scales are detached (a weight or a scale that requires
grad is warned about once), and on the dequant path the other inputs get the gradients of the experts with the
dequantized weights. The w8a8 path is forward only: every input is detached (warned once).
"""

import torch

from ..backward.experts import ExpertsGrads, deferred, experts_backward
from ..formats.fp8 import DEFAULT_FP8_BLOCK_SHAPE, WeightScale, infer_scheme, is_fp8, kernel_scale
from ..formats.mxfp4 import MXFP4_GROUP, is_mxfp4
from ..formats.scale_codes import WeightScaleCode
from ..host.checks import warn_if_gradient_cut
from ..host.device import call_scope
from ..host.library import call, custom_op, needs_operator
from ..host.replay import PlanCache
from .call import ExpertsCall
from .operator import fused_experts_op

# by lifetime: the replayed backward frees its activated rows before it allocates dW_gate_up, as the full path does
BACKWARD_PLANS = PlanCache("fused_experts backward", by_lifetime=True)

# The forward operator's inputs that can have a gradient, by their position in its schema.
_GRAD_INPUTS = ("x", "w_gate_up", "w_up", "w_down", "topk_weights", "gate_up_bias", "down_bias")
_FORWARD_SLOTS = tuple(arg.name for arg in fused_experts_op._opoverload._schema.arguments)
_GRAD_SLOTS = tuple(_FORWARD_SLOTS.index(name) for name in _GRAD_INPUTS)
_SCALE_TENSORS = ("w_gate_up_scale", "w_down_scale", "gate_up_input_scale", "down_input_scale")
_SAVED = ("x", "w_gate_up", "w_up", "w_down", "topk_ids", "topk_weights", "gate_up_bias", "down_bias")
_SAVED_SCALES = ("w_gate_up_scale", "w_down_scale")  # saved after the forward's outputs (None for float weights)


def run_experts(x, w_gate_up, w_up, w_down, topk_ids, topk_weights, gate_up_bias=None, down_bias=None, *,
                call_options: ExpertsCall = ExpertsCall(), scales: dict | None = None):
    """The experts operator on checked 2-D x (module docstring); saves the pre-activations only when a gradient will
    be needed. `scales`: the quantized weights' scale tensors by `_SCALE_TENSORS` name (None for float weights);
    `call_options.compute` resolved."""
    scales = dict.fromkeys(_SCALE_TENSORS) | (scales or {})
    if is_fp8(w_gate_up) or is_fp8(w_down) or is_mxfp4(w_gate_up):
        if call_options.compute == "w8a8":
            warn_if_gradient_cut("fused_experts with fp8_compute='w8a8'", hidden_states=x, topk_weights=topk_weights,
                                 gate_up_bias=gate_up_bias, down_bias=down_bias)
            x, topk_weights, gate_up_bias, down_bias = (t.detach() if t is not None else None
                                                        for t in (x, topk_weights, gate_up_bias, down_bias))
        frozen = {name: w for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)) if is_fp8(w) or is_mxfp4(w)}
        # their scales are frozen with them (transformers keeps `*_scale_inv` as Parameters that require grad)
        warn_if_gradient_cut("fused_experts with quantized (float8 or MXFP4) weights (frozen)", **frozen,
                             **{name: t for name, t in scales.items() if t is not None})
        w_gate_up, w_down = (w.detach() if name in frozen else w for name, w in (("w_gate_up", w_gate_up),
                                                                              ("w_down", w_down)))
        scales = {name: t.detach() if t is not None else None for name, t in scales.items()}
    inputs = (x, w_gate_up, w_up, w_down, topk_weights, gate_up_bias, down_bias)
    save_preact = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    out = call(fused_experts_op, x, w_gate_up, w_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias,
               *scales.values(), save_preact, *call_options.op_options(), autograd_function=EagerExperts)[0]
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


@custom_op("fused_experts_backward")
def fused_experts_backward_op(
    grad_out: torch.Tensor, x: torch.Tensor, w_gate_up: torch.Tensor, w_up: torch.Tensor | None, w_down: torch.Tensor,
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None, preact: torch.Tensor, expert_offsets: torch.Tensor, gather_idx: torch.Tensor,
    scatter_idx: torch.Tensor, activation: str, interleaved: bool, transposed: bool, alpha: float, limit: float,
    needs: list[bool], w_gate_up_scale: torch.Tensor | None = None, w_down_scale: torch.Tensor | None = None,
    fp8_block_shape: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for the inputs named in `_GRAD_INPUTS` where `needs` says so; an empty [0] tensor elsewhere. The
    operator reads `preact` only (`experts_grads` with reuse_preact=False). Quantized (frozen) weights come with
    their scales and get no gradient."""
    return experts_grads(grad_out, x, w_gate_up, w_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias, preact,
                         expert_offsets, gather_idx, scatter_idx, activation, interleaved, transposed, alpha, limit,
                         needs, w_gate_up_scale, w_down_scale, fp8_block_shape, reuse_preact=False)


@call_scope  # run by autograd after the forward's call returned: the backward reads the switches once for itself
def experts_grads(grad_out, x, w_gate_up, w_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias, preact,
                  expert_offsets, gather_idx, scatter_idx, activation, interleaved, transposed, alpha, limit, needs,
                  w_gate_up_scale=None, w_down_scale=None, fp8_block_shape=None, *, reuse_preact):
    """The backward operator's work, planned; `reuse_preact` lets the backward write d_preact over `preact`
    (backward/experts.py), which only a caller that never reads `preact` again may ask for (`_may_reuse_preact`)."""
    tensors = (grad_out, x, w_gate_up, w_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias, preact,
               expert_offsets, gather_idx, scatter_idx, w_gate_up_scale, w_down_scale)
    options = (activation, interleaved, transposed, alpha, limit, tuple(bool(need) for need in needs), reuse_preact,
               None if fp8_block_shape is None else tuple(fp8_block_shape))
    return BACKWARD_PLANS.run(_launch_grads, tensors, options)


def _launch_grads(grad_out, x, w_gate_up, w_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias, preact,
                  expert_offsets, gather_idx, scatter_idx, w_gate_up_scale, w_down_scale, activation, interleaved,
                  transposed, alpha, limit, needs, reuse_preact, fp8_block_shape):
    """`experts_grads` in full (tensors first, then options)."""
    gate_up_scale, down_scale = _backward_weight_scales(w_gate_up, w_down, kernel_scale(w_gate_up_scale),
                                                        kernel_scale(w_down_scale), fp8_block_shape, transposed)
    needs = _needed(x, w_gate_up, w_up, w_down, topk_weights, gate_up_bias, down_bias, needs)
    grads = _allocate_grads(x, w_gate_up, w_up, w_down, topk_weights, gate_up_bias, down_bias, needs, defer=True)
    filled = experts_backward(
        grad_out, x, w_gate_up, w_up, w_down, topk_ids, topk_weights, down_bias, preact, expert_offsets,
        gather_idx, scatter_idx,
        ExpertsGrads(*(g if need else None for g, need in zip(grads, needs))),
        activation=activation, transposed=transposed, interleaved=interleaved, alpha=alpha, limit=limit,
        reuse_preact=reuse_preact, gate_up_scale=gate_up_scale, down_scale=down_scale)
    return tuple(getattr(filled, name) if need else g for name, g, need in zip(_GRAD_INPUTS, grads, needs))


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


def _allocate_grads(x, w_gate_up, w_up, w_down, topk_weights, gate_up_bias, down_bias, needs, defer=False):
    """A buffer like each input whose gradient is needed (`defer`: its allocation, backward.experts.deferred, made
    when the backward first writes it), an empty [0] tensor for the others: the backward operator's outputs."""
    like = (x, w_gate_up, w_up, w_down, topk_weights, gate_up_bias, down_bias)
    needs = _needed(*like, needs)
    return tuple((deferred(t) if defer else torch.empty(t.shape, dtype=t.dtype, device=t.device)) if need
                 else x.new_empty((0,)) for t, need in zip(like, needs))


@fused_experts_backward_op.register_fake
def _(grad_out, x, w_gate_up, w_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias, preact, expert_offsets,
      gather_idx, scatter_idx, activation, interleaved, transposed, alpha, limit, needs, w_gate_up_scale=None,
      w_down_scale=None, fp8_block_shape=None):
    return _allocate_grads(x, w_gate_up, w_up, w_down, topk_weights, gate_up_bias, down_bias, needs)


def _setup_context(ctx, inputs, output):
    a = dict(zip(_FORWARD_SLOTS, inputs))
    _, preact, expert_offsets, gather_idx, scatter_idx = output
    ctx.save_for_backward(*(a[name] for name in _SAVED), preact, expert_offsets, gather_idx, scatter_idx,
                          *(a[name] for name in _SAVED_SCALES))
    ctx.call = ExpertsCall(*inputs[_FORWARD_SLOTS.index("activation"):])
    ctx.save_preact = a["save_preact"]
    # The outputs besides `out` (pre-activations, dispatch) get no gradient: autograd would otherwise fill a zero
    # tensor for each, one [N, 2F] buffer live at the backward's peak (benchmarks/experts_memory.py).
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, *_):
    if grad_out is None:  # `out` took no part in the loss (only the other outputs did: none of them has a gradient)
        return (None,) * len(_FORWARD_SLOTS)
    if not ctx.save_preact:
        raise RuntimeError("fused_experts ran without saving its pre-activations (no input required grad at the time); "
                           "cannot backward through it")
    needs = [bool(ctx.needs_input_grad[i]) for i in _GRAD_SLOTS]
    # The backward's kernels read the gradient by rows. Made contiguous here, outside the planned call, so that a
    # gradient of another layout (`out.sum()` gives an expanded one) does not keep the call from replaying its plan.
    grad_out = grad_out.contiguous()
    saved = ctx.saved_tensors
    c = ctx.call
    args = (grad_out, *saved[:-len(_SAVED_SCALES)], c.activation, c.interleaved, c.transposed, c.alpha, c.limit, needs,
            *saved[-len(_SAVED_SCALES):], list(c.block_shape))
    if getattr(ctx, "preact_private", False) and _may_reuse_preact(args):
        grads = experts_grads(*args, reuse_preact=True)
    else:
        grads = fused_experts_backward_op(*args)
    by_slot = {slot: g if need else None for slot, g, need in zip(_GRAD_SLOTS, grads, needs)}
    return tuple(by_slot.get(slot) for slot in range(len(_FORWARD_SLOTS)))  # None for every other input


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


fused_experts_op.register_autograd(_backward, setup_context=_setup_context)


class EagerExperts(torch.autograd.Function):
    """The experts operator with its registered backward as a plain autograd.Function, which an eager training call on
    plain tensors runs instead of the operator (host.library.call): the same forward (the operator's function, its
    plan) and the same `_setup_context` and `_backward`, without the dispatcher's round trip and torch's custom-op
    autograd wrapper (which fills the schema's defaults on every call): on a CPU with the kernels stubbed out a
    training forward took 368-376 us of host time through the operator and 223-238 us through this (E 128, top-8)."""

    # forward takes ctx (no separate setup_context): apply then binds no default arguments (inspect.signature) per call
    @staticmethod
    def forward(ctx, *inputs):
        output = fused_experts_op._init_fn(*inputs)
        _setup_context(ctx, inputs, output)
        ctx.mark_non_differentiable(*output[1:])  # the pre-activations and the dispatch: the backward's, no gradient
        return output

    @staticmethod
    def backward(ctx, grad_out, *_):
        return _backward(ctx, grad_out)
