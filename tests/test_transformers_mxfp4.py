"""GPT-OSS MXFP4 checkpoints through moe_dispatch: `from_pretrained_mxfp4`, `Mxfp4Experts`, `use_mxfp4_experts` and
`build_random_gpt_oss_mxfp4` (integrations/transformers_experts.py).

A tiny GPT-OSS with random MXFP4 experts (H = F = 64, E = 4, top-2, 2 layers, eager attention, fp32 so that the
comparisons are tight) is built by `build_random_gpt_oss_mxfp4` and saved as a stock MXFP4 checkpoint (uint8 blocks
and scales, config `quant_method: "mxfp4"`). The reference is that checkpoint as transformers itself loads it with
`Mxfp4Config(dequantize=True)`: its own dequantizer, its own `GptOssExperts`, run by `experts_implementation="eager"`.
Every load runs offline with sockets refused and the Hub kernel loader disabled: nothing may be downloaded.
On the CPU the kernels run through the Triton interpreter.
"""

import importlib
import json
import socket

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moe_dispatch
from helpers import DEVICE, assert_close, needs_gpu
from moe_dispatch.integrations import layers
from moe_dispatch.formats.mxfp4 import dequantize_experts_mxfp4

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")
from transformers.models.gpt_oss import modeling_gpt_oss  # noqa: E402

te = moe_dispatch.transformers_experts
VOCAB = 96
SCALE_CODE = 124  # scale codes 122-125: weights of standard deviation ~0.1-0.7, so the experts move the logits
TINY_GPT_OSS = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
    max_position_embeddings=64, initializer_range=0.1, bos_token_id=0, eos_token_id=1, pad_token_id=2,
    swiglu_limit=0.5,  # inside the activations' range: both clamps bite
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attn_implementation="eager",
)


def tiny_config(**changes):
    return transformers.GptOssConfig(**{**TINY_GPT_OSS, **changes})


def input_ids(batch=2, seq=6, seed=1):
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.fixture
def offline(monkeypatch):
    """No network and no Hub kernel for the test: sockets refuse to connect, `kernels.get_kernel` raises."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network or Hub kernel access: {args[:2]}")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    for module in ("kernels", "transformers.integrations.hub_kernels"):
        try:
            monkeypatch.setattr(importlib.import_module(module), "get_kernel", refuse, raising=False)
        except ImportError:  # no kernels package: nothing could load a Hub kernel anyway
            pass


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder of the saved stock MXFP4 checkpoint, the built model's state dict)."""
    model = te.build_random_gpt_oss_mxfp4(tiny_config(), device=DEVICE, dtype=torch.float32, seed=0,
                                          scale_code=SCALE_CODE)
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    model.save_pretrained(path)
    return path, {name: tensor.clone() for name, tensor in model.state_dict().items()}


# Loaded on the host, then moved: `device_map` needs accelerate, which the tests do without.
def load_ours(path, dtype=torch.float32, **kwargs):
    loaded = te.from_pretrained_mxfp4(path, dtype=dtype, **kwargs)
    if kwargs.get("output_loading_info"):
        return loaded[0].to(DEVICE), loaded[1]
    return loaded.to(DEVICE)


def load_reference(path):
    """The checkpoint as transformers loads it by itself, dequantized into its GptOssExperts (in bf16 whatever the
    model dtype: MXFP4 values are exact in bf16, so the cast to fp32 is exact too), run by its eager loop."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).to(DEVICE)
    model.set_experts_implementation("eager")
    for block in te._gpt_oss_blocks(model):
        assert type(block.experts) is modeling_gpt_oss.GptOssExperts
        block.experts.float()
    return model


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts `fused_experts` calls of the transformers integration (proof the package's kernel ran)."""
    calls = []
    original = te.fused_experts

    def counted(*args, **kwargs):
        calls.append((args[1].dtype, args[0].shape[0]))
        return original(*args, **kwargs)

    monkeypatch.setattr(te, "fused_experts", counted)
    return calls


def test_logits_match_transformers_dequantized_experts(checkpoint, offline, kernel_calls):
    path, _ = checkpoint
    ours, reference = load_ours(path), load_reference(path)
    ids = input_ids()
    with torch.no_grad():
        got, want = ours(ids), reference(ids)
    assert kernel_calls == [(torch.uint8, ids.numel())] * 2  # every layer, its uint8 blocks
    assert_close(got.logits, want.logits, torch.float32, "logits through Mxfp4Experts")
    # The experts matter: without them the logits are far from these.
    with torch.no_grad():
        for block in te._gpt_oss_blocks(reference):
            block.experts.down_proj.zero_()
            block.experts.down_proj_bias.zero_()
        bare = reference(ids).logits
    assert (bare - want.logits).norm() > 0.2 * want.logits.norm()


