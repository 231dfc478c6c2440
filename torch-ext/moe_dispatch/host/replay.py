"""The eager host path: what a call does is worked out once per input signature, then replayed.

An eager inference call at decode is a few microseconds of GPU work behind a long Python path: argument checks, the
choice of path and tiles, buffer sizes, grids, and Triton's binding and specialization of 30-50 arguments per launch.
None of it depends on the values in the tensors, only on their signatures (shape, strides, dtype, device, 16-byte
alignment of the data pointer) and on the call's other arguments. So `PlanCache.run` runs the full path once per
signature while recording what it does, and from then on replays the record (a `Plan`):

    record   the full path under a TorchDispatchMode that sees every torch op, with `launch` (the one way this
             package starts a Triton kernel) noting each launch: the compiled kernel, its grid, its bound arguments
    resolve  every tensor argument to where it comes from: an input of the call (itself, or a view at a fixed byte
             offset), or a buffer the call allocated (torch.empty and views of it)
    replay   allocate the same buffers, then start the same compiled kernels with the new pointers through Triton's
             compiled launcher (`CompiledKernel.run`), on the current stream

Buffers are allocated in one of two ways (`PlanCache(..., by_lifetime=)`): at the call's start, the outputs each on
its own and every other buffer carved from one scratch allocation (one allocator call: the eager inference path,
where host time counts); or by lifetime, each buffer right before the first step that uses it and dropped after the
last (outputs kept), as the full path did (the backward, whose peak memory counts: its activated rows are freed
before its largest output is allocated). A dropped buffer goes back to the caching allocator in stream order.

A record is kept only when the path did nothing but allocate, take views and launch Triton kernels: a torch op that
computes (`.zero_()`, a cast, a host read of a device value), a tensor from outside the call, an ambiguous alias or
a kernel started outside `launch` (announced with `unrecorded_launch`: the Gluon GEMM) leaves a `None` plan, and
that signature runs the full path every time (correct, only not faster). Checks that read
values (validate=True) are the caller's to keep out of plans; shape and dtype errors raise on the recording call and
a signature that raised is never recorded, so bad inputs get the full path's errors every time. For that the key holds
each option's type beside its value (4.0 and True equal 4 and 1 but are refused as ints), and a call with a
non-tensor or a meta tensor among its tensors has no key: the full path names the argument.

Where replay is used: eager calls without autograd (no input requiring a gradient under grad mode), outside
torch.compile tracing and any user TorchDispatchMode, on plain tensors. CUDA-graph capture replays like eager code
(its allocations come from the graph's pool, its launches go to the capturing stream). Under Triton's interpreter
and when a launch hook is set (profilers), replay re-launches through `kernel[grid](...)` with the recorded arguments
instead of the compiled launcher: the package's own Python is still skipped, and the CPU tests exercise the same
records. `ENABLED = False` (or MOE_DISPATCH_PLANS=0) runs every call in full, for A/B timing.

A plan is valid while nothing the path reads besides its arguments changes: a change of a module attribute of the
package (the A/B switches in scripts/) must be followed by `clear()`; the current CUDA device, grad mode,
`torch.backends.cuda.matmul.allow_tf32` and the package's environment switches that change what runs (PDL, the Gluon
engines: `device.Environment.plan_key`, read once per call by the public entry) are part of every key.
"""

import dataclasses
import inspect
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily

from .device import current_environment
from .library import plain_tensor

try:  # the compiled-launch fast path needs Triton's knobs (3.4+) and driver; without them replay re-launches
    from triton import knobs as _knobs
    from triton.runtime.driver import driver as _driver
except ImportError:  # pragma: no cover - older Triton
    _knobs = _driver = None

ENABLED = True  # False: every call in full (A/B timing); MOE_DISPATCH_PLANS=0 does the same (host/device.py)
MAX_PLANS = 1024  # signatures kept per cache; past this the cache starts over (prefill T varies without bound)

