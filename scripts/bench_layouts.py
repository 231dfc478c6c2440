#!/usr/bin/env python3
"""Weight-layout benchmark: every layout `fused_experts` accepts against the reference layout, stage by stage.

One set of expert values, laid out four ways, each tensor contiguous in its own layout (as a checkpoint stores it):

  layout       w_gate_up    w_down      along 2F (and gate_up_bias)   fused_experts flags
  reference    [E, 2F, H]   [E, H, F]   gate rows, then up rows       -
  gpt-oss      [E, H, 2F]   [E, F, H]   gate and up alternate, gate   transposed=True, interleaved=True
                                        at even (GPT-OSS as stored in transformers)
  transposed   [E, H, 2F]   [E, F, H]   gate, then up                 transposed=True
  interleaved  [E, 2F, H]   [E, H, F]   gate and up alternate         interleaved=True

GPT-OSS models run every layout with GPT-OSS's activation and biases (activation "swiglu_oai", gate_up_bias [E, 2F]
laid like the 2F axis, down_bias [E, H]), so that the layout is the only difference; other models of
benchmarks/model_shapes.py (--models) run "silu" without biases.

Per model and token count T (random routing, top_k distinct experts per token, fp32 routing weights), two modes:

  inference  out = fused_experts(...) under torch.no_grad (T * top_k <= 256 takes the decode path)
  training   torch.autograd.grad(out, [x, w_gate_up, w_down, topk_weights, biases], grad_out), grad_out random

Stages: GPU time per call of each stage, from torch.profiler (CUDA activity, --profile-iters calls after the warm-up),
kernel names mapped to stages by `STAGE_RULES` (substrings, first match wins):

  gate_up            GEMM1: _decode_gate_up_kernel, or the first forward GEMM launch of a call
                     (_grouped_gemm_kernel / _persistent_grouped_gemm_kernel, the gate/up activation in its epilogue)
  down               GEMM2: _decode_down_kernel / _decode_down_dot_kernel, or the second forward GEMM launch
  down_grad (dA)     _down_grad_kernel
  gate_up_grad (dX)  _gate_up_grad_kernel
  weight_grad (dW)   _expert_weight_grad_kernel / _persistent_weight_grad_kernel
  topk_weights_grad  _topk_weights_grad_kernel
  other              dispatch, combine, gather, torch's fills and copies; and any kernel no rule knows, whose names
                     are listed in the JSON ("unmapped_kernels") so a renamed kernel shows up instead of hiding
  kernel_sum         all of them (the call's kernel time without the gaps between launches)

The two forward GEMMs share kernel names, so a GEMM-named launch (no "grad" in its name) is GEMM1 or GEMM2 by its
position among a call's GEMM launches; where a call does not launch exactly two, they are reported together as
"forward GEMM (unsplit)".

Whole call: median ms of the call (triton.testing.do_bench, the L2 cache cleared before every call), --rounds rounds
in which the layouts take turns in a rotating order, so that clock drift under the power cap hits every layout alike;
the figure is the median over rounds. transformers' GPT-OSS experts (`GptOssExperts` with experts_implementation
"grouped_mm", the default transformers picks; on the gpt-oss tensors) run as a peer row of the whole-call table,
where transformers imports (skipped with the reason printed otherwise).

Correctness per cell: each layout's forward output against the reference layout's and each layout's gradients (mapped
back to the reference layout) against the reference layout's, norm-wise relative difference (the same values, so
they agree to rounding), held to reference.TOLERANCE of the dtype; the reference layout's output against the float64
experts (moe_dispatch.reference) on a row sample (--check-rows); transformers' output is reported beside them.

Writes OUT/layouts.json (everything, with device, versions, commit and arguments) and OUT/layouts.md, prints the stage
table, then the short whole-call table last.

    scripts/bench_layouts --out results/layouts                         # gpt-oss-120b and -20b, T = 1 .. 16384
    scripts/bench_layouts --models gpt-oss-20b,mixtral-8x7b --tokens 1,4096 --out layouts-out
    scripts/bench_layouts --smoke --out layouts-smoke                   # the plumbing on the CPU (interpreter)
"""

