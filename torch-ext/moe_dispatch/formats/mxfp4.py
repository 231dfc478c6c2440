"""MXFP4 expert weights (OCP Microscaling, MX v1.0): the format as GPT-OSS checkpoints store it, its checks, a
quantizer and a dequantizer.

An MXFP4 weight [E, N, K] is stored as two tensors:

  blocks  uint8 [E, N, K/32, 16]  e2m1 values (4 bits: sign, 2 exponent bits, 1 mantissa bit), two per byte, the LOW
                                  nibble holding the even K index: byte j of a row holds values 2j (bits 0-3) and
                                  2j + 1 (bits 4-7). The same bytes viewed [E, N, K/2] are accepted too.
  scales  uint8 or torch.float8_e8m0fnu [E, N, K/32]
                                  one e8m0 scale per 32 consecutive values along K: code c means 2^(c - 127)
                                  (c = exponent + 127, no mantissa), c = 0xFF is NaN.

  w[e, n, k] = e2m1(blocks[e, n, k // 32, (k % 32) // 2] nibble k % 2) * 2^(scales[e, n, k // 32] - 127)

The 16 e2m1 codes: 0-7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and 8-15 the same with the sign bit set (8 is -0). e2m1 has no
inf or NaN; its largest value is 6 = 1.5 * 2^2.

For the gate/up weight N = 2F rows (GPT-OSS: gate and up rows alternating, `interleaved=True`) and K = H; for the down
weight N = H and K = F. Only this non-transposed layout ([E, N, K], K contiguous) exists for MXFP4: the bytes along K
are what a kernel loads, and the weights are never copied per call (`check_mxfp4_weight` refuses other strides).
"""

import math

import torch

from ..host.checks import check_tensor
from .fp8 import WeightScale
from .scale_codes import WeightScaleCode

MXFP4_GROUP = 32  # values per e8m0 scale, consecutive along K
E2M1_MAX = 6.0  # the largest e2m1 magnitude: 1.5 * 2^2
E8M0_BIAS = 127  # scale code c means 2^(c - E8M0_BIAS)
E8M0_NAN = 0xFF  # the one special e8m0 code: the whole group reads as NaN
SCALE_DTYPES = (torch.uint8, torch.float8_e8m0fnu)
BYTES_PER_GROUP = MXFP4_GROUP // 2  # 16: the last dimension of the 4-D blocks
QUANTIZE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# The value of each e2m1 code (index = the 4-bit code; bit 3 is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Rounding to e2m1: a magnitude above midpoint i (between codes i and i + 1) rounds to code i + 1 or beyond. At a
# midpoint itself the even code (even mantissa bit) wins: up where code i is odd (>=), down where it is even (>).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
# Quantize / dequantize whole experts a few at a time, at most this many values per chunk (2^25: ~0.5 GiB of float32
# and index temporaries), so a [128, 5760, 2880] weight on a GPU needs that much scratch, not several times its size.
_CHUNK_VALUES = 1 << 25


def is_mxfp4(tensor: object) -> bool:
    """A uint8 tensor: MXFP4 packed blocks are the only uint8 expert weights the package takes."""
    return isinstance(tensor, torch.Tensor) and tensor.dtype == torch.uint8


def mxfp4_k(blocks: torch.Tensor) -> int:
    """K, the unpacked values per row, of blocks [E, N, K/32, 16] or [E, N, K/2]."""
    if blocks.dim() == 4:
        return blocks.shape[2] * MXFP4_GROUP
    if blocks.dim() == 3:
        return blocks.shape[2] * 2
    raise ValueError(f"MXFP4 blocks must be [E, N, K/32, 16] or [E, N, K/2], got shape {tuple(blocks.shape)}")


