"""Probe of the Gluon MXFP4 GEMM (moe_dispatch.gemm.gluon_mxfp4, Hopper, Triton 3.6) alone: GPT-OSS's GEMM1 in its
tile and stage forms, beside the package's portable MXFP4 and bf16 grouped GEMMs.

    PYTHONPATH=torch-ext:scripts:benchmarks python3 benchmarks/gluon_mxfp4_probe.py
        [--models gpt-oss-120b gpt-oss-20b] [--tokens 128 1024 4096 16384] [--stages 4 6] [--block-m 64 128]
        [--swap-tokens 256]
    PYTHONPATH=torch-ext:scripts:benchmarks python3 benchmarks/gluon_mxfp4_probe.py --layer
        [--tokens 128 1024 2048 4096 8192] [--layer-tiles auto split-64 split-128 swap-256]
    PYTHONPATH=torch-ext:scripts:benchmarks python3 benchmarks/gluon_mxfp4_probe.py --decode
        [--tokens 1 2 4 8 16 32 64] [--decode-tiles auto mma-4 mma-2 gate-up-4 down-4]

GEMM1 of an MXFP4 MoE layer (N = 2F, K = H), C [M, N] = A_seg @ dequant(W_e)^T over expert-sorted rows, M = 4T rows
of uniform random top-4 routing (the cells and weights of benchmarks/mxfp4_dot_scaled_probe.py, whose helpers it
uses): (c) the package's bf16 grouped GEMM on the dequantized weight, (b) its portable MXFP4 grouped GEMM
(gemm.grouped.expert_gemm with the tables' tiles), (g) the Gluon MXFP4 GEMM with output tiles of 64 or 128 rows and
4 or 6 stages, (s) its swapped form (the weights as the wgmma's register operand, 256-token tiles). CUDA-graph
replays, median us; TFLOP/s = 2 M N K / time; relative error against (c) (the same bf16 rows and weight values, fp32
sums). Nothing asserts a speed; its correctness against float64 is
tests/test_gluon_mxfp4.py's.

--layer times the whole layer instead, as users run it: `fused_experts` on GPT-OSS's MXFP4 experts (interleaved
gate/up, biases, the clamped SwiGLU, top-4 of random logits; scripts/harness.py's weights), the engine forced on
(MOE_DISPATCH_GLUON_MXFP4=1) and its (form, rows) per call taken from --layer-tiles (`auto`: gluon_mxfp4.gemm_tile's
choice; else FORM-ROWS, which replaces `gemm_tile` in gemm.gluon_experts for that call). Paired CUDA-graph replays
with the L2 flushed between calls (harness.paired_graph_times), medians; each variant's output against `auto`'s
(a relative error above 1e-2 is printed). This is how the engine's thresholds (ROWS128_FROM, SWAP_FROM) are set.

--decode times the layer the same way at a few tokens with the decode path's tiles forced from --decode-tiles
(`auto`: nothing forced, what the tables choose; `gemv`, `dot`: the GPT-OSS entries' tiles before the mma kernels;
`mma-W`: both decode kernels on mma.sync, gemm.gluon_mxfp4_decode,
W warps a program; `gate-up-W` / `down-W`: that kernel on mma, the other the GEMV of the tables' GPT-OSS decode
entry). This is how a table's decode entry takes `mma`.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mxfp4_dot_scaled_probe import _layer_shape, _random_mxfp4, _timer, cell_recorder, gemm1_cell  # noqa: E402

from moe_dispatch.gemm.gluon_mxfp4 import mxfp4_grouped_gemm  # noqa: E402

TOKENS = (128, 1024, 4096, 16384)


def probe_model(model, args, device, timer, rows, flops):
    """Time and check each method at each T of one model; appends Row entries to `rows` and each cell's GEMM FLOPs
    to `flops`."""
    from moe_dispatch.formats.mxfp4 import dequantize_experts_mxfp4, mxfp4_weight_scale
    from moe_dispatch.gemm.grouped import expert_gemm

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
        _, a, tiles_mx, tiles_bf, info_mx, info_bf, active = gemm1_cell(T, top_k, E, H, F, device)
        offsets = info_mx.expert_offsets
        mx_bytes, bf_bytes = active * N * (K // 2 + K // 32), active * N * K * 2
        flops[cell] = 2 * M * N * K
        record = cell_recorder(rows, timer, cell, M / E)

        c_bf = torch.empty(M, N, device=device, dtype=torch.bfloat16)
        record(f"(c) package bf16 {tiles_bf.block_m}x{tiles_bf.gate_up.block_n}x{tiles_bf.gate_up.block_k}",
               functools.partial(expert_gemm, a, w_bf16, info_bf, tiles_bf.gate_up, out=c_bf), bf_bytes)
        reference = c_bf.clone()
        c_mx = torch.empty(M, N, device=device, dtype=torch.bfloat16)
        record(f"(b) package mxfp4 {tiles_mx.block_m}x{tiles_mx.gate_up.block_n}x{tiles_mx.gate_up.block_k}",
               functools.partial(expert_gemm, a, blocks, info_mx, tiles_mx.gate_up,
                                 weight_scale=mxfp4_weight_scale(scales), out=c_mx), mx_bytes, c_mx, reference)
        for block_m in args.block_m:
            for stages in args.stages:
                run = functools.partial(mxfp4_grouped_gemm, a, blocks, scales, offsets, stages=stages,
                                        block_m=block_m)
                try:
                    record(f"(g) gluon mxfp4 {block_m}x256x64 {stages} stages", run, mx_bytes, run(), reference)
                except Exception as exc:  # noqa: BLE001 - reported, the rest runs
                    print(f"   {cell:<18} (g) {block_m} rows {stages} stages: {type(exc).__name__}: {str(exc)[:300]}",
                          flush=True)
        for tokens in args.swap_tokens:
            run = functools.partial(mxfp4_grouped_gemm, a, blocks, scales, offsets, block_m=tokens, form="swap")
            try:
                record(f"(s) gluon mxfp4 swap {tokens}x128x64", run, mx_bytes, run(), reference)
            except Exception as exc:  # noqa: BLE001 - reported, the rest runs
                print(f"   {cell:<18} (s) {tokens} tokens: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    del blocks, scales, w_bf16


LAYER_TILES = ("auto", "split-64", "split-128", "swap-256")
LAYER_TOKENS = (128, 1024, 2048, 4096, 8192)


def _checked_times(cell, calls, kind="flushed"):
    """{label: [us]} of the variants `calls` ({label: fn}) that ran, paired, `kind` "flushed" (the L2 cleared before
    each call) or "hot" (calls back to back); each output checked against the first's (a relative error above 1e-2
    is printed), a variant that raises reported and left out."""
    import harness

    kept, reference = {}, None
    for label, call in calls.items():
        try:
            out = call().float()
        except Exception as exc:  # noqa: BLE001 - reported, the rest runs
            print(f"   {cell} {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        reference = out if reference is None else reference
        error = ((out - reference).norm() / reference.norm()).item()
        if not error <= 1e-2:
            print(f"   {cell} {label}: relative error {error:.3g} against {next(iter(calls))}")
        kept[label] = call
    return harness.paired_graph_times(kept, 10, hot_calls=10)[kind]


def probe_layer(model, args, device):
    """Print one line per T of `model`: the layer's time through fused_experts with each of args.layer_tiles."""
    import statistics

    import harness
    from bench_mxfp4 import make_inputs, model_shape

    from moe_dispatch.gemm import gluon_experts

    import moe_dispatch as kernel
    shape = model_shape(model, False)
    weights = harness.make_mxfp4_weights(shape, device, 7, kernel)
    chosen = gluon_experts.gemm_tile
    for T in args.tokens:
        inputs = make_inputs(shape, T, device, 3)
        calls = {}
        for label in args.layer_tiles:
            tile = None if label == "auto" else (label.split("-")[0], int(label.split("-")[1]))

            def call(tile=tile):
                gluon_experts.gemm_tile = chosen if tile is None else (lambda *_: tile)
                try:
                    return kernel.fused_experts(inputs.x, topk_ids=inputs.ids, topk_weights=inputs.weights,
                                                validate=False, **weights.call_kwargs())
                finally:
                    gluon_experts.gemm_tile = chosen
            calls[label] = call
        times = _checked_times(f"{model} T{T}", calls)
        rows = T * shape.top_k // shape.num_experts
        print(f"{model} T={T} ({rows} rows per expert): "
              + "  ".join(f"{label} {statistics.median(us):.1f}" for label, us in times.items()), flush=True)


