"""The Gluon bf16 GEMM (moe_dispatch.gemm.gluon_bf16) and the grouped path's engine on it
(moe_dispatch.gemm.gluon_experts.gluon_bf16_experts, chosen by planner.plan_grouped_engine): when it runs, and the
arithmetic around its two GEMMs.

The Gluon GEMM needs an SM90 GPU and Triton 3.6, so on the CPU only the host side of the GEMM runs (its launchers'
argument checks) and the engine's glue (the gather of x into expert order, the bias + activation pass, the down bias
/ routing-weight pass, combine) runs in the interpreter with the GEMM swapped for its float64 reference
(`grouped_gemm_ref`, rounded to the activations' dtype as the kernel writes), through `fused_experts` with
MOE_DISPATCH_GLUON_BF16=1 and `gluon_bf16.available` patched to True. The glue runs in bf16 and fp16 as the engine
does (the interpreter's dots, which it would get wrong in bf16, are the swapped GEMM's). The swapped GEMM first asks
the real launcher, which checks every operand (dtypes, shapes, 16-byte aligned K-contiguous rows) before it refuses
for want of a GPU: what the engine hands the kernel is what the kernel takes. The GPU tests run the GEMM and the whole
engine where `gluon_bf16.available()` holds; tests/test_gluon_compile.py compiles the kernel for sm_90 ahead of time.

Tolerances: reference.TOLERANCE of the activations' dtype against the float64 experts (the engine rounds GEMM1's
sums, h and y to that dtype, as the portable path rounds h and y).
"""

import dataclasses

import pytest
import torch
from helpers import (DEVICE, TOLERANCE, EngineCase, Refusal, assert_close, assert_forced_on, engine_refusals,
                     distinct_ids, gpu_biases, offsets_of, run_gluon_engine, swap_gluon_gemm)

import moe_dispatch as md
from moe_dispatch import moe
from moe_dispatch.gemm import gluon_bf16, gluon_experts, planner
from moe_dispatch.gemm.planner import ExpertsPath, ExpertsPlan
from moe_dispatch.host.tiles import GemmTile, MoeTiles
from moe_dispatch.reference import fused_experts_ref, gated_grouped_gemm_ref, grouped_gemm_ref, relative_error

PREFILL = MoeTiles(64, GemmTile(64, 32), GemmTile(32, 32))  # prefill-sized tiles: the engine's floor (BLOCK_M 64)
on_hopper = pytest.mark.skipif(not gluon_bf16.available(), reason=f"{gluon_bf16.unavailable_reason()}")


def _experts(E, H, F, dtype=torch.bfloat16, device=DEVICE):
    """(w_gate_up [E, 2F, H], w_down [E, H, F]) of `dtype`, weights of std 0.1."""
    return ((torch.randn(E, 2 * F, H, device=device) * 0.1).to(dtype),
            (torch.randn(E, H, F, device=device) * 0.1).to(dtype))


# -- the GEMM's launchers --------------------------------------------------------------------------------------------


