#!/usr/bin/env python3
"""FP8 experts benchmark: moe_dispatch's FP8 path beside its bf16 path, transformers' FP8 experts and the
FP8 ceilings, all measured in one run.

Per model (benchmarks/model_shapes.py) and token count T (random routing, k distinct experts per token, fp32
routing weights), `fused_experts` on one layer's routed experts:

  fp8     moe_dispatch on float8_e4m3fn weights with 128 x 128 block scales (DeepSeek-V3's format), fp8_compute
          "auto" by default: the w8a8 path on FP8 tensor cores (SM89+), else the dequant path
  bf16    moe_dispatch on the bf16 weights the fp8 ones were quantized from
  hf_fp8  transformers' FP8Experts `grouped_mm` implementation (finegrained_fp8.fp8_grouped_mm_experts_forward) on the
          same fp8 weights and scales, when its kernel loads: it comes from the Hub (kernels-community/finegrained-fp8
          through `kernels`); this script runs with HF_HUB_OFFLINE=1 unless --allow-download, so an offline machine
          needs that kernel in the HF cache or mapped with LOCAL_KERNELS=kernels-community/finegrained-fp8=<dir>

Timings, median, each in ms -> us: `plain` triton.testing.do_bench (the L2 cache flushed before every call, launches
from Python); `graph` triton.testing.do_bench_cudagraph (a CUDA graph of repeated calls, no flush: weights that fit
the 50 MB L2 stay there); decode cells (T <= 16) also `graph_flushed` (replays of a one-call CUDA graph with the L2
flushed before each: launch overhead gone, weights read from HBM, what a served decode step sees).

Correctness per cell, on a row sample (all rows up to --check-rows tokens, that many random rows above): RMS relative
error against the float64 experts on the dequantized fp8 weights (fp8, hf_fp8: reference.W8A8_TOLERANCE when the
path quantizes activations, the bf16 tolerance on the dequant path) or on the bf16 weights (bf16: the bf16
tolerance).

Targets, marked per cell:
  decode, T <= 16    fp8 time (graph_flushed) <= 1.15 x (fp8 weight bytes + scale bytes of the experts hit) / R + 10 us
  prefill, T >= 4096 fp8 throughput >= 1.5 x bf16 throughput of the same cell (plain times)
  every cell         fp8 faster than hf_fp8 (same timing mode), when hf_fp8 ran
Ceilings measured at the start: R (read bandwidth, harness.measure_read_bandwidth), P_bf16 (torch.matmul, n^3), P_fp8
(torch._scaled_mm on e4m3 operands, n^3, rowwise and tensorwise scales).

Writes OUT/bench_fp8.json and OUT/bench_fp8.md after every model (a run cut short keeps what it measured) and prints the
short table last. --deadline-s stops starting new cells (skipped cells are listed).

    scripts/bench_fp8 --out results/fp8                      # all six models, T = 1, 4, 16, 128, 1024, 4096, 16384
    scripts/bench_fp8 --models mixtral-8x7b,deepseek-v3 --tokens 1,4096 --out fp8-out
    scripts/bench_fp8 --cpu-smoke --out fp8-smoke             # the plumbing on the CPU (interpreter, shrunk shapes)
"""

import argparse
import dataclasses
import datetime
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

import harness  # first (scripts/harness.py): without a GPU it turns on Triton's interpreter before triton imports
from harness import fmt, fp8_reference, make_fp8_problem, measure_matmul_rate, measure_read_bandwidth
from model_shapes import MODEL_SHAPES, shrunk
from moe_dispatch import reference
from moe_dispatch.reference import TOLERANCE, W8A8_TOLERANCE

