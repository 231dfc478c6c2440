#!/usr/bin/env python3
"""Tile tuner: measure the launch configurations of one path of the package on this device and write the tile table
the package reads, torch-ext/moe_dispatch/configs/<device_key>.json (host/tiles.py documents its format).

    scripts/tune --models mixtral-8x7b,qwen3-30b-a3b --budget-s 400         # the general path's buckets
    scripts/tune --path decode --out "$OUT/NVIDIA_H200.json"                # the decode path's entry
    scripts/tune --path decode --fp8                                        # ... for block-scaled float8 weights
    scripts/tune --path decode --mxfp4                                      # ... for MXFP4 weights (GPT-OSS)
    scripts/tune --path general --mxfp4 --tokens 128,1024,4096              # MXFP4's grouped-path buckets
    scripts/tune --path fp8 --models deepseek-v3 --tokens 128,1,16,1024     # the w8a8 path's buckets
    scripts/tune --path backward --models mixtral-8x7b --tokens 4096        # the experts backward's tiles
    scripts/tune --path fp8 --cpu-smoke --out table.json                    # plumbing on a CPU (interpreter)

The paths (PATHS below: each one's candidates, defaults and the part of the table it writes are data):

  general   the four-launch forward: BLOCK_M and each grouped GEMM's tiles per bucket of rows per expert,
            ceil(T * top_k / E). Writes the model shape's bucket list ("shapes": {"E,F,H": [...]}), a bucket ending
            at each tuned rows per expert (--generic-from MODEL: that model's list is also the generic "buckets"),
            and the table's device, measured and note fields; --mxfp4: on MXFP4 weights, into the "mxfp4" section.
  decode    the two-launch decode path (small T, inference) against the general path at each T <=
            --max-assignments / top_k. Writes the "decode" entry (--fp8: block-scaled float8 weights, the "fp8"
            section's "decode" entry; --mxfp4: MXFP4 weights, the "mxfp4" section's): per shape, buckets up to the
            largest N = T * top_k at which the decode path won at every measured T up to it (an empty list: it never
            did), and one generic bucket with the tiles best over all cells, up to the smallest shape's limit.
  fp8       the w8a8 path on block-scaled float8 weights (DeepSeek-V3's 128 x 128 format, harness.make_fp8_problem).
            Writes the "fp8" section's per-shape buckets, split at every measured rows per expert so that no winner
            changes the tiles another measured T runs.
  backward  the experts backward: the weight-gradient tile, then the input-gradient GEMMs' tiles. Writes no table
            (the package takes the forward's table and tiles.select_weight_grad_tile), only the log.

One sweep serves every path. Per unit (a model and the T scored together: a general bucket's T, else one T):

  1. the table's choice (the baseline) is checked and timed;
  2. the path's stages of candidates (general and fp8: BLOCK_M, then the gate_up GEMM's tile with the rest held, then
     the down GEMM's; then register caps on each GEMM, REGISTER_CAPS), each stage starting from the best so far. Every candidate's output is checked (against the
     float64 reference; the backward's gradients against the baseline's) and one that is off, does not compile or
     does not fit is rejected. Each is timed once, briefly (--select, --rep-ms);
  3. the --finalists best are re-timed beside the baseline call by call in alternation, --pairs pairs (CUDA graphs
     on a GPU: harness.paired_graph_times), and scored by the median of the per-pair ratios;
  4. the winner is the best re-timed candidate if it beats the baseline by more than --min-gain, else the baseline.

A score is the mean over the unit's T of log(time / the baseline's time), so T = 1 weighs as much as a bucket's
largest T. The table (--out, default the package's table for this device) is rewritten after every unit in the
layout of the shipped tables, so a run cut short keeps what it measured (--budget-s: no new unit or candidate after
it); each run (versions, arguments, every candidate tried and its times, the winners) is appended to the tuning log,
docs/results/tuning-<device_key>.json (tuning-<device_key>.json beside --out when --out is given).

Cost: every candidate tile compiles once per process (Triton's on-disk cache then serves other models and units);
a general bucket measures 20-40 candidates and all six models at every power-of-two T take several minutes of GPU
time, so pass --models / --tokens / --cells / --budget-s to fit a call. Its launcher is scripts/tune.
"""

import argparse
import copy
import dataclasses
import datetime
import importlib
import json
import math
import sys
import time
from pathlib import Path

import torch

# scripts/, benchmarks/ and torch-ext/ are on PYTHONPATH (scripts/_env.sh). The harness first: without a GPU it turns
# on Triton's interpreter before anything imports triton.
import harness
from model_shapes import MODEL_SHAPES
from moe_dispatch import reference

ROOT = Path(__file__).resolve().parent.parent
SMEM_FALLBACK = 227 * 1024  # H100/H200 opt-in shared memory per block, when torch does not report it
SMOKE_CANDIDATES = 2  # per stage with --cpu-smoke
SMOKE_PAIRS = 2

