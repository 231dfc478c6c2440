"""Smoke test of benchmarks/generate_e2e.py on the CPU: tiny models, the kernels in Triton's interpreter.

The decode run is the script's CPU default (1 layer, H 64, F 32, 8 experts top-2, vocab 128, 3 new tokens, batches 1
and 2, fp32, eager mode) on Qwen3-MoE and Mixtral: every implementation produces its cell, the package's kernel ran,
and at fp32 its greedy tokens equal transformers' eager experts loop token for token (a real check: fp32 tiny models
must agree). The second run takes the DeepSeek-V3-style model (grouped sigmoid routing with the correction bias, a
shared expert) through decode at batch 1 and the training step: its tokens match too, and the loss and experts'
gradients of moe_dispatch equal grouped_mm's at fp32. The other families (GPT-OSS's interleaved, transposed experts
with biases and clamped SwiGLU, OLMoE, Qwen2-MoE's shared expert) decode at batch 1 with the same checks; GPT-OSS also
trains under --profile-train (its bias gradients compared, the profile's outputs written). The profile's parts are
tested on their own: the kernel categories on made-up records, the backward's scopes on a real CPU profile, the step
breakdown (busy time, syncs, device-to-host copies) on made-up events. No speed assertions (interpreter times mean
nothing).

FP8 mode (--quantize fp8): `quantize_fp8_` on the tiny DeepSeek-V3-style model (which modules transformers' quantizer
converts, the e4m3 weights and their block scales against the original weights, a weight the block does not tile left
as it was); the peer kernel served from a source folder (`kernels.get_kernel` returns that copy, LOCAL_KERNELS keeps
what it held); and a smoke run of Qwen3-MoE and DeepSeek-V3 through every implementation on a stand-in of the
finegrained-fp8 kernel written here (its three matmuls in torch on the dequantized weights), so that at fp32 the
package's FP8 path must give transformers' FP8 experts loop's tokens exactly. Given the real kernel's source (not part
of the repository: MOE_DISPATCH_FINEGRAINED_FP8_SOURCE names its folder), the smoke run also takes that one: its w8a8
matmul (activations quantized too) runs in the interpreter, so there the logits agree to FP8 rounding, not exactly.
"""

import json
import os
import sys
import types
from pathlib import Path

import generate_e2e  # benchmarks/ is on pytest.ini's pythonpath
import pytest
import torch
from helpers import needs_interpreter

MODELS = ("qwen3-30b-a3b", "mixtral-8x7b")
ROOT = Path(__file__).resolve().parents[1]
# A source folder of the kernels-community/finegrained-fp8 kernel (its build.toml and torch-ext/finegrained_fp8/), what
# benchmarks/generate_e2e.py --finegrained-fp8 takes: a measuring instrument, not project code, so the repository has
# none. MOE_DISPATCH_FINEGRAINED_FP8_SOURCE names it; without it, a copy at .peers/hub/finegrained-fp8 of the checkout.
PEER_SOURCE = Path(os.environ.get("MOE_DISPATCH_FINEGRAINED_FP8_SOURCE") or ROOT / ".peers" / "hub" / "finegrained-fp8")


def test_cpu_defaults():
    args = generate_e2e.parse_args(["--device", "cpu"])
    assert args.tiny and args.modes == ["eager"] and not args.train
    assert (args.layers, args.vocab, args.new_tokens, args.batches, args.dtype) == (1, 128, 3, [1, 2], "float32")
    assert args.reference == "eager" and "moe_dispatch" in args.impls
    assert args.static_batches == [1, 2] and not args.profile_train
    assert "gpt-oss-20b" in generate_e2e.SPECS and "gpt-oss-20b" not in args.models  # named, not run by default
    assert {"gpt-oss-120b", "olmoe-1b-7b", "qwen1.5-moe-a2.7b"} <= set(args.models)


