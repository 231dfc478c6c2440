"""transformers experts interface backed by `fused_experts`.

transformers keeps the routed experts of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 and GPT-OSS in one
module holding 3-D weights, and sends that module's forward through `ExpertsInterface`: any function with the
signature `(self, hidden_states[T, H], top_k_index[T, k], top_k_weights[T, k]) -> [T, H]` registered under a name
replaces it when the model's `experts_implementation` is that name. The router still runs in transformers (so
router logits, aux losses and `output_router_logits` are untouched); only the expert FFNs run here::

    import moe_dispatch                        # or: moe_dispatch = kernels.get_kernel("<org>/moe-dispatch", version=1)
    name = moe_dispatch.register_experts()     # "moe_dispatch"
    model = AutoModelForCausalLM.from_pretrained(repo, experts_implementation=name)
    # or, on a model already built: model.set_experts_implementation(name)

What the experts module must look like (read from it on every call, nothing is copied):

    gate_up_proj        [E, 2F, H] (gate rows, then up rows)      `is_transposed`: [E, H, 2F]
    down_proj           [E, H, F]                                 `is_transposed`: [E, F, H]
    is_concatenated     False: gate/up columns alternate (GPT-OSS), gate at even index
    has_bias            gate_up_proj_bias [E, 2F], down_proj_bias [E, H]
    activation          `act_fn` SiLU with transformers' default gate (silu(gate) * up), or GPT-OSS's clamped
                        SwiGLU (`GptOssExperts._apply_gate`, reading `alpha` and `limit`)

Anything else (a different activation or gate function, experts without a gate projection, a post-expert norm,
non-float weights) raises `NotImplementedError` naming the module and the attribute, rather than computing
something else. Ids >= E (expert-parallel sentinels) contribute nothing.

FP8 checkpoints (`FineGrainedFP8Config`: DeepSeek-V3/R1, Qwen3-*-FP8) replace the experts with transformers'
`FP8Experts`, whose forward goes through `FP8ExpertsInterface`; `register_experts` registers the same function there,
under the same name, so `experts_implementation="moe_dispatch"` covers both. It reads:

    gate_up_proj, down_proj                 float8_e4m3fn (or e4m3fnuz), layout as above
    gate_up_proj_scale_inv, down_proj_scale_inv   fp32 block scales [E, 2 ceil(F/b0) or ceil(2F/b0), ceil(H/b1)]
                                            (see below), [E, ceil(H/b0), ceil(F/b1)]
    block_size                              (b0, b1), e.g. (128, 128)
    activation_scheme                       "dynamic", or "static" with fp32 per-expert activation scales
    gate_up_proj_activation_scale, down_proj_activation_scale   [E] (static only)

and runs `fused_experts` with `fp8_compute="auto"` (formats/fp8.py): on GPUs with FP8 tensor cores (NVIDIA SM89+) the
w8a8 path, activations quantized to e4m3 per token and 128-column group (dynamic) or with the module's static scales,
as transformers' own FP8 kernels do; elsewhere weights are dequantized in the GEMMs' loads and activations stay in
the model dtype (static scales unused). `gate_up_proj_scale_inv` is passed with the layout transformers gave it
(`fused_experts`' `w_gate_up_scale_layout`, the layouts differing only where F is not a multiple of b0): loading a
checkpoint merges each expert's gate_proj and up_proj scales into gate's ceil(F/b0) row blocks, then up's
("merged"); quantizing on load (`FineGrainedFP8Config` over a bf16 checkpoint) quantizes the merged weight:
ceil(2F/b0) blocks over its 2F rows ("fused"), made only where b0 divides 2F. So ceil(2F/b0) row blocks that are not
2 ceil(F/b0) are fused and every other count is merged: where the two counts agree and F is not a multiple of b0,
b0 does not divide 2F, so only loading can have made them. Refused with `NotImplementedError`: UE8M0
(`float8_e8m0fnu`) scales, FP4-packed int8 weights, `block_size=None` (per-tensor scales stored per gate/up half), a
static scheme without its fp32 activation scales, gates other than SiLU or GPT-OSS's SwiGLU.

GPT-OSS MXFP4 checkpoints (`quant_method: "mxfp4"`: uint8 e2m1 blocks and e8m0 scales per expert projection):
`from_pretrained_mxfp4(repo)` loads one with its experts as stored, through a quantization method registered in
transformers (`register_mxfp4`, "moe_dispatch_mxfp4"), into `Mxfp4Experts` modules that replace `GptOssMLP.experts`
under the model's own router and run `fused_experts` on the bytes as stored; nothing else is downloaded.
`use_mxfp4_experts(model)` converts a model holding float GPT-OSS experts; `build_random_gpt_oss_mxfp4` builds a
random one on a device without a float copy of the experts. The experts function runs `Mxfp4Experts` too
(`mxfp4_experts_options`), so the kernelize layer `MegaBlocksMoeMLP` takes such blocks as well.
"""

