#!/usr/bin/env python3
"""Tile sweep of the w8a8 FP8 path (fp8_gemm.py): the table's "fp8" tiles against a few candidates per bucket.

The "fp8" buckets of the tables were never measured: on the H200 the path runs Mixtral at T = 128 (32 rows per
expert, BLOCK_M 32) 1.6x slower than bf16, because below BLOCK_M 64 sm_90 runs the fp8 dots on mma.sync with the
operands converted to fp16 instead of wgmma, and decode (T <= 16) misses its weight-bandwidth targets. For each model
(benchmarks/model_shapes.py) and T, on bench_fp8's inputs (randn * 0.02 weights block-quantized 128 x 128 by the
package's quantize_experts_fp8, random routing), it times `fused_experts(..., fp8_compute="w8a8", tiles=...)`:

  1. the table's tiles (tiles.select_fp8_tiles)
  2. BLOCK_M: the power of two the rows per expert fill (16..128), half and twice that, and 64 (the smallest tile
     on wgmma), each with the table's tiles of the bucket that has that BLOCK_M
  3. the gate_up GEMM's tile over GATE_UP_CANDIDATES (by BLOCK_M regime) with the best down tile held
  4. the down GEMM's over DOWN_CANDIDATES with the best gate_up tile held

a coordinate search: each stage starts from the best tiles so far. --persistent adds persistent=1 copies of the
BLOCK_M >= 64 candidates for the persistent FP8 kernel (a package whose w8a8_tiles does not carry the flag runs them
as 0: they are then the same candidates, measured once). The w8a8 path couples the two GEMMs: BLOCK_K is the
activation group and GEMM1's BLOCK_N a multiple of GEMM2's group (GEMM1 quantizes the intermediate per group of its
own columns; fp8_gemm.w8a8_tiles rounds it up). A gate_up candidate narrower than the held down group takes the group
down to its BLOCK_N; a down candidate keeps its group and GEMM1's BLOCK_N is rounded up. Candidates are recorded as
they run (after w8a8_tiles), and each distinct one is measured once.

Each candidate: the output on a row sample is checked against the float64 experts on the dequantized weights
(bench_fp8.fp8_reference, reference.W8A8_TOLERANCE: bench_fp8's check); one off the reference or failing to compile
or run (out of shared memory or registers) is recorded and skipped. Then two medians: hot
(triton.testing.do_bench_cudagraph: repeated calls in one CUDA graph, no L2 flush; as sweep_prefill) and flushed
(bench.EventTimer.graph: replays of a one-call graph, L2 cleared before each; weights from HBM, no launch overhead).
The winner is picked on the flushed time at T <= 16 (bench_fp8's decode cells: a few experts' fp8 weights fit the
50 MB L2, warm in the hot timing but never in a served decode step) and on the hot time above.

Cells run in --tokens order, models inside, so a run cut by --budget-s (no new cell, and no new candidate, once it is
spent; building the inputs and compiling count) has every model at the first token counts: list the important T
first. Outputs in --out, rewritten after every cell:
  sweep.json          every measurement, the candidates, versions
  sweep.md            per model and T: the table's tiles and time, the best candidate's, the gain
  <device_key>.json   the package's table with the "fp8" winners (gain >= --min-gain) written into per-shape bucket
                      lists (`"fp8": {"buckets": [...], "shapes": {"E,F,H": [...]}}`, keyed by max_rows_per_expert),
                      split at every measured rows per expert so no winner changes another measured T's tiles
                      (sweep_prefill.patched_table); copy it to torch-ext/moe_dispatch/configs/

    scripts/sweep_fp8 --models mixtral-8x7b,qwen3-30b-a3b,deepseek-v3 --tokens 128,1,16,1024 --budget-s 300 \\
        --out "$OUT/sweep-fp8"
    scripts/sweep_fp8 --cpu-smoke --out /tmp/sweep-fp8     # plumbing on the CPU: interpreter, shrunk shapes

Cost on an H200: a cell measures at most 1 + 3 + 5 + 5 candidates (twice the last two with --persistent at
BLOCK_M >= 64; fewer after duplicates). Each new tile configuration compiles GEMM1 or GEMM2 (both for a new BLOCK_M),
about 1-3 s each, once per top_k (a constexpr) and T = 1 (Triton specializes an int argument equal to 1), then
~0.5 s of timing: ~20-40 s for a cell that compiles everything, a few seconds when a model of the same top_k
compiled its tiles before (Qwen3 and DeepSeek-V3 share top_k 8, the two Mixtrals top_k 2).
"""

