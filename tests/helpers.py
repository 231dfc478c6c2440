"""Shared test helpers: the device, the tolerance table and comparison, and the poisoned allocator.

Import them by name (`from helpers import DEVICE, TOLERANCE, assert_close`; pytest.ini puts tests/ on the path). The
tolerance table and `assert_close` live beside the float64 references they judge against (moe_dispatch.reference),
because the Hub benchmark verifies the kernel it loads with the ones that kernel ships.
"""

import dataclasses
import os
import sys

import pytest
import torch

from moe_dispatch.reference import TOLERANCE, assert_close, relative_error

__all__ = ["DEVICE", "INTERPRETED", "ON_GPU", "Refusal", "TOLERANCE", "assert_close", "capture_cuda_graph",
           "h200_tile_table", "make_weights",
           "needs_gpu", "needs_interpreter", "poison_empty", "relative_error", "swap_gluon_gemm"]

ON_GPU = torch.cuda.is_available()
# The device a test's kernels run on: the GPU where there is one, else the CPU (through Triton's interpreter). Tests
# name it (DEVICE, or the `device` fixture of conftest.py); no helper here chooses a device for them: the helpers that
# build tensors take a required `device` keyword, so a test that builds CPU operands on a GPU host says so.
DEVICE = "cuda" if ON_GPU else "cpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # conftest turns it on where there is no GPU
# Tests of the CPU set-up (kernels on CPU tensors through Triton's interpreter: the README's CPU blocks, the scripts'
# --cpu-smoke modes, gloo ranks) run in the CPU suite; on a GPU machine the same code runs compiled in the GPU tests.
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="the CPU set-up: kernels on CPU tensors through Triton's interpreter, which conftest turns on "
                            "only where there is no GPU")


def _poison(t):
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:  # a wild index: out of range of any tensor a test builds, and not the -1 sentinel
        t.fill_(min(2**30, torch.iinfo(t.dtype).max))
    return t


@pytest.fixture
def poison_empty(monkeypatch):
    """torch.empty / torch.empty_like return NaN floats, True booleans and 2^30 integers, so an output element a
    kernel forgets to write, or a buffer it reads before writing, shows up as NaN or a wild index."""
    real_empty, real_empty_like = torch.empty, torch.empty_like
    # torch builds the set of constructors a `with torch.device(...)` places once, on the first device context of the
    # process (torch.utils._device._device_constructors): built under this patch (fast gradcheck opens one), it
    # would hold the lambda, and torch.empty would ignore every later device context, `torch.device("meta")` included.
    try:
        from torch.utils._device import _device_constructors
    except ImportError:  # a torch without that cache
        pass
    else:
        _device_constructors()
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: _poison(real_empty(*args, **kwargs)))
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: _poison(real_empty_like(*args, **kwargs)))