import copy
import dataclasses
import functools
import os
import types
import weakref
from typing import Any

import torch

from ..formats.fp8 import DEFAULT_FP8_BLOCK_SHAPE
from ..formats.mxfp4 import E8M0_NAN, MXFP4_GROUP, dequantize_experts_mxfp4, quantize_experts_mxfp4
from ..formats.quant import V1_QUANT_KEYWORDS, ExpertsQuant
from ..host.checks import check_tensor, warn_if_gradient_cut
from ..host.device import call_scope
from ..moe import fused_experts
from .transformers_options import (_is_fp8_experts, _is_mxfp4_experts, fp8_experts_options, fused_experts_options,
                                  mxfp4_experts_options)

EXPERTS_IMPLEMENTATION = "moe_dispatch"
"""Default name under which `register_experts` puts `moe_dispatch_experts` in transformers' `ExpertsInterface`."""


def _options_of(experts) -> tuple[dict[str, Any], str]:
    """(the `fused_experts` keyword arguments of `experts`, the quantization as one `quant`, and its kind: "mxfp4",
    "fp8" or "float"); raises for what cannot run."""
    if _is_mxfp4_experts(experts):
        return _with_quant(mxfp4_experts_options(experts), "mxfp4"), "mxfp4"
    if _is_fp8_experts(experts):
        return _with_quant(fp8_experts_options(experts), "fp8"), "fp8"
    return fused_experts_options(experts), "float"


def _with_quant(options: dict[str, Any], kind: str) -> dict[str, Any]:
    """`options` (the v1 keywords the `*_experts_options` functions return) with the quantization keywords as one
    `ExpertsQuant` of format `kind`."""
    given = {key: options[key] for key in V1_QUANT_KEYWORDS if key in options}
    rest = {key: value for key, value in options.items() if key not in V1_QUANT_KEYWORDS}
    compute = given.get("fp8_compute", "auto")
    if kind == "mxfp4":
        return {**rest, "quant": ExpertsQuant.mxfp4(given["w_gate_up_scale"], given["w_down_scale"], compute=compute)}
    return {**rest, "quant": ExpertsQuant.fp8(
        given.get("w_gate_up_scale"), given.get("w_down_scale"),
        block_shape=given.get("fp8_block_shape", DEFAULT_FP8_BLOCK_SHAPE),
        gate_up_input_scale=given.get("gate_up_input_scale"), down_input_scale=given.get("down_input_scale"),
        compute=compute, gate_up_scale_layout=given.get("w_gate_up_scale_layout", "fused"))}


# id(module) -> (ids, kept, options, kind, weakref): what `_options_of` found for a module, valid while what it read
# is unchanged. Reading a module's parameters and flags through
# nn.Module.__getattr__ costs about as much host time as the rest of an eager decode call.
_OPTIONS = {}
# what an entry keeps alive: not the module's containers or bound methods (hooks and methods refer to the module)
_KEPT = (torch.Tensor, torch.nn.Module, torch.dtype, type, types.FunctionType, bool, int, float, str, tuple)


