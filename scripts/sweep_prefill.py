#!/usr/bin/env python3
"""A focused tile sweep for the large-T buckets (issue 12's prefill and mid-T cells): the persistent descriptor kernel
(persistent_gemm.py) against the pointer kernel, and a few tile shapes around the table's choice.

For each model and T it times `fused_experts` (hot: triton.testing.do_bench_cudagraph, no L2 flush; the L2-flushed
time is recorded beside it) for the table's tiles, then sweeps the gate_up GEMM's tile over CANDIDATES with the
down GEMM held, then the down GEMM's with the best gate_up held; BLOCK_M takes the table's value and, where listed,
one alternative. Every candidate's output is checked against the float64 reference on a row sample. Winners are chosen
on --select (the profiler's kernel time by default), then confirmed: the table's tiles and the winner are replayed call
by call in alternation (--confirm-pairs pairs of CUDA graphs, hot, or flushed with --select flushed) and the cell's gain
is the median of the per-pair ratios, so a winner that only ran on a cooler GPU than the table does not count. Writes
OUT/sweep.json, OUT/sweep.md and OUT/<device_key>.json: the package's table with the winning tiles written into
each swept (model, bucket) whose gain is above --min-gain (per-shape bucket lists are created from the generic ones
where a model had none). scripts/sweep_fp8.py reuses the tile and table helpers for the w8a8 path's buckets.

    scripts/sweep_prefill.py --models qwen3-30b-a3b --tokens 1024,16384 --out "$OUT/sweep"
    scripts/sweep_prefill.py --cpu-smoke --out /tmp/sweep    # plumbing on the CPU: interpreter, shrunk shapes
"""

import argparse
import copy
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

import torch

import bench  # scripts/, benchmarks/ and torch-ext/ are on PYTHONPATH (scripts/_env.sh)
import reference
import tune
from model_shapes import MODEL_SHAPES, shrunk

# (block_n, block_k, num_warps, num_stages, group_m, persistent); the pointer kernel's known-good shapes and the
# persistent kernel's (128 x 256 x 64 with 3 stages is what reaches cuBLAS on a plain GEMM, see gpu-workflow.md);
# persistent 2 (tiles.Persistent.GATHER_FIRST): the rows copied into expert order first, A through a descriptor too.
CANDIDATES = {
    "gate_up": ((128, 64, 8, 4, 8, 0), (128, 64, 8, 3, 8, 1), (128, 64, 8, 4, 8, 1), (64, 64, 4, 4, 8, 1),
                (128, 64, 4, 4, 8, 1), (64, 128, 4, 3, 8, 1), (128, 64, 8, 4, 8, 2), (128, 64, 4, 4, 8, 2),
                (64, 128, 4, 4, 8, 0)),
    "down": ((256, 64, 8, 3, 8, 0), (256, 64, 8, 3, 8, 1), (128, 64, 8, 4, 8, 1), (128, 64, 4, 4, 8, 1),
             (256, 64, 8, 4, 8, 1), (128, 128, 8, 3, 8, 1), (128, 128, 4, 3, 8, 0)),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="all")
    p.add_argument("--tokens", default="128,1024,4096,16384")
    p.add_argument("--cells", default="", help="comma list of model:T, in place of --models x --tokens")
    p.add_argument("--block-m", default="", help="alternative BLOCK_M per T, e.g. 128:64 (T=128 also tries 64)")
    p.add_argument("--alt-only", action="store_true",
                   help="where --block-m gives an alternative, sweep only it (the table's tiles are still timed)")
    p.add_argument("--out", default="sweep-results")
    p.add_argument("--min-gain", type=float, default=0.02, help="relative gain a winner needs over the table")
    p.add_argument("--budget-s", type=float, default=300.0, help="stop starting cells after this many seconds")
    p.add_argument("--hot-rep-ms", type=float, default=15.0)
    p.add_argument("--check-rows", type=int, default=64)
    p.add_argument("--select", choices=("kernels", "hot", "flushed"), default="kernels",
                   help="the timing winners are chosen on: kernels (the profiler's sum of kernel times, at the "
                        "clock of a lightly loaded GPU), hot (graph replays without flush, power-capped at large T) "
                        "or flushed")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--confirm-pairs", type=int, default=16,
                   help="on a GPU: pairs of call-by-call alternating graph replays of the table's tiles and the "
                        "winner (bench.paired_graph_times; 0: the sweep's own times)")
    p.add_argument("--confirm-rounds", type=int, default=2,
                   help="without CUDA (the CPU smoke run): alternating re-timings of the table's tiles and the winner")
    p.add_argument("--max-candidates", type=int, default=None, help="first N candidates of each GEMM only")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="plumbing run: CPU, interpreter, shrunk shapes (default cell mixtral-8x7b:40), two candidates")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.device = "cpu"
        args.cells = args.cells or "mixtral-8x7b:40"
        args.max_candidates = args.max_candidates or 2
    return args


