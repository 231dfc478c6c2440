#!/usr/bin/env python3
"""Regenerate a device's GEMM tile table (torch-ext/moe_dispatch/configs/<device_key>.json) by measurement.

For each model shape (benchmarks/model_shapes.py) the token counts are grouped by rows per expert,
ceil(T * top_k / E), which is what the table is keyed by (tiles.select_tiles). For each such bucket the tuner

  1. times the current table's choice at every T of the bucket (the reference),
  2. for each candidate BLOCK_M (fixed by the rows per expert), sweeps the gate_up GEMM's tiles with the down
     GEMM's held, then the down GEMM's with the best gate_up held (the two are separate launches, so their
     times add),
  3. keeps the candidate with the lowest mean log(time / reference time) over the bucket's T, so T = 1 weighs as
     much as the bucket's largest T, if it beats the current choice by more than --min-gain (noise).

Every candidate's output is checked against the float64 reference (all rows up to 256 tokens, a sample above) and
rejected when it is off or does not compile (e.g. too much shared memory). Buckets the run does not reach keep the
existing table's entries. The table keeps only what the package reads (tiles per bucket); the run itself (the T
measured per bucket, the new and the previous table's times, versions) is appended to a tuning log,
docs/results/tuning-<device_key>.json (beside --out when given). Both files are rewritten after every bucket, so a
run cut short keeps what it measured.

    scripts/tune --models mixtral-8x7b,qwen3-30b-a3b --out "$OUT/NVIDIA_H200.json" --budget-s 400

Cost: every candidate tile compiles once per process (Triton's on-disk cache then serves the other models and
buckets), and each bucket measures about 20-40 candidates; all six models at every power-of-two T is several minutes
of GPU time, so pass --models / --tokens / --budget-s to fit a call.
"""

import argparse
import dataclasses
import datetime
import importlib
import json
import math
import time
from pathlib import Path

import torch

import bench  # scripts/, benchmarks/ and torch-ext/ are on PYTHONPATH (scripts/_env.sh)
import reference
from model_shapes import MODEL_SHAPES

ROOT = Path(__file__).resolve().parent.parent

SMEM_FALLBACK = 227 * 1024  # H100/H200 opt-in shared memory per block, when torch does not report it

