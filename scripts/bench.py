#!/usr/bin/env python3
"""MoE forward benchmark: moe_dispatch against the physical floor and the alternatives users would otherwise run.

For every model shape (benchmarks/model_shapes.py) and token count T, and for both entry points

  fused_experts      given topk_ids / topk_weights (random routing)
  fused_moe_forward  routing included (random router weights)

it times moe_dispatch (plain launches, and CUDA-graph replays for small T), checks the output against the float64
references of benchmarks/reference.py (all rows for small T, a row sample above), and puts the time next to

  floor  = max(bytes / R, flops / P)         bytes = weights of the experts actually hit + activations in and out
  target = max(1.15 bytes / R, flops / (f P)) + 10 us (+ 15 us routing for fused_moe_forward), f = 0.9 or 0.8 by model

with R (read bandwidth) and P (dense bf16 matmul rate) measured at the start of the same run (_bench_ceilings.py),
and next to the baselines: a torch._grouped_mm pipeline (what transformers runs by default), vLLM's fused_experts
when `vllm` imports, and an eager per-expert loop for small T.

Writes DIR/bench.json (everything), DIR/bench.md (tables), DIR/roofline.png (when matplotlib imports) and
DIR/summary.txt, rewritten after every model so a run cut short keeps what it measured; prints the short table last.

    scripts/bench --quick --out results/            # T in 1,4,16,128,1024,4096,16384, all models
    scripts/bench --models mixtral-8x7b --tokens 1,4096 --paths fused_experts --no-baselines
"""

import argparse
import dataclasses
import datetime
import gc
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the CPU runs kernels interpreted

# Imported by name: scripts/ (this folder), benchmarks/ and torch-ext/ are on PYTHONPATH (scripts/_env.sh).
import reference  # noqa: E402  (benchmarks/reference.py: the float64 references and the tolerance table)
from _bench_ceilings import measure_ceilings  # noqa: E402
from _peer_figures import BEFORE_US, VLLM_US  # noqa: E402
from model_shapes import MODEL_SHAPES, ModelShape, shrunk  # noqa: E402
from reference import ROUTING_AGREEMENT_MIN, TOLERANCE  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

ALL_TOKENS = tuple(2**i for i in range(15))  # 1 .. 16384
QUICK_TOKENS = (1, 4, 16, 128, 1024, 4096, 16384)  # the T of issue 12's side-by-side table
PATHS = ("fused_experts", "fused_moe_forward")
BASELINES = ("grouped_mm", "vllm", "eager")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}

READ_SLACK = 1.15  # targets of issue 4
LAUNCH_ALLOWANCE_S = 10e-6
ROUTING_ALLOWANCE_S = 15e-6


# --------------------------------------------------------------------------------------------------------------------
# command line, package loading, timing


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


def default_shapes(shrink):
    return {name: shrunk(shape) for name, shape in MODEL_SHAPES.items()} if shrink else MODEL_SHAPES


def select_models(spec, shapes):
    if spec == "all":
        return list(shapes.values())
    out = []
    for name in spec.split(","):
        if name not in shapes:
            raise SystemExit(f"unknown model {name!r}; known: {', '.join(shapes)}")
        out.append(shapes[name])
    return out


