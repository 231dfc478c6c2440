"""The MXFP4 path's Gluon engine (moe_dispatch.gemm.gluon_mxfp4's GEMM, gemm.gluon_experts.gluon_mxfp4_experts, chosen
by planner.plan_mxfp4_engine): when it runs, the arithmetic around its two GEMMs, and on a Hopper GPU the GEMM and the
whole engine against float64.

The Gluon GEMM needs an SM90 GPU and Triton 3.6, so the CPU tests run the engine's glue (the pass that gathers x's
rows, the activation pass, the down bias / routing-weight pass, combine) in the interpreter with the GEMM swapped for
its float64 reference on the dequantized weight (helpers.swap_gluon_gemm: the real launcher checks every operand
first), through `fused_experts` with MOE_DISPATCH_GLUON_MXFP4=1 and `gluon_mxfp4.available` patched to True. Its
sm_90 compile is tests/test_gluon_compile.py's.
"""

import pytest
import torch
from helpers import DEVICE, Refusal, assert_close, capture_cuda_graph, engine_refusals, offsets_of, swap_gluon_gemm

import moe_dispatch as md
from moe_dispatch.gemm import gluon_experts, gluon_mxfp4, planner
from moe_dispatch.gemm.planner import ExpertsPath, ExpertsPlan
from moe_dispatch.host import replay
from moe_dispatch.host.device import GLUON_MXFP4_VARIABLE
from moe_dispatch.host.tiles import GemmTile, MoeTiles
from moe_dispatch.reference import dequantize_mxfp4_ref, fused_experts_ref, mxfp4_grouped_gemm_ref

on_hopper = pytest.mark.skipif(not gluon_mxfp4.available(), reason=f"{gluon_mxfp4.unavailable_reason()}")
PREFILL = MoeTiles(64, GemmTile(64, 32), GemmTile(32, 32))


