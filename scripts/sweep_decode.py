#!/usr/bin/env python3
"""Measure the decode path's tiles (decode.py) on a GPU and write the `decode` entry of its tile table.

For every model shape (benchmarks/model_shapes.py) and T in 1, 2, 4, 8, 16, 32 with N = T * top_k at most
--max-assignments, on random routing (bench.random_routing), it times `fused_experts` with

  general  the four-launch path with the device table's tiles (forced by their MoeTiles)
  vllm     vLLM's fused_experts, when `vllm` imports (nothing is installed for it)
  decode   the decode path forced by a DecodeTiles: the gate/up kernel's candidates with the down kernel's first
           candidate held, then the down kernel's candidates with the best gate/up tile held (two launches whose
           times add, so the two sweeps cost the sum of the candidate lists, not their product)

Every timing is `triton.testing.do_bench_cudagraph` (one CUDA graph of repeated calls, no L2 flush, median): the
number that picks tiles, since decode steps run as graph replays. The best decode tiles and the general path (and
vLLM) are also timed with `triton.testing.do_bench` (L2 flushed before each call, plain launches, median). Every
candidate's output is checked against the float64 reference (benchmarks/reference.py, all rows) and dropped when it
is off or fails to compile (e.g. out of shared memory).

Outputs in --out (rewritten after every T, so a run cut short keeps what it measured):
  sweep_decode.json   every measurement, the candidates, versions
  sweep_decode.md     best decode tiles per model and T, their time, the general path's (and vLLM's), the entry
  decode_entry.json   the ready-to-paste `decode` entry (see tiles.py): per model shape, buckets up to the largest N
                      where the decode path beat the general one at every measured T up to it (an empty list: it
                      never did); generic buckets for other shapes with the tiles best over all cells, up to the
                      smallest of the shapes' limits
  <device_key>.json   the package's table for this device with that entry in place (copy it to configs/)

    scripts/sweep_decode --out "$OUT/sweep-decode"            # all six models, about 2 minutes with compiles
    scripts/sweep_decode --fp8 --out "$OUT/sweep-decode-fp8"  # block-scaled float8 weights (bench_fp8's problems)
    scripts/sweep_decode --cpu-smoke --out /tmp/sweep         # plumbing on the CPU: shrunk shapes, interpreter

With --fp8 the weights are bench_fp8's 128 x 128 block-scaled e4m3 experts: the general path is the w8a8 path with
the table's "fp8" tiles, the decode path dequantizes in its loads, both are checked against the float64 experts on
the dequantized weights within reference.W8A8_TOLERANCE, and the entry goes to the table's "fp8" section.

Cost: a kernel compiles once per (tile, top_k, BLOCK_T) and is reused by every model that shares them (the token
count is not specialised on); --candidates, --models, --tokens and --budget-s trim a run.
"""

import argparse
import dataclasses
import datetime
import importlib
import json
import math
import sys
import time
from pathlib import Path

import torch

import bench  # first: sets TRITON_INTERPRET when there is no GPU (scripts/, benchmarks/, torch-ext/ on PYTHONPATH)
import bench_fp8
import reference
import tune

TOKENS = (1, 2, 4, 8, 16, 32)
SMOKE_TOKENS = (1, 2)
# (block_n, block_k, num_warps, num_stages). The gate/up kernel is a tl.dot of BLOCK_T = max(16, T) rows against a
# gate and an up tile, streaming the weights of each expert hit once; the down kernel is a GEMV per (assignment,
# BLOCK_N columns of H) whose parallelism at T = 1 is top_k * H / BLOCK_N programs.
GATE_UP_CANDIDATES = ((32, 256, 4, 3), (64, 128, 4, 4), (16, 256, 4, 3), (32, 128, 4, 4), (64, 256, 4, 3),
                      (128, 128, 8, 3))
# The down kernel's also carry split_k (see tiles.DecodeTile): splits along F multiply the programs of a few experts.
DOWN_CANDIDATES = ((64, 128, 4, 3, 1), (16, 256, 4, 3, 1), (32, 128, 4, 3, 1), (16, 128, 2, 4, 1),
                   (64, 256, 4, 3, 1), (64, 128, 4, 3, 4), (32, 256, 4, 3, 4), (64, 128, 4, 3, 8))
