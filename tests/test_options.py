"""Options other than tensors, checked by kind at every public entry before anything runs (host/checks.py,
host/tiles.py; the environment switches in host/device.py), each on a first call and after a valid one: a planned
function then replays its plan unless the bad option is refused first (host/replay.py). The public functions and
their valid arguments are tests/test_bad_inputs.py's `PUBLIC_CALLS`.

  bools     only True or False: interleaved="False" computed the interleaved layout (a wrong result)
  reals     an int or a float, finite: None failed deep inside naming nothing
  choices   one of the listed strings, ValueError listing them
  tiles     a forced tile the kernels take: BLOCK_K 48 ended in Triton's interpreter
  switches  MOE_DISPATCH_* read once per call and validated on every path; the ones that change what runs are in the
            plan key
  scales    float8 scales that require grad are warned about as the weights are
  names     messages name the public argument (w_gate_up missing its 2F was blamed on w_down)
"""

import inspect

import pytest
import torch
from helpers import DEVICE, assert_close
from test_bad_inputs import (E, F, PUBLIC_CALLS, T, TOP_K, WHEN, _call_id, _Experts, _inputs, _routed,
                             _valid_arguments, fresh_gradient_warnings)  # noqa: F401 (a fixture)

import moe_dispatch as md
from moe_dispatch.host import device
from moe_dispatch.host.tiles import DecodeTile, DecodeTiles, GemmTile, MoeTiles
from moe_dispatch.moe import _FUSED_EXPERTS_PLANS
from moe_dispatch.reference import fused_experts_ref


def _calls_with(field):
    calls = [call for call in PUBLIC_CALLS if getattr(call, field)]
    return pytest.mark.parametrize("call", calls, ids=_call_id)


def _none_is_valid(call, name):
    """None is a documented value of the argument: its default."""
    return inspect.signature(call.function).parameters[name].default is None


@pytest.mark.parametrize("when", WHEN)
@_calls_with("bools")
def test_a_bool_option_refuses_everything_but_true_and_false(call, when):
    """The string "False" is truthy: fused_experts(interleaved="False") computed the interleaved layout. A string, an
    int (0, 1) or None (where None means nothing) is a TypeError naming the argument."""
    arguments = _valid_arguments(call, when)
    for name in call.bools:
        for bad in ("False", 0, 1) + (() if _none_is_valid(call, name) else (None,)):
            with pytest.raises(TypeError, match=rf"^{name} must be a bool"):
                call.function(**{**arguments, name: bad})


@pytest.mark.parametrize("when", WHEN)
@_calls_with("reals")
def test_a_real_option_refuses_non_numbers_and_nan(call, when):
    """A clamp limit, alpha, a scaling or capacity factor: None failed inside (float(None)), "1.0" and True were
    taken; each is a TypeError naming the argument, NaN and infinities a ValueError."""
    arguments = _valid_arguments(call, when)
    for name in call.reals:
        for bad in ("1.0", True, torch.tensor(1.0)) + (() if _none_is_valid(call, name) else (None,)):
            with pytest.raises(TypeError, match=rf"^{name} must be a real number"):
                call.function(**{**arguments, name: bad})
        for bad in (float("nan"), float("inf")):
            with pytest.raises(ValueError, match=rf"^{name} must be finite"):
                call.function(**{**arguments, name: bad})


@pytest.mark.parametrize("when", WHEN)
@_calls_with("choices")
def test_a_choice_option_refuses_other_values_listing_the_choices(call, when):
    """activation, gating, fp8_compute, the scale layout, the FP8 scheme: another string, a non-string (0) or None
    (where None means nothing) is a ValueError that lists the accepted strings."""
    arguments = _valid_arguments(call, when)
    for name in call.choices:
        for bad in ("bogus", 0) + (() if _none_is_valid(call, name) else (None,)):
            with pytest.raises(ValueError, match=rf"^{name} must be one of \[.+\], got {bad!r}"):
                call.function(**{**arguments, name: bad})


