"""Launch configurations of the experts backward, measured on a GPU: a per-kernel time breakdown (torch.profiler) of
one backward, then the whole backward timed for each candidate weight-gradient tile and each candidate set of
input-gradient GEMM tiles, with the gradients checked against the default configuration's.

    scripts/tune_backward --models mixtral-8x7b,qwen3-30b-a3b --tokens 4096

Prints one table per model and token count; writes tune_backward.json under --out.
"""

import argparse
import dataclasses
import json
import os

import torch
import triton
from model_shapes import MODEL_SHAPES

from moe_dispatch.experts_backward import ExpertsGrads, experts_backward
from moe_dispatch.moe import _fused_experts_op
from moe_dispatch.tiles import GemmTile, MoeTiles, WeightGradTile, select_tiles, select_weight_grad_tile

WEIGHT_TILES = [
    WeightGradTile(128, 128, 64, 8, 3), WeightGradTile(128, 128, 32, 4, 4), WeightGradTile(128, 128, 64, 4, 3),
    WeightGradTile(128, 256, 64, 8, 3), WeightGradTile(256, 128, 64, 8, 3), WeightGradTile(64, 128, 64, 4, 4),
    WeightGradTile(128, 128, 128, 8, 2),
]
GEMM_TILES = [  # gate_up is the dA GEMM's tile (n = F, K = H, heavy epilogue), down the dX GEMM's (n = H, K = F)
    None,  # the forward's table
    MoeTiles(128, GemmTile(64, 64, 4, 4, 8), GemmTile(256, 64, 8, 3, 8)),
    MoeTiles(128, GemmTile(128, 64, 4, 4, 8), GemmTile(256, 64, 8, 3, 8)),
    MoeTiles(128, GemmTile(64, 128, 4, 3, 8), GemmTile(256, 64, 8, 3, 8)),
    MoeTiles(64, GemmTile(128, 64, 4, 4, 8), GemmTile(128, 64, 4, 4, 8)),
]


def problem(shape, T):
    E, k, H, F = shape.num_experts, shape.top_k, shape.hidden, shape.ffn
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w_gate_up = torch.randn(E, 2 * F, H, device="cuda", dtype=torch.bfloat16) * 0.02
    w_down = torch.randn(E, H, F, device="cuda", dtype=torch.bfloat16) * 0.02
    ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
    weights = torch.rand(T, k, device="cuda")
    _, preact, offsets, gather_idx, scatter_idx = _fused_experts_op._init_fn(
        x, w_gate_up, None, w_down, ids, weights, None, None, "silu", False, False, 1.702, 7.0, None, True)
    grad_out = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    return x, w_gate_up, w_down, ids, weights, preact, offsets, gather_idx, scatter_idx, grad_out


def run_backward(args, tiles=None, weight_tile=None):
    x, w_gate_up, w_down, ids, weights, preact, offsets, gather_idx, scatter_idx, grad_out = args
    F = w_down.shape[2]
    d_w_gate_up = torch.empty_like(w_gate_up)
    grads = ExpertsGrads(x=torch.empty_like(x), w_gate=d_w_gate_up[:, :F], w_up=d_w_gate_up[:, F:],
                         w_down=torch.empty_like(w_down), topk_weights=torch.empty_like(weights), gate_bias=None,
                         up_bias=None, down_bias=None)
    experts_backward(grad_out, x, w_gate_up[:, :F], w_gate_up[:, F:], w_down, ids, weights, None, preact, offsets,
                     gather_idx, scatter_idx, grads, activation="silu", transposed=False, alpha=1.702, limit=7.0,
                     tiles=tiles, weight_tile=weight_tile)
    return grads


def breakdown(args):
    run_backward(args)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            run_backward(args)
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.key] = event.device_time_total / 3 / 1e3  # ms per backward
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def max_rel(grads, ref):
    out = 0.0
    for name in ("x", "w_gate", "w_up", "w_down", "topk_weights"):
        a, b = getattr(grads, name).float(), getattr(ref, name).float()
        out = max(out, ((a - b).norm() / b.norm().clamp_min(1e-30)).item())
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="mixtral-8x7b,qwen3-30b-a3b")
    p.add_argument("--tokens", default="4096")
    p.add_argument("--out", default="tune-backward-out")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = []
    for name in args.models.split(","):
        shape = MODEL_SHAPES[name]
        for T in (int(t) for t in args.tokens.split(",")):
            torch.manual_seed(0)
            prob = problem(shape, T)
            flops = 2 * T * shape.top_k * 6 * shape.hidden * shape.ffn  # the backward: twice the forward
            ref = run_backward(prob)
            row = dict(model=name, T=T, breakdown_ms=breakdown(prob), default_weight_tile=dataclasses.asdict(
                select_weight_grad_tile(torch.device("cuda"), torch.bfloat16)),
                default_tiles=select_tiles(torch.device("cuda"), T, shape.top_k, shape.num_experts, shape.ffn,
                                           shape.hidden).to_dict(), weight_tiles=[], gemm_tiles=[])
            print(f"== {name} T={T}: per-kernel ms", {k[:40]: round(v, 3) for k, v in row["breakdown_ms"].items()})
            for tile in WEIGHT_TILES:
                try:
                    ms = triton.testing.do_bench(lambda: run_backward(prob, weight_tile=tile), warmup=10, rep=150)
                    err = max_rel(run_backward(prob, weight_tile=tile), ref)
                    row["weight_tiles"].append(dict(tile=dataclasses.asdict(tile), ms=ms, tflops=flops / ms / 1e9,
                                                    max_rel_vs_default=err))
                    print(f"  weight tile {tile}: {ms:.2f} ms {flops / ms / 1e9:.0f} TF/s err {err:.1e}", flush=True)
                except Exception as error:
                    print(f"  weight tile {tile}: {type(error).__name__} {str(error)[:120]}", flush=True)
            for tiles in GEMM_TILES:
                try:
                    ms = triton.testing.do_bench(lambda: run_backward(prob, tiles=tiles), warmup=10, rep=150)
                    err = max_rel(run_backward(prob, tiles=tiles), ref)
                    row["gemm_tiles"].append(dict(tiles=tiles.to_dict() if tiles else None, ms=ms,
                                                  tflops=flops / ms / 1e9, max_rel_vs_default=err))
                    print(f"  gemm tiles {tiles}: {ms:.2f} ms {flops / ms / 1e9:.0f} TF/s err {err:.1e}", flush=True)
                except Exception as error:
                    print(f"  gemm tiles {tiles}: {type(error).__name__} {str(error)[:120]}", flush=True)
            results.append(row)
            prob = ref = None  # free the problem before the next one
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "tune_backward.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