def test_profile_train_implies_training_and_static_batches_apply_to_compiled_modes():
    args = generate_e2e.parse_args(["--device", "cpu", "--profile-train", "--batches", "1,16", "--static-batches", "1"])
    assert args.train and args.profile_train and args.batches == [1, 16] and args.static_batches == [1]
    with pytest.raises(SystemExit):
        generate_e2e.parse_args(["--device", "cpu", "--profile-train", "--no-train"])


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


# Each family beyond the first three, and why it is here.
FAMILIES = {
    "gpt-oss-120b": "experts [E, H, 2F] with gate/up columns interleaved, biases, clamped SwiGLU; eager attention "
                    "with sinks, a sliding window shorter than the prompt",
    "olmoe-1b-7b": "top-k not renormalised, the expert width in `intermediate_size`",
    "qwen1.5-moe-a2.7b": "a sigmoid-gated shared expert beside the routed ones; `moe_intermediate_size`",
}


@needs_interpreter
@pytest.mark.parametrize("name", list(FAMILIES))
def test_cpu_smoke_families(name, kernel_calls):
    results = generate_e2e.main(["--device", "cpu", "--models", name, "--batches", "1", "--impls", "moe_dispatch"])
    record = results["models"][name]
    assert record["class"] == generate_e2e.SPECS[name].model and record["moe_layers"] == 1
    (ours,) = [c for c in results["decode"] if c["impl"] == "moe_dispatch"]
    assert ours["rows_equal"] == 1.0 and ours["first_diff"] is None, ours  # fp32: the eager loop's tokens
    (logits,) = [c for c in results["logits"] if c["impl"] == "moe_dispatch"]
    assert logits["max_abs_diff"] <= 1e-4 * logits["ref_max_abs"] and logits["rows_flipped"] == 0, logits
    assert kernel_calls, "moe_dispatch's fused_experts never ran"


def test_gpt_oss_is_built_in_its_own_layout():
    """GPT-OSS keeps transformers' layout (transposed, interleaved, biased experts), eager attention, and random
    experts' biases (so a kernel ignoring them changes the tokens), compared in training with the weights."""
    args = generate_e2e.parse_args(["--device", "cpu", "--models", "gpt-oss-120b"])
    model, shape = generate_e2e.build_model(generate_e2e.SPECS["gpt-oss-120b"], args, torch.device("cpu"),
                                            torch.float32, "eager")
    assert model.config._attn_implementation == "eager" and model.config.sliding_window < args.prompt_len
    ((_, experts),) = generate_e2e.experts_modules(model)
    assert experts.is_transposed and not experts.is_concatenated and experts.has_bias
    assert experts.gate_up_proj.shape == (shape.num_experts, shape.hidden, 2 * shape.ffn)
    assert experts.gate_up_proj_bias.abs().min() > 0 and experts.down_proj_bias.abs().min() > 0
    assert not model.model.layers[0].mlp.router.bias.any()  # a router bias would only move the choices
    names = [name.rsplit(".", 1)[1] for name, _ in generate_e2e.experts_parameters(model)]
    assert names == ["gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"]


@needs_interpreter
def test_cpu_gpt_oss_training_step_profiled(tmp_path):
    results = generate_e2e.main(["--device", "cpu", "--models", "gpt-oss-20b", "--modes", "", "--no-logits",
                                 "--impls", "moe_dispatch", "--profile-train", "--train-tokens", "2x8",
                                 "--train-steps", "1", "--out", str(tmp_path)])
    assert not results["decode"]
    baseline, ours = results["train"]
    assert (baseline["impl"], ours["impl"]) == ("grouped_mm", "moe_dispatch")
    assert ours["loss"] == pytest.approx(baseline["loss"], rel=1e-5)
    assert ours["grad_rel_diff"] < 1e-5 and ours["grad_max_diff"] < 1e-5  # weights and biases
    for cell in (baseline, ours):
        prof = cell["profile"]
        assert list(prof["categories"]) == list(generate_e2e.CATEGORIES)
        assert prof["wall_ms"] > 0 and prof["gpu_busy_ms"] == 0 and prof["kernels"] == 0  # CPU: no device events
        assert "aten::" in prof["table"]
    md = (tmp_path / "generate_e2e.md").read_text()
    assert "Training step under torch.profiler" in md and "| gpt-oss-20b | moe_dispatch | " in md
    raw = (tmp_path / "generate_e2e_train_profile.txt").read_text()
    assert raw.count("== gpt-oss-20b / ") == 2
    assert "profile" in json.loads((tmp_path / "generate_e2e.json").read_text())["train"][1]


