#!/usr/bin/env python3
"""MoE forward benchmark: moe_dispatch against the physical floor and the alternatives users would otherwise run.

For every model shape (benchmarks/model_shapes.py) and token count T, and for both entry points

  fused_experts      given topk_ids / topk_weights (random routing)
  fused_moe_forward  routing included (random router weights)

it times moe_dispatch (plain launches, and CUDA-graph replays for small T), checks the output against the float64
references of moe_dispatch.reference (all rows for small T, a row sample above), and puts the time next to

  floor  = max(bytes / R, flops / P)         bytes = weights of the experts actually hit + activations in and out
  target = max(1.15 bytes / R, flops / (f P)) + 10 us (+ 15 us routing for fused_moe_forward), f = 0.9 or 0.8 by model

with R (read bandwidth) and P (dense bf16 matmul rate) measured at the start of the same run (harness.measure_ceilings),
and next to the baselines: a torch._grouped_mm pipeline (what transformers runs by default), vLLM's fused_experts
when `vllm` imports, and an eager per-expert loop for small T.

Writes DIR/bench.json (everything), DIR/bench.md (tables), DIR/roofline.png (when matplotlib imports) and
DIR/summary.txt, rewritten after every model so a run cut short keeps what it measured; prints the short table last.

    scripts/bench --quick --out results/            # T in 1,4,16,128,1024,4096,16384, all models
    scripts/bench --models mixtral-8x7b --tokens 1,4096 --paths fused_experts --no-baselines

This file is the command line and the benchmark's own cells and tables; timing, ceilings, problems, baselines and
result writing are the harness's (scripts/harness.py), shared with the other tools. Its launcher is scripts/bench.
"""

import argparse
import dataclasses
import datetime
import platform
import sys
import time
from pathlib import Path

import torch

# Imported by name: scripts/ (this folder), benchmarks/ and torch-ext/ are on PYTHONPATH (scripts/_env.sh). The
# harness first: without a GPU it turns on Triton's interpreter before anything imports triton.
import harness
from harness import ALL_TOKENS, DTYPES, QUICK_TOKENS, fmt
from model_shapes import MODEL_SHAPES
from moe_dispatch import reference  # the float64 references and the tolerance table
from moe_dispatch.reference import ROUTING_AGREEMENT_MIN, TOLERANCE

PATHS = ("fused_experts", "fused_moe_forward")
BASELINES = ("grouped_mm", "vllm", "eager")

