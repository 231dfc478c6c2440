"""Probe of the Gluon FP8 block-scaled GEMMs (moe_dispatch.gemm.gluon_fp8) on a Hopper GPU with Triton 3.6, alone and
as the w8a8 path's engine.

    PYTHONPATH=torch-ext python benchmarks/gluon_fp8_probe.py [--sections gemm experts] [--models ...] [--tokens ...]

1. Correctness against the float64 references (moe_dispatch.reference, norm-wise relative error): dense at odd M
   (1, 77, 4097) and N, K tails; grouped with an empty expert, a one-row expert and tiles ending mid-expert; a NaN in
   A reaching its own output row and no other.
2. Speed (triton.testing.do_bench, median ms; TFLOP/s = 2 M N K / time): dense M = N = K in {4096, 8192} beside
   torch._scaled_mm with per-row / per-column scales (one scale per row of A and column of B: no promotion in the K
   loop, the ceiling a block-scaled GEMM aims at); NUM_STAGES 3 / 4 / 5 at 8192, and at 64 rows per expert the
   64 x 256 tile (`gluon_fp8.ROWS64_CONFIG`, checked against the default's result) beside the default. The MoE shape:
   16384 expert-sorted rows over E = 8 experts (2048 each), N = 4096, K = 7168, beside _scaled_mm on the dense
   [16384, 7168] x [7168, 4096] of the same FLOPs and the package's portable w8a8 fused_experts on the layer whose
   gate/up GEMM this is (H = 7168, 2F = 4096, T = 2048 tokens, top_k = 8: both GEMMs, dispatch and combine, FLOPs of
   both GEMMs counted).
   The timed shapes are checked too, on a sample of rows (a float64 reference of the whole is slow).
3. The experts path per engine (`--sections experts`): `fused_experts` on float8_e4m3fn experts with 128 x 128 block
   scales at Qwen3-30B-A3B (E 128, top-8, H 2048, F 768), DeepSeek-V3 (E 256, top-8, H 7168, F 2048) and
   Mixtral-8x7B (E 8, top-2, H 4096, F 14336) widths, T = 4096 and 16384, uniform random routing: the portable w8a8
   kernels (MOE_DISPATCH_GLUON_FP8=0), the Gluon engine as the package runs it (gemm/gluon_experts.py, the variable
   set to 1 in this process: GEMM1's activation fused into its epilogue, the plain GEMMs on 64 x 256 tiles below
   gluon_experts.ROWS64_BELOW_ROWS rows per expert and 128 x 128 from there), the engine's alternatives
   (`GLUON_FORMS`: dispatch -> gluon_w8a8_experts with explicit keywords -> combine; the same call with no keywords
   is checked bit for bit against fused_experts' engine output) and the bf16 path on the dequantized weights, each
   timed as a CUDA graph (do_bench_cudagraph, median). A table of ms, TFLOP/s (6 T top_k H F FLOPs), the default's
   speedup over the portable kernels and over each alternative, and fp8/bf16; the Gluon results checked against the
   portable one and the bf16 one (relative error < reference.W8A8_TOLERANCE: both quantize activations to e4m3 with
   different groups, or not at all).

Each part runs under its own try/except: a failure prints its error and the probe goes on. One table at the end.
Not a benchmark of the Hub convention (benchmarks/benchmark*.py); nothing here asserts a speed.
"""

import argparse
import functools
import os
import sys
import time
import traceback

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # model_shapes

from moe_dispatch.gemm import gluon_fp8  # noqa: E402

ROWS = []  # (part, shape, ms, TFLOP/s, note)
FAILURES = []
EXPERTS_ROWS = []  # (label, rows per expert, the default's plain GEMM tiles, ms by variant name, FLOPs)
SECTIONS = ("gemm", "experts")
EXPERTS_MODELS = {"qwen3": "qwen3-30b-a3b", "deepseek-v3": "deepseek-v3", "mixtral": "mixtral-8x7b"}
EXPERTS_TOKENS = (4096, 16384)
# The Gluon engine's alternatives to its default, as gluon_w8a8_experts keywords (column headers in the table)
GLUON_FORMS = {
    "gluon unfused": ("unfused", dict(fused_activation=False)),  # GEMM1's activation in the separate pass
    "gluon fused": ("fused", dict(fused_activation=True)),  # GEMM1's activation fused wherever the layout allows
    "gluon 128x128": ("128x128", dict(plain_gemm_cfg=gluon_fp8.DEFAULT_CONFIG)),  # at every rows per expert
    "gluon 64x256": ("64x256", dict(plain_gemm_cfg=gluon_fp8.ROWS64_CONFIG)),  # at every rows per expert
    # the engine before fusing and the 64 x 256 tile were its defaults (the earlier probes' "gluon w8a8")
    "gluon unfused 128x128": ("before", dict(fused_activation=False, plain_gemm_cfg=gluon_fp8.DEFAULT_CONFIG)),
}