import argparse
import dataclasses
import datetime
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

import harness  # first (scripts/harness.py): without a GPU it turns on Triton's interpreter before triton imports
import triton  # noqa: E402  (after harness)
from harness import fmt
from model_shapes import MODEL_SHAPES, ModelShape
from moe_dispatch import reference

import moe_dispatch as md

TOKENS = (1, 16, 128, 1024, 4096, 16384)
SMOKE_TOKENS = (1, 40)
DEFAULT_MODELS = ("gpt-oss-120b", "gpt-oss-20b")
# GPT-OSS-20B where benchmarks/model_shapes.py lacks it: 32 experts, else GPT-OSS-120B's widths (H = F = 2880, top_k 4)
GPT_OSS_20B = dataclasses.replace(MODEL_SHAPES["gpt-oss-120b"], name="gpt-oss-20b", num_experts=32)
SHAPES = {"gpt-oss-20b": GPT_OSS_20B, **MODEL_SHAPES}  # MODEL_SHAPES' own entries win
# --smoke: interpreter-sized, top_k 2 of 4 experts so that routing still chooses
SMOKE_SIZES = dict(num_experts=4, top_k=2, hidden=64, ffn=32)
SWIGLU_ALPHA, SWIGLU_LIMIT = harness.SWIGLU_ALPHA, harness.SWIGLU_LIMIT
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MODES = ("inference", "training")
PEER = "transformers_grouped_mm"


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    transposed: bool  # w_gate_up [E, H, 2F], w_down [E, F, H]
    interleaved: bool  # gate and up alternate along 2F, gate at even


LAYOUTS = (Layout("reference", False, False), Layout("gpt-oss", True, True), Layout("transposed", True, False),
           Layout("interleaved", False, True))
BASE = LAYOUTS[0].name


# Kernel name -> stage.

GATE_UP, DOWN, OTHER, KERNEL_SUM = "gate_up", "down", "other", "kernel_sum"
FORWARD_GEMM = "forward GEMM"  # GEMM1 or GEMM2 by launch position (split_forward_gemms)
UNSPLIT = "forward GEMM (unsplit)"
# (substrings the lower-cased kernel name must all hold, stage); first match wins. The "grad" rules come first so that
# no backward kernel, whatever else its name says ("gemm", "down"), counts as a forward GEMM; "weight" + "grad" before
# "down"/"gate_up" + "grad" so that a per-projection weight-gradient variant stays dW; stage None: "other", unmapped.
STAGE_RULES = (
    (("topk", "grad"), "topk_weights_grad"),
    (("weight", "grad"), "weight_grad (dW)"),
    (("down", "grad"), "down_grad (dA)"),
    (("gate_up", "grad"), "gate_up_grad (dX)"),
    (("grad",), None),
    (("decode", "gate_up"), GATE_UP),
    (("decode", "down"), DOWN),
    (("gemm",), FORWARD_GEMM),
)
# Kernels that are "other" by design, not listed as unmapped: the package's routing metadata and row copies, and
# torch's own kernels (fills, copies, the scans and clamps of the backward's bookkeeping).
KNOWN_OTHER = ("dispatch", "histogram", "prefix", "assign_positions", "tile_map", "combine", "gather", "scatter",
               "buffer_rows", "memset", "memcpy", "at::native")
STAGES = {
    "inference": (GATE_UP, DOWN, OTHER, KERNEL_SUM),
    "training": (GATE_UP, DOWN, "down_grad (dA)", "gate_up_grad (dX)", "weight_grad (dW)", "topk_weights_grad", OTHER,
                 KERNEL_SUM),
}


def stage_of(name):
    """(stage, known) of one kernel name: the first STAGE_RULES match; else "other", known if KNOWN_OTHER says so."""
    lower = name.lower()
    for parts, stage in STAGE_RULES:
        if all(part in lower for part in parts):
            return (stage, True) if stage is not None else (OTHER, False)
    return OTHER, any(part in lower for part in KNOWN_OTHER)


