"""Dispatch metadata: where each (token, expert) assignment goes, computed on the device without host syncs.

An assignment is a = t * top_k + j (token t's j-th expert). `dispatch` sorts the N = T * top_k assignments by expert
(stably: token order is kept inside an expert) and builds the tile map the grouped GEMMs walk:

  _chunk_histogram_kernel    per chunk of CHUNK assignments: how many go to each expert
  _chunk_prefix_kernel       per expert: its count in the chunks before each chunk, and its total
  _assign_positions_kernel   per chunk: expert start + chunk prefix + stable rank -> sorted position; writes
                             gather_idx and scatter_idx, and a slice of the tile map

Up to SINGLE_MAX assignments `_dispatch_single_kernel` does all three in one launch, with a sort in place of the ranks
(one launch instead of three: each launch costs the host tens of microseconds). Ids outside [0, E) are
dropped: they get no position (scatter_idx = -1) and contribute nothing downstream. Ids are compared with [0, E) in
their own width (int64 ids at or past 2^31, or below -2^31, are out of range, not wrapped into it) before narrowing.

`segment_dispatch` builds the tile map from a caller's `expert_offsets` (v1 functions on already-permuted rows); it
clamps them into [0, rows] and makes them non-decreasing on the device first, so bad offsets (unchecked on a GPU)
can give wrong rows but never a tile outside the rows.

`permute_tokens` (v1 API) materialises the expert-ordered copy of the activations with row_copies' plain gather
(shared with binned routing); the fused path never does: the first GEMM gathers rows through `gather_idx` in its loads.
"""

import dataclasses

import torch
import triton
import triton.language as tl

from ..host.checks import (check_float, check_ids_in_range, check_index, check_int, check_kernel_device,
                           check_same_device, validate_option, warn_if_gradient_cut)
from ..host.device import call_scope
from ..host.host_math import cdiv, next_power_of_2
from ..host.pdl import pdl_options, wait_for_producer
from ..host.replay import launch
from .row_copies import PLAIN, Layout, launch_gather

CHUNK = 128  # assignments per program in the multi-chunk path; the rank step compares CHUNK x CHUNK ids
SINGLE_MAX = 1024  # most assignments the one-program path takes (its sort holds them all in one block)
BLOCK_CHUNKS = 1024  # chunk counts of one expert the prefix kernel scans at once
BLOCK_TILES = 1024  # tile-map entries the one-program kernels scan at once
SCAN_WARPS = 8  # one-program kernels: 256 threads sort up to SINGLE_MAX keys and hold [rows, BLOCK_E] blocks


@dataclasses.dataclass(frozen=True)
class DispatchInfo:
    """Expert-sorted order of the N = T * top_k assignments and the tile map of the grouped GEMMs.

    All tensors live on the input's device and are int32; sizes depend only on host-known T, top_k, E, block_m.
    """

    num_tokens: int  # T
    top_k: int
    num_experts: int  # E
    block_m: int  # rows per tile; a tile never spans two experts
    # expert_offsets[e] is the first sorted position of expert e; expert_offsets[E] is the number of kept assignments
    # (N minus those with an id outside [0, E)). Shape [E + 1].
    expert_offsets: torch.Tensor
    # gather_idx[p] is the assignment at sorted position p (its token is gather_idx[p] // top_k); -1 past
    # expert_offsets[E]. Shape [N].
    gather_idx: torch.Tensor
    # scatter_idx[a] is the sorted position of assignment a, -1 when it was dropped. Shape [N].
    scatter_idx: torch.Tensor
    # tile_expert[i] is the expert of row tile i, -1 for tiles past the real work (their programs exit at once).
    # Shape [max_tiles] with max_tiles = (N + min(E, N) * (block_m - 1)) // block_m, the worst case over routings.
    tile_expert: torch.Tensor
    # tile_row_start[i] is the first sorted position of tile i; its rows end at min(+block_m, expert_offsets[e + 1]).
    tile_row_start: torch.Tensor

    @property
    def num_assignments(self) -> int:
        return self.num_tokens * self.top_k

    @property
    def max_tiles(self) -> int:
        return self.tile_expert.shape[0]

    @property
    def expert_counts(self) -> torch.Tensor:
        """[E] assignments per expert (a device op, for callers and tests)."""
        return self.expert_offsets[1:] - self.expert_offsets[:-1]