@pytest.mark.parametrize("when", WHEN)
def test_transformers_experts_flags_must_be_bools(when):
    """transformers sets an experts module's layout flags as bools; is_concatenated="False" read as true (the
    interleaved layout). A non-bool flag is a TypeError naming the module's attribute, also once the module's
    options are cached (and its call planned) from a valid call."""
    i = _inputs()
    experts = _Experts(i.w_gate_up, i.w_down)
    if when == "after-a-valid-call":
        md.moe_dispatch_experts(experts, i.x, i.ids, i.weights)
    for flag in ("is_concatenated", "is_transposed", "has_bias"):
        setattr(experts, flag, "False")
        with pytest.raises(TypeError, match=rf"^_Experts\.{flag} must be a bool"):
            md.moe_dispatch_experts(experts, i.x, i.ids, i.weights)
        delattr(experts, flag)


# Forced tiles: (id, why, tiles, exception, the field named)
BAD_TILES = [
    ("block-k-48", "the issue's repro: not a power of two, Triton's interpreter failed on it",
     MoeTiles(16, GemmTile(16, 48), GemmTile(16, 16)), ValueError, r"tiles\.gate_up\.block_k"),
    ("block-m-8", "below tl.dot's 16", MoeTiles(8, GemmTile(16, 16), GemmTile(16, 16)), ValueError, r"tiles\.block_m"),
    ("block-n-float", "an int field given a float", MoeTiles(16, GemmTile(16.0, 16), GemmTile(16, 16)), TypeError,
     r"tiles\.gate_up\.block_n must be an int"),
    ("warps-3", "num_warps not a power of two", MoeTiles(16, GemmTile(16, 16), GemmTile(16, 16, num_warps=3)),
     ValueError, r"tiles\.down\.num_warps"),
    ("stages-0", "no pipeline stage", MoeTiles(16, GemmTile(16, 16), GemmTile(16, 16, num_stages=0)), ValueError,
     r"tiles\.down\.num_stages"),
    ("persistent-true", "a bool for the kernel choice", MoeTiles(16, GemmTile(16, 16, persistent=True),
                                                                GemmTile(16, 16)), ValueError,
     r"tiles\.gate_up\.persistent"),
    ("decode-block-k-24", "the decode path's tiles likewise", DecodeTiles(DecodeTile(16, 24), DecodeTile(16, 16)),
     ValueError, r"tiles\.gate_up\.block_k"),
    ("decode-split-k-0", "no K split", DecodeTiles(DecodeTile(16, 16), DecodeTile(16, 16, split_k=0)), ValueError,
     r"tiles\.down\.split_k"),
    ("mixed", "a decode tile inside MoeTiles", MoeTiles(16, DecodeTile(16, 16), GemmTile(16, 16)), TypeError,
     r"tiles\.gate_up must be a GemmTile"),
    ("list", "not a tiles object", [16, 16, 16], TypeError, "tiles must be a MoeTiles"),
]
VALID_TILES = MoeTiles(16, GemmTile(16, 16), GemmTile(16, 16))


def _forced(call, inputs):
    """A call with forced tiles (the general path) that records a plan."""
    if call == "fused_experts":
        return md.fused_experts, dict(hidden_states=inputs.x, w_gate_up=inputs.w_gate_up, w_down=inputs.w_down,
                                      topk_ids=inputs.ids, topk_weights=inputs.weights, validate=False)
    return md.fused_moe_forward, dict(hidden_states=inputs.x, router_weight=inputs.router_weight, w_gate=inputs.w_gate,
                                      w_up=inputs.w_up, w_down=inputs.w_down, num_experts=E, top_k=TOP_K)


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("call", ["fused_experts", "fused_moe_forward"])
@pytest.mark.parametrize("tiles,error,field", [case[2:] for case in BAD_TILES], ids=[case[0] for case in BAD_TILES])
def test_a_forced_tile_is_checked_against_the_kernels(tiles, error, field, call, when):
    """A forced tile the kernels cannot take is an error naming its field before anything launches, not an error
    from inside Triton (or a kernel compiled for a tile it was never written for)."""
    function, arguments = _forced(call, _inputs())
    if when == "after-a-valid-call":
        function(**arguments, tiles=VALID_TILES)
    with pytest.raises(error, match=field):
        function(**arguments, tiles=tiles)


