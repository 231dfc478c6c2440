"""Device facts in one place: which backend runs the kernels and what it can do.

FP8: `has_fp8_tensor_cores` and `fp8_dtype` are the facts `planner.choose_fp8_compute` picks the FP8 path by.

Everything vendor-specific is decided here or in the tile tables (configs/*.json); the kernels themselves are the same
portable Triton source for NVIDIA, AMD and the CPU interpreter.
"""

import functools
import os
import re

import torch


def is_interpreter() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernels_run_on(device: torch.device) -> bool:
    """Whether Triton kernels can take tensors on `device`: a GPU's, or the CPU's under the interpreter."""
    return device.type != "cpu" or is_interpreter()


def is_hip() -> bool:
    return torch.version.hip is not None


def is_cuda() -> bool:
    return torch.version.cuda is not None and not is_hip()


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (NVIDIA) / compute units (AMD); 1 for the interpreter."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def smem_per_program(device: torch.device) -> int | None:
    """Shared memory one program may use (the opt-in maximum per block) on a GPU; None for the interpreter."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", None) or getattr(props, "shared_memory_per_block", None)


@functools.lru_cache(maxsize=None)
def device_key(device: torch.device) -> str:
    """Name of the tile table for `device`: `NVIDIA_H200`, `AMD_Instinct_MI300X`, ... or `interpreter`."""
    if device.type != "cuda":
        return "interpreter"
    name = torch.cuda.get_device_properties(device).name
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def dot_needs_fp32(dtype: torch.dtype) -> bool:
    """The interpreter's `tl.dot` returns garbage for bf16 operands; upcast them there (exact: bf16 fits in fp32)."""
    return is_interpreter() and dtype == torch.bfloat16


def dot_input_precision(dtype: torch.dtype) -> str:
    """`input_precision` of a GEMM's dots: fp32 operands follow torch's own switch (tf32 only when
    `torch.backends.cuda.matmul.allow_tf32` is set), so fp32 callers get what torch.matmul would give; half-precision
    operands run at their own precision ("ieee": the setting only concerns fp32 operands)."""
    return "tf32" if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"


@functools.lru_cache(maxsize=None)
def has_tma(device: torch.device) -> bool:
    """Tensor descriptors with a copy engine behind them (TMA): NVIDIA compute capability >= 9.0 (Hopper on). The
    interpreter emulates descriptors, so it says True there too (the CPU suite runs the persistent kernel); AMD and
    SM80 use pointer loads."""
    if device.type != "cuda":
        return is_interpreter()
    return is_cuda() and torch.cuda.get_device_capability(device) >= (9, 0)


@functools.lru_cache(maxsize=None)
def has_wgmma(device: torch.device) -> bool:
    """Hopper's warpgroup MMA (wgmma), what Triton compiles a dot to on compute capability 9.x when the tile has at
    least 64 rows per warpgroup (below that, the older mma.sync, whose FP8 form converts the operands to fp16 first).
    The interpreter says True, so the CPU suite runs the layouts chosen for it (the swapped small-tile w8a8 dots)."""
    if device.type != "cuda":
        return is_interpreter()
    return is_cuda() and torch.cuda.get_device_capability(device)[0] == 9


@functools.lru_cache(maxsize=None)
def has_fp8_tensor_cores(device: torch.device) -> bool:
    """FP8 tensor cores (e4m3 x e4m3 dots): NVIDIA compute capability >= 8.9 (Ada, Hopper, Blackwell). False on AMD
    (MI300X has FP8 matrix cores, in e4m3fnuz; the w8a8 path is not built for them) and on the interpreter.
    fp8_compute="auto" runs the w8a8 path (gemm/w8a8.py) where this holds, the dequant path elsewhere."""
    if device.type != "cuda" or not is_cuda():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_dtype(device: torch.device) -> torch.dtype:
    """The float8 dtype checkpoints are converted to for `device`: e4m3fnuz on AMD (MI300X's native format: no negative
    zero, bias 8, max 240), e4m3fn elsewhere (max 448). e4m3fn runs on the dequant path everywhere and on the w8a8 path
    where `has_fp8_tensor_cores` holds; e4m3fnuz on AMD and the interpreter (Triton's NVIDIA backend has no such type:
    `fused_experts` refuses it there)."""
    return torch.float8_e4m3fnuz if device.type == "cuda" and is_hip() else torch.float8_e4m3fn
