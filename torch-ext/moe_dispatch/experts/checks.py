"""Argument checks of the experts path (host only, no device value read): shapes, dtypes, devices and the options of
`fused_experts` (and `ep_fused_experts`, under the same names), each error naming the argument."""

from ..formats.fp8 import (DEFAULT_FP8_BLOCK_SHAPE, FP8_COMPUTE, GATE_UP_SCALE_LAYOUTS, check_block_shape,
                           check_fp8_dtype_on_device, check_fp8_weight, check_gate_up_scale_layout, check_input_scale,
                           is_fp8)
from ..formats.mxfp4 import check_mxfp4_weight, is_mxfp4, mxfp4_k
from ..host.checks import (ROUTING_WEIGHT_DTYPES, check_bool, check_choice, check_dim, check_float, check_index,
                           check_kernel_device, check_real, check_same_device, check_tensor)
from ..host.tiles import check_forced_tiles

EXPERT_ACTIVATIONS = ("silu", "swiglu_oai")


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
        E, F = check_mxfp4_experts(w_gate_up, w_down, w_gate_up_scale, w_down_scale, H, transposed=transposed,
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
            check_weight_dtype(name, w, hidden_states.dtype)
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


def check_mxfp4_experts(w_gate_up, w_down, w_gate_up_scale, w_down_scale, H, *, transposed, suffix, input_scales):
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


def check_weight_dtype(name, weight, dtype):
    """A float weight (or bias) in hidden_states' dtype; TypeError naming it."""
    if weight is not None and weight.dtype != dtype:
        raise TypeError(f"{name} has dtype {weight.dtype} but hidden_states has {dtype}; they must match")


def check_seed_weights(w_gate, w_up, w_down, num_experts, hidden, dtype):
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
        check_weight_dtype(name, w, dtype)
    return F
