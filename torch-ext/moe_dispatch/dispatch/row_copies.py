"""Row copies between token order and expert order: the kernels and raw launchers shared by dispatch/segments.py
(`permute_tokens`' plain gather) and dispatch/binned.py (MegaBlocks' plain, padded and capacity-limited copies, whose
public API, checks and autograd live there; dispatch/binned.py's docstring draws the layouts and the kernel family).

Launchers here trust their arguments (contiguous tensors, consistent routing) and allocate every output with
`torch.empty`: each kernel writes all of its output. They trust them for results only, not for memory: every index
read from `indices`, `bins` or `padded_bins` is bounded before it addresses memory (inconsistent routing, unchecked
on a GPU, gives wrong rows or zeros, never an access outside a tensor).
"""

import dataclasses

import torch
import triton
import triton.language as tl

from ..host.device import is_interpreter, on_gpu
from ..host.host_math import cdiv, next_power_of_2
from ..host.replay import launch

# LAYOUT: where sorted position p lives in the expert buffer (see dispatch/binned.py); jit code may only read constexprs
PLAIN, PADDED, BINNED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _bin_of(pos, bounds_ptr, num_bins, SEARCH_STEPS: tl.constexpr):
    """Bin holding each position: the number of (non-decreasing, inclusive) bounds <= pos; num_bins if past the end.

    A vectorised binary search: SEARCH_STEPS = bit_length(num_bins) halvings of [0, num_bins) always suffice.
    """
    lo = tl.zeros_like(pos)
    hi = lo + num_bins
    for _ in tl.static_range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        bound = tl.load(bounds_ptr + mid, mask=active, other=0).to(tl.int64)
        go_right = bound <= pos
        lo = tl.where(active & go_right, mid + 1, lo)
        hi = tl.where(active & ~go_right, mid, hi)
    return lo


@triton.jit
def _bin_start(e, bounds_ptr, mask):
    """First position of bin e: the inclusive bound of bin e - 1, 0 for bin 0."""
    return tl.load(bounds_ptr + e - 1, mask=mask & (e > 0), other=0).to(tl.int64)


