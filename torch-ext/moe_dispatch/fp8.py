"""FP8 expert weights: the formats, a quantizer for them, and the checks and launch facts the GEMMs need.

An FP8 expert weight is a float8 tensor (`float8_e4m3fn`, or `float8_e4m3fnuz` on AMD MI300X) of the bf16 weight's
shape, with fp32 scales in the `weight_scale_inv` convention of DeepSeek-V3 and transformers' `FP8Experts`:
w ≈ w_fp8 * scale. For a weight stored as [E, d1, d2] the scheme is read from the scale's shape:

  scale [E, ceil(d1/b1), ceil(d2/b2)]   "block"    one scale per (b1, b2) block of the stored weight (block_shape)
  scale [E, N]                          "channel"  one scale per output channel (N = output size of the projection)
  scale [E]                             "tensor"   one scale per expert

What runs (see `_device.py`): the portable path everywhere. The grouped GEMM loads the fp8 weight tile, converts it
to the activation dtype and runs the dot in that dtype with fp32 accumulation; block scales multiply the tile in fp32
before that conversion (each element by the scale of the block it lies in, so any tile shape and any weight shape
work), per-channel and per-tensor scales multiply the fp32 accumulator once after the K loop (the fp8 values are
exact in bf16/fp16, so those two schemes add no rounding of their own). Activations stay bf16/fp16/fp32: this is
weight-only FP8 (half the weight bytes of bf16 at decode, the dot at the activation dtype's rate).

Not built yet: the FP8 tensor-core path (w8a8) for GPUs where `has_fp8_tensor_cores` holds. It would plug in as one
more `WEIGHT_SCALE` variant of `_grouped_gemm_kernel`: GEMM1 quantizes each gathered activation row per 128-column
group in its prologue (fp32 scale per token and group), runs `tl.dot` on two fp8 tiles with BLOCK_K dividing the
block size, and multiplies each K step's partial sum by (activation group scale x weight block scale); its epilogue
quantizes the intermediate per token and group for GEMM2, which runs the same loop. `expert_gemm` would pick it from
the device facts and the scale scheme; the public API (weights, scales, `fp8_block_shape`) stays as it is.
"""

import dataclasses
import math

import torch

from ._checks import check_tensor

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
SCHEMES = ("block", "channel", "tensor")
# `WEIGHT_SCALE` constexpr of the grouped GEMM: 0 is a float weight without scales.
SCHEME_CODES = {"tensor": 1, "channel": 2, "block": 3}


def is_fp8(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.dtype in FP8_DTYPES


def check_block_shape(block_shape):
    if (not isinstance(block_shape, (tuple, list)) or len(block_shape) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block_shape)):
        raise ValueError(f"fp8_block_shape must be two positive ints, got {block_shape!r}")
    return tuple(block_shape)


def scale_shape(weight_shape, scheme, block_shape=(128, 128), *, n_axis=1):
    """Expected scale shape of an [E, d1, d2] weight under `scheme`; `n_axis` is the output (N) axis (1, or 2 for a
    transposed weight)."""
    E, d1, d2 = weight_shape
    if scheme == "block":
        b1, b2 = block_shape
        return (E, math.ceil(d1 / b1), math.ceil(d2 / b2))
    if scheme == "channel":
        return (E, weight_shape[n_axis])
    return (E,)


def infer_scheme(scale) -> str:
    """The scheme a scale's rank names: 3 block, 2 channel, 1 tensor."""
    return {3: "block", 2: "channel", 1: "tensor"}.get(scale.dim(), "unknown")


def check_fp8_weight(name, weight, scale_name, scale, block_shape, *, n_axis=1):
    """A weight and its optional scale: float8 needs an fp32 scale of a matching shape, a float weight takes none.
    Returns the scheme ("block", "channel", "tensor") or None for a float weight."""
    if not is_fp8(weight):
        if scale is not None:
            raise ValueError(f"{scale_name} was given but {name} has dtype {weight.dtype}; scales go with float8 "
                             f"weights ({', '.join(str(d) for d in FP8_DTYPES)}) only")
        return None
    if scale is None:
        raise ValueError(f"{name} is {weight.dtype} but {scale_name} is missing: float8 weights need their fp32 scales")
    check_tensor(scale_name, scale)
    if scale.dtype != torch.float32:
        raise TypeError(f"{scale_name} must be float32 (w ≈ w_fp8 * scale), got {scale.dtype}")
    scheme = infer_scheme(scale)
    if scheme == "unknown":
        raise ValueError(f"{scale_name} must have 1 (tensor), 2 (channel) or 3 (block) dimensions, got shape "
                         f"{tuple(scale.shape)}")
    expected = scale_shape(weight.shape, scheme, block_shape, n_axis=n_axis)
    if tuple(scale.shape) != expected:
        extra = f" with fp8_block_shape {tuple(block_shape)}" if scheme == "block" else ""
        raise ValueError(f"{scale_name} has shape {tuple(scale.shape)} but {name} {tuple(weight.shape)} needs "
                         f"{expected} for {scheme} scales{extra}")
    return scheme


