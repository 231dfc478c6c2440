"""benchmarks/benchmark_moe.py in the Hub's benchmark convention (kernels 0.17.2 `kernels benchmark`), on the CPU.

A folder laid out like the Hub repo's release branch (build/ from scripts/build, benchmarks/) is handed to the
runner of the `kernels` package in a fresh process whose PYTHONPATH holds nothing of this repository: its discovery
(`discover_benchmark_scripts`) and its runner (`run_benchmark_script`, which loads the kernel with
`get_local_kernel`, runs every workload's setup, benchmark and verify methods and compares with torch.allclose),
with one iteration, through Triton's interpreter. The `kernels benchmark` command itself needs the `tabulate` package
(the `kernels[benchmark]` extra); that test runs where it imports. On the CPU both run the benchmark's quick mode
(MOE_DISPATCH_BENCH_QUICK=1: one workload per class, T = 2), the interpreter being slow; on a GPU every workload. The
full set of workloads is checked by discovery alone on the CPU. The baseline the runner times as "Ref" (its Speedup column)
is transformers' experts path and router in the kernel's dtype, not the float64 reference.
"""

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from helpers import DEVICE

import benchmark_moe

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {"FusedExperts.mixtral_decode", "FusedExperts.qwen3_prefill", "FusedMoeForward.mixtral_prefill",
             "FusedMoeForward.deepseek_v3_decode", "MoeRouter.qwen3_prefill", "MoeRouter.deepseek_v3_prefill"}
QUICK_WORKLOADS = {"FusedExperts.mixtral_decode", "FusedMoeForward.deepseek_v3_decode", "MoeRouter.qwen3_prefill"}
QUICK = DEVICE == "cpu"
RUN_WORKLOADS = QUICK_WORKLOADS if QUICK else WORKLOADS

RUNNER = """
import json, sys
from pathlib import Path
from kernels.cli.benchmark import discover_benchmark_scripts, run_benchmark_script

repo = Path(sys.argv[1])
report = {"scripts": [], "verified": {}}
for script in discover_benchmark_scripts(str(repo), repo):
    report["scripts"].append(script.relative_to(repo).as_posix())
    timings, _ = run_benchmark_script(script, iterations=1, warmup=0, cwd=repo, repo_id=str(repo), is_local=True,
                                      revision="local")
    report["verified"].update({name: timing.verified for name, timing in timings.items()})
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def hub_layout(tmp_path_factory) -> Path:
    """build/ (scripts/build) and benchmarks/ side by side, as on the release branch."""
    pytest.importorskip("kernels.cli.benchmark")  # the runner (and its imports: a GPU image may lack cryptography)
    repo = tmp_path_factory.mktemp("hub_layout")
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "build"), "--out", str(repo / "build")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    (repo / "benchmarks").symlink_to(ROOT / "benchmarks", target_is_directory=True)
    return repo


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LOCAL_KERNELS", "HF_TOKEN")}
    # PYTHONPATH keeps what the machine installed there (a GPU image's side packages), nothing of this repository
    outside = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
               if p and not Path(p).resolve().is_relative_to(ROOT)]
    if outside:
        env["PYTHONPATH"] = os.pathsep.join(outside)
    env.update(HF_HUB_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1", MOE_DISPATCH_BENCH_QUICK="1" if QUICK else "0")
    if DEVICE == "cpu":
        env["TRITON_INTERPRET"] = "1"
    env.update(extra)
    return env


def test_runner_discovers_runs_and_verifies_every_workload(hub_layout, tmp_path):
    result = subprocess.run([sys.executable, "-c", RUNNER, str(hub_layout)], capture_output=True, text=True,
                            env=_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["scripts"] == ["benchmarks/benchmark_moe.py"]
    assert report["verified"] == {name: True for name in RUN_WORKLOADS}


DISCOVER = """
import json, os, sys
from pathlib import Path
from kernels.cli.benchmark import discover_benchmark_classes

found = {}
for quick in ("0", "1"):  # the script is executed anew by each discovery, reading the variable
    os.environ["MOE_DISPATCH_BENCH_QUICK"] = quick
    classes = discover_benchmark_classes(Path(sys.argv[1]), Path(sys.argv[1]).parent)
    found[quick] = sorted(f"{cls.__name__}.{name[len('benchmark_'):]}" for cls in classes for name in dir(cls)
                          if name.startswith("benchmark_") and callable(getattr(cls, name)))
