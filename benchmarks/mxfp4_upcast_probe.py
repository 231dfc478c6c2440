"""Probe of the MXFP4 experts' first GEMM with the weight upcast in registers, beside the package's MXFP4 and bf16
grouped GEMMs: one step ahead of the package, not part of it.

    PYTHONPATH=torch-ext:scripts:benchmarks python3 benchmarks/mxfp4_upcast_probe.py
        [--models gpt-oss-120b gpt-oss-20b] [--tokens 1 16 128 1024 4096]

GEMM1 of an MXFP4 MoE layer, C [M, N] = A_seg @ dequant(W_e)^T per expert (the same cells, weights, routing and
timing as benchmarks/mxfp4_dot_scaled_probe.py, whose helpers it uses), by `_mxfp4_upcast_grouped_gemm_kernel` with
the package's decode functions (gemm/jit.py) in five decodes and two operand orders:

  DECODE "f32-split"        the package's decode before v27: each nibble in its own 32-bit lane (`e2m1_to_f32`,
                            times `e8m0_to_f32`), the even and odd K values dotted separately against A's even and odd
                            columns (two dots a step, A split and transposed);
  DECODE "f32-join"         the same per-value decode, the halves joined back into K order (`tl.join`): one dot a step
                            (the package's fp32 decode since v27);
  DECODE "bf16x2"           `e2m1_bf16x2`: inline PTX, two values per 32-bit operation (the package's decode for bf16
                            on NVIDIA since v27), joined into K order, one dot;
  DECODE "bf16x2-prepared", "f32-prepared"
                            the same on bytes in the prepared order (`prepare_bytes`: each 16-byte group reordered so
                            that the four bytes an MMA operand's thread reads lie together), put back in the kernel.
  "swap": the weight is the dot's lhs (C^T accumulated), "rows": A is the lhs.

Printed per cell: us (CUDA graph replays, median), the TB/s of the weight bytes it reads, its speed over the
package's MXFP4 GEMM (> 1: faster) and its relative error against the package's bf16 GEMM on the dequantized weight
(all read the same bf16 rows and the same weight values, exact in bf16, and sum in fp32). Before the cells, the
bf16x2 decode of every byte under scale codes 0, 1, 118, 127, 200, 254 and 255 is checked bit for bit against the
package's dequantization (on a GPU only: the interpreter runs no PTX). Nothing asserts a speed.
"""

import argparse
import dataclasses
import functools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mxfp4_dot_scaled_probe import (ProbeConfig, _layer_shape, _random_mxfp4, _timer,  # noqa: E402
                                    cell_recorder, gemm1_cell, grouped_tile_pointers, launch_grouped, load_k_step, report_failures,
                                    store_tile, tile_map, zero_sums)

from moe_dispatch.gemm.jit import MXFP4_GROUP, e2m1_bf16x2, e2m1_to_f32, e8m0_to_bf16, e8m0_to_f32  # noqa: E402

DECODES = {"f32-split": 0, "f32-join": 1, "bf16x2": 2, "bf16x2-prepared": 3, "f32-prepared": 4}
TOKENS = (1, 16, 128, 1024, 4096)

