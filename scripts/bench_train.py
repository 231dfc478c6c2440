"""Training benchmark of the experts path on a GPU, with peak memory: bf16 experts trained whole, or frozen quantized
experts with gradients for the activations and the routing weights only (--frozen).

The bf16 training table (the default mode) compares, in one run and on the same tensors, `moe_dispatch.fused_experts`
under autograd with what a user would pick instead: transformers' `grouped_mm` experts implementation under autograd
(a real `MixtralExperts` module of the model's sizes, all four models run the same SiLU-gated experts) and
Liger-Kernel's `LigerFusedMoEFunction` (when `liger_kernel` imports). Times are `triton.testing.do_bench` medians (L2
cleared before every call) of one call of `torch.autograd.grad(out, [x, w_gate_up, w_down, topk_weights], grad_out)`;
FLOPs = 3 x the forward's 2 * T * top_k * 3 * H * F; P is the dense bf16 matmul rate measured in the same run. Peak
memory is the allocator's peak during one step above what was allocated before it (inputs and weights). Every cell
checks moe_dispatch's gradients against grouped_mm's (both bf16; norm-wise relative difference).

The frozen mode (--frozen fp8,mxfp4) measures what adapter fine-tuning on a quantized checkpoint runs through the
experts: one step is `torch.autograd.grad(out, [x, topk_weights], grad_out)` of `moe_dispatch.fused_experts` on
frozen quantized expert weights (nothing of them requires grad), timed against the same call on the bf16 values of
those weights (also frozen: that backward too computes d x and d topk_weights only). Per format, model and T:

  fp8    block-scaled 128 x 128 float8_e4m3fn weights (harness.make_fp8_problem: randn * 0.02 quantized by the
         package's quantize_experts_fp8), passed with quant=ExpertsQuant.fp8(...), SiLU-gated experts; the bf16 call
         takes their dequantization (dequantize_experts_fp8: q * scale rounded once to bf16, the scales being fp32)
  mxfp4  GPT-OSS's widths only: MXFP4 blocks with e8m0 scales (harness.make_mxfp4_weights), activation "swiglu_oai",
         interleaved gate/up rows, both biases (Mxfp4Weights.call_kwargs); the bf16 call takes their dequantization,
         which is exact

and the cell reports both times (do_bench medians, L2 cleared), quantized / bf16 (the target: <= 1.0), both peaks
above the pre-step allocation, the gradient check (d x and d topk_weights of the quantized call against the bf16
call's, norm-wise relative difference, held to the bf16 tolerance reference.TOLERANCE: the weights hold the same
values, up to bf16's rounding of fp8's dequantized products) and the weight tensors that required or got a gradient
(none may). Default models: fp8 qwen3-30b-a3b, mixtral-8x7b, deepseek-v3; mxfp4 gpt-oss-120b, gpt-oss-20b; --models
lists others (mxfp4 takes the GPT-OSS ones of the list). The frozen mode runs instead of the bf16 table.

--cpu-smoke (frozen mode only: transformers' grouped_mm and Liger run on GPUs only) runs the frozen cells' plumbing on
the CPU: Triton's interpreter (scripts/harness.py turns it on without a GPU), widths E 4, top_k 2, H 64, F 32, T = 5,
wall-clock medians in place of do_bench, no memory figures (None).

Run it through its launcher (which puts the package and benchmarks/ on PYTHONPATH, scripts/_env.sh):

    scripts/bench_train --out results/train                                  # the bf16 training table
    scripts/bench_train --frozen fp8,mxfp4 --out results/train-frozen        # frozen quantized experts
    scripts/bench_train --frozen fp8,mxfp4 --cpu-smoke --out train-smoke     # the frozen plumbing on the CPU

Writes train.json (the bf16 table's `rows` or the frozen mode's `frozen` cells) and train.md (that mode's table) under
--out and prints the table last.
"""

import argparse
import dataclasses
import json
import os
import time

import torch

import harness  # first (scripts/harness.py): without a GPU it turns on Triton's interpreter before triton imports
import triton  # noqa: E402
from model_shapes import MODEL_SHAPES  # noqa: E402
from moe_dispatch import reference  # noqa: E402

import moe_dispatch as md  # noqa: E402