_ALIGN = 16  # Triton specializes pointer arguments on 16-byte alignment
_SCRATCH_ALIGN = 256  # each buffer's offset in the call's scratch allocation (TMA wants 128-byte bases)

_aten = torch.ops.aten
_ALLOCATIONS = frozenset((_aten.empty, _aten.empty_strided, _aten.new_empty, _aten.new_empty_strided,
                          _aten.empty_like))
_FILLS = frozenset((_aten.fill_, _aten.zero_))
_VIEWS = frozenset((_aten.view, _aten._unsafe_view, _aten.slice, _aten.select, _aten.as_strided, _aten.alias,
                    _aten.t, _aten.transpose, _aten.permute, _aten.unsqueeze, _aten.squeeze, _aten.expand,
                    _aten.detach, _aten.narrow, _aten.split, _aten.split_with_sizes, _aten.unbind, _aten.chunk,
                    _aten.unflatten, _aten.diagonal, _aten.view_as, _aten.expand_as))

class _ThreadState(threading.local):
    recorder = None  # the `_Recorder` of the call being recorded on this thread, if any


_state = _ThreadState()


def launch(kernel, grid, *args, **kwargs):
    """`kernel[grid](*args, **kwargs)`; noted by the recorder when a plan is being made. Every launch site of the
    package goes through here, so a recorded call sees all of its kernels."""
    recorder = _state.recorder
    if recorder is None:
        return kernel[grid](*args, **kwargs)
    with _pop_mode_temporarily():  # what Triton does inside a launch (the interpreter's copies) is its own
        compiled = kernel[grid](*args, **kwargs)
    recorder.events.append((kernel, grid, args, kwargs, compiled))
    return compiled


def unrecorded_launch(what: str) -> None:
    """Say that the call is about to start a kernel outside `launch` (`what`: which one and why), which a plan could
    not replay: the call being recorded, if any, keeps no plan and its signature always runs in full."""
    recorder = _state.recorder
    if recorder is not None and recorder.unrecorded is None:
        recorder.unrecorded = what


class _Recorder(TorchDispatchMode):
    """Runs the full path once, keeping every allocation alive (so no two buffers share memory), the launches and the
    constant fills of fresh buffers (`.zero_()`, `.fill_(value)`) in their order (`events`), the first op that is
    none of these nor a view (`foreign_op`) and the first launch announced outside `launch` (`unrecorded`)."""

    def __init__(self):
        super().__init__()
        self.allocations = []
        self.events = []  # (kernel, grid, args, kwargs, compiled) of a launch, or (tensor, value) of a fill
        self.foreign_op = None
        self.unrecorded = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        if packet in _ALLOCATIONS:
            self.allocations.append(out)
        elif packet in _FILLS and func is not _aten.fill_.Tensor and any(_same(args[0], a) for a in self.allocations):
            self.events.append((args[0], args[1] if packet is _aten.fill_ else 0))
        elif packet in _FILLS and args[0].numel() == 0:  # fills nothing
            pass
        elif packet not in _VIEWS and self.foreign_op is None:
            self.foreign_op = str(func)
        return out


class NotReplayable(Exception):
    """Why a recorded call cannot be replayed (the signature then always runs in full)."""


# Sources of a tensor argument at replay: the input itself, an input's data pointer plus a byte offset, a replay
# buffer itself, a buffer's pointer plus an offset; views are rebuilt only where a tensor object is needed.
_INPUT, _INPUT_AT, _BUFFER, _BUFFER_AT = range(4)


@dataclasses.dataclass(frozen=True)
class _Source:
    kind: int
    index: int
    offset: int = 0  # bytes from the source's data pointer
    view: tuple | None = None  # (shape, stride, dtype) where the argument is not the source tensor itself


@dataclasses.dataclass(frozen=True)
class _Descriptor:
    """A TensorDescriptor argument: its base's source and the descriptor with the recorded base."""
    base: _Source
    recorded: object


