"""The two-launch decode path of `fused_experts` (gemm/decode.py) against the float64 reference and the four-launch
path.

Every case runs the decode path twice (bit-identical), the general path once with the same inputs, and the reference.
The expert weights are views into storage with NaN-filled guard experts on both sides (an id outside [0, E) that
reached memory would read NaN), the experts nobody picked are NaN-filled too, and torch.empty returns NaN
(`poison_empty`): a read of anything the path must not read, or an output element it forgets, shows up as NaN.
Tokens whose ids are all outside [0, E) must get exact zeros.
"""

import dataclasses

import pytest
import torch
from helpers import DEVICE, assert_close, capture_cuda_graph, needs_gpu

import moe_dispatch as md
from moe_dispatch.experts import operator
from moe_dispatch.experts.autograd import run_experts
from moe_dispatch.experts.call import ExpertsCall
from moe_dispatch.host import tiles
from moe_dispatch.formats.fp8 import quantize_experts_fp8
from moe_dispatch.reference import fused_experts_ref
from moe_dispatch.host.tiles import DecodeTile, DecodeTiles, GemmTile, MoeTiles

# Small tiles: several column tiles and K steps at these sizes (the interpreter ignores warps and stages).
DECODE = DecodeTiles(DecodeTile(16, 16), DecodeTile(16, 16))
# the down GEMM as one dot per expert hit over all its tokens' rows (DecodeTile.dot)
DECODE_DOT = DecodeTiles(DecodeTile(16, 16), DecodeTile(16, 16, dot=True))
# the gate/up GEMM as a GEMV per assignment too (DecodeTile.gemv)
DECODE_GATE_UP_GEMV = DecodeTiles(DecodeTile(16, 16, gemv=True), DecodeTile(16, 16))
DOWN_KERNELS = pytest.mark.parametrize("decode_tiles", [DECODE, DECODE_DOT, DECODE_GATE_UP_GEMV],
                                       ids=["gemv", "dot", "gate-up-gemv"])
GENERAL = MoeTiles(16, GemmTile(16, 16), GemmTile(16, 16))
GUARD = 4  # NaN experts on each side of the real ones; sentinel ids below stay within them (-1, E, E + 3)


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """T tokens with top_k experts each out of E, hidden H, ffn F; the experts' variant; how ids are chosen."""

    id: str
    why: str
    T: int
    top_k: int
    E: int = 6
    H: int = 32
    F: int = 24
    dtype: torch.dtype = torch.float32
    activation: str = "silu"
    interleaved: bool = False
    transposed: bool = False
    separate_up: bool = False  # seed layout: w_gate and w_up as two [E, F, H] tensors (fused_moe_forward's)
    bias: bool = False
    limit: float = 7.0
    # "mixed": a duplicate expert in token 0, token 1 all sentinels, sentinels -1 / E / E + 3 among valid ids, expert
    # E - 1 never picked; "one-expert": every slot of every token on expert 2; "all-sentinels": no valid id at all;
    # "distinct": k different experts per token out of all E (the usual router output)
    routing: str = "mixed"
    ids_dtype: torch.dtype = torch.int64
    ids_column_major: bool = False
    weights_dtype: torch.dtype = torch.float32


TOKENS = (1, 2, 3, 5, 16)
TOP_KS = (1, 2, 4)

# Every T of the decode range against every top_k with the mixed routing (BLOCK_T padding, per-slot stores, the
# sentinel mix): the variant cases below run 13 of the 15 pairs with that routing (the assert after CASES holds it),
# plain SiLU on the transformers layout the other two. (A grid of plain SiLU cases repeated each variant's pair.)
GRID_CASES = [(1, 1), (16, 4)]

