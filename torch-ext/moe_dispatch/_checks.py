"""Argument validation shared by the public entry points. Every error names the argument at fault."""

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(name, value, *, ndim=None, dtypes=None, min_ndim=None):
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
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
    present = {k: v for k, v in tensors.items() if v is not None}
    devices = {k: v.device for k, v in present.items()}
    first_name, first = next(iter(devices.items()))
    for name, device in devices.items():
        if device != first:
            raise ValueError(f"{name} is on {device} but {first_name} is on {first}; all tensors must share a device")


def check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")


def check_top_k(top_k, num_experts):
    if not isinstance(top_k, int) or isinstance(top_k, bool):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")


def check_ids_in_range(name, ids, num_experts, validate):
    """Raise for ids outside [0, num_experts).

    Reading ids costs a device-to-host sync on a GPU, so by default (`validate=None`) only CPU tensors are checked;
    on a GPU out-of-range ids then contribute nothing (the expert-parallel sentinel convention).
    """
    if validate is False or ids.numel() == 0:
        return
    if validate is None and ids.device.type != "cpu":
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= num_experts:
        raise ValueError(f"{name} must lie in [0, {num_experts}), got values in [{low}, {high}]")


def check_token_weights(top_k_weights, num_tokens, top_k):
    """num_tokens / top_k given as ints by the v1 functions, and top_k_weights [num_tokens, top_k] to match."""
    check_float("top_k_weights", top_k_weights, ndim=2)
    if not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    check_dim("top_k_weights", top_k_weights, 0, num_tokens, "num_tokens")
    check_dim("top_k_weights", top_k_weights, 1, top_k, "top_k")