class _Pointer:
    """A data pointer with a dtype: what Triton's launcher reads from a TensorDescriptor's base."""
    __slots__ = ("_ptr", "dtype")

    def __init__(self, ptr, dtype):
        self._ptr = ptr
        self.dtype = dtype

    def data_ptr(self):
        return self._ptr


def _same(t, a):
    """t is allocation a or an alias of all of it (a factory call under a dispatch mode returns a detached alias)."""
    return t is a or (t.device == a.device and t.dtype == a.dtype and t.shape == a.shape and t.stride() == a.stride()
                      and t.numel() > 0 and t.data_ptr() == a.data_ptr()
                      and t.untyped_storage().data_ptr() == a.untyped_storage().data_ptr())


def _extent(t):
    """Bytes from t's data pointer to one past its last element."""
    if t.numel() == 0:
        return 0
    return (sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1) * t.element_size()


class _Resolver:
    """Maps tensors seen during a recorded call to their `_Source`: an input, or a buffer the replay allocates (one
    per allocation of the recorded call that an argument or a result lies in, and one per empty tensor)."""

    def __init__(self, inputs, allocations):
        self.inputs = inputs
        self.allocations = [a for a in allocations if isinstance(a, torch.Tensor) and a.numel() > 0]
        self.used = {}  # allocation index -> buffer index
        self.specs = []  # (shape, stride, dtype, device) of each replay buffer, in buffer order

    def _buffer(self, j, t=None):
        if t is not None:  # an empty tensor: a buffer of its own (never read; empty storages share address 0)
            self.specs.append((tuple(t.shape), tuple(t.stride()), t.dtype, t.device))
            return len(self.specs) - 1
        if j not in self.used:
            a = self.allocations[j]
            self.used[j] = len(self.specs)
            self.specs.append((tuple(a.shape), tuple(a.stride()), a.dtype, a.device))
        return self.used[j]

    def resolve(self, t):
        for i, x in enumerate(self.inputs):
            if x is t or (isinstance(x, torch.Tensor) and _same(t, x)):
                return _Source(_INPUT, i)
        if t.numel() == 0:
            return _Source(_BUFFER, self._buffer(None, t))
        view = (tuple(t.shape), tuple(t.stride()), t.dtype)
        storage = t.untyped_storage().data_ptr()
        ptr = t.data_ptr()
        for j, a in enumerate(self.allocations):
            if a.device == t.device and a.untyped_storage().data_ptr() == storage:
                if _same(t, a):
                    return _Source(_BUFFER, self._buffer(j))
                return self._view(_BUFFER_AT, self._buffer(j), a, t, view)
        candidates = [i for i, x in enumerate(self.inputs)
                      if isinstance(x, torch.Tensor) and x.numel() > 0 and x.device == t.device
                      and x.untyped_storage().data_ptr() == storage
                      and x.data_ptr() <= ptr < x.data_ptr() + _extent(x)]
        if len(candidates) == 1:
            i = candidates[0]
            return self._view(_INPUT_AT, i, self.inputs[i], t, view)
        if candidates:
            raise NotReplayable(f"a tensor argument lies in {len(candidates)} overlapping inputs")
        raise NotReplayable("a tensor argument comes from outside the call")

    @staticmethod
    def _view(kind, index, base, t, view):
        offset = t.data_ptr() - base.data_ptr()
        if t.element_size() != base.element_size() or offset % t.element_size():
            raise NotReplayable("a view that reinterprets its base")
        return _Source(kind, index, offset, view)

    def value(self, value):
        """A recorded argument as a constant or a `_Source` / `_Descriptor`."""
        if isinstance(value, torch.Tensor):
            return self.resolve(value)
        if type(value).__name__ == "TensorDescriptor" and isinstance(getattr(value, "base", None), torch.Tensor):
            return _Descriptor(self.resolve(value.base), value)
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            raise NotReplayable("a tensor inside a list argument")
        return value


