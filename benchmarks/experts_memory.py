"""Where the bytes of one experts training step go: live tensor storage over a forward and a backward, measured on
tiny shapes without a GPU and extrapolated to real models.

    PYTHONPATH=torch-ext:scripts:benchmarks python benchmarks/experts_memory.py [--json PATH]
        [--models mixtral-8x7b gpt-oss-120b] [--tokens 4096 16384] [--layouts mixtral gpt-oss]
        [--train all | activations] [--dtype bf16 | fp32] [--min-mib 1]

One step is `out = experts(x, ...)` then `torch.autograd.grad(out, trained, grad_out)`, where `trained` is x,
w_gate_up, w_down, topk_weights and the biases (--train all, the default) or x and topk_weights alone (--train
activations: frozen experts), for two implementations on the same tensors:

  moe_dispatch  moe_dispatch.fused_experts, replay plans off (host/replay.py), so the full path runs and is seen
  grouped_mm    transformers' experts module with experts_implementation="grouped_mm" (MixtralExperts, or
                GptOssExperts for the GPT-OSS layout) on the same storage, torch._grouped_mm inside; where that cannot
                run a step here, "batched_mm" stands in and the report says so

and two layouts (`LAYOUTS`): "mixtral" (w_gate_up [E, 2F, H], w_down [E, H, F], silu, no biases) and "gpt-oss" (as
transformers stores GPT-OSS: [E, H, 2F] with gate and up interleaved, [E, F, H], swiglu_oai, both biases).

  measure      `StorageTracker`, a TorchDispatchMode: every storage an op returns that no live buffer or input holds
               is a buffer (its bytes, the op, the phase, who asked for it: the innermost package or transformers
               frame, else the autograd node running); `weakref.finalize` on the storage notes its free;
               saved_tensors_hooks mark what autograd keeps for the backward. A custom operator (torch.library) runs
               its Python body under the tracker, so the buffers inside it are seen one by one. Live bytes leave out
               the step's inputs (x, weights, biases, ids, routing weights, grad_out): the peak is what the step adds,
               as torch.cuda.max_memory_allocated less the allocation before the step reads on a GPU.
  formulas     the step at the three `PROBES` (T, top_k, E, H and F all varied): buffers matched across probes by
               (phase, allocated by, op, dtype, rank) and order; each dimension named by the first size expression
               of `DIM_EXPRESSIONS` that fits all three, e.g. [T*top_k, 2F]
  extrapolate  each buffer's bytes at a model's sizes, and the peak replayed over the probe's order of allocations
               and frees (that order does not depend on the sizes; which moment is the peak may)
  report       per layout and implementation the buffer table, then per model and T both peaks with the largest
               buffers live at each; --json writes every buffer, probe and cell

What it cannot see: memory an op takes inside itself (a cuBLAS or CUTLASS workspace, a copy an ATen kernel makes
without dispatching it); the package's Triton kernels take none. Dimensions that follow a tile size (tile maps,
per-column-tile partial sums) are fitted with the tiles of this device (the interpreter's table on a CPU); a GPU
picks others, which moves those few small buffers by kilobytes to a few MiB. Dispatch past 1024 assignments adds a
few per-chunk counters of E x T*top_k/128 int32 the probes do not reach.
"""

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import sys
import traceback
import weakref

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the CPU runs the kernels interpreted

from torch._library.custom_ops import OPDEFS  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import moe_dispatch as md  # noqa: E402
from model_shapes import MODEL_SHAPES  # noqa: E402  (beside this file)
from moe_dispatch.host import replay  # noqa: E402

IMPLS = ("moe_dispatch", "grouped_mm")
PHASES = ("forward", "backward")
TRAIN = ("all", "activations")
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Sizes:
    """One experts problem: T tokens, top_k experts each, E experts, hidden size H, expert FFN size F."""

    T: int
    top_k: int
    E: int
    H: int
    F: int


