"""Per-kernel GPU times of the package's FP8 (w8a8) and bf16 experts path for a few model shapes, from the torch
profiler: which launch the time goes to. Needs a GPU.

    scripts/_env.sh's PYTHONPATH; python scripts/profile_fp8.py --models mixtral-8x7b --tokens 4096
"""

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

import moe_dispatch
from model_shapes import MODEL_SHAPES


def inputs(shape, T, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    E, H, F, k = shape.num_experts, shape.hidden, shape.ffn, shape.top_k
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    w1 = torch.randn(E, 2 * F, H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    w2 = torch.randn(E, H, F, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    logits = torch.randn(T, E, device="cuda", generator=g)
    weights, ids = torch.topk(logits.softmax(-1), k, dim=-1)
    return x, w1, w2, ids.to(torch.int32), weights / weights.sum(-1, keepdim=True)


def kernel_times(fn, reps=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name[:70]] += event.device_time / reps
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mixtral-8x7b,qwen3-30b-a3b")
    parser.add_argument("--tokens", default="4096")
    parser.add_argument("--fp8-compute", default="w8a8")
    args = parser.parse_args()
    for name in args.models.split(","):
        shape = MODEL_SHAPES[name]
        for T in (int(t) for t in args.tokens.split(",")):
            x, w1, w2, ids, weights = inputs(shape, T)
            q1, s1 = moe_dispatch.quantize_experts_fp8(w1)
            q2, s2 = moe_dispatch.quantize_experts_fp8(w2)
            runs = {
                "bf16": lambda: moe_dispatch.fused_experts(x, w1, w2, ids, weights),
                "fp8": lambda: moe_dispatch.fused_experts(x, q1, q2, ids, weights, w_gate_up_scale=s1,
                                                         w_down_scale=s2, fp8_compute=args.fp8_compute),
            }
            for label, fn in runs.items():
                times = kernel_times(fn)
                total = sum(times.values())
                print(f"{name} T={T} {label}: {total:.1f} us of kernels")
                for kernel, us in sorted(times.items(), key=lambda kv: -kv[1]):
                    print(f"    {us:9.1f} us  {kernel}")


if __name__ == "__main__":
    main()