def part(name):
    """Run the decorated function now, printing and recording its error instead of raising."""
    def run(fn):
        start = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            fn()
        except Exception as exc:  # the probe goes on; the error is in the table's footer
            FAILURES.append((name, f"{type(exc).__name__}: {exc}"))
            traceback.print_exc(limit=4)
        print(f"   ({time.perf_counter() - start:.1f} s)", flush=True)
        return fn
    return run


def bench_ms(fn):
    return triton.testing.do_bench(fn, warmup=20, rep=100)


def tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12


def record(name, shape, ms, flops, note=""):
    ROWS.append((name, shape, ms, tflops(flops, ms), note))
    print(f"   {name:<34} {shape:<26} {ms:8.3f} ms {tflops(flops, ms):8.1f} TFLOP/s {note}", flush=True)


def check(name, err, tol):
    status = "ok" if err < tol else "FAIL"
    print(f"   {name:<48} rel err {err:.2e} (< {tol:.0e}) {status}", flush=True)
    if err >= tol:
        FAILURES.append((name, f"relative error {err:.2e} >= {tol:.0e}"))


def check_nan_row(prefix, outs):
    """Each (name, out [200, N]) of A with a NaN in row 3: row 3 all NaN and every other row finite, recorded."""
    for name, out in outs:
        others = torch.arange(out.shape[0], device=out.device) != 3
        ok = bool(out[3].isnan().all()) and bool(torch.isfinite(out[others]).all())
        print(f"   {prefix}{name}: row 3 all NaN and the other rows finite: {ok}")
        if not ok:
            FAILURES.append((f"{prefix}NaN {name}", "NaN did not stay in its row"))


def offsets_of(counts, device="cuda"):
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=device)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="gemm: parts 1-2 (the FP8 GEMMs alone, ~40 s); experts: part 3 (fused_experts per FP8 "
                             "engine)")
    parser.add_argument("--models", nargs="+", choices=list(EXPERTS_MODELS), default=list(EXPERTS_MODELS),
                        help="part 3's layer widths (benchmarks/model_shapes.py)")
    parser.add_argument("--tokens", nargs="+", type=int, default=list(EXPERTS_TOKENS),
                        help="part 3's T values")
    return parser.parse_args(argv)


def block_fp8_experts(E, H, F, dev, experts_per_chunk=16):
    """(w_gate_up [E, 2F, H], s_gate_up, w_down [E, H, F], s_down): float8_e4m3fn drawn directly (N(0, 64), clamped to
    the e4m3 range) with fp32 128 x 128 block scales near 1.5e-4 (weights of std ~0.01), a chunk of experts at a time
    (DeepSeek-V3's bf16 gate/up weight alone is 15 GB)."""
    def weight(rows, cols):
        w = torch.empty(E, rows, cols, device=dev, dtype=torch.float8_e4m3fn)
        for lo in range(0, E, experts_per_chunk):
            hi = min(E, lo + experts_per_chunk)
            w[lo:hi] = (torch.randn(hi - lo, rows, cols, device=dev, dtype=torch.bfloat16) * 64).clamp(-448, 448)
        scale = (torch.rand(E, triton.cdiv(rows, 128), triton.cdiv(cols, 128), device=dev) + 0.5) * 1.5e-4
        return w, scale

    return (*weight(2 * F, H), *weight(H, F))


def dequantized_bf16(w, scale, experts_per_chunk=8):
    """The bf16 weight w * scale (block scales), a chunk of experts at a time."""
    from moe_dispatch.formats.fp8 import dequantize_experts_fp8

    out = torch.empty(w.shape, device=w.device, dtype=torch.bfloat16)
    for lo in range(0, w.shape[0], experts_per_chunk):
        hi = min(w.shape[0], lo + experts_per_chunk)
        out[lo:hi] = dequantize_experts_fp8(w[lo:hi], scale[lo:hi], "block", dtype=torch.bfloat16)
    return out


