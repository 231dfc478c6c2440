"""Fine-tuning a Qwen3-MoE whose experts are frozen FP8, as transformers' `FineGrainedFP8Config` quantizes a checkpoint
(float8_e4m3fn weights, one fp32 scale per block): the attention projections and routers train, the experts' float8
weights and scales stay as they are, and gradients pass through them, dequantized tile by tile in the kernels' loads
(no float copy of an expert is made while training).

    PYTHONPATH=torch-ext python3 examples/fp8_finetune.py              # one GPU: Qwen3-30B-A3B's widths, 2 layers, bf16
    PYTHONPATH=torch-ext python3 examples/fp8_finetune.py --check      # and the gradient check (tiny, fp32)
    PYTHONPATH=torch-ext python3 examples/fp8_finetune.py --tiny       # CPU smoke: the Triton interpreter

The model is a random transformers `Qwen3MoeForCausalLM` (Qwen3-30B-A3B's widths at --layers layers on a GPU in bf16:
H 2048, F 768, 128 experts, top-8 renormalised, 32 query and 4 key/value heads of 128, vocab 151936; tiny widths in
float32 without one) whose experts are then quantized in place the way `from_pretrained(...,
quantization_config=FineGrainedFP8Config(weight_block_size=...))` quantizes a float checkpoint on load, with
transformers' own machinery: its FP8 quantizer swaps every `Qwen3MoeExperts` for an `FP8Experts` on the meta device,
and `Fp8Quantize`, the op loading runs on each weight, fills it from the float stack (e4m3 weights and fp32
`*_scale_inv` per 128 x 128 block at real widths, 16 x 16 at tiny ones). The quantizer's `modules_to_not_convert`
names the attention projections and the LM head, which it would otherwise make `FP8Linear`s: only the experts are
FP8, so the attention stays float and trains (the routers are not linear layers, which the quantizer leaves alone).
`model.set_experts_implementation(moe_dispatch.register_experts())` then runs every `FP8Experts` through the package:
`register_experts` registers its experts function in transformers' `FP8ExpertsInterface` too. Where a gradient is
needed the package computes FP8 experts weight-only on every device (its w8a8 path, activations quantized to e4m3,
is forward-only: `fp8_compute="auto"` takes it for inference on GPUs with FP8 tensor cores): the float8 weights are
dequantized in the loads of the forward GEMMs and of the backward's gradient GEMMs, the activations stay in the
model dtype, and no weight gradient is computed.

Everything is frozen but the attention projections (q/k/v/o) and the routers (the MoE block's `gate`): a stand-in for
adapter training on an FP8 checkpoint (with PEFT: LoRA adapters on `q_proj`, `k_proj`, `v_proj`, `o_proj`, the routers
in `modules_to_save`; transformers' FP8 quantizer says it `is_trainable`). Then --steps AdamW steps of next-token
cross-entropy on one fixed random batch (--batch sequences of --seq-len tokens) in train mode, so the loss has to fall.
Per step: the loss, the step time (between two synchronizes on a GPU; the first step's includes compiling the
kernels, so the median of the others is printed after them) and on a GPU the peak memory of the step. At the end,
checks:
    the loss fell (last step's below the first's);
    every expert tensor (float8 weights and their fp32 scales) is bit-identical to what it was before training;
    every trainable parameter got a finite, non-zero gradient at least once;
    no parameter of the experts has a `.grad`.
And a gradient check (by default without a GPU, with --check on one): a tiny float32 model, its float experts drawn
with a larger spread before quantization so that they move the result, one step's d(loss)/d(attention and router
weights) with the package's FP8 experts against a deep copy of the float model whose experts (transformers' eager
`Qwen3MoeExperts`) hold transformers' dequantization of the same float8 weights and scales (`Fp8Dequantize`, the op
that loading with `FineGrainedFP8Config(dequantize=True)` runs); relative error within the float32 tolerance (1e-4).
It also prints how far the gradient would be off with the experts zeroed, which is what the agreement is worth.
--json PATH writes the numbers. Exit status 1 when any check fails.
"""

