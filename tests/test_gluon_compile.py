"""The Gluon GEMM (gemm/gluon_fp8.py) and its engine's passes compiled ahead of time for sm_90 (an H200), without the
GPU, by any Triton whose Gluon API they are written for (gluon_ws.COMPILED_TRITON, the CPU suite's pinned Triton and
the GPU machine's among them; skipped under any other).

Each launcher runs on CPU tensors with the availability check answering yes and Triton's launch replaced: the launch
is bound as Triton binds it for the target (signature, constexprs, alignment attributes, options: what a launch on
the GPU would compile), then compiled by `triton.compile` from a GluonASTSource, never run. Each variant (grouped
and dense, its 64 x 256 tile, the probe's stage counts, the gated GEMM1 with silu and with swiglu_oai and biases) must
compile without spills (ptxas's: the cubin's STACK and LOCAL bytes), without ptxas serializing its wgmma pipeline,
within the MAXNREG it is built for and within an H200 program's shared memory, and to the wgmma shape and the wait
its consumers are written for. The numbers are printed (`pytest -s`).

Every operand is a CPU tensor on any host, a GPU host included: nothing here runs a kernel.
"""

import os
import re
import subprocess
import sys
import types

import pytest
import torch
import triton
from helpers import INTERPRETED, offsets_of

from moe_dispatch.gemm import gluon_experts, gluon_fp8, gluon_mxfp4, gluon_mxfp4_decode, gluon_ws

H200_SMEM = 227 * 1024  # the opt-in maximum of shared memory per block (scripts/compile_report.py's H200 target)
pytestmark = pytest.mark.skipif(
    gluon_ws._GLUON_ERROR is not None or not triton.__version__.startswith(gluon_ws.COMPILED_TRITON),
    reason=f"Triton {triton.__version__}: the Gluon kernels are written for Triton {gluon_ws.COMPILED_TRITON}")


def _fp8_call(grouped, cfg=gluon_fp8.DEFAULT_CONFIG):
    a, a_scale = torch.zeros(1000, 1024, dtype=torch.float8_e4m3fn), torch.ones(1000, 8)
    b, b_scale = torch.zeros(4, 512, 1024, dtype=torch.float8_e4m3fn), torch.ones(4, 4, 8)
    if grouped:
        return lambda: gluon_fp8.fp8_block_grouped_gemm(a, a_scale, b, b_scale, offsets_of([300, 0, 400, 300], device="cpu"), cfg=cfg)
    return lambda: gluon_fp8.fp8_block_gemm(a, a_scale, b[0], b_scale[0], cfg=cfg)


def _fp8_gated_call(activation, bias):
    a, a_scale = torch.zeros(1000, 1024, dtype=torch.float8_e4m3fn), torch.ones(1000, 8)
    b, b_scale = torch.zeros(4, 2 * 768, 1024, dtype=torch.float8_e4m3fn), torch.ones(4, 12, 8)
    biases = dict(gate_bias=torch.zeros(4, 768), up_bias=torch.zeros(4, 768)) if bias else {}
    return lambda: gluon_fp8.fp8_block_gated_grouped_gemm(a, a_scale, b, b_scale, offsets_of([300, 0, 400, 300], device="cpu"),
                                                          activation=activation, **biases)


def _mxfp4_call(block_m, epilogue, form="split"):
    a, offsets = torch.zeros(1000, 2880, dtype=torch.bfloat16), offsets_of([300, 0, 400, 300], device="cpu")
    blocks, scales = torch.zeros(4, 5760, 1440, dtype=torch.uint8), torch.zeros(4, 5760, 90, dtype=torch.uint8)
    bias = torch.zeros(4, 5760, dtype=torch.bfloat16)
    args = {"plain": {}, "pairs": dict(bias=bias, activation="swiglu_oai"),
            "routed": dict(bias=bias, routing=(torch.zeros(1000, dtype=torch.int32), torch.zeros(250, 4)))}[epilogue]
    return lambda: gluon_mxfp4.mxfp4_grouped_gemm(a, blocks, scales, offsets, block_m=block_m, form=form, **args)


