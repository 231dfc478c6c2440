"""Training benchmark of the experts path: forward + backward in bf16 on a GPU, with peak memory.

Compares, in one run and on the same tensors, `moe_dispatch.fused_experts` under autograd with what a user would pick
instead: transformers' `grouped_mm` experts implementation under autograd (a real `MixtralExperts` module of the
model's sizes, all four models run the same SiLU-gated experts) and Liger-Kernel's `LigerFusedMoEFunction` (when
`liger_kernel` imports). Times are `triton.testing.do_bench` medians (L2 cleared before every call) of one call of
`torch.autograd.grad(out, [x, w_gate_up, w_down, topk_weights], grad_out)`; FLOPs = 3 x the forward's
2 * T * top_k * 3 * H * F; P is the dense bf16 matmul rate measured in the same run. Peak memory is the allocator's
peak during one step above what was allocated before it (inputs and weights). Every cell checks moe_dispatch's
gradients against grouped_mm's (both bf16; norm-wise relative difference).

Run it through its launcher (which puts the package and benchmarks/ on PYTHONPATH, scripts/_env.sh):

    scripts/bench_train --out results/train

Writes train.json and train.md under --out and prints the table.
"""

import argparse
import json
import os
import time

import torch
import triton
from model_shapes import MODEL_SHAPES

import moe_dispatch as md

MODELS = ("mixtral-8x7b", "qwen2-57b-a14b", "qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b")
DTYPE = torch.bfloat16


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--tokens", default="4096,16384")
    p.add_argument("--out", default="train-out")
    p.add_argument("--rep-ms", type=int, default=300, help="do_bench measuring time per call site")
    p.add_argument("--liger-models", default="mixtral-8x7b",
                   help="models Liger runs on (its autotuning takes minutes per new shape)")
    return p.parse_args()


def matmul_rate():
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    b = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300)
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


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    P = matmul_rate()
    impls = ["moe_dispatch", "grouped_mm"] + (["liger"] if liger_function() is not None else [])
    print(f"bf16 matmul P = {P / 1e12:.0f} TFLOP/s; implementations: {impls}", flush=True)
    rows = []
    for name in args.models.split(","):
        shape = MODEL_SHAPES[name]
        E, k, H, F = shape.num_experts, shape.top_k, shape.hidden, shape.ffn
        torch.manual_seed(0)
        w_gate_up = (torch.randn(E, 2 * F, H, device="cuda", dtype=DTYPE) * 0.02).requires_grad_()
        w_down = (torch.randn(E, H, F, device="cuda", dtype=DTYPE) * 0.02).requires_grad_()
        for T in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(T, H, device="cuda", dtype=DTYPE, requires_grad=True)
            ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
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
                    ms = triton.testing.do_bench(fn, warmup=25, rep=args.rep_ms)
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
            del x, ids, weights, grad_out, grads
            torch.cuda.empty_cache()
        del w_gate_up, w_down
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "train.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                       P=P, rows=rows), f, indent=1)
    table = markdown(rows, impls, P)
    with open(os.path.join(args.out, "train.md"), "w") as f:
        f.write(table)
    print(table)


def format_row(row, impls):
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
        cells = []
        for impl in impls:
            r = row[impl]
            cells.append(f"{r['ms']:.2f} ({r['tflops']:.0f}, {r['peak_gib']:.1f})" if "ms" in r else "error")
        ours = row["moe_dispatch"]
        target = f"{ours['tflops'] * 1e12 / (0.8 * P):.2f}" if "ms" in ours else "-"
        diff = max(row.get("grad_rel_diff_vs_grouped_mm", {"-": float("nan")}).values())
        lines.append(f"| {row['model']} | {row['T']} | " + " | ".join(cells) + f" | {target} | {diff:.1e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