MODELS = ("mixtral-8x7b", "qwen2-57b-a14b", "qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b")
TOKENS = (4096, 16384)
DTYPE = torch.bfloat16
# --frozen: the formats, the models each runs by default, and the models MXFP4 takes (GPT-OSS's checkpoints)
FROZEN_FORMATS = ("fp8", "mxfp4")
FROZEN_MODELS = {"fp8": ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3"), "mxfp4": ("gpt-oss-120b", "gpt-oss-20b")}
MXFP4_MODELS = ("gpt-oss-120b", "gpt-oss-20b")
FROZEN_GRADS = ("x", "topk_weights")
FROZEN_TOLERANCE = reference.TOLERANCE[DTYPE]
# --cpu-smoke: bench_mxfp4's interpreter widths (H and F whole e8m0 groups of 32; one partial 128 x 128 fp8 block)
SMOKE_SIZES = dict(num_experts=4, top_k=2, hidden=64, ffn=32)
SMOKE_TOKENS = (5,)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default=None,
                   help=f"comma list of MODEL_SHAPES names (default {','.join(MODELS)});\nwith --frozen each "
                        "format's defaults (" + "; ".join(f"{k} {','.join(v)}" for k, v in FROZEN_MODELS.items())
                        + "),\nand mxfp4 runs only the GPT-OSS models of a list")
    p.add_argument("--tokens", default=None,
                   help=f"comma list of T (default {','.join(map(str, TOKENS))}; --cpu-smoke "
                        f"{','.join(map(str, SMOKE_TOKENS))})")
    p.add_argument("--out", default="train-out")
    p.add_argument("--rep-ms", type=int, default=300, help="do_bench measuring time per call site")
    p.add_argument("--liger-models", default="mixtral-8x7b",
                   help="models Liger runs on (its autotuning takes minutes per new shape)")
    p.add_argument("--frozen", default=None, metavar="FORMATS",
                   help=f"comma list of {', '.join(FROZEN_FORMATS)}: instead of the bf16 table, forward + backward\n"
                        "through frozen quantized experts (gradients for x and topk_weights only) against the\n"
                        "same call on their bf16 values")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="with --frozen: plumbing run on the CPU (Triton's interpreter), widths E 4, top_k 2, H 64,\n"
                        "F 32, wall-clock timing, no memory figures")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="start no new cell after this many seconds (0: no budget); cells not started are listed.\n"
                        "train.json and train.md are rewritten after every cell, so a run stopped from outside\n"
                        "keeps what it measured")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.cpu_smoke and args.frozen is None:
        p.error("--cpu-smoke runs the frozen mode only (transformers' grouped_mm and Liger need a GPU): add --frozen")
    args.device = "cpu" if args.cpu_smoke else "cuda"
    args.tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else (
        SMOKE_TOKENS if args.cpu_smoke else TOKENS)
    models = harness.comma_choices(p, "--models", args.models, tuple(MODEL_SHAPES)) if args.models else None
    if args.frozen is None:
        args.models = models or MODELS
        return args
    args.frozen = harness.comma_choices(p, "--frozen", args.frozen, FROZEN_FORMATS)
    if not args.frozen:
        p.error(f"--frozen needs one or more of {', '.join(FROZEN_FORMATS)}")
    # (format, model) of every frozen cell group, in the order they run
    args.frozen_runs = [(fmt, name) for fmt in args.frozen for name in (models or FROZEN_MODELS[fmt])
                        if fmt != "mxfp4" or name in MXFP4_MODELS]
    untaken = [name for name in models or () if name not in {name for _, name in args.frozen_runs}]
    if untaken:
        p.error(f"--models {untaken[0]!r}: no format of --frozen runs it (mxfp4 takes {', '.join(MXFP4_MODELS)})")
    args.models = models
    return args


def gpu_ms(fn, rep_ms, warmup_ms=25):
    """Median ms of fn, triton.testing.do_bench (the L2 cache cleared before every call)."""
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def matmul_rate():
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    b = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    ms = gpu_ms(lambda: a @ b, 300, warmup_ms=50)
    return 2 * 8192**3 / (ms * 1e-3)


def grouped_mm_experts(shape, w_gate_up, w_down):
    """transformers' MixtralExperts with the model's sizes and experts_implementation="grouped_mm", on our tensors."""
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = transformers.MixtralConfig(hidden_size=shape.hidden, intermediate_size=shape.ffn,
                                        num_local_experts=shape.num_experts, num_experts_per_tok=shape.top_k,
                                        experts_implementation="grouped_mm")
    with torch.device("meta"):
        experts = MixtralExperts(config)
    experts.gate_up_proj = torch.nn.Parameter(w_gate_up, requires_grad=True)
    experts.down_proj = torch.nn.Parameter(w_down, requires_grad=True)
    return experts


