"""The decode path's MXFP4 kernels on mma.sync (moe_dispatch.gemm.gluon_mxfp4_decode, a decode tile's `mma`).

On the CPU: the decode's PTX (E2M1_WORDS_PTX) run by a small interpreter of the instructions it uses, against the
package's dequantization, for every byte and scale code; the choice of the kernels (only MXFP4 weights under bf16
activations where the Gluon kernels run). On a Hopper GPU: `fused_experts` with forced decode tiles whose kernels say
`mma`, against float64 on the dequantized weights: GPT-OSS's interleaved layout with both biases and the concatenated
one without, K and rows off the kernels' steps, experts with more tokens than a pass's 8 slots, a token naming an
expert twice, ids outside [0, E), top_k 1, NaN in x and a NaN scale code; the replayed call; a CUDA graph.
"""

import re

import pytest
import torch
from helpers import DEVICE, assert_close, capture_cuda_graph

import moe_dispatch as md
from moe_dispatch.gemm import gluon_mxfp4, gluon_mxfp4_decode
from moe_dispatch.host import replay
from moe_dispatch.host.tiles import DecodeTile, DecodeTiles
from moe_dispatch.reference import dequantize_mxfp4_ref, fused_experts_ref

on_hopper = pytest.mark.skipif(not gluon_mxfp4.available(), reason=f"{gluon_mxfp4.unavailable_reason()}")