def load_kernel(kernel_dir=None):
    """The package: torch-ext/moe_dispatch by default, else a build variant folder or a kernel repo root."""
    if kernel_dir is None:
        import moe_dispatch  # torch-ext/ is on PYTHONPATH (scripts/_env.sh) or sys.path (tests/conftest.py)

        return moe_dispatch
    folder = Path(kernel_dir).resolve()
    if (folder / "__init__.py").exists():
        spec = importlib.util.spec_from_file_location(
            "moe_dispatch_bench_variant", folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    from kernels import get_local_kernel

    return get_local_kernel(folder)


class EventTimer:
    """Median times in ms: `plain` times launches as they come, `graph` times replays of a captured CUDA graph of one
    call; both use triton.testing.do_bench, which clears the L2 cache before each timed call (weights come from HBM).
    `hot` is triton.testing.do_bench_cudagraph: the call repeated in one CUDA graph, no L2 flush in between (the way
    issue 12's vLLM figures were taken; weights a call reuses from the previous one may hit L2).
    """

    def __init__(self, warmup_ms, rep_ms, hot_rep_ms=20.0):
        self.warmup_ms = warmup_ms
        self.rep_ms = rep_ms
        self.hot_rep_ms = hot_rep_ms

    def hot(self, fn):
        from triton.testing import do_bench_cudagraph

        return do_bench_cudagraph(fn, rep=self.hot_rep_ms, return_mode="median")

    def plain(self, fn):
        from triton.testing import do_bench

        return do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median")

    def graph(self, fn):
        from triton.testing import do_bench

        graph = _capture(fn, 1)
        try:
            return do_bench(graph.replay, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median")
        finally:
            del graph


def alternating_orders(names, pairs):
    """The replay order of each pair of a paired A/B: every name once per pair, the order reversed every other pair,
    so that neither side always runs first after the other."""
    names = list(names)
    return [names if i % 2 == 0 else names[::-1] for i in range(pairs)]


def median_ratios(times, base):
    """{name: median over pairs of times[name][i] / times[base][i]} (times: {name: [per-pair times]})."""
    return {name: statistics.median(a / b for a, b in zip(series, times[base])) for name, series in times.items()}


def paired_graph_times(variants, pairs, hot_calls=10, flush_bytes=256 << 20):
    """Paired A/B timing of `variants` ({name: fn}, each a complete call): each is captured as a one-call CUDA graph
    (replayed after an L2 flush: "flushed") and a graph of `hot_calls` calls (no flush: "hot", per call), then the
    variants are replayed call by call in `alternating_orders`, `pairs` times. Returns {"flushed": {name: [us]},
    "hot": {name: [us]}}. Clock drift under the power cap moves neighbouring replays alike, so per-pair ratios
    (`median_ratios`) resolve differences of 1-2% that whole rounds timed one after the other do not (docs/performance.md,
    "Issue 12, v7")."""
    flush = torch.empty(flush_bytes // 4, dtype=torch.int32, device="cuda")
    graphs = {}
    for name, fn in variants.items():
        graphs[name] = (_capture(fn, 1), _capture(fn, hot_calls))
    for one, many in graphs.values():  # warm-up
        one.replay()
        many.replay()
    torch.cuda.synchronize()
    times = {"flushed": {name: [] for name in variants}, "hot": {name: [] for name in variants}}
    for order in alternating_orders(variants, pairs):
        events = []
        for kind, index, do_flush in (("flushed", 0, True), ("hot", 1, False)):
            for name in order:
                if do_flush:
                    flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graphs[name][index].replay()
                end.record()
                events.append((kind, name, start, end))
        torch.cuda.synchronize()
        for kind, name, start, end in events:
            calls = 1 if kind == "flushed" else hot_calls
            times[kind][name].append(start.elapsed_time(end) * 1e3 / calls)
    return times


def _capture(fn, calls):
    """A CUDA graph of `calls` calls of fn (warmed up on a side stream first, as capture wants)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


class WallTimer:
    """CPU stand-in (plumbing runs with --device cpu): median host time of a few calls. No graphs."""

    def __init__(self, repeats=3):
        self.repeats = repeats

    def plain(self, fn):
        times = []
        for _ in range(self.repeats):
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
        return sorted(times)[len(times) // 2]


def make_timer(args, device):
    if device.type != "cuda":
        return WallTimer()
    return EventTimer(args.warmup_ms, args.rep_ms, getattr(args, "hot_rep_ms", 20.0))


# --------------------------------------------------------------------------------------------------------------------
# problems and implementations


@dataclasses.dataclass
class Problem:
    """One model's tensors, reused for every T (hidden states are sliced)."""

    shape: ModelShape
    dtype: torch.dtype
    x: torch.Tensor  # [T_max, H]
    w_gate_up: torch.Tensor  # [E, 2F, H], gate rows then up rows
    w_down: torch.Tensor  # [E, H, F]
    router_weight: torch.Tensor  # [E, H]
    router_bias: torch.Tensor | None  # [E]
    correction_bias: torch.Tensor | None  # [E] float32, selection only

    @property
    def w_gate(self):
        return self.w_gate_up[:, : self.shape.ffn]

    @property
    def w_up(self):
        return self.w_gate_up[:, self.shape.ffn:]


def make_problem(shape, max_tokens, dtype, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    E, H, F = shape.num_experts, shape.hidden, shape.ffn

    def randn(*size, scale=1.0, dt=dtype):
        t = torch.empty(size, device=device, dtype=dt)
        t.normal_(0.0, scale, generator=gen)
        return t

    return Problem(
        shape=shape,
        dtype=dtype,
        x=randn(max_tokens, H),
        w_gate_up=randn(E, 2 * F, H, scale=0.02),
        w_down=randn(E, H, F, scale=0.02),
        router_weight=randn(E, H, scale=0.02),
        router_bias=randn(E, scale=0.02) if shape.router_bias else None,
        correction_bias=randn(E, scale=0.1, dt=torch.float32) if shape.score_correction_bias else None,
    )


def random_routing(num_tokens, num_experts, top_k, device, seed):
    """k distinct uniformly random experts per token; positive weights summing to 1 (float32, as transformers)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, device=device, generator=gen)
    topk_ids = scores.topk(top_k, dim=1).indices
    topk_weights = torch.randn(num_tokens, top_k, device=device, generator=gen).softmax(dim=1)
    return topk_ids, topk_weights


def skewed_routing(num_tokens, num_experts, top_k, device, seed, exponent=1.0):
    """A few hot experts, as trained routers produce: k distinct experts per token drawn without replacement with
    probability proportional to 1 / rank^exponent over a seeded random ranking of the experts (Zipf; with exponent 1
    the hottest expert takes 1/H_E of the draws: 37% for E = 8, 18% for E = 128); softmax weights as `random_routing`.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    ranking = torch.randperm(num_experts, device=device, generator=gen)
    probs = torch.empty(num_experts, device=device)
    probs[ranking] = 1.0 / torch.arange(1, num_experts + 1, device=device, dtype=torch.float32) ** exponent
    topk_ids = torch.multinomial(probs.expand(max(num_tokens, 1), -1), top_k, replacement=False,
                                 generator=gen)[:num_tokens]
    topk_weights = torch.randn(num_tokens, top_k, device=device, generator=gen).softmax(dim=1)
    return topk_ids, topk_weights


ROUTINGS = {"balanced": random_routing, "skewed": skewed_routing}


def torch_route(shape, x, router_weight, router_bias, correction_bias, *, reference=False):
    """The model's router in torch. reference=True: float32 throughout; else the logits GEMM runs in x's dtype
    (what transformers does) and the gating in float32."""
    if reference:
        logits = x.float() @ router_weight.float().T
        if router_bias is not None:
            logits = logits + router_bias.float()
    else:
        logits = torch.nn.functional.linear(x, router_weight, router_bias).float()
    scores = logits.softmax(dim=-1) if shape.gating == "softmax" else logits.sigmoid()
    select = scores if correction_bias is None else scores + correction_bias
    if shape.n_group:
        num_tokens = select.shape[0]
        grouped = select.view(num_tokens, shape.n_group, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = group_scores.topk(shape.topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask.repeat_interleave(shape.num_experts // shape.n_group, dim=1)
        select = select.masked_fill(~expert_mask, float("-inf"))
    topk_ids = select.topk(shape.top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if shape.renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_ids, topk_weights * shape.routed_scaling_factor


def grouped_mm_experts(x, w_gate_up, w_down, topk_ids, topk_weights):
    """The transformers default: sort by expert, gather, grouped_mm gate_up, SiLU*up, grouped_mm down, weight,
    unsort, sum the k rows. torch._grouped_mm wants bf16, int32 cumulative row ends and 16-byte aligned strides."""
    num_tokens, top_k = topk_ids.shape
    num_experts = w_gate_up.shape[0]
    flat_ids = topk_ids.reshape(-1)
    sorted_ids, order = torch.sort(flat_ids)
    rows = x[order // top_k]
    if x.device.type == "cuda":  # histc on ints is CUDA-only; bincount would sync (no graph capture)
        counts = torch.histc(sorted_ids.int(), bins=num_experts, min=0, max=num_experts - 1)
    else:
        counts = torch.histc(sorted_ids.float(), bins=num_experts, min=0, max=num_experts - 1)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    gate_up = torch._grouped_mm(rows, w_gate_up.transpose(-2, -1), offs=offs)
    gate, up = gate_up.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up
    down = torch._grouped_mm(act, w_down.transpose(-2, -1), offs=offs)
    down = down * topk_weights.reshape(-1)[order].unsqueeze(-1).to(down.dtype)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return down[inverse].view(num_tokens, top_k, -1).sum(dim=1)


def eager_experts(x, w_gate_up, w_down, topk_ids, topk_weights):
    """The classic per-expert loop (one host sync, then a few launches per expert hit)."""
    ffn = w_down.shape[-1]
    out = torch.zeros_like(x)
    for expert in torch.unique(topk_ids).tolist():
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        h = x[token] @ w_gate_up[expert].T
        act = torch.nn.functional.silu(h[:, :ffn]) * h[:, ffn:]
        y = act @ w_down[expert].T
        out.index_add_(0, token, y * topk_weights[token, slot, None].to(y.dtype))
    return out


def load_vllm_fused_experts():
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
    except Exception as exc:  # not installed, or built for another torch
        return None, f"{type(exc).__name__}: {exc}"[:200]
    return fused_experts, None


# --------------------------------------------------------------------------------------------------------------------
# accounting and correctness


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


def check_rows(num_tokens, limit, device, seed):
    if num_tokens <= limit:
        return torch.arange(num_tokens, device=device)
    gen = torch.Generator(device=device).manual_seed(seed + 7)
    return torch.randperm(num_tokens, device=device, generator=gen)[:limit].sort().values


def check_output(prob, rows, out, topk_ids, topk_weights):
    x = prob.x[: out.shape[0]]
    ref = reference.fused_experts_ref(x[rows], prob.w_gate_up, prob.w_down, topk_ids[rows], topk_weights[rows])
    return reference.relative_error(out[rows], ref)


def check_routing(prob, rows, num_tokens, topk_ids, topk_weights):
    """Share of checked tokens routed to the float64 reference's experts; weight error on those tokens."""
    shape = prob.shape
    ref_ids, ref_weights, _ = reference.moe_router_ref(
        prob.x[:num_tokens][rows], prob.router_weight, shape.top_k, shape.gating, prob.router_bias,
        e_score_correction_bias=prob.correction_bias, **shape.routing_kwargs())
    got_ids, order = topk_ids[rows].sort(dim=1)
    ref_sorted, ref_order = ref_ids.sort(dim=1)
    same = (got_ids == ref_sorted).all(dim=1)
    match = same.float().mean().item()
    if not same.any():
        return match, float("nan")
    got_w = topk_weights[rows].gather(1, order)[same]
    ref_w = ref_weights.gather(1, ref_order)[same]
    return match, reference.relative_error(got_w, ref_w)


# --------------------------------------------------------------------------------------------------------------------
# one model


def error_text(exc):
    return f"{type(exc).__name__}: {exc}"[:300]


def free_memory(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def gpu_state(device):
    """{"sm_mhz", "temp_c", "power_w"} of the GPU right now (torch.cuda's NVML readers), or {} where they cannot be
    read (no GPU, no pynvml/amdsmi). Read right after a timing window: the clock the window most likely ran at, so
    that a hot time above a flushed one can be told apart from a slower kernel (issue 12's prefill cells)."""
    if device.type != "cuda":
        return {}
    try:
        return {"sm_mhz": torch.cuda.clock_rate(device), "temp_c": torch.cuda.temperature(device),
                "power_w": torch.cuda.power_draw(device) / 1000}
    except Exception:  # noqa: BLE001 (missing NVML bindings or an unsupported query: nvidia-smi next)
        pass
    query = ["nvidia-smi", f"--id={device.index or 0}", "--query-gpu=clocks.sm,temperature.gpu,power.draw",
             "--format=csv,noheader,nounits"]
    try:
        fields = subprocess.run(query, capture_output=True, text=True, timeout=5, check=True).stdout.split(",")
        return {"sm_mhz": float(fields[0]), "temp_c": float(fields[1]), "power_w": float(fields[2])}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):  # no nvidia-smi (AMD): the state is optional
        return {}


def host_time(fn, calls=20):
    """Host us per call of `fn`: `calls` calls issued back to back after a sync, without one in between (few enough
    that the launch queue never fills, so the figure is the host's enqueue time, not the GPU's). Where it exceeds the
    GPU time, plain launches (the flushed timing, eager serving) are bound by the host."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def cprofile_text(fn, calls, rows=25):
    """cProfile of `calls` calls of `fn` (a sync before and after): the `rows` functions of largest own time, as text."""
    import cProfile
    import io
    import pstats

    fn()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(rows)
    return text.getvalue()


def kernel_times(fn, calls=5):
    """{kernel name: GPU us per call} of `fn` over `calls` calls (torch.profiler, CUDA activity only; plain launches,
    so the clock is the one a lightly loaded GPU runs at), largest first. The sum is the call's kernel time without
    the gaps between launches."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.key] = event.device_time_total / calls
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


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
            record["state_plain"] = gpu_state(self.device)
        except Exception as exc:
            record["error"] = error_text(exc)
            free_memory(self.device)
            return
        if graph and self.device.type == "cuda" and hasattr(self.timer, "graph"):
            try:
                record["graph_us"] = self.timer.graph(fn) * 1e3
            except Exception as exc:
                record["graph_error"] = error_text(exc)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
            free_memory(self.device)
        if hot and self.device.type == "cuda" and hasattr(self.timer, "hot"):
            try:
                record["hot_us"] = self.timer.hot(fn) * 1e3
                record["state_hot"] = gpu_state(self.device)
            except Exception as exc:
                record["hot_error"] = error_text(exc)
                torch.cuda.synchronize()
            free_memory(self.device)
        if kernels and self.device.type == "cuda":
            try:
                record["kernel_us"] = sum(kernel_times(fn).values())
                record["host_us"] = host_time(fn)
            except Exception as exc:  # noqa: BLE001 (a profiler that cannot run leaves the column empty)
                record["kernel_error"] = error_text(exc)
                torch.cuda.synchronize()
            free_memory(self.device)


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
    prob = make_problem(shape, max(tokens), dtype, device, args.seed)
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
    free_memory(device)
    return records


def bench_cell(prob, num_tokens, args, runner, kernel, vllm_fn, itemsize, baselines, routing="balanced"):
    """Every implementation at one (model, T). routing "skewed" (see `skewed_routing`) times fused_experts only
    (ours and grouped_mm); its records carry routing = "skewed"."""
    shape, dtype, device = prob.shape, prob.dtype, runner.device
    seed = args.seed * 1000003 + num_tokens
    x = prob.x[:num_tokens]
    topk_ids, topk_weights = ROUTINGS[routing](num_tokens, shape.num_experts, shape.top_k, device, seed)
    if routing != "balanced":
        args = argparse.Namespace(**{**vars(args), "paths": ("fused_experts",)})
        baselines = tuple(b for b in baselines if b == "grouped_mm")
    rows = check_rows(num_tokens, args.check_rows, device, seed)
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
        err = check_output(prob, rows, result, ids, weights)
        match, weight_err = check_routing(prob, rows, num_tokens, ids, weights)
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
            runner.run(rec, lambda: grouped_mm_experts(x, prob.w_gate_up, prob.w_down, topk_ids, topk_weights),
                       graph=graph, check=experts_check)
        else:
            rec["error"] = "n/a: torch._grouped_mm takes bf16 only"
        out.append(finish_record(rec, accounting(shape, num_tokens, hit_given, itemsize, rec["path"],
                                                 runner.ceilings), runner.ceilings))
    if "grouped_mm" in baselines and "fused_moe_forward" in args.paths:
        rec = new("fused_moe_forward", "grouped_mm")

        def forward_baseline():
            ids, weights = torch_route(shape, x, prob.router_weight, prob.router_bias, prob.correction_bias)
            return grouped_mm_experts(x, prob.w_gate_up, prob.w_down, ids, weights), ids, weights

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
        runner.run(rec, lambda: eager_experts(x, prob.w_gate_up, prob.w_down, topk_ids, topk_weights),
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


# --------------------------------------------------------------------------------------------------------------------
# outputs


def fmt(value, spec=".1f", none="-"):
    """A table cell: `value` in `spec`, `none` for None, "nan" for NaN."""
    if value is None:
        return none
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return format(value, spec)


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
        "max(bytes/R, flops/P); target per issue 4. *vs gmm* = grouped_mm time / ours, like for like.",
    ]
    cells = results["cells"]
    models = list(dict.fromkeys(c["model"] for c in cells))
    lines += ["", "## Summary (the layout of docs/performance.md's current table)", ""] + summary_table(results)
    lines += ["", "## Side by side with issue 12's vLLM figures (hot: CUDA-graph replays of repeated calls, no L2 "
              "flush, median)", ""] + peer_table(results)
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


def peer_table(results):
    """fused_experts hot time against issue 12's vLLM figure and this package's figure before (same method), per
    model and T; also the L2-flushed time (the judged time: CUDA-graph replays where captured, T <= --graph-max-tokens,
    else plain launches), the sum of the kernels' GPU times (no launch gaps, a lightly loaded GPU's
    clock), the host's time per eager call (above the kernels' time: plain launches are host-bound) and the SM clock
    after the hot and flushed windows; ratios > 1 mean slower than the figure."""
    cells, dtype = results["cells"], results["meta"]["dtype"]
    lines = ["| model | T | ours hot | vLLM (issue 12) | ours / vLLM | before (issue 12) | ours / before | "
             "ours flushed | ours kernels | ours host | skewed hot | skewed gmm hot | SM MHz hot / flushed |",
             "|" + " --- |" * 13]
    ratios = []
    for model, tokens in dict.fromkeys((c["model"], c["tokens"]) for c in cells if c["dtype"] == dtype):
        c = _find(cells, model, tokens, "fused_experts", "moe_dispatch", dtype) or {}
        skew = _find(cells, model, tokens, "fused_experts", "moe_dispatch", dtype, "skewed") or {}
        skew_gmm = _find(cells, model, tokens, "fused_experts", "grouped_mm", dtype, "skewed") or {}
        hot, vllm, before = c.get("hot_us"), VLLM_US.get((model, tokens)), BEFORE_US.get((model, tokens))
        vs_vllm = hot / vllm if hot and vllm else None
        vs_before = hot / before if hot and before else None
        if vs_vllm:
            ratios.append(vs_vllm)
        mark = "" if vs_vllm is None or vs_vllm <= 1.0 else " **slower**"
        lines.append(f"| {model} | {tokens} | {fmt(hot)} | {fmt(vllm)} | {fmt(vs_vllm, '.3f')}{mark} | "
                     f"{fmt(before)} | {fmt(vs_before, '.3f')} | {fmt(c.get('time_us'))} {c.get('time_mode', '')} | "
                     f"{fmt(c.get('kernel_us'))} | {fmt(c.get('host_us'))} | {fmt(skew.get('hot_us'))} | "
                     f"{fmt(skew_gmm.get('hot_us'))} | "
                     f"{c.get('state_hot', {}).get('sm_mhz', '-')} / {c.get('state_plain', {}).get('sm_mhz', '-')} |")
    if ratios:
        geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        slower = sum(r > 1.0 for r in ratios)
        lines += ["", f"Geometric mean ours / vLLM over {len(ratios)} cells: {geo:.3f}; cells above the vLLM figure: "
                      f"{slower}."]
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
        f"{'xgmm':>5} {'err':>7} {'fe_hot':>8} {'/vllm':>6}",
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
        vllm = VLLM_US.get((model, tokens))
        parts.append(f"{fmt(hot):>8} {fmt(hot / vllm if hot and vllm else None, '.3f'):>6}")
        lines.append(" ".join(parts))
    lines.append(f"cells missing target: {misses}; cells with errors or failed checks: {errors}; "
                 "xgmm = grouped_mm time / ours ('!' = not faster); fe_hot = fused_experts hot (graph of repeated calls, "
                 "no L2 flush), /vllm = fe_hot / issue 12's vLLM figure")
    return "\n".join(lines)


def write_results(results, out_dir, name, markdown):
    """OUT/<name>.json (everything measured) and OUT/<name>.md (`markdown(results, path)` writes it)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    markdown(results, out_dir / f"{name}.md")


def write_outputs(results, out_dir):
    write_results(results, out_dir, "bench", write_markdown)
    results["meta"]["roofline_png"] = plot_roofline(results, out_dir / "roofline.png")
    summary = short_table(results)
    (out_dir / "summary.txt").write_text(summary + "\n")
    return summary


def _portable_path(value):
    """Results are committed: a path inside the repository is kept relative to it, any other absolute path is cut to
    its last component (no machine's layout ends up in the JSON)."""
    if not isinstance(value, str) or not os.path.isabs(value):
        return value
    path = Path(value)
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return path.name


def _git_commit():
    if os.environ.get("MOE_DISPATCH_COMMIT"):
        return os.environ["MOE_DISPATCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except Exception:
        return None


def benchmark_device(name, plumbing="--device cpu (with TRITON_INTERPRET=1)"):
    """torch.device(name); a CUDA name on a machine without a GPU exits saying how to run the plumbing instead."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"no CUDA device: pass {plumbing} for a plumbing run")
    return device


def main(argv=None, *, timer=None, kernel=None, shapes=None):
    """Run the benchmark; returns the results dict. timer/kernel/shapes let the smoke test stand in stubs."""
    started = time.monotonic()
    args = parse_args(argv)
    device = benchmark_device(args.device)
    torch.manual_seed(args.seed)
    kernel = kernel if kernel is not None else load_kernel(args.kernel_dir)
    timer = timer if timer is not None else make_timer(args, device)
    models = select_models(args.models, shapes if shapes is not None else default_shapes(args.shrunk))
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
            "package_file": _portable_path(getattr(kernel, "__file__", None)),
            "commit": _git_commit(),
            "dtype": str(dtype).replace("torch.", ""),
            "argv": [_portable_path(a) for a in (sys.argv[1:] if argv is None else argv)],
            "tolerance": {str(k).replace("torch.", ""): v for k, v in TOLERANCE.items()},
            "targets": {"read_slack": READ_SLACK, "launch_allowance_us": LAUNCH_ALLOWANCE_S * 1e6,
                        "routing_allowance_us": ROUTING_ALLOWANCE_S * 1e6},
        },
        "shapes": {s.name: dataclasses.asdict(s) for s in models},
        "ceilings": measure_ceilings(timer, device, nbytes=args.ceiling_mib << 20, matmul_size=args.matmul_size),
        "cells": [],
    }
    vllm_fn = None
    if "vllm" in args.baselines:
        vllm_fn, why = load_vllm_fused_experts() if device.type == "cuda" else (None, "not on cuda")
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
