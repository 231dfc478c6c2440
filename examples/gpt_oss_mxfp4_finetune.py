"""Fine-tuning a GPT-OSS whose MXFP4 experts stay as stored: the attention projections and routers train, the experts'
uint8 blocks, scales and biases stay frozen, and gradients pass through them without a float copy of any expert.

    PYTHONPATH=torch-ext python3 examples/gpt_oss_mxfp4_finetune.py              # one GPU: real widths, 2 layers, bf16
    PYTHONPATH=torch-ext python3 examples/gpt_oss_mxfp4_finetune.py --check      # and the gradient check (tiny, fp32)
    PYTHONPATH=torch-ext python3 examples/gpt_oss_mxfp4_finetune.py --tiny       # CPU smoke: the Triton interpreter

`transformers_experts.build_random_gpt_oss_mxfp4` builds a random GPT-OSS causal LM whose experts are `Mxfp4Experts`
(gpt-oss-120b's widths at --layers layers on a GPU in bf16; tiny widths in float32 without one). Everything is frozen
but the attention projections (q/k/v/o, weights and biases) and the routers: a stand-in for adapter training on an
MXFP4 checkpoint. With PEFT one would wrap the same modules instead (LoRA adapters on `q_proj`, `k_proj`, `v_proj`,
`o_proj`, the routers in `modules_to_save`); the experts see the same thing either way: gradients flow through them to
the hidden states and the routing weights, and none reaches their parameters. The loop here is plain PyTorch;
transformers' `Trainer` takes such a model once PEFT adapters are attached (it refuses a quantized model without
them, and asks the quantizer `is_trainable`, which the package's MXFP4 quantizer answers yes: its experts are frozen,
the rest trains).

Then --steps AdamW steps of next-token cross-entropy on one fixed random batch (--batch sequences of --seq-len
tokens) in train mode, so the loss has to fall (the model overfits the batch). Per step: the loss, the step time
(between two synchronizes on a GPU; the first step's includes compiling the kernels, so the median of the others is
printed after them) and on a GPU the peak memory of the step. At the end, checks:
    the loss fell (last step's below the first's);
    every expert tensor (uint8 blocks and scales, biases) is bit-identical to what it was before training;
    every trainable parameter got a finite, non-zero gradient at least once;
    no parameter of the experts has a `.grad`.
And a gradient check (by default without a GPU, with --check on one): a tiny float32 model, its experts' scale codes
raised so that they move the result, one step's d(loss)/d(attention and router weights) with the package's experts
against a deep copy whose experts transformers' `dequantize()` turned into float `GptOssExperts`; relative error
within the float32 tolerance (1e-4). It also prints how far the gradient would be off with the experts left out, which
is what the agreement is worth. --json PATH writes the numbers. Exit status 1 when any check fails.
"""

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

# The generating example beside this one (its folder on the path also when this file is loaded by path) sets up the
# device (Triton's interpreter without a GPU, before moe_dispatch imports) and holds the tiny widths.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_oss_mxfp4 import ON_GPU, TINY, GiB, synchronize  # noqa: E402

import moe_dispatch as md  # noqa: E402  (torch-ext/ on PYTHONPATH)
from moe_dispatch.reference import TOLERANCE, relative_error  # noqa: E402
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
# The gradient check's experts: scale codes 122-125 give weights of standard deviation about 0.1-0.7 (the default 120
# about 0.02-0.05), so the experts' share of the attention gradient is far above the tolerance.
CHECK_SCALE_CODE = 124
# What the gradient check compares, each group's gradients flattened into one vector: parameter names ending so.
GRADIENT_GROUPS = {"attention": tuple(f"{name}.{kind}" for name in ATTENTION_PROJECTIONS
                                      for kind in ("weight", "bias")),
                   "router": ("router.weight", "router.bias")}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", default=not ON_GPU,
                        help="tiny widths (H = F = 64, 4 experts, top-2, vocab 128; the default without a GPU)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default 20; 4 with --tiny)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per batch (default 4; 2 with --tiny)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 256; 16 with --tiny)")
    parser.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default 1e-3; 1e-2 with --tiny)")
    parser.add_argument("--check", action="store_true", default=not ON_GPU,
                        help="the gradient check against dequantized float experts (the default without a GPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    args.steps = args.steps or (4 if args.tiny else 20)
    args.batch = args.batch or (2 if args.tiny else 4)
    args.seq_len = args.seq_len or (16 if args.tiny else 256)
    args.lr = args.lr or (1e-2 if args.tiny else 1e-3)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the loss of the last step is compared with the first's)")
    return args


def build(tiny, layers, device, dtype, seed, **changes):
    """A random GPT-OSS causal LM with MXFP4 experts; `changes` go to `build_random_gpt_oss_mxfp4`."""
    from transformers import GptOssConfig

    widths = TINY if tiny else {}
    config = GptOssConfig(**widths, num_hidden_layers=layers, pad_token_id=2 if tiny else 199999,
                          eos_token_id=1 if tiny else 200002, attn_implementation="eager")
    torch.manual_seed(seed)  # transformers initialises the non-expert weights from torch's global generator
    return md.transformers_experts.build_random_gpt_oss_mxfp4(config, device=device, dtype=dtype, seed=seed, **changes)


def make_trainable(model, router="router"):
    """Freeze everything, then let the attention projections and the routers (each MoE block's `router` attribute)
    train; returns {name: parameter}."""
    model.requires_grad_(False)
    for layer in model.model.layers:
        for module in (*(getattr(layer.self_attn, name) for name in ATTENTION_PROJECTIONS), getattr(layer.mlp, router)):
            module.requires_grad_(True)
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def expert_tensors(model):
    """{name: tensor} of every experts module's parameters and buffers."""
    return {f"model.layers.{i}.mlp.experts.{name}": tensor for i, layer in enumerate(model.model.layers)
            for name, tensor in (*layer.mlp.experts.named_parameters(), *layer.mlp.experts.named_buffers())}


def bits(tensor):
    """The tensor's bytes as uint8 on the host: compared with `torch.equal`, bit for bit (NaN and -0.0 included)."""
    return tensor.detach().contiguous().view(torch.uint8).to("cpu", copy=True)


def random_batch(vocab, batch, seq_len, seed, device):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, seq_len), generator=generator).to(device)