def test_kernel_categories():
    """Made-up (name, us, scope) records, one per rule and the cases that must not match it."""
    package = frozenset({"_grouped_gemm_kernel", "_gather_kernel"})
    cutlass = "void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<GroupProblemShape<...>>>()"
    tma = "_ZN7cutlass13device_kernelIN4cute14SM90_TMA_LOAD8Copy_AtomE"
    torch_gather = "void at::native::_scatter_gather_elementwise_kernel<128, 4, ...>(int, ...)"
    cast = "void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda(...)>(...)"
    broadcast = "void at::native::elementwise_kernel<128, 2, broadcast_mul<float>>(int, ...)"
    records = [
        ("_grouped_gemm_kernel", 100.0, "experts"),  # found in the package
        ("_gather_kernel", 10.0, None),  # the package's, outside any scope (still the package's)
        ("_down_grad_kernel", 50.0, None),  # not found, but a plain name with a hint: a Triton kernel of the package
        ("triton_poi_fused_gather_0", 5.0, None),  # inductor's, despite "gather"
        (torch_gather, 7.0, "experts"),  # torch's gather inside the experts module
        (cutlass, 80.0, "experts"),  # transformers' grouped_mm
        (tma, 1.0, "experts"),  # a GEMM whose template spells a copy atom is no copy
        (tma, 2.0, None),  # the same GEMM outside the experts module
        ("nvjet_tst_128x256_64x4_h_bz_TNT", 40.0, "experts"),  # cuBLAS inside the experts module
        ("nvjet_tst_128x256_64x4_h_bz_TNT", 30.0, None),  # the same GEMM for the LM head
        (cast, 3.0, "experts"),  # a cast inside the experts module is a cast
        ("Memcpy DtoH (Device -> Pinned)", 1.0, None),
        (broadcast, 2.0, "router"),  # "broadcast" is no cast
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, ...>>(...)", 20.0, None),
        ("void at::native::cunn_SoftMaxForward<4, float>(...)", 6.0, "attention"),
        ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(...)", 4.0, "router"),
        ("mystery_kernel", 9.0, None),
    ]
    out = generate_e2e.categorize_kernels(records, package)
    ms = {key: round(value["ms"] * 1e3, 3) for key, value in out["categories"].items()}
    assert ms == {"moe_dispatch": 160.0, "casts/copies": 4.0, "grouped_mm": 121.0, "experts other": 7.0,
                  "attention": 26.0, "router": 6.0, "other": 46.0}
    assert out["categories"]["grouped_mm"]["count"] == 3
    assert out["total_ms"] == pytest.approx(sum(r[1] for r in records) / 1e3)
    assert [n["name"] for n in out["names"]["other"]] == ["nvjet_tst_128x256_64x4_h_bz_TNT", "mystery_kernel",
                                                          "triton_poi_fused_gather_0", tma]
    assert [n["name"] for n in out["names"]["experts other"]] == [torch_gather]
    assert out["scopes"]["experts"]["ms"] == pytest.approx(0.231)


