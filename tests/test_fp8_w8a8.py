"""FP8 experts on the w8a8 path (e4m3 activations x e4m3 weights, forced: "auto" takes "dequant" on the CPU) and
non-finite tokens on every FP8 path: split from tests/test_fp8.py (the weight formats, the dequant path, the path
choice and the argument checks), whose shapes, layouts and weight builders these tests share.

The w8a8 path is held twice: tightly against `fused_experts_w8a8_ref`, the float64 model of its own arithmetic, and
within reference.W8A8_TOLERANCE against the dequantized-weight reference. w8a8 needs the block's K side to be a power of
two >= 32.
"""

import dataclasses

import pytest
import torch
from helpers import DEVICE, assert_close
from test_fp8 import (DECODE, DECODE_DOT, E, F, H, LAYOUTS, MODEL_TOLERANCE, PREFILL, SCHEMES, T, TOP_K, _fp8_experts,
                      _ids)

import moe_dispatch as md
from moe_dispatch.gemm import planner, w8a8
from moe_dispatch.host.device import has_tma
from moe_dispatch.dispatch.segments import dispatch
from moe_dispatch.gemm.args import gemm_weights
from moe_dispatch.formats.fp8 import WeightScale
from moe_dispatch.gemm.w8a8 import quantize_fp8_rows, w8a8_gemm1, w8a8_groups, w8a8_tiles
from moe_dispatch.reference import (TOLERANCE, W8A8_TOLERANCE, dequantize_fp8_ref, fused_experts_fp8_ref,
                                    fused_experts_w8a8_ref, quantize_fp8_groups_ref)
from moe_dispatch.host.tiles import GemmTile, MoeTiles, Persistent
STATIC_MODES = ("dynamic", "static-tensor", "static-expert")


def _w8a8_block(transposed):
    """A block shape w8a8 runs: K side 32 (the weight's axis 2, or axis 1 when transposed), N side 16."""
    return (32, 16) if transposed else (16, 32)


def _groups(scales, transposed):
    """(G1, G2): the K steps (activation groups) of the two GEMMs for these scales on this device's table (at the
    module's T, top_k, E, F, H: channel and tensor scales take the tile's BLOCK_K, which a GPU table sets)."""
    tiles = md.host.tiles.select_fp8_tiles(torch.device(DEVICE), T, TOP_K, E, F, H)
    return w8a8_groups(tiles, scales["w_gate_up_scale"], scales["w_down_scale"],
                       scales.get("fp8_block_shape", (128, 128)), transposed=transposed)


def _static_scales(mode, x, num_experts=E):
    """Static input scales that cover x and the intermediate (no saturation), per tensor or per expert."""
    if mode == "dynamic":
        return {}
    x_scale = x.float().abs().amax() / 448 * 1.25
    if mode == "static-tensor":
        return dict(gate_up_input_scale=x_scale.reshape(()), down_input_scale=torch.full((1,), 0.06, device=DEVICE))
    return dict(gate_up_input_scale=x_scale * (1 + torch.rand(num_experts, device=DEVICE)),
                down_input_scale=0.05 + 0.05 * torch.rand(num_experts, device=DEVICE))


def _check_w8a8(out, x, q_gate_up, q_down, ids, weights, scales, options, *, model_tolerance=MODEL_TOLERANCE,
                groups=None):
    """out against the model of its arithmetic (tight) and against the dequantized-weight experts (W8A8_TOLERANCE)."""
    groups = groups or _groups(scales, options.get("transposed", False))
    weight_scales = {k: v for k, v in scales.items() if not k.endswith("input_scale")}
    model = fused_experts_w8a8_ref(x, q_gate_up, q_down, ids, weights, groups=groups, **scales, **options)
    assert_close(out, model, what="w8a8 vs its model", tolerance=model_tolerance)
    assert_close(out, fused_experts_fp8_ref(x, q_gate_up, q_down, ids, weights, **weight_scales, **options),
                 what="w8a8 vs dequantized weights", tolerance=W8A8_TOLERANCE)