@pytest.mark.parametrize("field", ["dot", "gemv"])
def test_a_decode_tile_refuses_a_string_for_its_switches(field):
    """DecodeTile turned `dot` into a bool with bool(): dot="False" asked for the dot kernel; `gemv` likewise."""
    with pytest.raises(TypeError, match=f"DecodeTile.{field} must be a bool"):
        DecodeTile(16, 16, **{field: "False"})
    assert getattr(DecodeTile(16, 16, **{field: 1}), field) is True  # the flat ints of DecodeTiles.to_list still load
    with pytest.raises(TypeError, match=f"tiles.gate_up.{field} must be a bool"):
        md.fused_experts(torch.randn(2, 16, device=DEVICE), torch.randn(2, 32, 16, device=DEVICE),
                         torch.randn(2, 16, 16, device=DEVICE), torch.zeros(2, 1, dtype=torch.int64, device=DEVICE),
                         torch.ones(2, 1, device=DEVICE),
                         tiles=DecodeTiles(_with_field(DecodeTile(16, 16), field, 2), DecodeTile(16, 16)))


def _with_field(tile, field, value):
    """A frozen tile with one field set past __post_init__'s check (what a forced tile built by hand could hold)."""
    object.__setattr__(tile, field, value)
    return tile


SWITCHES = ["MOE_DISPATCH_PLANS", "MOE_DISPATCH_PDL", "MOE_DISPATCH_GLUON_FP8", "MOE_DISPATCH_MXFP4_PREFILL",
            "MOE_DISPATCH_GLUON_MXFP4"]


@pytest.mark.parametrize("when", WHEN)
@_calls_with("launches")
def test_a_bad_environment_switch_is_refused_on_every_path(call, when, monkeypatch):
    """A bad MOE_DISPATCH_GLUON_FP8 raised on the w8a8 path and was taken everywhere else, a bad MOE_DISPATCH_PDL was
    taken for "on", and a replayed call read none of them: every public function that launches kernels reads the
    switches at its entry, before any plan lookup, and a bad value is a ValueError naming the variable."""
    arguments = _valid_arguments(call, when)
    for variable in SWITCHES:
        monkeypatch.setenv(variable, "yes")
        with pytest.raises(ValueError, match=rf"^{variable} must be one of"):
            call.function(**arguments)
        monkeypatch.delenv(variable)
    monkeypatch.setenv("MOE_DISPATCH_GLUON_FP8", "")  # empty is unset
    call.function(**arguments)


@pytest.mark.parametrize("variable,value", [("MOE_DISPATCH_PDL", "0"), ("MOE_DISPATCH_GLUON_FP8", "1"),
                                            ("MOE_DISPATCH_GLUON_FP8", "0"), ("MOE_DISPATCH_MXFP4_PREFILL", "loads"),
                                            ("MOE_DISPATCH_GLUON_MXFP4", "0")])
def test_changing_a_switch_records_a_new_plan(variable, value, monkeypatch):
    """The switches that change what runs are in the plan key: after changing one, the next call records a plan of
    its own instead of replaying the old one (which needed moe_dispatch.host.replay.clear() before), and replays it
    from then on; MOE_DISPATCH_PLANS=0 runs every call in full."""
    i = _inputs()
    arguments = dict(hidden_states=i.x, w_gate_up=i.w_gate_up, w_down=i.w_down, topk_ids=i.ids,
                     topk_weights=i.weights, tiles=VALID_TILES, validate=False)
    reference = fused_experts_ref(i.x, i.w_gate_up, i.w_down, i.ids, i.weights)
    md.fused_experts(**arguments)
    monkeypatch.setenv(variable, value)
    replays = _FUSED_EXPERTS_PLANS.replays
    assert_close(md.fused_experts(**arguments), reference, torch.float32)
    assert _FUSED_EXPERTS_PLANS.replays == replays and len(_FUSED_EXPERTS_PLANS) == 2, "the old plan replayed"
    assert_close(md.fused_experts(**arguments), reference, torch.float32)
    assert _FUSED_EXPERTS_PLANS.replays == replays + 1
    monkeypatch.setenv("MOE_DISPATCH_PLANS", "0")
    md.fused_experts(**arguments)
    assert _FUSED_EXPERTS_PLANS.replays == replays + 1


