"""What a transformers experts module's attributes say: the `fused_experts` keyword arguments that reproduce its
forward, for transformers' float experts (`fused_experts_options`: layout flags, biases, the gate function and
`act_fn`), `FP8Experts` (`fp8_experts_options`: float8 weights, their block scales and its gate/up scale layout,
static activation scales) and GPT-OSS's MXFP4 tensors (`mxfp4_experts_options`), and which of the three a module is
(`_is_fp8_experts`, `_is_mxfp4_experts`). The three readers raise `NotImplementedError`, naming the module and the
attribute, for what `fused_experts` cannot run. transformers_experts.py's docstring says what each kind of module
must hold; that module runs the experts (`moe_dispatch_experts`, which caches these options per module) and names
these functions too.
"""

import sys
from typing import Any

import torch

from ..formats.fp8 import FP8_DTYPES
from ..host.checks import check_bool, check_real

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


def _flag(experts: torch.nn.Module, name: str, default: bool) -> bool:
    """A layout flag of an experts module (`use_experts_implementation` sets them as bools): True or False, named
    `<class>.<flag>` in the TypeError otherwise (the string "False" would read as true)."""
    return check_bool(f"{type(experts).__name__}.{name}", getattr(experts, name, default))


def _swiglu_options(experts: torch.nn.Module, alpha_name: str, limit_name: str) -> dict[str, float]:
    """`swiglu_alpha` / `swiglu_limit` from the module's attributes, real numbers (named `<class>.<attribute>`)."""
    where = type(experts).__name__
    alpha = check_real(f"{where}.{alpha_name}", getattr(experts, alpha_name, None))
    limit = check_real(f"{where}.{limit_name}", getattr(experts, limit_name, None), minimum=0)
    return {"swiglu_alpha": float(alpha), "swiglu_limit": float(limit)}


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
    if not _flag(experts, "has_gate", True):
        raise _unsupported(experts, "experts without a gate projection (has_gate=False) are not supported")
    if _flag(experts, "has_post_expert_norm", False):
        raise _unsupported(experts, "a norm after each expert (has_post_expert_norm=True) is not supported")
    for name in ("gate_up_proj", "down_proj"):
        weight = getattr(experts, name, None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
            raise _unsupported(experts, f"`{name}` is not a 3-D tensor")
        if weight.dtype not in _WEIGHT_DTYPES:
            raise _unsupported(experts, f"`{name}` has dtype {weight.dtype}; float16, bfloat16 or float32 expected")

    options = {
        "transposed": _flag(experts, "is_transposed", False),
        "interleaved": not _flag(experts, "is_concatenated", True),
    }
    if _flag(experts, "has_bias", False):
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
        options.update(_swiglu_options(experts, "alpha", "limit"))
    else:
        raise _unsupported(
            experts,
            f"gate function {apply_gate.__qualname__} from {apply_gate.__module__}; only transformers' default gate "
            f"with SiLU and GPT-OSS's clamped SwiGLU are supported",
        )
    return options


def fp8_experts_options(experts: torch.nn.Module) -> dict[str, Any]:
    """`fused_experts` keyword arguments for transformers' `FP8Experts` (weights, scales, static activation scales,
    block shape, layout and gate); raises `NotImplementedError` for the variants it does not run (see
    transformers_experts.py's docstring)."""
    if not _flag(experts, "has_gate", True):
        raise _unsupported(experts, "experts without a gate projection (has_gate=False) are not supported")
    scheme = getattr(experts, "activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _unsupported(experts, f"activation_scheme={scheme!r}; 'dynamic' or 'static' expected")
    block_size = getattr(experts, "block_size", None)
    if block_size is None:
        raise _unsupported(experts, "block_size=None (per-tensor FP8 scales) is not supported; block scales are")
    options = {"transposed": _flag(experts, "is_transposed", False),
               "interleaved": not _flag(experts, "is_concatenated", True),
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
    if _flag(experts, "has_bias", False):
        options["gate_up_bias"] = experts.gate_up_proj_bias
        options["down_bias"] = experts.down_proj_bias
    apply_gate = getattr(type(experts), "_apply_gate", None)
    if apply_gate is None or not _is_gate(apply_gate, _FP8_EXPERTS_GATE):
        raise _unsupported(experts, "a gate function other than FP8Experts' own")
    if getattr(experts, "swiglu_alpha", None) is not None:
        options.update(activation="swiglu_oai", **_swiglu_options(experts, "swiglu_alpha", "swiglu_limit"))
    elif getattr(experts, "limit", None) is not None:
        raise _unsupported(experts, "a clamped SiLU gate (`limit` without `swiglu_alpha`) is not supported")
    elif not _is_silu(getattr(experts, "act_fn", None)):
        raise _unsupported(experts, f"activation `act_fn` = {experts.act_fn!r}; only SiLU (silu(gate) * up) is "
                                    f"supported")
    else:
        options["activation"] = "silu"
    return options


def mxfp4_experts_options(experts: torch.nn.Module) -> dict[str, Any]:
    """`fused_experts` keyword arguments for an `Mxfp4Experts`-style module (GPT-OSS's MXFP4 checkpoint tensors under
    their names: `gate_up_proj_blocks` / `down_proj_blocks` uint8 with `gate_up_proj_scales` / `down_proj_scales`,
    optional `gate_up_proj_bias` / `down_proj_bias`, the clamped SwiGLU's `alpha` and `limit`); the blocks themselves
    are `fused_experts`' weight arguments. Shapes are `fused_experts`' to check; a missing tensor or another dtype
    raises `NotImplementedError` naming the attribute."""
    options = {"activation": "swiglu_oai", "interleaved": True}  # GPT-OSS: gate and up rows alternate, gate first
    for name, key in (("gate_up_proj", "w_gate_up_scale"), ("down_proj", "w_down_scale")):
        blocks, scales = getattr(experts, f"{name}_blocks", None), getattr(experts, f"{name}_scales", None)
        if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8:
            what = getattr(blocks, "dtype", type(blocks).__name__)
            raise NotImplementedError(f"moe_dispatch cannot run {type(experts).__name__}: `{name}_blocks` is {what}; "
                                      f"uint8 MXFP4 blocks expected")
        if not isinstance(scales, torch.Tensor):
            raise NotImplementedError(f"moe_dispatch cannot run {type(experts).__name__}: `{name}_scales` (the e8m0 "
                                      f"scales of `{name}_blocks`) is missing")
        options[key] = scales
    for name in ("alpha", "limit"):
        if getattr(experts, name, None) is None:
            raise NotImplementedError(f"moe_dispatch cannot run {type(experts).__name__}: its clamped SwiGLU's "
                                      f"`{name}` is missing")
    options.update(_swiglu_options(experts, "alpha", "limit"))
    for name, key in (("gate_up_proj_bias", "gate_up_bias"), ("down_proj_bias", "down_bias")):
        bias = getattr(experts, name, None)
        if bias is not None:
            options[key] = bias
    return options


def _gate_up_scale_layout(weight, scale, block_size, transposed, interleaved) -> str:
    """"merged" or "fused": the layout transformers gave `gate_up_proj_scale_inv` (transformers_experts.py's
    docstring). Interleaved
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


def _is_mxfp4_experts(experts) -> bool:
    """An `Mxfp4Experts`-style module: GPT-OSS's MXFP4 tensors under the checkpoint's names (`*_blocks`, `*_scales`)."""
    return hasattr(experts, "gate_up_proj_blocks")