READ_SLACK = 1.15  # the targets: reads within 15% of the bandwidth floor, plus a launch allowance
LAUNCH_ALLOWANCE_S = 10e-6
ROUTING_ALLOWANCE_S = 15e-6


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="T in 1,4,16,128,1024,4096,16384 and shorter timing windows")
    p.add_argument("--models", default="all", help=f"comma list of {', '.join(MODEL_SHAPES)} (default all)")
    p.add_argument("--tokens", default=None, help="comma list of token counts (default 1..16384, powers of two)")
    p.add_argument("--paths", default=",".join(PATHS), help="comma list of fused_experts, fused_moe_forward")
    p.add_argument("--baselines", default=",".join(BASELINES), help="comma list of grouped_mm, vllm, eager")
    p.add_argument("--no-baselines", action="store_true", help="time moe_dispatch only")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--fp16-spot", default="mixtral-8x7b,qwen3-30b-a3b",
                   help="models that also get a float16 spot check ('none' for none)")
    p.add_argument("--fp16-spot-tokens", default="16,1024")
    p.add_argument("--out", default="bench-results", help="output folder (created)")
    p.add_argument("--kernel-dir", default=None,
                   help="load the package from a build variant (build/torch-cuda) or a kernel repo root "
                        "instead of torch-ext/")
    p.add_argument("--device", default="cuda")
    p.add_argument("--warmup-ms", type=float, default=None, help="do_bench warm-up window (default 10, quick 5)")
    p.add_argument("--rep-ms", type=float, default=None, help="do_bench timing window (default 60, quick 40)")
    p.add_argument("--graph-max-tokens", type=int, default=512, help="also time CUDA-graph replays up to this T")
    p.add_argument("--eager-max-tokens", type=int, default=64, help="eager per-expert loop only up to this T")
    p.add_argument("--check-rows", type=int, default=256,
                   help="correctness: all rows up to this T, a random sample of this many above")
    p.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    p.add_argument("--ceiling-mib", type=int, default=None,
                   help="buffer for the read-bandwidth ceiling (default 4096; 1 on the CPU)")
    p.add_argument("--matmul-size", type=int, default=None,
                   help="n of the n^3 matmul ceiling (default 8192; 64 on the CPU)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="stop starting new cells after this many seconds (the outputs keep what was measured)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skewed-tokens", default="16,1024,16384",
                   help="T at which fused_experts is also timed under skewed routing (a few hot experts; 'none')")
    p.add_argument("--hot-rep-ms", type=float, default=20.0,
                   help="triton.testing.do_bench_cudagraph window of the hot (no L2 flush) timing")
    p.add_argument("--shrunk", action="store_true",
                   help="interpreter-sized shapes (model_shapes.shrunk): a plumbing run, e.g. --device cpu")
    args = p.parse_args(argv)
    if args.tokens is None:
        args.tokens = QUICK_TOKENS if args.quick else ALL_TOKENS
    else:
        args.tokens = tuple(int(t) for t in args.tokens.split(","))
    on_cpu = args.device == "cpu"
    if args.ceiling_mib is None:
        args.ceiling_mib = 1 if on_cpu else 4096
    if args.matmul_size is None:
        args.matmul_size = 64 if on_cpu else 8192
    if args.warmup_ms is None:
        args.warmup_ms = 5.0 if args.quick else 10.0
    if args.rep_ms is None:
        args.rep_ms = 40.0 if args.quick else 60.0
    args.paths = tuple(s for s in args.paths.split(",") if s)
    args.baselines = () if args.no_baselines else tuple(s for s in args.baselines.split(",") if s)
    for name in args.paths:
        if name not in PATHS:
            p.error(f"unknown path {name!r}; choose from {PATHS}")
    for name in args.baselines:
        if name not in BASELINES:
            p.error(f"unknown baseline {name!r}; choose from {BASELINES}")
    args.fp16_spot = () if args.fp16_spot in ("", "none") else tuple(args.fp16_spot.split(","))
    args.fp16_spot_tokens = tuple(int(t) for t in args.fp16_spot_tokens.split(",") if t)
    args.skewed_tokens = () if args.skewed_tokens in ("", "none") else tuple(
        int(t) for t in args.skewed_tokens.split(","))
    return args


def accounting(shape, num_tokens, experts_hit, itemsize, path, ceilings):
    """Bytes, FLOPs, floor and target of one cell (seconds)."""
    H, F, E, k = shape.hidden, shape.ffn, shape.num_experts, shape.top_k
    nbytes = experts_hit * 3 * H * F * itemsize + 2 * num_tokens * H * itemsize
    flops = 2 * num_tokens * k * 3 * H * F
    allowance = LAUNCH_ALLOWANCE_S
    if path == "fused_moe_forward":  # the router GEMM reads its weight and does [T,H]x[H,E]
        nbytes += E * H * itemsize
        flops += 2 * num_tokens * H * E
        allowance += ROUTING_ALLOWANCE_S
    R = ceilings["read_bytes_per_s"]
    P = ceilings["matmul_flops_per_s"]
    floor = max(nbytes / R, flops / P)
    target = max(READ_SLACK * nbytes / R, flops / (shape.matmul_fraction * P)) + allowance
    return {
        "bytes": nbytes,
        "flops": flops,
        "floor_us": floor * 1e6,
        "bound": "bandwidth" if nbytes / R >= flops / P else "matmul",
        "target_us": target * 1e6,
    }


