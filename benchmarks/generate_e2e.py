"""End-to-end decode speed of transformers' `generate` with moe_dispatch as the experts implementation.

Builds causal-LM models of real layer width and small depth from transformers configs (random weights, nothing is
downloaded) and runs greedy `generate` on one model object, switching its experts implementation between runs
(`model.set_experts_implementation`), so every implementation decodes with the same weights from the same prompt.
One model per MoE family the package targets, each in the layout transformers stores its experts in:

    qwen3-30b-a3b      Qwen3MoeForCausalLM    H 2048, F 768, 128 experts, top-8 renormalised, 32 q / 4 kv heads of 128
    mixtral-8x7b       MixtralForCausalLM     H 4096, F 14336, 8 experts, top-2, 32 q / 8 kv heads
    deepseek-v3        DeepseekV3ForCausalLM  H 7168, F 2048, 256 experts, top-8 of 4 groups out of 8, sigmoid scores
                                              with e_score_correction_bias, a shared expert, MLA attention; every layer
                                              MoE (first_k_dense_replace 0)
    gpt-oss-120b       GptOssForCausalLM      H = F = 2880, 128 experts, top-4 (softmax over the 4 biased logits);
                                              experts stored [E, H, 2F] with gate/up columns interleaved, biases, and
                                              the clamped SwiGLU; 64 q / 8 kv heads of 64 with attention sinks, layers
                                              alternating sliding window (128) and full attention; eager attention
                                              (transformers has no sdpa path for the sinks)
    olmoe-1b-7b        OlmoeForCausalLM       H 2048, F 1024, 64 experts, top-8 not renormalised, 16 heads of 128
    qwen1.5-moe-a2.7b  Qwen2MoeForCausalLM    H 2048, F 1408, 60 experts, top-4 not renormalised, a sigmoid-gated
                                              shared expert (F 5632), 16 heads of 128

and, named in --models only (not in the default list), gpt-oss-20b: gpt-oss-120b's layers with 32 experts.

The expert widths and routing come from benchmarks/model_shapes.py (the table the kernel benchmarks use); --layers
decoder layers (default 2) and a vocabulary of --vocab (default 32000, so the LM head does not dominate), bf16. The
models are built on the device with transformers' weight initialisation switched off (`no_init_weights`), then every
weight is filled in place: norms 1, biases 0 except the experts' own (GPT-OSS's gate_up_proj_bias and down_proj_bias,
normal(0, --init-std) like the weights, so the token match covers the kernels' bias path), the rest normal(0,
--init-std), the DeepSeek-V3 correction bias an fp32 normal(0, 0.1) tensor. Building DeepSeek-V3 at 2 layers takes
about 47 GB, GPT-OSS-120B about 13 GB.

Implementations, in one process on one model: `moe_dispatch` (`moe_dispatch.register_experts()`), transformers'
default (`grouped_mm`, which `generate` itself swaps for `batched_mm` during the decode steps on a GPU:
`GenerationMixin._optimize_model_for_decode`), `batched_mm` (for prefill too: it gathers every token's expert
weights, which for 16 x 32 prompt tokens exceeds the GPU's memory on Mixtral and DeepSeek-V3; those cells record the
out-of-memory error), and `grouped_mm_always`: transformers' grouped_mm function registered under a second name,
which that swap leaves alone (grouped_mm's own decode speed).

Modes: `eager` is `generate` with the default DynamicCache, no compilation; `static` is
`cache_implementation="static"`, for which transformers compiles the decode step (torch.compile, inductor,
"reduce-overhead", i.e. CUDA graphs; prefill runs uncompiled). `generate` builds a new StaticCache on every call, whose
tensors are static inputs of the CUDA graphs, so each call's first decode step records its graph again (inside the
timed t(new_tokens)); `static-reuse` passes one StaticCache per batch size as `past_key_values` instead, reset before
every call, so the recorded graph replays from the first step: the steady decode rate. Every run is greedy,
--new-tokens (default 64) with `min_new_tokens` equal, so every row decodes the same number of steps; prompts are
--prompt-len (default 32) random ids from a fixed seed, batch sizes --batches (default 1,16; --static-batches, when
given, replaces them in the compiled modes, e.g. eager at 1 and 16 but compiled at 1 only).

Metric: decode tokens/s = batch * (new_tokens - 1) / (t(new_tokens) - t(1)), where t(n) is the median over --repeats
(default 3, after --warmup runs; the compiled modes warm up at least twice: compile, then CUDA-graph recording) of
`generate(max_new_tokens=n)` timed between two `torch.cuda.synchronize()`; the difference removes prefill and set-up.
In the eager mode the implementations' timed runs are interleaved (each round times every implementation once, the
order rotated by one per round): eager decode is host-bound, and the host's speed drifts by tens of percent within
one process on a shared machine, so cells timed one after another would compare the drift. `--interleave all` does
the same in the compiled modes (each implementation's compiled graph stays in dynamo's cache and replays after a
switch).
Each implementation's tokens are compared with the reference's (transformers' default on a GPU, its `eager` loop on
the CPU): the fraction of rows equal, and the first generated position at which any row differs (bf16 random weights
can legitimately diverge after a few tokens: a near-tie in an argmax flips on rounding).

Prefill (--prefill-tokens N; off by default, 4096 in the MXFP4 mode on a GPU): one forward of an N-token prompt at
batch 1 with the logits of the last position only, as generate's prefill runs it, timed between two synchronizes;
--warmup untimed forwards per implementation, then --repeats rounds interleaved as the eager decode's; the median ms,
tokens/s, vs default (the default's ms over this one's) and whether its next token equals the reference's.

Per model the order is: eager decode, prefill, training, static, static-reuse (a run cut by --budget-s loses the
compiled modes first; a cell that fails records its error and the run goes on).

Training (--train, on by default on a GPU): one forward + backward of a --train-tokens batch (default 4x512,
labels = input ids) with moe_dispatch and with grouped_mm: step time (median of --train-steps after one warm-up
step each, the implementations interleaved step by step), peak memory (torch.cuda.max_memory_allocated after a reset), the loss, and the largest norm-wise relative
difference between the two implementations' gradients of the experts' weights (gate_up_proj, down_proj and, where
the experts have them, their biases, of every layer; also max |diff| / max |ref|).

--profile-train (implies --train): after its timed steps, each implementation's training step runs once more under
torch.profiler (CPU and CUDA activities), with the model's experts, router and attention modules marked by
`record_function` ranges (`module_scope`: classes named *Experts, *Router, *Attention); a backward kernel belongs to
the module whose forward operator created its autograd node (matched by sequence number). Each device kernel and copy
is read from the host event that launched it (device time no host event claims stays in `other` under one name, so the
categories add up to the device's time) and put in one category (`categorize_kernels`, first rule that matches):
`moe_dispatch` (the package's Triton kernels, by name), `casts/copies` (copy, cast, convert, memcpy), `grouped_mm`
(GEMM kernels launched from the experts module: transformers' grouped_mm), `experts other` (the experts module's other
kernels: sort, histc, gathers, the activation, the weighting, the sum over top-k), `attention`, `router` (the gate
linear, softmax, top-k and their backward) and `other` (embeddings, norms, a shared expert, the LM head and the loss),
whose kernel names are listed. Recorded: the step's wall time (under the profiler, so above the unprofiled step_ms),
the GPU busy time (the union of the kernels' and copies' intervals), host gaps = wall - busy, the device-to-host syncs
(cudaStreamSynchronize / cudaDeviceSynchronize / cudaEventSynchronize calls and device-to-host copies, with the
operators that made them), and the raw `key_averages()` table (top 40 by device time).

Output: the tables (every implementation, then a short one: model, batch, mode, moe_dispatch vs default, tokens
match; then training, with --profile-train the step's breakdown, with --prefill-tokens the prefill, and the prefill
logits) are printed last; with --out, `generate_e2e.json` (every measurement, device, versions of torch, triton,
transformers and the package, git commit, arguments; `prefill` only where --prefill-tokens is on) and
`generate_e2e.md`, rewritten after every cell so a run cut short keeps what it measured, and with --profile-train
`generate_e2e_train_profile.txt` (the raw profiler tables of every model and implementation).

FP8 mode (--quantize fp8): does an FP8 checkpoint through transformers decode faster with the package than with
transformers' FP8 default, in the same run? After the model is built, `quantize_fp8_` quantizes it in place exactly as
`from_pretrained(..., quantization_config=FineGrainedFP8Config())` quantizes a bf16 checkpoint on load, with
transformers' own quantizer and quantize op: every nn.Linear but the LM head becomes an FP8Linear and every
routed-experts module an FP8Experts, e4m3 weights with fp32 scales per 128 x 128 block (a weight whose dims are not
multiples of the block stays as it was, as loading leaves it: DeepSeek-V3's kv_a_proj_with_mqa, 576 rows). FP8Experts
dispatches through transformers' FP8ExpertsInterface, where the implementations are `moe_dispatch` (register_experts
registers it there too), `grouped_mm` (transformers' default: the finegrained-fp8 kernel's grouped matmul, swapped for
its batched matmul during decode on a GPU), `batched_mm`, and `grouped_mm_always` (transformers' FP8 grouped_mm
function, registered under that name there too); `eager` is FP8Experts' own loop over the experts. Every
implementation runs beside the same FP8 attention and dense layers, so the rows differ in the experts only. The
defaults are the bf16 run's without the training step (FP8 weights are frozen, with no weight gradients to compare:
--train and --profile-train are refused). The model record holds `quantization` (block, FP8 module counts, the
modules left unquantized) and weights_gib from the parameters' own element sizes.

transformers' FP8 layers run the `kernels-community/finegrained-fp8` Triton kernel (version 4), which transformers
fetches from the Hub on first use (`lazy_load_kernel("finegrained-fp8")`). A machine without network serves it
locally: --finegrained-fp8 DIR takes a source folder of that kernel (build.toml, torch-ext/finegrained_fp8/), copies
its package into a temporary kernel repository laid out as `kernels` loads a local one (build/torch-<backend>/ with a
metadata.json) and appends `kernels-community/finegrained-fp8=<that folder>` to LOCAL_KERNELS before anything loads
the kernel, so `kernels.get_kernel` returns that copy. The run loads the kernel once before the first model and
records in meta.finegrained_fp8 where it came from (the folder as given, its build.toml version, a sha256 of its
package files, the module loaded, or the error). Without the flag transformers loads it its own way. On a GPU the run
sets TRANSFORMERS_DISABLE_DEEPGEMM_LINEAR=1 (unless it is set): for 128 x 128 blocks FP8Linear would prefer DeepGEMM,
a kernel transformers downloads on first use, which a machine without network cannot; the finegrained-fp8 linear
then runs every FP8Linear, the same layers under every experts implementation, so the experts comparison is
unaffected.

MXFP4 mode (--quantize mxfp4; gpt-oss-20b and gpt-oss-120b, both by default): in one process, on the same random
weights, does GPT-OSS with MXFP4 experts decode and prefill faster through `generate` with the package than with
transformers' own MXFP4 path? The model is built by the package's `build_random_gpt_oss_mxfp4`
(moe_dispatch.integrations.transformers_experts) as its `from_pretrained_mxfp4` leaves a checkpoint: every GptOssMLP
keeps transformers' router and holds an `Mxfp4Experts` (uint8 e2m1 blocks [E, 2F, H/32, 16] and [E, H, F/32, 16],
uint8 e8m0 scales, biases in the model dtype; uniformly random bytes, scale codes around the one that gives weights of
--init-std, 120 at 0.02: `mxfp4_scale_code`), the rest initialised by transformers. The implementations are MoE blocks
swapped into each layer (`Mxfp4Variants`), the router object shared, so attention, routers, embeddings and LM head
are the same objects under every one:

    moe_dispatch_mxfp4        the package: GptOssMLP with the Mxfp4Experts (`fused_experts` on the bytes as stored)
    transformers_mxfp4        transformers' MXFP4 path (transformers/integrations/mxfp4.py): `replace_with_mxfp4_linear`
                              (what from_pretrained runs for an MXFP4 checkpoint) makes an Mxfp4GptOssMLP per layer
                              around the same router, and `swizzle_mxfp4_convertops` (the op loading runs on a
                              checkpoint's *_blocks / *_scales) fills its Mxfp4GptOssExperts from the package's tensors:
                              the same values, the bytes in the GPU's value layout, the scales strided, the biases fp32.
                              Its forward runs OpenAI's triton_kernels from kernels-community/gpt-oss-triton-kernels
                              (version 1): routing (top-k of the router logits, softmax), two matmul_ogs (SwiGLU fused)
    transformers_dequantized  GptOssExperts holding transformers' dequantization of the same blocks and scales
                              (`convert_moe_packed_tensors`, what Mxfp4Config(dequantize=True) loads), run by
                              transformers' eager loop on the CPU and by its default experts implementation on a GPU
                              (grouped_mm, batched_mm in the decode steps); the CPU's reference, on a GPU by --impls

Each implementation carries the `hf_quantizer` loading would give it: the package's (compileable), transformers'
Mxfp4HfQuantizer (not compileable: `generate` runs its static-cache decode uncompiled, as for a model transformers
loads in MXFP4; a static cell's `compiled` says which ran), none for the dequantized model (loading with dequantize=True
drops it). On a GPU transformers_mxfp4 is the reference (tokens, next token of the prefill, logits) and the default
(the ratios); the defaults there are --impls moe_dispatch_mxfp4,transformers_mxfp4, --modes eager,static, batches 1
and 16, --prefill-tokens 4096, --layers 2, no training (the weights are frozen: --train is refused). The model record
holds `quantization` (MXFP4 experts modules, GiB of blocks and scales, the scale codes drawn) and `implementations`
(each one "ready" or "skipped: why").

transformers' MXFP4 path loads its kernel with `get_kernel("kernels-community/gpt-oss-triton-kernels", version=1)`. The
run loads it first, once, with scripts/bench_mxfp4.py's `load_hub` (scripts/ on PYTHONPATH): from the Hub or its cache,
or with --hub-dir DIR from DIR/gpt-oss-triton-kernels (the kernel repository as the Hub serves it, or its source:
build.toml, torch-ext/gpt_oss_triton_kernels/, served as a local build) through LOCAL_KERNELS, which transformers' own
call then finds; meta.mxfp4_peer records where it came from and the module loaded, the model record `peer_module` the
module transformers' blocks run. Where the peer cannot run (no CUDA device: its kernels are GPU-only; scripts/ not
importable; no such folder; the load or the conversion failing) its cells record `skipped` with the reason and the run
goes on with the others. Cost: not yet measured; only the package compiles decode graphs (at batch 1 and 16),
transformers' MXFP4 blocks running uncompiled. On a GPU, from the repository root:

    PYTHONPATH=torch-ext:scripts python benchmarks/generate_e2e.py --quantize mxfp4 --hub-dir .peers/hub \\
        --out results/generate-e2e-mxfp4

Run from the repository root (torch-ext/ holds the package), all models in one process or one model per process:

    PYTHONPATH=torch-ext python benchmarks/generate_e2e.py --out results/generate-e2e
    PYTHONPATH=torch-ext python benchmarks/generate_e2e.py --models deepseek-v3 --out results/generate-e2e/deepseek-v3
    PYTHONPATH=torch-ext python benchmarks/generate_e2e.py --models mixtral-8x7b --modes eager --no-train
    PYTHONPATH=torch-ext python benchmarks/generate_e2e.py --models gpt-oss-120b --static-batches 1 --profile-train
    PYTHONPATH=torch-ext python benchmarks/generate_e2e.py --quantize fp8 --models qwen3-30b-a3b,deepseek-v3 \\
        --finegrained-fp8 .peers/hub/finegrained-fp8 --modes eager,static --out results/generate-e2e-fp8
    PYTHONPATH=torch-ext:scripts python benchmarks/generate_e2e.py --quantize mxfp4 --models gpt-oss-120b \\
        --hub-dir .peers/hub --layers 4 --out results/generate-e2e-mxfp4/gpt-oss-120b

Cost on one H200 (estimated, not yet measured): mostly torch.compile, 6 decode graphs per model (moe_dispatch,
batched_mm, which grouped_mm's decode steps reuse, and grouped_mm_always, each at batch 1 and again with a dynamic
batch), each tens of seconds; roughly 5 to 9 minutes per model, the eager mode and training about a minute of that.
Measured (H200, torch 2.11, transformers 5.22.2): gpt-oss-120b, olmoe-1b-7b, qwen3-30b-a3b and mixtral-8x7b with
`--modes eager,static --static-batches 1 --impls moe_dispatch --new-tokens 32 --profile-train` (two implementations,
one compiled graph each per model) took 186 s in all.
--budget-s keeps a run inside a time limit (no new cell starts after it; what was measured is written).

Without a GPU (or with --device cpu) it is a smoke run: tiny widths (H 64, F 32, 8 experts, top-2, vocab 128,
1 layer, 3 new tokens, batches 1 and 2), fp32, eager mode only, no training, the kernels in Triton's interpreter
(TRITON_INTERPRET=1 is set when it is not); the times then mean nothing, the token match is exact. --profile-train
there records CPU activities only (no GPU time: every category is empty). With --quantize fp8 the smoke widths are
no multiples of 128, so the weights are quantized in 16 x 16 blocks (`weight_block_size=(16, 16)`; the package and
the finegrained-fp8 kernel take any block shape). The interpreter has no GPU driver to time a Triton autotuner's
configs with, so there each of the finegrained-fp8 kernel's autotuners keeps its first config (they differ in launch
parameters and tiles, not in what is computed). The package runs weight-only FP8 on the CPU (the weights dequantized
in its GEMMs' loads) while the finegrained-fp8 kernel quantizes the activations too, so there the tokens and logits
agree with transformers' FP8 loop to FP8 rounding, not exactly. With --quantize mxfp4 the smoke run builds GPT-OSS at
the same tiny widths (H and F multiples of the 32 values of a scale; scale codes around 122 for --init-std 0.1) with
all three implementations and a 16-token prefill: transformers_mxfp4 is skipped with its reason (GPU-only), the
reference is transformers_dequantized in transformers' eager loop, and at fp32 the package's tokens equal it exactly.
"""

