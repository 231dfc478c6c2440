"""The MoE forward, composed from the stages (no kernels here):

  fused_moe_forward = routing.route -> fused_experts
  fused_experts     = dispatch.dispatch -> GEMM1 (gather + gate/up + activation) -> GEMM2 (down, routed weight)
                      -> combine.combine
  fused_expert_ffn / expert_ffn_triton: the v1 functions that start from already-permuted rows.

Nothing here reads device data on the host: every size is known from shapes, so a forward can be captured in a CUDA
graph and replayed with new inputs.
"""

import torch

from ._checks import (ROUTING_WEIGHT_DTYPES, check_choice, check_dim, check_float, check_ids_in_range, check_index,
                      check_same_device, check_tensor, check_token_weights, index_map_problems,
                      segment_rows_problems, warn_if_gradient_cut)
from .binned import drop_over_capacity
from .combine import combine
from .dispatch import dispatch, segment_dispatch
from .grouped_gemm import check_segmented_rows, grouped_matmul
from .routing import check_router_args, route
from .tiles import MoeTiles, select_tiles

EXPERT_ACTIVATIONS = ("silu", "swiglu_oai")


def _check_weight_dtype(name, weight, dtype):
    if weight is not None and weight.dtype != dtype:
        raise TypeError(f"{name} has dtype {weight.dtype} but hidden_states has {dtype}; they must match")


def _split_gate_up(w, num_ffn, interleaved, axis):
    """Gate and up views of a gate_up tensor along `axis` (no copy)."""
    if interleaved:
        lead = (slice(None),) * axis
        return w[lead + (slice(0, None, 2),)], w[lead + (slice(1, None, 2),)]
    return w.narrow(axis, 0, num_ffn), w.narrow(axis, num_ffn, num_ffn)


def _experts(x, w_gate, w_up, w_down, topk_ids, topk_weights, num_experts, tiles, *, transposed=False,
             activation="silu", gate_bias=None, up_bias=None, down_bias=None, alpha=1.702, limit=7.0):
    """The experts path on 2-D x [T, H] once arguments are validated; returns out [T, H]."""
    T, top_k = topk_ids.shape
    info = dispatch(topk_ids, num_experts, tiles.block_m)
    intermediate = grouped_matmul(x, w_gate, info, tiles.gate_up, weight_up=w_up, transposed=transposed,
                                  gather_a=True, activation=activation, bias=gate_bias, bias_up=up_bias,
                                  alpha=alpha, limit=limit)
    y = grouped_matmul(intermediate, w_down, info, tiles.down, transposed=transposed, bias=down_bias,
                       topk_weights=topk_weights)
    return combine(y, info.scatter_idx, T, top_k)