TOKENS = (1, 4, 16, 128, 1024, 4096, 16384)
SMOKE_TOKENS = (1, 4, 40)
# the three models the FP8 targets were set on first, so a run cut by the deadline keeps them
MODEL_ORDER = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b", "qwen2-57b-a14b", "mixtral-8x22b")
IMPLS = ("fp8", "bf16", "hf_fp8")
BLOCK = harness.FP8_BLOCK
DTYPE = torch.bfloat16
DECODE_MAX_T = 16
PREFILL_MIN_T = 4096
READ_SLACK = 1.15
LAUNCH_ALLOWANCE_US = 10.0
PREFILL_SPEEDUP = 1.5


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="bench-fp8-results", help="output folder (created)")
    p.add_argument("--models", default=",".join(MODEL_ORDER), help="comma list (default: all six, in this order)")
    p.add_argument("--tokens", default=None, help=f"comma list (default {','.join(map(str, TOKENS))})")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {', '.join(IMPLS)}")
    p.add_argument("--fp8-compute", default="auto", choices=("auto", "w8a8", "dequant"))
    p.add_argument("--warmup-ms", type=float, default=3.0)
    p.add_argument("--rep-ms", type=float, default=10.0, help="timing window of do_bench and do_bench_cudagraph")
    p.add_argument("--check-rows", type=int, default=64)
    p.add_argument("--deadline-s", type=float, default=170.0, help="start no new cell after this (0: no deadline)")
    p.add_argument("--ceiling-mib", type=int, default=None, help="read-bandwidth buffer (default 4096; 1 on the CPU)")
    p.add_argument("--matmul-size", type=int, default=None, help="n of the n^3 ceilings (default 8192; 64 on the CPU)")
    p.add_argument("--allow-download", action="store_true",
                   help="let transformers fetch its FP8 kernel from the Hub (default: HF_HUB_OFFLINE=1)")
    p.add_argument("--kernel-dir", default=None, help="load moe_dispatch from a build variant (see scripts/bench)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="plumbing run: CPU, interpreter, shrunk shapes, T = 1,4,40, fp8_compute w8a8, wall-clock timer")
    args = p.parse_args(argv)
    args.device = "cpu" if args.cpu_smoke else "cuda"
    if args.tokens is None:
        args.tokens = SMOKE_TOKENS if args.cpu_smoke else TOKENS
    else:
        args.tokens = tuple(int(t) for t in args.tokens.split(","))
    if args.cpu_smoke and args.fp8_compute == "auto":
        args.fp8_compute = "w8a8"  # the interpreter runs it when asked; "auto" would pick dequant on the CPU
    args.impls = harness.comma_choices(p, "--impls", args.impls, IMPLS)
    args.models = harness.comma_choices(p, "--models", args.models, MODEL_SHAPES)
    on_cpu = args.device == "cpu"
    args.ceiling_mib = args.ceiling_mib or (1 if on_cpu else 4096)
    args.matmul_size = args.matmul_size or (64 if on_cpu else 8192)
    return args


# --------------------------------------------------------------------------------------------------------------------
# timing


class Timer:
    """plain / graph / graph_flushed medians in ms (see the module doc); the CPU stand-in times plain calls only."""

    def __init__(self, warmup_ms, rep_ms, device):
        self.warmup_ms, self.rep_ms, self.cuda = warmup_ms, rep_ms, device.type == "cuda"
        self.wall = None if self.cuda else harness.WallTimer()

    def plain(self, fn):
        if not self.cuda:
            return self.wall.plain(fn)
        from triton.testing import do_bench

        return do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median")

    def graph(self, fn):
        from triton.testing import do_bench_cudagraph

        return do_bench_cudagraph(fn, rep=self.rep_ms, return_mode="median")

    def graph_flushed(self, fn):
        return harness.EventTimer(self.warmup_ms, self.rep_ms).graph(fn)


def measure(record, timer, fn, *, check, graph_flushed):
    """Fills record: correctness (check(output) -> fields), then plain, graph and optionally graph_flushed times."""
    try:
        output = fn()  # compiles on first use
        if timer.cuda:
            torch.cuda.synchronize()
        record.update(check(output))
        del output
        record["plain_us"] = timer.plain(fn) * 1e3
    except Exception as exc:
        record["error"] = harness.error_text(exc)
        return
    if not timer.cuda:
        return
    modes = (("graph_us", timer.graph),) + ((("graph_flushed_us", timer.graph_flushed),) if graph_flushed else ())
    for key, method in modes:
        try:
            record[key] = method(fn) * 1e3
        except Exception as exc:
            record[key.replace("_us", "_error")] = harness.error_text(exc)
            torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------------------------------
# ceilings


def measure_fp8_matmul(timer, device, size):
    """torch._scaled_mm FLOP/s on e4m3 [n, n] x [n, n] (B column-major), bf16 out, rowwise and tensorwise scales."""
    if device.type != "cuda":
        return {"fp8_matmul_error": "needs a CUDA device"}
    out = {"fp8_matmul_size": size}
    a = torch.randn(size, size, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device=device).to(torch.float8_e4m3fn).t()
    scales = {"rowwise": (torch.ones(size, 1, device=device), torch.ones(1, size, device=device)),
              "tensorwise": (torch.ones((), device=device), torch.ones((), device=device))}
    for name, (scale_a, scale_b) in scales.items():
        try:
            ms = timer.plain(lambda: torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=DTYPE))
            out[f"fp8_matmul_{name}_flops_per_s"] = 2 * size**3 / (ms * 1e-3)
        except Exception as exc:
            out[f"fp8_matmul_{name}_error"] = harness.error_text(exc)
    return out