def test_backward_operators_take_the_scope_of_their_forward():
    """On a real (CPU) profile: the forward's operators are in their module's range, and each backward operator takes
    the scope of the forward operator that made its autograd node; what no scoped module made has none."""
    from torch.profiler import ProfilerActivity, profile

    class ToyRouter(torch.nn.Module):
        def forward(self, x):
            return torch.softmax(x, dim=-1)

    class ToyExperts(torch.nn.Module):
        def forward(self, x):
            return torch.tanh(x)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router, self.experts = ToyRouter(), ToyExperts()

        def forward(self, x):
            return torch.sigmoid(self.experts(x) * self.router(x))

    block, x = Block(), torch.randn(4, 8, requires_grad=True)
    with generate_e2e.scope_ranges(block), profile(activities=[ProfilerActivity.CPU]) as prof:
        block(x).sum().backward()
    assert not block.router._forward_hooks and not block.router._forward_pre_hooks  # removed afterwards
    scope_of = generate_e2e.event_scopes(prof.events())
    found = {}
    for event in prof.events():
        if event.name in ("aten::_softmax", "aten::tanh", "aten::sigmoid", "aten::_softmax_backward_data",
                          "aten::tanh_backward", "aten::sigmoid_backward"):
            found.setdefault(event.name, set()).add(scope_of(event))
    assert found == {"aten::_softmax": {"router"}, "aten::tanh": {"experts"}, "aten::sigmoid": {None},
                     "aten::_softmax_backward_data": {"router"}, "aten::tanh_backward": {"experts"},
                     "aten::sigmoid_backward": {None}}


def _event(name, start, end, *, device=False, parent=None, seq=-1, scope=0, kernels=()):
    from torch.autograd import DeviceType

    return types.SimpleNamespace(name=name, time_range=types.SimpleNamespace(start=start, end=end),
                                 device_type=DeviceType.CUDA if device else DeviceType.CPU, cpu_parent=parent,
                                 sequence_nr=seq, scope=scope, is_user_annotation=False,
                                 kernels=[types.SimpleNamespace(name=k, duration=us) for k, us in kernels])


def test_step_breakdown_from_events():
    """Made-up profiler events of one step: a grouped GEMM in the experts' range and its backward (matched by sequence
    number, overlapping the first on the device), an item() in the experts' range with its copy and stream sync, a
    kernel no host event claims, a sync after the step; the device-side range events are no device time."""
    gemm, backward_gemm, dtoh = "void cutlass::GroupProblemShape_kernel<...>", "nvjet_tst_gemm", "Memcpy DtoH (Device)"
    step = _event(generate_e2e.STEP_RANGE, 0, 100)
    experts = _event(generate_e2e.SCOPE_PREFIX + "experts", 10, 75, parent=step)
    item = _event("aten::item", 60, 70, parent=experts)
    local = _event("aten::_local_scalar_dense", 61, 69, parent=item, kernels=[(dtoh, 2.0)])
    node = _event("GroupedMmBackward0", 70, 90, seq=5, scope=generate_e2e.BACKWARD_FUNCTION)
    events = [step, experts, item, local, node,
              _event("aten::_grouped_mm", 11, 20, parent=experts, seq=5, kernels=[(gemm, 30.0)]),
              _event("aten::_grouped_mm", 71, 80, parent=node, kernels=[(backward_gemm, 20.0)]),
              _event("cudaStreamSynchronize", 64, 68, parent=local),
              _event("cudaDeviceSynchronize", 101, 110),
              _event(gemm, 20, 50, device=True), _event(backward_gemm, 40, 60, device=True),
              _event(dtoh, 62, 64, device=True), _event("mystery_kernel", 90, 95, device=True),
              _event(generate_e2e.SCOPE_PREFIX + "experts", 20, 50, device=True)]
    out = generate_e2e.step_breakdown(events, frozenset(), 200e-6)
    assert out["categories"]["grouped_mm"] == {"ms": pytest.approx(0.05), "count": 2}
    assert out["categories"]["casts/copies"] == {"ms": pytest.approx(0.002), "count": 1}
    assert out["names"]["other"] == [{"name": "(device time no host event launched)", "ms": pytest.approx(0.005),
                                      "count": 1}]
    assert out["total_ms"] == pytest.approx(0.057) and out["scopes"]["experts"]["ms"] == pytest.approx(0.052)
    assert out["gpu_busy_ms"] == pytest.approx(0.047)  # [20, 60] + [62, 64] + [90, 95]
    assert out["wall_ms"] == pytest.approx(0.2) and out["host_gap_ms"] == pytest.approx(0.2 - 0.047)
    where = f"aten::_local_scalar_dense < aten::item < {generate_e2e.SCOPE_PREFIX}experts [experts]"
    assert out["syncs"] == 1 and out["syncs_by_op"] == {where: 1}  # not the one after the step
    assert out["dtoh_copies"] == 1 and out["dtoh_by_op"] == {where: 1}


