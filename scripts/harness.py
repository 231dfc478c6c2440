"""The benchmark harness: what the benchmarks and the tuner share, one module imported by name.

  loading     `load_kernel` (the package, a build variant or a kernel repo), `benchmark_device`, `select_models`
  timing      `EventTimer` (L2-flushed plain launches and one-call graph replays, hot graphs of repeated calls),
              `WallTimer` (the CPU stand-in), paired A/B replays (`paired_graph_times`, `median_ratios`),
              `kernel_times` (profiler), `host_time`, `cprofile_text`, `gpu_state` (clock, temperature, power)
  ceilings    the read bandwidth R, the copy bandwidth and the bf16 matmul rate P, measured in the same run
              (`measure_ceilings`)
  problems    one model's tensors (`make_problem`; `make_fp8_problem`: block-quantized float8 weights), routing
              (`random_routing`, `skewed_routing`, `torch_route`), the baselines users would run otherwise
              (`grouped_mm_experts`, `eager_experts`, vLLM's `fused_experts` when it imports)
  checks      row samples and errors against the float64 references of moe_dispatch.reference
  reporting   `fmt`, `write_results`, `portable_path` (no machine's paths in committed results), `git_commit`

It is a library, not a tool: no launcher of its own (every user-facing tool in scripts/ has a five-line launcher that
puts scripts/, benchmarks/ and torch-ext/ on PYTHONPATH through scripts/_env.sh; tests/conftest.py does the same for
the tests). Without a GPU, importing it turns on Triton's interpreter (TRITON_INTERPRET=1, read when triton is first
imported), so the tools run their plumbing on CPU tensors.
"""

import dataclasses
import gc
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the CPU runs kernels interpreted

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from model_shapes import MODEL_SHAPES, ModelShape, shrunk  # noqa: E402
from moe_dispatch import reference  # noqa: E402  (the float64 references and the tolerance table)

ROOT = Path(__file__).resolve().parent.parent

ALL_TOKENS = tuple(2**i for i in range(15))  # 1 .. 16384
QUICK_TOKENS = (1, 4, 16, 128, 1024, 4096, 16384)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
FP8_BLOCK = (128, 128)  # DeepSeek-V3's weight block shape, the one the FP8 tools quantize with
QUANTIZE_CHUNK = 8  # experts generated and quantized at a time (DeepSeek-V3's fp32 temporaries stay ~2 GB)
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # GPT-OSS's clamped SwiGLU (transformers' GptOssConfig defaults)
MXFP4_GROUP = 32  # values per e8m0 scale
MXFP4_SCALE_CODE = 120  # e8m0 code of random MXFP4 weights' scales (+-1): 2^-7 times e2m1 values of RMS 2.9
MXFP4_REFERENCE_CHUNK = 8  # float64 dequantized experts at a time (GPT-OSS-120B: ~4 GB of float64 temporaries)


# Loading the package, the device and the model shapes.


def default_shapes(shrink):
    """{name: shape} of MODEL_SHAPES, shrunk to interpreter sizes with `shrink`."""
    return {name: shrunk(shape) for name, shape in MODEL_SHAPES.items()} if shrink else MODEL_SHAPES


def select_models(spec, shapes):
    """The shapes a comma list of names (or "all") asks for; an unknown name exits saying the known ones."""
    if spec == "all":
        return list(shapes.values())
    out = []
    for name in spec.split(","):
        if name not in shapes:
            raise SystemExit(f"unknown model {name!r}; known: {', '.join(shapes)}")
        out.append(shapes[name])
    return out


def comma_choices(parser, flag, text, known):
    """The names of a comma list option (`flag` its name in messages), each one of `known`; else parser.error."""
    names = tuple(name for name in text.split(",") if name)
    for name in names:
        if name not in known:
            parser.error(f"unknown {flag} value {name!r}; known: {', '.join(known)}")
    return names


def load_kernel(kernel_dir=None):
    """The package: torch-ext/moe_dispatch by default, else a build variant folder or a kernel repo root."""
    if kernel_dir is None:
        import moe_dispatch  # torch-ext/ is on PYTHONPATH (scripts/_env.sh) or pytest.ini's pythonpath (the tests)

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


