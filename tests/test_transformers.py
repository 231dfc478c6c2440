"""moe-dispatch inside transformers: the experts interface and the kernelize layers.

Each model case builds a random-weight model from its config (nothing is downloaded) and compares its logits with
transformers' own `experts_implementation="eager"`:

- experts interface: `register_experts()` + `experts_implementation=...` (config) or `set_experts_implementation`;
- kernelize: `layers.MegaBlocksMoeMLP` (GPT-OSS) and `layers.SparseMoeBlock` (the others) through `kernels.kernelize`;
- both with the package imported from torch-ext and with the build loaded by `kernels.get_kernel` + `LOCAL_KERNELS`.

On the CPU the kernels run through the Triton interpreter, so the models are tiny. The GPU tests (skipped without
CUDA) use real layer sizes in bf16 and a short `generate()`.
"""

import gc
import importlib
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import moe_dispatch  # from torch-ext (pytest.ini's pythonpath)
from moe_dispatch.reference import W8A8_TOLERANCE
from helpers import DEVICE, assert_close, needs_gpu

ROOT = Path(__file__).resolve().parents[1]
transformers = pytest.importorskip("transformers")
kernels = pytest.importorskip("kernels")

HUB_REPO_ID = "moe-dispatch-tests/moe-dispatch"  # only ever resolved through LOCAL_KERNELS
VOCAB = 96


@dataclass(frozen=True)
class ModelCase:
    id: str
    family: str  # transformers.models.<family>
    config: str
    model: str
    block: str  # the MoE block class kernelize replaces
    layer: str  # its replacement in moe_dispatch.layers
    tiny: dict = field(default_factory=dict)  # config of the CPU model (on top of TINY)
    real: dict = field(default_factory=dict)  # one decoder layer of the released model, for the GPU
    why: str = ""


TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
    initializer_range=0.1,  # large enough that the experts, not the residual, dominate the logits
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)

MODELS = [
    ModelCase(
        "mixtral", "mixtral", "MixtralConfig", "MixtralForCausalLM", "MixtralSparseMoeBlock", "SparseMoeBlock",
        tiny=dict(num_local_experts=4, num_experts_per_tok=2),
        real=dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                  num_attention_heads=32, num_key_value_heads=8),
        why="softmax top-2, renormalised, fp32 top_k_weights into a model-dtype experts module",
    ),
    ModelCase(
        "qwen2_moe", "qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", "Qwen2MoeSparseMoeBlock", "SparseMoeBlock",
        tiny=dict(moe_intermediate_size=48, shared_expert_intermediate_size=32, num_experts=6, num_experts_per_tok=2,
                  norm_topk_prob=False),
        real=dict(hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
                  shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4, norm_topk_prob=False,
                  num_attention_heads=16, num_key_value_heads=16),
        why="sigmoid-gated shared expert beside the routed ones; weights not renormalised",
    ),
    ModelCase(
        "qwen3_moe", "qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "Qwen3MoeSparseMoeBlock", "SparseMoeBlock",
        tiny=dict(moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, head_dim=16),
        real=dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                  num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4,
                  head_dim=128),
        why="many small experts (128, top-8) at real size",
    ),
    ModelCase(
        "olmoe", "olmoe", "OlmoeConfig", "OlmoeForCausalLM", "OlmoeSparseMoeBlock", "SparseMoeBlock",
        tiny=dict(num_experts=8, num_experts_per_tok=2),
        real=dict(hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8,
                  num_attention_heads=16, num_key_value_heads=16),
        why="E=8 with T*k=24 rows: some experts get no rows",
    ),
    ModelCase(
        "deepseek_v3", "deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM", "DeepseekV3MoE", "SparseMoeBlock",
        tiny=dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                  n_shared_experts=1, first_k_dense_replace=0, routed_scaling_factor=2.5, norm_topk_prob=True,
                  num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                  v_head_dim=16),
        real=dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
                  num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1, first_k_dense_replace=0,
                  routed_scaling_factor=2.5, norm_topk_prob=True, num_attention_heads=128, num_key_value_heads=128,
                  q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128),
        why="sigmoid + correction-bias group-limited routing, scaled fp32 weights, ungated shared expert",
    ),
    ModelCase(
        "gpt_oss", "gpt_oss", "GptOssConfig", "GptOssForCausalLM", "GptOssMLP", "MegaBlocksMoeMLP",
        # swiglu_limit well inside the activations' range so both clamps bite
        tiny=dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8, swiglu_limit=0.5,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        real=dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                  num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
                  swiglu_limit=7.0, rope_parameters={"rope_type": "default", "rope_theta": 150000.0}),
        why="transposed weights, interleaved gate/up, biases on both projections, clamped SwiGLU",
    ),
]
MODEL_IDS = [case.id for case in MODELS]


def _modeling(case: ModelCase):
    return importlib.import_module(f"transformers.models.{case.family}.modeling_{case.family}")