print(json.dumps(found))
"""


def test_the_runner_finds_every_workload_and_quick_mode_keeps_one_per_class(tmp_path):
    pytest.importorskip("kernels.cli.benchmark")
    result = subprocess.run([sys.executable, "-c", DISCOVER, str(ROOT / "benchmarks" / "benchmark_moe.py")],
                            capture_output=True, text=True, env=_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(found["0"]) == WORKLOADS and set(found["1"]) == QUICK_WORKLOADS


@pytest.mark.skipif(importlib.util.find_spec("tabulate") is None,
                    reason="`kernels benchmark` needs tabulate (the kernels[benchmark] extra), not installed here")
def test_kernels_benchmark_command_on_the_local_layout(hub_layout, tmp_path):
    command = "import sys; from kernels.cli import main; sys.argv[0] = 'kernels'; sys.exit(main())"
    result = subprocess.run([sys.executable, "-c", command, "benchmark", str(hub_layout), "--iterations", "1",
                             "--warmup", "0", "--output", str(tmp_path / "out.json")],
                            capture_output=True, text=True, env=_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads((tmp_path / "out.json").read_text())["results"]
    assert {r["workload"]: r.get("verified") for r in results} == {name: True for name in RUN_WORKLOADS}
    assert "Speedup" in result.stdout + result.stderr


class _WrongExperts:
    """moe_dispatch with fused_experts, or the fused_experts_ref it ships, off by 10% (past bf16's 2% tolerance on a
    GPU, float32's 1e-4 on the CPU): the verification, which takes its references from the kernel it benchmarks, must
    refuse either."""

    def __init__(self, wrong):
        self.wrong = wrong

    def fused_experts(self, *args, **kwargs):
        import moe_dispatch

        out = moe_dispatch.fused_experts(*args, **kwargs)
        return out * 1.1 if self.wrong == "kernel" else out

    @property
    def reference(self):
        from moe_dispatch import reference

        if self.wrong == "kernel":
            return reference
        return types.SimpleNamespace(assert_close=reference.assert_close,
                                     fused_experts_ref=lambda *args: reference.fused_experts_ref(*args) * 1.1)


@pytest.mark.parametrize("wrong", ["kernel", "shipped_reference"])
def test_verification_catches_a_wrong_kernel(monkeypatch, wrong):
    monkeypatch.setattr(benchmark_moe, "QUICK", QUICK)
    bench = benchmark_moe.FusedExperts()
    bench.kernel, bench.device = _WrongExperts(wrong), DEVICE
    torch.manual_seed(0)
    bench.setup_mixtral_decode()
    bench.benchmark_mixtral_decode()
    with pytest.raises(AssertionError, match="fused_experts: rms rel err"):
        bench.verify_mixtral_decode()


def test_the_baseline_is_transformers_in_the_kernels_dtype(monkeypatch):
    """verify_* returns (and the runner times) transformers' path in the output's dtype, close to the kernel's output;
    the float64 check runs once per output, not in every (timed) call."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    import moe_dispatch

    monkeypatch.setattr(benchmark_moe, "QUICK", QUICK)  # T = 2 on the CPU
    checks = []
    for cls, workload in ((benchmark_moe.FusedExperts, "mixtral_decode"),
                          (benchmark_moe.FusedMoeForward, "deepseek_v3_decode"),
                          (benchmark_moe.MoeRouter, "qwen3_prefill")):
        bench = cls()
        bench.kernel, bench.device = moe_dispatch, DEVICE
        torch.manual_seed(0)
        getattr(bench, f"setup_{workload}")()
        getattr(bench, f"benchmark_{workload}")()
        original = bench.checked
        bench.checked = lambda *args, _original=original: checks.append(cls) or _original(*args)
        baseline = getattr(bench, f"verify_{workload}")()
        getattr(bench, f"verify_{workload}")()
        assert baseline.dtype == bench.out.dtype and baseline.shape == bench.out.shape
        assert torch.allclose(bench.out, baseline, atol=1e-2), (cls, (bench.out - baseline).abs().max())
        if cls is not benchmark_moe.MoeRouter:
            assert bench._experts_function is ALL_EXPERTS_FUNCTIONS["grouped_mm"]
    assert checks == [benchmark_moe.FusedExperts, benchmark_moe.FusedMoeForward, benchmark_moe.MoeRouter]


def test_eager_baseline_matches_transformers():
    """The baseline where transformers does not import: transformers' eager loop, same result as its grouped_mm."""
    bench = benchmark_moe.FusedExperts()
    bench.kernel, bench.device = None, DEVICE
    torch.manual_seed(0)
    bench.setup_mixtral_decode()
    grouped = bench.baseline_experts(bench.topk_ids, bench.topk_weights)
    eager = benchmark_moe.eager_experts(bench.x, bench.w_gate_up, bench.w_down, bench.topk_ids, bench.topk_weights)
    # fp32 on the CPU: equal to rounding; bf16 on a GPU: the two sum in other orders (one bf16 step at these values)
    tight = grouped.dtype == torch.float32
    assert torch.allclose(grouped, eager, atol=1e-5 if tight else 1e-2, rtol=1e-4 if tight else 1e-2), (
        (grouped - eager).abs().max())
