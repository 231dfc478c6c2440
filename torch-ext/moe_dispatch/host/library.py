"""torch.library plumbing shared by the stage modules: operator names and when a call goes through an operator.

Every Triton launcher a public function reaches is registered as a custom operator under this build's namespace
(`_ops.py`), with a fake (meta) implementation, so torch.compile traces through it without a graph break and autograd
sees the registered backward. In plain eager inference (no autograd, no tracing) `call` runs the operator's Python
implementation directly: the same code, without the ~10 us the dispatcher adds per call, which matters at decode.
"""

import torch
from torch._library.custom_ops import OPDEFS

from .._ops import add_op_namespace_prefix
from . import device as _device
from .checks import check_kernel_device

# What the eager fast paths take as it is: no subclass (fake, functional and wrapped tensors need the operator)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def plain_tensor(t: torch.Tensor, grad_mode: bool) -> bool:
    """Whether the eager fast paths (`call` here, host/replay.py's plans) may take tensor `t` as it is: a plain
    Tensor or Parameter, of which autograd needs no record under `grad_mode`."""
    return type(t) in _PLAIN_TENSORS and not (grad_mode and t.requires_grad)


def custom_op(name, mutates_args=()):
    """`torch.library.custom_op` under this build's namespace.

    Importing one build twice in a process (a second `get_kernel` of the same revision) reuses the operator the first
    import registered: the same build id means the same source, and torch refuses a second definition.
    """
    qualname = add_op_namespace_prefix(name)
    if qualname in OPDEFS:
        return lambda fn: OPDEFS[qualname]
    return torch.library.custom_op(qualname, mutates_args=mutates_args)


def needs_operator(args) -> bool:
    """True when a call must go through the registered operator: under torch.compile, on fake or wrapped tensors, or
    when autograd has to record it."""
    if torch.compiler.is_compiling():
        return True
    grad_mode = torch.is_grad_enabled()
    for arg in args:
        if isinstance(arg, torch.Tensor) and not plain_tensor(arg, grad_mode):
            return True
    return False


def eager_autograd(args) -> bool:
    """Whether a call that autograd has to record may run as a plain `torch.autograd.Function` instead of the
    operator: eagerly (not traced by torch.compile), on plain tensors (Tensor or Parameter, requiring grad or not)."""
    if torch.compiler.is_compiling():
        return False
    return all(type(arg) in _PLAIN_TENSORS for arg in args if isinstance(arg, torch.Tensor))


def call(op, *args, autograd_function=None):
    """Run custom operator `op` on positional `args`: its implementation directly in eager inference, else the op.
    `autograd_function`: a `torch.autograd.Function` with the op's forward and registered backward, which an eager
    call on plain tensors that autograd has to record runs instead of the op (`eager_autograd`): the same work
    without the dispatcher's round trip and torch's custom-op autograd wrapper.

    Entry points validate first (their tensors share a device), so the first tensor argument's device is the call's:
    CPU tensors without Triton's interpreter are refused here, naming the argument, instead of failing in Triton's
    launcher ("cannot be accessed from Triton")."""
    first = next((i for i, arg in enumerate(args) if isinstance(arg, torch.Tensor)), None)
    if first is not None and not _device.kernels_run_on(args[first].device):  # the name is looked up only then
        check_kernel_device(_argument_name(op, first), args[first])
    if needs_operator(args):
        if autograd_function is not None and eager_autograd(args):
            return autograd_function.apply(*args)
        return op(*args)
    return op._init_fn(*args)  # the function the op was defined from (CustomOpDef keeps it as `_init_fn`)


def _argument_name(op, index):
    """The name of `op`'s positional argument `index` (its schema's), for error messages."""
    try:
        return f"{op._name}'s {op._opoverload._schema.arguments[index].name}"
    except (AttributeError, IndexError):
        return f"{op._name}'s argument {index}"