class Runner:
    """Times one implementation at one cell and fills the record (plain, graph, correctness)."""

    def __init__(self, args, timer, device, ceilings):
        self.args = args
        self.timer = timer
        self.device = device
        self.ceilings = ceilings

    def run(self, record, fn, *, graph, check, inspect=None, hot=True, kernels=False):
        """fn() -> output; check(output) -> correctness fields (skipped by --no-check); inspect(output) -> fields
        always wanted (experts hit by the routing). Fills record in place: plain_us, graph_us (when `graph`),
        hot_us (when `hot`; see EventTimer), the GPU's state after the plain and hot windows (`gpu_state`), and with
        `kernels` kernel_us, the sum of the call's kernel times (`kernel_times`), and host_us, the host's time per
        call (`host_time`)."""
        try:
            output = fn()  # compiles on first use; its result is what gets checked
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            if inspect is not None:
                record.update(inspect(output))
            if check is not None and not self.args.no_check:
                record.update(check(output))
            del output
            record["plain_us"] = self.timer.plain(fn) * 1e3
            record["state_plain"] = harness.gpu_state(self.device)
        except Exception as exc:
            record["error"] = harness.error_text(exc)
            harness.free_memory(self.device)
            return
        if graph and self.device.type == "cuda" and hasattr(self.timer, "graph"):
            try:
                record["graph_us"] = self.timer.graph(fn) * 1e3
            except Exception as exc:
                record["graph_error"] = harness.error_text(exc)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
            harness.free_memory(self.device)
        if hot and self.device.type == "cuda" and hasattr(self.timer, "hot"):
            try:
                record["hot_us"] = self.timer.hot(fn) * 1e3
                record["state_hot"] = harness.gpu_state(self.device)
            except Exception as exc:
                record["hot_error"] = harness.error_text(exc)
                torch.cuda.synchronize()
            harness.free_memory(self.device)
        if kernels and self.device.type == "cuda":
            try:
                record["kernel_us"] = sum(harness.kernel_times(fn).values())
                record["host_us"] = harness.host_time(fn)
            except Exception as exc:  # noqa: BLE001 (a profiler that cannot run leaves the column empty)
                record["kernel_error"] = harness.error_text(exc)
                torch.cuda.synchronize()
            harness.free_memory(self.device)


def finish_record(record, acct, ceilings):
    """Derived numbers: the time that is judged (graph replay when measured), rates, ratio to floor, target."""
    record.update(acct)
    time_us = record.get("graph_us") or record.get("plain_us")
    if time_us is None:
        return record
    record["time_us"] = time_us
    record["time_mode"] = "graph" if record.get("graph_us") else "plain"
    record["tb_per_s"] = acct["bytes"] / (time_us * 1e-6) / 1e12
    record["tflop_per_s"] = acct["flops"] / (time_us * 1e-6) / 1e12
    record["time_over_floor"] = time_us / acct["floor_us"]
    record["meets_target"] = time_us <= acct["target_us"]
    return record


def bench_model(shape, args, runner, kernel, vllm_fn, dtype, tokens, baselines, started):
    device = runner.device
    records = []
    itemsize = torch.empty((), dtype=dtype).element_size()
    prob = harness.make_problem(shape, max(tokens), dtype, device, args.seed)
    for num_tokens in tokens:
        if args.deadline_s is not None and time.monotonic() - started > args.deadline_s:
            records.append({"model": shape.name, "tokens": num_tokens, "dtype": str(dtype).replace("torch.", ""),
                            "skipped": "deadline"})
            continue
        records.extend(bench_cell(prob, num_tokens, args, runner, kernel, vllm_fn, itemsize, baselines))
        if num_tokens in args.skewed_tokens:
            records.extend(bench_cell(prob, num_tokens, args, runner, kernel, vllm_fn, itemsize, baselines,
                                      routing="skewed"))
    del prob
    harness.free_memory(device)
    return records


