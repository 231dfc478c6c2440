#!/usr/bin/env python3
"""Host time of an eager call beside its GPU time: `fused_experts` with and without plans (`moe_dispatch.host.replay`),
the transformers experts interface (`moe_dispatch_experts`), and transformers' own `batched_mm` and `grouped_mm`
experts functions, for the six models of MODEL_SHAPES at T = 1, 4, 16, 128, in one run.

Per (model, T, implementation), under torch.no_grad as `generate` runs:
  host_us      host time per call, calls issued back to back after a sync (harness.host_time: few enough calls that
               the launch queue never fills, so this is the host's enqueue time)
  idle_us      host time of one call issued to an idle GPU (sync, then the call), median of several
  latency_us   from that call's start to the end of its GPU work (the whole call, seen from an idle GPU)
  gpu_us       the sum of the call's kernel times (harness.kernel_times, torch.profiler)
The implementations are measured in alternating rounds (`--rounds`), medians reported, so clock drift hits all alike.

`--train` times a training call instead (autograd on, no torch.no_grad): each implementation's forward and
`torch.autograd.grad` of its output for x, both weights and the routing weights, with a dense output gradient (what a
residual stream hands the experts); `batched_mm` is left out (transformers' decode-step function), T defaults to
2048 (the whole-model step's 4 x 512 tokens), and each cell also records how many of three calls the package's
forward and backward served from their plans (`replays`: 2 and 2 where the second and third calls replay).

`--profile MODEL:T` adds a cProfile of 1000 calls of `fused_experts` with plans off and on (top functions by own
time) and the cost of each recorded launch through `JITFunction.run` against the compiled launcher the plan uses.

    scripts/bench_host.py --out "$OUT/host"                      # GPU: the whole table
    scripts/bench_host.py --models qwen3-30b-a3b --tokens 1,4 --profile qwen3-30b-a3b:1
    scripts/bench_host.py --train --models qwen3-30b-a3b,mixtral-8x7b --out "$OUT/host-train"

Prints a markdown table last and writes OUT/host.json (and OUT/profile.txt with --profile).
"""

import argparse
import io
import json
import statistics
import time
from pathlib import Path

import torch

import harness  # scripts/, benchmarks/ and torch-ext/ are on PYTHONPATH (scripts/_env.sh)
from benchmark_moe import TransformersExperts  # the stand-in experts module the Hub benchmark uses
from model_shapes import MODEL_SHAPES

IMPLEMENTATIONS = ("plans", "no_plans", "transformers_fn", "batched_mm", "grouped_mm")
BATCHED_MM_LIMIT = 8 << 30  # batched_mm copies one expert's weights per assignment; skip it past this many bytes


def implementations(md, prob, tokens, topk_ids, topk_weights):
    """{name: zero-argument callable} of one cell."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _default_apply_gate

    x = prob.x[:tokens]
    module = TransformersExperts(prob.w_gate_up, prob.w_down, _default_apply_gate)
    plan_module = md.host.replay

    def fused(enabled):
        def call():
            plan_module.ENABLED = enabled
            return md.fused_experts(x, prob.w_gate_up, prob.w_down, topk_ids, topk_weights)
        return call

    def transformers_fn():
        plan_module.ENABLED = True
        return md.moe_dispatch_experts(module, x, topk_ids, topk_weights)

    fns = {"plans": fused(True), "no_plans": fused(False), "transformers_fn": transformers_fn}
    weight_bytes = prob.shape.hidden * prob.shape.ffn * 3 * prob.w_down.element_size()
    for name in ("batched_mm", "grouped_mm"):
        fn = ALL_EXPERTS_FUNCTIONS.get(name) if hasattr(ALL_EXPERTS_FUNCTIONS, "get") else None
        if fn is None or (name == "batched_mm" and tokens * prob.shape.top_k * weight_bytes > BATCHED_MM_LIMIT):
            continue
        fns[name] = (lambda f: lambda: f(module, x, topk_ids, topk_weights))(fn)
    return fns


def training_implementations(md, prob, tokens, topk_ids, topk_weights, grad_out):
    """{name: zero-argument callable} of one training cell (`--train`): the forward with autograd, then
    `torch.autograd.grad` of its output (`grad_out`) for x, both weights and the routing weights; each returns the
    four gradients."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _default_apply_gate

    x = prob.x[:tokens].detach().requires_grad_(True)
    weights = topk_weights.detach().requires_grad_(True)
    module = TransformersExperts(prob.w_gate_up, prob.w_down, _default_apply_gate)
    for param in (module.gate_up_proj, module.down_proj):
        param.requires_grad_(True)
    leaves = [x, module.gate_up_proj, module.down_proj, weights]
    plan_module = md.host.replay

    def step(forward, plans=True):
        def call():
            plan_module.ENABLED = plans
            return torch.autograd.grad(forward(), leaves, grad_out)
        return call

    def fused():
        return md.fused_experts(x, module.gate_up_proj, module.down_proj, topk_ids, weights)

    fns = {"plans": step(fused), "no_plans": step(fused, plans=False),
           "transformers_fn": step(lambda: md.moe_dispatch_experts(module, x, topk_ids, weights))}
    fn = ALL_EXPERTS_FUNCTIONS.get("grouped_mm") if hasattr(ALL_EXPERTS_FUNCTIONS, "get") else None
    if fn is not None:
        fns["grouped_mm"] = step(lambda: fn(module, x, topk_ids, weights))
    return fns