def _bf16_bits(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF


def _from_bf16_bits(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int64).to(torch.int16).view(torch.bfloat16).float().item()


def _run_ptx(text: str, operands: dict[int, int]) -> dict[int, int]:
    """Runs the straight-line PTX `text` (mov, and, or, shr, prmt, fma.rn.bf16x2 on .b32 registers; $n operands)
    on 32-bit values and returns the $ operands it wrote."""
    regs = {f"${n}": v for n, v in operands.items()}

    def val(token):
        token = token.strip()
        return regs[token] if token in regs else int(token, 0) & 0xFFFFFFFF

    for stmt in re.findall(r"([a-z][\w.]*)\s+([^;{}]+);", text):
        op, args = stmt[0], [a.strip() for a in stmt[1].split(",")]
        if op == "reg":  # a declaration
            continue
        dst, src = args[0], [val(a) for a in args[1:]]
        if op == "mov.b32":
            out = src[0]
        elif op == "and.b32":
            out = src[0] & src[1]
        elif op == "or.b32":
            out = src[0] | src[1]
        elif op == "shr.u32":
            out = src[0] >> src[1]
        elif op == "prmt.b32":  # default mode: selector nibble k picks byte k of the result from {b, a}
            table = src[0] | (src[1] << 32)
            out = 0
            for k in range(4):
                nibble = (src[2] >> (4 * k)) & 0xF
                assert nibble < 8, "the decode never uses prmt's sign-replicate mode"
                out |= ((table >> (8 * nibble)) & 0xFF) << (8 * k)
        elif op == "fma.rn.bf16x2":
            halves = []
            for h in (0, 16):
                a, b, c = (_from_bf16_bits((v >> h) & 0xFFFF) for v in src)
                halves.append(int(_bf16_bits(torch.tensor([a * b + c], dtype=torch.float64))) << h)
            out = halves[0] | halves[1]
        else:
            raise AssertionError(f"the interpreter does not know {op}")
        regs[dst] = out & 0xFFFFFFFF
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$")}


def test_word_decode_ptx_matches_the_dequantization():
    """E2M1_WORDS_PTX: output $j is (low nibble, high nibble) of byte j of the four input words (bytes 4 e .. 4 e + 3
    in word e, low byte first), times the scale; every byte value 0..255 and scale codes 0 (2^-127), 127 (1), 130 and
    255 (NaN), against formats.mxfp4's dequantization of the same bytes and code."""
    text = gluon_mxfp4_decode.E2M1_WORDS_PTX.value
    for code in (0, 127, 130, 255):
        for first in range(0, 256, 16):
            data = torch.arange(first, first + 16, dtype=torch.int64) % 256
            blocks, codes = data.to(torch.uint8).reshape(1, 1, 16), torch.full((1, 1, 1), code, dtype=torch.uint8)
            want = dequantize_mxfp4_ref(blocks.reshape(1, 1, 16), codes).to(torch.bfloat16).reshape(16, 2)
            scale = int(_bf16_bits(dequantize_mxfp4_ref(torch.full((1, 1, 16), 0x22, dtype=torch.uint8), codes)
                                   .reshape(-1)[:1] / 1.0))  # 0x22: both nibbles 1.0, so this is the scale
            words = {16 + e: int(sum(int(data[4 * e + q]) << (8 * q) for q in range(4))) for e in range(4)}
            scales = {20 + i: scale | (scale << 16) for i in range(4)}
            got = _run_ptx(text, {**words, **scales})
            for j in range(16):
                pair = torch.tensor([got[j] & 0xFFFF, got[j] >> 16], dtype=torch.int64)
                values = pair.to(torch.int16).view(torch.bfloat16)
                if code == 255:
                    assert values.isnan().all(), (code, int(data[j]))
                else:
                    assert torch.equal(values, want[j]), (code, int(data[j]), values, want[j])


def test_only_mxfp4_under_bf16_on_the_gluon_gpus_takes_the_kernels(monkeypatch):
    """`runs`: MXFP4 bytes along their rows, each row on a 4-byte boundary (they load as words), bf16 x, a CUDA device
    where Gluon runs; anything else keeps the decode path's other kernels (a table's `mma` is then ignored)."""
    monkeypatch.setattr(gluon_mxfp4_decode, "available", lambda device=None: True)
    x, w = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(4, 32, 32, dtype=torch.uint8)
    cuda = lambda t: type("OnCuda", (), {"dtype": t.dtype, "device": torch.device("cuda")})()  # noqa: E731
    assert gluon_mxfp4_decode.runs(cuda(x), w, False)
    assert not gluon_mxfp4_decode.runs(x, w, False)  # a CPU tensor
    assert not gluon_mxfp4_decode.runs(cuda(x.float()), w, False)
    assert not gluon_mxfp4_decode.runs(cuda(x), w.to(torch.float8_e4m3fn), False)
    assert not gluon_mxfp4_decode.runs(cuda(x), w, True)
    assert not gluon_mxfp4_decode.runs(cuda(x), w.transpose(1, 2), False)
    shifted = torch.zeros(4 * 32 * 32 + 2, dtype=torch.uint8)[2:].view(4, 32, 32)  # rows 2 bytes off a word
    assert shifted.data_ptr() % 4 == 2 and not gluon_mxfp4_decode.runs(cuda(x), shifted, False)
    odd_rows = torch.zeros(4, 32, 34, dtype=torch.uint8)[:, :, :32]  # 34-byte rows: every other one off a word
    assert not gluon_mxfp4_decode.runs(cuda(x), odd_rows, False)
    monkeypatch.setattr(gluon_mxfp4_decode, "available", lambda device=None: False)
    assert not gluon_mxfp4_decode.runs(cuda(x), w, False)


def test_tiles_carry_mma():
    """DecodeTile.mma survives the flat form custom operators take (0 / 1 back to bools) and must be a bool."""
    tiles = DecodeTiles(DecodeTile(32, 128, mma=True), DecodeTile(64, 128, num_warps=2, mma=True))
    assert DecodeTiles.from_list(tiles.to_list()) == tiles
    assert DecodeTiles.from_list(tiles.to_list()).down.mma is True
    with pytest.raises(TypeError, match=r"DecodeTile\.mma must be a bool"):
        DecodeTile(64, 128, mma="yes")


def test_forced_mma_tiles_fall_back_where_the_kernels_cannot_run():
    """On a device where the Gluon kernels do not run (the CPU, an AMD or pre-Hopper GPU) or for activations other
    than bf16, decode tiles saying `mma` run the decode path's other kernels with the tiles' remaining fields, and
    agree with float64 (the CPU suite's interpreter runs them here; a Hopper GPU takes the fp32 activations there)."""
    x, gate_up, down, ids, weights, options = _case(3, 4, 2, 64, 96, interleaved=True, bias=True)
    if gluon_mxfp4_decode.runs(x, gate_up[0], False):  # a Hopper GPU: fp32 activations and biases there
        x = x.float()
        options = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    assert not gluon_mxfp4_decode.runs(x, gate_up[0], False)
    # tests/test_mxfp4.py's decode tiles (its dot kernels), each saying mma
    tiles = DecodeTiles(DecodeTile(32, 64, mma=True), DecodeTile(32, 32, split_k=2, dot=True, mma=True))
    out = _run(x, gate_up, down, ids, weights, tiles, **options)
    assert_close(out, _reference(x, gate_up, down, ids, weights, **options), x.dtype)


def _mxfp4(E, N, K, seed):
    gen = torch.Generator().manual_seed(seed)
    blocks, scales = md.quantize_experts_mxfp4(torch.randn(E, N, K, generator=gen) * 0.2)
    return blocks.reshape(E, N, K // 2).to(DEVICE), scales.to(DEVICE)


def _tiles(num_warps, gate_up=True, down=True):
    return DecodeTiles(DecodeTile(max(16, 8 * num_warps), 128, num_warps=num_warps, mma=gate_up),
                       DecodeTile(16 * num_warps, 128, num_warps=num_warps, mma=down))


def _case(T, E, top_k, H, F, *, interleaved, bias, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(T, H).to(DEVICE, torch.bfloat16)
    gate_up, down = _mxfp4(E, 2 * F, H, seed + 1), _mxfp4(E, H, F, seed + 2)
    ids = torch.stack([torch.randperm(E)[:top_k] for _ in range(T)]).to(DEVICE)
    weights = torch.rand(T, top_k, device=DEVICE)
    options = dict(activation="swiglu_oai", interleaved=True) if interleaved else {}
    if bias:
        options.update(gate_up_bias=(torch.randn(E, 2 * F, device=DEVICE) * 0.1).bfloat16(),
                       down_bias=(torch.randn(E, H, device=DEVICE) * 0.1).bfloat16())
    return x, gate_up, down, ids, weights, options


def _run(x, gate_up, down, ids, weights, tiles, **options):
    return md.fused_experts(x, gate_up[0], down[0], ids, weights, w_gate_up_scale=gate_up[1], w_down_scale=down[1],
                            validate=False, tiles=tiles, **options)


def _reference(x, gate_up, down, ids, weights, **options):
    """float64 on the dequantized weights; assignments whose id is outside [0, E) add nothing."""
    E = gate_up[0].shape[0]
    valid = (ids >= 0) & (ids < E)
    options = {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    return fused_experts_ref(x.double(), dequantize_mxfp4_ref(*gate_up), dequantize_mxfp4_ref(*down),
                             torch.where(valid, ids, 0), torch.where(valid, weights, 0).double(), **options)


# (id, T, E, top_k, H, F, interleaved, bias, num_warps, why)
CASES = [
    ("gpt-oss-1", 1, 8, 4, 2880 // 10, 2880 // 10, True, True, 4,
     "one token: GPT-OSS's interleaved gate/up with both biases, H = F = 288 (two whole K steps and a 32-value tail)"),
    ("gpt-oss-5", 5, 16, 4, 288, 288, True, True, 4, "a few tokens, most experts hit once"),
    ("shared-16", 16, 4, 4, 160, 96, True, True, 4,
     "16 tokens on 4 experts: 16 slots an expert, two passes of 8; F = 96 (3 programs of 32 columns), H = 160 rows"),
    ("concatenated", 7, 8, 2, 96, 64, False, False, 2,
     "gate rows then up rows, silu, no bias, 2 warps; H = 96 under one step (the tail alone)"),
    ("top-1", 9, 4, 1, 128, 416, True, True, 4,
     "top_k 1: each down program stores its tokens' rows itself; F = 416 (three whole steps and a tail)"),
    ("many", 64, 32, 4, 256, 128, True, True, 2, "256 assignments (16-slot passes), two warps a program"),
]


@on_hopper
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_float64(case):
    _, T, E, top_k, H, F, interleaved, bias, num_warps, why = case
    replay.clear()
    x, gate_up, down, ids, weights, options = _case(T, E, top_k, H, F, interleaved=interleaved, bias=bias)
    tiles = _tiles(num_warps)
    out = _run(x, gate_up, down, ids, weights, tiles, **options)
    assert_close(out, _reference(x, gate_up, down, ids, weights, **options), torch.bfloat16, what=why)
    again = _run(x, gate_up, down, ids, weights, tiles, **options)  # the recorded plan, replayed
    assert torch.equal(again, out), why


@on_hopper
@pytest.mark.parametrize("which", ["gate_up", "down"])
def test_each_kernel_beside_the_other_paths(which):
    """One kernel on mma, the other on the GEMV: the shared intermediate rows, partial rows and counters agree."""
    x, gate_up, down, ids, weights, options = _case(6, 8, 4, 288, 160, interleaved=True, bias=True)
    tiles = _tiles(4, gate_up=which == "gate_up", down=which == "down")
    out = _run(x, gate_up, down, ids, weights, tiles, **options)
    assert_close(out, _reference(x, gate_up, down, ids, weights, **options), torch.bfloat16, what=which)


@on_hopper
def test_repeated_and_outside_ids():
    """A token naming one expert twice gets both slots; ids -1 and E add nothing; a token with no valid id is zero."""
    x, gate_up, down, ids, weights, options = _case(6, 8, 4, 288, 96, interleaved=True, bias=True)
    ids[0] = torch.tensor([3, 3, 5, -1])
    ids[1] = torch.tensor([8, -1, 2, 2])
    ids[2] = torch.tensor([-1, -1, 8, -5])
    out = _run(x, gate_up, down, ids, weights, _tiles(4), **options)
    assert_close(out, _reference(x, gate_up, down, ids, weights, **options), torch.bfloat16)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


@on_hopper
def test_nan_reaches_only_what_it_touches():
    """NaN in one token's x: that token's output only. A 0xFF scale code in one expert's gate/up row: NaN in every
    token that picked the expert, finite elsewhere."""
    x, gate_up, down, ids, weights, options = _case(8, 8, 2, 288, 96, interleaved=True, bias=False)
    x[3, 17] = float("nan")
    out = _run(x, gate_up, down, ids, weights, _tiles(4), **options)
    assert out[3].isnan().all() and not out[[0, 1, 2, 4, 5, 6, 7]].isnan().any()
    blocks, scales = gate_up
    scales = scales.clone()
    expert = int(ids[5, 0])
    scales[expert, 10, 2] = 255
    x[3, 17] = 0.0
    out = _run(x, (blocks, scales), down, ids, weights, _tiles(4), **options)
    picked = (ids == expert).any(dim=1)
    assert out[picked].isnan().any(dim=1).all() and not out[~picked].isnan().any()


@on_hopper
def test_cuda_graph_replay():
    x, gate_up, down, ids, weights, options = _case(4, 8, 4, 288, 96, interleaved=True, bias=True)
    want = _run(x, gate_up, down, ids, weights, _tiles(4), **options)
    graph, out = capture_cuda_graph(lambda: _run(x, gate_up, down, ids, weights, _tiles(4), **options))
    graph.replay()
    assert torch.equal(out, want)
