"""moe_dispatch.gemm.gluon_fp8: the warp-specialized Hopper FP8 GEMMs (Gluon, Triton 3.6) and their float64 references.

The float64 references are moe_dispatch.reference's fp8_block_gemm_ref and fp8_block_grouped_gemm_ref (A and B
dequantized block by block, then one matmul). On the CPU (and with another Triton) only the host side runs: the import
guard, the tile map (dispatch.segments.segment_tile_map's, which the bf16 GEMM walks too) and the launchers' argument
checks; the kernels run where `gluon_fp8.available()` holds.
"""

import pytest
import torch
from helpers import DEVICE, offsets_of

from moe_dispatch.dispatch.segments import segment_tile_map
from moe_dispatch.gemm import gluon_fp8
from moe_dispatch.formats.fp8 import quantize_experts_fp8
from moe_dispatch.reference import (FP8_GEMM_TOLERANCE, W8A8_MODEL_TOLERANCE_GPU, fp8_block_gated_grouped_gemm_ref,
                                    fp8_block_gemm_ref, fp8_block_grouped_gemm_ref, relative_error)

SCALE_BLOCK = 128
on_hopper = pytest.mark.skipif(not gluon_fp8.available(), reason=f"{gluon_fp8.unavailable_reason()}")


def quantize_rows(x):
    """x [M, K] float -> (x_fp8 [M, K] float8_e4m3fn, scale [M, ceil(K/128)] fp32): one scale per row and K block."""
    q, s = quantize_experts_fp8(x[None], "block", block_shape=(1, SCALE_BLOCK))
    return q[0], s[0]


def quantize_blocks(w):
    """w [E, N, K] float -> (w_fp8, scale [E, ceil(N/128), ceil(K/128)] fp32): one scale per 128 x 128 block."""
    return quantize_experts_fp8(w, "block", block_shape=(SCALE_BLOCK, SCALE_BLOCK))


def test_import_guard_and_availability_reason():
    """The module imports with any Triton (the launchers refuse where the kernels cannot run, saying why)."""
    reason = gluon_fp8.unavailable_reason()
    assert gluon_fp8.available() == (reason is None)
    if reason is not None:
        a = torch.zeros(4, 128, dtype=torch.float8_e4m3fn)
        with pytest.raises(RuntimeError, match="unavailable"):
            gluon_fp8.fp8_block_gemm(a, torch.ones(4, 1), a, torch.ones(1, 1))


@pytest.mark.parametrize("counts", [
    [300, 0, 1, 255],  # an empty expert; a one-row expert; blocks ending mid-tile
    [0, 0, 0],  # no rows at all: only sentinels
    [128, 256],  # block-aligned experts: no partial tile
])
def test_tile_map_covers_each_expert_with_its_own_blocks(counts):
    """The grouped GEMMs' tile map (the dispatch's builder, with the real tiles counted): 128-row blocks of each
    expert in order, -1 past them, num_m_tiles the blocks the kernels walk."""
    offsets = offsets_of(counts, device=DEVICE)  # segment_tile_map launches a Triton kernel
    num_rows = sum(counts)
    safe, tile_expert, tile_row, num_m_tiles = segment_tile_map(offsets, num_rows, len(counts), 128, count_tiles=True)
    bound = (num_rows + min(len(counts), num_rows) * 127) // 128  # dispatch.segments.max_tiles_bound
    assert tile_expert.dtype == tile_row.dtype == num_m_tiles.dtype == torch.int32
    assert tile_expert.shape == tile_row.shape == (bound, )
    want_expert, want_row = [], []
    for e, c in enumerate(counts):
        for start in range(0, c, 128):
            want_expert.append(e)
            want_row.append(offsets[e].item() + start)
    n = len(want_expert)
    assert num_m_tiles.tolist() == [n] and torch.equal(safe, offsets)
    assert tile_expert.tolist() == want_expert + [-1] * (bound - n)
    assert tile_row.tolist()[:n] == want_row