def test_router_is_transformers_own_and_unchanged(checkpoint, offline):
    """Same router module class and weights, its logits recorded by transformers, and exactly its indices and scores
    reach the experts; the routing of every layer equals the reference model's."""
    path, _ = checkpoint
    ours, reference = load_ours(path), load_reference(path)
    seen = {}

    def record(model, key):
        for number, block in enumerate(te._gpt_oss_blocks(model)):
            block.router.register_forward_hook(
                lambda module, args, out, n=number: seen.__setitem__((key, "router", n), out))
            block.experts.register_forward_pre_hook(
                lambda module, args, n=number: seen.__setitem__((key, "experts", n), args))

    record(ours, "ours")
    record(reference, "ref")
    with torch.no_grad():
        got, want = ours(input_ids(), output_router_logits=True), reference(input_ids(), output_router_logits=True)
    for number, (block, ref_block) in enumerate(zip(te._gpt_oss_blocks(ours), te._gpt_oss_blocks(reference))):
        assert type(block.router) is modeling_gpt_oss.GptOssTopKRouter and type(block) is modeling_gpt_oss.GptOssMLP
        assert isinstance(block.experts, te.Mxfp4Experts)
        for name, tensor in block.router.state_dict().items():
            assert torch.equal(tensor, ref_block.router.state_dict()[name]), name
        logits, scores, indices = seen["ours", "router", number]
        _, expert_indices, expert_weights = seen["ours", "experts", number]
        assert expert_indices is indices and expert_weights is scores  # the router's own tensors, untouched
        ref_logits, ref_scores, ref_indices = seen["ref", "router", number]
        assert torch.equal(indices, ref_indices), f"layer {number}: other experts chosen"
        if number == 0:  # same embeddings and attention before it: bit for bit
            assert torch.equal(logits, ref_logits) and torch.equal(scores, ref_scores)
        assert_close(logits, ref_logits, torch.float32, f"router logits of layer {number}")
        assert torch.equal(got.router_logits[number], logits)  # what transformers recorded (aux loss, outputs)
    assert len(got.router_logits) == len(want.router_logits) == 2


def test_save_and_from_pretrained_mxfp4_round_trip(checkpoint, offline, tmp_path):
    path, built = checkpoint
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"  # a stock Hub MXFP4 checkpoint
    stored = safetensors.load_file(str(path / "model.safetensors"))
    assert stored["model.layers.1.mlp.experts.down_proj_blocks"].dtype == torch.uint8
    assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in stored)

    model, info = load_ours(path, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    state = model.state_dict()
    assert state.keys() == built.keys()
    for name, tensor in built.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name
    assert model.is_quantized and model.hf_quantizer.quantization_config.quant_method == te.MXFP4_QUANT_METHOD

    # Saved again: the same tensors byte for byte, the stock config again.
    model.save_pretrained(tmp_path)
    again = safetensors.load_file(str(tmp_path / "model.safetensors"))
    assert again.keys() == stored.keys() and all(torch.equal(again[k], stored[k]) for k in stored)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"] == config["quantization_config"]

    # In bf16: the blocks and scales as stored, the biases cast once, at load.
    model = load_ours(path, dtype=torch.bfloat16)
    experts = model.model.layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj_blocks, built["model.layers.0.mlp.experts.gate_up_proj_blocks"])
    assert torch.equal(experts.down_proj_scales, built["model.layers.0.mlp.experts.down_proj_scales"])
    assert experts.gate_up_proj_bias.dtype == experts.down_proj_bias.dtype == torch.bfloat16

    # dequantize(): transformers' own GptOssExperts, the weights transformers' dequantizer gives.
    dense = load_ours(path).dequantize()
    reference = load_reference(path)
    for block, ref_block in zip(te._gpt_oss_blocks(dense), te._gpt_oss_blocks(reference)):
        assert type(block.experts) is modeling_gpt_oss.GptOssExperts
        for name, tensor in ref_block.experts.state_dict().items():
            assert torch.equal(block.experts.state_dict()[name], tensor), name
    assert not dense.is_quantized


def test_generate_matches_transformers(checkpoint, offline, kernel_calls):
    path, _ = checkpoint
    ours, reference = load_ours(path), load_reference(path)
    prompt = input_ids(batch=1, seq=4)
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=2)
    got = ours.generate(prompt, **kwargs)
    assert torch.equal(got, reference.generate(prompt, **kwargs))
    assert len(kernel_calls) == 2 * 4  # prefill and three decode steps, two layers each