import argparse
import atexit
import contextlib
import dataclasses
import datetime
import gc
import hashlib
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import torch
from model_shapes import MODEL_SHAPES  # beside this file: on sys.path when it runs as a script or from the tests

ROOT = Path(__file__).resolve().parents[1]
BOS, EOS, PAD = 0, 1, 2  # prompts draw ids from PAD + 1 up
ALWAYS_GROUPED = "grouped_mm_always"
RESULTS_NAME = "generate_e2e"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One transformers model family: its classes, the released model's non-expert widths, and the smoke widths."""

    name: str  # a MODEL_SHAPES key: the routed experts' E, top_k, H, F and routing
    config: str  # transformers config class
    model: str  # transformers causal-LM class
    experts: dict  # config field -> the ModelShape attribute it takes (num_experts, ffn, renormalize, ...)
    real: dict  # attention and dense widths of the released model
    tiny: dict  # the same for the CPU smoke run
    attention: str = "sdpa"  # attn_implementation


SPECS = {
    s.name: s
    for s in (
        ModelSpec("qwen3-30b-a3b", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  experts=dict(num_experts="num_experts", moe_intermediate_size="ffn", norm_topk_prob="renormalize"),
                  real=dict(num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144),
                  tiny=dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64)),
        # Mixtral always renormalises its top-k: nothing to set
        ModelSpec("mixtral-8x7b", "MixtralConfig", "MixtralForCausalLM",
                  experts=dict(num_local_experts="num_experts", intermediate_size="ffn"),
                  real=dict(num_attention_heads=32, num_key_value_heads=8),
                  tiny=dict(num_attention_heads=4, num_key_value_heads=2)),
        ModelSpec("deepseek-v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
                  experts=dict(n_routed_experts="num_experts", moe_intermediate_size="ffn", n_group="n_group",
                               topk_group="topk_group", routed_scaling_factor="routed_scaling_factor",
                               norm_topk_prob="renormalize"),
                  real=dict(num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, intermediate_size=18432,
                            n_shared_experts=1, first_k_dense_replace=0),
                  tiny=dict(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, intermediate_size=64,
                            n_shared_experts=1, first_k_dense_replace=0)),
        # GPT-OSS: softmax over the top-k biased logits (renormalised by construction); sliding and full attention
        # alternate (config.layer_types' default); the tiny window is shorter than the smoke prompt, so it is used
        ModelSpec("gpt-oss-120b", "GptOssConfig", "GptOssForCausalLM", attention="eager",
                  experts=dict(num_local_experts="num_experts", intermediate_size="ffn"),
                  real=dict(num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128),
                  tiny=dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4)),
        ModelSpec("olmoe-1b-7b", "OlmoeConfig", "OlmoeForCausalLM",
                  experts=dict(num_experts="num_experts", intermediate_size="ffn", norm_topk_prob="renormalize"),
                  real=dict(num_attention_heads=16, num_key_value_heads=16),
                  tiny=dict(num_attention_heads=4, num_key_value_heads=4)),
        # Qwen2-MoE: every layer sparse (decoder_sparse_step 1), each with the gated shared expert beside the routed
        ModelSpec("qwen1.5-moe-a2.7b", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  experts=dict(num_experts="num_experts", moe_intermediate_size="ffn", norm_topk_prob="renormalize"),
                  real=dict(num_attention_heads=16, num_key_value_heads=16, shared_expert_intermediate_size=5632,
                            intermediate_size=5632),
                  tiny=dict(num_attention_heads=4, num_key_value_heads=4, shared_expert_intermediate_size=64,
                            intermediate_size=64)),
    )
}
# gpt-oss-20b: gpt-oss-120b's layers with 32 experts (model_shapes.py); run when named in --models
SPECS["gpt-oss-20b"] = dataclasses.replace(SPECS["gpt-oss-120b"], name="gpt-oss-20b")
DEFAULT_MODELS = [name for name in SPECS if name != "gpt-oss-20b"]
# The smoke run's experts: small enough for the interpreter, groups kept where the model routes by group.
TINY_EXPERTS = dict(num_experts=8, top_k=2, hidden=64, ffn=32)
TINY_GROUPS = dict(n_group=2, topk_group=1)

MODES = ("eager", "static", "static-reuse")
QUANTIZE = ("none", "fp8", "mxfp4")
# FP8 weight blocks: FineGrainedFP8Config's default (DeepSeek-V3's), and the smoke run's (its widths, H 64 and F 32, are
# no multiples of 128, and transformers leaves such a weight unquantized)
FP8_BLOCK = (128, 128)
TINY_FP8_BLOCK = (16, 16)
# The kernel transformers' FP8 layers run (transformers.integrations.hub_kernels: `lazy_load_kernel("finegrained-fp8")`
# = kernels.get_kernel(FINEGRAINED_FP8_REPO, version=4)); --finegrained-fp8 serves it from a source folder.
FINEGRAINED_FP8_REPO = "kernels-community/finegrained-fp8"
FINEGRAINED_FP8_VERSION = 4
GPU_DEFAULTS = dict(impls="moe_dispatch,grouped_mm,batched_mm," + ALWAYS_GROUPED, modes=",".join(MODES),
                    batches="1,16", new_tokens=64, prompt_len=32, layers=2, vocab=32000, repeats=3, warmup=1,
                    dtype="bfloat16", init_std=0.02, reference="grouped_mm", train=True, prefill_tokens=0)
# The CPU reference is transformers' eager loop: at fp32 its tokens and the kernel's must agree exactly. A larger
# init std than 0.02 makes the experts, not the embeddings, decide the tiny model's logits.
CPU_DEFAULTS = dict(impls="moe_dispatch,grouped_mm,batched_mm,eager", modes="eager", batches="1,2", new_tokens=3,
                    prompt_len=8, layers=1, vocab=128, repeats=1, warmup=0, dtype="float32", init_std=0.1,
                    reference="eager", train=False, prefill_tokens=0)
# MXFP4 mode (--quantize mxfp4): GPT-OSS models whose experts are MXFP4, swapped between the implementations below.
MXFP4_MODELS = ("gpt-oss-20b", "gpt-oss-120b")
MXFP4_PACKAGE = "moe_dispatch_mxfp4"  # the package's Mxfp4Experts under transformers' GptOssMLP and router
MXFP4_PEER = "transformers_mxfp4"  # transformers' Mxfp4GptOssMLP: OpenAI's triton_kernels (matmul_ogs)
MXFP4_DEQUANTIZED = "transformers_dequantized"  # GptOssExperts, dequantized as Mxfp4Config(dequantize=True) loads
MXFP4_IMPLS = (MXFP4_PACKAGE, MXFP4_PEER, MXFP4_DEQUANTIZED)
# The peer's kernel as transformers' replace_with_mxfp4_linear asks for it (bench_mxfp4.HUB_IMPLS names the same).
TRITON_KERNELS_REPO = "kernels-community/gpt-oss-triton-kernels"
# On top of GPU_DEFAULTS / CPU_DEFAULTS. The CPU reference is the dequantized experts in transformers' eager loop (fp32:
# the package's tokens must equal it); on a GPU the peer is both the reference and the default.
MXFP4_GPU_DEFAULTS = dict(impls=f"{MXFP4_PACKAGE},{MXFP4_PEER}", modes="eager,static", reference=MXFP4_PEER,
                          train=False, prefill_tokens=4096)
