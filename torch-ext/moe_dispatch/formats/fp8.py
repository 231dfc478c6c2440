"""FP8 expert weights: the formats, a quantizer for them, and the checks and launch facts the GEMMs need.

An FP8 expert weight is a float8 tensor (`float8_e4m3fn`, or `float8_e4m3fnuz` on AMD MI300X) of the bf16 weight's
shape, with fp32 scales in the `weight_scale_inv` convention of DeepSeek-V3 and transformers' `FP8Experts`:
w ≈ w_fp8 * scale. For a weight stored as [E, d1, d2] the scheme is read from the scale's shape:

  scale [E, ceil(d1/b1), ceil(d2/b2)]   "block"    one scale per (b1, b2) block of the stored weight (block_shape)
  scale [E, N]                          "channel"  one scale per output channel (N = output size of the projection)
  scale [E]                             "tensor"   one scale per expert

Block scales of the fused gate/up weight (2F rows, gate's then up's) come in two layouts, named by
`w_gate_up_scale_layout` and never guessed from shapes (where F is not a multiple of the block's N side b they
differ, even where their shapes agree, as at F = 96, b = 128):

  "fused"   ceil(2F/b) row blocks over the 2F rows as stored (the fused weight quantized as one; the default)
  "merged"  2 * ceil(F/b) row blocks: gate's ceil(F/b), then up's, each over its own F rows (a checkpoint's separate
            gate and up scales stacked, as transformers merges them); concatenated gate/up rows only

Two ways to compute with them (`fp8_compute`, chosen by planner.choose_fp8_compute from device facts, `host/device.py`):

  "dequant"  every device that loads the weights' float8 type (NVIDIA from SM89, AMD, the CPU interpreter; before
             SM89 Triton has no e4m3 type, and `check_fp8_dtype_on_device` refuses the weights). The grouped GEMM
             (gemm/grouped.py, WEIGHT_SCALE) loads the fp8 weight tile, converts it to the activation dtype and runs
             the dot in that dtype with fp32 accumulation; block scales multiply the tile in fp32 before that
             conversion (each element by the scale of its block, so any tile and weight shape work), per-channel and
             per-tensor scales multiply the fp32 accumulator once after the K loop. Activations stay
             bf16/fp16/fp32: weight-only FP8 (half the weight bytes of bf16 at decode, the dot at the activation
             dtype's rate).
  "w8a8"     float8_e4m3fn weights on GPUs with FP8 tensor cores (NVIDIA SM89+; `has_fp8_tensor_cores`). Activations
             are quantized to e4m3 too and both GEMMs run fp8 x fp8 dots with fp32 sums (gemm/w8a8.py): x per token
             and K step (in GEMM1's loads, or one pass first for prefill tiles), the intermediate per row and K step
             of GEMM2 in GEMM1's epilogue.
             It needs the K side of a block scale to be a power of two >= 32 (one weight scale per K step);
             other block shapes, float8_e4m3fnuz (AMD MI300X) and devices without FP8 tensor cores take "dequant".

"auto" (the default) picks "w8a8" where it can run and "dequant" everywhere else; forcing "w8a8" where it cannot run
raises a ValueError that says why. Static activation scales (`gate_up_input_scale`, `down_input_scale`: the
checkpoint's per-tensor or per-expert `input_scale`, x ≈ x_fp8 * input_scale) replace the dynamic ones in "w8a8";
"dequant" does not quantize activations and ignores them.
"""

import dataclasses
import math
from collections.abc import Callable, Collection, Sequence
from typing import Literal

import torch

from ..host.checks import check_choice, check_int, check_tensor
from ..host.device import FP8_MIN_CAPABILITY, capability, has_fp8_tensor_cores, is_cuda, is_hip, on_gpu
from .scale_codes import WeightScaleCode