class _Allocations(TorchDispatchMode):
    """Records the largest floating-point tensor an op makes off the meta device."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.device.type != "meta":
                self.largest = max(self.largest, tensor.numel())
        return out


def test_builder_makes_uint8_experts_and_no_float_copy():
    config = tiny_config()
    E, H, F = config.num_local_experts, config.hidden_size, config.intermediate_size
    with _Allocations() as allocations:
        model = te.build_random_gpt_oss_mxfp4(config, device=DEVICE, dtype=torch.float32, seed=3, scale_code=120)
    assert allocations.largest < E * H * F  # never a float tensor of an expert projection's size, let alone [E, H, 2F]
    blocks = te._gpt_oss_blocks(model)
    assert len(blocks) == 2 and not any(isinstance(m, modeling_gpt_oss.GptOssExperts) for m in model.modules())
    for block in blocks:
        experts = block.experts
        assert isinstance(experts, te.Mxfp4Experts) and (experts.alpha, experts.limit) == (1.702, 0.5)
        shapes = {name: (tuple(p.shape), p.dtype) for name, p in experts.named_parameters()}
        assert shapes == {
            "gate_up_proj_blocks": ((E, 2 * F, H // 32, 16), torch.uint8),
            "gate_up_proj_scales": ((E, 2 * F, H // 32), torch.uint8),
            "gate_up_proj_bias": ((E, 2 * F), torch.float32),
            "down_proj_blocks": ((E, H, F // 32, 16), torch.uint8),
            "down_proj_scales": ((E, H, F // 32), torch.uint8),
            "down_proj_bias": ((E, H), torch.float32),
        }
        for scales in (experts.gate_up_proj_scales, experts.down_proj_scales):
            assert 118 <= scales.min() and scales.max() <= 121
        assert experts.gate_up_proj_blocks.unique().numel() > 200  # random bytes, not a constant
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    # The rest is what transformers' own initialisation gives: the rotary frequencies among them.
    with torch.device(DEVICE):
        plain = transformers.GptOssForCausalLM(config)
    assert torch.equal(model.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq)
    assert model.config.quantization_config.to_dict()["quant_method"] == "mxfp4"
    with torch.no_grad():
        assert torch.isfinite(model(input_ids(batch=1, seq=3)).logits).all()


def test_use_mxfp4_experts_on_a_dequantized_model(checkpoint, offline, tmp_path):
    """A model holding the dequantized experts in float (transformers' `dequantize=True` load) converts back: the same
    values (MXFP4's rounding is exact on MXFP4 values), the same logits, and it saves as an MXFP4 checkpoint."""
    path, built = checkpoint
    model = load_reference(path)
    ids = input_ids(batch=1, seq=4)
    with torch.no_grad():
        before = model(ids).logits
    assert te.use_mxfp4_experts(model) is model
    for number, block in enumerate(te._gpt_oss_blocks(model)):
        experts, prefix = block.experts, f"model.layers.{number}.mlp.experts."
        assert isinstance(experts, te.Mxfp4Experts)
        for name in ("gate_up_proj", "down_proj"):
            got = dequantize_experts_mxfp4(getattr(experts, f"{name}_blocks"), getattr(experts, f"{name}_scales"),
                                           torch.float32)
            want = dequantize_experts_mxfp4(built[prefix + f"{name}_blocks"], built[prefix + f"{name}_scales"],
                                            torch.float32)
            assert torch.equal(got, want), f"layer {number} {name}"
    with torch.no_grad():
        assert_close(model(ids).logits, before, torch.float32, "logits after use_mxfp4_experts")
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    assert te.use_mxfp4_experts(model) is model  # MXFP4 experts already: left as they are


def test_kernelize_layer_runs_mxfp4_experts():
    """`layers.MegaBlocksMoeMLP` (the kernelize layer of GptOssMLP) runs a block holding Mxfp4Experts as its own
    forward does."""
    model = te.build_random_gpt_oss_mxfp4(tiny_config(num_hidden_layers=1), device=DEVICE, dtype=torch.float32,
                                          scale_code=SCALE_CODE)
    block = model.model.layers[0].mlp
    x = torch.randn(2, 3, 64, device=DEVICE)
    with torch.no_grad():
        out, scores = layers.MegaBlocksMoeMLP.forward(block, x)
        want, want_scores = block(x)
    assert torch.equal(out, want) and torch.equal(scores, want_scores)


def test_what_cannot_run_is_refused(checkpoint, tmp_path):
    path, _ = checkpoint
    reference = load_reference(path)
    reference.save_pretrained(tmp_path)  # a float checkpoint: no quantization_config
    with pytest.raises(ValueError, match="is not an MXFP4 checkpoint"):
        te.from_pretrained_mxfp4(tmp_path)
    mixtral = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=2))
    with pytest.raises(NotImplementedError, match="GptOssMLP"):
        te.use_mxfp4_experts(mixtral)
    experts = te.Mxfp4Experts(tiny_config(), device="meta")
    del experts.down_proj_scales
    with pytest.raises(NotImplementedError, match="down_proj_scales"):
        te.mxfp4_experts_options(experts)
    with pytest.raises(ValueError, match="multiple of 32"):
        te.Mxfp4Experts(tiny_config(intermediate_size=48), device="meta")
    with pytest.raises(ValueError, match="scale_code"):
        te.build_random_gpt_oss_mxfp4(tiny_config(), device="meta", scale_code=255)