def loss_of(model, input_ids):
    """Next-token cross-entropy: transformers shifts the labels."""
    return model(input_ids=input_ids, labels=input_ids).loss


def gradient_check(args, device):
    """One step's gradient of the attention projections and routers with the package's MXFP4 experts, against the
    same model with transformers' dequantized float experts (float32, tiny widths)."""
    model = build(True, args.layers, device, torch.float32, args.seed, scale_code=CHECK_SCALE_CODE)
    reference = copy.deepcopy(model).dequantize()  # every Mxfp4Experts -> GptOssExperts, weights dequantized
    without_experts = copy.deepcopy(reference)
    with torch.no_grad():
        for layer in without_experts.model.layers:
            for p in layer.mlp.experts.parameters():
                p.zero_()
    input_ids = random_batch(model.config.vocab_size, 2, 16, args.seed + 1, device)
    grads, losses = [], []
    for each in (model, reference, without_experts):
        each.train()
        trainable = make_trainable(each)
        loss = loss_of(each, input_ids)
        loss.backward()
        losses.append(loss.item())
        grads.append({name: p.grad for name, p in trainable.items()})
    ok_kinds = {type(layer.mlp.experts).__name__ for layer in reference.model.layers} == {"GptOssExperts"}
    tolerance = TOLERANCE[torch.float32]
    result = {"scale_code": CHECK_SCALE_CODE, "tolerance": tolerance, "loss": losses[0], "reference_loss": losses[1],
              "loss_rel_err": abs(losses[0] - losses[1]) / abs(losses[1])}
    for group, suffixes in GRADIENT_GROUPS.items():
        names = [name for name in grads[0] if name.endswith(suffixes)]
        flat = [torch.cat([g[name].flatten() for name in names]) for g in grads]
        result[f"{group}_rel_err"] = relative_error(flat[0], flat[1])
        result[f"{group}_without_experts_rel_err"] = relative_error(flat[2], flat[1])
    return judge(result, ok_kinds, f"tiny float32 model ({args.layers} layers, experts' scale codes "
                 f"{CHECK_SCALE_CODE - 2}-{CHECK_SCALE_CODE + 1}) against transformers' dequantized float experts",
                 "left out")


def judge(result, ok_kinds, what, without):
    """The gradient check's verdict on `result` (its relative errors and tolerance), printed with `what` was compared
    and how the experts were taken away for the comparison that shows what the agreement is worth; `ok_kinds`: the
    reference's experts are the float class expected. Returns `result` with "ok"."""
    tolerance = result["tolerance"]
    result["ok"] = (ok_kinds and result["loss_rel_err"] <= tolerance and result["attention_rel_err"] <= tolerance
                    and result["router_rel_err"] <= tolerance)
    print(f"gradient check, {what}: d(loss)/d(attention) relative error {result['attention_rel_err']:.2e}, "
          f"d(loss)/d(router) {result['router_rel_err']:.2e}, loss {result['loss_rel_err']:.1e} "
          f"({'ok' if result['ok'] else 'MISMATCH'}, tolerance {tolerance:.0e}); with the experts {without}, "
          f"d(loss)/d(attention) would be off by {result['attention_without_experts_rel_err']:.2e}", flush=True)
    return result