def assign_stages(kernels, calls):
    """Kernels of `calls` identical calls, [(name, us)] in launch order -> (stages {stage: us per call},
    per_kernel {name: {"stage", "us", "launches"} per call}, unmapped [names]).

    Forward-GEMM launches (one kernel name for both GEMMs) alternate GEMM1, GEMM2 within each call when a call makes
    exactly two; otherwise they are summed as UNSPLIT."""
    gemm_launches = sum(stage_of(name)[0] == FORWARD_GEMM for name, _ in kernels)
    split = calls > 0 and gemm_launches == 2 * calls
    stages, per_kernel, unmapped = {}, {}, set()
    gemm_index = 0
    for name, us in kernels:
        stage, known = stage_of(name)
        if stage == FORWARD_GEMM:
            stage = (GATE_UP, DOWN)[gemm_index % 2] if split else UNSPLIT
            gemm_index += 1
        if not known:
            unmapped.add(name)
        stages[stage] = stages.get(stage, 0.0) + us / calls
        entry = per_kernel.setdefault(f"{name} [{stage}]", {"name": name, "stage": stage, "us": 0.0, "launches": 0})
        entry["us"] += us / calls
        entry["launches"] += 1 / calls
    if kernels:
        stages[KERNEL_SUM] = sum(us for _, us in kernels) / calls
    return stages, per_kernel, sorted(unmapped)


def profile_stages(fn, calls, device):
    """assign_stages of `calls` calls of fn (already warmed up) under torch.profiler. Without a GPU the profiler runs
    (CPU activity) but sees no device kernels: empty stages."""
    activity = torch.profiler.ProfilerActivity.CUDA if device.type == "cuda" else torch.profiler.ProfilerActivity.CPU
    synchronize(device)
    with warnings.catch_warnings():  # "Profiler clears events at the end of each cycle": one cycle here
        warnings.filterwarnings("ignore", message=".*clears events.*")
        with torch.profiler.profile(activities=[activity]) as prof:
            for _ in range(calls):
                fn()
            synchronize(device)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.time_range.start)
    return assign_stages([(e.name, e.time_range.elapsed_us()) for e in events], calls)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Layouts of one set of values.


def lay_out(layout, w_gate_up, w_down, gate_up_bias):
    """Reference-layout values (w_gate_up [E, 2F, H] gate rows then up rows, w_down [E, H, F], gate_up_bias [E, 2F])
    -> the same values in `layout`, each tensor contiguous in its own layout."""
    E, two_f, H = w_gate_up.shape
    F = two_f // 2
    if layout.interleaved:  # row 2j + s of the 2F axis <- row s * F + j
        w_gate_up = w_gate_up.view(E, 2, F, H).permute(0, 2, 1, 3).reshape(E, two_f, H)
        if gate_up_bias is not None:
            gate_up_bias = gate_up_bias.view(E, 2, F).permute(0, 2, 1).reshape(E, two_f)
    if layout.transposed:
        w_gate_up, w_down = w_gate_up.permute(0, 2, 1), w_down.permute(0, 2, 1)
    return (w_gate_up.contiguous(), w_down.contiguous(),
            gate_up_bias.contiguous() if gate_up_bias is not None else None)


def to_reference(layout, name, grad):
    """A gradient in `layout` -> the reference layout (a view where one does; `name` says which input it is of)."""
    if name == "w_down" and layout.transposed:
        return grad.transpose(1, 2)
    if name not in ("w_gate_up", "gate_up_bias"):
        return grad
    if name == "w_gate_up" and layout.transposed:
        grad = grad.transpose(1, 2)  # [E, 2F, H]
    if layout.interleaved:  # row s * F + j <- row 2j + s
        F = grad.shape[1] // 2
        grad = grad.unflatten(1, (F, 2)).transpose(1, 2).flatten(1, 2)
    return grad


