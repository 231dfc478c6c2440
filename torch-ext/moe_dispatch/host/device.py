"""Device facts in one place: which backend runs the kernels and what it can do.

FP8: `has_fp8_tensor_cores` and `fp8_dtype` are the facts `planner.choose_fp8_compute` picks the FP8 path by.

Everything vendor-specific is decided here or in the tile tables (configs/*.json); the kernels themselves are the same
portable Triton source for NVIDIA, AMD and the CPU interpreter.

A `CompileTarget` set with `compile_target` makes the facts below those of a GPU that is not here, for every device:
the host path then picks and binds the launches that GPU would get, on CPU tensors, and Triton compiles them ahead of
time for it (scripts/compile_report.py; tests/test_targets.py). Nothing else sets one.

The package's environment switches, the other facts a launch is decided by, are read and validated here too, once per
call (`Environment`, `call_scope`, `current_environment`):

    MOE_DISPATCH_PLANS       "1" (unset) or "0"           eager calls replay recorded plans (host/replay.py)
    MOE_DISPATCH_PDL         "1" (unset) or "0"           programmatic dependent launch on Hopper (host/pdl.py)
    MOE_DISPATCH_GLUON_FP8   "auto" (unset), "1" or "0"   the w8a8 path's Gluon engine (gemm/planner.py)
    MOE_DISPATCH_GLUON_MXFP4 "auto" (unset), "1" or "0"   the MXFP4 path's Gluon engine (gemm/planner.py)

An empty value counts as unset; any other value raises ValueError naming the variable. Every public entry point that
launches kernels is wrapped in `call_scope`, which reads the switches once when the outermost entry of a call starts,
before any plan lookup, and holds them on the thread until it returns; the layers below ask `current_environment()`
(the planner for the Gluon FP8 engine, each launch for PDL, the plan caches for their keys). Outside a call (a backward
run by autograd, an operator run by a compiled graph, a test asking the planner) it reads them afresh. The switches
that change what runs (`Environment.plan_key`) are part of every plan key: changing one between calls records a new
plan rather than replaying the old one, and a replayed call refuses a bad value as the first call does.
"""

import contextlib
import dataclasses
import functools
import os
import re
import threading

import torch


@dataclasses.dataclass(frozen=True)
class CompileTarget:
    """A GPU the kernels are compiled for without it: what the device facts answer while `compile_target` holds it."""

    key: str  # the tile table's name (what `device_key` returns)
    backend: str  # Triton's backend: "cuda" or "hip"
    arch: int | str  # Triton's arch: the compute capability as 80, 90 (cuda), or the gfx name (hip)
    warp_size: int
    num_sms: int
    smem_per_program: int  # bytes of shared memory (LDS on AMD) one program may use

    @property
    def capability(self) -> tuple[int, int]:
        """(major, minor) of an NVIDIA target, (0, 0) on AMD (what the capability checks below compare)."""
        return divmod(self.arch, 10) if self.backend == "cuda" else (0, 0)


_target: CompileTarget | None = None
_PER_DEVICE_CACHES = []


def per_device(fn):
    """`functools.lru_cache` for a device fact; forgotten when a compile target is set or unset."""
    cached = functools.lru_cache(maxsize=None)(fn)
    _PER_DEVICE_CACHES.append(cached)
    return cached


@contextlib.contextmanager
def compile_target(target: CompileTarget | None):
    """The device facts of `target` for every device inside the block (see the module docstring)."""
    global _target
    previous, _target = _target, target
    for cached in _PER_DEVICE_CACHES:
        cached.cache_clear()
    try:
        yield target
    finally:
        _target = previous
        for cached in _PER_DEVICE_CACHES:
            cached.cache_clear()


def on_gpu(device: torch.device) -> bool:
    """Whether launches on `device` are a GPU's: a CUDA / ROCm device, or any while a compile target is set."""
    return device.type == "cuda" or _target is not None


