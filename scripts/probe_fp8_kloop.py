"""Probe: how fast can a Triton K loop run block-scaled FP8 (128 x 128 weight blocks) on Hopper, and which way of
applying the scales keeps the wgmma pipeline full? A dense GEMM C = A W^T with TMA-fed operands, one kernel, the
K loop's form chosen by MODE:

- scaled:    acc += dot(a8, w8) * a_scale[row, k] * w_scale[k]: the form of the package's w8a8 kernels today (each
             dot's result is needed before the next K step, so the MMAs serialize with the promotion).
- pure:      acc = dot(a8, w8, acc), no scales: the ceiling of the loop (what Triton reaches on FP8 without scales).
- fold_bf16: A arrives in bf16; each K step multiplies it by w_scale[k] / s[row] and converts it to e4m3 in
             registers, then acc = dot(a8', w8, acc); s[row] = max_k(amax[row, k] * w_scale[k]) / 448 (one scale per
             row and column tile, from the per-group amaxes), applied once after the loop. The accumulation is a pure
             chain again; the price is CUDA-core work per A element per column tile.
- fold_fp8:  as fold_bf16 from e4m3 A with group scales (a second rounding of A).
- scaled_pair: as scaled, the weight [N, K] read as two halves [2, N / 2, K] (gate and up of a gated GEMM1): one
             3-D descriptor tile [2, BLOCK_N / 2, BLOCK_K] reshaped to [BLOCK_N, BLOCK_K], one dot of N = BLOCK_N, the
             two halves' block scales as one column vector. Tile column j < BLOCK_N / 2 is row pid_n * BLOCK_N / 2 + j
             of the first half, the rest of the second half (a store of the raw tile: the probe times the K loop).

Prints one line per (shape, mode, tile): time, TFLOP/s, relative error against the dequantized fp32 product; and
torch._scaled_mm (row-wise fp8) as the library ceiling. Needs a Hopper GPU.

    PYTHONPATH=torch-ext python scripts/probe_fp8_kloop.py [--out results.json]
"""

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moe_dispatch.gemm.jit import tile_coords

MODES = {"scaled": 0, "pure": 1, "fold_bf16": 2, "fold_fp8": 3, "scaled_pair": 4}
FP8_MAX = 448.0
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a plumbing check under TRITON_INTERPRET=1


