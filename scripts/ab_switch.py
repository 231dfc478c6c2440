#!/usr/bin/env python3
"""Paired A/B timing of one switch of the package in one run: an environment variable (MOE_DISPATCH_PDL, ...) or a
module attribute read at launch (persistent_gemm.PREFETCH_META, ...). For each (model, T)
cell, `fused_experts` is captured once per value of the switch (a one-call CUDA graph, replayed after an L2 flush, and
a graph of ten calls, hot), then the values are replayed call by call, A B, B A, ... for --pairs pairs
(`bench.paired_graph_times`): clock drift under the power cap hits neighbouring replays alike, so the medians of the
per-pair ratios resolve 1-2% differences. The outputs of the values must be bit-identical; the first value's is checked
against the float64 reference.

    scripts/ab_switch.py --switch MOE_DISPATCH_PDL=1,0 --cells qwen3-30b-a3b:1,qwen3-30b-a3b:4 --out "$OUT/ab"
    scripts/ab_switch.py --switch moe_dispatch.dispatch:SINGLE_MAX=1024,0 --cells qwen3-30b-a3b:128 --out "$OUT/ab"

Prints a table (medians; ratios against the first value) and writes OUT/ab.json.
"""

import argparse
import ast
import importlib
import json
import os
import statistics
from pathlib import Path

import torch

import bench  # scripts/, benchmarks/ and torch-ext/ are on PYTHONPATH (scripts/_env.sh)
from model_shapes import MODEL_SHAPES


def switch_setter(switch):
    """(set(value), values) of a --switch: "VAR=a,b" sets environment variable VAR to the string value;
    "package.module:NAME=a,b" sets the module's attribute NAME to the value read as a Python literal. set(None) puts
    back what was there before."""
    name, values = switch.split("=")
    values = values.split(",")
    if ":" not in name:
        before = os.environ.get(name)

        def set_env(value):
            value = before if value is None else value
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
            clear_plans()  # the package reads its settings when a plan is recorded (MOE_DISPATCH_PDL)

        return set_env, values
    module_name, attr = name.split(":")
    module = importlib.import_module(module_name)
    before = getattr(module, attr)  # fails early on a misspelt attribute

    def set_attr(value):
        setattr(module, attr, before if value is None else ast.literal_eval(value))
        clear_plans()  # a plan replays what the path did when recorded: the attribute is not part of its key

    return set_attr, values


def clear_plans():
    importlib.import_module("moe_dispatch._plan").clear()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--switch", required=True,
                   help="VAR=a,b (an environment variable) or package.module:NAME=a,b (a module attribute, values as "
                        "Python literals), and its values")
    p.add_argument("--cells", required=True, help="comma list of model:T (model:T:skewed for skewed routing)")
    p.add_argument("--pairs", type=int, default=16)
    p.add_argument("--out", default="ab-out")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    import moe_dispatch as md

    setter, values = switch_setter(args.switch)
    device = torch.device("cuda")
    results = []
    prob = None
    for cell in args.cells.split(","):
        name, t, *routing = cell.split(":")
        t = int(t)
        shape = MODEL_SHAPES[name]
        if prob is None or prob.shape.name != name or prob.x.shape[0] < t:
            prob = None
            bench.free_memory(device)
            prob = bench.make_problem(shape, max(t, 1024), torch.bfloat16, device, args.seed)
        route = bench.skewed_routing if routing else bench.random_routing
        ids, weights = route(t, shape.num_experts, shape.top_k, device, args.seed * 1000003 + t)
        x = prob.x[:t]
        row = {"model": name, "tokens": t, "routing": "skewed" if routing else "balanced"}
        try:
            outputs = {}
            variants = {}
            for v in values:
                setter(v)
                outputs[v] = md.fused_experts(x, prob.w_gate_up, prob.w_down, ids, weights)

                def call(v=v):  # the switch as it is read at launch, i.e. while each graph is captured
                    setter(v)
                    return md.fused_experts(x, prob.w_gate_up, prob.w_down, ids, weights)

                variants[v] = call
            row["identical"] = all(torch.equal(outputs[values[0]], outputs[v]) for v in values[1:])
            rows = bench.check_rows(t, 256, device, args.seed)
            row["rel_err"] = bench.check_output(prob, rows, outputs[values[0]], ids, weights)
            times = bench.paired_graph_times(variants, args.pairs)
            for kind, series in times.items():
                ratios = bench.median_ratios(series, values[0])
                for v in values:
                    row[f"{kind}_{v}"] = statistics.median(series[v])
                    row[f"{kind}_ratio_{v}"] = ratios[v]
            row["per_pair"] = times
        except Exception as exc:  # noqa: BLE001 (recorded; the other cells still run)
            row["error"] = bench.error_text(exc)
            torch.cuda.synchronize()
        finally:
            setter(None)
        results.append(row)
        if "error" in row:
            print(f"{name:16s} T={t:<5d} {row['routing']:8s} error: {row['error']}", flush=True)
        else:
            line = " ".join(f"{kind}[{v}] {row[f'{kind}_{v}']:.1f} ({row[f'{kind}_ratio_{v}'] - 1:+.1%})"
                            for kind in ("flushed", "hot") for v in values)
            print(f"{name:16s} T={t:<5d} {row['routing']:8s} {line} identical={row['identical']} "
                  f"rel_err={row['rel_err']:.1e}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab.json").write_text(json.dumps({"switch": args.switch, "pairs": args.pairs, "cells": results}, indent=1))


if __name__ == "__main__":
    main()