def rel_diff(a, b):
    """||a - b|| / ||b|| in float64, accumulated over the leading dimension (no float copy of a whole weight);
    NaN when a is not finite."""
    num = den = 0.0
    for a_part, b_part in zip(a.detach().split(1), b.detach().split(1)):
        a_part, b_part = a_part.double(), b_part.double()
        if not torch.isfinite(a_part).all():
            return float("nan")
        num += (a_part - b_part).square().sum().item()
        den += b_part.square().sum().item()
    return (num / max(den, 1e-300)) ** 0.5


# The model's experts.


@dataclasses.dataclass
class Experts:
    """One model's expert values in every layout, and how they run."""

    shape: ModelShape
    activation: str
    laid: dict  # layout name -> (w_gate_up, w_down, gate_up_bias); down_bias is shared
    down_bias: torch.Tensor | None

    def grad_names(self):
        names = ["x", "w_gate_up", "w_down", "topk_weights"]
        return names + (["gate_up_bias", "down_bias"] if self.down_bias is not None else [])


def make_experts(shape, dtype, device, seed, gpt_oss):
    """Reference values (x-independent): weights and biases randn * 0.02, seeded; every layout made from them."""
    gen = torch.Generator(device=device).manual_seed(seed)
    E, H, F = shape.num_experts, shape.hidden, shape.ffn

    def randn(*size):
        return torch.empty(size, device=device, dtype=dtype).normal_(0.0, 0.02, generator=gen)

    w_gate_up, w_down = randn(E, 2 * F, H), randn(E, H, F)
    gate_up_bias, down_bias = (randn(E, 2 * F), randn(E, H)) if gpt_oss else (None, None)
    laid = {}
    with torch.no_grad():
        for layout in LAYOUTS:
            tensors = lay_out(layout, w_gate_up, w_down, gate_up_bias)
            laid[layout.name] = tuple(t.requires_grad_() if t is not None else None for t in tensors)
    if down_bias is not None:
        down_bias.requires_grad_()
    return Experts(shape, "swiglu_oai" if gpt_oss else "silu", laid, down_bias)


def layout_forward(experts, layout, x, topk_ids, topk_weights):
    w_gate_up, w_down, gate_up_bias = experts.laid[layout.name]

    def forward():
        return md.fused_experts(x, w_gate_up, w_down, topk_ids, topk_weights, activation=experts.activation,
                                interleaved=layout.interleaved, transposed=layout.transposed,
                                gate_up_bias=gate_up_bias, down_bias=experts.down_bias, swiglu_alpha=SWIGLU_ALPHA,
                                swiglu_limit=SWIGLU_LIMIT)

    inputs = [x, w_gate_up, w_down, topk_weights]
    if experts.down_bias is not None:
        inputs += [gate_up_bias, experts.down_bias]
    return forward, inputs


def transformers_peer(experts):
    """(module, None) or (None, reason): transformers' GptOssExperts of the model's sizes, experts_implementation
    "grouped_mm" (what transformers picks by default), on the gpt-oss layout's tensors (shared storage)."""
    if experts.activation != "swiglu_oai":
        return None, "transformers' GPT-OSS experts are the peer of GPT-OSS models only"
    try:
        import transformers
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        shape = experts.shape
        config = transformers.GptOssConfig(hidden_size=shape.hidden, intermediate_size=shape.ffn,
                                           num_local_experts=shape.num_experts, num_experts_per_tok=shape.top_k,
                                           swiglu_alpha=SWIGLU_ALPHA, swiglu_limit=SWIGLU_LIMIT,
                                           experts_implementation="grouped_mm")
        with torch.device("meta"):
            module = GptOssExperts(config)
        w_gate_up, w_down, gate_up_bias = experts.laid["gpt-oss"]
        module.gate_up_proj = torch.nn.Parameter(w_gate_up.detach())
        module.gate_up_proj_bias = torch.nn.Parameter(gate_up_bias.detach())
        module.down_proj = torch.nn.Parameter(w_down.detach())
        module.down_proj_bias = torch.nn.Parameter(experts.down_bias.detach())
        if config._experts_implementation != "grouped_mm":
            return None, f"transformers set experts_implementation {config._experts_implementation!r}"
        return module, None
    except Exception as exc:  # noqa: BLE001 (an older or newer transformers: the peer is skipped, the reason kept)
        return None, harness.error_text(exc)