DECODE_TOKENS = (1, 2, 4, 8, 16, 32, 64)
DECODE_TILES = ("auto", "mma-4", "mma-2", "gate-up-4", "down-4")


def decode_tiles(label):
    """The DecodeTiles of a --decode-tiles label (None for `auto`)."""
    from moe_dispatch.host.tiles import DecodeTile, DecodeTiles

    if label == "auto":
        return None
    if label in ("gemv", "dot"):  # the GPT-OSS entries' tiles before the mma kernels (GEMVs; GPT-OSS-20B's dots)
        if label == "gemv":
            return DecodeTiles(DecodeTile(16, 512, num_warps=4, num_stages=1, gemv=True),
                               DecodeTile(32, 512, num_warps=4, num_stages=1))
        return DecodeTiles(DecodeTile(64, 128, num_warps=4, num_stages=4),
                           DecodeTile(64, 128, num_warps=4, num_stages=3, split_k=2, dot=True))
    kind, warps = label.rsplit("-", 1)
    mma_gate_up = DecodeTile(max(16, 8 * int(warps)), 128, num_warps=int(warps), mma=True)
    mma_down = DecodeTile(16 * int(warps), 128, num_warps=int(warps), mma=True)
    gemv_gate_up = DecodeTile(16, 512, num_warps=4, num_stages=1, gemv=True)  # the GPT-OSS entries' GEMVs
    gemv_down = DecodeTile(32, 512, num_warps=4, num_stages=1)
    return {"mma": DecodeTiles(mma_gate_up, mma_down), "gate-up": DecodeTiles(mma_gate_up, gemv_down),
            "down": DecodeTiles(gemv_gate_up, mma_down)}[kind]