import argparse
import collections
import copy
import os
import sys

import torch

# The MXFP4 examples beside this one (their folder on the path also when this file is loaded by path): the generating
# one sets up the device (Triton's interpreter without a GPU, before moe_dispatch imports), the fine-tuning one holds
# the helpers that do not depend on the model family.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_oss_mxfp4 import ON_GPU, GiB  # noqa: E402
from gpt_oss_mxfp4_finetune import (ATTENTION_PROJECTIONS, bits, expert_tensors, finish, loss_of,  # noqa: E402
                                    judge, make_trainable, random_batch, start, train)

import moe_dispatch as md  # noqa: E402  (torch-ext/ on PYTHONPATH)
from moe_dispatch.reference import TOLERANCE, relative_error  # noqa: E402

# Qwen3-30B-A3B's widths (its config.json); the depth is --layers.
REAL = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
            num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4, head_dim=128)
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
# `weight_block_size`: Qwen3-*-FP8's at real widths; at tiny ones a block that still leaves several per weight.
REAL_BLOCK, TINY_BLOCK = (128, 128), (16, 16)
# What the quantizer leaves float (its `modules_to_not_convert`): every nn.Linear but the experts.
NOT_CONVERTED = (*ATTENTION_PROJECTIONS, "lm_head")
EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")
ROUTER = "gate"  # the MoE block's router attribute (GPT-OSS's is `router`)
# The gradient check's float experts are drawn normal(0, 0.1) before quantization, not transformers' normal(0, 0.02):
# at 0.02 an error of 1e-3 in one layer's experts moves d(loss)/d(attention) by about 6e-5, under the tolerance.
CHECK_EXPERTS_STD = 0.1
# What the gradient check compares, each group's gradients flattened into one vector: parameter names ending so.
GRADIENT_GROUPS = {"attention": tuple(f"{name}.weight" for name in ATTENTION_PROJECTIONS),
                   "router": ("mlp.gate.weight",)}