def measure_all_ceilings(timer, device, args):
    out = measure_read_bandwidth(timer, device, args.ceiling_mib << 20)
    out.update(measure_matmul_rate(timer, device, args.matmul_size))
    out.update(measure_fp8_matmul(timer, device, args.matmul_size))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------------------------------------------------
# transformers' FP8 experts


def load_transformers_fp8(device):
    """(the grouped_mm experts function, None) or (None, why it cannot run)."""
    if device.type != "cuda":
        return None, "needs a CUDA device (the finegrained-fp8 kernel is GPU-only)"
    try:
        from transformers.integrations import finegrained_fp8

        finegrained_fp8.load_finegrained_fp8_kernel()
    except Exception as exc:
        return None, (f"{harness.error_text(exc)} (offline: HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE')}; stage "
                      "kernels-community/finegrained-fp8 in the HF cache or map it with LOCAL_KERNELS)")
    return finegrained_fp8, None


def transformers_experts(finegrained, q_gate_up, q_down, scales):
    """An object with what `fp8_grouped_mm_experts_forward` reads from an FP8Experts module."""

    class Experts:
        gate_up_proj, down_proj = q_gate_up, q_down
        gate_up_proj_scale_inv, down_proj_scale_inv = scales["w_gate_up_scale"], scales["w_down_scale"]
        block_size, activation_scheme, has_gate, has_bias = list(BLOCK), "dynamic", True, False
        num_experts, _is_expert_parallel = q_gate_up.shape[0], False
        act_fn = torch.nn.SiLU()
        swiglu_alpha = swiglu_limit = limit = None
        _apply_gate = finegrained.FP8Experts._apply_gate

    experts = Experts()
    return lambda x, ids, weights: finegrained.fp8_grouped_mm_experts_forward(experts, x, ids, weights)


# --------------------------------------------------------------------------------------------------------------------
# one model


def fp8_weight_bytes(shape, experts_hit):
    """FP8 weight bytes + fp32 block-scale bytes of the experts hit (what a decode step must read)."""
    H, F = shape.hidden, shape.ffn
    blocks = math.ceil(2 * F / BLOCK[0]) * math.ceil(H / BLOCK[1]) + math.ceil(H / BLOCK[0]) * math.ceil(F / BLOCK[1])
    return experts_hit * (3 * H * F + 4 * blocks)


def judged_time(record, modes):
    for mode in modes:
        if record.get(mode):
            return record[mode], mode[:-3]
    return None, None