def peer_fns(module, x, topk_ids, topk_weights, grad_out):
    def forward():
        return module(x, topk_ids, topk_weights)

    params = [x, module.gate_up_proj, module.down_proj, topk_weights, module.gate_up_proj_bias,
              module.down_proj_bias]
    return {"inference": no_grad(forward), "training": lambda: torch.autograd.grad(forward(), params, grad_out)}


def no_grad(fn):
    def call():
        with torch.no_grad():
            return fn()

    return call


# One cell.


def run_cell(args, experts, T, device, timer, peer):
    """Every layout (and the peer) at T tokens, both modes -> the cell's record."""
    shape = experts.shape
    gen = torch.Generator(device=device).manual_seed(args.seed + T)
    dtype = DTYPES[args.dtype]
    x = torch.empty(T, shape.hidden, device=device, dtype=dtype).normal_(generator=gen).requires_grad_()
    topk_ids, topk_weights = harness.random_routing(T, shape.num_experts, shape.top_k, device, args.seed + 1 + T)
    topk_weights.requires_grad_()
    grad_out = torch.empty(T, shape.hidden, device=device, dtype=dtype).normal_(generator=gen)
    tolerance = reference.TOLERANCE[dtype]
    cell = dict(model=shape.name, T=T, E=shape.num_experts, top_k=shape.top_k, H=shape.hidden, F=shape.ffn,
                activation=experts.activation, biases=experts.down_bias is not None, tolerance=tolerance,
                errors={}, modes={})
    check = cell["check"] = dict(forward_rel_diff={}, grad_rel_diff={})

    fns = {mode: {} for mode in MODES}
    for layout in LAYOUTS:
        forward, inputs = layout_forward(experts, layout, x, topk_ids, topk_weights)
        fns["inference"][layout.name] = no_grad(forward)
        fns["training"][layout.name] = (lambda forward=forward, inputs=inputs:
                                        torch.autograd.grad(forward(), inputs, grad_out))
    if peer is not None:
        for mode, fn in peer_fns(peer, x, topk_ids, topk_weights, grad_out).items():
            fns[mode][PEER] = fn

    for mode in MODES:
        record = cell["modes"][mode] = dict(stages={}, kernels={}, whole_ms={})
        base_result = None
        for name, fn in list(fns[mode].items()):
            try:
                result = fn()  # compile, plan and warm up outside the timing; its result is checked
                synchronize(device)
            except Exception as exc:  # noqa: BLE001 (a layout that cannot run this cell is reported, the rest go on)
                cell["errors"][f"{mode}/{name}"] = harness.error_text(exc)
                del fns[mode][name]
                harness.free_memory(device)
                continue
            if name == BASE:
                base_result = result
                if mode == "inference":
                    check["reference_vs_float64"] = float64_check(args, experts, x, topk_ids, topk_weights, result)
            elif base_result is not None:
                compare(check, mode, name, result, base_result, experts)
            del result
            if name == PEER:
                continue  # the peer is timed as a whole call only
            for _ in range(args.warmup_calls):
                fn()
            stages, per_kernel, unmapped = profile_stages(fn, args.profile_iters, device)
            record["stages"][name] = stages
            record["kernels"][name] = per_kernel
            record.setdefault("unmapped_kernels", set()).update(unmapped)
        del base_result
        record["unmapped_kernels"] = sorted(record.get("unmapped_kernels", ()))
        record["whole_ms"] = whole_call_times(fns[mode], timer, args.rounds)
        record["whole_ratio"] = ratios(record["whole_ms"])
        record["stage_ratio"] = stage_ratios(record["stages"])
        harness.free_memory(device)

    judge(cell, tolerance)
    return cell


