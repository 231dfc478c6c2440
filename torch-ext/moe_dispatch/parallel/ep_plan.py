"""The expert-parallel routing plan on the device: which rows a rank sends where (parallel/expert_parallel.py's
`_plan`).

Rank d of W holds experts [d * E_local, (d + 1) * E_local). A pair (destination d, token t) is wanted when one of
t's top_k ids lives on d (ids outside [0, E) live nowhere); d's rows are its wanted tokens in token order, and the
plan gives each kept pair a slot of the send buffer, slots grouped by destination::

    topk_ids [T, top_k]
      -> _count_rows_kernel     (dropless only) counts[d] = wanted pairs of d            -> counts [2W] (send half)
         ... counts exchange and the one host read of the split sizes, in parallel/expert_parallel.py ...
      -> _route_rows_kernel     per destination, a running prefix over the tokens: slot of each kept pair,
                                slot_token / slot_local_ids of each slot, padding, stats  -> pair_slot [W, T]
      -> _token_slots_kernel    per token, its kept slots in rank order                 -> token_slots [R, T]

Capacity mode (C rows per destination): slot_base[d] = d * C and pairs past C are dropped; nothing is read on the
host. Dropless: slot_base[d] = counts[0] + ... + counts[d - 1], summed in the kernel from the exchanged counts.
Launchers trust their arguments for results (consistent counts, the T and top_k of `topk_ids`) but never for
memory: ids only decide which pairs are wanted, and every slot a kernel writes is bounded by the slot count.
"""

import torch
import triton
import triton.language as tl

from ..host.device import is_interpreter, on_gpu
from ..host.host_math import cdiv, next_power_of_2
from ..host.replay import launch