# ---------------------------------------------------------------------------------------------------------------------
# --quantize fp8

# A finegrained-fp8 source folder whose kernel computes exactly what the FP8 weights hold: each matmul on the weights
# dequantized block by block (w_fp8 * scale_inv), in fp32, the activations unquantized; CALLS logs what ran.
STAND_IN = """
import torch

CALLS = []


def _dequantize(weight, scale, block):
    scale = scale.repeat_interleave(block[0], dim=-2)[..., :weight.shape[-2], :]
    return weight.float() * scale.repeat_interleave(block[1], dim=-1)[..., :weight.shape[-1]]


def matmul_2d(a, b, bs, block_size, output_dtype=None, activation_scale=None):
    CALLS.append("matmul_2d")
    return (a.float() @ _dequantize(b, bs, block_size).T).to(output_dtype or a.dtype)


def matmul_batched(a, b, bs, block_size, expert_ids):
    CALLS.append("matmul_batched")
    return torch.einsum("sk,snk->sn", a.float(), _dequantize(b, bs, block_size)[expert_ids]).to(a.dtype)


def matmul_grouped(a, b, bs, offsets, tokens_per_expert, block_size):
    CALLS.append("matmul_grouped")
    experts = torch.repeat_interleave(torch.arange(b.shape[0]), tokens_per_expert.long())
    return torch.einsum("sk,snk->sn", a.float(), _dequantize(b, bs, block_size)[experts]).to(a.dtype)
"""


@pytest.fixture(scope="module")
def stand_in_source(tmp_path_factory):
    """A finegrained-fp8 source folder (build.toml, torch-ext/finegrained_fp8/) holding STAND_IN."""
    source = tmp_path_factory.mktemp("finegrained-fp8")
    (source / "build.toml").write_text('[general]\nname = "finegrained-fp8"\nversion = 4\n')
    package = source / "torch-ext" / "finegrained_fp8"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(STAND_IN)
    return source


@pytest.fixture
def fresh_fp8_kernel(monkeypatch, tmp_path):
    """Forget any finegrained-fp8 kernel transformers loaded earlier in this process, and give LOCAL_KERNELS an entry
    of another kernel (restored afterwards): the run must append its own."""
    from transformers.integrations import finegrained_fp8, hub_kernels

    monkeypatch.setattr(finegrained_fp8, "_FINEGRAINED_FP8", None)
    monkeypatch.setitem(hub_kernels._KERNEL_MODULE_MAPPING, "finegrained-fp8", None)
    other = f"other-org/other-kernel={tmp_path / 'other'}"
    monkeypatch.setenv("LOCAL_KERNELS", ":".join(filter(None, [os.environ.get("LOCAL_KERNELS"), other])))
    return os.environ["LOCAL_KERNELS"]


def test_fp8_arguments():
    args = generate_e2e.parse_args(["--device", "cpu", "--quantize", "fp8"])
    assert args.quantize == "fp8" and not args.train and args.fp8_block == [16, 16]  # tiny widths: 16x16 blocks
    assert generate_e2e.parse_args(["--device", "cpu", "--quantize", "fp8", "--no-tiny"]).fp8_block == [128, 128]
    assert generate_e2e.parse_args(["--device", "cpu"]).fp8_block is None
    for refused in (["--train"], ["--profile-train"], ["--finegrained-fp8", "somewhere"]):
        quantize = [] if refused[0] == "--finegrained-fp8" else ["--quantize", "fp8"]  # the flag needs fp8 mode
        with pytest.raises(SystemExit):
            generate_e2e.parse_args(["--device", "cpu", *quantize, *refused])