class _Launch:
    """One recorded launch: constant arguments plus the positions filled from the call's tensors."""
    __slots__ = ("kernel", "grid", "values", "fills", "fast_fills", "names", "options", "compiled", "launcher",
                 "function", "packed")

    def __init__(self, kernel, grid, values, fills, names, compiled, options):
        self.kernel = kernel
        self.grid = grid  # (x, y, z)
        self.values = values  # every bound argument in the kernel's parameter order, sources as placeholders
        self.fills = fills  # ((position, source), ...)
        # the same as flat tuples for the compiled path: (position, kind, index, offset, descriptor or None)
        self.fast_fills = tuple((position, source.kind, source.index, source.offset, None) if type(source) is _Source
                                else (position, -1, -1, 0, source) for position, source in fills)
        self.names = names  # parameter names, for the re-launch path
        self.options = options  # launch options (num_warps, ...), for the re-launch path
        self.compiled = compiled
        self.launcher = self.function = self.packed = None
        if compiled is not None and hasattr(compiled, "packed_metadata"):
            self.launcher = compiled.run
            self.function = compiled.function
            self.packed = compiled.packed_metadata


@dataclasses.dataclass(frozen=True)
class _Fill:
    """A recorded `.fill_(value)` / `.zero_()` of a replay buffer."""
    buffer: int
    value: object


def _bound_values(kernel, args, kwargs):
    """Every parameter of `kernel` in order (positional, then keyword, then defaults), their names, and the launch
    options (num_warps, ...): what Triton's binder hands its compiled launcher."""
    parameters = list(inspect.signature(kernel.fn).parameters.values())
    values = list(args)
    for param in parameters[len(args):]:
        values.append(kwargs[param.name] if param.name in kwargs else param.default)
    names = [p.name for p in parameters]
    options = {k: v for k, v in kwargs.items() if k not in names}
    return values, names, options


def _grid3(grid):
    if callable(grid):
        raise NotReplayable("a callable grid")
    grid = tuple(grid)
    return grid + (1,) * (3 - len(grid))


@dataclasses.dataclass
class Plan:
    """A recorded call: the buffers to allocate, the steps (launches and fills, in order), where each output comes
    from."""
    buffers: tuple  # (shape, stride, dtype, device, scratch offset or None) of each buffer, in buffer order
    steps: list
    scratch_bytes: int  # one allocation holding every buffer that is neither an output nor filled
    device: torch.device
    outputs: tuple
    single: bool  # the recorded function returned one tensor, not a tuple
    fast: bool  # every launch has a compiled handle
    # by lifetime: per step, the buffers to allocate before it and those to drop after it (None: all at the start)
    allocate_before: tuple | None = None
    drop_after: tuple | None = None


def _lifetimes(steps, outputs, num_buffers):
    """(allocate_before, drop_after): per step, the buffers it uses first and those it uses last (a buffer no step
    uses: before the first step); outputs are never dropped."""
    first, last = {}, {}
    for index, step in enumerate(steps):
        if type(step) is _Fill:
            used = (step.buffer,)
        else:
            used = tuple(source.index for _, source in step.fills if type(source) is _Source
                         and source.kind in (_BUFFER, _BUFFER_AT))
            used += tuple(source.base.index for _, source in step.fills if type(source) is _Descriptor
                          and source.base.kind in (_BUFFER, _BUFFER_AT))
        for buffer in used:
            first.setdefault(buffer, index)
            last[buffer] = index
    kept = {source.index for source in outputs if source.kind in (_BUFFER, _BUFFER_AT)}
    allocate_before = [[] for _ in steps] or [[]]
    drop_after = [[] for _ in steps] or [[]]
    for buffer in range(num_buffers):
        allocate_before[first.get(buffer, 0)].append(buffer)
        if buffer not in kept and buffer in last:
            drop_after[last[buffer]].append(buffer)
    return tuple(map(tuple, allocate_before)), tuple(map(tuple, drop_after))


