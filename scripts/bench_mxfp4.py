#!/usr/bin/env python3
"""MXFP4 experts benchmark: moe_dispatch on GPT-OSS's MXFP4 expert weights beside its bf16 path on the same values,
transformers' dequantized experts and the Hub's MXFP4 kernels, all measured in one run.

Per model (GPT-OSS-120B: E 128, GPT-OSS-20B: E 32; both top-4, H = F = 2880) and token count T, one layer's routed
experts with random MXFP4 weights built directly (uniformly random e2m1 bytes, e8m0 scale codes 119-121, so weights
are ~0.023 RMS; never a whole model), bf16 biases randn * 0.02, x randn, and GPT-OSS's routing on random logits
(top-4 of the logits, softmax over the four kept, fp32):

  mxfp4          moe_dispatch.fused_experts on the MXFP4 blocks uint8 [E, 2F, H/32, 16] (gate/up rows interleaved) and
                 [E, H, F/32, 16], e8m0 scales uint8, activation "swiglu_oai", interleaved=True, both biases
  bf16           moe_dispatch.fused_experts on the same values dequantized to bf16 (dequantize_experts_mxfp4:
                 [E, 2F, H] and [E, H, F], exact), same flags and biases: what Mxfp4Config(dequantize=True) plus the
                 package's experts give a user
  hf_grouped_mm  transformers' GptOssExperts, experts_implementation "grouped_mm" (bench_layouts.transformers_peer), on
                 the dequantized values laid out as transformers stores them ([E, H, 2F] interleaved, [E, F, H]; copied
                 once, outside the timing); skipped with the reason where transformers does not import
  tk_matmul_ogs  kernels-community/gpt-oss-triton-kernels (OpenAI's triton_kernels): routing(logits, 4) + the two
                 matmul_ogs calls (fused swiglu; bias fp32; gammas on the down GEMM) exactly as transformers'
                 Mxfp4GptOssMLP runs them after its router linear, on our blocks and scales converted once the way
                 transformers' swizzle_mxfp4_convertops does (the bytes transposed and swizzled into the arch's value
                 layout, HopperMXValueLayout on an H200; scales strided): the same values. Its timed call includes the
                 top-k and softmax of the logits (the package's calls take the chosen ids)
  fg_mxfp4       kernels-community/finegrained-fp8's fused MXFP4 MoE (moe_fused_batched for T <= 16, moe_fused_grouped
                 above; W4A8: activations and the intermediate quantized to MXFP8 in the kernels), GPT-OSS's clamped
                 SwiGLU (swiglu_alpha, swiglu_limit), gate/up rows de-interleaved into its concatenated layout (bytes
                 and scales reordered: the same values). Its fused MoE takes no biases: it runs without them, its
                 error is taken against the float64 experts without biases and held to W8A8_TOLERANCE. Its Bayesian
                 autotuner is capped (--fg-trials, refinement off unless --fg-refine) and kept to the tiles that
                 divide H and F (its kernels mask neither N nor K; --fg-all-configs lifts that)

The two Hub peers load as users load kernels, with `kernels.get_kernel(repo_id, version=N)` (the versions transformers
asks for): from the Hub or its cache by default, or, with --hub-dir DIR, from DIR/<repository name> through
LOCAL_KERNELS (no network). Such a folder is either the kernel repository as the Hub serves it (build/torch-<backend>/
with metadata.json; `hf download kernels-community/gpt-oss-triton-kernels --repo-type kernel --revision v1 --local-dir
DIR/gpt-oss-triton-kernels`) or its source (build.toml, torch-ext/<package>/), served as a local build first
(generate_e2e.serve_kernel_source). Any failure to find, load, convert, compile or run one is recorded as its row's
"skipped: reason" or "error" and the benchmark goes on. --no-hub leaves them out.

Timing (a GPU): every implementation that ran is captured as a CUDA graph and the graphs are replayed alternately
(harness.paired_graph_times: --pairs pairs, the order reversed every other pair): `us` is the median of one-call
replays after an L2 flush (weights come from HBM), `hot_us` the per-call median of a graph of --hot-calls calls (no
flush). An implementation whose call cannot be captured is timed with triton.testing.do_bench instead (L2 flushed,
plain launches; time_mode "plain"). MXFP4 / bf16 is the median over pairs of the per-pair ratio. On the CPU
(--cpu-smoke) the calls are timed by the wall clock, alternated the same way.

Correctness per implementation, on a row sample (all rows up to --check-rows, that many seeded rows above): relative
Frobenius error ||out - ref|| / ||ref|| against float64 experts on the float64 dequantized weights
(reference.dequantize_mxfp4_ref, a few experts at a time; reference.fused_experts_ref), held to the bf16 tolerance
(reference.TOLERANCE) except fg_mxfp4 (W8A8_TOLERANCE).

Targets, per cell (R, the read bandwidth, and P, the bf16 matmul rate, measured at the start of the same run):
  decode, T <= 16      mxfp4 us <= floor_us = 1.15 x (MXFP4 bytes + scale bytes of the experts hit) / R + 10 us
  prefill, T >= 1024   mxfp4 / bf16 <= 1.1

Writes OUT/mxfp4.json and OUT/mxfp4.md after every model (a run cut short keeps what it measured) and prints the short
Markdown table last. --budget-s stops starting new cells (they are listed as skipped).

    scripts/bench_mxfp4 --out results/mxfp4 --hub-dir DIR    # both models, T = 1 .. 16384, the Hub peers from DIR
    scripts/bench_mxfp4 --models gpt-oss-20b --tokens 1,4096 --no-hub --out mxfp4-out
    scripts/bench_mxfp4 --cpu-smoke --out mxfp4-smoke                  # the plumbing on the CPU (interpreter)
"""

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import harness  # first (scripts/harness.py): without a GPU it turns on Triton's interpreter before triton imports
import bench_layouts  # noqa: E402  (transformers' GPT-OSS experts as a peer, GPT-OSS's SwiGLU constants)
from generate_e2e import serve_kernel_source  # noqa: E402  (benchmarks/: a Hub kernel's source as a local build)
from harness import fmt  # noqa: E402
from model_shapes import MODEL_SHAPES  # noqa: E402
from moe_dispatch import reference  # noqa: E402