def tile_with(tiles_module, tiles, gemm, values):
    """`tiles` with one GEMM's tile replaced by a candidate tuple (block_n, block_k, warps, stages, group_m,
    persistent)."""
    block_n, block_k, num_warps, num_stages, group_m, persistent = values
    new = tiles_module.GemmTile(block_n, block_k, num_warps, num_stages, group_m, persistent)
    return dataclasses.replace(tiles, **{gemm: new})


def main(argv=None, *, timer=None):
    """`timer` (tests): an object with hot(fn) and plain(fn) in ms; default bench.EventTimer on a GPU, none on the
    CPU (every time 1 us)."""
    args = parse_args(argv)
    import moe_dispatch as md
    from moe_dispatch import tiles as tiles_module
    from moe_dispatch._device import device_key

    device = torch.device(args.device)
    key = device_key(device)
    table = copy.deepcopy(tiles_module.load_table(key))
    if timer is None and device.type == "cuda":
        timer = bench.EventTimer(5.0, 30.0, args.hot_rep_ms)
    alt_block_m = dict(tuple(int(v) for v in item.split(":")) for item in args.block_m.split(",") if item)
    tokens = [int(t) for t in args.tokens.split(",")]
    models = list(MODEL_SHAPES) if args.models == "all" else args.models.split(",")
    model_tokens = {name: tokens for name in models}
    if args.cells:
        model_tokens = {}
        for cell in args.cells.split(","):
            name, t = cell.split(":")
            model_tokens.setdefault(name, []).append(int(t))
    started = time.monotonic()
    cells = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, tokens in model_tokens.items():
        shape = shrunk(MODEL_SHAPES[name]) if args.cpu_smoke else MODEL_SHAPES[name]
        prob = bench.make_problem(shape, max(tokens), torch.bfloat16, device, args.seed)
        for t in tokens:
            if time.monotonic() - started > args.budget_s:
                cells.append({"model": name, "tokens": t, "skipped": "budget"})
                continue
            cells.append(sweep_cell(md, tiles_module, prob, t, alt_block_m.get(t), timer, args, device))
            print(json.dumps({k: v for k, v in cells[-1].items() if k != "tried"}), flush=True)
            write(out, key, table, cells, args.min_gain, markdown(cells))
        del prob
        bench.free_memory(device)
    write(out, key, table, cells, args.min_gain, markdown(cells))
    return cells