# Every pair of factors, not their product: each of the kernels' constexpr branches follows one factor (the weight
# addressing and the activation epilogue the layout, the scale loads the scheme, the activation quantization and the
# intermediate's the mode), and the branches meet two at a time (scaled_dot: mode x scheme; the epilogue's channel /
# tensor scale rows: scheme x layout; the quantized intermediate after the activation: mode x layout). Layout i takes
# scheme j with mode (i + j) % 3, a Latin square: all 12 layout x scheme pairs, every layout and every scheme with
# each of the three modes.
W8A8_CASES = [(layout, scheme, STATIC_MODES[(i + j) % len(STATIC_MODES)])
              for i, layout in enumerate(LAYOUTS) for j, scheme in enumerate(SCHEMES)]


@pytest.mark.parametrize("layout,scheme,mode", W8A8_CASES, ids=[f"{c[0][0]}-{c[1]}-{c[2]}" for c in W8A8_CASES])
def test_w8a8_fused_experts(layout, scheme, mode, poison_empty):
    """Every scheme x activation-scale mode x layout pair (W8A8_CASES), fp32 activations (the model check is tight
    there), H = 40 and F = 24: partial K steps in both GEMMs and a partial group of the intermediate. Buffers start as
    NaN (poison_empty): no intermediate value or scale is read before GEMM1 writes it."""
    _, options, _ = layout
    options = dict(options)
    transposed = options.get("transposed", False)
    q_gate_up, q_down, scales = _fp8_experts(scheme, transposed=transposed, block_shape=_w8a8_block(transposed))
    if options.get("activation") == "swiglu_oai":
        options.update(gate_up_bias=torch.randn(E, 2 * F, device=DEVICE), down_bias=torch.randn(E, H, device=DEVICE))
    x = torch.randn(T, H, device=DEVICE)
    x[0] = 0  # an all-zero token: its groups take the amax floor, never 0 / 0
    ids, weights = _ids(T), torch.rand(T, TOP_K, device=DEVICE)
    scales.update(_static_scales(mode, x))
    out = md.fused_experts(x, q_gate_up, q_down, ids, weights, fp8_compute="w8a8", **scales, **options)
    assert out.dtype == torch.float32
    _check_w8a8(out, x, q_gate_up, q_down, ids, weights, scales, options)


@pytest.mark.parametrize("act_dtype,mode", [(torch.bfloat16, "dynamic"), (torch.float16, "static-tensor"),
                                            (torch.bfloat16, "static-expert")],
                         ids=["bf16-dynamic", "fp16-static-tensor", "bf16-static-expert"])
def test_w8a8_half_precision_and_default_block(act_dtype, mode):
    """bf16 / fp16 activations in and out with the default 128 x 128 blocks over several partial blocks (2F = 160,
    H = 136): against the model within the activation dtype's rounding of y and the output. Each activation-scale
    mode once, the dtypes alternating: the dtype only converts the loads to fp32 and the stored output, the same
    instructions whichever mode quantized the sums (test_w8a8_fused_experts holds every mode to the tight bound)."""
    q_gate_up, q_down, scales = _fp8_experts("block", block_shape=(128, 128), ffn=80, hidden=136)
    x = torch.randn(7, 136, device=DEVICE).to(act_dtype)
    ids, weights = _ids(7), torch.rand(7, TOP_K, device=DEVICE)
    scales.update(_static_scales(mode, x))
    out = md.fused_experts(x, q_gate_up, q_down, ids, weights, fp8_compute="w8a8", **scales)
    assert out.dtype == act_dtype
    # the dtype's bound, or the GPU's looser one where wgmma's sums move a few e4m3 roundings (MODEL_TOLERANCE)
    _check_w8a8(out, x, q_gate_up, q_down, ids, weights, scales, {},
                model_tolerance=max(TOLERANCE[act_dtype], MODEL_TOLERANCE))


@pytest.mark.parametrize("interleaved", [False, True], ids=["concatenated", "interleaved"])
def test_w8a8_uniform_block_scale_tiles(interleaved):
    """F = H = 64 with blocks whose N side holds whole column tiles (32, or 64 for the interleaved view's doubled
    rows): each tile reads one scale per K step (the scalar path of `load_block_scale`)."""
    from moe_dispatch.gemm.w8a8 import _uniform_block_scale

    block_shape = (64, 32) if interleaved else (32, 32)
    q_gate_up, q_down, scales = _fp8_experts("block", block_shape=block_shape, ffn=64, hidden=64)
    gate_up = WeightScale.of(scales["w_gate_up_scale"], "block", block_shape, transposed=False,
                             row_step=2 if interleaved else 1, up_row_offset=1 if interleaved else 64)
    assert _uniform_block_scale(gate_up, 32, gated=True)
    x = torch.randn(T, 64, device=DEVICE)
    ids, weights = _ids(T), torch.rand(T, TOP_K, device=DEVICE)
    out = md.fused_experts(x, q_gate_up, q_down, ids, weights, fp8_compute="w8a8", interleaved=interleaved, **scales)
    _check_w8a8(out, x, q_gate_up, q_down, ids, weights, scales, {"interleaved": interleaved})