def test_tile_map_never_trusts_the_offsets():
    """Offsets past the rows, decreasing or negative are clamped into [0, rows] and made non-decreasing before the
    map (and the kernels, which read the experts' ends from the returned offsets) use them: no tile reaches past the
    rows."""
    offsets = torch.tensor([-5, 300, 200, 10_000], dtype=torch.int32, device=DEVICE)
    safe, tile_expert, tile_row, num_m_tiles = segment_tile_map(offsets, 400, 3, 128, count_tiles=True)
    assert safe.tolist() == [0, 300, 300, 400]
    n = num_m_tiles.item()
    assert tile_expert.tolist()[:n] == [0, 0, 0, 2] and tile_row.tolist()[:n] == [0, 128, 256, 300]
    assert (tile_expert[n:] == -1).all()


def test_launchers_refuse_bad_arguments():
    a = torch.zeros(8, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="a_scale must be float32"):
        gluon_fp8.fp8_block_gemm(a, torch.ones(8, 2, dtype=torch.bfloat16), a, torch.ones(1, 2))
    with pytest.raises(ValueError, match="b_scale must have shape"):
        gluon_fp8.fp8_block_gemm(a, torch.ones(8, 2), a, torch.ones(2, 2))
    with pytest.raises(TypeError, match="b must be float8_e4m3fn"):
        gluon_fp8.fp8_block_gemm(a, torch.ones(8, 2), a.float(), torch.ones(1, 2))
    with pytest.raises(ValueError, match="expert_offsets must be int32"):
        gluon_fp8.fp8_block_grouped_gemm(a, torch.ones(8, 2), a[None], torch.ones(1, 1, 2),
                                         torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="BLOCK_N"):
        gluon_fp8.fp8_block_gemm(a, torch.ones(8, 2), a, torch.ones(1, 2),
                                 cfg=gluon_fp8.GluonFp8Config(BLOCK_N=256))
    with pytest.raises(ValueError, match="N_TILES must be 1, or 2 with BLOCK_N 128"):
        gluon_fp8.fp8_block_gemm(a, torch.ones(8, 2), a, torch.ones(1, 2),
                                 cfg=gluon_fp8.GluonFp8Config(BLOCK_M=64, N_TILES=2, BLOCK_N=64))
    # the 128 x 256 tile (128 rows, two B tiles) measured slower than 128 x 128 and is gone
    for change in (dict(BLOCK_M=64), dict(BLOCK_M=32, N_TILES=2), dict(N_TILES=2), dict(N_TILES=3)):
        with pytest.raises(ValueError, match="BLOCK_M must be 128 with N_TILES 1 .* or 64 with N_TILES 2"):
            gluon_fp8.fp8_block_gemm(a, torch.ones(8, 2), a, torch.ones(1, 2), cfg=gluon_fp8.GluonFp8Config(**change))
    gated, offsets = gluon_fp8.fp8_block_gated_grouped_gemm, torch.tensor([0, 3, 8], dtype=torch.int32)
    b, b_scale = torch.zeros(2, 256, 256, dtype=torch.float8_e4m3fn), torch.ones(2, 2, 2)
    with pytest.raises(ValueError, match="F a multiple of 128"):
        gated(a, torch.ones(8, 2), b[:, :160].contiguous(), torch.ones(2, 2, 2), offsets)
    with pytest.raises(ValueError, match="b_scale must have shape"):
        gated(a, torch.ones(8, 2), b, torch.ones(2, 1, 2), offsets)
    for activation in ("none", "gelu"):
        with pytest.raises(ValueError, match=f"activation must be one of .* got '{activation}'"):
            gated(a, torch.ones(8, 2), b, b_scale, offsets, activation=activation)
    with pytest.raises(ValueError, match="come together"):
        gated(a, torch.ones(8, 2), b, b_scale, offsets, gate_bias=torch.zeros(2, 128))
    with pytest.raises(ValueError, match=r"up_bias must be \[E, F\]"):
        gated(a, torch.ones(8, 2), b, b_scale, offsets, gate_bias=torch.zeros(2, 128), up_bias=torch.zeros(2, 64))
    for cfg in (gluon_fp8.GluonFp8Config(BLOCK_N=64), gluon_fp8.ROWS64_CONFIG):
        with pytest.raises(ValueError, match="BLOCK_N must be 128, N_TILES 1 and BLOCK_M 128"):
            gated(a, torch.ones(8, 2), b, b_scale, offsets, cfg=cfg)
    if not gluon_fp8.available():
        with pytest.raises(RuntimeError, match="unavailable"):
            gated(a, torch.ones(8, 2), b, b_scale, offsets)