# (id, launcher call, its config, the wgmma the consumers issue, the wait that follows a K block's wgmma)
VARIANTS = [
    *[(f"fp8-gemm-{form}", (lambda g=grouped: _fp8_call(g)), gluon_fp8.DEFAULT_CONFIG,
       "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3", "wgmma.wait_group.sync.aligned 0;")
      for form, grouped in (("grouped", True), ("dense", False))],
    *[(f"fp8-gemm-{form}-rows64", (lambda g=grouped: _fp8_call(g, gluon_fp8.ROWS64_CONFIG)), gluon_fp8.ROWS64_CONFIG,
       "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3", "wgmma.wait_group.sync.aligned 0;")
      for form, grouped in (("grouped", True), ("dense", False))],
    # the probe's other tiles (benchmarks/gluon_fp8_probe.py): each must compile before a GPU run times it
    *[(f"fp8-gemm-dense-{stages}-stages", (lambda c=cfg: _fp8_call(False, c)), cfg,
       "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3", "wgmma.wait_group.sync.aligned 0;")
      for stages, cfg in ((3, gluon_fp8.GluonFp8Config(NUM_STAGES=3)), (5, gluon_fp8.GluonFp8Config(NUM_STAGES=5)))],
    *[(f"fp8-gated-{activation}{'-bias' if bias else ''}",
       (lambda act=activation, bias=bias: _fp8_gated_call(act, bias)),
       gluon_fp8.DEFAULT_CONFIG, "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3",
       "wgmma.wait_group.sync.aligned 0;") for activation, bias in (("silu", False), ("swiglu_oai", True))],
    # the MXFP4 GEMM at GPT-OSS-120B's GEMM1 widths, 64- and 128-row tiles, each epilogue: the decode of step i + 1
    # under the wgmma of step i (one left in flight)
    *[(f"mxfp4-grouped-{block_m}-rows-{epilogue}", (lambda b=block_m, e=epilogue: _mxfp4_call(b, e)),
       gluon_fp8.DEFAULT_CONFIG, "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",
       "wgmma.wait_group.sync.aligned 1;") for block_m in (64, 128) for epilogue in ("plain", "pairs", "routed")],
    # its swapped form (the decoded weights as the wgmma's register operand, m64 x 256 tokens; each step's wgmma
    # waited for, the two consumers overlapping), each epilogue
    *[(f"mxfp4-swap-{tokens}-tokens-{epilogue}", (lambda t=tokens, e=epilogue: _mxfp4_call(t, e, "swap")),
       gluon_fp8.DEFAULT_CONFIG, f"wgmma.mma_async.sync.aligned.m64n{tokens}k16.f32.bf16.bf16",
       "wgmma.wait_group.sync.aligned 0;")
      for tokens, epilogue in ((256, "plain"), (256, "pairs"), (256, "routed"))],
]


def _dispatch_stand_in(E=8, num_rows=4096, T=2048, top_k=2, block_m=128):
    """What the engine's passes read of a DispatchInfo (dispatch.segments), as untouched CPU tensors."""
    index = dict(dtype=torch.int32)
    return types.SimpleNamespace(tile_expert=torch.zeros(64, **index), tile_row_start=torch.zeros(64, **index),
                                 expert_offsets=torch.zeros(E + 1, **index), gather_idx=torch.zeros(num_rows, **index),
                                 num_experts=E, max_tiles=64, block_m=block_m, top_k=top_k, num_tokens=T)


def _pass_call(name):
    info, dtype = _dispatch_stand_in(), torch.bfloat16
    gate_up, bias = torch.zeros(4096, 2048, dtype=dtype), torch.zeros(8, 2048, dtype=dtype)
    calls = {
        "down-bias-routing-weight": lambda: gluon_experts._bias_routing_weight(
            torch.zeros(4096, 2048, dtype=dtype), info, bias, torch.zeros(2048, 2)),
        "fp8-concatenated-silu": lambda: gluon_experts._gated_activation_fp8(
            gate_up, info, interleaved=False, activation="silu", gate_bias=None, up_bias=None, alpha=1.702,
            limit=7.0),
        "fp8-interleaved-swiglu-bias": lambda: gluon_experts._gated_activation_fp8(
            gate_up, info, interleaved=True, activation="swiglu_oai", gate_bias=bias[:, 0::2], up_bias=bias[:, 1::2],
            alpha=1.702, limit=7.0),
    }
    return calls[name]


