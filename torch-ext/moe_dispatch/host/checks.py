"""Argument validation shared by the public entry points. Every error names the argument at fault.

Every tensor argument goes through `check_tensor` (or `check_same_device`, which calls it): anything but a tensor is a
TypeError, a tensor on the meta device (no data for a kernel to read) a ValueError. The other options are checked by
kind, at the public entry before anything else runs (a plan lookup included): integers (`num_experts`, `top_k`, ...)
by `check_int` (a float or a bool is a TypeError even where it equals an int), switches by `check_bool` (only True or
False: the string "False" is truthy, 0 and 1 are ints), real numbers by `check_real` (an int or a float, not a bool,
a string or None unless None means something; NaN and, where asked, infinities refused), and values chosen from a
list by `check_choice` (ValueError listing the choices).

Index tensors from a caller (`expert_offsets`, `sorted_idx`, `restore_idx`, ids) are checked by value only where that
is free (CPU tensors) or asked for (`validate=True`: one device-to-host sync); the kernels bound every index they read
anyway, so an unchecked bad index gives a wrong result, never a crash or a write outside an output.
"""

import math
import numbers
import warnings

import torch

from . import device as _device

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
# Routing weights are applied in fp32 inside the kernels, so a float64 router may hand its weights over unchanged.
ROUTING_WEIGHT_DTYPES = FLOAT_DTYPES + (torch.float64,)


def check_tensor(name, value, *, ndim=None, dtypes=None, min_ndim=None, allow_meta=False):
    """`allow_meta`: a tensor on meta passes (a module's weights, held before they are loaded)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.is_meta and not allow_meta:  # shapes only: a launch would fail in torch ("Cannot copy out of meta tensor")
        raise ValueError(f"{name} is on meta, a device without data for the kernels to read; materialize it first "
                         f"(weights: module.to_empty(device=...), then load their values)")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    if min_ndim is not None and value.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions, got shape {tuple(value.shape)}")
    if dtypes is not None and value.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {str(value.dtype).replace('torch.', '')}")
    return value


def check_float(name, value, **kwargs):
    return check_tensor(name, value, dtypes=FLOAT_DTYPES, **kwargs)


def check_index(name, value, **kwargs):
    return check_tensor(name, value, dtypes=INDEX_DTYPES, **kwargs)


def check_dim(name, value, dim, expected, what):
    if value.shape[dim] != expected:
        raise ValueError(
            f"{name} has {value.shape[dim]} in dimension {dim} ({what}) but {expected} was expected; "
            f"shape {tuple(value.shape)}"
        )


def check_same_device(**tensors):
    """The given tensors (None for an absent optional one) are tensors with data (`check_tensor`) on one device."""
    present = {k: v for k, v in tensors.items() if v is not None}
    for name, value in present.items():
        check_tensor(name, value)
    devices = {k: v.device for k, v in present.items()}
    first_name, first = next(iter(devices.items()))
    for name, device in devices.items():
        if device != first:
            raise ValueError(f"{name} is on {device} but {first_name} is on {first}; all tensors must share a device")


def check_kernel_device(name, tensor):
    """ValueError naming `name` when `tensor` is where Triton kernels cannot take it: the CPU without the interpreter.
    `host.library.call` checks each operator call's first tensor; public functions that launch kernels without `call`
    check theirs after validating."""
    if not _device.kernels_run_on(tensor.device):
        raise ValueError(f"{name} is on the CPU, where moe_dispatch's Triton kernels run only through Triton's "
                         "interpreter (TRITON_INTERPRET=1, set before triton is imported); move the tensors to a GPU")


def check_choice(name, value, choices):
    """One of the strings `choices`; anything else (another string, a non-string) is a ValueError listing them."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")
    return value


def check_bool(name, value, *, none=False):
    """True or False (or None, where `none` says None means something): a TypeError for anything else, the string
    "False" (truthy) and the ints 0 and 1 included."""
    if type(value) is bool or (none and value is None):
        return value
    allowed = "a bool or None" if none else "a bool"
    raise TypeError(f"{name} must be {allowed} (True or False), got {type(value).__name__} {value!r}")