SMOKE_CANDIDATES = 2  # per kernel with --cpu-smoke


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="sweep-decode", help="output folder (created)")
    p.add_argument("--models", default="all", help="comma list of model names (default all)")
    p.add_argument("--tokens", default=None, help="comma list of token counts (default 1,2,4,8,16,32)")
    p.add_argument("--max-assignments", type=int, default=256, help="largest T * top_k swept (at most "
                   "tiles.MAX_DECODE_ASSIGNMENTS)")
    p.add_argument("--candidates", type=int, default=None, help="first N candidates of each kernel only")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(bench.DTYPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--rep-ms", type=float, default=5.0, help="timing window of each measurement")
    p.add_argument("--no-vllm", action="store_true", help="skip vLLM even when it imports")
    p.add_argument("--budget-s", type=float, default=140.0, help="start no new (T, model) cell after this many s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fp8", action="store_true", help="block-scaled float8 weights; writes the table's fp8 decode entry")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="plumbing run on the CPU: interpreter, shrunk shapes, T in 1,2, two candidates per kernel")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.device = "cpu"
    if args.tokens is None:
        args.tokens = SMOKE_TOKENS if args.cpu_smoke else TOKENS
    else:
        args.tokens = tuple(sorted(int(t) for t in args.tokens.split(",") if t))
    if args.cpu_smoke and args.candidates is None:
        args.candidates = SMOKE_CANDIDATES
    return args


class GpuTimer:
    """Median ms of `fn`: `graph` replays a CUDA graph of repeated calls (no L2 flush), `flushed` times plain calls
    with L2 cleared before each (triton.testing)."""

    def __init__(self, rep_ms):
        self.rep_ms = rep_ms

    def graph(self, fn):
        from triton.testing import do_bench_cudagraph

        return do_bench_cudagraph(fn, rep=self.rep_ms, return_mode="median")

    def flushed(self, fn):
        from triton.testing import do_bench

        return do_bench(fn, warmup=self.rep_ms, rep=self.rep_ms, return_mode="median")


class CpuTimer:
    """--cpu-smoke stand-in: host time of one call for both (plumbing only, no meaning)."""

    def graph(self, fn):
        begin = time.perf_counter()
        fn()
        return (time.perf_counter() - begin) * 1e3

    flushed = graph


def tile_text(tile):
    """block_n/block_k/warps/stages, then /split_k where it is not 1."""
    split = f"/{tile.split_k}" if tile.split_k != 1 else ""
    return "/".join(str(v) for v in (tile.block_n, tile.block_k, tile.num_warps, tile.num_stages)) + split


def candidates(tiles_module, table, limit):
    tiles = [tiles_module.DecodeTile(*c) for c in table]
    return tiles[:limit] if limit else tiles


def fits(tile, block_t, smem, gated):
    """The pipeline's shared memory (2-byte elements): x tile plus gate and up tiles, or the GEMV's weight tile."""
    rows = block_t + 2 * tile.block_n if gated else tile.block_n
    return tile.num_stages * rows * tile.block_k * 2 <= smem