def build_model(case: ModelCase, dtype: torch.dtype, experts_implementation: str, *, sizes: dict | None = None,
                num_layers: int | None = None, device: str = DEVICE, seed: int = 0):
    """A random-weight model of `case` (tiny unless `sizes` gives the layer shapes), in eval mode."""
    options = {**TINY, **(case.tiny if sizes is None else sizes)}
    if num_layers is not None:
        options["num_hidden_layers"] = num_layers
    config = getattr(transformers, case.config)(
        **options, attn_implementation="eager", experts_implementation=experts_implementation
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, case.model)(config)
        # Parameters transformers initialises to zero, randomised so that they are exercised.
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("gate_up_proj_bias", "down_proj_bias", "e_score_correction_bias")):
                with torch.no_grad():
                    tensor.normal_(0.0, 0.1)
    return model.to(dtype).eval()


def input_ids(batch: int = 2, seq: int = 6, device: str = DEVICE, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, seq), generator=generator).to(device)


def moe_blocks(model, case: ModelCase) -> list:
    block_cls = getattr(_modeling(case), case.block)
    return [module for module in model.modules() if isinstance(module, block_cls)]


@pytest.fixture
def count_kernel_calls(monkeypatch):
    """Counts `fused_experts` launches made by a package's transformers integration (proof the kernel ran)."""

    def install(package) -> list:
        calls = []
        original = package.transformers_experts.fused_experts

        def counted(*args, **kwargs):
            calls.append(args[0].shape)
            return original(*args, **kwargs)

        monkeypatch.setattr(package.transformers_experts, "fused_experts", counted)
        return calls

    return install


@pytest.fixture
def hook_block_class(monkeypatch):
    """`replace_kernel_forward_from_hub(block, name)` for one test, undone afterwards (GPT-OSS is marked already)."""

    def install(case: ModelCase):
        block_cls = getattr(_modeling(case), case.block)
        if getattr(block_cls, "kernel_layer_name", None) == case.layer:
            return
        monkeypatch.setattr(block_cls, "kernel_layer_name", None, raising=False)
        monkeypatch.setattr(block_cls, "kernel_condition", None, raising=False)
        kernels.replace_kernel_forward_from_hub(block_cls, case.layer)

    return install


# transformers marks other layers too (RMSNorm, rotary, ...): those keep their forward, while a problem with the
# mapped MoE layer (wrong device, mode or signature, failed load) raises instead of silently falling back.
ONLY_UNMAPPED_LAYERS = kernels.KernelizeFallback.NO_LAYER


class PackageLayers:
    """A kernelize repository serving the layers of a package already imported (the torch-ext checkout)."""

    def __init__(self, package, layer_name: str):
        self.package = package
        self.layer_name = layer_name

    def load(self):
        return getattr(self.package.layers, self.layer_name)


def kernelize_model(model, case: ModelCase, repository):
    """kernelize for inference on DEVICE; the mapping has an entry for that device type only ("cpu" or "cuda")."""
    mapping = {case.layer: {DEVICE: {kernels.Mode.INFERENCE: repository}}}
    with kernels.use_kernel_mapping(mapping):
        kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device=DEVICE, use_fallback=ONLY_UNMAPPED_LAYERS)


def run(model, ids):
    with torch.no_grad():
        return model(ids, output_router_logits=True)


def check_outputs(case: ModelCase, got, ref, dtype: torch.dtype, what: str):
    assert_close(got.logits, ref.logits, dtype, f"{case.id} {what} logits")
    # The router ran, and its logits reached transformers' output recorder (hence aux losses).
    assert len(got.router_logits) == len(ref.router_logits) > 0
    for layer, (got_logits, ref_logits) in enumerate(zip(got.router_logits, ref.router_logits)):
        assert_close(got_logits, ref_logits, dtype, f"{case.id} {what} router logits of layer {layer}")
    # Half precision may flip a near-tie top-k choice in a later layer: a discrete jump in the load-balancing loss.
    if ref.aux_loss is not None and dtype == torch.float32:
        assert_close(got.aux_loss, ref.aux_loss, dtype, f"{case.id} {what} aux loss")


# --------------------------------------------------------------------------------------------------------------------
# Experts interface, package from torch-ext


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", MODELS, ids=MODEL_IDS)
def test_experts_interface_matches_eager(case, dtype, count_kernel_calls):
    name = moe_dispatch.register_experts()
    ref_model = build_model(case, dtype, "eager")
    # Selected in the config, as `from_pretrained(..., experts_implementation=name)` does.
    model = build_model(case, dtype, name)
    model.load_state_dict(ref_model.state_dict())
    assert model.config._experts_implementation == name
    ids = input_ids()
    ref = run(ref_model, ids)
    calls = count_kernel_calls(moe_dispatch)
    got = run(model, ids)
    assert len(calls) == len(moe_blocks(model, case))
    check_outputs(case, got, ref, dtype, f"experts interface {dtype}")


def test_from_pretrained_experts_implementation(tmp_path, count_kernel_calls):
    """The README's path: register, then `from_pretrained(..., experts_implementation=name)` on a saved checkpoint."""
    case = MODELS[MODEL_IDS.index("qwen2_moe")]
    ref_model = build_model(case, torch.float32, "eager", num_layers=1)
    ref_model.save_pretrained(tmp_path)
    name = moe_dispatch.register_experts()
    model = getattr(transformers, case.model).from_pretrained(tmp_path, experts_implementation=name,
                                                             dtype=torch.float32).to(DEVICE)
    assert model.config._experts_implementation == name and not model.training
    calls = count_kernel_calls(moe_dispatch)
    ids = input_ids()
    check_outputs(case, run(model, ids), run(ref_model, ids), torch.float32, "from_pretrained")
    assert len(calls) == 1