def bench_cell(prob, T, args, timer, kernel, hf_forward, ceilings):
    shape, device = prob.shape, prob.x.device
    seed = args.seed * 1000003 + T
    x = prob.x[:T]
    ids, weights = harness.random_routing(T, shape.num_experts, shape.top_k, device, seed)
    rows = harness.check_rows(T, args.check_rows, device, seed)
    hit = int(torch.unique(ids).numel())
    decode = T <= DECODE_MAX_T
    records = {}
    refs = {}

    def ref(kind):
        if kind not in refs:
            if kind == "bf16":
                refs[kind] = reference.fused_experts_ref(x[rows], prob.w_gate_up, prob.w_down, ids[rows], weights[rows])
            else:
                refs[kind] = fp8_reference(prob, x, ids, weights, rows)
        return refs[kind]

    def checker(kind, tolerance):
        def check(output):
            err = reference.relative_error(output[rows], ref(kind))
            return {"rel_err": err, "ok": err <= tolerance}
        return check

    fp8_tolerance = TOLERANCE[DTYPE] if args.fp8_compute == "dequant" else W8A8_TOLERANCE
    runs = {
        "fp8": (lambda: kernel.fused_experts(x, prob.q_gate_up, prob.q_down, ids, weights,
                                             fp8_compute=args.fp8_compute, **prob.scales),
                checker("fp8", fp8_tolerance)),
        "bf16": (lambda: kernel.fused_experts(x, prob.w_gate_up, prob.w_down, ids, weights),
                 checker("bf16", TOLERANCE[DTYPE])),
    }
    if hf_forward is not None:
        runs["hf_fp8"] = (lambda: hf_forward(x, ids, weights), checker("fp8", W8A8_TOLERANCE))
    for impl in args.impls:
        record = {"model": shape.name, "tokens": T, "impl": impl, "experts_hit": hit}
        records[impl] = record
        if impl not in runs:
            record["error"] = "n/a: " + (args.hf_why or "not run")
            continue
        fn, check = runs[impl]
        measure(record, timer, fn, check=check, graph_flushed=decode)
    return judge(records, shape, T, hit, ceilings)


def judge(records, shape, T, hit, ceilings):
    """Bytes, FLOPs, rates and the targets on the fp8 record; every record gets its rates."""
    flops = 2 * T * shape.top_k * 3 * shape.hidden * shape.ffn
    weight_bytes = fp8_weight_bytes(shape, hit)
    for record in records.values():
        time_us, mode = judged_time(record, ("graph_flushed_us", "plain_us"))
        if time_us is not None:
            record["tflop_per_s"] = flops / (time_us * 1e-6) / 1e12
            record["time_mode"] = mode
    fp8, bf16, hf = records.get("fp8", {}), records.get("bf16", {}), records.get("hf_fp8", {})
    fp8.update(flops=flops, fp8_weight_bytes=weight_bytes)
    if T <= DECODE_MAX_T:
        target = READ_SLACK * weight_bytes / ceilings["read_bytes_per_s"] * 1e6 + LAUNCH_ALLOWANCE_US
        time_us, mode = judged_time(fp8, ("graph_flushed_us", "plain_us"))
        fp8.update(target="decode", target_us=target)
        if time_us is not None:
            fp8.update(met=time_us <= target, judged_us=time_us, judged_mode=mode,
                       read_tb_per_s=weight_bytes / (time_us * 1e-6) / 1e12)
    elif T >= PREFILL_MIN_T:
        fp8["target"] = "prefill"
        if fp8.get("plain_us") and bf16.get("plain_us"):
            fp8["vs_bf16"] = bf16["plain_us"] / fp8["plain_us"]
            fp8["met"] = fp8["vs_bf16"] >= PREFILL_SPEEDUP
    if fp8.get("plain_us") and bf16.get("plain_us") and "vs_bf16" not in fp8:
        fp8["vs_bf16"] = bf16["plain_us"] / fp8["plain_us"]
    for mode in ("graph_flushed_us", "graph_us", "plain_us"):  # like for like with transformers' path
        if fp8.get(mode) and hf.get(mode):
            fp8["vs_hf"] = hf[mode] / fp8[mode]
            fp8["vs_hf_mode"] = mode[:-3]
            fp8["faster_than_hf"] = fp8[mode] < hf[mode]
            break
    return list(records.values())


def bench_model(shape, args, timer, kernel, hf_module, ceilings, started):
    device = torch.device(args.device)
    cells = []
    prob = make_fp8_problem(shape, max(args.tokens), device, args.seed, kernel)
    hf_forward = transformers_experts(hf_module, prob.q_gate_up, prob.q_down, prob.scales) if hf_module else None
    for T in args.tokens:
        if args.deadline_s and time.monotonic() - started > args.deadline_s:
            cells.append({"model": shape.name, "tokens": T, "impl": "fp8", "skipped": "deadline"})
            continue
        cells.extend(bench_cell(prob, T, args, timer, kernel, hf_forward, ceilings))
    del prob, hf_forward
    harness.free_memory(device)
    return cells


# --------------------------------------------------------------------------------------------------------------------
# outputs