def _make_plan(recorder, inputs, result, by_lifetime=False):
    if recorder.foreign_op is not None:
        raise NotReplayable(f"the call runs torch op {recorder.foreign_op}")
    if recorder.unrecorded is not None:
        raise NotReplayable(f"the call launches {recorder.unrecorded}")
    single = isinstance(result, torch.Tensor)
    results = (result,) if single else tuple(result)
    if not all(isinstance(r, torch.Tensor) for r in results):
        raise NotReplayable("a result that is not a tensor")
    resolver = _Resolver(inputs, recorder.allocations)
    steps = []
    for event in recorder.events:
        if len(event) == 2:  # a fill of a fresh buffer
            tensor, value = event
            source = resolver.resolve(tensor)
            if source.kind != _BUFFER:
                raise NotReplayable("a fill of a view")
            steps.append(_Fill(source.index, value))
            continue
        kernel, grid, args, kwargs, compiled = event
        values, names, launch_options = _bound_values(kernel, args, kwargs)
        resolved = [resolver.value(v) for v in values]
        fills = tuple((i, v) for i, v in enumerate(resolved) if isinstance(v, (_Source, _Descriptor)))
        steps.append(_Launch(kernel, _grid3(grid), resolved, fills, names, compiled, launch_options))
    outputs = tuple(resolver.resolve(r) for r in results)
    launches = [step for step in steps if type(step) is _Launch]
    if not steps and any(source.kind != _INPUT and r.numel() for source, r in zip(outputs, results)):
        # nothing seen writes a fresh output: its launches went past this recorder (another copy of the package
        # whose operators this one shares), and a replay would hand back uninitialised memory
        raise NotReplayable("no launch or fill of this package wrote the output")
    fast = _knobs is not None and bool(launches) and all(step.launcher is not None for step in launches)
    separate = {source.index for source in outputs if source.kind in (_BUFFER, _BUFFER_AT)}
    separate |= {step.buffer for step in steps if type(step) is _Fill}
    allocate_before = drop_after = None
    if by_lifetime:
        separate = set(range(len(resolver.specs)))
        allocate_before, drop_after = _lifetimes(steps, outputs, len(resolver.specs))
    buffers, scratch_bytes = [], 0
    for index, (shape, stride, dtype, device) in enumerate(resolver.specs):
        if index in separate:
            buffers.append((shape, stride, dtype, device, None))
            continue
        buffers.append((shape, stride, dtype, device, scratch_bytes))
        size = (sum((n - 1) * st for n, st in zip(shape, stride)) + 1) * dtype.itemsize if all(shape) else 0
        scratch_bytes += -(-size // _SCRATCH_ALIGN) * _SCRATCH_ALIGN
    device = inputs[0].device
    return Plan(tuple(buffers), steps, scratch_bytes, device, outputs, single, fast, allocate_before, drop_after)


def _tensor(source, inputs, buffers):
    """The tensor a source stands for (a view rebuilt where it is not the source itself)."""
    base = inputs[source.index] if source.kind in (_INPUT, _INPUT_AT) else buffers[source.index]
    if source.view is None:
        return base
    shape, stride, dtype = source.view
    if dtype != base.dtype:  # same element size (checked when recorded)
        base = base.view(dtype)
    return base.as_strided(shape, stride, base.storage_offset() + source.offset // base.element_size())


def _pointer(source, inputs, buffers):
    """What the compiled launcher takes for a pointer argument: the tensor itself, or its address plus the offset."""
    kind = source.kind
    if kind == _INPUT:
        return inputs[source.index]
    if kind == _BUFFER:
        return buffers[source.index]
    base = inputs[source.index] if kind == _INPUT_AT else buffers[source.index]
    return (base if type(base) is int else base.data_ptr()) + source.offset


def _descriptor(desc, inputs, buffers, fast):
    base = desc.base
    if fast:
        source = base
        ptr = _pointer(source, inputs, buffers)
        new_base = _Pointer(ptr if isinstance(ptr, int) else ptr.data_ptr(), desc.recorded.base.dtype)
    else:
        new_base = _tensor(base, inputs, buffers)
    copy = object.__new__(type(desc.recorded))
    copy.__dict__.update(desc.recorded.__dict__)
    copy.base = new_base
    return copy


def _no_launch_hooks() -> bool:
    """No launch hook is set (Triton 3.6 keeps None there, later versions an empty HookChain)."""
    runtime = _knobs.runtime
    return all(hook is None or not getattr(hook, "calls", True)
               for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook))


def _buffers(plan, fast):
    """The call's buffers: outputs and filled buffers as tensors of their own, the others carved from one scratch
    allocation (addresses on the compiled path, typed views on the re-launch path). The scratch tensor is returned
    too: it must outlive the launches' enqueueing (the caching allocator then reuses it in stream order). A plan by
    lifetime gets None for every buffer: `_replay` allocates them step by step."""
    if plan.allocate_before is not None:
        return [None] * len(plan.buffers), None
    scratch = (torch.empty(plan.scratch_bytes, dtype=torch.uint8, device=plan.device) if plan.scratch_bytes
               else None)
    base = scratch.data_ptr() if fast and scratch is not None else 0
    buffers = []
    for shape, stride, dtype, device, offset in plan.buffers:
        if offset is None:
            buffers.append(_new_buffer(shape, stride, dtype, device))
        elif fast:
            buffers.append(base + offset)
        else:
            size = (sum((n - 1) * st for n, st in zip(shape, stride)) + 1) if all(shape) else 0
            flat = scratch[offset:offset + size * dtype.itemsize] if scratch is not None else torch.empty(
                0, dtype=torch.uint8, device=device)
            buffers.append(flat.view(dtype).as_strided(shape, stride))
    return buffers, scratch


def _new_buffer(shape, stride, dtype, device):
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


def _replay(plan, inputs):
    fast = plan.fast and _no_launch_hooks()
    buffers, scratch = _buffers(plan, fast)
    if fast:
        stream = _current_stream(plan.device)
    lifetime = plan.allocate_before is not None
    if lifetime and not plan.steps:
        for buffer in plan.allocate_before[0]:
            buffers[buffer] = _new_buffer(*plan.buffers[buffer][:4])
    for index, step in enumerate(plan.steps):
        if lifetime:
            if index:
                for buffer in plan.drop_after[index - 1]:
                    buffers[buffer] = None  # back to the caching allocator, in stream order
            for buffer in plan.allocate_before[index]:
                buffers[buffer] = _new_buffer(*plan.buffers[buffer][:4])
        if type(step) is _Fill:
            buffers[step.buffer].fill_(step.value)
            continue
        values = list(step.values)
        if fast:
            for position, kind, index, offset, desc in step.fast_fills:
                if desc is not None:
                    values[position] = _descriptor(desc, inputs, buffers, True)
                elif kind == _INPUT:
                    values[position] = inputs[index]
                elif kind == _BUFFER:
                    values[position] = buffers[index]
                elif kind == _INPUT_AT:
                    values[position] = inputs[index].data_ptr() + offset
                else:
                    buffer = buffers[index]
                    values[position] = (buffer if type(buffer) is int else buffer.data_ptr()) + offset
            step.launcher(*step.grid, stream, step.function, step.packed, None, None, None, *values)
        else:
            for position, source in step.fills:
                values[position] = (_tensor(source, inputs, buffers) if type(source) is _Source
                                    else _descriptor(source, inputs, buffers, False))
            step.kernel[step.grid](**dict(zip(step.names, values)), **step.options)
    del scratch  # enqueued: the allocator may hand it out again, in stream order
    outputs = tuple(_tensor(source, inputs, buffers) for source in plan.outputs)
    return outputs[0] if plan.single else outputs


def _current_stream(device):
    """The raw current CUDA stream of `device` (what Triton's launcher takes)."""
    return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else _current_device())