def test_register_mxfp4_twice_keeps_one_entry():
    from transformers.quantizers import auto

    assert te.register_mxfp4() == te.register_mxfp4() == te.MXFP4_QUANT_METHOD
    config_class, quantizer_class = te._mxfp4_quantization_classes()
    assert auto.AUTO_QUANTIZATION_CONFIG_MAPPING[te.MXFP4_QUANT_METHOD] is config_class
    assert auto.AUTO_QUANTIZER_MAPPING[te.MXFP4_QUANT_METHOD] is quantizer_class


def test_compiles_whole_model():
    """`is_compileable`: generate may compile the decode step of a model holding Mxfp4Experts; the model compiles as
    one graph (the experts are a torch custom operator) and computes the same logits."""
    model = te.build_random_gpt_oss_mxfp4(tiny_config(num_hidden_layers=1), device=DEVICE, dtype=torch.float32,
                                          scale_code=SCALE_CODE)
    assert model.hf_quantizer.is_compileable
    ids = input_ids(batch=1, seq=5)
    backend = "inductor" if DEVICE == "cuda" else "aot_eager"
    with torch.no_grad():
        want = model(ids).logits
        got = torch.compile(model, backend=backend, fullgraph=True)(ids).logits
    assert_close(got, want, torch.float32, "compiled logits")


def _demo():
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("gpt_oss_mxfp4_demo", f"{ROOT}/examples/gpt_oss_mxfp4.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


def test_demo_script_runs_tiny(tmp_path):
    """examples/gpt_oss_mxfp4.py at its smoke settings: builds, checks layer 0's experts, times, generates."""
    out = tmp_path / "demo.json"
    assert _demo().main(["--tiny", "--layers", "1", "--batches", "1", "--new-tokens", "2", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["experts"]["check"]["ok"] and results["generate"][0]["generated"] == 2


@needs_gpu
def test_gpu_demo_real_width_two_layers(tmp_path):
    """gpt-oss-120b's widths at 2 layers: the peak memory stays within the parameters (plus 1 GiB of activations and
    workspace), so no float copy of an expert projection ever existed (one layer's bf16 experts alone are 5.9 GiB)."""
    out = tmp_path / "demo.json"
    assert _demo().main(["--layers", "2", "--batches", "1,4", "--new-tokens", "4", "--repeats", "1",
                         "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    model = results["model"]
    assert model["hidden"] == 2880 and model["experts"] == 128 and model["float_experts_would_be_gib"] > 11
    assert model["peak_gib"] < model["parameters_gib"] + 1.0
    assert all(cell["generated"] == 4 for cell in results["generate"])


def test_device_map_loads_in_place(checkpoint, offline):
    """With accelerate, `device_map=` loads each tensor straight onto the device, as stored."""
    # transformers 5.22.2 refuses any device_map without accelerate, which requirements.txt does not pin.
    pytest.importorskip("accelerate", reason="device_map= needs accelerate (transformers' rule), which requirements.txt "
                                             "does not pin: `.venv/bin/pip install accelerate` runs this test")
    path, built = checkpoint
    model, info = te.from_pretrained_mxfp4(path, dtype=torch.float32, device_map=DEVICE, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    for name, tensor in model.state_dict().items():
        assert tensor.device.type == DEVICE and torch.equal(tensor.cpu(), built[name].cpu()), name


def test_config_argument_is_not_changed(checkpoint, offline):
    """A config passed in keeps the checkpoint's quantization method (the loader works on a copy)."""
    path, _ = checkpoint
    config = transformers.AutoConfig.from_pretrained(path)
    model = te.from_pretrained_mxfp4(path, config=config, dtype=torch.float32)
    assert isinstance(model.model.layers[0].mlp.experts, te.Mxfp4Experts)
    assert config.quantization_config["quant_method"] == "mxfp4"