def _rows(results):
    """(model, T, {impl: record}) in run order."""
    table = {}
    for c in results["cells"]:
        table.setdefault((c["model"], c["tokens"]), {})[c["impl"]] = c
    return [(model, T, impls) for (model, T), impls in table.items()]


def _met(record):
    if record.get("skipped"):
        return f"skipped ({record['skipped']})"
    if record.get("error"):
        return f"error: {record['error'][:60]}"
    if "met" not in record:
        return "-" if record.get("target") is None else "? (no bf16 time)"
    return "met" if record["met"] else "**missed**"


def write_markdown(results, path):
    meta, ceil = results["meta"], results["ceilings"]
    tflops = {k: ceil.get(f"fp8_matmul_{k}_flops_per_s") for k in ("rowwise", "tensorwise")}
    lines = [
        "# moe-dispatch FP8 experts benchmark", "",
        f"{meta['device']} · torch {meta['torch']} · triton {meta['triton']} · "
        f"transformers {meta['transformers']} · {meta['date']} · commit {meta['commit']} · "
        f"fp8_compute={meta['fp8_compute']}", "",
        "| read R | bf16 matmul P | fp8 _scaled_mm rowwise | fp8 _scaled_mm tensorwise |", "| --- | --- | --- | --- |",
        f"| {ceil['read_bytes_per_s'] / 1e12:.2f} TB/s | {ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s | "
        f"{fmt(tflops['rowwise'] and tflops['rowwise'] / 1e12, '.0f')} TFLOP/s | "
        f"{fmt(tflops['tensorwise'] and tflops['tensorwise'] / 1e12, '.0f')} TFLOP/s |", "",
        f"transformers FP8 experts (grouped_mm): {meta['hf_fp8']}", "",
        "Times in us, median. plain: do_bench, L2 flushed; graph: do_bench_cudagraph, repeated calls, no flush; "
        "gflush: one-call graph replays with the L2 flushed (decode cells). Target: decode (T <= 16) fp8 gflush <= "
        "1.15 x (fp8 weights + scales of the experts hit) / R + 10 us; prefill (T >= 4096) fp8 plain >= 1.5x bf16 "
        "throughput. x bf16 / x hf: their time / fp8's (same mode). err: RMS relative error on a row sample.", "",
        "| model | T | hit | fp8 plain | fp8 graph | fp8 gflush | fp8 TFLOP/s | bf16 plain | bf16 graph | "
        "bf16 gflush | x bf16 | hf plain | hf graph | x hf | target us | fp8 err | bf16 err | hf err | target |",
        "|" + " --- |" * 19,
    ]
    for model, T, impls in _rows(results):
        f, b, h = impls.get("fp8", {}), impls.get("bf16", {}), impls.get("hf_fp8", {})
        lines.append(
            f"| {model} | {T} | {f.get('experts_hit', '-')} | {fmt(f.get('plain_us'))} | {fmt(f.get('graph_us'))} | "
            f"{fmt(f.get('graph_flushed_us'))} | {fmt(f.get('tflop_per_s'), '.0f')} | {fmt(b.get('plain_us'))} | "
            f"{fmt(b.get('graph_us'))} | {fmt(b.get('graph_flushed_us'))} | {fmt(f.get('vs_bf16'), '.2f')} | "
            f"{fmt(h.get('plain_us'))} | {fmt(h.get('graph_us'))} | {fmt(f.get('vs_hf'), '.2f')} | "
            f"{fmt(f.get('target_us'))} | {fmt(f.get('rel_err'), '.1e')} | {fmt(b.get('rel_err'), '.1e')} | "
            f"{fmt(h.get('rel_err'), '.1e')} | {_met(f)} |")
    Path(path).write_text("\n".join(lines) + "\n")