def float64_check(args, experts, x, topk_ids, topk_weights, out):
    """The reference layout's output against the float64 experts on a row sample."""
    rows = harness.check_rows(x.shape[0], args.check_rows, x.device, args.seed)
    w_gate_up, w_down, gate_up_bias = experts.laid[BASE]
    ref = reference.fused_experts_ref(x[rows], w_gate_up, w_down, topk_ids[rows], topk_weights[rows],
                                      activation=experts.activation, gate_up_bias=gate_up_bias,
                                      down_bias=experts.down_bias, swiglu_alpha=SWIGLU_ALPHA,
                                      swiglu_limit=SWIGLU_LIMIT)
    return reference.relative_error(out[rows], ref)


def compare(check, mode, name, result, base_result, experts):
    """A layout's (or the peer's) forward output or gradients against the reference layout's."""
    if mode == "inference":
        if name == PEER:
            check["peer_forward_rel_diff"] = rel_diff(result, base_result)
        else:
            check["forward_rel_diff"][name] = rel_diff(result, base_result)
        return
    names = experts.grad_names()
    if name == PEER:  # the peer's order: x, gate_up_proj, down_proj, topk_weights, biases, in the gpt-oss layout
        layout = next(layout for layout in LAYOUTS if layout.name == "gpt-oss")
        check["peer_grad_rel_diff"] = {n: rel_diff(to_reference(layout, n, g), b)
                                       for n, g, b in zip(names, result, base_result)}
        return
    layout = next(layout for layout in LAYOUTS if layout.name == name)
    check["grad_rel_diff"][name] = {n: rel_diff(to_reference(layout, n, g), b)
                                    for n, g, b in zip(names, result, base_result)}


def judge(cell, tolerance):
    """cell["check"]["ok"]: every layout ran both modes, agrees with the reference layout within `tolerance` (output
    and every gradient), and the reference layout agrees with the float64 experts."""
    check = cell["check"]
    diffs = list(check["forward_rel_diff"].values())
    diffs += [d for grads in check["grad_rel_diff"].values() for d in grads.values()]
    diffs.append(check.get("reference_vs_float64", float("nan")))
    ran = all(layout.name in cell["modes"][mode]["whole_ms"] for mode in MODES for layout in LAYOUTS)
    compared = len(check["forward_rel_diff"]) == len(check["grad_rel_diff"]) == len(LAYOUTS) - 1
    check["max_layout_rel_diff"] = max(diffs[:-1], default=float("nan"))
    check["ok"] = ran and compared and all(d <= tolerance for d in diffs)  # NaN fails


def whole_call_times(fns, timer, rounds):
    """{name: median over rounds of the call's time in ms}; in round r the names run in an order rotated by r, so
    that no name always follows the same one and drift spreads over all of them."""
    names = list(fns)
    times = {name: [] for name in names}
    for r in range(rounds):
        shift = r % max(len(names), 1)
        for name in names[shift:] + names[:shift]:
            times[name].append(timer.plain(fns[name]))
    return {name: statistics.median(series) for name, series in times.items() if series}


def ratios(times, base=BASE):
    """{name: times[name] / times[base]} where both are known."""
    b = times.get(base)
    return {name: t / b for name, t in times.items() if t is not None and b} if b else {}


def stage_ratios(stages):
    """{stage: {layout: layout us / reference us}} for the stages the reference layout has."""
    base = stages.get(BASE, {})
    return {stage: {name: s[stage] / us for name, s in stages.items() if name != BASE and stage in s}
            for stage, us in base.items() if us > 0}


