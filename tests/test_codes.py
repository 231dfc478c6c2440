"""The integer codes the kernels branch on (gemm.jit.Activation and WeightScaleCode, gemm.w8a8_jit.AQuant and QuantOut,
tiles.Persistent) as the GPU compiler needs them, which the interpreter does not check: jit code reads no module
global but a `tl.constexpr` (Triton's GPU compiler refuses the rest, an enum class included: "Cannot access global
variable ... from within @jit'ed function"), and launches pass each code as a plain int, so that Triton's cache key
of a specialization (the repr of its constexprs) is one per value, not one per spelling of it."""

import ast
import builtins
import enum
import importlib
import inspect
import pkgutil
import textwrap
import types

import pytest
import torch
import triton
import triton.language as tl
from helpers import DEVICE

import moe_dispatch as md
from moe_dispatch.host import replay
from moe_dispatch.host.device import has_wgmma
from moe_dispatch.formats.fp8 import quantize_experts_fp8
from moe_dispatch.gemm.jit import ACT_SILU, Activation
from moe_dispatch.host.tiles import DecodeTile, DecodeTiles, GemmTile, MoeTiles, Persistent

MODULES = [importlib.import_module(info.name) for info in pkgutil.walk_packages(md.__path__, "moe_dispatch.")
           if info.name != "moe_dispatch._ops"]


def _is_jit(value):
    return type(value).__name__ in ("JITFunction", "InterpretedFunction") and hasattr(value, "fn")


def _allowed_global(value):
    """What Triton's code generator lets jit code read as a module global (its `global_lookup`)."""
    return (isinstance(value, (types.ModuleType, tl.constexpr, tl.dtype)) or _is_jit(value)
            or getattr(value, "__triton_builtin__", False) or getattr(value, "__triton_aggregate__", False)
            or getattr(value, "__module__", "").startswith("triton.language"))


def refused_globals(jit_function):
    """Names of module globals `jit_function` reads that Triton's GPU compiler would refuse, with their types."""
    fn = jit_function.fn
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    local = set(fn.__code__.co_varnames)
    refused = set()
    for node in ast.walk(tree.body[0]):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in local:
            if node.id in fn.__globals__:
                value = fn.__globals__[node.id]
                if not _allowed_global(value):
                    refused.add((node.id, type(value).__name__))
            elif not hasattr(builtins, node.id):
                refused.add((node.id, "undefined"))
    return refused


class _Code(enum.IntEnum):
    SILU = 1


@triton.jit
def _reads_an_enum(x, ACTIVATION: tl.constexpr):
    if ACTIVATION == _Code.SILU:
        x = x + 1
    return x


@triton.jit
def _reads_an_alias(x, ACTIVATION: tl.constexpr):
    if ACTIVATION == ACT_SILU:
        x = x + 1
    return x


def test_the_global_check_tells_an_enum_from_a_constexpr():
    """Positive control: the check below flags an enum class read in jit code and passes a constexpr alias."""
    assert refused_globals(_reads_an_enum) == {("_Code", "EnumType")}
    assert refused_globals(_reads_an_alias) == set()


def test_jit_code_reads_only_constexpr_globals():
    jit_functions = {f"{module.__name__}.{name}": value for module in MODULES
                     for name, value in vars(module).items()
                     if _is_jit(value) and value.fn.__module__ == module.__name__}
    assert len(jit_functions) > 40  # every module's kernels and jit helpers were found
    refused = {name: found for name, function in jit_functions.items() if (found := refused_globals(function))}
    assert not refused, refused


class _LaunchSpy:
    """Every launch of the package (each module's `launch`, replay.launch) recorded as (kernel name, kwargs)."""

    def __init__(self, monkeypatch):
        self.launches = []
        real = replay.launch

        def spy(kernel, grid, *args, **kwargs):
            self.launches.append((kernel.fn.__name__, kwargs))
            return real(kernel, grid, *args, **kwargs)

        for module in MODULES:
            if getattr(module, "launch", None) is real:
                monkeypatch.setattr(module, "launch", spy)

    def constexprs_of(self, kernel):
        return [kwargs for name, kwargs in self.launches if name == kernel]


def _experts(E, H, F, gen):
    return (torch.randn(E, 2 * F, H, generator=gen).mul(0.2).to(DEVICE),
            torch.randn(E, H, F, generator=gen).mul(0.2).to(DEVICE))


