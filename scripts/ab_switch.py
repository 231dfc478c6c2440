#!/usr/bin/env python3
"""A/B timing of one environment switch of the package (MOE_DISPATCH_PDL, ...) in one run: each (model, T) cell's
`fused_experts` call timed hot (triton.testing.do_bench_cudagraph: the call repeated in one CUDA graph, no L2 flush)
and as one-call graph replays with L2 flushed, for each value of the switch in turn, over --rounds alternating rounds
(A B A B ...: clock drift hits both sides alike); the outputs of the values must be bit-identical.

    scripts/ab_switch.py --switch MOE_DISPATCH_PDL=1,0 --cells qwen3-30b-a3b:1,qwen3-30b-a3b:4 --out "$OUT/ab"

Prints a table (medians over rounds) and writes OUT/ab.json.
"""

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

import bench  # scripts/, benchmarks/ and torch-ext/ are on PYTHONPATH (scripts/_env.sh)
from model_shapes import MODEL_SHAPES


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--switch", required=True, help="VAR=a,b: the environment variable and its values")
    p.add_argument("--cells", required=True, help="comma list of model:T")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="ab-out")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    import moe_dispatch as md

    var, values = args.switch.split("=")
    values = values.split(",")
    device = torch.device("cuda")
    timer = bench.EventTimer(5.0, 30.0, 15.0)
    results = []
    prob = None
    for cell in args.cells.split(","):
        name, t = cell.split(":")
        t = int(t)
        shape = MODEL_SHAPES[name]
        if prob is None or prob.shape.name != name:
            prob = None
            bench.free_memory(device)
            prob = bench.make_problem(shape, 4096, torch.bfloat16, device, args.seed)
        ids, weights = bench.random_routing(t, shape.num_experts, shape.top_k, device, args.seed * 1000003 + t)
        x = prob.x[:t]

        def call():
            return md.fused_experts(x, prob.w_gate_up, prob.w_down, ids, weights)

        times = {v: {"hot": [], "graph": []} for v in values}
        outputs = {}
        errors = []
        for _ in range(args.rounds):
            for v in values:
                os.environ[var] = v
                try:
                    if v not in outputs:
                        outputs[v] = call()
                    times[v]["hot"].append(timer.hot(call) * 1e3)
                    times[v]["graph"].append(timer.graph(call) * 1e3)
                except Exception as exc:  # noqa: BLE001 (recorded; the other cells still run)
                    errors.append(f"{var}={v}: {bench.error_text(exc)[:200]}")
                    torch.cuda.synchronize()
        same = len(outputs) == len(values) and all(torch.equal(outputs[values[0]], outputs[v]) for v in values[1:])
        row = {"model": name, "tokens": t, "identical": same, "errors": errors,
               **{f"{kind}_{v}": statistics.median(times[v][kind]) if times[v][kind] else float("nan")
                  for v in values for kind in ("hot", "graph")}}
        results.append(row)
        line = " ".join(f"{kind}[{v}] {row[f'{kind}_{v}']:.1f}" for kind in ("hot", "graph") for v in values)
        print(f"{name:16s} T={t:<5d} {line} identical={same} {' '.join(errors)}", flush=True)
    os.environ.pop(var, None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab.json").write_text(json.dumps({"switch": args.switch, "cells": results}, indent=1))


if __name__ == "__main__":
    main()