CASES = [
    *(DecodeCase(f"silu-T{T}-k{k}", "each T against each top_k: BLOCK_T padding, per-slot stores, sentinel mix", T, k)
      for T, k in GRID_CASES),
    DecodeCase("one-expert-T5-k4", "all tokens and slots on one expert: one owner writes all 20 rows", 5, 4,
               routing="one-expert"),
    DecodeCase("one-expert-T16-k1", "all tokens on one expert, one slot each", 16, 1, routing="one-expert"),
    DecodeCase("all-sentinels", "no valid id: nothing is computed, the output is exactly zero", 3, 2,
               routing="all-sentinels"),
    DecodeCase("distinct-ragged-T16-k4", "k distinct experts per token over all E: most experts have several owners' "
               "slots, N = 64 (the table's largest), with H = 33, F = 17: masked tails at that size", 16, 4, H=33, F=17,
               routing="distinct"),
    DecodeCase("interleaved-T2-k4", "interleaved gate/up: gate and up views with column stride 2", 2, 4,
               interleaved=True),
    DecodeCase("interleaved-bias-T16-k1", "interleaved gate/up with both biases", 16, 1, interleaved=True, bias=True),
    DecodeCase("seed-T3-k2", "separate w_gate and w_up tensors (seed layout)", 3, 2, separate_up=True),
    DecodeCase("seed-bias-T1-k4", "seed layout with biases, one token, a duplicate expert", 1, 4, separate_up=True,
               bias=True),
    DecodeCase("gpt-oss-T5-k4", "GPT-OSS: transposed, interleaved, biases, clamped SwiGLU with both clamps active",
               5, 4, activation="swiglu_oai", interleaved=True, transposed=True, bias=True, limit=0.5),
    DecodeCase("gpt-oss-T1-k2", "GPT-OSS at one token", 1, 2, activation="swiglu_oai", interleaved=True,
               transposed=True, bias=True, limit=0.5),
    DecodeCase("swiglu-transposed-T2-k1", "transposed weights, concatenated gate/up, clamped SwiGLU", 2, 1,
               activation="swiglu_oai", transposed=True, limit=0.5),
    DecodeCase("swiglu-transposed-T16-k2", "transposed weights at T = 16", 16, 2, activation="swiglu_oai",
               transposed=True),
    DecodeCase("bias-T5-k1", "concatenated gate/up with both biases", 5, 1, bias=True),
    DecodeCase("fp16-T3-k4", "fp16 dots and intermediate", 3, 4, dtype=torch.float16),
    DecodeCase("fp16-T16-k2", "fp16 at T = 16", 16, 2, dtype=torch.float16, bias=True),
    DecodeCase("bf16-gpt-oss-T2-k2", "bf16 (interpreter dots upcast) on the GPT-OSS variant", 2, 2,
               dtype=torch.bfloat16, activation="swiglu_oai", interleaved=True, transposed=True, bias=True, limit=0.5),
    DecodeCase("bf16-T5-k4", "bf16 on the transformers layout", 5, 4, dtype=torch.bfloat16),
    DecodeCase("int32-column-major-T5-k2", "int32 ids stored column-major, fp16 routing weights", 5, 2,
               ids_dtype=torch.int32, ids_column_major=True, weights_dtype=torch.float16),
    DecodeCase("int32-T1-k4", "int32 ids, bf16 routing weights", 1, 4, ids_dtype=torch.int32,
               weights_dtype=torch.bfloat16),
    DecodeCase("fp64-weights-T3-k1", "float64 routing weights (applied in fp32)", 3, 1, weights_dtype=torch.float64),
    DecodeCase("ragged-T3-k2", "H = 33, F = 17: masked K and column tails in both kernels", 3, 2, H=33, F=17),
    DecodeCase("even-T2-k2", "H = 64, F = 48: no K tails, several column tiles and K steps in both kernels", 2, 2, H=64,
               F=48),
]
assert {(c.T, c.top_k) for c in CASES if c.routing == "mixed"} >= {(T, k) for T in TOKENS for k in TOP_KS}