def bench_cell(prob, num_tokens, args, runner, kernel, vllm_fn, itemsize, baselines, routing="balanced"):
    """Every implementation at one (model, T). routing "skewed" (see `skewed_routing`) times fused_experts only
    (ours and grouped_mm); its records carry routing = "skewed"."""
    shape, dtype, device = prob.shape, prob.dtype, runner.device
    seed = args.seed * 1000003 + num_tokens
    x = prob.x[:num_tokens]
    topk_ids, topk_weights = harness.ROUTINGS[routing](num_tokens, shape.num_experts, shape.top_k, device, seed)
    if routing != "balanced":
        args = argparse.Namespace(**{**vars(args), "paths": ("fused_experts",)})
        baselines = tuple(b for b in baselines if b == "grouped_mm")
    rows = harness.check_rows(num_tokens, args.check_rows, device, seed)
    hit_given = int(torch.unique(topk_ids).numel())
    graph = num_tokens <= args.graph_max_tokens
    dtype_name = str(dtype).replace("torch.", "")
    out = []

    def new(path, impl):
        return {"model": shape.name, "tokens": num_tokens, "path": path, "impl": impl, "dtype": dtype_name,
                "routing": routing}

    given_ref = []  # the float64 reference of the given routing, shared by every fused_experts implementation

    def experts_check(output):
        if not given_ref:
            given_ref.append(reference.fused_experts_ref(x[rows], prob.w_gate_up, prob.w_down, topk_ids[rows],
                                                        topk_weights[rows]))
        err = reference.relative_error(output[rows], given_ref[0])
        return {"rel_err": err, "ok": err <= TOLERANCE[dtype]}

    def forward_check(output):
        result, ids, weights = output
        err = harness.check_output(prob, rows, result, ids, weights)
        match, weight_err = harness.check_routing(prob, rows, num_tokens, ids, weights)
        ok = err <= TOLERANCE[dtype] and match >= ROUTING_AGREEMENT_MIN
        ok = ok and (not weight_err == weight_err or weight_err <= TOLERANCE[dtype])  # nan: no token matched
        return {"rel_err": err, "routing_match": match, "routing_weight_err": weight_err, "ok": bool(ok)}

    def forward_hits(output):
        return {"experts_hit": int(torch.unique(output[1]).numel())}

    routing_kwargs = shape.routing_kwargs()
    forward_tensors = {"router_bias": prob.router_bias, "e_score_correction_bias": prob.correction_bias}

    if "fused_experts" in args.paths:
        rec = new("fused_experts", "moe_dispatch")
        runner.run(rec, lambda: kernel.fused_experts(x, prob.w_gate_up, prob.w_down, topk_ids, topk_weights),
                   graph=graph, check=experts_check, kernels=routing == "balanced")
        out.append(finish_record(rec, accounting(shape, num_tokens, hit_given, itemsize, rec["path"],
                                                 runner.ceilings), runner.ceilings))
        rec["experts_hit"] = hit_given

    if "fused_moe_forward" in args.paths:
        rec = new("fused_moe_forward", "moe_dispatch")

        def forward():
            return kernel.fused_moe_forward(
                x, prob.router_weight, prob.w_gate, prob.w_up, prob.w_down, shape.num_experts, shape.top_k,
                shape.gating, **forward_tensors, **routing_kwargs,
            )

        runner.run(rec, forward, graph=graph, check=forward_check, inspect=forward_hits)
        hit = rec.get("experts_hit", hit_given)
        out.append(finish_record(rec, accounting(shape, num_tokens, hit, itemsize, rec["path"], runner.ceilings),
                                 runner.ceilings))
        rec["experts_hit"] = hit

    bf16 = dtype == torch.bfloat16
    if "grouped_mm" in baselines and "fused_experts" in args.paths:
        rec = new("fused_experts", "grouped_mm")
        if bf16:
            runner.run(rec, lambda: harness.grouped_mm_experts(x, prob.w_gate_up, prob.w_down, topk_ids, topk_weights),
                       graph=graph, check=experts_check)
        else:
            rec["error"] = "n/a: torch._grouped_mm takes bf16 only"
        out.append(finish_record(rec, accounting(shape, num_tokens, hit_given, itemsize, rec["path"],
                                                 runner.ceilings), runner.ceilings))
    if "grouped_mm" in baselines and "fused_moe_forward" in args.paths:
        rec = new("fused_moe_forward", "grouped_mm")

        def forward_baseline():
            ids, weights = harness.torch_route(shape, x, prob.router_weight, prob.router_bias, prob.correction_bias)
            return harness.grouped_mm_experts(x, prob.w_gate_up, prob.w_down, ids, weights), ids, weights

        if bf16:
            runner.run(rec, forward_baseline, graph=graph, check=forward_check, inspect=forward_hits)
        else:
            rec["error"] = "n/a: torch._grouped_mm takes bf16 only"
        hit = rec.get("experts_hit", hit_given)
        out.append(finish_record(rec, accounting(shape, num_tokens, hit, itemsize, rec["path"], runner.ceilings),
                                 runner.ceilings))
    if "vllm" in baselines and "fused_experts" in args.paths:
        rec = new("fused_experts", "vllm")
        if vllm_fn is None:
            rec["error"] = "n/a: vllm not importable"
        else:
            runner.run(rec, lambda: vllm_fn(x, prob.w_gate_up, prob.w_down, topk_weights, topk_ids.to(torch.int32)),
                       graph=graph, check=experts_check)
        out.append(finish_record(rec, accounting(shape, num_tokens, hit_given, itemsize, rec["path"],
                                                 runner.ceilings), runner.ceilings))
    if "eager" in baselines and "fused_experts" in args.paths and num_tokens <= args.eager_max_tokens:
        rec = new("fused_experts", "eager")
        runner.run(rec, lambda: harness.eager_experts(x, prob.w_gate_up, prob.w_down, topk_ids, topk_weights),
                   graph=False, hot=False, check=experts_check)
        out.append(finish_record(rec, accounting(shape, num_tokens, hit_given, itemsize, rec["path"],
                                                 runner.ceilings), runner.ceilings))

    # ours against grouped_mm, like for like (graph against graph when both were captured)
    by_key = {(r["path"], r["impl"]): r for r in out}
    for path in PATHS:
        ours, base = by_key.get((path, "moe_dispatch")), by_key.get((path, "grouped_mm"))
        if not ours or not base:
            continue
        for mode in ("graph_us", "plain_us"):
            if ours.get(mode) and base.get(mode):
                ours["vs_grouped_mm"] = base[mode] / ours[mode]
                ours["vs_grouped_mm_mode"] = mode[:-3]
                ours["faster_than_grouped_mm"] = ours[mode] < base[mode]
                break
    return out


