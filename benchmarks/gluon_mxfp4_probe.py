"""Probe of a warp-specialized Gluon GEMM with MXFP4 weights (Hopper, Triton 3.6): the MXFP4 experts' GEMM1 with the
weight decode overlapped with the MMA, beside the package's MXFP4 and bf16 grouped GEMMs. One step ahead of the
package, not part of it.

    PYTHONPATH=torch-ext:scripts:benchmarks python3 benchmarks/gluon_mxfp4_probe.py
        [--models gpt-oss-120b gpt-oss-20b] [--tokens 128 1024 4096 16384] [--stages 4]

The kernel (`_mxfp4_gemm_kernel`): C [M, N] bf16 = A_seg @ dequant(W_e)^T over expert-sorted rows (the tile map of
dispatch.segments, as the FP8 engine walks it), persistent, one CTA per SM, three partitions (gemm/gluon_ws.py's
skeleton: its tile order, ring and store):

    producer  (1 warp)      TMA loads of A [64, 64] bf16 and two packed weight tiles [128, 32] uint8 (the output
                            tile's two 128-column halves; 64 K values as 32 bytes a row) into a ring of stages
    consumer c (warp group) its 128 columns: per K step, the packed bytes from shared memory into registers (16 a
                            thread), their two scale codes from global memory, the PTX decode of gemm/jit.py
                            (E2M1_BF16X2_PTX: two values per 32-bit operation, the scale applied), the values back
                            in K order into one of two bf16 [128, 64] buffers of its own, then an asynchronous wgmma
                            (m64n128k16) of A's stage against that buffer. The decode of step i + 1 runs while the
                            wgmma of step i is in flight (wait until one is outstanding); a stage goes back to the
                            producer once the wgmma that read its A tile has completed.

The checkpoint's byte order is read as stored (byte j of a row: K values 2j and 2j + 1); no prepared layout.

1. Correctness on a GPU against float64 (moe_dispatch.reference) on small odd sizes (dot_scaled probe's SMALL_CASES:
   an empty expert, ragged rows, a masked column tile and K step), a NaN in a row of A, a 0xFF scale code.
2. Speed: GPT-OSS GEMM1 (N = 2F, K = H) at each T (M = 4T rows, uniform random top-4 routing), CUDA-graph replays,
   median us, beside (c) the package's bf16 grouped GEMM on the dequantized weight and (b) its MXFP4 grouped GEMM
   (gemm.grouped.expert_gemm with the tables' tiles). Relative error against (c). Nothing asserts a speed.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import traceback

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mxfp4_dot_scaled_probe import (SMALL_CASES, Row, _layer_shape, _mxfp4_weight, _offsets,  # noqa: E402
                                    _random_mxfp4, _reference, _timer)

from moe_dispatch.dispatch.segments import segment_tile_map  # noqa: E402
from moe_dispatch.gemm.gluon_ws import (TensorDescriptor, check_device, gl, gluon_jit, mbarrier,  # noqa: E402
                                        stage_ring, store_layout, store_tile, tile_at, tile_counts, tma_load,
                                        warpgroup_mma, warpgroup_mma_wait)
from moe_dispatch.gemm.jit import E2M1_BF16X2_PTX  # noqa: E402
from moe_dispatch.host.device import num_sms  # noqa: E402

try:
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared
except ImportError:
    fence_async_shared = None

MXFP4_GROUP = 32
BLOCK_M, HALF_N, BLOCK_K = 64, 128, 64  # a consumer's wgmma: m64 n128, K steps of 64 values (32 bytes, 2 scales)
GEMM_NAME = "Gluon MXFP4 GEMM (probe)"
TOKENS = (128, 1024, 4096, 16384)


@gluon_jit
def _load_partition(a_desc, w_desc, a_bufs, w_bufs, ready_bars, empty_bars, M, K, num_pid_m, num_pid_n, num_tiles,
                    n_per_expert, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, GROUP_M: gl.constexpr):
    """Producer: per tile and K step, A [BLOCK_M, BLOCK_K] and the weight's two [HALF_N, BLOCK_K / 2] byte tiles
    (columns off_n and off_n + HALF_N of the expert) into the next free stage."""
    A_ROWS: gl.constexpr = a_desc.block_type.shape[0]
    A_K: gl.constexpr = a_desc.block_type.shape[1]
    W_ROWS: gl.constexpr = w_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    STAGE_BYTES: gl.constexpr = a_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes
    k_blocks = gl.cdiv(K, A_K)
    it = 0
    for tile_id in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        row_start, row_end, expert, pid_n = tile_at(tile_id, num_pid_m, num_pid_n, M, tile_expert_ptr, tile_row_ptr,
                                                    expert_offsets_ptr, A_ROWS, GROUP_M, True)
        row_w = expert * n_per_expert + pid_n * (2 * W_ROWS)
        for kb in range(k_blocks):
            stage = it % STAGES
            mbarrier.wait(empty_bars.index(stage), ((it // STAGES) & 1) ^ 1)
            ready = ready_bars.index(stage)
            mbarrier.expect(ready, STAGE_BYTES)
            tma_load(a_desc, [row_start, kb * A_K], ready, a_bufs.index(stage))
            for t in gl.static_range(2):
                tma_load(w_desc, [row_w + t * W_ROWS, kb * (A_K // 2)], ready, w_bufs.index(2 * stage + t))
            it += 1


@gluon_jit
def _mma_partition(a_bufs, w_bufs, dec_bufs, ready_bars, empty_bars, scale_ptr, out_ptr, M, N, K, num_pid_m,
                   num_pid_n, num_tiles, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, stride_s_e, stride_s_n,
                   stride_s_k, stride_out_m, WARP_GROUP: gl.constexpr, GROUP_M: gl.constexpr,
                   acc_layout: gl.constexpr, out_layout: gl.constexpr,
                   bytes_layout: gl.constexpr, split_layout: gl.constexpr):
    """Consumer WARP_GROUP: columns [WARP_GROUP * HALF_N, +HALF_N) of every 64 x 2 HALF_N tile (module docstring)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    A_ROWS: gl.constexpr = a_bufs.type.shape[1]
    A_K: gl.constexpr = a_bufs.type.shape[2]
    W_ROWS: gl.constexpr = w_bufs.type.shape[1]
    GROUPS: gl.constexpr = A_K // 32  # scale groups per K step (16 bytes each)
    scale_layout: gl.constexpr = gl.SliceLayout(2, split_layout)
    offs_r = gl.arange(0, W_ROWS, layout=gl.SliceLayout(1, scale_layout))
    offs_g = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, scale_layout))
    k_blocks = gl.cdiv(K, A_K)
    k_groups = K // 32
    zero = gl.zeros([A_ROWS, W_ROWS], gl.float32, acc_layout)
    it = 0
    for tile_id in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        row_start, row_end, expert, pid_n = tile_at(tile_id, num_pid_m, num_pid_n, M, tile_expert_ptr, tile_row_ptr,
                                                    expert_offsets_ptr, A_ROWS, GROUP_M, True)
        col_start = pid_n * (2 * W_ROWS) + WARP_GROUP * W_ROWS
        cols = col_start + offs_r
        s_ptrs = (scale_ptr + expert.to(gl.int64) * stride_s_e + gl.expand_dims(cols.to(gl.int64) * stride_s_n, 1)
                  + gl.expand_dims(offs_g * stride_s_k, 0))
        mask_cols = gl.expand_dims(cols < N, 1)
        acc = zero
        for kb in range(k_blocks):
            stage = it % STAGES
            mbarrier.wait(ready_bars.index(stage), (it // STAGES) & 1)
            packed = w_bufs.index(2 * stage + WARP_GROUP).load(bytes_layout)  # [W_ROWS, A_K / 2] uint8
            packed = gl.convert_layout(gl.reshape(packed, [W_ROWS, GROUPS, 16]), split_layout)
            codes = gl.load(s_ptrs + kb * GROUPS * stride_s_k,
                            mask=mask_cols & gl.expand_dims(kb * GROUPS + offs_g < k_groups, 0), other=0)
            codes = codes.to(gl.uint16)
            bits = gl.where(codes == 0, 0x0040, gl.where(codes == 255, 0x7FC0, codes << 7)).to(gl.uint16)
            scale = gl.expand_dims(bits.to(gl.bfloat16, bitcast=True), 2)  # [W_ROWS, GROUPS, 1]
            scale, packed = gl.broadcast(scale, packed)
            lo, hi = gl.inline_asm_elementwise(E2M1_BF16X2_PTX, "=r,=r,=r,=r,r,r,r", [packed, scale],
                                               dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
            w = gl.reshape(gl.join(lo, hi), [W_ROWS, A_K])  # K order: byte j's low nibble is value 2j
            dec = dec_bufs.index(2 * WARP_GROUP + it % 2)
            dec.store(w)
            fence_async_shared()
            acc = warpgroup_mma(a_bufs.index(stage), dec.permute((1, 0)), acc, is_async=True)
            # the wgmma of the step before has completed: its stage (A tile) goes back to the producer, and its
            # decode buffer may be written at the next step
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            if kb > 0:
                mbarrier.arrive(empty_bars.index((it - 1) % STAGES), count=1)
            it += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty_bars.index((it - 1) % STAGES), count=1)
        store_tile(out_ptr, stride_out_m, gl.convert_layout(acc.to(gl.bfloat16), out_layout), row_start, row_end,
                   col_start, N, out_layout)


@gluon_jit
def _mxfp4_gemm_kernel(a_desc, w_desc, scale_ptr, out_ptr, tile_expert_ptr, tile_row_ptr, num_m_tiles_ptr,
                       expert_offsets_ptr, M, N, K, n_per_expert, stride_s_e, stride_s_n, stride_s_k, stride_out_m,
                       NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                       PRODUCER_REGS: gl.constexpr, acc_layout: gl.constexpr, out_layout: gl.constexpr,
                       bytes_layout: gl.constexpr, split_layout: gl.constexpr, dec_layout: gl.constexpr,
                       num_warps: gl.constexpr):
    A_ROWS: gl.constexpr = a_desc.block_type.shape[0]
    A_K: gl.constexpr = a_desc.block_type.shape[1]
    W_ROWS: gl.constexpr = w_desc.block_type.shape[0]
    gl.static_assert(num_warps == 4, "each consumer is one warp group")
    a_bufs, w_bufs, ready_bars, empty_bars = stage_ring(a_desc, w_desc, NUM_STAGES, 2)
    dec_bufs = gl.allocate_shared_memory(gl.bfloat16, [4, W_ROWS, A_K], dec_layout)  # two per consumer
    num_pid_m, num_pid_n, num_tiles = tile_counts(M, N, num_m_tiles_ptr, A_ROWS, 2 * W_ROWS, True)
    gl.warp_specialize([
        (_mma_partition, (a_bufs, w_bufs, dec_bufs, ready_bars, empty_bars, scale_ptr, out_ptr, M, N, K, num_pid_m,
                          num_pid_n, num_tiles, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, stride_s_e,
                          stride_s_n, stride_s_k, stride_out_m, 0, GROUP_M, acc_layout, out_layout, bytes_layout,
                          split_layout)),
        (_mma_partition, (a_bufs, w_bufs, dec_bufs, ready_bars, empty_bars, scale_ptr, out_ptr, M, N, K, num_pid_m,
                          num_pid_n, num_tiles, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, stride_s_e,
                          stride_s_n, stride_s_k, stride_out_m, 1, GROUP_M, acc_layout, out_layout, bytes_layout,
                          split_layout)),
        (_load_partition, (a_desc, w_desc, a_bufs, w_bufs, ready_bars, empty_bars, M, K, num_pid_m, num_pid_n,
                           num_tiles, n_per_expert, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, GROUP_M)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def kernel_layouts():
    """Register and shared layouts of the kernel: (acc, out, bytes, split, dec, a_smem, w_smem)."""
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF_N, 16])
    out = store_layout(BLOCK_M, HALF_N)
    # a consumer's [128, 32] packed tile: 16 bytes (one scale group) a thread, two threads a row, 16 rows a warp
    bytes_layout = gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0])
    split = gl.BlockedLayout([1, 1, 16], [16, 2, 1], [4, 1, 1], [2, 1, 0])  # the same as [rows, groups, 16 bytes]
    dec = gl.NVMMASharedLayout.get_default_for([HALF_N, BLOCK_K], gl.bfloat16)
    a_smem = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
    w_smem = gl.NVMMASharedLayout.get_default_for([HALF_N, BLOCK_K // 2], gl.uint8)
    return acc, out, bytes_layout, split, dec, a_smem, w_smem


def mxfp4_grouped_gemm(a, blocks, scales, expert_offsets, *, stages=4, group_m=8, out=None):
    """out [M, N] bf16: rows of expert e, out[o_e:o_{e+1}] = a[o_e:o_{e+1}] @ dequant(blocks[e], scales[e])^T.

    a [M, K] bf16 sorted by expert (K a multiple of 32), blocks uint8 [E, N, K / 2] contiguous (the checkpoint's
    order), scales uint8 [E, N, K / 32] (e8m0 codes), expert_offsets int32 [E + 1]. No host sync."""
    E, N, half_k = blocks.shape
    M, K = a.shape
    assert a.dtype == torch.bfloat16 and blocks.dtype == torch.uint8 and scales.dtype == torch.uint8
    assert K % MXFP4_GROUP == 0 and half_k * 2 == K and tuple(scales.shape) == (E, N, K // MXFP4_GROUP)
    assert blocks.is_contiguous() and a.stride(1) == 1
    check_device(GEMM_NAME, a, blocks, scales, expert_offsets)
    out = torch.empty(M, N, device=a.device, dtype=torch.bfloat16) if out is None else out
    if out.numel() == 0 or E == 0:
        return out
    acc, out_l, bytes_l, split_l, dec_l, a_smem, w_smem = kernel_layouts()
    offsets, tile_expert, tile_row, num_m_tiles = segment_tile_map(expert_offsets, M, E, BLOCK_M, count_tiles=True)
    bound_tiles = tile_expert.numel() * triton.cdiv(N, 2 * HALF_N)
    a_desc = TensorDescriptor.from_tensor(a, [BLOCK_M, BLOCK_K], a_smem)
    w_desc = TensorDescriptor.from_tensor(blocks.view(E * N, half_k), [HALF_N, BLOCK_K // 2], w_smem)
    grid = (max(1, min(num_sms(a.device), bound_tiles)), )
    _mxfp4_gemm_kernel[grid](a_desc, w_desc, scales, out, tile_expert, tile_row, num_m_tiles, offsets, M, N, K, N,
                             scales.stride(0), scales.stride(1), scales.stride(2), out.stride(0), NUM_STAGES=stages,
                             GROUP_M=group_m, CONSUMER_REGS=232, PRODUCER_REGS=24, acc_layout=acc, out_layout=out_l,
                             bytes_layout=bytes_l, split_layout=split_l, dec_layout=dec_l, num_warps=4, maxnreg=168)
    return out


def check_small_cases(device):
    """The kernel against float64 on SMALL_CASES, a NaN row of A and a 0xFF scale code; -> lines to print (raises
    AssertionError on the first failure)."""
    from moe_dispatch.reference import assert_close

    lines = []
    for counts, N, K, why in SMALL_CASES:
        E, M = len(counts), sum(counts)
        a = torch.randn(M, K, generator=torch.Generator().manual_seed(3)).to(device, torch.bfloat16)
        blocks, scales = _mxfp4_weight(E, N, K, device, 1)
        offsets = _offsets(counts, device)
        out = torch.full((M, N), float("nan"), device=device, dtype=torch.bfloat16)  # poisoned: every row written
        mxfp4_grouped_gemm(a, blocks.contiguous(), scales, offsets, out=out)
        assert_close(out, _reference(a, blocks, scales, offsets), torch.bfloat16, what=why)
        lines.append(f"ok: {why}")
    counts, N, K, _ = SMALL_CASES[0]
    E, M = len(counts), sum(counts)
    a = torch.randn(M, K, device=device).to(torch.bfloat16)
    a[7, 5] = float("nan")
    blocks, scales = _mxfp4_weight(E, N, K, device, 2)
    scales[2, 9, 1] = 255  # expert 2 (rows 5..21), column 9
    out = mxfp4_grouped_gemm(a, blocks.contiguous(), scales, _offsets(counts, device))
    nan = out.isnan()
    expected = torch.zeros_like(nan)
    expected[7] = True
    expected[5:22, 9] = True
    assert torch.equal(nan, expected), f"NaN pattern: {nan.nonzero().tolist()[:20]}"
    lines.append("ok: a NaN in row 7 of A -> row 7; scale code 0xFF of expert 2, column 9 -> that column of its rows")
    return lines


def probe_model(model, args, device, timer, rows):
    from moe_dispatch.dispatch.segments import dispatch
    from moe_dispatch.formats.mxfp4 import dequantize_experts_mxfp4, mxfp4_weight_scale
    from moe_dispatch.gemm.grouped import expert_gemm
    from moe_dispatch.host.tiles import select_tiles
    from moe_dispatch.reference import relative_error

    shape = _layer_shape(model, False)
    E, H, F, top_k = shape.num_experts, shape.hidden, shape.ffn, 4
    N, K = 2 * F, H
    torch.manual_seed(0)
    blocks, scales = _random_mxfp4(E, N, K, device)
    w_bf16 = dequantize_experts_mxfp4(blocks, scales, torch.bfloat16)
    print(f"== {model}: E {E}, top-{top_k}, GEMM1 N = {N}, K = {K}", flush=True)
    for T in args.tokens:
        cell = f"{model} T{T}"
        M = T * top_k
        ids = torch.rand(T, E, device=device).topk(top_k, dim=1).indices.to(torch.int32)
        a = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        tiles_mx = select_tiles(device, T, top_k, E, F, H, torch.bfloat16, mxfp4=True)
        tiles_bf = select_tiles(device, T, top_k, E, F, H, torch.bfloat16)
        info_mx, info_bf = dispatch(ids, E, tiles_mx.block_m), dispatch(ids, E, tiles_bf.block_m)
        offsets = info_mx.expert_offsets
        flops = 2 * M * N * K

        def record(method, fn, out=None, reference=None):
            us, how = timer(fn)
            error = relative_error(out, reference) if out is not None and reference is not None else None
            rows.append(Row(cell, M / E, method, us, flops, how, error))
            print(f"   {cell:<18} {method:<40} {us:10.1f} us {flops / us / 1e6:7.1f} TFLOP/s"
                  + (f"  err {error:.1e}" if error is not None else ""), flush=True)

        c_bf = torch.empty(M, N, device=device, dtype=torch.bfloat16)
        record(f"(c) package bf16 {tiles_bf.block_m}x{tiles_bf.gate_up.block_n}x{tiles_bf.gate_up.block_k}",
               functools.partial(expert_gemm, a, w_bf16, info_bf, tiles_bf.gate_up, out=c_bf))
        reference = c_bf.clone()
        c_mx = torch.empty(M, N, device=device, dtype=torch.bfloat16)
        record(f"(b) package mxfp4 {tiles_mx.block_m}x{tiles_mx.gate_up.block_n}x{tiles_mx.gate_up.block_k}",
               functools.partial(expert_gemm, a, blocks, info_mx, tiles_mx.gate_up,
                                 weight_scale=mxfp4_weight_scale(scales), out=c_mx), c_mx, reference)
        for stages in args.stages:
            c = torch.empty(M, N, device=device, dtype=torch.bfloat16)
            try:
                record(f"(g) gluon mxfp4 64x256x64 {stages} stages",
                       functools.partial(mxfp4_grouped_gemm, a, blocks, scales, offsets, stages=stages, out=c), c,
                       reference)
            except Exception as exc:  # noqa: BLE001 - reported, the rest runs
                print(f"   {cell:<18} (g) {stages} stages: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    del blocks, scales, w_bf16


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt-oss-120b", "gpt-oss-20b"])
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--stages", nargs="+", type=int, default=[4, 6])
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    failures = []
    try:
        for line in check_small_cases(device):
            print(line, flush=True)
    except Exception as exc:  # noqa: BLE001 - the speed section still runs
        failures.append(f"correctness: {type(exc).__name__}: {exc}")
        traceback.print_exc()
    rows = []
    for model in args.models:
        try:
            probe_model(model, args, device, _timer(device), rows)
        except Exception as exc:  # noqa: BLE001
            failures.append(f"{model}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
    print(f"\n{'cell':<20} {'method':<40} {'us':>9} {'TFLOP/s':>8} {'(b)/this':>8} {'(c)/this':>8}")
    for cell in dict.fromkeys(row.cell for row in rows):
        cell_rows = [row for row in rows if row.cell == cell]
        by = {row.method[:3]: row.us for row in cell_rows}
        for row in cell_rows:
            print(f"{cell:<20} {row.method:<40} {row.us:9.1f} {row.weight_bytes / row.us / 1e6:8.1f} "
                  f"{by.get('(b)', float('nan')) / row.us:8.2f} {by.get('(c)', float('nan')) / row.us:8.2f}")
    for failure in failures:
        print(f"FAILED {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
