"""The decode path of the experts forward: two launches, no sort, no dispatch metadata.

At a few tokens the four launches of the general path (dispatch, GEMM1, GEMM2, combine) cost more in launch latency
and round trips through memory than the arithmetic they order. Here the assignments stay in their given order
(a = t * top_k + j, N = T * top_k of them):

  _decode_gate_up_kernel  one program per (assignment, F tile); the program of the FIRST assignment naming an expert
                          owns that expert, the others exit. It multiplies all T rows of x (read densely) by the
                          expert's gate and up tiles, applies the activation, and stores the rows of the tokens that
                          picked the expert into intermediate[t * top_k + j] (both slots when a token lists it twice).
                          Each expert hit is streamed from memory exactly once.
  _decode_down_kernel     one program per (token, H tile): for j = 0..top_k-1 in that order, the GEMV
                          intermediate[t * top_k + j] @ W_down[e]^T (+ down bias) scaled by topk_weights[t, j] and
                          summed in fp32; the token's output tile is stored once. No atomics: reruns are bit-identical.

Ids outside [0, E) (other ranks' experts, dropped assignments) own nothing and add nothing; their intermediate rows are
never written nor read, and a token whose ids are all outside stores zeros. Only experts some token picked are read.

The path applies to inference with float weights and at most MAX_ASSIGNMENTS assignments (the gate/up program compares
its id with every earlier one); `moe._fused_experts_op` chooses between it and the general path (tiles.py:
`select_decode_tiles`, the `decode` entry of the tile tables). Weights are addressed through strides as in
grouped_gemm.py, so every layout `fused_experts` takes (concatenated, interleaved, separate up, transposed) runs without
copies.
"""

import torch
import triton
import triton.language as tl

from .grouped_gemm import ACTIVATIONS, _apply_activation, add_bias, dot_options, same_strides, tile_dot, weight_strides
from .tiles import DecodeTiles

MAX_ASSIGNMENTS = 256  # largest N = T * top_k the gate/up kernel's [BLOCK_A] id comparison is sized for


