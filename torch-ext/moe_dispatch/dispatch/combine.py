"""Combine: each token's top_k expert rows summed back into one row, in fixed order (deterministic, no atomics).

  _combine_kernel   out[t] = sum_j w[t, j] * y[row_idx[t * top_k + j]]   (fp32 accumulation, j = 0..top_k-1)

Rows with row_idx < 0 (dropped assignments) contribute nothing, and so do indices past the rows of y (a caller's bad
`restore_idx`: bounded, never read); without weights (the fused path applies them in the
down GEMM's epilogue) the sum is unweighted.
"""

import torch
import triton
import triton.language as tl

from ..host.checks import (check_bool, check_dim, check_float, check_index, check_kernel_device, check_same_device,
                           check_token_weights, index_map_problems, raise_problems, reads_values, warn_if_gradient_cut)
from ..host.device import call_scope
from ..host.host_math import cdiv, next_power_of_2
from ..host.pdl import pdl_options, wait_for_producer
from ..host.replay import launch


@triton.jit
def _combine_kernel(
    y_ptr, row_idx_ptr, weights_ptr, out_ptr,
    T, H, n_rows,
    stride_y_m, stride_w_t, stride_w_k, stride_out_t,
    TOP_K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid: (cdiv(T, BLOCK_T), cdiv(H, BLOCK_H)). Each program writes a [BLOCK_T, BLOCK_H] tile of out."""
    wait_for_producer(PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_t = offs_t < T
    mask_h = offs_h < H
    b_acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        b_row = tl.load(row_idx_ptr + offs_t.to(tl.int64) * TOP_K + j, mask=mask_t, other=-1)
        b_keep = (b_row >= 0) & (b_row < n_rows)
        b_y = tl.load(y_ptr + tl.where(b_keep, b_row, 0)[:, None].to(tl.int64) * stride_y_m + offs_h[None, :],
                      mask=(mask_t & b_keep)[:, None] & mask_h[None, :], other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            b_w = tl.load(weights_ptr + offs_t.to(tl.int64) * stride_w_t + j * stride_w_k, mask=mask_t, other=0.0)
            b_y = b_y * b_w.to(tl.float32)[:, None]
        b_acc += b_y
    tl.store(out_ptr + offs_t[:, None].to(tl.int64) * stride_out_t + offs_h[None, :],
             b_acc.to(out_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_h[None, :])


def combine(y: torch.Tensor, row_idx: torch.Tensor, num_tokens: int, top_k: int, weights: torch.Tensor | None = None,
            out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out [T, H] = sum over j of (weights[t, j] *) y[row_idx[t * top_k + j]]. y rows must have unit stride in H."""
    H = y.shape[1]
    if out is None:
        out = torch.empty((num_tokens, H), device=y.device, dtype=out_dtype or y.dtype)
    if num_tokens == 0 or H == 0:
        return out
    block_h = min(next_power_of_2(H), 1024 if top_k <= 4 else 512)
    block_t = max(1, min(16, 2048 // block_h))
    grid = (cdiv(num_tokens, block_t), cdiv(H, block_h))
    w_t, w_k = (weights.stride(0), weights.stride(1)) if weights is not None else (0, 0)
    launch(_combine_kernel, grid,
        y, row_idx, weights, out, num_tokens, H, y.shape[0],
        y.stride(0), w_t, w_k, out.stride(0),
        TOP_K=top_k, HAS_WEIGHTS=weights is not None, BLOCK_T=block_t, BLOCK_H=block_h,
        num_warps=4, **pdl_options(y.device),
    )
    return out


@call_scope
def unpermute_tokens(expert_outputs: torch.Tensor, top_k_weights: torch.Tensor, restore_idx: torch.Tensor,
                     num_tokens: int, top_k: int, *, validate: bool | None = None) -> torch.Tensor:
    """v1 API: out[t] = sum_j top_k_weights[t, j] * expert_outputs[restore_idx[t * top_k + j]] -> [T, H].

    expert_outputs [T*top_k, H] in expert order (as returned by permute_tokens and the grouped GEMMs), restore_idx
    [T*top_k] (permute_tokens' inverse permutation; entries < 0 are skipped). Output in expert_outputs' dtype.
    `validate`: check that restore_idx points into expert_outputs' rows with no row twice (ValueError otherwise);
    None checks CPU tensors only, True also on a GPU (one sync), False never. Unchecked bad entries are bounded in the
    kernel (rows past the end add nothing). Forward-only.
    """
    check_bool("validate", validate, none=True)
    check_float("expert_outputs", expert_outputs, ndim=2)
    check_index("restore_idx", restore_idx, ndim=1)
    check_token_weights(top_k_weights, num_tokens, top_k)
    check_dim("restore_idx", restore_idx, 0, num_tokens * top_k, "num_tokens * top_k")
    check_same_device(expert_outputs=expert_outputs, top_k_weights=top_k_weights, restore_idx=restore_idx)
    if reads_values(validate, restore_idx):
        raise_problems(index_map_problems("restore_idx", restore_idx, expert_outputs.shape[0], "rows of expert_outputs"))
    warn_if_gradient_cut("unpermute_tokens", expert_outputs=expert_outputs, top_k_weights=top_k_weights)
    check_kernel_device("expert_outputs", expert_outputs)
    y = expert_outputs if expert_outputs.stride(1) == 1 else expert_outputs.contiguous()
    return combine(y, restore_idx, num_tokens, top_k, weights=top_k_weights)