def test_the_removed_gluon_bf16_switch_is_ignored(monkeypatch):
    """MOE_DISPATCH_GLUON_BF16 chose a Gluon bf16 engine that was removed before any release (it measured no faster
    than the portable kernels): like any variable the package does not read, a set value, valid once or not, changes
    nothing, not even the plan key."""
    assert "MOE_DISPATCH_GLUON_BF16" not in device.SWITCH_VALUES
    i = _inputs()
    arguments = dict(hidden_states=i.x, w_gate_up=i.w_gate_up, w_down=i.w_down, topk_ids=i.ids,
                     topk_weights=i.weights, tiles=VALID_TILES, validate=False)
    reference = fused_experts_ref(i.x, i.w_gate_up, i.w_down, i.ids, i.weights)
    md.fused_experts(**arguments)
    replays = _FUSED_EXPERTS_PLANS.replays
    for value in ("1", "yes"):
        monkeypatch.setenv("MOE_DISPATCH_GLUON_BF16", value)
        assert_close(md.fused_experts(**arguments), reference, torch.float32)
    assert _FUSED_EXPERTS_PLANS.replays == replays + 2, "a new plan was recorded"


@pytest.mark.parametrize("when", WHEN)
def test_the_switches_are_read_once_per_call(when, monkeypatch):
    """One read of the environment per call however many layers ask (the plan key, the planner's engine choice, each
    launch's PDL option), on the general path's first call and on its replay."""
    i = _inputs()
    arguments = dict(hidden_states=i.x, w_gate_up=i.w_gate_up, w_down=i.w_down, topk_ids=i.ids,
                     topk_weights=i.weights, tiles=VALID_TILES, validate=False)
    if when == "after-a-valid-call":
        md.fused_experts(**arguments)
    reads, read = [], device.read_environment
    monkeypatch.setattr(device, "read_environment", lambda: reads.append(1) or read())
    md.fused_experts(**arguments)
    assert len(reads) == 1, reads


@pytest.fixture
def fp8_experts():
    """fused_experts' float8 arguments (block scales 8 x 8 over tiny weights) with fresh scale tensors."""
    i = _inputs()
    w_gate_up, w_gate_up_scale = md.quantize_experts_fp8(i.w_gate_up, block_shape=(8, 8))
    w_down, w_down_scale = md.quantize_experts_fp8(i.w_down, block_shape=(8, 8))
    return dict(hidden_states=i.x, w_gate_up=w_gate_up, w_down=w_down, topk_ids=i.ids, topk_weights=i.weights,
                w_gate_up_scale=w_gate_up_scale, w_down_scale=w_down_scale, fp8_block_shape=(8, 8),
                gate_up_input_scale=torch.full((E,), 0.05, device=DEVICE), validate=False)


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("scale", ["w_gate_up_scale", "w_down_scale", "gate_up_input_scale"])
def test_a_scale_that_requires_grad_is_warned_about(scale, when, fp8_experts, fresh_gradient_warnings):
    """Quantized weights are frozen and a weight that requires grad is warned about; its scale (transformers keeps
    `*_scale_inv` as Parameters) lost its gradient without a word. Now the same warning names it, once."""
    if when == "after-a-valid-call":
        md.fused_experts(**fp8_experts)
    fp8_experts[scale].requires_grad_(True)
    with pytest.warns(UserWarning, match=rf"fused_experts with quantized .* no gradient to {scale}\b"):
        out = md.fused_experts(**fp8_experts)
    assert not out.requires_grad