@triton.jit
def _gather_kernel(
    x_ptr, out_ptr, indices_ptr, weights_ptr, bins_ptr, padded_bins_ptr,
    n_rows, H, N, num_experts, capacity,
    TOP_K: tl.constexpr,
    LAYOUT: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Grid: (cdiv(n_rows, BLOCK_R), cdiv(H, BLOCK_H)). Each program owns a [BLOCK_R, BLOCK_H] tile of the buffer
    out[n_rows, H] and writes all of it: the source row of each buffer row, or zeros where the row holds no assignment
    (unused capacity, padding). Rows are mapped one by one, so a tile may span any number of experts."""
    pid_r = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_r = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_r = offs_r < n_rows
    mask_h = offs_h < H

    if LAYOUT == PLAIN:
        b_pos = offs_r
        mask_a = mask_r
    else:
        if LAYOUT == BINNED:
            b_expert = offs_r // capacity
            b_local = offs_r % capacity
            mask_e = mask_r
        else:
            b_expert = _bin_of(offs_r, padded_bins_ptr, num_experts, SEARCH_STEPS)
            mask_e = mask_r & (b_expert < num_experts)
            b_local = offs_r - _bin_start(b_expert, padded_bins_ptr, mask_e)
        b_start = _bin_start(b_expert, bins_ptr, mask_e)
        b_end = tl.load(bins_ptr + b_expert, mask=mask_e, other=0).to(tl.int64)
        b_pos = b_start + b_local
        mask_a = mask_e & (b_pos < b_end)  # binned: b_local < C by construction, so positions >= C are never read
    mask_a = mask_a & (b_pos >= 0) & (b_pos < N)  # bins / padded_bins are caller data: bound the position too
    b_assign = tl.load(indices_ptr + b_pos, mask=mask_a, other=0).to(tl.int64)
    mask_a = mask_a & (b_assign >= 0) & (b_assign < N)  # memory safety when indices is not a permutation
    b_token = b_assign // TOP_K

    b_x = tl.load(x_ptr + b_token[:, None] * H + offs_h[None, :], mask=mask_a[:, None] & mask_h[None, :], other=0.0)
    if HAS_WEIGHTS:
        b_w = tl.load(weights_ptr + b_assign, mask=mask_a, other=0.0).to(ACC_DTYPE)
        b_x = b_x.to(ACC_DTYPE) * b_w[:, None]  # [BLOCK_R, BLOCK_H]
    tl.store(out_ptr + offs_r[:, None] * H + offs_h[None, :], b_x.to(out_ptr.dtype.element_ty),
             mask=mask_r[:, None] & mask_h[None, :])


@triton.jit
def _buffer_rows_kernel(
    indices_ptr, bins_ptr, padded_bins_ptr, buffer_row_ptr,
    N, num_experts, capacity,
    LAYOUT: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid: (cdiv(N, BLOCK),). Each program owns BLOCK sorted positions p and writes buffer_row[indices[p]]: the
    buffer row holding that assignment, -1 when binned capacity drops it. The inverse map lets scatter and wgrad
    walk tokens and assignments directly, so each of their outputs is written once, without atomics."""
    offs_p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask_p = offs_p < N
    b_assign = tl.load(indices_ptr + offs_p, mask=mask_p, other=-1).to(tl.int64)
    if LAYOUT == PLAIN:
        b_row = offs_p
    else:
        b_expert = tl.minimum(_bin_of(offs_p, bins_ptr, num_experts, SEARCH_STEPS), num_experts - 1)
        b_local = offs_p - _bin_start(b_expert, bins_ptr, mask_p)
        if LAYOUT == PADDED:
            b_row = _bin_start(b_expert, padded_bins_ptr, mask_p) + b_local
        else:
            b_row = tl.where((b_local >= 0) & (b_local < capacity), b_expert * capacity + b_local, -1)
    tl.store(buffer_row_ptr + b_assign, b_row, mask=mask_p & (b_assign >= 0) & (b_assign < N))


@triton.jit
def _scatter_kernel(
    x_ptr, out_ptr, buffer_row_ptr, weights_ptr,
    T, H, n_rows,
    TOP_K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Grid: (cdiv(T, BLOCK_T), cdiv(H, BLOCK_H)). Each program owns a [BLOCK_T, BLOCK_H] tile of out[T, H] and sums
    the token's top_k buffer rows in the fixed order j = 0..top_k-1 (deterministic); dropped assignments add 0."""
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_t = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_t = offs_t < T
    mask_h = offs_h < H

    b_acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=ACC_DTYPE)
    for j in tl.static_range(TOP_K):
        offs_a = offs_t * TOP_K + j
        b_row = tl.load(buffer_row_ptr + offs_a, mask=mask_t, other=-1)
        mask_a = (b_row >= 0) & (b_row < n_rows)
        b_x = tl.load(x_ptr + b_row[:, None] * H + offs_h[None, :], mask=mask_a[:, None] & mask_h[None, :],
                      other=0.0).to(ACC_DTYPE)
        if HAS_WEIGHTS:
            b_w = tl.load(weights_ptr + offs_a, mask=mask_a, other=0.0).to(ACC_DTYPE)
            b_x = b_x * b_w[:, None]
        b_acc += b_x
    tl.store(out_ptr + offs_t[:, None] * H + offs_h[None, :], b_acc.to(out_ptr.dtype.element_ty),
             mask=mask_t[:, None] & mask_h[None, :])


@triton.jit
def _wgrad_kernel(
    x_ptr, grad_ptr, wgrad_ptr, buffer_row_ptr,
    N, H, n_rows,
    TOP_K: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Grid: (cdiv(N, BLOCK_A),). Each program owns BLOCK_A assignments and walks the hidden dimension:
    wgrad[a] = sum_h x[buffer_row[a], h] * grad[a // top_k, h], 0 for dropped assignments."""
    offs_a = tl.program_id(0).to(tl.int64) * BLOCK_A + tl.arange(0, BLOCK_A)
    mask_n = offs_a < N
    b_row = tl.load(buffer_row_ptr + offs_a, mask=mask_n, other=-1)
    mask_a = (b_row >= 0) & (b_row < n_rows)
    b_token = offs_a // TOP_K
    b_acc = tl.zeros((BLOCK_A, BLOCK_H), dtype=ACC_DTYPE)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = mask_a[:, None] & (offs_h < H)[None, :]
        b_x = tl.load(x_ptr + b_row[:, None] * H + offs_h[None, :], mask=mask, other=0.0).to(ACC_DTYPE)
        b_g = tl.load(grad_ptr + b_token[:, None] * H + offs_h[None, :], mask=mask, other=0.0).to(ACC_DTYPE)
        b_acc += b_x * b_g  # [BLOCK_A, BLOCK_H]
    tl.store(wgrad_ptr + offs_a, tl.sum(b_acc, axis=1).to(wgrad_ptr.dtype.element_ty), mask=mask_n)


@dataclasses.dataclass(frozen=True)
class CopyConfig:
    """Tile of one program of the copy kernels. They are bandwidth-bound, so a small heuristic replaces autotuning."""

    block_rows: int  # buffer rows (gather), tokens (scatter) or assignments (wgrad) per program
    block_h: int  # hidden columns per program (a power of two; the tail is masked)
    num_warps: int


def copy_config(hidden: int, element_size: int, device: torch.device) -> CopyConfig:
    """Interpreter: few large programs (each one costs Python time). GPU: 16-byte vectors across 4 warps per row
    pass (2048 bytes of a row), and about 8 KiB of a tile per program so enough loads are in flight per SM."""
    hidden_pow2 = next_power_of_2(max(hidden, 1))
    if is_interpreter() or not on_gpu(device):
        return CopyConfig(block_rows=16, block_h=min(hidden_pow2, 256), num_warps=1)
    block_h = min(hidden_pow2, 2048 // element_size)
    block_rows = max(1, min(16, 8192 // (block_h * element_size)))
    return CopyConfig(block_rows=block_rows, block_h=block_h, num_warps=4)


_BUFFER_ROWS_BLOCK = 512  # sorted positions per program of _buffer_rows_kernel (int work, a few KiB)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Host-side description of a buffer layout: which LAYOUT, the routing's top_k and (binned) the capacity C."""

    kind: int  # PLAIN.value, PADDED.value or BINNED.value
    top_k: int
    capacity: int = 0


def _acc_dtype(*tensors):
    return tl.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else tl.float32


def launch_gather(x, indices, weights, bins, padded_bins, layout, n_rows, *, out=None):
    """buffer[n_rows, H] from x[T, H] (contiguous): every row written (the routed token row, scaled, or zeros); into
    `out` (contiguous [n_rows, H], x's dtype) when given."""
    hidden = x.shape[1]
    num_assignments = indices.shape[0]
    if out is None:
        out = torch.empty((n_rows, hidden), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if num_assignments == 0:
        return out.zero_()
    num_experts = bins.shape[0] if bins is not None else 1
    cfg = copy_config(hidden, x.element_size(), x.device)
    grid = (cdiv(n_rows, cfg.block_rows), cdiv(hidden, cfg.block_h))
    launch(_gather_kernel, grid,
        x, out, indices,
        weights if weights is not None else x,
        bins if bins is not None else indices,
        padded_bins if padded_bins is not None else indices,
        n_rows, hidden, num_assignments, num_experts, layout.capacity,
        TOP_K=layout.top_k,
        LAYOUT=layout.kind,
        HAS_WEIGHTS=weights is not None,
        SEARCH_STEPS=num_experts.bit_length(),
        ACC_DTYPE=_acc_dtype(x, weights),
        BLOCK_R=cfg.block_rows,
        BLOCK_H=cfg.block_h,
        num_warps=cfg.num_warps,
    )
    return out


def buffer_rows(indices, bins, padded_bins, layout):
    """int64 [N]: buffer row of each assignment, -1 where binned capacity drops it."""
    num_assignments = indices.shape[0]
    # -1 first: only binned layouts drop, but the fill also leaves a defined value if indices is not a permutation
    buffer_row = torch.full((num_assignments,), -1, dtype=torch.int64, device=indices.device)
    if num_assignments == 0:
        return buffer_row
    num_experts = bins.shape[0] if bins is not None else 1
    launch(_buffer_rows_kernel, (cdiv(num_assignments, _BUFFER_ROWS_BLOCK),),
        indices,
        bins if bins is not None else indices,
        padded_bins if padded_bins is not None else indices,
        buffer_row,
        num_assignments, num_experts, layout.capacity,
        LAYOUT=layout.kind,
        SEARCH_STEPS=num_experts.bit_length(),
        BLOCK=_BUFFER_ROWS_BLOCK,
    )
    return buffer_row


def launch_scatter(x, buffer_row, weights, top_k, num_tokens):
    """out[T, H] from buffer x[n_rows, H]: the sum of each token's top_k rows, in order, fp32 accumulation."""
    n_rows, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if x.numel() == 0:
        return out.zero_()
    cfg = copy_config(hidden, x.element_size(), x.device)
    grid = (cdiv(num_tokens, cfg.block_rows), cdiv(hidden, cfg.block_h))
    launch(_scatter_kernel, grid,
        x, out, buffer_row, weights if weights is not None else x,
        num_tokens, hidden, n_rows,
        TOP_K=top_k,
        HAS_WEIGHTS=weights is not None,
        ACC_DTYPE=_acc_dtype(x, weights),
        BLOCK_T=cfg.block_rows,
        BLOCK_H=cfg.block_h,
        num_warps=cfg.num_warps,
    )
    return out


def launch_wgrad(x, grad, buffer_row, top_k, out_dtype):
    """[N]: dot product of each assignment's buffer row x[buffer_row[a]] with its token's grad row."""
    n_rows, hidden = x.shape
    num_assignments = buffer_row.shape[0]
    out = torch.empty((num_assignments,), dtype=out_dtype, device=x.device)
    if num_assignments == 0:
        return out
    if x.numel() == 0:
        return out.zero_()
    cfg = copy_config(hidden, x.element_size(), x.device)
    launch(_wgrad_kernel, (cdiv(num_assignments, cfg.block_rows),),
        x, grad, out, buffer_row,
        num_assignments, hidden, n_rows,
        TOP_K=top_k,
        ACC_DTYPE=_acc_dtype(x, grad),
        BLOCK_A=cfg.block_rows,
        BLOCK_H=cfg.block_h,
        num_warps=cfg.num_warps,
    )
    return out