# Every float8 dtype of weights the package takes (NVIDIA's e4m3fn, AMD's e4m3fnuz): what `is_fp8` recognizes.
# W8A8_DTYPE below is the one the FP8 tensor cores take.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
# Scales of float8 weights: fp32, or e8m0 powers of two (DeepSeek-V3.1-style UE8M0 checkpoints, DeepGEMM), which the
# kernels read as their uint8 codes (`kernel_scale`, gemm.jit.scale_values)
WEIGHT_SCALE_DTYPES = (torch.float32, torch.float8_e8m0fnu)
SCHEMES = ("block", "channel", "tensor")
# The WEIGHT_SCALE code of each scheme (scale_codes.WeightScaleCode; float weights have NONE).
SCHEME_CODES = {"tensor": WeightScaleCode.TENSOR, "channel": WeightScaleCode.CHANNEL, "block": WeightScaleCode.BLOCK}
FP8_COMPUTE = ("auto", "w8a8", "dequant")
DEFAULT_FP8_BLOCK_SHAPE = (128, 128)  # (N side, K side) of a block scale: DeepSeek-V3 / Qwen3-FP8 `weight_block_size`
GATE_UP_SCALE_LAYOUTS = ("fused", "merged")  # `w_gate_up_scale_layout` (module docstring)
W8A8_DTYPE = torch.float8_e4m3fn  # the operand type of NVIDIA's FP8 tensor cores (Triton's fp8e4nv)
# Smallest K step of an fp8 x fp8 tensor-core dot (the K of one e4m3 MMA instruction on SM89 / SM90).
W8A8_MIN_GROUP = 32


def is_fp8(tensor: object) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.dtype in FP8_DTYPES


def check_block_shape(block_shape: tuple[int, int] | list[int], name: str = "fp8_block_shape") -> tuple[int, int]:
    """Two positive ints (a tuple or a list); `name` is the caller's argument (`fused_experts`' fp8_block_shape, the
    quantizers' block_shape)."""
    if (not isinstance(block_shape, (tuple, list)) or len(block_shape) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block_shape)):
        raise ValueError(f"{name} must be two positive ints, got {block_shape!r}")
    return tuple(block_shape)


def check_n_axis(n_axis: int) -> int:
    """The quantizers' `n_axis`: the int 1 or 2 (not True, not 1.0)."""
    check_int("n_axis", n_axis, 1)
    if n_axis not in (1, 2):
        raise ValueError(f"n_axis must be 1 or 2, got {n_axis!r}")
    return n_axis


