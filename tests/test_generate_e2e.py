"""Smoke test of benchmarks/generate_e2e.py on the CPU: tiny models, the kernels in Triton's interpreter.

The decode run is the script's CPU default (1 layer, H 64, F 32, 8 experts top-2, vocab 128, 3 new tokens, batches 1
and 2, fp32, eager mode) on Qwen3-MoE and Mixtral: every implementation produces its cell, the package's kernel ran,
and at fp32 its greedy tokens equal transformers' eager experts loop token for token (a real check: fp32 tiny models
must agree). The second run takes the DeepSeek-V3-style model (grouped sigmoid routing with the correction bias, a
shared expert) through decode at batch 1 and the training step: its tokens match too, and the loss and experts'
gradients of moe_dispatch equal grouped_mm's at fp32. No speed assertions (interpreter times mean nothing).
"""

import json

import generate_e2e  # benchmarks/ is on pytest.ini's pythonpath
import pytest
import torch
from helpers import needs_interpreter

import moe_dispatch

MODELS = ("qwen3-30b-a3b", "mixtral-8x7b")


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the package's `fused_experts` calls from its transformers integration (proof the kernel ran)."""
    calls = []
    original = moe_dispatch.transformers_experts.fused_experts

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(moe_dispatch.transformers_experts, "fused_experts", counted)
    return calls


def test_cpu_defaults():
    args = generate_e2e.parse_args(["--device", "cpu"])
    assert args.tiny and args.modes == ["eager"] and not args.train
    assert (args.layers, args.vocab, args.new_tokens, args.batches, args.dtype) == (1, 128, 3, [1, 2], "float32")
    assert args.reference == "eager" and "moe_dispatch" in args.impls


def test_agreement_reports_rows_and_first_difference():
    ref = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]])
    got = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 8]])
    assert generate_e2e.agreement(ref, ref) == {"rows_equal": 1.0, "first_diff": None}
    assert generate_e2e.agreement(got, ref) == {"rows_equal": 0.5, "first_diff": 2}


@needs_interpreter  # the CPU smoke run: the package's kernels on CPU tensors
def test_cpu_smoke_tokens_match_eager(tmp_path, capsys, kernel_calls):
    results = generate_e2e.main(["--device", "cpu", "--models", ",".join(MODELS), "--out", str(tmp_path)])

    assert results["package_impl"] == "moe_dispatch" and results["default_impl"] == "grouped_mm"
    cells = results["decode"]
    impls = {"moe_dispatch", "grouped_mm", "batched_mm", "eager"}
    assert {(c["model"], c["batch"], c["impl"]) for c in cells} == {
        (m, b, i) for m in MODELS for b in (1, 2) for i in impls}
    for c in cells:
        assert "error" not in c and "skipped" not in c, c
        assert c["mode"] == "eager" and c["generate_s"] > 0
    assert kernel_calls, "moe_dispatch's fused_experts never ran"
    for c in cells:
        if c["impl"] == "moe_dispatch":
            assert c["rows_equal"] == 1.0 and c["first_diff"] is None, c  # fp32: the same tokens as eager
    for name in MODELS:
        assert results["models"][name]["moe_layers"] == 1

    data = json.loads((tmp_path / "generate_e2e.json").read_text())
    assert set(data) == {"meta", "package_impl", "default_impl", "models", "decode", "train", "logits"}
    logits = {(c["model"], c["batch"], c["impl"]): c for c in data["logits"]}
    assert set(logits) == {(m, b, i) for m in MODELS for b in (1, 2) for i in impls}
    for (_, _, impl), c in logits.items():
        assert "error" not in c, c
        if impl == "moe_dispatch":  # fp32: the same logits as the eager loop, to rounding
            assert c["max_abs_diff"] <= 1e-4 * c["ref_max_abs"] and c["rows_flipped"] == 0, c
    assert data["meta"]["transformers"] and data["meta"]["device"] == "cpu"
    assert str(tmp_path) not in json.dumps(data["meta"])
    printed = capsys.readouterr().out
    md = (tmp_path / "generate_e2e.md").read_text()
    assert "| qwen3-30b-a3b | 2 | eager | " in md and "moe_dispatch tok/s | grouped_mm tok/s" in md
    assert "Training: not run (--no-train)" in printed
    assert printed.rstrip().endswith(md.rstrip().splitlines()[-1])  # the logits table, printed last


@needs_interpreter
def test_cpu_smoke_deepseek_v3_and_training_step(kernel_calls):
    results = generate_e2e.main(["--device", "cpu", "--models", "deepseek-v3", "--batches", "1", "--impls",
                                 "moe_dispatch", "--train", "--train-tokens", "2x8", "--train-steps", "1"])
    assert results["models"]["deepseek-v3"]["moe_layers"] == 1
    (ours_decode,) = [c for c in results["decode"] if c["impl"] == "moe_dispatch"]
    assert ours_decode["rows_equal"] == 1.0, ours_decode
    baseline, ours = results["train"]
    assert (baseline["impl"], ours["impl"]) == ("grouped_mm", "moe_dispatch")
    assert ours["loss"] == pytest.approx(baseline["loss"], rel=1e-5)
    assert ours["grad_rel_diff"] < 1e-5 and ours["grad_max_diff"] < 1e-5
    assert kernel_calls


def test_interleaved_rounds_keep_going_when_an_implementation_fails():
    """Without a warm-up an implementation's first failure (batched_mm out of memory) happens in a timed round: it is
    recorded as that implementation's result and the others are still timed."""

    class Model:
        impl = None

        def set_experts_implementation(self, impl):
            self.impl = impl

        def generate(self, ids, max_new_tokens, **kwargs):
            if self.impl == "broken":
                raise MemoryError("no room")
            return torch.cat([ids, torch.zeros(ids.shape[0], max_new_tokens, dtype=ids.dtype)], dim=1)

    args = generate_e2e.parse_args(["--device", "cpu", "--warmup", "0", "--repeats", "2"])
    ids = torch.ones(1, 4, dtype=torch.long)
    out = generate_e2e.measure_interleaved(Model(), ["ok", "broken"], ids, "eager", args, torch.device("cpu"))
    assert isinstance(out["broken"], MemoryError)
    cell, tokens = out["ok"]
    assert len(cell["generate_times_s"]) == 2 and tokens.shape == (1, args.new_tokens)
