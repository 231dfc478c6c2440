"""Probe of `tl.dot_scaled` for the MXFP4 experts' first GEMM (gate/up), beside the package's MXFP4 and bf16 grouped
GEMMs: one step ahead of the package, not part of it.

    PYTHONPATH=torch-ext:scripts:benchmarks python3 benchmarks/mxfp4_dot_scaled_probe.py
        [--models gpt-oss-120b gpt-oss-20b] [--tokens 1 16 128 1024 4096] [--top-k 4]

What it measures. GEMM1 of an MXFP4 MoE layer: C [M, N] = A_seg @ dequant(W_e)^T per expert e, A bf16 [M, K] in
expert-sorted order (M = T * top_k rows, uniform random routing, `expert_offsets` [E + 1] int32), W_e MXFP4 as the
GPT-OSS checkpoints store it (bytes uint8 [E, N, K/2], two e2m1 codes a byte, the low nibble the even K index; e8m0
scale codes uint8 [E, N, K/32]), K = H = 2880 and N = 2F = 5760 for GPT-OSS (E from benchmarks/model_shapes.py).
Timed as CUDA graphs (triton.testing.do_bench_cudagraph, median), all in one run:

  (a) `_mxfp4_dot_scaled_grouped_gemm_kernel` below: each K step is one `tl.dot_scaled(bf16 A, e2m1 W with its e8m0
      scales)`, the weights read in the checkpoint layout (no prepared copy), in two forms and a few tiles
      (`CONFIGS`): "rows", A the dot's lhs and the weight bytes its rhs ([K/2, N], packed along K); "swap", the weight
      the lhs ([N, K/2], scales [N, K/32]) and A^T the rhs, accumulating C^T [BLOCK_N, BLOCK_M] (few rows per expert:
      the weight fills the MMA's M side). Triton lowers dot_scaled on Hopper by upcasting the e2m1 operand in
      registers, then a bf16 MMA.
  (b) the package's MXFP4 grouped GEMM (`moe_dispatch.gemm.grouped.expert_gemm` with `mxfp4_weight_scale`, the
      tiles `select_tiles(..., mxfp4=True)` picks: bytes loaded, decoded with integer ops, a bf16 dot), activation
      "none" on the same sorted rows (fused_experts runs GEMM1 gated, on interleaved rows, and at decode sizes on its
      decode path instead: the layer rows below time what it runs);
  (c) the package's bf16 grouped GEMM on the dequantized weight (`select_tiles`' bf16 tiles, its persistent kernel
      where the table says so);
  and, as reference points for the whole layer (both GEMMs, dispatch, combine), `moe_dispatch.fused_experts` with
  the MXFP4 weights (which, at prefill sizes, decodes them into a bf16 buffer first: planner.mxfp4_dequantizes_first;
  MOE_DISPATCH_MXFP4_PREFILL=loads keeps the in-load decode) and with the bf16 dequantized ones.

One table: us, TB/s of the weight bytes each reads (experts with at least one row: MXFP4 bytes + scales for (a) and
(b), bf16 bytes for (c)), and each time's ratio to (b)'s (> 1: faster than the package's MXFP4 GEMM). Each (a) form and
(b) are checked against (c) (norm-wise relative error < moe_dispatch.reference.TOLERANCE[bf16]; all read the same
bf16 rows and the same weight values, exact in bf16, and sum in fp32). Nothing asserts a speed.

The decision it informs: whether the package's MXFP4 grouped GEMM (gemm/jit.py's `mxfp4_tile_dot`) should move to
`tl.dot_scaled`, in which form at which rows per expert, and whether a prepared (swizzled) weight layout is needed on
top: if (a) on the checkpoint layout already reaches (b)'s time or better, the move is a kernel change only; if it
stays behind (or near (b)), the register upcast needs the weights in the layout the MMA operand wants (triton_kernels'
Hopper value and scale layouts, prepared once at load), which this probe does not build.

On the GPU each (a) tile's registers, spills and shared memory are printed at its first launch; tests/ compiles the
same tiles for sm_90 without a GPU (`compile_sm90`).

`--device cpu --tiny` runs the same plumbing on interpreter-sized shapes (TRITON_INTERPRET=1, each call once,
wall-clock times that mean nothing); `check_small_cases` is the correctness check against float64
(moe_dispatch.reference), run by tests/test_mxfp4_dot_scaled_probe.py with an AOT compile for sm_90 (`compile_sm90`).
"""

import argparse
import dataclasses
import functools
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # model_shapes

