"""The Gluon engine of the w8a8 path (moe_dispatch.gemm.gluon_experts, chosen by planner.plan_w8a8_engine): when it
runs, and the arithmetic around its two GEMMs.

The Gluon GEMM needs an SM90 GPU and Triton 3.6, so the CPU tests run the engine's glue (the quantization pass that
gathers x, the activation pass that quantizes h, the bias / routing-weight pass, combine) in the interpreter with the
GEMM swapped for its float64 reference (`fp8_block_grouped_gemm_ref`, rounded to bf16 as the kernel writes), through
`fused_experts` with MOE_DISPATCH_GLUON_FP8=1 and `gluon_fp8.available` patched to True. The swapped GEMM first asks the
real launcher, which checks every operand (dtypes, shapes, 16-byte aligned K-contiguous rows) before it refuses for
want of a GPU: what the engine hands the kernel is what the kernel takes. The GPU tests run the whole engine where
`gluon_fp8.available()` holds.

Tolerances: against the float64 experts on the dequantized weights, reference.W8A8_TOLERANCE (the error of e4m3
activations); against the float64 model of the engine's arithmetic (`fused_experts_w8a8_ref` with groups of 128 and
both GEMMs' sums rounded to bf16, as the Gluon GEMM writes them), MODEL_TOLERANCE: the bf16 roundings of y, of the
weighted y and of the output (measured 5-6e-3 RMS on the CPU cases), and the few e4m3 roundings of the intermediate
that fp32 activation math puts on the other side of a rounding boundary from float64 (one element a full e4m3 step
off: 1-4e-2 on its token at these small F; measured 1.4e-2 RMS overall on the odd-sizes case with one such token).
On the GPU, wgmma's narrower sums within each K block move a few more (reference.W8A8_MODEL_TOLERANCE_GPU).
"""

import dataclasses

import pytest
import torch
from helpers import (DEVICE, TOLERANCE, EngineCase, Refusal, assert_close, assert_forced_on, engine_refusals,
                     distinct_ids, gpu_biases, run_gluon_engine, swap_gluon_gemm, wrap_gluon_engine)

import moe_dispatch as md
from moe_dispatch.formats.fp8 import quantize_experts_fp8
from moe_dispatch.gemm import gluon_experts, gluon_fp8, planner
from moe_dispatch.gemm.planner import ExpertsPath, ExpertsPlan
from moe_dispatch.host.tiles import GemmTile, MoeTiles
from moe_dispatch.reference import (W8A8_MODEL_TOLERANCE_GPU, W8A8_TOLERANCE, fp8_block_gated_grouped_gemm_ref,
                                    fp8_block_grouped_gemm_ref, fused_experts_fp8_ref, fused_experts_w8a8_ref)

GROUPS = (128, 128)  # the engine's activation groups: one per 128-wide K block of either GEMM
MODEL_TOLERANCE = max(TOLERANCE[torch.bfloat16], W8A8_MODEL_TOLERANCE_GPU)  # module docstring
PREFILL = MoeTiles(64, GemmTile(64, 32), GemmTile(32, 32))  # prefill-sized tiles: the engine's floor (BLOCK_M 64)
on_hopper = pytest.mark.skipif(not gluon_fp8.available(), reason=f"{gluon_fp8.unavailable_reason()}")


def _block_fp8_experts(E, H, F, device=DEVICE):
    """(w_gate_up [E, 2F, H], w_down [E, H, F]) float8_e4m3fn with fp32 128 x 128 block scales, as fused_experts'
    keyword arguments."""
    q_gate_up, s_gate_up = quantize_experts_fp8(torch.randn(E, 2 * F, H, device=device) * 0.2)
    q_down, s_down = quantize_experts_fp8(torch.randn(E, H, F, device=device) * 0.2)
    return q_gate_up, q_down, dict(w_gate_up_scale=s_gate_up, w_down_scale=s_down)


# -- selection ----------------------------------------------------------------------------------------------------