def _bound_launches(monkeypatch, call, target):
    """[(kernel, signature, constexprs, attrs, options)] of the launches `call()` makes, bound for `target`."""
    from triton import knobs
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = make_backend(target)
    launches = []

    def run(kernel, *args, grid, warmup, **kwargs):
        kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
        for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):  # what this Triton's launcher passes
            if hasattr(knobs.compilation, name):
                kwargs[name] = getattr(knobs.compilation, name)
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization,
                                                                  options)
        launches.append((kernel, signature, constexprs, attrs, options))

    with monkeypatch.context() as patch:
        patch.setattr(JITFunction, "run", run)
        patch.setattr(gluon_ws, "unavailable_reason", lambda device=None: None)
        call()
    return launches


def _resource_usage(cubin, tmp_path):
    """(registers, spill bytes) of the cubin: cuobjdump's REG, and STACK + LOCAL (where ptxas spills)."""
    from triton import knobs

    path = tmp_path / "kernel.cubin"
    path.write_bytes(cubin)
    text = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", str(path)], capture_output=True, text=True,
                          check=True).stdout
    usage = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", text))
    return int(usage["REG"]), int(usage.get("STACK", 0)) + int(usage.get("LOCAL", 0))


compiled_here = pytest.mark.skipif(INTERPRETED, reason="under the interpreter the kernels' Triton helpers are "
                                   "interpreted functions, which Gluon cannot compile: "
                                   "test_compiles_in_a_process_that_does_not_interpret runs this file again")