def bench_graph_ms(fn):
    """Median ms of fn replayed in a CUDA graph (no host time between calls: the Gluon engine's calls run the full
    host path, which a plan does not record, while the portable ones replay plans); do_bench where capture fails."""
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"), "graph"
    except Exception as exc:  # noqa: BLE001 - the probe reports the fallback and goes on
        print(f"   CUDA graph timing failed ({type(exc).__name__}: {str(exc)[:120]}); do_bench instead", flush=True)
        torch.cuda.synchronize()
        return bench_ms(fn), "eager"


def layer_widths(model):
    """(E, top_k, H, F) of a --models name (benchmarks/model_shapes.py)."""
    from model_shapes import MODEL_SHAPES

    shape = MODEL_SHAPES[EXPERTS_MODELS[model]]
    return shape.num_experts, shape.top_k, shape.hidden, shape.ffn


def routed_tokens(T, E, top_k, H, dev):
    """(x [T, H] bf16, topk ids [T, top_k] int32, softmaxed routing weights): uniform random routing."""
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    ids = torch.rand(T, E, device=dev).topk(top_k, dim=1).indices.to(torch.int32)
    return x, ids, torch.softmax(torch.randn(T, top_k, device=dev), dim=-1)


def engine_call(x, w_gate_up, w_down, ids, weights, s_gate_up, s_down, **form):
    """dispatch -> gemm.gluon_experts.gluon_w8a8_experts(..., **form) -> combine, as fused_experts runs the engine on
    these operands (concatenated gate/up rows, silu, no biases; its planner's block_m): the engine's form chosen by
    explicit keywords. -> a function of no arguments returning [T, H]."""
    from moe_dispatch.dispatch.combine import combine
    from moe_dispatch.dispatch.segments import dispatch
    from moe_dispatch.gemm import planner
    from moe_dispatch.gemm.gluon_experts import gluon_w8a8_experts

    (T, H), top_k, (E, _, F) = x.shape, ids.shape[1], w_down.shape
    block_m = planner.plan_experts(x.device, T, top_k, E, F, H, x.dtype, fp8=True, w8a8=True).tiles.block_m

    def run():
        info = dispatch(ids, E, block_m)
        y, combine_weights = gluon_w8a8_experts(x, w_gate_up, w_down, info, s_gate_up, s_down, topk_weights=weights,
                                                **form)
        return combine(y, info.scatter_idx, T, top_k, weights=combine_weights)

    return run


def time_variants(label, flops, variable, variants):
    """Time each variant (name, the engine variable's value, a function of no arguments) as a CUDA graph and record
    it; the variable is part of every plan key (host/device.py), and unset after. -> (ms by name, output by name)."""
    times, outs = {}, {}
    try:
        for name, mode, run in variants:
            os.environ[variable] = mode
            outs[name] = run()
            times[name], how = bench_graph_ms(run)
            record(name, label, times[name], flops, how)
    finally:
        os.environ.pop(variable, None)
    return times, outs