def liger_function():
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except ImportError:
        return None
    return LigerFusedMoEFunction


def step_fn(impl, shape, inputs, ids, grad_out):
    x, w_gate_up, w_down, weights = inputs
    if impl == "moe_dispatch":
        def forward():
            return md.fused_experts(x, w_gate_up, w_down, ids, weights)
    elif impl == "grouped_mm":
        experts = grouped_mm_experts(shape, w_gate_up, w_down)
        params = [x, experts.gate_up_proj, experts.down_proj, weights]

        def forward():
            return experts(x, ids, weights)

        return lambda: torch.autograd.grad(forward(), params, grad_out)
    else:
        liger = liger_function()
        ids32 = ids.int()

        def forward():
            return liger.apply(x, w_gate_up, w_down, ids32, weights)
    return lambda: torch.autograd.grad(forward(), list(inputs), grad_out)


def peak_bytes(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return peak, result


def rel(a, b):
    """||a - b|| / ||b||, accumulated over the leading dimension (no fp32 copy of a whole weight gradient)."""
    num = den = 0.0
    for a_part, b_part in zip(a.split(1), b.split(1)):
        num += (a_part.float() - b_part.float()).square().sum().item()
        den += b_part.float().square().sum().item()
    return (num / max(den, 1e-60)) ** 0.5


def device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"


def main(argv=None):
    args = parse_args(argv)
    device = harness.benchmark_device(args.device, "--frozen ... --cpu-smoke")
    os.makedirs(args.out, exist_ok=True)
    results = dict(device=device_name(device), torch=torch.__version__, triton=triton.__version__, P=None, rows=[],
                   frozen=[])
    args.deadline = time.time() + args.budget_s if args.budget_s else None
    if args.frozen:
        results["frozen_meta"] = frozen_meta(args)
        results["frozen"] = cells = []
        run_frozen(args, device, cells, lambda: save(args, results, frozen_markdown(cells, device)))
        table = frozen_markdown(cells, device)
    else:
        results["rows"] = rows = []
        impls = run_train(args, results, lambda impls: save(args, results, markdown(rows, impls, results["P"])))
        table = markdown(rows, impls, results["P"])
    save(args, results, table)
    print(table)
    return results


def save(args, results, table):
    """train.json and train.md as they stand (after every cell)."""
    with open(os.path.join(args.out, "train.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "train.md"), "w") as f:
        f.write(table)


def out_of_budget(args) -> bool:
    return args.deadline is not None and time.time() > args.deadline


# The bf16 training table: every weight trained, against grouped_mm and Liger.


def run_train(args, results, saved):
    """The bf16 training table into results["P"] and results["rows"] (`saved(impls)` after every row); returns the
    implementations run."""
    results["P"] = P = matmul_rate()
    impls = ["moe_dispatch", "grouped_mm"] + (["liger"] if liger_function() is not None else [])
    print(f"bf16 matmul P = {P / 1e12:.0f} TFLOP/s; implementations: {impls}", flush=True)
    rows = results["rows"]
    for name in args.models:
        if out_of_budget(args):
            rows += [dict(model=name, T=T, P=P, skipped=f"budget {args.budget_s:g} s") for T in args.tokens]
            continue
        shape = MODEL_SHAPES[name]
        E, k, H, F = shape.num_experts, shape.top_k, shape.hidden, shape.ffn
        torch.manual_seed(args.seed)
        w_gate_up = (torch.randn(E, 2 * F, H, device="cuda", dtype=DTYPE) * 0.02).requires_grad_()
        w_down = (torch.randn(E, H, F, device="cuda", dtype=DTYPE) * 0.02).requires_grad_()
        for T in args.tokens:
            if out_of_budget(args):
                rows.append(dict(model=name, T=T, P=P, skipped=f"budget {args.budget_s:g} s"))
                continue
            x = torch.randn(T, H, device="cuda", dtype=DTYPE, requires_grad=True)
            ids = torch.rand(T, E, device="cuda").argsort(dim=1)[:, :k]  # k distinct experts per token, uniform
            weights = torch.rand(T, k, device="cuda", dtype=torch.float32).requires_grad_()
            grad_out = torch.randn(T, H, device="cuda", dtype=DTYPE)
            flops = 3 * 2 * T * k * 3 * H * F
            row = dict(model=name, T=T, flops=flops, P=P)
            grads = {}
            for impl in impls:
                if impl == "liger" and name not in args.liger_models.split(","):
                    row[impl] = dict(error="not run (--liger-models)")
                    continue
                started = time.time()
                try:
                    fn = step_fn(impl, shape, (x, w_gate_up, w_down, weights), ids, grad_out)
                    fn()  # compile / autotune outside the timing
                    peak, grads[impl] = peak_bytes(fn)
                    ms = gpu_ms(fn, args.rep_ms)
                    row[impl] = dict(ms=ms, tflops=flops / (ms * 1e-3) / 1e12, peak_gib=peak / 2**30,
                                     wall_s=time.time() - started)
                except Exception as error:  # a baseline that cannot run this cell (memory, shape) is reported
                    row[impl] = dict(error=f"{type(error).__name__}: {str(error)[:200]}")
                torch.cuda.empty_cache()
            if "moe_dispatch" in grads and "grouped_mm" in grads:
                row["grad_rel_diff_vs_grouped_mm"] = {
                    n: rel(a, b) for n, a, b in zip(("x", "w_gate_up", "w_down", "topk_weights"),
                                                    grads["moe_dispatch"], grads["grouped_mm"])}
            rows.append(row)
            print(format_row(row, impls), flush=True)
            saved(impls)
            del x, ids, weights, grad_out, grads
            torch.cuda.empty_cache()
        del w_gate_up, w_down
        torch.cuda.empty_cache()
    return impls


def format_row(row, impls):
    if "skipped" in row:
        return f"{row['model']} T={row['T']}: not started ({row['skipped']})"
    cells = []
    for impl in impls:
        r = row[impl]
        cells.append(f"{impl} {r['ms']:.2f} ms {r['tflops']:.0f} TF/s {r['peak_gib']:.1f} GiB" if "ms" in r
                     else f"{impl} {r['error']}")
    return f"{row['model']} T={row['T']}: " + " | ".join(cells)


def markdown(rows, impls, P):
    head = ("| model | T | " + " | ".join(f"{i} ms (TFLOP/s, peak GiB)" for i in impls)
            + " | ours / 0.8 P | max grad diff |")
    lines = [f"bf16 matmul P = {P / 1e12:.0f} TFLOP/s", "", head, "|" + "---|" * (len(impls) + 4)]
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['model']} | {row['T']} | " + " | ".join(["not started"] * len(impls))
                         + f" | - | {row['skipped']} |")
            continue
        cells = []
        for impl in impls:
            r = row[impl]
            cells.append(f"{r['ms']:.2f} ({r['tflops']:.0f}, {r['peak_gib']:.1f})" if "ms" in r else "error")
        ours = row["moe_dispatch"]
        target = f"{ours['tflops'] * 1e12 / (0.8 * P):.2f}" if "ms" in ours else "-"
        diff = max(row.get("grad_rel_diff_vs_grouped_mm", {"-": float("nan")}).values())
        lines.append(f"| {row['model']} | {row['T']} | " + " | ".join(cells) + f" | {target} | {diff:.1e} |")
    return "\n".join(lines) + "\n"


# The frozen mode: quantized experts frozen, gradients for x and topk_weights only, against their bf16 values.


@dataclasses.dataclass
class FrozenExperts:
    """One model's frozen experts in one format: fused_experts' keyword arguments besides the activations and the
    routing, for the quantized weights and for their bf16 values (dequantized)."""

    format: str  # FROZEN_FORMATS
    quantized: dict
    bf16: dict

    def weight_tensors(self):
        """{name: tensor} of every weight-side tensor of both calls (weights, scales, biases): none may get a
        gradient."""
        out = {}
        for side, kwargs in (("quantized", self.quantized), ("bf16", self.bf16)):
            for name, value in kwargs.items():
                if isinstance(value, md.ExpertsQuant):  # its scales
                    for field in ("w_gate_up_scale", "w_down_scale"):
                        out[f"{side}.quant.{field}"] = getattr(value, field)
                elif isinstance(value, torch.Tensor):
                    out[f"{side}.{name}"] = value
        return {name: t for name, t in out.items() if t is not None}


def frozen_shape(name, smoke):
    shape = MODEL_SHAPES[name]
    return dataclasses.replace(shape, **SMOKE_SIZES) if smoke else shape


def dequantize_fp8(q, scale, block_shape):
    """bf16 [E, d1, d2] of the block-scaled float8 weight q, harness.QUANTIZE_CHUNK experts at a time (the fp32
    temporaries of DeepSeek-V3's whole gate/up weight would be 30 GB)."""
    out = torch.empty(q.shape, dtype=DTYPE, device=q.device)
    for start in range(0, q.shape[0], harness.QUANTIZE_CHUNK):
        part = slice(start, start + harness.QUANTIZE_CHUNK)
        out[part] = md.dequantize_experts_fp8(q[part], scale[part], "block", block_shape, dtype=DTYPE)
    return out


def make_frozen_experts(fmt, shape, device, seed):
    """`FrozenExperts` of `fmt` and `shape`, seeded; the weights quantized, then their bf16 values from them."""
    if fmt == "fp8":
        prob = harness.make_fp8_problem(shape, 1, device, seed, md)
        prob.w_gate_up = prob.w_down = None  # the values before quantization: not the bf16 call's, and memory
        scales = prob.scales
        block = scales["fp8_block_shape"]
        quant = md.ExpertsQuant.fp8(scales["w_gate_up_scale"], scales["w_down_scale"], block_shape=block)
        return FrozenExperts(fmt, dict(w_gate_up=prob.q_gate_up, w_down=prob.q_down, quant=quant),
                             dict(w_gate_up=dequantize_fp8(prob.q_gate_up, scales["w_gate_up_scale"], block),
                                  w_down=dequantize_fp8(prob.q_down, scales["w_down_scale"], block)))
    w = harness.make_mxfp4_weights(shape, device, seed, md)
    quantized = w.call_kwargs()
    bf16 = {name: value for name, value in quantized.items() if not name.endswith("_scale")}
    bf16.update(w_gate_up=w.dq_gu, w_down=w.dq_d)
    return FrozenExperts(fmt, quantized, bf16)


def frozen_step(x, ids, weights, grad_out, kwargs):
    """One training step through frozen experts: the gradients of x and topk_weights only."""
    def step():
        out = md.fused_experts(x, topk_ids=ids, topk_weights=weights, validate=False, **kwargs)
        return torch.autograd.grad(out, [x, weights], grad_out)

    return step


def measure(fn, args, device):
    """(record, gradients) of one step: compiled outside the timing, peak memory above the pre-step allocation and
    do_bench's median on a GPU; on the CPU the wall clock's median and no memory figure."""
    started = time.time()
    grads = fn()  # compile outside the timing; on the CPU also the gradients checked
    if device.type == "cuda":
        peak, grads = peak_bytes(fn)
        ms, peak_gib = gpu_ms(fn, args.rep_ms), peak / 2**30
    else:
        ms, peak_gib = harness.WallTimer().plain(fn), None
    return dict(ms=ms, peak_gib=peak_gib, wall_s=time.time() - started), grads


def run_frozen(args, device, cells, saved):
    """The frozen cells of every (format, model) of args.frozen_runs at every T, appended to `cells` (`saved()` after
    each)."""
    for index, (fmt, name) in enumerate(args.frozen_runs):
        if out_of_budget(args):
            cells += [dict(format=fmt, model=name, T=T, skipped=f"budget {args.budget_s:g} s") for T in args.tokens]
            continue
        shape = frozen_shape(name, args.cpu_smoke)
        try:
            experts = make_frozen_experts(fmt, shape, device, args.seed + 1000 * index)
        except Exception as error:  # weights that do not fit: the model's cells are reported, the run goes on
            cells += [dict(format=fmt, model=name, T=T, error=harness.error_text(error)) for T in args.tokens]
            print(f"{fmt} {name}: {cells[-1]['error']}", flush=True)
            harness.free_memory(device)
            continue
        for T in args.tokens:
            if out_of_budget(args):
                cells.append(dict(format=fmt, model=name, T=T, skipped=f"budget {args.budget_s:g} s"))
                continue
            cell = frozen_cell(args, device, experts, shape, T)
            cells.append(cell)
            print(format_frozen(cell), flush=True)
            saved()
        del experts
        harness.free_memory(device)


def frozen_cell(args, device, experts, shape, T):
    """One (format, model, T) cell: both steps measured, their gradients compared, the weights' gradients looked
    for."""
    E, k, H, F = shape.num_experts, shape.top_k, shape.hidden, shape.ffn
    cell = dict(format=experts.format, model=shape.name, T=T, E=E, top_k=k, H=H, F=F)
    gen = torch.Generator(device=device).manual_seed(args.seed + T)
    x = torch.empty(T, H, device=device, dtype=DTYPE).normal_(0.0, 1.0, generator=gen).requires_grad_()
    grad_out = torch.empty(T, H, device=device, dtype=DTYPE).normal_(0.0, 1.0, generator=gen)
    ids, weights = harness.random_routing(T, E, k, device, args.seed + T)
    weights.requires_grad_()
    grads = {}
    for side in ("quantized", "bf16"):
        try:
            cell[side], grads[side] = measure(frozen_step(x, ids, weights, grad_out, getattr(experts, side)), args,
                                              device)
        except Exception as error:  # a cell that cannot run (memory, a path without a backward) is reported
            cell[side] = dict(error=harness.error_text(error))
        harness.free_memory(device)
    if "ms" in cell["quantized"] and "ms" in cell["bf16"]:
        cell["quantized_over_bf16"] = cell["quantized"]["ms"] / cell["bf16"]["ms"]
    if len(grads) == 2:
        cell["grad_rel_diff"] = {n: reference.relative_error(a, b)
                                 for n, a, b in zip(FROZEN_GRADS, grads["quantized"], grads["bf16"])}
        cell["grad_ok"] = all(diff <= FROZEN_TOLERANCE for diff in cell["grad_rel_diff"].values())  # NaN: False
    cell["weights_with_grad"] = sorted(name for name, t in experts.weight_tensors().items()
                                       if t.requires_grad or t.grad is not None)
    return cell


def frozen_meta(args):
    return dict(formats=list(args.frozen), tokens=list(args.tokens), cpu_smoke=args.cpu_smoke, seed=args.seed,
                grads=list(FROZEN_GRADS), tolerance=FROZEN_TOLERANCE, fp8_block_shape=list(harness.FP8_BLOCK),
                timing="wall-clock median (CPU)" if args.cpu_smoke else
                f"triton.testing.do_bench median, L2 cleared, rep {args.rep_ms} ms",
                git_commit=harness.git_commit())


def format_frozen(cell):
    sides = []
    for side in ("quantized", "bf16"):
        r = cell[side]
        sides.append(f"{side} {r['ms']:.2f} ms {harness.fmt(r['peak_gib'], '.2f')} GiB" if "ms" in r
                     else f"{side} {r['error']}")
    diff = cell.get("grad_rel_diff", {})
    return (f"{cell['format']} {cell['model']} T={cell['T']}: " + " | ".join(sides)
            + f" | q/bf16 {harness.fmt(cell.get('quantized_over_bf16'), '.2f')}"
            + f" | grad diff x {harness.fmt(diff.get('x'), '.1e')} w {harness.fmt(diff.get('topk_weights'), '.1e')}")


def frozen_markdown(cells, device):
    timing = "do_bench medians, L2 cleared" if device.type == "cuda" else "wall-clock medians, Triton's interpreter"
    lines = ["## Frozen quantized experts: d x and d topk_weights only", "",
             f"{device_name(device)}. Times in ms ({timing}); peaks in GiB above the pre-step allocation; grad diff: "
             f"the quantized call's gradients against the bf16 call's, tolerance {FROZEN_TOLERANCE:g}.", "",
             "| format | model | T | quantized ms | bf16 ms | quantized / bf16 | peak quantized | peak bf16 "
             "| grad diff x | grad diff topk_weights | check |",
             "|" + "---|" * 11]
    for c in cells:
        q, b, diff = c.get("quantized", {}), c.get("bf16", {}), c.get("grad_rel_diff", {})
        with_grad = c.get("weights_with_grad")
        check = ("not started: " + c["skipped"] if "skipped" in c else "weights got grads" if with_grad else
                 "error" if "grad_ok" not in c else "ok" if c["grad_ok"] else "FAIL")
        values = (harness.fmt(q.get("ms"), ".2f", "error"), harness.fmt(b.get("ms"), ".2f", "error"),
                  harness.fmt(c.get("quantized_over_bf16"), ".2f"), harness.fmt(q.get("peak_gib"), ".2f"),
                  harness.fmt(b.get("peak_gib"), ".2f"), harness.fmt(diff.get("x"), ".1e"),
                  harness.fmt(diff.get("topk_weights"), ".1e"), check)
        lines.append(f"| {c['format']} | {c['model']} | {c['T']} | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