# (block_n, block_k, num_warps, num_stages, group_m) per BLOCK_M regime; gate_up tiles load two weight tiles
# (gate and up) per K step, so their shared-memory need is checked with that factor.
SMALL_M = (  # BLOCK_M 16 / 32: weight-streaming, many CTAs, deep pipelines
    (32, 128, 4, 4, 1), (64, 128, 4, 4, 1), (64, 64, 4, 5, 1), (128, 64, 4, 4, 1),
    (32, 256, 4, 3, 1), (64, 256, 4, 3, 1), (128, 128, 4, 3, 1), (128, 128, 8, 3, 1), (256, 64, 4, 4, 1),
)
MID_M = (  # BLOCK_M 64
    (64, 64, 4, 4, 8), (128, 64, 4, 4, 8), (128, 64, 8, 4, 8), (64, 128, 4, 3, 8), (128, 128, 8, 3, 8),
    (256, 64, 8, 3, 8), (256, 64, 8, 4, 8),
)
LARGE_M = (  # BLOCK_M 128: tensor-core bound
    (128, 64, 8, 4, 8), (128, 64, 8, 3, 8), (256, 64, 8, 3, 8), (256, 64, 8, 4, 8), (128, 128, 8, 3, 8),
    (128, 64, 4, 4, 8), (64, 64, 4, 4, 8),
)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="all", help=f"comma list of {', '.join(MODEL_SHAPES)} (default all)")
    p.add_argument("--tokens", default=",".join(str(t) for t in bench.ALL_TOKENS),
                   help="token counts; grouped into buckets by rows per expert")
    p.add_argument("--out", default=None,
                   help="table to write (default torch-ext/moe_dispatch/configs/<device_key>.json)")
    p.add_argument("--history", default=None,
                   help="tuning log to append this run to (default docs/results/tuning-<device_key>.json, or "
                        "tuning-<device_key>.json beside --out when --out is given)")
    p.add_argument("--base", default=None,
                   help="table to start from (default: --out if it exists, else the package's table for this device, "
                        "else configs/default.json)")
    p.add_argument("--generic-from", default=None,
                   help="also use this model's tuned buckets as the table's generic `buckets` (unknown shapes)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(bench.DTYPES))
    p.add_argument("--warmup-ms", type=float, default=5.0)
    p.add_argument("--rep-ms", type=float, default=25.0)
    p.add_argument("--check-rows", type=int, default=128)
    p.add_argument("--max-candidates", type=int, default=None, help="per GEMM and BLOCK_M (smoke runs)")
    p.add_argument("--min-gain", type=float, default=0.02,
                   help="keep the current tiles unless a candidate is this much faster (geometric mean)")
    p.add_argument("--budget-s", type=float, default=None, help="stop starting new buckets after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shrunk", action="store_true", help="interpreter-sized shapes: a plumbing run with --device cpu")
    args = p.parse_args(argv)
    args.tokens = tuple(sorted(int(t) for t in args.tokens.split(",") if t))
    return args


def rows_per_expert(num_tokens, top_k, num_experts):
    return -(-num_tokens * top_k // num_experts)


def buckets_for(shape, tokens):
    """{rows per expert: [T, ...]} in increasing rows order."""
    out = {}
    for t in tokens:
        out.setdefault(rows_per_expert(t, shape.top_k, shape.num_experts), []).append(t)
    return dict(sorted(out.items()))


def block_m_candidates(rows):
    if rows <= 8:
        return (16,)
    if rows <= 32:
        return (16, 32)
    if rows <= 64:
        return (32, 64)
    return (64, 128)


def gemm_candidates(tiles_module, block_m, gated, smem_limit, limit=None):
    table = SMALL_M if block_m <= 32 else MID_M if block_m <= 64 else LARGE_M
    fields = {f.name for f in dataclasses.fields(tiles_module.GemmTile)}
    out = []
    for block_n, block_k, num_warps, num_stages, group_m in table:
        b_tiles = 2 if gated else 1
        if num_stages * (block_m * block_k + b_tiles * block_k * block_n) * 2 > smem_limit:
            continue
        entry = {"block_n": block_n, "block_k": block_k, "num_warps": num_warps, "num_stages": num_stages,
                 "group_m": group_m}
        out.append(tiles_module.GemmTile(**{k: v for k, v in entry.items() if k in fields}))
    return out[:limit] if limit else out


def smem_limit(device):
    if device.type != "cuda":
        return SMEM_FALLBACK
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", None) or SMEM_FALLBACK


class BucketTuner:
    """Scores tile choices for one (shape, bucket): mean log time ratio to the reference over the bucket's T."""

    def __init__(self, kernel, prob, tokens, args, timer, device):
        self.kernel, self.prob, self.args, self.timer, self.device = kernel, prob, args, timer, device
        self.cases = []
        shape = prob.shape
        for t in tokens:
            seed = args.seed * 1000003 + t
            ids, weights = bench.random_routing(t, shape.num_experts, shape.top_k, device, seed)
            rows = bench.check_rows(t, args.check_rows, device, seed)
            ref = reference.fused_experts_ref(prob.x[:t][rows], prob.w_gate_up, prob.w_down, ids[rows], weights[rows])
            self.cases.append({"tokens": t, "ids": ids, "weights": weights, "rows": rows, "ref": ref})
        self.reference_ms = None
        self.tried = 0

    def _time(self, tiles, case):
        x = self.prob.x[: case["tokens"]]

        def call():
            return self.kernel.fused_experts(x, self.prob.w_gate_up, self.prob.w_down, case["ids"], case["weights"],
                                             tiles=tiles)

        out = call()
        err = reference.relative_error(out[case["rows"]], case["ref"])
        if not err <= reference.TOLERANCE[self.prob.dtype]:
            raise ValueError(f"rel err {err:.2e}")
        return self.timer.plain(call)

    def measure(self, tiles):
        """{T: ms} for tiles, or None when it fails (compile error, wrong output)."""
        self.tried += 1
        try:
            return {c["tokens"]: self._time(tiles, c) for c in self.cases}
        except Exception as exc:  # out of shared memory, wrong output, ...
            print(f"    rejected {tiles}: {bench.error_text(exc)[:160]}", flush=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            return None

    def score(self, times):
        if times is None:
            return math.inf
        return sum(math.log(times[t] / self.reference_ms[t]) for t in times) / len(times)


def tune_bucket(tiles_module, kernel, prob, rows, tokens, args, timer, device):
    shape = prob.shape
    tuner = BucketTuner(kernel, prob, tokens, args, timer, device)
    current = tiles_module.select_tiles(device, max(tokens), shape.top_k, shape.num_experts, shape.ffn, shape.hidden)
    tuner.reference_ms = tuner.measure(current)
    if tuner.reference_ms is None:
        raise RuntimeError(f"the current table's tiles fail for {shape.name} rows={rows}: {current}")
    # a new choice must beat the current one by more than timing noise (geometric mean over the bucket's T)
    best, best_score, best_ms = current, math.log(1.0 - args.min_gain), tuner.reference_ms
    limit = smem_limit(device)
    for block_m in block_m_candidates(rows):
        gate_up_cands = gemm_candidates(tiles_module, block_m, True, limit, args.max_candidates)
        down_cands = gemm_candidates(tiles_module, block_m, False, limit, args.max_candidates)
        if block_m == current.block_m:
            start = current
        else:
            start = tiles_module.MoeTiles(block_m=block_m, gate_up=gate_up_cands[0], down=down_cands[0])
        local, local_ms = start, tuner.measure(start)
        local_score = tuner.score(local_ms)
        for which, cands in (("gate_up", gate_up_cands), ("down", down_cands)):
            for cand in cands:
                trial = dataclasses.replace(local, **{which: cand})
                if trial == local:
                    continue
                ms = tuner.measure(trial)
                s = tuner.score(ms)
                if s < local_score:
                    local, local_ms, local_score = trial, ms, s
        if local_score < best_score:
            best, best_ms, best_score = local, local_ms, local_score
    entry = {"max_rows_per_expert": rows, **best.to_dict()}
    measured = {"tuned_tokens": list(tokens),
                "measured_us": {str(t): round(ms * 1e3, 2) for t, ms in best_ms.items()},
                "previous_us": {str(t): round(ms * 1e3, 2) for t, ms in tuner.reference_ms.items()}}
    return entry, measured, tuner.tried, best != current


def load_history(path, key):
    """The tuning log of a device: {"device": key, "runs": [...]}, one run per scripts/tune call, oldest first."""
    if path.exists():
        return json.loads(path.read_text())
    return {"device": key, "runs": []}


def load_base(args, out_path, tiles_module, key):
    for candidate in (args.base, out_path if out_path.exists() else None):
        if candidate:
            return json.loads(Path(candidate).read_text())
    return json.loads(json.dumps(tiles_module.load_table(key)))  # the device's table or the default (a copy)


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
        elif key in ("decode", "fp8"):  # the decode path's and the w8a8 path's entries (tiles.py), same layout one
            parts = []  # level down; an empty `shapes` is left out
            for k, v in value.items():
                if k == "shapes" and not v:
                    continue
                text = buckets_text(v, 4) if k == "buckets" else shapes_text(v, 4) if k == "shapes" else json.dumps(v)
                parts.append(f"    {json.dumps(k)}: {text}")
            lines.append(f"  {json.dumps(key)}: {{\n" + ",\n".join(parts) + "\n  }")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def write_outputs(out_path, table, history_path, history):
    """The table (runtime data only) and the tuning log, rewritten after every bucket."""
    for path, text in ((out_path, dump_table(table)), (history_path, json.dumps(history, indent=1) + "\n")):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def merge_bucket(buckets, entry):
    """Replace the entry with the same max_rows_per_expert (or add it), keep the list sorted."""
    kept = [b for b in buckets if b["max_rows_per_expert"] != entry["max_rows_per_expert"]]
    return sorted(kept + [entry], key=lambda b: b["max_rows_per_expert"])


def main(argv=None, *, timer=None, kernel=None, shapes=None):
    started = time.monotonic()
    args = parse_args(argv)
    device = torch.device(args.device)
    kernel = kernel if kernel is not None else bench.load_kernel()
    tiles_module = importlib.import_module(kernel.__name__ + ".tiles")
    device_module = importlib.import_module(kernel.__name__ + "._device")
    timer = timer if timer is not None else bench.make_timer(args, device)
    models = bench.select_models(args.models, shapes if shapes is not None else bench.default_shapes(args.shrunk))
    dtype = bench.DTYPES[args.dtype]
    key = device_module.device_key(device)
    out_path = Path(args.out) if args.out else ROOT / "torch-ext" / "moe_dispatch" / "configs" / f"{key}.json"
    table = load_base(args, out_path, tiles_module, key)
    if args.history:
        history_path = Path(args.history)
    elif args.out:
        history_path = out_path.with_name(f"tuning-{key}.json")
    else:
        history_path = ROOT / "docs" / "results" / f"tuning-{key}.json"
    history = load_history(history_path, key)
    import triton

    # The table keeps what the package reads at run time; how it was measured goes to the tuning log.
    table.update({"device": key, "measured": True,
                  "note": f"measured by scripts/tune; the runs are logged in docs/results/tuning-{key}.json"})
    run = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "dtype": args.dtype,
        "buckets": [],  # per (shape, bucket): the tiles kept, the T measured, their time and the previous table's
    }
    history["runs"].append(run)
    table.setdefault("shapes", {})
    summary = []
    for shape in models:
        prob = bench.make_problem(shape, max(args.tokens), dtype, device, args.seed)
        shape_key = f"{shape.num_experts},{shape.ffn},{shape.hidden}"
        buckets = [b for b in table["shapes"].get(shape_key, table["buckets"])]
        for rows, tokens in buckets_for(shape, args.tokens).items():
            if args.budget_s is not None and time.monotonic() - started > args.budget_s:
                summary.append((shape.name, rows, tokens, "skipped: budget", None))
                continue
            print(f"{shape.name} rows/expert={rows} T={tokens}", flush=True)
            entry, measured, tried, changed = tune_bucket(tiles_module, kernel, prob, rows, tokens, args, timer,
                                                          device)
            buckets = merge_bucket([dict(b) for b in buckets if "max_rows_per_expert" in b], entry)
            table["shapes"][shape_key] = buckets
            if args.generic_from == shape.name:
                table["buckets"] = table["shapes"][shape_key]
            run["buckets"].append({"model": shape.name, "shape": shape_key, **entry, "changed": changed, **measured})
            write_outputs(out_path, table, history_path, history)
            speedup = [measured["previous_us"][str(t)] / measured["measured_us"][str(t)] for t in tokens]
            summary.append((shape.name, rows, tokens, f"{tried} tried", (entry, speedup, changed)))
        del prob
        bench.free_memory(device)
    write_outputs(out_path, table, history_path, history)
    lines = [f"tile table -> {out_path}, tuning log -> {history_path} ({time.monotonic() - started:.0f} s)",
             f"{'model':<15}{'rows':>6} {'T':<22} {'BM':>4} {'gate_up n/k/w/s':<16} {'down n/k/w/s':<16} speedup"]
    for name, rows, tokens, note, result in summary:
        if result is None:
            lines.append(f"{name[:15]:<15}{rows:>6} {','.join(map(str, tokens))[:22]:<22} {note}")
            continue
        entry, speedup, changed = result
        g, d = entry["gate_up"], entry["down"]
        lines.append(
            f"{name[:15]:<15}{rows:>6} {','.join(map(str, tokens))[:22]:<22} {entry['block_m']:>4} "
            f"{'/'.join(str(g[k]) for k in ('block_n', 'block_k', 'num_warps', 'num_stages')):<16} "
            f"{'/'.join(str(d[k]) for k in ('block_n', 'block_k', 'num_warps', 'num_stages')):<16} "
            f"{' '.join(f'{s:.2f}' for s in speedup)}{'' if changed else ' (kept)'}")
    print("\n".join(lines), flush=True)
    return table


if __name__ == "__main__":
    main()