def _current_device():
    return torch._C._cuda_getDevice() if torch.cuda.is_available() else -1


def replayable(tensors) -> bool:
    """Whether a call on `tensors` (None allowed) may be replayed: plans on, eager (no compile tracing, no user
    dispatch mode, not inside another recording), plain tensors, no gradient to record."""
    return _key(tensors, ()) is not None


def _key(tensors, options):
    """The plan key of a call, or None when it may not be replayed (see `replayable`). The tensors give what the full
    path and Triton's specialization read from them (shape, strides, dtype, device, 16-byte alignment); the rest is
    what every path reads besides its arguments, the call's environment switches included."""
    if torch.compiler.is_compiling() or not ENABLED or _state.recorder is not None:  # tracing first: nothing else
        return None                                                                   # is read under torch.compile
    switches = current_environment()
    if not switches.plans:
        return None
    if torch._C._len_torch_dispatch_stack():
        return None
    if tensors[0] is None:  # refused by the full path, which names the argument
        return None
    grad_mode = torch.is_grad_enabled()
    signature = []
    for t in tensors:
        if t is None:
            signature.append(None)
        elif not plain_tensor(t, grad_mode):
            return None
        else:
            device = t.get_device()
            if device < 0 and t.is_meta:  # -1 like the CPU's; the full path refuses it
                return None
            signature.append((t.shape, t.stride(), t.dtype, device, t.data_ptr() % _ALIGN == 0))
    # allow_tf32 read as torch.backends.cuda.matmul's getter does, without its __getattr__
    current = torch._C._cuda_getDevice() if tensors[0].is_cuda else -1
    return (options, _types(options), tuple(signature), grad_mode, current, torch._C._get_cublas_allow_tf32(),
            switches.plan_key())