def fused_experts(hidden_states, w_gate_up, w_down, topk_ids, topk_weights, *, activation="silu", gate_up_bias=None,
                  down_bias=None, interleaved=False, transposed=False, swiglu_alpha=1.702, swiglu_limit=7.0,
                  validate_ids=None, tiles: MoeTiles | None = None):
    """Experts path for callers with their own router: out[t] = sum_j topk_weights[t, j] * expert_{ids[t, j]}(x_t).

    hidden_states [..., H]; w_gate_up [E, 2F, H] (gate rows then up rows, the transformers layout) and w_down [E, H, F];
    with `transposed`, [E, H, 2F] and [E, F, H] (GPT-OSS); with `interleaved`, gate and up alternate along 2F (gate
    first). expert(x) = down(act(gate_up(x) + gate_up_bias)) + down_bias with act "silu" (silu(gate) * up) or
    "swiglu_oai" (GPT-OSS: gate clamped above at limit, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)).
    topk_ids [T, k] int32/int64; topk_weights [T, k] any float dtype (applied in fp32).
    Ids outside [0, E) contribute nothing. Checking for them costs a device-to-host sync, so `validate_ids=None` raises
    only when the ids are on the CPU; True always checks, False never (expert-parallel sentinels).
    `tiles` forces a tile configuration (tuning and tests). Returns out [..., H] in hidden_states' dtype.
    """
    check_float("hidden_states", hidden_states, min_ndim=1)
    check_float("w_gate_up", w_gate_up, ndim=3)
    check_float("w_down", w_down, ndim=3)
    check_index("topk_ids", topk_ids, ndim=2)
    check_tensor("topk_weights", topk_weights, ndim=2, dtypes=ROUTING_WEIGHT_DTYPES)
    check_choice("activation", activation, EXPERT_ACTIVATIONS)
    H = hidden_states.shape[-1]
    E = w_gate_up.shape[0]
    h_axis, f_axis = (1, 2) if transposed else (2, 1)
    layout = "[E, H, 2F]" if transposed else "[E, 2F, H]"
    check_dim("w_gate_up", w_gate_up, h_axis, H, f"hidden size H of hidden_states, layout {layout}")
    if w_gate_up.shape[f_axis] % 2:
        raise ValueError(f"w_gate_up dimension {f_axis} (2F, layout {layout}) must be even, got {w_gate_up.shape[f_axis]}")
    F = w_gate_up.shape[f_axis] // 2
    check_dim("w_down", w_down, 0, E, "number of experts E of w_gate_up")
    down_h_axis, down_f_axis = (2, 1) if transposed else (1, 2)
    check_dim("w_down", w_down, down_h_axis, H, "hidden size H")
    check_dim("w_down", w_down, down_f_axis, F, "ffn size F (half of w_gate_up's 2F)")
    T = hidden_states.shape[:-1].numel()
    check_dim("topk_ids", topk_ids, 0, T, "number of tokens T")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights has shape {tuple(topk_weights.shape)} but topk_ids has {tuple(topk_ids.shape)}")
    if topk_ids.shape[1] < 1:
        raise ValueError("topk_ids must have at least one column (top_k >= 1)")
    for name, bias, size in (("gate_up_bias", gate_up_bias, 2 * F), ("down_bias", down_bias, H)):
        if bias is not None:
            check_float(name, bias, ndim=2)
            check_dim(name, bias, 0, E, "number of experts E")
            check_dim(name, bias, 1, size, "output size of the projection")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down), ("gate_up_bias", gate_up_bias),
                    ("down_bias", down_bias)):
        _check_weight_dtype(name, w, hidden_states.dtype)
    check_same_device(hidden_states=hidden_states, w_gate_up=w_gate_up, w_down=w_down, topk_ids=topk_ids,
                      topk_weights=topk_weights, gate_up_bias=gate_up_bias, down_bias=down_bias)
    check_ids_in_range("topk_ids", topk_ids, E, validate_ids)

    x = hidden_states.reshape(T, H)
    top_k = topk_ids.shape[1]
    if tiles is None:
        tiles = select_tiles(x.device, T, top_k, E, F, H, x.dtype)
    w_gate, w_up = _split_gate_up(w_gate_up, F, interleaved, f_axis)
    gate_bias = up_bias = None
    if gate_up_bias is not None:
        gate_bias, up_bias = _split_gate_up(gate_up_bias, F, interleaved, 1)
    out = _experts(x, w_gate, w_up, w_down, topk_ids, topk_weights, E, tiles, transposed=transposed,
                   activation=activation, gate_bias=gate_bias, up_bias=up_bias, down_bias=down_bias,
                   alpha=swiglu_alpha, limit=swiglu_limit)
    return out.reshape(hidden_states.shape)


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


def fused_moe_forward(hidden_states, router_weight, w_gate, w_up, w_down, num_experts, top_k, gating="softmax", *,
                      renormalize=None, router_bias=None, n_group=None, topk_group=None, e_score_correction_bias=None,
                      routed_scaling_factor=1.0, capacity_factor=None, tiles: MoeTiles | None = None):
    """Whole MoE layer (v1 API): route, then run the experts.

    hidden_states [..., H], router_weight [E, H], w_gate and w_up [E, F, H], w_down [E, H, F]. Routing semantics are
    those of `moe_router`. With `capacity_factor`, each expert takes at most C = int(capacity_factor * T * top_k / E)
    assignments, the earliest in order t * top_k + j (MegaBlocks' rule; C = 0 drops nothing, as MegaBlocks falls back
    to the largest count); dropped assignments contribute nothing to `out` but are still reported in the returned ids
    and weights (`binned.capacity_keep_mask` tells which were kept). Returns (out [..., H] in the input dtype, top_k_indices [T, top_k] int64, top_k_weights
    [T, top_k] in the input dtype) with T the product of the leading dims.
    """
    E = check_router_args(hidden_states, router_weight, top_k, gating, router_bias, n_group, topk_group,
                          e_score_correction_bias)
    if num_experts != E:
        raise ValueError(f"num_experts={num_experts!r} but router_weight has {E} rows")
    H = hidden_states.shape[-1]
    F = _check_expert_weights(w_gate, w_up, w_down, E, H, hidden_states.dtype)
    check_same_device(hidden_states=hidden_states, w_gate=w_gate, w_up=w_up, w_down=w_down)
    x = hidden_states.reshape(-1, H)
    T = x.shape[0]
    topk_ids, topk_weights, _ = route(
        x, router_weight, top_k, gating, router_bias, renormalize=renormalize, n_group=n_group,
        topk_group=topk_group, e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=routed_scaling_factor)
    if tiles is None:
        tiles = select_tiles(x.device, T, top_k, E, F, H, x.dtype)
    expert_ids = topk_ids if capacity_factor is None else drop_over_capacity(topk_ids, E, capacity_factor)
    out = _experts(x, w_gate, w_up, w_down, expert_ids, topk_weights, E, tiles)
    return out.reshape(hidden_states.shape), topk_ids, topk_weights.to(hidden_states.dtype)