# --------------------------------------------------------------------------------------------------------------------
# kernelize layers, package from torch-ext


@pytest.mark.parametrize("case", MODELS, ids=MODEL_IDS)
def test_kernelize_layers_match_eager(case, count_kernel_calls, hook_block_class):
    dtype = torch.float32
    model = build_model(case, dtype, "eager")
    ids = input_ids()
    ref = run(model, ids)
    blocks = moe_blocks(model, case)
    block_input = torch.randn(2, 3, model.config.hidden_size, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with torch.no_grad():
        ref_block_out = blocks[0](block_input)

    hook_block_class(case)
    kernelize_model(model, case, PackageLayers(moe_dispatch, case.layer))
    layer_cls = getattr(moe_dispatch.layers, case.layer)
    assert all(block.forward.__func__ is layer_cls.forward for block in blocks)

    calls = count_kernel_calls(moe_dispatch)
    got = run(model, ids)
    assert len(calls) == len(blocks)
    check_outputs(case, got, ref, dtype, "kernelize")

    # The block's return convention is the original's: a tensor, or GPT-OSS's (out, router_scores).
    with torch.no_grad():
        block_out = blocks[0](block_input)
    if isinstance(ref_block_out, tuple):
        assert isinstance(block_out, tuple) and len(block_out) == len(ref_block_out)
        assert_close(block_out[0], ref_block_out[0], dtype, f"{case.id} block output")
        torch.testing.assert_close(block_out[1], ref_block_out[1], rtol=0, atol=0)
    else:
        assert isinstance(block_out, torch.Tensor)
        assert_close(block_out, ref_block_out, dtype, f"{case.id} block output")


@pytest.mark.parametrize("case_id", ["mixtral", "gpt_oss"])
def test_kernelize_layers_train(case_id, count_kernel_calls, hook_block_class):
    """kernelize(mode=Mode.TRAINING) picks the layers (has_backward) and a training step matches eager's."""
    case = next(c for c in MODELS if c.id == case_id)
    ref_model = build_model(case, torch.float32, "eager").train()
    model = build_model(case, torch.float32, "eager").train()
    model.load_state_dict(ref_model.state_dict())
    hook_block_class(case)
    mapping = {case.layer: {DEVICE: {kernels.Mode.TRAINING: PackageLayers(moe_dispatch, case.layer)}}}
    with kernels.use_kernel_mapping(mapping):
        kernels.kernelize(model, mode=kernels.Mode.TRAINING, device=DEVICE, use_fallback=ONLY_UNMAPPED_LAYERS)
    layer_cls = getattr(moe_dispatch.layers, case.layer)
    assert all(block.forward.__func__ is layer_cls.forward for block in moe_blocks(model, case))
    calls = count_kernel_calls(moe_dispatch)
    ids = input_ids()
    ref_loss, ref_grads = _training_step(ref_model, ids)
    loss, grads = _training_step(model, ids)
    assert len(calls) == TINY["num_hidden_layers"]
    assert_close(loss, ref_loss, torch.float32, f"{case_id} kernelized loss")
    for name, ref_grad in ref_grads.items():
        if ref_grad is not None:
            assert_close(grads[name], ref_grad, torch.float32, f"{case_id} kernelized d {name}")


# --------------------------------------------------------------------------------------------------------------------
# The same package built as a Hub kernel and loaded with kernels.get_kernel + LOCAL_KERNELS


def _build_kernel_repo(repo_dir: Path) -> Path:
    """Write the kernel repo layout (`build/torch-<backend>/`) into `repo_dir`; returns `repo_dir`.

    Uses the project's `scripts/build` when it is there, else a minimal stand-in: a flat copy of the package plus
    the `metadata.json` the loader requires, for this machine's backend only.
    """
    build_script = ROOT / "scripts" / "build"
    if build_script.exists():
        done = subprocess.run([sys.executable, str(build_script), "--out", str(repo_dir / "build")], cwd=ROOT,
                              capture_output=True, text=True)
        assert done.returncode == 0, f"scripts/build failed:\n{done.stdout}\n{done.stderr}"
        return repo_dir
    backend = "cuda" if torch.version.cuda else "rocm" if torch.version.hip else "cpu"
    variant = repo_dir / "build" / f"torch-{backend}"
    package_dir = Path(moe_dispatch.__file__).parent
    shutil.copytree(package_dir, variant, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    metadata = {
        "name": "moe-dispatch",
        "id": f"_moe_dispatch_{backend}_test",
        "version": 1,
        "license": "Apache-2.0",
        "python-depends": [],
        "backend": {"type": backend},
    }
    (variant / "metadata.json").write_text(json.dumps(metadata))
    return repo_dir


@pytest.fixture(scope="module")
def hub_kernel(tmp_path_factory):
    """(module returned by get_kernel, repo directory) with LOCAL_KERNELS pointing the test repo id at the build."""
    repo_dir = _build_kernel_repo(tmp_path_factory.mktemp("moe_dispatch_kernel"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LOCAL_KERNELS", f"{HUB_REPO_ID}={repo_dir}")
        package = kernels.get_kernel(HUB_REPO_ID, version=1)
        yield package, repo_dir


def test_hub_kernel_is_a_separate_copy(hub_kernel):
    package, _ = hub_kernel
    for name in ("moe_dispatch_experts", "register_experts"):
        assert name in package.__all__
    if moe_dispatch.__name__ != "moe_dispatch":
        pytest.skip("the suite itself runs on a hub build (MOE_DISPATCH_FROM=hub): both are that one module")
    assert package is not moe_dispatch and package.__name__ != moe_dispatch.__name__
    assert package.layers.MegaBlocksMoeMLP is not moe_dispatch.layers.MegaBlocksMoeMLP


# One model per layer class of the Hub build (SparseMoeBlock, MegaBlocksMoeMLP): the build is a copy of torch-ext's
# package, whose every model runs above through both the experts interface and kernelize (MOE_DISPATCH_FROM=hub runs
# the whole suite on the build); what is the Hub's own here is the copy's registration under its own name and each
# layer class resolved through a LayerRepository.
HUB_MODELS = [case for case in MODELS if case.id in ("mixtral", "gpt_oss")]


@pytest.mark.parametrize("case", HUB_MODELS, ids=lambda case: case.id)
def test_hub_kernel_experts_and_layers_match_eager(case, hub_kernel, count_kernel_calls, hook_block_class):
    package, _ = hub_kernel
    dtype = torch.float32
    model = build_model(case, dtype, "eager")
    ids = input_ids()
    ref = run(model, ids)
    calls = count_kernel_calls(package)
    blocks = moe_blocks(model, case)

    # Experts interface, selected on a built model. The hub copy registers its own function.
    name = package.register_experts("moe_dispatch_hub")
    model.set_experts_implementation(name)
    assert model.config._experts_implementation == name
    check_outputs(case, run(model, ids), ref, dtype, "hub experts interface")
    assert len(calls) == len(blocks)

    # kernelize, the layer fetched the way users map it (a LayerRepository), resolved through LOCAL_KERNELS.
    # (`version=` would first list the repo's branches on the Hub, so the local test pins a revision instead.)
    model.set_experts_implementation("eager")
    hook_block_class(case)
    kernelize_model(model, case, kernels.LayerRepository(HUB_REPO_ID, layer_name=case.layer, revision="v1"))
    layer_cls = getattr(package.layers, case.layer)
    assert all(block.forward.__func__ is layer_cls.forward for block in blocks)
    check_outputs(case, run(model, ids), ref, dtype, "hub kernelize")
    assert len(calls) == 2 * len(blocks)


def test_local_layer_repository(hub_kernel, count_kernel_calls):
    """`LocalLayerRepository(path)`: kernelize from a build directory without any repo id."""
    package, repo_dir = hub_kernel
    case = MODELS[MODEL_IDS.index("gpt_oss")]
    model = build_model(case, torch.float32, "eager", num_layers=1)
    ids = input_ids(batch=1, seq=5)
    ref = run(model, ids)
    kernelize_model(model, case, kernels.LocalLayerRepository(repo_dir, layer_name=case.layer))
    check_outputs(case, run(model, ids), ref, torch.float32, "LocalLayerRepository")


# --------------------------------------------------------------------------------------------------------------------
# What the experts function accepts and refuses


def _tiny_experts(case_id: str, dtype=torch.float32, **config_changes):
    case = MODELS[MODEL_IDS.index(case_id)]
    model = build_model(case, dtype, "eager", num_layers=1)
    for key, value in config_changes.items():
        setattr(model.config, key, value)
    return model, moe_blocks(model, case)[0].experts


def test_expert_parallel_sentinels_contribute_nothing():
    """Ids == E (transformers' expert-parallel sentinel) are skipped whatever their weight, like eager."""
    _, experts = _tiny_experts("mixtral")
    num_experts = experts.num_experts
    generator = torch.Generator().manual_seed(3)
    hidden_states = torch.randn(7, experts.hidden_dim, generator=generator).to(DEVICE)
    top_k_index = torch.randint(0, num_experts, (7, 2), generator=generator).to(DEVICE)
    top_k_index[1, 0] = num_experts
    top_k_index[4, :] = num_experts
    top_k_weights = torch.rand(7, 2, generator=generator).to(DEVICE)
    top_k_weights[1, 0] = 0.0  # as RouterParallel leaves it; [4, :] keeps nonzero weights on purpose
    with torch.no_grad():
        expected = experts(hidden_states, top_k_index, top_k_weights)  # eager
        got = moe_dispatch.moe_dispatch_experts(experts, hidden_states, top_k_index, top_k_weights)
    assert_close(got, expected, torch.float32, "experts with sentinels")
    assert torch.equal(got[4], torch.zeros_like(got[4]))


@pytest.mark.parametrize("case_id", ["mixtral", "gpt_oss"])
def test_expert_parallel_layer_replaces_an_experts_module(case_id):
    """docs/usage.md's swap `block.experts = ExpertParallelExperts.from_experts_module(block.experts, group)`, here on
    one rank (no process group): same forward signature and result as the eager experts module, layout and activation
    read as the experts function reads them (GPT-OSS: transposed, interleaved, biases, clamped SwiGLU)."""
    _, experts = _tiny_experts(case_id)
    layer = moe_dispatch.ExpertParallelExperts.from_experts_module(experts)
    generator = torch.Generator().manual_seed(5)
    hidden_states = torch.randn(6, experts.gate_up_proj.shape[2 if case_id == "mixtral" else 1],
                                generator=generator).to(DEVICE)
    top_k_index = torch.rand(6, experts.num_experts, generator=generator).argsort(dim=1)[:, :2].to(DEVICE)
    top_k_weights = torch.rand(6, 2, generator=generator).to(DEVICE)
    with torch.no_grad():
        assert_close(layer(hidden_states, top_k_index, top_k_weights),
                     experts(hidden_states, top_k_index, top_k_weights), torch.float32, "EP layer vs eager")


def _fake_gate(self, gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.relu(gate) * up


@pytest.mark.parametrize(
    "change, message",
    [
        ("act_fn_gelu", "activation `act_fn`"),
        ("custom_gate", "gate function"),
        ("no_gate", "has_gate=False"),
        ("post_norm", "has_post_expert_norm"),
        ("fp8_weights", "dtype"),
    ],
)
def test_unsupported_experts_raise_clearly(change, message, monkeypatch):
    _, experts = _tiny_experts("qwen3_moe")
    if change == "act_fn_gelu":
        experts.act_fn = transformers.activations.ACT2FN["gelu"]
    elif change == "custom_gate":
        monkeypatch.setattr(type(experts), "_apply_gate", _fake_gate)
    elif change == "no_gate":
        experts.has_gate = False
    elif change == "post_norm":
        experts.has_post_expert_norm = True
    elif change == "fp8_weights":
        if not hasattr(torch, "float8_e4m3fn"):
            pytest.skip("no float8 dtype in this torch")
        experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.data.to(torch.float8_e4m3fn), False)
    hidden_states = torch.randn(3, experts.hidden_dim, device=DEVICE)
    top_k_index = torch.zeros(3, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(NotImplementedError, match=message) as error:
        moe_dispatch.moe_dispatch_experts(experts, hidden_states, top_k_index, torch.ones(3, 2, device=DEVICE))
    assert type(experts).__name__ in str(error.value)


def _training_step(model, ids, forward=None):
    """Loss and every parameter's gradient of one language-modelling step (router aux loss included); `forward` runs
    the model instead of itself (a compiled wrapper)."""
    model.zero_grad(set_to_none=True)
    out = (model if forward is None else forward)(ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    return out.loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("case", MODELS, ids=MODEL_IDS)
def test_training_step_matches_eager(case):
    """model.train() through the experts interface: the loss and every parameter's gradient equal eager's (fp32)."""
    name = moe_dispatch.register_experts()
    ref_model = build_model(case, torch.float32, "eager").train()
    model = build_model(case, torch.float32, name).train()
    model.load_state_dict(ref_model.state_dict())
    ids = input_ids()
    ref_loss, ref_grads = _training_step(ref_model, ids)
    loss, grads = _training_step(model, ids)
    assert_close(loss, ref_loss, torch.float32, f"{case.id} loss")
    experts_grads = 0
    for param_name, ref_grad in ref_grads.items():
        if ref_grad is None:
            assert grads[param_name] is None, param_name
            continue
        assert_close(grads[param_name], ref_grad, torch.float32, f"{case.id} d {param_name}")
        experts_grads += ".experts." in param_name
    assert experts_grads >= 2 * TINY["num_hidden_layers"]  # the routed experts' weights did get gradients


@pytest.mark.parametrize("case_id", ["mixtral", "gpt_oss"])
def test_compiled_training_step(case_id):
    """torch.compile(model, fullgraph=True) with the experts interface: forward and backward with no graph break,
    loss and gradients equal to the uncompiled run. (transformers' own eager and grouped_mm experts break the graph
    here: data-dependent shapes.)"""
    case = next(c for c in MODELS if c.id == case_id)
    name = moe_dispatch.register_experts()
    model = build_model(case, torch.float32, name).train()
    ids = input_ids()
    loss, grads = _training_step(model, ids)
    torch._dynamo.reset()
    compiled_loss, compiled_grads = _training_step(
        model, ids, torch.compile(model, fullgraph=True, backend="aot_eager"))
    assert_close(compiled_loss, loss, torch.float32, f"{case_id} compiled loss")
    for param_name, grad in grads.items():
        if grad is not None:
            assert_close(compiled_grads[param_name], grad, torch.float32, f"{case_id} compiled d {param_name}")


def test_cached_options_follow_module_changes():
    """The experts function caches each module's options; a change after the first call is seen: a new activation
    (refused), new weights and a new GPT-OSS `alpha` (results follow the eager module), and a dead module's entry
    goes with it."""
    model, experts = _tiny_experts("gpt_oss")
    generator = torch.Generator().manual_seed(7)
    hidden_states = torch.randn(5, experts.gate_up_proj.shape[1], generator=generator).to(DEVICE)
    top_k_index = torch.rand(5, experts.num_experts, generator=generator).argsort(dim=1)[:, :2].to(DEVICE)
    top_k_weights = torch.rand(5, 2, generator=generator).to(DEVICE)

    def check(what):
        with torch.no_grad():
            got = moe_dispatch.moe_dispatch_experts(experts, hidden_states, top_k_index, top_k_weights)
            assert_close(got, experts(hidden_states, top_k_index, top_k_weights), torch.float32, what)

    check("first call")
    experts.alpha = experts.alpha * 3.0
    check("after a new alpha")
    experts.down_proj = torch.nn.Parameter(torch.randn_like(experts.down_proj), requires_grad=False)
    check("after new down_proj weights")
    key = id(experts)
    assert key in moe_dispatch.transformers_experts._OPTIONS
    del model, experts
    gc.collect()
    assert key not in moe_dispatch.transformers_experts._OPTIONS

    _, experts = _tiny_experts("qwen3_moe")
    hidden_states = torch.randn(3, experts.hidden_dim, device=DEVICE)
    top_k_index = torch.zeros(3, 2, dtype=torch.int64, device=DEVICE)
    moe_dispatch.moe_dispatch_experts(experts, hidden_states, top_k_index, torch.ones(3, 2, device=DEVICE))
    experts.act_fn = transformers.activations.ACT2FN["gelu"]
    with pytest.raises(NotImplementedError, match="activation `act_fn`"):
        moe_dispatch.moe_dispatch_experts(experts, hidden_states, top_k_index, torch.ones(3, 2, device=DEVICE))


def test_swish_act_fn_is_accepted():
    """`hidden_act="swish"` gives nn.SiLU rather than transformers' SiLUActivation: the same function."""
    _, experts = _tiny_experts("olmoe")
    experts.act_fn = transformers.activations.ACT2FN["swish"]
    assert moe_dispatch.transformers_experts.fused_experts_options(experts)["activation"] == "silu"


def test_gpt_oss_options_read_from_the_module():
    _, experts = _tiny_experts("gpt_oss")
    options = moe_dispatch.transformers_experts.fused_experts_options(experts)
    assert options["activation"] == "swiglu_oai" and options["interleaved"] and options["transposed"]
    assert options["swiglu_alpha"] == pytest.approx(experts.alpha)
    assert options["swiglu_limit"] == pytest.approx(experts.limit)
    assert options["gate_up_bias"] is experts.gate_up_proj_bias and options["down_bias"] is experts.down_proj_bias


def test_layers_follow_kernelize_rules():
    """No constructor, no members beyond forward / can_torch_compile / has_backward (kernels checks this too)."""
    module_members = set(dir(torch.nn.Module))
    for layer_name in ("MegaBlocksMoeMLP", "SparseMoeBlock"):
        layer_cls = getattr(moe_dispatch.layers, layer_name)
        assert layer_cls.__init__ is torch.nn.Module.__init__
        assert set(dir(layer_cls)) - module_members <= {"can_torch_compile", "has_backward"}
        assert isinstance(layer_cls.can_torch_compile, bool) and isinstance(layer_cls.has_backward, bool)


# --------------------------------------------------------------------------------------------------------------------
# GPU: real layer sizes in bf16, and generate()


@needs_gpu
@pytest.mark.whole_gpu  # DeepSeek-V3's layer alone allocates 28 GiB of experts at once
@pytest.mark.parametrize("case", MODELS, ids=MODEL_IDS)
def test_gpu_real_layer_sizes_bf16(case, count_kernel_calls):
    """One decoder layer of the released model; bf16 kernel vs bf16 eager on the same weights."""
    name = moe_dispatch.register_experts()
    sizes = {**case.tiny, **case.real, "initializer_range": 0.02}
    model = build_model(case, torch.bfloat16, "eager", sizes=sizes, num_layers=1, device="cuda")
    ids = input_ids(batch=2, seq=64, device="cuda")
    block = moe_blocks(model, case)[0]
    outputs = {}
    handle = block.register_forward_hook(lambda module, args, out: outputs.__setitem__("block", out))
    ref = run(model, ids)
    ref_block = outputs["block"]
    model.set_experts_implementation(name)
    calls = count_kernel_calls(moe_dispatch)
    got = run(model, ids)
    handle.remove()
    assert len(calls) == 1
    first = (lambda out: out[0] if isinstance(out, tuple) else out)
    assert_close(first(outputs["block"]), first(ref_block), torch.bfloat16, f"{case.id} real-size block")
    check_outputs(case, got, ref, torch.bfloat16, "real-size bf16")


@needs_gpu
@pytest.mark.parametrize("case_id", ["mixtral", "gpt_oss"])
def test_gpu_generate_tokens_match_eager(case_id):
    """Greedy decoding (prefill then T=1 steps) picks the same tokens with the kernel as with eager."""
    case = MODELS[MODEL_IDS.index(case_id)]
    name = moe_dispatch.register_experts()
    sizes = {**case.tiny, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64, "initializer_range": 0.05}
    model = build_model(case, torch.float32, "eager", sizes=sizes, device="cuda")
    ids = input_ids(batch=2, seq=8, device="cuda")
    generate = dict(max_new_tokens=12, do_sample=False, pad_token_id=2)
    ref = model.generate(ids, **generate)
    model.set_experts_implementation(name)
    got = model.generate(ids, **generate)
    assert torch.equal(got, ref), f"{case_id}: tokens differ\n{got}\n{ref}"


@needs_gpu
def test_gpu_from_pretrained_use_kernels(tmp_path, hub_kernel):
    """transformers' own switch: `from_pretrained(use_kernels=True, kernel_config=KernelConfig(...))` on GPT-OSS.

    transformers kernelizes with fallback on every error, so the test checks that the forward really was replaced.
    """
    package, _ = hub_kernel
    case = MODELS[MODEL_IDS.index("gpt_oss")]
    ref_model = build_model(case, torch.bfloat16, "eager", num_layers=1)
    ref_model.save_pretrained(tmp_path)
    layer = (f"{HUB_REPO_ID}:MegaBlocksMoeMLP", {"revision": "v1", "trust_remote_code": True})
    # inherit_mapping=False: only this mapping, not transformers' defaults (other layers keep their forward).
    kernel_config = transformers.KernelConfig({"MegaBlocksMoeMLP": layer}, inherit_mapping=False)
    model = getattr(transformers, case.model).from_pretrained(
        tmp_path, dtype=torch.bfloat16, device_map="cuda", use_kernels=True, kernel_config=kernel_config
    )
    block = moe_blocks(model, case)[0]
    assert block.forward.__func__ is package.layers.MegaBlocksMoeMLP.forward
    ids = input_ids()
    check_outputs(case, run(model, ids), run(ref_model, ids), torch.bfloat16, "use_kernels")


# --------------------------------------------------------------------------------------------------------------------
# FP8 checkpoints: transformers' FP8Experts through FP8ExpertsInterface


def _fp8_experts_model(quant_block=(16, 16), activation_scheme="dynamic", **experts_changes):
    """Tiny Mixtral whose experts are transformers' `FP8Experts` holding block-quantized copies of the random weights,
    and the same model with the float32 dequantized weights in its ordinary experts (the reference). A static
    scheme gets per-expert activation scales of about the size the hidden states need."""
    finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")
    from transformers.integrations.moe import use_experts_implementation

    from moe_dispatch.formats.fp8 import dequantize_experts_fp8, quantize_experts_fp8

    class TinyFP8Experts(finegrained.FP8Experts):  # a subclass: wrapping FP8Experts itself would patch it globally
        pass

    fp8_class = use_experts_implementation(experts_class=TinyFP8Experts,
                                           experts_interface=finegrained.ALL_FP8_EXPERTS_FUNCTIONS)
    case = MODELS[MODEL_IDS.index("mixtral")]
    reference = build_model(case, torch.float32, "eager")
    model = build_model(case, torch.float32, "eager")
    for block, ref_block in zip(moe_blocks(model, case), moe_blocks(reference, case)):
        experts = fp8_class(model.config, block_size=quant_block, activation_scheme=activation_scheme)
        if activation_scheme == "static":
            with torch.no_grad():
                experts.gate_up_proj_activation_scale.copy_(0.02 * (1 + torch.rand(experts.num_experts)))
                experts.down_proj_activation_scale.copy_(0.01 * (1 + torch.rand(experts.num_experts)))
        for name in ("gate_up_proj", "down_proj"):
            q, scale = quantize_experts_fp8(getattr(block.experts, name).detach(), block_shape=quant_block)
            setattr(experts, name, torch.nn.Parameter(q, requires_grad=False))
            setattr(experts, f"{name}_scale_inv", torch.nn.Parameter(scale, requires_grad=False))
            with torch.no_grad():
                getattr(ref_block.experts, name).copy_(dequantize_experts_fp8(q, scale, block_shape=quant_block))
        for key, value in experts_changes.items():  # the variants moe_dispatch refuses, set after the weights
            setattr(experts, key, value)
        block.experts = experts.to(DEVICE)
    return model, reference


def test_fp8_experts_interface_matches_dequantized_eager(count_kernel_calls):
    """FP8Experts (block scales 16 x 16 over 2F = 96, H = 32) through `experts_implementation="moe_dispatch"` equal
    transformers' eager experts on the dequantized weights. transformers' own FP8 path (`FP8Experts.forward`, its
    grouped_mm) needs the finegrained-fp8 GPU kernels from the Hub and does not run on the CPU; the GPU suite
    compares against it (tests/test_gpu_fp8.py)."""
    calls = count_kernel_calls(moe_dispatch)
    model, reference = _fp8_experts_model()
    model.set_experts_implementation(moe_dispatch.register_experts())
    ids = input_ids()
    got, ref = run(model, ids), run(reference, ids)
    assert calls, "the FP8 experts did not run through moe_dispatch"
    assert_close(got.logits, ref.logits, torch.float32, "fp8 mixtral logits")


def test_fp8_experts_static_activation_scales(count_kernel_calls):
    """activation_scheme="static": the module's per-expert `*_activation_scale` become `fused_experts`' static input
    scales. On the w8a8 path (forced here; the CPU picks dequant) one block's experts equal the float64 model of the
    w8a8 arithmetic with those scales; through the interface (dequant on the CPU, static scales unused) the logits
    equal transformers' eager experts on the dequantized weights. On a GPU with FP8 tensor cores the interface's
    "auto" takes w8a8 (the module docstring): there the e4m3 activations put the logits about 2% from that model."""
    from moe_dispatch.reference import fused_experts_w8a8_ref, w8a8_model_tolerance

    model, reference = _fp8_experts_model(quant_block=(32, 32), activation_scheme="static")
    experts = moe_blocks(model, MODELS[MODEL_IDS.index("mixtral")])[0].experts
    options = moe_dispatch.transformers_experts.fp8_experts_options(experts)
    assert options["gate_up_input_scale"] is experts.gate_up_proj_activation_scale
    assert options["down_input_scale"] is experts.down_proj_activation_scale
    T, H, E = 7, experts.gate_up_proj.shape[2], experts.num_experts
    x = torch.randn(T, H, device=DEVICE)
    ids = torch.stack([torch.randperm(E)[:2] for _ in range(T)]).to(DEVICE)
    weights = torch.rand(T, 2, device=DEVICE)
    with torch.no_grad():
        out = moe_dispatch.fused_experts(x, experts.gate_up_proj, experts.down_proj, ids, weights,
                                         fp8_compute="w8a8", **options)
    scales = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    model_out = fused_experts_w8a8_ref(x, experts.gate_up_proj, experts.down_proj, ids, weights, groups=(32, 32),
                                       **scales)
    assert_close(out, model_out, torch.float32, "static FP8Experts on w8a8", tolerance=w8a8_model_tolerance(DEVICE))

    calls = count_kernel_calls(moe_dispatch)
    model.set_experts_implementation(moe_dispatch.register_experts())
    ids = input_ids()
    got, ref = run(model, ids), run(reference, ids)
    assert calls, "the FP8 experts did not run through moe_dispatch"
    w8a8_here = DEVICE == "cuda" and torch.version.cuda is not None and torch.cuda.get_device_capability() >= (8, 9)
    assert_close(got.logits, ref.logits, torch.float32, "static fp8 mixtral logits",
                 tolerance=W8A8_TOLERANCE if w8a8_here else None)


def test_fp8_experts_fine_tuning_gradients(count_kernel_calls):
    """Fine-tuning around an FP8 checkpoint's frozen experts (adapters, attention, routers) through
    `experts_implementation="moe_dispatch"`: one training step's loss and the gradient of every parameter outside
    the experts equal those of transformers' eager experts on the dequantized weights (fp32), and the experts' float8
    weights and scales get no gradient and keep their bits."""
    model, reference = _fp8_experts_model()
    model.set_experts_implementation(moe_dispatch.register_experts())
    for each in (model, reference):
        each.train()
        for name, p in each.named_parameters():
            p.requires_grad_(".experts." not in name)
    fp8 = {name: t.detach().clone() for name, t in model.named_parameters() if ".experts." in name}
    assert fp8 and all(t.dtype == torch.float8_e4m3fn for name, t in fp8.items() if name.endswith("_proj"))
    calls = count_kernel_calls(moe_dispatch)
    ids = input_ids()
    loss, grads = _training_step(model, ids)
    ref_loss, ref_grads = _training_step(reference, ids)
    assert calls, "the FP8 experts did not run through moe_dispatch"
    assert_close(loss, ref_loss, torch.float32, "fp8 mixtral loss")
    trained = [name for name, g in ref_grads.items() if g is not None]
    assert any(".self_attn." in name for name in trained) and any(".gate." in name for name in trained), trained
    for name in trained:
        assert_close(grads[name], ref_grads[name], torch.float32, f"d {name}")
    for name, before in fp8.items():
        after = dict(model.named_parameters())[name]
        assert after.grad is None and torch.equal(after.view(torch.uint8), before.view(torch.uint8)), name


@pytest.mark.parametrize("change,message", [
    (dict(activation_scheme="static", gate_up_proj_activation_scale=None),
     "activation_scheme='static' with `gate_up_proj_activation_scale` = NoneType"),
    (dict(activation_scheme="per-head"), "activation_scheme='per-head'"),
    (dict(block_size=None), "block_size=None"),
    (dict(limit=7.0), "clamped SiLU"),
])
def test_fp8_experts_unsupported_raise_clearly(change, message):
    model, _ = _fp8_experts_model(**change)
    model.set_experts_implementation(moe_dispatch.register_experts())
    with pytest.raises(NotImplementedError, match=message):
        run(model, input_ids())


def test_fp8_experts_ue8m0_scales_refused():
    model, _ = _fp8_experts_model()
    experts = moe_blocks(model, MODELS[MODEL_IDS.index("mixtral")])[0].experts
    experts.down_proj_scale_inv = torch.nn.Parameter(experts.down_proj_scale_inv.to(torch.float8_e8m0fnu),
                                                     requires_grad=False)
    with pytest.raises(NotImplementedError, match="not UE8M0"):
        moe_dispatch.transformers_experts.fp8_experts_options(experts)