# Candidate GEMM tiles: (block_n, block_k, num_warps, num_stages, group_m), or with a sixth field, the name of the
# tiles.Persistent member the tile asks for (the pointer kernel without it).
GENERAL_TILES = {  # per BLOCK_M regime, both GEMMs; gate_up loads two weight tiles per K step (the smem check)
    "small": (  # BLOCK_M 16 / 32: weight-streaming, many CTAs, deep pipelines
        (32, 128, 4, 4, 1), (64, 128, 4, 4, 1), (64, 64, 4, 5, 1), (128, 64, 4, 4, 1), (32, 256, 4, 3, 1),
        (64, 256, 4, 3, 1), (128, 128, 4, 3, 1), (128, 128, 8, 3, 1), (256, 64, 4, 4, 1)),
    "mid": (  # BLOCK_M 64
        (64, 64, 4, 4, 8), (128, 64, 4, 4, 8), (128, 64, 8, 4, 8), (64, 128, 4, 3, 8), (128, 128, 8, 3, 8),
        (256, 64, 8, 3, 8), (256, 64, 8, 4, 8), (64, 128, 4, 4, 8), (128, 128, 4, 3, 8)),
    "large": (  # BLOCK_M 128: tensor-core bound
        (128, 64, 8, 4, 8), (128, 64, 8, 3, 8), (256, 64, 8, 3, 8), (256, 64, 8, 4, 8), (128, 128, 8, 3, 8),
        (128, 64, 4, 4, 8), (64, 64, 4, 4, 8), (64, 128, 4, 4, 8), (128, 128, 4, 3, 8)),
}
# --persistent, BLOCK_M >= 64: the persistent descriptor kernel (SM90; 128 x 256 x 64 with 3 stages is what reaches
# cuBLAS on a plain GEMM).
GENERAL_PERSISTENT = {
    "gate_up": ((128, 64, 8, 3, 8, "ON"), (128, 64, 8, 4, 8, "ON"), (64, 64, 4, 4, 8, "ON"), (128, 64, 4, 4, 8, "ON"),
                (64, 128, 4, 3, 8, "ON")),
    "down": ((256, 64, 8, 3, 8, "ON"), (128, 64, 8, 4, 8, "ON"), (128, 64, 4, 4, 8, "ON"), (256, 64, 8, 4, 8, "ON"),
             (128, 128, 8, 3, 8, "ON")),
}
# --mxfp4 (MXFP4 weights, the pointer kernel dequantizing byte tiles in its loads; no persistent kernel reads them):
# a K step of BLOCK_K values reads BLOCK_K / 2 bytes per weight row, so wider K steps than the bf16 tiles' come first.
MXFP4_GENERAL_TILES = {
    "small": ((32, 256, 4, 3, 1), (64, 256, 4, 3, 1), (32, 128, 4, 4, 1), (64, 128, 4, 4, 1), (128, 128, 4, 3, 1),
              (128, 256, 8, 3, 1), (16, 512, 4, 3, 1), (32, 512, 4, 3, 1)),
    "mid": ((64, 128, 4, 4, 8), (128, 128, 8, 3, 8), (128, 128, 4, 3, 8), (64, 256, 4, 3, 8), (128, 256, 8, 3, 8),
            (256, 128, 8, 3, 8), (128, 64, 4, 4, 8)),
    "large": ((128, 128, 8, 3, 8), (128, 128, 8, 4, 8), (256, 128, 8, 3, 8), (128, 256, 8, 3, 8), (64, 128, 4, 4, 8),
              (128, 64, 8, 4, 8), (256, 64, 8, 3, 8), (64, 256, 4, 3, 8)),
}
# w8a8, per GEMM and BLOCK_M regime; block_k is the activation group (a power of two dividing the 128-wide weight
# block). small, BLOCK_M 16 / 32: mma.sync, weight streaming, so the number of programs (narrow N tiles for small F)
# and the bytes in flight matter; mid (64) and large (128): wgmma, where a gated 128 x 128 tile holds two fp32
# accumulators of 128 x 128 (they spill at BLOCK_M 128). --persistent adds ON copies from BLOCK_M 64.
FP8_TILES = {
    "gate_up": {
        "small": ((64, 128, 4, 4, 8), (32, 128, 4, 4, 8), (128, 128, 4, 3, 8), (64, 64, 4, 4, 8), (64, 128, 8, 3, 8),
                  (64, 128, 4, 5, 8), (128, 128, 4, 4, 8)),
        "mid": ((64, 128, 4, 4, 8), (128, 128, 8, 3, 8), (128, 64, 4, 4, 8), (64, 128, 8, 4, 8), (64, 64, 4, 3, 8)),
        "large": ((64, 128, 8, 4, 8), (64, 128, 8, 3, 8), (64, 64, 8, 4, 8), (128, 64, 8, 3, 8), (64, 128, 4, 4, 8)),
    },
    "down": {
        "small": ((64, 64, 4, 4, 8), (64, 128, 4, 4, 8), (128, 64, 4, 4, 8), (128, 128, 4, 3, 8), (64, 128, 4, 5, 8),
                  (128, 128, 4, 4, 8)),
        "mid": ((128, 64, 4, 4, 8), (128, 128, 4, 3, 8), (256, 64, 8, 3, 8), (64, 128, 4, 4, 8), (128, 64, 8, 4, 8)),
        "large": ((128, 64, 8, 4, 8), (256, 64, 8, 3, 8), (128, 128, 8, 3, 8), (256, 128, 8, 3, 8), (128, 64, 8, 3, 8),
                  (128, 128, 8, 4, 8)),
    },
}
# The decode path's kernels: (block_n, block_k, num_warps, num_stages[, split_k[, dot]]). The gate/up kernel is a
# tl.dot of BLOCK_T = max(16, T) rows against a gate and an up tile, streaming the weights of each expert hit once; the
# down kernel a GEMV per (assignment, BLOCK_N columns of H), whose splits along F (split_k) multiply the programs of a
# few experts, or (dot) one tl.dot per expert hit over its tokens' rows.
DECODE_TILES = {
    "gate_up": ((32, 256, 4, 3), (64, 128, 4, 4), (16, 256, 4, 3), (32, 128, 4, 4), (64, 256, 4, 3), (128, 128, 8, 3),
                (128, 256, 8, 3)),
    "down": ((64, 128, 4, 3, 1), (16, 256, 4, 3, 1), (32, 128, 4, 3, 1), (16, 128, 2, 4, 1), (64, 256, 4, 3, 1),
             (64, 128, 4, 3, 4), (32, 256, 4, 3, 4), (64, 128, 4, 3, 8), (128, 128, 4, 3, 1), (128, 256, 8, 3, 2),
             (64, 128, 4, 3, 1, True), (64, 128, 4, 3, 2, True), (64, 128, 4, 3, 4, True), (128, 128, 4, 3, 1, True)),
}
# --mxfp4: the gate/up kernel's tiles with wider K steps too, then its GEMV's (DecodeTile.gemv); the down kernel as the
# dot kernel, the first one tiles.MXFP4_DOWN_DECODE_TILES' (held while the gate/up tiles are measured), then as the
# GEMV.
MXFP4_DECODE_TILES = {
    "gate_up": ((32, 256, 4, 3), (16, 256, 4, 3), (64, 256, 4, 3), (16, 512, 4, 3), (32, 512, 4, 3), (32, 128, 4, 4),
                (64, 128, 4, 4), (32, 256, 8, 3), (64, 512, 8, 2), (128, 256, 8, 3)),
    "down": ((64, 128, 4, 3, 2, True), (128, 128, 4, 3, 1, True), (64, 128, 4, 3, 4, True), (32, 128, 4, 3, 2, True),
             (64, 256, 4, 3, 2, True), (32, 256, 4, 3, 4, True), (128, 256, 8, 3, 1, True), (64, 128, 4, 3, 8, True),
             (32, 128, 4, 3, 8, True), (128, 128, 4, 3, 2, True), (32, 256, 4, 1, 1), (16, 256, 4, 1, 2),
             (64, 128, 4, 1, 1), (32, 512, 4, 1, 1)),
}
MXFP4_DECODE_TILES["gate_up"] += ((16, 256, 4, 1, 1, False, True), (16, 512, 4, 1, 1, False, True),
                                  (32, 256, 4, 1, 1, False, True), (16, 128, 4, 1, 1, False, True))
# and both kernels on mma.sync (DecodeTile.mma: 16 weight rows a warp, K steps of 128; the tile's block_n says the
# same as its num_warps, 8 output columns a warp for gate/up and 16 for down), where bf16 activations take them
MXFP4_DECODE_TILES["gate_up"] += ((32, 128, 4, 1, 1, False, False, True), (16, 128, 2, 1, 1, False, False, True))
MXFP4_DECODE_TILES["down"] += ((64, 128, 4, 1, 1, False, False, True), (32, 128, 2, 1, 1, False, False, True))
# The backward: weight-gradient tiles (block_i, block_j, block_p, num_warps, num_stages), then the input-gradient
# GEMMs' (block_m, gate_up = the dA GEMM's tile: n = F, K = H, heavy epilogue; down = the dX GEMM's: n = H, K = F).
BACKWARD_WEIGHT_TILES = ((128, 128, 64, 8, 3), (128, 128, 32, 4, 4), (128, 128, 64, 4, 3), (128, 256, 64, 8, 3),
                         (256, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 128, 128, 8, 2), (128, 256, 32, 8, 4),
                         (256, 128, 32, 8, 4), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4))
