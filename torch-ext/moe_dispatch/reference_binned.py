"""Float64 references of binned routing and its row copies (MegaBlocks semantics: binned, padded and plain gather /
scatter / scatter_wgrad), the capacity keep masks and expert parallelism's routing plan (`moe_dispatch.reference`
names them all). Plain torch, nothing else.
"""

import torch

from .reference_moe import _f64


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