def max_tiles_bound(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Most row tiles any routing of N assignments over E experts can need: each non-empty expert wastes < block_m rows."""
    return (num_assignments + min(num_experts, num_assignments) * (block_m - 1)) // block_m


@triton.jit
def _load_chunk_ids(topk_ids_ptr, chunk, N, E, stride_ids_t, stride_ids_k, TOP_K: tl.constexpr, CHUNK: tl.constexpr):
    """Expert ids of assignments [chunk * CHUNK, +CHUNK); -1 for padding and for ids outside [0, E)."""
    offs_a = chunk * CHUNK + tl.arange(0, CHUNK)
    mask_a = offs_a < N
    b_ids = tl.load(topk_ids_ptr + (offs_a // TOP_K).to(tl.int64) * stride_ids_t + (offs_a % TOP_K) * stride_ids_k,
                    mask=mask_a, other=-1)  # int32 or int64: range-checked in that width, then narrowed
    b_ids = tl.where((b_ids >= 0) & (b_ids < E), b_ids, -1).to(tl.int32)
    return offs_a, mask_a, b_ids


@triton.jit
def _histogram(b_ids, BLOCK_E: tl.constexpr):
    """[BLOCK_E] counts of the ids in a chunk (ids of -1 are not counted: they go to bin 0 and are taken off it)."""
    b_valid = b_ids >= 0
    b_counts = tl.histogram(tl.where(b_valid, b_ids, 0), BLOCK_E)
    num_dropped = tl.sum((~b_valid).to(tl.int32), axis=0)
    return b_counts - tl.where(tl.arange(0, BLOCK_E) == 0, num_dropped, 0)


@triton.jit
def _stable_rank(b_ids, CHUNK: tl.constexpr):
    """For each id in the chunk, how many earlier entries of the chunk hold the same id."""
    offs = tl.arange(0, CHUNK)
    b_same = (b_ids[:, None] == b_ids[None, :]) & (offs[None, :] < offs[:, None])  # [CHUNK, CHUNK]
    return tl.sum(b_same.to(tl.int32), axis=1)


@triton.jit
def _tile_map_block(b_counts, b_offsets, first_tile, tile_expert_ptr, tile_row_start_ptr, max_tiles,
                    BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_TILES: tl.constexpr):
    """Entries [first_tile, +BLOCK_TILES) of the tile map (see `_write_tile_map`), from the experts' row counts and
    first rows alone, with no pass over the rest of the map, so that many programs write it side by side: tile i
    belongs to the expert after every expert whose tiles end at or before i (experts with no rows end where they
    start, so they are passed over); its first row is that expert's first row plus BLOCK_M per earlier tile of the
    expert. Tiles past the real total get expert -1 and row 0."""
    b_tiles = (b_counts + BLOCK_M - 1) // BLOCK_M
    b_tiles_end = tl.cumsum(b_tiles, axis=0)
    total_tiles = tl.sum(b_tiles, axis=0)
    offs_i = first_tile + tl.arange(0, BLOCK_TILES)
    b_expert = tl.sum((b_tiles_end[None, :] <= offs_i[:, None]).to(tl.int32), axis=1)  # [BLOCK_TILES]
    b_valid = offs_i < total_tiles
    b_at = tl.where(b_valid, b_expert, 0)
    b_row = tl.gather(b_offsets, b_at, 0) + (offs_i - tl.gather(b_tiles_end - b_tiles, b_at, 0)) * BLOCK_M
    mask_i = offs_i < max_tiles
    tl.store(tile_expert_ptr + offs_i, tl.where(b_valid, b_expert, -1), mask=mask_i)
    tl.store(tile_row_start_ptr + offs_i, tl.where(b_valid, b_row, 0), mask=mask_i)


@triton.jit
def _running_max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _write_tile_map(b_counts, b_offsets, tile_expert_ptr, tile_row_start_ptr, max_tiles,
                    BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_TILES: tl.constexpr):
    """Tile i belongs to the expert whose tile range holds i; tiles past the real total get expert -1.

    The one-program kernels' map, O(max_tiles + E): each expert with rows marks its first tile (its id in
    tile_expert, its first row in tile_row_start) over a cleared map, then a running maximum over the tiles carries
    each mark to the expert's other tiles (experts, first tiles and first rows all increase along the map). The
    chunked path's programs write a slice each with `_tile_map_block` instead: no pass over the rest of the map, but
    more work per entry (a one-program map built that way measured 1.5-2x slower on the H200)."""
    offs_e = tl.arange(0, BLOCK_E)
    b_tiles = (b_counts + BLOCK_M - 1) // BLOCK_M
    b_tiles_start = tl.cumsum(b_tiles, axis=0) - b_tiles
    total_tiles = tl.sum(b_tiles, axis=0)
    for i0 in range(0, max_tiles, BLOCK_TILES):
        offs_i = i0 + tl.arange(0, BLOCK_TILES)
        tl.store(tile_expert_ptr + offs_i, tl.full((BLOCK_TILES,), -1, tl.int32), mask=offs_i < max_tiles)
    tl.debug_barrier()
    b_marks = b_tiles > 0
    tl.store(tile_expert_ptr + b_tiles_start, offs_e, mask=b_marks)
    tl.store(tile_row_start_ptr + b_tiles_start, b_offsets, mask=b_marks)
    tl.debug_barrier()
    carry_expert = total_tiles * 0 - 1  # int32 scalars, carried from one block of the map to the next
    carry_first = total_tiles * 0
    carry_row = total_tiles * 0
    for i0 in range(0, max_tiles, BLOCK_TILES):
        offs_i = i0 + tl.arange(0, BLOCK_TILES)
        mask_i = offs_i < max_tiles
        b_mark = tl.load(tile_expert_ptr + offs_i, mask=mask_i, other=-1)
        b_marked = b_mark >= 0
        b_mark_row = tl.load(tile_row_start_ptr + offs_i, mask=mask_i & b_marked, other=-1)
        b_expert = tl.maximum(tl.associative_scan(b_mark, 0, _running_max), carry_expert)
        b_first = tl.maximum(tl.associative_scan(tl.where(b_marked, offs_i, -1), 0, _running_max), carry_first)
        b_row = tl.maximum(tl.associative_scan(b_mark_row, 0, _running_max), carry_row)
        carry_expert = tl.max(b_expert, axis=0)
        carry_first = tl.max(b_first, axis=0)
        carry_row = tl.max(b_row, axis=0)
        b_valid = offs_i < total_tiles
        tl.debug_barrier()  # every load of this block before any store to it
        tl.store(tile_expert_ptr + offs_i, tl.where(b_valid, b_expert, -1), mask=mask_i)
        tl.store(tile_row_start_ptr + offs_i, tl.where(b_valid, b_row + (offs_i - b_first) * BLOCK_M, 0), mask=mask_i)


@triton.jit
def _dispatch_single_kernel(
    topk_ids_ptr, expert_offsets_ptr, gather_idx_ptr, scatter_idx_ptr, tile_expert_ptr, tile_row_start_ptr,
    N, E, max_tiles,
    stride_ids_t, stride_ids_k,
    TOP_K: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_TILES: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid: (1,). The whole dispatch for N <= CHUNK (<= SINGLE_MAX) assignments in one program: counts, offsets and
    tile map as the multi-chunk path, then one sort of the chunk's keys gives both index maps."""
    wait_for_producer(PDL)
    offs_e = tl.arange(0, BLOCK_E)
    offs_a, mask_a, b_ids = _load_chunk_ids(topk_ids_ptr, 0, N, E, stride_ids_t, stride_ids_k, TOP_K, CHUNK)
    b_counts = _histogram(b_ids, BLOCK_E)
    b_offsets = tl.cumsum(b_counts, axis=0) - b_counts  # exclusive: first position of each expert
    total = tl.sum(b_counts, axis=0)
    tl.store(expert_offsets_ptr + offs_e, b_offsets, mask=offs_e < E)
    tl.store(expert_offsets_ptr + E, total)
    _write_tile_map(b_counts, b_offsets, tile_expert_ptr, tile_row_start_ptr, max_tiles, BLOCK_E, BLOCK_M, BLOCK_TILES)

    # Sorting the keys id * CHUNK + a orders the assignments by expert, stably (a breaks ties); dropped ids and the
    # padding past N take id E, after every kept one. Sorted position p < total then holds assignment key % CHUNK.
    b_sorted = tl.sort(tl.where(b_ids >= 0, b_ids, E) * CHUNK + offs_a)
    b_assignment = b_sorted % CHUNK
    offs_p = tl.arange(0, CHUNK)
    b_kept = offs_p < total
    tl.store(gather_idx_ptr + offs_p, tl.where(b_kept, b_assignment, -1), mask=offs_p < N)
    tl.store(scatter_idx_ptr + b_assignment, tl.where(b_kept, offs_p, -1), mask=b_assignment < N)