@triton.jit
def _probe_kernel(a_desc, a_scale_ptr, row_scale_ptr, w_desc, w_pair_desc, w_scale_ptr, c_ptr, M, N, K,
                  MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),). a_scale [M, K / 128] (per row and group), w_scale
    [N / 128, K / 128], row_scale [M, N / 128] (fold modes: s[row] of each column block)."""
    pid_m, pid_n = tile_coords(tl.program_id(0), N, tl.cdiv(M, BLOCK_M), BLOCK_N, GROUP_M)  # the package's order
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    num_kb = tl.cdiv(K, 128)
    nb = (pid_n * BLOCK_N) // 128
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if MODE == 2 or MODE == 3:
        inv_s = 1.0 / tl.load(row_scale_ptr + offs_m * tl.cdiv(N, 128) + nb)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        a = a_desc.load([pid_m * BLOCK_M, k0])
        if MODE == 4:
            w = tl.reshape(w_pair_desc.load([0, pid_n * (BLOCK_N // 2), k0]), (BLOCK_N, BLOCK_K))
            half_n = N // 2
            s_g = tl.load(w_scale_ptr + ((pid_n * (BLOCK_N // 2)) // 128) * num_kb + k0 // 128)
            s_u = tl.load(w_scale_ptr + ((half_n + pid_n * (BLOCK_N // 2)) // 128) * num_kb + k0 // 128)
            w_s = tl.where(tl.arange(0, BLOCK_N) < BLOCK_N // 2, s_g, s_u)[None, :]
        else:
            w = w_desc.load([pid_n * BLOCK_N, k0])
            w_s = tl.load(w_scale_ptr + nb * num_kb + k0 // 128)
        if MODE == 0 or MODE == 4:
            a_s = tl.load(a_scale_ptr + offs_m * num_kb + k0 // 128)
            acc += tl.dot(a, w.T) * (a_s[:, None] * w_s)
        elif MODE == 1:
            acc = tl.dot(a, w.T, acc)
        elif MODE == 2:
            a8 = (a.to(tl.float32) * (inv_s * w_s)[:, None]).to(tl.float8e4nv)
            acc = tl.dot(a8, w.T, acc)
        else:
            a_s = tl.load(a_scale_ptr + offs_m * num_kb + k0 // 128)
            a8 = (a.to(tl.float32) * (a_s * inv_s * w_s)[:, None]).to(tl.float8e4nv)
            acc = tl.dot(a8, w.T, acc)
    if MODE == 2 or MODE == 3:
        acc = acc * (1.0 / inv_s)[:, None]
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16))


def quantize_groups(x):
    """x [M, K] -> (e4m3 [M, K], scale [M, K / 128]) per row and 128 columns."""
    M, K = x.shape
    g = x.float().view(M, K // 128, 128)
    amax = g.abs().amax(-1).clamp_min(1e-10)
    q = (g * (FP8_MAX / amax)[..., None]).to(torch.float8_e4m3fn).view(M, K)
    return q, amax / FP8_MAX


def quantize_blocks(w):
    """w [N, K] -> (e4m3 [N, K], scale [N / 128, K / 128]) per 128 x 128 block."""
    N, K = w.shape
    b = w.float().view(N // 128, 128, K // 128, 128)
    amax = b.abs().amax((1, 3)).clamp_min(1e-10)
    q = (b * (FP8_MAX / amax)[:, None, :, None]).to(torch.float8_e4m3fn).view(N, K)
    return q, amax / FP8_MAX


def run_case(M, N, K, tiles, modes, results):
    torch.manual_seed(0)
    x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=DEVICE, dtype=torch.bfloat16) * 0.02
    # vary the weight scale across blocks by up to 16x, as checkpoints do
    block_gain = 2.0 ** torch.randint(-2, 3, (N // 128, 1, K // 128, 1), device=DEVICE)
    w = w * block_gain.expand(-1, 128, -1, 128).reshape(N, K)
    xq, xs = quantize_groups(x)
    wq, ws = quantize_blocks(w)
    w_deq = (wq.float().view(N // 128, 128, K // 128, 128) * ws[:, None, :, None]).view(N, K)
    ref = x.float() @ w_deq.T
    # s[row, column block] = max_k amax[row, k] * w_scale[block, k] / 448 (xs is amax / 448 already)
    row_scale = (xs[:, None, :] * ws[None, :, :]).amax(-1).contiguous()  # [M, N / 128]
    flops = 2.0 * M * N * K
    for mode_name, mode in modes.items():
        for (bm, bn, bk, warps, stages) in tiles:
            a = x if mode == 2 else xq
            a_desc = TensorDescriptor(a, [M, K], [K, 1], [bm, bk])
            w_desc = TensorDescriptor(wq, [N, K], [K, 1], [bn, bk])
            w_pair_desc = TensorDescriptor(wq, [2, N // 2, K], [N // 2 * K, K, 1], [2, bn // 2, bk])
            c = torch.empty(M, N, device=DEVICE, dtype=torch.bfloat16)
            grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)

            def call():
                _probe_kernel[grid](a_desc, xs, row_scale, w_desc, w_pair_desc, ws, c, M, N, K, MODE=mode, BLOCK_M=bm,
                                    BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_STAGES=stages, num_warps=warps)
            try:
                call()
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(call, warmup=50, rep=200)
            except Exception as exc:  # a tile that does not fit (shared memory) is reported, not fatal
                print(f"{M}x{N}x{K} {mode_name:9s} {bm}x{bn}x{bk} w{warps} s{stages}: failed {type(exc).__name__}: "
                      f"{str(exc)[:120]}")
                continue
            if mode == 1:
                err = float("nan")
            elif mode == 4:  # tile columns: the first half of each from the first half of W, the rest from the second
                order = torch.arange(N, device=DEVICE).view(N // bn, 2, bn // 2)
                order[:, 1] += N // 2 - torch.arange(N // bn, device=DEVICE)[:, None] * (bn // 2) - bn // 2
                order[:, 0] -= torch.arange(N // bn, device=DEVICE)[:, None] * (bn // 2)
                err = ((c.float() - ref[:, order.reshape(N)]).norm() / ref.norm()).item()
            else:
                err = ((c.float() - ref).norm() / ref.norm()).item()
            row = dict(M=M, N=N, K=K, mode=mode_name, tile=[bm, bn, bk, warps, stages], us=ms * 1e3,
                       tflops=flops / ms / 1e9, rel_err=err)
            results.append(row)
            print(f"{M}x{N}x{K} {mode_name:9s} {bm}x{bn}x{bk} w{warps} s{stages}: {ms * 1e3:8.1f} us "
                  f"{row['tflops']:7.1f} TFLOP/s err {err:.2e}", flush=True)
    # the library's row-wise FP8 GEMM as the ceiling
    one = torch.ones(M, 1, device=DEVICE)
    ones_n = torch.ones(1, N, device=DEVICE)
    mm = lambda: torch._scaled_mm(xq, wq.T, scale_a=one, scale_b=ones_n, out_dtype=torch.bfloat16)
    ms = triton.testing.do_bench(mm, warmup=50, rep=200)
    results.append(dict(M=M, N=N, K=K, mode="_scaled_mm rowwise", us=ms * 1e3, tflops=flops / ms / 1e9))
    print(f"{M}x{N}x{K} _scaled_mm rowwise: {ms * 1e3:8.1f} us {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)
    wb = w.to(torch.bfloat16)
    ms = triton.testing.do_bench(lambda: x @ wb.T, warmup=50, rep=200)
    results.append(dict(M=M, N=N, K=K, mode="bf16 matmul", us=ms * 1e3, tflops=flops / ms / 1e9))
    print(f"{M}x{N}x{K} bf16 matmul: {ms * 1e3:8.1f} us {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--tiles", default="128x128x128x8x3,128x128x128x8x4,128x128x128x4x3,64x128x128x4x4,"
                        "128x128x64x8x4,128x128x64x4x4", help="BMxBNxBKxWARPSxSTAGES,...")
    parser.add_argument("--shapes", default="8192x14336x4096,8192x4096x14336,4096x1536x2048", help="MxNxK,...")
    args = parser.parse_args()
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
    modes = {name: MODES[name] for name in args.modes.split(",")}
    results = []
    for shape in args.shapes.split(","):
        M, N, K = (int(v) for v in shape.split("x"))
        run_case(M, N, K, tiles, modes, results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