def experts_sections(args, dev="cuda"):
    """Part 3: fused_experts per engine at real layer widths (module docstring)."""
    import moe_dispatch as md
    from moe_dispatch.gemm import gluon_experts, planner
    from moe_dispatch.reference import W8A8_TOLERANCE, relative_error

    for model in args.models:
        E, top_k, H, F = layer_widths(model)

        @part(f"fused_experts engines: {model} (E {E}, top-{top_k}, H {H}, F {F})")
        def _():
            torch.manual_seed(0)
            w_gate_up, s_gate_up, w_down, s_down = block_fp8_experts(E, H, F, dev)
            bf16_gate_up, bf16_down = dequantized_bf16(w_gate_up, s_gate_up), dequantized_bf16(w_down, s_down)
            fp8 = dict(w_gate_up_scale=s_gate_up, w_down_scale=s_down, fp8_compute="w8a8")
            for T in args.tokens:
                x, ids, weights = routed_tokens(T, E, top_k, H, dev)
                flops = 6 * T * top_k * H * F  # gate/up (2 F x H) and down (H x F), 2 FLOPs a multiply-add
                label = f"{model} T{T}"
                package = functools.partial(md.fused_experts, x, w_gate_up, w_down, ids, weights, validate=False,
                                            **fp8)
                operands = (x, w_gate_up, w_down, ids, weights, s_gate_up, s_down)
                times, outs = time_variants(
                    label, flops, planner.GLUON_FP8_VARIABLE,
                    [("portable w8a8", "0", package), ("gluon w8a8", "1", package),
                     *[(name, "1", engine_call(*operands, **form)) for name, (_, form) in GLUON_FORMS.items()]])
                same = torch.equal(engine_call(*operands)(), outs["gluon w8a8"])
                print(f"   {label} gluon_w8a8_experts' defaults == fused_experts' engine: {same}", flush=True)
                if not same:
                    FAILURES.append((f"{label} engine call", "the engine's defaults differ from fused_experts' engine"))
                run = functools.partial(md.fused_experts, x, bf16_gate_up, bf16_down, ids, weights, validate=False)
                outs["bf16"] = run()
                times["bf16"], how = bench_graph_ms(run)
                record("bf16 (dequantized weights)", label, times["bf16"], flops, how)
                tiles = gluon_experts.fp8_gemm_config(T, top_k, E)  # the default's plain GEMM tiles
                EXPERTS_ROWS.append((label, T * top_k / E, tiles, times, flops))
                for engine in ("gluon w8a8", *GLUON_FORMS):
                    check(f"{label} {engine} vs portable w8a8", relative_error(outs[engine], outs["portable w8a8"]),
                          W8A8_TOLERANCE)
                    check(f"{label} {engine} vs bf16 weights", relative_error(outs[engine], outs["bf16"]),
                          W8A8_TOLERANCE)
                del outs
            del w_gate_up, w_down, bf16_gate_up, bf16_down
            torch.cuda.empty_cache()

    if EXPERTS_ROWS:
        short = [short for short, _ in GLUON_FORMS.values()]
        print(f"\n{'fused_experts':<20} {'rows/E':>7} {'tiles':>8} {'portable':>9} {'gluon':>7} "
              + "".join(f"{name:>9}" for name in short) + f" {'bf16':>7}   {'TFLOP/s':>7} {'speedup of gluon over':>30}"
              + f" {'fp8/bf16':>9}")
        print(f"{'':<20} {'':>7} {'':>8} {'ms':>9} {'ms':>7} " + "".join(f"{'ms':>9}" for _ in short)
              + f" {'ms':>7}   {'gluon':>7} {'portable':>9}" + "".join(f"{name:>9}" for name in short)
              + f" {'(best)':>9}")
        for label, rows, cfg, times, flops in EXPERTS_ROWS:
            gluon = times["gluon w8a8"]
            tiles = f"{cfg.BLOCK_M}x{cfg.BLOCK_N * cfg.N_TILES}"
            best = min(times[name] for name in ("gluon w8a8", *GLUON_FORMS))
            print(f"{label:<20} {rows:7.0f} {tiles:>8} {times['portable w8a8']:9.3f} {gluon:7.3f} "
                  + "".join(f"{times[name]:9.3f}" for name in GLUON_FORMS) + f" {times['bf16']:7.3f}   "
                  + f"{tflops(flops, gluon):7.1f} {times['portable w8a8'] / gluon:8.2f}x"
                  + "".join(f"{times[name] / gluon:8.2f}x" for name in GLUON_FORMS)
                  + f" {times['bf16'] / min(times['portable w8a8'], best):8.2f}x")
        print("(gluon: the engine as the package runs it, GEMM1 fused and the plain GEMMs on the 'tiles' column's "
              "tile; unfused: the activation in a separate pass; 128x128 / 64x256: the plain GEMMs on that tile at "
              "every size; before: unfused and 128x128, the earlier default. Speedups are the other's time over "
              "gluon's (> 1: the default is faster); fp8/bf16 takes the fastest FP8 form. At T = 1024 pass --tokens "
              "1024, the engine forced on below GLUON_FP8_MIN_ROWS)")