# The tiny shapes the step runs at. Every size changes between them and no two size expressions agree on all three,
# so each dimension of a buffer gets one name.
PROBES = (
    Sizes(T=16, top_k=2, E=4, H=64, F=32),  # the base: 2F = H and T*top_k = F here, told apart by the other two
    Sizes(T=32, top_k=2, E=4, H=64, F=32),  # T alone doubled: what scales with tokens
    Sizes(T=12, top_k=3, E=5, H=80, F=48),  # top_k, E, H and F changed: H apart from 2F, F over two 32-column tiles
)


def _cdiv(a, b):
    return -(-a // b)


def _max_tiles(s: Sizes, block_m: int) -> int:
    """dispatch.segments.max_tiles_bound: row tiles of the worst routing of T*top_k rows over E experts."""
    rows = s.T * s.top_k
    return (rows + min(s.E, rows) * (block_m - 1)) // block_m


# Names a dimension can have, tried in this order (the first that fits all probes wins); the tile-sized ones last.
DIM_EXPRESSIONS = (
    ("T*top_k", lambda s: s.T * s.top_k),
    ("T", lambda s: s.T),
    ("H", lambda s: s.H),
    ("F", lambda s: s.F),
    ("2F", lambda s: 2 * s.F),
    ("E", lambda s: s.E),
    ("E+1", lambda s: s.E + 1),
    ("top_k", lambda s: s.top_k),
    *((f"cdiv(F,{b})", lambda s, b=b: _cdiv(s.F, b)) for b in (16, 32, 64, 128)),
    *((f"cdiv(H,{b})", lambda s, b=b: _cdiv(s.H, b)) for b in (16, 32, 64, 128)),
    *((f"tiles(T*top_k,E,{b})", lambda s, b=b: _max_tiles(s, b)) for b in (16, 32, 64, 128)),
)
_EXPRESSIONS = dict(DIM_EXPRESSIONS)


# Measuring one step.


@dataclasses.dataclass
class Buffer:
    """One storage the step allocated: what made it, how big, when it lived (times index `StepRecord.events`)."""

    index: int  # allocation order within the step
    op: str  # the op that first returned the storage, e.g. "aten.empty.memory_format"
    shape: tuple  # the shape of the tensor that op returned
    dtype: str
    nbytes: int  # the storage's bytes
    phase: str  # "forward" or "backward"
    allocated_by: str  # "path:function" of the package / transformers frame, or "autograd <node>"
    born: int
    freed: int | None = None  # None: still live when the step returned
    saved: bool = False  # autograd saved it for the backward


@dataclasses.dataclass
class StepRecord:
    """What `measure_step` saw: the buffers, the ordered events ("alloc" or "free", buffer index) and the peak."""

    sizes: Sizes
    buffers: list
    events: list
    peak_bytes: int
    peak_live: tuple  # buffer indices live at the peak
    forward_end: int  # events before the backward started
    end_live: tuple  # buffer indices live after the step returned
    outputs: tuple  # buffer indices holding `out` and the gradients (what should be live at the end)
    saved_inputs: tuple  # names of the inputs autograd saved (no bytes of their own)
    ops_seen: tuple  # every op the step dispatched, once each, in first-seen order
    interpreter_buffers: int  # storages Triton's interpreter made inside launches (host copies): not counted


class StorageTracker(TorchDispatchMode):
    """Live storage bytes over a step (module docstring, "measure"). Set `phase` before each phase; `watch_graph`
    after the forward names the autograd node that allocates each backward buffer."""

    def __init__(self, inputs: dict):
        super().__init__()
        self.phase = PHASES[0]
        self.node = None  # the autograd node running (backward)
        self.buffers, self.events, self.ops_seen = [], [], {}
        self.live = {}  # storage key -> buffer index
        self.live_bytes = self.peak_bytes = 0
        self.peak_live = ()
        self.interpreter_buffers = 0
        self._finalizers = []
        self._inputs = {_storage_key(t): name for name, t in inputs.items() if t is not None}
        self.saved_inputs = set()
        self._roots = _frame_roots()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops_seen.setdefault(str(func))
        opdef = OPDEFS.get(f"{func.namespace}::{func._opname}")
        if opdef is not None:  # a Python custom operator: its body under this mode, each buffer in it seen
            with self:
                out = opdef._init_fn(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._note(t, str(func))
        return out

    def _note(self, t, op):
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live or key in self._inputs:
            return
        where = self._allocated_by()
        if where is None:
            self.interpreter_buffers += 1
            return
        index = len(self.buffers)
        self.buffers.append(Buffer(index, op, tuple(t.shape), str(t.dtype).removeprefix("torch."), storage.nbytes(),
                                   self.phase, where, born=len(self.events)))
        self.live[key] = index
        self.events.append(("alloc", index))
        self._finalizers.append(weakref.finalize(storage, self._free, key, index))
        self.live_bytes += storage.nbytes()
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_live = self.live_bytes, tuple(self.live.values())

    def stop(self):
        """Stop noting frees: what outlives the step (out, the gradients) stays live in the record."""
        for finalizer in self._finalizers:
            finalizer.detach()

    def _free(self, key, index):
        if self.live.get(key) != index:
            return
        del self.live[key]
        buffer = self.buffers[index]
        buffer.freed = len(self.events)
        self.events.append(("free", index))
        self.live_bytes -= buffer.nbytes

    def _allocated_by(self):
        """"path:function" of the innermost frame under the package or transformers; else, in the backward, the
        autograd node running (an ATen backward formula, or the engine itself), else the innermost torch frame that
        is not dispatch plumbing. None inside Triton's interpreter (its copies of launch arguments are host memory)."""
        fallback = None
        for frame, _ in traceback.walk_stack(sys._getframe(2)):
            name = frame.f_code.co_filename
            if _INTERPRETER in name:
                return None
            for root, label in self._roots:
                if not name.startswith(root):
                    continue
                where = f"{label}/{os.path.relpath(name, root)}:{frame.f_code.co_name}"
                if label != "torch":
                    return where
                if fallback is None and not any(part in name for part in _TORCH_PLUMBING):
                    fallback = where
                break
        if self.node is not None:
            return f"autograd {self.node}"
        return fallback or "(no package frame)"

    def watch_graph(self, out):
        """A pre-hook on every node of out's autograd graph that tells the tracker which node runs."""
        seen, stack = set(), [out.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            node.register_prehook(lambda grads, name=_node_name(node): setattr(self, "node", name))
            stack += [next_node for next_node, _ in node.next_functions]

    def pack(self, t):
        """saved_tensors_hooks' pack: note what autograd keeps (the tensor itself is kept, as without the hook)."""
        key = _storage_key(t)
        if key in self.live:
            self.buffers[self.live[key]].saved = True
        elif key in self._inputs:
            self.saved_inputs.add(self._inputs[key])
        return t

    @staticmethod
    def unpack(t):
        return t


def _storage_key(t):
    return t.untyped_storage()._cdata


def _node_name(node) -> str:
    """An autograd node's name, a custom operator's generated one shortened to "<op> backward"."""
    name = node.name()
    for qualname in OPDEFS:
        namespace, op = qualname.split("::")
        if name.startswith(f"GeneratedBackwardFor_{namespace}_{op}_"):
            return f"{op} backward"
    return name


# Frames an allocation is never named after: Triton's interpreter (its allocations are skipped) and the torch modules
# every dispatched op passes through.
_INTERPRETER = os.path.join("triton", "runtime", "interpreter")
_TORCH_PLUMBING = tuple(os.path.join("torch", part) for part in ("_dynamo", "_compile.py", "_ops.py", "_library",
                                                                 "overrides.py",
                                                                 os.path.join("utils", "_python_dispatch.py")))


def _frame_roots():
    """(folder, label) pairs the allocating frame is named by: the package, transformers, torch."""
    roots = [(os.path.dirname(md.__file__), "moe_dispatch")]
    with contextlib.suppress(ImportError):
        import transformers

        roots.append((os.path.dirname(transformers.__file__), "transformers"))
    roots.append((os.path.dirname(torch.__file__), "torch"))
    return [(root + os.sep, label) for root, label in roots]


@contextlib.contextmanager
def plans_off():
    """Replay plans off: host/replay.py records in its own dispatch mode, and a replay would hide the buffers."""
    enabled = replay.ENABLED
    replay.ENABLED = False
    try:
        yield
    finally:
        replay.ENABLED = enabled


@contextlib.contextmanager
def interpreter_cycles_collected():
    """Under Triton's interpreter a launch leaves a reference cycle (its recursive closures over the arguments'
    storages) that holds every buffer it was given until Python's cycle collector runs: collected after each launch,
    a buffer is freed when its last real reference goes, as on a GPU. Nothing to do where kernels run compiled."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        yield
        return
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run
    gc.collect()
    gc.freeze()  # what exists now is no garbage of the step: the collections after each launch skip it (speed)

    def run_and_collect(self, *args, **kwargs):
        try:
            return run(self, *args, **kwargs)
        finally:
            gc.collect()

    InterpretedFunction.run = run_and_collect
    try:
        yield
    finally:
        InterpretedFunction.run = run
        gc.unfreeze()


def measure_step(forward, trained: dict, frozen: dict, grad_out, sizes: Sizes) -> StepRecord:
    """One `out = forward()` then `torch.autograd.grad(out, trained, grad_out)` under a `StorageTracker`; `frozen`:
    the other inputs (ids, weights that need no gradient), left out of the bytes like `trained`."""
    tracker = StorageTracker({**trained, **frozen, "grad_out": grad_out})
    hooks = torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack)
    gc.collect()  # no earlier garbage freed inside the step
    with plans_off(), interpreter_cycles_collected(), tracker, hooks:
        out = forward()
        forward_end = len(tracker.events)
        tracker.phase = PHASES[1]
        tracker.watch_graph(out)
        grads = torch.autograd.grad(out, list(trained.values()), grad_out)
    tracker.stop()
    outputs = tuple(tracker.live.get(_storage_key(t)) for t in (out, *grads))
    return StepRecord(sizes, tracker.buffers, tracker.events, tracker.peak_bytes, tracker.peak_live, forward_end,
                      tuple(sorted(tracker.live.values())), tuple(sorted(i for i in outputs if i is not None)),
                      tuple(sorted(tracker.saved_inputs)), tuple(tracker.ops_seen), tracker.interpreter_buffers)


# The two implementations on one layout's tensors.


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    transposed: bool  # w_gate_up [E, H, 2F], w_down [E, F, H]
    interleaved: bool  # gate and up alternate along 2F
    activation: str
    biases: bool
    peer_class: str  # transformers' experts module of this layout

    def describe(self) -> str:
        weights = "w_gate_up [E, H, 2F], w_down [E, F, H]" if self.transposed else \
            "w_gate_up [E, 2F, H], w_down [E, H, F]"
        return (f"{weights}{', gate/up interleaved' if self.interleaved else ''}, {self.activation}"
                f"{', gate_up_bias and down_bias' if self.biases else ''}")


LAYOUTS = {
    "mixtral": Layout("mixtral", False, False, "silu", False, "MixtralExperts"),
    "gpt-oss": Layout("gpt-oss", True, True, "swiglu_oai", True, "GptOssExperts"),
}


@dataclasses.dataclass
class StepInputs:
    """The step's tensors: `tensors` the float ones by name (x, w_gate_up, w_down, topk_weights, the biases),
    `trained` the names of those that require grad."""

    sizes: Sizes
    tensors: dict
    trained: tuple
    topk_ids: torch.Tensor
    grad_out: torch.Tensor


def make_inputs(layout: Layout, s: Sizes, dtype, device, train="all", seed=0) -> StepInputs:
    """The layout's tensors as stored, weights randn * 0.02; top_k distinct random experts per token, fp32 softmax
    routing weights (what transformers' routers hand the experts)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size, scale=0.02):
        return (torch.randn(size, generator=gen, device=device) * scale).to(dtype)

    gate_up_shape, down_shape = ((s.E, s.H, 2 * s.F), (s.E, s.F, s.H)) if layout.transposed else \
        ((s.E, 2 * s.F, s.H), (s.E, s.H, s.F))
    tensors = dict(x=randn(s.T, s.H, scale=1.0), w_gate_up=randn(*gate_up_shape), w_down=randn(*down_shape),
                   topk_weights=torch.randn(s.T, s.top_k, generator=gen, device=device).softmax(dim=1))
    if layout.biases:
        tensors.update(gate_up_bias=randn(s.E, 2 * s.F), down_bias=randn(s.E, s.H))
    trained = tuple(tensors) if train == "all" else ("x", "topk_weights")
    for name in trained:
        tensors[name].requires_grad_()
    topk_ids = torch.rand(s.T, s.E, generator=gen, device=device).topk(s.top_k, dim=1).indices
    return StepInputs(s, tensors, trained, topk_ids, randn(s.T, s.H, scale=1.0))


def package_step(layout: Layout, inputs: StepInputs):
    """(forward, the tensors to differentiate by name) of moe_dispatch.fused_experts."""
    t = inputs.tensors

    def forward():
        return md.fused_experts(t["x"], t["w_gate_up"], t["w_down"], inputs.topk_ids, t["topk_weights"],
                                activation=layout.activation, gate_up_bias=t.get("gate_up_bias"),
                                down_bias=t.get("down_bias"), interleaved=layout.interleaved,
                                transposed=layout.transposed, swiglu_alpha=SWIGLU_ALPHA, swiglu_limit=SWIGLU_LIMIT,
                                validate=False)  # as on a GPU, where None reads no ids either

    return forward, {name: t[name] for name in inputs.trained}


# The step's tensors by the names of transformers' experts Parameters.
PEER_PARAMETERS = {"w_gate_up": "gate_up_proj", "w_down": "down_proj", "gate_up_bias": "gate_up_proj_bias",
                   "down_bias": "down_proj_bias"}


def peer_module(layout: Layout, s: Sizes, tensors: dict, implementation: str):
    """transformers' experts module of the layout holding `tensors` (Parameters on the same storage)."""
    import transformers

    if layout.name == "gpt-oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as Experts

        config = transformers.GptOssConfig(hidden_size=s.H, intermediate_size=s.F, num_local_experts=s.E,
                                           num_experts_per_tok=s.top_k, swiglu_alpha=SWIGLU_ALPHA,
                                           swiglu_limit=SWIGLU_LIMIT, experts_implementation=implementation)
    else:
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts as Experts

        config = transformers.MixtralConfig(hidden_size=s.H, intermediate_size=s.F, num_local_experts=s.E,
                                            num_experts_per_tok=s.top_k, experts_implementation=implementation)
    with torch.device("meta"):
        module = Experts(config)
    for name, attribute in PEER_PARAMETERS.items():
        if name in tensors:
            t = tensors[name]
            setattr(module, attribute, torch.nn.Parameter(t, requires_grad=t.requires_grad))
    return module


def peer_step(layout: Layout, inputs: StepInputs, implementation: str):
    """(forward, the tensors to differentiate by name) of the transformers module: gradients at its Parameters."""
    t = inputs.tensors
    module = peer_module(layout, inputs.sizes, t, implementation)

    def forward():
        return module(t["x"], inputs.topk_ids, t["topk_weights"])

    return forward, {name: getattr(module, PEER_PARAMETERS[name]) if name in PEER_PARAMETERS else t[name]
                     for name in inputs.trained}


def peer_implementation(layout: Layout, dtype, device) -> tuple[str, str | None]:
    """("grouped_mm", None) where transformers' grouped_mm experts run a step here, else ("batched_mm", why not)."""
    inputs = make_inputs(layout, PROBES[0], dtype, device)
    try:
        forward, trained = peer_step(layout, inputs, "grouped_mm")
        torch.autograd.grad(forward(), list(trained.values()), inputs.grad_out)
    except Exception as exc:  # noqa: BLE001 (any failure of the peer on this device: the stand-in runs instead)
        return "batched_mm", f"{type(exc).__name__}: {str(exc)[:160]}"
    return "grouped_mm", None


def measure(impl: str, layout: Layout, s: Sizes, dtype, device, train="all", peer_impl="grouped_mm") -> StepRecord:
    """One step of `impl` ("moe_dispatch" or "grouped_mm") at sizes s."""
    inputs = make_inputs(layout, s, dtype, device, train)
    forward, trained = package_step(layout, inputs) if impl == "moe_dispatch" else \
        peer_step(layout, inputs, peer_impl)
    frozen = {name: t for name, t in inputs.tensors.items() if name not in trained}
    return measure_step(forward, trained, {**frozen, "topk_ids": inputs.topk_ids}, inputs.grad_out, s)


# Formulas and extrapolation.


@dataclasses.dataclass
class Fitted:
    """One buffer of the first probe with its dimensions named (None where no expression fits every probe)."""

    buffer: Buffer
    dims: tuple  # per dimension: a name of DIM_EXPRESSIONS, a constant ("1"), or None
    itemsize: int

    @property
    def formula(self) -> str:
        dims = ", ".join(d if d is not None else f"{n}?" for d, n in zip(self.dims, self.buffer.shape))
        return f"[{dims}]"

    def nbytes(self, s: Sizes) -> int:
        """Bytes at sizes s (a dimension without a name keeps its first-probe size)."""
        numel = 1
        for dim, measured in zip(self.dims, self.buffer.shape):
            numel *= measured if dim is None else (int(dim) if dim.isdigit() else _EXPRESSIONS[dim](s))
        return numel * self.itemsize


def _signature(b: Buffer):
    return (b.phase, b.allocated_by, b.op, b.dtype, len(b.shape))


def fit(records: list) -> list:
    """The first record's buffers with named dimensions, each matched in the other records by signature and order."""
    orders = []
    for record in records:
        count, order = {}, {}
        for b in record.buffers:
            key = _signature(b)
            order[(key, count.setdefault(key, 0))] = b
            count[key] += 1
        orders.append(order)
    fitted, count = [], {}
    for b in records[0].buffers:
        key = _signature(b)
        n = count.setdefault(key, 0)
        count[key] += 1
        matches = [order.get((key, n)) for order in orders]
        itemsize = torch.empty((), dtype=getattr(torch, b.dtype)).element_size()
        if not all(m is not None and m.nbytes == math.prod(m.shape) * itemsize for m in matches):
            fitted.append(Fitted(b, (None,) * len(b.shape), itemsize))  # bytes as measured (flagged by "?")
            continue
        dims = tuple(_name_dim([m.shape[axis] for m in matches], [r.sizes for r in records])
                     for axis in range(len(b.shape)))
        fitted.append(Fitted(b, dims, itemsize))
    return fitted


def _name_dim(values, sizes):
    if len(set(values)) == 1:  # every size changes between probes: a dimension that does not is a constant
        return str(values[0])
    for name, expression in DIM_EXPRESSIONS:
        if all(expression(s) == v for s, v in zip(sizes, values)):
            return name
    return None


@dataclasses.dataclass
class Peak:
    """A step's live bytes replayed at some sizes: the peak, what was live then, and when."""

    nbytes: int
    live: tuple  # buffer indices live at the peak
    reached_by: int  # the buffer whose allocation made the peak
    after_forward: int  # live bytes when the forward returned: what it saved for the backward, and out


def replay_peak(record: StepRecord, fitted: list, s: Sizes) -> Peak:
    sizes = [f.nbytes(s) for f in fitted]
    live, live_bytes, best, best_live, reached_by, after_forward = set(), 0, 0, (), -1, 0
    for clock, (kind, index) in enumerate(record.events):
        if clock == record.forward_end:
            after_forward = live_bytes
        if kind == "alloc":
            live.add(index)
            live_bytes += sizes[index]
            if live_bytes > best:
                best, best_live, reached_by = live_bytes, tuple(sorted(live)), index
        else:
            live.discard(index)
            live_bytes -= sizes[index]
    if record.forward_end == len(record.events):
        after_forward = live_bytes
    return Peak(best, best_live, reached_by, after_forward)


def model_sizes(name: str, T: int) -> Sizes:
    shape = MODEL_SHAPES[name]
    return Sizes(T=T, top_k=shape.top_k, E=shape.num_experts, H=shape.hidden, F=shape.ffn)


def analyse(layout: Layout, dtype, device, cells, train="all", peer_impl="grouped_mm") -> dict:
    """Both implementations on one layout: probe records, fitted buffers, the peak at every (model, T) cell."""
    result = {}
    for impl in IMPLS:
        records = [measure(impl, layout, s, dtype, device, train, peer_impl) for s in PROBES]
        fitted = fit(records)
        result[impl] = dict(records=records, fitted=fitted,
                            cells={cell: replay_peak(records[0], fitted, model_sizes(*cell)) for cell in cells},
                            probe_peaks=[replay_peak(r, fitted, r.sizes).nbytes for r in records])
    return result


# Reports.


def fmt_bytes(n: int) -> str:
    """Binary units: 1.75G is 1.75 GiB."""
    for unit, scale in (("G", GIB), ("M", 2**20), ("K", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n}B"


def buffer_name(b: Buffer) -> str:
    """"f5" / "b24": phase letter and allocation order."""
    return f"{b.phase[0]}{b.index}"


def lifetime(b: Buffer, record: StepRecord) -> str:
    """When a buffer lived, by phase: "f-b" allocated in the forward and freed in the backward, "b-end" live when the
    step returned (an output or a gradient)."""
    def phase(clock):
        return "end" if clock is None else PHASES[clock >= record.forward_end][0]
    return f"{phase(b.born)}-{phase(b.freed)}"


def buffer_table(analysis: dict, cells: list, min_bytes: int) -> list:
    """Lines of one implementation's buffer table: each buffer reaching min_bytes at some cell, the rest summed."""
    fitted, peaks, record = analysis["fitted"], analysis["cells"], analysis["records"][0]
    heads = [f"{model} T={T}" for model, T in cells]
    width = max(9, *(len(h) for h in heads))

    def row(name, shape, dtype="", saved="", lived="", values=(), tail=""):
        return (f"  {name:>6} {shape:<22} {dtype:<8} {saved:<5} {lived:<6} "
                + " ".join(f"{v:>{width}}" for v in values) + tail).rstrip()

    lines = [row("buffer", "shape", "dtype", "saved", "lived", heads, "  allocated by (op)")]
    rest, rest_count = [0] * len(cells), 0
    for f in fitted:
        sizes = [f.nbytes(model_sizes(*cell)) for cell in cells]
        if max(sizes) < min_bytes:
            rest, rest_count = [a + b for a, b in zip(rest, sizes)], rest_count + 1
            continue
        b = f.buffer
        marks = [fmt_bytes(n) + ("*" if b.index in peaks[cell].live else " ") for n, cell in zip(sizes, cells)]
        lines.append(row(buffer_name(b), f.formula, b.dtype, "yes" if b.saved else "", lifetime(b, record), marks,
                         f"  {b.allocated_by} ({b.op})"))
    if rest_count:
        lines.append(row("", f"{rest_count} under {fmt_bytes(min_bytes)}", values=[fmt_bytes(n) + " " for n in rest]))
    lines.append(row("", "after the forward", values=[fmt_bytes(peaks[c].after_forward) + " " for c in cells]))
    lines.append(row("", "peak (* live there)", values=[fmt_bytes(peaks[c].nbytes) + " " for c in cells]))
    lines.append(row("", "reached at", values=[buffer_name(fitted[peaks[c].reached_by].buffer) + " " for c in cells]))
    return lines


def top_at_peak(analysis: dict, cell, count: int) -> str:
    """The `count` largest buffers live at the cell's peak: "b14 1.75G [E, 2F, H]; ..." (names as in the table)."""
    fitted, s = analysis["fitted"], model_sizes(*cell)
    live = sorted(analysis["cells"][cell].live, key=lambda i: -fitted[i].nbytes(s))
    return "; ".join(f"{buffer_name(fitted[i].buffer)} {fmt_bytes(fitted[i].nbytes(s))} {fitted[i].formula}"
                     for i in live[:count])


def report(layout: Layout, analysis: dict, cells: list, train: str, peer_impl: str, peer_note, min_bytes: int):
    peer = f"transformers {layout.peer_class}, experts_implementation={peer_impl!r}"
    lines = [f"== layout {layout.name}: {layout.describe()}; --train {train}; peer: {peer}"]
    if peer_note:
        lines.append(f"   grouped_mm cannot run a step here ({peer_note}): {peer_impl!r} stands in")
    for impl in IMPLS:
        a = analysis[impl]
        record = a["records"][0]
        measured = [r.peak_bytes for r in a["records"]]
        check = "= the formulas replayed there" if measured == a["probe_peaks"] else f"!= {a['probe_peaks']} replayed"
        lines.append(f"-- {impl}: bytes per buffer at each cell (* live at that cell's peak; buffer: phase letter and "
                     f"allocation order; lived: phases of allocation and free)")
        lines += buffer_table(a, cells, min_bytes)
        lines.append(f"   inputs autograd saved (no bytes of their own): {', '.join(record.saved_inputs) or '-'}; "
                     f"peaks at the probes {measured} B {check}")
        if impl == "grouped_mm":
            kernels = [op for op in record.ops_seen if "grouped_mm" in op or "bmm" in op]
            lines.append(f"   matmul ops the peer dispatched: {', '.join(kernels) or '-'}")
    lines.append("-- predicted peak above the inputs (GiB), and the largest buffers live at each")
    for cell in cells:
        peaks = {impl: analysis[impl]["cells"][cell].nbytes for impl in IMPLS}
        lines.append(f"   {cell[0]} T={cell[1]}: " + ", ".join(f"{impl} {peaks[impl] / GIB:.2f}" for impl in IMPLS)
                     + f" (difference {(peaks[IMPLS[0]] - peaks[IMPLS[1]]) / GIB:+.2f})")
        for impl in IMPLS:
            lines.append(f"     {impl:<12} {top_at_peak(analysis[impl], cell, 7)}")
    return lines


def to_json(layout: Layout, analysis: dict, cells: list, peer_impl: str, peer_note) -> dict:
    out = dict(layout=dataclasses.asdict(layout), description=layout.describe(), peer_implementation=peer_impl,
               peer_note=peer_note, implementations={})
    for impl in IMPLS:
        a = analysis[impl]
        record = a["records"][0]
        buffers = []
        for f in a["fitted"]:
            b = f.buffer
            buffers.append(dict(name=buffer_name(b), phase=b.phase, op=b.op, allocated_by=b.allocated_by,
                                dtype=b.dtype, saved=b.saved, formula=f.formula, probe_shape=list(b.shape),
                                probe_bytes=b.nbytes, born=b.born, freed=b.freed,
                                cells={f"{m} T={T}": dict(bytes=f.nbytes(model_sizes(m, T)),
                                                          live_at_peak=b.index in a["cells"][(m, T)].live)
                                       for m, T in cells}))
        out["implementations"][impl] = dict(
            buffers=buffers, forward_end=record.forward_end, events=record.events,
            probes=[dict(sizes=dataclasses.asdict(r.sizes), measured_peak=r.peak_bytes, replayed_peak=p,
                         end_live=list(r.end_live), outputs=list(r.outputs),
                         interpreter_buffers=r.interpreter_buffers) for r, p in zip(a["records"], a["probe_peaks"])],
            saved_inputs=list(record.saved_inputs), ops_seen=list(record.ops_seen),
            cells={f"{m} T={T}": dict(peak=p.nbytes, after_forward=p.after_forward, reached_by=p.reached_by,
                                      live_at_peak=list(p.live)) for (m, T), p in a["cells"].items()})
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["mixtral-8x7b", "gpt-oss-120b"], choices=sorted(MODEL_SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--train", default="all", choices=TRAIN,
                   help="all: every float input gets a gradient; activations: x and topk_weights only")
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--min-mib", type=float, default=1.0, help="buffers under this at every cell are summed in a row")
    p.add_argument("--json", metavar="PATH", help="write every buffer, event, probe and cell here")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype]
    cells = [(model, T) for model in args.models for T in args.tokens]
    results = dict(device=str(device), dtype=args.dtype, train=args.train, torch=torch.__version__,
                   probes=[dataclasses.asdict(s) for s in PROBES], layouts={})
    for name in args.layouts:
        layout = LAYOUTS[name]
        peer_impl, peer_note = peer_implementation(layout, dtype, device)
        analysis = analyse(layout, dtype, device, cells, args.train, peer_impl)
        print("\n".join(report(layout, analysis, cells, args.train, peer_impl, peer_note, int(args.min_mib * 2**20))),
              end="\n\n", flush=True)
        results["layouts"][name] = to_json(layout, analysis, cells, peer_impl, peer_note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