def _find(cells, model, tokens, path, impl, dtype, routing="balanced"):
    for c in cells:
        if ((c["model"], c["tokens"], c.get("path"), c.get("impl"), c["dtype"], c.get("routing", "balanced"))
                == (model, tokens, path, impl, dtype, routing)):
            return c
    return None


def write_markdown(results, path):
    meta, ceil = results["meta"], results["ceilings"]
    lines = [
        "# moe-dispatch benchmark",
        "",
        f"{meta['device']} · torch {meta['torch']} · triton {meta['triton']} · {meta['date']} · "
        f"package {meta['package']}",
        "",
        "## Ceilings (measured in this run)",
        "",
        "| read R (Triton stream) | torch.sum read | D2D copy (r+w) | bf16 matmul P |",
        "| --- | --- | --- | --- |",
        f"| {ceil['read_bytes_per_s'] / 1e12:.2f} TB/s | {ceil['torch_sum_bytes_per_s'] / 1e12:.2f} TB/s | "
        f"{ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s | {ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s |",
        "",
        "Times in us (median). *time* is the CUDA-graph replay where captured, else the plain launch. floor = "
        "max(bytes/R, flops/P); target = max(1.15 bytes/R, flops/(f P)) + allowances. *vs gmm* = grouped_mm time / "
        "ours, like for like.",
    ]
    cells = results["cells"]
    models = list(dict.fromkeys(c["model"] for c in cells))
    lines += ["", "## Summary: both paths per model and T, time over the floor, target met, speedup over grouped_mm",
              ""] + summary_table(results)
    lines += ["", "## fused_experts: hot, flushed, kernel and host times (medians)", ""] + hot_table(results)
    header = ("| T | path | dtype | hit | plain | graph | hot | floor | target | time/floor | TB/s | TFLOP/s | "
              "grouped_mm | vs gmm | vLLM | eager | rel err | target met |")
    for model in models:
        shape = results["shapes"][model]
        lines += ["", f"## {model} (E={shape['num_experts']}, top_k={shape['top_k']}, H={shape['hidden']}, "
                      f"F={shape['ffn']})", "", header, "|" + " --- |" * (header.count("|") - 1)]
        for c in cells:
            if c["model"] != model or c.get("impl") != "moe_dispatch":
                if c["model"] == model and c.get("skipped"):
                    lines.append(f"| {c['tokens']} | skipped ({c['skipped']}) |" + " |" * 15)
                continue
            routing = c.get("routing", "balanced")
            gmm = _find(cells, model, c["tokens"], c["path"], "grouped_mm", c["dtype"], routing) or {}
            vllm = _find(cells, model, c["tokens"], c["path"], "vllm", c["dtype"], routing) or {}
            eager = _find(cells, model, c["tokens"], c["path"], "eager", c["dtype"], routing) or {}
            met = _met(c, "yes", "**MISS**")
            if c.get("error"):
                met = f"error: {c['error'][:80]}"
            lines.append(
                f"| {c['tokens']} | {c['path']}{'' if routing == 'balanced' else f' ({routing})'} | {c['dtype']} | "
                f"{c.get('experts_hit', '-')} | {fmt(c.get('plain_us'))} | {fmt(c.get('graph_us'))} | "
                f"{fmt(c.get('hot_us'))} | {fmt(c.get('floor_us'))} | "
                f"{fmt(c.get('target_us'))} | {fmt(c.get('time_over_floor'), '.2f')} | "
                f"{fmt(c.get('tb_per_s'), '.2f')} | {fmt(c.get('tflop_per_s'), '.0f')} | "
                f"{fmt(gmm.get('time_us'))} | {fmt(c.get('vs_grouped_mm'), '.2f')} | "
                f"{fmt(vllm.get('time_us'))} | {fmt(eager.get('time_us'))} | {fmt(c.get('rel_err'), '.1e')} | "
                f"{met} |"
            )
    Path(path).write_text("\n".join(lines) + "\n")