# The run's sizes: (flag, type, default at real widths, default with --tiny, what it is).
SIZES = (("--steps", int, 20, 4, "optimizer steps"), ("--batch", int, 4, 2, "sequences per batch"),
         ("--seq-len", int, 256, 16, "tokens per sequence"), ("--lr", float, 1e-3, 1e-2, "AdamW learning rate"))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", default=not ON_GPU,
                        help="tiny widths (H 64, F 32, 4 experts, top-2, vocab 128, 16 x 16 blocks; the default "
                             "without a GPU)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    for flag, kind, real, tiny, what in SIZES:
        parser.add_argument(flag, type=kind, default=None, help=f"{what} (default {real:g}; {tiny:g} with --tiny)")
    parser.add_argument("--check", action="store_true", default=not ON_GPU,
                        help="the gradient check against dequantized float experts (the default without a GPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    for flag, _, real, tiny, _ in SIZES:
        name = flag.removeprefix("--").replace("-", "_")
        setattr(args, name, getattr(args, name) or (tiny if args.tiny else real))
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the loss of the last step is compared with the first's)")
    return args


def build_float(tiny, layers, device, dtype, seed, experts_std=None):
    """A random Qwen3-MoE causal LM on `device` in `dtype`, its experts still float: transformers' initialisation
    (normal(0, 0.02)), the experts normal(0, `experts_std`) instead where given."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**(TINY if tiny else REAL), num_hidden_layers=layers, attn_implementation="eager")
    torch.manual_seed(seed)  # transformers initialises the weights from torch's global generator
    with torch.device(device):
        model = Qwen3MoeForCausalLM._from_config(config, dtype=dtype)
    if experts_std is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                for name in EXPERT_PROJECTIONS:
                    getattr(layer.mlp.experts, name).normal_(0.0, experts_std)
    return model


def quantize_experts_(model, block):
    """Make `model`'s experts FP8 in place as `from_pretrained(..., quantization_config=FineGrainedFP8Config(
    weight_block_size=block, modules_to_not_convert=NOT_CONVERTED))` does when it loads a float checkpoint: the
    quantizer (`AutoHfQuantizer.from_config`, not pre-quantized) swaps each experts module for an `FP8Experts` on the
    meta device (`preprocess_model`); each is allocated on the model's device and `Fp8Quantize.convert`, the op loading
    runs on a weight, fills it from the float stack it replaces (e4m3 weights, fp32 `*_scale_inv` per block, w ~ w_fp8
    * scale_inv); then `postprocess_model`, with `model.hf_quantizer` set, as from_pretrained leaves them. Each float
    stack is released once quantized. Returns the quantizer."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.auto import AutoHfQuantizer

    config = FineGrainedFP8Config(weight_block_size=tuple(block), modules_to_not_convert=list(NOT_CONVERTED))
    quantizer = AutoHfQuantizer.from_config(config, pre_quantized=False)
    device = next(model.parameters()).device
    floats = {f"model.layers.{i}.mlp.experts": layer.mlp.experts for i, layer in enumerate(model.model.layers)}
    quantizer.preprocess_model(model, dtype=model.dtype)
    quantize = Fp8Quantize(quantizer)
    with torch.no_grad():
        for name in list(floats):
            float_experts, fp8_experts = floats.pop(name), model.get_submodule(name)
            fp8_experts.to_empty(device=device)
            for projection in EXPERT_PROJECTIONS:
                quantized = quantize.convert({f"{name}.{projection}": getattr(float_experts, projection)})
                for key, tensor in quantized.items():
                    getattr(fp8_experts, key.rsplit(".", 1)[1]).copy_(tensor)
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)
    return quantizer


def build(tiny, layers, device, dtype, seed):
    """The fine-tuned model: a random Qwen3-MoE with FP8 experts running through the package."""
    model = build_float(tiny, layers, device, dtype, seed)
    quantize_experts_(model, TINY_BLOCK if tiny else REAL_BLOCK)
    model.set_experts_implementation(md.register_experts())
    return model


def load_dequantized_experts_(reference, model):
    """Fill the float experts of `reference` (a copy of `model` before quantization) with transformers' dequantization
    of `model`'s FP8 experts: `Fp8Dequantize.convert` on each weight and its `*_scale_inv`, what loading with
    `FineGrainedFP8Config(dequantize=True)` runs. Returns `reference`."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    dequantize = Fp8Dequantize(model.hf_quantizer)
    with torch.no_grad():
        for layer, reference_layer in zip(model.model.layers, reference.model.layers):
            for projection in EXPERT_PROJECTIONS:
                stored = {projection: [getattr(layer.mlp.experts, projection)],
                          f"{projection}_scale_inv": [getattr(layer.mlp.experts, f"{projection}_scale_inv")]}
                getattr(reference_layer.mlp.experts, projection).copy_(dequantize.convert(stored)[projection][0])
    return reference


def one_step_gradients(model, input_ids):
    """The loss of `input_ids` in train mode and its gradient {name: tensor} for the trainable parameters."""
    model.train()
    trainable = make_trainable(model, ROUTER)
    loss = loss_of(model, input_ids)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in trainable.items()}


def flat_group(gradients, group):
    """The gradients of one of GRADIENT_GROUPS, flattened into one vector."""
    return torch.cat([g.flatten() for name, g in gradients.items() if name.endswith(GRADIENT_GROUPS[group])])


def gradient_check(args, device):
    """One step's gradient of the attention projections and routers with the package's FP8 experts, against the same
    model with transformers' eager float experts holding the dequantized weights (float32, tiny widths)."""
    model = build_float(True, args.layers, device, torch.float32, args.seed, experts_std=CHECK_EXPERTS_STD)
    reference = copy.deepcopy(model)
    quantize_experts_(model, TINY_BLOCK)
    model.set_experts_implementation(md.register_experts())
    reference = load_dequantized_experts_(reference, model)
    reference.set_experts_implementation("eager")
    without_experts = copy.deepcopy(reference)
    with torch.no_grad():
        for layer in without_experts.model.layers:
            layer.mlp.experts.gate_up_proj.zero_()
            layer.mlp.experts.down_proj.zero_()
    input_ids = random_batch(model.config.vocab_size, 2, 16, args.seed + 1, device)
    (loss, grads), (reference_loss, reference_grads), (_, zeroed_grads) = (
        one_step_gradients(each, input_ids) for each in (model, reference, without_experts))
    ok_kinds = ({type(layer.mlp.experts).__name__ for layer in model.model.layers} == {"FP8Experts"}
                and {type(layer.mlp.experts).__name__ for layer in reference.model.layers} == {"Qwen3MoeExperts"})
    tolerance = TOLERANCE[torch.float32]
    result = {"experts_std": CHECK_EXPERTS_STD, "block": list(TINY_BLOCK), "tolerance": tolerance, "loss": loss,
              "reference_loss": reference_loss, "loss_rel_err": abs(loss - reference_loss) / abs(reference_loss)}
    for group in GRADIENT_GROUPS:
        expected = flat_group(reference_grads, group)
        result[f"{group}_rel_err"] = relative_error(flat_group(grads, group), expected)
        result[f"{group}_without_experts_rel_err"] = relative_error(flat_group(zeroed_grads, group), expected)
    return judge(result, ok_kinds, f"tiny float32 model ({args.layers} layers, experts drawn normal(0, "
                 f"{CHECK_EXPERTS_STD:g}), {TINY_BLOCK[0]} x {TINY_BLOCK[1]} blocks) against transformers' eager "
                 "experts on its dequantization", "zeroed")


def main(argv=None):
    args = parse_args(argv)
    device, dtype, where, check = start(args, gradient_check)

    model = build(args.tiny, args.layers, device, dtype, args.seed)
    config, block = model.config, TINY_BLOCK if args.tiny else REAL_BLOCK
    trainable_count = sum(p.numel() for p in make_trainable(model, ROUTER).values())
    experts = expert_tensors(model)
    experts_bytes = sum(t.numel() * t.element_size() for t in experts.values())
    # the quantizer's FP8 modules by class: FP8Experts alone, NOT_CONVERTED keeping every nn.Linear float
    fp8_modules = collections.Counter(type(module).__name__ for module in model.modules()
                                      if type(module).__name__.startswith("FP8"))
    info = {"layers": args.layers, "hidden": config.hidden_size, "ffn": config.moe_intermediate_size,
            "experts": config.num_experts, "top_k": config.num_experts_per_tok, "vocab": config.vocab_size,
            "dtype": str(dtype).removeprefix("torch."), "block": list(block), "fp8_modules": dict(fp8_modules),
            "trainable_parameters": trainable_count, "parameters": sum(p.numel() for p in model.parameters()),
            "fp8_experts_gib": experts_bytes / GiB}
    print(f"Qwen3-MoE {args.layers} layers, H {config.hidden_size}, F {config.moe_intermediate_size}, "
          f"{config.num_experts} experts top-{config.num_experts_per_tok}, vocab {config.vocab_size}, {info['dtype']}: "
          f"{trainable_count:,} of {info['parameters']:,} parameters train (attention projections, routers); FP8 "
          f"experts ({fp8_modules['FP8Experts']} FP8Experts, e4m3 with fp32 scales per {block[0]} x {block[1]} block) "
          f"{info['fp8_experts_gib']:.2f} GiB, frozen. AdamW lr {args.lr:g}, batch {args.batch} x {args.seq_len} "
          f"tokens", flush=True)
    before = {name: bits(tensor) for name, tensor in experts.items()}

    records, got_gradient = train(model, args, device, ROUTER)
    return finish(model, args, where, info, experts, before, records, got_gradient, check)

if __name__ == "__main__":
    sys.exit(main())