def _planner_args(**changes):
    """gluon_fp8_refusal's arguments for a call the engine takes (CPU tensors, `available` answering True), with
    `changes` applied: H = 256, F = 128, E = 2, bf16 x, prefill tiles on the w8a8 path."""
    E, H, F = 2, 256, 128
    w_gate_up, w_down, scales = _block_fp8_experts(E, H, F, device="cpu")
    args = dict(plan=ExpertsPlan(ExpertsPath.W8A8, PREFILL), x=torch.zeros(4, H, dtype=torch.bfloat16),
                w_gate_up=w_gate_up, w_down=w_down, w_gate_up_scale=scales["w_gate_up_scale"],
                w_down_scale=scales["w_down_scale"], separate_up=False, block_shape=(128, 128), scale_layout="fused",
                static_input_scales=False, transposed=False, top_k=1, available=lambda device: True)
    args.update(changes)
    return args


def _refusal(**changes):
    args = _planner_args(**changes)
    plan = args.pop("plan")
    return planner.gluon_fp8_refusal(plan, *(args.pop(k) for k in ("x", "w_gate_up", "w_down", "w_gate_up_scale",
                                                                  "w_down_scale")), **args)


REFUSALS = [
    *engine_refusals(gluon_fp8, PREFILL),
    Refusal("decode-tiles", "16-row tiles: decode sizes on the w8a8 path",
            lambda: dict(plan=ExpertsPlan(ExpertsPath.W8A8, MoeTiles(16, GemmTile(64, 32), GemmTile(32, 32)))),
            "decode-sized tiles"),
    Refusal("dequant-path", "float8 weights on the dequant path", lambda: dict(
        plan=ExpertsPlan(ExpertsPath.GROUPED, PREFILL)), "grouped path"),
    Refusal("fp16", "the GEMM writes bf16 only", lambda: dict(x=torch.zeros(4, 256, dtype=torch.float16)),
            "float16"),
    Refusal("transposed", "GPT-OSS's [E, H, 2F] layout", lambda: dict(transposed=True), "transposed"),
    Refusal("separate-up", "w_up passed apart from w_gate", lambda: dict(separate_up=True), "separate"),
    Refusal("static-scales", "a checkpoint's input_scale", lambda: dict(static_input_scales=True), "static"),
    Refusal("channel", "per-channel weight scales", lambda: dict(
        w_gate_up_scale=torch.ones(2, 256), w_down_scale=torch.ones(2, 256)), "block scales"),
    Refusal("tensor", "per-tensor weight scales", lambda: dict(
        w_gate_up_scale=torch.ones(2), w_down_scale=torch.ones(2)), "block scales"),
    Refusal("e8m0-scales", "power-of-two scales as e8m0 codes", lambda: dict(
        w_gate_up_scale=torch.ones(2, 2, 2, dtype=torch.uint8)), "fp32 block scales"),
    Refusal("block-64", "64 x 64 blocks", lambda: dict(block_shape=(64, 64)), "block shape"),
    Refusal("merged-odd-F", "merged gate/up scales where F = 80 is not a multiple of 128 (the scale rows of up do not "
            "continue gate's)", lambda: dict(scale_layout="merged", w_down=torch.zeros(2, 256, 80,
                                                                                      dtype=torch.float8_e4m3fn)),
            "merged"),
    Refusal("unaligned-rows", "H = 40: weight rows of 40 bytes, which TMA cannot address",
            lambda: dict(w_gate_up=torch.zeros(2, 256, 40, dtype=torch.float8_e4m3fn)), "16 bytes"),
    Refusal("non-contiguous", "a strided view of the weights",
            lambda: dict(w_down=torch.zeros(2, 128, 512, dtype=torch.float8_e4m3fn)[:, :, ::2]), "contiguous"),
]


