"""One fused MoE forward against the float64 reference, with its time.

From the repository root:

    bash scripts/demo                                   # the project's .venv (made by scripts/setup-env if missing)
    bash scripts/demo --model deepseek-v3 --tokens 32
    PYTHONPATH=torch-ext:benchmarks .venv/bin/python examples/demo.py --model deepseek-v3 --tokens 32

The last line is what scripts/demo runs; any Python with the pinned torch and triton (requirements.txt) does in place
of .venv/bin/python. With a GPU: the model's real layer in bf16. Without: its routing on a shrunk layer through the
Triton interpreter.
"""

import argparse
import os
import sys
import time

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import moe_dispatch as md  # noqa: E402  (torch-ext/ and benchmarks/ on PYTHONPATH: scripts/_env.sh)
from model_shapes import MODEL_SHAPES, shrunk  # noqa: E402
from moe_dispatch.reference import fused_moe_forward_ref  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mixtral-8x7b", choices=sorted(MODEL_SHAPES),
                        help="the model whose MoE layer runs (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=64 if ON_GPU else 16,
                        help="tokens T in the batch (default: %(default)s here)")
    args = parser.parse_args()
    real = MODEL_SHAPES[args.model]
    shape = real if ON_GPU else shrunk(real)
    if shape != real:
        print(f"No GPU: the Triton interpreter runs {real.name}'s routing on a shrunk shape (E={shape.num_experts} "
              f"H={shape.hidden} F={shape.ffn}; the real layer has E={real.num_experts} H={real.hidden} "
              f"F={real.ffn}). Correctness only; the time is not a speed figure.", flush=True)
    device, dtype = ("cuda", torch.bfloat16) if ON_GPU else ("cpu", torch.float32)
    E, k, H, F = shape.num_experts, shape.top_k, shape.hidden, shape.ffn
    g = torch.Generator(device="cpu").manual_seed(0)
    make = lambda *s: (torch.randn(*s, generator=g) * 0.02).to(device, dtype)  # noqa: E731
    x = (torch.randn(args.tokens, H, generator=g)).to(device, dtype)
    router_weight, w_gate, w_up, w_down = make(E, H), make(E, F, H), make(E, F, H), make(E, H, F)
    kwargs = shape.routing_kwargs()
    if shape.score_correction_bias:
        kwargs["e_score_correction_bias"] = make(E).float()
    if shape.router_bias:
        kwargs["router_bias"] = make(E)
    call = lambda: md.fused_moe_forward(x, router_weight, w_gate, w_up, w_down, E, k, shape.gating, **kwargs)  # noqa
    out, ids, weights = call()  # compile / warm up
    if ON_GPU:
        torch.cuda.synchronize()
    start = time.perf_counter()
    reps = 20 if ON_GPU else 1
    for _ in range(reps):
        out, ids, weights = call()
    if ON_GPU:
        torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / reps
    ref, ref_ids, _ = fused_moe_forward_ref(x, router_weight, w_gate, w_up, w_down, E, k, shape.gating, **kwargs)
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    where = "GPU " + torch.cuda.get_device_name() if ON_GPU else "CPU, Triton interpreter"
    routing_ok = torch.equal(ids.cpu(), ref_ids.cpu())
    nan_free = not out.isnan().any().item()
    ok = rel < (2e-2 if dtype == torch.bfloat16 else 1e-4)  # False for NaN; routing may differ at bf16 near-ties
    label = shape.name + (" (shrunk)" if shape != real else "")
    print(f"{label}: T={args.tokens} E={E} top_k={k} H={H} F={F} {str(dtype)[6:]} on {where} | "
          f"{elapsed * 1e3:.2f} ms/forward | rel. error {rel:.1e} vs float64 | routing "
          f"{'matches' if routing_ok else 'DIFFERS'} | {'no NaN' if nan_free else 'NaN in output'} | "
          f"{'OK' if ok else 'MISMATCH'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