def check_real(name, value, *, none=False, finite=True, minimum=None, above=None):
    """A real number: an int or a float (numpy's too), not a bool, a string or a tensor; None only where `none`. NaN is
    a ValueError, and so are infinities where `finite`, values below `minimum` and values not above `above`."""
    if none and value is None:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        allowed = "a real number (int or float) or None" if none else "a real number (int or float)"
        raise TypeError(f"{name} must be {allowed}, got {type(value).__name__} {value!r}")
    if math.isnan(value) or (finite and math.isinf(value)):
        raise ValueError(f"{name} must be {'finite' if finite else 'a number (not NaN)'}, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if above is not None and value <= above:
        raise ValueError(f"{name} must be > {above}, got {value}")
    return value


def check_int(name, value, minimum):
    """An int (not a bool, not a float equal to an int) >= minimum."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_top_k(top_k, num_experts):
    if not isinstance(top_k, int) or isinstance(top_k, bool):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")


def check_ids_in_range(name, ids, num_experts, validate):
    """Raise for ids outside [0, num_experts).

    Reading ids costs a device-to-host sync on a GPU, so by default (`validate=None`) only CPU tensors are checked;
    on a GPU out-of-range ids then contribute nothing (the expert-parallel sentinel convention). Under torch.compile
    values are never read (a data-dependent read would break the graph); the kernels skip such ids anyway.
    """
    if not reads_values(validate, ids) or ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= num_experts:
        raise ValueError(f"{name} must lie in [0, {num_experts}), got values in [{low}, {high}]")


def check_token_weights(top_k_weights, num_tokens, top_k):
    """num_tokens / top_k given as ints by the v1 functions, and top_k_weights [num_tokens, top_k] to match."""
    check_tensor("top_k_weights", top_k_weights, ndim=2, dtypes=ROUTING_WEIGHT_DTYPES)
    check_int("num_tokens", num_tokens, 0)
    check_int("top_k", top_k, 1)
    check_dim("top_k_weights", top_k_weights, 0, num_tokens, "num_tokens")
    check_dim("top_k_weights", top_k_weights, 1, top_k, "top_k")


def check_hidden_size(name, value):
    """The last dimension of `value` (H) must be at least 1: a router or an expert needs an input."""
    if value.shape[-1] < 1:
        raise ValueError(f"{name} must have a hidden size (last dimension) >= 1, got shape {tuple(value.shape)}")


def check_finite_number(name, value, *, minimum=None):
    """A finite real number (`check_real`) >= minimum."""
    return check_real(name, value, minimum=minimum)


def validate_option(validate, validate_ids, function):
    """The one `validate` switch of a function that also accepts the v1.0 spelling `validate_ids` (deprecated alias:
    same meaning, kept so v1.0 callers keep working)."""
    check_bool("validate", validate, none=True)
    check_bool("validate_ids", validate_ids, none=True)
    if validate_ids is None:
        return validate
    warnings.warn(f"{function}(validate_ids=...) is deprecated; pass validate=... (same meaning)", DeprecationWarning,
                  stacklevel=3)
    if validate is not None and validate != validate_ids:
        raise ValueError(f"{function}: validate={validate!r} and validate_ids={validate_ids!r} disagree")
    return validate_ids


def reads_values(validate, *tensors):
    """Whether to check index values: always with validate=True (one sync on a GPU), never with False, and by
    default (None) only when every tensor is on the CPU, where reading them costs nothing."""
    check_bool("validate", validate, none=True)
    if torch.compiler.is_compiling():  # data-dependent reads would break the graph; the kernels bound indices anyway
        return False
    if validate is None:
        return all(t.device.type == "cpu" for t in tensors if t is not None)
    return validate


def expert_offsets_problems(expert_offsets, num_rows, rows_name):
    """(flag, message) pairs for `raise_problems`: offsets [E + 1] must start at 0, not decrease and end at or
    before the num_rows rows they index."""
    offsets = expert_offsets.long()
    return [
        (offsets[0] != 0, lambda: f"expert_offsets must start at 0, got expert_offsets[0] = {int(offsets[0])}"),
        ((offsets[1:] < offsets[:-1]).any(),
         lambda: f"expert_offsets must be non-decreasing, got {offsets.tolist()}"),
        (offsets[-1] > num_rows,
         lambda: f"expert_offsets[-1] = {int(offsets[-1])} exceeds the {num_rows} rows of {rows_name}"),
    ]


def index_map_problems(name, index, bound, what):
    """(flag, message) pairs: entries of `index` point into range(bound) (`what` names it) or are negative ("none"),
    and no two entries point to the same place (a permutation of part of range(bound))."""
    if index.numel() == 0:
        return []
    values = index.long()
    ordered = torch.sort(values).values
    return [
        (values.max() >= bound,
         lambda: f"{name} must lie in [0, {bound}) ({what}) or be negative (none), got max {int(values.max())}"),
        (((ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)).any(),
         lambda: f"{name} is not a permutation: value {_first_duplicate(ordered)} appears more than once"),
    ]


def _first_duplicate(ordered):
    same = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)
    return int(ordered[1:][same][0])


def raise_problems(problems):
    """Raise ValueError for the first true flag; all flags are read from the device in one transfer."""
    if not problems:
        return
    flags = torch.stack([torch.as_tensor(flag).reshape(()) for flag, _ in problems]).tolist()
    for flag, (_, message) in zip(flags, problems):
        if flag:
            raise ValueError(message())


_GRADIENT_WARNED = set()  # names of the forward-only functions that have warned once in this process


def warn_if_gradient_cut(function_name, **tensors):
    """Warn once per function when grad mode is on and an input requires grad: forward-only kernels return tensors
    without a grad_fn, so a gradient would stop here without a word."""
    if function_name in _GRADIENT_WARNED or not torch.is_grad_enabled():
        return
    needing = [name for name, t in tensors.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    if not needing:
        return
    _GRADIENT_WARNED.add(function_name)
    warnings.warn(
        f"moe_dispatch.{function_name} is forward-only: its output carries no gradient to {', '.join(needing)}. "
        f"Run it under torch.no_grad() / torch.inference_mode(), or detach the inputs.",
        UserWarning,
        stacklevel=3,
    )


def segment_rows_problems(name, index, expert_offsets):
    """(flag, message) pair: every row inside a segment (p < expert_offsets[-1]) names an assignment (index >= 0)."""
    inside = torch.arange(index.shape[0], device=index.device) < expert_offsets[-1]
    bad = inside & (index < 0)
    return [(bad.any(), lambda: f"{name} is negative (no assignment) at row {int(bad.nonzero()[0])}, which lies "
                                f"inside a segment of expert_offsets")]
