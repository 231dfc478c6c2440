"""Probe: the decode gate/up kernel's ways of dotting float8 weight tiles (gemm.jit.StepDot, chosen by
decode.step_dot), A/B at the table's tiles. For each model and T, `fused_experts` on the decode path with each mode
forced, timed as paired one-call graph replays (hot and L2-flushed, harness.paired_graph_times), with each variant's
per-kernel GPU times and its error against the float64 experts on the same weights (128 x 128 block scales):

- tile: the weight tiles scaled in fp32 and converted to bf16 before a bf16 dot
- f16:  fp16 dots of the unscaled tiles, x rows rescaled per K step, each step's sums scaled after the dot

(The runs in docs/results/h200-probe-decode-dots-v17*.txt also timed three modes measured slower and since removed:
the tiles converted to bf16 unscaled, the down GEMV as a tensor-core dot with the row as the one nonzero column, and
the fp16 dots with one factor per x row for the whole K loop from a first pass over the row.)

The package's eager plans are off for the run (`replay.ENABLED`): a recorded call would replay the first variant's
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
from moe_dispatch import reference
from moe_dispatch.gemm import decode
from moe_dispatch.host import replay, tiles
from moe_dispatch.gemm.jit import StepDot

VARIANTS = {"tile": StepDot.SCALED_TILE, "f16": StepDot.F16_SUMS}
FALLBACK = tiles.DecodeTiles(tiles.DecodeTile(64, 256, 4, 3, 1), tiles.DecodeTile(64, 128, 4, 3, 1))


def forced(mode, fn):
    """fn with decode.step_dot answering `mode` while it runs (and while a graph of it is captured)."""
    def call():
        saved = decode.step_dot
        decode.step_dot = lambda *_: mode
        try:
            return fn()
        finally:
            decode.step_dot = saved
    return call


def cell(shape, prob, T, pairs, read_tbps):
    x = prob.x[:T]
    gen = torch.Generator(device="cuda").manual_seed(T)
    ids = torch.stack([torch.randperm(shape.num_experts, device="cuda", generator=gen)[:shape.top_k]
                       for _ in range(T)]).to(torch.int32)
    weights = torch.rand(T, shape.top_k, device="cuda", generator=gen)
    # the table's decode tiles, else (a T where the table sends the call to the general path) its generic ones
    table = tiles.select_decode_tiles(x.device, T, shape.top_k, shape.num_experts, shape.ffn, shape.hidden, x.dtype,
                                      fp8=True) or FALLBACK
    ref = reference.fused_experts_fp8_ref(x, prob.q_gate_up, prob.q_down, ids, weights, experts_per_chunk=16,
                                          **prob.scales)

    def run():
        return moe_dispatch.fused_experts(x, prob.q_gate_up, prob.q_down, ids, weights, validate=False, tiles=table,
                                          fp8_compute="dequant", **prob.scales)

    fns = {name: forced(mode, run) for name, mode in VARIANTS.items()}
    errors = {name: reference.relative_error(fn(), ref) for name, fn in fns.items()}
    times = harness.paired_graph_times(fns, pairs)
    first = next(iter(VARIANTS))
    H, F = shape.hidden, shape.ffn
    hit = int(torch.unique(ids).numel())
    scale_bytes = 4 * 3 * -(-H // 128) * -(-F // 128)
    return {"model": shape.name, "T": T, "hit": hit,
            "hot_us": {n: statistics.median(v) for n, v in times["hot"].items()},
            "flushed_us": {n: statistics.median(v) for n, v in times["flushed"].items()},
            "hot_ratio": harness.median_ratios(times["hot"], first),
            "flushed_ratio": harness.median_ratios(times["flushed"], first),
            "errors": errors,
            "kernels_us": {name: harness.kernel_times(fn) for name, fn in fns.items()},
            "target_us": 1.15 * hit * (3 * H * F + scale_bytes) / (read_tbps * 1e6) + 10.0}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen3-30b-a3b,deepseek-v3,mixtral-8x7b,qwen2-57b-a14b,mixtral-8x22b")
    parser.add_argument("--tokens", default="1,4,16")
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--read-tbps", type=float, default=4.25, help="R, the read bandwidth in TB/s")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    replay.ENABLED = False
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for name in args.models.split(","):
        shape = MODEL_SHAPES[name]
        prob = harness.make_fp8_problem(shape, max(tokens), "cuda", 0, moe_dispatch)
        for T in tokens:
            row = cell(shape, prob, T, args.pairs, args.read_tbps)
            rows.append(row)
            hot = "  ".join(f"{n} {v:8.1f}" for n, v in row["hot_us"].items())
            ratios = " ".join(f"{v:.3f}" for v in row["hot_ratio"].values())
            print(f"{name:16s} T={T:<3d} hot us: {hot}  ratios {ratios} target {row['target_us']:.1f}  err "
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
