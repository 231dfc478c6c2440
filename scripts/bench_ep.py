#!/usr/bin/env python3
"""Expert-parallel benchmark: one MoE layer's experts split over the GPUs of one host, NCCL.

    scripts/bench_ep --out ep-results/                       # its launcher: torchrun, one rank per GPU
    scripts/bench_ep --models deepseek-v3 --tokens 1,1024 --iters 20
    MOE_DISPATCH_RANKS=2 scripts/bench_ep --cpu-smoke        # the plumbing on a CPU (gloo, interpreter)

For each model (benchmarks/model_shapes.py) and T tokens per rank, with random distinct top-k ids (balanced in
expectation), bf16, it times on every rank and reports the slowest rank (max over ranks of the per-rank median):

  plan        routing -> slots, counts all-to-all and the one host read of the split sizes (dropless)
  dispatch    gather + all_to_all_single of the rows, routing weights and local ids
  experts     fused_experts on the received rows with the local E / W experts
  combine     all_to_all_single back + per-token sum in rank order
  ep          the whole ep_fused_experts call (dropless), and with capacity_factor=1.25 (no host read)
  bare        one all_to_all_single of the same bytes and split sizes as dispatch (and as combine): the floor the
              exchange is held to (target: dispatch and combine each within 1.2x of it)
  nvlink      achieved all-to-all bandwidth on a 256 MiB-per-rank exchange, the ceiling measured in the same run
  one_gpu     rank 0 holding all E experts and running fused_experts on all W * T tokens, when the weights fit
              (target: ep faster than one_gpu at T >= 1024)

Writes OUT/ep.json and OUT/ep.md on rank 0 and prints the table. The output is checked against fused_experts with
all experts at one T per model (the all-expert weights are built on every rank from one seed; when they do not fit
next to the shard, that check and one_gpu are skipped and said so).

It measures what expert parallelism costs and buys on one host: each stage of the exchange against the bare
all-to-all and NVLink ceiling, and the whole call against one GPU holding every expert (docs/performance.md, "Expert
parallelism", has the H200 figures). It imports on the CPU; launched with torchrun there, it runs the plumbing through
gloo and Triton's interpreter at shrunk sizes (--cpu-smoke).
"""

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from model_shapes import MODEL_SHAPES, shrunk  # noqa: E402  (benchmarks/ on PYTHONPATH)
from moe_dispatch.reference import TOLERANCE, relative_error  # noqa: E402

import moe_dispatch as md  # noqa: E402
from moe_dispatch import expert_parallel as ep  # noqa: E402  (the stages, timed one by one)

DEFAULT_MODELS = "deepseek-v3,qwen3-30b-a3b"
DEFAULT_TOKENS = "1,16,128,1024,4096"
CAPACITY_FACTOR = 1.25
NVLINK_PROBE_BYTES = 256 << 20


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=DEFAULT_MODELS, help=f"comma list of {', '.join(MODEL_SHAPES)}")
    p.add_argument("--tokens", default=DEFAULT_TOKENS, help="comma list of T per rank")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per measurement (median reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="ep-results")
    p.add_argument("--cpu-smoke", action="store_true", help="gloo + interpreter, shrunk shapes, 1 iteration")
    return p.parse_args()


class Timer:
    """Median seconds per call on this rank (CUDA events on a GPU, wall clock on the CPU), then max over ranks."""

    def __init__(self, device, iters, warmup):
        self.device, self.iters, self.warmup = device, iters, warmup

    def __call__(self, fn, collective=True):
        """collective=False: this rank alone (no barrier, no reduction over ranks)."""
        for _ in range(self.warmup):
            fn()
        samples = []
        for _ in range(self.iters):
            if collective:
                dist.barrier()
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
        slowest = torch.tensor([statistics.median(samples)], dtype=torch.float64, device=self.device)
        if collective:
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return slowest.item()


