"""examples/gpt_oss_mxfp4_finetune.py at its tiny settings: a random GPT-OSS with MXFP4 experts whose attention
projections and routers train for a few AdamW steps on one batch while the experts stay frozen. On the CPU the kernels
run through the Triton interpreter.
"""

import importlib.util
import json

import pytest
import torch

from conftest import ROOT
from helpers import DEVICE

pytest.importorskip("transformers")


def _example():
    path = f"{ROOT}/examples/gpt_oss_mxfp4_finetune.py"
    spec = importlib.util.spec_from_file_location("gpt_oss_mxfp4_finetune", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_tiny_defaults():
    """--tiny (a bare run's setting without a GPU): 2 layers, 4 steps of 2 x 16 tokens; the gradient check runs by
    default where there is no GPU, and with --check on one."""
    example = _example()
    args = example.parse_args(["--tiny"])
    assert (args.layers, args.steps, args.batch, args.seq_len) == (2, 4, 2, 16)
    assert args.check == (not example.ON_GPU) and example.parse_args(["--tiny", "--check"]).check
    assert example.parse_args([]).tiny == (not example.ON_GPU)


def test_finetune_example_runs_tiny(tmp_path):
    """One layer, three steps: the loss falls, the experts stay bit for bit, every trainable parameter gets a gradient,
    none of the experts' parameters does, and the gradient matches transformers' dequantized float experts."""
    out = tmp_path / "finetune.json"
    assert _example().main(["--tiny", "--check", "--layers", "1", "--steps", "3", "--seq-len", "8",
                            "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    checks = results["checks"]
    assert checks == {"gradient_matches_dequantized_reference": True, "loss_decreased": True,
                      "experts_bit_identical": True, "every_trainable_parameter_got_a_gradient": True,
                      "no_expert_parameter_has_grad": True}
    losses = [record["loss"] for record in results["steps"]]
    assert len(losses) == 3 and losses[-1] < losses[0]
    check = results["gradient_check"]
    assert check["attention_rel_err"] <= check["tolerance"] and check["router_rel_err"] <= check["tolerance"]
    # the experts matter to the gradient: the agreement is not that of two models whose experts do nothing
    assert check["attention_without_experts_rel_err"] > 100 * check["tolerance"]
    assert 0 < results["model"]["trainable_parameters"] < results["model"]["parameters"]


def test_gradient_check_catches_a_reference_off_by_1e_3(monkeypatch):
    """The check can fail: reference experts whose down projection is off by 1e-3 (relative, random) in one layer
    move the attention gradient past the float32 tolerance. A uniform scaling would not do (the final RMSNorm divides
    it out of the residual stream the experts dominate)."""
    example = _example()
    experts_module = example.md.transformers_experts
    dequantize = experts_module._dequantize_gpt_oss_experts

    def dequantize_off(model, dtype):
        dequantize(model, dtype)
        with torch.no_grad():
            weight = model.model.layers[0].mlp.experts.down_proj
            noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(1))  # CPU generator: same values
            weight.add_(noise.to(weight.device) * weight.std() * 1e-3)                  # on every device
        return model

    monkeypatch.setattr(experts_module, "_dequantize_gpt_oss_experts", dequantize_off)
    check = example.gradient_check(example.parse_args(["--tiny", "--check", "--layers", "1"]), torch.device(DEVICE))
    assert not check["ok"] and check["attention_rel_err"] > check["tolerance"]