def _read_from(experts) -> tuple:
    """What the options of `experts` are read from, compared by identity: its class, parameters, buffers and submodules
    (`act_fn`), the weights' dtypes (`Module.to` changes a parameter's dtype in place), the class's gate function and
    the instance attributes (the layout flags, `alpha`, `limit`, `block_size`, `activation_scheme`, ...). Other class
    attributes changed after a module's first call are not seen."""
    params = experts._parameters
    w_gate_up, w_down = params.get("gate_up_proj"), params.get("down_proj")
    cls = type(experts)
    return (cls, getattr(cls, "_apply_gate", None), getattr(w_gate_up, "dtype", None),
            getattr(w_down, "dtype", None), *params.values(),
            *experts._buffers.values(), *experts._modules.values(), *experts.__dict__.values())


def _forget(key, _ref):
    _OPTIONS.pop(key, None)


def _experts_options(experts) -> tuple:
    """(options, kind) of `experts`, from the cache when nothing they are read from has changed (same ids). The
    entry keeps every compared object alive but the module's own containers (hooks may refer to the module, which
    must stay collectable), so a changed attribute cannot reuse its predecessor's id; it is dropped when the module
    dies."""
    read = _read_from(experts)
    ids = tuple(map(id, read))
    key = id(experts)
    cached = _OPTIONS.get(key)
    if cached is not None and cached[0] == ids:
        return cached[2], cached[3]
    options, kind = _options_of(experts)
    kept = tuple(v for v in read if isinstance(v, _KEPT))
    ref = cached[4] if cached is not None else weakref.ref(experts, functools.partial(_forget, key))
    _OPTIONS[key] = (ids, kept, options, kind, ref)
    return options, kind


# ExpertsQuant's scale fields -> the FP8Experts attributes they are read from (what a warning names)
_FP8_SCALE_ATTRIBUTES = {"w_gate_up_scale": "gate_up_proj_scale_inv", "w_down_scale": "down_proj_scale_inv",
                         "gate_up_input_scale": "gate_up_proj_activation_scale",
                         "down_input_scale": "down_proj_activation_scale"}


def _frozen_scales(experts: torch.nn.Module, options: dict[str, Any]) -> dict[str, Any]:
    """`options` with the scales that require grad detached (transformers keeps `*_scale_inv` as Parameters; the
    quantized experts are frozen), warned about once under the module's attribute names."""
    quant = options["quant"]
    needing = {key: getattr(quant, key) for key in _FP8_SCALE_ATTRIBUTES
               if isinstance(getattr(quant, key), torch.Tensor) and getattr(quant, key).requires_grad}
    if not needing or not torch.is_grad_enabled():
        return options
    warn_if_gradient_cut(f"moe_dispatch_experts with FP8 experts (frozen: {type(experts).__name__})",
                         **{_FP8_SCALE_ATTRIBUTES[key]: scale for key, scale in needing.items()})
    return {**options, "quant": dataclasses.replace(quant, **{key: scale.detach() for key, scale in needing.items()})}