def scale_shape(weight_shape: Sequence[int], scheme: Literal["block", "channel", "tensor"],
                block_shape: tuple[int, int] | list[int] = DEFAULT_FP8_BLOCK_SHAPE, *, n_axis: Literal[1, 2] = 1,
                gate_up_layout: Literal["fused", "merged"] = "fused") -> tuple[int, ...]:
    """Expected scale shape of an [E, d1, d2] weight under `scheme`; `n_axis` is the output (N) axis (1, or 2 for a
    transposed weight). `gate_up_layout` "merged": block scales of a gate/up weight (N = 2F) as two halves of
    ceil(F/b) blocks each (module docstring)."""
    E, d1, d2 = weight_shape
    if scheme == "block":
        b1, b2 = block_shape
        shape = [E, math.ceil(d1 / b1), math.ceil(d2 / b2)]
        if gate_up_layout == "merged":
            shape[n_axis] = 2 * math.ceil(weight_shape[n_axis] // 2 / block_shape[n_axis - 1])
        return tuple(shape)
    if scheme == "channel":
        return (E, weight_shape[n_axis])
    return (E,)


def infer_scheme(scale: torch.Tensor) -> Literal["block", "channel", "tensor", "unknown"]:
    """The scheme a scale's rank names: 3 block, 2 channel, 1 tensor."""
    return {3: "block", 2: "channel", 1: "tensor"}.get(scale.dim(), "unknown")


def check_fp8_weight(name: str, weight: torch.Tensor, scale_name: str, scale: torch.Tensor | None,
                     block_shape: tuple[int, int] | list[int], *, n_axis: Literal[1, 2] = 1,
                     gate_up_layout: Literal["fused", "merged"] | None = None, block_name: str = "fp8_block_shape"
                     ) -> Literal["block", "channel", "tensor"] | None:
    """A weight and its optional scale: float8 needs an fp32 scale of a matching shape, a float weight takes none.
    `gate_up_layout`: the `w_gate_up_scale_layout` of a gate/up weight's scale (None for other weights). Returns the
    scheme ("block", "channel", "tensor") or None for a float weight."""
    check_tensor(name, weight)
    if scale is not None:
        check_tensor(scale_name, scale)
    if not is_fp8(weight):
        if scale is not None:
            raise ValueError(f"{scale_name} was given but {name} has dtype {weight.dtype}; scales go with float8 "
                             f"weights ({', '.join(str(d) for d in FP8_DTYPES)}) only")
        return None
    if scale is None:
        raise ValueError(f"{name} is {weight.dtype} but {scale_name} is missing: float8 weights need their fp32 scales")
    if scale.dtype not in WEIGHT_SCALE_DTYPES:
        raise TypeError(f"{scale_name} must be float32 or float8_e8m0fnu (w ≈ w_fp8 * scale), got {scale.dtype}")
    scheme = infer_scheme(scale)
    if scheme == "unknown":
        raise ValueError(f"{scale_name} must have 1 (tensor), 2 (channel) or 3 (block) dimensions, got shape "
                         f"{tuple(scale.shape)}")
    expected = scale_shape(weight.shape, scheme, block_shape, n_axis=n_axis, gate_up_layout=gate_up_layout or "fused")
    if tuple(scale.shape) != expected:
        extra = f" with {block_name} {tuple(block_shape)}" if scheme == "block" else ""
        if gate_up_layout is not None and scheme == "block":
            extra += f" and w_gate_up_scale_layout={gate_up_layout!r}"
            other = "merged" if gate_up_layout == "fused" else "fused"
            if tuple(scale.shape) == scale_shape(weight.shape, scheme, block_shape, n_axis=n_axis,
                                                 gate_up_layout=other):
                extra += f" (its shape is that of w_gate_up_scale_layout={other!r})"
        raise ValueError(f"{scale_name} has shape {tuple(scale.shape)} but {name} {tuple(weight.shape)} needs "
                         f"{expected} for {scheme} scales{extra}")
    return scheme


def check_gate_up_scale_layout(layout: Literal["fused", "merged"], interleaved: bool,
                               scale: torch.Tensor | None) -> None:
    """`w_gate_up_scale_layout`: one of GATE_UP_SCALE_LAYOUTS; "merged" stacks the halves' own scales, which
    interleaved gate/up rows do not have."""
    check_choice("w_gate_up_scale_layout", layout, GATE_UP_SCALE_LAYOUTS)
    if layout == "merged" and interleaved and scale is not None:
        raise ValueError("w_gate_up_scale_layout='merged' (gate's scales, then up's) needs concatenated gate/up rows; "
                         "with interleaved=True pass the scales of the weight as stored (w_gate_up_scale_layout="
                         "'fused')")


def gate_up_row_offset(num_ffn: int, scheme: Literal["block", "channel", "tensor"],
                       block_shape: tuple[int, int] | list[int], *, transposed: bool,
                       layout: Literal["fused", "merged"]) -> int:
    """The row of w_gate_up's scales where the up half (concatenated rows) starts, in the unsplit weight's row
    coordinates (WeightScale.up_row_offset): F; merged block scales, F rounded up to whole blocks of N, so that up's
    row j reads block ceil(F/b) + j // b."""
    if layout == "merged" and scheme == "block":
        block_n = block_shape[1] if transposed else block_shape[0]
        return math.ceil(num_ffn / block_n) * block_n
    return num_ffn


def check_fp8_dtype_on_device(name: str, weight: torch.Tensor, device: torch.device) -> None:
    """A float8 type Triton cannot load on `device` is refused naming the weight rather than failing in the compiler:
    float8_e4m3fnuz (AMD's format) on NVIDIA GPUs (the H200 failed to compile the dequant loads), and float8_e4m3fn
    on NVIDIA GPUs before compute capability 8.9 (SM80: "type fp8e4nv not supported in this architecture", every
    kernel that reads it; docs/results/compile-targets.md)."""
    if weight.dtype == torch.float8_e4m3fnuz and on_gpu(device) and not is_hip():
        raise TypeError(f"{name} is torch.float8_e4m3fnuz, AMD's float8 format, which Triton cannot load on NVIDIA "
                        f"GPUs; pass torch.float8_e4m3fn weights (`host.device.fp8_dtype(device)` names the format of "
                        f"a device; quantize_experts_fp8 writes either)")
    if weight.dtype == torch.float8_e4m3fn and on_gpu(device) and is_cuda() and capability(device) < FP8_MIN_CAPABILITY:
        major, minor = capability(device)
        raise TypeError(f"{name} is torch.float8_e4m3fn, which Triton cannot load on NVIDIA GPUs before compute "
                        f"capability 8.9 ({device} has {major}.{minor}); pass the weights dequantized "
                        f"(dequantize_experts_fp8) in the activations' dtype")


@dataclasses.dataclass(frozen=True)
class WeightScale:
    """How the grouped GEMM reads the scales of an fp8 weight used as [E, n, K] (possibly a gate or up view).

    The scale is addressed in the coordinates of the unsplit weight it belongs to: output column j of the view is
    row `j * row_step + row_offset` of that weight (row_offset is the up half's: gate views start at 0); block
    scales then divide by `block_n` / `block_k`. `strides` are (e, n, k) of the scale, n and k 0 where absent."""

    scale: torch.Tensor
    code: WeightScaleCode  # SCHEME_CODES[scheme]
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


def kernel_scale(scale: torch.Tensor | None) -> torch.Tensor | None:
    """A weight scale as the kernels take it: float32 as it is, float8_e8m0fnu as its uint8 codes (a view)."""
    if scale is not None and scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    return scale


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def _check_quantize_args(w, scheme, block_shape, dtype):
    check_tensor("w", w, ndim=3)
    check_choice("scheme", scheme, SCHEMES)
    if not isinstance(dtype, torch.dtype) or dtype not in FP8_DTYPES:
        raise TypeError(f"dtype must be one of {FP8_DTYPES}, got {dtype!r}")
    return check_block_shape(block_shape, "block_shape")


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
def quantize_experts_fp8(w: torch.Tensor, scheme: Literal["block", "channel", "tensor"] = "block", *,
                         block_shape: tuple[int, int] | list[int] = DEFAULT_FP8_BLOCK_SHAPE,
                         dtype: torch.dtype = torch.float8_e4m3fn,
                         n_axis: Literal[1, 2] = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize expert weights w [E, d1, d2] (any float dtype) -> (w_fp8 of `dtype`, scale fp32) with w ≈ w_fp8 * scale.

    scheme "block": scale [E, ceil(d1/b1), ceil(d2/b2)] for block_shape (b1, b2) (the weight's trailing partial blocks
    get their own scale); "channel": scale [E, N] with N = w.shape[n_axis] (1 for the transformers layout [E, N, K],
    2 for a transposed [E, K, N] weight); "tensor": scale [E]. Each scale is amax / fp8 max of its group's finite
    values (1 for a group without a nonzero one), so the largest value of a group maps onto the largest fp8 value. A
    NaN or +-inf weight becomes NaN alone (the float8 formats have no inf), as it stays non-finite in bf16; the rest of
    its group keeps its scale.
    """
    block_shape = _check_quantize_args(w, scheme, block_shape, dtype)
    check_n_axis(n_axis)
    w32 = w.detach().to(torch.float32)
    finite = torch.isfinite(w32)
    magnitude = torch.where(finite, w32.abs(), 0.0)
    if scheme == "block":
        amax = _block_view(magnitude, block_shape).amax(dim=(2, 4))
    elif scheme == "channel":
        amax = magnitude.amax(dim=3 - n_axis)
    else:
        amax = magnitude.amax(dim=(1, 2))
    scale = torch.where(amax > 0, amax / fp8_max(dtype), torch.ones_like(amax))
    limit = fp8_max(dtype)
    q = (w32 / _expand_scale(scale, scheme, w.shape, block_shape, n_axis)).clamp(-limit, limit)
    q = torch.where(finite, q, float("nan"))
    return q.to(dtype), scale.contiguous()


def dequantize_experts_fp8(w_fp8: torch.Tensor, scale: torch.Tensor,
                           scheme: Literal["block", "channel", "tensor"] | None = None,
                           block_shape: tuple[int, int] | list[int] = DEFAULT_FP8_BLOCK_SHAPE, *,
                           dtype: torch.dtype = torch.float32,
                           n_axis: Literal[1, 2] = 1) -> torch.Tensor:
    """w_fp8 * scale (each element times the scale of its block, channel or expert) in `dtype`. `scheme` defaults to
    the one the scale's rank names; `n_axis` as in `quantize_experts_fp8`."""
    check_tensor("w_fp8", w_fp8, ndim=3)
    check_tensor("scale", scale)
    if scheme is not None:
        check_choice("scheme", scheme, SCHEMES)
    block_shape = check_block_shape(block_shape, "block_shape")
    check_n_axis(n_axis)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype!r}")
    inferred = check_fp8_weight("w_fp8", w_fp8, "scale", scale, block_shape, n_axis=n_axis, block_name="block_shape")
    if scheme is not None and scheme != inferred:
        raise ValueError(f"scheme={scheme!r} but scale has shape {tuple(scale.shape)}, the shape of {inferred} scales")
    scheme = inferred
    expanded = _expand_scale(scale, scheme, w_fp8.shape, block_shape, n_axis)
    return (w_fp8.to(torch.float32) * expanded).to(dtype)


def k_block(block_shape: Sequence[int], transposed: bool) -> int:
    """The K side of a block shape: weights are stored [E, n, K] (block_shape[1]) or, transposed, [E, K, n]
    (block_shape[0])."""
    return block_shape[0] if transposed else block_shape[1]


def w8a8_refusal(device: torch.device, weights: dict[str, torch.Tensor], schemes: Collection[str],
                 block_shape: Sequence[int], transposed: bool) -> str | None:
    """Why "w8a8" cannot run these weights on `device` (a sentence), or None when it can. The CPU (Triton's
    interpreter) runs it when asked, so the tests can check it; "auto" still takes "dequant" there."""
    for name, weight in weights.items():
        if not is_fp8(weight):
            return f"{name} has dtype {weight.dtype}; w8a8 needs both expert weights in float8"
        if weight.dtype != W8A8_DTYPE:
            return (f"{name} is {weight.dtype}; w8a8 runs {W8A8_DTYPE} (NVIDIA's FP8 tensor cores), "
                    f"float8_e4m3fnuz weights (AMD MI300X) run the dequant path")
    if "block" in schemes:
        side = k_block(block_shape, transposed)
        if side < W8A8_MIN_GROUP or side & (side - 1):
            return (f"the K side of fp8_block_shape {tuple(block_shape)} is {side}; w8a8 needs a power of two "
                    f">= {W8A8_MIN_GROUP} (one weight scale per K step of the dot)")
    if on_gpu(device) and not has_fp8_tensor_cores(device):
        return f"{device} has no FP8 tensor cores (NVIDIA compute capability >= 8.9 needed)"
    return None


def check_input_scale(name: str, scale: torch.Tensor | None, weight_name: str, weight: torch.Tensor,
                      num_experts: int) -> None:
    """A static activation scale: None, or fp32 of shape [] / [1] (per tensor) or [E] (per expert), given with a
    float8 weight."""
    if scale is None:
        return
    check_tensor(name, scale)
    if not is_fp8(weight):
        raise ValueError(f"{name} was given but {weight_name} has dtype {weight.dtype}; static activation scales go "
                         f"with float8 weights")
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 (x ≈ x_fp8 * scale), got {scale.dtype}")
    if not (scale.dim() <= 1 and scale.numel() == 1) and tuple(scale.shape) != (num_experts,):
        raise ValueError(f"{name} must hold one scale per tensor (shape [] or [1]) or per expert ([E] = "
                         f"[{num_experts}]), got shape {tuple(scale.shape)}")


def input_scale_problems(name: str, scale: torch.Tensor) -> list[tuple[torch.Tensor, Callable[[], str]]]:
    """(flag, message) pairs for host.checks.raise_problems: a static scale must be positive and finite."""
    return [(~(torch.isfinite(scale) & (scale > 0)).all(),
             lambda: f"{name} must be positive and finite, got {scale.flatten()[:8].tolist()}")]
