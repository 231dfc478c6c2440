"""The public surface is annotated (the package ships py.typed): every function in `__all__`, the public functions of
the public submodules and the methods of the public classes annotate each parameter and the return, the annotations
resolve, and each `Literal` of string choices lists exactly what the function's own check accepts."""

import importlib
import inspect
import types
import typing

import pytest

import moe_dispatch as md
from moe_dispatch import expert_parallel, fp8, layers, mxfp4, transformers_experts
from moe_dispatch.routing import router
from moe_dispatch.formats import quant
from moe_dispatch.integrations import transformers_options
from moe_dispatch.experts import checks as experts_checks

PUBLIC_SUBMODULES = (layers, transformers_experts, transformers_options, fp8, mxfp4, expert_parallel)

# Parameters whose values a check restricts to a set of strings: the Literal of their annotation must be that set.
CHOICES = {
    "gating": set(router.GATINGS),
    "activation": set(experts_checks.EXPERT_ACTIVATIONS),
    "scheme": set(fp8.SCHEMES),
    "fp8_compute": set(fp8.FP8_COMPUTE),
    "w_gate_up_scale_layout": set(fp8.GATE_UP_SCALE_LAYOUTS),
    "gate_up_layout": set(fp8.GATE_UP_SCALE_LAYOUTS),
    "layout": set(fp8.GATE_UP_SCALE_LAYOUTS),  # fp8's gate/up scale layout helpers
    "format": set(quant.QUANT_FORMATS),  # ExpertsQuant's fields
    "gate_up_scale_layout": set(fp8.GATE_UP_SCALE_LAYOUTS),
    "weight_layout": set(quant.WEIGHT_LAYOUTS),
}


def _methods(cls):
    """The methods a class defines itself (not inherited, not generated dunders), as plain functions."""
    found = {}
    for name, value in vars(cls).items():
        if isinstance(value, (classmethod, staticmethod)):
            value = value.__func__
        if inspect.isfunction(value) and (name == "__init__" or not name.startswith("_")):
            found[f"{cls.__qualname__}.{name}"] = value
    return found


def _public_callables():
    """name -> function: `__all__`'s functions and classes' methods, the public functions of the public submodules
    (those defined there) and the methods of the layers."""
    found = {}
    for name in md.__all__:
        obj = getattr(md, name)
        if inspect.isclass(obj):
            found.update(_methods(obj))
        else:
            found[name] = obj
    for module in PUBLIC_SUBMODULES:
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj):
                found[f"{module.__name__.rpartition('.')[2]}.{name}"] = obj
            elif inspect.isclass(obj) and (module is layers or name in md.__all__):
                found.update(_methods(obj))
    return found


PUBLIC = _public_callables()


def _missing(function):
    """Names of the parameters of `function` without an annotation (its first one for a method), plus "return"."""
    signature = inspect.signature(function)
    params = list(signature.parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    missing = [p.name for p in params if p.annotation is inspect.Parameter.empty]
    if signature.return_annotation is inspect.Signature.empty:
        missing.append("return")
    return missing


def _literal_strings(annotation):
    """The strings of a Literal annotation, also inside `Literal[...] | None`; None when it holds no Literal."""
    if typing.get_origin(annotation) is typing.Literal:
        return set(typing.get_args(annotation))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        parts = [_literal_strings(arg) for arg in typing.get_args(annotation)]
        parts = [part for part in parts if part is not None]
        return set().union(*parts) if parts else None
    return None


def test_the_checks_see_what_they_test():
    def bare(x, y: int, *rest, **options):
        return x

    def typed(x: int, *, y: str | None = None) -> int:
        return x

    assert _missing(bare) == ["x", "rest", "options", "return"] and _missing(typed) == []
    assert _literal_strings(typing.Literal["a", "b"] | None) == {"a", "b"} and _literal_strings(int | None) is None
    # The surface covers every `__all__` name, the v1 functions and the classes' own methods.
    assert {"fused_moe_forward", "moe_router", "grouped_gemm", "expert_capacity", "quantize_experts_fp8"} <= set(PUBLIC)
    assert {"ExpertParallelExperts.__init__", "ExpertParallelExperts.forward", "ExpertParallelExperts.from_experts",
            "SparseMoeBlock.forward", "MegaBlocksMoeMLP.forward", "fp8.is_fp8", "expert_parallel.ep_capacity",
            "transformers_options.fused_experts_options", "mxfp4.check_mxfp4_weight",
            "quantize_experts_mxfp4"} <= set(PUBLIC)


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_function_is_annotated(name):
    function = PUBLIC[name]
    assert not _missing(function), f"{name} lacks annotations for {_missing(function)}"
    hints = typing.get_type_hints(function)  # resolves string annotations too (a misspelt name raises)
    for param in inspect.signature(function).parameters:
        if param in CHOICES:
            assert _literal_strings(hints[param]) == CHOICES[param], (
                f"{name}'s {param} is annotated {hints[param]} but its check accepts {sorted(CHOICES[param])}")


def test_package_ships_the_py_typed_marker():
    from importlib.resources import files

    assert files(md).joinpath("py.typed").is_file()


# The public modules' v1 paths (flat, before the sub-packages) -> where they live now.
V1_MODULE_PATHS = {"fp8": "formats.fp8", "mxfp4": "formats.mxfp4", "tiles": "host.tiles",
                   "layers": "integrations.layers", "transformers_experts": "integrations.transformers_experts",
                   "expert_parallel": "parallel.expert_parallel", "reference": "reference",
                   "binned": "dispatch.binned", "_plan": "host.replay"}  # the last two: named by docs/usage.md


@pytest.mark.parametrize("old,new", V1_MODULE_PATHS.items(), ids=list(V1_MODULE_PATHS))
def test_v1_module_paths_are_the_moved_modules(old, new):
    """`import moe_dispatch.fp8`, `from moe_dispatch.tiles import MoeTiles`, `moe_dispatch.layers`: each v1 path of a
    public module gives the one module object of its new home, as an import and as an attribute."""
    module = importlib.import_module(f"moe_dispatch.{new}")
    assert importlib.import_module(f"moe_dispatch.{old}") is module
    assert getattr(md, old) is module
    assert module.__name__ == f"moe_dispatch.{new}"
    assert old == "reference" or md.V1_MODULE_PATHS[old] is module  # the package's own list says the same


def test_v1_from_imports_still_work():
    from moe_dispatch.fp8 import quantize_experts_fp8
    from moe_dispatch.host import tiles
    from moe_dispatch.mxfp4 import quantize_experts_mxfp4
    from moe_dispatch.tiles import DecodeTiles, MoeTiles

    assert quantize_experts_fp8 is md.quantize_experts_fp8 and quantize_experts_mxfp4 is md.quantize_experts_mxfp4
    assert (MoeTiles, DecodeTiles) == (tiles.MoeTiles, tiles.DecodeTiles)
