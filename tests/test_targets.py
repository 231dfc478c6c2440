"""The GPUs the package is written for, on a machine without them: A100 (cuda:80), H200 (cuda:90), MI300X (hip:gfx942).

- Every kernel specialization the public functions launch for a target's problems compiles for it, without spills
  beyond the reviewed ones and within its shared memory (scripts/compile_report.py, in a fresh process: Triton
  compiles there, this one interprets). CI runs the reduced lists (`--quick`: the tables' generic buckets), the
  A100's and the MI300X's here, the H200's in tests/test_targets_h200.py (each file within its time budget);
  MOE_DISPATCH_COMPILE_TARGETS (a comma list, default all three) picks the targets, MOE_DISPATCH_COMPILE_ALL=1 runs
  every bucket of every list, what `scripts/compile_report` writes to docs/results/compile-targets.md (minutes a
  target: with MOE_DISPATCH_FILE_BUDGET_S=0).
- The paths a target cannot run are never planned there, over every problem of the full list (capture only, no
  compile): tensor descriptors (TMA) and PDL before SM90 and on AMD, FP8 tensor-core dots before SM89 and on AMD.
- The planner's decisions under each target's device facts (`host.device.compile_target`), in this process; float8_e4m3fn
  weights, which Triton cannot load before SM89, are refused on the A100 naming the weight.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from moe_dispatch import fused_experts
from moe_dispatch.formats import fp8
from moe_dispatch.gemm import planner
from moe_dispatch.gemm.args import gemm_weights
from moe_dispatch.host import device as _device, pdl, tiles
from moe_dispatch.host.device import CompileTarget
from moe_dispatch.host.tiles import GemmTile, Persistent

SCRIPT = os.path.join(ROOT, "scripts", "compile_report.py")
TARGETS = ("a100", "h200", "mi300x")
# The script's targets, spelled here too (this process cannot import it: it needs Triton's compiled mode); the
# capture test checks they are the same.
A100 = CompileTarget("NVIDIA_A100", "cuda", 80, 32, num_sms=108, smem_per_program=163 * 1024)
H200 = CompileTarget("NVIDIA_H200", "cuda", 90, 32, num_sms=132, smem_per_program=227 * 1024)
MI300X = CompileTarget("AMD_Instinct_MI300X", "hip", "gfx942", 64, num_sms=304, smem_per_program=64 * 1024)
ALL = os.environ.get("MOE_DISPATCH_COMPILE_ALL", "0") not in ("", "0")
COMPILED = [name.strip() for name in os.environ.get("MOE_DISPATCH_COMPILE_TARGETS", ",".join(TARGETS)).split(",")
            if name.strip()]


def _run_script(*args, tmp_path):
    """scripts/compile_report.py with `args` in a fresh process -> (exit status, its JSON results, its stderr)."""
    out = tmp_path / "results.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(os.path.join(ROOT, d) for d in ("scripts", "benchmarks",
                                                                                        "torch-ext"))}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, SCRIPT, "--check", "--json", str(out), *args], env=env,
                            capture_output=True, text=True, timeout=2400)
    assert out.exists(), result.stderr[-4000:]
    return result.returncode, json.loads(out.read_text()), result.stderr


def compile_check(name, tmp_path):
    """The check of one target: its CI list (every list and bucket with MOE_DISPATCH_COMPILE_ALL=1) compiled with no
    compile error, no spill beyond the script's reviewed `KNOWN` ones, shared memory within the target's limit and no
    launch the target cannot run; every kernel family the list reaches is there."""
    if name not in COMPILED:
        pytest.skip(f"MOE_DISPATCH_COMPILE_TARGETS={','.join(COMPILED)} leaves {name} out")
    status, results, stderr = _run_script("--targets", name, "-j", "2", *(() if ALL else ("--quick",)),
                                          tmp_path=tmp_path)
    run = results[name]
    assert not run["failures"], "\n".join(f"{kernel}: {what} [{variant}] ({'; '.join(problems[:2])})"
                                          for kernel, what, variant, problems in run["failures"])
    assert status == 0, stderr[-4000:]
    kernels = {r["name"] for r in run["results"]}
    common = {"_grouped_gemm_kernel", "_decode_gate_up_kernel", "_dispatch_single_kernel", "_combine_kernel",
              "_down_grad_kernel", "_gate_up_grad_kernel", "_expert_weight_grad_kernel", "_topk_gating_kernel",
              "_gather_kernel", "_route_rows_kernel"}
    assert common <= kernels, common - kernels
    hopper = {"_persistent_grouped_gemm_kernel", "_w8a8_gemm_kernel", "_persistent_w8a8_gemm_kernel"}
    assert hopper <= kernels if name == "h200" else not hopper & kernels
    assert all(r["registers"] for r in run["results"] if not r["error"])


@pytest.mark.parametrize("name", ["a100", "mi300x"])
def test_every_launch_compiles_for_the_target(name, tmp_path):
    """The A100's and the MI300X's lists (the H200's: tests/test_targets_h200.py, a test file's time budget alone)."""
    compile_check(name, tmp_path)


def test_no_target_is_planned_a_path_it_cannot_run(tmp_path):
    """Every problem of the full list on every target, captured (bound for the target, not compiled): no TMA, PDL or
    w8a8 launch where the target lacks them, and every call passes the host path."""
    status, results, stderr = _run_script("--capture-only", tmp_path=tmp_path)
    assert set(results) == set(TARGETS)
    for name, target in zip(TARGETS, (A100, H200, MI300X)):
        assert results[name]["target"] == dataclasses.asdict(target), name  # the script's targets are these
    for name, run in results.items():
        assert not run["failures"], (name, run["failures"][:5])
        assert run["launches"] > 100, (name, run["launches"])
    assert status == 0, stderr[-4000:]


# -- the planner under each target's device facts ----------------------------------------------------------------------


@pytest.fixture(params=[A100, H200, MI300X], ids=TARGETS)
def target(request):
    with _device.compile_target(request.param):
        yield request.param
    assert _device.device_key(torch.device("cpu")) == "interpreter"  # the CPU's facts are back


def _operands(E=8, N=256, K=512, rows=64, dtype=torch.bfloat16):
    a = torch.empty(rows, K, dtype=dtype)
    weight = torch.empty(E, N, K, dtype=dtype)
    return a, gemm_weights(weight, None, None, None, transposed=False, activation="none")


def test_device_facts_are_the_targets(target):
    cpu = torch.device("cpu")
    hopper = target is H200
    assert _device.on_gpu(cpu) and _device.kernels_run_on(cpu) and not _device.is_interpreter()
    assert _device.is_hip() == (target is MI300X) and _device.is_cuda() == (target is not MI300X)
    assert _device.has_tma(cpu) == hopper and _device.has_wgmma(cpu) == hopper
    assert _device.has_fp8_tensor_cores(cpu) == hopper
    assert pdl.pdl_enabled(cpu) == hopper
    assert _device.device_key(cpu) == target.key and tiles.load_table(target.key)["device"] == target.key
    assert _device.fp8_dtype(cpu) == (torch.float8_e4m3fnuz if target is MI300X else torch.float8_e4m3fn)


@pytest.mark.parametrize("gather_a", [False, True])
def test_descriptor_kernels_only_on_hopper(target, gather_a):
    """A tile asking for the persistent TMA kernel gets it on the H200 only; elsewhere the pointer kernel."""
    a, w = _operands()
    tile = GemmTile(128, 64, num_warps=8, num_stages=3, persistent=Persistent.ON)
    kernel = planner.expert_gemm_kernel(a, w, tile, transposed=False, gather_a=gather_a, weight_scale=None)
    assert kernel == (planner.GemmKernel.PERSISTENT if target is H200 else planner.GemmKernel.POINTER)
    weight_tile = tiles.PERSISTENT_WEIGHT_GRAD_TILE
    assert planner.weight_grad_kernel(a, a, torch.empty(8, 512, 512), weight_tile) == (target is H200)
    assert tiles.select_weight_grad_tile(torch.device("cpu"), torch.bfloat16, 4096).persistent == (target is H200)


def test_fp8_tensor_cores_only_on_hopper(target):
    """fp8_compute="auto" takes w8a8 on the H200 only; a forced "w8a8" elsewhere raises saying why; the w8a8 GEMM's
    variants that need wgmma (operands swapped) or TMA (persistent) are the H200's alone."""
    cpu = torch.device("cpu")
    w = torch.empty(8, 256, 512, dtype=torch.float8_e4m3fn)
    choose = lambda choice: planner.choose_fp8_compute(choice, cpu, w, w, ("block",), (128, 128), False)  # noqa: E731
    assert choose("auto") == ("w8a8" if target is H200 else "dequant")
    if target is H200:
        assert choose("w8a8") == "w8a8"
    else:
        with pytest.raises(ValueError, match="no FP8 tensor cores|w8a8 runs"):
            choose("w8a8")
    a = torch.empty(64, 512, dtype=torch.float8_e4m3fn)
    weights = gemm_weights(w, None, None, None, transposed=False, activation="none")
    small = planner.w8a8_gemm_kernel(a, weights, GemmTile(64, 128), block_m=16, transposed=False, gather_a=False)
    large = planner.w8a8_gemm_kernel(a, weights, GemmTile(128, 128, persistent=Persistent.ON), block_m=128,
                                     transposed=False, gather_a=False)
    assert (small, large) == ((planner.GemmKernel.POINTER_SWAPPED, planner.GemmKernel.PERSISTENT) if target is H200
                              else (planner.GemmKernel.POINTER, planner.GemmKernel.POINTER))


