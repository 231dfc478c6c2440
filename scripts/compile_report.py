"""Every kernel the package would launch on each GPU target, compiled ahead of time without the GPU.

    capture   the public functions run on CPU tensors with the device facts of a target (`host.device.compile_target`),
              Triton's launch (`JITFunction.run`) replaced by a recorder: each launch is bound as Triton binds it for
              the target's backend (signature, constexprs, alignment attributes, options), never run; launches dedupe
              on Triton's own cache key. The problems are the shipped tables' (`problems`): every bucket of each
              table at the model shapes of benchmarks/model_shapes.py, every dtype, the FP8 schemes, MXFP4, decode,
              the backward, binned routing, the router and the expert-parallel plan.
    compile   `triton.compile(ASTSource(...), target=GPUTarget(...))` of each unique launch, in worker processes
    check     registers, spills (ptxas's, from the cubin's resource usage; the AMD assembler's VGPR / SGPR spill counts
              and scratch) and shared memory (LDS) against the target's limit; a compile error fails too

`scripts/compile_report` writes docs/results/compile-targets.md (per target: kernels, registers, spills, shared memory,
every failure) and exits 1 on a failure that is not a reviewed one (`KNOWN`, each with its reason); `--check` writes
nothing, `--capture-only` compiles nothing. tests/test_targets.py and tests/test_targets_h200.py run the CI list
(`--quick`). Triton runs compiled here (the script clears TRITON_INTERPRET) into a fresh cache, removed at exit,
unless TRITON_CACHE_DIR names one: the report's compile times are cold compiles'.

Launches hold no device data, so nothing is computed: buffers are allocated and never touched, the large weights are
views of a sparse file (no memory is committed), and a host read of a device value would read garbage (no public path
the problems take does one).
"""

import argparse
import atexit
import collections
import contextlib
import dataclasses
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: kernels must be JITFunctions, not interpreted
os.environ.setdefault("MOE_DISPATCH_PLANS", "0")  # every call takes the full path (a plan would replay, not launch)
if "TRITON_CACHE_DIR" not in os.environ:  # compile every variant (honest times), leave no cache behind
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="compile_report_cache_")
    atexit.register(shutil.rmtree, os.environ["TRITON_CACHE_DIR"], True)

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

import moe_dispatch  # noqa: E402
from model_shapes import MODEL_SHAPES  # noqa: E402
from moe_dispatch.host import device as _device, tiles  # noqa: E402
from moe_dispatch.host.device import CompileTarget  # noqa: E402
from moe_dispatch.parallel import ep_plan  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORT = os.path.join("docs", "results", "compile-targets.md")

KB = 1024
# Compilation knobs Triton's `JITFunction.run` passes to its binder; a Triton has the ones of its version (3.6 the
# first, 3.9 both).
LAUNCH_KNOBS = ("instrumentation_mode", "fpsan_homomorphic_casts")
# The targets: the tile table each reads (device_key), Triton's backend and arch, and the shared memory a program may
# use (the opt-in maximum per block; LDS per workgroup on AMD).
TARGETS = {
    "a100": CompileTarget("NVIDIA_A100", "cuda", 80, 32, num_sms=108, smem_per_program=163 * KB),
    "h200": CompileTarget("NVIDIA_H200", "cuda", 90, 32, num_sms=132, smem_per_program=227 * KB),
    "mi300x": CompileTarget("AMD_Instinct_MI300X", "hip", "gfx942", 64, num_sms=304, smem_per_program=64 * KB),
}


# -- capture -----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Launch:
    """One unique kernel specialization of a target: what `triton.compile` takes, and the problems that launch it."""

    kernel: JITFunction
    signature: dict
    constexprs: dict
    attrs: dict
    options: object  # the backend's parsed options (num_warps, num_stages, ...)
    problems: list

    @property
    def name(self):
        return self.kernel.fn.__name__

    def named_constexprs(self):
        """The kernel's declared constexprs by name (what a reader tells variants by)."""
        params = self.kernel.params
        return {params[path[0]].name: value for path, value in self.constexprs.items()
                if len(path) == 1 and params[path[0]].is_constexpr}

    def dtype(self):
        """The element type of the kernel's first pointer argument (its first operand): "bf16", "fp32", "fp8e4nv"..."""
        return next((kind[1:] for kind in self.signature.values() if isinstance(kind, str) and kind.startswith("*")),
                    "-")

    def describe(self):
        shown = ", ".join(f"{name}={value}" for name, value in self.named_constexprs().items())
        return f"{self.dtype()}: {shown}; warps={self.options.num_warps}, stages={self.options.num_stages}"