@triton.jit
def _f32_halves(b_bytes, b_codes, dtype: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """(even, odd) [ROWS, BLOCK_K / 2] in dtype: the package's decode of the low and high nibbles."""
    b_scale = tl.broadcast_to(e8m0_to_f32(b_codes)[:, :, None], (ROWS, BLOCK_K // MXFP4_GROUP, MXFP4_GROUP // 2))
    b_scale = tl.reshape(b_scale, (ROWS, BLOCK_K // 2))
    return (e2m1_to_f32(b_bytes) * b_scale).to(dtype), (e2m1_to_f32(b_bytes >> 4) * b_scale).to(dtype)


@triton.jit
def _weight_tile(b_bytes, b_codes, dtype: tl.constexpr, DECODE: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """The weight tile [ROWS, BLOCK_K] in K order from bytes [ROWS, BLOCK_K / 2] and scale codes [ROWS, BLOCK_K /
    32]: DECODE 1 the package's per-value decode, 2 bf16x2 (bf16 only); 3 and 4 as 2 and 1 on bytes in the prepared
    order (`prepare_bytes`), put back into K order here (a permutation inside each 16-byte group)."""
    if DECODE >= 3:
        b_groups = tl.reshape(b_bytes, (ROWS, BLOCK_K // MXFP4_GROUP, 4, 4))  # memory byte 4q + j of a group
        b_bytes = tl.reshape(tl.permute(b_groups, (0, 1, 3, 2)), (ROWS, BLOCK_K // 2))  # K-order byte 4j + q
    if DECODE == 2 or DECODE == 3:
        b_scale = tl.broadcast_to(e8m0_to_bf16(b_codes)[:, :, None], (ROWS, BLOCK_K // MXFP4_GROUP, MXFP4_GROUP // 2))
        lo, hi = e2m1_bf16x2(b_bytes, tl.reshape(b_scale, (ROWS, BLOCK_K // 2)))
    else:
        lo, hi = _f32_halves(b_bytes, b_codes, dtype, ROWS, BLOCK_K)
    return tl.reshape(tl.join(lo, hi), (ROWS, BLOCK_K))


@triton.jit
def _mxfp4_upcast_grouped_gemm_kernel(
        a_ptr, w_ptr, w_scale_ptr, c_ptr, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
        N, K,
        stride_a_m, stride_a_k,
        stride_w_e, stride_w_n, stride_w_k,
        stride_w_scale_e, stride_w_scale_n, stride_w_scale_k,
        stride_c_m, stride_c_n,
        DECODE: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C [M, N] = A_seg @ dequant(W_e)^T (the dot_scaled probe's grid and arguments), the weight decoded by DECODE."""
    offs_m, offs_n, mask_m, mask_n, a_ptrs, w_ptrs, s_ptrs = grouped_tile_pointers(
        a_ptr, w_ptr, w_scale_ptr, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, N, stride_a_m, stride_a_k,
        stride_w_e, stride_w_n, stride_w_k, stride_w_scale_e, stride_w_scale_n, stride_w_scale_k,
        BLOCK_M, BLOCK_N, BLOCK_K)
    acc = zero_sums(SWAP_AB, BLOCK_M, BLOCK_N)
    for k0 in range(0, K, BLOCK_K):
        b_a, b_bytes, b_codes = load_k_step(a_ptrs, w_ptrs, s_ptrs, mask_m, mask_n, K - k0, not EVEN_K, BLOCK_K)
        if DECODE == 0:
            w0, w1 = _f32_halves(b_bytes, b_codes, a_ptr.dtype.element_ty, BLOCK_N, BLOCK_K)
            a_even, a_odd = tl.split(tl.reshape(b_a, (BLOCK_M, BLOCK_K // 2, 2)))
            if SWAP_AB:
                acc = tl.dot(w0, tl.trans(a_even), acc)
                acc = tl.dot(w1, tl.trans(a_odd), acc)
            else:
                acc = tl.dot(a_even, tl.trans(w0), acc)
                acc = tl.dot(a_odd, tl.trans(w1), acc)
        else:
            w0 = _weight_tile(b_bytes, b_codes, a_ptr.dtype.element_ty, DECODE, BLOCK_N, BLOCK_K)
            if SWAP_AB:
                acc = tl.dot(w0, tl.trans(b_a), acc)
            else:
                acc = tl.dot(b_a, tl.trans(w0), acc)
        a_ptrs += BLOCK_K * stride_a_k
        w_ptrs += (BLOCK_K // 2) * stride_w_k
        s_ptrs += (BLOCK_K // 32) * stride_w_scale_k
    store_tile(acc, c_ptr, offs_m, offs_n, mask_m, mask_n, stride_c_m, stride_c_n, SWAP_AB)


@triton.jit
def _decode_table_kernel(w_ptr, s_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out [2 n] bf16: the low- and high-nibble values of bytes w [n] under scale codes s [n] (bf16x2 decode)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    b = tl.load(w_ptr + offs, mask=mask, other=0)
    s = e8m0_to_bf16(tl.load(s_ptr + offs, mask=mask, other=127))
    lo, hi = e2m1_bf16x2(b, s)
    tl.store(out_ptr + 2 * offs, lo, mask=mask)
    tl.store(out_ptr + 2 * offs + 1, hi, mask=mask)


def check_decode_table(device):
    """The bf16x2 decode of all 256 bytes under scale codes 0, 1, 118, 127, 200, 254, 255 against
    moe_dispatch.reference.dequantize_mxfp4_ref, bit for bit (NaN where the reference is NaN) -> a line."""
    from moe_dispatch.reference import dequantize_mxfp4_ref

    codes = torch.tensor([0, 1, 118, 127, 200, 254, 255], dtype=torch.uint8)
    w = torch.arange(256, dtype=torch.uint8).repeat(len(codes))
    s = codes.repeat_interleave(256)
    out = torch.empty(2 * w.numel(), dtype=torch.bfloat16, device=device)
    _decode_table_kernel[(triton.cdiv(w.numel(), 256),)](w.to(device), s.to(device), out, w.numel(), BLOCK=256)
    # reference: one "expert" of w.numel() / 16 rows of 32 values (16 bytes), each row one scale code
    rows = w.numel() // 16
    ref = dequantize_mxfp4_ref(w.view(1, rows, 16), s.view(1, rows, 16)[:, :, :1].contiguous()).reshape(-1)
    ref = ref.to(torch.bfloat16).float()
    got = out.float().cpu()
    same = (got == ref) | (got.isnan() & ref.isnan())
    bad = (~same).nonzero().flatten()[:8].tolist()
    assert not bad, f"bf16x2 decode differs at {bad}: got {got[bad].tolist()}, want {ref[bad].tolist()}"
    return f"bf16x2 decode: {w.numel()} bytes x 2 nibbles equal to the reference (NaN scale -> NaN)"


@dataclasses.dataclass(frozen=True)
class UpcastConfig(ProbeConfig):
    """One launch: the dot_scaled probe's form and tile, and the weight's decode (DECODES)."""

    decode: str = "bf16x2"

    @property
    def name(self):
        return f"{self.decode} {super().name} w{self.num_warps}s{self.num_stages}"


def _config(decode, swap_ab, block_m, block_n, block_k, num_warps=4, num_stages=3):
    return UpcastConfig(swap_ab, block_m, block_n, block_k, num_warps, num_stages, decode)


CONFIGS = tuple(
    [_config(d, True, 16, 128, 64, 4, 4) for d in DECODES if d != "f32-prepared"]
    + [_config(d, True, 64, 128, 64, 8, 3) for d in DECODES if d != "f32-prepared"]
    + [_config(d, True, 128, 128, 64, 8, 3) for d in ("f32-join", "bf16x2")]
    + [_config("bf16x2", True, 256, 128, 64, 8, 3), _config("bf16x2", True, 128, 64, 128, 4, 3),
       _config("bf16x2", True, 32, 64, 128, 4, 4), _config("bf16x2", True, 16, 64, 128, 4, 4)]
    + [_config(d, False, 128, 128, 64, 8, 3) for d in ("f32-join", "bf16x2")]
    + [_config("bf16x2", False, 128, 256, 64, 8, 3)]
    + [_config("bf16x2-prepared", sw, bm, bn, bk, w, st) for sw, bm, bn, bk, w, st in
       ((True, 16, 64, 128, 4, 4), (True, 32, 64, 128, 4, 4), (True, 128, 128, 64, 8, 3), (False, 128, 128, 64, 8, 3))])
TINY_CONFIGS = (_config("f32-split", True, 16, 64, 64), _config("f32-join", True, 16, 64, 64),
                _config("f32-join", False, 16, 64, 64))


def prepare_bytes(blocks):
    """MXFP4 bytes [E, N, K/2] (or [E, N, K/32, 16]) -> the same bytes reordered inside each 16-byte (32-value) group so
    that byte 4q + j holds K-order byte 4j + q: the four bytes an MMA operand's thread q reads for its K pairs (bytes
    q, q + 4, q + 8, q + 12 of the group) lie together. Same size; made once, outside anything timed."""
    E, N = blocks.shape[:2]
    return blocks.reshape(E, N, -1, 4, 4).transpose(-1, -2).contiguous().reshape(E, N, -1)


def upcast_grouped_gemm(a, blocks, scales, expert_offsets, config, *, tiles=None, out=None):
    """C [M, N] = A_seg @ dequant(W_e)^T by `_mxfp4_upcast_grouped_gemm_kernel` (the dot_scaled probe's
    `launch_grouped`; a bf16, or fp32 for the interpreter; blocks in the prepared order, `prepare_bytes`, for the
    "prepared" decodes)."""
    assert a.dtype in (torch.bfloat16, torch.float32)
    return launch_grouped(_mxfp4_upcast_grouped_gemm_kernel, a, blocks, scales, expert_offsets, config, tiles=tiles,
                          out=out, DECODE=DECODES[config.decode])


def probe_model(model, args, device, configs, timer, rows):
    from moe_dispatch.formats.mxfp4 import dequantize_experts_mxfp4, mxfp4_weight_scale
    from moe_dispatch.gemm.grouped import expert_gemm

    shape = _layer_shape(model, args.tiny)
    E, H, F, top_k = shape.num_experts, shape.hidden, shape.ffn, args.top_k
    N, K = 2 * F, H
    torch.manual_seed(0)
    blocks, scales = _random_mxfp4(E, N, K, device)
    prepared = prepare_bytes(blocks)
    w_bf16 = dequantize_experts_mxfp4(blocks, scales, torch.bfloat16)
    mx_bytes_per_expert = N * (K // 2 + K // 32)
    print(f"== {model}: E {E}, top-{top_k}, GEMM1 N = {N}, K = {K}", flush=True)
    for T in args.tokens:
        cell = f"{model} T{T}"
        M = T * top_k
        _, a, tiles_mx, tiles_bf, info_mx, info_bf, active = gemm1_cell(T, top_k, E, H, F, device)
        offsets = info_mx.expert_offsets

        record = cell_recorder(rows, timer, cell, M / E)

        c_bf = torch.empty(M, N, device=device, dtype=torch.bfloat16)
        record(f"(c) package bf16 {tiles_bf.block_m}x{tiles_bf.gate_up.block_n}x{tiles_bf.gate_up.block_k}",
               functools.partial(expert_gemm, a, w_bf16, info_bf, tiles_bf.gate_up, out=c_bf), active * N * K * 2)
        reference = c_bf.clone()
        c_mx = torch.empty(M, N, device=device, dtype=torch.bfloat16)
        record(f"(b) package mxfp4 {tiles_mx.block_m}x{tiles_mx.gate_up.block_n}x{tiles_mx.gate_up.block_k}",
               functools.partial(expert_gemm, a, blocks, info_mx, tiles_mx.gate_up,
                                 weight_scale=mxfp4_weight_scale(scales), out=c_mx),
               active * mx_bytes_per_expert, c_mx, reference)
        for config in configs:
            if config.block_m > 2 * max(16, triton.next_power_of_2(int(M / E) or 1)):
                continue  # far more rows than an expert holds
            c = torch.empty(M, N, device=device, dtype=torch.bfloat16)
            try:
                run = functools.partial(upcast_grouped_gemm, a, prepared if "prepared" in config.decode else blocks,
                                        scales, offsets, config,
                                        tiles=tile_map(offsets, config.block_m), out=c)
                record(f"(u) {config.name}", run, active * mx_bytes_per_expert, c, reference)
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile is reported, the rest run
                print(f"   {cell:<18} (u) {config.name}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
    del blocks, prepared, scales, w_bf16


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt-oss-120b", "gpt-oss-20b"])
    parser.add_argument("--tokens", nargs="+", type=int, default=None)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--match", default="", help="comma list: only configs whose name holds one of these")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    args.tokens = args.tokens or ([1, 7] if args.tiny else list(TOKENS))
    failures = []
    if device.type == "cuda":
        try:
            print(check_decode_table(device), flush=True)
        except AssertionError as exc:
            failures.append(str(exc))
            print(f"FAIL {exc}", flush=True)
    rows = []
    for model in args.models:
        configs = TINY_CONFIGS if args.tiny else CONFIGS
        if args.match:
            configs = [c for c in configs if any(m in c.name for m in args.match.split(","))]
        probe_model(model, args, device, configs, _timer(device), rows)
    print(f"\n{'cell':<18} {'method':<44} {'us':>9} {'TB/s':>6} {'(b)/this':>8}")
    for cell in dict.fromkeys(row.cell for row in rows):
        cell_rows = sorted((row for row in rows if row.cell == cell), key=lambda row: row.us)
        package = next(row.us for row in cell_rows if row.method.startswith("(b)"))
        for row in cell_rows[:6] + [row for row in cell_rows[6:] if row.method[:3] in ("(b)", "(c)")]:
            tbs = row.weight_bytes / (row.us * 1e-6) / 1e12
            print(f"{cell:<18} {row.method:<44} {row.us:9.1f} {tbs:6.2f} {package / row.us:7.2f}x")
    return report_failures(rows, failures)


if __name__ == "__main__":
    sys.exit(main())