def sweep_cell(md, tiles_module, prob, t, alt_block_m, timer, args, device):
    shape = prob.shape
    seed = args.seed * 1000003 + t
    ids, weights = bench.random_routing(t, shape.num_experts, shape.top_k, device, seed)
    rows = bench.check_rows(t, args.check_rows, device, seed)
    x = prob.x[:t]
    ref = reference.fused_experts_ref(x[rows], prob.w_gate_up, prob.w_down, ids[rows], weights[rows])
    base = tiles_module.select_tiles(device, t, shape.top_k, shape.num_experts, shape.ffn, shape.hidden)
    tried = []

    def call_with(tiles):
        return lambda: md.fused_experts(x, prob.w_gate_up, prob.w_down, ids, weights, tiles=tiles)

    def timed(call):
        """The selected timing of `call` in us (1.0 without a timer)."""
        if timer is None:
            return 1.0
        if args.select == "kernels":
            return sum(bench.kernel_times(call, calls=10).values()) if device.type == "cuda" else timer.hot(call) * 1e3
        return (timer.hot(call) if args.select == "hot" else timer.plain(call)) * 1e3

    def measure(tiles):
        call = call_with(tiles)
        entry = {"tiles": tiles.to_dict()}
        try:
            err = reference.relative_error(call()[rows], ref)
            entry["rel_err"] = err
            if not err <= reference.TOLERANCE[prob.dtype]:
                raise ValueError(f"rel err {err:.2e}")
            if timer is None:
                entry["hot_us"] = entry["flushed_us"] = entry["kernels_us"] = 1.0
            else:
                entry["hot_us"] = timer.hot(call) * 1e3
                entry["flushed_us"] = timer.plain(call) * 1e3
                entry["kernels_us"] = (sum(bench.kernel_times(call, calls=10).values()) if device.type == "cuda"
                                       else entry["hot_us"])
        except Exception as exc:
            entry["error"] = bench.error_text(exc)[:200]
            if device.type == "cuda":
                torch.cuda.synchronize()
        tried.append(entry)
        return entry.get(f"{args.select}_us", math.inf), entry

    reference_us, table_entry = measure(base)
    best, best_us, best_entry = base, reference_us, table_entry
    block_ms = [base.block_m] + ([alt_block_m] if alt_block_m and alt_block_m != base.block_m else [])
    for block_m in block_ms[1:] if args.alt_only and len(block_ms) > 1 else block_ms:
        start, start_us, start_entry = dataclasses.replace(base, block_m=block_m), math.inf, None
        for gemm in ("gate_up", "down"):  # gate_up with the table's down held, then down with the best gate_up
            for values in CANDIDATES[gemm][:args.max_candidates]:
                candidate = tile_with(tiles_module, start, gemm, values)
                us, entry = measure(candidate)
                if us < start_us:
                    start, start_us, start_entry = candidate, us, entry
        if start_us < best_us:
            best, best_us, best_entry = start, start_us, start_entry
    gain = reference_us / best_us - 1 if best_us < math.inf else None
    confirm = None
    if best is not base and gain is not None and device.type == "cuda" and args.confirm_pairs > 0:
        # the table's tiles and the winner replayed call by call in alternation (bench.paired_graph_times): the gain
        # is the median of the per-pair ratios, hot (flushed when selecting on flushed times)
        kind = "flushed" if args.select == "flushed" else "hot"
        times = bench.paired_graph_times({"table": call_with(base), "best": call_with(best)}, args.confirm_pairs)[kind]
        ratio = bench.median_ratios(times, "table")["best"]
        confirm = {"kind": kind, "pairs": args.confirm_pairs, "best_over_table": ratio, **times}
        gain = 1 / ratio - 1
    elif best is not base and gain is not None and args.confirm_rounds > 0:
        # without CUDA graphs (the CPU smoke run): the table's tiles and the winner timed again in alternating rounds,
        # the gain the ratio of the medians
        confirm = {"table": [], "best": []}
        for _ in range(args.confirm_rounds):
            confirm["table"].append(timed(call_with(base)))
            confirm["best"].append(timed(call_with(best)))
        gain = statistics.median(confirm["table"]) / statistics.median(confirm["best"]) - 1
    timings = ("kernels_us", "hot_us", "flushed_us")
    return {"model": shape.name, "shape": shape_key(shape), "tokens": t, "select": args.select,
            "rows_per_expert": tune.rows_per_expert(t, shape.top_k, shape.num_experts),
            "table_tiles": base.to_dict(), "table": {k: table_entry.get(k) for k in timings},
            "best_tiles": best.to_dict(), "best": {k: best_entry.get(k) for k in timings},
            "sweep_gain": reference_us / best_us - 1 if best_us < math.inf else None, "confirm": confirm,
            "gain": gain, "tried": tried}


def shape_key(shape):
    """"E,F,H": the key of a model's per-shape bucket lists in the tile tables (tiles.py)."""
    return f"{shape.num_experts},{shape.ffn},{shape.hidden}"


def tiles_text(tiles):
    """A MoeTiles dict in one short line: bm<BLOCK_M> gu (gate_up fields) dn (down fields)."""
    return f"bm{tiles['block_m']} gu {tuple(tiles['gate_up'].values())} dn {tuple(tiles['down'].values())}"


