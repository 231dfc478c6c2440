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

and runs `fused_experts` with `fp8_compute="auto"` (fp8.py): on GPUs with FP8 tensor cores (NVIDIA SM89+) the w8a8
path, activations quantized to e4m3 per token and 128-column group (dynamic) or with the module's static scales,
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
"""

import functools
import sys
import types
import weakref
from typing import Any

import torch

from ._checks import check_tensor
from .fp8 import FP8_DTYPES
from .moe import fused_experts

EXPERTS_IMPLEMENTATION = "moe_dispatch"
"""Default name under which `register_experts` puts `moe_dispatch_experts` in transformers' `ExpertsInterface`."""

# Gate functions recognised by identity with the ones transformers defines (module, attribute path of `_apply_gate`),
# so a subclass that inherits one is recognised too and a model-specific override is refused, never guessed at.
# Identity, not the function's name: torch.compile traces `is` but not every function attribute (`__qualname__`).
_DEFAULT_GATE = ("transformers.integrations.moe", ("_default_apply_gate",))
_GPT_OSS_GATE = ("transformers.models.gpt_oss.modeling_gpt_oss", ("GptOssExperts", "_apply_gate"))


def _is_gate(apply_gate, where) -> bool:
    """Whether `apply_gate` is the function at `where` (a module already imported, since a model uses it)."""
    target = sys.modules.get(where[0])
    for name in where[1]:
        target = getattr(target, name, None)
    return target is not None and apply_gate is target

_WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8_EXPERTS_GATE = ("transformers.integrations.finegrained_fp8", ("FP8Experts", "_apply_gate"))


def _unsupported(experts: torch.nn.Module, what: str) -> NotImplementedError:
    return NotImplementedError(
        f"moe_dispatch cannot run {type(experts).__name__}: {what}. "
        f"Use another experts_implementation (e.g. 'grouped_mm' or 'eager') for this model."
    )


def _is_silu(act_fn) -> bool:
    # transformers' ACT2FN gives SiLUActivation for "silu" and nn.SiLU for "swish"; both are x * sigmoid(x).
    return (
        isinstance(act_fn, torch.nn.SiLU)
        or type(act_fn).__name__ == "SiLUActivation"
        or act_fn is torch.nn.functional.silu
    )