def _ids(case, generator):
    T, k, E = case.T, case.top_k, case.E
    if case.routing == "one-expert":
        ids = torch.full((T, k), 2)
    elif case.routing == "all-sentinels":
        ids = torch.tensor([-1, E, E + 3])[torch.arange(T * k) % 3].view(T, k)
    elif case.routing == "distinct":
        ids = torch.stack([torch.randperm(E, generator=generator)[:k] for _ in range(T)])
    else:
        ids = torch.randint(0, E - 1, (T, k), generator=generator)
        if k >= 2 and T >= 1:
            ids[0, 1] = ids[0, 0]
        if T >= 2:
            ids[1] = torch.tensor([-1, E + 3])[torch.arange(k) % 2]
        if T >= 3:
            ids[2, k - 1] = E
        if T >= 4 and k >= 2:
            ids[3, 0] = -1
    ids = ids.to(DEVICE, case.ids_dtype)
    return ids.t().contiguous().t() if case.ids_column_major else ids


def _experts(case, *shape, scale=0.3):
    """[E, *shape] randn * scale as a view into NaN storage with GUARD experts on each side."""
    storage = torch.full((case.E + 2 * GUARD, *shape), float("nan"), device=DEVICE, dtype=case.dtype)
    storage[GUARD:GUARD + case.E] = (torch.randn(case.E, *shape) * scale).to(DEVICE, case.dtype)
    return storage[GUARD:GUARD + case.E]


def make_inputs(case):
    """Keyword arguments of `run`, with the weights of experts nobody picked filled with NaN."""
    generator = torch.Generator().manual_seed(case.T * 100 + case.top_k)
    E, H, F = case.E, case.H, case.F
    ids = _ids(case, generator)
    inputs = dict(x=torch.randn(case.T, H).to(DEVICE, case.dtype), topk_ids=ids,
                  topk_weights=torch.rand(case.T, case.top_k).to(DEVICE, case.weights_dtype))
    if case.separate_up:
        inputs.update(w_gate=_experts(case, F, H), w_up=_experts(case, F, H), w_down=_experts(case, H, F))
    else:
        inputs.update(w_gate_up=_experts(case, *((H, 2 * F) if case.transposed else (2 * F, H))),
                      w_down=_experts(case, *((F, H) if case.transposed else (H, F))))
    if case.bias:
        inputs.update(gate_up_bias=_experts(case, 2 * F), down_bias=_experts(case, H))
    picked = set(ids[(ids >= 0) & (ids < E)].tolist())
    unused = [e for e in range(E) if e not in picked]
    for name in ("w_gate_up", "w_gate", "w_up", "w_down", "gate_up_bias", "down_bias"):
        if name in inputs and unused:
            inputs[name][unused] = float("nan")
    return inputs


def run(case, inputs, tile_choice):
    """`fused_experts` (or, for the seed layout, the experts operator that fused_moe_forward calls) on the inputs."""
    options = dict(activation=case.activation, interleaved=case.interleaved, transposed=case.transposed,
                   gate_up_bias=inputs.get("gate_up_bias"), down_bias=inputs.get("down_bias"), tiles=tile_choice)
    if case.separate_up:
        described = ExpertsCall(case.activation, case.interleaved, case.transposed, limit=case.limit,
                                tiles=tile_choice)
        return run_experts(inputs["x"], inputs["w_gate"], inputs["w_up"], inputs["w_down"], inputs["topk_ids"],
                           inputs["topk_weights"], inputs.get("gate_up_bias"), inputs.get("down_bias"),
                           call_options=described)
    return md.fused_experts(inputs["x"], inputs["w_gate_up"], inputs["w_down"], inputs["topk_ids"],
                            inputs["topk_weights"], swiglu_limit=case.limit, validate=False, **options)