@dataclasses.dataclass(frozen=True)
class WeightScale:
    """How the grouped GEMM reads the scales of an fp8 weight used as [E, n, K] (possibly a gate or up view).

    The scale is addressed in the coordinates of the unsplit weight it belongs to: output column j of the view is
    row `j * row_step + row_offset` of that weight (row_offset is the up half's: gate views start at 0); block
    scales then divide by `block_n` / `block_k`. `strides` are (e, n, k) of the scale, n and k 0 where absent."""

    scale: torch.Tensor
    code: int
    strides: tuple
    block_n: int = 1
    block_k: int = 1
    row_step: int = 1
    up_row_offset: int = 0

    @classmethod
    def of(cls, scale, scheme, block_shape, *, transposed, row_step=1, up_row_offset=0):
        if scheme == "block":
            stride_e, stride_1, stride_2 = scale.stride()
            block_n, block_k = (block_shape[1], block_shape[0]) if transposed else block_shape
            strides = (stride_e, stride_2, stride_1) if transposed else (stride_e, stride_1, stride_2)
            return cls(scale, SCHEME_CODES[scheme], strides, block_n, block_k, row_step, up_row_offset)
        if scheme == "channel":
            return cls(scale, SCHEME_CODES[scheme], (scale.stride(0), scale.stride(1), 0), 1, 1, row_step,
                       up_row_offset)
        return cls(scale, SCHEME_CODES[scheme], (scale.stride(0), 0, 0))


def fp8_max(dtype) -> float:
    return float(torch.finfo(dtype).max)


def _check_quantize_args(w, scheme, block_shape, dtype):
    check_tensor("w", w, ndim=3)
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {list(SCHEMES)}, got {scheme!r}")
    if dtype not in FP8_DTYPES:
        raise TypeError(f"dtype must be one of {FP8_DTYPES}, got {dtype}")
    return check_block_shape(block_shape)


def _block_view(t, block_shape):
    """[E, d1, d2] zero-padded to whole blocks and viewed as [E, n1, b1, n2, b2]."""
    E, d1, d2 = t.shape
    b1, b2 = block_shape
    n1, n2 = math.ceil(d1 / b1), math.ceil(d2 / b2)
    padded = torch.nn.functional.pad(t, (0, n2 * b2 - d2, 0, n1 * b1 - d1))
    return padded.view(E, n1, b1, n2, b2)


def _expand_scale(scale, scheme, shape, block_shape, n_axis=1):
    """The scale broadcast to every element of a weight of `shape` [E, d1, d2]."""
    E, d1, d2 = shape
    if scheme == "block":
        b1, b2 = block_shape
        return scale.repeat_interleave(b1, dim=1)[:, :d1].repeat_interleave(b2, dim=2)[:, :, :d2]
    if scheme == "channel":
        return scale[:, :, None] if n_axis == 1 else scale[:, None, :]
    return scale[:, None, None]


@torch.no_grad()
def quantize_experts_fp8(w, scheme="block", *, block_shape=(128, 128), dtype=torch.float8_e4m3fn, n_axis=1):
    """Quantize expert weights w [E, d1, d2] (any float dtype) -> (w_fp8 of `dtype`, scale fp32) with w ≈ w_fp8 * scale.

    scheme "block": scale [E, ceil(d1/b1), ceil(d2/b2)] for block_shape (b1, b2) (the weight's trailing partial blocks
    get their own scale); "channel": scale [E, N] with N = w.shape[n_axis] (1 for the transformers layout [E, N, K],
    2 for a transposed [E, K, N] weight); "tensor": scale [E]. Each scale is amax / fp8 max of its group (1 for an
    all-zero group), so the largest value of a group maps onto the largest fp8 value.
    """
    block_shape = _check_quantize_args(w, scheme, block_shape, dtype)
    if n_axis not in (1, 2):
        raise ValueError(f"n_axis must be 1 or 2, got {n_axis!r}")
    w32 = w.detach().to(torch.float32)
    if scheme == "block":
        amax = _block_view(w32.abs(), block_shape).amax(dim=(2, 4))
    elif scheme == "channel":
        amax = w32.abs().amax(dim=3 - n_axis)
    else:
        amax = w32.abs().amax(dim=(1, 2))
    scale = torch.where(amax > 0, amax / fp8_max(dtype), torch.ones_like(amax))
    limit = fp8_max(dtype)
    q = (w32 / _expand_scale(scale, scheme, w.shape, block_shape, n_axis)).clamp(-limit, limit)
    return q.to(dtype), scale.contiguous()


def dequantize_experts_fp8(w_fp8, scale, scheme=None, block_shape=(128, 128), *, dtype=torch.float32, n_axis=1):
    """w_fp8 * scale (each element times the scale of its block, channel or expert) in `dtype`. `scheme` defaults to
    the one the scale's rank names; `n_axis` as in `quantize_experts_fp8`."""
    block_shape = check_block_shape(block_shape)
    inferred = check_fp8_weight("w_fp8", w_fp8, "scale", scale, block_shape, n_axis=n_axis)
    if scheme is not None and scheme != inferred:
        raise ValueError(f"scheme={scheme!r} but scale has shape {tuple(scale.shape)}, the shape of {inferred} scales")
    scheme = inferred
    expanded = _expand_scale(scale, scheme, w_fp8.shape, block_shape, n_axis)
    return (w_fp8.to(torch.float32) * expanded).to(dtype)