class Cell:
    """One (model, T): the routing, the float64 reference, and measurements of `fused_experts` under tile choices."""

    def __init__(self, kernel, prob, num_tokens, args, timer, device):
        shape = prob.shape
        self.kernel, self.prob, self.timer, self.device = kernel, prob, timer, device
        self.fp8 = args.fp8
        self.x = prob.x[:num_tokens]
        self.ids, self.weights = bench.random_routing(num_tokens, shape.num_experts, shape.top_k, device,
                                                      args.seed * 1000003 + num_tokens)
        if self.fp8:  # a bench_fp8.Problem: float8 weights and their scales
            self.operands = dict(w_gate_up=prob.q_gate_up, w_down=prob.q_down, **prob.scales)
            self.ref = reference.fused_experts_fp8_ref(self.x, prob.q_gate_up, prob.q_down, self.ids, self.weights,
                                                       experts_per_chunk=16, **prob.scales)
            self.tolerance = reference.W8A8_TOLERANCE
        else:
            self.operands = dict(w_gate_up=prob.w_gate_up, w_down=prob.w_down)
            self.ref = reference.fused_experts_ref(self.x, prob.w_gate_up, prob.w_down, self.ids, self.weights)
            self.tolerance = reference.TOLERANCE[prob.x.dtype]
        self.record = {"model": shape.name, "shape": f"{shape.num_experts},{shape.ffn},{shape.hidden}",
                       "tokens": num_tokens, "assignments": num_tokens * shape.top_k,
                       "experts_hit": int(torch.unique(self.ids).numel())}

    def measure(self, fn, *, flushed=False):
        """{graph_us[, flushed_us], rel_err} of fn, or {error} when it fails or is off the reference."""
        try:
            out = fn()
            err = reference.relative_error(out, self.ref)
            del out
            if not err <= self.tolerance:
                return {"error": f"rel err {err:.2e}", "rel_err": err}
            result = {"graph_us": self.timer.graph(fn) * 1e3, "rel_err": err}
            if flushed:
                result["flushed_us"] = self.timer.flushed(fn) * 1e3
            return result
        except Exception as exc:  # out of shared memory, a compile error, ...
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            return {"error": bench.error_text(exc)}
        finally:
            bench.free_memory(self.device)

    def experts(self, tiles):
        return lambda: self.kernel.fused_experts(self.x, topk_ids=self.ids, topk_weights=self.weights,
                                                 validate=False, tiles=tiles, **self.operands)

    def general_tiles(self, tiles_module):
        """The four-launch path's tiles from the device's table (the w8a8 path's "fp8" ones for float8 weights)."""
        shape, T = self.prob.shape, self.record["tokens"]
        if self.fp8:
            return tiles_module.select_fp8_tiles(self.device, T, shape.top_k, shape.num_experts, shape.ffn,
                                                 shape.hidden)
        return tiles_module.select_tiles(self.device, T, shape.top_k, shape.num_experts, shape.ffn, shape.hidden,
                                         self.prob.dtype)


def sweep_cell(cell, tiles_module, gate_up_cands, down_cands, vllm_fn, smem):
    """Fills cell.record with the general path, vLLM, both decode sweeps and the best decode tiles."""
    prob, record = cell.prob, cell.record
    shape = prob.shape
    general = cell.general_tiles(tiles_module)
    record["general"] = {"tiles": general.to_dict(), **cell.measure(cell.experts(general), flushed=True)}
    if vllm_fn is not None and not cell.fp8:
        ids = cell.ids.to(torch.int32)
        record["vllm"] = cell.measure(lambda: vllm_fn(cell.x, prob.w_gate_up, prob.w_down, cell.weights, ids),
                                      flushed=True)
    block_t = max(16, 1 << (record["tokens"] - 1).bit_length())
    held_down = down_cands[0]
    sweeps = {"gate_up": [], "down": []}
    for tile in gate_up_cands:
        if not fits(tile, block_t, smem, gated=True):
            sweeps["gate_up"].append({"tile": tile_text(tile), "error": "skipped: shared memory"})
            continue
        result = cell.measure(cell.experts(tiles_module.DecodeTiles(tile, held_down)))
        sweeps["gate_up"].append({"tile": tile_text(tile), **result})
    timed = [(r["graph_us"], t) for r, t in zip(sweeps["gate_up"], gate_up_cands) if "graph_us" in r]
    record["decode"] = sweeps
    if not timed:
        return
    best_gate_up = min(timed, key=lambda pair: pair[0])[1]
    for tile in down_cands:
        if not fits(tile, block_t, smem, gated=False):
            sweeps["down"].append({"tile": tile_text(tile), "error": "skipped: shared memory"})
        elif tile == held_down:  # measured in the gate/up sweep
            sweeps["down"].append({"tile": tile_text(tile), **next(
                {k: r[k] for k in ("graph_us", "rel_err")} for r, t in zip(sweeps["gate_up"], gate_up_cands)
                if t == best_gate_up)})
        else:
            result = cell.measure(cell.experts(tiles_module.DecodeTiles(best_gate_up, tile)))
            sweeps["down"].append({"tile": tile_text(tile), **result})
    timed = [(r["graph_us"], t) for r, t in zip(sweeps["down"], down_cands) if "graph_us" in r]
    if not timed:
        return
    best_down = min(timed, key=lambda pair: pair[0])[1]
    best = tiles_module.DecodeTiles(best_gate_up, best_down)
    record["best"] = {"tiles": best.to_dict(), **cell.measure(cell.experts(best), flushed=True)}