@pytest.mark.parametrize("mode", STATIC_MODES)
def test_w8a8_prefill_tiles(mode, poison_empty):
    """block_m 64 (the prefill buckets): x quantized by its own pass first (per-expert static scales stay in the
    loads), and GEMM1's BLOCK_N 64 holding two groups of the intermediate; bit-identical to the decode tiles in the
    interpreter."""
    q_gate_up, q_down, scales = _fp8_experts("block", block_shape=(16, 32))
    x = torch.randn(T, H, device=DEVICE)
    ids, weights = _ids(T), torch.rand(T, TOP_K, device=DEVICE)
    scales.update(_static_scales(mode, x))
    prefill = MoeTiles(64, GemmTile(64, 32), GemmTile(32, 32))
    out = md.fused_experts(x, q_gate_up, q_down, ids, weights, fp8_compute="w8a8", tiles=prefill, **scales)
    _check_w8a8(out, x, q_gate_up, q_down, ids, weights, scales, {})
    decode = md.fused_experts(x, q_gate_up, q_down, ids, weights, fp8_compute="w8a8", **scales)
    if DEVICE == "cpu":
        assert torch.equal(out, decode)
    else:  # wgmma (BLOCK_M 64) and mma.sync (16) sum fp8 products with different precision: see MODEL_TOLERANCE
        assert_close(out, decode, what="prefill vs decode tiles", tolerance=MODEL_TOLERANCE)


# 16 rows by 64 columns in both GEMMs (F = 64 gated columns, H = 72: a partial K step in GEMM1, a partial column
# tile in GEMM2): on Hopper, and in the interpreter, both sum the transposed tile W^T A^T (planner.w8a8_gemm_kernel)
SWAPPED = MoeTiles(16, GemmTile(64, 32), GemmTile(64, 32))
SWAPPED_FFN, SWAPPED_HIDDEN = 64, 72


def _swap_flags(monkeypatch):
    """The SWAP_AB of every w8a8 pointer launch from here on, in order."""
    flags = []
    launch = w8a8.launch
    monkeypatch.setattr(w8a8, "launch",
                        lambda kernel, grid, *a, **k: flags.append(k.get("SWAP_AB")) or launch(kernel, grid, *a, **k))
    return flags


# Each weight scale form with dynamic activations (row scales along the swapped accumulator's columns) and with a
# static mode (no row scales: scaled_dot's column-scale-only and scale-free forms); the two static modes differ only
# in where the one scalar a_static comes from (per tensor or per expert), which the swap never sees, so they alternate.
SWAPPED_CASES = [(f"{name}-{mode}", scheme, block_shape, mode) for k, (name, scheme, block_shape) in enumerate(
    [("block-per-column", "block", (16, 32)), ("block-uniform", "block", (64, 32)), ("channel", "channel", (16, 32)),
     ("tensor", "tensor", (16, 32))]) for mode in ("dynamic", STATIC_MODES[1 + k % 2])]