MXFP4_CPU_DEFAULTS = dict(impls=",".join(MXFP4_IMPLS), reference=MXFP4_DEQUANTIZED, prefill_tokens=16)
# RMS of an e2m1 value drawn uniformly from its 16 codes: sqrt(mean of 0, .25, 1, 2.25, 4, 9, 16, 36) = 2.93
E2M1_RMS = 2.93
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda (default where there is one) or cpu (the smoke run)")
    p.add_argument("--models", default=None,
                   help=f"comma list of {', '.join(SPECS)} (default all but gpt-oss-20b; --quantize mxfp4: "
                   f"{', '.join(MXFP4_MODELS)}, the default)")
    p.add_argument("--impls", default=None, help="experts implementations to compare (GPU default: "
                   f"{GPU_DEFAULTS['impls']}; CPU: {CPU_DEFAULTS['impls']}; --quantize mxfp4 takes "
                   f"{', '.join(MXFP4_IMPLS)}: GPU default {MXFP4_GPU_DEFAULTS['impls']}, CPU all three)")
    p.add_argument("--reference", default=None, help="implementation whose tokens the others are compared with "
                   f"(GPU: grouped_mm, transformers' default; CPU: eager; --quantize mxfp4: {MXFP4_PEER} on a GPU, "
                   f"{MXFP4_DEQUANTIZED} on the CPU)")
    p.add_argument("--modes", default=None, help="of eager (DynamicCache), static (StaticCache, compiled decode), "
                   "static-reuse (one StaticCache reused); GPU default all three (--quantize mxfp4: eager,static), "
                   "CPU eager")
    p.add_argument("--batches", default=None, help="comma list of batch sizes (GPU 1,16; CPU 1,2)")
    p.add_argument("--static-batches", default=None, help="batch sizes of the compiled modes (static, static-reuse) "
                   "where they differ from --batches, e.g. 1")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per row (GPU 64, CPU 3)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per row (GPU 32, CPU 8)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (GPU 2, CPU 1)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (GPU 32000, CPU 128)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per length, median (GPU 3, CPU 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs per length first (GPU 1, CPU 0)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="GPU bfloat16, CPU float32")
    p.add_argument("--init-std", type=float, default=None, help="std of the random weights (GPU 0.02, CPU 0.1)")
    p.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=None,
                   help="smoke widths (default on the CPU only)")
    p.add_argument("--train", action=argparse.BooleanOptionalAction, default=None,
                   help="also time one training step, moe_dispatch vs grouped_mm (default on a GPU; refused with "
                   "--quantize fp8)")
    p.add_argument("--quantize", choices=QUANTIZE, default="none",
                   help="fp8: quantize the built model as FineGrainedFP8Config does on load (FP8Linear, FP8Experts; "
                   "128x128 blocks, 16x16 at the smoke widths); mxfp4: GPT-OSS built with MXFP4 experts, run by the "
                   f"package ({MXFP4_PACKAGE}) and by transformers' own MXFP4 path ({MXFP4_PEER}: OpenAI's "
                   f"triton_kernels from {TRITON_KERNELS_REPO}); gpt-oss models only")
    p.add_argument("--hub-dir", default=None, metavar="DIR",
                   help=f"--quantize mxfp4: load {TRITON_KERNELS_REPO} from DIR/gpt-oss-triton-kernels (the kernel "
                   "repository as the Hub serves it, or its source: build.toml, torch-ext/gpt_oss_triton_kernels/) "
                   "through LOCAL_KERNELS instead of the Hub, as scripts/bench_mxfp4.py --hub-dir does")
    p.add_argument("--prefill-tokens", type=int, default=None,
                   help="also time one forward of a prompt of this many tokens (batch 1, the last position's logits) "
                   "per implementation; default 0 (off), --quantize mxfp4: 4096 on a GPU, 16 on the CPU")
    p.add_argument("--finegrained-fp8", default=None, metavar="DIR",
                   help="source folder of the kernels-community/finegrained-fp8 kernel (build.toml, "
                   "torch-ext/finegrained_fp8/) that transformers' FP8 layers load, served locally through "
                   "LOCAL_KERNELS instead of the Hub (--quantize fp8)")
    p.add_argument("--interleave", choices=("eager", "all"), default="eager",
                   help="which modes time their implementations interleaved (round by round; default the eager mode "
                   "only); the compiled modes otherwise time one implementation after the other")
    p.add_argument("--logits", action=argparse.BooleanOptionalAction, default=True,
                   help="compare each implementation's prefill logits (last prompt position) with the reference's")
    p.add_argument("--train-tokens", default="4x512", help="training batch as BATCHxSEQ")
    p.add_argument("--train-steps", type=int, default=3, help="timed training steps, median")
    p.add_argument("--profile-train", action="store_true", help="also one training step per implementation under "
                   "torch.profiler: GPU time by category, wall time, GPU busy time, host gaps, device-to-host syncs, "
                   "and the raw table (implies --train)")
    p.add_argument("--budget-s", type=float, default=None, help="start no new cell after this many seconds")
    p.add_argument("--profile", action="store_true", help="also a cProfile of one generate per cell (printed)")
    p.add_argument("--trace", action="store_true", help="also a torch.profiler table of one generate per cell "
                   "(operators and kernels by host and by device time; printed and kept in the JSON)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for generate_e2e.json and .md (default: write nothing)")
    args = p.parse_args(argv)

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu for the smoke run")
    defaults = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    if args.quantize in ("fp8", "mxfp4"):
        if args.train or args.profile_train:
            p.error(f"--quantize {args.quantize} has no training step: {args.quantize.upper()} weights are frozen (no "
                    "weight gradients to compare); drop --train / --profile-train")
        args.train = False
    if args.quantize != "fp8" and args.finegrained_fp8 is not None:
        p.error("--finegrained-fp8 serves the kernel of transformers' FP8 layers: add --quantize fp8")
    if args.quantize != "mxfp4" and args.hub_dir is not None:
        p.error(f"--hub-dir serves {TRITON_KERNELS_REPO}, the kernel of transformers' MXFP4 path: add --quantize mxfp4")
    if args.quantize == "mxfp4":
        defaults = {**defaults, **(MXFP4_GPU_DEFAULTS if device.type == "cuda" else MXFP4_CPU_DEFAULTS)}
        if args.models is None:
            args.models = ",".join(MXFP4_MODELS)
    elif args.models is None:
        args.models = ",".join(DEFAULT_MODELS)
    if args.profile_train:
        if args.train is False:
            p.error("--profile-train profiles the training step: drop --no-train")
        args.train = True
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.tiny is None:
        args.tiny = device.type == "cpu"
    args.fp8_block = None if args.quantize == "none" else list(TINY_FP8_BLOCK if args.tiny else FP8_BLOCK)
    args.models = _names(args.models)
    unknown = [m for m in args.models if m not in SPECS]
    if unknown:
        p.error(f"unknown models {unknown}; choose from {list(SPECS)}")
    args.impls = _names(args.impls)
    if args.quantize == "mxfp4":
        others = [m for m in args.models if m not in MXFP4_MODELS]
        if others:
            p.error(f"--quantize mxfp4 builds GPT-OSS models only ({', '.join(MXFP4_MODELS)}), not {others}")
        others = [i for i in args.impls + [args.reference] if i not in MXFP4_IMPLS]
        if others:
            p.error(f"--quantize mxfp4 compares {', '.join(MXFP4_IMPLS)} (--impls, --reference), not {others}")
    if args.prefill_tokens < 0:
        p.error("--prefill-tokens must be 0 (off) or a prompt length")
    args.modes = _names(args.modes)
    if set(args.modes) - set(MODES):
        p.error(f"--modes takes {', '.join(MODES)}")
    args.batches = [int(b) for b in _names(args.batches)]
    args.static_batches = ([int(b) for b in _names(args.static_batches)] if args.static_batches is not None
                           else list(args.batches))
    try:
        args.train_batch, args.train_seq = (int(n) for n in args.train_tokens.lower().split("x"))
    except ValueError:
        p.error("--train-tokens is BATCHxSEQ, e.g. 4x512")
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (the metric subtracts a 1-token generate)")
    return args


def _names(text):
    return [name.strip() for name in str(text).split(",") if name.strip()]


# ---------------------------------------------------------------------------------------------------------------------
# Models


def experts_shape(name, tiny):
    """The routed experts of `name` (model_shapes.ModelShape), at the smoke widths when `tiny`."""
    shape = MODEL_SHAPES[name]
    if not tiny:
        return shape
    groups = TINY_GROUPS if shape.n_group else {}
    return dataclasses.replace(shape, **TINY_EXPERTS, **groups)


def config_kwargs(spec, shape, args):
    """transformers config arguments of `spec` with `shape`'s experts and the run's depth, vocabulary and init."""
    kwargs = dict(spec.tiny if args.tiny else spec.real)
    kwargs.update(hidden_size=shape.hidden, num_experts_per_tok=shape.top_k, num_hidden_layers=args.layers,
                  vocab_size=args.vocab, initializer_range=args.init_std, tie_word_embeddings=False,
                  max_position_embeddings=max(4096, args.prompt_len + args.new_tokens, args.train_seq,
                                              args.prefill_tokens),
                  bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, output_router_logits=False)
    kwargs.update({field: getattr(shape, attribute) for field, attribute in spec.experts.items()})
    return kwargs