def test_launchers_refuse_bad_arguments():
    """Every operand is checked before anything runs; on this machine a valid call then refuses for want of Gluon or
    an SM90 GPU (saying so)."""
    a, b = torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(2, 32, 64, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(TypeError, match="a must be bfloat16 or float16"):
        gluon_bf16.bf16_gemm(a.float(), b[0])
    with pytest.raises(TypeError, match="one dtype"):
        gluon_bf16.bf16_gemm(a, b[0].half())
    with pytest.raises(ValueError, match="16-byte aligned"):  # K = 36: rows of 72 bytes
        gluon_bf16.bf16_gemm(torch.zeros(8, 36, dtype=torch.bfloat16), torch.zeros(32, 36, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"b is \[N, K\]"):
        gluon_bf16.bf16_gemm(a, torch.zeros(32, 72, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="expert_offsets must be int32"):
        gluon_bf16.bf16_grouped_gemm(a, b, offsets.long())
    with pytest.raises(ValueError, match="contiguous"):
        gluon_bf16.bf16_grouped_gemm(a, torch.zeros(2, 64, 64, dtype=torch.bfloat16)[:, ::2], offsets)
    for change in (dict(BLOCK_K=128), dict(BLOCK_N=512), dict(BLOCK_M=64), dict(NUM_STAGES=1)):
        name = next(iter(change))
        with pytest.raises(ValueError, match=name):
            gluon_bf16.bf16_gemm(a, b[0], cfg=gluon_bf16.GluonBf16Config(**change))
    gated = gluon_bf16.bf16_gated_grouped_gemm
    with pytest.raises(ValueError, match="gate rows then up rows"):
        gated(a, torch.zeros(2, 33, 64, dtype=torch.bfloat16), offsets)
    for activation in ("none", "gelu"):
        with pytest.raises(ValueError, match=f"activation must be one of .* got '{activation}'"):
            gated(a, b, offsets, activation=activation)
    with pytest.raises(ValueError, match=r"bias must be torch.bfloat16 \[E, 2F\]"):
        gated(a, b, offsets, bias=torch.zeros(2, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bias must be"):
        gated(a, b, offsets, bias=torch.zeros(2, 32))
    with pytest.raises(ValueError, match="K > 0"):
        gated(a[:, :0], b[:, :, :0], offsets)
    reason = gluon_bf16.unavailable_reason(a.device)
    assert gluon_bf16.available(a.device) == (reason is None)
    if reason is not None:
        for launch in (gluon_bf16.bf16_grouped_gemm, gated):
            with pytest.raises(RuntimeError, match="unavailable"):
                launch(a, b, offsets)


# -- selection -------------------------------------------------------------------------------------------------------


def _planner_args(**changes):
    """gluon_bf16_refusal's arguments for a call the engine takes (CPU tensors, `available` answering True), with
    `changes` applied: H = 64, F = 32, E = 2, bf16, prefill tiles on the grouped path, inference."""
    w_gate_up, w_down = _experts(2, 64, 32, device="cpu")
    args = dict(plan=ExpertsPlan(ExpertsPath.GROUPED, PREFILL), x=torch.zeros(4, 64, dtype=torch.bfloat16),
                w_gate_up=w_gate_up, w_down=w_down, separate_up=False, transposed=False, save_preact=False,
                available=lambda device: True)
    args.update(changes)
    return args


def _refusal(**changes):
    args = _planner_args(**changes)
    tensors = [args.pop(k) for k in ("plan", "x", "w_gate_up", "w_down")]
    return planner.gluon_bf16_refusal(*tensors, **args)


REFUSALS = [
    *engine_refusals(gluon_bf16, PREFILL),
    Refusal("w8a8-path", "float8 weights on the w8a8 path (their own engine)", lambda: dict(
        plan=ExpertsPlan(ExpertsPath.W8A8, PREFILL)), "w8a8 path"),
    Refusal("decode-tiles", "16-row tiles: decode sizes on the grouped path",
            lambda: dict(plan=ExpertsPlan(ExpertsPath.GROUPED, MoeTiles(16, GemmTile(64, 32), GemmTile(32, 32)))),
            "decode-sized tiles"),
    Refusal("autograd", "a gradient will be needed: the pre-activations are saved",
            lambda: dict(save_preact=True), "inference only"),
    Refusal("fp32", "float32 activations and weights: no wgmma of that type",
            lambda: dict(x=torch.zeros(4, 64), w_gate_up=torch.zeros(2, 64, 64), w_down=torch.zeros(2, 64, 32)),
            "float32"),
    Refusal("fp8-weights", "float8 weights on the dequant path (the grouped path, dequantized in the loads)",
            lambda: dict(w_gate_up=torch.zeros(2, 64, 64, dtype=torch.float8_e4m3fn)), "float8_e4m3fn"),
    Refusal("mxfp4-weights", "MXFP4 blocks (uint8) on the grouped path",
            lambda: dict(w_down=torch.zeros(2, 64, 16, dtype=torch.uint8)), "uint8"),
    Refusal("mixed-dtypes", "fp16 activations with bf16 weights",
            lambda: dict(x=torch.zeros(4, 64, dtype=torch.float16)), "not the activations'"),
    Refusal("transposed", "GPT-OSS's [E, H, 2F] layout", lambda: dict(transposed=True), "transposed"),
    Refusal("separate-up", "w_up passed apart from w_gate", lambda: dict(separate_up=True), "separate"),
    Refusal("unaligned-rows", "H = 36: weight rows of 72 bytes, which TMA cannot address",
            lambda: dict(w_gate_up=torch.zeros(2, 64, 36, dtype=torch.bfloat16)), "16 bytes"),
    Refusal("non-contiguous", "a strided view of the weights",
            lambda: dict(w_down=torch.zeros(2, 64, 64, dtype=torch.bfloat16)[:, :, ::2]), "contiguous"),
]


def test_planner_engine_modes(monkeypatch):
    """Unset, empty or "0": never (opt-in: not yet measured on a GPU); "1": wherever it can run; any other value
    ("auto", which the FP8 engine's variable takes, included): ValueError naming the variable."""
    args = _planner_args()
    plan = args.pop("plan")
    tensors = [args.pop(k) for k in ("x", "w_gate_up", "w_down")]
    for off in (None, "", "0"):
        if off is None:
            monkeypatch.delenv(planner.GLUON_BF16_VARIABLE, raising=False)
        else:
            monkeypatch.setenv(planner.GLUON_BF16_VARIABLE, off)
        assert planner.GLUON_BF16_VARIABLE in _refusal()
        assert planner.plan_grouped_engine(plan, *tensors, **args) is plan
    assert_forced_on(monkeypatch, planner.GLUON_BF16_VARIABLE, _refusal,
                     lambda: planner.plan_grouped_engine(plan, *tensors, **args),
                     ExpertsPlan(ExpertsPath.GROUPED_GLUON, PREFILL), ("auto", "true"))


@pytest.mark.parametrize("case", REFUSALS, ids=[c.id for c in REFUSALS])
def test_planner_falls_back(case, monkeypatch):
    monkeypatch.setenv(planner.GLUON_BF16_VARIABLE, "1")
    case.assert_refused(_refusal)


def test_fused_experts_keeps_the_portable_path_unless_the_engine_is_chosen(monkeypatch):
    """Through fused_experts: the engine does not run by default (here with `available` patched to True), nor with
    the variable "1" where Gluon cannot run (the CPU), nor when autograd needs the pre-activations; the portable
    kernels answer instead."""
    calls = []
    monkeypatch.setattr(moe, "gluon_bf16_experts", lambda *a, **k: calls.append(1))
    w_gate_up, w_down = _experts(2, 64, 32)
    x = torch.randn(3, 64, device=DEVICE).bfloat16()
    ids, weights = distinct_ids(3, 2, 1, device=DEVICE), torch.rand(3, 1, device=DEVICE)

    def run(x=x):
        md.host.replay.clear()  # the variable is read when a plan is recorded
        return md.fused_experts(x, w_gate_up, w_down, ids, weights, tiles=PREFILL)

    real_available = gluon_bf16.available
    monkeypatch.delenv(planner.GLUON_BF16_VARIABLE, raising=False)
    monkeypatch.setattr(gluon_bf16, "available", lambda device=None: True)
    out = run()
    assert calls == [] and out.shape == x.shape
    monkeypatch.setenv(planner.GLUON_BF16_VARIABLE, "1")
    run(x.clone().requires_grad_())
    assert calls == [], "the engine ran under autograd"
    if not real_available(x.device):
        monkeypatch.setattr(gluon_bf16, "available", real_available)
        assert torch.equal(run(), out) and calls == []


# -- the glue on the CPU, the GEMM swapped for its float64 reference -----------------------------------------------


@pytest.fixture
def reference_engine(monkeypatch):
    """The engine selected on this machine, its GEMMs (the plain and the gated one) the float64 references in the
    operands' dtype (helpers.swap_gluon_gemm). Yields the list of GEMM calls, in order, each led by "plain" or
    "gated"."""
    calls = swap_gluon_gemm(monkeypatch, gluon_bf16, "bf16_grouped_gemm", planner.GLUON_BF16_VARIABLE,
                            lambda a, b, offsets: grouped_gemm_ref(a, b, offsets, b.shape[0]), label="plain")
    yield swap_gluon_gemm(monkeypatch, gluon_bf16, "bf16_gated_grouped_gemm", planner.GLUON_BF16_VARIABLE,
                          lambda a, b, offsets, **gate: gated_grouped_gemm_ref(a, b, offsets, b.shape[0], **gate),
                          calls=calls, label="gated")


@dataclasses.dataclass(frozen=True)
class GlueCase(EngineCase):
    dtype: torch.dtype = torch.bfloat16
    gate_up_bias: bool = False
    down_bias: bool = False
    dropped: bool = False  # ids outside [0, E) (expert-parallel sentinels, -1): no row, no contribution


GLUE_CASES = [
    GlueCase("odd-sizes", "H = 136 and F = 88, multiples of 8 (TMA's 16-byte rows) but not of 64 or 128: partial K "
             "blocks and column tiles in both GEMMs and both passes; expert 2 gets no row; no bias, so the routing "
             "weights are applied in combine"),
    GlueCase("interleaved-swiglu-bias", "GPT-OSS's activation with both biases on the interleaved layout (not "
             "transposed: the engine's): gate and up columns alternate in GEMM1's output; the down bias pass applies "
             "the routing weights", H=128, F=72, options=(("interleaved", True), ("activation", "swiglu_oai"),
                                                         ("swiglu_alpha", 1.5), ("swiglu_limit", 3.0)),
             gate_up_bias=True, down_bias=True),
    GlueCase("dropped-ids", "ids E + 2 and -1 (validate=False): their assignments sort past the experts' last offset, "
             "where GEMM1's rows and h are never written (NaN here) and combine reads nothing; a down bias",
             down_bias=True, dropped=True),
    GlueCase("fp16-every-expert", "fp16 activations and weights, silu with a gate/up bias only; top_k = E, every "
             "expert hit", T=7, E=3, top_k=3, H=64, F=40, dtype=torch.float16, gate_up_bias=True, skip_expert=None),
]


def _glue_inputs(case):
    w_gate_up, w_down = _experts(case.E, case.H, case.F, case.dtype)
    x = torch.randn(case.T, case.H, device=DEVICE).to(case.dtype)
    ids = distinct_ids(case.T, case.E, case.top_k, skip=() if case.skip_expert is None else (case.skip_expert,), device=DEVICE)
    if case.dropped:
        ids[::3, 0] = case.E + 2
        ids[1, 1] = -1
    weights = torch.rand(case.T, case.top_k, device=DEVICE)
    options = dict(case.options)
    if case.gate_up_bias:
        options["gate_up_bias"] = torch.randn(case.E, 2 * case.F, device=DEVICE).to(case.dtype)
    if case.down_bias:
        options["down_bias"] = torch.randn(case.E, case.H, device=DEVICE).to(case.dtype)
    return x, w_gate_up, w_down, ids, weights, options


@pytest.mark.parametrize("fused", [False, True], ids=["pass", "fused"])
@pytest.mark.parametrize("case", GLUE_CASES, ids=[c.id for c in GLUE_CASES])
def test_engine_glue_matches_float64(case, fused, reference_engine, poison_empty, monkeypatch):
    """The whole experts output through fused_experts (dispatch, the engine, combine) against the float64 experts.
    Buffers start as NaN (poison_empty): the passes write every row the GEMMs and combine read."""
    monkeypatch.setattr(gluon_experts, "FUSED_ACTIVATION", fused)
    x, w_gate_up, w_down, ids, weights, options = _glue_inputs(case)
    out = md.fused_experts(x, w_gate_up, w_down, ids, weights, tiles=PREFILL, validate=False, **options)
    N = case.T * case.top_k
    # fused: GEMM1 activates in its epilogue unless the gate and up rows alternate (then a separate pass activates)
    gemm1 = "gated" if fused and not options.get("interleaved") else "plain"
    assert reference_engine == [(gemm1, (N, case.H), (case.E, 2 * case.F, case.H), case.dtype),
                                ("plain", (N, case.F), (case.E, case.H, case.F), case.dtype)]
    assert out.dtype == case.dtype and out.shape == x.shape
    assert_close(out, fused_experts_ref(x, w_gate_up, w_down, ids, weights, **options), what="engine vs float64")


def test_engine_nan_token_reaches_its_row_only(reference_engine):
    """A NaN in one token's hidden state makes its output row NaN (through the gathered row, both GEMMs and the
    activation); every other row is bit for bit that of the call without it."""
    case = GLUE_CASES[0]
    x, w_gate_up, w_down, ids, weights, _ = _glue_inputs(case)
    clean = md.fused_experts(x, w_gate_up, w_down, ids, weights, tiles=PREFILL)
    bad = x.clone()
    bad[4, 131] = float("nan")  # in the partial last K block of H = 136
    out = md.fused_experts(bad, w_gate_up, w_down, ids, weights, tiles=PREFILL)
    assert torch.isnan(out[4]).all(), out[4, :8].tolist()
    others = [t for t in range(case.T) if t != 4]
    assert torch.isfinite(clean).all() and torch.equal(out[others], clean[others])


def test_engine_no_tokens(reference_engine):
    """T = 0: nothing to gather, multiply or combine; an empty [0, H] result."""
    w_gate_up, w_down = _experts(2, 64, 32)
    x = torch.zeros(0, 64, device=DEVICE, dtype=torch.bfloat16)
    ids = torch.zeros(0, 2, dtype=torch.int64, device=DEVICE)
    out = md.fused_experts(x, w_gate_up, w_down, ids, torch.zeros(0, 2, device=DEVICE), tiles=PREFILL,
                           validate=False)
    assert out.shape == (0, 64)


# -- on a Hopper GPU -------------------------------------------------------------------------------------------------


@on_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("M, N, K", [(1, 256, 512), (77, 320, 1000), (4097, 512, 2048)])
def test_gpu_dense_matches_float64(M, N, K, dtype):
    a = torch.randn(M, K, device="cuda").to(dtype)
    b = torch.randn(N, K, device="cuda").to(dtype)
    out = gluon_bf16.bf16_gemm(a, b)
    assert out.dtype == dtype and out.shape == (M, N)
    assert relative_error(out, a.double() @ b.double().T) < TOLERANCE[dtype]


@on_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("counts", [[77, 0, 1, 4019], [1], [129, 128, 0, 0, 300]])
def test_gpu_grouped_matches_float64(counts, dtype):
    N, K = 384, 1000
    offsets = offsets_of(counts, device="cuda")
    a = torch.randn(sum(counts), K, device="cuda").to(dtype)
    b = torch.randn(len(counts), N, K, device="cuda").to(dtype)
    out = gluon_bf16.bf16_grouped_gemm(a, b, offsets)
    assert relative_error(out, grouped_gemm_ref(a, b, offsets, len(counts))) < TOLERANCE[dtype]


@on_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("activation, bias", [("silu", False), ("swiglu_oai", True)], ids=["silu", "swiglu-bias"])
@pytest.mark.parametrize("counts, F", [([77, 0, 1, 4019], 200), ([129, 128, 0, 300], 768), ([1], 128)],
                         ids=["partial-tile", "qwen3-width", "one-row"])
def test_gpu_gated_matches_float64(counts, F, activation, bias, dtype):
    """GEMM1 with its activation against float64: F = 200 ends in a partial column tile whose gate rows past F read up
    rows and whose up rows past 2F read the next expert's (columns never stored); an empty expert; rows past the
    last offset are left as torch.empty leaves them (not compared)."""
    K, E = 1000, len(counts)
    offsets = offsets_of(counts, device="cuda")
    a = torch.randn(sum(counts) + 5, K, device="cuda").to(dtype)
    b = (torch.randn(E, 2 * F, K, device="cuda") / K**0.5).to(dtype)
    options = dict(activation=activation, bias=torch.randn(E, 2 * F, device="cuda").to(dtype) if bias else None)
    out = gluon_bf16.bf16_gated_grouped_gemm(a, b, offsets, **options)
    rows = sum(counts)
    assert out.shape == (rows + 5, F) and out.dtype == dtype
    expected = gated_grouped_gemm_ref(a[:rows], b, offsets, E, **options)
    assert relative_error(out[:rows], expected) < TOLERANCE[dtype]


@on_hopper
def test_gpu_nan_in_a_reaches_its_row_only():
    a = torch.randn(200, 512, device="cuda").bfloat16()
    b = torch.randn(2, 256, 512, device="cuda").bfloat16()
    a[3, 5] = float("nan")
    others = torch.arange(200, device="cuda") != 3
    for out in (gluon_bf16.bf16_gemm(a, b[0]), gluon_bf16.bf16_grouped_gemm(a, b, offsets_of([100, 100], device="cuda")),
                gluon_bf16.bf16_gated_grouped_gemm(a, b, offsets_of([100, 100], device="cuda"))):
        assert out[3].isnan().all()
        assert torch.isfinite(out[others]).all()


@on_hopper
@pytest.mark.parametrize("options,bias,fused", [({}, False, False), ({}, False, True),
                                                ({"activation": "swiglu_oai"}, True, True),
                                                ({"interleaved": True, "activation": "swiglu_oai"}, True, False)],
                         ids=["silu", "silu-fused", "swiglu-bias-fused", "interleaved-swiglu-bias"])
def test_gpu_engine_matches_float64_and_is_deterministic(options, bias, fused, monkeypatch):
    """E = 8, H = 2048, F = 1024, T = 512, top_k = 2 (128 rows per expert: the table's prefill tiles) with the engine
    on: against float64 and against the portable kernels, two calls bit for bit, and a CUDA graph replay bit for bit
    the eager call."""
    E, H, F, T, top_k = 8, 2048, 1024, 512, 2
    w_gate_up, w_down = _experts(E, H, F, device="cuda")
    x = torch.randn(T, H, device="cuda").bfloat16()
    ids, weights = distinct_ids(T, E, top_k, device="cuda"), torch.rand(T, top_k, device="cuda")
    options = {**options, **(gpu_biases(E, H, F, device="cuda") if bias else {})}

    def run():
        return md.fused_experts(x, w_gate_up, w_down, ids, weights, **options)

    portable, out = run_gluon_engine(monkeypatch, run, planner.GLUON_BF16_VARIABLE, "gluon_bf16_experts",
                                     FUSED_ACTIVATION=fused)
    assert_close(out, fused_experts_ref(x, w_gate_up, w_down, ids, weights, **options), what="engine vs float64")
    assert_close(out, portable.double(), what="engine vs portable")
