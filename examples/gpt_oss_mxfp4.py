"""GPT-OSS-120B at real width and depth with random MXFP4 experts, generating through moe_dispatch on one GPU.

    PYTHONPATH=torch-ext python3 examples/gpt_oss_mxfp4.py                 # one H200: 36 layers, about 61 GiB
    PYTHONPATH=torch-ext python3 examples/gpt_oss_mxfp4.py --layers 4      # fewer layers, same widths
    PYTHONPATH=torch-ext python3 examples/gpt_oss_mxfp4.py --tiny          # CPU smoke: the Triton interpreter

`transformers_experts.build_random_gpt_oss_mxfp4` builds the model on the device: made on the meta device, the float
experts dropped before anything is allocated, the rest (attention, router, norms, embeddings, LM head) initialised by
transformers, then each layer's experts allocated as an `Mxfp4Experts` with random uint8 blocks and e8m0 scales (no
bf16 expert copy ever exists: the peak memory says so). The router and attention are transformers' own; only the
experts run here, from their MXFP4 bytes. Nothing is downloaded.

Then, per batch size (--batches, default 1 and 16; a --prompt-len token random prompt), greedy `generate` with
--new-tokens new tokens (`min_new_tokens` equal): decode tokens/s = batch * (n - 1) / (t(n) - t(1)), t(n) the median
over --repeats of `generate(max_new_tokens=n)` between two synchronizes (the difference removes prefill). Before that,
one layer's experts alone: checked against the float64 reference on the dequantized weights of the experts its tokens
hit, and timed per call at each batch size (the decode step runs that call once per layer).
--json PATH writes the numbers. Exit status 1 when the experts check fails.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import moe_dispatch as md  # noqa: E402  (torch-ext/ on PYTHONPATH)
from moe_dispatch.mxfp4 import dequantize_experts_mxfp4  # noqa: E402
from moe_dispatch.reference import TOLERANCE, fused_experts_ref, relative_error  # noqa: E402

GiB = 2**30
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", default=not ON_GPU,
                        help="tiny widths (H = F = 64, 4 experts, top-2, vocab 128; the default without a GPU)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 36; 2 with --tiny)")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,16; 1,2 with --tiny)")
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=None, help="default 32; 3 with --tiny")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per cell (default 3; 1 with --tiny)")
    parser.add_argument("--cache", choices=("dynamic", "static"), default="dynamic",
                        help="static: cache_implementation='static' (transformers then compiles the decode step)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    args.layers = args.layers or (2 if args.tiny else 36)
    args.batches = [int(b) for b in (args.batches or ("1,2" if args.tiny else "1,16")).split(",")]
    args.new_tokens = args.new_tokens or (3 if args.tiny else 32)
    args.repeats = args.repeats or (1 if args.tiny else 3)
    return args


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory(device):
    if device.type != "cuda":
        return {}
    return {"allocated_gib": torch.cuda.memory_allocated(device) / GiB,
            "peak_gib": torch.cuda.max_memory_allocated(device) / GiB}


def build(args, device, dtype):
    from transformers import GptOssConfig

    widths = TINY if args.tiny else {}
    config = GptOssConfig(**widths, num_hidden_layers=args.layers, pad_token_id=199999 if not args.tiny else 2,
                          eos_token_id=200002 if not args.tiny else 1, attn_implementation="eager")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    model = md.transformers_experts.build_random_gpt_oss_mxfp4(config, device=device, dtype=dtype, seed=args.seed)
    synchronize(device)
    built_s = time.perf_counter() - start
    E, H, F = config.num_local_experts, config.hidden_size, config.intermediate_size
    experts = [layer.mlp.experts for layer in model.model.layers]
    experts_bytes = sum(p.numel() * p.element_size() for module in experts for p in module.parameters())
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    info = {"layers": args.layers, "hidden": H, "ffn": F, "experts": E, "top_k": config.num_experts_per_tok,
            "vocab": config.vocab_size, "dtype": str(dtype).removeprefix("torch."), "build_s": built_s,
            "parameters_gib": total_bytes / GiB, "mxfp4_experts_gib": experts_bytes / GiB,
            "float_experts_would_be_gib": args.layers * E * 3 * H * F * dtype.itemsize / GiB, **memory(device)}
    print(f"GPT-OSS {args.layers} layers, H = F = {H}, {E} experts top-{config.num_experts_per_tok}, vocab "
          f"{config.vocab_size}, {info['dtype']}: built on {device} in {built_s:.1f} s; parameters "
          f"{info['parameters_gib']:.2f} GiB, of which MXFP4 experts {info['mxfp4_experts_gib']:.2f} GiB (the "
          f"{info['dtype']} experts would be {info['float_experts_would_be_gib']:.1f} GiB)", flush=True)
    if device.type == "cuda":
        print(f"  torch.cuda.memory_allocated {info['allocated_gib']:.2f} GiB, max_memory_allocated "
              f"{info['peak_gib']:.2f} GiB", flush=True)
    return model, info


def check_and_time_experts(model, args, device, dtype):
    """Layer 0's experts on random hidden states routed by its own router: checked against the float64 reference on
    the experts hit (dequantized), then timed per call at each batch size."""
    block = model.model.layers[0].mlp
    experts, H = block.experts, block.experts.hidden_size
    generator = torch.Generator(device=device).manual_seed(args.seed + 1)
    results = {}
    with torch.no_grad():
        x = torch.randn(4, H, device=device, dtype=dtype, generator=generator)
        _, scores, ids = block.router(x)
        out = experts(x, ids, scores)
        hit, local_ids = ids.unique(return_inverse=True)  # the reference dequantizes only the experts hit
        weights = {name: dequantize_experts_mxfp4(getattr(experts, f"{name}_blocks")[hit],
                                                  getattr(experts, f"{name}_scales")[hit], torch.float64)
                   for name in ("gate_up_proj", "down_proj")}
        ref = fused_experts_ref(x.double(), weights["gate_up_proj"], weights["down_proj"], local_ids, scores,
                                activation="swiglu_oai", interleaved=True,
                                gate_up_bias=experts.gate_up_proj_bias[hit].double(),
                                down_bias=experts.down_proj_bias[hit].double(), swiglu_alpha=experts.alpha,
                                swiglu_limit=experts.limit)
        del weights
        error = relative_error(out, ref)
        results["check"] = {"tokens": x.shape[0], "experts_hit": hit.numel(), "rel_err": error,
                            "tolerance": TOLERANCE[dtype], "ok": error <= TOLERANCE[dtype]}
        print(f"layer 0 experts vs float64 reference on {x.shape[0]} tokens ({hit.numel()} experts hit): relative "
              f"error {error:.2e} ({'ok' if results['check']['ok'] else 'MISMATCH'}, tolerance {TOLERANCE[dtype]:.0e})",
              flush=True)

        per_expert_bytes = sum(p[0].numel() * p.element_size() for p in experts.parameters())
        reps = 50 if device.type == "cuda" else 1
        results["timing"] = []
        for tokens in args.batches:
            x = torch.randn(tokens, H, device=device, dtype=dtype, generator=generator)
            _, scores, ids = block.router(x)
            experts(x, ids, scores)  # compile / plan this shape
            synchronize(device)
            start = time.perf_counter()
            for _ in range(reps):
                experts(x, ids, scores)
            synchronize(device)
            call_s = (time.perf_counter() - start) / reps
            hit_bytes = ids.unique().numel() * per_expert_bytes
            cell = {"tokens": tokens, "us_per_call": call_s * 1e6, "experts_hit": ids.unique().numel(),
                    "weight_gb_per_s": hit_bytes / call_s / 1e9, "all_layers_ms": call_s * args.layers * 1e3}
            results["timing"].append(cell)
            print(f"  experts forward, T = {tokens}: {cell['us_per_call']:.1f} us per layer ({cell['experts_hit']} "
                  f"experts hit, {cell['weight_gb_per_s']:.0f} GB/s of their MXFP4 bytes); x {args.layers} layers = "
                  f"{cell['all_layers_ms']:.2f} ms per decode step", flush=True)
    return results


def time_generate(model, args, device, batch):
    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab, (batch, args.prompt_len), generator=torch.Generator().manual_seed(args.seed))
    prompt = prompt.to(device)
    kwargs = dict(attention_mask=torch.ones_like(prompt), do_sample=False, pad_token_id=model.config.pad_token_id)
    if args.cache == "static":
        kwargs["cache_implementation"] = "static"

    def run(new_tokens):
        synchronize(device)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        synchronize(device)
        return time.perf_counter() - start, out

    run(args.new_tokens)  # warm-up: kernels compiled for every shape the run meets
    if args.cache == "static":
        run(args.new_tokens)  # compiled modes: the compile, then the CUDA-graph recording
    t_one = statistics.median(run(1)[0] for _ in range(args.repeats))
    runs = [run(args.new_tokens) for _ in range(args.repeats)]
    t_full = statistics.median(t for t, _ in runs)
    out = runs[-1][1]
    steps = args.new_tokens - 1
    decode_s = t_full - t_one
    cell = {"batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "cache": args.cache,
            "generate_s": t_full, "prefill_s": t_one,
            "tokens_per_s": batch * steps / decode_s if decode_s > 0 else None,
            "ms_per_step": decode_s / steps * 1e3 if steps else None, "generated": out.shape[1] - args.prompt_len,
            **memory(device)}
    rate = f"{cell['tokens_per_s']:.1f}" if cell["tokens_per_s"] else "n/a"
    step = f"{cell['ms_per_step']:.2f}" if cell["ms_per_step"] else "n/a"
    print(f"generate batch {batch}: {args.new_tokens} new tokens in {t_full:.2f} s (t(1) {t_one:.2f} s); decode "
          f"{rate} tok/s, {step} ms/step" + (f"; peak {cell['peak_gib']:.2f} GiB" if "peak_gib" in cell else ""),
          flush=True)
    return cell


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda" if ON_GPU else "cpu")
    dtype = getattr(torch, args.dtype)
    where = (torch.cuda.get_device_name(device) if ON_GPU
             else "CPU, Triton interpreter (correctness only: the times are not speed figures)")
    print(f"moe_dispatch {md.__version__} on {where}; torch {torch.__version__}", flush=True)
    model, info = build(args, device, dtype)
    experts = check_and_time_experts(model, args, device, dtype)
    cells = [time_generate(model, args, device, batch) for batch in args.batches]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": where, "model": info, "experts": experts, "generate": cells, "args": vars(args)}, f,
                      indent=1)
    return 0 if experts["check"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