BACKWARD_GEMM_TILES = ((128, (64, 64, 4, 4, 8), (256, 64, 8, 3, 8)), (128, (128, 64, 4, 4, 8), (256, 64, 8, 3, 8)),
                       (128, (64, 128, 4, 3, 8), (256, 64, 8, 3, 8)), (64, (128, 64, 4, 4, 8), (128, 64, 4, 4, 8)))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--path", default="general", choices=tuple(PATHS), help="what is tuned (default general)")
    p.add_argument("--models", default=None, help=f"comma list of {', '.join(MODEL_SHAPES)} or all (default: the "
                   "path's: all; backward: mixtral-8x7b,qwen3-30b-a3b)")
    p.add_argument("--tokens", default=None, help="comma list of token counts (default: the path's, listed below)")
    p.add_argument("--cells", default="", help="comma list of model:T, in place of --models x --tokens")
    p.add_argument("--out", default=None,
                   help="table to write (default torch-ext/moe_dispatch/configs/<device_key>.json)")
    p.add_argument("--history", default=None,
                   help="tuning log to append this run to (default docs/results/tuning-<device_key>.json, or "
                        "tuning-<device_key>.json beside --out when --out is given)")
    p.add_argument("--base", default=None,
                   help="table to start from (default: --out if it exists, else the package's table for this device, "
                        "else configs/default.json)")
    p.add_argument("--generic-from", default=None,
                   help="general: also use this model's tuned buckets as the table's generic `buckets`")
    p.add_argument("--fp8", action="store_true",
                   help="decode: block-scaled float8 weights (the fp8 decode entry)")
    p.add_argument("--mxfp4", action="store_true",
                   help="general, decode: MXFP4 weights as GPT-OSS stores them (the table's mxfp4 section)")
    p.add_argument("--persistent", action="store_true",
                   help="general, fp8: also try the persistent descriptor kernel's tiles from BLOCK_M 64 (SM90)")
    p.add_argument("--block-m", default="", help="general, fp8: comma list of BLOCK_M tried in place of the path's "
                   "(the table's tiles are timed as the baseline either way)")
    p.add_argument("--max-assignments", type=int, default=256,
                   help="decode: largest T * top_k tuned (at most tiles.MAX_DECODE_ASSIGNMENTS)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(harness.DTYPES),
                   help="activations and float weights (general, decode, backward)")
    p.add_argument("--select", default=None, choices=SELECTS,
                   help="the timing that ranks candidates: plain (do_bench, L2 flushed, plain launches), flushed "
                        "(one-call CUDA-graph replays after an L2 flush), hot (do_bench_cudagraph: repeated calls, no "
                        "flush) or kernels (the profiler's sum of kernel times); default: the path's (general and "
                        "backward plain, decode hot, fp8 flushed up to T = 16 and hot above)")
    p.add_argument("--warmup-ms", type=float, default=5.0)
    p.add_argument("--rep-ms", type=float, default=25.0, help="timing window of each measurement")
    p.add_argument("--check-rows", type=int, default=128, help="rows checked per T (all up to this T)")
    p.add_argument("--max-candidates", type=int, default=None, help="first N candidates of each stage only")
    p.add_argument("--finalists", type=int, default=3, help="candidates re-timed beside the baseline")
    p.add_argument("--pairs", type=int, default=16,
                   help="alternating re-timings of the finalists and the baseline (0: the brief timings decide)")
    p.add_argument("--min-gain", type=float, default=None,
                   help="relative gain a winner needs over the baseline (default: the path's)")
    p.add_argument("--profile", action="store_true",
                   help="on a GPU: per-kernel times of the baseline and the winner at each T, into the log")
    p.add_argument("--budget-s", type=float, default=None, help="start no new unit or candidate after this many s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shrunk", action="store_true", help="interpreter-sized shapes (model_shapes.shrunk)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="plumbing run: --device cpu --shrunk, the path's smoke T, two candidates per stage, two pairs")
    p.epilog = "default tokens: " + "; ".join(f"{name} {','.join(map(str, spec.tokens))} (smoke "
                                                 f"{','.join(map(str, spec.smoke_tokens))})"
                                                 for name, spec in PATHS.items())
    args = p.parse_args(argv)
    spec = PATHS[args.path]
    if args.cpu_smoke:
        args.device, args.shrunk = "cpu", True
        args.max_candidates = args.max_candidates or SMOKE_CANDIDATES
        args.pairs = min(args.pairs, SMOKE_PAIRS)
    if args.cpu_smoke and args.out is None:
        p.error("--cpu-smoke needs --out (a plumbing run must not rewrite the package's interpreter table)")
    if args.fp8 and args.path != "decode":
        p.error("--fp8 is the decode path's (the fp8 path always runs float8 weights)")
    if args.mxfp4 and (args.path not in ("general", "decode") or args.fp8):
        p.error("--mxfp4 is the general and decode paths' (and not with --fp8)")
    args.models = args.models or (MXFP4_MODELS if args.mxfp4 else spec.models)
    if args.tokens is None:
        args.tokens = spec.smoke_tokens if args.cpu_smoke else spec.tokens
    else:
        args.tokens = tuple(int(t) for t in args.tokens.split(",") if t)
    args.block_m = tuple(int(m) for m in args.block_m.split(",") if m)
    args.min_gain = spec.min_gain if args.min_gain is None else args.min_gain
    return args


MXFP4_MODELS = "gpt-oss-120b,gpt-oss-20b"  # the models that ship MXFP4 experts


# The timings a candidate can be ranked by, and which paired replay re-times each (the hot or the flushed graph).
SELECTS = ("plain", "flushed", "hot", "kernels")
PAIRED_KIND = {"plain": "flushed", "flushed": "flushed", "hot": "hot", "kernels": "hot"}


class GpuTimer:
    """Brief timings in ms (`time(fn, select)`, SELECTS) and the paired re-timing (`paired`) on a GPU."""

    def __init__(self, warmup_ms, rep_ms):
        self.events = harness.EventTimer(warmup_ms, rep_ms, rep_ms)

    def time(self, fn, select):
        if select == "kernels":
            return sum(harness.kernel_times(fn, calls=10).values()) / 1e3
        return {"plain": self.events.plain, "flushed": self.events.graph, "hot": self.events.hot}[select](fn)

    def paired(self, fns, pairs, select):
        times = harness.paired_graph_times(fns, pairs)[PAIRED_KIND[select]]
        return {name: [us / 1e3 for us in series] for name, series in times.items()}


class CpuTimer:
    """The CPU stand-in (plumbing runs): wall-clock medians for every timing; no graphs."""

    def __init__(self):
        self.wall = harness.WallTimer()

    def time(self, fn, select):
        return self.wall.plain(fn)


def paired_times(timer, fns, pairs, select):
    """{name: [ms per pair]}: the timer's paired replays, or without them its brief timing in alternating order."""
    if hasattr(timer, "paired"):
        return timer.paired(fns, pairs, select)
    times = {name: [] for name in fns}
    for order in harness.alternating_orders(fns, pairs):
        for name in order:
            times[name].append(timer.time(fns[name], select))
    return times


# Tiles from the candidate data.


def gemm_tile(tiles_module, values):
    """A tiles.GemmTile from (block_n, block_k, num_warps, num_stages, group_m[, Persistent member name])."""
    block_n, block_k, num_warps, num_stages, group_m, *persistent = values
    kind = tiles_module.Persistent[persistent[0]] if persistent else tiles_module.Persistent.OFF
    return tiles_module.GemmTile(block_n, block_k, num_warps, num_stages, group_m, kind)


def tiles_text(tiles):
    """One short line: bm<BLOCK_M> gu n/k/warps/stages/group_m[/persistent][/r<maxnreg>] dn ...; decode: the kernels'
    fields (/split_k where it is not 1); backward: the weight-gradient tile, then the GEMMs'."""
    def fields(tile):
        values = [f"r{getattr(tile, f.name)}" if f.name == "maxnreg" else getattr(tile, f.name)
                  for f in dataclasses.fields(tile)
                  if not (f.name in ("persistent", "split_k", "maxnreg") and getattr(tile, f.name) == f.default)]
        return "/".join(str(getattr(v, "name", v)).lower() for v in values)

    if isinstance(tiles, BackwardTiles):
        return f"wgrad {fields(tiles.weight)} | {tiles_text(tiles.tiles)}"
    head = f"bm{tiles.block_m} " if hasattr(tiles, "block_m") else "decode "
    return f"{head}gu {fields(tiles.gate_up)} dn {fields(tiles.down)}"


def tiles_dict(tiles):
    """The tiles as the table holds them (the package's own to_dict, so its field encoding is the table's)."""
    if isinstance(tiles, BackwardTiles):
        return {"tiles": tiles.tiles.to_dict(), "weight_tile": dataclasses.asdict(tiles.weight)}
    return tiles.to_dict()


def smem_limit(device):
    if device.type != "cuda":
        return SMEM_FALLBACK
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", None) or SMEM_FALLBACK


def rows_per_expert(num_tokens, top_k, num_experts):
    return -(-num_tokens * top_k // num_experts)


def shape_key(shape):
    """"E,F,H": the key of a model's per-shape bucket lists in the tile tables (host/tiles.py)."""
    return f"{shape.num_experts},{shape.ffn},{shape.hidden}"


# Units, cases and the sweep every path shares.


@dataclasses.dataclass
class Unit:
    """What one sweep tunes: a model shape and the token counts scored together; `key` is the table key they share
    (rows per expert, N = T * top_k or T, by path)."""

    shape: object
    tokens: tuple
    key: int


@dataclasses.dataclass
class Case:
    """One T of a unit: `call(tiles)` gives a complete call under forced tiles, `error(output)` its relative error
    (rejected above `tolerance`)."""

    tokens: int
    call: object
    error: object
    tolerance: float


@dataclasses.dataclass
class Trial:
    candidate: object  # the tiles as the path runs them
    stage: str  # the first stage that asked for it
    stages: set = dataclasses.field(default_factory=set)  # every stage that did
    ms: dict | None = None  # {T: ms} of the brief timing, None when rejected
    error: str | None = None
    rel_err: float | None = None  # the worst over the unit's T
    score: float = math.inf  # mean over T of log(ms / the baseline's)
    retimed: float | None = None  # the same from the paired re-timing

    def record(self):
        out = {"stage": self.stage, "tiles": tiles_text(self.candidate)}
        if self.ms is not None:
            out["us"] = {str(t): round(ms * 1e3, 2) for t, ms in self.ms.items()}
        if self.rel_err is not None:
            out["rel_err"] = self.rel_err
        if self.error is not None:
            out["error"] = self.error
        if self.retimed is not None:
            out["retimed_ratio"] = math.exp(self.retimed)
        return out


class Run:
    """One tuner call: arguments, the package, the device, the timer, the budget."""

    def __init__(self, args, kernel, timer, device):
        self.args, self.kernel, self.timer, self.device = args, kernel, timer, device
        self.modules = {name.rpartition(".")[2]: importlib.import_module(f"{kernel.__name__}.{name}")
                        for name in ("host.tiles", "host.device", "formats.fp8", "gemm.w8a8", "gemm.planner")}
        self.tiles = self.modules["tiles"]
        self.started = time.monotonic()
        self.spec = PATHS[args.path]

    def spent(self):
        return self.args.budget_s is not None and time.monotonic() - self.started > self.args.budget_s

    def select(self, num_tokens):
        return self.args.select or self.spec.select(num_tokens)

    def candidates(self, made):
        return made[:self.args.max_candidates] if self.args.max_candidates else made


def tune_unit(run, spec, unit, prob, base_table):
    """The sweep of the module doc on one unit; returns its log record (winner, times, every trial)."""
    cases = [spec.case(run, prob, t) for t in unit.tokens]
    trials = {}

    def measure(candidate, stage):
        candidate = spec.as_run(run, prob, candidate)
        if candidate in trials:
            trials[candidate].stages.add(stage)
            return trials[candidate]
        trial = trials[candidate] = Trial(candidate, stage, {stage})
        ms, worst = {}, 0.0
        try:
            for case in cases:
                fn = case.call(candidate)
                err = case.error(fn())
                worst = max(worst, err)
                if not err <= case.tolerance:
                    raise ValueError(f"rel err {err:.2e} > {case.tolerance}")
                ms[case.tokens] = run.timer.time(fn, run.select(case.tokens))
            trial.ms = ms
        except Exception as exc:  # out of shared memory or registers, a compile error, off the reference
            trial.error = harness.error_text(exc)
            print(f"    rejected {tiles_text(candidate)}: {trial.error[:160]}", flush=True)
            if run.device.type == "cuda":
                torch.cuda.synchronize()
            harness.free_memory(run.device)
        trial.rel_err = worst
        return trial

    record = {"model": unit.shape.name, "shape": shape_key(unit.shape), spec.key_name: unit.key,
              "tokens": list(unit.tokens), "select": {str(t): run.select(t) for t in unit.tokens}}
    base = measure(spec.baseline(run, unit, prob), "table")
    record["table"] = tiles_dict(base.candidate)
    if base.ms is None:
        record["error"] = f"the table's tiles fail: {base.error}"
        record["tried"] = [base.record()]
        return record
    base.score = 0.0

    def score(ms):
        return sum(math.log(ms[t] / base.ms[t]) for t in ms) / len(ms)

    held = base if spec.held(base.candidate) else None
    for stage, make in spec.stages(run, unit, prob, base_table, base.candidate):
        for candidate in run.candidates(make(held.candidate if held is not None else None)):
            if run.spent():
                record["cut"] = "budget"
                break
            trial = measure(candidate, stage)
            if trial.ms is not None:
                trial.score = score(trial.ms)
        eligible = [t for t in trials.values() if t.ms is not None and spec.held(t.candidate)]
        held = min(eligible, key=lambda t: t.score) if eligible else None
        if "cut" in record:
            break

    ranked = sorted((t for t in trials.values() if t is not base and t.ms is not None), key=lambda t: t.score)
    finalists = ranked[:max(run.args.finalists, 1)]
    winner = finalists[0] if finalists else None
    final = winner.score if winner else None
    if finalists and run.args.pairs > 0 and not run.spent():
        try:
            ratios = {id(t): [] for t in finalists}
            for case in cases:
                fns = {"table": case.call(base.candidate), **{str(i): case.call(t.candidate)
                                                              for i, t in enumerate(finalists)}}
                times = paired_times(run.timer, fns, run.args.pairs, run.select(case.tokens))
                medians = harness.median_ratios(times, "table")
                for i, t in enumerate(finalists):
                    ratios[id(t)].append(math.log(medians[str(i)]))
            for t in finalists:
                t.retimed = sum(ratios[id(t)]) / len(ratios[id(t)])
            winner = min(finalists, key=lambda t: t.retimed)
            final = winner.retimed
            record["retimed"] = {"pairs": run.args.pairs, "finalists": len(finalists)}
        except Exception as exc:  # noqa: BLE001 (a replay that cannot be captured: the brief timings decide)
            record["retimed"] = {"error": harness.error_text(exc)}
            if run.device.type == "cuda":
                torch.cuda.synchronize()
    gain = math.exp(-final) - 1 if final is not None else None
    chosen = winner if winner is not None and gain > run.args.min_gain else base
    record.update(best=tiles_dict(chosen.candidate), changed=chosen is not base, gain=gain,
                  winner=tiles_dict(winner.candidate) if winner else None,
                  table_us={str(t): round(ms * 1e3, 2) for t, ms in base.ms.items()},
                  best_us={str(t): round(ms * 1e3, 2) for t, ms in chosen.ms.items()},
                  tried=[t.record() for t in trials.values()])
    record["_trials"] = list(trials.values())  # (kept in memory for the table writers, not logged)
    record["_chosen"] = chosen.candidate
    if run.args.profile and run.device.type == "cuda":
        record["kernels_us"] = {name: {str(c.tokens): harness.kernel_times(c.call(t.candidate)) for c in cases}
                                for name, t in (("table", base), ("best", chosen))}
    return record


# The paths.


class TunerPath:
    """What every path shares unless it says otherwise: a winner must gain 2%, one model's tensors at a time (models
    outside, T inside), plain timing, a candidate runs as it is, and every stage may start from any candidate."""

    min_gain = 0.02
    tokens_first = False  # models outside: one model's tensors at a time

    @staticmethod
    def select(num_tokens):
        """The timing mode (harness) of a cell of `num_tokens` tokens."""
        return "plain"

    @staticmethod
    def cell(run, prob, num_tokens):
        """(x, ids, weights, seed) of a cell: the problem's first `num_tokens` rows and their random routing, seeded by
        the run's seed and T, so every candidate of a cell sees the same tokens."""
        seed = run.args.seed * 1000003 + num_tokens
        shape = prob.shape
        ids, weights = harness.random_routing(num_tokens, shape.num_experts, shape.top_k, run.device, seed)
        return prob.x[:num_tokens], ids, weights, seed

    @staticmethod
    def mxfp4_case(run, prob, num_tokens):
        """A cell of --mxfp4: GPT-OSS's experts on the MXFP4 blocks (harness.Mxfp4Weights.call_kwargs) against the
        float64 experts on their dequantized values."""
        x, ids, weights, seed = TunerPath.cell(run, prob, num_tokens)
        rows = harness.check_rows(num_tokens, run.args.check_rows, run.device, seed)
        ref = harness.mxfp4_reference(prob.weights, x[rows], ids[rows], weights[rows])
        return Case(num_tokens,
                    lambda tiles: lambda: run.kernel.fused_experts(x, topk_ids=ids, topk_weights=weights,
                                                                   validate=False, tiles=tiles,
                                                                   **prob.weights.call_kwargs()),
                    lambda out: reference.relative_error(out[rows], ref), reference.TOLERANCE[prob.dtype])

    @staticmethod
    def as_run(run, prob, tiles):
        """What the path runs for `tiles` (the same tiles, unless a path normalises them)."""
        return tiles

    @staticmethod
    def held(tiles):
        """Whether a stage may start from `tiles`."""
        return True


class GeneralPath(TunerPath):
    """The four-launch forward's GEMM tiles, per bucket of rows per expert (see the module doc)."""

    name = "general"
    models, tokens, smoke_tokens = "all", harness.ALL_TOKENS, (2, 8)
    key_name = "max_rows_per_expert"

    @staticmethod
    def units(run, shape, tokens):
        buckets = {}
        for t in tokens:
            buckets.setdefault(rows_per_expert(t, shape.top_k, shape.num_experts), []).append(t)
        return [Unit(shape, tuple(ts), rows) for rows, ts in sorted(buckets.items())]

    @staticmethod
    def problem(run, shape, max_tokens):
        if run.args.mxfp4:
            return harness.make_mxfp4_problem(shape, max_tokens, run.device, run.args.seed, run.kernel)
        return harness.make_problem(shape, max_tokens, harness.DTYPES[run.args.dtype], run.device, run.args.seed)

    @staticmethod
    def case(run, prob, num_tokens):
        if run.args.mxfp4:
            return TunerPath.mxfp4_case(run, prob, num_tokens)
        x, ids, weights, seed = TunerPath.cell(run, prob, num_tokens)
        rows = harness.check_rows(num_tokens, run.args.check_rows, run.device, seed)
        ref = reference.fused_experts_ref(x[rows], prob.w_gate_up, prob.w_down, ids[rows], weights[rows])
        return Case(num_tokens,
                    lambda tiles: lambda: run.kernel.fused_experts(x, prob.w_gate_up, prob.w_down, ids, weights,
                                                                   tiles=tiles),
                    lambda out: reference.relative_error(out[rows], ref), reference.TOLERANCE[prob.dtype])

    @staticmethod
    def baseline(run, unit, prob):
        shape = unit.shape
        return run.tiles.select_tiles(run.device, max(unit.tokens), shape.top_k, shape.num_experts, shape.ffn,
                                      shape.hidden, prob.dtype, mxfp4=run.args.mxfp4)

    @staticmethod
    def block_m_candidates(rows):
        if rows <= 8:
            return (16,)
        if rows <= 32:
            return (16, 32)
        if rows <= 64:
            return (32, 64)
        return (64, 128)

    @classmethod
    def gemm_candidates(cls, run, block_m, gemm):
        tiles_module, limit = run.tiles, smem_limit(run.device)
        regime = "small" if block_m <= 32 else "mid" if block_m <= 64 else "large"
        values = (MXFP4_GENERAL_TILES if run.args.mxfp4 else GENERAL_TILES)[regime]
        if run.args.persistent and block_m >= 64 and not run.args.mxfp4:
            values = values + GENERAL_PERSISTENT[gemm]
        b_tiles = 2 if gemm == "gate_up" else 1  # gate and up weight tiles per K step
        weight_bytes = 0.5 if run.args.mxfp4 else 2  # per weight value (an MXFP4 byte holds two)
        return [gemm_tile(tiles_module, v) for v in values
                if v[3] * (block_m * v[1] * 2 + b_tiles * v[1] * v[0] * weight_bytes) <= limit]

    @classmethod
    def stages(cls, run, unit, prob, base_table, baseline):
        block_ms = run.args.block_m or cls.block_m_candidates(unit.key)
        table_buckets = cls.section_buckets(run, base_table, shape_key(unit.shape))
        return (
            ("block_m", lambda held: [start_tiles(run.tiles, table_buckets, m, held) for m in block_ms]),
            ("gate_up", lambda held: [dataclasses.replace(held, gate_up=g)
                                      for g in cls.gemm_candidates(run, held.block_m, "gate_up")]),
            ("down", lambda held: [dataclasses.replace(held, down=d)
                                   for d in cls.gemm_candidates(run, held.block_m, "down")]),
            ("gate_up maxnreg", lambda held: register_cap_candidates(held, "gate_up")),
            ("down maxnreg", lambda held: register_cap_candidates(held, "down")),
        )

    @staticmethod
    def section_buckets(run, table, key):
        """The buckets the package reads for shape `key` (tiles.select_tiles): the shape's, else the generic ones; with
        --mxfp4 the "mxfp4" section's first, else the float weights' (without their persistent kernels: the pointer
        kernel is the one that reads MXFP4)."""
        mxfp4 = table.get("mxfp4", {}) if run.args.mxfp4 else {}
        buckets = (mxfp4.get("shapes", {}).get(key) or mxfp4.get("buckets")
                   or table.get("shapes", {}).get(key) or table.get("buckets", []))
        if not run.args.mxfp4:
            return buckets
        return [{k: {f: v for f, v in g.items() if f != "persistent"} if k in ("gate_up", "down") else g
                 for k, g in b.items()} for b in buckets]

    @classmethod
    def table(cls, run, base, records):
        """The base table with each unit's chosen tiles as the bucket ending at its rows per expert (tune's merge),
        and the table's head (device, measured, note); with --mxfp4 into the "mxfp4" section's shapes."""
        table = copy.deepcopy(base)
        key = run.modules["device"].device_key(run.device)
        # a measured base keeps its note (it says where each earlier part of the table came from)
        note = base.get("note") if base.get("measured") else None
        table.update({"device": key, "measured": True,
                      "note": note or f"measured by scripts/tune; the runs are logged in docs/results/tuning-{key}"
                                           ".json"})
        section = table.setdefault("mxfp4", {}) if run.args.mxfp4 else table
        section.setdefault("shapes", {})
        for record in records:
            if "best" not in record:
                continue
            buckets = [dict(b) for b in cls.section_buckets(run, table, record["shape"]) if "max_rows_per_expert" in b]
            entry = {"max_rows_per_expert": record["max_rows_per_expert"], **record["best"]}
            section["shapes"][record["shape"]] = merge_bucket(buckets, entry)
            if run.args.generic_from == record["model"]:
                section["buckets"] = section["shapes"][record["shape"]]
        return table


def start_tiles(tiles_module, buckets, block_m, held):
    """The table's tiles of a bucket with this BLOCK_M (its N tiles and warps were chosen for it), else `held` with
    BLOCK_M replaced."""
    if held.block_m == block_m:
        return held
    bucket = next((b for b in buckets if b["block_m"] == block_m), None)
    return tiles_module.MoeTiles.from_dict(bucket) if bucket else dataclasses.replace(held, block_m=block_m)


def merge_bucket(buckets, entry):
    """Replace the entry with the same max_rows_per_expert (or add it), keep the list sorted."""
    kept = [b for b in buckets if b["max_rows_per_expert"] != entry["max_rows_per_expert"]]
    return sorted(kept + [entry], key=lambda b: b["max_rows_per_expert"])


class Fp8Path(TunerPath):
    """The w8a8 path's tiles (gemm/w8a8.py) per (model, T), on block-scaled float8 weights (see the module doc)."""

    name = "fp8"
    models = "mixtral-8x7b,qwen3-30b-a3b,deepseek-v3,gpt-oss-120b,qwen2-57b-a14b,mixtral-8x22b"  # important first
    tokens, smoke_tokens = (1, 4, 16, 128, 1024, 4096), (1, 40)
    min_gain = 0.03
    tokens_first = True  # T outside: a run cut short has every model's first T (list the important T first)
    key_name = "rows_per_expert"
    DECODE_MAX_T = 16  # decode cells: a few experts' fp8 weights fit the L2, warm in a hot timing, never when served

    @classmethod
    def select(cls, num_tokens):
        return "flushed" if num_tokens <= cls.DECODE_MAX_T else "hot"

    @staticmethod
    def units(run, shape, tokens):
        return [Unit(shape, (t,), rows_per_expert(t, shape.top_k, shape.num_experts)) for t in tokens]

    @staticmethod
    def problem(run, shape, max_tokens):
        prob = harness.make_fp8_problem(shape, max_tokens, run.device, run.args.seed, run.kernel)
        prob.w_gate_up = prob.w_down = None  # the bf16 originals: the check uses the dequantized fp8 weights
        return prob

    @staticmethod
    def case(run, prob, num_tokens):
        x, ids, weights, seed = TunerPath.cell(run, prob, num_tokens)
        rows = harness.check_rows(num_tokens, run.args.check_rows, run.device, seed)
        ref = harness.fp8_reference(prob, x, ids, weights, rows)
        return Case(num_tokens,
                    lambda tiles: lambda: run.kernel.fused_experts(x, prob.q_gate_up, prob.q_down, ids, weights,
                                                                   validate=False, tiles=tiles, fp8_compute="w8a8",
                                                                   **prob.scales),
                    lambda out: reference.relative_error(out[rows], ref), reference.W8A8_TOLERANCE)

    @staticmethod
    def baseline(run, unit, prob):
        shape = unit.shape
        return run.tiles.select_fp8_tiles(run.device, unit.tokens[0], shape.top_k, shape.num_experts, shape.ffn,
                                          shape.hidden)

    @staticmethod
    def as_run(run, prob, tiles):
        """What the path runs for `tiles` (gemm.w8a8.w8a8_tiles: BLOCK_K is the activation group, GEMM1's BLOCK_N a
        multiple of GEMM2's group), so that each distinct configuration is measured once."""
        scales = tuple(run.modules["fp8"].WeightScale.of(prob.scales[name], "block", harness.FP8_BLOCK,
                                                         transposed=False)
                       for name in ("w_gate_up_scale", "w_down_scale"))
        return run.modules["w8a8"].w8a8_tiles(tiles, *scales)

    @staticmethod
    def block_m_candidates(rows):
        """BLOCK_M the rows per expert fill (a power of two in 16..128), half and twice that, and 64: the smallest tile
        sm_90 runs on wgmma unswapped (below it the pointer kernel swaps its operands where BLOCK_N >= 64, else the
        fp8 dots take mma.sync with the operands converted to fp16: planner.w8a8_gemm_kernel)."""
        fill = min(128, max(16, 1 << (rows - 1).bit_length()))
        return sorted({m for m in (fill // 2, fill, 2 * fill, 64) if 16 <= m <= 128})

    @staticmethod
    def gemm_candidates(run, block_m, gemm):
        regime = "small" if block_m < 64 else "mid" if block_m == 64 else "large"
        values = FP8_TILES[gemm][regime]
        if run.args.persistent and block_m >= 64:
            values = values + tuple(v + ("ON",) for v in values)
        return [gemm_tile(run.tiles, v) for v in values]

    @classmethod
    def stages(cls, run, unit, prob, base_table, baseline):
        fp8 = base_table.get("fp8", {})
        table_buckets = fp8.get("shapes", {}).get(shape_key(unit.shape)) or fp8.get("buckets", [])
        block_ms = run.args.block_m or cls.block_m_candidates(unit.key)

        def with_gate_up(held, tile):
            """A pointer gate_up candidate narrower than the held down GEMM's group takes the group down to its BLOCK_N
            (w8a8_tiles would otherwise round the BLOCK_N up to the group); a persistent one keeps both (a pass
            quantizes its intermediate: gemm.w8a8.w8a8_gemm1)."""
            tiles = dataclasses.replace(held, gate_up=tile)
            if not tile.persistent and tiles.down.block_k > tile.block_n:
                tiles = dataclasses.replace(tiles, down=dataclasses.replace(tiles.down, block_k=tile.block_n))
            return tiles

        return (
            ("block_m", lambda held: [start_tiles(run.tiles, table_buckets, m, held) for m in block_ms]),
            ("gate_up", lambda held: [with_gate_up(held, g) for g in cls.gemm_candidates(run, held.block_m,
                                                                                          "gate_up")]),
            ("down", lambda held: [dataclasses.replace(held, down=d)
                                   for d in cls.gemm_candidates(run, held.block_m, "down")]),
            ("gate_up maxnreg", lambda held: register_cap_candidates(held, "gate_up")),
            ("down maxnreg", lambda held: register_cap_candidates(held, "down")),
        )

    @staticmethod
    def table(run, base, records):
        """The base table with the winners written into the "fp8" section's per-shape buckets (patched_table, split)."""
        cells = [{"shape": r["shape"], "rows_per_expert": r["rows_per_expert"], "gain": r["gain"],
                  "best_tiles": r["winner"]} for r in records if r.get("winner") is not None]
        return patched_table(base, cells, run.args.min_gain)


# Register caps (GemmTile.maxnreg) the general and fp8 paths try on each GEMM once its tile is chosen, by its warps:
# the caps at which 2 or 3 (4 warps: 4 or 5) programs' threads fit an SM's 64K registers. Measured on MXFP4 GPT-OSS
# (docs/performance.md, MXFP4 experts): lower caps fail in ptxas or spill on 128-row tiles.
REGISTER_CAPS = {4: (128, 96), 8: (128, 80, 64)}


def register_cap_candidates(held, gemm):
    """`held` with its `gemm` tile under each cap of REGISTER_CAPS for its warps (none it already has)."""
    tile = getattr(held, gemm)
    return [dataclasses.replace(held, **{gemm: dataclasses.replace(tile, maxnreg=cap)})
            for cap in REGISTER_CAPS.get(tile.num_warps, ()) if cap != tile.maxnreg]


def bucket_index(buckets, rows):
    """Index of the bucket `rows` per expert select (host/tiles.py: the first with rows <= its max, else the last)."""
    return next((i for i, b in enumerate(buckets) if rows <= b["max_rows_per_expert"]), len(buckets) - 1)


def bucket_tiles(bucket):
    """A bucket's tiles: the entry without its bound (max_rows_per_expert, or the decode entry's max_assignments) and
    without an FP8 decode bucket's "auto" (host/tiles.py: what fp8_compute="auto" runs there; not measured here)."""
    return {k: v for k, v in bucket.items() if k not in ("max_rows_per_expert", "max_assignments", "auto")}


def patched_table(table, cells, min_gain):
    """The table with the winning cells' tiles (`best_tiles`, where `gain` > `min_gain`) written into the "fp8"
    section's bucket list of their shape (created from the generic list where the shape had none; a table without an
    "fp8" section first gets the buckets that path borrows: the bf16 ones with BLOCK_K 128).

    In shapes that have a winner, every measured cell's rows per expert becomes a bucket boundary: winners get their
    tiles up to their rows, the other cells keep the tiles the table gave them, so a winner never changes what another
    measured T runs; neighbours with equal tiles are then merged."""
    table = copy.deepcopy(table)
    lent = [{**b, **{g: {**b[g], "block_k": 128} for g in ("gate_up", "down")}} for b in table["buckets"]]
    entry = table.setdefault("fp8", {"buckets": lent})
    measured = [c for c in cells if c.get("gain") is not None]
    for key in dict.fromkeys(c["shape"] for c in measured if c["gain"] > min_gain):
        buckets = entry.setdefault("shapes", {}).setdefault(key, copy.deepcopy(entry["buckets"]))
        chosen = {}  # bucket boundary -> the cell of the largest gain there
        for c in measured:
            if c["shape"] == key and (c["rows_per_expert"] not in chosen
                                      or chosen[c["rows_per_expert"]]["gain"] < c["gain"]):
                chosen[c["rows_per_expert"]] = c
        for c in sorted(chosen.values(), key=lambda c: c["rows_per_expert"]):
            index = bucket_index(buckets, c["rows_per_expert"])
            bucket = buckets[index]
            tiles = c["best_tiles"] if c["gain"] > min_gain else bucket_tiles(bucket)
            if c["rows_per_expert"] < bucket["max_rows_per_expert"]:
                buckets.insert(index, {"max_rows_per_expert": c["rows_per_expert"], **tiles})
            else:
                buckets[index] = {"max_rows_per_expert": bucket["max_rows_per_expert"], **tiles}
        merged = []
        for bucket in buckets:
            if merged and bucket_tiles(merged[-1]) == bucket_tiles(bucket):
                merged[-1] = bucket  # one bucket covers both
            else:
                merged.append(bucket)
        buckets[:] = merged
    return table


class DecodePath(TunerPath):
    """The decode path's tiles (gemm/decode.py) per (model, T) against the general path (see the module doc)."""

    name = "decode"
    models, tokens, smoke_tokens = "all", (1, 2, 4, 8, 16, 32), (1, 2)
    min_gain = 0.0  # the decode path must be faster, by any margin
    tokens_first = True  # T outside: a run cut short has every model's smallest T
    key_name = "assignments"

    @staticmethod
    def select(num_tokens):
        return "hot"  # decode steps run as graph replays

    @staticmethod
    def units(run, shape, tokens):
        limit = min(run.args.max_assignments, run.tiles.MAX_DECODE_ASSIGNMENTS)
        return [Unit(shape, (t,), t * shape.top_k) for t in tokens if t * shape.top_k <= limit]

    @staticmethod
    def problem(run, shape, max_tokens):
        if run.args.fp8:
            return harness.make_fp8_problem(shape, max_tokens, run.device, run.args.seed, run.kernel)
        if run.args.mxfp4:
            return harness.make_mxfp4_problem(shape, max_tokens, run.device, run.args.seed, run.kernel)
        return harness.make_problem(shape, max_tokens, harness.DTYPES[run.args.dtype], run.device, run.args.seed)

    @staticmethod
    def case(run, prob, num_tokens):
        if run.args.mxfp4:
            return TunerPath.mxfp4_case(run, prob, num_tokens)
        x, ids, weights, _ = TunerPath.cell(run, prob, num_tokens)
        if run.args.fp8:
            operands = dict(w_gate_up=prob.q_gate_up, w_down=prob.q_down, **prob.scales)
            ref = reference.fused_experts_fp8_ref(x, prob.q_gate_up, prob.q_down, ids, weights, experts_per_chunk=16,
                                                  **prob.scales)
            tolerance = reference.W8A8_TOLERANCE
        else:
            operands = dict(w_gate_up=prob.w_gate_up, w_down=prob.w_down)
            ref = reference.fused_experts_ref(x, prob.w_gate_up, prob.w_down, ids, weights)
            tolerance = reference.TOLERANCE[prob.x.dtype]
        return Case(num_tokens,
                    lambda tiles: lambda: run.kernel.fused_experts(x, topk_ids=ids, topk_weights=weights,
                                                                   validate=False, tiles=tiles, **operands),
                    lambda out: reference.relative_error(out, ref), tolerance)

    @staticmethod
    def baseline(run, unit, prob):
        """The four-launch path with the table's tiles (the w8a8 path's "fp8" ones for float8 weights, the "mxfp4"
        section's for MXFP4 ones)."""
        shape, T = unit.shape, unit.tokens[0]
        if run.args.fp8:
            return run.tiles.select_fp8_tiles(run.device, T, shape.top_k, shape.num_experts, shape.ffn, shape.hidden)
        return run.tiles.select_tiles(run.device, T, shape.top_k, shape.num_experts, shape.ffn, shape.hidden,
                                      prob.x.dtype, mxfp4=run.args.mxfp4)

    @staticmethod
    def held(tiles):
        return not hasattr(tiles, "block_m")  # a stage starts from the best decode tiles, never the general path's

    @staticmethod
    def fits(tile, block_t, smem, gated):
        """The pipeline's shared memory (2-byte elements): x tile plus gate and up tiles, the down dot's intermediate
        and weight tiles, or the GEMVs' weight tiles."""
        rows = block_t + 2 * tile.block_n if gated else tile.block_n + (block_t if tile.dot else 0)
        if tile.gemv:  # the gate/up GEMV: gate and up rows of the weight, no x tile
            rows = 2 * tile.block_n
        return tile.num_stages * rows * tile.block_k * 2 <= smem

    @classmethod
    def stages(cls, run, unit, prob, base_table, baseline):
        """The gate/up kernel's candidates with the down kernel's first held, then the down kernel's with the best
        gate/up tile held (two launches whose times add: the sum of the lists is measured, not their product)."""
        decode_tile, smem = run.tiles.DecodeTile, smem_limit(run.device)
        block_t = max(16, 1 << (unit.tokens[0] - 1).bit_length())
        candidates = MXFP4_DECODE_TILES if run.args.mxfp4 else DECODE_TILES
        gate_ups = [decode_tile(*v) for v in candidates["gate_up"]]
        downs = [decode_tile(*v) for v in candidates["down"]]
        return (
            ("gate_up", lambda held: [run.tiles.DecodeTiles(g, downs[0]) for g in gate_ups
                                      if cls.fits(g, block_t, smem, gated=True)]),
            ("down", lambda held: [] if held is None else [run.tiles.DecodeTiles(held.gate_up, d) for d in downs
                                                          if cls.fits(d, block_t, smem, gated=False)]),
        )

    @classmethod
    def table(cls, run, base, records):
        entry = cls.entry([r for r in records if "best" in r])
        if run.args.fp8:
            return dict(base, fp8=dict(base.get("fp8", {}), decode=entry))
        if run.args.mxfp4:
            return dict(base, mxfp4=dict(base.get("mxfp4", {}), decode=entry))
        return dict(base, decode=entry)

    @classmethod
    def entry(cls, records):
        """The `decode` entry (host/tiles.py) from the units' records: per shape, buckets up to the largest N where the
        decode path won at every measured T up to it (equal neighbours merged); one generic bucket up to the smallest
        shape limit, with each kernel's tile best over all cells (mean log time ratio to each cell's best)."""
        shapes, limits = {}, []
        for key in dict.fromkeys(r["shape"] for r in records):
            buckets = []
            for record in sorted((r for r in records if r["shape"] == key), key=lambda r: r["tokens"][0]):
                if not record["changed"]:
                    break  # the general path wins (or was not measured) from here on
                bucket = {"max_assignments": record["assignments"], **record["best"]}
                if buckets and bucket_tiles(buckets[-1]) == record["best"]:
                    buckets[-1] = bucket  # same tiles as the bucket below: one bucket covers both
                else:
                    buckets.append(bucket)
            shapes[key] = buckets
            limits.append(buckets[-1]["max_assignments"] if buckets else 0)
        generic = []
        if limits and min(limits) > 0:
            best = {kernel: cls.best_over_cells(records, kernel) for kernel in ("gate_up", "down")}
            if all(best.values()):
                generic = [{"max_assignments": min(limits), **{k: dataclasses.asdict(t) for k, t in best.items()}}]
        return {"buckets": generic, "shapes": shapes}

    @staticmethod
    def best_over_cells(records, kernel):
        """The `kernel` tile of least mean log(time / the cell's best time) over the cells where its stage ran; a
        tile that failed in one of them is out."""
        logs, failed = {}, set()
        for record in records:
            runs = [t for t in record["_trials"] if kernel in t.stages]
            timed = [t for t in runs if t.ms is not None]
            if not timed:
                continue
            fastest = min(next(iter(t.ms.values())) for t in timed)
            for t in runs:
                tile = getattr(t.candidate, kernel)
                if t.ms is None:
                    failed.add(tile)
                else:
                    logs.setdefault(tile, []).append(math.log(next(iter(t.ms.values())) / fastest))
        scores = {tile: sum(v) / len(v) for tile, v in logs.items() if tile not in failed}
        return min(scores, key=scores.get) if scores else None


@dataclasses.dataclass(frozen=True)
class BackwardTiles:
    """The experts backward's launch configuration: the input-gradient GEMMs' MoeTiles and the weight-gradient tile."""

    tiles: object
    weight: object


class BackwardPath(TunerPath):
    """The experts backward's tiles per (model, T), the whole backward timed (see the module doc)."""

    name = "backward"
    models, tokens, smoke_tokens = "mixtral-8x7b,qwen3-30b-a3b", (4096,), (8,)
    key_name = "T"

    @staticmethod
    def units(run, shape, tokens):
        return [Unit(shape, (t,), t) for t in tokens]

    problem = GeneralPath.problem

    @staticmethod
    def case(run, prob, num_tokens):
        """The forward's saved pre-activations and dispatch (the experts operator's launches with save_preact), a random
        gradient of the output; `call` runs experts_backward under forced tiles into fresh gradient buffers."""
        shape, device, kernel = prob.shape, run.device, run.kernel
        operator = importlib.import_module(kernel.__name__ + ".experts.operator")
        described = importlib.import_module(kernel.__name__ + ".experts.call").ExpertsCall()
        backward = importlib.import_module(kernel.__name__ + ".backward.experts")
        x, ids, weights, _ = TunerPath.cell(run, prob, num_tokens)
        no_scales = (None, None, None, None)
        _, preact, offsets, gather_idx, scatter_idx = operator.launch_experts(
            x, prob.w_gate_up, None, prob.w_down, ids, weights, None, None, *no_scales, True, described)
        grad_out = torch.randn(x.shape, device=device, generator=torch.Generator(device=device).manual_seed(
            run.args.seed + num_tokens)).to(x.dtype)
        ref = []

        def call(candidate):
            def run_backward():
                grads = backward.ExpertsGrads(x=torch.empty_like(x), w_gate_up=torch.empty_like(prob.w_gate_up),
                                              w_up=None, w_down=torch.empty_like(prob.w_down),
                                              topk_weights=torch.empty_like(weights), gate_up_bias=None,
                                              down_bias=None)
                backward.experts_backward(grad_out, x, prob.w_gate_up, None, prob.w_down,
                                          ids, weights, None, preact, offsets, gather_idx, scatter_idx, grads,
                                          activation="silu", transposed=False, alpha=1.702, limit=7.0,
                                          tiles=candidate.tiles, weight_tile=candidate.weight)
                return grads
            return run_backward

        def error(grads):
            """The worst norm-wise relative difference of the gradients from the baseline's (the first call)."""
            if not ref:
                ref.append(grads)
                return 0.0
            worst = 0.0
            for name in ("x", "w_gate_up", "w_down", "topk_weights"):
                a, b = getattr(grads, name).float(), getattr(ref[0], name).float()
                worst = max(worst, ((a - b).norm() / b.norm().clamp_min(1e-30)).item())
            return worst

        return Case(num_tokens, call, error, reference.TOLERANCE[prob.dtype])

    @staticmethod
    def baseline(run, unit, prob):
        shape = unit.shape
        plan = run.modules["planner"].plan_backward(run.device, unit.tokens[0], shape.top_k, shape.num_experts,
                                                    shape.ffn, shape.hidden, prob.dtype)
        return BackwardTiles(plan.tiles, plan.weight_tile)

    @staticmethod
    def stages(run, unit, prob, base_table, baseline):
        tiles_module = run.tiles
        weights = [tiles_module.WeightGradTile(*v) for v in BACKWARD_WEIGHT_TILES]
        gemms = [tiles_module.MoeTiles(m, gemm_tile(tiles_module, g), gemm_tile(tiles_module, d))
                 for m, g, d in BACKWARD_GEMM_TILES]
        return (
            ("weight_tile", lambda held: [dataclasses.replace(held, weight=w) for w in weights]),
            ("gemm_tiles", lambda held: [dataclasses.replace(held, tiles=t) for t in gemms]),
        )

    @staticmethod
    def table(run, base, records):
        return None  # the backward's tiles are code (tiles.select_weight_grad_tile) and the forward's table


PATHS = {spec.name: spec for spec in (GeneralPath, DecodePath, Fp8Path, BackwardPath)}


# Tables and the tuning log.


def dump_table(table):
    """JSON with one line per bucket (the layout of the hand-written tables)."""
    def buckets_text(buckets, indent):
        pad = " " * indent
        return "[\n" + ",\n".join(pad + "  " + json.dumps(b) for b in buckets) + "\n" + pad + "]"

    def shapes_text(shapes, indent):
        pad = " " * indent
        return "{\n" + ",\n".join(f'{pad}  {json.dumps(k)}: {buckets_text(v, indent + 2)}'
                                    for k, v in shapes.items()) + "\n" + pad + "}"

    lines = []
    for key, value in table.items():
        if key == "buckets":
            lines.append(f'  "buckets": {buckets_text(value, 2)}')
        elif key == "shapes":
            lines.append(f'  "shapes": {shapes_text(value, 2)}')
        elif key in ("decode", "fp8", "mxfp4"):  # host/tiles.py's section entries: the same layout one level down
            parts = []  # (an empty `shapes` is left out)
            for k, v in value.items():
                if k == "shapes" and not v:
                    continue
                text = buckets_text(v, 4) if k == "buckets" else shapes_text(v, 4) if k == "shapes" else json.dumps(v)
                parts.append(f"    {json.dumps(k)}: {text}")
            lines.append(f"  {json.dumps(key)}: {{\n" + ",\n".join(parts) + "\n  }")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def load_base(args, out_path, tiles_module, key):
    """The table a run starts from: --base, else --out where it exists, else the package's table (a copy)."""
    for candidate in (args.base, out_path if out_path.exists() else None):
        if candidate:
            return json.loads(Path(candidate).read_text())
    return json.loads(json.dumps(tiles_module.load_table(key)))


def load_history(path, key):
    """The tuning log of a device: {"device": key, "runs": [...]}, one run per scripts/tune call, oldest first."""
    if path.exists():
        return json.loads(path.read_text())
    return {"device": key, "runs": []}


def write_outputs(out_path, table, history_path, history):
    """The table (runtime data only; none for the backward path) and the tuning log, rewritten after every unit."""
    def public(run):  # the log's first run (the hand-measured table before the tuner) has no units
        if "units" not in run:
            return run
        return {**run, "units": [{k: v for k, v in u.items() if not k.startswith("_")} for u in run["units"]]}

    logged = {**history, "runs": [public(run) for run in history["runs"]]}
    outputs = [(history_path, json.dumps(logged, indent=1) + "\n")]
    if table is not None:
        outputs.append((out_path, dump_table(table)))
    for path, text in outputs:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def summary(records, spec):
    """A markdown table, one row per unit: T, the table's and the winner's times, the gain, the tiles kept."""
    def us(times):
        return " ".join(f"{v:.1f}" for v in times.values())

    key = spec.key_name if spec.key_name != "T" else None  # a unit of one T says it once
    lines = [f"| model | T |{f' {key} |' if key else ''} table us | best us | gain | kept | tiles |",
             "|" + "---|" * (8 if key else 7)]
    for r in records:
        tokens = ",".join(map(str, r["tokens"]))
        if "best" not in r:
            lines.append(f"| {r['model']} | {tokens} |{f' {r.get(key)} |' if key else ''} "
                         f"{r.get('skipped') or r.get('error', '')[:80]} | | | | |")
            continue
        gain = "-" if r["gain"] is None else f"{r['gain'] * 100:+.1f}%"
        kept = "new" if r["changed"] else "table"
        lines.append(f"| {r['model']} | {tokens} |{f' {r[key]} |' if key else ''} {us(r['table_us'])} | "
                     f"{us(r['best_us'])} | {gain}{' (cut)' if r.get('cut') else ''} | {kept} | "
                     f"{tiles_text(r['_chosen'])} |")
    return "\n".join(lines)


def plan_units(run, spec, shapes):
    """[(shape, [units])] in run order: per model (the general and backward paths), or T outside and models inside."""
    args = run.args
    if args.cells:
        per_model = {}
        for cell in args.cells.split(","):
            name, t = cell.split(":")
            per_model.setdefault(name, []).append(int(t))
        models = harness.select_models(",".join(per_model), shapes)
        tokens = {s.name: tuple(sorted(per_model[s.name])) for s in models}
    else:
        models = harness.select_models(args.models, shapes)
        tokens = {s.name: args.tokens for s in models}
    units = [(s, spec.units(run, s, tokens[s.name])) for s in models]
    if not spec.tokens_first:
        return [(shape, [u]) for shape, us in units for u in us]
    order = sorted((u.tokens[0] if args.cells else args.tokens.index(u.tokens[0]), i, u)
                   for i, (shape, us) in enumerate(units) for u in us)
    return [(u.shape, [u]) for _, _, u in order]


def main(argv=None, *, timer=None, kernel=None, shapes=None):
    """Run the tuner; returns the written table (None for the backward path). timer / kernel / shapes let the tests
    stand in a stub timer (`time(fn, select)` in ms, optionally `paired`), a package, tiny shapes."""
    args = parse_args(argv)
    device = harness.benchmark_device(args.device, "--cpu-smoke")
    kernel = kernel if kernel is not None else harness.load_kernel()
    if timer is None:
        timer = GpuTimer(args.warmup_ms, args.rep_ms) if device.type == "cuda" else CpuTimer()
    run = Run(args, kernel, timer, device)
    spec = run.spec
    key = run.modules["device"].device_key(device)
    out_path = Path(args.out) if args.out else ROOT / "torch-ext" / "moe_dispatch" / "configs" / f"{key}.json"
    base = load_base(args, out_path, run.tiles, key)
    if args.history:
        history_path = Path(args.history)
    elif args.out:
        history_path = out_path.with_name(f"tuning-{key}.json")
    else:
        history_path = ROOT / "docs" / "results" / f"tuning-{key}.json"
    history = load_history(history_path, key)
    import triton

    record = {"date": datetime.date.today().isoformat(),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
              "path": args.path, "torch": torch.__version__, "triton": triton.__version__, "dtype": args.dtype,
              "commit": harness.git_commit(),
              "argv": [harness.portable_path(a) for a in (sys.argv[1:] if argv is None else argv)],
              "units": []}  # per unit: the baseline, the winner, their times, every candidate tried
    history["runs"].append(record)
    shapes = shapes if shapes is not None else harness.default_shapes(args.shrunk)
    plan = plan_units(run, spec, shapes)
    max_tokens = {}
    for shape, units in plan:
        max_tokens[shape.name] = max([max_tokens.get(shape.name, 0)] + [t for u in units for t in u.tokens])
    problems = {}
    table = spec.table(run, base, [])
    for shape, units in plan:
        for unit in units:
            if run.spent():
                record["units"].append({"model": shape.name, "shape": shape_key(shape), spec.key_name: unit.key,
                                        "tokens": list(unit.tokens), "skipped": "budget"})
                continue
            if shape.name not in problems:
                if not spec.tokens_first:  # one model's tensors at a time
                    problems.clear()
                    harness.free_memory(device)
                problems[shape.name] = spec.problem(run, shape, max_tokens[shape.name])
            print(f"{shape.name} {spec.key_name}={unit.key} T={','.join(map(str, unit.tokens))} "
                  f"({time.monotonic() - run.started:.0f} s)", flush=True)
            record["units"].append(tune_unit(run, spec, unit, problems[shape.name], base))
            table = spec.table(run, base, record["units"])
            write_outputs(out_path, table, history_path, history)
    write_outputs(out_path, table, history_path, history)
    written = f"table -> {out_path}, " if table is not None else ""
    print(f"{args.path} path: {written}tuning log -> {history_path} ({time.monotonic() - run.started:.0f} s)\n"
          f"{summary(record['units'], spec)}", flush=True)
    return table


if __name__ == "__main__":
    main()