def reference(case, inputs):
    w_gate_up = inputs.get("w_gate_up")
    if case.separate_up:
        w_gate_up = torch.cat([inputs["w_gate"], inputs["w_up"]], dim=1)
    return fused_experts_ref(inputs["x"], w_gate_up, inputs["w_down"], inputs["topk_ids"], inputs["topk_weights"],
                             activation=case.activation, gate_up_bias=inputs.get("gate_up_bias"),
                             down_bias=inputs.get("down_bias"), interleaved=case.interleaved,
                             transposed=case.transposed, swiglu_limit=case.limit)


# the dot down kernel's share of CASES (interpreter time): duplicates and sentinels, shared and distinct experts, every
# layout and activation, tails, half precision, int32 column-major ids
DOT_CASES = {"ragged-T3-k2", "silu-T16-k4", "one-expert-T5-k4", "all-sentinels", "distinct-ragged-T16-k4",
             "interleaved-T2-k4", "seed-bias-T1-k4", "gpt-oss-T5-k4", "swiglu-transposed-T16-k2", "fp16-T16-k2",
             "bf16-T5-k4", "int32-column-major-T5-k2"}


def _kernels_id(tiles):
    return "gate-up-gemv" if tiles.gate_up.gemv else "dot" if tiles.down.dot else "gemv"


@pytest.mark.parametrize("case,decode_tiles", [
    *((c, DECODE) for c in CASES), *((c, DECODE_DOT) for c in CASES if c.id in DOT_CASES),
    *((c, DECODE_GATE_UP_GEMV) for c in CASES if c.id in DOT_CASES)],
    ids=lambda v: v.id if isinstance(v, DecodeCase) else _kernels_id(v))
def test_decode_path(case, decode_tiles, poison_empty):
    inputs = make_inputs(case)
    out = run(case, inputs, decode_tiles)
    ref = reference(case, inputs)
    assert out.dtype == case.dtype and out.shape == (case.T, case.H)
    assert_close(out, ref, case.dtype, exact_zeros=True)
    assert torch.equal(run(case, inputs, decode_tiles), out), "a rerun differs"
    if decode_tiles is not DECODE:
        return  # the general path's comparison once, under the GEMVs
    general = run(case, inputs, GENERAL)
    assert_close(general, ref, case.dtype, "general path", exact_zeros=True)
    assert_close(out, general, case.dtype, "decode vs general path")


SPLIT_CASES = ["silu-T1-k1", "seed-bias-T1-k4", "gpt-oss-T5-k4", "ragged-T3-k2", "even-T2-k2", "one-expert-T16-k1",
               "all-sentinels"]
_BY_ID = {c.id: c for c in CASES}
_F64 = dataclasses.replace(_BY_ID["silu-T1-k1"], id="silu-T1-k1-F64", F=64)
# What each split launches follows from decode_experts' host arithmetic with DECODE's 16-column K steps: split_k is
# clamped to F's steps and each split takes ceil(steps / split_k) of them. F = 24 and 17 have 2 steps, so any
# split_k >= 2 runs 2 one-step splits (8 asks for more splits than steps: the clamp; 2 and 3 launched the very same
# kernels); F = 48 has 3 (2: splits of 2 + 1 steps; 8: clamped to 3 of one step); F = 64 has 4, where split_k = 3 gives
# 2 + 2 + 0 steps: the GEMV's empty third split adds zeros, the dot kernel drops it (2 splits).
SPLITS = [*((_BY_ID[i], 8, DECODE) for i in SPLIT_CASES), *((_BY_ID[i], 3, DECODE_DOT) for i in SPLIT_CASES),
          (_BY_ID["even-T2-k2"], 2, DECODE), (_F64, 3, DECODE), (_F64, 3, DECODE_DOT)]


@pytest.mark.parametrize("case,split_k,decode_tiles", SPLITS,
                         ids=[f"{c.id}-{s}-{'dot' if t.down.dot else 'gemv'}" for c, s, t in SPLITS])