def train(model, args, device, router="router"):
    """--steps AdamW steps on one fixed batch, `make_trainable(model, router)` training; returns (per-step records,
    {name: got a finite, non-zero gradient})."""
    trainable = make_trainable(model, router)
    optimizer = torch.optim.AdamW(trainable.values(), lr=args.lr)
    input_ids = random_batch(model.config.vocab_size, args.batch, args.seq_len, args.seed + 2, device)
    got_gradient = dict.fromkeys(trainable, False)  # a finite, non-zero gradient at least once
    model.train()
    records = []
    for step in range(args.steps):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        synchronize(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model, input_ids)
        loss.backward()
        for name, p in trainable.items():
            if p.grad is not None and not got_gradient[name]:
                got_gradient[name] = bool(torch.isfinite(p.grad).all() and p.grad.ne(0).any())
        optimizer.step()
        synchronize(device)
        record = {"step": step, "loss": loss.item(), "step_s": time.perf_counter() - start}
        if device.type == "cuda":
            record["peak_gib"] = torch.cuda.max_memory_allocated(device) / GiB
        records.append(record)
        peak = f", peak {record['peak_gib']:.2f} GiB" if "peak_gib" in record else ""
        print(f"step {step}: loss {record['loss']:.4f}, {record['step_s'] * 1e3:.1f} ms{peak}", flush=True)
    return records, got_gradient


def start(args, check_gradients):
    """The run's device and dtype (a GPU in bf16, else the CPU in float32), printed, then `check_gradients(args,
    device)` where --check asks for it -> (device, dtype, the device in words, the check's result or None)."""
    device = torch.device("cuda" if ON_GPU else "cpu")
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    where = (torch.cuda.get_device_name(device) if ON_GPU
             else "CPU, Triton interpreter (correctness only: the times are not speed figures)")
    print(f"moe_dispatch {md.__version__} on {where}; torch {torch.__version__}", flush=True)
    return device, dtype, where, check_gradients(args, device) if args.check else None


def main(argv=None):
    args = parse_args(argv)
    device, dtype, where, check = start(args, gradient_check)

    model = build(args.tiny, args.layers, device, dtype, args.seed)
    config = model.config
    trainable_count = sum(p.numel() for p in make_trainable(model).values())
    experts = expert_tensors(model)
    experts_bytes = sum(t.numel() * t.element_size() for t in experts.values())
    info = {"layers": args.layers, "hidden": config.hidden_size, "ffn": config.intermediate_size,
            "experts": config.num_local_experts, "top_k": config.num_experts_per_tok, "vocab": config.vocab_size,
            "dtype": str(dtype).removeprefix("torch."), "trainable_parameters": trainable_count,
            "parameters": sum(p.numel() for p in model.parameters()), "mxfp4_experts_gib": experts_bytes / GiB}
    print(f"GPT-OSS {args.layers} layers, H = F = {config.hidden_size}, {config.num_local_experts} experts top-"
          f"{config.num_experts_per_tok}, vocab {config.vocab_size}, {info['dtype']}: {trainable_count:,} of "
          f"{info['parameters']:,} parameters train (attention projections, routers); MXFP4 experts "
          f"{info['mxfp4_experts_gib']:.2f} GiB, frozen. AdamW lr {args.lr:g}, batch {args.batch} x {args.seq_len} "
          f"tokens", flush=True)
    before = {name: bits(tensor) for name, tensor in experts.items()}

    records, got_gradient = train(model, args, device)
    return finish(model, args, where, info, experts, before, records, got_gradient, check)


def finish(model, args, where, info, experts, before, records, got_gradient, check):
    """The median step time and the checks after training (module docstring), printed and written to --json
    (`where` the device in words, `info` the model's description, `experts` and `before` the expert tensors and
    their bits before training, `check` the gradient check's result or None); returns the exit status."""
    median_step_s = statistics.median(record["step_s"] for record in records[1:])
    print(f"median step time after the first: {median_step_s * 1e3:.1f} ms", flush=True)
    checks = {}
    if check is not None:
        checks["gradient_matches_dequantized_reference"] = check["ok"]
    changed = [name for name, tensor in expert_tensors(model).items() if not torch.equal(bits(tensor), before[name])]
    with_grad = [name for name, tensor in experts.items() if getattr(tensor, "grad", None) is not None]
    without_gradient = [name for name, got in got_gradient.items() if not got]
    first, last = records[0]["loss"], records[-1]["loss"]
    checks.update({"loss_decreased": last < first, "experts_bit_identical": not changed,
                   "every_trainable_parameter_got_a_gradient": not without_gradient,
                   "no_expert_parameter_has_grad": not with_grad})
    details = {"loss_decreased": f"{first:.4f} -> {last:.4f}",
               "experts_bit_identical": f"{len(experts)} tensors" + (f"; changed: {changed}" if changed else ""),
               "every_trainable_parameter_got_a_gradient": f"{len(got_gradient)} tensors" + (
                   f"; none for: {without_gradient}" if without_gradient else ""),
               "no_expert_parameter_has_grad": f"with .grad: {with_grad}" if with_grad else "none has one"}
    if check is not None:
        details["gradient_matches_dequantized_reference"] = (f"attention {check['attention_rel_err']:.1e}, router "
                                                             f"{check['router_rel_err']:.1e}")
    for name, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name.replace('_', ' ')} ({details[name]})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": where, "model": info, "steps": records, "median_step_s": median_step_s,
                       "gradient_check": check, "checks": checks, "args": vars(args)}, f, indent=1)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