def check_mxfp4_weight(name: str, blocks: torch.Tensor, scale_name: str, scale: torch.Tensor | None, *,
                       num_experts: int | None = None, rows: int | None = None, k: int | None = None,
                       rows_source: str | None = None, k_source: str | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """An MXFP4 weight (`blocks`, named `name`) and its e8m0 scale (named `scale_name`), checked; returns (blocks as a
    uint8 view [E, N, K/2], scale as a uint8 view [E, N, K/32]): views of the caller's tensors, never copies.

    blocks: uint8 [E, N, K/32, 16] or [E, N, K/2] with K a positive multiple of 32 and the bytes of a row contiguous
    (stride 1 along the last dimension, and 16 along K/32 in the 4-D form). scale: uint8 or float8_e8m0fnu
    [E, N, K/32], any strides. Given `num_experts`, `rows` or `k`, the weight's E, N or K must equal it;
    `rows_source` / `k_source` say where the expected value comes from in the message (k_source="hidden_states has H":
    "w_gate_up packs K = 2048 values per row but hidden_states has H = 2880")."""
    check_tensor(name, blocks)
    if blocks.dtype != torch.uint8:
        raise TypeError(f"{name} must be uint8 for MXFP4 (two e2m1 values per byte), got "
                        f"{str(blocks.dtype).replace('torch.', '')}")
    if blocks.dim() not in (3, 4):
        raise ValueError(f"{name} must be MXFP4 blocks [E, N, K/32, 16] or their bytes [E, N, K/2], got shape "
                         f"{tuple(blocks.shape)}")
    if blocks.dim() == 4 and blocks.shape[3] != BYTES_PER_GROUP:
        raise ValueError(f"{name} must be MXFP4 blocks [E, N, K/32, 16] (16 bytes: 32 e2m1 values per scale), got "
                         f"shape {tuple(blocks.shape)}")
    num_k = mxfp4_k(blocks)
    if num_k == 0 or num_k % MXFP4_GROUP:
        raise ValueError(f"{name} packs K = {num_k} values per row (shape {tuple(blocks.shape)}); MXFP4 needs K a "
                         f"positive multiple of {MXFP4_GROUP} (one scale per {MXFP4_GROUP} values)")
    if scale is None:
        raise ValueError(f"{name} holds MXFP4 blocks (uint8) but {scale_name} is missing: MXFP4 weights need their "
                         f"e8m0 scales (uint8 or float8_e8m0fnu [E, N, K/32])")
    check_tensor(scale_name, scale)
    if scale.dtype not in SCALE_DTYPES:
        raise TypeError(f"{scale_name} must be e8m0 scales of dtype uint8 or float8_e8m0fnu (code c means "
                        f"2^(c - 127)), got {str(scale.dtype).replace('torch.', '')}")
    num_experts_w, num_rows = blocks.shape[:2]
    expected = (num_experts_w, num_rows, num_k // MXFP4_GROUP)
    if tuple(scale.shape) != expected:
        raise ValueError(f"{scale_name} has shape {tuple(scale.shape)} but {name} {tuple(blocks.shape)} (E, N, K = "
                         f"{num_experts_w}, {num_rows}, {num_k}) needs {expected}: one scale per {MXFP4_GROUP} "
                         f"values along K")
    if num_experts is not None and num_experts_w != num_experts:
        raise ValueError(f"{name} holds E = {num_experts_w} experts but num_experts = {num_experts}")
    if rows is not None and num_rows != rows:
        raise ValueError(f"{name} has N = {num_rows} rows per expert but "
                         + (f"{rows_source} = {rows}" if rows_source else f"{rows} were expected"))
    if k is not None and num_k != k:
        raise ValueError(f"{name} packs K = {num_k} values per row but "
                         + (f"{k_source} = {k}" if k_source else f"K = {k} was expected"))
    if blocks.stride(-1) != 1 or (blocks.dim() == 4 and blocks.stride(2) != BYTES_PER_GROUP):
        raise ValueError(f"{name} must have the bytes of each row contiguous along K (strides (..., 16, 1) for "
                         f"[E, N, K/32, 16], (..., 1) for [E, N, K/2]), got strides {blocks.stride()}; MXFP4 weights "
                         f"are never copied per call: store them as the checkpoint does ([E, N, K] with K last)")
    packed = blocks.view(num_experts_w, num_rows, num_k // 2)
    return packed, scale.view(torch.uint8)


def mxfp4_weight_scale(scale: torch.Tensor, *, up_row_offset: int = 0) -> WeightScale:
    """How the GEMMs read the uint8 e8m0 codes [E, N, K/32] of an MXFP4 weight used as [E, n, K] (a view of it:
    column j is row j, + up_row_offset for the up half of concatenated gate/up rows)."""
    return WeightScale(scale, WeightScaleCode.MXFP4, scale.stride(), 1, MXFP4_GROUP, 1, up_row_offset)


def _pow2(exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2^exponent for integer exponents in [-127, 127], exactly on every device (float32 holds 2^-127 as a subnormal):
    written as float64 bits, then converted to `dtype`."""
    bits = (exponent.to(torch.int64) + 1023) << 52
    return bits.view(torch.float64).to(dtype)


def _scale_factors(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2^(code - 127) in `dtype` (float32 or float64), NaN for code 0xFF."""
    codes = codes.to(torch.int32)
    factors = _pow2(codes.clamp(max=E8M0_NAN - 1) - E8M0_BIAS, dtype)
    return torch.where(codes == E8M0_NAN, math.nan, factors)


def _experts_per_chunk(shape: torch.Size) -> int:
    per_expert = max(1, math.prod(shape[1:]))
    return max(1, _CHUNK_VALUES // per_expert)


def _quantize_groups(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """groups [..., 32] (float32 or float64) -> (e2m1 codes uint8 [..., 32], scale codes uint8 [...])."""
    finite = torch.isfinite(groups).all(dim=-1)
    amax = torch.where(torch.isfinite(groups), groups.abs(), 0.0).amax(dim=-1)
    # frexp: amax = m * 2^p with m in [0.5, 1), so floor(log2(amax)) = p - 1 exactly (subnormals included).
    floor_log2 = torch.frexp(amax).exponent.to(torch.int32) - 1
    exponent = (floor_log2 - 2).clamp(-E8M0_BIAS, E8M0_BIAS)  # the group's largest value lands in [4, 8)
    exponent = torch.where(amax > 0, exponent, -E8M0_BIAS)  # an all-zero group: code 0
    scaled = groups * _pow2(-exponent, groups.dtype)[..., None]  # exact: a power of two
    magnitude = scaled.abs()
    codes = torch.zeros(groups.shape, dtype=torch.uint8, device=groups.device)
    for midpoint, ties_up in _MIDPOINTS:  # beyond the last one (5) everything saturates to code 7 (6)
        codes += (magnitude >= midpoint) if ties_up else (magnitude > midpoint)
    codes |= torch.signbit(scaled).to(torch.uint8) << 3
    codes = torch.where(finite[..., None], codes, 0)
    scale_codes = torch.where(finite, exponent + E8M0_BIAS, E8M0_NAN).to(torch.uint8)
    return codes, scale_codes


@torch.no_grad()
def quantize_experts_mxfp4(w: torch.Tensor, *, scale_dtype: torch.dtype = torch.uint8
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize expert weights w [E, N, K] (float16, bfloat16, float32 or float64; K a multiple of 32) to MXFP4 ->
    (blocks uint8 [E, N, K/32, 16], scales [E, N, K/32] of `scale_dtype`, uint8 or float8_e8m0fnu), on w's device.

    Per group of 32 consecutive values along K (in float32, float64 for a float64 w: exact either way):
    - the shared exponent is floor(log2(amax)) - 2 (e2m1's largest exponent is 2), clamped to e8m0's [-127, 127], so
      the group's largest magnitude lands in [4, 8) before rounding;
    - each value / 2^exponent rounds to the nearest e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6), ties to the even
      mantissa (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), and saturates to +-6 (a
      largest value in (6, 8) * 2^exponent becomes 6 * 2^exponent: the OCP spec's rounding, no exponent bump). The
      sign is kept, so a small negative value becomes -0;
    - an all-zero group gets scale code 0 (2^-127) and +0 values;
    - a group holding a NaN or +-inf gets scale code 0xFF and zero codes: the whole group dequantizes to NaN. e2m1 has
      no inf or NaN and e8m0's only special value is NaN, so a non-finite weight cannot be stored alone; marking its
      group keeps it from turning silently into a finite weight (as a non-finite bf16 weight stays non-finite in the
      forward), at the price of its 31 neighbours (the FP8 quantizer, whose format has NaN, spoils only the value).
    """
    check_tensor("w", w, ndim=3, dtypes=QUANTIZE_DTYPES)
    if not isinstance(scale_dtype, torch.dtype) or scale_dtype not in SCALE_DTYPES:
        raise TypeError(f"scale_dtype must be torch.uint8 or torch.float8_e8m0fnu, got {scale_dtype!r}")
    num_experts, num_rows, num_k = w.shape
    if num_k % MXFP4_GROUP:
        raise ValueError(f"w has K = {num_k} values per row (shape {tuple(w.shape)}); MXFP4 needs K a multiple of "
                         f"{MXFP4_GROUP} (one scale per {MXFP4_GROUP} values)")
    work_dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
    num_groups = num_k // MXFP4_GROUP
    blocks = torch.empty(num_experts, num_rows, num_groups, BYTES_PER_GROUP, dtype=torch.uint8, device=w.device)
    scales = torch.empty(num_experts, num_rows, num_groups, dtype=torch.uint8, device=w.device)
    step = _experts_per_chunk(w.shape)
    for start in range(0, num_experts, step):
        chunk = w[start:start + step].detach().to(work_dtype)
        codes, scale_codes = _quantize_groups(chunk.reshape(*chunk.shape[:2], num_groups, MXFP4_GROUP))
        blocks[start:start + step] = codes[..., 0::2] | (codes[..., 1::2] << 4)  # low nibble: the even K index
        scales[start:start + step] = scale_codes
    return blocks, scales.view(scale_dtype)


@torch.no_grad()
def dequantize_experts_mxfp4(blocks: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
                             ) -> torch.Tensor:
    """MXFP4 blocks ([E, N, K/32, 16] or [E, N, K/2] uint8) and their e8m0 scales ([E, N, K/32], uint8 or
    float8_e8m0fnu) -> w [E, N, K] in `dtype`: each e2m1 value times 2^(code - 127) of its group, NaN for the whole
    group where the code is 0xFF. Computed in float32 (float64 for dtype float64), then converted: a value beyond
    `dtype`'s range (6 * 2^127 with code 254) becomes inf."""
    packed, codes = check_mxfp4_weight("blocks", blocks, "scale", scale)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype!r}")
    work_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    num_experts, num_rows, half_k = packed.shape
    values = torch.tensor(E2M1_VALUES, dtype=work_dtype, device=packed.device)
    out = torch.empty(num_experts, num_rows, half_k * 2, dtype=dtype, device=packed.device)
    step = _experts_per_chunk(out.shape)
    for start in range(0, num_experts, step):
        chunk = packed[start:start + step]
        nibbles = torch.stack((chunk & 0xF, chunk >> 4), dim=-1).to(torch.int64)  # [e, N, K/2, 2]: even K first
        w = values[nibbles].reshape(*chunk.shape[:2], -1, MXFP4_GROUP)  # [e, N, K/32, 32]
        w = w * _scale_factors(codes[start:start + step], work_dtype)[..., None]
        out[start:start + step] = w.reshape(*chunk.shape[:2], -1).to(dtype)
    return out