def benchmark_device(name, plumbing="--device cpu (with TRITON_INTERPRET=1)"):
    """torch.device(name); a CUDA name on a machine without a GPU exits saying how to run the plumbing instead."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"no CUDA device: pass {plumbing} for a plumbing run")
    return device


# Timing: every figure in ms unless its name says us.


class EventTimer:
    """Median times in ms: `plain` times launches as they come, `graph` times replays of a captured CUDA graph of one
    call; both use triton.testing.do_bench, which clears the L2 cache before each timed call (weights come from HBM).
    `hot` is triton.testing.do_bench_cudagraph: the call repeated in one CUDA graph, no L2 flush in between (the way
    vLLM's published MoE figures are taken; weights a call reuses from the previous one may hit L2).
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
    (`median_ratios`) resolve differences of 1-2% that whole rounds timed one after the other do not
    (docs/performance.md, "Method": the A/B of one change)."""
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
    """EventTimer with the arguments' windows on a GPU, WallTimer on the CPU."""
    if device.type != "cuda":
        return WallTimer()
    return EventTimer(args.warmup_ms, args.rep_ms, getattr(args, "hot_rep_ms", 20.0))


def gpu_state(device):
    """{"sm_mhz", "temp_c", "power_w"} of the GPU right now (torch.cuda's NVML readers), or {} where they cannot be
    read (no GPU, no pynvml/amdsmi). Read right after a timing window: the clock the window most likely ran at, so
    that a hot time above a flushed one can be told apart from a slower kernel (prefill cells run under the power
    cap)."""
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


# Ceilings: what every cell is judged against, measured in the same run, each timed through a `timer` with
# plain(fn) -> ms (so the CPU tests can stand in a counting stub):
# - R, the read-only bandwidth: a Triton grid-stride reduction over a buffer of several GB that keeps many 16-byte
#   loads in flight per SM; a few launch shapes are tried and the best is kept (torch.sum is reported beside it: it
#   reads slower than a well-pipelined kernel, so it would make the floor too easy);
# - the device-to-device copy bandwidth (bytes read + bytes written), the binned copies' ceiling;
# - P, the dense bf16 matmul rate: torch.matmul on random n^3 operands (never zeros: they run faster).

# (BLOCK, UNROLL, num_warps, programs per SM): BLOCK*UNROLL fp32 per program and iteration; each thread issues
# BLOCK*UNROLL/(32*num_warps*4) independent 16-byte loads before it adds any of them.
READ_CONFIGS = (
    (2048, 4, 8, 2),
    (4096, 2, 8, 4),
    (2048, 2, 4, 8),
    (4096, 4, 8, 2),
    (1024, 8, 4, 4),
)


@triton.jit
def _stream_read_kernel(x_ptr, partial_ptr, n_elements, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """Grid: (n_programs,). Program p sums the chunks p, p + n_programs, ... of BLOCK*UNROLL elements.

    n_elements must be a multiple of BLOCK*UNROLL (the buffer is sized so), so no load needs a mask.
    """
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(pid, n_elements // (BLOCK * UNROLL), tl.num_programs(0)):
        start = c * (BLOCK * UNROLL)  # a constant multiple: the compiler knows the loads are 16-byte aligned
        for u in tl.static_range(UNROLL):
            acc += tl.load(x_ptr + start + u * BLOCK + offs)
    tl.store(partial_ptr + pid, tl.sum(acc, axis=0))


def _num_sms(device):
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def measure_read_bandwidth(timer, device, nbytes):
    """Best Triton streaming-read bandwidth (bytes/s) over READ_CONFIGS, plus every config's figure."""
    chunk = max(block * unroll for block, unroll, _, _ in READ_CONFIGS)
    n = max(chunk, (nbytes // 4) // chunk * chunk)
    x = torch.randn(n, device=device, dtype=torch.float32)
    sms = _num_sms(device)
    expect = x.double().sum().item()
    tried = []
    for block, unroll, num_warps, per_sm in READ_CONFIGS:
        n_programs = min(sms * per_sm, n // (block * unroll))
        partial = torch.empty(n_programs, device=device, dtype=torch.float32)

        def run(block=block, unroll=unroll, num_warps=num_warps, n_programs=n_programs, partial=partial):
            _stream_read_kernel[(n_programs,)](x, partial, n, BLOCK=block, UNROLL=unroll, num_warps=num_warps)

        run()
        # the kernel's sum must equal torch's (it read every element exactly once)
        got = partial.double().sum().item()
        if abs(got - expect) > 1e-3 * (abs(expect) + x.numel() ** 0.5):
            raise RuntimeError(f"stream-read kernel summed {got}, torch {expect} (config {block, unroll})")
        ms = timer.plain(run)
        tried.append({"block": block, "unroll": unroll, "num_warps": num_warps, "programs": n_programs,
                      "ms": ms, "bytes_per_s": x.numel() * 4 / (ms * 1e-3)})
    sum_ms = timer.plain(lambda: x.sum())
    best = max(tried, key=lambda t: t["bytes_per_s"])
    return {
        "read_bytes_per_s": best["bytes_per_s"],
        "read_best_config": best,
        "read_configs": tried,
        "torch_sum_bytes_per_s": x.numel() * 4 / (sum_ms * 1e-3),
        "read_buffer_bytes": x.numel() * 4,
    }


def measure_copy_bandwidth(timer, device, nbytes):
    """Device-to-device copy bandwidth, bytes read + bytes written per second."""
    src = torch.randn(max(1, nbytes // 4), device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = timer.plain(lambda: dst.copy_(src))
    return {"copy_bytes_per_s": 2 * src.numel() * 4 / (ms * 1e-3), "copy_buffer_bytes": src.numel() * 4}


def measure_matmul_rate(timer, device, size, dtype=torch.bfloat16):
    """torch.matmul FLOP/s on random [size, size] x [size, size] operands."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    ms = timer.plain(lambda: torch.matmul(a, b))
    return {"matmul_flops_per_s": 2 * size**3 / (ms * 1e-3), "matmul_size": size, "matmul_dtype": str(dtype)}


def measure_ceilings(timer, device, *, nbytes, matmul_size):
    """R, the copy bandwidth and P in one dict (the `ceilings` of a results file)."""
    out = {}
    out.update(measure_read_bandwidth(timer, device, nbytes))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    out.update(measure_copy_bandwidth(timer, device, nbytes // 2))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    out.update(measure_matmul_rate(timer, device, matmul_size))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# Problems: one model's tensors, routing, and the implementations users would run otherwise.


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
    """`Problem` of `shape`: x randn [max_tokens, H], weights randn * 0.02, the router's biases where the model has
    them; seeded, on `device`."""
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
    """(vLLM's fused_experts, None), or (None, why it does not import)."""
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
    except Exception as exc:  # not installed, or built for another torch
        return None, f"{type(exc).__name__}: {exc}"[:200]
    return fused_experts, None


@dataclasses.dataclass
class Fp8Problem:
    """One model's tensors with float8 expert weights: bf16 weights randn * 0.02 and their FP8_BLOCK block
    quantization by the package's `quantize_experts_fp8`, reused for every T (hidden states are sliced)."""

    shape: ModelShape
    x: torch.Tensor  # [T_max, H] bf16
    w_gate_up: torch.Tensor | None  # [E, 2F, H] bf16, the weights quantized (None once a tool has dropped them)
    w_down: torch.Tensor | None  # [E, H, F] bf16
    q_gate_up: torch.Tensor  # float8_e4m3fn
    q_down: torch.Tensor
    scales: dict  # w_gate_up_scale, w_down_scale, fp8_block_shape: the keyword arguments of fused_experts


def _random_quantized(E, d1, d2, device, gen, quantize):
    """bf16 weights randn * 0.02 and their block quantization, QUANTIZE_CHUNK experts at a time."""
    w = torch.empty(E, d1, d2, device=device, dtype=torch.bfloat16)
    q = torch.empty(E, d1, d2, device=device, dtype=torch.float8_e4m3fn)
    scales = []
    for start in range(0, E, QUANTIZE_CHUNK):
        part = slice(start, min(E, start + QUANTIZE_CHUNK))
        w[part].normal_(0.0, 0.02, generator=gen)
        q[part], scale = quantize(w[part], "block", block_shape=FP8_BLOCK)
        scales.append(scale)
    return w, q, torch.cat(scales)


def make_fp8_problem(shape, max_tokens, device, seed, kernel):
    """`Fp8Problem` of `shape` (`kernel`: the package whose quantizer makes the float8 weights)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    E, H, F = shape.num_experts, shape.hidden, shape.ffn
    x = torch.empty(max_tokens, H, device=device, dtype=torch.bfloat16).normal_(0.0, 1.0, generator=gen)
    w_gate_up, q_gate_up, s_gate_up = _random_quantized(E, 2 * F, H, device, gen, kernel.quantize_experts_fp8)
    w_down, q_down, s_down = _random_quantized(E, H, F, device, gen, kernel.quantize_experts_fp8)
    return Fp8Problem(shape, x, w_gate_up, w_down, q_gate_up, q_down,
                      dict(w_gate_up_scale=s_gate_up, w_down_scale=s_down, fp8_block_shape=FP8_BLOCK))


@dataclasses.dataclass
class Mxfp4Weights:
    """One layer's experts: MXFP4 as GPT-OSS checkpoints store them, and their exact bf16 values."""

    shape: ModelShape
    gu_blocks: torch.Tensor  # uint8 [E, 2F, H/32, 16], gate and up rows alternating (gate at even)
    gu_scales: torch.Tensor  # uint8 [E, 2F, H/32]
    d_blocks: torch.Tensor  # uint8 [E, H, F/32, 16]
    d_scales: torch.Tensor  # uint8 [E, H, F/32]
    gu_bias: torch.Tensor  # bf16 [E, 2F], interleaved like the rows
    d_bias: torch.Tensor  # bf16 [E, H]
    dq_gu: torch.Tensor | None  # bf16 [E, 2F, H], interleaved (None once a tool has dropped it)
    dq_d: torch.Tensor | None  # bf16 [E, H, F]

    def call_kwargs(self):
        """fused_experts' arguments besides the activations and the routing: GPT-OSS's experts on the blocks."""
        return dict(w_gate_up=self.gu_blocks, w_down=self.d_blocks, w_gate_up_scale=self.gu_scales,
                    w_down_scale=self.d_scales, activation="swiglu_oai", interleaved=True, gate_up_bias=self.gu_bias,
                    down_bias=self.d_bias, swiglu_alpha=SWIGLU_ALPHA, swiglu_limit=SWIGLU_LIMIT)


@dataclasses.dataclass
class Mxfp4Problem:
    """One model's tensors with MXFP4 expert weights (the tuner's problem; hidden states sliced per T)."""

    shape: ModelShape
    x: torch.Tensor  # [T_max, H] bf16
    weights: Mxfp4Weights
    dtype: torch.dtype = torch.bfloat16


def make_mxfp4_problem(shape, max_tokens, device, seed, kernel):
    """`Mxfp4Problem` of `shape`: make_mxfp4_weights without their bf16 copies (the float64 check dequantizes the
    blocks), hidden states randn."""
    weights = make_mxfp4_weights(shape, device, seed, kernel)
    weights.dq_gu = weights.dq_d = None
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.empty(max_tokens, shape.hidden, device=device, dtype=torch.bfloat16).normal_(0.0, 1.0, generator=gen)
    return Mxfp4Problem(shape, x, weights)


def make_mxfp4_weights(shape, device, seed, kernel):
    """Random MXFP4 experts built directly (uniform bytes, scale codes MXFP4_SCALE_CODE +- 1), biases randn * 0.02,
    and the bf16 dequantization of the blocks (exact: e2m1 values times 2^-8 .. 2^-6)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    E, H, F = shape.num_experts, shape.hidden, shape.ffn

    def blocks(n, k):
        return torch.randint(0, 256, (E, n, k // MXFP4_GROUP, MXFP4_GROUP // 2), dtype=torch.uint8, device=device,
                             generator=gen)

    def scales(n, k):
        return torch.randint(MXFP4_SCALE_CODE - 1, MXFP4_SCALE_CODE + 2, (E, n, k // MXFP4_GROUP), dtype=torch.uint8,
                             device=device, generator=gen)

    gu_blocks, gu_scales, d_blocks, d_scales = blocks(2 * F, H), scales(2 * F, H), blocks(H, F), scales(H, F)
    gu_bias = torch.empty(E, 2 * F, device=device, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)
    d_bias = torch.empty(E, H, device=device, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)
    return Mxfp4Weights(shape, gu_blocks, gu_scales, d_blocks, d_scales, gu_bias, d_bias,
                        kernel.dequantize_experts_mxfp4(gu_blocks, gu_scales, torch.bfloat16),
                        kernel.dequantize_experts_mxfp4(d_blocks, d_scales, torch.bfloat16))


def mxfp4_reference(w, x, ids, weights, *, biases=True, chunk=MXFP4_REFERENCE_CHUNK):
    """float64 experts on the float64 dequantized MXFP4 weights `w` (Mxfp4Weights; reference.dequantize_mxfp4_ref)
    for the rows x: the experts hit, `chunk` at a time (each chunk's ids mapped to its local numbering, the others -1,
    which fused_experts_ref skips)."""
    E = w.shape.num_experts
    hit = torch.unique(ids)
    local = torch.full((E,), -1, dtype=torch.long, device=ids.device)
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for start in range(0, hit.numel(), chunk):
        part = hit[start:start + chunk]
        local.fill_(-1)
        local[part] = torch.arange(part.numel(), device=ids.device)
        w1 = reference.dequantize_mxfp4_ref(w.gu_blocks[part], w.gu_scales[part])
        w2 = reference.dequantize_mxfp4_ref(w.d_blocks[part], w.d_scales[part])
        out += reference.fused_experts_ref(x, w1, w2, local[ids.long()], weights, activation="swiglu_oai",
                                           interleaved=True, gate_up_bias=w.gu_bias[part] if biases else None,
                                           down_bias=w.d_bias[part] if biases else None, swiglu_alpha=SWIGLU_ALPHA,
                                           swiglu_limit=SWIGLU_LIMIT)
        del w1, w2
    return out


def fp8_reference(prob, x, ids, weights, rows):
    """float64 experts on the dequantized fp8 weights at the sampled `rows` (what the FP8 outputs are held to)."""
    return reference.fused_experts_fp8_ref(x[rows], prob.q_gate_up, prob.q_down, ids[rows], weights[rows],
                                           experts_per_chunk=16, **prob.scales)


# Correctness against the float64 references.


def check_rows(num_tokens, limit, device, seed):
    """The rows a correctness check compares: all of them up to `limit`, else `limit` seeded random rows, sorted."""
    if num_tokens <= limit:
        return torch.arange(num_tokens, device=device)
    gen = torch.Generator(device=device).manual_seed(seed + 7)
    return torch.randperm(num_tokens, device=device, generator=gen)[:limit].sort().values


def check_output(prob, rows, out, topk_ids, topk_weights):
    """RMS relative error of `out` at `rows` against the float64 experts of `prob` on the given routing."""
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


# Reporting.


def error_text(exc):
    """An exception as one short line for a results file."""
    return f"{type(exc).__name__}: {exc}"[:300]


def free_memory(device):
    """Collect garbage and return the CUDA caching allocator's free blocks (between models and after failures)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fmt(value, spec=".1f", none="-"):
    """A table cell: `value` in `spec`, `none` for None, "nan" for NaN."""
    if value is None:
        return none
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return format(value, spec)


def write_results(results, out_dir, name, markdown):
    """OUT/<name>.json (everything measured) and OUT/<name>.md (`markdown(results, path)` writes it)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    markdown(results, out_dir / f"{name}.md")


def portable_path(value):
    """Results are committed: a path inside the repository is kept relative to it, any other absolute path is cut to
    its last component (no machine's layout ends up in the JSON)."""
    if not isinstance(value, str) or not os.path.isabs(value):
        return value
    path = Path(value)
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return path.name


def git_commit():
    """The checkout's short commit (MOE_DISPATCH_COMMIT where there is no .git), or None."""
    if os.environ.get("MOE_DISPATCH_COMMIT"):
        return os.environ["MOE_DISPATCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except Exception:
        return None


