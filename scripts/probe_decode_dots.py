"""Probe: the decode path's ways of meeting weight tiles (decode.default_dots), A/B at the table's tiles. For each
model and T, `fused_experts` on the decode path with each (STEP_DOT, ROW_DOT) pair forced, timed as paired one-call
graph replays (hot and L2-flushed, harness.paired_graph_times), with the per-kernel GPU times of the first and last
variant and the error against the float64 experts on the same weights. Float8 weights (128 x 128 block scales):

- tile:   gate/up weight tiles scaled in fp32 and converted to bf16 before a bf16 dot; down GEMV on the CUDA cores
- sums:   gate/up tiles converted unscaled, each K step's dot scaled after it; down as tile
- f16up:  gate/up in fp16 dots (x rows rescaled per K step); down as tile
- f16down: gate/up as tile; the down GEMV as a fp16 dot with the row as the one nonzero column

bf16 weights: `none` (the CUDA-core down GEMV) against `native` (the down GEMV as a bf16 dot).

The package's eager plans are off for the run (`_plan.ENABLED`): a recorded call would replay the first variant's
launches for every variant of the same signature.

The decode target beside each fp8 cell: 1.15 x (hit experts' fp8 bytes + scales) / R + 10 us, R given (--read-tbps).

    scripts/_env.sh's PYTHONPATH; python scripts/probe_decode_dots.py [--models ...] [--tokens 1,4,16] [--out f.json]
"""

import argparse
import json
import statistics

import torch

import harness
import moe_dispatch
from model_shapes import MODEL_SHAPES
from moe_dispatch import _plan, decode, reference, tiles
from moe_dispatch.gemm_jit import StepDot

FP8_VARIANTS = {"tile": (StepDot.SCALED_TILE, decode.ROW_DOT_NONE), "sums": (StepDot.SCALED_SUMS, decode.ROW_DOT_NONE),
                "f16up": (StepDot.F16_SUMS, decode.ROW_DOT_NONE), "f16down": (StepDot.SCALED_TILE, decode.ROW_DOT_F16)}
FALLBACK = tiles.DecodeTiles(tiles.DecodeTile(64, 256, 4, 3, 1), tiles.DecodeTile(64, 128, 4, 3, 1))
BF16_VARIANTS = {"none": (StepDot.SCALED_TILE, decode.ROW_DOT_NONE),
                 "native": (StepDot.SCALED_TILE, decode.ROW_DOT_NATIVE)}


def forced(dots, fn):
    """fn with decode.default_dots answering `dots` while it runs (and while a graph of it is captured)."""
    def call():
        saved = decode.default_dots
        decode.default_dots = lambda *_: (int(dots[0]), int(dots[1]))
        try:
            return fn()
        finally:
            decode.default_dots = saved
    return call


def cell(shape, prob, T, fp8, pairs, read_tbps):
    x = prob.x[:T]
    gen = torch.Generator(device="cuda").manual_seed(T)
    ids = torch.stack([torch.randperm(shape.num_experts, device="cuda", generator=gen)[:shape.top_k]
                       for _ in range(T)]).to(torch.int32)
    weights = torch.rand(T, shape.top_k, device="cuda", generator=gen)
    # the table's decode tiles, else (a T where the table sends the call to the general path) its generic ones
    table = tiles.select_decode_tiles(x.device, T, shape.top_k, shape.num_experts, shape.ffn, shape.hidden, x.dtype,
                                      fp8=fp8) or FALLBACK
    if fp8:
        operands = dict(w_gate_up=prob.q_gate_up, w_down=prob.q_down, **prob.scales, fp8_compute="dequant")
        ref = reference.fused_experts_fp8_ref(x, prob.q_gate_up, prob.q_down, ids, weights, experts_per_chunk=16,
                                              **prob.scales)
        variants = FP8_VARIANTS
    else:
        operands = dict(w_gate_up=prob.w_gate_up, w_down=prob.w_down)
        ref = reference.fused_experts_ref(x, prob.w_gate_up, prob.w_down, ids, weights)
        variants = BF16_VARIANTS

    def run():
        return moe_dispatch.fused_experts(x, topk_ids=ids, topk_weights=weights, validate=False, tiles=table,
                                          **operands)

    fns = {name: forced(dots, run) for name, dots in variants.items()}
    errors = {name: reference.relative_error(fn(), ref) for name, fn in fns.items()}
    times = harness.paired_graph_times(fns, pairs)
    first = next(iter(variants))
    row = {"model": shape.name, "T": T, "weights": "fp8" if fp8 else "bf16",
           "hot_us": {n: statistics.median(v) for n, v in times["hot"].items()},
           "flushed_us": {n: statistics.median(v) for n, v in times["flushed"].items()},
           "hot_ratio": harness.median_ratios(times["hot"], first),
           "flushed_ratio": harness.median_ratios(times["flushed"], first),
           "errors": errors,
           "kernels_us": {name: harness.kernel_times(fn) for name, fn in fns.items()}}
    hit = int(torch.unique(ids).numel())
    if fp8:
        H, F = shape.hidden, shape.ffn
        scale_bytes = 4 * 3 * -(-H // 128) * -(-F // 128)
        row["target_us"] = 1.15 * hit * (3 * H * F + scale_bytes) / (read_tbps * 1e6) + 10.0
    row["hit"] = hit
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen3-30b-a3b,deepseek-v3,mixtral-8x7b,qwen2-57b-a14b,mixtral-8x22b")
    parser.add_argument("--tokens", default="1,4,16")
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--read-tbps", type=float, default=4.25, help="R, the read bandwidth in TB/s")
    parser.add_argument("--bf16", action="store_true", help="also the bf16 weights' down GEMV variants")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    _plan.ENABLED = False
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for name in args.models.split(","):
        shape = MODEL_SHAPES[name]
        kinds = [True, False] if args.bf16 else [True]
        for fp8 in kinds:
            prob = (harness.make_fp8_problem(shape, max(tokens), "cuda", 0, moe_dispatch) if fp8
                    else harness.make_problem(shape, max(tokens), torch.bfloat16, "cuda", 0))
            for T in tokens:
                row = cell(shape, prob, T, fp8, args.pairs, args.read_tbps)
                rows.append(row)
                hot = "  ".join(f"{n} {v:8.1f}" for n, v in row["hot_us"].items())
                ratios = " ".join(f"{v:.3f}" for v in row["hot_ratio"].values())
                target = f" target {row['target_us']:.1f}" if "target_us" in row else ""
                print(f"{name:16s} {row['weights']:4s} T={T:<3d} hot us: {hot}  ratios {ratios}{target}  err "
                      + " ".join(f"{e:.1e}" for e in row["errors"].values()), flush=True)
                for variant, kernels in row["kernels_us"].items():
                    print(f"    {variant:8s} " + "  ".join(f"{k[:22]} {v:.1f}" for k, v in kernels.items()))
            del prob
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