def is_interpreter() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1) and no compile target is
    set."""
    return _target is None and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernels_run_on(device: torch.device) -> bool:
    """Whether Triton kernels can take tensors on `device`: a GPU's, or the CPU's under the interpreter (or a compile
    target, whose launches are compiled, never run)."""
    return device.type != "cpu" or is_interpreter() or _target is not None


def is_hip() -> bool:
    if _target is not None:
        return _target.backend == "hip"
    return torch.version.hip is not None


def is_cuda() -> bool:
    if _target is not None:
        return _target.backend == "cuda"
    return torch.version.cuda is not None and not is_hip()


@per_device
def capability(device: torch.device) -> tuple[int, int]:
    """NVIDIA compute capability (major, minor) of a GPU's device; (0, 0) on AMD and for the interpreter."""
    if _target is not None:
        return _target.capability
    if device.type != "cuda" or not is_cuda():
        return (0, 0)
    return torch.cuda.get_device_capability(device)


def decodes_mxfp4_bf16x2(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether MXFP4 weights met by activations of `dtype` on `device` decode through gemm/jit.py's PTX
    (`e2m1_bf16x2`: bf16x2 fma, sm_80 and later): bf16 on an NVIDIA GPU of capability 8.0 or more (or such a compile
    target); never on AMD or the interpreter, which run no PTX."""
    return dtype == torch.bfloat16 and is_cuda() and not is_interpreter() and capability(device) >= (8, 0)


@per_device
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (NVIDIA) / compute units (AMD); 1 for the interpreter."""
    if _target is not None:
        return _target.num_sms
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@per_device
def smem_per_program(device: torch.device) -> int | None:
    """Shared memory one program may use (the opt-in maximum per block) on a GPU; None for the interpreter."""
    if _target is not None:
        return _target.smem_per_program
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", None) or getattr(props, "shared_memory_per_block", None)


@per_device
def device_key(device: torch.device) -> str:
    """Name of the tile table for `device`: `NVIDIA_H200`, `AMD_Instinct_MI300X`, ... or `interpreter`."""
    if _target is not None:
        return _target.key
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


@per_device
def has_tma(device: torch.device) -> bool:
    """Tensor descriptors with a copy engine behind them (TMA): NVIDIA compute capability >= 9.0 (Hopper on). The
    interpreter emulates descriptors, so it says True there too (the CPU suite runs the persistent kernel); AMD and
    SM80 use pointer loads."""
    if not on_gpu(device):
        return is_interpreter()
    return is_cuda() and capability(device) >= (9, 0)


# Bytes: what a TMA descriptor needs its base address and every stride but the last (unit) one to be whole multiples of
TMA_ALIGN = 16


def tma_readable(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can read `t` as it is laid out: its last dimension contiguous, its base address and
    every other stride (in bytes) whole multiples of TMA_ALIGN. The one test of it; the descriptor views built on it
    (gemm/args.py) add what their own shapes need."""
    size = t.element_size()
    return (t.stride(-1) == 1 and all(s * size % TMA_ALIGN == 0 for s in t.stride()[:-1])
            and t.data_ptr() % TMA_ALIGN == 0)


@per_device
def has_wgmma(device: torch.device) -> bool:
    """Hopper's warpgroup MMA (wgmma), what Triton compiles a dot to on compute capability 9.x when the tile has at
    least 64 rows per warpgroup (below that, the older mma.sync, whose FP8 form converts the operands to fp16 first).
    The interpreter says True, so the CPU suite runs the layouts chosen for it (the swapped small-tile w8a8 dots)."""
    if not on_gpu(device):
        return is_interpreter()
    return is_cuda() and capability(device)[0] == 9


# NVIDIA's first compute capability with an e4m3 type: FP8 tensor cores, and in Triton any load of float8_e4m3fn
# (before it, "type fp8e4nv not supported in this architecture").
FP8_MIN_CAPABILITY = (8, 9)


@per_device
def has_fp8_tensor_cores(device: torch.device) -> bool:
    """FP8 tensor cores (e4m3 x e4m3 dots): NVIDIA compute capability >= 8.9 (Ada, Hopper, Blackwell). False on AMD
    (MI300X has FP8 matrix cores, in e4m3fnuz; the w8a8 path is not built for them) and on the interpreter.
    fp8_compute="auto" runs the w8a8 path (gemm/w8a8.py) where this holds, the dequant path elsewhere."""
    if not on_gpu(device) or not is_cuda():
        return False
    return capability(device) >= FP8_MIN_CAPABILITY


def fp8_dtype(device: torch.device) -> torch.dtype:
    """The float8 dtype checkpoints are converted to for `device`: e4m3fnuz on AMD (MI300X's native format: no negative
    zero, bias 8, max 240), e4m3fn elsewhere (max 448). e4m3fn runs on the dequant path on NVIDIA from compute
    capability 8.9 (before it Triton loads no e4m3: `fused_experts` refuses it there) and on the interpreter, and on
    the w8a8 path where `has_fp8_tensor_cores` holds; e4m3fnuz on AMD and the interpreter (Triton's NVIDIA backend has
    no such type: `fused_experts` refuses it there)."""
    return torch.float8_e4m3fnuz if on_gpu(device) and is_hip() else torch.float8_e4m3fn


PLANS_VARIABLE = "MOE_DISPATCH_PLANS"
PDL_VARIABLE = "MOE_DISPATCH_PDL"
GLUON_FP8_VARIABLE = "MOE_DISPATCH_GLUON_FP8"
GLUON_MXFP4_VARIABLE = "MOE_DISPATCH_GLUON_MXFP4"
MXFP4_PREFILL_VARIABLE = "MOE_DISPATCH_MXFP4_PREFILL"
# Each switch's accepted values, the first one what unset (or empty) means.
SWITCH_VALUES = {PLANS_VARIABLE: ("1", "0"), PDL_VARIABLE: ("1", "0"), GLUON_FP8_VARIABLE: ("auto", "1", "0"),
                 MXFP4_PREFILL_VARIABLE: ("auto", "loads", "buffer"), GLUON_MXFP4_VARIABLE: ("auto", "1", "0")}
_SWITCHES = tuple(SWITCH_VALUES)


@dataclasses.dataclass(frozen=True)
class Environment:
    """The environment switches of one call, validated (module docstring)."""

    plans: bool  # MOE_DISPATCH_PLANS: replay recorded plans
    pdl: bool  # MOE_DISPATCH_PDL: launch with programmatic dependent launch where the device has it
    gluon_fp8: str  # MOE_DISPATCH_GLUON_FP8: "auto", "1" or "0"
    mxfp4_prefill: str  # MOE_DISPATCH_MXFP4_PREFILL: "auto", "loads" or "buffer" (planner.mxfp4_dequantizes_first)
    gluon_mxfp4: str  # MOE_DISPATCH_GLUON_MXFP4: "auto", "1" or "0" (planner.gluon_mxfp4_refusal)

    def plan_key(self) -> tuple:
        """The switches that change a recorded call's launches (`plans` only says whether there is a plan)."""
        return self.pdl, self.gluon_fp8, self.mxfp4_prefill, self.gluon_mxfp4


def read_environment() -> Environment:
    """The switches as the environment holds them now; ValueError naming a variable set to a value it does not take."""
    get = os.environ.get
    return _parse_environment(tuple(get(name) or None for name in _SWITCHES))


@functools.lru_cache(maxsize=64)
def _parse_environment(raw: tuple) -> Environment:
    """`Environment` of the raw values (None: unset) in `_SWITCHES` order; a bad value raises (and is not cached)."""
    values = []
    for name, value in zip(_SWITCHES, raw):
        accepted = SWITCH_VALUES[name]
        if value is None:
            value = accepted[0]
        elif value not in accepted:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, accepted))} (or unset), got {value!r}")
        values.append(value)
    plans, pdl, gluon_fp8, mxfp4_prefill, gluon_mxfp4 = values
    return Environment(plans == "1", pdl == "1", gluon_fp8, mxfp4_prefill, gluon_mxfp4)


class _CallState(threading.local):
    environment = None  # the switches of the public call running on this thread (`call_scope`), if any


_call = _CallState()


def current_environment() -> Environment:
    """The switches of the call in progress on this thread, read when it started; outside a call, read now."""
    environment = _call.environment
    return environment if environment is not None else read_environment()


def call_scope(fn):
    """Decorator of a public entry point: the switches are read and validated once, before the function runs, and
    held for every layer of the call (`current_environment`); an entry called inside another shares its caller's.
    Under torch.compile tracing nothing is read (the operators read them when the graph runs)."""

    @functools.wraps(fn)
    def entry(*args, **kwargs):
        if torch.compiler.is_compiling() or _call.environment is not None:
            return fn(*args, **kwargs)
        _call.environment = read_environment()
        try:
            return fn(*args, **kwargs)
        finally:
            _call.environment = None

    return entry