@triton.jit
def _wanted_chunk(ids_ptr, stride_ids_t, stride_ids_j, offs_t, T, first_expert, experts_per_rank,
                  TOP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """(wanted [BLOCK_T] int32, on_rank [BLOCK_T, BLOCK_K], local ids [BLOCK_T, BLOCK_K] int64) of tokens offs_t
    for the destination holding experts [first_expert, first_expert + experts_per_rank)."""
    offs_j = tl.arange(0, BLOCK_K)
    mask = (offs_t < T)[:, None] & (offs_j < TOP_K)[None, :]
    b_ids = tl.load(ids_ptr + offs_t[:, None] * stride_ids_t + offs_j[None, :] * stride_ids_j, mask=mask, other=-1)
    b_local = b_ids.to(tl.int64) - first_expert  # [BLOCK_T, BLOCK_K]
    b_on = mask & (b_local >= 0) & (b_local < experts_per_rank)
    return tl.max(b_on.to(tl.int32), axis=1), b_on, b_local


@triton.jit
def _count_rows_kernel(
    ids_ptr, counts_ptr,
    T, stride_ids_t, stride_ids_j, experts_per_rank,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Grid: (W,). Program d walks all T tokens and writes counts[d], the number of tokens with an expert on d."""
    d = tl.program_id(0)
    first_expert = d.to(tl.int64) * experts_per_rank
    total = tl.zeros((), dtype=tl.int64)
    for t0 in range(0, T, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        b_wanted, _, _ = _wanted_chunk(ids_ptr, stride_ids_t, stride_ids_j, offs_t, T, first_expert,
                                       experts_per_rank, TOP_K, BLOCK_K)
        total += tl.sum(b_wanted.to(tl.int64), axis=0)
    tl.store(counts_ptr + d, total)


@triton.jit
def _route_rows_kernel(
    ids_ptr, counts_ptr, pair_slot_ptr, slot_token_ptr, slot_local_ids_ptr, stats_ptr,
    T, stride_ids_t, stride_ids_j, experts_per_rank, world_size, capacity, num_slots,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DROPLESS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Grid: (W,). Program d owns destination d: row pair_slot[d, :], the slots of d's segment and stats[:, d].

    Walking the tokens in BLOCK_T chunks with a running count, pair (d, t) gets position p = the number of earlier
    tokens wanting d; kept pairs (dropless: all wanted; capacity: p < C) take slot slot_base + p, where
    slot_token[slot] = t and slot_local_ids[slot, j] = t's j-th id on d (E_local where it lives elsewhere); other
    pairs get pair_slot = num_slots ("no slot"). Capacity mode then pads the unused slots [kept, C) of the segment
    (slot_token T, ids E_local). stats[0, d] = wanted pairs, stats[1, d] = dropped ones."""
    d = tl.program_id(0)
    first_expert = d.to(tl.int64) * experts_per_rank
    if DROPLESS:
        offs_w = tl.arange(0, BLOCK_W)
        b_counts = tl.load(counts_ptr + offs_w, mask=offs_w < d, other=0)
        slot_base = tl.sum(b_counts.to(tl.int64), axis=0)  # exclusive prefix of the send counts
    else:
        slot_base = d.to(tl.int64) * capacity
    first_pair = d.to(tl.int64) * T  # pair_slot row d
    offs_j = tl.arange(0, BLOCK_K)
    position = tl.zeros((), dtype=tl.int64)  # wanted pairs of d among the tokens before this chunk
    for t0 in range(0, T, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        mask_t = offs_t < T
        b_wanted, b_on, b_local = _wanted_chunk(ids_ptr, stride_ids_t, stride_ids_j, offs_t, T, first_expert,
                                                experts_per_rank, TOP_K, BLOCK_K)
        b_position = position + (tl.cumsum(b_wanted, axis=0) - b_wanted).to(tl.int64)  # [BLOCK_T] exclusive
        b_kept = b_wanted != 0
        if not DROPLESS:
            b_kept = b_kept & (b_position < capacity)  # the earliest C tokens per destination
        b_slot = slot_base + b_position
        b_kept = b_kept & (b_slot >= 0) & (b_slot < num_slots)  # bounds every slot written (counts are the caller's)
        tl.store(pair_slot_ptr + first_pair + offs_t, tl.where(b_kept, b_slot, num_slots), mask=mask_t)
        tl.store(slot_token_ptr + b_slot, offs_t, mask=b_kept)
        b_ids = tl.where(b_on, b_local, experts_per_rank).to(tl.int32)  # [BLOCK_T, BLOCK_K]
        tl.store(slot_local_ids_ptr + b_slot[:, None] * TOP_K + offs_j[None, :], b_ids,
                 mask=b_kept[:, None] & (offs_j < TOP_K)[None, :])
        position += tl.sum(b_wanted.to(tl.int64), axis=0)
    kept_rows = position
    if not DROPLESS:
        kept_rows = tl.minimum(position, capacity)
        for c0 in range(0, capacity, BLOCK_T):
            offs_c = c0 + tl.arange(0, BLOCK_T).to(tl.int64)
            b_slot = slot_base + offs_c
            mask_c = (offs_c >= kept_rows) & (offs_c < capacity) & (b_slot < num_slots)
            tl.store(slot_token_ptr + b_slot, tl.zeros_like(offs_c) + T, mask=mask_c)
            b_pad = tl.full((BLOCK_T, BLOCK_K), 0, tl.int32) + experts_per_rank
            tl.store(slot_local_ids_ptr + b_slot[:, None] * TOP_K + offs_j[None, :], b_pad,
                     mask=mask_c[:, None] & (offs_j < TOP_K)[None, :])
    tl.store(stats_ptr + d, position)
    tl.store(stats_ptr + world_size + d, position - kept_rows)


@triton.jit
def _token_slots_kernel(
    pair_slot_ptr, token_slots_ptr,
    T, world_size, num_slots,
    NUM_RANKS_PER_TOKEN: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Grid: (cdiv(T, BLOCK_T),). Each program owns BLOCK_T tokens: walking d = 0, 1, ... it appends each kept
    pair_slot[d, t] to token_slots[:, t], then fills the rest of the column with num_slots ("no slot")."""
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    b_count = tl.zeros((BLOCK_T,), dtype=tl.int64)  # kept slots of each token so far
    for _ in range(0, world_size):
        b_slot = tl.load(pair_slot_ptr + offs_t, mask=mask_t, other=num_slots)  # row d of pair_slot, d ascending
        pair_slot_ptr += T
        b_kept = (b_slot >= 0) & (b_slot < num_slots)
        tl.store(token_slots_ptr + b_count * T + offs_t, b_slot, mask=b_kept & (b_count < NUM_RANKS_PER_TOKEN))
        b_count += b_kept.to(tl.int64)
    for c in tl.static_range(NUM_RANKS_PER_TOKEN):
        tl.store(token_slots_ptr + c * T + offs_t, tl.zeros_like(offs_t) + num_slots, mask=mask_t & (b_count <= c))


def _block_tokens(device):
    """Tokens per chunk: the interpreter pays per chunk in Python, so a small block there keeps the tests' chunk
    carries exercised at tiny T; a GPU program walks 1024 tokens at once (a few registers per thread)."""
    return 16 if is_interpreter() or not on_gpu(device) else 1024


def count_rows(topk_ids, world_size, experts_per_rank):
    """int64 [2W]: [:W] = rows this rank sends to each destination (tokens with an expert there), one launch;
    [W:] is left for the received counts (the exchange fills it)."""
    T, top_k = topk_ids.shape
    counts = torch.empty(2 * world_size, dtype=torch.int64, device=topk_ids.device)
    if T == 0:
        counts[:world_size].zero_()
        return counts
    launch(_count_rows_kernel, (world_size,),
        topk_ids, counts,
        T, topk_ids.stride(0), topk_ids.stride(1), experts_per_rank,
        TOP_K=top_k,
        BLOCK_K=next_power_of_2(top_k),
        BLOCK_T=_block_tokens(topk_ids.device),
    )
    return counts


def route_rows(topk_ids, world_size, experts_per_rank, capacity, counts, num_slots):
    """(slot_token [n_slots] int64, slot_local_ids [n_slots, top_k] int32, token_slots [R, T] int64, stats [2, W]
    int64: wanted rows, dropped rows), R = min(top_k, W). `capacity` None: dropless, slots placed by `counts[:W]`
    (`count_rows`' send counts, n_slots their sum); else C, n_slots = W * C. Two launches; none when T = 0."""
    T, top_k = topk_ids.shape
    device = topk_ids.device
    num_ranks_per_token = min(top_k, world_size)
    slot_token = torch.empty(num_slots, dtype=torch.int64, device=device)
    slot_local_ids = torch.empty((num_slots, top_k), dtype=torch.int32, device=device)
    token_slots = torch.empty((num_ranks_per_token, T), dtype=torch.int64, device=device)
    stats = torch.empty((2, world_size), dtype=torch.int64, device=device)
    if T == 0:  # nothing wanted: every slot is padding
        return slot_token.fill_(0), slot_local_ids.fill_(experts_per_rank), token_slots, stats.zero_()
    pair_slot = torch.empty((world_size, T), dtype=torch.int64, device=device)  # slot of pair (d, t), n_slots: none
    block_t = _block_tokens(device)
    # With no slot at all nothing is stored there: any tensor stands in for the empty ones.
    launch(_route_rows_kernel, (world_size,),
        topk_ids, counts if counts is not None else stats, pair_slot,
        slot_token if num_slots else pair_slot,
        slot_local_ids if num_slots else pair_slot,
        stats,
        T, topk_ids.stride(0), topk_ids.stride(1), experts_per_rank, world_size, capacity or 0, num_slots,
        TOP_K=top_k,
        BLOCK_K=next_power_of_2(top_k),
        DROPLESS=capacity is None,
        BLOCK_W=next_power_of_2(world_size),
        BLOCK_T=block_t,
    )
    launch(_token_slots_kernel, (cdiv(T, block_t),),
        pair_slot, token_slots,
        T, world_size, num_slots,
        NUM_RANKS_PER_TOKEN=num_ranks_per_token,
        BLOCK_T=block_t,
    )
    return slot_token, slot_local_ids, token_slots, stats