import argparse
import copy
import dataclasses
import datetime
import importlib
import math
import sys
import time
from pathlib import Path

import torch

import bench  # first: sets TRITON_INTERPRET when there is no GPU (scripts/, benchmarks/, torch-ext/ on PYTHONPATH)
import bench_fp8
import reference
import sweep_prefill
import tune
from model_shapes import MODEL_SHAPES, shrunk

TOKENS = (1, 4, 16, 128, 1024, 4096)
SMOKE_TOKENS = (1, 40)
SMOKE_CANDIDATES = 2  # per stage with --cpu-smoke
WARMUP_MS = 3.0  # the kernels are compiled by the check call before any timing

# (block_n, block_k, num_warps, num_stages, group_m, persistent) per BLOCK_M regime, the table's tile first. block_k
# is the activation group (a power of two dividing the 128-wide weight block). "small", BLOCK_M 16 / 32: mma.sync,
# weight streaming, so the number of programs (narrow N tiles for small F) and the bytes in flight matter; "mid",
# BLOCK_M 64, and "large", 128: wgmma, where a gated 128 x 128 tile holds two fp32 accumulators of 128 x 128 (they
# spill at BLOCK_M 128: the table's note).
GATE_UP_CANDIDATES = {
    "small": ((64, 128, 4, 4, 8, 0), (32, 128, 4, 4, 8, 0), (128, 128, 4, 3, 8, 0), (64, 64, 4, 4, 8, 0),
              (64, 128, 8, 3, 8, 0)),
    "mid": ((64, 128, 4, 4, 8, 0), (128, 128, 8, 3, 8, 0), (128, 64, 4, 4, 8, 0), (64, 128, 8, 4, 8, 0),
            (64, 64, 4, 3, 8, 0)),
    "large": ((64, 128, 8, 4, 8, 0), (64, 128, 8, 3, 8, 0), (64, 64, 8, 4, 8, 0), (128, 64, 8, 3, 8, 0),
              (64, 128, 4, 4, 8, 0)),
}
DOWN_CANDIDATES = {
    "small": ((64, 64, 4, 4, 8, 0), (64, 128, 4, 4, 8, 0), (128, 64, 4, 4, 8, 0), (128, 128, 4, 3, 8, 0)),
    "mid": ((128, 64, 4, 4, 8, 0), (128, 128, 4, 3, 8, 0), (256, 64, 8, 3, 8, 0), (64, 128, 4, 4, 8, 0),
            (128, 64, 8, 4, 8, 0)),
    "large": ((128, 64, 8, 4, 8, 0), (256, 64, 8, 3, 8, 0), (128, 128, 8, 3, 8, 0), (256, 128, 8, 3, 8, 0),
              (128, 64, 8, 3, 8, 0)),
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="sweep-fp8", help="output folder (created)")
    p.add_argument("--models", default=",".join(bench_fp8.MODEL_ORDER), help="comma list (default: all six)")
    p.add_argument("--tokens", default=None,
                   help=f"comma list, run in this order (default {','.join(map(str, TOKENS))})")
    p.add_argument("--persistent", action="store_true", help="also try persistent=1 for BLOCK_M >= 64 candidates")
    p.add_argument("--min-gain", type=float, default=0.03, help="relative gain a winner needs over the table")
    p.add_argument("--budget-s", type=float, default=300.0, help="start no new cell or candidate after this many s")
    p.add_argument("--max-candidates", type=int, default=None, help="first N candidates of each stage only")
    p.add_argument("--rep-ms", type=float, default=10.0, help="timing window of each median (hot and flushed)")
    p.add_argument("--check-rows", type=int, default=64)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="plumbing run: CPU, interpreter, shrunk shapes, T = 1,40, two candidates per stage")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.device = "cpu"
        args.max_candidates = args.max_candidates or SMOKE_CANDIDATES
    args.tokens = tuple(int(t) for t in args.tokens.split(",") if t) if args.tokens else (
        SMOKE_TOKENS if args.cpu_smoke else TOKENS)
    args.models = tuple(s for s in args.models.split(",") if s)
    for name in args.models:
        if name not in MODEL_SHAPES:
            p.error(f"unknown model {name!r}; known: {', '.join(MODEL_SHAPES)}")
    return args