def bare_all_to_all(send_rows, recv_rows, row_bytes, device, group=None):
    """A callable doing one all_to_all_single of uint8 rows with these split sizes (in rows of row_bytes)."""
    send = torch.empty(sum(send_rows) * row_bytes, dtype=torch.uint8, device=device)
    recv = torch.empty(sum(recv_rows) * row_bytes, dtype=torch.uint8, device=device)
    send_sizes, recv_sizes = [n * row_bytes for n in send_rows], [n * row_bytes for n in recv_rows]
    return lambda: dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)


def nvlink_bandwidth(timer, world_size, device):
    """Bytes each rank sends to the others per second, on a large equal-split all-to-all."""
    per_peer = NVLINK_PROBE_BYTES // world_size
    send = torch.empty(per_peer * world_size, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    seconds = timer(lambda: dist.all_to_all_single(recv, send))
    return per_peer * (world_size - 1) / seconds


def weights_fit(shape, world_size, device):
    """Whether all E experts fit next to this rank's shard (and a margin for activations)."""
    if device.type != "cuda":
        return True
    need = shape.expert_weight_bytes() * shape.num_experts * (1 + 1 / world_size)
    return need < 0.8 * torch.cuda.get_device_properties(device).total_memory


def bench_model(shape, tokens, timer, rank, world_size, device, log):
    E, k, H, F = shape.num_experts, shape.top_k, shape.hidden, shape.ffn
    if E % world_size:
        log(f"{shape.name}: E = {E} not divisible by {world_size} ranks, skipped")
        return []
    E_local = E // world_size
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    full = weights_fit(shape, world_size, device)
    if full:
        w_gate_up = torch.randn(E, 2 * F, H, device=device, dtype=dtype, generator=g) * H**-0.5
        w_down = torch.randn(E, H, F, device=device, dtype=dtype, generator=g) * F**-0.5
        shard = slice(rank * E_local, (rank + 1) * E_local)
        w_gate_up_r, w_down_r = w_gate_up[shard].contiguous(), w_down[shard].contiguous()
    else:
        log(f"{shape.name}: all {E} experts do not fit on one device; correctness check and one_gpu skipped")
        g.manual_seed(1 + rank)
        w_gate_up_r = torch.randn(E_local, 2 * F, H, device=device, dtype=dtype, generator=g) * H**-0.5
        w_down_r = torch.randn(E_local, H, F, device=device, dtype=dtype, generator=g) * F**-0.5
        w_gate_up = w_down = None
    rows = []
    for T in tokens:
        g.manual_seed(100 + rank)
        x = torch.randn(T, H, device=device, dtype=dtype, generator=g)
        ids = torch.rand(T, E, device=device, generator=g).argsort(dim=1)[:, :k]
        weights = torch.rand(T, k, device=device, generator=g)
        row = {"model": shape.name, "T_per_rank": T, "world_size": world_size, "E_local": E_local}
        with torch.no_grad():
            plan = ep._plan(ids, world_size, E_local, None, None)
            received, _, _ = ep._Dispatch.apply(x, weights, plan, None, world_size)
            row["recv_rows"] = received.shape[0]
            row["send_rows"] = plan.slot_token.shape[0]
            row["plan_s"] = timer(lambda: ep._plan(ids, world_size, E_local, None, None))
            row["dispatch_s"] = timer(lambda: ep._Dispatch.apply(x, weights, plan, None, world_size))
            rows_in, weights_in, ids_in = ep._Dispatch.apply(x, weights, plan, None, world_size)
            partials = md.fused_experts(rows_in, w_gate_up_r, w_down_r, ids_in, weights_in, validate=False)
            row["experts_s"] = timer(lambda: md.fused_experts(rows_in, w_gate_up_r, w_down_r, ids_in, weights_in,
                                                              validate=False))
            row["combine_s"] = timer(lambda: ep._Combine.apply(partials, plan, None, world_size))
            row["ep_s"] = timer(lambda: md.ep_fused_experts(x, w_gate_up_r, w_down_r, ids, weights))
            row["ep_capacity_s"] = timer(lambda: md.ep_fused_experts(
                x, w_gate_up_r, w_down_r, ids, weights, capacity_factor=CAPACITY_FACTOR))
            # The same bytes as the dispatch's three exchanges (rows, weights, ids) and as the combine's one.
            dispatch_row_bytes = H * x.element_size() + k * weights.element_size() + k * 4
            row["bare_dispatch_s"] = timer(bare_all_to_all(plan.send_sizes, plan.recv_sizes, dispatch_row_bytes,
                                                           device))
            row["bare_combine_s"] = timer(bare_all_to_all(plan.recv_sizes, plan.send_sizes, H * x.element_size(),
                                                          device))
            row["dispatch_bytes_per_rank"] = row["send_rows"] * dispatch_row_bytes
            if full:
                out = md.ep_fused_experts(x, w_gate_up_r, w_down_r, ids, weights)
                ref = md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=False)
                error = torch.tensor([relative_error(out, ref)], dtype=torch.float64, device=device)
                dist.all_reduce(error, op=dist.ReduceOp.MAX)
                row["rel_error"] = error.item()
                row["correct"] = row["rel_error"] <= TOLERANCE[dtype]
                # One device with all experts doing every rank's tokens (rank 0 times it; the others wait).
                x_all = x.repeat(world_size, 1)
                ids_all, weights_all = ids.repeat(world_size, 1), weights.repeat(world_size, 1)
                one = torch.zeros(1, dtype=torch.float64, device=device)
                if rank == 0:
                    one[0] = timer(lambda: md.fused_experts(x_all, w_gate_up, w_down, ids_all, weights_all,
                                                            validate=False), collective=False)
                dist.broadcast(one, 0)
                row["one_gpu_s"] = one.item()
        rows.append(row)
        log(json.dumps(row))
    return rows