def _mxfp4(E, N, K, seed, device=DEVICE):
    """(blocks uint8 [E, N, K / 2], scale codes uint8 [E, N, K / 32]) of a random weight, by the package's quantizer."""
    gen = torch.Generator().manual_seed(seed)
    blocks, scales = md.quantize_experts_mxfp4(torch.randn(E, N, K, generator=gen) * 0.2)
    return blocks.reshape(E, N, K // 2).to(device), scales.to(device)


def _gemm_reference(a, blocks, scales, expert_offsets, *, block_m=None, stages=None, form=None, **epilogue):
    """The GEMM's float64 reference (its tile and form keywords ignored)."""
    return mxfp4_grouped_gemm_ref(a, blocks, scales, expert_offsets, **epilogue)


def _experts(T, E, top_k, H, F, *, bias, skip=2, seed=0):
    """x bf16, MXFP4 (blocks, scales) of gate/up [E, 2F, H] and down [E, H, F], ids (never expert `skip`), routing
    weights, biases."""
    torch.manual_seed(seed)
    x = torch.randn(T, H).to(DEVICE, torch.bfloat16)
    gate_up, down = _mxfp4(E, 2 * F, H, seed + 1), _mxfp4(E, H, F, seed + 2)
    pool = torch.tensor([e for e in range(E) if e != skip])
    ids = torch.stack([pool[torch.randperm(len(pool))[:top_k]] for _ in range(T)]).to(DEVICE)
    weights = torch.rand(T, top_k, device=DEVICE)
    biases = {}
    if bias:
        biases = dict(gate_up_bias=(torch.randn(E, 2 * F, device=DEVICE) * 0.1).bfloat16(),
                      down_bias=(torch.randn(E, H, device=DEVICE) * 0.1).bfloat16())
    return x, gate_up, down, ids, weights, biases


def _run(x, gate_up, down, ids, weights, **options):
    return md.fused_experts(x, gate_up[0], down[0], ids, weights, w_gate_up_scale=gate_up[1], w_down_scale=down[1],
                            validate=False, **options)


def _reference(x, gate_up, down, ids, weights, **options):
    options = {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    return fused_experts_ref(x.double(), dequantize_mxfp4_ref(*gate_up), dequantize_mxfp4_ref(*down), ids,
                             weights.double(), **options)


# (id, T, E, top_k, H, F, fused_experts options, biases, why)
# T * top_k = 260 assignments: past the decode path's 256 wherever a table has decode buckets (a GPU's)
GLUE_CASES = [
    ("gpt-oss", 130, 4, 2, 64, 96, dict(activation="swiglu_oai", interleaved=True), True,
     "GPT-OSS's layout (gate and up rows alternating) with both biases: GEMM1 activates its pairs, GEMM2 adds the down "
     "bias and applies the routing weights; expert 2 gets no row"),
    ("concatenated-silu", 130, 4, 2, 96, 64, {}, False,
     "gate rows then up rows, silu, no bias: the activation pass, then combine applies the routing weights; H = 96 "
     "not a multiple of 64"),
]


@pytest.mark.parametrize("case", GLUE_CASES, ids=[c[0] for c in GLUE_CASES])
def test_engine_glue_matches_float64(case, monkeypatch, poison_empty):
    """The whole experts output through fused_experts (dispatch, the engine's passes, combine) with both GEMMs their
    float64 reference (epilogues included) rounded to bf16, against the float64 experts on the dequantized weights.
    Buffers start as NaN (poison_empty): the passes write every row the GEMMs and combine read."""
    _, T, E, top_k, H, F, options, bias, _ = case
    calls = swap_gluon_gemm(monkeypatch, gluon_mxfp4, "mxfp4_grouped_gemm", GLUON_MXFP4_VARIABLE, _gemm_reference,
                            out_dtype=torch.bfloat16)
    replay.clear()
    x, gate_up, down, ids, weights, biases = _experts(T, E, top_k, H, F, bias=bias)
    out = _run(x, gate_up, down, ids, weights, **options, **biases)
    N = T * top_k
    assert calls == [((N, H), (E, 2 * F, H // 2), torch.bfloat16), ((N, F), (E, H, F // 2), torch.bfloat16)]
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert_close(out, _reference(x, gate_up, down, ids, weights, **options, **biases), torch.bfloat16)


def test_gather_rows_zeroes_rows_past_the_kept_assignments():
    """gemm.w8a8.gather_rows: row p is x[gather_idx[p] // top_k] in sorted order; an assignment to an expert out of
    range is dropped by the dispatch and its row reads as zeros (every row written, none read from past x)."""
    from moe_dispatch.dispatch.segments import dispatch
    from moe_dispatch.gemm.w8a8 import gather_rows

    x = torch.randn(5, 40).to(DEVICE, torch.bfloat16)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [1, 9], [0, 2]], device=DEVICE)  # 9: out of range for E = 3
    info = dispatch(ids, 3, 16)
    rows = gather_rows(x, info)
    kept = int(info.expert_offsets[-1])
    assert kept == 9 and rows.shape == (10, 40)
    assert torch.equal(rows[:kept], x[info.gather_idx[:kept].long() // 2])
    assert torch.equal(rows[kept:], torch.zeros_like(rows[kept:]))


def _refusal_args(**changes):
    x = torch.zeros(512, 64, dtype=torch.bfloat16)
    w_gate_up, w_down = torch.zeros(4, 192, 32, dtype=torch.uint8), torch.zeros(4, 64, 48, dtype=torch.uint8)
    args = dict(plan=ExpertsPlan(ExpertsPath.GROUPED, PREFILL), x=x, w_gate_up=w_gate_up, w_down=w_down,
                w_gate_up_scale=torch.zeros(4, 192, 2, dtype=torch.uint8),
                w_down_scale=torch.zeros(4, 64, 3, dtype=torch.uint8), separate_up=False, transposed=False,
                save_preact=False, forced_tiles=False, top_k=2, available=lambda device: True)
    args.update(changes)
    return args


REFUSALS = [
    *engine_refusals(gluon_mxfp4, PREFILL),
    Refusal("gradients", "a training call saves pre-activations", lambda: dict(save_preact=True), "gradients"),
    Refusal("forced-tiles", "the caller's tiles are the portable kernels'", lambda: dict(forced_tiles=True),
            "forced tiles"),
    Refusal("fp32", "fp32 activations", lambda: dict(x=torch.zeros(512, 64)), "activations are torch.float32"),
    Refusal("separate-up", "gate and up as two tensors", lambda: dict(separate_up=True), "separate"),
    Refusal("strided", "a weight that is not contiguous",
            lambda: dict(w_down=torch.zeros(4, 48, 64, dtype=torch.uint8).transpose(1, 2)), "w_down is not contiguous"),
    Refusal("few-rows", "T * top_k / E under GLUON_MXFP4_MIN_ROWS (4 here)",
            lambda: dict(x=torch.zeros(7, 64, dtype=torch.bfloat16)), "rows per expert"),
]


@pytest.mark.parametrize("refusal", REFUSALS, ids=[r.id for r in REFUSALS])
def test_planner_refuses(refusal, monkeypatch):
    monkeypatch.delenv(GLUON_MXFP4_VARIABLE, raising=False)
    monkeypatch.setattr(planner, "GLUON_MXFP4_MIN_ROWS", 4)
    refusal.assert_refused(lambda **changes: planner.gluon_mxfp4_refusal(**_refusal_args(**changes)))


def test_auto_follows_the_measured_threshold(monkeypatch):
    """In mode auto the engine runs from GLUON_MXFP4_MIN_ROWS rows per expert, and nowhere while that is None."""
    monkeypatch.delenv(GLUON_MXFP4_VARIABLE, raising=False)
    monkeypatch.setattr(planner, "GLUON_MXFP4_MIN_ROWS", None)
    assert "is None" in planner.gluon_mxfp4_refusal(**_refusal_args())
    monkeypatch.setattr(planner, "GLUON_MXFP4_MIN_ROWS", 256)
    assert planner.gluon_mxfp4_refusal(**_refusal_args()) is None  # 512 * 2 / 4 = 256 rows per expert
    assert "rows per expert" in planner.gluon_mxfp4_refusal(**_refusal_args(x=torch.zeros(511, 64,
                                                                                           dtype=torch.bfloat16)))


def test_tile_rows_follow_the_rows_per_expert(monkeypatch):
    """The engine's tiles by rows per expert (T * top_k / E): 64-row split tiles under ROWS128_FROM, 128-row ones from
    it, the swapped form's 256-token tiles from SWAP_FROM."""
    split, swap = gluon_mxfp4.FORM_SPLIT, gluon_mxfp4.FORM_SWAP
    # GPT-OSS-20B (32 experts, top-4) at the shipped thresholds: 64 rows per expert from T = 512, 256 from T = 2048
    assert [gluon_mxfp4.gemm_tile(T, 4, 32) for T in (1, 511, 512, 2047, 2048, 10**6)] == [
        (split, 64), (split, 64), (split, 128), (split, 128), (swap, 256), (swap, 256)]
    monkeypatch.setattr(gluon_mxfp4, "ROWS128_FROM", 128)
    monkeypatch.setattr(gluon_mxfp4, "SWAP_FROM", 512)
    assert [gluon_mxfp4.gemm_tile(T, 4, 32) for T in (1, 1023, 1024, 4095, 4096, 10**6)] == [
        (split, 64), (split, 64), (split, 128), (split, 128), (swap, 256), (swap, 256)]


def test_planner_accepts_and_follows_the_variable(monkeypatch):
    """Accepted in mode auto at 256 rows per expert (the threshold at 4); "1" takes it at 3.5 rows, "0" refuses it
    anywhere; any other value raises naming the variable."""
    monkeypatch.delenv(GLUON_MXFP4_VARIABLE, raising=False)
    monkeypatch.setattr(planner, "GLUON_MXFP4_MIN_ROWS", 4)
    assert planner.gluon_mxfp4_refusal(**_refusal_args()) is None
    args = _refusal_args()
    plan = planner.plan_mxfp4_engine(**args)
    assert plan.path is ExpertsPath.MXFP4_GLUON and plan.tiles == PREFILL
    few = _refusal_args(x=torch.zeros(7, 64, dtype=torch.bfloat16))
    assert planner.gluon_mxfp4_refusal(**few) is not None
    monkeypatch.setenv(GLUON_MXFP4_VARIABLE, "1")
    assert planner.gluon_mxfp4_refusal(**few) is None
    monkeypatch.setenv(GLUON_MXFP4_VARIABLE, "0")
    assert "is 0" in planner.gluon_mxfp4_refusal(**_refusal_args())
    monkeypatch.setenv(GLUON_MXFP4_VARIABLE, "yes")
    with pytest.raises(ValueError, match=GLUON_MXFP4_VARIABLE):
        planner.gluon_mxfp4_refusal(**_refusal_args())


# (expert row counts, N, K, why): small odd sizes of the GEMM
GEMM_CASES = [
    ((5, 0, 17, 1), 96, 96, "an empty expert, ragged rows, a one-row expert; N 96 a masked column tile (of 256), K 96 "
                            "a masked K step (96 = 64 + 32)"),
    ((3, 70, 0), 320, 128, "K a multiple of 64; 70 rows span two 64-row tiles; N 320 a second, partial output tile "
                           "whose second half reads past the expert's rows; the last expert empty"),
    ((700, 0, 1100, 5), 2048, 160, "more output tiles than the GPU has SMs at every tile height (a program runs "
                                   "several: the stage ring's and decode buffers' phases carry from tile to tile); "
                                   "K 160 two and a half K steps (the next step's scale codes past K read as 0)"),
]
EPILOGUES = ["plain", "pairs-swiglu-bias", "pairs-silu", "routed-bias", "routed"]


def _epilogue_args(epilogue, E, N, M, device=DEVICE):
    gen = torch.Generator().manual_seed(5)
    bias = (torch.randn(E, N, generator=gen) * 0.1).to(device, torch.bfloat16)
    if epilogue.startswith("pairs"):
        args = dict(activation="swiglu_oai" if "swiglu" in epilogue else "silu")
    elif epilogue.startswith("routed"):
        T, top_k = M, 3  # every row a distinct assignment of a [T, 3] routing, in a shuffled order
        gather_idx = torch.randperm(T * top_k, generator=gen)[:M].to(torch.int32).to(device)
        args = dict(routing=(gather_idx, torch.rand(T, top_k, generator=gen).to(device)))
    else:
        return {}
    return dict(args, bias=bias) if epilogue.endswith("bias") else args


def _gemm_args(M=40, E=3, N=64, K=64, device="cpu"):
    """A valid call of mxfp4_grouped_gemm's arguments (zeros; offsets [0, 10, 30, 40]), keyword by keyword."""
    return dict(a=torch.zeros(M, K, dtype=torch.bfloat16, device=device),
                blocks=torch.zeros(E, N, K // 2, dtype=torch.uint8, device=device),
                scales=torch.zeros(E, N, K // 32, dtype=torch.uint8, device=device),
                expert_offsets=torch.tensor([0, 10, 30, M], dtype=torch.int32, device=device))


# (what is wrong, the change to a valid call, the exception, words its message must hold)
BAD_GEMM_CALLS = [
    ("an unknown form", dict(form="tall"), ValueError, "form must be"),
    ("a split tile height", dict(block_m=256), ValueError, "block_m must be one of (64, 128)"),
    ("a swapped tile the launcher does not offer", dict(form="swap", block_m=128), ValueError, "block_m must be one of"),
    ("float activations", dict(a=torch.zeros(40, 64)), TypeError, "a must be bfloat16"),
    ("K of a against the blocks", dict(a=torch.zeros(40, 96, dtype=torch.bfloat16)), ValueError, "but blocks is"),
    ("scales of another shape", dict(scales=torch.zeros(3, 64, 3, dtype=torch.uint8)), ValueError,
     "scales must be uint8 [E, N, K / 32]"),
    ("offsets of another length", dict(expert_offsets=torch.tensor([0, 40], dtype=torch.int32)), ValueError,
     "expert_offsets must be int32 [E + 1]"),
    ("both epilogues", dict(activation="silu", routing=(torch.zeros(40, dtype=torch.int32), torch.zeros(10, 4))),
     ValueError, "do not come together"),
    ("a bias with no epilogue", dict(bias=torch.zeros(3, 64)), ValueError, "bias comes with an activation"),
    ("a bias of another shape", dict(bias=torch.zeros(3, 32), activation="silu"), ValueError, "bias must be a float"),
    ("int64 gather indices", dict(routing=(torch.zeros(40, dtype=torch.int64), torch.zeros(10, 4))), ValueError,
     "gather_idx must be int32 [M]"),
]


@pytest.mark.parametrize("case", BAD_GEMM_CALLS, ids=[c[0] for c in BAD_GEMM_CALLS])
def test_gemm_refuses_bad_arguments(case):
    """Each malformed call raises naming the argument, before any device is asked (on any host: the checks come first;
    a valid call on the CPU says only that the GEMM is unavailable there)."""
    _, change, error, words = case
    args = dict(_gemm_args(), **change)
    with pytest.raises(error) as caught:
        gluon_mxfp4.mxfp4_grouped_gemm(args.pop("a"), args.pop("blocks"), args.pop("scales"),
                                       args.pop("expert_offsets"), **args)
    assert words in str(caught.value)


def test_gemm_on_the_cpu_says_it_is_unavailable():
    args = _gemm_args()
    with pytest.raises(RuntimeError, match="Gluon MXFP4 GEMM unavailable"):
        gluon_mxfp4.mxfp4_grouped_gemm(args["a"], args["blocks"], args["scales"], args["expert_offsets"])


# (form, block_m): the split form at both of its tile heights, the swapped form at its 256 tokens
GEMM_TILES = [("split", 64), ("split", 128), ("swap", 256)]


@on_hopper
@pytest.mark.parametrize("form, block_m", GEMM_TILES, ids=[f"{f}-{m}" for f, m in GEMM_TILES])
@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("case", GEMM_CASES, ids=["ragged", "two-tiles", "many-tiles"])
def test_gemm_matches_float64(case, epilogue, form, block_m):
    """Each epilogue (plain; gate/up pairs activated, with and without the bias; the down bias and routing weights)
    in each form and tile height, against mxfp4_grouped_gemm_ref."""
    counts, N, K, why = case
    E, M = len(counts), sum(counts)
    a = torch.randn(M, K, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)
    blocks, scales = _mxfp4(E, N, K, 1)
    offsets = offsets_of(counts, device=DEVICE)
    args = _epilogue_args(epilogue, E, N, M)
    out = gluon_mxfp4.mxfp4_grouped_gemm(a, blocks, scales, offsets, block_m=block_m, form=form, **args)
    assert_close(out, _gemm_reference(a, blocks, scales, offsets, **args), torch.bfloat16, what=why)


@on_hopper
@pytest.mark.parametrize("form, block_m", [("split", 64), ("swap", 256)])
def test_gemm_keeps_nans_in_place(form, block_m):
    """A NaN in row 7 of A reaches row 7 only; scale code 0xFF of expert 2, column 9 makes column 9 NaN in expert 2's
    rows (5..21) only."""
    counts, N, K = (5, 0, 17, 1), 96, 96
    a = torch.randn(sum(counts), K, device=DEVICE).bfloat16()
    a[7, 5] = float("nan")
    blocks, scales = _mxfp4(len(counts), N, K, 2)
    scales[2, 9, 1] = 0xFF
    out = gluon_mxfp4.mxfp4_grouped_gemm(a, blocks, scales, offsets_of(counts, device=DEVICE), block_m=block_m,
                                         form=form)
    expected = torch.zeros_like(out, dtype=torch.bool)
    expected[7] = True
    expected[5:22, 9] = True
    assert torch.equal(out.isnan(), expected)


@on_hopper
@pytest.mark.parametrize("interleaved", [True, False], ids=["gpt-oss", "concatenated"])
def test_engine_matches_float64_and_replays(interleaved, monkeypatch):
    """The whole engine through fused_experts at odd widths (H = 288, F = 160: masked K steps and a partial 256-column
    tile in both GEMMs; an expert with no row), against float64 on the dequantized weights and against the portable
    kernels (MOE_DISPATCH_GLUON_MXFP4=0); two calls agree bit for bit and a CUDA graph replay equals the eager call."""
    T, E, top_k, H, F = 300, 8, 4, 288, 160
    options = dict(activation="swiglu_oai", interleaved=True) if interleaved else {}
    x, gate_up, down, ids, weights, biases = _experts(T, E, top_k, H, F, bias=interleaved)
    run = lambda: _run(x, gate_up, down, ids, weights, **options, **biases)  # noqa: E731
    monkeypatch.setenv(GLUON_MXFP4_VARIABLE, "0")
    replay.clear()
    portable = run()
    monkeypatch.setenv(GLUON_MXFP4_VARIABLE, "1")
    replay.clear()
    calls = []
    real = gluon_experts.gluon_mxfp4_experts
    from moe_dispatch.experts import operator
    monkeypatch.setattr(operator, "gluon_mxfp4_experts", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = run()
    assert calls, "the engine did not run"
    assert torch.equal(run(), out)
    graph, static = capture_cuda_graph(run)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, out)
    ref = _reference(x, gate_up, down, ids, weights, **options, **biases)
    assert_close(out, ref, torch.bfloat16, what="engine")
    assert_close(portable, ref, torch.bfloat16, what="portable")


@on_hopper
@pytest.mark.whole_gpu  # ~34 GiB at once (2^18 tokens of H = 4096, their gathered copies and outputs)
def test_engine_offsets_past_32_bits(monkeypatch):
    """T * k * H > 2^31 through the engine (16k rows per expert: the swapped form's 256-token tiles): the gathered rows,
    gate_up / h and y are addressed with 64-bit offsets, TMA by 32-bit row coordinates (M < 2^31). Rows sampled against
    float64."""
    T, E, k, H, F = 2**18 + 1000, 32, 2, 4096, 64
    assert T * k * H > 2**31
    torch.manual_seed(1)
    gate_up, down = _mxfp4(E, 2 * F, H, 1), _mxfp4(E, H, F, 2)
    x = torch.randn(T, H, device=DEVICE, dtype=torch.bfloat16)
    ids = torch.randint(0, E, (T, k), device=DEVICE)
    ids[:, 1] = (ids[:, 0] + 1 + torch.randint(0, E - 1, (T,), device=DEVICE)) % E  # two distinct experts a token
    weights = torch.rand(T, k, device=DEVICE)
    options = dict(activation="swiglu_oai", interleaved=True)
    monkeypatch.setenv(GLUON_MXFP4_VARIABLE, "1")
    out = _run(x, gate_up, down, ids, weights, **options)
    rows = torch.cat([torch.arange(64), torch.randint(0, T, (192,)), torch.arange(T - 64, T)]).to(DEVICE)
    assert_close(out[rows], _reference(x[rows], gate_up, down, ids[rows], weights[rows], **options), torch.bfloat16)