# Arguments, metadata and outputs.


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="bench-layouts-results", help="output folder (created)")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help=f"comma list of {', '.join(SHAPES)} (default: {','.join(DEFAULT_MODELS)})")
    p.add_argument("--tokens", default=None, help=f"comma list of T (default {','.join(map(str, TOKENS))}; "
                                                  f"--smoke: {','.join(map(str, SMOKE_TOKENS))})")
    p.add_argument("--dtype", default=None, choices=tuple(DTYPES),
                   help="default bfloat16 on a GPU, float32 on the CPU (the interpreter)")
    p.add_argument("--profile-iters", type=int, default=None, help="profiled calls per layout and mode (default 10)")
    p.add_argument("--warmup-calls", type=int, default=None, help="calls before profiling (default 3)")
    p.add_argument("--rounds", type=int, default=None, help="whole-call timing rounds (default 5)")
    p.add_argument("--warmup-ms", type=float, default=10.0, help="do_bench warm-up per round and call")
    p.add_argument("--rep-ms", type=float, default=50.0, help="do_bench measuring time per round and call")
    p.add_argument("--check-rows", type=int, default=64, help="rows checked against the float64 experts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-peer", action="store_true", help="skip transformers' GPT-OSS experts")
    p.add_argument("--smoke", "--cpu-smoke", dest="smoke", action="store_true",
                   help="plumbing run: tiny shapes (E 4, top_k 2, H 64, F 32), T = 1, 40, one call each; on the CPU\n"
                        "through Triton's interpreter (no device kernels: the stage tables stay empty)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu" and not args.smoke:
        p.error("no CUDA device: pass --smoke for a plumbing run on the CPU")
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    args.tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else (
        SMOKE_TOKENS if args.smoke else TOKENS)
    args.models = tuple(args.models.split(","))
    unknown = [m for m in args.models if m not in SHAPES]
    if unknown:
        p.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    for name, full, smoke in (("profile_iters", 10, 1), ("warmup_calls", 3, 0), ("rounds", 5, 1)):
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    return args


def git_commit():
    """`git rev-parse HEAD` of the checkout (MOE_DISPATCH_COMMIT where there is no .git), or None."""
    if os.environ.get("MOE_DISPATCH_COMMIT"):
        return os.environ["MOE_DISPATCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=harness.ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001 (no git: the commit is optional)
        return None


def meta(args, device, peer_note):
    try:
        import transformers

        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    return dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        torch=torch.__version__, triton=triton.__version__, transformers=transformers_version,
        moe_dispatch=getattr(md, "__version__", None), git_commit=git_commit(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        args={k: harness.portable_path(v) if k == "out" else v for k, v in vars(args).items() if k != "argv"},
        argv=[harness.portable_path(a) for a in args.argv], peer=peer_note,
        layouts=[dataclasses.asdict(layout) for layout in LAYOUTS],
        stage_rules=[{"all_of": list(parts), "stage": stage or f"{OTHER} (unmapped)"} for parts, stage in STAGE_RULES],
        known_other=list(KNOWN_OTHER),
    )


def stage_table(results):
    """Markdown: per model, T, mode and stage, the reference layout's us and each layout's (ratio to reference)."""
    others = [layout.name for layout in LAYOUTS[1:]]
    lines = ["| model | T | mode | stage | reference us | " + " | ".join(f"{n} us (x ref)" for n in others) + " |",
             "|" + "---|" * (5 + len(others))]
    for cell in results["cells"]:
        for mode in MODES:
            stages = cell["modes"][mode]["stages"]
            names = list(STAGES[mode]) + [s for s in stages.get(BASE, {}) if s not in STAGES[mode]]
            for stage in names:
                base = stages.get(BASE, {}).get(stage)
                row = [cell["model"], str(cell["T"]), mode, stage, fmt(base)]
                if base is None and not any(stage in stages.get(n, {}) for n in others):
                    continue
                for name in others:
                    us = stages.get(name, {}).get(stage)
                    ratio = us / base if us is not None and base else None
                    row.append(f"{fmt(us)} ({fmt(ratio, '.2f')})")
                lines.append("| " + " | ".join(row) + " |")
    if len(lines) == 2:
        lines.append("| (no device kernels seen: a CPU run) |" + " |" * (4 + len(others)))
    return "\n".join(lines) + "\n"


def whole_table(results):
    """Markdown: per model, T and mode, the whole call's ms per layout (ratio to reference) and the check."""
    others = [layout.name for layout in LAYOUTS[1:]] + [PEER]
    lines = ["| model | T | mode | reference ms | " + " | ".join(f"{n} ms (x ref)" for n in others)
             + " | max layout rel diff | check |", "|" + "---|" * (6 + len(others))]
    for cell in results["cells"]:
        check = cell["check"]
        for mode in MODES:
            whole = cell["modes"][mode]["whole_ms"]
            row = [cell["model"], str(cell["T"]), mode, fmt(whole.get(BASE), ".3f")]
            for name in others:
                ms, ratio = whole.get(name), cell["modes"][mode]["whole_ratio"].get(name)
                row.append(f"{fmt(ms, '.3f')} ({fmt(ratio, '.2f')})" if ms is not None else "-")
            row += [fmt(check["max_layout_rel_diff"], ".1e"), "ok" if check["ok"] else "FAIL"]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def markdown(results, path):
    m = results["meta"]
    head = (f"# fused_experts weight layouts: {m['device']}, {m['args']['dtype']}\n\n"
            f"commit {m['git_commit']}, torch {m['torch']}, triton {m['triton']}, transformers {m['transformers']}; "
            f"transformers' GPT-OSS experts: {'; '.join(f'{k} {v}' for k, v in m['peer'].items())}\n")
    unmapped = results["unmapped_kernels"]
    text = (head + "\n## Stages (GPU us per call, torch.profiler; x ref = layout / reference)\n\n"
            + stage_table(results)
            + (f"\nKernels no stage rule knows (counted in other): {', '.join(unmapped)}\n" if unmapped else "")
            + "\n## Whole call (ms, median of rounds; x ref = layout / reference)\n\n" + whole_table(results))
    path.write_text(text)
    return text


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    timer = harness.WallTimer(repeats=1) if device.type != "cuda" else harness.EventTimer(args.warmup_ms, args.rep_ms)
    started = time.monotonic()
    results = dict(meta=None, cells=[], unmapped_kernels=[])
    peer_notes = {}
    out = Path(args.out)
    for model_index, name in enumerate(args.models):
        shape = SHAPES[name]
        if args.smoke:
            shape = dataclasses.replace(shape, **SMOKE_SIZES)
        gpt_oss = name.startswith("gpt-oss")
        experts = make_experts(shape, dtype, device, args.seed + 1000 * model_index, gpt_oss)
        peer, reason = (None, "--no-peer") if args.no_peer else transformers_peer(experts)
        peer_notes[name] = "experts_implementation grouped_mm" if peer is not None else f"skipped: {reason}"
        if peer is None and gpt_oss:
            print(f"{name}: transformers' GPT-OSS experts skipped: {reason}", file=sys.stderr, flush=True)
        for T in args.tokens:
            cell = run_cell(args, experts, T, device, timer, peer)
            results["cells"].append(cell)
            print(progress_line(cell, time.monotonic() - started), file=sys.stderr, flush=True)
        del experts, peer
        harness.free_memory(device)
        results["meta"] = meta(args, device, peer_notes)
        results["unmapped_kernels"] = sorted({k for c in results["cells"] for m in MODES
                                              for k in c["modes"][m]["unmapped_kernels"]})
        harness.write_results(results, out, "layouts", markdown)  # after every model: a cut run keeps what it has
    if results["unmapped_kernels"]:
        print(f"kernels no stage rule knows (counted in other): {', '.join(results['unmapped_kernels'])}", flush=True)
    print(stage_table(results), flush=True)
    print(whole_table(results), flush=True)
    return results


def progress_line(cell, elapsed):
    worst = {mode: max((r for name, r in cell["modes"][mode]["whole_ratio"].items() if name != PEER),
                       default=float("nan")) for mode in MODES}
    status = "ok" if cell["check"]["ok"] else f"CHECK FAILED {cell['check']} {cell['errors']}"
    return (f"{cell['model']} T={cell['T']}: worst layout / reference inference {worst['inference']:.2f}, "
            f"training {worst['training']:.2f}; {status} ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