def probe_decode(model, args, device):
    """Print one line per T of `model`: the layer's time through fused_experts with each of args.decode_tiles."""
    import statistics

    import harness
    from bench_mxfp4 import make_inputs, model_shape

    import moe_dispatch as kernel
    shape = model_shape(model, False)
    weights = harness.make_mxfp4_weights(shape, device, 7, kernel)
    for T in args.tokens:
        inputs = make_inputs(shape, T, device, 3)
        calls = {label: functools.partial(kernel.fused_experts, inputs.x, topk_ids=inputs.ids,
                                          topk_weights=inputs.weights, validate=False, tiles=decode_tiles(label),
                                          **weights.call_kwargs())
                 for label in args.decode_tiles}
        times = _checked_times(f"{model} T{T}", calls, "hot" if args.hot else "flushed")
        print(f"{model} T={T}{' (hot)' if args.hot else ''}: "
              + "  ".join(f"{label} {statistics.median(us):.1f}" for label, us in times.items()), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt-oss-120b", "gpt-oss-20b"])
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--stages", nargs="+", type=int, default=[4])
    parser.add_argument("--block-m", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--swap-tokens", nargs="*", type=int, default=[256])
    parser.add_argument("--layer", action="store_true", help="time the whole layer per engine tile (docstring)")
    parser.add_argument("--layer-tiles", nargs="+", default=list(LAYER_TILES))
    parser.add_argument("--decode", action="store_true", help="time the layer per decode tile (docstring)")
    parser.add_argument("--decode-tiles", nargs="+", default=list(DECODE_TILES))
    parser.add_argument("--hot", action="store_true", help="--decode: time calls back to back, no L2 flush")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    failures = []
    whole_layer = {"decode": (probe_decode, DECODE_TOKENS), "layer": (probe_layer, LAYER_TOKENS)}
    mode = "decode" if args.decode else "layer" if args.layer else None
    if mode is not None:
        probe, tokens = whole_layer[mode]
        if mode == "layer":
            os.environ["MOE_DISPATCH_GLUON_MXFP4"] = "1"
        if args.tokens == list(TOKENS):
            args.tokens = list(tokens)
        for model in args.models:
            try:
                probe(model, args, device)
            except Exception as exc:  # noqa: BLE001
                failures.append(f"{model}: {type(exc).__name__}: {exc}")
                traceback.print_exc()
        for failure in failures:
            print(f"FAILED {failure}")
        return 1 if failures else 0
    rows, flops = [], {}
    for model in args.models:
        try:
            probe_model(model, args, device, _timer(device), rows, flops)
        except Exception as exc:  # noqa: BLE001
            failures.append(f"{model}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
    print(f"\n{'cell':<20} {'method':<40} {'us':>9} {'TFLOP/s':>8} {'(b)/this':>8} {'(c)/this':>8}")
    for cell in dict.fromkeys(row.cell for row in rows):
        cell_rows = [row for row in rows if row.cell == cell]
        by = {row.method[:3]: row.us for row in cell_rows}
        for row in cell_rows:
            print(f"{cell:<20} {row.method:<40} {row.us:9.1f} {flops[cell] / row.us / 1e6:8.1f} "
                  f"{by.get('(b)', float('nan')) / row.us:8.2f} {by.get('(c)', float('nan')) / row.us:8.2f}")
    for failure in failures:
        print(f"FAILED {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