@pytest.mark.skipif(not INTERPRETED, reason="this process compiles the kernels itself")
def test_compiles_in_a_process_that_does_not_interpret():
    """The CPU suite interprets Triton (conftest), so this file's compile tests run again in a fresh pytest process
    with TRITON_INTERPRET=0: every variant and pass must pass there."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-m", "pytest", os.path.abspath(__file__), "-q", "-p", "no:cacheprovider"],
                            env=dict(os.environ, TRITON_INTERPRET="0"), cwd=root, capture_output=True, text=True,
                            timeout=600)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, f"{summary}\n{result.stdout[-4000:]}\n{result.stderr[-2000:]}"
    expected = len(VARIANTS) + len(PASSES) + len(DECODE_MMA)  # and this test, skipped there
    assert re.match(rf"{expected} passed, 1 skipped\b", summary), summary


@compiled_here
@pytest.mark.parametrize("variant", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_compiles_for_sm90(variant, monkeypatch, tmp_path, capfd):
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    name, make_call, cfg, wgmma, wait = variant
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))  # a cold compile, nothing left behind
    target = GPUTarget("cuda", 90, 32)
    # the grouped forms launch the tile map's Triton kernel first (dispatch.segments), then the Gluon GEMM
    launches = [launch for launch in _bound_launches(monkeypatch, make_call(), target)
                if isinstance(launch[0], GluonJITFunction)]
    assert len(launches) == 1, launches
    kernel, signature, constexprs, attrs, options = launches[0]
    capfd.readouterr()
    monkeypatch.setattr(knobs.nvidia, "dump_ptxas_log", True)
    compiled = triton.compile(GluonASTSource(kernel, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    ptxas_log = capfd.readouterr().out
    # ptxas serializes the wgmma pipeline (C7514) where a non-wgmma instruction reads the accumulator registers of a
    # wgmma while one is in flight, e.g. promoting one K block's partial sum under the next block's wgmma: the
    # consumers' overlap would then be silently lost.
    assert "wgmma" in ptxas_log or "Used" in ptxas_log, f"{name}: no ptxas log captured:\n{ptxas_log[:500]}"
    assert "serialized" not in ptxas_log, f"{name}: ptxas serializes the wgmma pipeline:\n{ptxas_log}"
    registers, spills = _resource_usage(compiled.asm["cubin"], tmp_path)
    shared = compiled.metadata.shared
    print(f"\n{name}: {kernel.fn.__name__} registers {registers} (MAXNREG {cfg.MAXNREG}), spills {spills} bytes, "
          f"shared memory {shared} bytes")
    assert spills == 0, f"{name}: ptxas spills {spills} bytes"
    assert registers <= cfg.MAXNREG
    assert shared <= H200_SMEM, f"{name}: {shared} bytes of shared memory > {H200_SMEM}"
    ptx = compiled.asm["ptx"]
    assert wgmma in ptx and wait in ptx, f"{name}: not the consumers' wgmma ({wgmma}) and wait ({wait})"
    assert "setmaxnreg.dec.sync.aligned.u32 \t24;" in ptx  # the producer's registers given back


PASSES = ["down-bias-routing-weight", "fp8-concatenated-silu", "fp8-interleaved-swiglu-bias"]


def _decode_mma_call(kernel, num_warps, T=16, top_k=4):
    """The decode path's MXFP4 mma.sync kernels (gemm/gluon_mxfp4_decode.py) at GPT-OSS-120B's widths."""
    E, H, F = 128, 2880, 2880
    x, inter = torch.zeros(T, H, dtype=torch.bfloat16), torch.zeros(T * top_k, F, dtype=torch.bfloat16)
    w, s = torch.zeros(E, 2 * F, H // 2, dtype=torch.uint8), torch.zeros(E, 2 * F, H // 32, dtype=torch.uint8)
    bias, ids = torch.zeros(E, 2 * F, dtype=torch.bfloat16), torch.zeros(T, top_k, dtype=torch.int32)
    counters = torch.zeros(T * 64, dtype=torch.int32)
    if kernel == "gate-up":
        views = gluon_mxfp4_decode.gate_up_views(w, None, s, 0, bias, None, True)
        return lambda: gluon_mxfp4_decode.gate_up_mma(x, *views, inter, ids, counters, activation="swiglu_oai",
                                                      alpha=1.702, limit=7.0, num_warps=num_warps)
    w_down, s_down = torch.zeros(E, H, F // 2, dtype=torch.uint8), torch.zeros(E, H, F // 32, dtype=torch.uint8)
    return lambda: gluon_mxfp4_decode.down_mma(inter, w_down, s_down, torch.zeros(E, H, dtype=torch.bfloat16), ids,
                                               torch.zeros(T, top_k), torch.zeros(T * top_k, H), counters,
                                               torch.zeros(T, H, dtype=torch.bfloat16), num_warps=num_warps)


DECODE_MMA = [(kernel, warps) for kernel in ("gate-up", "down") for warps in (1, 4)]


@compiled_here
@pytest.mark.parametrize("kernel,num_warps", DECODE_MMA, ids=[f"{k}-{w}-warps" for k, w in DECODE_MMA])
def test_decode_mma_kernels_compile_for_sm90(kernel, num_warps, monkeypatch, tmp_path):
    """Each decode kernel on mma.sync: without spills, m16n8k16 bf16 MMAs, and the weights' 16 bytes of a lane as
    one 128-bit load (their decode needs no trip through shared memory)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gluon_mxfp4_decode, "available", lambda device=None: True)
    target = GPUTarget("cuda", 90, 32)
    (fn, signature, constexprs, attrs, options), = _bound_launches(monkeypatch, _decode_mma_call(kernel, num_warps),
                                                                   target)
    compiled = triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    registers, spills = _resource_usage(compiled.asm["cubin"], tmp_path)
    ptx = compiled.asm["ptx"]
    print(f"\ndecode {kernel}, {num_warps} warps: registers {registers}, spills {spills} bytes, shared memory "
          f"{compiled.metadata.shared} bytes")
    assert spills == 0
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    assert "ld.global.v4.b32" in ptx


@compiled_here
@pytest.mark.parametrize("name", PASSES)
def test_engine_passes_compile_for_sm90(name, monkeypatch, tmp_path):
    """The engine's elementwise passes (gemm/gluon_experts.py) at the engine's tiles: without spills and within the
    shared memory. They launch only where the engine runs, so scripts/compile_report never reaches them."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    target = GPUTarget("cuda", 90, 32)
    (kernel, signature, constexprs, attrs, options), = _bound_launches(monkeypatch, _pass_call(name), target)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)
    registers, spills = _resource_usage(compiled.asm["cubin"], tmp_path)
    print(f"\n{name}: {kernel.fn.__name__} registers {registers}, spills {spills} bytes, shared memory "
          f"{compiled.metadata.shared} bytes")
    assert spills == 0 and compiled.metadata.shared <= H200_SMEM