MODELS = ("gpt-oss-120b", "gpt-oss-20b")
TOKENS = (1, 2, 4, 8, 16, 128, 1024, 4096, 16384)
SMOKE_TOKENS = (1, 5)
SMOKE_SIZES = bench_layouts.SMOKE_SIZES  # E 4, top_k 2, H 64, F 32: multiples of the 32 values of an e8m0 scale
IMPLS = ("mxfp4", "bf16", "mxfp4_portable", "hf_grouped_mm", "tk_matmul_ogs", "fg_mxfp4")


@dataclasses.dataclass(frozen=True)
class HubPeer:
    """A Hub kernel timed beside the package, and how to find it."""

    repo_id: str  # its Hub repository
    version: int  # what get_kernel loads: the version transformers asks for
    package: str  # its package folder in a source tree, torch-ext/<package>

    @property
    def folder(self) -> str:
        """Its folder's name under --hub-dir: the repository's name."""
        return self.repo_id.split("/")[-1]


HUB_IMPLS = {"tk_matmul_ogs": HubPeer("kernels-community/gpt-oss-triton-kernels", 1, "gpt_oss_triton_kernels"),
             "fg_mxfp4": HubPeer("kernels-community/finegrained-fp8", 4, "finegrained_fp8")}
LABELS = {"mxfp4": "mxfp4", "bf16": "bf16", "mxfp4_portable": "mx portable", "hf_grouped_mm": "hf gmm", "tk_matmul_ogs": "tk ogs", "fg_mxfp4": "fg"}
DTYPE = torch.bfloat16
ALPHA, LIMIT = harness.SWIGLU_ALPHA, harness.SWIGLU_LIMIT
MXFP4_GROUP = harness.MXFP4_GROUP
DECODE_MAX_T = 16
PREFILL_MIN_T = 1024
READ_SLACK = 1.15
LAUNCH_ALLOWANCE_US = 10.0
PREFILL_MAX_RATIO = 1.1
TOLERANCE = reference.TOLERANCE[DTYPE]
FG_TOLERANCE = reference.W8A8_TOLERANCE


