"""benchmarks/benchmark_moe.py in the Hub's benchmark convention (kernels 0.17.2 `kernels benchmark`), on the CPU.

A folder laid out like the Hub repo's release branch (build/ from scripts/build, benchmarks/) is handed to the
runner of the `kernels` package in a fresh process whose PYTHONPATH holds nothing of this repository: its discovery
(`discover_benchmark_scripts`) and its runner (`run_benchmark_script`, which loads the kernel with
`get_local_kernel`, runs every workload's setup, benchmark and verify methods and compares with torch.allclose),
with one iteration, through Triton's interpreter. The `kernels benchmark` command itself needs the `tabulate` package
(the `kernels[benchmark]` extra), which requirements.txt does not pin; that test runs where it imports.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import DEVICE

import benchmark_moe

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {"FusedExperts.mixtral_decode", "FusedExperts.qwen3_prefill", "FusedMoeForward.mixtral_prefill",
             "FusedMoeForward.deepseek_v3_decode", "MoeRouter.qwen3_prefill", "MoeRouter.deepseek_v3_prefill"}

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


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LOCAL_KERNELS", "HF_TOKEN")}
    # PYTHONPATH keeps what the machine installed there (a GPU image's side packages), nothing of this repository
    outside = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
               if p and not Path(p).resolve().is_relative_to(ROOT)]
    if outside:
        env["PYTHONPATH"] = os.pathsep.join(outside)
    env.update(HF_HUB_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    if DEVICE == "cpu":
        env["TRITON_INTERPRET"] = "1"
    return env


def test_runner_discovers_runs_and_verifies_every_workload(hub_layout, tmp_path):
    result = subprocess.run([sys.executable, "-c", RUNNER, str(hub_layout)], capture_output=True, text=True,
                            env=_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["scripts"] == ["benchmarks/benchmark_moe.py"]
    assert report["verified"] == {name: True for name in WORKLOADS}


@pytest.mark.skipif(importlib.util.find_spec("tabulate") is None,
                    reason="`kernels benchmark` needs tabulate (the kernels[benchmark] extra), not installed here")
def test_kernels_benchmark_command_on_the_local_layout(hub_layout, tmp_path):
    command = "import sys; from kernels.cli import main; sys.argv[0] = 'kernels'; sys.exit(main())"
    result = subprocess.run([sys.executable, "-c", command, "benchmark", str(hub_layout), "--iterations", "1",
                             "--warmup", "0", "--output", str(tmp_path / "out.json")],
                            capture_output=True, text=True, env=_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    workloads = {r["workload"]: r.get("verified") for r in json.loads((tmp_path / "out.json").read_text())["results"]}
    assert workloads == {name: True for name in WORKLOADS}


class _WrongExperts:
    """moe_dispatch with fused_experts off by 10% (past bf16's 2% tolerance on a GPU, float32's 1e-4 on the CPU): the
    verification must refuse it."""

    def fused_experts(self, *args, **kwargs):
        import moe_dispatch

        return moe_dispatch.fused_experts(*args, **kwargs) * 1.1


def test_verification_catches_a_wrong_kernel():
    bench = benchmark_moe.FusedExperts()
    bench.kernel, bench.device = _WrongExperts(), DEVICE
    torch.manual_seed(0)
    bench.setup_mixtral_decode()
    bench.benchmark_mixtral_decode()
    with pytest.raises(AssertionError, match="fused_experts: rms rel err"):
        bench.verify_mixtral_decode()