def _types(options):
    """The type of each option, and of each item of a tuple option: `==` alone takes 2.0 and True for 2, so a call
    whose options differ from a plan's only in type (and that the full path may refuse) would replay that plan."""
    types = tuple(map(type, options))
    if tuple in types:  # fused_experts' fp8_block_shape
        for option in options:
            if type(option) is tuple:
                types += tuple(map(type, option))
    return types


class PlanCache:
    """Plans of one entry point, keyed by (options and their types, tensor signature, global state)."""

    def __init__(self, name, by_lifetime=False):
        self.name = name
        self.by_lifetime = by_lifetime  # allocate each buffer at its first use, drop it after its last (module doc)
        self._plans = {}
        self.last_reason = None  # why the last new signature was not recorded (tests, benchmarks)
        self.replays = 0  # calls served from a plan
        _CACHES.append(self)

    def __len__(self):
        """Signatures seen: each with its plan, or None where it cannot be replayed."""
        return len(self._plans)

    def run(self, fn, tensors, options):
        """`fn(*tensors, *options)` (tensors[0] a tensor, the others tensors or None; `options` hashable, everything
        else the call depends on): replayed from this signature's
        plan when there is one, recorded when the signature is new, in full when it cannot be replayed, and in full
        inside another cache's record (a call is planned at one level: the record above holds these launches)."""
        if _state.recorder is not None:
            return fn(*tensors, *options)
        key = _key(tensors, options)
        if key is None:
            return fn(*tensors, *options)
        try:
            plan = self._plans.get(key, False)
        except TypeError:  # an unhashable option: no plan
            return fn(*tensors, *options)
        if plan is None:
            return fn(*tensors, *options)
        if plan is not False:
            self.replays += 1
            return _replay(plan, tensors)
        return self._record(key, fn, tensors, options)

    def _record(self, key, fn, tensors, options):
        recorder = _Recorder()
        _state.recorder = recorder
        try:
            with recorder:
                result = fn(*tensors, *options)
        finally:
            _state.recorder = None
        try:
            plan = _make_plan(recorder, tensors, result, self.by_lifetime)
            self.last_reason = None
        except NotReplayable as reason:
            plan, self.last_reason = None, str(reason)
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        self._plans[key] = plan
        return result

    def clear(self):
        self._plans.clear()

    def __len__(self):
        return len(self._plans)

    def replayable_count(self):
        return sum(plan is not None for plan in self._plans.values())


_CACHES = []


def clear():
    """Forget every plan (after changing a module attribute a path reads)."""
    for cache in _CACHES:
        cache.clear()