def test_reference_matches_the_dequantized_product():
    """The reference is the product of the dequantized operands (what the quantizer approximates)."""
    x, w = torch.randn(5, 300, dtype=torch.float64), torch.randn(1, 130, 300, dtype=torch.float64)
    a, a_scale = quantize_rows(x)
    b, b_scale = quantize_blocks(w)
    out = fp8_block_gemm_ref(a, a_scale, b[0], b_scale[0])
    assert relative_error(out, x @ w[0].T) < 0.1  # e4m3's 3 mantissa bits


@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
def test_gated_reference_is_the_quantized_activation(activation):
    """The gated GEMM's reference, dequantized, is act(gate, up) of the dequantized operands within e4m3's rounding
    of h (one scale per row and 128 columns: the largest element of each group exact)."""
    E, F, K, counts = 2, 256, 300, [5, 7]
    x, w = torch.randn(sum(counts), K, dtype=torch.float64), torch.randn(E, 2 * F, K, dtype=torch.float64) / K**0.5
    a, a_scale = quantize_rows(x)
    b, b_scale = quantize_blocks(w)
    offsets = offsets_of(counts, device="cpu")
    gate_bias, up_bias = torch.randn(E, F), torch.randn(E, F)
    h, h_scale = fp8_block_gated_grouped_gemm_ref(a, a_scale, b, b_scale, offsets, activation=activation,
                                                  gate_bias=gate_bias, up_bias=up_bias)
    assert h.dtype == torch.float8_e4m3fn and h.shape == (sum(counts), F) and h_scale.shape == (sum(counts), 2)
    gate_up = fp8_block_grouped_gemm_ref(a, a_scale, b, b_scale, offsets)
    experts = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
    gate, up = gate_up[:, :F] + gate_bias[experts].double(), gate_up[:, F:] + up_bias[experts].double()
    if activation == "silu":
        expected = torch.nn.functional.silu(gate) * up
    else:
        gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
        expected = (up + 1) * gate * torch.sigmoid(1.702 * gate)
    dequantized = h.double() * h_scale.double().repeat_interleave(128, dim=1)
    assert relative_error(dequantized, expected) < 0.05
    group_amax = expected.abs().view(-1, 2, 128).amax(dim=2)
    torch.testing.assert_close(h_scale.double(), group_amax / 448, rtol=1e-6, atol=0)


CONFIGS = [gluon_fp8.DEFAULT_CONFIG, gluon_fp8.ROWS64_CONFIG]
CONFIG_IDS = ["128x128", "64x256"]


@on_hopper
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("M, N, K", [(1, 256, 512), (77, 320, 1040), (4097, 512, 2048), (300, 128, 256)])
def test_dense_matches_float64(M, N, K, cfg):
    """N = 320: a last 256-column tile whose second half is 64 columns wide; N = 128: its second half past N (never
    stored; the 64-row tile's second consumer reads the last scale row for it)."""
    a, a_scale = quantize_rows(torch.randn(M, K, device="cuda"))
    b, b_scale = quantize_blocks(torch.randn(1, N, K, device="cuda"))
    out = gluon_fp8.fp8_block_gemm(a, a_scale, b[0], b_scale[0], cfg=cfg)
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    assert relative_error(out, fp8_block_gemm_ref(a, a_scale, b[0], b_scale[0])) < FP8_GEMM_TOLERANCE