E, H, F, TOP_K = 4, 32, 32, 2
SWAPS = has_wgmma(torch.device(DEVICE))  # planner.w8a8_gemm_kernel swaps 16-row tiles of 64 columns
GENERAL = MoeTiles(16, GemmTile(32, 32), GemmTile(32, 32))  # forced: at 3 tokens the table takes the decode path
# (id, fused_experts options, float8 block scales, {kernel: {constexpr: expected code}}, why)
CASES = [
    ("bf16-silu", dict(tiles=GENERAL), None,
     {"_grouped_gemm_kernel": {"ACTIVATION": Activation.SILU, "WEIGHT_SCALE": 0}},
     "the pointer kernel's gated GEMM1, then GEMM2 without an activation"),
    ("bf16-persistent-swiglu", dict(activation="swiglu_oai", interleaved=True,
                                    tiles=MoeTiles(16, GemmTile(32, 32, persistent=Persistent.ON),
                                                   GemmTile(32, 32, persistent=Persistent.ON))), None,
     {"_persistent_grouped_gemm_kernel": {"ACTIVATION": Activation.SWIGLU_OAI}},
     "tiles asking for the persistent descriptor kernel (the interpreter emulates descriptors)"),
    ("fp8-dequant-block", dict(fp8_compute="dequant", tiles=GENERAL), (16, 16),
     {"_grouped_gemm_kernel": {"WEIGHT_SCALE": 4}},
     "block scales whose K step lies in one block: WeightScaleCode.BLOCK_STEP"),
    ("fp8-decode-channel", dict(fp8_compute="dequant", tiles=DecodeTiles(DecodeTile(32, 32), DecodeTile(32, 32))),
     "channel", {"_decode_gate_up_kernel": {"WEIGHT_SCALE": 2, "ACTIVATION": 1}, "_decode_down_kernel": {}},
     "the two-launch decode path with per-channel scales"),
    ("fp8-w8a8-block", dict(fp8_compute="w8a8", tiles=GENERAL), (32, 32),
     {"_w8a8_gemm_kernel": {"A_QUANT": 0, "WEIGHT_SCALE": 3, "QUANT_OUT": 1, "SWAP_AB": False}},
     "the w8a8 pointer kernel: dynamic activations in GEMM1's loads, its epilogue quantizing GEMM2's input"),
    ("fp8-w8a8-swapped", dict(fp8_compute="w8a8", tiles=MoeTiles(16, GemmTile(64, 32), GemmTile(64, 32))), (32, 32),
     {"_w8a8_gemm_kernel": {"A_QUANT": 2 if SWAPS else 0, "WEIGHT_SCALE": 3, "QUANT_OUT": 1, "SWAP_AB": SWAPS}},
     "small tiles swapping their operands where wgmma runs (the interpreter says it does): x quantized by the pass"),
]


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_launches_pass_codes_as_plain_ints(case, monkeypatch):
    """Every constexpr a launch of the case passes is a plain int (no IntEnum), and the codes are the case's."""
    _, options, fp8, expected, _ = case
    gen = torch.Generator().manual_seed(0)
    w_gate_up, w_down = _experts(E, H, F, gen)
    if fp8 is not None:
        scheme, block_shape = ("channel", (128, 128)) if fp8 == "channel" else ("block", fp8)
        w_gate_up, s_gate_up = quantize_experts_fp8(w_gate_up, scheme, block_shape=block_shape)
        w_down, s_down = quantize_experts_fp8(w_down, scheme, block_shape=block_shape)
        options = dict(options, w_gate_up_scale=s_gate_up, w_down_scale=s_down, fp8_block_shape=block_shape)
    else:
        w_gate_up, w_down = w_gate_up.bfloat16(), w_down.bfloat16()
    T = 3
    x = torch.randn(T, H, generator=gen).to(DEVICE, torch.bfloat16)
    ids = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :TOP_K].to(DEVICE)
    weights = torch.rand(T, TOP_K, generator=gen).to(DEVICE)
    spy = _LaunchSpy(monkeypatch)
    md.fused_experts(x, w_gate_up, w_down, ids, weights, **options)
    assert spy.launches, "nothing launched: the call replayed a plan recorded before the spy"
    for kernel, kwargs in spy.launches:
        coded = {key: type(value).__name__ for key, value in kwargs.items() if isinstance(value, enum.Enum)}
        assert not coded, (kernel, coded)
    for kernel, codes in expected.items():
        launches = spy.constexprs_of(kernel)
        assert launches, (kernel, [name for name, _ in spy.launches])
        first = launches[0]
        assert {key: first[key] for key in codes} == codes, (kernel, first)