@triton.jit
def _chunk_histogram_kernel(
    topk_ids_ptr, chunk_counts_ptr,
    N, E, n_chunks,
    stride_ids_t, stride_ids_k,
    TOP_K: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid: (n_chunks,). chunk_counts[e, c] = assignments of chunk c routed to expert e (expert-major [E, n_chunks],
    so that the prefix kernel scans each expert's counts along contiguous memory)."""
    wait_for_producer(PDL)
    chunk = tl.program_id(0)
    _, _, b_ids = _load_chunk_ids(topk_ids_ptr, chunk, N, E, stride_ids_t, stride_ids_k, TOP_K, CHUNK)
    offs_e = tl.arange(0, BLOCK_E)
    tl.store(chunk_counts_ptr + offs_e.to(tl.int64) * n_chunks + chunk, _histogram(b_ids, BLOCK_E), mask=offs_e < E)


@triton.jit
def _chunk_prefix_kernel(
    chunk_counts_ptr, chunk_prefix_ptr, expert_totals_ptr,
    n_chunks,
    BLOCK_CHUNKS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid: (E,). Program e scans its expert's row: chunk_prefix[e, c] = assignments to expert e in chunks before c,
    expert_totals[e] = all of them. The experts' rows are scanned side by side, one program each."""
    wait_for_producer(PDL)
    expert = tl.program_id(0)
    row = expert.to(tl.int64) * n_chunks
    offs_c = tl.arange(0, BLOCK_CHUNKS)
    running = expert * 0  # int32 scalar, carried from one block of the row to the next
    for c0 in range(0, n_chunks, BLOCK_CHUNKS):
        mask_c = c0 + offs_c < n_chunks
        b_counts = tl.load(chunk_counts_ptr + row + c0 + offs_c, mask=mask_c, other=0)
        tl.store(chunk_prefix_ptr + row + c0 + offs_c, tl.cumsum(b_counts, axis=0) - b_counts + running, mask=mask_c)
        running += tl.sum(b_counts, axis=0)
    tl.store(expert_totals_ptr + expert, running)


@triton.jit
def _assign_positions_kernel(
    topk_ids_ptr, chunk_prefix_ptr, expert_totals_ptr,
    expert_offsets_ptr, gather_idx_ptr, scatter_idx_ptr, tile_expert_ptr, tile_row_start_ptr,
    N, E, n_chunks, max_tiles,
    stride_ids_t, stride_ids_k,
    TOP_K: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILES_PER_CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid: (n_chunks,). Program c: sorted position of each of its assignments = first position of the id's expert
    (exclusive scan of expert_totals) + chunk_prefix[id, c] + rank among the chunk's same-id assignments; -1 into
    gather_idx at the chunk's positions no kept assignment takes (those at or past the kept total); tile map entries
    [c * TILES_PER_CHUNK, +TILES_PER_CHUNK). Program 0 also writes expert_offsets."""
    wait_for_producer(PDL)
    chunk = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    b_totals = tl.load(expert_totals_ptr + offs_e, mask=offs_e < E, other=0)
    b_offsets = tl.cumsum(b_totals, axis=0) - b_totals
    total = tl.sum(b_totals, axis=0)
    if chunk == 0:
        tl.store(expert_offsets_ptr + offs_e, b_offsets, mask=offs_e < E)
        tl.store(expert_offsets_ptr + E, total)
    offs_a, mask_a, b_ids = _load_chunk_ids(topk_ids_ptr, chunk, N, E, stride_ids_t, stride_ids_k, TOP_K, CHUNK)
    b_valid = b_ids >= 0
    b_first = tl.gather(b_offsets, tl.where(b_valid, b_ids, 0), 0)
    b_prefix = tl.load(chunk_prefix_ptr + b_ids.to(tl.int64) * n_chunks + chunk, mask=mask_a & b_valid, other=0)
    b_pos = b_first + b_prefix + _stable_rank(b_ids, CHUNK)
    tl.store(scatter_idx_ptr + offs_a, tl.where(b_valid, b_pos, -1), mask=mask_a)
    tl.store(gather_idx_ptr + b_pos, offs_a, mask=mask_a & b_valid)
    tl.store(gather_idx_ptr + offs_a, tl.full((CHUNK,), -1, tl.int32), mask=mask_a & (offs_a >= total))
    _tile_map_block(b_totals, b_offsets, chunk * TILES_PER_CHUNK, tile_expert_ptr, tile_row_start_ptr, max_tiles,
                    BLOCK_E, BLOCK_M, TILES_PER_CHUNK)


def dispatch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> DispatchInfo:
    """Sort the assignments of `topk_ids` [T, top_k] (int32/int64, any strides) by expert; see `DispatchInfo`."""
    T, top_k = topk_ids.shape
    N = T * top_k
    E = num_experts
    device = topk_ids.device
    max_tiles = max_tiles_bound(N, E, block_m)
    expert_offsets = torch.empty(E + 1, device=device, dtype=torch.int32)
    gather_idx = torch.empty(N, device=device, dtype=torch.int32)
    scatter_idx = torch.empty(N, device=device, dtype=torch.int32)
    tile_expert = torch.empty(max_tiles, device=device, dtype=torch.int32)
    tile_row_start = torch.empty(max_tiles, device=device, dtype=torch.int32)
    info = DispatchInfo(T, top_k, E, block_m, expert_offsets, gather_idx, scatter_idx, tile_expert, tile_row_start)
    if N == 0:
        expert_offsets.zero_()
        return info

    block_e = next_power_of_2(E)
    block_tiles = min(BLOCK_TILES, next_power_of_2(max_tiles))
    common = dict(TOP_K=top_k, BLOCK_E=block_e, **pdl_options(device))
    if N <= SINGLE_MAX and (E + 1) * SINGLE_MAX < 2**31:  # the sort keys id * CHUNK + a stay in int32
        launch(_dispatch_single_kernel, (1,),
            topk_ids, expert_offsets, gather_idx, scatter_idx, tile_expert, tile_row_start,
            N, E, max_tiles, topk_ids.stride(0), topk_ids.stride(1),
            CHUNK=max(16, next_power_of_2(N)), BLOCK_M=block_m, BLOCK_TILES=block_tiles, **common,
            num_warps=SCAN_WARPS,
        )
        return info

    n_chunks = cdiv(N, CHUNK)
    chunk_counts = torch.empty((E, n_chunks), device=device, dtype=torch.int32)
    chunk_prefix = torch.empty((E, n_chunks), device=device, dtype=torch.int32)
    expert_totals = torch.empty(E, device=device, dtype=torch.int32)
    launch(_chunk_histogram_kernel, (n_chunks,),
        topk_ids, chunk_counts, N, E, n_chunks, topk_ids.stride(0), topk_ids.stride(1), CHUNK=CHUNK, **common,
    )
    launch(_chunk_prefix_kernel, (E,),
        chunk_counts, chunk_prefix, expert_totals, n_chunks,
        BLOCK_CHUNKS=min(next_power_of_2(n_chunks), BLOCK_CHUNKS), **pdl_options(device),
    )
    launch(_assign_positions_kernel, (n_chunks,),
        topk_ids, chunk_prefix, expert_totals, expert_offsets, gather_idx, scatter_idx, tile_expert, tile_row_start,
        N, E, n_chunks, max_tiles, topk_ids.stride(0), topk_ids.stride(1),
        CHUNK=CHUNK, BLOCK_M=block_m, TILES_PER_CHUNK=next_power_of_2(cdiv(max_tiles, n_chunks)), **common,
    )
    return info


@call_scope
def permute_tokens(hidden_states: torch.Tensor, top_k_indices: torch.Tensor, num_experts: int, *,
                   validate: bool | None = None,
                   validate_ids: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort token copies by expert (v1 API).

    hidden_states [T, H], top_k_indices [T, top_k]. Returns (permuted_tokens [T*top_k, H], expert_offsets [E+1] int64,
    sorted_idx [T*top_k] int64, restore_idx [T*top_k] int64): permuted_tokens[p] = hidden_states[sorted_idx[p] // top_k],
    expert e owns rows [expert_offsets[e], expert_offsets[e+1]), restore_idx[a] is the row of assignment a (its inverse).
    Order inside an expert follows the assignment id (stable). Ids outside [0, E) are rejected on the CPU (see
    `validate` in fused_experts; `validate_ids` is its deprecated v1.0 spelling); on a GPU they are dropped:
    restore_idx = -1 and no row. Forward-only.
    """
    validate = validate_option(validate, validate_ids, "permute_tokens")
    check_float("hidden_states", hidden_states, ndim=2)
    check_index("top_k_indices", top_k_indices, ndim=2)
    if top_k_indices.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"top_k_indices has {top_k_indices.shape[0]} rows but hidden_states has "
                         f"{hidden_states.shape[0]} tokens")
    check_int("num_experts", num_experts, 1)
    check_same_device(hidden_states=hidden_states, top_k_indices=top_k_indices)
    check_ids_in_range("top_k_indices", top_k_indices, num_experts, validate)
    warn_if_gradient_cut("permute_tokens", hidden_states=hidden_states)
    check_kernel_device("hidden_states", hidden_states)
    info = dispatch(top_k_indices, num_experts, block_m=16)
    # The plain (unpadded) MegaBlocks gather: row p = hidden_states[gather_idx[p] // top_k], zero where gather_idx < 0.
    permuted = launch_gather(hidden_states.contiguous(), info.gather_idx, None, None, None,
                             Layout(PLAIN.value, info.top_k), info.num_assignments)
    return permuted, info.expert_offsets.long(), info.gather_idx.long(), info.scatter_idx.long()


@triton.jit
def _segment_tile_map_kernel(
    expert_offsets_ptr, stride_offsets, clean_offsets_ptr, tile_expert_ptr, tile_row_start_ptr, num_tiles_ptr,
    E, num_rows, max_tiles,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_TILES: tl.constexpr,
    COUNT_TILES: tl.constexpr,
):
    """Grid: (1,). Tile map for rows already in expert order, from the caller's expert_offsets [E + 1] (never
    trusted): clean_offsets [E + 1] gets them clamped into [0, num_rows] and made non-decreasing (a running maximum;
    equal to the input when valid), and the map is built from those; COUNT_TILES: num_tiles [1] gets the number of
    real tiles (the entries before the sentinels)."""
    offs_e = tl.arange(0, BLOCK_E)  # BLOCK_E > E: lane E holds the last offset
    b_offsets = tl.load(expert_offsets_ptr + offs_e * stride_offsets, mask=offs_e <= E, other=0)
    b_start = tl.associative_scan(tl.minimum(tl.maximum(b_offsets, 0), num_rows), 0, _running_max)
    b_next = tl.load(expert_offsets_ptr + (offs_e + 1) * stride_offsets, mask=offs_e < E, other=0)
    b_end = tl.maximum(b_start, tl.minimum(tl.maximum(b_next, 0), num_rows))  # the running maximum one lane on
    tl.store(clean_offsets_ptr + offs_e, b_start, mask=offs_e <= E)
    b_counts = (b_end - b_start).to(tl.int32)
    _write_tile_map(b_counts, b_start.to(tl.int32), tile_expert_ptr, tile_row_start_ptr, max_tiles, BLOCK_E, BLOCK_M,
                    BLOCK_TILES)
    if COUNT_TILES:
        tl.store(num_tiles_ptr, tl.sum((b_counts + BLOCK_M - 1) // BLOCK_M, axis=0))


def segment_tile_map(expert_offsets: torch.Tensor, num_rows: int, num_experts: int, block_m: int, *,
                     count_tiles: bool = False):
    """The tile map of `num_rows` rows already sorted by expert, in one launch, no host sync -> (clean_offsets [E + 1]
    (the offsets clamped into [0, num_rows] and made non-decreasing; equal to the input when valid), tile_expert and
    tile_row_start int32 [max_tiles_bound(num_rows, E, block_m)] (DispatchInfo's), and with `count_tiles` the number of
    real tiles as int32 [1], else None)."""
    device = expert_offsets.device
    clean_offsets = torch.empty(num_experts + 1, device=device, dtype=expert_offsets.dtype)
    max_tiles = max_tiles_bound(num_rows, num_experts, block_m)
    tile_expert = torch.empty(max_tiles, device=device, dtype=torch.int32)
    tile_row_start = torch.empty(max_tiles, device=device, dtype=torch.int32)
    num_tiles = torch.empty(1, device=device, dtype=torch.int32)  # written only with count_tiles
    launch(_segment_tile_map_kernel, (1,),
        expert_offsets, expert_offsets.stride(0), clean_offsets, tile_expert, tile_row_start, num_tiles, num_experts,
        num_rows, max_tiles,
        BLOCK_E=next_power_of_2(num_experts + 1), BLOCK_M=block_m,
        BLOCK_TILES=min(BLOCK_TILES, next_power_of_2(max(max_tiles, 1))), COUNT_TILES=count_tiles,
        num_warps=SCAN_WARPS,
    )
    return clean_offsets, tile_expert, tile_row_start, num_tiles if count_tiles else None


def segment_dispatch(expert_offsets: torch.Tensor, num_rows: int, num_experts: int, block_m: int,
                     gather_idx: torch.Tensor | None = None, top_k: int = 1) -> DispatchInfo:
    """DispatchInfo for `num_rows` rows already sorted by expert (v1 functions that take `expert_offsets`).

    gather_idx defaults to the identity (row p is assignment p); scatter_idx is not built (None). The offsets the
    kernels see are a sanitised copy made by the tile-map kernel (`segment_tile_map`: clamped into [0, num_rows],
    non-decreasing; equal to the input when valid): launches only, so the backward and the segment entry points replay
    (`host/replay.py`).
    """
    clean_offsets, tile_expert, tile_row_start, _ = segment_tile_map(expert_offsets, num_rows, num_experts, block_m)
    if gather_idx is None:
        gather_idx = torch.arange(num_rows, device=expert_offsets.device, dtype=torch.int32)
    return DispatchInfo(num_rows // top_k, top_k, num_experts, block_m, clean_offsets, gather_idx, None,
                        tile_expert, tile_row_start)