def capture_cuda_graph(fn, warmups=1):
    """(graph, fn's outputs inside it): `fn` runs `warmups` times on a side stream first (Triton compiles its kernels
    outside the capture), then once under capture; `graph.replay()` reruns it on whatever the inputs hold now."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn()
    return graph, static


def make_weights(E, H, F, dtype, *, device, scale=0.1):
    """Seed-layout expert weights: w_gate, w_up [E, F, H] and w_down [E, H, F], randn * scale."""
    w_gate = (torch.randn(E, F, H) * scale).to(device, dtype)
    w_up = (torch.randn(E, F, H) * scale).to(device, dtype)
    w_down = (torch.randn(E, H, F) * scale).to(device, dtype)
    return w_gate, w_up, w_down


def swap_gluon_gemm(monkeypatch, module, name, variable, reference, out_dtype=None, calls=None, label=None):
    """Run a Gluon engine of gemm/gluon_experts.py where its GEMM cannot run (no SM90 GPU): `variable` set to "1",
    `module.available` answering yes, and gluon_experts' `name` (the grouped GEMM `module.<name>`) replaced by a
    stand-in. The stand-in first calls the real launcher, which checks every operand before it refuses for want of a
    GPU (so what the engine hands the kernel is what the kernel takes), then returns `reference(*args, **kwargs)`
    (float64 [rows or more, N]) in `out_dtype` (a's when None), the rows past the experts' last offset NaN: nothing
    may read them; a reference that returns a tuple of tensors (a launcher with several outputs) gets each in its own
    dtype, NaN past the last offset likewise. Returns the list of its calls (`calls`, appended to, when given), each
    (a's shape, the weight's shape, a's dtype), led by `label` when given; the weight is the first 3-D operand, the
    expert offsets the last positional one."""
    from moe_dispatch.gemm import gluon_experts

    launcher, calls = getattr(module, name), [] if calls is None else calls

    def stand_in(*args, **kwargs):
        a, offsets = args[0], args[-1]
        weight = next(t for t in args if t.dim() == 3)
        if module.unavailable_reason(a.device) is not None:
            with pytest.raises(RuntimeError, match="unavailable"):
                launcher(*args, **kwargs)
        calls.append((() if label is None else (label, )) + (tuple(a.shape), tuple(weight.shape), a.dtype))
        rows = int(offsets[-1])
        expected = reference(*args, **kwargs)
        outs = []
        for value in expected if isinstance(expected, tuple) else (expected, ):
            dtype = value.dtype if isinstance(expected, tuple) else out_dtype or a.dtype
            out = torch.full((a.shape[0], value.shape[1]), float("nan"), dtype=dtype, device=a.device)
            out[:rows] = value[:rows].to(dtype)
            outs.append(out)
        return tuple(outs) if isinstance(expected, tuple) else outs[0]

    monkeypatch.setenv(variable, "1")
    monkeypatch.setattr(module, "available", lambda device=None: True)
    monkeypatch.setattr(gluon_experts, name, stand_in)
    return calls


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A case where a planner turns an engine down: `changes` builds the arguments changed from an accepted call
    (lazily: tensors per test), and the refusal's sentence must contain `says`."""

    id: str
    why: str
    changes: object  # () -> the changed arguments
    says: str

    def assert_refused(self, refusal):
        """refusal(**changes) names a reason, and the reason says `says`."""
        reason = refusal(**self.changes())
        assert reason is not None and self.says in reason, reason


def engine_refusals(gluon_module, tiles):
    """The refusals every Gluon engine's planner makes, as `Refusal` cases: `gluon_module.available` False (another
    Triton, another GPU), the real availability check on this machine's CPU, and the decode path (plan `tiles`)."""
    from moe_dispatch.gemm.planner import ExpertsPath, ExpertsPlan

    name = gluon_module.__name__.rsplit(".", 1)[-1]
    return [
        Refusal("gluon-unavailable", f"{name}.available is False (another Triton, another GPU)",
                lambda: dict(available=lambda device: False), "cannot run"),
        Refusal("cpu", "the real availability check on the CPU", lambda: dict(available=gluon_module.available),
                "cannot run on cpu"),
        Refusal("decode-path", "the decode path keeps its two launches",
                lambda: dict(plan=ExpertsPlan(ExpertsPath.DECODE, tiles)), "decode path"),
    ]


def assert_forced_on(monkeypatch, variable, refusal, plan_engine, engine_plan, bad_values):
    """An engine's variable set to "1": `refusal()` names no reason and `plan_engine()` is `engine_plan`; set to each
    of `bad_values`, `refusal()` raises a ValueError naming the variable."""
    monkeypatch.setenv(variable, "1")
    assert refusal() is None
    assert plan_engine() == engine_plan
    for bad in bad_values:
        monkeypatch.setenv(variable, bad)
        with pytest.raises(ValueError, match=variable):
            refusal()


def distinct_ids(T, E, top_k, skip=(), *, device):
    """topk ids [T, top_k]: distinct experts per token, never those in `skip`."""
    pool = torch.tensor([e for e in range(E) if e not in skip])
    return torch.stack([pool[torch.randperm(len(pool))[:top_k]] for _ in range(T)]).to(device)


def offsets_of(counts, *, device):
    """int32 expert offsets [E + 1] of expert-sorted rows with `counts` rows per expert."""
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=device)


@dataclasses.dataclass(frozen=True)
class EngineCase:
    """A small experts call for the engine's glue tests on the CPU (tests/test_gluon_experts.py adds its own fields):
    T tokens routed to top_k of E experts (never `skip_expert`), hidden H, intermediate F, `options` fused_experts
    keywords as (name, value) pairs; `why` says what the case covers."""
    id: str
    why: str
    T: int = 13
    E: int = 4
    top_k: int = 2
    H: int = 136
    F: int = 88
    options: tuple = ()
    skip_expert: int | None = 2


def gpu_biases(E, H, F, dtype=torch.bfloat16, *, device):
    """fused_experts' gate_up_bias [E, 2F] and down_bias [E, H], small (std 0.1)."""
    return dict(gate_up_bias=(torch.randn(E, 2 * F, device=device) * 0.1).to(dtype),
                down_bias=(torch.randn(E, H, device=device) * 0.1).to(dtype))


@pytest.fixture
def h200_tile_table(monkeypatch):
    """The H200's tile table (configs/NVIDIA_H200.json) on whatever GPU runs the test: for GPU tests whose cases are
    sized for the tiles that table chooses (the H100 reads it anyway, `tiles.TABLE_ALIASES`; other GPUs their own)."""
    from moe_dispatch.host import tiles

    monkeypatch.setattr(tiles, "device_key", lambda device: "NVIDIA_H200")


def wrap_gluon_engine(monkeypatch, engine, **engine_kwargs):
    """Where the package calls the Gluon engine gemm.gluon_experts.`engine` (each of its modules that imported it), a
    stand-in that notes the call and passes `engine_kwargs` on: the engine's explicit alternatives (`fused_activation`,
    `plain_gemm_cfg`), what a caller of the engine, not a module attribute, chooses. -> the list of calls."""
    from moe_dispatch.gemm import gluon_experts

    real, calls = getattr(gluon_experts, engine), []

    def stand_in(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs, **engine_kwargs)

    callers = [module for name, module in sorted(sys.modules.items()) if name.startswith("moe_dispatch.")
               and module is not gluon_experts and getattr(module, engine, None) is real]
    assert callers, f"no module of the package calls gluon_experts.{engine}"
    for module in callers:
        monkeypatch.setattr(module, engine, stand_in)
    return calls


def run_gluon_engine(monkeypatch, run, variable, engine, **engine_kwargs):
    """`run()` (a fused_experts call) with the Gluon engine forced off, then on (`variable` "1"; the engine called
    with `engine_kwargs`: `wrap_gluon_engine`): the engine must run, two calls must agree bit for bit and a CUDA
    graph replay must equal the eager call. -> (portable output, engine output)."""
    import moe_dispatch as md

    monkeypatch.delenv(variable, raising=False)
    md.host.replay.clear()
    portable = run()
    monkeypatch.setenv(variable, "1")
    md.host.replay.clear()
    calls = wrap_gluon_engine(monkeypatch, engine, **engine_kwargs)
    out = run()
    assert calls, "the Gluon engine did not run"
    assert torch.equal(run(), out), "two calls differ"
    graph, static = capture_cuda_graph(run)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, out), "CUDA graph replay differs from the eager call"
    return portable, out
