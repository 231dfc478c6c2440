#!/usr/bin/env python3
"""Registers, spills, shared memory and code size of the kernels one forward launches on an H200, found on a CPU.

`fused_experts` runs on CPU tensors of a model's real shapes (allocated, never touched) with the package believing it
is on an H200 (its tile table, TMA, PDL, 132 SMs, 227 KB of shared memory per program); every kernel launch is caught
and, instead of running, compiled for sm_90 the way Triton's JIT would compile it there: the same binder specializes
the arguments (integers equal to 1 become constants, multiples of 16 and 16-byte aligned pointers are marked), then
`triton.compile` and `cuobjdump -res-usage` on the cubin. No GPU is needed; launches do nothing, outputs are garbage.

Use the Triton of the GPU image (3.6) for numbers that match the H200's kernels: code generation differs between
Triton versions. For example:

    pip install --target "$HOME/triton36" --no-deps triton==3.6.0
    PYTHONPATH="$HOME/triton36:$PYTHONPATH" scripts/kernel_resources.py --cells qwen3-30b-a3b:4096,qwen3-30b-a3b:4

Prints one line per distinct compiled kernel (registers per thread, spill bytes, shared memory, SASS instructions)
and writes OUT/resources.json with --out. Use it to screen tiles before spending GPU time: a candidate whose shared
memory exceeds 232448 bytes will not launch, and spills show up as STACK / LOCAL bytes (docs/performance.md,
"Issue 12, v7").
"""

import argparse
import contextlib
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from model_shapes import MODEL_SHAPES  # benchmarks/ is on PYTHONPATH (scripts/_env.sh)

H200 = {"key": "NVIDIA_H200", "capability": 90, "sms": 132, "smem_per_program": 232448}
_TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def resource_usage(cubin: bytes) -> dict:
    """{"registers", "stack", "local", "static_shared", "sass_instructions"} of a one-kernel cubin (cuobjdump)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_TOOLS / "cuobjdump", "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([_TOOLS / "cuobjdump", "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    return {"registers": int(fields.get("REG", 0)), "stack": int(fields.get("STACK", 0)),
            "local": int(fields.get("LOCAL", 0)), "static_shared": int(fields.get("SHARED", 0)),
            "sass_instructions": len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, flags=re.M))}


class CompileOnly:
    """Replaces `JITFunction.run` while active: each launch is compiled for `target` (as the JIT would: same binder,
    same argument packing) and recorded once per distinct kernel; nothing runs."""

    def __init__(self, target: GPUTarget):
        self.target = target
        self.backend = make_backend(target)
        self.records = {}

    def run(self, kernel, args, kwargs):
        binder = create_function_from_signature(kernel.signature, kernel.params, self.backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(self.backend, kwargs, bound_args, specialization,
                                                                  options)
        key = (kernel.__name__, str(sorted(constexprs.items())), str(signature), str(options))
        if key in self.records:
            return
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=self.target,
                                  options=options.__dict__)
        names = [p.name for p in kernel.params]
        meta = {names[path[0]]: value for path, value in constexprs.items()
                if len(path) == 1 and names[path[0]].isupper()}
        self.records[key] = {"kernel": kernel.__name__, "num_warps": options.num_warps,
                             "num_stages": options.num_stages, "constexprs": meta,
                             "shared": compiled.metadata.shared, **resource_usage(compiled.asm["cubin"])}

    @contextlib.contextmanager
    def active(self):
        real = JITFunction.run
        JITFunction.run = lambda kernel, *args, grid, warmup, **kwargs: self.run(kernel, args, kwargs)
        try:
            yield self
        finally:
            JITFunction.run = real


@contextlib.contextmanager
def as_h200():
    """The package's device facts as on an H200 (tile table, TMA, PDL, SMs, shared memory), for CPU tensors."""
    from moe_dispatch import _device, decode, pdl, persistent_gemm, planner, tiles

    patches = [(_device, "kernels_run_on", lambda device: True),  # CPU tensors, compiled for the GPU
               (tiles, "device_key", lambda device: H200["key"]),
               (planner, "has_tma", lambda device: True),  # the planner chooses the persistent kernels
               (persistent_gemm, "INTERPRETER_PROGRAMS", H200["sms"]),
               (pdl, "pdl_enabled", lambda device: True),
               (decode, "smem_per_program", lambda device: H200["smem_per_program"])]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def cell_kernels(name, num_tokens, seed=0):
    """The compiled kernels of one `fused_experts` call at (model, T) on an H200, as `CompileOnly` records them."""
    import moe_dispatch as md

    shape = MODEL_SHAPES[name]
    E, H, F, top_k = shape.num_experts, shape.hidden, shape.ffn, shape.top_k
    gen = torch.Generator().manual_seed(seed)
    x = torch.empty(num_tokens, H, dtype=torch.bfloat16)
    w_gate_up = torch.empty(E, 2 * F, H, dtype=torch.bfloat16)  # never touched: the pages are not even mapped
    w_down = torch.empty(E, H, F, dtype=torch.bfloat16)
    topk_ids = torch.rand(num_tokens, E, generator=gen).argsort(dim=1)[:, :top_k]
    topk_weights = torch.full((num_tokens, top_k), 1.0 / top_k)
    compiler = CompileOnly(GPUTarget("cuda", H200["capability"], 32))
    with as_h200(), compiler.active():
        md.fused_experts(x, w_gate_up, w_down, topk_ids, topk_weights, validate=False)
    return list(compiler.records.values())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cells", required=True, help="comma list of model:T")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not the interpreter
    print(f"triton {triton.__version__} (the H200 image has 3.6)", flush=True)
    results = []
    for cell in args.cells.split(","):
        name, t = cell.split(":")
        for record in cell_kernels(name, int(t)):
            results.append({"model": name, "tokens": int(t), **record})
            blocks = " ".join(f"{k}={v}" for k, v in record["constexprs"].items() if k.startswith("BLOCK"))
            print(f"{name:16s} T={t:<6s} {record['kernel']:34s} {blocks:38s} w{record['num_warps']} "
                  f"s{record['num_stages']}  regs {record['registers']:3d}  spill {record['stack'] + record['local']:4d} B"
                  f"  smem {record['shared']:6d} B  sass {record['sass_instructions']}", flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "resources.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