def test_down_kernel_split_k(case, split_k, decode_tiles, poison_empty):
    """The down kernel split along F (split_k programs per assignment or expert and H tile, more than F's K steps
    included: the GEMV's empty splits add zeros, the dot kernel's are dropped; SPLITS says which case runs what), its
    partial rows summed by the last arrival: the reference's values (bias added once), reruns bit-identical, top_k = 1
    reduced too."""
    inputs = make_inputs(case)
    tiles_split = DecodeTiles(decode_tiles.gate_up, dataclasses.replace(decode_tiles.down, split_k=split_k))
    out = run(case, inputs, tiles_split)
    assert_close(out, reference(case, inputs), case.dtype, exact_zeros=True)
    assert torch.equal(run(case, inputs, tiles_split), out), "a rerun differs"


@pytest.mark.parametrize("tile_choice", [DECODE, None], ids=["forced", "table"])
def test_zero_tokens(tile_choice, poison_empty):
    case = DecodeCase("zero", "T = 0", 0, 2)
    inputs = make_inputs(case)
    assert run(case, inputs, tile_choice).shape == (0, case.H)


@DOWN_KERNELS
@pytest.mark.parametrize("routing", ["one-expert", "mixed"])
def test_nan_row_stays_in_its_row(routing, decode_tiles, poison_empty):
    """NaN in x row 2 gives NaN in out row 2 only, even when every token shares the expert (one dot, one owner; the
    dot kernel's down GEMM too)."""
    case = DecodeCase("nan", "NaN row", 5, 2, routing=routing)
    inputs = make_inputs(case)
    inputs["topk_ids"][2, 0] = 2  # token 2 keeps a valid expert in the "mixed" routing too
    inputs["w_gate_up"][2] = torch.randn_like(inputs["w_gate_up"][2]) * 0.3  # in case it was poisoned as unused
    inputs["w_down"][2] = torch.randn_like(inputs["w_down"][2]) * 0.3
    ref = reference(case, inputs)
    inputs["x"][2] = float("nan")
    out = run(case, inputs, decode_tiles)
    assert out[2].isnan().all()
    others = torch.tensor([0, 1, 3, 4], device=DEVICE)
    assert_close(out[others], ref[others], case.dtype, exact_zeros=True)


@DOWN_KERNELS
def test_sentinel_ids_own_nothing(decode_tiles, monkeypatch):
    """No program works for an id outside [0, E): with finite guard experts around the weights (so a stray read would
    not show as NaN), the intermediate rows of sentinel slots stay unwritten and every other row is written."""
    case = DecodeCase("sentinels", "white box", 5, 2)
    inputs = make_inputs(case)
    for name in ("w_gate_up", "w_down"):
        storage = inputs[name]._base
        storage[:GUARD], storage[GUARD + case.E:] = 1.0, 1.0
    allocated = []
    real_empty = torch.empty

    def recording_empty(*args, **kwargs):
        allocated.append(real_empty(*args, **kwargs))
        return allocated[-1].fill_(float("nan")) if allocated[-1].is_floating_point() else allocated[-1]

    monkeypatch.setattr(torch, "empty", recording_empty)
    out = run(case, inputs, decode_tiles)
    intermediate = next(t for t in allocated if t.shape == (case.T * case.top_k, case.F))
    ids = inputs["topk_ids"].reshape(-1)
    sentinel = (ids < 0) | (ids >= case.E)
    assert sentinel.any() and (~sentinel).any()
    assert intermediate[sentinel].isnan().all() and not intermediate[~sentinel].isnan().any()
    assert_close(out, reference(case, inputs), case.dtype, exact_zeros=True)


