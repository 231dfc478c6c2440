"""Float64 references of the MoE forward's stages (`moe_dispatch.reference` names them all): the router
(`moe_router_ref`), one expert's MLP and the routed experts in the seed layout (`expert_mlp_ref`, `experts_ref`) and in
transformers' / GPT-OSS's (`split_gate_up_ref`, `fused_experts_ref`), the whole forward (`fused_moe_forward_ref`),
permute / unpermute, the grouped GEMM and the expert FFN over sorted rows. `_f64`, `_activation` and `_segments` are
the other reference files' building blocks too. Plain torch, nothing else.
"""

import torch


def _f64(t):
    """float64 copy of t, differentiable: a float64 leaf passes through, so autograd of a reference is the float64
    reference of the gradient."""
    return None if t is None else t.to(torch.float64)


def moe_router_ref(hidden_states, router_weight, top_k, gating="softmax", router_bias=None, *, renormalize=None,
                   n_group=None, topk_group=None, e_score_correction_bias=None, routed_scaling_factor=1.0):
    """-> (ids [T, k] int64, weights [T, k], logits [T, E]); T = product of leading dims."""
    x = _f64(hidden_states).reshape(-1, hidden_states.shape[-1])
    logits = x @ _f64(router_weight).T
    if router_bias is not None:
        logits = logits + _f64(router_bias)
    scores = torch.sigmoid(logits) if gating == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores.clone()
    if e_score_correction_bias is not None:
        choice = choice + _f64(e_score_correction_bias)
    T, E = scores.shape
    if n_group is not None and n_group > 1:
        groups = choice.view(T, n_group, E // n_group)
        group_scores = groups.topk(2, dim=-1).values.sum(-1)  # [T, n_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group or n_group, dim=-1).indices, True)
        allowed = keep.repeat_interleave(E // n_group, dim=1)
        choice = choice.masked_fill(~allowed, float("-inf"))
    # Stable descending sort: ties go to the lower expert id.
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    if renormalize is None:
        renormalize = gating == "sigmoid"
    if renormalize:
        eps = 1e-6 if gating == "sigmoid" else 0.0
        weights = weights / (weights.sum(-1, keepdim=True) + eps)
    return ids, weights * routed_scaling_factor, logits


def _activation(gate, up, activation, alpha, limit):
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def expert_mlp_ref(x, w_gate, w_up, w_down, e, *, activation="silu", gate_bias=None, up_bias=None, down_bias=None,
                   alpha=1.702, limit=7.0):
    """Expert e on float64 rows x [M, H], seed layout: w_gate/w_up [E, F, H], w_down [E, H, F]. Only expert e's
    slices are upcast, so real model sizes fit."""
    gate = x @ _f64(w_gate[e]).T
    up = x @ _f64(w_up[e]).T
    if gate_bias is not None:
        gate, up = gate + _f64(gate_bias[e]), up + _f64(up_bias[e])
    out = _activation(gate, up, activation, alpha, limit) @ _f64(w_down[e]).T
    return out + _f64(down_bias[e]) if down_bias is not None else out


def experts_ref(hidden_states, w_gate, w_up, w_down, topk_ids, topk_weights, **kwargs):
    """out[t] = sum_j w[t, j] * expert_{ids[t, j]}(x_t) over ids in [0, E); seed weight layout. -> [T, H]."""
    x = _f64(hidden_states).reshape(-1, hidden_states.shape[-1])
    ids = topk_ids.detach().long()
    weights = _f64(topk_weights)
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        if not 0 <= e < w_gate.shape[0]:
            continue
        token, slot = (ids == e).nonzero(as_tuple=True)
        out.index_add_(0, token, weights[token, slot, None] * expert_mlp_ref(x[token], w_gate, w_up, w_down, e,
                                                                              **kwargs))
    return out


def split_gate_up_ref(w_gate_up, w_down, gate_up_bias=None, *, interleaved=False, transposed=False):
    """transformers / GPT-OSS layouts -> seed layout (w_gate, w_up [E, F, H], w_down [E, H, F], gate/up biases)."""
    w = w_gate_up
    if transposed:
        w, w_down = w.transpose(1, 2), w_down.transpose(1, 2)
    F = w.shape[1] // 2
    if interleaved:
        gate, up = w[:, 0::2], w[:, 1::2]
    else:
        gate, up = w[:, :F], w[:, F:]
    biases = (None, None)
    if gate_up_bias is not None:
        b = gate_up_bias
        biases = (b[:, 0::2], b[:, 1::2]) if interleaved else (b[:, :F], b[:, F:])
    return gate, up, w_down, biases


def fused_experts_ref(hidden_states, w_gate_up, w_down, topk_ids, topk_weights, *, activation="silu",
                      gate_up_bias=None, down_bias=None, interleaved=False, transposed=False, swiglu_alpha=1.702,
                      swiglu_limit=7.0):
    """-> out with hidden_states' shape (float64)."""
    gate, up, down, (gate_bias, up_bias) = split_gate_up_ref(w_gate_up, w_down, gate_up_bias,
                                                             interleaved=interleaved, transposed=transposed)
    out = experts_ref(hidden_states, gate, up, down, topk_ids, topk_weights, activation=activation,
                      gate_bias=gate_bias, up_bias=up_bias, down_bias=down_bias, alpha=swiglu_alpha,
                      limit=swiglu_limit)
    return out.reshape(hidden_states.shape)


def fused_moe_forward_ref(hidden_states, router_weight, w_gate, w_up, w_down, num_experts, top_k, gating="softmax",
                          **router_kwargs):
    """-> (out [..., H], ids [T, k], weights [T, k])."""
    ids, weights, _ = moe_router_ref(hidden_states, router_weight, top_k, gating, **router_kwargs)
    out = experts_ref(hidden_states, w_gate, w_up, w_down, ids, weights)
    return out.reshape(hidden_states.shape), ids, weights


def permute_tokens_ref(hidden_states, top_k_indices, num_experts):
    """-> (permuted [T*k, H], expert_offsets [E+1], sorted_idx [T*k], restore_idx [T*k]); stable by assignment id."""
    flat = top_k_indices.detach().long().reshape(-1)
    top_k = top_k_indices.shape[1]
    sorted_idx = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device=flat.device), counts.cumsum(0)])
    restore_idx = torch.empty_like(sorted_idx)
    restore_idx[sorted_idx] = torch.arange(flat.numel(), device=flat.device)
    return _f64(hidden_states)[sorted_idx // top_k], offsets, sorted_idx, restore_idx


def unpermute_tokens_ref(expert_outputs, top_k_weights, restore_idx, num_tokens, top_k):
    rows = _f64(expert_outputs)[restore_idx.long()].view(num_tokens, top_k, -1)
    return (rows * _f64(top_k_weights)[..., None]).sum(1)


def _segments(expert_offsets):
    offsets = expert_offsets.cpu().long().tolist()
    return list(zip(offsets[:-1], offsets[1:]))


def grouped_gemm_ref(tokens, weights, expert_offsets, num_experts):
    a, w = _f64(tokens), _f64(weights)
    out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float64, device=a.device)
    for e, (lo, hi) in enumerate(_segments(expert_offsets)):
        out[lo:hi] = a[lo:hi] @ w[e].T
    return out


def expert_ffn_ref(permuted_tokens, w_gate, w_up, w_down, expert_offsets, num_experts):
    a = _f64(permuted_tokens)
    out = torch.zeros_like(a)
    for e, (lo, hi) in enumerate(_segments(expert_offsets)):
        out[lo:hi] = expert_mlp_ref(a[lo:hi], w_gate, w_up, w_down, e)
    return out


def fused_expert_ffn_ref(permuted_tokens, w_gate, w_up, w_down, expert_offsets, num_experts, top_k_weights, sorted_idx,
                         num_tokens, top_k):
    y = expert_ffn_ref(permuted_tokens, w_gate, w_up, w_down, expert_offsets, num_experts)
    sorted_idx = sorted_idx.cpu().long()
    out = torch.zeros(num_tokens, y.shape[1], dtype=torch.float64, device=y.device)
    weights = _f64(top_k_weights).reshape(-1)
    for p, a in enumerate(sorted_idx.tolist()):
        if a >= 0:
            out[a // top_k] += weights[a] * y[p]
    return out
