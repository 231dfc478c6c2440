"""The fine-tuning examples at their tiny settings: examples/gpt_oss_mxfp4_finetune.py (a random GPT-OSS with MXFP4
experts) and examples/fp8_finetune.py (a random Qwen3-MoE whose experts transformers' FP8 quantizer made `FP8Experts`,
16 x 16 blocks): the attention projections and routers train for a few AdamW steps on one batch while the experts stay
frozen. On the CPU the kernels run through the Triton interpreter.
"""

import importlib.util
import json

import pytest
import torch

from conftest import ROOT
from helpers import DEVICE

pytest.importorskip("transformers")
EXAMPLES = ["gpt_oss_mxfp4_finetune", "fp8_finetune"]


def _example(name="gpt_oss_mxfp4_finetune"):
    spec = importlib.util.spec_from_file_location(name, f"{ROOT}/examples/{name}.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def _perturbed_down_proj(reference):
    """One layer's reference experts' down projection off by 1e-3 (relative, random); returns the model."""
    with torch.no_grad():
        weight = reference.model.layers[0].mlp.experts.down_proj
        noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(1))  # CPU generator: same values
        weight.add_(noise.to(weight.device) * weight.std() * 1e-3)                  # on every device
    return reference


def _run_tiny(name, out):
    """One layer, three steps, 8 tokens: (exit status, the --json results)."""
    status = _example(name).main(["--tiny", "--check", "--layers", "1", "--steps", "3", "--seq-len", "8",
                                  "--json", str(out)])
    return status, json.loads(out.read_text())


@pytest.mark.parametrize("name", EXAMPLES)
def test_tiny_defaults(name):
    """--tiny (a bare run's setting without a GPU): 2 layers, 4 steps of 2 x 16 tokens; the gradient check runs by
    default where there is no GPU, and with --check on one."""
    example = _example(name)
    args = example.parse_args(["--tiny"])
    assert (args.layers, args.steps, args.batch, args.seq_len) == (2, 4, 2, 16)
    assert args.check == (not example.ON_GPU) and example.parse_args(["--tiny", "--check"]).check
    assert example.parse_args([]).tiny == (not example.ON_GPU)


@pytest.mark.parametrize("name", EXAMPLES)
def test_finetune_example_runs_tiny(name, tmp_path):
    """One layer, three steps: the loss falls, the experts (MXFP4 blocks and scales, or float8 weights and scales)
    stay bit for bit, every trainable parameter gets a gradient, none of the experts' parameters does, and the
    gradient matches transformers' float experts on the dequantized weights."""
    if name == "fp8_finetune":
        pytest.importorskip("transformers.integrations.finegrained_fp8")
    status, results = _run_tiny(name, tmp_path / f"{name}.json")
    assert status == 0
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
    assert 0 < model["trainable_parameters"] < model["parameters"]
    if name == "fp8_finetune":
        assert model["fp8_modules"] == {"FP8Experts": 1} and model["block"] == [16, 16]  # the attention stays float


def test_gradient_check_catches_a_reference_off_by_1e_3(monkeypatch):
    """The check can fail: reference experts whose down projection is off by 1e-3 (relative, random) in one layer
    move the attention gradient past the float32 tolerance. A uniform scaling would not do (the final RMSNorm divides
    it out of the residual stream the experts dominate)."""
    example = _example()
    experts_module = example.md.transformers_experts
    dequantize = experts_module._dequantize_gpt_oss_experts

    def dequantize_off(model, dtype):
        return _perturbed_down_proj(dequantize(model, dtype))

    monkeypatch.setattr(experts_module, "_dequantize_gpt_oss_experts", dequantize_off)
    check = example.gradient_check(example.parse_args(["--tiny", "--check", "--layers", "1"]), torch.device(DEVICE))
    assert not check["ok"] and check["attention_rel_err"] > check["tolerance"]


def test_fp8_gradient_check_catches_a_reference_off_by_1e_3(monkeypatch):
    """The FP8 example's check can fail: reference experts whose down projection is off by 1e-3 (relative, random) in
    one layer move the attention gradient past the float32 tolerance."""
    pytest.importorskip("transformers.integrations.finegrained_fp8")
    example = _example("fp8_finetune")
    load = example.load_dequantized_experts_
    monkeypatch.setattr(example, "load_dequantized_experts_",
                        lambda reference, model: _perturbed_down_proj(load(reference, model)))
    check = example.gradient_check(example.parse_args(["--tiny", "--check", "--layers", "1"]), torch.device(DEVICE))
    assert not check["ok"] and check["attention_rel_err"] > check["tolerance"]