# --mxfp4-prefill: the values of MOE_DISPATCH_MXFP4_PREFILL (host/device.py), read by the package once per call
PREFILL_CHOICES = ("auto", "loads", "buffer")
GLUON_MXFP4_VARIABLE = "MOE_DISPATCH_GLUON_MXFP4"  # host/device.py's switch of the MXFP4 Gluon engine


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="bench-mxfp4-results", help="output folder (created)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)} (default both)")
    p.add_argument("--tokens", default=None, help=f"comma list of T (default {','.join(map(str, TOKENS))}; "
                                                  f"--cpu-smoke: {','.join(map(str, SMOKE_TOKENS))})")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {', '.join(IMPLS)} (default all)")
    p.add_argument("--hub-dir", default=None, metavar="DIR",
                   help="load the Hub peers from DIR/gpt-oss-triton-kernels and DIR/finegrained-fp8 (each the kernel\n"
                        "repository as the Hub serves it, or its source) through LOCAL_KERNELS; default: the Hub or\n"
                        "its cache, through kernels.get_kernel")
    p.add_argument("--no-hub", action="store_true", help="leave out the Hub peers (tk_matmul_ogs, fg_mxfp4)")
    p.add_argument("--fg-trials", type=int, default=8,
                   help="finegrained-fp8's autotune trials per key (FINEGRAINED_AUTOTUNE_TRIALS; its default is 60)")
    p.add_argument("--fg-refine", action="store_true", help="keep finegrained-fp8's coordinate-descent refinement")
    p.add_argument("--fg-all-configs", action="store_true",
                   help="let finegrained-fp8 autotune over all its tiles, also those that do not divide H and F\n"
                        "(its kernels mask neither N nor K: such tiles compute wrong values and store out of bounds)")
    p.add_argument("--pairs", type=int, default=None, help="paired replays per cell (default 10; --cpu-smoke 1)")
    p.add_argument("--hot-calls", type=int, default=10, help="calls in the hot graph")
    p.add_argument("--warmup-ms", type=float, default=3.0, help="do_bench warm-up (ceilings, plain timings)")
    p.add_argument("--rep-ms", type=float, default=10.0, help="do_bench window (ceilings, plain timings)")
    p.add_argument("--check-rows", type=int, default=64, help="rows checked against the float64 experts")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="start no new cell after this many seconds (0: no budget); the default keeps a full run\n"
                        "near 6 minutes on an H200")
    p.add_argument("--peer-warmup-s", type=float, default=75.0,
                   help="a peer whose first calls (compile, autotune) have taken this long in all is skipped in the\n"
                        "cells left (0: no limit)")
    p.add_argument("--ceiling-mib", type=int, default=None, help="read-bandwidth buffer (default 4096; 1 on the CPU)")
    p.add_argument("--matmul-size", type=int, default=None,
                   help="n of the n^3 matmul rate (default 8192; 64 on the CPU)")
    p.add_argument("--kernel-dir", default=None, help="load moe_dispatch from a build variant (see scripts/bench)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mxfp4-prefill", choices=PREFILL_CHOICES, default="auto",
                   help="auto: the planner decides when a call decodes the MXFP4 weights once into a float buffer\n"
                        "(gemm/mxfp4_dequant.py); loads: never (the weights decoded in the GEMMs' loads at every T);\n"
                        "buffer: every call without gradients (MOE_DISPATCH_MXFP4_PREFILL, set for this run)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="plumbing run: CPU, Triton's interpreter, tiny widths (E 4, top_k 2, H 64, F 32), T = 1, 5,\n"
                        "wall-clock timing; the Hub peers are found but not run (their kernels are GPU-only)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.device = "cpu" if args.cpu_smoke else "cuda"
    args.tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else (
        SMOKE_TOKENS if args.cpu_smoke else TOKENS)
    args.models = harness.comma_choices(p, "--models", args.models, MODELS)
    args.impls = harness.comma_choices(p, "--impls", args.impls, IMPLS)
    if "mxfp4" not in args.impls or "bf16" not in args.impls:
        p.error("--impls must keep mxfp4 and bf16 (the ratio and the targets are theirs)")
    if args.no_hub:
        args.impls = tuple(i for i in args.impls if i not in HUB_IMPLS)
    on_cpu = args.device == "cpu"
    args.pairs = args.pairs if args.pairs is not None else (1 if on_cpu else 10)
    args.ceiling_mib = args.ceiling_mib or (1 if on_cpu else 4096)
    args.matmul_size = args.matmul_size or (64 if on_cpu else 8192)
    return args


# --------------------------------------------------------------------------------------------------------------------
# the experts' weights and the float64 reference


def model_shape(name, smoke):
    shape = MODEL_SHAPES[name]
    return dataclasses.replace(shape, **SMOKE_SIZES) if smoke else shape


def mxfp4_bytes(shape, experts_hit):
    """MXFP4 weight bytes + e8m0 scale bytes of `experts_hit` experts (gate/up and down; no biases): what a decode
    step must read."""
    values = 3 * shape.hidden * shape.ffn
    return experts_hit * (values // 2 + values // MXFP4_GROUP)


# --------------------------------------------------------------------------------------------------------------------
# the implementations


@dataclasses.dataclass
class Inputs:
    T: int
    x: torch.Tensor  # [T, H] bf16
    logits: torch.Tensor  # [T, E] fp32
    ids: torch.Tensor  # [T, k] int64: the top-k of the logits
    weights: torch.Tensor  # [T, k] fp32: softmax over the k kept logits


def make_inputs(shape, T, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.empty(T, shape.hidden, device=device, dtype=DTYPE).normal_(0.0, 1.0, generator=gen)
    logits = torch.empty(T, shape.num_experts, device=device, dtype=torch.float32).normal_(0.0, 1.0, generator=gen)
    top, ids = logits.topk(shape.top_k, dim=-1)
    return Inputs(T, x, logits, ids, top.softmax(dim=-1))


@dataclasses.dataclass
class Impl:
    """One implementation of a model: `make(inputs)` -> a no-argument call, or a status saying why it does not run."""

    name: str
    status: str  # "ready", or "skipped: why"
    make: object = None
    biases: bool = True  # computes GPT-OSS's biases (its error is taken against the biased reference)
    tolerance: float = TOLERANCE
    note: str = ""


def package_impls(kernel, w):
    common = dict(activation="swiglu_oai", interleaved=True, gate_up_bias=w.gu_bias, down_bias=w.d_bias,
                  swiglu_alpha=ALPHA, swiglu_limit=LIMIT, validate=False)

    def mxfp4(inp):
        return lambda: kernel.fused_experts(inp.x, topk_ids=inp.ids, topk_weights=inp.weights, validate=False,
                                            **w.call_kwargs())

    def bf16(inp):
        return lambda: kernel.fused_experts(inp.x, w.dq_gu, w.dq_d, inp.ids, inp.weights, **common)

    return {"mxfp4": Impl("mxfp4", "ready", mxfp4, note="moe_dispatch.fused_experts on the MXFP4 blocks and scales"),
            "bf16": Impl("bf16", "ready", bf16, note="moe_dispatch.fused_experts on the dequantized bf16 values")}


def portable_impl(kernel, w):
    """The package on the MXFP4 blocks with its Gluon MXFP4 engine off (MOE_DISPATCH_GLUON_MXFP4=0 for the call, read
    at its entry and part of its plan's key): the portable kernels, which decode in their loads."""
    def make(inp):
        def call():
            before = os.environ.get(GLUON_MXFP4_VARIABLE)
            os.environ[GLUON_MXFP4_VARIABLE] = "0"
            try:
                return kernel.fused_experts(inp.x, topk_ids=inp.ids, topk_weights=inp.weights, validate=False,
                                            **w.call_kwargs())
            finally:  # the switch as it was (the other impls of the run read it)
                if before is None:
                    del os.environ[GLUON_MXFP4_VARIABLE]
                else:
                    os.environ[GLUON_MXFP4_VARIABLE] = before
        return call

    return Impl("mxfp4_portable", "ready", make, note="moe_dispatch.fused_experts on the MXFP4 blocks and scales with "
                "MOE_DISPATCH_GLUON_MXFP4=0: the portable kernels (the same as mxfp4 where the engine does not run)")


def hf_impl(w):
    """transformers' GptOssExperts (grouped_mm) on the dequantized values in transformers' layout."""
    gu_t = w.dq_gu.transpose(1, 2).contiguous()  # [E, H, 2F], gate and up columns alternating, as transformers holds it
    d_t = w.dq_d.transpose(1, 2).contiguous()  # [E, F, H]
    experts = bench_layouts.Experts(w.shape, "swiglu_oai", {"gpt-oss": (gu_t, d_t, w.gu_bias)}, w.d_bias)
    module, reason = bench_layouts.transformers_peer(experts)
    if module is None:
        return Impl("hf_grouped_mm", f"skipped: {reason}")

    def make(inp):
        return lambda: module(inp.x, inp.ids, inp.weights)

    return Impl("hf_grouped_mm", "ready", make,
                note="transformers GptOssExperts, experts_implementation grouped_mm, on the dequantized bf16 values "
                     "([E, H, 2F] interleaved, [E, F, H]): Mxfp4Config(dequantize=True)'s experts")


def find_peer(hub_dir, peer):
    """(folder, kind) of `peer` under hub_dir, DIR/<repository name>: kind "build" for the kernel repository as the Hub
    serves it (variants with a metadata.json, in build/ or at its top), "source" for its source tree
    (torch-ext/<package>/__init__.py); (None, None) when neither is there."""
    folder = Path(hub_dir) / peer.folder
    if any(folder.glob("build/*/metadata.json")) or any(folder.glob("*/metadata.json")):
        return folder, "build"
    if (folder / "torch-ext" / peer.package / "__init__.py").is_file():
        return folder, "source"
    return None, None


def load_peer(hub_dir, peer):
    """(module, None) or (None, why): `peer` loaded as users load a kernel, `kernels.get_kernel(repo_id, version=N)`.
    With hub_dir, LOCAL_KERNELS maps its repo id to DIR/<repository name> first (a source tree is served as a local
    build: generate_e2e.serve_kernel_source), so nothing is downloaded; without, the Hub or its cache answers."""
    if hub_dir is not None:
        folder, kind = find_peer(hub_dir, peer)
        where = harness.portable_path(str(Path(hub_dir).resolve()))
        if folder is None:
            return None, (f"no {peer.folder} under --hub-dir {where} (put there `hf download {peer.repo_id} "
                          f"--repo-type kernel --revision v{peer.version} --local-dir DIR/{peer.folder}`, or its "
                          f"source: build.toml and torch-ext/{peer.package}/)")
        try:
            if kind == "source":
                serve_kernel_source(folder, peer.repo_id, peer.package, version=peer.version)
            else:
                entry = f"{peer.repo_id}={folder}"
                os.environ["LOCAL_KERNELS"] = ":".join(filter(None, [os.environ.get("LOCAL_KERNELS"), entry]))
        except Exception as exc:  # noqa: BLE001 (a folder that is not what it seems)
            return None, f"serving {where}/{peer.folder} failed: {harness.error_text(exc)}"
    try:
        from kernels import get_kernel

        return get_kernel(peer.repo_id, version=peer.version), None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 (a peer pinned to another Triton may fail anyhow)
        return None, f"get_kernel({peer.repo_id!r}, version={peer.version}) failed: {harness.error_text(exc)}"


def load_hub(args, device):
    """{impl: (module or None, status)} for the Hub peers asked for."""
    hub = {}
    for impl, peer in HUB_IMPLS.items():
        if impl not in args.impls:
            continue
        if device.type != "cuda":
            if args.hub_dir is None:
                where = f"{peer.repo_id} would come from the Hub"
            else:
                found = find_peer(args.hub_dir, peer)[0] is not None
                where = f"{'found' if found else 'no'} {peer.folder} under --hub-dir"
            hub[impl] = (None, f"skipped: needs a CUDA device (its kernels are GPU-only; {where})")
            continue
        if impl == "fg_mxfp4":
            os.environ["FINEGRAINED_AUTOTUNE_TRIALS"] = str(args.fg_trials)  # read when its autotuners are made
        module, why = load_peer(args.hub_dir, peer)
        if module is not None and impl == "fg_mxfp4":
            dims = {d for name in args.models for d in (model_shape(name, False).hidden, model_shape(name, False).ffn)}
            try:
                args.fg_configs = prepare_fg(module, args, dims)
            except Exception as exc:  # noqa: BLE001 (another version of the kernel: its tuners are not as expected)
                module, why = None, f"preparing its autotuners failed: {harness.error_text(exc)}"
        hub[impl] = (module, "loaded" if module is not None else f"skipped: {why}")
    return hub


def fg_autotuners(fg):
    """{name: autotuner} of finegrained-fp8's fused MXFP4 MoE kernels (mxfp_dynamic_moe_*: batched and grouped, gate/up
    and down)."""
    found = {}
    for module_name in ("fused_batched", "fused_grouped"):
        module = getattr(fg, module_name, None) or sys.modules.get(f"{fg.__name__}.{module_name}")
        for name, obj in (vars(module).items() if module is not None else ()):
            if name.startswith("mxfp_dynamic_moe_") and isinstance(getattr(obj, "configs", None), list):
                found[name] = obj
    return found


def prepare_fg(fg, args, dims):
    """finegrained-fp8's MXFP4 autotuners, made fit for this run: the coordinate-descent refinement off (unless
    --fg-refine; it can bench dozens more configs per key), and (unless --fg-all-configs) only the configs whose
    BLOCK_SIZE_N and BLOCK_SIZE_K divide every width in `dims` (H and F): its kernels mask neither N nor K, so another
    tile reads past a row (wrong values) and stores past it (into the next row, or past the buffer's end).
    Returns {kernel: [configs before, configs kept]}."""
    kept = {}
    for name, tuner in fg_autotuners(fg).items():
        if hasattr(tuner, "refine") and not args.fg_refine:
            tuner.refine = False
        before = len(tuner.configs)
        if not args.fg_all_configs:
            fits = [c for c in tuner.configs
                    if all(d % c.kwargs.get("BLOCK_SIZE_N", 1) == 0 and d % c.kwargs.get("BLOCK_SIZE_K", 1) == 0
                           for d in dims)]
            if not fits:
                raise RuntimeError(f"{name}: no autotune config has tiles dividing {sorted(dims)}")
            tuner.configs = fits
        kept[name] = [before, len(tuner.configs)]
    if not kept:
        raise RuntimeError("no mxfp_dynamic_moe_* autotuner found in finegrained_fp8.fused_batched / fused_grouped")
    return kept


def tk_impl(tk, w):
    """OpenAI's triton_kernels (gpt-oss-triton-kernels) as transformers' Mxfp4GptOssExperts runs them, on our bytes."""
    shape = w.shape
    E, H, F = shape.num_experts, shape.hidden, shape.ffn
    layout = tk.tensor_details.layout
    mm = tk.matmul_ogs

    def convert(blocks, scales, n, k):
        # transformers' swizzle_mxfp4_convertops: the bytes [E, n, k/2] as a transposed view [E, k/2, n] (stride 1
        # along K: matmul_ogs wants MXFP4 weights column-major) wrapped as FP4 and converted into the arch's value
        # layout; the scales [E, k/32, n] strided; the wrapper's shape set to the logical [E, k, n].
        value_layout, value_opts = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        value = tk.tensor.convert_layout(tk.tensor.wrap_torch_tensor(blocks.reshape(E, n, k // 2).transpose(-2, -1),
                                                                     dtype=tk.tensor.FP4), value_layout, **value_opts)
        scale = tk.tensor.convert_layout(tk.tensor.wrap_torch_tensor(scales.transpose(-2, -1)), layout.StridedLayout)
        value.shape = torch.Size([E, k, n])
        return value, mm.PrecisionConfig(weight_scale=scale, flex_ctx=mm.FlexCtx(rhs_data=mm.InFlexData()))

    gu, gu_config = convert(w.gu_blocks, w.gu_scales, 2 * F, H)
    down, down_config = convert(w.d_blocks, w.d_scales, H, F)
    gu_bias, d_bias = w.gu_bias.float(), w.d_bias.float()  # transformers holds them in fp32
    act = mm.FusedActivation(mm.FnSpecs("swiglu", tk.swiglu.swiglu_fn, ("alpha", "limit")), (ALPHA, LIMIT), 2)

    def make(inp):
        def call():
            routing_data, gather, scatter = tk.routing.routing(inp.logits, shape.top_k)
            h = mm.matmul_ogs(inp.x, gu, gu_bias, routing_data, gather_indx=gather, precision_config=gu_config,
                              gammas=None, fused_activation=act)
            return mm.matmul_ogs(h, down, d_bias, routing_data, scatter_indx=scatter, precision_config=down_config,
                                 gammas=routing_data.gate_scal)
        return call

    return Impl("tk_matmul_ogs", "ready", make,
                note="kernels-community/gpt-oss-triton-kernels: routing(logits, k) + 2 matmul_ogs (fused swiglu, fp32 "
                     "biases), as transformers' Mxfp4GptOssMLP after its router linear; our bytes converted once as "
                     "transformers' swizzle_mxfp4_convertops does (same values); the call includes top-k + softmax")


def fg_weights(w):
    """Our MXFP4 experts in finegrained-fp8's layout, the same values: gate_up int8 [E, 2F, H/2] with gate rows [0, F)
    and up rows [F, 2F) (ours alternate: a copy with the rows reordered) and its scales [E, 2F, H/32] alike; down
    int8 [E, H, F/2] and its scales (views of ours)."""
    E, H, F = w.shape.num_experts, w.shape.hidden, w.shape.ffn
    gu = torch.cat([w.gu_blocks[:, 0::2], w.gu_blocks[:, 1::2]], dim=1).reshape(E, 2 * F, H // 2).view(torch.int8)
    gu_scales = torch.cat([w.gu_scales[:, 0::2], w.gu_scales[:, 1::2]], dim=1).contiguous()
    return gu, gu_scales, w.d_blocks.reshape(E, H, F // 2).view(torch.int8), w.d_scales


def fg_impl(fg, w):
    """finegrained-fp8's fused MXFP4 MoE on our bytes, gate/up rows de-interleaved into its concatenated layout."""
    gu, gu_scales, down, down_scales = fg_weights(w)

    def make(inp):
        entry = fg.moe_fused_batched if inp.T <= DECODE_MAX_T else fg.moe_fused_grouped
        return lambda: entry(inp.x, inp.ids, inp.weights, gu, down, gu_scales, down_scales, None, act_fn="silu",
                             swiglu_alpha=ALPHA, swiglu_limit=LIMIT)

    return Impl("fg_mxfp4", "ready", make, biases=False, tolerance=FG_TOLERANCE,
                note="kernels-community/finegrained-fp8 fused MXFP4 MoE (moe_fused_batched for T <= 16, "
                     "moe_fused_grouped above), W4A8 (MXFP8 activations); gate/up rows de-interleaved (same values); "
                     "NO biases (its fused MoE has none): error against the float64 experts without biases, held to "
                     "W8A8_TOLERANCE")


def model_impls(args, kernel, hub, w):
    """{impl: Impl} of one model's weights, in IMPLS order; a peer that cannot be built is skipped with the reason."""
    impls = package_impls(kernel, w)
    builders = {"mxfp4_portable": lambda: portable_impl(kernel, w), "hf_grouped_mm": lambda: hf_impl(w),
                "tk_matmul_ogs": lambda: tk_impl(hub["tk_matmul_ogs"][0], w),
                "fg_mxfp4": lambda: fg_impl(hub["fg_mxfp4"][0], w)}
    for name in IMPLS[2:]:
        if name not in args.impls:
            continue
        if name in hub and hub[name][0] is None:
            impls[name] = Impl(name, hub[name][1])
            continue
        try:
            impls[name] = builders[name]()
        except Exception as exc:  # noqa: BLE001 (a peer's layout conversion may fail on this Triton / GPU)
            impls[name] = Impl(name, f"skipped: converting the weights failed: {harness.error_text(exc)}")
            harness.free_memory(w.gu_blocks.device)
    return impls


# --------------------------------------------------------------------------------------------------------------------
# one cell


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cuda_context_lost(device):
    """None while the device still runs work, else the error a synchronize raises (a kernel's fault is sticky)."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
        torch.empty(1, device=device).add_(1)
        torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001
        return harness.error_text(exc)
    return None


def time_calls(fns, args, device):
    """{name: {"us", "hot_us", "time_mode", "pairs_us"}} and the per-pair median MXFP4 / bf16 ratio (None where
    either was not in the paired set): the calls that capture into CUDA graphs are replayed alternately
    (harness.paired_graph_times), the others timed by do_bench; on the CPU wall-clock calls, alternated alike."""
    out = {}
    if device.type != "cuda":
        series = {name: [] for name in fns}
        for order in harness.alternating_orders(fns, args.pairs):
            for name in order:
                start = time.perf_counter()
                fns[name]()
                series[name].append((time.perf_counter() - start) * 1e6)
        for name, values in series.items():
            out[name] = {"us": statistics.median(values), "time_mode": "wall", "pairs_us": values}
        ratio = None
        if "mxfp4" in series and "bf16" in series:
            ratio = statistics.median(a / b for a, b in zip(series["mxfp4"], series["bf16"]))
        return out, ratio
    graphed = {}
    for name, fn in fns.items():  # which calls capture: a one-call probe each, so that one peer cannot spoil the rest
        try:
            harness.paired_graph_times({name: fn}, 0, hot_calls=1)
            graphed[name] = fn
        except Exception as exc:  # noqa: BLE001 (a host sync or an allocation the capture refuses)
            out[name] = {"graph_error": harness.error_text(exc)}
            torch.cuda.synchronize(device)
    ratio = None
    if graphed:
        times = harness.paired_graph_times(graphed, args.pairs, hot_calls=args.hot_calls)
        for name in graphed:
            out[name] = {"us": statistics.median(times["flushed"][name]),
                         "hot_us": statistics.median(times["hot"][name]), "time_mode": "graph",
                         "pairs_us": times["flushed"][name]}
        if "mxfp4" in graphed and "bf16" in graphed:
            ratio = harness.median_ratios(times["flushed"], "bf16")["mxfp4"]
    plain = harness.EventTimer(args.warmup_ms, args.rep_ms)
    for name, fn in fns.items():
        if name in graphed:
            continue
        try:
            out[name].update(us=plain.plain(fn) * 1e3, time_mode="plain")
        except Exception as exc:  # noqa: BLE001
            out[name]["timing_error"] = harness.error_text(exc)
    return out, ratio


def judge(T, hit, shape, times, ceilings, paired_ratio=None):
    """The cell's accounting: MXFP4 bytes of the experts hit, the decode floor (T <= 16) and the prefill ratio
    (T >= 1024), from {impl: us} times; paired_ratio (the per-pair median MXFP4 / bf16) wins over the ratio of
    medians where given."""
    nbytes = mxfp4_bytes(shape, hit)
    mx, bf = times.get("mxfp4"), times.get("bf16")
    out = {"mxfp4_bytes": nbytes, "flops": 2 * T * shape.top_k * 3 * shape.hidden * shape.ffn}
    if mx:
        out["mxfp4_read_tb_per_s"] = nbytes / (mx * 1e-6) / 1e12
        out["mxfp4_tflop_per_s"] = out["flops"] / (mx * 1e-6) / 1e12
    if mx and bf:
        out["mxfp4_over_bf16"] = paired_ratio if paired_ratio is not None else mx / bf
        out["ratio_kind"] = "median of per-pair ratios" if paired_ratio is not None else "ratio of medians"
    if T <= DECODE_MAX_T:
        floor = READ_SLACK * nbytes / ceilings["read_bytes_per_s"] * 1e6 + LAUNCH_ALLOWANCE_US
        out.update(target="decode", floor_us=floor)
        if mx:
            out.update(mxfp4_over_floor=mx / floor, met=mx <= floor)
    elif T >= PREFILL_MIN_T:
        out["target"] = "prefill"
        if "mxfp4_over_bf16" in out:
            out["met"] = out["mxfp4_over_bf16"] <= PREFILL_MAX_RATIO
    return out


def run_cell(args, w, impls, T, device, peer_warmup):
    """Every implementation at T tokens: first call (compile, autotune) and its check, then the alternated timing."""
    shape = w.shape
    seed = args.seed * 1000003 + T
    inp = make_inputs(shape, T, device, seed)
    rows = harness.check_rows(T, args.check_rows, device, seed)
    hit = int(torch.unique(inp.ids).numel())
    cell = {"model": shape.name, "T": T, "E": shape.num_experts, "top_k": shape.top_k, "H": shape.hidden,
            "F": shape.ffn, "experts_hit": hit, "check_rows": int(rows.numel()), "impls": {}}
    refs = {}

    def ref(biases):
        if biases not in refs:
            refs[biases] = harness.mxfp4_reference(w, inp.x[rows], inp.ids[rows], inp.weights[rows], biases=biases)
        return refs[biases]

    fns = {}
    for name in IMPLS:
        if name not in impls:
            continue
        impl, record = impls[name], {}
        cell["impls"][name] = record
        if impl.status != "ready":
            record["skipped"] = impl.status.removeprefix("skipped: ")
            continue
        if args.peer_warmup_s and peer_warmup.get(name, 0.0) > args.peer_warmup_s and name not in ("mxfp4", "bf16"):
            record["skipped"] = (f"its first calls (compile, autotune) took {peer_warmup[name]:.0f} s in all, over "
                                 f"--peer-warmup-s {args.peer_warmup_s:.0f}")
            continue
        fn = noting_switch(bench_layouts.no_grad(impl.make(inp)), record.setdefault("engine_switch_seen", []))
        start = time.monotonic()
        try:
            out = fn()  # compiles (and autotunes) on first use; its output is checked
            synchronize(device)
        except Exception as exc:  # noqa: BLE001 (a peer that cannot run this cell is reported, the rest go on)
            record["error"] = harness.error_text(exc)
            record["first_call_s"] = time.monotonic() - start
            peer_warmup[name] = peer_warmup.get(name, 0.0) + record["first_call_s"]
            lost = cuda_context_lost(device)
            if lost:  # a fault (an illegal address, say) leaves the context unusable: nothing more can run
                cell["cuda_context_lost"] = f"after {name} failed: {lost}"
                return cell
            harness.free_memory(device)
            continue
        record["first_call_s"] = time.monotonic() - start
        peer_warmup[name] = peer_warmup.get(name, 0.0) + record["first_call_s"]
        try:
            err = reference.relative_error(out[rows], ref(impl.biases))
        except Exception as exc:  # noqa: BLE001 (a wrong output shape, say)
            err, record["check_error"] = float("nan"), harness.error_text(exc)
        record.update(rel_err=err, tolerance=impl.tolerance, ok=err <= impl.tolerance, biases=impl.biases)  # NaN fails
        del out
        fns[name] = fn
    del refs
    harness.free_memory(device)
    try:
        times, paired_ratio = time_calls(fns, args, device)
    except Exception as exc:  # noqa: BLE001 (out of memory in a capture, say: the checks are kept)
        times, paired_ratio = {}, None
        cell["timing_error"] = harness.error_text(exc)
        lost = cuda_context_lost(device)
        if lost:
            cell["cuda_context_lost"] = f"during the timing: {lost}"
            return cell
    for name, timing in times.items():
        cell["impls"][name].update(timing)
    state = harness.gpu_state(device)
    if state:
        cell["gpu_state"] = state
    cell.update(judge(T, hit, shape, {n: r.get("us") for n, r in cell["impls"].items()}, args.ceilings, paired_ratio))
    harness.free_memory(device)
    return cell


# --------------------------------------------------------------------------------------------------------------------
# outputs


def impl_text(record, spec=".1f"):
    """A table cell of one implementation: its time, or why there is none; a failed check marks the time."""
    if record is None:
        return "-"
    if "skipped" in record:
        return "skip"
    if "error" in record:
        return "error"
    us = record.get("us")
    text = fmt(us, spec) if us is not None else "?"
    if record.get("time_mode") == "plain":
        text += " (plain)"
    return text if record.get("ok") else f"{text} (wrong)"


def noting_switch(fn, seen):
    """`fn`, noting in `seen` the MXFP4 engine's switch (GLUON_MXFP4_VARIABLE, None when unset) as each call finds it,
    each value once. The timed CUDA graphs are captured after every implementation's first call: an implementation
    whose calls found different values did not time what its first call checked (`checks_text` says so)."""
    def call():
        value = os.environ.get(GLUON_MXFP4_VARIABLE)
        if value not in seen:
            seen.append(value)
        return fn()
    return call


def checks_text(cell):
    """"ok", or the implementations whose check failed, that raised or whose calls found the engine's switch changed."""
    bad = []
    for name, record in cell.get("impls", {}).items():
        if "error" in record:
            bad.append(f"{LABELS[name]} error")
        elif "rel_err" in record and not record.get("ok"):
            bad.append(f"{LABELS[name]} err {fmt(record['rel_err'], '.1e')}")
        if len(record.get("engine_switch_seen", ())) > 1:
            bad.append(f"{LABELS[name]} ran with {GLUON_MXFP4_VARIABLE} " + " then ".join(
                repr(value) for value in record["engine_switch_seen"]))
    for key, text in (("timing_error", "timing error"), ("error", "cell error"),
                      ("cuda_context_lost", "CUDA context lost")):
        if cell.get(key):
            bad.append(text)
    return "; ".join(bad) if bad else "ok"


def target_text(cell):
    if cell.get("skipped"):
        return f"skipped ({cell['skipped']})"
    if "target" not in cell:
        return "-"
    if "met" not in cell:
        return f"{cell['target']}: ?"
    return f"{cell['target']}: {'met' if cell['met'] else '**missed**'}"


def short_table(results):
    """The Markdown table printed last: per model and T the times (us), MXFP4 / bf16, the decode floor."""
    names = [n for n in IMPLS if n in results["meta"]["args"]["impls"]]
    lines = ["| model | T | hit | " + " | ".join(f"{LABELS[n]} us" for n in names)
             + " | mx/bf16 | floor us | mx/floor | target | checks |", "|" + "---|" * (8 + len(names))]
    for cell in results["cells"]:
        impls = cell.get("impls", {})
        row = [cell["model"], str(cell["T"]), str(cell.get("experts_hit", "-"))]
        row += [impl_text(impls.get(n)) for n in names]
        row += [fmt(cell.get("mxfp4_over_bf16"), ".2f"), fmt(cell.get("floor_us")),
                fmt(cell.get("mxfp4_over_floor"), ".2f"), target_text(cell),
                checks_text(cell) if not cell.get("skipped") else "-"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def full_table(results):
    names = [n for n in IMPLS if n in results["meta"]["args"]["impls"]]
    head = (["model", "T", "hit"] + [f"{LABELS[n]} us" for n in names] + ["mx hot us", "bf16 hot us", "mx/bf16",
            "floor us", "mx/floor", "mx TB/s", "mx TFLOP/s", "target"] + [f"{LABELS[n]} err" for n in names])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cell in results["cells"]:
        impls = cell.get("impls", {})
        mx, bf = impls.get("mxfp4", {}), impls.get("bf16", {})
        row = [cell["model"], str(cell["T"]), str(cell.get("experts_hit", "-"))]
        row += [impl_text(impls.get(n)) for n in names]
        row += [fmt(mx.get("hot_us")), fmt(bf.get("hot_us")), fmt(cell.get("mxfp4_over_bf16"), ".3f"),
                fmt(cell.get("floor_us")), fmt(cell.get("mxfp4_over_floor"), ".2f"),
                fmt(cell.get("mxfp4_read_tb_per_s"), ".2f"), fmt(cell.get("mxfp4_tflop_per_s"), ".0f"),
                target_text(cell)]
        row += [fmt(impls.get(n, {}).get("rel_err"), ".1e") for n in names]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def notes_text(results):
    meta = results["meta"]
    lines = []
    for model, peers in meta["impl_status"].items():
        for name, status in peers.items():
            if status != "ready":
                lines.append(f"- {model} {name}: {status}")
    errors = [(c["model"], c["T"], n, r[k]) for c in results["cells"] for n, r in c.get("impls", {}).items()
              for k in ("error", "check_error", "graph_error", "timing_error") if k in r]
    errors += [(c["model"], c["T"], "cell", c[k]) for c in results["cells"]
               for k in ("error", "timing_error", "cuda_context_lost") if c.get(k)]
    lines += [f"- {m} T={t} {n}: {e}" for m, t, n, e in errors]
    skipped = [f"{c['model']} T={c['T']} ({c['skipped']})" for c in results["cells"] if c.get("skipped")]
    if skipped:
        lines.append(f"- cells skipped: {', '.join(skipped)}")
    return "\n".join(lines) + "\n" if lines else "- none\n"


def write_markdown(results, path):
    meta, ceil = results["meta"], results["ceilings"]
    impl_notes = "\n".join(f"- **{n}** ({LABELS[n]}): {note}" for n, note in meta["impl_notes"].items())
    text = "\n".join([
        "# moe-dispatch MXFP4 experts benchmark", "",
        f"{meta['device']} · torch {meta['torch']} · triton {meta['triton']} · "
        f"transformers {meta['transformers']} · {meta['date']} · commit {meta['commit']}", "",
        f"R (read) {ceil['read_bytes_per_s'] / 1e12:.2f} TB/s · copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s · "
        f"P (bf16 matmul) {ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s", "",
        impl_notes, "",
        "Times: us per call, median; graph replays alternated with the L2 flushed before each (plain: do_bench, L2 "
        "flushed, where the call does not capture); hot: a graph of repeated calls, no flush. mx/bf16: median of the "
        "per-pair ratios. floor (T <= 16): 1.15 x (MXFP4 + scale bytes of the experts hit) / R + 10 us; prefill "
        "(T >= 1024) target mx/bf16 <= 1.1. err: relative Frobenius error on the row sample against float64 experts "
        f"on the dequantized weights (tolerance {TOLERANCE:g}; fg {FG_TOLERANCE:g}, without biases); (wrong): over "
        "its tolerance.", "",
        full_table(results),
        "## Notes (skips and errors)", "", notes_text(results),
        "## Short table", "", short_table(results)])
    Path(path).write_text(text)


def write_outputs(results, out_dir):
    harness.write_results(results, out_dir, "mxfp4", write_markdown)


def meta(args, device, kernel, hub):
    import triton

    try:
        import transformers

        transformers_version = transformers.__version__
    except Exception:  # noqa: BLE001
        transformers_version = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers_version,
        "python": platform.python_version(), "commit": harness.git_commit(),
        "package": f"{getattr(kernel, '__name__', '?')} {getattr(kernel, '__version__', '?')}",
        "argv": [harness.portable_path(a) for a in args.argv],
        "args": {k: harness.portable_path(v) if k in ("out", "hub_dir", "kernel_dir") else v
                 for k, v in vars(args).items() if k not in ("argv", "ceilings", "fg_configs")},
        "hub": {impl: status for impl, (_, status) in hub.items()},
        "weights": f"random MXFP4: uniform e2m1 bytes, e8m0 scale codes {harness.MXFP4_SCALE_CODE} +- 1; biases "
                   "bf16 randn * 0.02; x randn bf16; routing top-k of randn fp32 logits, softmax over the k",
        "tolerance": {"bf16": TOLERANCE, "fg_mxfp4 (w4a8)": FG_TOLERANCE},
        "targets": {"read_slack": READ_SLACK, "launch_allowance_us": LAUNCH_ALLOWANCE_US,
                    "decode_max_tokens": DECODE_MAX_T, "prefill_min_tokens": PREFILL_MIN_T,
                    "prefill_max_mxfp4_over_bf16": PREFILL_MAX_RATIO},
        "fg_autotune": {"trials": args.fg_trials, "refine": args.fg_refine, "all_configs": args.fg_all_configs,
                        "configs_before_kept": getattr(args, "fg_configs", None)},
        "impl_status": {}, "impl_notes": {},
    }


def main(argv=None, *, kernel=None):
    started = time.monotonic()
    args = parse_args(argv)
    device = harness.benchmark_device(args.device, "--cpu-smoke")
    torch.manual_seed(args.seed)
    kernel = kernel if kernel is not None else harness.load_kernel(args.kernel_dir)
    os.environ["MOE_DISPATCH_MXFP4_PREFILL"] = args.mxfp4_prefill  # in every plan's key: no plan to clear
    timer = harness.make_timer(args, device)
    hub = load_hub(args, device)
    results = {"meta": meta(args, device, kernel, hub), "shapes": {}, "ceilings": None, "cells": []}
    results["ceilings"] = args.ceilings = harness.measure_ceilings(timer, device, nbytes=args.ceiling_mib << 20,
                                                                   matmul_size=args.matmul_size)
    print(f"ceilings done at {time.monotonic() - started:.0f} s: "
          f"R {args.ceilings['read_bytes_per_s'] / 1e12:.2f} TB/s; hub: {results['meta']['hub']}",
          file=sys.stderr, flush=True)
    out_dir = Path(args.out)
    peer_warmup = {}
    lost = None  # why the CUDA context can no longer run work, once a peer has broken it
    for index, name in enumerate(args.models):
        if lost:
            results["cells"] += [{"model": name, "T": T, "skipped": "the CUDA context was lost"} for T in args.tokens]
            continue
        shape = model_shape(name, args.cpu_smoke)
        results["shapes"][name] = dataclasses.asdict(shape)
        w = harness.make_mxfp4_weights(shape, device, args.seed + 1000 * index, kernel)
        impls = model_impls(args, kernel, hub, w)
        results["meta"]["impl_status"][name] = {n: i.status for n, i in impls.items()}
        for n, impl in impls.items():
            if impl.note:
                results["meta"]["impl_notes"].setdefault(n, impl.note)
        for n, impl in impls.items():
            if impl.status != "ready":
                print(f"{name}: {n} {impl.status}", file=sys.stderr, flush=True)
        for T in args.tokens:
            elapsed = time.monotonic() - started
            if lost:
                results["cells"].append({"model": name, "T": T, "skipped": "the CUDA context was lost"})
                continue
            if args.budget_s and elapsed > args.budget_s:
                results["cells"].append({"model": name, "T": T, "skipped": f"budget {args.budget_s:.0f} s"})
                continue
            try:
                cell = run_cell(args, w, impls, T, device, peer_warmup)
            except Exception as exc:  # noqa: BLE001 (out of memory outside a call, say: the cell is reported)
                cell = {"model": name, "T": T, "impls": {}, "error": harness.error_text(exc)}
                lost = cuda_context_lost(device)
                if lost:
                    cell["cuda_context_lost"] = lost
            lost = lost or cell.get("cuda_context_lost")
            results["cells"].append(cell)
            times = ", ".join(f"{LABELS[n]} {fmt(r.get('us'))}" for n, r in cell["impls"].items() if "us" in r)
            print(f"{name} T={T}: {times} us; mx/bf16 {fmt(cell.get('mxfp4_over_bf16'), '.2f')}; "
                  f"{target_text(cell)}; checks {checks_text(cell)} ({time.monotonic() - started:.0f} s)",
                  file=sys.stderr, flush=True)
        del w, impls
        if not lost:
            harness.free_memory(device)
        results["meta"]["elapsed_s"] = time.monotonic() - started
        write_outputs(results, out_dir)
    write_outputs(results, out_dir)
    print(notes_text(results), flush=True)
    print(short_table(results), flush=True)
    return results


if __name__ == "__main__":
    main()