def short_table(results):
    ceil = results["ceilings"]
    rowwise = ceil.get("fp8_matmul_rowwise_flops_per_s")
    lines = [f"R {ceil['read_bytes_per_s'] / 1e12:.2f} TB/s · P bf16 {ceil['matmul_flops_per_s'] / 1e12:.0f} · "
             f"P fp8 {fmt(rowwise and rowwise / 1e12, '.0f')} TFLOP/s · {results['meta']['device']} · "
             f"hf_fp8: {'ran' if results['meta']['hf_fp8'] == 'loaded' else 'not run'}",
             f"{'model':<15}{'T':>6} {'fp8_us':>9} {'bf16_us':>9} {'xbf16':>6} {'hf_us':>9} {'xhf':>5} "
             f"{'tgt_us':>8} {'err':>7} target"]
    misses = errors = 0
    for model, T, impls in _rows(results):
        f, b, h = impls.get("fp8", {}), impls.get("bf16", {}), impls.get("hf_fp8", {})
        fp8_us = judged_time(f, ("graph_flushed_us", "plain_us"))[0]
        bf16_us = judged_time(b, ("graph_flushed_us", "plain_us"))[0]
        hf_us = judged_time(h, ("graph_flushed_us", "plain_us"))[0]
        misses += f.get("met") is False
        errors += bool(f.get("error")) or f.get("ok") is False or b.get("ok") is False
        lines.append(f"{model[:15]:<15}{T:>6} {fmt(fp8_us):>9} {fmt(bf16_us):>9} {fmt(f.get('vs_bf16'), '.2f'):>6} "
                     f"{fmt(hf_us):>9} {fmt(f.get('vs_hf'), '.2f'):>5} {fmt(f.get('target_us')):>8} "
                     f"{fmt(f.get('rel_err'), '.1e'):>7} {_met(f)}")
    lines.append(f"targets missed: {misses}; cells with errors or failed checks: {errors}; times: gflush for T <= 16, "
                 "else plain")
    return "\n".join(lines)


def write_outputs(results, out_dir):
    harness.write_results(results, out_dir, "bench_fp8", write_markdown)
    return short_table(results)


def main(argv=None, *, kernel=None):
    started = time.monotonic()
    args = parse_args(argv)
    if not args.allow_download and not args.cpu_smoke:  # (the smoke run never loads transformers' kernel)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers / huggingface_hub read it
    device = harness.benchmark_device(args.device, "--cpu-smoke")
    torch.manual_seed(args.seed)
    kernel = kernel if kernel is not None else harness.load_kernel(args.kernel_dir)
    timer = Timer(args.warmup_ms, args.rep_ms, device)
    shapes = {name: shrunk(MODEL_SHAPES[name]) if args.cpu_smoke else MODEL_SHAPES[name] for name in args.models}
    hf_module, args.hf_why = (load_transformers_fp8(device) if "hf_fp8" in args.impls else (None, "not asked"))
    import triton

    try:
        import transformers

        transformers_version = transformers.__version__
    except Exception:
        transformers_version = None
    results = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
            "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers_version,
            "python": platform.python_version(), "commit": harness.git_commit(),
            "package": f"{getattr(kernel, '__name__', '?')} {getattr(kernel, '__version__', '?')}",
            "argv": [harness.portable_path(a) for a in (sys.argv[1:] if argv is None else argv)],
            "fp8_compute": args.fp8_compute, "block_shape": list(BLOCK), "hf_fp8": args.hf_why or "loaded",
            "tolerance": {"w8a8": W8A8_TOLERANCE, "bf16": TOLERANCE[DTYPE]},
            "targets": {"read_slack": READ_SLACK, "launch_allowance_us": LAUNCH_ALLOWANCE_US,
                        "decode_max_tokens": DECODE_MAX_T, "prefill_min_tokens": PREFILL_MIN_T,
                        "prefill_speedup_over_bf16": PREFILL_SPEEDUP},
        },
        "shapes": {name: dataclasses.asdict(shape) for name, shape in shapes.items()},
        "ceilings": measure_all_ceilings(timer, device, args),
        "cells": [],
    }
    print(f"ceilings done at {time.monotonic() - started:.0f} s; transformers FP8 experts: "
          f"{results['meta']['hf_fp8']}", file=sys.stderr, flush=True)
    out_dir = Path(args.out)
    for shape in shapes.values():
        results["cells"].extend(bench_model(shape, args, timer, kernel, hf_module, results["ceilings"], started))
        results["meta"]["elapsed_s"] = time.monotonic() - started
        write_outputs(results, out_dir)
        print(f"{shape.name}: done at {results['meta']['elapsed_s']:.0f} s", file=sys.stderr, flush=True)
    summary = write_outputs(results, out_dir)
    print(summary, flush=True)
    return results


if __name__ == "__main__":
    main()