def test_hopper_only_stages_of_the_input_gradient(target):
    """The dA GEMM's extra stages (tiles.DOWN_GRAD_STAGES) are Hopper's; elsewhere the forward's tile."""
    tile = GemmTile(128, 64, num_warps=8, num_stages=3)
    chosen = tiles.select_down_grad_tile(torch.device("cpu"), tile, 128, 2)
    assert chosen.num_stages == (tiles.DOWN_GRAD_STAGES if target is H200 else tile.num_stages)


def test_e4m3fn_weights_are_refused_before_sm89():
    """Triton has no e4m3 type before SM89 ("type fp8e4nv not supported in this architecture" for every kernel that
    loads one): float8_e4m3fn weights are refused on the A100 naming the weight, before any launch; the H200 and the
    CPU take them, and MI300X takes its own e4m3fnuz."""
    E, F, H, T = 4, 64, 64, 2
    x = torch.randn(T, H, dtype=torch.bfloat16)
    w_gate_up, w_down = (torch.randn(E, 2 * F, H) * 0.1, torch.randn(E, H, F) * 0.1)
    (q1, s1), (q2, s2) = (fp8.quantize_experts_fp8(w, "channel") for w in (w_gate_up, w_down))
    ids, weights = torch.randint(0, E, (T, 2)), torch.rand(T, 2)
    with _device.compile_target(A100), pytest.raises(TypeError, match="w_gate_up is torch.float8_e4m3fn.*8.9"):
        fused_experts(x, q1, q2, ids, weights, w_gate_up_scale=s1, w_down_scale=s2, validate=False)
    cpu, fnuz = torch.device("cpu"), q1.to(torch.float8_e4m3fnuz)
    fp8.check_fp8_dtype_on_device("w", q1, cpu)  # the interpreter loads both
    fp8.check_fp8_dtype_on_device("w", fnuz, cpu)
    with _device.compile_target(H200):
        fp8.check_fp8_dtype_on_device("w", q1, cpu)
        with pytest.raises(TypeError, match="AMD's float8 format"):
            fp8.check_fp8_dtype_on_device("w", fnuz, cpu)
    with _device.compile_target(MI300X):
        fp8.check_fp8_dtype_on_device("w", fnuz, cpu)
