#!/usr/bin/env python3
"""Where a `fused_experts` call spends its GPU time: a per-kernel breakdown (bench.kernel_times: torch.profiler, CUDA
activity only, mean of 5 calls) per (model, T). The launches that are neither GEMM (dispatch, combine) are the part
issue 12's vLLM figure does not include.

With --host, also where it spends its host time: the mean time to enqueue one eager call (bench.host_time: a short
run of calls issued without a sync, so the launch queue never fills), and a cProfile of --host-calls more calls (the
functions of largest own time). The L2-flushed timing of small cells is this host time, not the GPU's.

    scripts/profile_forward.py --cells qwen3-30b-a3b:4,qwen3-30b-a3b:1024 --host --out "$OUT/profile"

Prints one line per cell (kernel: us) and writes OUT/profile.json (and OUT/host-<model>-<T>.txt with --host).
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
    p.add_argument("--host", action="store_true", help="also the host time per call and a cProfile of it")
    p.add_argument("--host-calls", type=int, default=200)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
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

        def call():
            return md.fused_experts(x, prob.w_gate_up, prob.w_down, ids, weights)

        kernels = bench.kernel_times(call)
        total = sum(kernels.values())
        results.append({"model": name, "tokens": t, "total_us": total, "kernels_us": kernels})
        parts = ", ".join(f"{key[:48]} {us:.1f}" for key, us in kernels.items())
        print(f"{name} T={t}: {total:.1f} us = {parts}", flush=True)
        if args.host:
            results[-1]["host_us"], text = host_profile(call, args.host_calls)
            (out / f"host-{name}-{t}.txt").write_text(text)
            print(f"{name} T={t}: host {results[-1]['host_us']:.1f} us per call", flush=True)
    (out / "profile.json").write_text(json.dumps(results, indent=1))


def host_profile(fn, calls):
    """(host us per call of `fn` (bench.host_time), cProfile text of `calls` calls: the 40 functions of largest own
    time)."""
    for _ in range(10):
        fn()
    host_us = bench.host_time(fn)
    return host_us, bench.cprofile_text(fn, calls, rows=40)


if __name__ == "__main__":
    main()