def _score(cells, kernel_name, tile):
    """Mean log(time / the cell's best time) of one candidate over the cells where its sweep ran; inf if it failed."""
    logs = []
    for record in cells:
        runs = [r for r in record.get("decode", {}).get(kernel_name, []) if "graph_us" in r]
        if not runs:
            continue
        mine = next((r for r in record["decode"][kernel_name] if r["tile"] == tile), None)
        if mine is None or "graph_us" not in mine:
            return math.inf
        logs.append(math.log(mine["graph_us"] / min(r["graph_us"] for r in runs)))
    return sum(logs) / len(logs) if logs else math.inf


def build_entry(cells, gate_up_cands, down_cands):
    """The `decode` table entry from the measured cells (see the module doc)."""
    shapes, limits = {}, []
    for key in dict.fromkeys(record["shape"] for record in cells):
        buckets = []
        for record in sorted((r for r in cells if r["shape"] == key), key=lambda r: r["tokens"]):
            best, general = record.get("best", {}), record.get("general", {})
            if "graph_us" not in best or general.get("graph_us", 0.0) <= best["graph_us"]:
                break  # the general path wins (or was not measured) from here on
            entry = {"max_assignments": record["assignments"], **best["tiles"]}
            if buckets and {k: v for k, v in buckets[-1].items() if k != "max_assignments"} == best["tiles"]:
                buckets[-1] = entry  # same tiles as the bucket below: one bucket covers both
            else:
                buckets.append(entry)
        shapes[key] = buckets
        limits.append(buckets[-1]["max_assignments"] if buckets else 0)
    generic = []
    if limits and min(limits) > 0:
        scored = [(min(cands, key=lambda t: _score(cells, name, tile_text(t))), name)
                  for name, cands in (("gate_up", gate_up_cands), ("down", down_cands))]
        generic = [{"max_assignments": min(limits), **{name: dataclasses.asdict(tile) for tile, name in scored}}]
    return {"buckets": generic, "shapes": shapes}


def _us(value):
    return "-" if value is None else f"{value:.1f}"


def entry_text(entry, fp8=False):
    """{"decode": entry} (inside {"fp8": ...} for float8 weights) as JSON in the tables' layout (one line per
    bucket): the lines to paste."""
    return tune.dump_table({"fp8": {"decode": entry}} if fp8 else {"decode": entry})


