"""examples/fp8_finetune.py at its tiny settings: a random Qwen3-MoE whose experts transformers' FP8 quantizer made
`FP8Experts` (16 x 16 blocks), its attention projections and routers training for a few AdamW steps on one batch
through the package while the experts stay frozen. On the CPU the kernels run through the Triton interpreter.
"""

import importlib.util
import json

import pytest
import torch

from conftest import ROOT
from helpers import DEVICE

pytest.importorskip("transformers.integrations.finegrained_fp8")


def _example():
    path = f"{ROOT}/examples/fp8_finetune.py"
    spec = importlib.util.spec_from_file_location("fp8_finetune", path)
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


def test_fp8_finetune_example_runs_tiny(tmp_path):
    """One layer, three steps: the loss falls, the float8 weights and scales stay bit for bit, every trainable
    parameter gets a gradient, none of the experts' parameters does, and the gradient matches transformers' eager
    experts on the dequantized weights."""
    out = tmp_path / "fp8_finetune.json"
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
    model = results["model"]
    assert model["fp8_modules"] == {"FP8Experts": 1} and model["block"] == [16, 16]  # the attention stays float
    assert 0 < model["trainable_parameters"] < model["parameters"]


def test_gradient_check_catches_a_reference_off_by_1e_3(monkeypatch):
    """The check can fail: reference experts whose down projection is off by 1e-3 (relative, random) in one layer
    move the attention gradient past the float32 tolerance."""
    example = _example()
    load = example.load_dequantized_experts_

    def load_off(reference, model):
        load(reference, model)
        with torch.no_grad():
            weight = reference.model.layers[0].mlp.experts.down_proj
            noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(1))  # CPU generator: same values
            weight.add_(noise.to(weight.device) * weight.std() * 1e-3)                  # on every device
        return reference

    monkeypatch.setattr(example, "load_dequantized_experts_", load_off)
    check = example.gradient_check(example.parse_args(["--tiny", "--check", "--layers", "1"]), torch.device(DEVICE))
    assert not check["ok"] and check["attention_rel_err"] > check["tolerance"]