def markdown(rows, nvlink):
    lines = [f"NVLink all-to-all ceiling (measured): {nvlink / 1e9:.1f} GB/s per rank", "",
             "| model | T/rank | plan | dispatch | experts | combine | EP total | EP capacity | bare dispatch | "
             "bare combine | one GPU | dispatch GB/s | rel err |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        us = {key: f"{r[key] * 1e6:.0f} us" if key in r else "-" for key in (
            "plan_s", "dispatch_s", "experts_s", "combine_s", "ep_s", "ep_capacity_s", "bare_dispatch_s",
            "bare_combine_s", "one_gpu_s")}
        bandwidth = r["dispatch_bytes_per_rank"] / r["dispatch_s"] / 1e9
        lines.append(f"| {r['model']} | {r['T_per_rank']} | {us['plan_s']} | {us['dispatch_s']} | {us['experts_s']} | "
                     f"{us['combine_s']} | {us['ep_s']} | {us['ep_capacity_s']} | {us['bare_dispatch_s']} | "
                     f"{us['bare_combine_s']} | {us['one_gpu_s']} | {bandwidth:.1f} | "
                     f"{r.get('rel_error', float('nan')):.1e} |")
    return "\n".join(lines)


def main():
    args = parse_args()
    on_gpu = torch.cuda.is_available() and not args.cpu_smoke
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)

    def log(message):
        if rank == 0:
            print(message, flush=True)

    iters, warmup = (1, 0) if args.cpu_smoke else (args.iters, args.warmup)
    timer = Timer(device, iters, warmup)
    tokens = [int(t) for t in args.tokens.split(",")] if not args.cpu_smoke else [3, 8]
    nvlink = nvlink_bandwidth(timer, world_size, device) if on_gpu else float("nan")
    log(f"all-to-all ceiling: {nvlink / 1e9:.1f} GB/s per rank")
    rows = []
    for name in args.models.split(","):
        shape = MODEL_SHAPES[name] if not args.cpu_smoke else shrunk(MODEL_SHAPES[name])
        rows += bench_model(shape, tokens, timer, rank, world_size, device, log)
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"world_size": world_size, "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
                "torch": torch.__version__, "nvlink_bytes_per_s": nvlink}
        (out / "ep.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        table = markdown(rows, nvlink)
        (out / "ep.md").write_text(table + "\n")
        print(table)
    dist.barrier()  # no rank tears the group down while a peer still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