@call_scope
def moe_dispatch_experts(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers experts-interface function: `self` is the experts module, returns `[T, H]` in the input dtype.

    `top_k_weights` may be float32 (Mixtral, DeepSeek-V3) or the model dtype; ids >= E contribute nothing.
    `FP8Experts` modules (FP8 checkpoints) run with their float8 weights and scales (w8a8 on FP8 tensor cores where
    the device has them), activations in and out in their own dtype. `Mxfp4Experts` modules (GPT-OSS MXFP4
    checkpoints) run with their uint8 blocks and scales as stored, activations in their biases' dtype.
    """
    # checked by their names here: fused_experts calls them topk_ids and topk_weights
    for name, tensor in (("hidden_states", hidden_states), ("top_k_index", top_k_index),
                         ("top_k_weights", top_k_weights)):
        check_tensor(name, tensor)
    if torch.compiler.is_compiling():  # traced: no host-side cache (dynamo would guard on it)
        options, kind = _options_of(self)
    else:
        options, kind = _experts_options(self)
    if kind == "fp8":
        options = _frozen_scales(self, options)
    if kind == "mxfp4":
        w_gate_up, w_down = self.gate_up_proj_blocks, self.down_proj_blocks
        bias = options.get("gate_up_bias")
        compute_dtype = hidden_states.dtype if bias is None else bias.dtype
    else:
        w_gate_up, w_down = self.gate_up_proj, self.down_proj
        compute_dtype = hidden_states.dtype if kind == "fp8" else w_gate_up.dtype
    # Mixed precision (autocast, an fp32 residual stream) can hand fp32 activations to half-precision experts.
    x = hidden_states if hidden_states.dtype == compute_dtype else hidden_states.to(compute_dtype)
    out = fused_experts(x, w_gate_up, w_down, top_k_index, top_k_weights, validate=False, **options)
    return out if out.dtype == hidden_states.dtype else out.to(hidden_states.dtype)


def register_experts(name: str = EXPERTS_IMPLEMENTATION) -> str:
    """Register `moe_dispatch_experts` in transformers' `ExpertsInterface` under `name`, and in `FP8ExpertsInterface`
    (FP8 checkpoints' `FP8Experts`) where this transformers has it; returns `name`.

    Works the same on the local package and on the module `kernels.get_kernel` returns (each registers its own
    copy of the function). Register before building or loading a model that names it in `experts_implementation`.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if not name:
        raise ValueError("name must be a non-empty str")
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, moe_dispatch_experts)
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:  # a transformers without FP8 experts
        return name
    FP8ExpertsInterface.register(name, moe_dispatch_experts)
    return name


# --------------------------------------------------------------------------------------------------------------------
# GPT-OSS MXFP4 checkpoints: the experts as stored, loaded through a quantization method of transformers' registry

MXFP4_QUANT_METHOD = "moe_dispatch_mxfp4"
"""The `quant_method` `register_mxfp4` adds to transformers' quantization registry (config and quantizer)."""

# What GPT-OSS hub checkpoints keep unquantized (their config.json's `modules_to_not_convert`): written back on save.
_GPT_OSS_NOT_CONVERTED = ("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head")


class Mxfp4Experts(torch.nn.Module):
    """GPT-OSS's routed experts holding an MXFP4 checkpoint's tensors as stored, run by `fused_experts`.

    Parameters, named as the checkpoint names them under `model.layers.N.mlp.experts.` (E experts, H hidden, F ffn;
    formats/mxfp4.py describes the format)::

        gate_up_proj_blocks  uint8 [E, 2F, H/32, 16]  e2m1 pairs; gate and up rows alternate, gate first
        gate_up_proj_scales  uint8 [E, 2F, H/32]      e8m0 codes: 2^(code - 127) per 32 values along H
        gate_up_proj_bias    [E, 2F]                  in the activations' dtype
        down_proj_blocks     uint8 [E, H, F/32, 16]
        down_proj_scales     uint8 [E, H, F/32]
        down_proj_bias       [E, H]

    `alpha` and `limit` are the clamped SwiGLU's (`config.swiglu_alpha`, `config.swiglu_limit`, as `GptOssExperts`
    reads them). `forward(hidden_states [T, H], router_indices [T, k], routing_weights [T, k]) -> [T, H]` has
    `GptOssExperts`' signature, so the module takes the place of `GptOssMLP.experts` under the model's own router;
    activations are cast to the biases' dtype and back. The experts are frozen: no gradient reaches their tensors,
    while the hidden states and routing weights get theirs (fine-tuning the rest of the model, adapters included:
    examples/gpt_oss_mxfp4_finetune.py). Built with `device="meta"` it allocates nothing (what the loader fills).
    """

    def __init__(self, config: Any, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        num_experts, hidden, ffn = config.num_local_experts, config.hidden_size, config.intermediate_size
        for name, size in (("hidden_size", hidden), ("intermediate_size", ffn)):
            if size % MXFP4_GROUP:
                raise ValueError(f"config.{name} = {size}: MXFP4 experts need it a multiple of {MXFP4_GROUP} (one "
                                 f"scale per {MXFP4_GROUP} values)")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden, ffn
        self.alpha, self.limit = float(config.swiglu_alpha), float(config.swiglu_limit)
        blocks = dict(dtype=torch.uint8, device=device)
        bias = dict(dtype=dtype or torch.get_default_dtype(), device=device)

        def frozen(tensor):
            return torch.nn.Parameter(tensor, requires_grad=False)

        self.gate_up_proj_blocks = frozen(torch.empty(num_experts, 2 * ffn, hidden // MXFP4_GROUP, 16, **blocks))
        self.gate_up_proj_scales = frozen(torch.empty(num_experts, 2 * ffn, hidden // MXFP4_GROUP, **blocks))
        self.gate_up_proj_bias = frozen(torch.empty(num_experts, 2 * ffn, **bias))
        self.down_proj_blocks = frozen(torch.empty(num_experts, hidden, ffn // MXFP4_GROUP, 16, **blocks))
        self.down_proj_scales = frozen(torch.empty(num_experts, hidden, ffn // MXFP4_GROUP, **blocks))
        self.down_proj_bias = frozen(torch.empty(num_experts, hidden, **bias))

    def forward(self, hidden_states: torch.Tensor, router_indices: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        return moe_dispatch_experts(self, hidden_states, router_indices, routing_weights)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, alpha={self.alpha}, limit={self.limit}")


def _gpt_oss_blocks(model) -> list:
    """The `GptOssMLP` modules of `model`."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    return [module for module in model.modules() if isinstance(module, GptOssMLP)]


@functools.cache
def _mxfp4_quantization_classes() -> tuple[type, type]:
    """(config class, quantizer class) of `MXFP4_QUANT_METHOD`, made once (they subclass transformers' bases)."""
    from transformers.quantizers.base import HfQuantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin

    class MoeDispatchMxfp4Config(QuantizationConfigMixin):
        """A GPT-OSS MXFP4 checkpoint (`quant_method: "mxfp4"` on the Hub) whose experts load as stored into
        `Mxfp4Experts`. Serialised as the Hub's own MXFP4 config: a saved model is a stock MXFP4 checkpoint."""

        def __init__(self, modules_to_not_convert: list[str] | None = None, **kwargs):
            self.quant_method = MXFP4_QUANT_METHOD
            self.modules_to_not_convert = modules_to_not_convert

        def to_dict(self) -> dict[str, Any]:
            return {"quant_method": "mxfp4", "modules_to_not_convert": self.modules_to_not_convert}

    class MoeDispatchMxfp4Quantizer(HfQuantizer):
        """Loads pre-quantized GPT-OSS MXFP4 checkpoints: each `GptOssMLP.experts` becomes an `Mxfp4Experts` on the
        meta device before the weights are read, so the checkpoint's blocks, scales and biases load 1:1 into
        parameters of the same names (uint8 kept as uint8, biases cast once to the model dtype). Needs nothing but
        transformers: no accelerate, no `kernels`, no Hub kernel."""

        requires_calibration = True  # pre-quantized checkpoints only

        def _process_model_before_weight_loading(self, model, **kwargs):
            config = model.config.get_text_config()
            blocks = _gpt_oss_blocks(model)
            if not blocks:
                raise NotImplementedError(f"{MXFP4_QUANT_METHOD} loads GPT-OSS checkpoints (GptOssMLP blocks); "
                                          f"{type(model).__name__} has none")
            for block in blocks:
                block.experts = Mxfp4Experts(config, device="meta", dtype=block.experts.gate_up_proj_bias.dtype)
            return model

        def _dequantize(self, model, dtype=None):
            return _dequantize_gpt_oss_experts(model, dtype)

        def is_serializable(self) -> bool:
            return True

        @property
        def is_trainable(self) -> bool:
            return True  # adapters (Trainer wants PEFT ones on a quantized model) train; the experts stay frozen

        @property
        def is_compileable(self) -> bool:
            return True  # the experts are a torch custom operator: generate may compile a static-cache decode step

    return MoeDispatchMxfp4Config, MoeDispatchMxfp4Quantizer


def register_mxfp4() -> str:
    """Register `MXFP4_QUANT_METHOD` ("moe_dispatch_mxfp4") in transformers' quantization registry (its config class
    and quantizer) and return the name. Loading a GPT-OSS MXFP4 checkpoint whose config names it (what
    `from_pretrained_mxfp4` arranges) puts `Mxfp4Experts` in every MoE block, filled with the checkpoint's tensors
    as stored. Registering again replaces the entry (the local package and a `kernels.get_kernel` copy may both
    register; the last one wins)."""
    from transformers.quantizers import auto

    config_class, quantizer_class = _mxfp4_quantization_classes()
    # The registry's own dicts: transformers' register_* decorators refuse a second registration of a name.
    auto.AUTO_QUANTIZATION_CONFIG_MAPPING[MXFP4_QUANT_METHOD] = config_class
    auto.AUTO_QUANTIZER_MAPPING[MXFP4_QUANT_METHOD] = quantizer_class
    return MXFP4_QUANT_METHOD


# from_pretrained keyword arguments that say where the config comes from
_CONFIG_SOURCE_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder",
                         "token", "trust_remote_code")


def from_pretrained_mxfp4(pretrained_model_name_or_path: str | os.PathLike, *model_args: Any,
                          model_class: Any = None, config: Any = None, **kwargs: Any) -> Any:
    """Load a GPT-OSS MXFP4 checkpoint (a Hub repository or a local folder whose config says `quant_method: "mxfp4"`,
    e.g. openai/gpt-oss-120b) with its experts as stored, run by this package; returns the model.

    One call in place of `AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args,
    **kwargs)` (`model_class` another auto or model class): it registers `MXFP4_QUANT_METHOD` (`register_mxfp4`),
    points the config's quantization method at it and loads. Each `GptOssMLP` keeps its router (router logits,
    `output_router_logits`, aux loss unchanged); its experts are an `Mxfp4Experts` holding the checkpoint's uint8
    blocks and scales byte for byte, its biases in the model dtype. Nothing else is downloaded: no Hub kernel and no
    `kernels` package (accelerate only for `device_map=`, as for any model). `save_pretrained` writes a stock MXFP4
    checkpoint again; `model.dequantize()` gives transformers' own `GptOssExperts`. The experts stay frozen under
    training; the rest of the model (or adapters on it) trains through them.

    Not for: `quantization_config=` (the checkpoint's config decides), `use_kernels=True` without a kernel mapping
    naming this package's `MegaBlocksMoeMLP` (transformers' default mapping downloads a layer that reads float
    weights), transformers' tensor- or expert-parallel plans.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    register_mxfp4()
    if config is None or isinstance(config, (str, os.PathLike)):
        source = {key: kwargs[key] for key in _CONFIG_SOURCE_KWARGS if key in kwargs}
        config = AutoConfig.from_pretrained(pretrained_model_name_or_path if config is None else config, **source)
    else:
        config = copy.deepcopy(config)  # the caller's config keeps its quantization method
    quantization = getattr(config, "quantization_config", None)
    quantization = quantization.to_dict() if hasattr(quantization, "to_dict") else dict(quantization or {})
    if quantization.get("quant_method") not in ("mxfp4", MXFP4_QUANT_METHOD):
        raise ValueError(f"{pretrained_model_name_or_path} is not an MXFP4 checkpoint (quantization_config = "
                         f"{quantization or None}); load it with from_pretrained and "
                         f"experts_implementation=register_experts()")
    config.quantization_config = {**quantization, "quant_method": MXFP4_QUANT_METHOD}
    model_class = AutoModelForCausalLM if model_class is None else model_class
    return model_class.from_pretrained(pretrained_model_name_or_path, *model_args, config=config, **kwargs)


def _attach_mxfp4_quantizer(model) -> None:
    """Make a model holding `Mxfp4Experts` look as `from_pretrained_mxfp4` leaves it: its config's quantization
    method, `hf_quantizer` (so `save_pretrained` writes a stock MXFP4 checkpoint and `dequantize()` works)."""
    config_class, quantizer_class = _mxfp4_quantization_classes()
    quantizer = getattr(model, "hf_quantizer", None)
    if isinstance(quantizer, quantizer_class):
        return
    if quantizer is not None:
        raise ValueError(f"the model is quantized by {type(quantizer).__name__}; MXFP4 experts cannot be added to it")
    quantizer = quantizer_class(config_class(modules_to_not_convert=list(_GPT_OSS_NOT_CONVERTED)), pre_quantized=True)
    model.is_quantized = True
    model.quantization_method = MXFP4_QUANT_METHOD
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)


def use_mxfp4_experts(model: Any) -> Any:
    """In place, for a GPT-OSS model built or loaded with float experts (transformers' `GptOssExperts`, e.g. from a
    config, or `Mxfp4Config(dequantize=True)`): quantize each block's experts to MXFP4 (`quantize_experts_mxfp4`) into
    an `Mxfp4Experts`, freeing the float weights; returns `model`. Blocks already holding `Mxfp4Experts` are left as
    they are. Weights that are MXFP4 values already (a dequantized MXFP4 checkpoint) come back exactly, so the
    outputs do not change; other weights take MXFP4's rounding. The router and biases are kept; `save_pretrained`
    then writes a stock MXFP4 checkpoint. Needs the float weights in memory: for a checkpoint that is MXFP4 already,
    `from_pretrained_mxfp4` loads the blocks directly."""
    blocks = _gpt_oss_blocks(model)
    if not blocks:
        stock = [type(m).__name__ for m in model.modules() if type(m).__name__ == "Mxfp4GptOssMLP"]
        if stock:
            raise NotImplementedError("the model was loaded by transformers' own MXFP4 path (Mxfp4GptOssMLP, hub "
                                      "kernel weights); load the checkpoint with from_pretrained_mxfp4 instead")
        raise NotImplementedError(f"use_mxfp4_experts takes GPT-OSS models (GptOssMLP blocks); "
                                  f"{type(model).__name__} has none")
    config = model.config.get_text_config()
    for block in blocks:
        experts = block.experts
        if _is_mxfp4_experts(experts):
            continue
        if not isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
            raise NotImplementedError(f"use_mxfp4_experts cannot read {type(experts).__name__}: no float "
                                      f"`gate_up_proj`")
        bias = experts.gate_up_proj_bias
        mxfp4 = Mxfp4Experts(config, device="meta", dtype=bias.dtype)
        mxfp4.alpha, mxfp4.limit = float(experts.alpha), float(experts.limit)
        with torch.no_grad():
            # GptOssExperts holds [E, H, 2F] / [E, F, H]; MXFP4 groups run along the input dimension, so
            # [E, 2F, H] / [E, H, F] are quantized
            tensors = dict(zip(("gate_up_proj_blocks", "gate_up_proj_scales"),
                               quantize_experts_mxfp4(experts.gate_up_proj.transpose(1, 2))))
            tensors.update(zip(("down_proj_blocks", "down_proj_scales"),
                               quantize_experts_mxfp4(experts.down_proj.transpose(1, 2))))
            tensors.update(gate_up_proj_bias=experts.gate_up_proj_bias.detach(),
                           down_proj_bias=experts.down_proj_bias.detach())
        for name, tensor in tensors.items():
            setattr(mxfp4, name, torch.nn.Parameter(tensor, requires_grad=False))
        block.experts = mxfp4
    _attach_mxfp4_quantizer(model)
    return model


def _dequantize_gpt_oss_experts(model, dtype):
    """Every `Mxfp4Experts` of `model` -> transformers' `GptOssExperts` with the dequantized weights in `dtype` (the
    biases' dtype when None), as transformers' `Mxfp4Config(dequantize=True)` loads them; returns `model`."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = model.config.get_text_config()
    for block in _gpt_oss_blocks(model):
        experts = block.experts
        if not _is_mxfp4_experts(experts):
            continue
        to = experts.gate_up_proj_bias.dtype if dtype is None else dtype
        with torch.device("meta"):
            dense = GptOssExperts(config)
        dense.alpha, dense.limit = experts.alpha, experts.limit
        tensors = {
            "gate_up_proj": dequantize_experts_mxfp4(experts.gate_up_proj_blocks, experts.gate_up_proj_scales, to),
            "down_proj": dequantize_experts_mxfp4(experts.down_proj_blocks, experts.down_proj_scales, to),
        }
        for name, weight in tensors.items():  # [E, N, K] -> GptOssExperts' [E, K, N]
            setattr(dense, name, torch.nn.Parameter(weight.transpose(1, 2).contiguous()))
        for name in ("gate_up_proj_bias", "down_proj_bias"):
            setattr(dense, name, torch.nn.Parameter(getattr(experts, name).detach().to(to)))
        block.experts = dense
    return model


def build_random_gpt_oss_mxfp4(config: Any = None, *, device: torch.device | str = "cuda",
                               dtype: torch.dtype = torch.bfloat16, seed: int = 0, scale_code: int = 120) -> Any:
    """A GPT-OSS causal LM with random weights and MXFP4 experts, built on `device` without a float copy of the
    experts ever existing; returns it in eval mode, as `from_pretrained_mxfp4` would leave it (it saves as a stock
    MXFP4 checkpoint). Needs transformers.

    `config` defaults to `GptOssConfig()` with the Hub's pad / eos ids: gpt-oss-120b's widths and depth (36 layers,
    H = F = 2880, 128 experts, top-4), about 61 GiB (57 of them MXFP4 experts; the bf16 experts would be 214 GiB).
    The model is made on the meta device, its experts dropped, the rest allocated on `device` in `dtype` and
    initialised by transformers (`initialize_weights`: normal(0, initializer_range), norms 1, attention sinks, router,
    rotary frequencies); then each block gets an `Mxfp4Experts` allocated on `device`: uniformly random bytes (any
    byte is two valid e2m1 values), e8m0 scale codes drawn from [scale_code - 2, scale_code + 1] (code 120: weights
    of standard deviation about 0.02-0.05), biases normal(0, initializer_range), all from `seed`.
    """
    from transformers import GptOssConfig, GptOssForCausalLM

    if not isinstance(scale_code, int) or isinstance(scale_code, bool) or not 2 <= scale_code < E8M0_NAN - 1:
        raise ValueError(f"scale_code must be an int in [2, {E8M0_NAN - 2}] (e8m0 code {E8M0_NAN} is NaN), "
                         f"got {scale_code!r}")
    if config is None:
        config = GptOssConfig(pad_token_id=199999, eos_token_id=200002)
    device = torch.device(device)
    with torch.device("meta"):  # nothing allocated, nothing initialised
        model = GptOssForCausalLM._from_config(config, dtype=dtype)
    blocks = _gpt_oss_blocks(model)
    for block in blocks:
        block.experts = None  # before to_empty: the float experts are never allocated
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives tied parameters a tensor each
    model.initialize_weights()
    text_config = model.config.get_text_config()
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for block in blocks:
            experts = Mxfp4Experts(text_config, device=device, dtype=dtype)
            for name, tensor in experts.named_parameters():
                if name.endswith("_blocks"):
                    tensor.random_(0, 256, generator=generator)
                elif name.endswith("_scales"):
                    tensor.random_(scale_code - 2, scale_code + 2, generator=generator)
                else:
                    tensor.normal_(0.0, text_config.initializer_range, generator=generator)
            block.experts = experts
    _attach_mxfp4_quantizer(model)
    return model.eval()