@pytest.mark.parametrize("scheme,block_shape,mode", [c[1:] for c in SWAPPED_CASES], ids=[c[0] for c in SWAPPED_CASES])
def test_w8a8_swapped_small_tiles(scheme, block_shape, mode, poison_empty, monkeypatch):
    """Small tiles with the operands swapped: against the model of the arithmetic, and equal to the same tiles
    unswapped (mma.sync's form, has_wgmma False) within the bound the model is held to. Block
    scales of 16 rows give each of a tile's 64 columns its own scale (the [BLOCK_N, 1] form of load_block_scale);
    64-row blocks one scale per tile (its scalar form). Concatenated weights only: interleaved views read the same
    tiles through strides, and transposed weights never swap (FP8 wgmma wants K-major operands)."""
    q_gate_up, q_down, scales = _fp8_experts(scheme, block_shape=block_shape, ffn=SWAPPED_FFN, hidden=SWAPPED_HIDDEN)
    x = torch.randn(T, SWAPPED_HIDDEN, device=DEVICE)
    ids, weights = _ids(T), torch.rand(T, TOP_K, device=DEVICE)
    scales.update(_static_scales(mode, x))
    flags = _swap_flags(monkeypatch)
    swapped = md.fused_experts(x, q_gate_up, q_down, ids, weights, fp8_compute="w8a8", tiles=SWAPPED, **scales)
    if planner.has_wgmma(x.device):
        assert flags[-2:] == [True, True]
    # the K steps of these tiles, not the table's (channel and tensor scales take the tile's BLOCK_K as the group)
    groups = w8a8_groups(SWAPPED, scales["w_gate_up_scale"], scales["w_down_scale"], block_shape)
    _check_w8a8(swapped, x, q_gate_up, q_down, ids, weights, scales, {}, groups=groups)
    monkeypatch.setattr(planner, "has_wgmma", lambda device: False)
    md.host.replay.clear()
    plain = md.fused_experts(x, q_gate_up, q_down, ids, weights, fp8_compute="w8a8", tiles=SWAPPED, **scales)
    assert flags[-2:] == [False, False]
    # the same products in the same K steps, summed in another order inside each dot (here too: numpy's matmul of
    # the transposed tiles)
    assert_close(swapped, plain, what="swapped vs plain small tiles", tolerance=MODEL_TOLERANCE)


def test_w8a8_swap_is_chosen_for_small_tiles_only(monkeypatch):
    """Where the planner swaps: fewer than 64 rows, at least 64 columns, K-contiguous weights, a wgmma device."""
    a = torch.empty(4, 64, device=DEVICE, dtype=torch.float8_e4m3fn)
    w = gemm_weights(torch.empty(2, 64, 64, device=DEVICE, dtype=torch.float8_e4m3fn), None, None, None,
                         transposed=False, activation="none")
    monkeypatch.setattr(planner, "has_wgmma", lambda device: True)
    kernel = lambda block_m, block_n, transposed=False: planner.w8a8_gemm_kernel(  # noqa: E731
        a, w, GemmTile(block_n, 32), block_m=block_m, transposed=transposed, gather_a=True)
    assert kernel(16, 64) is planner.GemmKernel.POINTER_SWAPPED
    assert kernel(32, 128) is planner.GemmKernel.POINTER_SWAPPED
    assert kernel(64, 64) is planner.GemmKernel.POINTER  # wgmma's own 64-row slab
    assert kernel(16, 32) is planner.GemmKernel.POINTER  # 32 weight columns would not fill it either
    assert kernel(16, 64, transposed=True) is planner.GemmKernel.POINTER
    monkeypatch.setattr(planner, "has_wgmma", lambda device: False)
    assert kernel(16, 64) is planner.GemmKernel.POINTER