MXFP4_GROUP = 32  # e2m1 values per e8m0 scale, consecutive along K
MODELS = ("gpt-oss-120b", "gpt-oss-20b")
TOKENS = (1, 16, 128, 1024, 4096)
COMPILED = {}  # config name -> registers, spills, shared memory of its first GPU launch


@triton.jit
def grouped_tile_pointers(a_ptr, w_ptr, w_scale_ptr, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, N,
                          stride_a_m, stride_a_k, stride_w_e, stride_w_n, stride_w_k,
                          stride_w_scale_e, stride_w_scale_n, stride_w_scale_k,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(offs_m, offs_n, mask_m, mask_n, a_ptrs, w_ptrs, w_scale_ptrs) of program (t, j) of a grouped probe kernel (the
    grid of `_mxfp4_dot_scaled_grouped_gemm_kernel`): A [BLOCK_M, BLOCK_K], MXFP4 bytes [BLOCK_N, BLOCK_K / 2] and
    scale codes [BLOCK_N, BLOCK_K / 32] at k = 0. Shared with benchmarks/mxfp4_upcast_probe.py."""
    pid_tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + pid_tile).to(tl.int64)
    row_start = tl.load(tile_row_start_ptr + pid_tile)
    row_end = tl.load(expert_offsets_ptr + expert + 1)
    offs_m = row_start + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_byte = tl.arange(0, BLOCK_K // 2)
    offs_group = tl.arange(0, BLOCK_K // 32)
    a_ptrs = a_ptr + offs_m[:, None] * stride_a_m + offs_k[None, :] * stride_a_k
    w_ptrs = w_ptr + expert * stride_w_e + offs_n[:, None] * stride_w_n + offs_byte[None, :] * stride_w_k
    w_scale_ptrs = (w_scale_ptr + expert * stride_w_scale_e + offs_n[:, None] * stride_w_scale_n
                    + offs_group[None, :] * stride_w_scale_k)
    return offs_m, offs_n, offs_m < row_end, offs_n < N, a_ptrs, w_ptrs, w_scale_ptrs


@triton.jit
def load_k_step(a_ptrs, w_ptrs, w_scale_ptrs, mask_m, mask_n, k_left, MASK_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """(A [BLOCK_M, BLOCK_K], bytes [BLOCK_N, BLOCK_K / 2] uint8 (two e2m1 codes a byte), scale codes [BLOCK_N,
    BLOCK_K / 32] uint8) of one K step. MASK_K: only k_left values of K remain (a multiple of 32); the rest read as
    zero values with scale code 127 (1.0)."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_byte = tl.arange(0, BLOCK_K // 2)
    offs_group = tl.arange(0, BLOCK_K // 32)
    if MASK_K:
        mask_a = mask_m[:, None] & (offs_k[None, :] < k_left)
        mask_w = mask_n[:, None] & (offs_byte[None, :] < k_left // 2)
        mask_s = mask_n[:, None] & (offs_group[None, :] < k_left // 32)
    else:
        mask_a = mask_m[:, None]
        mask_w = mask_n[:, None]
        mask_s = mask_n[:, None]
    return (tl.load(a_ptrs, mask=mask_a, other=0.0), tl.load(w_ptrs, mask=mask_w, other=0),
            tl.load(w_scale_ptrs, mask=mask_s, other=127))


@triton.jit
def zero_sums(SWAP_AB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The fp32 sums of a tile, [BLOCK_M, BLOCK_N], or its transpose under SWAP_AB (the weight the dot's lhs)."""
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return acc


@triton.jit
def store_tile(acc, c_ptr, offs_m, offs_n, mask_m, mask_n, stride_c_m, stride_c_n, SWAP_AB: tl.constexpr):
    """C's tile from the fp32 sums acc [BLOCK_M, BLOCK_N] (its transpose under SWAP_AB), rows and columns masked."""
    if SWAP_AB:
        acc = tl.trans(acc)
    c_ptrs = c_ptr + offs_m[:, None] * stride_c_m + offs_n[None, :] * stride_c_n
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _mxfp4_dot_scaled_step(acc, a_ptrs, w_ptrs, w_scale_ptrs, mask_m, mask_n, k_left, MASK_K: tl.constexpr,
                           SWAP_AB: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + one K step (`load_k_step`): A times the e2m1 weight tile by tl.dot_scaled; acc is [BLOCK_M, BLOCK_N], or
    its transpose under SWAP_AB."""
    b_a, b_w, b_s = load_k_step(a_ptrs, w_ptrs, w_scale_ptrs, mask_m, mask_n, k_left, MASK_K, BLOCK_K)
    if SWAP_AB:
        # C^T += W @ A^T: the weight is the lhs, packed along K as the checkpoint stores it
        acc = tl.dot_scaled(b_w, b_s, "e2m1", tl.trans(b_a), None, "bf16", acc)
    else:
        # C += A @ W^T: the rhs is [BLOCK_K / 2, BLOCK_N], packed along K; its scales stay [BLOCK_N, BLOCK_K / 32]
        acc = tl.dot_scaled(b_a, None, "bf16", tl.trans(b_w), b_s, "e2m1", acc)
    return acc


@triton.jit
def _mxfp4_dot_scaled_grouped_gemm_kernel(
        a_ptr, w_ptr, w_scale_ptr, c_ptr, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
        N, K,
        stride_a_m, stride_a_k,
        stride_w_e, stride_w_n, stride_w_k,
        stride_w_scale_e, stride_w_scale_n, stride_w_scale_k,
        stride_c_m, stride_c_n,
        SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr):
    """C [M, N] = A_seg @ dequant(W_e)^T for the expert-sorted rows of A [M, K] bf16, W MXFP4 bytes [E, N, K/2] uint8
    and e8m0 scale codes [E, N, K/32] uint8, C bf16.

    Grid: (num_tiles, cdiv(N, BLOCK_N)). Program (t, j) owns rows [tile_row_start[t], min(tile_row_start[t] +
    BLOCK_M, expert_offsets[e + 1])) of expert e = tile_expert[t] and columns [j BLOCK_N, (j + 1) BLOCK_N) of C. K is a
    multiple of 32; EVEN_K: of BLOCK_K too, else every K step is masked (a peeled, masked last step compiled to
    more registers, and spills, on Triton 3.6)."""
    offs_m, offs_n, mask_m, mask_n, a_ptrs, w_ptrs, w_scale_ptrs = grouped_tile_pointers(
        a_ptr, w_ptr, w_scale_ptr, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, N, stride_a_m, stride_a_k,
        stride_w_e, stride_w_n, stride_w_k, stride_w_scale_e, stride_w_scale_n, stride_w_scale_k,
        BLOCK_M, BLOCK_N, BLOCK_K)
    acc = zero_sums(SWAP_AB, BLOCK_M, BLOCK_N)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        acc = _mxfp4_dot_scaled_step(acc, a_ptrs, w_ptrs, w_scale_ptrs, mask_m, mask_n, K - k * BLOCK_K, not EVEN_K,
                                     SWAP_AB, BLOCK_K)
        a_ptrs += BLOCK_K * stride_a_k
        w_ptrs += (BLOCK_K // 2) * stride_w_k
        w_scale_ptrs += (BLOCK_K // 32) * stride_w_scale_k

    store_tile(acc, c_ptr, offs_m, offs_n, mask_m, mask_n, stride_c_m, stride_c_n, SWAP_AB)


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
    """One launch of the kernel: its form (SWAP_AB: the weight is the dot's lhs) and tile."""

    swap_ab: bool
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    @property
    def name(self):
        return f"{'swap' if self.swap_ab else 'rows'} {self.block_m}x{self.block_n}x{self.block_k}"


# The GPU's tiles, each compiled for sm_90 without spills by Triton 3.6 (the GPU machine's) and 3.9 (tests/ checks
# with the CPU's Triton); on Triton 3.6 the 4-warp 128 x 128 x 64 "rows" tile spilled 48 bytes and is left out.
# K = 2880 is a multiple of 64 (the only power of two >= 64 dividing it), so BLOCK_K 64 runs unmasked (EVEN_K) and
# BLOCK_K 128 masks every step. "swap" is for the few-rows cells (the weight fills the MMA's M side of 64 per warp
# group; the rows, >= 16, its N side), "rows" for the many-rows ones.
CONFIGS = (
    ProbeConfig(True, 16, 128, 64, num_warps=4, num_stages=4),
    ProbeConfig(True, 32, 128, 64, num_warps=4, num_stages=4),
    ProbeConfig(True, 64, 128, 128, num_warps=8, num_stages=3),
    ProbeConfig(False, 64, 128, 128, num_warps=8, num_stages=3),
    ProbeConfig(False, 128, 128, 64, num_warps=8, num_stages=3),
    ProbeConfig(False, 128, 128, 128, num_warps=8, num_stages=4),
)
# Interpreter-sized tiles (--tiny and the CPU check): N 96 against BLOCK_N 64 leaves a masked column tile, K 96
# against BLOCK_K 64 a masked K step.
TINY_CONFIGS = (ProbeConfig(True, 16, 64, 64), ProbeConfig(False, 16, 64, 64))


def tile_map(expert_offsets, block_m):
    """(tile_expert, tile_row_start) int32 [num_tiles] of expert-sorted rows: ceil(count / block_m) tiles per expert,
    in expert order; an empty expert has none. Built on the host (one device read), outside anything timed."""
    offsets = expert_offsets.to("cpu", torch.int64)
    counts = offsets[1:] - offsets[:-1]
    tiles = (counts + block_m - 1) // block_m
    tile_expert = torch.repeat_interleave(torch.arange(len(counts)), tiles)
    first_tile = torch.cumsum(tiles, 0) - tiles  # each expert's first tile index
    tile_in_expert = torch.arange(len(tile_expert)) - first_tile[tile_expert]
    tile_row_start = offsets[:-1][tile_expert] + tile_in_expert * block_m
    device = expert_offsets.device
    return tile_expert.to(device, torch.int32), tile_row_start.to(device, torch.int32)


def launch_grouped(kernel, a, blocks, scales, expert_offsets, config, *, tiles=None, out=None, **constexprs):
    """C [M, N] = A_seg @ dequant(W_e)^T by a grouped probe kernel (this file's argument list and grid; `constexprs`
    beyond the tile's): a [M, K] in expert-sorted rows, blocks uint8 [E, N, K/2] (or [E, N, K/32, 16]), scales uint8
    or float8_e8m0fnu [E, N, K/32], expert_offsets int32 [E + 1]; rows past expert_offsets[E] are left unwritten.
    `tiles`: tile_map(expert_offsets, config.block_m), built here if None. Records the first GPU launch's registers,
    spills and shared memory per config name (COMPILED)."""
    E, N = blocks.shape[:2]
    w = blocks.reshape(E, N, -1)
    w_scale = scales.view(torch.uint8)
    M, K = a.shape
    assert w.dtype == torch.uint8 and w.shape[2] * 2 == K and K % MXFP4_GROUP == 0
    assert w_scale.shape == (E, N, K // MXFP4_GROUP) and expert_offsets.shape == (E + 1,)
    tile_expert, tile_row_start = tiles if tiles is not None else tile_map(expert_offsets, config.block_m)
    c = out if out is not None else torch.empty((M, N), device=a.device, dtype=a.dtype)
    if tile_expert.numel() == 0 or N == 0:
        return c
    grid = (tile_expert.numel(), triton.cdiv(N, config.block_n))
    compiled = kernel[grid](
        a, w, w_scale, c, tile_expert, tile_row_start, expert_offsets,
        N, K,
        a.stride(0), a.stride(1),
        w.stride(0), w.stride(1), w.stride(2),
        w_scale.stride(0), w_scale.stride(1), w_scale.stride(2),
        c.stride(0), c.stride(1),
        SWAP_AB=config.swap_ab, EVEN_K=K % config.block_k == 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages, **constexprs)
    if getattr(compiled, "n_regs", None) is not None and config.name not in COMPILED:  # a GPU launch's kernel
        COMPILED[config.name] = dict(registers=compiled.n_regs, spills=compiled.n_spills,
                                     shared=compiled.metadata.shared)
        print(f"   {config.name} compiled: {COMPILED[config.name]}", flush=True)
    return c


def mxfp4_dot_scaled_grouped_gemm(a, blocks, scales, expert_offsets, config, *, tiles=None, out=None):
    """C [M, N] bf16 = A_seg @ dequant(W_e)^T by `_mxfp4_dot_scaled_grouped_gemm_kernel` (`launch_grouped`; a
    bf16)."""
    assert a.dtype == torch.bfloat16
    assert config.block_k % 64 == 0, "BLOCK_K: whole scale groups, and >= 64 for the MMA's K"
    return launch_grouped(_mxfp4_dot_scaled_grouped_gemm_kernel, a, blocks, scales, expert_offsets, config,
                          tiles=tiles, out=out)


def _offsets(counts, device):
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _mxfp4_weight(E, N, K, device, seed):
    """(blocks uint8 [E, N, K/2], scale codes uint8 [E, N, K/32]) of a random weight, by the package's quantizer."""
    from moe_dispatch import quantize_experts_mxfp4

    gen = torch.Generator().manual_seed(seed)
    blocks, scales = quantize_experts_mxfp4(torch.randn(E, N, K, generator=gen) * 0.2)
    return blocks.reshape(E, N, K // 2).to(device), scales.to(device)


def _reference(a, blocks, scales, expert_offsets):
    """float64 A_seg @ dequant(W_e)^T (moe_dispatch.reference)."""
    from moe_dispatch.reference import dequantize_mxfp4_ref, grouped_gemm_ref

    return grouped_gemm_ref(a, dequantize_mxfp4_ref(blocks, scales), expert_offsets, blocks.shape[0])


# (counts per expert, N, K, why)
SMALL_CASES = (
    ((5, 0, 17, 1), 96, 96, "an empty expert, ragged rows (17 = a full 16-row tile + 1), a one-row expert; N 96 a "
                            "masked column tile, K 96 a masked K step (96 = 64 + 32)"),
    ((3, 20, 0), 64, 128, "K a multiple of BLOCK_K (no masked step); the last expert empty"),
)


def check_small_cases(device="cpu", configs=TINY_CONFIGS):
    """The kernel against float64 on small odd sizes (SMALL_CASES) in each form of `configs`, then non-finite values:
    a NaN in one row of A reaches that row's outputs only; a NaN scale code (0xFF) of expert e, column n makes column
    n NaN in expert e's rows only. Raises AssertionError on the first failure; -> a list of lines to print."""
    from moe_dispatch.reference import TOLERANCE, assert_close

    lines = []
    for config in configs:
        for seed, (counts, N, K, _why) in enumerate(SMALL_CASES):
            E, M = len(counts), sum(counts)
            gen = torch.Generator().manual_seed(100 + seed)
            a = torch.randn(M, K, generator=gen).to(device, torch.bfloat16)
            blocks, scales = _mxfp4_weight(E, N, K, device, seed)
            offsets = _offsets(counts, device)
            out = mxfp4_dot_scaled_grouped_gemm(a, blocks, scales, offsets, config)
            assert_close(out, _reference(a, blocks, scales, offsets), torch.bfloat16,
                         what=f"{config.name} counts={counts} N={N} K={K}")
            lines.append(f"{config.name} counts={counts} N={N} K={K}: within {TOLERANCE[torch.bfloat16]:.0e} of "
                         f"float64")

        counts, N, K, _ = SMALL_CASES[0]
        E, M = len(counts), sum(counts)
        offsets = _offsets(counts, device)
        a = torch.randn(M, K, generator=torch.Generator().manual_seed(7)).to(device, torch.bfloat16)
        blocks, scales = _mxfp4_weight(E, N, K, device, 7)
        nan_row = 9  # in expert 2's rows [5, 22)
        a[nan_row, 40] = float("nan")
        out = mxfp4_dot_scaled_grouped_gemm(a, blocks, scales, offsets, config).float().cpu()
        others = torch.arange(M) != nan_row
        assert out[nan_row].isnan().all(), f"{config.name}: row {nan_row} of A holds a NaN, its outputs {out[nan_row]}"
        assert torch.isfinite(out[others]).all(), f"{config.name}: a NaN in row {nan_row} of A reached other rows"
        lines.append(f"{config.name}: a NaN in row {nan_row} of A: that row all NaN, the others finite")

        a[nan_row, 40] = 1.0
        expert, column, group = 2, 70, 2  # column 70: the second, masked column tile; group 2: the masked K step
        scales = scales.clone()
        scales[expert, column, group] = 0xFF
        out = mxfp4_dot_scaled_grouped_gemm(a, blocks, scales, offsets, config).float().cpu()
        lo, hi = int(offsets[expert]), int(offsets[expert + 1])
        poisoned = torch.zeros(M, N, dtype=torch.bool)
        poisoned[lo:hi, column] = True
        assert out[poisoned].isnan().all(), f"{config.name}: scale code 0xFF of expert {expert}, column {column} did " \
                                            f"not make column {column} of rows [{lo}, {hi}) NaN"
        assert torch.isfinite(out[~poisoned]).all(), f"{config.name}: the NaN scale reached other rows or columns"
        lines.append(f"{config.name}: scale code 0xFF at expert {expert}, column {column}: NaN in rows [{lo}, {hi}) of "
                     f"that column only")
    return lines


KERNEL_SIGNATURE = {
    "a_ptr": "*bf16", "w_ptr": "*u8", "w_scale_ptr": "*u8", "c_ptr": "*bf16", "tile_expert_ptr": "*i32",
    "tile_row_start_ptr": "*i32", "expert_offsets_ptr": "*i32", "N": "i32", "K": "i32",
    "stride_a_m": "i32", "stride_a_k": "i32", "stride_w_e": "i32", "stride_w_n": "i32", "stride_w_k": "i32",
    "stride_w_scale_e": "i32", "stride_w_scale_n": "i32", "stride_w_scale_k": "i32",
    "stride_c_m": "i32", "stride_c_n": "i32",
    "SWAP_AB": "constexpr", "EVEN_K": "constexpr",
    "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
}


def compile_sm90(config, K=2880, arch=90):
    """Compile the kernel ahead of time for cuda:`arch` (no GPU needed; Triton's compiled mode, not the interpreter)
    at GPT-OSS's unit strides -> dict(registers, spills (ptxas's STACK + LOCAL bytes), shared (bytes), ptx_dot: the
    MMA instruction it issues)."""
    import re
    import subprocess
    import tempfile

    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = _mxfp4_dot_scaled_grouped_gemm_kernel
    constexprs = dict(SWAP_AB=config.swap_ab, EVEN_K=K % config.block_k == 0, BLOCK_M=config.block_m,
                      BLOCK_N=config.block_n, BLOCK_K=config.block_k)
    # unit strides specialized as a launch with contiguous tensors would be (value 1 -> a constant)
    constexprs.update(stride_a_k=1, stride_w_k=1, stride_w_scale_k=1, stride_c_n=1)
    signature = {name: ("constexpr" if name in constexprs else kind) for name, kind in KERNEL_SIGNATURE.items()}
    # 16-byte aligned pointers and strides divisible by 16, as Triton specializes them at launch
    aligned = [[i] for i, name in enumerate(signature) if signature[name] != "constexpr" and
               (name.endswith("_ptr") or name in ("K", "stride_a_m", "stride_w_e", "stride_w_n", "stride_c_m"))]
    source = ASTSource(kernel, signature, constexprs, {tuple(i): [["tt.divisibility", 16]] for i in aligned})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    usage = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", text))
    dots = sorted(set(re.findall(r"(wgmma\.mma_async\S*|mma\.sync\S*)", compiled.asm["ptx"])))
    return dict(config=config.name, registers=int(usage["REG"]),
                spills=int(usage.get("STACK", 0)) + int(usage.get("LOCAL", 0)), shared=compiled.metadata.shared,
                ptx_dot=dots)


@dataclasses.dataclass
class Row:
    """One timed method at one cell."""

    cell: str
    rows_per_expert: float
    method: str
    us: float
    weight_bytes: int | None  # bytes of weights it reads (None: a whole-layer reference point)
    how: str  # "graph", "eager" (do_bench: graph capture failed) or "once" (--device cpu)
    error: float | None = None  # relative error against (c)


def cell_recorder(rows, timer, cell, rows_per_expert):
    """-> record(method, fn, weight_bytes, out=None, reference=None) for one cell: times fn with `timer`, appends a Row
    to `rows` (its error: `out` against `reference`, where both are given) and prints a line."""
    from moe_dispatch.reference import relative_error

    def record(method, fn, weight_bytes, out=None, reference=None):
        us, how = timer(fn)
        error = relative_error(out, reference) if out is not None and reference is not None else None
        rows.append(Row(cell, rows_per_expert, method, us, weight_bytes, how, error))
        print(f"   {cell:<22} {method:<40} {us:10.1f} us {how}"
              + (f"  rel err vs bf16 {error:.2e}" if error is not None else ""), flush=True)

    return record


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS),
                        help="E, H, F from benchmarks/model_shapes.py (GEMM1: K = H, N = 2F)")
    parser.add_argument("--tokens", nargs="+", type=int, default=None,
                        help=f"T values (default {' '.join(map(str, TOKENS))}; with --tiny 1 7)")
    parser.add_argument("--top-k", type=int, default=4, help="assignments per token (GPT-OSS: 4)")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu under TRITON_INTERPRET=1 (plumbing only)")
    parser.add_argument("--tiny", action="store_true",
                        help="interpreter-sized shapes (model_shapes.shrunk: E <= 16, H 96, F 96) and tiles")
    parser.add_argument("--no-layer", action="store_true", help="skip the fused_experts reference points")
    return parser.parse_args(argv)


def _timer(device):
    """fn -> (median us, how): a CUDA graph's replays (do_bench_cudagraph; do_bench where capture fails), or on the
    CPU one call's wall-clock time (plumbing: the interpreter's times mean nothing)."""
    if device.type != "cuda":
        def once(fn):
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e6, "once"
        return once

    def graph(fn):
        fn()
        torch.cuda.synchronize()
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3, "graph"
        except Exception as exc:  # noqa: BLE001 - the probe reports the fallback and goes on
            print(f"   CUDA graph timing failed ({type(exc).__name__}: {str(exc)[:120]}); do_bench instead", flush=True)
            torch.cuda.synchronize()
            return triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median") * 1e3, "eager"
    return graph


def _random_mxfp4(E, N, K, device, experts_per_chunk=16):
    """(blocks uint8 [E, N, K/2], scale codes uint8 [E, N, K/32]): uniform random bytes (every e2m1 code) and codes
    in [118, 122] (values of magnitude <= 6 * 2^-5), drawn on the device a chunk of experts at a time."""
    blocks = torch.empty(E, N, K // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(E, N, K // MXFP4_GROUP, dtype=torch.uint8, device=device)
    for lo in range(0, E, experts_per_chunk):
        hi = min(E, lo + experts_per_chunk)
        blocks[lo:hi] = torch.randint(0, 256, (hi - lo, N, K // 2), dtype=torch.uint8, device=device)
        scales[lo:hi] = torch.randint(118, 123, (hi - lo, N, K // MXFP4_GROUP), dtype=torch.uint8, device=device)
    return blocks, scales


def gemm1_cell(T, top_k, E, H, F, device):
    """The inputs of GEMM1 at T tokens: (ids int32 [T, top_k] a uniform random routing, a bf16 [T * top_k, H] random
    expert-sorted rows, tiles_mx and tiles_bf (the tables' MXFP4 and bf16 tiles), info_mx and info_bf (their
    dispatches of ids), the number of experts ids hits)."""
    from moe_dispatch.dispatch.segments import dispatch
    from moe_dispatch.host.tiles import select_tiles

    ids = torch.rand(T, E, device=device).topk(top_k, dim=1).indices.to(torch.int32)
    a = torch.randn(T * top_k, H, device=device, dtype=torch.bfloat16)
    tiles_mx = select_tiles(device, T, top_k, E, F, H, torch.bfloat16, mxfp4=True)
    tiles_bf = select_tiles(device, T, top_k, E, F, H, torch.bfloat16)
    info_mx, info_bf = dispatch(ids, E, tiles_mx.block_m), dispatch(ids, E, tiles_bf.block_m)
    offsets = info_mx.expert_offsets
    return ids, a, tiles_mx, tiles_bf, info_mx, info_bf, int((offsets[1:] > offsets[:-1]).sum())


def _layer_shape(model, tiny):
    from model_shapes import MODEL_SHAPES, shrunk

    shape = MODEL_SHAPES[model]
    return shrunk(shape, ffn=96) if tiny else shape  # F 96: the down weight's K a multiple of 32 too


def probe_model(model, args, device, configs, timer, rows):
    """Time and check every method at each T of one model (module docstring); appends Row entries to `rows`."""
    import moe_dispatch as md
    from moe_dispatch.formats.mxfp4 import dequantize_experts_mxfp4, mxfp4_weight_scale
    from moe_dispatch.gemm.grouped import expert_gemm

    shape = _layer_shape(model, args.tiny)
    E, H, F, top_k = shape.num_experts, shape.hidden, shape.ffn, args.top_k
    N, K = 2 * F, H  # GEMM1: the gate/up rows against the hidden size
    torch.manual_seed(0)
    blocks, scales = _random_mxfp4(E, N, K, device)
    w_bf16 = dequantize_experts_mxfp4(blocks, scales, torch.bfloat16)
    down_blocks, down_scales = _random_mxfp4(E, H, F, device) if not args.no_layer else (None, None)
    down_bf16 = dequantize_experts_mxfp4(down_blocks, down_scales, torch.bfloat16) if not args.no_layer else None
    mx_bytes_per_expert = N * (K // 2 + K // MXFP4_GROUP)
    print(f"== {model}: E {E}, top-{top_k}, GEMM1 N = 2F = {N}, K = H = {K}", flush=True)

    for T in args.tokens:
        cell = f"{model} T{T}"
        M = T * top_k
        ids, a, tiles_mx, tiles_bf, info_mx, info_bf, active = gemm1_cell(T, top_k, E, H, F, device)
        offsets = info_mx.expert_offsets
        rows_per_expert = M / E

        record = cell_recorder(rows, timer, cell, rows_per_expert)

        c_bf = torch.empty(M, N, device=device, dtype=torch.bfloat16)
        run_bf = functools.partial(expert_gemm, a, w_bf16, info_bf, tiles_bf.gate_up, out=c_bf)
        record(f"(c) package bf16 {tiles_bf.block_m}x{tiles_bf.gate_up.block_n}x{tiles_bf.gate_up.block_k}", run_bf,
               active * N * K * 2)
        reference = c_bf.clone()

        c_mx = torch.empty(M, N, device=device, dtype=torch.bfloat16)
        weight_scale = mxfp4_weight_scale(scales)
        run_mx = functools.partial(expert_gemm, a, blocks, info_mx, tiles_mx.gate_up, weight_scale=weight_scale,
                                   out=c_mx)
        record(f"(b) package mxfp4 {tiles_mx.block_m}x{tiles_mx.gate_up.block_n}x{tiles_mx.gate_up.block_k}", run_mx,
               active * mx_bytes_per_expert, c_mx, reference)

        for config in configs:
            tiles = tile_map(offsets, config.block_m)
            c_ds = torch.empty(M, N, device=device, dtype=torch.bfloat16)
            run_ds = functools.partial(mxfp4_dot_scaled_grouped_gemm, a, blocks, scales, offsets, config, tiles=tiles,
                                       out=c_ds)
            record(f"(a) dot_scaled {config.name}", run_ds, active * mx_bytes_per_expert, c_ds, reference)

        if not args.no_layer:
            x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
            weights = torch.softmax(torch.randn(T, top_k, device=device), dim=-1)
            layer_mx = functools.partial(md.fused_experts, x, blocks, down_blocks, ids, weights,
                                         w_gate_up_scale=scales, w_down_scale=down_scales, validate=False)
            layer_bf = functools.partial(md.fused_experts, x, w_bf16, down_bf16, ids, weights, validate=False)
            record("layer: fused_experts mxfp4", layer_mx, None)
            record("layer: fused_experts bf16", layer_bf, None)
    del blocks, scales, w_bf16, down_blocks, down_scales, down_bf16


def print_table(rows):
    """One table: per cell, each method's us, TB/s of its weight bytes and its speed relative to (b)."""
    print(f"\n{'cell':<22} {'rows/E':>7} {'method':<34} {'us':>10} {'TB/s':>7} {'(b)/this':>9} {'rel err':>9}")
    for cell in dict.fromkeys(row.cell for row in rows):
        cell_rows = [row for row in rows if row.cell == cell]
        package = next((row.us for row in cell_rows if row.method.startswith("(b)")), None)
        for row in cell_rows:
            tbs = f"{row.weight_bytes / (row.us * 1e-6) / 1e12:7.2f}" if row.weight_bytes else f"{'':>7}"
            ratio = f"{package / row.us:8.2f}x" if package and row.weight_bytes else f"{'':>9}"
            error = f"{row.error:9.1e}" if row.error is not None else f"{'':>9}"
            print(f"{cell:<22} {row.rows_per_expert:7.2f} {row.method:<34} {row.us:10.1f} {tbs} {ratio} {error}")
        best = min((row for row in cell_rows if row.method.startswith("(a)")), key=lambda row: row.us, default=None)
        if best is not None and package:
            print(f"{cell:<22} {'':>7} {'best dot_scaled: ' + best.method[15:]:<34} {'':>10} {'':>7} "
                  f"{package / best.us:8.2f}x")
    print("(b)/this: the package's MXFP4 GEMM1 time over this one's (> 1: faster than the package). TB/s: weight "
          "bytes read (experts with rows) per second: MXFP4 bytes + scales for (a), (b); bf16 for (c). rel err: "
          "norm-wise, against (c). Layer rows: fused_experts, both GEMMs, dispatch and combine (MXFP4 at prefill "
          "sizes decodes the weights into a bf16 buffer first).")


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.tokens is None:
        args.tokens = [1, 7] if args.tiny else list(TOKENS)
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if device.type == "cpu" and not interpreted:
        print("--device cpu needs TRITON_INTERPRET=1 (Triton's interpreter)")
        return 2
    print(f"torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU (interpreter)'}", flush=True)
    configs = TINY_CONFIGS if args.tiny else CONFIGS
    rows, failures = [], []
    for model in args.models:
        try:
            probe_model(model, args, device, configs, _timer(device), rows)
        except Exception as exc:  # noqa: BLE001 - the other model still runs; the failure is listed at the end
            import traceback

            traceback.print_exc(limit=4)
            failures.append(f"{model}: {type(exc).__name__}: {str(exc)[:300]}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_table(rows)
    return report_failures(rows, failures)


def report_failures(rows, failures):
    """Adds each row whose error against (c) reaches the bf16 tolerance to `failures`, prints them and the counts ->
    the exit status (1 on any failure)."""
    from moe_dispatch.reference import TOLERANCE

    tolerance = TOLERANCE[torch.bfloat16]
    for row in rows:
        if row.error is not None and not row.error < tolerance:
            failures.append(f"{row.cell} {row.method}: relative error {row.error:.2e} against (c) >= {tolerance:.0e}")
    for line in failures:
        print(f"FAIL {line}")
    print(f"{len(rows)} timings, {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