class Recorder:
    """Replaces `JITFunction.run` while active: binds each launch for `target` as Triton's launcher would and keeps
    the unique ones (`launches`, by Triton's cache key), running nothing."""

    def __init__(self, target: CompileTarget):
        self.gpu_target = GPUTarget(target.backend, target.arch, target.warp_size)
        self.backend = make_backend(self.gpu_target)
        self.binders = {}
        self.launches = {}
        self.problem = None

    def run(self, kernel, *args, grid, warmup, **kwargs):
        kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
        for name in LAUNCH_KNOBS:  # what this Triton's own launcher passes from its compilation knobs
            if hasattr(knobs.compilation, name):
                kwargs[name] = getattr(knobs.compilation, name)
        binder = self.binders.get(kernel)
        if binder is None:
            binder = self.binders[kernel] = create_function_from_signature(kernel.signature, kernel.params,
                                                                           self.backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        key = (kernel.fn.__module__, kernel.fn.__qualname__, str(specialization), str(options))
        launch = self.launches.get(key)
        if launch is None:
            options, signature, constexprs, attrs = kernel._pack_args(self.backend, kwargs, bound_args,
                                                                      specialization, options)
            launch = self.launches[key] = Launch(kernel, signature, constexprs, attrs, options, [])
        if self.problem not in launch.problems:
            launch.problems.append(self.problem)
        return None

    @contextlib.contextmanager
    def active(self):
        real_run = JITFunction.run
        recorder = self

        def run(kernel, *args, grid, warmup, **kwargs):
            return recorder.run(kernel, *args, grid=grid, warmup=warmup, **kwargs)

        JITFunction.run = run
        try:
            yield self
        finally:
            JITFunction.run = real_run


class Arena:
    """Untouched tensors of any size: views of one sparse file mapped shared (pages are never written, so none is
    committed), each 256-byte aligned. `reset` reuses the space for the next problem."""

    SIZE = 1 << 37

    def __init__(self):
        self._file = tempfile.NamedTemporaryFile(prefix="compile_report_arena_")
        self._file.truncate(self.SIZE)
        self._bytes = torch.from_file(self._file.name, shared=True, size=self.SIZE, dtype=torch.uint8)
        self._offset = 0

    def reset(self):
        self._offset = 0

    def empty(self, shape, dtype):
        count = 1
        for size in shape:
            count *= size
        nbytes = count * dtype.itemsize
        start = self._offset
        self._offset = -(-(start + nbytes) // 256) * 256
        if self._offset > self.SIZE:
            raise MemoryError(f"arena of {self.SIZE} bytes too small")
        return self._bytes[start:start + nbytes].view(dtype).view(shape)


# -- problems ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Problem:
    """One call of a public function: `kind` names the path and dtype, `shape` the model, `why` what it covers."""

    kind: str
    shape: str
    why: str
    run: object  # callable(arena)

    def label(self):
        return f"{self.kind}, {self.shape}, {self.why}"


FP8_SCHEMES = ("block", "channel", "tensor")
# Weight gradients are asked for only where the fp32 gradient of w_gate_up stays below this (it is allocated, and a
# single allocation past the machine's memory is refused even untouched); larger models run the input gradients.
MAX_WEIGHT_GRAD_BYTES = 4 << 30


def _dt(dtype):
    return str(dtype).replace("torch.", "")


def _key(model):
    return f"{model.num_experts},{model.ffn},{model.hidden}"


def _bucket_lists(section, quick=False):
    """(shape key or None, buckets) of a table section: its generic list, then (not `quick`) each per-shape list."""
    yield None, section["buckets"]
    if not quick:
        yield from section.get("shapes", {}).items()


def _models_for(section, key, quick):
    """The models a bucket list is checked at: its own shape; for the generic list the first benchmarked model
    without a list of its own whose H and F are multiples of 128, and (not `quick`) the first whose H or F is not
    (the K loops' EVEN_K variants)."""
    if key is not None:
        return [m for m in MODEL_SHAPES.values() if _key(m) == key]
    own = section.get("shapes", {})
    served = [m for m in MODEL_SHAPES.values() if _key(m) not in own] or list(MODEL_SHAPES.values())
    aligned = [m for m in served if m.hidden % 128 == 0 and m.ffn % 128 == 0]
    ragged = [m for m in served if m not in aligned]
    return (aligned or served)[:1] + ([] if quick else ragged[:1])


def _bucket_tokens(buckets, model):
    """(T, bucket index) per general bucket: the T whose rows per expert (T * top_k / E, rounded up) are the
    bucket's top (past the previous bucket for the open last one)."""
    out, previous = [], 0
    for index, bucket in enumerate(buckets):
        limit = bucket["max_rows_per_expert"]
        rows = limit if limit < 10**6 else max(2 * previous, previous + 1)
        out.append((max(1, rows * model.num_experts // model.top_k), index))
        previous = limit
    return out


def _decode_tokens(buckets, model):
    """(T, bucket index) per decode bucket: the largest T whose T * top_k assignments land in it (none where no T
    does), and T = 1 in the first (one token: T specializes to a constant)."""
    out, previous = [], 0
    for index, bucket in enumerate(buckets):
        T = bucket["max_assignments"] // model.top_k
        if T >= 1 and T * model.top_k > previous:
            out += [(1, index)] if not out and T > 1 else []
            out.append((T, index))
        previous = bucket["max_assignments"]
    return out


def _ends(cells, quick, every=False, last=False):
    """The cells checked: all of them, or with `quick` (unless `every`) the first and the last (the smallest and the
    largest tiles of a list), or the last alone (`last`)."""
    if not quick or every:
        return cells
    return cells[-1:] if last else list(dict.fromkeys(cells[:1] + cells[-1:]))


def _experts_call(model, T, dtype, *, weights="float", scheme=None, fp8_dtype=None, fp8_compute="auto", grad=False,
                  gpt_oss=False):
    """A `fused_experts` call at `model`'s shape: float weights of `dtype`, float8 ones ("fp8", `scheme`, `fp8_dtype`)
    or "mxfp4"; `gpt_oss`: GPT-OSS's layout (interleaved gate/up, biases, swiglu_oai; float weights transposed);
    `grad`: the backward too (weight gradients where they fit, MAX_WEIGHT_GRAD_BYTES)."""
    E, F, H, top_k = model.num_experts, model.ffn, model.hidden, model.top_k
    transposed = gpt_oss and weights == "float"

    def run(arena):
        x = torch.empty(T, H, dtype=dtype, requires_grad=grad)
        ids = torch.randint(0, E, (T, top_k))
        topk_weights = torch.empty(T, top_k, dtype=torch.float32, requires_grad=grad)
        kwargs = dict(validate=False)
        if gpt_oss:
            kwargs.update(activation="swiglu_oai", interleaved=True, transposed=transposed,
                          gate_up_bias=torch.empty(E, 2 * F, dtype=dtype, requires_grad=grad),
                          down_bias=torch.empty(E, H, dtype=dtype, requires_grad=grad))
        shapes = ((E, H, 2 * F), (E, F, H)) if transposed else ((E, 2 * F, H), (E, H, F))
        if weights == "fp8":
            w_gate_up, w_down = (arena.empty(shape, fp8_dtype) for shape in shapes)
            scales = [torch.empty(moe_dispatch.formats.fp8.scale_shape(shape, scheme, n_axis=2 if transposed else 1))
                      for shape in shapes]
            kwargs.update(w_gate_up_scale=scales[0], w_down_scale=scales[1], fp8_compute=fp8_compute)
        elif weights == "mxfp4":
            w_gate_up, w_down = arena.empty((E, 2 * F, H // 2), torch.uint8), arena.empty((E, H, F // 2), torch.uint8)
            kwargs.update(w_gate_up_scale=torch.empty(E, 2 * F, H // 32, dtype=torch.uint8),
                          w_down_scale=torch.empty(E, H, F // 32, dtype=torch.uint8))
        else:
            weight_grad = grad and E * 2 * F * H * 4 <= MAX_WEIGHT_GRAD_BYTES
            w_gate_up, w_down = (arena.empty(shape, dtype).requires_grad_(weight_grad) for shape in shapes)
        out = moe_dispatch.fused_experts(x, w_gate_up, w_down, ids, topk_weights, **kwargs)
        if grad:
            inputs = [t for t in (x, topk_weights, w_gate_up, w_down, kwargs.get("gate_up_bias"),
                                  kwargs.get("down_bias")) if t is not None and t.requires_grad]
            torch.autograd.grad(out, inputs, torch.empty_like(out))

    return run


def problems(target: CompileTarget, quick=False):
    """The calls whose launches are compiled for `target`, each table bucket once per variant that compiles apart:

      general path   bf16 forward and backward at every bucket of every list of the target's table; fp16 and fp32
                     forward and backward at the generic buckets (fp32 halves their BLOCK_K)
      decode path    bf16 at every decode bucket (and T = 1); fp16 and fp32 at the generic ones
      float8         where the target loads its float8 type (e4m3fn on NVIDIA from SM89, e4m3fnuz on AMD): the w8a8
                     path (NVIDIA from SM89) at every "fp8" bucket with block scales; the dequant path at the generic
                     bf16 buckets and at every fp8 decode bucket with block scales; channel and tensor scales at the
                     generic buckets of each; the frozen experts' backward (gradients for x and the routing weights)
                     with block scales at the generic buckets' ends
      GPT-OSS        MXFP4 weights and the transposed float layout (interleaved, biases, swiglu_oai) at every bucket
                     of the lists GPT-OSS-120B reads, general and decode; the backward of the float layout and of
                     the frozen MXFP4 experts
      the rest       the router, the v1 functions on sorted rows, binned routing, the expert-parallel plan

    Generic lists are checked at `_models_for`'s models. `quick` (the CI test): the generic lists alone (all of a
    table without per-shape lists), every bucket in bf16 and the other variants at the first and the last (the
    backward of fp32 and of GPT-OSS's layout at the last); fp32 but not fp16 (`_other_dtypes`); the general dequant
    path at its ends where w8a8 runs; binned routing in bf16."""
    table = tiles.load_table(target.key)
    out = _general_problems(table, quick) + _decode_problems(table, quick)
    if target.backend == "hip" or target.capability >= _device.FP8_MIN_CAPABILITY:  # fused_experts refuses it else
        fp8_dtype = torch.float8_e4m3fnuz if target.backend == "hip" else torch.float8_e4m3fn
        out += _fp8_problems(table, fp8_dtype, target.backend == "cuda", quick)
    out += _gpt_oss_problems(table, quick) + _router_problems(quick)
    return out + _binned_problems(quick) + _ep_plan_problems(quick)


def _other_dtypes(quick):
    """The float dtypes besides bf16 checked at the generic buckets: fp16 and fp32; fp32 alone with `quick` (fp16
    compiles as bf16's twin: the same tiles, bytes and dots)."""
    return (torch.float32,) if quick else (torch.float16, torch.float32)


def _where(kind, index, key, T):
    return f"{kind}bucket {index}{' of its shape' if key else ''}, T={T}"


def _general_problems(table, quick):
    out = []
    for key, buckets in _bucket_lists(table, quick):
        for model in _models_for(table, key, quick):
            cells = _bucket_tokens(buckets, model)
            for T, index in _ends(cells, quick, every=key is None):
                out.append(Problem("forward bf16", model.name, _where("", index, key, T),
                                   _experts_call(model, T, torch.bfloat16)))
            for T, index in _ends(cells, quick):
                for dtype in (torch.bfloat16, *_other_dtypes(quick)) if key is None else (torch.bfloat16,):
                    why = _where("", index, key, T)
                    if dtype != torch.bfloat16:
                        out.append(Problem(f"forward {_dt(dtype)}", model.name, why, _experts_call(model, T, dtype)))
                    if dtype == torch.bfloat16 or (T, index) in _ends(cells, quick, last=True):
                        out.append(Problem(f"backward {_dt(dtype)}", model.name, why,
                                           _experts_call(model, T, dtype, grad=True)))
    return out


def _decode_problems(table, quick):
    out = []
    for key, buckets in _bucket_lists(table["decode"], quick) if "decode" in table else ():
        for model in _models_for(table["decode"], key, quick):
            cells = _decode_tokens(buckets, model)
            for T, index in _ends(cells, quick, every=key is None):
                out.append(Problem("decode bf16", model.name, _where("decode ", index, key, T),
                                   _experts_call(model, T, torch.bfloat16)))
            for T, index in _ends(cells, quick) if key is None else ():
                for dtype in _other_dtypes(quick):
                    out.append(Problem(f"decode {_dt(dtype)}", model.name, _where("decode ", index, key, T),
                                       _experts_call(model, T, dtype)))
    return out


def _fp8_problems(table, fp8_dtype, w8a8, quick):
    """float8 weights: the w8a8 path at the "fp8" buckets (or the bf16 ones a table without them lends), the dequant
    path at the generic bf16 buckets and at the fp8 decode buckets."""
    fp8 = table.get("fp8")
    sections = [("fp8 ", fp8 or table, _bucket_tokens, "w8a8")] if w8a8 else []
    sections += [("", {"buckets": table["buckets"]}, _bucket_tokens, "dequant")]
    if fp8 and "decode" in fp8:
        sections.append(("fp8 decode ", fp8["decode"], _decode_tokens, "dequant"))
    out = []
    for kind, section, cells_of, compute in sections:
        for key, buckets in _bucket_lists(section, quick):
            for model in _models_for(section, key, quick):
                cells = cells_of(buckets, model)
                # where w8a8 runs, the general dequant path is the forced one: its first and last bucket in CI
                every = key is None and not (w8a8 and compute == "dequant" and kind == "")
                for T, index in _ends(cells, quick, every=every):
                    for scheme in FP8_SCHEMES if key is None and (T, index) in _ends(cells, quick) else ("block",):
                        out.append(Problem(f"{compute} {scheme}", model.name, _where(kind, index, key, T),
                                           _experts_call(model, T, torch.bfloat16, weights="fp8", scheme=scheme,
                                                         fp8_dtype=fp8_dtype, fp8_compute=compute)))
                if kind == "" and key is None:  # frozen float8 experts in training: the backward's dequant GEMMs
                    for T, index in _ends(cells, quick, last=quick):
                        out.append(Problem("frozen fp8 backward block", model.name, _where(kind, index, key, T),
                                           _experts_call(model, T, torch.bfloat16, weights="fp8", scheme="block",
                                                         fp8_dtype=fp8_dtype, fp8_compute="dequant", grad=True)))
    return out


def _gpt_oss_problems(table, quick):
    """MXFP4 weights and GPT-OSS's float layout at the buckets of the lists GPT-OSS-120B reads (its own, else the
    generic ones): general and decode (MXFP4 weights read the "mxfp4" section's decode entry, else the "fp8" one's);
    the float layout's backward at the general ones."""
    model = MODEL_SHAPES["gpt-oss-120b"]

    def own(section):
        return section.get("shapes", {}).get(_key(model), section["buckets"]) if section else []

    general = _ends(_bucket_tokens(own(table), model), quick)
    decode = [(T, f"decode bucket {i}") for T, i in _decode_tokens(own(table.get("decode")), model)]
    mxfp4_entry = "mxfp4" if "decode" in table.get("mxfp4", {}) else "fp8"  # as tiles.select_decode_tiles reads
    mxfp4_decode = [(T, f"{mxfp4_entry} decode bucket {i}")
                    for T, i in _decode_tokens(own(table.get(mxfp4_entry, {}).get("decode")), model)]
    general = [(T, f"bucket {i}") for T, i in general]
    out = []
    for T, why in general + decode:
        out.append(Problem("gpt-oss layout bf16", model.name, f"{why}, T={T}",
                           _experts_call(model, T, torch.bfloat16, gpt_oss=True)))
    for T, why in general + mxfp4_decode:
        out.append(Problem("mxfp4 bf16", model.name, f"{why}, T={T}",
                           _experts_call(model, T, torch.bfloat16, weights="mxfp4", gpt_oss=True)))
    for T, why in general[-1:] if quick else general:
        out.append(Problem("gpt-oss layout backward bf16", model.name, f"{why}, T={T}",
                           _experts_call(model, T, torch.bfloat16, gpt_oss=True, grad=True)))
        out.append(Problem("frozen mxfp4 backward bf16", model.name, f"{why}, T={T}",
                           _experts_call(model, T, torch.bfloat16, weights="mxfp4", gpt_oss=True, grad=True)))
    return out


def _router_problems(quick):
    """moe_router in each kind of routing (Mixtral's softmax, DeepSeek-V3's grouped sigmoid with a correction bias,
    GPT-OSS's biased softmax; DeepSeek-V3's alone with `quick`); the v1 functions (fused_moe_forward, grouped_gemm,
    expert_ffn_triton, permute_tokens, unpermute_tokens) at Qwen3-30B's shape."""
    out = []
    models = [MODEL_SHAPES["mixtral-8x7b"], MODEL_SHAPES["deepseek-v3"], MODEL_SHAPES["gpt-oss-120b"]]
    for model in models if not quick else models[1:2]:
        def run(arena, model=model):
            T, E, H = 256, model.num_experts, model.hidden
            x = torch.empty(T, H, dtype=torch.bfloat16)
            router = torch.empty(E, H, dtype=torch.bfloat16)
            bias = torch.empty(E, dtype=torch.bfloat16) if model.router_bias else None
            correction = torch.empty(E, dtype=torch.float32) if model.score_correction_bias else None
            moe_dispatch.moe_router(x, router, model.top_k, model.gating, router_bias=bias,
                                    e_score_correction_bias=correction, **model.routing_kwargs())
        out.append(Problem("router", model.name, "T=256", run))

    def v1(arena):
        model = MODEL_SHAPES["qwen3-30b-a3b"]
        T, E, H, F = 512, model.num_experts, model.hidden, model.ffn
        x = torch.empty(T, H, dtype=torch.bfloat16)
        router = torch.empty(E, H, dtype=torch.bfloat16)
        w_gate, w_up = arena.empty((E, F, H), torch.bfloat16), arena.empty((E, F, H), torch.bfloat16)
        w_down = arena.empty((E, H, F), torch.bfloat16)
        moe_dispatch.fused_moe_forward(x, router, w_gate, w_up, w_down, E, model.top_k,
                                       **model.routing_kwargs())
        rows = torch.empty(T * model.top_k, H, dtype=torch.bfloat16)
        offsets = torch.arange(E + 1, dtype=torch.int64) * (T * model.top_k // E)
        moe_dispatch.grouped_gemm(rows, w_gate, offsets, E, validate=False)
        moe_dispatch.expert_ffn_triton(rows, w_gate, w_up, w_down, offsets, E, validate=False)
        ids = torch.randint(0, E, (T, model.top_k))
        permuted, _, _, restore_idx = moe_dispatch.permute_tokens(x, ids, E, validate=False)
        moe_dispatch.unpermute_tokens(permuted, torch.empty(T, model.top_k, dtype=torch.bfloat16), restore_idx, T,
                                      model.top_k, validate=False)
    out.append(Problem("v1 functions", "qwen3-30b-a3b", "T=512", v1))
    return out


def _binned_problems(quick):
    """Binned routing (MegaBlocks' kernels) at Mixtral's width in bf16 (and fp32)."""
    def run(arena, dtype):
        T, H, E, top_k = 4096, 4096, 8, 2
        x = torch.empty(T, H, dtype=dtype)
        ids = torch.randint(0, E, (T * top_k,), dtype=torch.int32)
        bin_ids, indices = moe_dispatch.sort(ids, 3)
        counts = moe_dispatch.histogram(ids, E)
        bins = moe_dispatch.inclusive_cumsum(counts, 0)
        weights = torch.empty(T * top_k, dtype=dtype)
        capacity = moe_dispatch.expert_capacity(T, top_k, E, 1.25)
        buffer = moe_dispatch.binned_gather(x, indices, weights, bins, capacity, top_k, validate=False)
        moe_dispatch.binned_scatter(buffer, indices, weights, bins, top_k, validate=False)
        moe_dispatch.binned_scatter_wgrad(buffer, x, indices, bins, top_k, validate=False)
        rows = moe_dispatch.gather(x, indices, bin_ids, weights, bins, top_k, validate=False)
        moe_dispatch.scatter(rows, indices, bin_ids, weights, bins, top_k, validate=False)
        moe_dispatch.scatter_wgrad(rows, x, indices, bin_ids, bins, top_k, validate=False)
        padded_bins = bins  # the kernels read them as offsets; values do not matter here
        padded = moe_dispatch.padded_gather(x, indices, bin_ids, weights, bins, padded_bins, top_k, validate=False)
        moe_dispatch.padded_scatter(padded, indices, bin_ids, weights, bins, padded_bins, top_k, validate=False)
        moe_dispatch.padded_scatter_wgrad(padded, x, indices, bin_ids, bins, padded_bins, top_k, validate=False)

    return [Problem(f"binned {_dt(dtype)}", "mixtral-8x7b", "T=4096", lambda arena, dtype=dtype: run(arena, dtype))
            for dtype in ((torch.bfloat16,) if quick else (torch.bfloat16, torch.float32))]


def _ep_plan_problems(quick):
    """The expert-parallel plan's kernels (parallel/ep_plan.py) at 8 ranks, dropless and with a capacity, top_k 8 (and 2)."""
    def run(arena, top_k, capacity):
        T, W, E_local = 4096, 8, 32
        ids = torch.randint(0, W * E_local, (T, top_k))
        counts = ep_plan.count_rows(ids, W, E_local) if capacity is None else None
        if counts is not None:
            counts.copy_(torch.full((2 * W,), T, dtype=torch.int64))
        ep_plan.route_rows(ids, W, E_local, capacity, counts, W * (capacity or T))

    return [Problem("ep plan", f"W=8, top_k={top_k}", "dropless" if capacity is None else f"capacity {capacity}",
                    lambda arena, top_k=top_k, capacity=capacity: run(arena, top_k, capacity))
            for top_k in ((8,) if quick else (2, 8)) for capacity in (None, 1024)]


def capture(target: CompileTarget, quick=False):
    """The unique launches of `problems(target)` (a list of Launch), and the problems that raised (label, error)."""
    recorder = Recorder(target)
    arena = Arena()
    errors = []
    with _device.compile_target(target), recorder.active(), warnings_off():
        for problem in problems(target, quick):
            recorder.problem = problem.label()
            arena.reset()
            try:
                problem.run(arena)
            except Exception as error:  # noqa: BLE001 - a problem the host path refuses is reported, not fatal
                errors.append((problem.label(), f"{type(error).__name__}: {error}"))
    return list(recorder.launches.values()), errors


@contextlib.contextmanager
def warnings_off():
    """The package's warnings (frozen quantized weights, ...) say nothing here: the calls are not the user's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# -- compile -----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    """What the compiler made of one launch on one target."""

    name: str
    variant: str
    dtype: str = "-"  # of the first operand (`Launch.dtype`)
    constexprs: dict = dataclasses.field(default_factory=dict)
    registers: int | None = None  # per thread (NVIDIA) / VGPRs per lane (AMD)
    spills: int | None = None  # bytes of spill stores (NVIDIA) / spilled VGPRs + SGPRs (AMD)
    shared: int | None = None  # bytes of shared memory (LDS) per program
    seconds: float = 0.0
    error: str | None = None
    problems: tuple = ()


_JOBS = []  # (Launch, GPUTarget) of the current compile, read by forked workers by index


def _cuobjdump():
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _nvidia_usage(cubin):
    """(registers, spill bytes) from the cubin's resource usage: REG, and STACK + LOCAL (the bytes ptxas spills to;
    Triton's kernels keep no local arrays, so anything there is a spill)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    usage = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", text))
    return int(usage["REG"]), int(usage.get("STACK", 0)) + int(usage.get("LOCAL", 0))


def _amd_usage(amdgcn):
    """(VGPRs, spilled VGPRs + SGPRs, or scratch bytes where the counts say none) from the kernel's metadata."""
    fields = {key: int(value) for key, value in re.findall(
        r"\.(vgpr_count|vgpr_spill_count|sgpr_spill_count|private_segment_fixed_size):\s+(\d+)", amdgcn)}
    spills = fields.get("vgpr_spill_count", 0) + fields.get("sgpr_spill_count", 0)
    return fields.get("vgpr_count"), spills or fields.get("private_segment_fixed_size", 0)


def _result(launch):
    constexprs = {**launch.named_constexprs(), "num_warps": launch.options.num_warps,
                  "num_stages": launch.options.num_stages}
    return Result(launch.name, launch.describe(), launch.dtype(), constexprs, problems=tuple(launch.problems))


def _compile_one(index):
    launch, gpu_target = _JOBS[index]
    result = _result(launch)
    start = time.perf_counter()
    try:
        source = ASTSource(launch.kernel, launch.signature, launch.constexprs, launch.attrs)
        compiled = triton.compile(source, target=gpu_target, options=launch.options.__dict__)
        result.shared = compiled.metadata.shared  # what Triton's loader checks against the device's limit
        if gpu_target.backend == "cuda":
            result.registers, result.spills = _nvidia_usage(compiled.asm["cubin"])
        else:
            result.registers, result.spills = _amd_usage(compiled.asm["amdgcn"])
    except Exception as error:  # noqa: BLE001 - a compile error is a finding, reported with the launch
        lines = [line for line in str(error).splitlines() if line.strip()]  # Triton's cause comes last
        result.error = f"{type(error).__name__}: {lines[-1].strip() if lines else ''}"[:300]
    result.seconds = time.perf_counter() - start
    return result


def compile_all(launches, target: CompileTarget, jobs=1):
    """Compile every launch for `target` (`jobs` forked worker processes) -> list of Result, in launch order."""
    gpu_target = GPUTarget(target.backend, target.arch, target.warp_size)
    _JOBS[:] = [(launch, gpu_target) for launch in launches]
    try:
        if jobs <= 1:
            return [_compile_one(i) for i in range(len(_JOBS))]
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            return pool.map(_compile_one, range(len(_JOBS)), chunksize=1)
    finally:
        _JOBS.clear()


# -- check and report --------------------------------------------------------------------------------------------------


def failures(result: Result, target: CompileTarget):
    """What is wrong with one compiled launch on `target`: a compile error, spills, shared memory past the limit."""
    if result.error:
        return [f"compile error: {result.error}"]
    out = []
    if result.spills:
        out.append(f"spills {result.spills} {'bytes' if target.backend == 'cuda' else 'registers (or scratch bytes)'}")
    if result.shared > target.smem_per_program:
        out.append(f"shared memory {result.shared} > {target.smem_per_program} bytes")
    return out


def forbidden(launch: Launch, target: CompileTarget):
    """Why the planner must never make `launch` on `target`: tensor descriptors (TMA) before SM90 and on AMD, the
    w8a8 path's kernels (FP8 tensor cores) before SM89 and on AMD, PDL off Hopper."""
    hopper = target.backend == "cuda" and target.capability >= (9, 0)
    fp8_dots = target.backend == "cuda" and target.capability >= _device.FP8_MIN_CAPABILITY
    reasons = []
    if not hopper and any("tensordesc" in str(kind) for kind in launch.signature.values()):
        reasons.append("tensor descriptors (TMA)")
    if not fp8_dots and launch.name in W8A8_KERNELS:
        reasons.append("the w8a8 path (FP8 tensor cores)")
    if not hopper and getattr(launch.options, "launch_pdl", False):
        reasons.append("PDL")
    return reasons


W8A8_KERNELS = ("_w8a8_gemm_kernel", "_persistent_w8a8_gemm_kernel", "_quantize_rows_kernel")
GEMM_KERNELS = ("_grouped_gemm_kernel", "_persistent_grouped_gemm_kernel", "_down_grad_kernel", "_gate_up_grad_kernel")


@dataclasses.dataclass(frozen=True)
class Known:
    """A reviewed failure: the check accepts it and the report lists it with `why`. It covers the failures on
    `targets` that start with `failure`, of `kernels` (any when empty), with first operands of `dtype` (any when
    None), whose constexprs (and num_warps, num_stages) match every (name, value) of `where` (a tuple of values:
    any of them)."""

    why: str
    targets: tuple
    kernels: tuple = ()
    dtype: str | None = None
    where: tuple = ()
    failure: str = "spills"

    def covers(self, target_name, result: Result, what):
        def matches(name, value):
            have = result.constexprs.get(name)
            return have in value if isinstance(value, tuple) else have == value

        return (target_name in self.targets and what.startswith(self.failure)
                and (not self.kernels or result.name in self.kernels)
                and (self.dtype is None or result.dtype == self.dtype)
                and all(matches(name, value) for name, value in self.where))


ALL_TARGETS = tuple(TARGETS)
KNOWN = (
    Known("The backward of frozen quantized experts (block FP8, MXFP4; gradients for x and the routing weights) at "
          "the tables' forward tiles, which it borrows: its dX and dA GEMMs decode each weight tile in registers "
          "before the dot, 8-520 bytes at some buckets. Its tiles are not tuned (measured 1.37-1.93x the bf16 "
          "backward's time on an H100; docs/performance.md, \"Frozen quantized experts\"); the dX GEMM's BLOCK_N is "
          "capped at 128 on quantized weights, which removed the largest spills.", ALL_TARGETS,
          ("_gate_up_grad_kernel", "_down_grad_kernel"), where=(("WEIGHT_SCALE", (4, 6)),)),
    Known("fp32 operands: the dots run at input_precision \"ieee\", as FMA, whose operand slices and accumulator "
          "live in registers; the tables' tiles are sized for 2-byte operands (fp32 only halves BLOCK_K). fp32 is "
          "the exact path, not a tuned one.", ALL_TARGETS, GEMM_KERNELS, "fp32"),
    Known("MXFP4 weights: the e2m1 values and e8m0 scales of each weight tile are decoded in registers; the tiles "
          "are the tables' (the H200's `mxfp4` section tuned with them, docs/performance.md, \"MXFP4 experts\").",
          ALL_TARGETS, where=(("WEIGHT_SCALE", 5),)),
    Known("MXFP4 weights decoded by PTX (bf16 activations) at the tables' 64-row tiles under their register cap of 64 "
          "(4 programs an SM): 96-192 bytes; capped, they measured 1.38x faster than uncapped on an H100 with Triton "
          "3.6 (docs/performance.md, \"MXFP4 experts\").", ALL_TARGETS, ("_grouped_gemm_kernel",),
          where=(("WEIGHT_SCALE", 7), ("BLOCK_M", 64))),
    Known("H200, the forward of a training step (STORE_PREACT: the pre-activations stored for the backward) at the "
          "table's 64- and 128-row tiles: 16-128 bytes; the tiles were measured for inference, the training step was "
          "measured with them (docs/performance.md, \"Training\").", ("h200",),
          ("_grouped_gemm_kernel", "_persistent_grouped_gemm_kernel"), where=(("STORE_PREACT", True),)),
    Known("H200, float8 weights on the dequant path with per-tensor, per-channel or stepped block scales at three "
          "of the table's tiles: on the H200 \"auto\" takes the w8a8 path; the dequant path runs where it is forced "
          "or the block shape rules w8a8 out.", ("h200",), ("_grouped_gemm_kernel",),
          where=(("WEIGHT_SCALE", (1, 2, 4)),)),
    Known("H200 (the H100 reads its table), Mixtral-8x7B's one-token FP8 decode bucket: the gate/up GEMV at 32 x 128 "
          "(64 weight rows a program) with stepped block scales, 72 bytes under the pinned Triton; measured with Triton "
          "3.6 on an H100 1.15x faster than the dot kernel it replaced (168.5 -> 146.5 us; docs/performance.md, "
          "\"Decode: the GEMVs\").", ("h200",), ("_decode_gate_up_kernel",),
          where=(("GEMV", True), ("WEIGHT_SCALE", 4), ("BLOCK_N", 32), ("BLOCK_K", 128))),
    Known("H200 with Triton 3.6 (the GPU image's; none with the pinned Triton): the fp8 decode table's gate/up tile "
          "at BLOCK_K 256 on the dequant path with a per-tensor or per-channel scale: 8 bytes; the tile was measured "
          "with that Triton (scripts/tune --path decode --fp8).", ("h200",), ("_decode_gate_up_kernel",),
          where=(("GEMV", False), ("WEIGHT_SCALE", (1, 2)), ("BLOCK_K", 256))),
    Known("H200, Qwen3-30B's measured 32 x 128 x 128 tile (4 warps, 3 stages) in inference: 16 bytes; the winner by "
          "kernel time (scripts/tune).", ("h200",), ("_grouped_gemm_kernel",),
          where=(("BLOCK_M", 32), ("BLOCK_N", 128), ("BLOCK_K", 128), ("num_warps", 4), ("num_stages", 3))),
    Known("H200, GPT-OSS's interleaved gate/up rows in the persistent kernel (paired gate/up columns; 3-D weight "
          "descriptors for its transposed bf16 layout, and [E, 2F, H] for the buffer its MXFP4 weights are decoded "
          "into at prefill) at the 128-row tiles of its list: 8 bytes in inference.", ("h200",),
          ("_persistent_grouped_gemm_kernel",), where=(("PAIRED", True),)),
    Known("A100, dispatch/combine.py's 1024 columns per program with top_k 4 and no weights (GPT-OSS's H = 2880): 8 bytes; "
          "a launcher's choice, not a table's.", ("a100",), ("_combine_kernel",),
          where=(("BLOCK_H", 1024), ("TOP_K", 4))),
    Known("MI300X, dispatch/segments.py's rank of a 128-assignment chunk against 128 experts in registers ([CHUNK, BLOCK_E] "
          "one-hot: E 65-128, past the one-program dispatch): ~100 VGPRs; CHUNK is a launcher's choice, sized on "
          "NVIDIA.", ("mi300x",), ("_assign_positions_kernel",), where=(("BLOCK_E", 128),)),
    Known("MI300X, parallel/ep_plan.py's 1024 tokens per step (`_block_tokens`, one value for every GPU) with top_k 2-8: "
          "7-66 VGPRs; a launcher's choice, sized on NVIDIA.", ("mi300x",),
          ("_count_rows_kernel", "_route_rows_kernel"), where=(("BLOCK_T", 1024),)),
)


@dataclasses.dataclass
class TargetRun:
    """One target's capture and (unless capture only) compile."""

    name: str
    target: CompileTarget
    problems: int
    launches: list
    results: list
    capture_errors: list
    seconds: float

    def failed(self):
        """(result, what, Known or None) of every failure: compile errors, spills, shared memory past the limit,
        launches the target cannot run, calls the host path refused."""
        out = [(r, what) for r in self.results for what in failures(r, self.target)]
        out += [(_result(launch), f"never on this target: {why}") for launch in self.launches
                for why in forbidden(launch, self.target)]
        out += [(Result("(host path)", label, problems=(label,)), f"the call raised {error}")
                for label, error in self.capture_errors]
        return [(r, what, next((k for k in KNOWN if k.covers(self.name, r, what)), None)) for r, what in out]

    def new_failures(self):
        return [(r, what) for r, what, known in self.failed() if known is None]


def run_target(name, quick=False, jobs=1, compile=True):
    target = TARGETS[name]
    start = time.perf_counter()
    launches, errors = capture(target, quick)
    results = compile_all(launches, target, jobs) if compile else []
    return TargetRun(name, target, len(problems(target, quick)), launches, results, errors,
                     time.perf_counter() - start)


def _arch(target):
    return f"{target.backend}:{target.arch}"


def _table(target):
    return os.path.basename(tiles.table_path(target.key))


# What the lists leave out, and the tile tables' entries changed after a first run; written into every report.
FINDINGS = (
    "Not on the lists: float8 weights on the A100. Triton has no e4m3 type before SM89 (\"type fp8e4nv not "
    "supported in this architecture\" for every kernel that reads float8_e4m3fn weights, the dequant path's too), "
    "so `fused_experts` refuses them there naming the weight (`fp8.check_fp8_dtype_on_device`); the H200 reads "
    "e4m3fn, the MI300X e4m3fnuz. Changed after the first run, whose spills they were: the A100 table's bucket of "
    "5-16 rows per expert (BLOCK_K 128 with 3 stages -> 64 with 4: the down GEMM spilled where K is not a multiple "
    "of 128, GPT-OSS's F = 2880, and in fp32), and the MI300X table's BLOCK_K at up to 4 rows per expert (128 -> "
    "64) and in the down GEMM at 17-64 rows (64 -> 32), where float8 block-scaled weights spilled VGPRs.")


def report(runs, quick, command):
    """The Markdown report of `runs`."""
    lines = [
        "# Kernels compiled for each target",
        "",
        f"Written by `{command}` ([scripts/compile_report.py](../../scripts/compile_report.py)) with Triton "
        f"{triton.__version__} and torch {torch.__version__.split('+')[0]} on a machine without a GPU: every kernel "
        "specialization the public functions launch for the problems of a target's tile table, bound as Triton binds "
        "it for that target and compiled ahead of time for it "
        f"({'the CI list: the generic buckets' if quick else 'every bucket of every list'}; the script's `problems` "
        "says which calls). Registers are per thread (NVIDIA) or VGPRs per lane (AMD); spills are ptxas's spill "
        "bytes (NVIDIA) or spilled VGPRs and SGPRs (AMD); shared memory (LDS on AMD) is per program. A failure is a "
        "compile error, a spill, shared memory past the target's limit, or a launch the target cannot run (TMA and "
        "PDL before SM90, FP8 tensor cores before SM89); reviewed ones (the script's `KNOWN`, below) are accepted by "
        "`--check` and tests/test_targets.py, any other fails them.",
        "",
        "| target | Triton target | tile table | shared memory limit (bytes) | problems | kernels | variants "
        "| compile errors | spills | over the limit | reviewed failures | new failures | max registers "
        "| max shared memory | compile time |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        ok = [r for r in run.results if not r.error]
        failed = run.failed()
        lines.append(
            f"| {run.name} | {_arch(run.target)} | {_table(run.target)} | {run.target.smem_per_program} "
            f"| {run.problems} | {len({r.name for r in run.results})} | {len(run.results)} "
            f"| {sum(1 for r in run.results if r.error)} | {sum(1 for r in ok if r.spills)} "
            f"| {sum(1 for r in ok if r.shared > run.target.smem_per_program)} "
            f"| {sum(1 for *_, known in failed if known)} | {sum(1 for *_, known in failed if not known)} "
            f"| {max((r.registers or 0 for r in ok), default=0)} | {max((r.shared or 0 for r in ok), default=0)} "
            f"| {sum(r.seconds for r in run.results):.0f} s |")
    lines += ["", "Compile time is the sum over variants (one process each at a time; the script runs them on "
              "`--jobs` processes).", "", FINDINGS, "", "## Reviewed failures", ""]
    for number, known in enumerate(KNOWN, 1):
        counts = ", ".join(f"{run.name} {sum(1 for *_, k in run.failed() if k is known)}" for run in runs)
        lines.append(f"{number}. {known.why} (variants: {counts})")
    for run in runs:
        lines += ["", f"## {run.name}: {_arch(run.target)}, {_table(run.target)}", "",
                  "| kernel | variants | registers | variants with spills | shared memory (bytes) | compile errors |",
                  "|---|---|---|---|---|---|"]
        by_kernel = collections.defaultdict(list)
        for r in run.results:
            by_kernel[r.name].append(r)
        for name, results in sorted(by_kernel.items()):
            ok = [r for r in results if not r.error]
            lines.append(f"| `{name}` | {len(results)} | {_span(r.registers for r in ok)} "
                         f"| {sum(1 for r in ok if r.spills)} | {_span(r.shared for r in ok)} "
                         f"| {sum(1 for r in results if r.error)} |")
        failed = run.failed()
        lines += ["", f"Failures: {len(failed) or 'none'}."]
        if failed:
            lines += ["", "| kernel | failure | reviewed | variant | problems (first 2) |", "|---|---|---|---|---|"]
            for result, what, known in failed:
                problems_ = "; ".join(result.problems[:2]) + (f" (+{len(result.problems) - 2})"
                                                              if len(result.problems) > 2 else "")
                lines.append(f"| `{result.name}` | {what} | {KNOWN.index(known) + 1 if known else 'new'} "
                             f"| {_cell(result.variant)} | {_cell(problems_)} |")
    return "\n".join(lines) + "\n"


def _span(values):
    values = sorted(v for v in values if v is not None)
    if not values:
        return "-"
    return str(values[0]) if values[0] == values[-1] else f"{values[0]}-{values[-1]}"


def _cell(text):
    return str(text).replace("|", "\\|")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"comma list of {', '.join(TARGETS)}")
    parser.add_argument("--quick", action="store_true", help="the CI problem list: the tables' generic buckets")
    parser.add_argument("--capture-only", action="store_true",
                        help="capture the launches (the full list unless --quick), compile nothing; fail on launches "
                             "a target cannot run and on calls the host path refuses")
    parser.add_argument("--check", action="store_true", help="write no report; exit 1 on a failure not in KNOWN")
    parser.add_argument("--out", default=os.path.join(ROOT, REPORT), help="the Markdown report (default: %(default)s)")
    parser.add_argument("--json", help="also write the results as JSON here (tests/test_targets.py reads them)")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.targets.split(",") if name.strip()]
    unknown = [name for name in names if name not in TARGETS]
    if unknown:
        parser.error(f"unknown targets {unknown}; known: {', '.join(TARGETS)}")
    runs = []
    for name in names:
        run = run_target(name, args.quick, args.jobs, compile=not args.capture_only)
        runs.append(run)
        print(f"{name}: {run.problems} problems, {len(run.launches)} kernel variants, {len(run.failed())} failures "
              f"({len(run.new_failures())} new), {run.seconds:.0f} s", file=sys.stderr)
        for result, what, known in run.failed():
            print(f"  {'' if known else 'NEW '}{result.name}: {what} [{result.variant}] "
                  f"({'; '.join(result.problems[:2])})", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({run.name: {"target": dataclasses.asdict(run.target), "problems": run.problems,
                                  "launches": len(run.launches), "seconds": run.seconds,
                                  "results": [dataclasses.asdict(r) for r in run.results],
                                  "failures": [[r.name, what, r.variant, list(r.problems)]
                                               for r, what in run.new_failures()],
                                  "reviewed": [[r.name, what, r.variant, KNOWN.index(known) + 1]
                                               for r, what, known in run.failed() if known]}
                       for run in runs}, f, indent=1, default=str)
    if not args.check and not args.capture_only:
        command = "scripts/compile_report" + (" --quick" if args.quick else "")
        with open(args.out, "w") as f:
            f.write(report(runs, args.quick, command))
        print(f"wrote {os.path.relpath(args.out, ROOT)}", file=sys.stderr)
    return 1 if any(run.new_failures() for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