def plan_replays(md, fn, calls=3):
    """How many of `calls` calls of `fn` the experts operator's forward and backward served from their plans."""
    forward, backward = md.experts.operator.FORWARD_PLANS, md.experts.autograd.BACKWARD_PLANS
    before = (forward.replays, backward.replays)
    for _ in range(calls):
        fn()
    return {"forward": forward.replays - before[0], "backward": backward.replays - before[1],
            "why_not": forward.last_reason or backward.last_reason}


def idle_times(fn, calls=7):
    """(host us, latency us) of single calls on an idle GPU, medians."""
    host, latency = [], []
    for _ in range(calls):
        torch.cuda.synchronize()
        time.sleep(0.002)
        start = time.perf_counter()
        fn()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        host.append((issued - start) * 1e6)
        latency.append((done - start) * 1e6)
    return statistics.median(host), statistics.median(latency)


def measure_cell(fns, rounds):
    samples = {name: {"host_us": [], "idle_us": [], "latency_us": []} for name in fns}
    for fn in fns.values():  # compile, record plans
        fn()
        fn()
    torch.cuda.synchronize()
    for r in range(rounds):
        names = list(fns) if r % 2 == 0 else list(reversed(fns))
        for name in names:
            samples[name]["host_us"].append(harness.host_time(fns[name]))
            idle, latency = idle_times(fns[name])
            samples[name]["idle_us"].append(idle)
            samples[name]["latency_us"].append(latency)
    record = {name: {k: statistics.median(v) for k, v in s.items()} for name, s in samples.items()}
    for name, fn in fns.items():
        record[name]["gpu_us"] = sum(harness.kernel_times(fn).values())
    return record