def test_quantize_fp8_converts_like_loading_and_keeps_the_weights():
    """The tiny DeepSeek-V3-style model quantized in place: routed experts -> FP8Experts, every nn.Linear but the LM
    head -> FP8Linear (the routers are no nn.Linear), e4m3 weights whose 16x16 block scales bring back the original
    within e4m3's rounding; kv_a_proj_with_mqa (24 rows, no multiple of 16) stays as it was."""
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear

    args = generate_e2e.parse_args(["--device", "cpu", "--quantize", "fp8", "--models", "deepseek-v3"])
    spec = generate_e2e.SPECS["deepseek-v3"]
    model, shape = generate_e2e.build_model(spec, args, torch.device("cpu"), torch.float32, None)
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    linears = {name for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    before = generate_e2e.model_record(model, spec, shape, args, 0.0)
    generate_e2e.quantize_fp8_(model, args.fp8_block)

    ((_, experts),) = generate_e2e.experts_modules(model)
    assert isinstance(experts, FP8Experts) and model.is_quantized and model.hf_quantizer is not None
    converted = {name for name, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert converted == linears - {"lm_head"} and type(model.lm_head) is torch.nn.Linear
    kept = "model.layers.0.self_attn.kv_a_proj_with_mqa"
    assert model.get_submodule(kept).weight.dtype == torch.float32
    assert torch.equal(model.get_submodule(kept).weight, original[f"{kept}.weight"])
    E, F, H = shape.num_experts, shape.ffn, shape.hidden
    assert experts.gate_up_proj_scale_inv.shape == (E, 2 * F // 16, H // 16)
    assert experts.down_proj_scale_inv.shape == (E, H // 16, F // 16)

    checked = 0
    for name, module in model.named_modules():
        if not isinstance(module, (FP8Linear, FP8Experts)) or name == kept:
            continue
        for attr in ("weight", "gate_up_proj", "down_proj"):
            weight = getattr(module, attr, None)
            if not isinstance(weight, torch.Tensor):
                continue
            assert weight.dtype == torch.float8_e4m3fn, (name, attr)
            scale = getattr(module, f"{attr}_scale_inv")
            assert scale.dtype == torch.float32 and scale.shape[-2:] == (weight.shape[-2] // 16, weight.shape[-1] // 16)
            back = weight.detach().float() * scale.detach().repeat_interleave(16, dim=-2).repeat_interleave(16, dim=-1)
            ref = original[f"{name}.{attr}"]
            error = float((back - ref).norm() / ref.norm())
            assert 0 < error < 0.05, (name, attr, error)  # quantized (not copied), to e4m3's 3 mantissa bits
            checked += 1
    assert checked == len(converted) - 1 + 2  # every FP8Linear but the one kept, and both expert stacks

    record = generate_e2e.model_record(model, spec, shape, args, 0.0)
    quant = record["quantization"]
    assert quant["method"] == "fp8" and quant["weight_block_size"] == [16, 16] and quant["unquantized"] == [kept]
    assert (quant["fp8_linear"], quant["fp8_experts"]) == (len(converted), 1)
    assert record["params"] > before["params"]  # the scales are parameters too
    assert record["weights_gib"] < 0.5 * before["weights_gib"]  # most bytes were fp32, now one each


def test_finegrained_fp8_is_served_from_a_source_folder(stand_in_source, fresh_fp8_kernel, tmp_path):
    import kernels

    served = generate_e2e.serve_finegrained_fp8(stand_in_source)
    assert served["version"] == 4 and served["source"] == str(stand_in_source)
    assert os.environ["LOCAL_KERNELS"].startswith(fresh_fp8_kernel + ":kernels-community/finegrained-fp8=")
    kernel = kernels.get_kernel("kernels-community/finegrained-fp8", version=4)  # what transformers asks for
    assert kernel.__name__ == served["module"] and hasattr(kernel, "CALLS")
    metadata = json.loads((Path(kernel.__file__).parent / "metadata.json").read_text())
    assert metadata["version"] == 4 and metadata["name"] == "finegrained-fp8"
    with pytest.raises(SystemExit):
        generate_e2e.serve_finegrained_fp8(tmp_path)  # no torch-ext/finegrained_fp8 there


@needs_interpreter
def test_cpu_smoke_fp8_matches_transformers_fp8_loop(stand_in_source, fresh_fp8_kernel, kernel_calls):
    """Qwen3-MoE and DeepSeek-V3, FP8-quantized, through every implementation: transformers' FP8 ones (eager loop,
    grouped_mm, batched_mm, and grouped_mm_always, registered in FP8ExpertsInterface) on the served stand-in kernel,
    the package's on its own kernels; at fp32 the package's tokens and logits are the eager loop's."""
    names = ("qwen3-30b-a3b", "deepseek-v3")
    results = generate_e2e.main(["--device", "cpu", "--quantize", "fp8", "--finegrained-fp8", str(stand_in_source),
                                 "--models", ",".join(names), "--batches", "1", "--impls",
                                 f"moe_dispatch,batched_mm,{generate_e2e.ALWAYS_GROUPED}"])
    peer = results["meta"]["finegrained_fp8"]
    assert peer["loaded"] == peer["module"] and "error" not in peer and peer["version"] == 4
    impls = {"eager", "grouped_mm", "moe_dispatch", "batched_mm", generate_e2e.ALWAYS_GROUPED}
    assert {(c["model"], c["impl"]) for c in results["decode"]} == {(m, i) for m in names for i in impls}
    for c in results["decode"] + results["logits"]:
        assert "error" not in c, c
    for c in results["decode"]:
        if c["impl"] == "moe_dispatch":
            assert c["rows_equal"] == 1.0 and c["first_diff"] is None, c
    for c in results["logits"]:
        if c["impl"] == "moe_dispatch":
            assert c["max_abs_diff"] <= 1e-4 * c["ref_max_abs"] and c["rows_flipped"] == 0, c
    assert kernel_calls, "moe_dispatch's fused_experts never ran"
    calls = set(sys.modules[peer["module"]].CALLS)
    assert calls == {"matmul_2d", "matmul_grouped", "matmul_batched"}  # every FP8 path of transformers used it
    for name in names:
        quant = results["models"][name]["quantization"]
        assert quant["fp8_experts"] == 1 and quant["fp8_linear"] >= 4 and quant["weight_block_size"] == [16, 16]
    assert not results["train"]


@needs_interpreter
@pytest.mark.skipif(not (PEER_SOURCE / "torch-ext" / "finegrained_fp8").is_dir(),
                    reason="needs the finegrained-fp8 kernel's source, which the repository does not hold: set "
                           "MOE_DISPATCH_FINEGRAINED_FP8_SOURCE to a folder with its build.toml and "
                           "torch-ext/finegrained_fp8/ (a copy of kernels-community's finegrained-fp8 source)")
def test_cpu_smoke_fp8_on_the_real_finegrained_fp8_kernel(fresh_fp8_kernel, kernel_calls):
    """The kernel's own w8a8 matmul (activations quantized to e4m3 per 16 columns) runs transformers' FP8Linear layers
    and eager FP8 loop in the interpreter, each autotuner kept to its first config; the package (weight-only FP8 on
    the CPU) decodes and its logits agree with that loop's to FP8 rounding."""
    results = generate_e2e.main(["--device", "cpu", "--quantize", "fp8", "--finegrained-fp8", str(PEER_SOURCE),
                                 "--models", "qwen3-30b-a3b", "--batches", "1", "--impls", "moe_dispatch"])
    peer = results["meta"]["finegrained_fp8"]
    assert peer["loaded"] == peer["module"] and peer["autotune_pinned"] > 0 and "error" not in peer
    cells = {c["impl"]: c for c in results["decode"]}
    for impl in ("eager", "moe_dispatch"):
        assert "error" not in cells[impl], cells[impl]
    assert "rows_equal" in cells["moe_dispatch"]
    (logits,) = [c for c in results["logits"] if c["impl"] == "moe_dispatch"]
    assert logits["max_abs_diff"] <= 0.1 * logits["ref_max_abs"], logits
    assert kernel_calls