def test_w8a8_static_scale_saturates_like_the_model():
    """A static scale too small for the data: values beyond 448 * scale saturate (clamp), as in the model."""
    q_gate_up, q_down, scales = _fp8_experts("channel")
    x = torch.randn(T, H, device=DEVICE)
    ids, weights = _ids(T), torch.rand(T, TOP_K, device=DEVICE)
    scales.update(gate_up_input_scale=x.abs().amax() / 448 / 4, down_input_scale=torch.tensor(1e-3, device=DEVICE))
    out = md.fused_experts(x, q_gate_up, q_down, ids, weights, fp8_compute="w8a8", **scales)
    model = fused_experts_w8a8_ref(x, q_gate_up, q_down, ids, weights, groups=_groups(scales, False), **scales)
    assert_close(out, model, tolerance=MODEL_TOLERANCE)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_w8a8_intermediate_is_quantized_in_gemm1_epilogue(static):
    """GEMM1 alone: its float8 intermediate and per-(row, 32-column) scales against a float64 model of
    quantize(act(x_fp8 @ W_gate_up^T)): scales equal the model's amax / 448, every element within half an e4m3 step
    of the unquantized value (2^-4 relative, 2^-10 of the scale among subnormals), and each group's largest element
    on +-448 (dynamic scales)."""
    q_gate_up, _, scales = _fp8_experts("block", block_shape=(16, 32))
    x = torch.randn(T, H, device=DEVICE)
    ids = _ids(T)
    ws = WeightScale.of(scales["w_gate_up_scale"], "block", (16, 32), transposed=False, up_row_offset=F)
    tiles = w8a8_tiles(md.host.tiles.select_fp8_tiles(torch.device("cpu"), T, TOP_K, E, F, H), ws, ws)
    info = dispatch(ids, E, tiles.block_m)
    down_input_scale = torch.tensor(0.05, device=DEVICE) if static else None
    h, h_scale = w8a8_gemm1(x, q_gate_up[:, :F], q_gate_up[:, F:], info, tiles, ws, down_input_scale=down_input_scale)
    assert h.dtype == torch.float8_e4m3fn and h.shape == (T * TOP_K, F)
    group = tiles.down.block_k
    w = dequantize_fp8_ref(q_gate_up, scales["w_gate_up_scale"], (16, 32))
    rows = info.gather_idx.long()
    token, slot = rows // TOP_K, rows % TOP_K
    expert = ids[token, slot].long()
    x_q = quantize_fp8_groups_ref(x, tiles.gate_up.block_k)[token]
    gate_up = torch.einsum("nk,nfk->nf", x_q, w[expert])
    value = (torch.nn.functional.silu(gate_up[:, :F]) * gate_up[:, F:]).float().double()
    if static:
        assert h_scale is None
        expanded = torch.full_like(value, 0.05)
    else:
        amax = torch.nn.functional.pad(value.abs(), (0, -F % group)).view(len(rows), -1, group).amax(2)
        torch.testing.assert_close(h_scale.double(), amax / 448, rtol=1e-5, atol=0)
        expanded = h_scale.double().repeat_interleave(group, dim=1)[:, :F]
        q = torch.nn.functional.pad(h.float().abs(), (0, -F % group)).view(len(rows), -1, group).amax(2)
        assert (q == 448).all()
    dequantized = h.double() * expanded
    assert ((dequantized - value).abs() <= 2**-4 * value.abs() + 2**-10 * expanded + 1e-6 * value.abs()).all()


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_quantize_fp8_rows_matches_model(static):
    """The prefill pass over x: e4m3 codes and per-(row, group) scales equal to the model bit for bit, over
    magnitudes from 1e-6 to 1e4, an all-zero row and a partial last group."""
    x = torch.randn(37, 100, device=DEVICE) * torch.logspace(-6, 4, 37, device=DEVICE)[:, None]
    x[3] = 0
    static_scale = torch.tensor(0.02, device=DEVICE) if static else None
    q, scale = quantize_fp8_rows(x, 32, static_scale)
    model = quantize_fp8_groups_ref(x, 32, static_scale)
    if static:
        assert scale is None
        torch.testing.assert_close(q.double() * static_scale.double(), model, rtol=0, atol=0)
    else:
        assert scale.shape == (37, 4)
        torch.testing.assert_close(q.double() * scale.double().repeat_interleave(32, dim=1)[:, :100], model, rtol=0,
                                   atol=0)


@pytest.mark.parametrize("T", [0, 3])
def test_w8a8_no_tokens_and_sentinel_ids(T, poison_empty):
    """No tokens, and ids outside [0, E) (expert-parallel sentinels) contributing nothing, on the prefill tiles too."""
    q_gate_up, q_down, scales = _fp8_experts("block", block_shape=(16, 32))
    x = torch.randn(T, H, device=DEVICE)
    ids = torch.full((T, TOP_K), E, device=DEVICE)
    ids[:, 0] = torch.arange(T) % E
    weights = torch.rand(T, TOP_K, device=DEVICE)
    for tiles in (None, MoeTiles(64, GemmTile(32, 32), GemmTile(32, 32))):
        out = md.fused_experts(x, q_gate_up, q_down, ids, weights, fp8_compute="w8a8", validate=False, tiles=tiles,
                               **scales)
        assert out.shape == (T, H)
        if T:
            _check_w8a8(out, x, q_gate_up, q_down, ids, weights, scales, {})


PERSISTENT = MoeTiles(64, GemmTile(64, 32, persistent=Persistent.ON), GemmTile(32, 32, persistent=Persistent.ON))