def profile_cell(md, prob, tokens, topk_ids, topk_weights, calls=1000):
    """cProfile text of `calls` calls with plans off and on, and per-launch costs: JITFunction.run vs the plan's
    compiled launcher."""
    x = prob.x[:tokens]
    out = io.StringIO()

    def call():
        return md.fused_experts(x, prob.w_gate_up, prob.w_down, topk_ids, topk_weights)

    for enabled in (False, True):
        md.host.replay.ENABLED = enabled
        out.write(f"\n=== cProfile, {calls} calls, plans {'on' if enabled else 'off'} ===\n")
        out.write(harness.cprofile_text(call, calls))
    md.host.replay.ENABLED = True
    cache = md.moe._FUSED_EXPERTS_PLANS
    plans = [p for p in cache._plans.values() if p is not None]
    launch_costs = []
    if plans:
        plan = plans[-1]
        from moe_dispatch.host.replay import _Launch, _buffers, _tensor

        for step in plan.steps:
            if type(step) is not _Launch or any(f[4] is not None for f in step.fast_fills):
                continue
            values = list(step.values)
            # the recorded call's own tensors are gone; time both paths on fresh buffers of the same shapes
            inputs = (x, prob.w_gate_up, prob.w_down, topk_ids, topk_weights) + (None,) * 6
            buffers, _scratch = _buffers(plan, False)
            for position, source in step.fills:
                values[position] = _tensor(source, inputs, buffers)
            kwargs = dict(zip(step.names, values))
            stream = torch.cuda.current_stream().cuda_stream

            def jit_run():
                step.kernel[step.grid](**kwargs, **step.options)

            def compiled_run():
                step.launcher(*step.grid, stream, step.function, step.packed, None, None, None, *values)

            timings = {}
            for name, fn in (("jit_run_us", jit_run), ("compiled_run_us", compiled_run)):
                fn()
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(200):
                    fn()
                timings[name] = (time.perf_counter() - start) / 200 * 1e6
                torch.cuda.synchronize()
            timings["kernel"] = getattr(step.kernel, "__name__", str(step.kernel))
            timings["arguments"] = len(values)
            launch_costs.append(timings)
    return out.getvalue(), launch_costs


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODEL_SHAPES))
    parser.add_argument("--tokens", default=None, help="comma list (default 1,4,16,128; --train 2048)")
    parser.add_argument("--train", action="store_true", help="time training calls (forward + autograd.grad)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", default=None, help="MODEL:T for the cProfile and per-launch costs")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import moe_dispatch as md

    device = torch.device("cuda")
    tokens_list = [int(t) for t in (args.tokens or ("2048" if args.train else "1,4,16,128")).split(",")]
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cells": [], "profile": None,
               "train": args.train}
    try:
        import transformers
        import triton
        results.update(transformers=transformers.__version__, triton=triton.__version__)
    except ImportError:
        pass
    profile_model, profile_tokens = (args.profile.split(":") if args.profile else (None, None))
    with torch.set_grad_enabled(args.train):
        for name in args.models.split(","):
            shape = MODEL_SHAPES[name]
            prob = harness.make_problem(shape, max(tokens_list), torch.bfloat16, device, seed=0)
            for tokens in tokens_list:
                topk_ids, topk_weights = harness.random_routing(tokens, shape.num_experts, shape.top_k, device, seed=1)
                if args.train:
                    grad_out = torch.randn(tokens, shape.hidden, device=device, dtype=torch.bfloat16)
                    fns = training_implementations(md, prob, tokens, topk_ids, topk_weights, grad_out)
                else:
                    fns = implementations(md, prob, tokens, topk_ids, topk_weights)
                record = measure_cell(fns, args.rounds)
                cell = {"model": name, "T": tokens, **record}
                if args.train:
                    cell["replays"] = plan_replays(md, fns["plans"])
                results["cells"].append(cell)
                print(name, tokens, {k: round(v["host_us"], 1) for k, v in record.items()}, cell.get("replays", ""),
                      flush=True)
                if name == profile_model and tokens == int(profile_tokens):
                    text, launch_costs = profile_cell(md, prob, tokens, topk_ids, topk_weights)
                    results["profile"] = {"cell": args.profile, "launches": launch_costs}
                    if args.out:
                        Path(args.out).mkdir(parents=True, exist_ok=True)
                        Path(args.out, "profile.txt").write_text(text)
                    print(text[:6000])
                    print(json.dumps(launch_costs, indent=1))
            del prob
            torch.cuda.empty_cache()
    md.host.replay.ENABLED = True
    table = markdown(results)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "host.json").write_text(json.dumps(results, indent=1))
        Path(args.out, "host.md").write_text(table)
    print(table)
    return results


def markdown(results):
    lines = ["| model | T | GPU us (ours) | plans host / idle | no plans host | transformers fn host | batched_mm host "
             "(GPU) | grouped_mm host (GPU) |", "|---|---|---|---|---|---|---|---|"]

    def cell(record, name, gpu=False):
        r = record.get(name)
        if r is None:
            return "-"
        return f"{r['host_us']:.1f} ({r['gpu_us']:.1f})" if gpu else f"{r['host_us']:.1f}"

    if results.get("train"):  # training calls: how many of three calls replayed, forward / backward
        lines[0] += " replays (fwd / bwd of 3) |"
        lines[1] += "---|"
    for c in results["cells"]:
        plans = c["plans"]
        line = (f"| {c['model']} | {c['T']} | {plans['gpu_us']:.1f} | {plans['host_us']:.1f} / "
                f"{plans['idle_us']:.1f} | {cell(c, 'no_plans')} | {cell(c, 'transformers_fn')} | "
                f"{cell(c, 'batched_mm', True)} | {cell(c, 'grouped_mm', True)} |")
        if "replays" in c:
            line += f" {c['replays']['forward']} / {c['replays']['backward']} |"
        lines.append(line)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