def test_planner_engine_modes(monkeypatch):
    """Unset or empty ("auto"): the engine from GLUON_FP8_MIN_ROWS rows per expert (T * top_k / E) and the portable
    kernels below; "1": the engine at any count; "0": never; any other value: ValueError naming the variable."""
    E = 2  # _planner_args' experts
    few = torch.zeros(4, 256, dtype=torch.bfloat16)  # 2 rows per expert at top_k 1
    at_threshold = torch.zeros(planner.GLUON_FP8_MIN_ROWS * E // 2, 256, dtype=torch.bfloat16)  # top_k 2
    args = _planner_args()
    plan = args.pop("plan")
    tensors = [args.pop(k) for k in ("x", "w_gate_up", "w_down", "w_gate_up_scale", "w_down_scale")]
    for unset in (None, ""):
        if unset is None:
            monkeypatch.delenv(planner.GLUON_FP8_VARIABLE, raising=False)
        else:
            monkeypatch.setenv(planner.GLUON_FP8_VARIABLE, unset)
        assert "GLUON_FP8_MIN_ROWS" in _refusal(x=few)
        assert "GLUON_FP8_MIN_ROWS" in _refusal(x=at_threshold[:-1], top_k=2)  # one row under the threshold
        assert _refusal(x=at_threshold, top_k=2) is None
        assert planner.plan_w8a8_engine(plan, *tensors, **args) is plan  # the default 4 tokens: portable
        assert planner.plan_w8a8_engine(plan, at_threshold, *tensors[1:], **{**args, "top_k": 2}) == ExpertsPlan(
            ExpertsPath.W8A8_GLUON, PREFILL)
    monkeypatch.setenv(planner.GLUON_FP8_VARIABLE, "0")
    assert planner.GLUON_FP8_VARIABLE in _refusal(x=at_threshold, top_k=2)
    assert_forced_on(monkeypatch, planner.GLUON_FP8_VARIABLE, lambda: _refusal(x=few),
                     lambda: planner.plan_w8a8_engine(plan, *tensors, **args),
                     ExpertsPlan(ExpertsPath.W8A8_GLUON, PREFILL), ("true",))


@pytest.mark.parametrize("case", REFUSALS, ids=[c.id for c in REFUSALS])
def test_planner_falls_back(case, monkeypatch):
    monkeypatch.setenv(planner.GLUON_FP8_VARIABLE, "1")
    case.assert_refused(_refusal)


def test_fused_experts_keeps_the_portable_path_unless_the_engine_is_chosen(monkeypatch):
    """Through fused_experts: the engine does not run by default below GLUON_FP8_MIN_ROWS rows per expert (here with
    `available` patched to True), nor with the variable "1" where Gluon cannot run (the CPU); the portable w8a8
    kernels answer instead, with the same result."""
    calls = wrap_gluon_engine(monkeypatch, "gluon_w8a8_experts")
    w_gate_up, w_down, scales = _block_fp8_experts(2, 128, 128)
    x = torch.randn(3, 128, device=DEVICE).bfloat16()
    ids, weights = distinct_ids(3, 2, 1, device=DEVICE), torch.rand(3, 1, device=DEVICE)

    def run():
        md.host.replay.clear()  # the variable is read when a plan is recorded
        return md.fused_experts(x, w_gate_up, w_down, ids, weights, fp8_compute="w8a8", tiles=PREFILL, **scales)

    real_available = gluon_fp8.available
    monkeypatch.delenv(planner.GLUON_FP8_VARIABLE, raising=False)
    monkeypatch.setattr(gluon_fp8, "available", lambda device=None: True)
    out = run()
    assert calls == [] and torch.isfinite(out).all()
    if not real_available(x.device):
        monkeypatch.setenv(planner.GLUON_FP8_VARIABLE, "1")
        monkeypatch.setattr(gluon_fp8, "available", real_available)
        assert torch.equal(run(), out) and calls == []


# -- the glue on the CPU, the GEMM swapped for its float64 reference -----------------------------------------------


def test_plain_gemm_tiles_by_rows_per_expert():
    """The engine's plain FP8 GEMMs take the 64 x 256 tile below ROWS64_BELOW_ROWS = 1024 rows per expert
    (T * top_k / E, on average) and 128 x 128 from there: the probe's six H200 cells on their sides of it, and the
    rows just either side."""
    tiles = gluon_experts.fp8_gemm_config
    rows64, default = gluon_fp8.ROWS64_CONFIG, gluon_fp8.DEFAULT_CONFIG
    assert gluon_experts.ROWS64_BELOW_ROWS == 1024
    qwen3, deepseek_v3, mixtral = (8, 128), (8, 256), (2, 8)  # (top_k, E)
    assert tiles(4096, *qwen3) == rows64  # 256 rows per expert
    assert tiles(4096, *deepseek_v3) == rows64  # 128
    assert tiles(16384, *deepseek_v3) == rows64  # 512
    assert tiles(16384, *qwen3) == default  # 1024
    assert tiles(4096, *mixtral) == default  # 1024
    assert tiles(16384, *mixtral) == default  # 4096
    assert tiles(16383, *qwen3) == rows64  # 1023.94: the average, not rounded
    assert tiles(1, 1, 8) == rows64 and tiles(0, 8, 128) == rows64


def test_fused_activation_by_rows_per_expert():
    """GEMM1 activates in its epilogue from FUSED_FROM_ROWS = 256 rows per expert (T * top_k / E, on average): the
    measured cells on their sides of it (DeepSeek-V3 T = 4096 at 128 rows: the separate pass faster), and the rows
    just either side."""
    fuses = gluon_experts.fuses_activation
    assert gluon_experts.FUSED_FROM_ROWS == 256
    qwen3, deepseek_v3, mixtral = (8, 128), (8, 256), (2, 8)  # (top_k, E)
    assert not fuses(4096, *deepseek_v3)  # 128 rows per expert
    assert fuses(4096, *qwen3) and fuses(16384, *deepseek_v3) and fuses(4096, *mixtral)  # 256, 512, 1024
    assert fuses(8192, *deepseek_v3) and not fuses(8191, *deepseek_v3)  # 256 and 255.97: the average, not rounded
    assert not fuses(1, 1, 8) and not fuses(0, 8, 128)


PLAIN_GEMM_CONFIGS = []  # the `cfg` of each plain GEMM call under `reference_engine`, in order


@pytest.fixture
def reference_engine(monkeypatch):
    """The engine selected on this machine, its GEMMs the float64 references (helpers.swap_gluon_gemm): the plain
    one rounded to bf16 as the kernel writes, the gated one's activation quantized to e4m3 per row and 128 columns
    as its epilogue does. Yields the list of GEMM calls, in order, each led by "plain" or "gated"."""
    PLAIN_GEMM_CONFIGS.clear()
    calls = swap_gluon_gemm(monkeypatch, gluon_fp8, "fp8_block_grouped_gemm", planner.GLUON_FP8_VARIABLE,
                            lambda *operands, cfg: PLAIN_GEMM_CONFIGS.append(cfg) or fp8_block_grouped_gemm_ref(
                                *operands), out_dtype=torch.bfloat16, label="plain")
    yield swap_gluon_gemm(monkeypatch, gluon_fp8, "fp8_block_gated_grouped_gemm", planner.GLUON_FP8_VARIABLE,
                          fp8_block_gated_grouped_gemm_ref, calls=calls, label="gated")


@dataclasses.dataclass(frozen=True)
class GlueCase(EngineCase):
    H: int = 144
    F: int = 80
    bias: bool = False


GLUE_CASES = [
    GlueCase("odd-sizes", "H = 144 and F = 80, not multiples of 128: partial K blocks in both GEMMs, a partial 128 "
             "group of x and of h, and the 2F = 160 rows of w_gate_up in a partial scale block; expert 2 gets no row"),
    GlueCase("interleaved-swiglu-bias", "GPT-OSS's activation with both biases on the interleaved layout: gate and up "
             "columns alternate in GEMM1's output (not transposed: the engine's layout)", H=128, F=144,
             options=(("interleaved", True), ("activation", "swiglu_oai")), bias=True),
    GlueCase("merged-scales", "merged gate/up scales where F = 128: the same blocks as fused ones; top_k = E, every "
             "expert hit; GEMM1 activates and quantizes in its epilogue", T=7, E=3, top_k=3, H=160, F=128,
             options=(("w_gate_up_scale_layout", "merged"),), skip_expert=None),
    GlueCase("gated-swiglu-bias", "F = 256: two 128-column tiles of h from GEMM1's epilogue (their up rows and scale "
             "blocks F further), swiglu_oai with both biases on concatenated rows; the down bias pass applies the "
             "routing weights", H=144, F=256, options=(("activation", "swiglu_oai"),), bias=True),
]


def _glue_inputs(case):
    w_gate_up, w_down, scales = _block_fp8_experts(case.E, case.H, case.F)
    x = torch.randn(case.T, case.H, device=DEVICE).bfloat16()
    skip = () if case.skip_expert is None else (case.skip_expert,)
    ids = distinct_ids(case.T, case.E, case.top_k, skip=skip, device=DEVICE)
    weights = torch.rand(case.T, case.top_k, device=DEVICE)
    options = dict(case.options)
    if case.bias:
        options.update(gate_up_bias=torch.randn(case.E, 2 * case.F, device=DEVICE).bfloat16(),
                       down_bias=torch.randn(case.E, case.H, device=DEVICE).bfloat16())
    return x, w_gate_up, w_down, ids, weights, scales, options


# The engine's forms, as gluon_w8a8_experts keywords: the package's call, and the explicit alternatives the probe times
# (benchmarks/gluon_fp8_probe.py)
ENGINE_FORMS = {"default": {}, "pass": dict(fused_activation=False), "fused": dict(fused_activation=True),
                "128x128": dict(plain_gemm_cfg=gluon_fp8.DEFAULT_CONFIG)}


@pytest.mark.parametrize("form", list(ENGINE_FORMS))
@pytest.mark.parametrize("case", GLUE_CASES, ids=[c.id for c in GLUE_CASES])
def test_engine_glue_matches_float64(case, form, reference_engine, poison_empty, monkeypatch):
    """The whole experts output through fused_experts (dispatch, the engine, combine) against the float64 experts on
    the dequantized weights and against the float64 model of the w8a8 arithmetic, in each form: the default (these
    cases have fewer than FUSED_FROM_ROWS rows per expert: the separate activation pass; the plain GEMMs on 64 x 256
    tiles, fewer than ROWS64_BELOW_ROWS), the separate pass everywhere, GEMM1 activating in its epilogue wherever the
    layout allows, and 128 x 128 plain GEMMs (the launcher checks the operands under each config). Buffers start as NaN (poison_empty): the passes write every row
    the GEMMs and combine read."""
    assert case.T * case.top_k < gluon_experts.ROWS64_BELOW_ROWS * case.E
    assert not gluon_experts.fuses_activation(case.T, case.top_k, case.E)
    calls = wrap_gluon_engine(monkeypatch, "gluon_w8a8_experts", **ENGINE_FORMS[form])
    x, w_gate_up, w_down, ids, weights, scales, options = _glue_inputs(case)
    out = md.fused_experts(x, w_gate_up, w_down, ids, weights, fp8_compute="w8a8", tiles=PREFILL, **scales,
                           **options)
    assert calls == [1]
    N = case.T * case.top_k
    fp8 = torch.float8_e4m3fn
    # GEMM1 activates and quantizes h in its epilogue for concatenated gate/up rows with F a multiple of 128 when the
    # call asks for it (by default only from FUSED_FROM_ROWS rows per expert)
    fusable = not options.get("interleaved") and case.F % 128 == 0
    gemm1 = "gated" if fusable and form == "fused" else "plain"
    assert reference_engine == [(gemm1, (N, case.H), (case.E, 2 * case.F, case.H), fp8),
                                ("plain", (N, case.F), (case.E, case.H, case.F), fp8)]
    tiles = gluon_fp8.DEFAULT_CONFIG if form == "128x128" else gluon_fp8.ROWS64_CONFIG
    assert PLAIN_GEMM_CONFIGS == [tiles] * (1 if gemm1 == "gated" else 2)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    ref_options = {k: v for k, v in options.items() if k != "w_gate_up_scale_layout"}
    assert_close(out, fused_experts_w8a8_ref(x, w_gate_up, w_down, ids, weights, groups=GROUPS,
                                             gemm_out_dtype=torch.bfloat16, **scales, **ref_options),
                 what="engine vs its model", tolerance=MODEL_TOLERANCE)
    assert_close(out, fused_experts_fp8_ref(x, w_gate_up, w_down, ids, weights, **scales, **ref_options),
                 what="engine vs dequantized weights", tolerance=W8A8_TOLERANCE)


@pytest.mark.parametrize("T,tiles", [(2047, gluon_fp8.ROWS64_CONFIG), (2048, gluon_fp8.DEFAULT_CONFIG)],
                         ids=["1023.5-rows", "1024-rows"])
def test_engine_tiles_from_the_call(T, tiles, reference_engine):
    """Through fused_experts, the default engine's tiles follow the call's shapes: E = 2, top_k = 1, so T = 2047 is
    1023.5 rows per expert (64 x 256) and T = 2048 is 1024 (128 x 128); F = 128: GEMM1 fused, GEMM2 the plain one."""
    w_gate_up, w_down, scales = _block_fp8_experts(2, 128, 128)
    x = torch.randn(T, 128, device=DEVICE).bfloat16()
    ids, weights = distinct_ids(T, 2, 1, device=DEVICE), torch.rand(T, 1, device=DEVICE)
    out = md.fused_experts(x, w_gate_up, w_down, ids, weights, fp8_compute="w8a8", tiles=PREFILL, **scales)
    assert [call[0] for call in reference_engine] == ["gated", "plain"]
    assert PLAIN_GEMM_CONFIGS == [tiles] and torch.isfinite(out).all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's, in the interpreter, on NaN
def test_engine_nan_token_reaches_its_row_only(reference_engine):
    """A NaN in one token's hidden state makes its output row NaN (the group's scale and the e4m3 NaN carry it through
    both GEMMs and the activation); every other row is bit for bit that of the call without it."""
    case = GLUE_CASES[0]
    x, w_gate_up, w_down, ids, weights, scales, options = _glue_inputs(case)
    clean = md.fused_experts(x, w_gate_up, w_down, ids, weights, fp8_compute="w8a8", tiles=PREFILL, **scales)
    bad = x.clone()
    bad[4, 131] = float("nan")  # in the partial second 128 group of H = 144
    out = md.fused_experts(bad, w_gate_up, w_down, ids, weights, fp8_compute="w8a8", tiles=PREFILL, **scales)
    assert torch.isnan(out[4]).all(), out[4, :8].tolist()
    others = [t for t in range(case.T) if t != 4]
    assert torch.isfinite(clean).all() and torch.equal(out[others], clean[others])


def test_engine_no_tokens(reference_engine):
    """T = 0: nothing to quantize, multiply or combine; an empty [0, H] result."""
    w_gate_up, w_down, scales = _block_fp8_experts(2, 128, 128)
    x = torch.zeros(0, 128, device=DEVICE, dtype=torch.bfloat16)
    ids = torch.zeros(0, 2, dtype=torch.int64, device=DEVICE)
    out = md.fused_experts(x, w_gate_up, w_down, ids, torch.zeros(0, 2, device=DEVICE), fp8_compute="w8a8",
                           tiles=PREFILL, validate=False, **scales)
    assert out.shape == (0, 128)


# -- the engine on a Hopper GPU --------------------------------------------------------------------------------------


@on_hopper
@pytest.mark.parametrize("options,bias,form", [
    ({}, False, {}), ({"activation": "swiglu_oai"}, True, {}),
    ({"interleaved": True, "activation": "swiglu_oai"}, True, {}),
    ({}, False, dict(fused_activation=False)), ({}, False, dict(plain_gemm_cfg=gluon_fp8.DEFAULT_CONFIG)),
    ({}, False, dict(fused_activation=False, plain_gemm_cfg=gluon_fp8.DEFAULT_CONFIG))],
    ids=["silu", "swiglu-bias", "interleaved-swiglu-bias", "silu-pass", "silu-128x128", "silu-pass-128x128"])
def test_gpu_engine_matches_float64_and_is_deterministic(options, bias, form, monkeypatch, h200_tile_table):
    """E = 8, H = 2048, F = 1024, T = 256, top_k = 2 (64 rows per expert: the table's prefill tiles) with the engine
    on: against float64 (dequantized weights; the w8a8 model), against the portable w8a8 kernels, two calls bit for
    bit, and a CUDA graph replay bit for bit the eager call. The engine's default (GEMM1 fused where the layout allows:
    not for interleaved rows; 64 x 256 plain GEMMs) and the explicit alternatives `form` passes it: the separate
    activation pass, 128 x 128 plain GEMMs, both."""
    E, H, F, T, top_k = 8, 2048, 1024, 256, 2
    w_gate_up, w_down, scales = _block_fp8_experts(E, H, F, device="cuda")
    x = torch.randn(T, H, device="cuda").bfloat16()
    ids, weights = distinct_ids(T, E, top_k, device="cuda"), torch.rand(T, top_k, device="cuda")
    options = {**options, **(gpu_biases(E, H, F, device="cuda") if bias else {})}

    def run():
        return md.fused_experts(x, w_gate_up, w_down, ids, weights, fp8_compute="w8a8", **scales, **options)

    portable, out = run_gluon_engine(monkeypatch, run, planner.GLUON_FP8_VARIABLE, "gluon_w8a8_experts", **form)
    assert_close(out, fused_experts_w8a8_ref(x, w_gate_up, w_down, ids, weights, groups=GROUPS,
                                             gemm_out_dtype=torch.bfloat16, **scales, **options),
                 what="engine vs its model", tolerance=MODEL_TOLERANCE)
    assert_close(out, fused_experts_fp8_ref(x, w_gate_up, w_down, ids, weights, **scales, **options),
                 what="engine vs dequantized weights", tolerance=W8A8_TOLERANCE)
    assert_close(out, portable, what="engine vs portable w8a8", tolerance=W8A8_TOLERANCE)