@triton.jit(do_not_specialize=["num_tokens"])
def _decode_gate_up_kernel(
    # x: [T, H], every row read (no gather)
    x_ptr, stride_x_t, stride_x_h,
    # gate and up weights: per-expert [E, F, H] views by strides (one set for both, see grouped_gemm.same_strides)
    w_gate_ptr, w_up_ptr, stride_w_e, stride_w_n, stride_w_k,
    bias_gate_ptr, bias_up_ptr, stride_bias_e, stride_bias_n,
    # intermediate: [N, F] in assignment order, unit stride along F
    inter_ptr, stride_inter_a,
    # routing: topk_ids [T, TOP_K], any integer dtype and strides
    topk_ids_ptr, stride_ids_t, stride_ids_k,
    # sizes (num_tokens is not specialised on, so every T of one BLOCK_T shares a compiled kernel)
    num_tokens, F, H, E,
    alpha, limit,
    TOP_K: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Grid: (N, cdiv(F, BLOCK_N)). Program (a, n) works only when assignment a is the first naming its expert e, a
    valid one; it then writes columns [n * BLOCK_N, +BLOCK_N) of intermediate[t * TOP_K + j] for every (t, j) with
    topk_ids[t, j] == e. BLOCK_T >= T rows (at least 16 for tl.dot); BLOCK_A >= N."""
    pid_a = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(topk_ids_ptr + (pid_a // TOP_K) * stride_ids_t + (pid_a % TOP_K) * stride_ids_k)
    # Earlier assignments only; ids compared in their own width (an int64 id is never wrapped into [0, E)).
    offs_a = tl.arange(0, BLOCK_A)
    b_earlier = tl.load(topk_ids_ptr + (offs_a // TOP_K) * stride_ids_t + (offs_a % TOP_K) * stride_ids_k,
                        mask=offs_a < pid_a, other=-1)  # [BLOCK_A]
    num_earlier = tl.sum((b_earlier == expert).to(tl.int32), axis=0)
    if (expert < 0) | (expert >= E) | (num_earlier > 0):
        return

    offs_t = tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_tokens
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < F
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + offs_t[:, None].to(tl.int64) * stride_x_t + offs_k[None, :] * stride_x_h  # [BLOCK_T, BLOCK_K]
    # One expert's matrix stays below 2^31 elements: 64-bit only for the expert's base offset.
    expert_base = expert.to(tl.int64) * stride_w_e
    w_offs = offs_n[None, :] * stride_w_n + offs_k[:, None] * stride_w_k  # [BLOCK_K, BLOCK_N]
    b_gate = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    b_up = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    b_gate, b_up = tile_dot(b_gate, b_up, a_ptrs, w_gate_ptr + expert_base + w_offs, w_up_ptr + expert_base + w_offs,
                            mask_t, mask_n, H, stride_x_h, stride_w_k, True, DOT_FP32, DOT_PRECISION, EVEN_K,
                            BLOCK_K)
    if HAS_BIAS:
        b_gate, b_up = add_bias(b_gate, b_up, expert, offs_n, mask_n, bias_gate_ptr, bias_up_ptr, stride_bias_e,
                                stride_bias_n, ACTIVATION)
    b_act = _apply_activation(b_gate, b_up, alpha, limit, ACTIVATION).to(inter_ptr.dtype.element_ty)

    for j in tl.static_range(TOP_K):
        b_ids = tl.load(topk_ids_ptr + offs_t * stride_ids_t + j * stride_ids_k, mask=mask_t, other=-1)  # [BLOCK_T]
        mask_rows = mask_t & (b_ids == expert)
        inter_ptrs = inter_ptr + (offs_t * TOP_K + j)[:, None].to(tl.int64) * stride_inter_a + offs_n[None, :]
        tl.store(inter_ptrs, b_act, mask=mask_rows[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["num_tokens"])
def _decode_down_kernel(
    # intermediate: [N, F] in assignment order, unit stride along F
    inter_ptr, stride_inter_a,
    # down weights: per-expert [E, H, F] by strides
    w_ptr, stride_w_e, stride_w_n, stride_w_k,
    bias_ptr, stride_bias_e, stride_bias_n,
    # routing: topk_ids, topk_weights [T, TOP_K], any strides; weights of any float dtype (applied in fp32)
    topk_ids_ptr, stride_ids_t, stride_ids_k,
    topk_weights_ptr, stride_tw_t, stride_tw_k,
    # out: [T, H]
    out_ptr, stride_out_t, stride_out_h,
    num_tokens, H, F, E,
    TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Grid: (T * cdiv(H, BLOCK_N),), token fastest: the T programs of one column tile run side by side, so tokens
    that share an expert find its weight tile in L2. Each program writes out[t, n * BLOCK_N : +BLOCK_N]."""
    pid = tl.program_id(0)
    t = pid % num_tokens
    pid_n = pid // num_tokens
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    b_out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        expert = tl.load(topk_ids_ptr + t * stride_ids_t + j * stride_ids_k)
        if (expert >= 0) & (expert < E):
            row_ptrs = inter_ptr + (t * TOP_K + j).to(tl.int64) * stride_inter_a + offs_k  # [BLOCK_K]
            w_ptrs = (w_ptr + expert.to(tl.int64) * stride_w_e
                      + offs_n[:, None] * stride_w_n + offs_k[None, :] * stride_w_k)  # [BLOCK_N, BLOCK_K]
            b_y = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for k0 in range(0, F, BLOCK_K):
                if EVEN_K:
                    b_row = tl.load(row_ptrs)
                    b_w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
                else:
                    mask_k = offs_k < F - k0
                    b_row = tl.load(row_ptrs, mask=mask_k, other=0.0)
                    b_w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
                b_y += tl.sum(b_w.to(tl.float32) * b_row.to(tl.float32)[None, :], axis=1)
                row_ptrs += BLOCK_K
                w_ptrs += BLOCK_K * stride_w_k
            if HAS_BIAS:
                b_y += tl.load(bias_ptr + expert.to(tl.int64) * stride_bias_e + offs_n * stride_bias_n, mask=mask_n,
                               other=0.0).to(tl.float32)
            b_weight = tl.load(topk_weights_ptr + t * stride_tw_t + j * stride_tw_k).to(tl.float32)
            b_out += b_weight * b_y
    tl.store(out_ptr + t.to(tl.int64) * stride_out_t + offs_n * stride_out_h, b_out.to(out_ptr.dtype.element_ty),
             mask=mask_n)


def decode_experts(x, w_gate, w_up, w_down, topk_ids, topk_weights, tiles: DecodeTiles, *, transposed=False,
                   activation="silu", gate_bias=None, up_bias=None, down_bias=None, alpha=1.702, limit=7.0):
    """out [T, H] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) in two launches (see the module doc).

    x [T, H]; w_gate, w_up: the gate and up views [E, F, H] ([E, H, F] when `transposed`); w_down [E, H, F] ([E, F, H]
    transposed); gate_bias, up_bias [E, F] views, down_bias [E, H]. Needs T * top_k <= MAX_ASSIGNMENTS.
    """
    T, H = x.shape
    top_k = topk_ids.shape[1]
    num_assignments = T * top_k
    if num_assignments > MAX_ASSIGNMENTS:
        raise ValueError(f"the decode path takes at most {MAX_ASSIGNMENTS} assignments, got T * top_k = "
                         f"{num_assignments}")
    E = w_down.shape[0]
    F = w_down.shape[1] if transposed else w_down.shape[2]
    out = torch.empty((T, H), device=x.device, dtype=x.dtype)
    if T == 0 or H == 0:
        return out
    # Rows of tokens' slots whose id is outside [0, E) stay unwritten: the down kernel never reads them.
    intermediate = torch.empty((num_assignments, F), device=x.device, dtype=x.dtype)
    if F > 0:
        w_gate, w_up = same_strides(w_gate, w_up)
        if gate_bias is not None:
            gate_bias, up_bias = same_strides(gate_bias, up_bias)
        stride_e, stride_n, stride_k = weight_strides(w_gate, transposed)
        block_t = max(16, triton.next_power_of_2(T))
        dot_fp32, precision = dot_options(x.dtype)
        tile = tiles.gate_up
        _decode_gate_up_kernel[(num_assignments, triton.cdiv(F, tile.block_n))](
            x, x.stride(0), x.stride(1),
            w_gate, w_up, stride_e, stride_n, stride_k,
            gate_bias, up_bias, *(gate_bias.stride() if gate_bias is not None else (0, 0)),
            intermediate, intermediate.stride(0),
            topk_ids, topk_ids.stride(0), topk_ids.stride(1),
            T, F, H, E,
            float(alpha), float(limit),
            TOP_K=top_k,
            ACTIVATION=ACTIVATIONS[activation],
            HAS_BIAS=gate_bias is not None,
            DOT_FP32=dot_fp32,
            DOT_PRECISION=precision,
            EVEN_K=H % tile.block_k == 0,
            BLOCK_T=block_t,
            # a function of BLOCK_T and TOP_K only (>= N), so it adds no compiled variants of its own
            BLOCK_A=triton.next_power_of_2(block_t * top_k),
            BLOCK_N=tile.block_n,
            BLOCK_K=tile.block_k,
            num_warps=tile.num_warps,
            num_stages=tile.num_stages,
        )
    stride_e, stride_n, stride_k = weight_strides(w_down, transposed)
    tile = tiles.down
    _decode_down_kernel[(T * triton.cdiv(H, tile.block_n),)](
        intermediate, intermediate.stride(0),
        w_down, stride_e, stride_n, stride_k,
        down_bias, *(down_bias.stride() if down_bias is not None else (0, 0)),
        topk_ids, topk_ids.stride(0), topk_ids.stride(1),
        topk_weights, topk_weights.stride(0), topk_weights.stride(1),
        out, out.stride(0), out.stride(1),
        T, H, F, E,
        TOP_K=top_k,
        HAS_BIAS=down_bias is not None,
        EVEN_K=F % tile.block_k == 0,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return out