def _ffn_on_segments(permuted_tokens, w_gate, w_up, w_down, expert_offsets, num_experts, *, sorted_idx=None,
                     top_k=1, top_k_weights=None):
    H = permuted_tokens.shape[1]
    F = _check_expert_weights(w_gate, w_up, w_down, num_experts, H, permuted_tokens.dtype)
    check_same_device(permuted_tokens=permuted_tokens, w_gate=w_gate, w_up=w_up, w_down=w_down)
    M = permuted_tokens.shape[0]
    tiles = select_tiles(permuted_tokens.device, M, 1, num_experts, F, H, permuted_tokens.dtype)
    info = segment_dispatch(expert_offsets, M, num_experts, tiles.block_m, gather_idx=sorted_idx, top_k=top_k)
    intermediate = grouped_matmul(permuted_tokens, w_gate, info, tiles.gate_up, weight_up=w_up, activation="silu")
    out = torch.zeros((M, H), device=permuted_tokens.device, dtype=permuted_tokens.dtype)
    return grouped_matmul(intermediate, w_down, info, tiles.down, topk_weights=top_k_weights, out=out)


def expert_ffn_triton(permuted_tokens, w_gate, w_up, w_down, expert_offsets, num_experts, *, validate=None):
    """v1 API: per-expert SwiGLU FFN on rows already in expert order. Returns [M, H]; rows past expert_offsets[-1]
    are zero. `validate` as in grouped_gemm. Forward-only."""
    check_segmented_rows("permuted_tokens", permuted_tokens, expert_offsets, num_experts, validate)
    warn_if_gradient_cut("expert_ffn_triton", permuted_tokens=permuted_tokens, w_gate=w_gate, w_up=w_up, w_down=w_down)
    return _ffn_on_segments(permuted_tokens, w_gate, w_up, w_down, expert_offsets, num_experts)


def fused_expert_ffn(permuted_tokens, w_gate, w_up, w_down, expert_offsets, num_experts, top_k_weights, sorted_idx,
                     num_tokens, top_k, *, validate=None):
    """v1 API: expert FFN on permuted rows, then the weighted combine back to token order -> [num_tokens, H].

    sorted_idx[p] is the assignment id (t * top_k + j) of row p, as returned by permute_tokens (-1: no assignment).
    `validate`: check expert_offsets (as in grouped_gemm) and sorted_idx (ids in [0, num_tokens * top_k), none twice,
    none negative inside a segment); None checks CPU tensors only, True also on a GPU (one sync), False never.
    Forward-only.
    """
    check_float("permuted_tokens", permuted_tokens, ndim=2)
    check_index("sorted_idx", sorted_idx, ndim=1)
    check_token_weights(top_k_weights, num_tokens, top_k)
    check_dim("sorted_idx", sorted_idx, 0, permuted_tokens.shape[0], "rows of permuted_tokens")
    check_same_device(permuted_tokens=permuted_tokens, top_k_weights=top_k_weights, sorted_idx=sorted_idx)
    if permuted_tokens.shape[0] != num_tokens * top_k:
        raise ValueError(f"permuted_tokens has {permuted_tokens.shape[0]} rows, expected num_tokens * top_k = "
                         f"{num_tokens * top_k}")
    check_segmented_rows("permuted_tokens", permuted_tokens, expert_offsets, num_experts, validate,
                         more_problems=lambda: (index_map_problems("sorted_idx", sorted_idx, num_tokens * top_k,
                                                                   "assignments t * top_k + j")
                                                + segment_rows_problems("sorted_idx", sorted_idx, expert_offsets)))
    warn_if_gradient_cut("fused_expert_ffn", permuted_tokens=permuted_tokens, w_gate=w_gate, w_up=w_up,
                         w_down=w_down, top_k_weights=top_k_weights)
    y = _ffn_on_segments(permuted_tokens, w_gate, w_up, w_down, expert_offsets, num_experts, sorted_idx=sorted_idx,
                         top_k=top_k, top_k_weights=top_k_weights)
    # restore[a] = row of assignment a; rows without an assignment (sorted_idx < 0) land in a discarded extra slot.
    N = sorted_idx.shape[0]
    slots = torch.where((sorted_idx >= 0) & (sorted_idx < N), sorted_idx, N)  # bad ids (unvalidated) go nowhere
    restore = torch.full((N + 1,), -1, device=sorted_idx.device, dtype=torch.int64)
    restore.scatter_(0, slots.long(), torch.arange(N, device=sorted_idx.device))
    return combine(y, restore[:N], num_tokens, top_k)