def block_m_candidates(rows):
    """BLOCK_M the rows per expert fill (a power of two in 16..128), half and twice that, and 64: the smallest tile
    sm_90 runs on wgmma (below it the fp8 dots take mma.sync with the operands converted to fp16)."""
    fill = min(128, max(16, 1 << (rows - 1).bit_length()))
    return sorted({m for m in (fill // 2, fill, 2 * fill, 64) if 16 <= m <= 128})


def regime(block_m):
    return "small" if block_m < 64 else "mid" if block_m == 64 else "large"


def gemm_candidates(table, block_m, persistent):
    values = table[regime(block_m)]
    if persistent and block_m >= 64:
        values = values + tuple(v[:5] + (1,) for v in values)
    return values


def table_tiles_with_block_m(tiles_module, table, shape, block_m, fallback):
    """The table's fp8 tiles of the bucket that has this BLOCK_M (its N tiles and warps were chosen for it), else
    `fallback` with BLOCK_M replaced."""
    fp8 = table.get("fp8", {})
    buckets = fp8.get("shapes", {}).get(sweep_prefill.shape_key(shape)) or fp8.get("buckets", [])
    bucket = next((b for b in buckets if b["block_m"] == block_m), None)
    return tiles_module.MoeTiles.from_dict(bucket) if bucket else dataclasses.replace(fallback, block_m=block_m)


def with_gate_up(tiles_module, held, values):
    """`held` with a gate_up candidate; one narrower than the down GEMM's group takes the group down to its BLOCK_N
    (w8a8_tiles would otherwise round the BLOCK_N up to the group)."""
    tiles = sweep_prefill.tile_with(tiles_module, held, "gate_up", values)
    if tiles.down.block_k > tiles.gate_up.block_n:
        tiles = dataclasses.replace(tiles, down=dataclasses.replace(tiles.down, block_k=tiles.gate_up.block_n))
    return tiles


class Cell:
    """One (model, T): the routing, the float64 reference on a row sample, and `fused_experts` on the w8a8 path
    measured under forced tiles, each distinct configuration (as it runs, after w8a8_tiles) once."""

    def __init__(self, kernel, modules, prob, num_tokens, args, timer):
        shape, device = prob.shape, prob.x.device
        self.kernel, self.prob, self.timer, self.device = kernel, prob, timer, device
        self.tiles_module, self.fp8_gemm, fp8 = modules
        seed = args.seed * 1000003 + num_tokens
        self.x = prob.x[:num_tokens]
        self.ids, self.weights = bench.random_routing(num_tokens, shape.num_experts, shape.top_k, device, seed)
        self.rows = bench.check_rows(num_tokens, args.check_rows, device, seed)
        self.ref = bench_fp8.fp8_reference(prob, self.x, self.ids, self.weights, self.rows)
        self.scales = tuple(fp8.WeightScale.of(prob.scales[name], "block", bench_fp8.BLOCK, transposed=False)
                            for name in ("w_gate_up_scale", "w_down_scale"))
        self.metric = "flushed_us" if num_tokens <= bench_fp8.DECODE_MAX_T else "hot_us"
        self.tried = []
        self._seen = {}
        self.record = {"model": shape.name, "shape": sweep_prefill.shape_key(shape), "tokens": num_tokens,
                       "rows_per_expert": tune.rows_per_expert(num_tokens, shape.top_k, shape.num_experts),
                       "experts_hit": int(torch.unique(self.ids).numel()), "metric": self.metric}

    def time(self, entry):
        """The time that picks the winner (`metric`), inf for a failed candidate."""
        return entry.get(self.metric, math.inf)

    def measure(self, tiles, stage):
        """The entry of `tiles`: {stage, tiles (as run), asked (when it differs), rel_err, hot_us, flushed_us}, or
        {..., error} for a candidate that failed."""
        ran = self.fp8_gemm.w8a8_tiles(tiles, *self.scales)  # what the path runs for `tiles`
        if ran in self._seen:
            return self._seen[ran]
        entry = {"stage": stage, "tiles": ran.to_dict()}
        if ran != tiles:
            entry["asked"] = tiles.to_dict()

        def call():
            return self.kernel.fused_experts(self.x, self.prob.q_gate_up, self.prob.q_down, self.ids, self.weights,
                                             validate=False, tiles=ran, fp8_compute="w8a8", **self.prob.scales)

        try:
            entry["rel_err"] = reference.relative_error(call()[self.rows], self.ref)
            if not entry["rel_err"] <= reference.W8A8_TOLERANCE:
                raise ValueError(f"rel err {entry['rel_err']:.2e} > {reference.W8A8_TOLERANCE}")
            if self.timer is None:  # the CPU: plumbing only
                entry["hot_us"] = entry["flushed_us"] = 1.0
            else:
                entry["hot_us"] = self.timer.hot(call) * 1e3
                entry["flushed_us"] = self.timer.graph(call) * 1e3
        except Exception as exc:  # out of shared memory or registers, a compile error, off the reference
            entry["error"] = bench.error_text(exc)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
        self._seen[ran] = entry
        self.tried.append(entry)
        return entry


def sweep_cell(cell, table, args, started):
    """Fills cell.record: the table's tiles, then the coordinate search (module doc), best and gain."""
    tiles_module, prob, record = cell.tiles_module, cell.prob, cell.record
    shape = prob.shape
    table_tiles = tiles_module.select_fp8_tiles(cell.device, record["tokens"], shape.top_k, shape.num_experts,
                                                shape.ffn, shape.hidden)
    base = best = cell.measure(table_tiles, "table")
    stages = (
        ("block_m", lambda held: [table_tiles_with_block_m(tiles_module, table, shape, m, held)
                                  for m in block_m_candidates(record["rows_per_expert"])]),
        ("gate_up", lambda held: [with_gate_up(tiles_module, held, v) for v in
                                  gemm_candidates(GATE_UP_CANDIDATES, held.block_m, args.persistent)]),
        ("down", lambda held: [sweep_prefill.tile_with(tiles_module, held, "down", v) for v in
                               gemm_candidates(DOWN_CANDIDATES, held.block_m, args.persistent)]),
    )
    for stage, candidates in stages:
        held = tiles_module.MoeTiles.from_dict(best["tiles"])
        for tiles in candidates(held)[:args.max_candidates]:
            if time.monotonic() - started > args.budget_s:
                record["cut"] = "budget"
                break
            entry = cell.measure(tiles, stage)
            if cell.time(entry) < cell.time(best):
                best = entry
    table_us, best_us = (t if t < math.inf else None for t in (cell.time(base), cell.time(best)))
    record.update(table_tiles=base["tiles"], table_us=table_us, best_tiles=best["tiles"], best_us=best_us,
                  gain=table_us / best_us - 1 if table_us and best_us else None, table=base, best=best,
                  tried=cell.tried)


def _us(value):
    return "-" if value is None else f"{value:.1f}"


def markdown(results):
    meta = results["meta"]
    lines = [f"# FP8 w8a8 tile sweep: {meta['device']} ({meta['device_key']}), {meta['date']}, commit {meta['commit']}",
             "", "Times in us, median. hot: do_bench_cudagraph (repeated calls in one graph, no L2 flush); flushed: "
             "one-call graph replays with the L2 cleared before each. by: the time that picks the winner (flushed at "
             f"T <= {bench_fp8.DECODE_MAX_T}, hot above); gain = table / best - 1 on it; cells with gain >= "
             f"{meta['min_gain']} are written to {meta['device_key']}.json. Tiles: bm<BLOCK_M> gu/dn (block_n, "
             "block_k, warps, stages, group_m, persistent), as they run.", "",
             "| model | T | rows/expert | by | table tiles | table hot | table flushed | best hot | best flushed | "
             "gain | best tiles | tried (failed) |", "|" + "---|" * 12]
    for c in results["cells"]:
        if "skipped" in c:
            lines.append(f"| {c['model']} | {c['tokens']} | {c['rows_per_expert']} | skipped ({c['skipped']}) |"
                         + " |" * 8)
            continue
        table, best = c["table"], c["best"]
        gain = "-" if c["gain"] is None else f"{c['gain'] * 100:+.1f}%" + (" (cut)" if c.get("cut") else "")
        failed = sum("error" in e for e in c["tried"])
        lines.append(f"| {c['model']} | {c['tokens']} | {c['rows_per_expert']} | {c['metric'][:-3]} | "
                     f"{sweep_prefill.tiles_text(c['table_tiles'])} | {_us(table.get('hot_us'))} | "
                     f"{_us(table.get('flushed_us'))} | {_us(best.get('hot_us'))} | {_us(best.get('flushed_us'))} | "
                     f"{gain} | {sweep_prefill.tiles_text(c['best_tiles'])} | {len(c['tried'])} ({failed}) |")
    lines += ["", f"Elapsed {meta.get('elapsed_s', 0):.0f} s of a {meta['budget_s']:.0f} s budget.", ""]
    return lines


def main(argv=None, *, kernel=None, timer=None):
    """`timer` (tests): an object with hot(fn) and graph(fn) in ms; default bench.EventTimer on a GPU, none on the
    CPU (every time 1 us)."""
    started = time.monotonic()
    args = parse_args(argv)
    device = bench.benchmark_device(args.device, "--cpu-smoke")
    kernel = kernel if kernel is not None else bench.load_kernel()
    modules = tuple(importlib.import_module(f"{kernel.__name__}.{name}") for name in ("tiles", "fp8_gemm", "fp8"))
    key = importlib.import_module(kernel.__name__ + "._device").device_key(device)
    table = copy.deepcopy(modules[0].load_table(key))
    if timer is None and device.type == "cuda":
        timer = bench.EventTimer(WARMUP_MS, args.rep_ms, args.rep_ms)
    import triton

    results = {
        "meta": {"date": datetime.date.today().isoformat(),
                 "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
                 "device_key": key, "torch": torch.__version__, "triton": triton.__version__,
                 "commit": bench._git_commit(),
                 "argv": [bench._portable_path(a) for a in (sys.argv[1:] if argv is None else argv)],
                 "min_gain": args.min_gain, "budget_s": args.budget_s, "rep_ms": args.rep_ms,
                 "persistent": args.persistent, "tolerance": reference.W8A8_TOLERANCE,
                 "candidates": {"gate_up": GATE_UP_CANDIDATES, "down": DOWN_CANDIDATES}},
        "cells": [],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    problems = {}
    for name in args.models:
        shape = shrunk(MODEL_SHAPES[name]) if args.cpu_smoke else MODEL_SHAPES[name]
        prob = bench_fp8.make_problem(shape, max(args.tokens), device, args.seed, kernel)
        prob.w_gate_up = prob.w_down = None  # the bf16 originals: the check uses the dequantized fp8 weights
        problems[name] = prob
    bench.free_memory(device)
    for num_tokens in args.tokens:
        for name, prob in problems.items():
            shape = prob.shape
            if time.monotonic() - started > args.budget_s:
                results["cells"].append({"model": name, "shape": sweep_prefill.shape_key(shape), "tokens": num_tokens,
                                         "rows_per_expert": tune.rows_per_expert(num_tokens, shape.top_k,
                                                                                 shape.num_experts),
                                         "skipped": "budget"})
                continue
            cell = Cell(kernel, modules, prob, num_tokens, args, timer)
            sweep_cell(cell, table, args, started)
            results["cells"].append(cell.record)
            del cell
            bench.free_memory(device)
            c = results["cells"][-1]
            gain = "-" if c["gain"] is None else f"{c['gain'] * 100:+.1f}%"
            print(f"{name} T={num_tokens}: table {_us(c['table_us'])} us, best {_us(c['best_us'])} us ({gain}, "
                  f"{c['metric'][:-3]}) {sweep_prefill.tiles_text(c['best_tiles'])} "
                  f"[{time.monotonic() - started:.0f} s]", flush=True)
            results["meta"]["elapsed_s"] = time.monotonic() - started
            sweep_prefill.write(out, key, table, results["cells"], args.min_gain, markdown(results), results["meta"],
                                fp8=True, split=True)
    results["meta"]["elapsed_s"] = time.monotonic() - started
    sweep_prefill.write(out, key, table, results["cells"], args.min_gain, markdown(results), results["meta"],
                        fp8=True, split=True)
    print("\n".join(markdown(results)), flush=True)
    return results


if __name__ == "__main__":
    main()