@pytest.mark.parametrize("when", WHEN)
def test_transformers_fp8_scales_that_require_grad_are_named_as_the_module_names_them(when, fresh_gradient_warnings):
    """FP8Experts keeps `gate_up_proj_scale_inv` as a Parameter that requires grad: the experts function warns under
    that name (the caller's), and runs on the detached scales (after a call under no_grad too, which warns nothing)."""
    finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")
    i = _inputs()

    class Fp8Experts(torch.nn.Module):  # what fp8_experts_options reads of an FP8Experts module
        _apply_gate = finegrained.FP8Experts._apply_gate

        def __init__(self):
            super().__init__()
            for name, weight in (("gate_up_proj", i.w_gate_up), ("down_proj", i.w_down)):
                quantized, scale = md.quantize_experts_fp8(weight, block_shape=(8, 8))
                setattr(self, name, torch.nn.Parameter(quantized, requires_grad=False))
                setattr(self, f"{name}_scale_inv", torch.nn.Parameter(scale))  # requires grad, as transformers' do
            self.block_size, self.act_fn = (8, 8), torch.nn.SiLU()

    experts = Fp8Experts()
    if when == "after-a-valid-call":
        with torch.no_grad():
            md.moe_dispatch_experts(experts, i.x, i.ids, i.weights)
    with pytest.warns(UserWarning, match=r"no gradient to gate_up_proj_scale_inv, down_proj_scale_inv"):
        out = md.moe_dispatch_experts(experts, i.x, i.ids, i.weights)
    ref = md.fused_experts(i.x, experts.gate_up_proj, experts.down_proj, i.ids, i.weights, fp8_block_shape=(8, 8),
                           w_gate_up_scale=experts.gate_up_proj_scale_inv.detach(),
                           w_down_scale=experts.down_proj_scale_inv.detach())
    assert torch.equal(out, ref)


def _mxfp4_gate_only():
    """A valid MXFP4 experts call (H = F = 32) and the change that leaves w_gate_up the gate rows only (F, not 2F)."""
    w_gate_up, w_down = torch.randn(E, 64, 32, device=DEVICE), torch.randn(E, 32, 32, device=DEVICE)
    (gate_up, gate_up_scale), (down, down_scale) = map(md.quantize_experts_mxfp4, (w_gate_up, w_down))
    valid = dict(hidden_states=torch.randn(T, 32, device=DEVICE), w_gate_up=gate_up, w_down=down, topk_ids=_routed(),
                 topk_weights=torch.rand(T, TOP_K, device=DEVICE), w_gate_up_scale=gate_up_scale,
                 w_down_scale=down_scale, validate=False)
    return valid, dict(w_gate_up=gate_up[:, :32], w_gate_up_scale=gate_up_scale[:, :32])


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("weights", ["float", "mxfp4"])
def test_a_gate_up_weight_without_its_2f_is_named_first(weights, when):
    """w_gate_up holding F rows (the gate alone) was reported as w_down having the wrong F; the message now leads with
    w_gate_up and says it must hold 2F, on a first call and after a valid one."""
    if weights == "float":
        i = _inputs()
        valid = dict(hidden_states=i.x, w_gate_up=i.w_gate_up, w_down=i.w_down, topk_ids=i.ids,
                     topk_weights=i.weights, validate=False)
        bad, rows, two_f = dict(w_gate_up=i.w_gate), F, 2 * F
    else:
        valid, bad = _mxfp4_gate_only()
        rows, two_f = 32, 64
    if when == "after-a-valid-call":
        md.fused_experts(**valid)
    with pytest.raises(ValueError, match=rf"^w_gate_up has {rows} in dimension 1 .*must hold 2F = {two_f}"):
        md.fused_experts(**{**valid, **bad})
