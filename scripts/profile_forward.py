#!/usr/bin/env python3
"""Where a `fused_experts` call spends its GPU time: a per-kernel breakdown (bench.kernel_times: torch.profiler, CUDA
activity only, mean of 5 calls) per (model, T). The launches that are neither GEMM (dispatch, combine) are the part
issue 12's vLLM figure does not include.

    scripts/profile_forward.py --cells qwen3-30b-a3b:4,qwen3-30b-a3b:1024 --out "$OUT/profile"

Prints one line per cell (kernel: us) and writes OUT/profile.json.
"""

import argparse
import json
from pathlib import Path

import torch

import bench  # scripts/, benchmarks/ and torch-ext/ are on PYTHONPATH (scripts/_env.sh)
from model_shapes import MODEL_SHAPES

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cells", required=True, help="comma list of model:T")
    p.add_argument("--out", default="profile-out")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    import moe_dispatch as md

    device = torch.device("cuda")
    results = []
    problems = {}
    for cell in args.cells.split(","):
        name, t = cell.split(":")
        t = int(t)
        shape = MODEL_SHAPES[name]
        if name not in problems:
            problems.clear()
            bench.free_memory(device)
            problems[name] = bench.make_problem(shape, 16384, torch.bfloat16, device, args.seed)
        prob = problems[name]
        ids, weights = bench.random_routing(t, shape.num_experts, shape.top_k, device, args.seed * 1000003 + t)
        x = prob.x[:t]
        kernels = bench.kernel_times(lambda: md.fused_experts(x, prob.w_gate_up, prob.w_down, ids, weights))
        total = sum(kernels.values())
        results.append({"model": name, "tokens": t, "total_us": total, "kernels_us": kernels})
        parts = ", ".join(f"{key[:48]} {us:.1f}" for key, us in kernels.items())
        print(f"{name} T={t}: {total:.1f} us = {parts}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