def _met(cell, yes, no):
    """'yes', or the miss with how far over the target the time is."""
    met = cell.get("meets_target")
    if met is None:
        return "-"
    return yes if met else f"{no} (+{(cell['time_us'] / cell['target_us'] - 1) * 100:.0f}%)"


def summary_table(results):
    """One row per model and T (the run's main dtype): both paths' time, time/floor, target, speedup over grouped_mm."""
    cells, dtype = results["cells"], results["meta"]["dtype"]
    lines = ["| model | T | fused_experts | x floor | target met | vs gmm | fused_moe_forward | x floor | target met | "
             "vs gmm |", "|" + " --- |" * 10]
    for model, tokens in dict.fromkeys((c["model"], c["tokens"]) for c in cells if c["dtype"] == dtype):
        row = [model, str(tokens)]
        for path in PATHS:
            c = _find(cells, model, tokens, path, "moe_dispatch", dtype) or {}
            met = _met(c, "yes", "**no**")
            row += [fmt(c.get("time_us")), fmt(c.get("time_over_floor"), ".2f"), met,
                    fmt(c.get("vs_grouped_mm"), ".2f")]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def hot_table(results):
    """fused_experts per model and T, every timing side by side: hot (CUDA-graph replays of repeated calls, no L2
    flush: the method of vLLM's published MoE figures), the L2-flushed judged time (CUDA-graph replays where captured,
    T <= --graph-max-tokens, else plain launches), the sum of the kernels' GPU times (no launch gaps, a lightly loaded
    GPU's clock), the host's time per eager call (above the kernels' time: plain launches are host-bound), the skewed
    routing's hot times and the SM clock after the hot and flushed windows."""
    cells, dtype = results["cells"], results["meta"]["dtype"]
    lines = ["| model | T | hot | flushed | kernels | host | skewed hot | skewed gmm hot | SM MHz hot / flushed |",
             "|" + " --- |" * 9]
    for model, tokens in dict.fromkeys((c["model"], c["tokens"]) for c in cells if c["dtype"] == dtype):
        c = _find(cells, model, tokens, "fused_experts", "moe_dispatch", dtype) or {}
        skew = _find(cells, model, tokens, "fused_experts", "moe_dispatch", dtype, "skewed") or {}
        skew_gmm = _find(cells, model, tokens, "fused_experts", "grouped_mm", dtype, "skewed") or {}
        lines.append(f"| {model} | {tokens} | {fmt(c.get('hot_us'))} | {fmt(c.get('time_us'))} "
                     f"{c.get('time_mode', '')} | {fmt(c.get('kernel_us'))} | {fmt(c.get('host_us'))} | "
                     f"{fmt(skew.get('hot_us'))} | {fmt(skew_gmm.get('hot_us'))} | "
                     f"{c.get('state_hot', {}).get('sm_mhz', '-')} / {c.get('state_plain', {}).get('sm_mhz', '-')} |")
    return lines