@dataclasses.dataclass(frozen=True)
class NonFiniteCase:
    id: str
    why: str
    scheme: str = "block"
    fp8_compute: str = "w8a8"
    static: str = "dynamic"  # STATIC_MODES
    tiles: object = None
    hidden: int = H
    ffn: int = F


NON_FINITE_CASES = [
    NonFiniteCase("w8a8-block", "dynamic scales per token and K step, quantized in GEMM1's loads; the intermediate "
                  "quantized per group in GEMM1's epilogue"),
    NonFiniteCase("w8a8-block-prefill", "x quantized by the pass over its rows first", tiles=PREFILL),
    NonFiniteCase("w8a8-block-swapped", "small tiles summing W^T A^T (the row scales along the accumulator's columns)",
                  tiles=SWAPPED, hidden=SWAPPED_HIDDEN, ffn=SWAPPED_FFN),
    NonFiniteCase("w8a8-block-persistent", "the pass gathers the rows; both GEMMs on the descriptor kernel (H = 64, "
                  "F = 32: weight rows of whole 16 bytes)", tiles=PERSISTENT, hidden=64, ffn=32),
    NonFiniteCase("w8a8-tensor-static-tensor", "per-tensor static input scales: no scale to carry a NaN, the e4m3 "
                  "values must (x / scale in GEMM1's loads, h / scale in its epilogue)", scheme="tensor",
                  static="static-tensor"),
    NonFiniteCase("w8a8-tensor-static-tensor-prefill", "the pass divides x by the static scale", scheme="tensor",
                  static="static-tensor", tiles=PREFILL),
    NonFiniteCase("w8a8-channel-static-expert", "per-expert static input scales, in the loads", scheme="channel",
                  static="static-expert"),
    NonFiniteCase("dequant-block", "weights dequantized in the loads, activations stay in their dtype",
                  fp8_compute="dequant"),
    NonFiniteCase("dequant-tensor", "per-tensor weight scales after the K loop", scheme="tensor",
                  fp8_compute="dequant"),
    NonFiniteCase("decode-block", "the two-launch decode path", fp8_compute="dequant", tiles=DECODE),
    NonFiniteCase("decode-block-down-dot", "the decode path with the down GEMM as one dot per expert (NaN rows among "
                  "the dot's rows)", fp8_compute="dequant", tiles=DECODE_DOT),
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's, in the interpreter, on NaN
@pytest.mark.parametrize("case", NON_FINITE_CASES, ids=[c.id for c in NON_FINITE_CASES])
def test_fp8_non_finite_tokens_propagate(case, poison_empty, monkeypatch):
    """A NaN in one token's hidden state gives NaN in its whole output row and an inf gives a non-finite row, as the
    bf16 experts do, on every FP8 path (never a finite made-up row: the e4m3 clamp and the group amax must not drop
    them); every other token's row is bit for bit the output of the same call without them."""
    persistent_launches = []
    persistent = w8a8.persistent_w8a8_gemm
    monkeypatch.setattr(w8a8, "persistent_w8a8_gemm",
                        lambda *a, **k: persistent_launches.append(1) or persistent(*a, **k))
    q_gate_up, q_down, scales = _fp8_experts(case.scheme, block_shape=(16, 32), ffn=case.ffn, hidden=case.hidden)
    x = torch.randn(T, case.hidden, device=DEVICE)
    scales.update(_static_scales(case.static, x))
    ids, weights = _ids(T), torch.rand(T, TOP_K, device=DEVICE)
    options = dict(fp8_compute=case.fp8_compute, tiles=case.tiles, **scales)
    clean = md.fused_experts(x, q_gate_up, q_down, ids, weights, **options)
    # both GEMMs of the recording call on the descriptor kernel (the next call may replay the plan: no launcher call)
    assert len(persistent_launches) == (2 if case.tiles is PERSISTENT and has_tma(x.device) else 0)
    bad = x.clone()
    bad[2, 7] = float("nan")
    bad[5, 33] = float("inf")  # in the second K step of 32 columns
    out = md.fused_experts(bad, q_gate_up, q_down, ids, weights, **options)
    assert torch.isnan(out[2]).all(), f"NaN token: {out[2, :8].tolist()}"
    assert not torch.isfinite(out[5]).any(), f"inf token: {out[5, :8].tolist()}"
    others = [t for t in range(T) if t not in (2, 5)]
    assert torch.isfinite(clean).all()
    assert torch.equal(out[others], clean[others])