def markdown(cells):
    """One row per cell: the table's and the winner's timings (us: kernels / hot / flushed), the gain on the selected
    timing, the winner's tiles."""
    lines = ["| model | T | rows/expert | table us (kernels/hot/flushed) | best us (kernels/hot/flushed) | gain | "
             "best tiles |", "|---|---|---|---|---|---|---|"]

    def us(timings):
        return " / ".join("-" if timings.get(k) is None else f"{timings[k]:.1f}"
                          for k in ("kernels_us", "hot_us", "flushed_us"))

    for c in cells:
        if "skipped" in c:
            lines.append(f"| {c['model']} | {c['tokens']} | skipped | | | | |")
            continue
        gain = f"{c['gain'] * 100:+.1f}% ({c['select']}{', confirmed' if c.get('confirm') else ''})" \
            if c.get("gain") is not None else "-"
        lines.append(f"| {c['model']} | {c['tokens']} | {c['rows_per_expert']} | {us(c['table'])} | "
                     f"{us(c['best'])} | {gain} | {tiles_text(c['best_tiles'])} |")
    return lines


def write(out, key, table, cells, min_gain, markdown_lines, meta=None, **patch):
    """OUT/sweep.json (`meta` and every cell), OUT/sweep.md (`markdown_lines`) and OUT/<key>.json: `table` patched with
    the winners (`patched_table(..., **patch)`) in the layout of the shipped tables (tune.dump_table), for configs/."""
    head = {"device_key": key} if meta is None else {"device_key": key, "meta": meta}
    (out / "sweep.json").write_text(json.dumps({**head, "cells": cells}, indent=1) + "\n")
    (out / f"{key}.json").write_text(tune.dump_table(patched_table(table, cells, min_gain, **patch)))
    (out / "sweep.md").write_text("\n".join(markdown_lines) + "\n")


def bucket_index(buckets, rows):
    """Index of the bucket `rows` per expert select (tiles.py: the first with rows <= its max, else the last)."""
    return next((i for i, b in enumerate(buckets) if rows <= b["max_rows_per_expert"]), len(buckets) - 1)


def bucket_tiles(bucket):
    return {k: v for k, v in bucket.items() if k != "max_rows_per_expert"}


def patched_table(table, cells, min_gain, *, fp8=False, split=False):
    """The table with the winning cells' tiles (`best_tiles`, `gain` at least `min_gain`) written into their shape's
    bucket list (created from the generic list where the shape had none).

    Without `split` a winner takes the whole bucket its rows per expert select (a bucket whose cells disagree keeps
    the winner of the largest gain). With `split`, in shapes that have a winner, every measured cell's rows per
    expert becomes a bucket boundary: winners get their tiles up to their rows, the other cells keep the tiles the
    table gave them, so a winner never changes what another measured T runs (neighbours with equal tiles are then
    merged). `fp8` patches the w8a8 path's buckets (tiles.select_fp8_tiles) instead of the bf16 ones; a table
    without them gets the ones that path borrows first (the bf16 buckets with BLOCK_K 128)."""
    table = copy.deepcopy(table)
    entry = table
    if fp8:
        lent = [{**b, **{g: {**b[g], "block_k": 128} for g in ("gate_up", "down")}} for b in table["buckets"]]
        entry = table.setdefault("fp8", {"buckets": lent})
    measured = [c for c in cells if c.get("gain") is not None]
    for key in dict.fromkeys(c["shape"] for c in measured if c["gain"] >= min_gain):
        buckets = entry.setdefault("shapes", {}).setdefault(key, copy.deepcopy(entry["buckets"]))
        chosen = {}  # bucket boundary (split) or bucket index -> the cell of the largest gain there
        for c in measured:
            if c["shape"] == key and (split or c["gain"] >= min_gain):
                slot = c["rows_per_expert"] if split else bucket_index(buckets, c["rows_per_expert"])
                if slot not in chosen or chosen[slot]["gain"] < c["gain"]:
                    chosen[slot] = c
        for c in sorted(chosen.values(), key=lambda c: c["rows_per_expert"]):
            index = bucket_index(buckets, c["rows_per_expert"])
            bucket = buckets[index]
            tiles = c["best_tiles"] if c["gain"] >= min_gain else bucket_tiles(bucket)
            if split and c["rows_per_expert"] < bucket["max_rows_per_expert"]:
                buckets.insert(index, {"max_rows_per_expert": c["rows_per_expert"], **tiles})
            else:
                buckets[index] = {"max_rows_per_expert": bucket["max_rows_per_expert"], **tiles}
        if split:
            merged = []
            for bucket in buckets:
                if merged and bucket_tiles(merged[-1]) == bucket_tiles(bucket):
                    merged[-1] = bucket  # one bucket covers both
                else:
                    merged.append(bucket)
            buckets[:] = merged
    return table


if __name__ == "__main__":
    main()