def main(argv=None):
    args = parse_args(argv)
    print(f"torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}")
    reason = gluon_fp8.unavailable_reason()
    if reason is not None:
        print(f"gluon_fp8 unavailable: {reason}")
        return 1
    from moe_dispatch.formats.fp8 import quantize_experts_fp8
    from moe_dispatch.reference import (FP8_GEMM_TOLERANCE, fp8_block_gemm_ref, fp8_block_grouped_gemm_ref,
                                        relative_error)

    def quantize_rows(x):  # one scale per row and 128-wide K block
        q, s = quantize_experts_fp8(x[None], "block", block_shape=(1, 128))
        return q[0], s[0]

    def quantize_blocks(w):  # one scale per 128 x 128 block
        return quantize_experts_fp8(w, "block", block_shape=(128, 128))
    torch.manual_seed(0)
    dev = "cuda"

    def sampled_error(out, a, a_s, b, b_s, spans):
        """Relative error of out's rows [lo, hi) for each span against float64 (slices: no fp8 gather)."""
        got = torch.cat([out[lo:hi] for lo, hi in spans])
        ref = torch.cat([fp8_block_gemm_ref(a[lo:hi], a_s[lo:hi], b, b_s) for lo, hi in spans])
        return relative_error(got, ref)
    tol = FP8_GEMM_TOLERANCE

    if "gemm" in args.sections:
        @part("dense correctness")
        def _():
            for M, N, K in [(1, 256, 512), (77, 320, 1040), (4097, 512, 2048), (300, 1024, 7168)]:
                a, a_s = quantize_rows(torch.randn(M, K, device=dev))
                b, b_s = quantize_blocks(torch.randn(1, N, K, device=dev))
                out = gluon_fp8.fp8_block_gemm(a, a_s, b[0], b_s[0])
                torch.cuda.synchronize()
                check(f"dense M={M} N={N} K={K}", relative_error(out, fp8_block_gemm_ref(a, a_s, b[0], b_s[0])), tol)

        @part("grouped correctness")
        def _():
            for counts, N, K in [([77, 0, 1, 4019], 384, 1024), ([1], 256, 512), ([129, 128, 0, 0, 300], 320, 1040)]:
                offsets = offsets_of(counts)
                a, a_s = quantize_rows(torch.randn(sum(counts), K, device=dev))
                b, b_s = quantize_blocks(torch.randn(len(counts), N, K, device=dev))
                out = gluon_fp8.fp8_block_grouped_gemm(a, a_s, b, b_s, offsets)
                torch.cuda.synchronize()
                ref = fp8_block_grouped_gemm_ref(a, a_s, b, b_s, offsets)
                check(f"grouped counts={counts} N={N} K={K}", relative_error(out[:sum(counts)], ref), tol)

        @part("NaN propagation")
        def _():
            a, a_s = quantize_rows(torch.randn(200, 512, device=dev))
            b, b_s = quantize_blocks(torch.randn(2, 256, 512, device=dev))
            a.view(torch.uint8)[3, 5] = 0x7F  # e4m3fn NaN (S.1111.111)
            check_nan_row("", [("dense", gluon_fp8.fp8_block_gemm(a, a_s, b[0], b_s[0])),
                               ("grouped", gluon_fp8.fp8_block_grouped_gemm(a, a_s, b, b_s, offsets_of([100, 100])))])

        for size in (4096, 8192):
            @part(f"dense {size}^3 timing")
            def _():
                M = N = K = size
                flops = 2 * M * N * K
                a, a_s = quantize_rows(torch.randn(M, K, device=dev))
                b, b_s = quantize_blocks(torch.randn(1, N, K, device=dev))
                b, b_s = b[0], b_s[0]
                out = gluon_fp8.fp8_block_gemm(a, a_s, b, b_s)
                check(f"dense {size}^3 (rows sampled)",
                      sampled_error(out, a, a_s, b, b_s, [(0, 128), (M - 77, M)]), tol)
                stage_choices = (3, 4, 5) if size == 8192 else (4, )
                for stages in stage_choices:
                    cfg = gluon_fp8.GluonFp8Config(NUM_STAGES=stages)
                    ms = bench_ms(lambda: gluon_fp8.fp8_block_gemm(a, a_s, b, b_s, cfg=cfg))
                    record(f"gluon dense (stages {stages})", f"{M}x{N}x{K}", ms, flops)
                row_scale = torch.rand(M, 1, device=dev) + 0.5
                col_scale = torch.rand(1, N, device=dev) + 0.5
                for fast in (False, True):
                    ms = bench_ms(lambda: torch._scaled_mm(a, b.t(), scale_a=row_scale, scale_b=col_scale,
                                                           out_dtype=torch.bfloat16, use_fast_accum=fast))
                    record(f"torch._scaled_mm rowwise{' fast' if fast else ''}", f"{M}x{N}x{K}", ms, flops, "(ceiling)")

        @part("MoE timing")
        def _():
            E, N, K, rows_per_expert = 8, 4096, 7168, 2048
            M = E * rows_per_expert
            flops = 2 * M * N * K
            offsets = offsets_of([rows_per_expert] * E)
            a, a_s = quantize_rows(torch.randn(M, K, device=dev))
            b, b_s = quantize_blocks(torch.randn(E, N, K, device=dev))
            out = gluon_fp8.fp8_block_grouped_gemm(a, a_s, b, b_s, offsets)
            for e in (0, E - 1):  # the first and last 64 rows of two experts against float64
                lo, hi = e * rows_per_expert, (e + 1) * rows_per_expert
                check(f"grouped MoE expert {e} (rows sampled)",
                      sampled_error(out, a, a_s, b[e], b_s[e], [(lo, lo + 64), (hi - 64, hi)]), tol)
            ms = bench_ms(lambda: gluon_fp8.fp8_block_grouped_gemm(a, a_s, b, b_s, offsets))
            record("gluon grouped", f"E{E} {M}x{N}x{K}", ms, flops)
            # 64 rows per expert (T = 512 tokens' worth at top-8 over 64 experts): the 64 x 256 tile against the
            # default, the shape the Gluon engine leaves to the portable kernels today
            small = offsets_of([64] * E)
            a64, a64_s = a[:64 * E], a_s[:64 * E]
            out64 = gluon_fp8.fp8_block_grouped_gemm(a64, a64_s, b, b_s, small)
            for name, cfg in (("128x128", gluon_fp8.DEFAULT_CONFIG), ("64x256", gluon_fp8.ROWS64_CONFIG)):
                check(f"grouped 64 rows per expert, {name} tile vs 128x128",
                      relative_error(gluon_fp8.fp8_block_grouped_gemm(a64, a64_s, b, b_s, small, cfg=cfg), out64),
                      1e-3)
                ms = bench_ms(lambda: gluon_fp8.fp8_block_grouped_gemm(a64, a64_s, b, b_s, small, cfg=cfg))
                record(f"gluon grouped ({name} tile)", f"E{E} {64 * E}x{N}x{K}", ms, 2 * 64 * E * N * K)
            row_scale = torch.rand(M, 1, device=dev) + 0.5
            col_scale = torch.rand(1, N, device=dev) + 0.5
            ms = bench_ms(lambda: torch._scaled_mm(a, b[0].t(), scale_a=row_scale, scale_b=col_scale,
                                                   out_dtype=torch.bfloat16, use_fast_accum=True))
            record("torch._scaled_mm rowwise fast", f"{M}x{N}x{K}", ms, flops, "(ceiling: dense, one B)")

        @part("portable w8a8 fused_experts (whole MoE layer)")
        def _():
            import moe_dispatch as md
            from moe_dispatch.formats.fp8 import quantize_experts_fp8
            E, H, F, T, top_k = 8, 7168, 2048, 2048, 8
            x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
            w_gate_up, s_gate_up = quantize_experts_fp8(
                torch.randn(E, 2 * F, H, device=dev, dtype=torch.bfloat16) * 0.02)
            w_down, s_down = quantize_experts_fp8(torch.randn(E, H, F, device=dev, dtype=torch.bfloat16) * 0.02)
            ids = torch.stack([torch.randperm(E, device=dev)[:top_k] for _ in range(T)]).to(torch.int32)
            weights = torch.softmax(torch.randn(T, top_k, device=dev), dim=-1)

            def run():
                return md.fused_experts(x, w_gate_up, w_down, ids, weights, w_gate_up_scale=s_gate_up,
                                        w_down_scale=s_down, fp8_compute="w8a8", validate=False)

            ms = bench_ms(run)
            flops = 2 * T * top_k * (2 * F * H + H * F)
            record("portable fused_experts w8a8", f"T{T} k{top_k} H{H} 2F{2 * F}", ms, flops, "(2 GEMMs + routing)")

    if "experts" in args.sections:
        experts_sections(args)

    print("\n" + "-" * 100)
    print(f"{'kernel':<34} {'shape':<26} {'ms':>8} {'TFLOP/s':>9}  note")
    for name, shape, ms, rate, note in ROWS:
        print(f"{name:<34} {shape:<26} {ms:8.3f} {rate:9.1f}  {note}")
    print("-" * 100)
    if FAILURES:
        print("failures:")
        for name, msg in FAILURES:
            print(f"  {name}: {msg[:300]}")
    else:
        print("all checks passed")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
