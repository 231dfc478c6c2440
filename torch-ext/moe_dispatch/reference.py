"""Float64 references for every public function, written from the documented semantics (not from the kernels).

`moe_dispatch.reference`: shipped with the package, so the tests, the scripts and the Hub benchmark (which verifies
the kernel it loads with the references that kernel ships) import the same `<stage>_ref` functions and tolerance
table by name. Plain torch, nothing else: importing it compiles and launches no kernel. Inputs are upcast to float64
on their own device (so a GPU can run the reference at real model sizes); outputs are float64 (floats) or int64
(indices) on that device.
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


# Binned routing (MegaBlocks semantics): a = t * top_k + j; indices = assignments sorted by expert; bins[e] inclusive
# cumulative counts, so expert e owns sorted positions [bins[e - 1] (0 for e = 0), bins[e]).


def binned_routing_ref(topk_ids, num_experts):
    """-> (indices [N] int64: assignments sorted by expert, ties in assignment order; bins [E] int64 inclusive)."""
    ids = topk_ids.detach().cpu().long().reshape(-1).tolist()
    indices = sorted(range(len(ids)), key=ids.__getitem__)  # Python's sort is stable
    bins, total = [], 0
    for e in range(num_experts):
        total += ids.count(e)
        bins.append(total)
    device = topk_ids.device
    return torch.tensor(indices, dtype=torch.int64, device=device), torch.tensor(bins, dtype=torch.int64, device=device)


def _kept_assignments_ref(indices, bins, *, padded_bins=None, capacity=None):
    """(assignment ids, buffer rows) of the assignments that have a buffer row. The j-th assignment of expert e goes to
    row e * capacity + j (binned; only while j < capacity), else padded_bins[e - 1] + j (padded) or bins[e - 1] + j."""
    order = indices.detach().long()
    ends = bins.detach().cpu().long().tolist()
    padded_ends = ends if padded_bins is None else padded_bins.detach().cpu().long().tolist()
    assignments, rows = [], []
    start = padded_start = 0
    for e, end in enumerate(ends):
        count = end - start if capacity is None else min(end - start, capacity)
        first_row = padded_start if capacity is None else e * capacity
        assignments.append(order[start:start + count])
        rows.append(torch.arange(first_row, first_row + count, device=order.device))
        start, padded_start = end, padded_ends[e]
    return torch.cat(assignments), torch.cat(rows)


def _routed_gather_ref(x, weights, top_k, assignments, rows, num_rows):
    x = _f64(x)
    out = torch.zeros(num_rows, x.shape[1], dtype=torch.float64, device=x.device)
    scale = 1.0 if weights is None else _f64(weights)[assignments][:, None]
    out[rows] = x[assignments // top_k] * scale
    return out


def _routed_scatter_ref(x, weights, top_k, assignments, rows, num_assignments):
    x = _f64(x).reshape(-1, x.shape[-1])
    slots = torch.zeros(num_assignments, x.shape[1], dtype=torch.float64, device=x.device)  # dropped slots stay 0
    scale = 1.0 if weights is None else _f64(weights)[assignments][:, None]
    slots[assignments] = x[rows] * scale
    return slots.view(num_assignments // top_k, top_k, x.shape[1]).sum(1)


def _routed_wgrad_ref(x, grad, top_k, assignments, rows, num_assignments):
    x = _f64(x).reshape(-1, x.shape[-1])
    out = torch.zeros(num_assignments, dtype=torch.float64, device=x.device)
    out[assignments] = (x[rows] * _f64(grad)[assignments // top_k]).sum(-1)
    return out


def binned_gather_ref(x, indices, weights, bins, expert_capacity, top_k):
    """[E, C, H]: out[e, j] = x[a // top_k] * weights[a] for a = indices[bins[e - 1] + j], j < min(C, count_e)."""
    kept = _kept_assignments_ref(indices, bins, capacity=expert_capacity)
    num_experts = bins.shape[0]
    out = _routed_gather_ref(x, weights, top_k, *kept, num_experts * expert_capacity)
    return out.view(num_experts, expert_capacity, x.shape[1])


def binned_scatter_ref(x, indices, weights, bins, top_k):
    """[T, H]: slot a of a zero [N, H] buffer = x[e, j] * weights[a] for kept assignments; sum of each token's slots."""
    kept = _kept_assignments_ref(indices, bins, capacity=x.shape[1])
    return _routed_scatter_ref(x, weights, top_k, *kept, indices.shape[0])


def binned_scatter_wgrad_ref(x, grad, indices, bins, top_k):
    """[N]: sum_h x[e, j, h] * grad[a // top_k, h] for kept assignments, 0 for dropped ones."""
    kept = _kept_assignments_ref(indices, bins, capacity=x.shape[1])
    return _routed_wgrad_ref(x, grad, top_k, *kept, indices.shape[0])


def padded_gather_ref(x, indices, weights, bins, padded_bins, top_k, num_rows=None):
    """[R, H]: expert e's segment starts at row padded_bins[e - 1]; padding rows (and rows past the last) are 0."""
    num_rows = int(padded_bins[-1]) if num_rows is None else num_rows
    kept = _kept_assignments_ref(indices, bins, padded_bins=padded_bins)
    return _routed_gather_ref(x, weights, top_k, *kept, num_rows)


def padded_scatter_ref(x, indices, weights, bins, padded_bins, top_k):
    kept = _kept_assignments_ref(indices, bins, padded_bins=padded_bins)
    return _routed_scatter_ref(x, weights, top_k, *kept, indices.shape[0])


def padded_scatter_wgrad_ref(x, grad, indices, bins, padded_bins, top_k):
    kept = _kept_assignments_ref(indices, bins, padded_bins=padded_bins)
    return _routed_wgrad_ref(x, grad, top_k, *kept, indices.shape[0])


def gather_ref(x, indices, weights, bins, top_k):
    """[N, H] in sorted order: out[p] = x[indices[p] // top_k] * weights[indices[p]] (no padding, nothing dropped)."""
    return padded_gather_ref(x, indices, weights, bins, bins, top_k)


def scatter_ref(x, indices, weights, bins, top_k):
    return padded_scatter_ref(x, indices, weights, bins, bins, top_k)


def scatter_wgrad_ref(x, grad, indices, bins, top_k):
    return padded_scatter_wgrad_ref(x, grad, indices, bins, bins, top_k)


def capacity_keep_mask_ref(topk_ids, num_experts, capacity):
    """bool [T, top_k]: walking assignments in order a = t * top_k + j, each expert keeps its first `capacity`;
    ids outside [0, num_experts) are never kept."""
    used = [0] * num_experts
    keep = []
    for e in topk_ids.detach().cpu().long().reshape(-1).tolist():
        kept = 0 <= e < num_experts and used[e] < capacity
        if kept:
            used[e] += 1
        keep.append(kept)
    return torch.tensor(keep, dtype=torch.bool, device=topk_ids.device).view(topk_ids.shape)



def ep_capacity_keep_ref(topk_ids, experts_per_rank, world_size, capacity):
    """bool [T, top_k] for one source rank of expert parallelism with `capacity` rows per destination rank.

    Rank d holds experts [d * experts_per_rank, (d + 1) * experts_per_rank). Walking the source's tokens in order,
    a token needs one row on each rank holding at least one of its experts; each destination takes the first
    `capacity` such rows. Assignment (t, j) is kept when its expert is in [0, experts_per_rank * world_size) and the
    row of token t for its expert's rank was taken."""
    rows_taken = [0] * world_size
    keep = []
    for token_ids in topk_ids.detach().cpu().long().tolist():
        ranks = {e // experts_per_rank for e in token_ids if 0 <= e < experts_per_rank * world_size}
        taken = set()
        for d in sorted(ranks):
            if rows_taken[d] < capacity:
                rows_taken[d] += 1
                taken.add(d)
        keep.append([0 <= e < experts_per_rank * world_size and e // experts_per_rank in taken for e in token_ids])
    return torch.tensor(keep, dtype=torch.bool, device=topk_ids.device).view(topk_ids.shape)


def ep_plan_ref(topk_ids, world_size, experts_per_rank, capacity, recv_counts=None):
    """expert_parallel's routing plan for one source rank, in torch ops: a dict of `_Plan`'s fields (slot_token,
    slot_local_ids, token_slots, send_sizes, recv_sizes, num_recv, padded) and the stats (wanted_rows, dropped_rows).

    Rank d holds experts [d * experts_per_rank, (d + 1) * experts_per_rank); ids outside [0, E) are on no rank. Pair
    (d, t) is wanted when one of token t's ids is on d; d's rows are its wanted tokens in token order. `capacity`
    None: dropless, every wanted pair kept, `recv_counts` (int64 [W], what the counts exchange would return) gives
    the receive sizes; else C: each destination keeps its earliest C tokens and has exactly C slots, unused ones
    padding (slot_token T, ids experts_per_rank). Slots are grouped by destination; token_slots[c, t] is the slot of
    t's c-th kept destination in rank order (n_slots: none), c < min(top_k, W)."""
    T, top_k = topk_ids.shape
    W, device = world_size, topk_ids.device
    first_expert = torch.arange(W, device=device) * experts_per_rank  # [W]
    local_ids = topk_ids.long().unsqueeze(0) - first_expert.view(W, 1, 1)  # [W, T, k]
    on_rank = (local_ids >= 0) & (local_ids < experts_per_rank)
    pair_local_ids = torch.where(on_rank, local_ids, experts_per_rank).to(torch.int32)  # [W, T, k]
    wanted = on_rank.any(dim=2)  # [W, T]
    position = torch.cumsum(wanted, dim=1) - 1  # [W, T] row of t among d's rows
    wanted_rows = wanted.sum(dim=1)  # [W]
    if capacity is None:
        kept = wanted
        send_counts = wanted_rows
        send_sizes, recv_sizes = send_counts.tolist(), recv_counts.tolist()
        num_slots, num_recv = sum(send_sizes), sum(recv_sizes)
        slot_base = torch.cumsum(send_counts, 0) - send_counts  # [W] exclusive
    else:
        kept = wanted & (position < capacity)
        send_counts = wanted_rows.clamp(max=capacity)
        send_sizes = recv_sizes = None
        num_slots = num_recv = W * capacity
        slot_base = torch.arange(W, device=device) * capacity
    num_pairs = W * T
    pair_index = torch.arange(num_pairs, device=device)
    # Kept pairs take their slot, the others a private place past num_slots (every scatter index unique).
    pair_slot = torch.where(kept, slot_base.view(W, 1) + position, num_slots + pair_index.view(W, T))  # [W, T]
    slot_pair = torch.full((num_slots + num_pairs,), num_pairs, device=device, dtype=torch.int64)
    slot_pair.scatter_(0, pair_slot.reshape(-1), pair_index)
    slot_pair = slot_pair[:num_slots]  # [n_slots] pair in slot s (num_pairs: padding)
    pair_token = torch.cat([torch.arange(T, device=device).repeat(W), torch.tensor([T], device=device)])
    slot_token = pair_token.index_select(0, slot_pair)
    padding_ids = torch.full((1, top_k), experts_per_rank, device=device, dtype=torch.int32)
    slot_local_ids = torch.cat([pair_local_ids.reshape(num_pairs, top_k), padding_ids]).index_select(0, slot_pair)
    # Each token's kept slots in rank order: a stable sort moves kept destinations first, ascending.
    order = torch.sort(torch.where(kept, 0, 1), dim=0, stable=True).indices[:min(top_k, W)]  # [R, T]
    token_slots = torch.where(kept.gather(0, order), pair_slot.gather(0, order), num_slots)
    return dict(slot_token=slot_token, slot_local_ids=slot_local_ids, token_slots=token_slots, send_sizes=send_sizes,
                recv_sizes=recv_sizes, num_recv=num_recv, padded=capacity is not None, wanted_rows=wanted_rows,
                dropped_rows=wanted_rows - send_counts)


# Agreement with the references: one tolerance table and one comparison for every test and benchmark (the tests
# import them through tests/helpers.py; scripts/ and the Hub benchmark from here).
#
# TOLERANCE bounds the norm-wise relative error ||out - ref|| / ||ref|| by the dtype of the inputs. It is sized for
# the op with the most roundings, the MoE forward: the [T*k, F] intermediate, the weighted [T*k, H] expert rows and
# the output are each rounded to the input dtype once and everything else accumulates in fp32, so its error is a few
# unit roundoffs u (bf16 2^-8 = 3.9e-3, fp16 2^-11 = 4.9e-4; tests/cases.py's forward cases measure bf16 9e-3 = 2.3u
# and fp16 4e-4 = 0.8u), and the bound is 5u for both half precisions. fp32 only reorders fp32 sums (2e-7 measured);
# 1e-4 leaves room for a GPU's fp32 dots over K up to 16k and still catches a 0.1% error in the routing weights
# (4e-4). tf32, when torch allows it, is not held to this row. float64 inputs (binned copies) only reorder float64
# sums. Ops that round less than the forward (the binned copies round once) pass far inside these bounds; their
# tests add exact checks of their own (integers, exact zeros). The benchmarks (scripts/bench*.py, the Hub benchmark)
# hold real model sizes to the same table.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-4, torch.float16: 2.5e-3, torch.bfloat16: 2e-2}


def relative_error(out, ref):
    """||out - ref|| / ||ref|| in float64; NaN when `out` is not finite."""
    out, ref = out.detach().double(), ref.detach().double().to(out.device)
    if not torch.isfinite(out).all():
        return float("nan")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(out, ref, dtype=None, what="output", *, exact_zeros=False, tolerance=None):
    """out within TOLERANCE[dtype] (default: out's dtype; `tolerance` overrides) of ref by RMS relative error; never
    NaN or inf.

    On failure the message gives the RMS and the max relative error and the worst element (index, got, expected).
    exact_zeros: where ref is exactly zero (dropped, unused, padding), out must be exactly zero too."""
    dtype = out.dtype if dtype is None else dtype
    tolerance = TOLERANCE[dtype] if tolerance is None else tolerance
    out = out.detach().double().cpu()
    ref = ref.detach().double().cpu()
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    bad = ~torch.isfinite(out)
    assert not bad.any(), f"{what}: non-finite values at {bad.nonzero()[:5].tolist()} (unwritten?)"
    if exact_zeros:
        stray = (ref == 0) & (out != 0)
        assert not stray.any(), f"{what}: nonzero where the reference is zero at {stray.nonzero()[:5].tolist()}"
    if not out.numel():
        return
    diff = (out - ref).abs()
    rms_rel = (diff.norm() / ref.norm().clamp_min(1e-30)).item()
    max_rel = (diff.max() / ref.abs().max().clamp_min(1e-30)).item()
    worst = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    assert rms_rel <= tolerance, (
        f"{what}: rms rel err {rms_rel:.3e} > {tolerance:.1e} ({dtype}); max rel err {max_rel:.3e}, worst at {worst}: "
        f"got {out[worst].item():.6g}, expected {ref[worst].item():.6g}")


# Routing in half precision may pick another expert where two scores are within rounding of each other; checks of
# a kernel's routing against moe_router_ref ask for this share of tokens with exactly the reference's k experts.
ROUTING_AGREEMENT_MIN = 0.99


def routing_agreement(ids, ref_ids):
    """Share of tokens whose set of k experts equals the reference's."""
    ids, ref_ids = ids.detach().long().cpu(), ref_ids.detach().long().cpu()
    return (ids.sort(-1).values == ref_ids.sort(-1).values).all(-1).float().mean().item()


def dequantize_fp8_ref(w_fp8, scale, block_shape=(128, 128), *, n_axis=1):
    """float64 w_fp8 * scale, from the `weight_scale_inv` convention: w_fp8 [E, d1, d2]; scale [E] (per tensor),
    [E, N] (per output channel, N = dimension `n_axis`) or [E, ceil(d1/b1), ceil(d2/b2)] (per (b1, b2) block, a
    trailing partial block keeping its own scale)."""
    w = w_fp8.to(torch.float64)
    scale = scale.to(torch.float64)
    if scale.dim() == 1:
        return w * scale[:, None, None]
    if scale.dim() == 2:
        return w * (scale[:, :, None] if n_axis == 1 else scale[:, None, :])
    b1, b2 = block_shape
    out = torch.empty_like(w)
    for i in range(scale.shape[1]):
        for j in range(scale.shape[2]):
            rows, cols = slice(i * b1, (i + 1) * b1), slice(j * b2, (j + 1) * b2)
            out[:, rows, cols] = w[:, rows, cols] * scale[:, i, j, None, None]
    return out



def fp8_block_gemm_ref(a, a_scale, b, b_scale, block=128):
    """-> out [M, N] float64 = (a * a_scale) @ (b * b_scale)^T, DeepSeek-style block-scaled fp8 operands: a [M, K] with
    a_scale [M, ceil(K/block)] (one scale per row and K block), b [N, K] with b_scale [ceil(N/block), ceil(K/block)]."""
    a64 = dequantize_fp8_ref(a[None], a_scale[None], (1, block))[0]
    b64 = dequantize_fp8_ref(b[None], b_scale[None], (block, block))[0]
    return a64 @ b64.T


def fp8_block_grouped_gemm_ref(a, a_scale, b, b_scale, expert_offsets, block=128):
    """-> out [expert_offsets[-1], N] float64: rows [o_e, o_{e+1}) of a (sorted by expert) times expert e's b[e]
    [N, K] with b_scale[e] (`fp8_block_gemm_ref`); expert_offsets [E + 1]."""
    offsets = expert_offsets.tolist()
    out = torch.zeros(offsets[-1], b.shape[1], dtype=torch.float64, device=a.device)
    for e in range(b.shape[0]):
        lo, hi = offsets[e], offsets[e + 1]
        if hi > lo:
            out[lo:hi] = fp8_block_gemm_ref(a[lo:hi], a_scale[lo:hi], b[e], b_scale[e], block)
    return out

def fp8_block_gated_grouped_gemm_ref(a, a_scale, b, b_scale, expert_offsets, *, activation="silu", gate_bias=None,
                                     up_bias=None, alpha=1.702, limit=7.0, block=128):
    """-> (h float8_e4m3fn [rows, F], h_scale float32 [rows, F / block]): GEMM1 of the w8a8 experts with its
    activation and the quantization of h (`quantize_fp8_groups_codes_ref`), the sums and the activation in float64
    then rounded to fp32 (as the kernel holds them). b [E, 2F, K] holds each expert's gate rows then its up rows;
    gate_bias and up_bias [E, F]; a, a_scale, b_scale and expert_offsets as in `fp8_block_grouped_gemm_ref`."""
    gate_up = fp8_block_grouped_gemm_ref(a, a_scale, b, b_scale, expert_offsets, block)
    gate, up = gate_up.chunk(2, dim=1)
    if gate_bias is not None:
        for e, (lo, hi) in enumerate(_segments(expert_offsets)):
            gate[lo:hi] += _f64(gate_bias[e])
            up[lo:hi] += _f64(up_bias[e])
    return quantize_fp8_groups_codes_ref(_activation(gate, up, activation, alpha, limit), block)


# e2m1 (MXFP4's element type) by 4-bit code: bit 3 the sign, bits 1-2 the exponent (bias 1), bit 0 the mantissa; code
# 8 is -0.
E2M1_TABLE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4_ref(blocks, scale):
    """float64 MXFP4 weight [E, N, K] (OCP Microscaling, as GPT-OSS stores it): blocks uint8 [E, N, K/32, 16] or
    [E, N, K/2], two e2m1 codes a byte, the low nibble the even K index; scale uint8 or float8_e8m0fnu [E, N, K/32],
    code c = 2^(c - 127) for the 32 values of its group along K, c = 255 NaN."""
    E, N = blocks.shape[:2]
    packed = blocks.reshape(E, N, -1).to(torch.int64)
    table = torch.tensor(E2M1_TABLE, dtype=torch.float64, device=blocks.device)
    values = torch.stack((table[packed % 16], table[packed // 16]), dim=-1).reshape(E, N, -1)
    codes = (scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale).to(torch.float64)
    factor = torch.where(codes == 255, float("nan"), 2.0 ** (codes - 127))
    return values * factor.repeat_interleave(32, dim=-1)


def quantize_mxfp4_ref(w):
    """w [E, N, K] (K a multiple of 32) -> (blocks uint8 [E, N, K/32, 16], scale codes uint8 [E, N, K/32]) by the
    documented rule, in float64 (exact for weights float32 holds): per group of 32 along K the scale is
    2^(floor(log2 amax) - 2) clamped to [2^-127, 2^127], each value / scale goes to the nearest e2m1 value (ties to the
    even code, beyond 6 to 6, the sign kept); an all-zero group gets code 0 and +0 values, a group holding NaN or inf
    code 255 and zero codes."""
    E, N, K = w.shape
    groups = w.to(torch.float64).reshape(E, N, K // 32, 32)
    finite = torch.isfinite(groups).all(dim=-1)
    amax = torch.where(torch.isfinite(groups), groups.abs(), 0.0).amax(dim=-1)
    exponent = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
    exponent = torch.where(amax > 0, exponent, -127.0)
    scaled = groups / 2.0 ** exponent[..., None]
    table = torch.tensor(E2M1_TABLE[:8], dtype=torch.float64, device=w.device)
    distance = (scaled.abs().clamp(max=6.0)[..., None] - table).abs()  # [E, N, K/32, 32, 8]; saturated first
    nearest = distance == distance.amin(dim=-1, keepdim=True)  # one code, or two neighbours at a midpoint
    even = torch.arange(8, device=w.device) % 2 == 0
    code = torch.where((nearest & even).any(dim=-1), (nearest & even).int().argmax(dim=-1), nearest.int().argmax(-1))
    code = code + 8 * torch.signbit(scaled).long()
    code = torch.where(finite[..., None], code, 0)
    blocks = (code[..., 0::2] + 16 * code[..., 1::2]).to(torch.uint8)
    scale = torch.where(finite, exponent + 127, 255.0).to(torch.uint8)
    return blocks, scale


def fused_experts_fp8_ref(hidden_states, w_gate_up, w_down, topk_ids, topk_weights, *, w_gate_up_scale=None,
                          w_down_scale=None, fp8_block_shape=(128, 128), transposed=False, gate_up_bias=None,
                          down_bias=None, experts_per_chunk=None, **kwargs):
    """`fused_experts_ref` on the float64 dequantized weights (a float weight without a scale is used as it is).

    `experts_per_chunk` dequantizes that many experts at a time (real model sizes: DeepSeek-V3's gate_up weights are
    60 GB in float64); each chunk adds the contributions of its experts."""
    num_experts = w_down.shape[0]
    chunk = num_experts if experts_per_chunk is None else experts_per_chunk
    n_axis = 2 if transposed else 1
    ids = topk_ids.detach().long()
    out = None
    for start in range(0, num_experts, chunk):
        stop = min(num_experts, start + chunk)
        inside = (ids >= start) & (ids < stop)
        if chunk < num_experts and not inside.any():
            continue
        part = slice(start, stop)
        w1, w2 = w_gate_up[part], w_down[part]
        if w_gate_up_scale is not None:
            w1 = dequantize_fp8_ref(w1, w_gate_up_scale[part], fp8_block_shape, n_axis=n_axis)
        if w_down_scale is not None:
            w2 = dequantize_fp8_ref(w2, w_down_scale[part], fp8_block_shape, n_axis=n_axis)
        local_ids = torch.where(inside, ids - start, -1)
        term = fused_experts_ref(hidden_states, w1, w2, local_ids, topk_weights, transposed=transposed,
                                 gate_up_bias=gate_up_bias[part] if gate_up_bias is not None else None,
                                 down_bias=down_bias[part] if down_bias is not None else None, **kwargs)
        out = term if out is None else out + term
    if out is None:
        out = torch.zeros(hidden_states.shape, dtype=torch.float64, device=hidden_states.device)
    return out


# The w8a8 FP8 path's activation quantization, modelled in the arithmetic the kernels use (fp32, e4m3fn, round to
# nearest even, saturating): a group g of values v (one row, `group` consecutive columns) gets
#   amax = max(max |v_g|, W8A8_MIN_AMAX),  q = e4m3(clamp(v * (448 / amax), -448, 448)),  v ≈ q * (amax / 448)
# and with a static scale s:  q = e4m3(clamp(v / s, -448, 448)),  v ≈ q * s.
W8A8_MIN_AMAX = 1e-10
FP8_E4M3_MAX = 448.0

# RMS relative error of `fused_experts` on the w8a8 path against the float64 experts on the dequantized weights
# (fused_experts_fp8_ref), which do not quantize activations. Rounding to e4m3 (3 mantissa bits: a step of 2^-3
# relative to the binade, uniform error of that step / sqrt(12)) gives one element an RMS relative error of
# 2^-3 / sqrt(12) * sqrt(E[1/m^2]) = 0.0266 over mantissas m in [1, 2) (log-uniform). A dot product over K terms
# sums K independent errors, and on data without structure its value grows by sqrt(K) too, so the relative error of
# a GEMM output stays about that of one element: 2.7 % for the quantized x in GEMM1 and 2.7 % for the quantized
# intermediate in GEMM2, ~3.8 % together (the GEMM1 error passes through silu(gate) * up with a gain near 1; measured
# 3.9-4.5 % on the CPU tests' random experts, 4.3 % at real sizes). The bound is 1.6x that RMS: it catches a wrong
# scale (a factor 2 in one group or one K step moves the output by far more) but not a misrounding of single
# elements, which the comparison with the w8a8 model below (fused_experts_w8a8_ref) catches.
W8A8_TOLERANCE = 0.08
# A block-scaled fp8 GEMM against fp8_block_gemm_ref (the operands already fp8): bf16 output rounding (2^-9) and the FP8
# tensor cores' own accumulation within each 128-wide K block (narrower than fp32), over sums of a few thousand products.
FP8_GEMM_TOLERANCE = 1e-2

# Tight bound of the w8a8 kernels against their model (fused_experts_w8a8_ref) with fp32 activations: kernel and model
# round the same fp32 values to e4m3 with the same fp32 operations, so they differ by the order of fp32 sums (~1e-7)
# unless an intermediate value lies within that of an e4m3 rounding boundary (one element one step off: ~1e-2 on its
# row); measured 5e-8 to 1.2e-7 over tests/test_fp8.py's cases.
W8A8_MODEL_TOLERANCE = 1e-5
# On a GPU the bound is looser: Hopper's FP8 wgmma keeps fewer bits than fp32 in each K step's sum, so kernel and
# model round a few intermediate values to neighbouring e4m3 values (1/16 relative each, on a tiny F a visible share
# of a row). wgmma runs tiles of BLOCK_M >= 64 and, operands swapped, the smaller ones (planner.w8a8_gemm_kernel; only
# tiles that stay on mma.sync, on fp16-converted operands with fp32 sums, stay within 1e-5). The H200 measured 2e-4
# to 3.8e-3 RMS on tests/test_fp8_persistent.py's cases and 1.05e-2 on F = 80 with fp16 activations and per-expert
# static scales (test_w8a8_half_precision_and_default_block, swapped tiles). Still 4x tighter than W8A8_TOLERANCE; the
# error against the dequantized weights is unchanged (4.2-4.5e-2 at real sizes, as vLLM's FP8 kernel).
W8A8_MODEL_TOLERANCE_GPU = 2e-2


def w8a8_model_tolerance(device):
    """The tight bound of a w8a8 kernel against `fused_experts_w8a8_ref` on `device` ("cpu"/"cuda" or a device)."""
    return W8A8_MODEL_TOLERANCE if torch.device(device).type == "cpu" else W8A8_MODEL_TOLERANCE_GPU


def quantize_fp8_groups_ref(v, group, static_scale=None):
    """v [M, K] -> float64 q * scale of the w8a8 quantization (model above) with one scale per row and `group`
    columns, or the static scale (a 0-d tensor or float)."""
    v = v.to(torch.float32)
    if static_scale is not None:
        scale = torch.as_tensor(static_scale, dtype=torch.float32, device=v.device)
        q = (v / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        return q.to(torch.float64) * scale.to(torch.float64)
    q, scale = quantize_fp8_groups_codes_ref(v, group)
    M, groups = scale.shape
    return (q.to(torch.float64).view(M, groups, group) * scale.to(torch.float64)[:, :, None]).view(
        M, groups * group)[:, :v.shape[1]]


def quantize_fp8_groups_codes_ref(v, group):
    """v [M, K] -> (q float8_e4m3fn [M, cdiv(K, group) * group], scale float32 [M, cdiv(K, group)]): the w8a8
    quantization (model above) with one scale per row and `group` columns, v ~ q * scale (columns past K zero)."""
    v = v.to(torch.float32)
    M, K = v.shape
    groups = -(-K // group)
    padded = torch.nn.functional.pad(v, (0, -K % group)).view(M, groups, group)
    amax = padded.abs().amax(dim=2, keepdim=True).clamp_min(W8A8_MIN_AMAX)
    q = (padded * (FP8_E4M3_MAX / amax)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(M, groups * group), (amax / FP8_E4M3_MAX)[:, :, 0]


def _expert_scale(scale, e):
    """A static input scale's value for expert e (scale of shape [], [1] or [E])."""
    return None if scale is None else scale.reshape(-1)[e if scale.numel() > 1 else 0]


def fused_experts_w8a8_ref(hidden_states, w_gate_up, w_down, topk_ids, topk_weights, *, w_gate_up_scale,
                           w_down_scale, groups, fp8_block_shape=(128, 128), gate_up_input_scale=None,
                           down_input_scale=None, activation="silu", gate_up_bias=None, down_bias=None,
                           interleaved=False, transposed=False, swiglu_alpha=1.702, swiglu_limit=7.0,
                           experts_per_chunk=16, gemm_out_dtype=None):
    """The w8a8 path's arithmetic in float64 except its quantizations: x rows quantized per `groups[0]` columns (or
    with gate_up_input_scale), GEMM1 on the dequantized weights, bias, activation, the intermediate (rounded to fp32,
    as the kernel holds it) quantized per `groups[1]` columns (or with down_input_scale), GEMM2, down bias. The
    weights are dequantized `experts_per_chunk` experts at a time. `gemm_out_dtype`: both GEMMs' sums rounded to it
    before their biases (the Gluon engine, gemm/gluon_experts.py: its GEMM writes bf16). -> [T, H] float64."""
    n_axis = 2 if transposed else 1
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    ids = topk_ids.detach().long()
    weights = _f64(topk_weights)
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    hit = [e for e in ids.unique().tolist() if 0 <= e < w_down.shape[0]]
    for start in range(0, w_down.shape[0], experts_per_chunk):
        chunk = [e for e in hit if start <= e < start + experts_per_chunk]
        if not chunk:
            continue
        part = slice(start, start + experts_per_chunk)
        w1 = dequantize_fp8_ref(w_gate_up[part], w_gate_up_scale[part], fp8_block_shape, n_axis=n_axis)
        w2 = dequantize_fp8_ref(w_down[part], w_down_scale[part], fp8_block_shape, n_axis=n_axis)
        bias = gate_up_bias[part] if gate_up_bias is not None else None
        gate, up, down, (gate_bias, up_bias) = split_gate_up_ref(w1, w2, bias, interleaved=interleaved,
                                                                 transposed=transposed)
        for e in chunk:
            _w8a8_expert_ref(out, x, ids, weights, e, e - start, gate, up, down, gate_bias, up_bias, down_bias,
                             groups, gate_up_input_scale, down_input_scale, activation, swiglu_alpha, swiglu_limit,
                             gemm_out_dtype)
    return out.reshape(hidden_states.shape)


def _w8a8_expert_ref(out, x, ids, weights, e, local, gate, up, down, gate_bias, up_bias, down_bias, groups,
                     gate_up_input_scale, down_input_scale, activation, alpha, limit, gemm_out_dtype=None):
    """Adds expert e's weighted rows to out (float64): `local` indexes e in the dequantized chunk."""
    def gemm_out(t):
        return t if gemm_out_dtype is None else t.to(gemm_out_dtype).to(torch.float64)

    token, slot = (ids == e).nonzero(as_tuple=True)
    rows = quantize_fp8_groups_ref(x[token], groups[0], _expert_scale(gate_up_input_scale, e))
    g, u = gemm_out(rows @ gate[local].T), gemm_out(rows @ up[local].T)
    if gate_bias is not None:
        g, u = g + _f64(gate_bias[local]), u + _f64(up_bias[local])
    h = _activation(g, u, activation, alpha, limit)
    h = quantize_fp8_groups_ref(h, groups[1], _expert_scale(down_input_scale, e))
    y = gemm_out(h @ down[local].T)
    if down_bias is not None:
        y = y + _f64(down_bias[e])
    out.index_add_(0, token, weights[token, slot, None] * y)
