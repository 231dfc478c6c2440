"""Bandwidth of the MegaBlocks-style routing copies on a GPU, against the device-to-device copy ceiling.

    scripts/bench_binned                      # T=16384, H=4096, top_k=2, E=8, bf16, capacity factor 1.0
    scripts/bench_binned --sweep              # also time every candidate tile (to retune copy_config)
    scripts/bench_binned --json out.json

Bytes per op are one row per assignment moved, as the op is defined: a gather reads the token row of every kept
assignment and writes the whole buffer (unused capacity and padding included, they are written as zeros); a scatter
reads every kept buffer row and writes [T, H]; wgrad reads every kept buffer row and its token's gradient row. Index
and weight traffic (a few hundred KiB) is left out. Achieved bytes/s is compared with the copy ceiling (bytes read
plus bytes written per second by `dst.copy_(src)`, harness.measure_copy_bandwidth); the target is >= 80%.
Each output is checked once against the float64 reference (moe_dispatch.reference) before it is timed, and a plain
torch indexing implementation of the same op is timed beside it for scale.
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

# Imported by name: scripts/ (this folder), benchmarks/ and torch-ext/ are on PYTHONPATH (scripts/_env.sh).
from harness import measure_copy_bandwidth
from moe_dispatch import reference  # the float64 references and the tolerance table
from moe_dispatch.dispatch import binned, row_copies
from moe_dispatch.reference import TOLERANCE

TARGET = 0.80  # fraction of the copy ceiling
SWEEP = [  # (block_rows, block_h, num_warps) candidates for --sweep
    (1, 1024, 4), (2, 1024, 4), (4, 1024, 4), (8, 1024, 4), (4, 2048, 8), (8, 512, 4), (16, 256, 4), (4, 1024, 8),
    (8, 1024, 8), (2, 4096, 8),
]


class Timer:
    """Median of triton.testing.do_bench (which flushes L2 before every call, so data comes from HBM)."""

    def __init__(self, warmup_ms=25, rep_ms=200):
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms

    def plain(self, fn):
        from triton.testing import do_bench

        return do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median")


@dataclasses.dataclass
class Routing:
    topk_ids: torch.Tensor  # [T, top_k]
    indices: torch.Tensor  # [N] int32, assignments in expert order
    bin_ids: torch.Tensor  # [N] int32
    bins: torch.Tensor  # [E] int32 inclusive
    padded_bins: torch.Tensor  # [E] int32 inclusive, counts rounded up to `block`
    weights: torch.Tensor  # [N] float32
    capacity: int
    kept: int  # assignments inside capacity
    top_k: int


def make_routing(num_tokens, num_experts, top_k, capacity_factor, block, device):
    """Uniform random top-k routing, prepared with the package's own helpers the way MegaBlocks prepares it."""
    topk_ids = torch.rand(num_tokens, num_experts, device=device).topk(top_k, dim=1).indices.int()
    bin_ids, indices = binned.sort(topk_ids.reshape(-1))
    counts = binned.histogram(topk_ids.reshape(-1), num_experts)
    bins = binned.inclusive_cumsum(counts, 0)
    padded_bins = binned.inclusive_cumsum((counts + block - 1) // block * block, 0)
    capacity = binned.expert_capacity(num_tokens, top_k, num_experts, capacity_factor)
    kept = int(counts.clamp(max=capacity).sum())
    weights = torch.rand(indices.shape[0], device=device)
    return Routing(topk_ids, indices, bin_ids, bins, padded_bins, weights, capacity, kept, top_k)


def torch_binned_gather(x, r):
    """The same op with torch indexing: position -> (expert, rank) -> buffer row, then index_put."""
    num_experts = r.bins.shape[0]
    starts = r.bins.long() - torch.diff(r.bins.long(), prepend=r.bins.new_zeros(1).long())
    positions = torch.arange(r.indices.shape[0], device=x.device)
    expert = torch.searchsorted(r.bins.long(), positions, right=True)
    rank = positions - starts[expert]
    keep = rank < r.capacity
    out = torch.zeros(num_experts * r.capacity, x.shape[1], device=x.device, dtype=x.dtype)
    assignment = r.indices.long()[keep]
    out[(expert * r.capacity + rank)[keep]] = (x[assignment // r.top_k] * r.weights[assignment, None]).to(x.dtype)
    return out.view(num_experts, r.capacity, -1)


def torch_binned_scatter(buffer, r):
    num_tokens = r.indices.shape[0] // r.top_k
    starts = r.bins.long() - torch.diff(r.bins.long(), prepend=r.bins.new_zeros(1).long())
    positions = torch.arange(r.indices.shape[0], device=buffer.device)
    expert = torch.searchsorted(r.bins.long(), positions, right=True)
    rank = positions - starts[expert]
    keep = rank < r.capacity
    assignment = r.indices.long()[keep]
    slots = torch.zeros(r.indices.shape[0], buffer.shape[2], device=buffer.device, dtype=torch.float32)
    slots[assignment] = buffer.view(-1, buffer.shape[2])[(expert * r.capacity + rank)[keep]] * r.weights[assignment,
                                                                                                         None]
    return slots.view(num_tokens, r.top_k, -1).sum(1).to(buffer.dtype)


def check(name, out, expected, dtype):
    err = reference.relative_error(out, expected)
    if not err <= TOLERANCE[dtype]:
        raise RuntimeError(f"{name}: relative error {err:.2e} against the float64 reference exceeds {TOLERANCE[dtype]}")
    return err


def ops(x, grad, r, dtype):
    """[(name, fn, bytes moved, reference or None)] for every timed op."""
    H, e = x.shape[1], x.element_size()
    T, N, E = x.shape[0], r.indices.shape[0], r.bins.shape[0]
    padded_rows = int(r.padded_bins[-1])
    binned_buffer = binned.binned_gather(x, r.indices, r.weights, r.bins, r.capacity, r.top_k)
    padded_buffer = binned.padded_gather(x, r.indices, r.bin_ids, r.weights, r.bins, r.padded_bins, r.top_k)
    plain_buffer = binned.gather(x, r.indices, r.bin_ids, r.weights, r.bins, r.top_k)
    buffer_bytes = E * r.capacity * H * e
    args = (r.indices, r.weights, r.bins)
    return [
        ("binned_gather", lambda: binned.binned_gather(x, *args, r.capacity, r.top_k),
         r.kept * H * e + buffer_bytes,
         lambda: reference.binned_gather_ref(x, *args, r.capacity, r.top_k)),
        ("binned_gather (unweighted)", lambda: binned.binned_gather(x, r.indices, None, r.bins, r.capacity, r.top_k),
         r.kept * H * e + buffer_bytes,
         lambda: reference.binned_gather_ref(x, r.indices, None, r.bins, r.capacity, r.top_k)),
        ("binned_scatter", lambda: binned.binned_scatter(binned_buffer, *args, r.top_k),
         r.kept * H * e + T * H * e,
         lambda: reference.binned_scatter_ref(binned_buffer, *args, r.top_k)),
        ("binned_scatter_wgrad", lambda: binned.binned_scatter_wgrad(binned_buffer, grad, r.indices, r.bins, r.top_k),
         2 * r.kept * H * e,
         lambda: reference.binned_scatter_wgrad_ref(binned_buffer, grad, r.indices, r.bins, r.top_k)),
        ("padded_gather", lambda: binned.padded_gather(x, r.indices, r.bin_ids, r.weights, r.bins, r.padded_bins,
                                                       r.top_k, num_rows=padded_rows),
         N * H * e + padded_rows * H * e,
         lambda: reference.padded_gather_ref(x, r.indices, r.weights, r.bins, r.padded_bins, r.top_k)),
        ("padded_scatter", lambda: binned.padded_scatter(padded_buffer, r.indices, r.bin_ids, r.weights, r.bins,
                                                         r.padded_bins, r.top_k),
         N * H * e + T * H * e,
         lambda: reference.padded_scatter_ref(padded_buffer, r.indices, r.weights, r.bins, r.padded_bins, r.top_k)),
        ("gather", lambda: binned.gather(x, r.indices, r.bin_ids, r.weights, r.bins, r.top_k),
         2 * N * H * e,
         lambda: reference.gather_ref(x, r.indices, r.weights, r.bins, r.top_k)),
        ("scatter", lambda: binned.scatter(plain_buffer, r.indices, r.bin_ids, r.weights, r.bins, r.top_k),
         N * H * e + T * H * e,
         lambda: reference.scatter_ref(plain_buffer, r.indices, r.weights, r.bins, r.top_k)),
        ("torch indexing: binned_gather", lambda: torch_binned_gather(x, r), r.kept * H * e + buffer_bytes, None),
        ("torch indexing: binned_scatter", lambda: torch_binned_scatter(binned_buffer, r),
         r.kept * H * e + T * H * e, None),
    ]


def bench_binned(num_tokens=16384, hidden=4096, top_k=2, num_experts=8, dtype=torch.bfloat16, capacity_factor=1.0,
                 block=128, sweep=False, timer=None, device="cuda"):
    """Time every op, print a table against the copy ceiling and return the rows (dicts)."""
    device = torch.device(device)
    timer = timer or Timer()
    torch.manual_seed(0)
    r = make_routing(num_tokens, num_experts, top_k, capacity_factor, block, device)
    x = torch.randn(num_tokens, hidden, device=device, dtype=dtype)
    grad = torch.randn_like(x)
    copy = measure_copy_bandwidth(timer, device, 2 * 2**30)["copy_bytes_per_s"]
    cfg = row_copies.copy_config(hidden, x.element_size(), device)
    print(f"T={num_tokens} H={hidden} top_k={top_k} E={num_experts} {str(dtype).replace('torch.', '')} "
          f"capacity={r.capacity} (factor {capacity_factor}) kept={r.kept}/{r.indices.shape[0]} padded block={block}")
    print(f"copy ceiling (read + write): {copy / 1e12:.2f} TB/s; tile {cfg}")
    rows = []
    for name, fn, nbytes, ref_fn in ops(x, grad, r, dtype):
        err = check(name, fn(), ref_fn(), dtype) if ref_fn is not None else None
        ms = timer.plain(fn)
        rows.append({"op": name, "ms": ms, "bytes": nbytes, "tb_per_s": nbytes / (ms * 1e-3) / 1e12,
                     "fraction_of_copy": nbytes / (ms * 1e-3) / copy, "rel_err": err})
    print(f"{'op':34s} {'time us':>9s} {'MB moved':>9s} {'TB/s':>6s} {'of copy':>8s} {'rel err':>8s}")
    for row in rows:
        flag = "" if row["op"].startswith("torch") or row["fraction_of_copy"] >= TARGET else "  < target"
        err = f"{row['rel_err']:.1e}" if row["rel_err"] is not None else "-"
        print(f"{row['op']:34s} {row['ms'] * 1e3:9.1f} {row['bytes'] / 1e6:9.1f} {row['tb_per_s']:6.2f} "
              f"{row['fraction_of_copy']:8.1%} {err:>8s}{flag}")
    if sweep:
        rows += _sweep(x, grad, r, copy, timer)
    return {"copy_bytes_per_s": copy, "config": dataclasses.asdict(cfg), "rows": rows}


def _sweep(x, grad, r, copy, timer):
    """Time the three binned ops under every SWEEP tile (monkeypatching copy_config)."""
    original = row_copies.copy_config
    selected = [op for op in ops(x, grad, r, x.dtype) if op[0] in ("binned_gather", "binned_scatter",
                                                                    "binned_scatter_wgrad")]
    results = []
    print(f"\n{'tile (rows, h, warps)':24s} " + " ".join(f"{name:>22s}" for name, *_ in selected))
    try:
        for block_rows, block_h, num_warps in SWEEP:
            tile = row_copies.CopyConfig(block_rows, block_h, num_warps)
            row_copies.copy_config = lambda *args, tile=tile: tile
            cells = []
            for name, fn, nbytes, _ in selected:
                ms = timer.plain(fn)
                results.append({"op": name, "tile": dataclasses.asdict(tile), "ms": ms,
                                "fraction_of_copy": nbytes / (ms * 1e-3) / copy})
                cells.append(f"{ms * 1e3:8.1f} us {nbytes / (ms * 1e-3) / copy:7.1%}")
            print(f"{str((block_rows, block_h, num_warps)):24s} " + " ".join(f"{c:>22s}" for c in cells))
    finally:
        row_copies.copy_config = original
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--capacity-factor", type=float, default=1.0)
    parser.add_argument("--block", type=int, default=128, help="padded layout: segment multiple")
    parser.add_argument("--sweep", action="store_true", help="also time the candidate tiles of SWEEP")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_binned needs a CUDA GPU (the interpreter's timings mean nothing)")
    result = bench_binned(args.tokens, args.hidden, args.top_k, args.experts, getattr(torch, args.dtype),
                          args.capacity_factor, args.block, args.sweep)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
