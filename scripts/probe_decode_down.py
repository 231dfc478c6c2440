"""Probe: the decode path's down GEMM as a GEMV per assignment (the table's tiles) against one tensor-core dot per
expert hit over all its tokens' rows (tiles.DecodeTile.dot, gemm/decode.py's `_decode_down_dot_kernel`), at the table's
gate/up tile, and the general path the device's table picks ("auto") beside them. For each model and T:
`fused_experts` with each variant, timed as paired one-call graph replays (hot and L2-flushed,
harness.paired_graph_times), per-kernel GPU times of the decode variants, the error against the float64 experts.
float8 weights (128 x 128 block scales, weight-only dequantization on the decode path) or bf16 weights (--bf16).

The package's eager plans are off for the run (`replay.ENABLED`): a recorded call would replay the first variant's
launches for every variant of the same signature.

    scripts/_env.sh's PYTHONPATH; python scripts/probe_decode_down.py [--models ...] [--tokens 1,4,16] [--bf16]
        [--out f.json]
"""

import argparse
import dataclasses
import json
import statistics

import torch

import harness
import moe_dispatch
from model_shapes import MODEL_SHAPES
from moe_dispatch import reference
from moe_dispatch.host import replay, tiles

FALLBACK = tiles.DecodeTiles(tiles.DecodeTile(64, 256, 4, 3, 1), tiles.DecodeTile(64, 128, 4, 3, 1))
# the dot kernel's candidates: (block_n, block_k, num_warps, num_stages, split_k)
DOT_TILES = ((64, 128, 4, 3, 1), (64, 128, 4, 3, 2), (64, 128, 4, 3, 4), (128, 128, 4, 3, 1), (128, 128, 8, 3, 2),
             (64, 256, 4, 3, 1))


def cell(shape, prob, T, pairs, bf16, read_tbps):
    x = prob.x[:T]
    gen = torch.Generator(device="cuda").manual_seed(T)
    ids = torch.stack([torch.randperm(shape.num_experts, device="cuda", generator=gen)[:shape.top_k]
                       for _ in range(T)]).to(torch.int32)
    weights = torch.rand(T, shape.top_k, device="cuda", generator=gen)
    found = tiles.select_decode_tiles(x.device, T, shape.top_k, shape.num_experts, shape.ffn, shape.hidden, x.dtype,
                                      fp8=not bf16)
    table = found or FALLBACK
    if bf16:
        operands = dict(w_gate_up=prob.w_gate_up, w_down=prob.w_down)
        ref = reference.fused_experts_ref(x, prob.w_gate_up, prob.w_down, ids, weights)
        options = {}
    else:
        operands = dict(w_gate_up=prob.q_gate_up, w_down=prob.q_down, **prob.scales)
        ref = reference.fused_experts_fp8_ref(x, prob.q_gate_up, prob.q_down, ids, weights, experts_per_chunk=16,
                                              **prob.scales)
        options = dict(fp8_compute="dequant")

    def call(tile_choice, **extra):
        return lambda: moe_dispatch.fused_experts(x, topk_ids=ids, topk_weights=weights, validate=False,
                                                  tiles=tile_choice, **operands, **extra)

    fns = {"gemv": call(table, **options)}
    for v in DOT_TILES:
        down = tiles.DecodeTile(*v, dot=True)
        fns["dot" + "/".join(map(str, v))] = call(dataclasses.replace(table, down=down), **options)
    fns["auto"] = call(None)
    errors = {name: reference.relative_error(fn(), ref) for name, fn in fns.items()}
    times = harness.paired_graph_times(fns, pairs)
    H, F = shape.hidden, shape.ffn
    hit = int(torch.unique(ids).numel())
    elem = 2 if bf16 else 1
    scale_bytes = 0 if bf16 else 4 * 3 * -(-H // 128) * -(-F // 128)
    return {"model": shape.name, "T": T, "hit": hit, "weights": "bf16" if bf16 else "fp8",
            "table_has_decode": found is not None, "table": table.to_dict(),
            "hot_us": {n: statistics.median(v) for n, v in times["hot"].items()},
            "flushed_us": {n: statistics.median(v) for n, v in times["flushed"].items()},
            "hot_ratio": harness.median_ratios(times["hot"], "gemv"),
            "errors": errors,
            "kernels_us": {name: harness.kernel_times(fn) for name, fn in fns.items() if name != "auto"},
            "target_us": 1.15 * hit * (3 * H * F * elem + scale_bytes) / (read_tbps * 1e6) + 10.0}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen3-30b-a3b,deepseek-v3,mixtral-8x7b,qwen2-57b-a14b,mixtral-8x22b")
    parser.add_argument("--tokens", default="1,2,4,8,16,32")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--bf16", action="store_true", help="bf16 weights (default: float8 with block scales)")
    parser.add_argument("--read-tbps", type=float, default=4.25, help="R, the read bandwidth in TB/s")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    replay.ENABLED = False
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for name in args.models.split(","):
        shape = MODEL_SHAPES[name]
        if args.bf16:
            prob = harness.make_problem(shape, max(tokens), torch.bfloat16, "cuda", 0)
        else:
            prob = harness.make_fp8_problem(shape, max(tokens), "cuda", 0, moe_dispatch)
        for T in tokens:
            if T * shape.top_k > tiles.MAX_DECODE_ASSIGNMENTS:
                continue
            row = cell(shape, prob, T, args.pairs, args.bf16, args.read_tbps)
            rows.append(row)
            best = min((v, n) for n, v in row["hot_us"].items() if n.startswith("dot"))
            print(f"{row['weights']} {name:15s} T={T:<3d} hit {row['hit']:3d} gemv {row['hot_us']['gemv']:8.1f} "
                  f"best {best[1]:18s} {best[0]:8.1f} ({best[0] / row['hot_us']['gemv']:.3f}) auto "
                  f"{row['hot_us']['auto']:8.1f} target {row['target_us']:7.1f} table-decode {row['table_has_decode']}"
                  f"  err gemv {row['errors']['gemv']:.1e} dot {row['errors'][best[1]]:.1e}", flush=True)
            for variant in ("gemv", best[1]):
                kernels = row["kernels_us"][variant]
                print(f"    {variant:18s} " + "  ".join(f"{k[:24]} {v:.1f}" for k, v in kernels.items()))
            print("    all: " + "  ".join(f"{n} {v:.1f}" for n, v in row["hot_us"].items()), flush=True)
        del prob
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