def fused_experts_options(experts: torch.nn.Module) -> dict[str, Any]:
    """The `fused_experts` keyword arguments that reproduce `experts`' forward; raises for what it cannot run.

    Reads the layout flags transformers' `use_experts_implementation` sets (`has_gate`, `has_bias`, `is_transposed`,
    `is_concatenated`, `has_post_expert_norm`), the gate function and `act_fn`, or GPT-OSS's `alpha` / `limit`.
    """
    if not getattr(experts, "has_gate", True):
        raise _unsupported(experts, "experts without a gate projection (has_gate=False) are not supported")
    if getattr(experts, "has_post_expert_norm", False):
        raise _unsupported(experts, "a norm after each expert (has_post_expert_norm=True) is not supported")
    for name in ("gate_up_proj", "down_proj"):
        weight = getattr(experts, name, None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
            raise _unsupported(experts, f"`{name}` is not a 3-D tensor")
        if weight.dtype not in _WEIGHT_DTYPES:
            raise _unsupported(experts, f"`{name}` has dtype {weight.dtype}; float16, bfloat16 or float32 expected")

    options = {
        "transposed": bool(getattr(experts, "is_transposed", False)),
        "interleaved": not getattr(experts, "is_concatenated", True),
    }
    if getattr(experts, "has_bias", False):
        options["gate_up_bias"] = experts.gate_up_proj_bias
        options["down_bias"] = experts.down_proj_bias

    apply_gate = getattr(type(experts), "_apply_gate", None)
    if apply_gate is None or _is_gate(apply_gate, _DEFAULT_GATE):
        act_fn = getattr(experts, "act_fn", None)
        if not _is_silu(act_fn):
            raise _unsupported(experts, f"activation `act_fn` = {act_fn!r}; only SiLU (silu(gate) * up) is supported")
        options["activation"] = "silu"
    elif _is_gate(apply_gate, _GPT_OSS_GATE):
        options["activation"] = "swiglu_oai"
        options["swiglu_alpha"] = float(experts.alpha)
        options["swiglu_limit"] = float(experts.limit)
    else:
        raise _unsupported(
            experts,
            f"gate function {apply_gate.__qualname__} from {apply_gate.__module__}; only transformers' default gate "
            f"with SiLU and GPT-OSS's clamped SwiGLU are supported",
        )
    return options


def fp8_experts_options(experts: torch.nn.Module) -> dict[str, Any]:
    """`fused_experts` keyword arguments for transformers' `FP8Experts` (weights, scales, static activation scales,
    block shape, layout and gate); raises `NotImplementedError` for the variants it does not run (see the module
    doc)."""
    if not getattr(experts, "has_gate", True):
        raise _unsupported(experts, "experts without a gate projection (has_gate=False) are not supported")
    scheme = getattr(experts, "activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _unsupported(experts, f"activation_scheme={scheme!r}; 'dynamic' or 'static' expected")
    block_size = getattr(experts, "block_size", None)
    if block_size is None:
        raise _unsupported(experts, "block_size=None (per-tensor FP8 scales) is not supported; block scales are")
    options = {"transposed": bool(getattr(experts, "is_transposed", False)),
               "interleaved": not getattr(experts, "is_concatenated", True),
               "fp8_block_shape": tuple(int(b) for b in block_size)}
    for name, key in (("gate_up_proj", "w_gate_up_scale"), ("down_proj", "w_down_scale")):
        weight = getattr(experts, name, None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
            raise _unsupported(experts, f"`{name}` is not a 3-D tensor")
        if weight.dtype == torch.int8:
            raise _unsupported(experts, f"`{name}` is FP4-packed (int8); only float8 expert weights are supported")
        if weight.dtype not in FP8_DTYPES:
            raise _unsupported(experts, f"`{name}` has dtype {weight.dtype}; float8_e4m3fn(uz) expected")
        scale = getattr(experts, f"{name}_scale_inv", None)
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
            what = getattr(scale, "dtype", type(scale).__name__)
            raise _unsupported(experts, f"`{name}_scale_inv` is {what}; float32 scales are supported (not UE8M0)")
        options[key] = scale
    if _gate_up_scale_layout(experts.gate_up_proj, options["w_gate_up_scale"], options["fp8_block_shape"],
                             options["transposed"], options["interleaved"]) == "merged":
        options["w_gate_up_scale_layout"] = "merged"  # only then: "fused" is fused_experts' default
    if scheme == "static":  # transformers keeps one fp32 scale per expert and projection input (x ≈ x_fp8 * scale)
        for name, key in (("gate_up_proj_activation_scale", "gate_up_input_scale"),
                          ("down_proj_activation_scale", "down_input_scale")):
            scale = getattr(experts, name, None)
            if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
                what = getattr(scale, "dtype", type(scale).__name__)
                raise _unsupported(experts, f"activation_scheme='static' with `{name}` = {what}; float32 "
                                            f"activation scales expected")
            options[key] = scale
    if getattr(experts, "has_bias", False):
        options["gate_up_bias"] = experts.gate_up_proj_bias
        options["down_bias"] = experts.down_proj_bias
    apply_gate = getattr(type(experts), "_apply_gate", None)
    if apply_gate is None or not _is_gate(apply_gate, _FP8_EXPERTS_GATE):
        raise _unsupported(experts, "a gate function other than FP8Experts' own")
    if getattr(experts, "swiglu_alpha", None) is not None:
        options.update(activation="swiglu_oai", swiglu_alpha=float(experts.swiglu_alpha),
                       swiglu_limit=float(experts.swiglu_limit))
    elif getattr(experts, "limit", None) is not None:
        raise _unsupported(experts, "a clamped SiLU gate (`limit` without `swiglu_alpha`) is not supported")
    elif not _is_silu(getattr(experts, "act_fn", None)):
        raise _unsupported(experts, f"activation `act_fn` = {experts.act_fn!r}; only SiLU (silu(gate) * up) is "
                                    f"supported")
    else:
        options["activation"] = "silu"
    return options


def _gate_up_scale_layout(weight, scale, block_size, transposed, interleaved) -> str:
    """"merged" or "fused": the layout transformers gave `gate_up_proj_scale_inv` (module docstring). Interleaved
    rows take "fused" (scales of the weight as stored: transformers merges separate projections by concatenating them),
    and so does a scale that is not 3-D (no block scale: fused_experts' checks say what it is)."""
    n_axis = 2 if transposed else 1
    num_ffn, block_n = weight.shape[n_axis] // 2, block_size[n_axis - 1]
    fused_blocks, merged_blocks = -(-2 * num_ffn // block_n), 2 * -(-num_ffn // block_n)
    if interleaved or scale.dim() != 3 or scale.shape[n_axis] == fused_blocks != merged_blocks:
        return "fused"
    return "merged"


def _is_fp8_experts(experts) -> bool:
    """An FP8Experts-style module: its weights come with `*_scale_inv` scales (float8 weights without them are
    refused by `fused_experts_options`)."""
    return hasattr(experts, "gate_up_proj_scale_inv")


# id(module) -> (ids, kept, options, is_fp8, weakref): what `fused_experts_options` / `fp8_experts_options` found
# for a module, valid while what they read is unchanged. Reading a module's parameters and flags through
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
    """(options, is_fp8) of `experts`, from the cache when nothing they are read from has changed (same ids). The
    entry keeps every compared object alive but the module's own containers (hooks may refer to the module, which
    must stay collectable), so a changed attribute cannot reuse its predecessor's id; it is dropped when the module
    dies."""
    read = _read_from(experts)
    ids = tuple(map(id, read))
    key = id(experts)
    cached = _OPTIONS.get(key)
    if cached is not None and cached[0] == ids:
        return cached[2], cached[3]
    is_fp8 = _is_fp8_experts(experts)
    options = fp8_experts_options(experts) if is_fp8 else fused_experts_options(experts)
    kept = tuple(v for v in read if isinstance(v, _KEPT))
    ref = cached[4] if cached is not None else weakref.ref(experts, functools.partial(_forget, key))
    _OPTIONS[key] = (ids, kept, options, is_fp8, ref)
    return options, is_fp8


def moe_dispatch_experts(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers experts-interface function: `self` is the experts module, returns `[T, H]` in the input dtype.

    `top_k_weights` may be float32 (Mixtral, DeepSeek-V3) or the model dtype; ids >= E contribute nothing.
    `FP8Experts` modules (FP8 checkpoints) run with their float8 weights and scales (w8a8 on FP8 tensor cores where
    the device has them), activations in and out in their own dtype.
    """
    # checked by their names here: fused_experts calls them topk_ids and topk_weights
    for name, tensor in (("hidden_states", hidden_states), ("top_k_index", top_k_index),
                         ("top_k_weights", top_k_weights)):
        check_tensor(name, tensor)
    if torch.compiler.is_compiling():  # traced: no host-side cache (dynamo would guard on it)
        options, is_fp8 = (fp8_experts_options(self), True) if _is_fp8_experts(self) else (
            fused_experts_options(self), False)
    else:
        options, is_fp8 = _experts_options(self)
    x = hidden_states
    weight_dtype = self.gate_up_proj.dtype
    # Mixed precision (autocast, an fp32 residual stream) can hand fp32 activations to half-precision experts.
    if not is_fp8 and x.dtype != weight_dtype:
        x = x.to(weight_dtype)
    out = fused_experts(
        x, self.gate_up_proj, self.down_proj, top_k_index, top_k_weights, validate=False, **options
    )
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