def markdown(results):
    meta = results["meta"]
    lines = [f"# Decode path sweep: {meta['device']}, {meta['dtype']}, {meta['date']}", "",
             "Times in us. graph: `do_bench_cudagraph` median (CUDA graph of repeated calls, no L2 flush); flushed: "
             "`do_bench` median (L2 cleared before each call, plain launches). Tiles: block_n/block_k/warps/stages/split_k.",
             "", "| model | T | N | hit | decode gate_up | decode down | decode graph | general graph | vLLM graph | "
             "decode / general | decode flushed | general flushed | vLLM flushed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["cells"]:
        best, general, vllm = r.get("best", {}), r.get("general", {}), r.get("vllm", {})
        tiles = best.get("tiles")
        ratio = (best["graph_us"] / general["graph_us"]
                 if "graph_us" in best and general.get("graph_us") else None)
        lines.append(
            f"| {r['model']} | {r['tokens']} | {r['assignments']} | {r.get('experts_hit', '-')} | "
            f"{'/'.join(str(v) for v in tiles['gate_up'].values()) if tiles else '-'} | "
            f"{'/'.join(str(v) for v in tiles['down'].values()) if tiles else '-'} | "
            f"{_us(best.get('graph_us'))} | {_us(general.get('graph_us'))} | {_us(vllm.get('graph_us'))} | "
            f"{'-' if ratio is None else f'{ratio:.2f}'} | {_us(best.get('flushed_us'))} | "
            f"{_us(general.get('flushed_us'))} | {_us(vllm.get('flushed_us'))} |")
    lines += ["", f"vLLM: {meta.get('vllm')}. Elapsed {meta.get('elapsed_s', 0):.0f} s.", "",
              "## `decode` entry (paste into configs/<device>.json, or copy the table written beside this file)", "",
              "```json", entry_text(results["decode_entry"], meta.get("fp8", False)), "```", ""]
    return "\n".join(lines)


def write_outputs(results, out_dir, base_table, key):
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep_decode.json").write_text(json.dumps(results, indent=1) + "\n")
    (out_dir / "sweep_decode.md").write_text(markdown(results))
    fp8 = results["meta"].get("fp8", False)
    (out_dir / "decode_entry.json").write_text(entry_text(results["decode_entry"], fp8))
    if fp8:
        table = dict(base_table, fp8=dict(base_table.get("fp8", {}), decode=results["decode_entry"]))
    else:
        table = dict(base_table, decode=results["decode_entry"])
    (out_dir / f"{key}.json").write_text(tune.dump_table(table))


def main(argv=None, *, kernel=None):
    started = time.monotonic()
    args = parse_args(argv)
    device = bench.benchmark_device(args.device, "--cpu-smoke")
    kernel = kernel if kernel is not None else bench.load_kernel()
    tiles_module = importlib.import_module(kernel.__name__ + ".tiles")
    key = importlib.import_module(kernel.__name__ + "._device").device_key(device)
    max_assignments = min(args.max_assignments, tiles_module.MAX_DECODE_ASSIGNMENTS)
    models = bench.select_models(args.models, bench.default_shapes(args.cpu_smoke))
    dtype = bench.DTYPES[args.dtype]
    timer = GpuTimer(args.rep_ms) if device.type == "cuda" else CpuTimer()
    smem = tune.smem_limit(device)
    gate_up_cands = candidates(tiles_module, GATE_UP_CANDIDATES, args.candidates)
    down_cands = candidates(tiles_module, DOWN_CANDIDATES, args.candidates)
    vllm_fn, why = (None, "skipped") if args.no_vllm or device.type != "cuda" else bench.load_vllm_fused_experts()
    import triton

    results = {
        "meta": {"date": datetime.date.today().isoformat(),
                 "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "device_key": key, "torch": torch.__version__, "triton": triton.__version__,
                 "dtype": args.dtype, "fp8": args.fp8,
                 "argv": [bench._portable_path(a) for a in (sys.argv[1:] if argv is None else argv)],
                 "vllm": why or "imported", "rep_ms": args.rep_ms,
                 "candidates": {"gate_up": [tile_text(t) for t in gate_up_cands],
                                "down": [tile_text(t) for t in down_cands]}},
        "cells": [], "decode_entry": {"buckets": [], "shapes": {}},
    }
    base_table = json.loads(json.dumps(tiles_module.load_table(key)))
    out_dir = Path(args.out)
    if args.fp8:
        problems = {shape.name: bench_fp8.make_problem(shape, max(args.tokens), device, args.seed, kernel)
                    for shape in models}
    else:
        problems = {shape.name: bench.make_problem(shape, max(args.tokens), dtype, device, args.seed)
                    for shape in models}
    # T outside, models inside: a run cut short by --budget-s has every model's smallest T.
    for num_tokens in args.tokens:
        for shape in models:
            if num_tokens * shape.top_k > max_assignments:
                continue
            if time.monotonic() - started > args.budget_s:
                results["cells"].append({"model": shape.name, "tokens": num_tokens, "skipped": "budget",
                                         "shape": f"{shape.num_experts},{shape.ffn},{shape.hidden}",
                                         "assignments": num_tokens * shape.top_k})
                continue
            cell = Cell(kernel, problems[shape.name], num_tokens, args, timer, device)
            sweep_cell(cell, tiles_module, gate_up_cands, down_cands, vllm_fn, smem)
            results["cells"].append(cell.record)
            best = cell.record.get("best", {})
            print(f"{shape.name} T={num_tokens}: decode {_us(best.get('graph_us'))} us, general "
                  f"{_us(cell.record['general'].get('graph_us'))} us ({time.monotonic() - started:.0f} s)",
                  flush=True)
        results["decode_entry"] = build_entry(results["cells"], gate_up_cands, down_cands)
        results["meta"]["elapsed_s"] = time.monotonic() - started
        write_outputs(results, out_dir, base_table, key)
    print(markdown(results), flush=True)
    return results


if __name__ == "__main__":
    main()