@contextlib.contextmanager
def default_dtype(dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@torch.no_grad()
def fill_random_(model, std, seed):
    """Norm weights 1, biases 0 but the experts' own (GPT-OSS's gate_up_proj_bias, down_proj_bias: normal(0, std), so
    the kernels' bias path changes the tokens), every other parameter normal(0, std), in place; the correction bias
    of a DeepSeek-V3-style router becomes a real fp32 normal(0, 0.1) tensor (it picks experts, it does not weight
    them)."""
    torch.manual_seed(seed)
    for module in model.modules():
        is_norm = "Norm" in type(module).__name__
        is_experts = module_scope(module) == "experts"
        for name, param in module.named_parameters(recurse=False):
            if is_norm:
                param.fill_(1.0)
            elif name.endswith("bias") and not is_experts:
                param.zero_()
            else:
                param.normal_(0.0, std)
        bias = getattr(module, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            module.e_score_correction_bias = torch.randn(bias.shape, device=bias.device, dtype=torch.float32) * 0.1


def build_model(spec, args, device, dtype, experts_implementation):
    """A random-weight `spec.model` built directly on `device` in `dtype`, eval mode (see the module docstring)."""
    import transformers

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older layouts kept it in modeling_utils
        from transformers.modeling_utils import no_init_weights

    shape = experts_shape(spec.name, args.tiny)
    config = getattr(transformers, spec.config)(**config_kwargs(spec, shape, args),
                                                attn_implementation=spec.attention,
                                                experts_implementation=experts_implementation)
    with torch.device(device), default_dtype(dtype), no_init_weights():
        model = getattr(transformers, spec.model)(config)
    fill_random_(model, args.init_std, args.seed)
    return model.eval(), shape


def module_scope(module):
    """The role of a module from its class name, the same across families (the routed experts, and the scopes of
    --profile-train): "experts" (Qwen3MoeExperts, GptOssExperts, FP8Experts, ...), "router" (*TopKRouter,
    DeepseekV3TopkRouter), "attention" (*Attention), or None."""
    name = type(module).__name__
    if name.endswith("Experts"):
        return "experts"
    if "Router" in name:
        return "router"
    if name.endswith("Attention"):
        return "attention"
    return None


def experts_modules(model):
    """(name, module) of every routed-experts module (a class named *Experts; shared experts are plain MLPs)."""
    return [(name, module) for name, module in model.named_modules() if module_scope(module) == "experts"]


def experts_parameters(model):
    """(name, parameter) of every routed-experts module's gate_up_proj and down_proj, and their biases where the
    experts have them (GPT-OSS)."""
    found = []
    for module_name, module in experts_modules(model):
        for p in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            if isinstance(getattr(module, p, None), torch.nn.Parameter):
                found.append((f"{module_name}.{p}", getattr(module, p)))
    return found


def model_record(model, spec, shape, args, build_s):
    """What was built: class, experts' shape, depth, parameter counts, weights in GiB (from each parameter's own
    element size: FP8 weights count one byte, their fp32 scales four; MXFP4 blocks one byte per two values), the build
    time, the config's scalars, and with --quantize `quantization` (`fp8_summary`, `mxfp4_summary`)."""
    params = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for _, p in experts_parameters(model))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    record = {"class": spec.model, "experts": dataclasses.asdict(shape), "layers": args.layers, "vocab": args.vocab,
              "moe_layers": len(experts_modules(model)), "params": params, "experts_params": experts,
              "weights_gib": weight_bytes / 2**30, "build_s": build_s,
              "config": {k: v for k, v in model.config.to_diff_dict().items()
                         if isinstance(v, (int, float, str, bool))}}
    if args.quantize == "mxfp4":
        record["quantization"] = mxfp4_summary(model)
    elif getattr(model.config, "quantization_config", None) is not None:
        record["quantization"] = fp8_summary(model)
    return record


# ---------------------------------------------------------------------------------------------------------------------
# FP8


def quantize_fp8_(model, block_size=FP8_BLOCK, modules_to_not_convert=None):
    """Quantize `model` in place as `from_pretrained(..., quantization_config=FineGrainedFP8Config())` does when it
    loads a bf16 checkpoint, with transformers' own machinery: its FP8 quantizer (`AutoHfQuantizer.from_config`, not
    pre-quantized) replaces every nn.Linear but the LM head (and `modules_to_not_convert`) with an FP8Linear and every
    routed-experts module with an FP8Experts, on the meta device (`preprocess_model`); each new module is then
    materialized on the model's device and filled from the original tensors by `Fp8Quantize._quantize_one`, the op
    loading runs on each weight: e4m3 weights with fp32 `*_scale_inv` scales per `block_size` block (w ~ w_fp8 *
    scale_inv), biases as they were. An expert stack is quantized one expert at a time (no block spans two experts, so
    the result is the same, with one expert's fp32 temporaries: DeepSeek-V3's whole gate_up stack would need 30 GB). A
    weight whose dims are not multiples of the block stays unquantized in its FP8 module, as loading leaves it (the
    module then runs F.linear; its unused scale is set to 1): DeepSeek-V3's kv_a_proj_with_mqa (576 rows). Last
    `postprocess_model` (config.quantization_config, is_quantized, the multi-device DeepGEMM guard) with
    `model.hf_quantizer` set, as from_pretrained does. The original tensors are released module by module, so the peak
    is the original model plus one module's FP8 copy. Returns the quantizer."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear, Fp8Quantize
    from transformers.quantizers.auto import AutoHfQuantizer

    config = FineGrainedFP8Config(weight_block_size=tuple(block_size), modules_to_not_convert=modules_to_not_convert)
    quantizer = AutoHfQuantizer.from_config(config, pre_quantized=False)
    first = next(model.parameters())
    originals = dict(model.state_dict())  # the original tensors outlive the modules replaced next
    quantizer.preprocess_model(model, dtype=first.dtype)
    quantize = Fp8Quantize(quantizer)
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, (FP8Linear, FP8Experts)):
                continue
            module.to_empty(device=first.device)
            written = set()
            for attr in [attr for attr, _ in module.named_parameters(recurse=False)]:
                key = f"{name}.{attr}"
                if key in originals:
                    written |= _fill_quantized_(module, key, originals.pop(key), quantize)
            for attr, param in module.named_parameters(recurse=False):
                if attr not in written:  # the scale of a weight left unquantized, or a static activation scale
                    param.fill_(1.0)
    del originals
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)
    return quantizer


def _fill_quantized_(module, key, value, quantize):
    """Write `quantize._quantize_one(key, value)` (one expert at a time for a 3-D stack) into `module`'s parameters;
    a tensor it passes through (a bias, a weight the block does not tile) replaces the parameter as loading does.
    Returns the attribute names written."""
    stacked = value.dim() == 3
    written = set()
    for index, part in enumerate(value.unbind(0) if stacked else [value]):
        for out_key, tensor in quantize._quantize_one(key, part).items():
            attr = out_key.rsplit(".", 1)[1]
            target = getattr(module, attr)
            if tensor.dtype != target.dtype or (not stacked and tensor.shape != target.shape):
                setattr(module, attr, torch.nn.Parameter(value, requires_grad=value.is_floating_point()))
                return {attr}
            (target[index] if stacked else target).copy_(tensor)
            written.add(attr)
    return written


def fp8_summary(model):
    """The quantization of a `quantize_fp8_` model: method, block, the FP8Linear / FP8Experts modules, the parameters
    stored in float8, and the FP8 modules whose weight stayed unquantized."""
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear

    config = model.config.quantization_config
    fp8 = [(name, m) for name, m in model.named_modules() if isinstance(m, (FP8Linear, FP8Experts))]
    kept = [name for name, m in fp8 if not any(p.dtype == torch.float8_e4m3fn for p in m.parameters())]
    return {"method": str(getattr(config.quant_method, "value", config.quant_method)),
            "weight_block_size": list(config.weight_block_size),
            "fp8_linear": sum(isinstance(m, FP8Linear) for _, m in fp8),
            "fp8_experts": sum(isinstance(m, FP8Experts) for _, m in fp8),
            "fp8_params": sum(p.numel() for p in model.parameters() if p.dtype == torch.float8_e4m3fn),
            "unquantized": kept}


def _package_digest(folder):
    """sha256 of a package folder's .py files (relative names and contents, in name order)."""
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*.py")):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def serve_kernel_source(source, repo_id, package, version=None, what="the kernel's source folder"):
    """Serve a Hub kernel from its source folder `source` (build.toml, torch-ext/<package>/) as `kernels` loads a
    local one: copy the package into a temporary kernel repository (build/torch-<backend>/ holding the package and a
    metadata.json) and append `<repo_id>=<that folder>` to LOCAL_KERNELS (entries separated by ':', as kernels
    parses them), so `kernels.get_kernel(repo_id, version=...)` gets this copy instead of the Hub's; must run before
    anything loads the kernel. `version` is the metadata's where build.toml does not say (or is absent). The folder
    is removed at exit. Raises ValueError when `source` holds no such package. Returns the record of where it came
    from: the folder as given, the repo id it serves, its build.toml name and version, a sha256 of its package
    files, the module name it imports under."""
    folder = Path(source)
    package_dir = folder / "torch-ext" / package
    if not (package_dir / "__init__.py").is_file():
        raise ValueError(f"{what} {source}: no torch-ext/{package}/__init__.py there (a source folder of {repo_id} "
                         "is expected)")
    build = folder / "build.toml"
    general = tomllib.loads(build.read_text()).get("general", {}) if build.is_file() else {}
    digest = _package_digest(package_dir)
    backend = "cuda" if torch.version.cuda else "rocm" if torch.version.hip else "cpu"
    repo = Path(tempfile.mkdtemp(prefix=f"{repo_id.split('/')[-1]}-"))
    atexit.register(shutil.rmtree, repo, ignore_errors=True)
    variant = repo / "build" / f"torch-{backend}"
    shutil.copytree(package_dir, variant, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    module = f"_{package}_{digest[:10]}"  # one module name per source: two sources never share sys.modules
    name = general.get("name", repo_id.split("/")[-1])
    metadata = {"name": name, "id": module, "version": general.get("version", version),
                "license": general.get("license", "Apache-2.0"), "python-depends": [], "backend": {"type": backend}}
    (variant / "metadata.json").write_text(json.dumps(metadata))
    entry = f"{repo_id}={repo}"
    os.environ["LOCAL_KERNELS"] = ":".join(filter(None, [os.environ.get("LOCAL_KERNELS"), entry]))
    return {"source": str(source), "served_as": repo_id, "name": name, "version": metadata["version"],
            "sha256": digest, "module": module}


def serve_finegrained_fp8(source):
    """Serve the finegrained-fp8 kernel from its source folder `source` (build.toml, torch-ext/finegrained_fp8/) under
    kernels-community/finegrained-fp8 (serve_kernel_source), so transformers' `lazy_load_kernel` gets this copy
    instead of the Hub's; must run before anything loads the kernel."""
    try:
        return serve_kernel_source(source, FINEGRAINED_FP8_REPO, "finegrained_fp8", version=FINEGRAINED_FP8_VERSION,
                                   what="--finegrained-fp8")
    except ValueError as e:
        raise SystemExit(str(e)) from None


def load_finegrained_fp8(served, device):
    """Load the finegrained-fp8 kernel the way transformers' FP8 layers do (`load_finegrained_fp8_kernel`) before the
    first model, so a kernel that cannot load says so once; returns meta's record: `served` (serve_finegrained_fp8's
    record, or transformers' own loading without --finegrained-fp8), the module loaded and its error if any. In
    Triton's interpreter (the CPU smoke run) an autotuned kernel with several configs would time them through the GPU
    driver the interpreter does not have: there each of the kernel's autotuners keeps its first config (they differ in
    launch parameters and tile shapes, not in what is computed)."""
    record = dict(served or {"source": "transformers' lazy_load_kernel (the Hub or its cache)"})
    record["deepgemm_linear_disabled"] = os.environ.get("TRANSFORMERS_DISABLE_DEEPGEMM_LINEAR") == "1"
    try:
        from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel
        from transformers.integrations.hub_kernels import lazy_load_kernel

        load_finegrained_fp8_kernel()
        kernel = lazy_load_kernel("finegrained-fp8")  # the module just loaded (cached)
    except Exception as exc:  # noqa: BLE001 (the FP8 cells that need it record their own errors)
        record["error"] = _error(exc)
        return record
    record["loaded"] = kernel.__name__
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        record["autotune_pinned"] = pin_autotune_configs(kernel)
    if served is not None and kernel.__name__ != served["module"]:
        record["error"] = f"loaded {kernel.__name__}, not the served copy {served['module']}"
    return record


def pin_autotune_configs(kernel):
    """Keep the first config of every Triton autotuner in `kernel`'s modules (see load_finegrained_fp8); returns how
    many autotuners had more than one."""
    from triton.runtime.autotuner import Autotuner

    pinned = 0
    for name, module in list(sys.modules.items()):
        if name == kernel.__name__ or name.startswith(kernel.__name__ + "."):
            for value in list(vars(module).values()):
                if isinstance(value, Autotuner) and len(value.configs) > 1:
                    value.configs = value.configs[:1]
                    pinned += 1
    return pinned


# ---------------------------------------------------------------------------------------------------------------------
# MXFP4


VARIANTS_ATTRIBUTE = "_generate_e2e_mxfp4_variants"  # where an MXFP4-mode model keeps its Mxfp4Variants


def mxfp4_scale_code(std):
    """The e8m0 code whose scale gives uniformly random e2m1 values the standard deviation `std` (the codes drawn lie
    around it): 120 for 0.02, the package's default, and 122 for the smoke run's 0.1."""
    return round(127 + math.log2(std / E2M1_RMS))


def build_mxfp4_model(spec, args, device, dtype):
    """A random GPT-OSS causal LM of `spec`'s widths whose experts are the package's `Mxfp4Experts` (uint8 e2m1 blocks
    and e8m0 scales, biases in `dtype`), as `from_pretrained_mxfp4` leaves a checkpoint it loads: the package's
    `build_random_gpt_oss_mxfp4` on `device`, no float copy of the experts ever made; the rest initialised by
    transformers (normal(0, --init-std), norms 1), the experts' bytes uniform, their scale codes around
    `mxfp4_scale_code(--init-std)`, their biases normal(0, --init-std). Eval mode."""
    import transformers

    build = load_package(device).integrations.transformers_experts.build_random_gpt_oss_mxfp4
    shape = experts_shape(spec.name, args.tiny)
    config = getattr(transformers, spec.config)(**config_kwargs(spec, shape, args), attn_implementation=spec.attention)
    model = build(config, device=device, dtype=dtype, seed=args.seed, scale_code=mxfp4_scale_code(args.init_std))
    return model, shape


def mxfp4_summary(model):
    """The MXFP4 experts of an MXFP4-mode model: how many, GiB of blocks and of scales, the scale codes drawn."""
    experts = [module for _, module in experts_modules(model)]
    tensors = [(name, p) for module in experts for name, p in module.named_parameters()]
    scales = [p for name, p in tensors if name.endswith("_scales")]
    return {"method": "mxfp4", "mxfp4_experts": len(experts),
            "blocks_gib": sum(p.numel() for name, p in tensors if name.endswith("_blocks")) / 2**30,
            "scales_gib": sum(p.numel() for p in scales) / 2**30,
            "scale_codes": [min(int(p.min()) for p in scales), max(int(p.max()) for p in scales)] if scales else None}


def _portable_path(value):
    """A folder as given where it is relative; an absolute one relative to the repository where it lies inside,
    else its last component (no machine's layout in the results)."""
    if value is None or not os.path.isabs(value):
        return value
    try:
        return str(Path(value).resolve().relative_to(ROOT))
    except ValueError:
        return Path(value).name


def load_mxfp4_peer(args, device):
    """(module or None, meta's record) of the kernel transformers' MXFP4 path runs, kernels-community/gpt-oss-triton-
    kernels, loaded once before the first model by scripts/bench_mxfp4.py's `load_hub`: `kernels.get_kernel(repo,
    version=1)` (the version transformers asks for), with --hub-dir from DIR/gpt-oss-triton-kernels through
    LOCAL_KERNELS (a source folder served as a local build first), so that transformers' own `get_kernel` call gets the
    same copy. The record says where it came from and the module loaded, or "skipped: why": no CUDA device (its kernels
    are GPU-only), scripts/ not importable, the folder absent, the load failing."""
    where = (f"{_portable_path(args.hub_dir)}/gpt-oss-triton-kernels" if args.hub_dir is not None
             else "the Hub or its cache (kernels.get_kernel)")
    record = {"repo": TRITON_KERNELS_REPO, "from": where}
    try:
        import bench_mxfp4  # scripts/: the Hub peers' loading, shared with the MXFP4 experts benchmark
    except Exception as exc:  # noqa: BLE001 (scripts/ not on the path, or a broken import: the peer is skipped)
        record["status"] = (f"skipped: cannot import scripts/bench_mxfp4.py, which loads the kernel ({_error(exc)}; "
                            "run with scripts/ on PYTHONPATH)")
        return None, record
    try:
        record["version"] = bench_mxfp4.HUB_IMPLS["tk_matmul_ogs"].version
        hub = bench_mxfp4.load_hub(argparse.Namespace(impls=("tk_matmul_ogs",), hub_dir=args.hub_dir), device)
        module, record["status"] = hub["tk_matmul_ogs"]
    except Exception as exc:  # noqa: BLE001 (another bench_mxfp4: the peer is skipped, the package still runs)
        module, record["status"] = None, f"skipped: loading it failed: {_error(exc)}"
    if module is not None:
        record["loaded"] = module.__name__
    return module, record


@dataclasses.dataclass
class Mxfp4Variants:
    """The MoE blocks of one MXFP4-mode model under each implementation, swapped in by `use`: one model object, so the
    attention, routers, embeddings and LM head are the same objects under every implementation, and the experts'
    tensors are the package's, converted where another implementation holds them in another layout.

    blocks[impl] maps each decoder layer's `mlp` name to the block that implementation runs there; quantizers[impl]
    is the `hf_quantizer` the model carries under it (generate compiles a static-cache decode step only where the
    quantizer allows it, and transformers' Mxfp4HfQuantizer does not); experts_implementation[impl] is set in
    transformers' experts interface where the block's experts read it (the dequantized GptOssExperts); skipped[impl]
    says why an implementation cannot run; checks[impl] is its first block's difference from the package's
    (`block_difference`); peer_module is the triton_kernels module transformers' MXFP4 blocks run."""

    blocks: dict
    quantizers: dict
    experts_implementation: dict = dataclasses.field(default_factory=dict)
    skipped: dict = dataclasses.field(default_factory=dict)
    checks: dict = dataclasses.field(default_factory=dict)
    peer_module: str | None = None

    def use(self, model, impl):
        if impl in self.skipped:
            raise RuntimeError(f"{impl} skipped: {self.skipped[impl]}")
        if impl not in self.blocks:
            raise ValueError(f"--quantize mxfp4 runs {', '.join(self.blocks)}, not {impl!r}")
        for name, block in self.blocks[impl].items():
            model.set_submodule(name, block)
        model.hf_quantizer = self.quantizers[impl]
        if impl in self.experts_implementation:
            model.set_experts_implementation(self.experts_implementation[impl])

    def status(self):
        return {impl: "ready" for impl in self.blocks} | {impl: f"skipped: {why}" for impl, why in self.skipped.items()}


def dequantized_blocks(model, ours, dtype):
    """{name: GptOssMLP} holding each block's router and transformers' GptOssExperts with the weights as
    `Mxfp4Config(dequantize=True)` loads them: `convert_moe_packed_tensors` (transformers' dequantizing load op) of the
    package's blocks and scales, in `dtype` ([E, H, 2F] gate/up interleaved, [E, F, H]), its biases in `dtype`."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = model.config.get_text_config()
    out = {}
    for name, block in ours.items():
        mxfp4 = block.experts
        with torch.device("meta"):
            dense = GptOssMLP(config)
        dense.router = block.router
        with torch.no_grad():
            for proj in ("gate_up_proj", "down_proj"):
                weight = convert_moe_packed_tensors(getattr(mxfp4, f"{proj}_blocks"), getattr(mxfp4, f"{proj}_scales"),
                                                    dtype=dtype)
                setattr(dense.experts, proj, torch.nn.Parameter(weight, requires_grad=False))
                bias = getattr(mxfp4, f"{proj}_bias").detach().to(dtype)
                setattr(dense.experts, f"{proj}_bias", torch.nn.Parameter(bias, requires_grad=False))
        out[name] = dense
    return out


def transformers_mxfp4_blocks(model, ours):
    """({name: Mxfp4GptOssMLP}, the triton_kernels module they run): transformers' own MXFP4 blocks filled from the
    package's tensors. `replace_with_mxfp4_linear` (what from_pretrained runs before it reads an MXFP4 checkpoint)
    replaces every GptOssMLP with an Mxfp4GptOssMLP holding the same router and an empty Mxfp4GptOssExperts, and loads
    the kernel itself (`get_kernel(repo, version=1)`, answered by the copy load_mxfp4_peer loaded); then each experts
    module gets the package's blocks and scales through `swizzle_mxfp4_convertops`, the op loading runs on a
    checkpoint's `*_blocks` / `*_scales` (the bytes transposed into the GPU's value layout, the scales strided), and its
    biases in fp32, as transformers holds them. The package's blocks go back into the model."""
    from transformers import Mxfp4Config
    from transformers.integrations import mxfp4 as hf_mxfp4

    try:
        hf_mxfp4.replace_with_mxfp4_linear(model, quantization_config=Mxfp4Config())
        peer = {name: model.get_submodule(name) for name in ours}
    finally:
        for name, block in ours.items():
            model.set_submodule(name, block)
    triton_kernels = hf_mxfp4.triton_kernels_hub  # what Mxfp4GptOssMLP's forward reads
    for name, block in peer.items():
        if not isinstance(block, hf_mxfp4.Mxfp4GptOssMLP):
            raise RuntimeError(f"replace_with_mxfp4_linear left {name} a {type(block).__name__}")
        peer_experts, experts = block.experts, ours[name].experts
        device = experts.gate_up_proj_blocks.device
        with torch.no_grad():
            for proj in ("gate_up_proj", "down_proj"):
                blocks, scales = getattr(experts, f"{proj}_blocks"), getattr(experts, f"{proj}_scales")
                hf_mxfp4.swizzle_mxfp4_convertops(blocks, scales, peer_experts, proj, device, triton_kernels)
                bias = getattr(experts, f"{proj}_bias").detach().float()
                setattr(peer_experts, f"{proj}_bias", torch.nn.Parameter(bias, requires_grad=False))
        left = [n for n, t in [*block.named_parameters(), *block.named_buffers()] if t.is_meta]
        if left:
            raise RuntimeError(f"{name}: {left} left on the meta device after the conversion")
    return peer, getattr(triton_kernels, "__name__", None)


def block_difference(block, reference, hidden, device, dtype, tokens=8, seed=0):
    """||block(x) - reference(x)|| / ||reference(x)|| of two MoE blocks on `tokens` rows of normal(0, 1) activations in
    `dtype` (what a post-attention norm hands the block): a conversion that changed the experts' values, or a block that
    cannot run here, shows before anything is timed."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(1, tokens, hidden, generator=generator).to(device=device, dtype=dtype)
    with torch.no_grad():
        got, ref = block(x)[0].float(), reference(x)[0].float()
    return float((got - ref).norm() / ref.norm())


def mxfp4_variants(model, impls, device, dtype, peer_kernel):
    """The Mxfp4Variants of a freshly built MXFP4-mode model (its blocks are the package's), with the dequantized and
    transformers' MXFP4 blocks where `impls` names them. The dequantized experts run transformers' eager loop on the
    CPU (exact at fp32: the smoke run's reference) and its default experts implementation on a GPU (grouped_mm,
    batched_mm in the decode steps). transformers' MXFP4 blocks are skipped with the reason where its kernel
    (`peer_kernel`: load_mxfp4_peer's answer) did not load, or the conversion or its first block's check
    (`block_difference` against the package's, recorded in `checks`) fails."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.quantizers.quantizer_mxfp4 import Mxfp4HfQuantizer

    ours = {name: module for name, module in model.named_modules() if isinstance(module, GptOssMLP)}
    first = next(iter(ours))
    hidden = model.config.get_text_config().hidden_size
    variants = Mxfp4Variants(blocks={MXFP4_PACKAGE: ours}, quantizers={MXFP4_PACKAGE: model.hf_quantizer})
    if MXFP4_DEQUANTIZED in impls:
        try:
            variants.blocks[MXFP4_DEQUANTIZED] = dequantized_blocks(model, ours, dtype)
            variants.checks[MXFP4_DEQUANTIZED] = block_difference(variants.blocks[MXFP4_DEQUANTIZED][first],
                                                                  ours[first], hidden, device, dtype)
        except Exception as exc:  # noqa: BLE001 (out of memory, say: the others still run)
            variants.blocks.pop(MXFP4_DEQUANTIZED, None)
            variants.skipped[MXFP4_DEQUANTIZED] = f"dequantizing the experts failed: {_error(exc)}"
        else:
            variants.quantizers[MXFP4_DEQUANTIZED] = None  # loading with dequantize=True drops the quantizer
            variants.experts_implementation[MXFP4_DEQUANTIZED] = ("eager" if device.type == "cpu"
                                                                  else model.config._experts_implementation)
    if MXFP4_PEER in impls:
        module, record = peer_kernel
        if module is None:
            variants.skipped[MXFP4_PEER] = record["status"].removeprefix("skipped: ")
        else:
            step = "building transformers' MXFP4 blocks"
            try:
                from transformers import Mxfp4Config

                blocks, variants.peer_module = transformers_mxfp4_blocks(model, ours)
                step = "checking its first block"
                variants.checks[MXFP4_PEER] = block_difference(blocks[first], ours[first], hidden, device, dtype)
                variants.blocks[MXFP4_PEER] = blocks
                variants.quantizers[MXFP4_PEER] = Mxfp4HfQuantizer(Mxfp4Config(), pre_quantized=True)
            except Exception as exc:  # noqa: BLE001 (a triton_kernels that does not fit this Triton or GPU)
                variants.skipped[MXFP4_PEER] = f"{step} failed: {_error(exc)}"
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return variants


def use_implementation(model, impl):
    """Switch `model` to the experts implementation `impl`: in transformers' experts interface
    (set_experts_implementation), or with --quantize mxfp4 by swapping in that implementation's MoE blocks
    (Mxfp4Variants.use)."""
    variants = getattr(model, VARIANTS_ATTRIBUTE, None)
    if variants is None:
        model.set_experts_implementation(impl)
    else:
        variants.use(model, impl)


def skipped_implementations(model):
    """{impl: why} of the implementations `model` cannot run (--quantize mxfp4: a peer that did not load)."""
    variants = getattr(model, VARIANTS_ATTRIBUTE, None)
    return dict(variants.skipped) if variants is not None else {}


def runs_compiled(model):
    """Whether generate runs `model`'s compiled decode step now: one was compiled and the model's quantizer allows it
    (transformers' Mxfp4HfQuantizer does not: its static-cache decode runs uncompiled)."""
    quantizer = getattr(model, "hf_quantizer", None)
    return hasattr(model, "_compiled_call") and (quantizer is None or bool(quantizer.is_compileable))


# ---------------------------------------------------------------------------------------------------------------------
# Decode


def register_implementations(package):
    """Register moe_dispatch (in ExpertsInterface and FP8ExpertsInterface: `register_experts`), and grouped_mm under
    a name generate's decode switch does not touch: transformers' grouped_mm function in ExpertsInterface, its FP8
    grouped_mm function (FP8Experts, --quantize fp8) in FP8ExpertsInterface; the package's name."""
    from transformers.integrations.moe import ExpertsInterface, grouped_mm_experts_forward

    ExpertsInterface.register(ALWAYS_GROUPED, grouped_mm_experts_forward)
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface, fp8_grouped_mm_experts_forward
    except ImportError:  # a transformers without FP8 experts
        pass
    else:
        FP8ExpertsInterface.register(ALWAYS_GROUPED, fp8_grouped_mm_experts_forward)
    return package.register_experts()


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompt(batch, args, device):
    generator = torch.Generator().manual_seed(args.seed * 1000 + batch)
    return torch.randint(PAD + 1, args.vocab, (batch, args.prompt_len), generator=generator).to(device)


def timed_generate(model, ids, new_tokens, mode, args, device, cache=None):
    """(seconds, generated ids [batch, new_tokens]) of one greedy generate; `cache` is static-reuse's StaticCache."""
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD,
                  attention_mask=torch.ones_like(ids))
    if mode == "static":  # one cache length for both lengths: the compiled step is the same graph
        kwargs.update(cache_implementation="static", max_cache_len=args.prompt_len + args.new_tokens)
    elif mode == "static-reuse":
        cache.reset()
        kwargs.update(past_key_values=cache)
    synchronize(device)
    start = time.perf_counter()
    out = model.generate(ids, **kwargs)
    synchronize(device)
    return time.perf_counter() - start, out[:, ids.shape[1]:]


def compile_counts():
    """torch.compile's running totals in this process: graphs produced (grows on every (re)compile), graph breaks,
    and graphs inductor ran without CUDA graphs ("reduce-overhead" skipped them)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"])}


def _delta(after, before):
    return {key: after[key] - before.get(key, 0) for key in after}


def decode_rate(ids, long_s, short_s, args):
    """The decode measurement of a cell from its timed generate(new_tokens) and generate(1) runs (medians)."""
    t_long, t_short = statistics.median(long_s), statistics.median(short_s)
    steps = args.new_tokens - 1
    decode_s = t_long - t_short
    return {"generate_s": t_long, "one_token_s": t_short, "decode_ms_per_step": decode_s / steps * 1e3,
            "tokens_per_s": ids.shape[0] * steps / decode_s if decode_s > 0 else None,
            "generate_times_s": long_s, "one_token_times_s": short_s}


def warm_up(model, impl, ids, mode, args, device, cache=None):
    """Switch the model to `impl` and run the untimed generates (the compiled modes at least twice: compile, then
    CUDA-graph recording)."""
    use_implementation(model, impl)
    warmup = max(args.warmup, 2) if mode != "eager" else args.warmup
    for _ in range(warmup):
        timed_generate(model, ids, args.new_tokens, mode, args, device, cache)
        timed_generate(model, ids, 1, mode, args, device, cache)


def timed_pair(model, ids, mode, args, device, cache=None):
    """(seconds of generate(new_tokens), its tokens, seconds of generate(1))."""
    seconds, tokens = timed_generate(model, ids, args.new_tokens, mode, args, device, cache)
    return seconds, tokens, timed_generate(model, ids, 1, mode, args, device, cache)[0]


def diagnostics(model, ids, mode, args, device, cache=None):
    """The --profile and --trace texts of one more generate (every mode: in the compiled ones the decode steps
    replay CUDA graphs, so what is left on the host is generate's own loop and the graphs' launch)."""
    out = {}
    if args.profile:
        out["profile"] = profile_generate(model, ids, mode, args, device, cache)
    if args.trace:
        out["trace"] = trace_generate(model, ids, mode, args, device, cache)
    return out


def measure_decode(model, impl, ids, mode, args, device, cache=None):
    """One cell: warm-up, then --repeats pairs of generate(new_tokens) and generate(1); the decode rate."""
    before = compile_counts()
    warm_up(model, impl, ids, mode, args, device, cache)
    after_warmup = compile_counts()
    long_s, short_s, tokens = [], [], None
    for _ in range(args.repeats):
        seconds, tokens, short = timed_pair(model, ids, mode, args, device, cache)
        long_s.append(seconds)
        short_s.append(short)
    cell = decode_rate(ids, long_s, short_s, args)
    cell.update(diagnostics(model, ids, mode, args, device, cache))
    if mode != "eager":  # a graph compiled while timed would mean the timed runs were not the warmed-up graph
        cell.update(compiled=runs_compiled(model), compile_in_warmup=_delta(after_warmup, before),
                    compile_while_timed=_delta(compile_counts(), after_warmup))
    return cell, tokens.cpu()


def measure_interleaved(model, impls, ids, mode, args, device, cache=None):
    """The cells of one batch with the timed runs interleaved: every implementation warms up, then each of the
    --repeats rounds times one generate(new_tokens) and one generate(1) of every implementation, the order rotated
    by one each round. The host's speed drifts by tens of percent between and within runs on a shared machine
    (eager decode is host-bound, and so is compiled decode of a small-depth model: generate's own loop), so timing
    one implementation after another would compare drift, not the paths. In the compiled modes every
    implementation's graph stays in dynamo's cache, so a switch replays it; the compile counts of the timed rounds
    are kept (a graph compiled while timed would show there).
    {impl: (cell, tokens) or the exception of its warm-up}."""
    ready, results = [], {}
    before = compile_counts()
    for impl in impls:
        try:
            warm_up(model, impl, ids, mode, args, device, cache)
            ready.append(impl)
        except Exception as exc:  # noqa: BLE001 (one failing implementation does not end the run)
            results[impl] = exc
    after_warmup = compile_counts()
    times = {impl: ([], [], None) for impl in ready}
    for r in range(args.repeats if ready else 0):
        for impl in ready[r % len(ready):] + ready[:r % len(ready)]:
            if impl in results:  # failed in an earlier round
                continue
            use_implementation(model, impl)
            try:
                seconds, tokens, short = timed_pair(model, ids, mode, args, device, cache)
            except Exception as exc:  # noqa: BLE001 (without a warm-up the first failure happens here)
                results[impl] = exc
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            long_s, short_s, _ = times[impl]
            times[impl] = (long_s + [seconds], short_s + [short], tokens)
    timed = _delta(compile_counts(), after_warmup)
    for impl in [i for i in ready if i not in results]:
        long_s, short_s, tokens = times[impl]
        use_implementation(model, impl)
        cell = decode_rate(ids, long_s, short_s, args)
        cell.update(diagnostics(model, ids, mode, args, device, cache))
        if mode != "eager":
            cell.update(compiled=runs_compiled(model), compile_in_warmup=_delta(after_warmup, before),
                        compile_while_timed=timed, interleaved=True)
        results[impl] = (cell, tokens.cpu())
    return results


def profile_generate(model, ids, mode, args, device, cache=None, rows=25):
    """cProfile of one generate(new_tokens): the top functions by own time, as text (where the host time goes)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    timed_generate(model, ids, args.new_tokens, mode, args, device, cache)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(rows)
    return text.getvalue()


def trace_generate(model, ids, mode, args, device, cache=None, rows=30):
    """torch.profiler of one generate(new_tokens): the operators and kernels with the most host time, then those with
    the most device time, and the step's wall time beside the summed device time (how much of a step the GPU is
    idle), as text."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        seconds, _ = timed_generate(model, ids, args.new_tokens, mode, args, device, cache)
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) if device.type == "cuda" else 0.0
    head = (f"generate({args.new_tokens}) wall {seconds * 1e3:.2f} ms under the profiler, summed device time "
            f"{device_us / 1e3:.2f} ms\n")
    by_host = events.table(sort_by="self_cpu_time_total", row_limit=rows)
    by_device = events.table(sort_by="self_device_time_total", row_limit=rows) if device.type == "cuda" else ""
    return head + by_host + "\n" + by_device


def agreement(tokens, ref):
    """Fraction of rows equal to the reference's, and the first generated position where any row differs."""
    differs = tokens != ref
    columns = differs.any(dim=0).nonzero()
    return {"rows_equal": float((~differs.any(dim=1)).float().mean()),
            "first_diff": int(columns[0]) if len(columns) else None}


def prefill_logits(model, impls, ids, reference):
    """The last prompt position's logits of one forward per implementation, against the reference's: the largest
    |difference| and the reference's logit scale, the rows whose argmax (the first generated token) differs, and for
    those rows the reference's margin between its top two logits. A differing first token with a margin under the
    logit difference that two of transformers' own implementations also show between themselves is a near tie
    flipped by rounding, not a wrong result. An implementation the model cannot run is recorded as skipped."""
    skipped = skipped_implementations(model)
    logits = {}
    for impl in impls:
        if impl in skipped:
            logits[impl] = None
            continue
        use_implementation(model, impl)
        try:
            with torch.no_grad():
                logits[impl] = model(ids, attention_mask=torch.ones_like(ids)).logits[:, -1].float()
        except Exception as exc:  # noqa: BLE001 (batched_mm's prefill can run out of memory)
            logits[impl] = exc
            if ids.is_cuda:
                torch.cuda.empty_cache()
    ref = logits.get(reference)
    out = []
    for impl, got in logits.items():
        cell = {"impl": impl, "batch": ids.shape[0]}
        if impl in skipped:
            cell["skipped"] = skipped[impl]
        elif isinstance(got, Exception) or isinstance(ref, Exception):
            cell["error"] = _error(got if isinstance(got, Exception) else ref)
        elif ref is None:
            cell["error"] = f"no reference logits: {reference} did not run"
        if "skipped" in cell or "error" in cell:
            out.append(cell)
            continue
        top2 = ref.topk(2, dim=-1).values
        flipped = (got.argmax(-1) != ref.argmax(-1)).nonzero().flatten()
        cell.update(max_abs_diff=float((got - ref).abs().max()), ref_max_abs=float(ref.abs().max()),
                    rows_flipped=len(flipped), batch_rows=ids.shape[0],
                    flipped_ref_margins=[float(top2[r, 0] - top2[r, 1]) for r in flipped.tolist()])
        out.append(cell)
    return out


def prefill_prompt(args, device):
    """The --prefill-tokens prompt: one row of random ids, seeded apart from the decode prompts."""
    generator = torch.Generator().manual_seed(args.seed * 1000 + 999)
    return torch.randint(PAD + 1, args.vocab, (1, args.prefill_tokens), generator=generator).to(device)


def timed_prefill(model, ids, device):
    """(seconds, the next token) of one forward of `ids` as generate's prefill runs it: a fresh cache, the logits of
    the last position only."""
    synchronize(device)
    start = time.perf_counter()
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.ones_like(ids), logits_to_keep=1).logits
    synchronize(device)
    return time.perf_counter() - start, logits[:, -1].argmax(-1).cpu()


def measure_prefill(model, impls, ids, args, device):
    """The prefill cells: per implementation --warmup untimed forwards of `ids`, then --repeats rounds, each timing one
    forward of every implementation, the order rotated by one per round (as the eager decode's cells: the host's drift
    is shared out); median ms, tokens/s and the next token of each. {impl: cell, or the exception it raised}; an
    implementation the model cannot run is left out."""
    skipped = skipped_implementations(model)
    ready, results, times = [], {}, {}
    for impl in [i for i in impls if i not in skipped]:
        try:
            use_implementation(model, impl)
            for _ in range(args.warmup):
                timed_prefill(model, ids, device)
            ready.append(impl)
            times[impl] = []
        except Exception as exc:  # noqa: BLE001 (out of memory, say: the others are still timed)
            results[impl] = exc
            if device.type == "cuda":
                torch.cuda.empty_cache()
    tokens = {}
    for r in range(args.repeats if ready else 0):
        for impl in ready[r % len(ready):] + ready[:r % len(ready)]:
            if impl in results:
                continue
            use_implementation(model, impl)
            try:
                seconds, tokens[impl] = timed_prefill(model, ids, device)
            except Exception as exc:  # noqa: BLE001 (without a warm-up the first failure happens here)
                results[impl] = exc
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            times[impl].append(seconds)
    for impl in [i for i in ready if i not in results]:
        median = statistics.median(times[impl])
        results[impl] = {"prefill_ms": median * 1e3, "tokens_per_s": ids.numel() / median, "times_s": times[impl],
                         "next_token": tokens[impl].tolist()}
    return results


def reset_compiled(model):
    """Forget the compiled graphs and CUDA graphs (after each model)."""
    if hasattr(model, "_compiled_call"):
        del model._compiled_call
    try:
        torch._dynamo.reset()
    except Exception:  # noqa: BLE001 (a torch without dynamo: nothing was compiled)
        pass


# ---------------------------------------------------------------------------------------------------------------------
# Training


def training_step(model, ids, device):
    """(seconds, peak bytes, bytes allocated before the step, loss) of one forward + backward from no gradients."""
    model.zero_grad(set_to_none=True)
    synchronize(device)
    before = peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    synchronize(device)
    seconds = time.perf_counter() - start
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    return seconds, peak, before, loss.item()


@torch.no_grad()
def gradient_difference(got, ref):
    """max over tensors of ||got - ref|| / ||ref|| and of max|got - ref| / max|ref|, one expert at a time (a
    DeepSeek-V3 layer's gate_up gradient is 15 GB in bf16; its fp32 difference would not fit beside the model)."""
    worst_norm, worst_max = 0.0, 0.0
    for name, grad in got:
        reference = ref.get(name)
        if reference is None:
            continue
        sq_diff = sq_ref = max_diff = max_ref = torch.zeros((), device=grad.device, dtype=torch.float64)
        for e in range(grad.shape[0]):
            a, b = grad[e].float(), reference[e].to(grad.device).float()
            d = a - b
            sq_diff = sq_diff + d.double().square().sum()
            sq_ref = sq_ref + b.double().square().sum()
            max_diff = torch.maximum(max_diff, d.abs().max().double())
            max_ref = torch.maximum(max_ref, b.abs().max().double())
        worst_norm = max(worst_norm, float(sq_diff.sqrt() / sq_ref.sqrt().clamp_min(1e-300)))
        worst_max = max(worst_max, float(max_diff / max_ref.clamp_min(1e-300)))
    return worst_norm, worst_max


def measure_training(model, impls, args, device):
    """One forward + backward per step for each implementation (the first is the gradient reference)."""
    generator = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(PAD + 1, args.vocab, (args.train_batch, args.train_seq), generator=generator).to(device)
    model.train()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the eager decode's cached blocks (batched_mm's gathered weights) go back first
    cells, ref_grads = [], None
    try:
        for impl in impls:  # warm-up: kernel compiles, allocator growth
            model.set_experts_implementation(impl)
            training_step(model, ids, device)
        timed = {impl: [] for impl in impls}
        for _ in range(args.train_steps):  # interleaved round by round: a drift of the host or GPU hits every impl
            for impl in impls:
                model.set_experts_implementation(impl)
                timed[impl].append(training_step(model, ids, device))
        for impl in impls:
            model.set_experts_implementation(impl)
            steps = timed[impl]
            cell = {"impl": impl, "tokens": args.train_batch * args.train_seq, "batch": args.train_batch,
                    "seq": args.train_seq, "step_ms": statistics.median(s[0] for s in steps) * 1e3,
                    "step_times_s": [s[0] for s in steps], "loss": steps[-1][3]}
            if device.type == "cuda":  # weights (and whatever else was alive), then the step's peak
                cell["before_gib"] = steps[-1][2] / 2**30
                cell["peak_gib"] = max(s[1] for s in steps) / 2**30
            if args.profile_train:  # one more full step: the gradients compared below are its own
                cell["profile"] = profile_training_step(model, ids, device)
            else:  # one more step, whose gradients are this implementation's (the rounds ended on the last one)
                training_step(model, ids, device)
            grads = [(name, p.grad) for name, p in experts_parameters(model) if p.grad is not None]
            if ref_grads is None:  # kept on the host: the next implementation needs the device memory
                ref_grads = {name: g.detach().to("cpu") for name, g in grads}
                ref_loss = cell["loss"]
            else:
                cell["grad_rel_diff"], cell["grad_max_diff"] = gradient_difference(grads, ref_grads)
                cell["loss_diff"] = cell["loss"] - ref_loss
            cells.append(cell)
            del grads  # the next implementation's "before" and peak must not hold this one's gradients
            model.zero_grad(set_to_none=True)
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()
    return cells


# ---------------------------------------------------------------------------------------------------------------------
# Training profile


SCOPE_PREFIX = "generate_e2e.scope::"  # record_function ranges around the scoped modules' forward
STEP_RANGE = "generate_e2e.train_step"
BACKWARD_FUNCTION = 1  # torch's RecordScope::BACKWARD_FUNCTION: an autograd node's event, sequence_nr = its forward's
# Categories of device time, in the order `categorize_kernels` tries them (the first that matches takes the kernel).
CATEGORIES = {
    "moe_dispatch": "the package's Triton kernels (by name)",
    "casts/copies": "names with copy, cast, convert or memcpy, not GEMMs (dtype casts, contiguous and host copies)",
    "grouped_mm": "GEMM kernels launched from the experts module (transformers' grouped_mm: CUTLASS / cuBLAS)",
    "experts other": "the experts module's other kernels (sort, histc, gathers, activation, weighting, top-k sum)",
    "attention": "the attention modules' kernels, or a flash / fmha / attention name anywhere",
    "router": "the router modules' kernels (gate linear, softmax, top-k) and their backward",
    "other": "the rest (embeddings, norms, a shared expert, the LM head, the loss), names listed",
}
# Substrings of the package's kernel names, for a Triton kernel `package_kernel_names` did not find (a plain
# identifier: torch's and CUTLASS's kernels are C++ signatures, inductor's start with "triton_").
PACKAGE_KERNEL_HINTS = ("grouped_gemm", "decode", "_grad_kernel", "gather", "combine", "dispatch", "route")
GEMM_HINTS = ("gemm", "cutlass", "nvjet", "xmma", "cublas", "grouped_mm", "matmul", "wgmma")
COPY_PATTERN = re.compile(r"copy|memcpy|(?<![a-z])cast|convert", re.IGNORECASE)
ATTENTION_HINTS = ("flash", "fmha", "attention", "sdpa")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize",
              "cuCtxSynchronize", "cuEventSynchronize")
OTHER_LISTED = 30  # kernel names kept per category that lists its names


@contextlib.contextmanager
def scope_ranges(model):
    """A `record_function` range named SCOPE_PREFIX + scope around every scoped module's forward."""
    from torch.autograd.profiler import record_function

    opened, handles = [], []

    def enter(scope):
        def hook(module, args):
            opened.append(record_function(SCOPE_PREFIX + scope).__enter__())
        return hook

    def leave(module, args, output):
        opened.pop().__exit__(None, None, None)

    for module in model.modules():
        scope = module_scope(module)
        if scope is not None:
            handles.append(module.register_forward_pre_hook(enter(scope)))
            handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        while opened:
            opened.pop().__exit__(None, None, None)


def package_kernel_names(package):
    """Names of the Triton kernels (and jit helpers) defined in `package`'s modules."""
    from triton.runtime.jit import KernelInterface

    names = set()
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name.split(".")[0] != package.__name__:
            continue
        for value in vars(module).values():
            if isinstance(value, KernelInterface):
                while not hasattr(value, "__name__") and hasattr(value, "fn"):  # autotuner / heuristics wrappers
                    value = value.fn
                names.add(getattr(value, "__name__", None) or getattr(getattr(value, "fn", None), "__name__", ""))
    names.discard("")
    return frozenset(names)


def is_package_kernel(name, package_kernels):
    """Whether a device kernel's name is one of the package's Triton kernels: a name found in the package, or a plain
    identifier (Triton names a kernel after its function) outside inductor's `triton_*` with a package hint."""
    if name in package_kernels or any(name.startswith(k + "_") for k in package_kernels if k.endswith("_kernel")):
        return True
    plain = re.fullmatch(r"[A-Za-z_]\w*", name) is not None and not name.startswith("triton_")
    return plain and any(hint in name for hint in PACKAGE_KERNEL_HINTS)


def kernel_category(name, scope, package_kernels):
    """The CATEGORIES key of one device kernel or copy, from its name and the scope of the module that launched it.
    A GEMM's name is never read as a copy (CUTLASS's template names spell their TMA copy atoms)."""
    lowered = name.lower()
    if is_package_kernel(name, package_kernels):
        return "moe_dispatch"
    gemm = any(hint in lowered for hint in GEMM_HINTS)
    if not gemm and COPY_PATTERN.search(name):
        return "casts/copies"
    if scope == "experts":
        return "grouped_mm" if gemm else "experts other"
    if scope == "attention" or (scope is None and any(hint in lowered for hint in ATTENTION_HINTS)):
        return "attention"
    if scope == "router":
        return "router"
    return "other"


def categorize_kernels(records, package_kernels=frozenset()):
    """Device time by category of (name, microseconds, scope) records (scope: module_scope's name or None).

    {"categories": {category: {"ms", "count"}} (every CATEGORIES key, in its order), "scopes": {scope or "none":
    {"ms", "count"}}, "names": {category: [{"name", "ms", "count"}, ...]} for "other" and "experts other" (largest
    first, at most OTHER_LISTED), "total_ms"}."""
    categories = {key: {"ms": 0.0, "count": 0} for key in CATEGORIES}
    scopes, listed = {}, {"other": {}, "experts other": {}}
    total_us = 0.0
    for name, us, scope in records:
        category = kernel_category(name, scope, package_kernels)
        categories[category]["ms"] += us / 1e3
        categories[category]["count"] += 1
        by_scope = scopes.setdefault(scope or "none", {"ms": 0.0, "count": 0})
        by_scope["ms"] += us / 1e3
        by_scope["count"] += 1
        total_us += us
        if category in listed:
            ms, count = listed[category].get(name, (0.0, 0))
            listed[category][name] = (ms + us / 1e3, count + 1)
    names = {category: [{"name": n, "ms": ms, "count": count}
                        for n, (ms, count) in sorted(found.items(), key=lambda item: -item[1][0])[:OTHER_LISTED]]
             for category, found in listed.items()}
    return {"categories": categories, "scopes": scopes, "names": names, "total_ms": total_us / 1e3}


def _is_device(event):
    from torch.autograd import DeviceType

    return event.device_type != DeviceType.CPU


def _ancestors(event):
    while event is not None:
        yield event
        event = event.cpu_parent


def event_scopes(events):
    """A function giving the scope of a host event: the innermost scope range around it, or for an operator of the
    backward, the scope of the forward operator that created its autograd node (the node's event carries the forward's
    sequence number; the last forward event with that number is the creator or one of its callees)."""
    forward = {}
    host = [e for e in events if not _is_device(e)]

    def in_range(event):
        for ancestor in _ancestors(event):
            if ancestor.name.startswith(SCOPE_PREFIX):
                return ancestor.name[len(SCOPE_PREFIX):], False
            if getattr(ancestor, "scope", 0) == BACKWARD_FUNCTION or ancestor.name.startswith("autograd::engine"):
                return None, True
        return None, False

    for event in sorted(host, key=lambda e: e.time_range.start):
        if getattr(event, "sequence_nr", -1) < 0:
            continue
        scope, backward = in_range(event)
        if not backward:
            forward[event.sequence_nr] = scope

    def scope_of(event):
        for ancestor in _ancestors(event):
            if ancestor.name.startswith(SCOPE_PREFIX):
                return ancestor.name[len(SCOPE_PREFIX):]
            if getattr(ancestor, "scope", 0) == BACKWARD_FUNCTION and getattr(ancestor, "sequence_nr", -1) >= 0:
                return forward.get(ancestor.sequence_nr)
        return None

    return scope_of


def _launcher_name(event):
    """Where a runtime call or copy came from: its innermost three ancestors that are not runtime calls nor the step's
    range ("aten::copy_ < aten::_to_copy < aten::to"), or "(top level)"."""
    names = [a.name for a in _ancestors(event)
             if (not a.name.startswith("cu") or a.name.startswith("cudnn")) and a.name != STEP_RANGE]
    return " < ".join(names[:3]) or "(top level)"


def _is_range(event):
    return (getattr(event, "is_user_annotation", False) or event.name.startswith(SCOPE_PREFIX)
            or event.name == STEP_RANGE)


def _union_us(intervals):
    busy, end = 0.0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy


def step_breakdown(events, package_kernels, wall_s):
    """The --profile-train record of one profiled step from the profiler's events (`prof.events()`): device time by
    category and scope, GPU busy time, host gaps and device-to-host syncs (inside the step's range).

    Each device kernel or copy is read from the `kernels` of the host event that launched it (the profiler links
    them by correlation id; an operator, or a range for what ran outside any operator); device time no host event
    claims is kept in "other" under one name, so the categories always add up to the device's time."""
    scope_of = event_scopes(events)
    records, dtoh = [], {}
    for event in events:
        if _is_device(event) or not getattr(event, "kernels", None):
            continue
        scope = scope_of(event)
        for kernel in event.kernels:
            records.append((kernel.name, kernel.duration, scope))
            if "dtoh" in kernel.name.lower():
                where = _launcher_name(event) + (f" [{scope}]" if scope else "")
                dtoh[where] = dtoh.get(where, 0) + 1
    intervals = [(e.time_range.start, e.time_range.end) for e in events if _is_device(e) and not _is_range(e)]
    unclaimed_us = sum(end - start for start, end in intervals) - sum(us for _, us, _ in records)
    if unclaimed_us > 1e-6 * max(1.0, sum(end - start for start, end in intervals)):
        records.append(("(device time no host event launched)", unclaimed_us, None))
    step = [e for e in events if e.name == STEP_RANGE and not _is_device(e)]
    window = (step[0].time_range.start, step[0].time_range.end) if step else (float("-inf"), float("inf"))
    syncs = {}
    for event in events:
        if not _is_device(event) and event.name in SYNC_CALLS and window[0] <= event.time_range.start <= window[1]:
            scope = scope_of(event.cpu_parent) if event.cpu_parent is not None else None
            where = _launcher_name(event.cpu_parent) + (f" [{scope}]" if scope else "")
            syncs[where] = syncs.get(where, 0) + 1
    out = categorize_kernels(records, package_kernels)
    busy_ms = _union_us(intervals) / 1e3
    out.update(wall_ms=wall_s * 1e3, gpu_busy_ms=busy_ms, host_gap_ms=wall_s * 1e3 - busy_ms,
               kernels=len(records), syncs=sum(syncs.values()), syncs_by_op=syncs,
               dtoh_copies=sum(dtoh.values()), dtoh_by_op=dtoh)
    return out


def profile_training_step(model, ids, device, rows=40):
    """One forward + backward under torch.profiler with the scope ranges (see the module docstring): the
    step_breakdown record plus the raw key_averages() table (top `rows` by device time, by host time on the CPU)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    package_kernels = package_kernel_names(load_package(device))
    model.zero_grad(set_to_none=True)
    synchronize(device)
    with scope_ranges(model), profile(activities=activities) as prof:
        start = time.perf_counter()
        with record_function(STEP_RANGE):
            model(input_ids=ids, labels=ids).loss.backward()
        synchronize(device)
        wall_s = time.perf_counter() - start
    out = step_breakdown(prof.events(), package_kernels, wall_s)
    sort_by = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    out["table"] = prof.key_averages().table(sort_by=sort_by, row_limit=rows)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Output


def _git_commit():
    if os.environ.get("MOE_DISPATCH_COMMIT"):
        return os.environ["MOE_DISPATCH_COMMIT"]
    try:
        run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (run.stdout.strip() + ("-dirty" if dirty else "")) or None
    except Exception:  # noqa: BLE001 (no git, not a checkout)
        return None


def meta(args, device, package):
    import transformers
    import triton

    recorded = {k: v for k, v in vars(args).items() if k != "out"}  # --out is a path on this machine
    recorded["hub_dir"] = _portable_path(args.hub_dir)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "package": f"{package.__name__} {getattr(package, '__version__', '?')}",
        "commit": _git_commit(), "interpreter": os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        "args": recorded,
    }


def _num(value, digits=1):
    return "-" if value is None else f"{value:,.{digits}f}"


def _sci(value):
    return "-" if value is None else f"{value:.2e}"


def _match(cell):
    if "rows_equal" not in cell:
        return "-"
    rows = round(cell["rows_equal"] * cell["batch"])
    text = f"{rows}/{cell['batch']}"
    return text if cell["first_diff"] is None else f"{text} (first diff at {cell['first_diff']})"


def _not_measured(cell):
    """Why a cell has no measurement, for a table: its error, or "skipped: why"."""
    return cell.get("error") or f"skipped: {cell.get('skipped')}"


def tables(results):
    """[full table, short table, training table, the training profile (with --profile-train), the prefill timing
    (with --prefill-tokens), prefill logits], each in Markdown."""
    args = results["meta"]["args"]
    cells = [c for c in results["decode"] if "tokens_per_s" in c]
    weights = args["dtype"]
    if args.get("quantize", "none") == "fp8":
        weights += f" with FP8 weights ({'x'.join(map(str, args['fp8_block']))} blocks, FineGrainedFP8Config)"
    elif args.get("quantize", "none") == "mxfp4":
        weights += " with MXFP4 experts (e2m1 blocks, e8m0 scales per 32 values)"
    head = (f"{args['layers']} decoder layers, vocab {args['vocab']}, prompt {args['prompt_len']}, "
            f"{args['new_tokens']} new tokens, {weights}, {results['meta']['device']}; decode tok/s = "
            f"batch * (new_tokens - 1) / (t(new_tokens) - t(1)); tokens vs {args['reference']}")
    full = [head, "", "| model | batch | mode | impl | tok/s | ms/step | generate s | vs default | tokens match |",
            "|---|---:|---|---|---:|---:|---:|---:|---|"]
    for c in results["decode"]:
        if "tokens_per_s" not in c:
            full.append(f"| {c['model']} | {c['batch']} | {c['mode']} | {c['impl']} | {_not_measured(c)} | | | | |")
            continue
        full.append(f"| {c['model']} | {c['batch']} | {c['mode']} | {c['impl']} | {_num(c['tokens_per_s'])} | "
                    f"{_num(c['decode_ms_per_step'], 2)} | {_num(c['generate_s'], 3)} | "
                    f"{_num(c.get('vs_default'), 2)} | {_match(c)} |")
    default, package = results["default_impl"], results["package_impl"]
    short = [f"{head}; default = {default}", "",
             f"| model | batch | mode | {package} tok/s | {default} tok/s | ratio | tokens match |",
             "|---|---:|---|---:|---:|---:|---|"]
    for c in results["decode"]:
        if c["impl"] != package:
            continue
        if "tokens_per_s" not in c:
            short.append(f"| {c['model']} | {c['batch']} | {c['mode']} | {_not_measured(c)} | | | |")
            continue
        base = next((b for b in cells if b["impl"] == default and
                     (b["model"], b["batch"], b["mode"]) == (c["model"], c["batch"], c["mode"])), None)
        short.append(f"| {c['model']} | {c['batch']} | {c['mode']} | {_num(c['tokens_per_s'])} | "
                     f"{_num(base and base['tokens_per_s'])} | {_num(c.get('vs_default'), 2)} | {_match(c)} |")
    train = ["Training: one forward + backward, labels = input ids; gradient difference of the experts' weights "
             "against the first implementation (norm-wise, max over tensors)", "",
             "| model | tokens | impl | step ms | peak GiB (before step) | loss | grad rel diff | grad max diff |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for c in results["train"]:
        if "step_ms" not in c:
            train.append(f"| {c['model']} | | {c.get('impl', '')} | {_not_measured(c)} | | | | |")
            continue
        memory = "-" if "peak_gib" not in c else f"{c['peak_gib']:.2f} ({c['before_gib']:.2f})"
        train.append(f"| {c['model']} | {c['batch']}x{c['seq']} | {c['impl']} | {_num(c['step_ms'])} | {memory} | "
                     f"{c['loss']:.5f} | {_sci(c.get('grad_rel_diff'))} | {_sci(c.get('grad_max_diff'))} |")
    if not results["train"]:
        train = ["Training: not run (--no-train)"]
    logits = [f"Prefill logits (last prompt position) against {args['reference']}: the largest |difference| "
              "(the reference's largest |logit|), rows whose first token differs, the reference's top-2 margin there",
              "", "| model | batch | impl | max abs diff | rows flipped | margins of flipped rows |",
              "|---|---:|---|---:|---:|---|"]
    for c in results.get("logits", []):
        if "error" in c or "skipped" in c:
            logits.append(f"| {c['model']} | {c['batch']} | {c['impl']} | {_not_measured(c)} | | |")
            continue
        margins = ", ".join(f"{m:.3g}" for m in c["flipped_ref_margins"]) or "-"
        logits.append(f"| {c['model']} | {c['batch']} | {c['impl']} | {_sci(c['max_abs_diff'])} "
                      f"({c['ref_max_abs']:.3g}) | {c['rows_flipped']}/{c['batch_rows']} | {margins} |")
    if not results.get("logits"):
        logits = ["Prefill logits: not compared (--no-logits)"]
    profile = profile_table(results)
    prefill = prefill_table(results)
    sections = [full, short, train] + ([profile] if profile else []) + ([prefill] if prefill else []) + [logits]
    return ["\n".join(lines) for lines in sections]


def prefill_table(results):
    """The --prefill-tokens cells in Markdown lines (none without)."""
    cells = results.get("prefill")
    if not cells:
        return []
    args = results["meta"]["args"]
    lines = [f"Prefill: one forward of a {args['prefill_tokens']}-token prompt (batch 1, the last position's logits, "
             f"as generate's prefill), median of {args['repeats']} interleaved rounds; vs default = "
             f"{results['default_impl']} ms / ms; next token vs {args['reference']}", "",
             "| model | tokens | impl | ms | tok/s | vs default | next token |", "|---|---:|---|---:|---:|---:|---|"]
    for c in cells:
        if "prefill_ms" not in c:
            lines.append(f"| {c['model']} | {c['tokens']} | {c['impl']} | {_not_measured(c)} | | | |")
            continue
        match = "-" if "next_token_equal" not in c else ("equal" if c["next_token_equal"] else "differs")
        lines.append(f"| {c['model']} | {c['tokens']} | {c['impl']} | {_num(c['prefill_ms'], 2)} | "
                     f"{_num(c['tokens_per_s'])} | {_num(c.get('vs_default'), 2)} | {match} |")
    return lines


def _short_name(name, width=90):
    name = name.replace("|", "/")
    return name if len(name) <= width else name[:width - 3] + "..."


def profile_table(results):
    """The --profile-train breakdown of every training cell that has one, in Markdown lines (none without)."""
    cells = [c for c in results["train"] if "profile" in c]
    if not cells:
        return []
    lines = ["Training step under torch.profiler (one step after the timed ones; wall time under the profiler; GPU "
             "busy = union of the kernels' and copies' intervals; host gaps = wall - busy; syncs: stream / device / "
             "event synchronize calls; DtoH: device-to-host copies); GPU ms by category:", ""]
    lines += [f"- {name}: {what}" for name, what in CATEGORIES.items()]
    lines += ["", "| model | impl | step ms (unprofiled) | wall ms | GPU busy ms | host gaps ms | syncs | DtoH | "
              + " | ".join(CATEGORIES) + " |",
              "|---|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(CATEGORIES)]
    for c in cells:
        prof = c["profile"]
        lines.append(f"| {c['model']} | {c['impl']} | {_num(c['step_ms'])} | {_num(prof['wall_ms'])} | "
                     f"{_num(prof['gpu_busy_ms'])} | {_num(prof['host_gap_ms'])} | {prof['syncs']} | "
                     f"{prof['dtoh_copies']} | "
                     + " | ".join(_num(prof["categories"][key]["ms"], 2) for key in CATEGORIES) + " |")
    lines += ["", "Largest kernels of `other` and `experts other`, and where the syncs came from:", ""]
    for c in cells:
        prof = c["profile"]
        parts = []
        for category, found in prof["names"].items():
            if found:
                parts.append(f"{category}: " + "; ".join(f"`{_short_name(k['name'])}` {k['ms']:.2f} ms x{k['count']}"
                                                          for k in found[:5]))
        for key in ("syncs_by_op", "dtoh_by_op"):
            if prof[key]:
                parts.append(f"{key}: " + ", ".join(f"{op} x{n}" for op, n in prof[key].items()))
        lines.append(f"- {c['model']}, {c['impl']}: " + (" / ".join(parts) or "-"))
    return lines


def profile_text(results):
    """The raw profiler tables of every profiled training cell, one after the other."""
    blocks = []
    for c in results["train"]:
        if "profile" in c:
            prof = c["profile"]
            blocks.append(f"== {c['model']} / {c['impl']}: wall {prof['wall_ms']:.2f} ms, GPU busy "
                          f"{prof['gpu_busy_ms']:.2f} ms, {prof['kernels']} device events\n{prof['table']}")
    return "\n\n".join(blocks)


def write(results, out):
    if out is None:
        return
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{RESULTS_NAME}.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (folder / f"{RESULTS_NAME}.md").write_text("\n\n".join(tables(results)) + "\n")
    raw = profile_text(results)
    if raw:
        (folder / f"{RESULTS_NAME}_train_profile.txt").write_text(raw + "\n")


# ---------------------------------------------------------------------------------------------------------------------


def load_package(device):
    """The moe_dispatch package (torch-ext/ on PYTHONPATH); on the CPU its kernels need Triton's interpreter, which
    must be on before the package (its @triton.jit decorators) is imported."""
    if device.type == "cpu" and "moe_dispatch" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import moe_dispatch
    except ImportError as exc:
        raise SystemExit(f"cannot import moe_dispatch ({exc}): run from the repository root with "
                         f"PYTHONPATH=torch-ext") from exc
    return moe_dispatch


def _error(exc):
    """One line for a table cell: the exception's type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300].replace("|", "/")


def _over_budget(args, started):
    return args.budget_s is not None and time.monotonic() - started > args.budget_s


def run_decode_mode(model, spec, mode, impls, args, device, results, started, log):
    """Every (batch, implementation) cell of one mode; tokens compared with the reference's of the same batch. An
    implementation the model cannot run (skipped_implementations) gets its cells with the reason."""
    default = results["default_impl"]
    skipped = skipped_implementations(model)
    ready = [impl for impl in impls if impl not in skipped]
    for batch in args.batches if mode == "eager" else args.static_batches:
        ids = prompt(batch, args, device)
        cache = None
        if mode == "static-reuse":
            from transformers import StaticCache

            cache = StaticCache(config=model.config, max_cache_len=args.prompt_len + args.new_tokens)
        ref_tokens, by_impl = None, {}
        interleaved = None
        if (mode == "eager" or args.interleave == "all") and len(ready) > 1 and not _over_budget(args, started):
            interleaved = measure_interleaved(model, ready, ids, mode, args, device, cache)
        for impl in impls:
            cell = {"model": spec.name, "batch": batch, "mode": mode, "impl": impl, "new_tokens": args.new_tokens,
                    "prompt_len": args.prompt_len}
            results["decode"].append(cell)
            if impl in skipped:
                cell["skipped"] = skipped[impl]
                log(f"  {mode} batch {batch} {impl}: skipped: {skipped[impl]}")
                continue
            if _over_budget(args, started):
                cell["skipped"] = "budget"
                continue
            try:
                if interleaved is None:
                    measured, tokens = measure_decode(model, impl, ids, mode, args, device, cache)
                elif isinstance(interleaved[impl], Exception):
                    raise interleaved[impl]
                else:
                    measured, tokens = interleaved[impl]
            except Exception as exc:  # noqa: BLE001 (one failing implementation does not end the run)
                cell["error"] = _error(exc)
                log(f"  {mode} batch {batch} {impl}: {cell['error']}")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            cell.update(measured)
            if impl == args.reference:
                ref_tokens = tokens
            if ref_tokens is not None:
                cell.update(agreement(tokens, ref_tokens))
            by_impl[impl] = cell
            compiled = ""
            if "compile_while_timed" in cell:
                warm, timed = cell["compile_in_warmup"], cell["compile_while_timed"]
                compiled = (f"; compiled {cell['compiled']}: {warm.get('graphs')} graphs in warm-up, "
                            f"{timed.get('graphs')} while timed, "
                            f"{warm.get('cudagraph_skips', 0) + timed.get('cudagraph_skips', 0)} CUDA-graph skips")
            log(f"  {mode} batch {batch} {impl}: {_num(cell['tokens_per_s'])} tok/s, "
                f"{cell['decode_ms_per_step']:.2f} ms/step, tokens {_match(cell)}{compiled}")
            for key in ("profile", "trace"):
                if key in cell:
                    log(cell[key])
            write(results, args.out)
        base = by_impl.get(default, {}).get("tokens_per_s")
        for cell in by_impl.values():
            if base and cell["tokens_per_s"]:
                cell["vs_default"] = cell["tokens_per_s"] / base
        del cache


def run_training(model, spec, args, device, results, started, log):
    if _over_budget(args, started):
        results["train"].append({"model": spec.name, "skipped": "budget"})
        return
    try:
        for cell in measure_training(model, [results["default_impl"], results["package_impl"]], args, device):
            results["train"].append({"model": spec.name, **cell})
            log(f"  train {cell['impl']}: {cell['step_ms']:.1f} ms, loss {cell['loss']:.5f}, "
                f"grad rel diff {_sci(cell.get('grad_rel_diff'))}")
            if "profile" in cell:
                prof = cell["profile"]
                log(f"    profiled: wall {prof['wall_ms']:.1f} ms, GPU busy {prof['gpu_busy_ms']:.1f} ms, "
                    f"{prof['syncs']} syncs, {prof['dtoh_copies']} DtoH; "
                    + ", ".join(f"{k} {v['ms']:.2f}" for k, v in prof["categories"].items() if v["count"]))
    except Exception as exc:  # noqa: BLE001 (an out-of-memory step keeps the decode results)
        results["train"].append({"model": spec.name, "error": _error(exc)})
        log(f"  train: {results['train'][-1]['error']}")
        if device.type == "cuda":
            torch.cuda.empty_cache()


def run_prefill(model, spec, impls, args, device, results, started, log):
    """The --prefill-tokens cells of one model (measure_prefill), each against the default implementation's time and
    the reference's next token."""
    skipped = skipped_implementations(model)
    cells = {impl: {"model": spec.name, "impl": impl, "batch": 1, "tokens": args.prefill_tokens} for impl in impls}
    results["prefill"].extend(cells.values())
    if _over_budget(args, started):
        for cell in cells.values():
            cell["skipped"] = "budget"
        return
    measured = measure_prefill(model, impls, prefill_prompt(args, device), args, device)
    for impl, cell in cells.items():
        got = measured.get(impl)
        if impl in skipped:
            cell["skipped"] = skipped[impl]
        elif isinstance(got, Exception):
            cell["error"] = _error(got)
        else:
            cell.update(got)
    base, ref = cells[results["default_impl"]].get("prefill_ms"), cells[args.reference].get("next_token")
    for impl, cell in cells.items():
        if "prefill_ms" not in cell:
            log(f"  prefill {args.prefill_tokens} {impl}: " + (f"skipped: {cell['skipped']}" if "skipped" in cell
                                                               else cell["error"]))
            continue
        if base:
            cell["vs_default"] = base / cell["prefill_ms"]
        if ref is not None:
            cell["next_token_equal"] = cell["next_token"] == ref
        log(f"  prefill {args.prefill_tokens} {impl}: {cell['prefill_ms']:.2f} ms, {_num(cell['tokens_per_s'])} tok/s"
            + (f", next token {'equal' if cell['next_token_equal'] else 'differs'}" if ref is not None else ""))
    write(results, args.out)


def run_model(spec, args, device, dtype, results, started, log, peer_kernel=None):
    """Build one model, then: eager decode, the prefill timing, the training step, the compiled decode modes (the order
    a run cut short by --budget-s loses least in). `peer_kernel`: load_mxfp4_peer's answer (--quantize mxfp4)."""
    build_start = time.perf_counter()
    if args.quantize == "mxfp4":
        model, shape = build_mxfp4_model(spec, args, device, dtype)
    else:
        model, shape = build_model(spec, args, device, dtype, None)  # None: the implementation transformers defaults to
    quantize_s = None
    if args.quantize == "fp8":
        synchronize(device)
        quantize_start = time.perf_counter()
        quantize_fp8_(model, args.fp8_block)
        synchronize(device)
        quantize_s = time.perf_counter() - quantize_start
    synchronize(device)
    if args.quantize != "mxfp4":  # the MXFP4 mode's default is transformers' MXFP4 path (main)
        results["default_impl"] = model.config._experts_implementation
    default = results["default_impl"]
    record = model_record(model, spec, shape, args, time.perf_counter() - build_start)
    quantized = ""
    if quantize_s is not None:
        record["quantize_s"] = quantize_s
        quant = record["quantization"]
        quantized = (f", FP8 {'x'.join(map(str, quant['weight_block_size']))} blocks ({quant['fp8_linear']} FP8Linear, "
                     f"{quant['fp8_experts']} FP8Experts, {len(quant['unquantized'])} left unquantized; "
                     f"{quantize_s:.1f} s)")
    results["models"][spec.name] = record
    impls = list(dict.fromkeys([args.reference, default, *args.impls]))  # reference first, then the default
    if args.quantize == "mxfp4":
        variants = mxfp4_variants(model, impls, device, dtype, peer_kernel)
        setattr(model, VARIANTS_ATTRIBUTE, variants)
        record["implementations"] = variants.status()
        record["block_check"] = variants.checks
        record["peer_module"] = variants.peer_module
        quant = record["quantization"]
        gib = quant["blocks_gib"] + quant["scales_gib"]
        quantized = (f", {quant['mxfp4_experts']} MXFP4 experts modules ({gib:.2f} GiB of blocks and scales, scale "
                     f"codes {quant['scale_codes']})")
    log(f"{spec.name}: built in {record['build_s']:.1f} s, {record['params'] / 1e9:.2f} B parameters "
        f"({record['weights_gib']:.1f} GiB){quantized}, {record['moe_layers']} MoE layers; default experts: {default}")
    for impl, status in record.get("implementations", {}).items():
        if status != "ready":
            log(f"  {impl}: {status}")
    for impl, difference in record.get("block_check", {}).items():
        log(f"  {impl}: first MoE block vs {MXFP4_PACKAGE}'s on random activations: rel diff {difference:.2e}")
    try:
        if args.logits and not _over_budget(args, started):
            for batch in args.batches:
                for cell in prefill_logits(model, impls, prompt(batch, args, device), args.reference):
                    results["logits"].append({"model": spec.name, **cell})
            write(results, args.out)
        if "eager" in args.modes:
            run_decode_mode(model, spec, "eager", impls, args, device, results, started, log)
        if args.prefill_tokens:
            run_prefill(model, spec, impls, args, device, results, started, log)
        if args.train:
            run_training(model, spec, args, device, results, started, log)
            write(results, args.out)
        for mode in [m for m in args.modes if m != "eager"]:
            run_decode_mode(model, spec, mode, impls, args, device, results, started, log)
    finally:
        reset_compiled(model)  # the compiled graphs and their CUDA-graph memory pools go with the model
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv=None):
    """Run the benchmark; returns the results dict (see the module docstring)."""
    started = time.monotonic()
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    served = None
    if args.quantize == "fp8":
        if device.type == "cuda":  # DeepGEMM is downloaded on first use: the finegrained-fp8 linear instead (docstring)
            os.environ.setdefault("TRANSFORMERS_DISABLE_DEEPGEMM_LINEAR", "1")
        if args.finegrained_fp8 is not None:  # before anything loads the kernel
            served = serve_finegrained_fp8(args.finegrained_fp8)
    package = load_package(device)
    package_impl = register_implementations(package)
    if args.quantize == "mxfp4":
        package_impl = MXFP4_PACKAGE
    if set(args.modes) - {"eager"}:
        # Each implementation and batch size compiles its own decode graph of the same frame (model.__call__):
        # close to dynamo's default limit of 8 recompilations, past which it would silently run uncompiled.
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))

    def log(line):
        print(line, flush=True)

    results = {"meta": meta(args, device, package), "package_impl": package_impl,
               "default_impl": MXFP4_PEER if args.quantize == "mxfp4" else None,
               "models": {}, "decode": [], "train": [], "logits": []}
    if args.prefill_tokens:
        results["prefill"] = []
    log(f"generate_e2e on {results['meta']['device']}: {args.layers} layers, vocab {args.vocab}, {args.dtype}, "
        f"impls {','.join(args.impls)}, modes {','.join(args.modes)}, batches {args.batches}")
    if args.quantize == "fp8":
        peer = results["meta"]["finegrained_fp8"] = load_finegrained_fp8(served, device)
        log(f"finegrained-fp8 kernel from {peer['source']}: " + (peer.get("error") or f"loaded as {peer['loaded']}"))
    peer_kernel = None
    if args.quantize == "mxfp4":
        peer_kernel = load_mxfp4_peer(args, device)
        peer = results["meta"]["mxfp4_peer"] = peer_kernel[1]
        log(f"{TRITON_KERNELS_REPO} from {peer['from']}: " + (f"loaded as {peer['loaded']}" if "loaded" in peer
                                                             else peer["status"]))
    for name in args.models:
        run_model(SPECS[name], args, device, dtype, results, started, log, peer_kernel)
    results["meta"]["wall_s"] = time.monotonic() - started
    write(results, args.out)
    print("\n" + "\n\n".join(tables(results)), flush=True)
    return results


if __name__ == "__main__":
    main()