@on_hopper
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("counts", [[77, 0, 1, 4019], [1], [129, 128, 0, 0, 300]])
def test_grouped_matches_float64(counts, cfg):
    """N = 384: a 256-column tile's last column tile has one half inside N and one past it, whose B rows are the
    next expert's (or past the last expert's: zeros), never stored; 64-row tiles cut the 77-, 129- and 300-row
    experts differently."""
    N, K = 384, 1024
    offsets = offsets_of(counts, device="cuda")
    a, a_scale = quantize_rows(torch.randn(sum(counts), K, device="cuda"))
    b, b_scale = quantize_blocks(torch.randn(len(counts), N, K, device="cuda"))
    out = gluon_fp8.fp8_block_grouped_gemm(a, a_scale, b, b_scale, offsets, cfg=cfg)
    ref = fp8_block_grouped_gemm_ref(a, a_scale, b, b_scale, offsets)
    assert relative_error(out[:sum(counts)], ref) < FP8_GEMM_TOLERANCE


@on_hopper
def test_nan_in_a_reaches_its_row_only():
    a, a_scale = quantize_rows(torch.randn(200, 512, device="cuda"))
    b, b_scale = quantize_blocks(torch.randn(1, 256, 512, device="cuda"))
    a.view(torch.uint8)[3, 5] = 0x7F  # e4m3fn NaN (S.1111.111)
    for cfg in CONFIGS:
        out = gluon_fp8.fp8_block_gemm(a, a_scale, b[0], b_scale[0], cfg=cfg)
        assert out[3].isnan().all()
        assert torch.isfinite(out[torch.arange(200, device="cuda") != 3]).all()


def _dequantized(h, h_scale):
    return h.double() * h_scale.double().repeat_interleave(SCALE_BLOCK, dim=1)[:, :h.shape[1]]


@on_hopper
@pytest.mark.parametrize("activation, bias", [("silu", False), ("swiglu_oai", True)], ids=["silu", "swiglu-bias"])
@pytest.mark.parametrize("counts, F", [([77, 0, 1, 4019], 256), ([129, 128, 0, 300], 768), ([1], 128)],
                         ids=["two-tiles", "qwen3-width", "one-row"])
def test_gated_matches_float64(counts, F, activation, bias):
    """GEMM1 with its activation and h's quantization against the float64 reference, dequantized: the kernel's
    fp32 sums (wgmma's narrower ones inside each K block) move a few e4m3 roundings by one step
    (W8A8_MODEL_TOLERANCE_GPU); an empty expert; rows past the last offset are not compared."""
    K, E = 1024, len(counts)
    offsets = offsets_of(counts, device="cuda")
    rows = sum(counts)
    a, a_scale = quantize_rows(torch.randn(rows + 5, K, device="cuda"))
    b, b_scale = quantize_blocks(torch.randn(E, 2 * F, K, device="cuda") / K**0.5)
    biases = dict(gate_bias=torch.randn(E, F, device="cuda").bfloat16(),
                  up_bias=torch.randn(E, F, device="cuda").bfloat16()) if bias else {}
    h, h_scale = gluon_fp8.fp8_block_gated_grouped_gemm(a, a_scale, b, b_scale, offsets, activation=activation,
                                                        **biases)
    assert h.dtype == torch.float8_e4m3fn and h.shape == (rows + 5, F) and h_scale.shape == (rows + 5, F // 128)
    ref = fp8_block_gated_grouped_gemm_ref(a[:rows], a_scale[:rows], b, b_scale, offsets, activation=activation,
                                           **biases)
    assert relative_error(_dequantized(h[:rows], h_scale[:rows]), _dequantized(*ref)) < W8A8_MODEL_TOLERANCE_GPU
    torch.testing.assert_close(h_scale[:rows], ref[1], rtol=1e-3, atol=0)


@on_hopper
def test_gated_nan_in_a_reaches_its_row_only():
    a, a_scale = quantize_rows(torch.randn(200, 512, device="cuda"))
    b, b_scale = quantize_blocks(torch.randn(2, 256, 512, device="cuda"))
    a.view(torch.uint8)[3, 5] = 0x7F  # e4m3fn NaN
    h, h_scale = gluon_fp8.fp8_block_gated_grouped_gemm(a, a_scale, b, b_scale, offsets_of([100, 100], device="cuda"))
    assert h[3].float().isnan().all()
    others = torch.arange(200, device="cuda") != 3
    assert torch.isfinite(h[others].float()).all() and torch.isfinite(h_scale[others]).all()
