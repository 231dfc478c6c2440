"""benchmarks/mxfp4_dot_scaled_probe.py, the probe of `tl.dot_scaled` for the MXFP4 experts' GEMM1 (not part of the
package): its kernel against float64 on small odd sizes (an empty expert, ragged rows, masked column and K tiles, a NaN
row of A, a NaN scale code) in both forms, its `--device cpu --tiny` plumbing under the interpreter, and each of its
GPU tiles compiled ahead of time for sm_90 (no spills, a Hopper wgmma), so the GPU session that runs it only times.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from helpers import DEVICE, INTERPRETED, needs_gpu, needs_interpreter

import mxfp4_dot_scaled_probe as probe


def test_tile_map_covers_each_expert_rows_once():
    """ceil(count / block_m) tiles per expert, none for an empty one, row starts block_m apart from the expert's
    first row."""
    offsets = torch.tensor([0, 5, 5, 22, 23], dtype=torch.int32)
    tile_expert, tile_row_start = probe.tile_map(offsets, 16)
    assert tile_expert.tolist() == [0, 2, 2, 3]
    assert tile_row_start.tolist() == [0, 5, 21, 22]
    assert tile_expert.dtype == tile_row_start.dtype == torch.int32
    assert probe.tile_map(torch.zeros(4, dtype=torch.int32), 16)[0].numel() == 0


def test_small_cases_match_float64(poison_empty):
    """Both forms (weight as the dot's rhs, and swapped) against float64 on the probe's SMALL_CASES, then the NaN row
    and the NaN scale code; outputs start as NaN (poison_empty), so a row or column left unwritten fails too. On the
    CPU through the interpreter's tl.dot_scaled, on a GPU compiled."""
    lines = probe.check_small_cases(DEVICE)
    assert len(lines) == len(probe.TINY_CONFIGS) * (len(probe.SMALL_CASES) + 2)


@needs_interpreter
def test_tiny_plumbing_runs_every_method(capsys):
    """`--device cpu --tiny`: each method at one cell, checked against the bf16 GEMM, the table printed."""
    status = probe.main(["--device", "cpu", "--tiny", "--models", "gpt-oss-20b", "--tokens", "3"])
    out = capsys.readouterr().out
    assert status == 0, out[-3000:]
    methods = ["(c) package bf16", "(b) package mxfp4", *[f"(a) dot_scaled {c.name}" for c in probe.TINY_CONFIGS],
               "layer: fused_experts mxfp4", "layer: fused_experts bf16"]
    table = out[out.index("\ncell "):]
    for method in methods:
        assert "gpt-oss-20b T3" in table and method in table, method
    assert "best dot_scaled" in table and "0 failures" in out


def test_compiles_for_sm90_without_spills(tmp_path):
    """Each GPU tile (probe.CONFIGS) compiled for sm_90 in a fresh process (Triton's compiled mode: this one may
    interpret), cold: no ptxas spills, within an H200 program's shared memory, lowered to a Hopper wgmma."""
    code = ("import json, mxfp4_dot_scaled_probe as p; "
            "print(json.dumps([p.compile_sm90(c) for c in p.CONFIGS]))")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join(os.path.join(ROOT, d) for d in ("torch-ext", "scripts", "benchmarks")))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    reports = json.loads(result.stdout.strip().splitlines()[-1])
    assert [r["config"] for r in reports] == [c.name for c in probe.CONFIGS]
    for report in reports:
        print(report)
        assert report["spills"] == 0, report
        assert report["shared"] <= 227 * 1024, report
        wgmma = [dot for dot in report["ptx_dot"] if dot.startswith("wgmma.mma_async") and dot.endswith(".bf16.bf16")]
        assert wgmma, report


@needs_gpu
@pytest.mark.skipif(INTERPRETED, reason="times compiled kernels")
def test_probe_runs_on_the_gpu(capsys):
    """One real GPT-OSS-20B cell on the GPU, each method checked against the bf16 GEMM (timings not asserted)."""
    status = probe.main(["--models", "gpt-oss-20b", "--tokens", "16", "--no-layer"])
    out = capsys.readouterr().out
    assert status == 0, out[-3000:]