def plot_roofline(results, path):
    """Achieved TFLOP/s against arithmetic intensity, under min(P, R * intensity); one series per model."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # not pinned in requirements.txt: say so rather than skip the picture silently
        print(f"warning: {path} not written: matplotlib does not import ({e}); `pip install matplotlib` for the "
              "roofline plot (bench.json and bench.md are complete without it)", file=sys.stderr)
        return False
    ceil = results["ceilings"]
    R, P = ceil["read_bytes_per_s"], ceil["matmul_flops_per_s"]
    cells = [c for c in results["cells"] if c.get("tflop_per_s") and c["dtype"] == results["meta"]["dtype"]]
    if not cells:
        return False
    fig, ax = plt.subplots(figsize=(9, 6))
    intensities = [c["flops"] / c["bytes"] for c in cells]
    lo, hi = min(intensities) / 2, max(max(intensities) * 2, 2 * P / R)
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(xs, [min(P, R * x) / 1e12 for x in xs], color="black", lw=1.5,
            label=f"min(P, R·I): P={P / 1e12:.0f} TFLOP/s, R={R / 1e12:.2f} TB/s")
    markers = "osD^v<>ph*"
    for i, model in enumerate(dict.fromkeys(c["model"] for c in cells)):
        for impl, filled in (("moe_dispatch", True), ("grouped_mm", False)):
            sel = [c for c in cells if c["model"] == model and c["impl"] == impl and c["path"] == "fused_experts"]
            if not sel:
                continue
            ax.scatter([c["flops"] / c["bytes"] for c in sel], [c["tflop_per_s"] for c in sel],
                       marker=markers[i % len(markers)], s=36, color=f"C{i}" if filled else "none",
                       edgecolors=f"C{i}", label=model if filled else None, zorder=3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte of weights hit + activations)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(f"moe_dispatch fused_experts, {results['meta']['dtype']}, {results['meta']['device']} "
                 "(filled: moe_dispatch, hollow: grouped_mm)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _ceilings_line(results):
    ceil = results["ceilings"]
    return (f"R {ceil['read_bytes_per_s'] / 1e12:.2f} TB/s (torch.sum {ceil['torch_sum_bytes_per_s'] / 1e12:.2f}) · "
            f"copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s · P {ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")


def short_table(results):
    """A few lines per model: fused_experts and fused_moe_forward time, ratio to floor, target, grouped_mm."""
    lines = [
        f"{_ceilings_line(results)} · {results['meta']['device']}",
        f"{'model':<15}{'T':>6} {'fe_us':>9} {'/flr':>5} {'tgt':>4} {'xgmm':>5} {'fwd_us':>9} {'/flr':>5} {'tgt':>4} "
        f"{'xgmm':>5} {'err':>7} {'fe_hot':>8}",
    ]
    cells, dtype = results["cells"], results["meta"]["dtype"]
    seen = list(dict.fromkeys((c["model"], c["tokens"]) for c in cells if c["dtype"] == dtype))
    misses = errors = 0
    for model, tokens in seen:
        parts = [f"{model[:15]:<15}{tokens:>6}"]
        worst_err = None
        for path in PATHS:
            c = _find(cells, model, tokens, path, "moe_dispatch", dtype)
            if c is None or c.get("time_us") is None:
                text = "skip" if c is None else "ERR"
                errors += c is not None
                parts.append(f"{text:>9} {'':>5} {'':>4} {'':>5}")
                continue
            met = c.get("meets_target")
            misses += met is False
            fast = c.get("faster_than_grouped_mm")
            parts.append(f"{c['time_us']:>9.1f} {c['time_over_floor']:>5.2f} {'ok' if met else 'MISS':>4} "
                         f"{fmt(c.get('vs_grouped_mm'), '.2f') + ('' if fast in (None, True) else '!'):>5}")
            if c.get("rel_err") is not None:
                worst_err = c["rel_err"] if worst_err is None else max(worst_err, c["rel_err"])
                if not c.get("ok", True):
                    errors += 1
        parts.append(f"{fmt(worst_err, '.1e'):>7}")
        hot = (_find(cells, model, tokens, "fused_experts", "moe_dispatch", dtype) or {}).get("hot_us")
        parts.append(f"{fmt(hot):>8}")
        lines.append(" ".join(parts))
    lines.append(f"cells missing target: {misses}; cells with errors or failed checks: {errors}; "
                 "xgmm = grouped_mm time / ours ('!' = not faster); fe_hot = fused_experts hot (graph of repeated calls, "
                 "no L2 flush)")
    return "\n".join(lines)


def write_outputs(results, out_dir):
    harness.write_results(results, out_dir, "bench", write_markdown)
    results["meta"]["roofline_png"] = plot_roofline(results, out_dir / "roofline.png")
    summary = short_table(results)
    (out_dir / "summary.txt").write_text(summary + "\n")
    return summary


def main(argv=None, *, timer=None, kernel=None, shapes=None):
    """Run the benchmark; returns the results dict. timer/kernel/shapes let the smoke test stand in stubs."""
    started = time.monotonic()
    args = parse_args(argv)
    device = harness.benchmark_device(args.device)
    torch.manual_seed(args.seed)
    kernel = kernel if kernel is not None else harness.load_kernel(args.kernel_dir)
    timer = timer if timer is not None else harness.make_timer(args, device)
    models = harness.select_models(args.models, shapes if shapes is not None else harness.default_shapes(args.shrunk))
    dtype = DTYPES[args.dtype]
    import triton

    results = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "sms": torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
            "package": f"{getattr(kernel, '__name__', '?')} {getattr(kernel, '__version__', '?')}",
            "package_file": harness.portable_path(getattr(kernel, "__file__", None)),
            "commit": harness.git_commit(),
            "dtype": str(dtype).replace("torch.", ""),
            "argv": [harness.portable_path(a) for a in (sys.argv[1:] if argv is None else argv)],
            "tolerance": {str(k).replace("torch.", ""): v for k, v in TOLERANCE.items()},
            "targets": {"read_slack": READ_SLACK, "launch_allowance_us": LAUNCH_ALLOWANCE_S * 1e6,
                        "routing_allowance_us": ROUTING_ALLOWANCE_S * 1e6},
        },
        "shapes": {s.name: dataclasses.asdict(s) for s in models},
        "ceilings": harness.measure_ceilings(timer, device, nbytes=args.ceiling_mib << 20,
                                             matmul_size=args.matmul_size),
        "cells": [],
    }
    vllm_fn = None
    if "vllm" in args.baselines:
        vllm_fn, why = harness.load_vllm_fused_experts() if device.type == "cuda" else (None, "not on cuda")
        results["meta"]["vllm"] = why or "imported"
    print(f"ceilings: {_ceilings_line(results)} ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    out_dir = Path(args.out)
    runner = Runner(args, timer, device, results["ceilings"])
    for shape in models:
        results["cells"].extend(
            bench_model(shape, args, runner, kernel, vllm_fn, dtype, args.tokens, args.baselines, started))
        if shape.name in args.fp16_spot and dtype != torch.float16 and args.fp16_spot_tokens:
            results["cells"].extend(bench_model(shape, args, runner, kernel, vllm_fn, torch.float16,
                                                args.fp16_spot_tokens, (), started))
        results["meta"]["elapsed_s"] = time.monotonic() - started
        write_outputs(results, out_dir)
        print(f"{shape.name}: done at {results['meta']['elapsed_s']:.0f} s", file=sys.stderr, flush=True)
    results["meta"]["elapsed_s"] = time.monotonic() - started
    summary = write_outputs(results, out_dir)
    print(summary, flush=True)
    return results


if __name__ == "__main__":
    main()