def _spy(monkeypatch):
    """Counts of the decode launcher's and the general path's dispatch calls inside the experts operator."""
    calls = {"decode": 0, "general": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(operator, "decode_experts", counted("decode", operator.decode_experts))
    monkeypatch.setattr(operator, "dispatch", counted("general", operator.dispatch))
    return calls


def _simple_inputs(T, top_k=2, E=4, H=16, F=8, requires_grad=False):
    x = torch.randn(T, H, device=DEVICE, requires_grad=requires_grad)
    ids = torch.stack([torch.randperm(E)[:top_k] for _ in range(T)]).to(DEVICE)
    w_gate_up = (torch.randn(E, 2 * F, H, device=DEVICE) * 0.3).requires_grad_(requires_grad)
    w_down = (torch.randn(E, H, F, device=DEVICE) * 0.3).requires_grad_(requires_grad)
    return x, w_gate_up, w_down, ids, torch.rand(T, top_k, device=DEVICE)


@pytest.mark.parametrize("T,tile_choice,path", [
    (32, None, "decode"),  # N = 64: the interpreter table's decode bucket (a GPU follows its own table)
    (33, None, "general"),  # N = 66: past it
    (3, GENERAL, "general"),  # a forced MoeTiles is the four-launch path even at decode sizes
    (33, DECODE, "decode"),  # a forced DecodeTiles runs past the table's limit ...
    (tiles.MAX_DECODE_ASSIGNMENTS // 2 + 1, DECODE, "general"),  # ... but not past the kernel's
])
def test_path_selection(T, tile_choice, path, monkeypatch):
    calls = _spy(monkeypatch)
    x, w_gate_up, w_down, ids, weights = _simple_inputs(T)
    if tile_choice is None and x.device.type == "cuda":  # the device's table decides (H200: shapes it was measured on)
        chosen = tiles.select_decode_tiles(x.device, T, ids.shape[1], w_down.shape[0], w_down.shape[2], x.shape[1])
        path = "decode" if chosen is not None else "general"
    out = md.fused_experts(x, w_gate_up, w_down, ids, weights, tiles=tile_choice)
    assert calls == {"decode": int(path == "decode"), "general": int(path == "general")}
    assert_close(out, fused_experts_ref(x, w_gate_up, w_down, ids, weights), torch.float32)


def test_gradient_and_w8a8_take_the_general_path(monkeypatch):
    """A gradient needs the saved pre-activations and dispatch metadata, and fp8_compute="w8a8" quantizes the
    activations in the grouped GEMMs: both run the four launches even when the decode path is forced. float8
    weights computed by dequantizing ("dequant") take the decode path (tests/test_fp8.py checks their values)."""
    calls = _spy(monkeypatch)
    x, w_gate_up, w_down, ids, weights = _simple_inputs(3, requires_grad=True)
    out = md.fused_experts(x, w_gate_up, w_down, ids, weights, tiles=DECODE)
    grads = torch.autograd.grad(out.square().sum(), [x, w_gate_up, w_down])
    x64, w_gate_up64, w_down64 = (t.detach().double().requires_grad_() for t in (x, w_gate_up, w_down))
    ref = fused_experts_ref(x64, w_gate_up64, w_down64, ids, weights)
    for got, expected in zip(grads, torch.autograd.grad(ref.square().sum(), [x64, w_gate_up64, w_down64])):
        assert_close(got, expected, torch.float32, "gradient")
    assert calls == {"decode": 0, "general": 1}
    with torch.no_grad():
        x, w_down = x.detach().bfloat16(), w_down.detach().bfloat16()
        w_fp8, scale = quantize_experts_fp8(w_gate_up.detach(), "channel")
        w_fp8_down, scale_down = quantize_experts_fp8(w_down.float(), "channel")
        md.fused_experts(x, w_fp8, w_fp8_down, ids, weights, w_gate_up_scale=scale, w_down_scale=scale_down,
                         tiles=DECODE, fp8_compute="w8a8")
        assert calls == {"decode": 0, "general": 2}
        md.fused_experts(x, w_fp8, w_down, ids, weights, w_gate_up_scale=scale, tiles=DECODE, fp8_compute="dequant")
    assert calls == {"decode": 1, "general": 2}


def _bucket(max_assignments, block_n, block_k=64):
    tile = {"block_n": block_n, "block_k": block_k, "num_warps": 4, "num_stages": 3}
    return {"max_assignments": max_assignments, "gate_up": tile, "down": tile}


SELECTION_CASES = [
    # (decode entry of the table or None, T, top_k, (E, F, H), dtype, expected gate_up block_n / block_k or None)
    (None, 1, 2, (8, 32, 16), torch.bfloat16, None),  # no entry: no decode path
    ({"buckets": [_bucket(8, 32), _bucket(64, 64)]}, 4, 2, (8, 32, 16), torch.bfloat16, (32, 64)),  # first bucket
    ({"buckets": [_bucket(8, 32), _bucket(64, 64)]}, 5, 2, (8, 32, 16), torch.bfloat16, (64, 64)),  # second
    ({"buckets": [_bucket(8, 32), _bucket(64, 64)]}, 33, 2, (8, 32, 16), torch.bfloat16, None),  # past the last
    ({"buckets": [_bucket(64, 64)]}, 4, 2, (8, 32, 16), torch.float32, (64, 32)),  # fp32 halves BLOCK_K
    ({"buckets": [_bucket(64, 64)], "shapes": {"8,32,16": [_bucket(4, 128)]}}, 2, 2, (8, 32, 16), torch.float16,
     (128, 64)),  # a shape's own buckets ...
    ({"buckets": [_bucket(64, 64)], "shapes": {"8,32,16": [_bucket(4, 128)]}}, 3, 2, (8, 32, 16), torch.float16,
     None),  # ... replace the generic ones, limit included
    ({"buckets": [_bucket(64, 64)], "shapes": {"8,32,16": []}}, 1, 1, (8, 32, 16), torch.float16, None),  # opt out
    ({"buckets": [_bucket(64, 64)], "shapes": {"8,32,16": []}}, 1, 1, (9, 32, 16), torch.float16, (64, 64)),
]


@pytest.mark.parametrize("entry,T,top_k,shape,dtype,expected", SELECTION_CASES)
def test_select_decode_tiles(entry, T, top_k, shape, dtype, expected, monkeypatch):
    table = {"device": "test", "measured": False, "buckets": []}
    if entry is not None:
        table["decode"] = entry
    monkeypatch.setattr(tiles, "load_table", lambda key: table)
    E, F, H = shape
    chosen = tiles.select_decode_tiles(torch.device("cpu"), T, top_k, E, F, H, dtype)
    assert (chosen.gate_up.block_n, chosen.gate_up.block_k) == expected if expected else chosen is None


def test_tiles_travel_as_flat_ints():
    """The operator takes tiles as a list of ints: each kind comes back as itself."""
    assert tiles.tiles_from_list(DECODE.to_list()) == DECODE
    assert tiles.tiles_from_list(DECODE_DOT.to_list()) == DECODE_DOT
    assert tiles.tiles_from_list(DECODE_GATE_UP_GEMV.to_list()) == DECODE_GATE_UP_GEMV
    assert all(type(v) is int for v in DECODE_DOT.to_list() + DECODE_GATE_UP_GEMV.to_list())
    assert tiles.tiles_from_list(GENERAL.to_list()) == GENERAL


@DOWN_KERNELS
@needs_gpu
def test_decode_path_in_a_cuda_graph(decode_tiles):
    """Captured once, replayed with new tokens, ids (sentinels included) and weights: no host reads, same as eager."""
    x, w_gate_up, w_down, ids, weights = _simple_inputs(4, top_k=2, E=8)
    x, w_gate_up, w_down = (t.to(torch.bfloat16) for t in (x, w_gate_up, w_down))

    def forward():
        return md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=False, tiles=decode_tiles)

    graph, out = capture_cuda_graph(forward)
    for sentinel in (-1, 8):
        x.copy_(torch.randn_like(x))
        ids.copy_(torch.stack([torch.randperm(8)[:2] for _ in range(4)]))
        ids[1, 0] = sentinel
        weights.copy_(torch.rand_like(weights))
        graph.replay()
        assert torch.equal(out, forward())
