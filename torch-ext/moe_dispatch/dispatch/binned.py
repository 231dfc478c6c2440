"""MegaBlocks-style routing copies: capacity-limited (binned), block-padded and plain, in pure Triton.

Vocabulary (MegaBlocks' conventions, kept so its users can switch by changing the import):

  assignment a = t * top_k + j        token t's j-th expert; N = T * top_k of them
  indices[p]                          the assignment at sorted position p (assignments sorted by expert, stably)
  bins[e]                             INCLUSIVE cumulative count: expert e owns sorted positions [start_e, bins[e])
                                      with start_e = bins[e-1] (0 for e = 0); so bins[-1] == N
  bin_ids[p]                          the expert of sorted position p (accepted by the plain/padded ops for signature
                                      compatibility; the kernels derive the expert from `bins`)
  padded_bins[e]                      inclusive cumulative counts after rounding each expert up to a block multiple

The three layouts differ only in where sorted position p (of expert e, j = p - start_e) lives in the expert buffer:

  plain    row p                                          gather/scatter[_wgrad]              buffer [N, H]
  padded   row padded_start_e + j                         padded_gather/scatter[_wgrad]       buffer [R, H]
  binned   row e * C + j, DROPPED when j >= C             binned_gather/scatter[_wgrad]       buffer [E, C, H]

One kernel family in `dispatch/row_copies.py` serves all three (the `LAYOUT` constexpr):

  _gather_kernel        grid over buffer rows: buffer[r] = x[a // top_k] * weights[a] (zeros where r holds nothing)
  _buffer_rows_kernel   grid over sorted positions: buffer_row[a] = row of assignment a in the buffer, -1 if dropped
  _scatter_kernel       grid over tokens: out[t] = sum_j buffer[buffer_row[t*k+j]] * weights[t*k+j], j in order
  _wgrad_kernel         grid over assignments: wgrad[a] = <buffer[buffer_row[a]], grad[a // top_k]>

Every output element is written exactly once (no memset, no atomics: deterministic); scaled copies and dot products
accumulate in fp32 (fp64 for fp64 inputs); offsets are int64. Output shapes come from host-known sizes only
(E = len(bins), C given, T = len(indices) // top_k), so the forward never syncs with the device; the one exception is
`padded_gather` without `num_rows`, which reads padded_bins[-1] like MegaBlocks does.

Autograd and compile: the three copies are torch custom operators (`row_gather`, `row_scatter`, `row_wgrad`, under the
build's namespace like the experts' operators), so every function here compiles with fullgraph=True; gather and
scatter register their backward, so every gather/scatter function is differentiable with respect to `x` and
`weights` (eager inference calls the kernels directly, see host.library.call). Backward:
gather's dx = scatter of the gradient with the same weights (unweighted when weights is None), d(weights) = wgrad;
scatter's dx = gather of the gradient with the same weights, d(weights) = wgrad. The `*_wgrad` functions themselves
are not differentiable.

Validation: shapes, ranks, dtypes and devices are always checked (ValueError / TypeError naming the argument). Value
checks (bins non-decreasing, bins[-1] == N, indices a permutation, bin_ids and padded_bins consistent with bins) need
to read device memory, so they run only when the tensors are on the CPU or when `validate=True` is passed; on a GPU
they are skipped by default to keep the forward free of host syncs.

Capacity for the fused forward: `capacity_keep_mask` / `drop_over_capacity` mark, without a host sync, the
assignments MegaBlocks drops (per expert, the earliest assignments in order a = t * top_k + j are kept).
"""

import torch

from ..host.checks import (check_bool, check_finite_number, check_int, check_kernel_device, check_same_device,
                           check_tensor, reads_values)
from ..host.device import call_scope
from ..host.library import call, custom_op
from .row_copies import BINNED, PADDED, PLAIN, Layout, buffer_rows, launch_gather, launch_scatter, launch_wgrad

_INDEX_DTYPES = (torch.int32, torch.int64)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# The three copies as torch custom operators (compilable; gather and scatter carry their autograd). A layout travels
# as (kind, top_k, capacity): see row_copies.Layout.


@custom_op("row_gather")
def _row_gather_op(x: torch.Tensor, weights: torch.Tensor | None, indices: torch.Tensor, bins: torch.Tensor | None,
                   padded_bins: torch.Tensor | None, kind: int, top_k: int, capacity: int, n_rows: int) -> torch.Tensor:
    return launch_gather(x, indices, weights, bins, padded_bins, Layout(kind, top_k, capacity), n_rows)


@_row_gather_op.register_fake
def _(x, weights, indices, bins, padded_bins, kind, top_k, capacity, n_rows):
    return x.new_empty((n_rows, x.shape[1]))


@custom_op("row_scatter")
def _row_scatter_op(x: torch.Tensor, weights: torch.Tensor | None, indices: torch.Tensor, bins: torch.Tensor | None,
                    padded_bins: torch.Tensor | None, kind: int, top_k: int, capacity: int,
                    num_tokens: int) -> torch.Tensor:
    layout = Layout(kind, top_k, capacity)
    return launch_scatter(x, buffer_rows(indices, bins, padded_bins, layout), weights, top_k, num_tokens)


@_row_scatter_op.register_fake
def _(x, weights, indices, bins, padded_bins, kind, top_k, capacity, num_tokens):
    return x.new_empty((num_tokens, x.shape[1]))


@custom_op("row_wgrad")
def _row_wgrad_op(x: torch.Tensor, grad: torch.Tensor, indices: torch.Tensor, bins: torch.Tensor | None,
                  padded_bins: torch.Tensor | None, kind: int, top_k: int, capacity: int,
                  out_dtype: torch.dtype) -> torch.Tensor:
    layout = Layout(kind, top_k, capacity)
    return launch_wgrad(x, grad, buffer_rows(indices, bins, padded_bins, layout), top_k, out_dtype)


@_row_wgrad_op.register_fake
def _(x, grad, indices, bins, padded_bins, kind, top_k, capacity, out_dtype):
    return x.new_empty((indices.shape[0],), dtype=out_dtype)


def _save_copy_context(ctx, inputs, output):
    x, weights, indices, bins, padded_bins, kind, top_k, capacity, rows = inputs
    ctx.save_for_backward(x, weights, indices, bins, padded_bins)
    ctx.layout = (kind, top_k, capacity)
    ctx.input_rows = x.shape[0]


def _copy_backward(ctx, grad, transposed_copy, buffer_first):
    """The backward of a weighted row copy: dx is the transposed copy of the gradient (gather <-> scatter), and
    d weights[a] the dot product of the buffer row of assignment a with its token row, one of which is the gradient
    (`buffer_first`: the gradient is the buffer side, as for gather)."""
    x, weights, indices, bins, padded_bins = ctx.saved_tensors
    grad = grad.contiguous()
    grad_x = grad_weights = None
    if ctx.needs_input_grad[0]:
        grad_x = transposed_copy(grad, weights, indices, bins, padded_bins, *ctx.layout, ctx.input_rows)
    if ctx.needs_input_grad[1]:
        buffer, tokens = (grad, x) if buffer_first else (x, grad)
        grad_weights = _row_wgrad_op(buffer, tokens, indices, bins, padded_bins, *ctx.layout, weights.dtype)
    return grad_x, grad_weights, None, None, None, None, None, None, None


def _gather_backward(ctx, grad_buffer):
    """buffer = gather(x, weights): dx = scatter(d buffer, weights); d weights[a] = <d buffer[row(a)], x[a // k]>."""
    return _copy_backward(ctx, grad_buffer, _row_scatter_op, buffer_first=True)


def _scatter_backward(ctx, grad_out):
    """out = scatter(buffer, weights): d buffer = gather(d out, weights); d weights[a] = <buffer[row(a)], d out[t]>."""
    return _copy_backward(ctx, grad_out, _row_gather_op, buffer_first=False)


_row_gather_op.register_autograd(_gather_backward, setup_context=_save_copy_context)
_row_scatter_op.register_autograd(_scatter_backward, setup_context=_save_copy_context)


def _gather(x, weights, indices, bins, padded_bins, layout, n_rows):
    check_kernel_device("x", x)  # what every public function here calls its first tensor
    weights = weights.contiguous() if weights is not None else None
    return call(_row_gather_op, x.contiguous(), weights, indices, bins, padded_bins, layout.kind, layout.top_k,
                layout.capacity, n_rows)


def _scatter(x, weights, indices, bins, padded_bins, layout, num_tokens):
    check_kernel_device("x", x)  # what every public function here calls its first tensor
    weights = weights.contiguous() if weights is not None else None
    return call(_row_scatter_op, x.contiguous(), weights, indices, bins, padded_bins, layout.kind, layout.top_k,
                layout.capacity, num_tokens)


def _wgrad(x, grad, indices, bins, padded_bins, layout):
    check_kernel_device("x", x)  # what every public function here calls its first tensor
    return call(_row_wgrad_op, x.detach().contiguous(), grad.detach().contiguous(), indices, bins, padded_bins,
                layout.kind, layout.top_k, layout.capacity, x.dtype)


_NOT_TAKEN = object()  # the bin_ids / padded_bins of an op that has no such argument (None is a bad argument)


def _check_routing(indices, weights, bins, top_k, *, bin_ids=_NOT_TAKEN, padded_bins=_NOT_TAKEN):
    """Shape and dtype checks of the routing arguments shared by every op; returns N = len(indices). `weights` may be
    None; `bin_ids` and `padded_bins` are tensors wherever the op takes them."""
    check_tensor("indices", indices, ndim=1, dtypes=_INDEX_DTYPES)
    check_tensor("bins", bins, ndim=1, dtypes=_INDEX_DTYPES)
    check_int("top_k", top_k, 1)
    num_assignments = indices.shape[0]
    if num_assignments % top_k:
        raise ValueError(f"len(indices) = {num_assignments} must be a multiple of top_k = {top_k}")
    if bins.shape[0] == 0:
        raise ValueError("bins must hold one inclusive cumulative count per expert, got an empty tensor")
    if weights is not None:
        check_tensor("weights", weights, ndim=1, dtypes=_FLOAT_DTYPES)
        if weights.shape[0] != num_assignments:
            raise ValueError(f"weights must have len(indices) = {num_assignments} entries, got {weights.shape[0]}")
    if bin_ids is not _NOT_TAKEN:
        check_tensor("bin_ids", bin_ids, ndim=1, dtypes=_INDEX_DTYPES)
        if bin_ids.shape[0] != num_assignments:
            raise ValueError(f"bin_ids must have len(indices) = {num_assignments} entries, got {bin_ids.shape[0]}")
    if padded_bins is not _NOT_TAKEN:
        check_tensor("padded_bins", padded_bins, ndim=1, dtypes=_INDEX_DTYPES)
        if padded_bins.shape[0] != bins.shape[0]:
            raise ValueError(f"padded_bins must have len(bins) = {bins.shape[0]} entries, got {padded_bins.shape[0]}")
    return num_assignments


def _check_num_tokens(name, value, num_assignments, top_k):
    if value * top_k != num_assignments:
        raise ValueError(f"{name} has {value} tokens, so len(indices) must be {name}.shape[0] * top_k = "
                         f"{value * top_k}, got {num_assignments}")


def _check_values(validate, indices, bins, *, bin_ids=None, padded_bins=None, n_rows=None, n_rows_name=None):
    """Value checks that read device memory: only on the CPU, or anywhere with validate=True (never under
    torch.compile: see host.checks.reads_values)."""
    if not reads_values(validate, indices):
        return
    num_assignments = indices.shape[0]
    bounds = bins.long()
    if int(bounds[0]) < 0 or bool((bounds[1:] < bounds[:-1]).any()):
        raise ValueError(f"bins must be non-negative and non-decreasing (inclusive cumulative counts), got "
                         f"{bounds.tolist()}")
    if int(bounds[-1]) != num_assignments:
        raise ValueError(f"bins[-1] must equal len(indices) = {num_assignments}, got {int(bounds[-1])}")
    if not torch.equal(torch.sort(indices.long()).values, torch.arange(num_assignments, device=indices.device)):
        raise ValueError(f"indices must be a permutation of range({num_assignments})")
    counts = torch.diff(bounds, prepend=bounds.new_zeros(1))
    if bin_ids is not None:
        expected = torch.repeat_interleave(torch.arange(bins.shape[0], device=bins.device), counts)
        if not torch.equal(bin_ids.long(), expected):
            raise ValueError("bin_ids must give the expert of each sorted position, consistent with bins")
    if padded_bins is not None:
        padded = padded_bins.long()
        padded_counts = torch.diff(padded, prepend=padded.new_zeros(1))
        if bool((padded_counts < counts).any()):
            raise ValueError(f"padded_bins must be non-decreasing with each expert's padded count >= its count, "
                             f"got padded_bins={padded.tolist()} for bins={bounds.tolist()}")
        if n_rows is not None and int(padded[-1]) > n_rows:
            raise ValueError(f"padded_bins[-1] = {int(padded[-1])} exceeds {n_rows_name} = {n_rows}")


def _check_x(name, x, ndim):
    return check_tensor(name, x, ndim=ndim, dtypes=_FLOAT_DTYPES)


def _check_grad(grad, x, num_assignments, top_k):
    check_tensor("grad", grad, ndim=2, dtypes=_FLOAT_DTYPES)
    if grad.dtype != x.dtype:
        raise TypeError(f"grad must have the dtype of x ({x.dtype}), got {grad.dtype}")
    if grad.shape[1] != x.shape[-1]:
        raise ValueError(f"grad must have x's hidden size {x.shape[-1]} in dimension 1, got shape {tuple(grad.shape)}")
    _check_num_tokens("grad", grad.shape[0], num_assignments, top_k)


@call_scope
def binned_gather(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor | None, bins: torch.Tensor,
                  expert_capacity: int, top_k: int, *, validate: bool | None = None) -> torch.Tensor:
    """Capacity-limited gather: x [T, H] -> [E, C, H], each expert's first C assignments, unused slots zero.

    out[e, j] = x[a // top_k] * weights[a] with a = indices[start_e + j], for j < min(C, count_e); assignments at
    position >= C of their expert are dropped (never read). `weights` may be None (plain copy). C = 0 gives an empty
    [E, 0, H] buffer. Differentiable in x and weights.
    """
    check_bool("validate", validate, none=True)
    _check_x("x", x, 2)
    num_assignments = _check_routing(indices, weights, bins, top_k)
    check_int("expert_capacity", expert_capacity, 0)
    _check_num_tokens("x", x.shape[0], num_assignments, top_k)
    check_same_device(x=x, indices=indices, weights=weights, bins=bins)
    _check_values(validate, indices, bins)
    num_experts, hidden = bins.shape[0], x.shape[1]
    layout = Layout(BINNED.value, top_k, expert_capacity)
    out = _gather(x, weights, indices, bins, None, layout, num_experts * expert_capacity)
    return out.view(num_experts, expert_capacity, hidden)


@call_scope
def binned_scatter(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor | None, bins: torch.Tensor, top_k: int,
                   *, validate: bool | None = None) -> torch.Tensor:
    """Capacity-limited scatter: [E, C, H] -> [T, H], summing each token's top_k kept rows; dropped ones add zero.

    out[t] = sum_j x[e, i] * weights[a] over a = t * top_k + j (e its expert, i its rank inside e, kept when i < C =
    x.shape[1]), summed in the order j = 0..top_k-1 in fp32. T = len(indices) // top_k. `weights` may be None.
    Differentiable in x and weights.
    """
    check_bool("validate", validate, none=True)
    _check_x("x", x, 3)
    num_assignments = _check_routing(indices, weights, bins, top_k)
    if x.shape[0] != bins.shape[0]:
        raise ValueError(f"x must have one capacity bin per expert: x.shape[0] = {x.shape[0]} but len(bins) = "
                         f"{bins.shape[0]}")
    check_same_device(x=x, indices=indices, weights=weights, bins=bins)
    _check_values(validate, indices, bins)
    layout = Layout(BINNED.value, top_k, x.shape[1])
    return _scatter(x.reshape(-1, x.shape[2]), weights, indices, bins, None, layout, num_assignments // top_k)


@call_scope
def binned_scatter_wgrad(x: torch.Tensor, grad: torch.Tensor, indices: torch.Tensor, bins: torch.Tensor, top_k: int, *,
                         validate: bool | None = None) -> torch.Tensor:
    """Gradient of `binned_scatter` with respect to its weights: [T * top_k] in x's dtype, 0 for dropped assignments.

    wgrad[a] = sum_h x[e, i, h] * grad[a // top_k, h], accumulated in fp32. Not differentiable itself.
    """
    check_bool("validate", validate, none=True)
    _check_x("x", x, 3)
    num_assignments = _check_routing(indices, None, bins, top_k)
    if x.shape[0] != bins.shape[0]:
        raise ValueError(f"x must have one capacity bin per expert: x.shape[0] = {x.shape[0]} but len(bins) = "
                         f"{bins.shape[0]}")
    _check_grad(grad, x, num_assignments, top_k)
    check_same_device(x=x, grad=grad, indices=indices, bins=bins)
    _check_values(validate, indices, bins)
    layout = Layout(BINNED.value, top_k, x.shape[1])
    return _wgrad(x.reshape(-1, x.shape[2]), grad, indices, bins, None, layout)


@call_scope
def gather(x: torch.Tensor, indices: torch.Tensor, bin_ids: torch.Tensor, weights: torch.Tensor | None,
           bins: torch.Tensor, top_k: int, *, validate: bool | None = None) -> torch.Tensor:
    """Dropless gather: x [T, H] -> [N, H] in expert-sorted order, no padding, nothing dropped.

    out[p] = x[indices[p] // top_k] * weights[indices[p]]. `weights` may be None. Differentiable in x and weights.
    """
    check_bool("validate", validate, none=True)
    _check_x("x", x, 2)
    num_assignments = _check_routing(indices, weights, bins, top_k, bin_ids=bin_ids)
    _check_num_tokens("x", x.shape[0], num_assignments, top_k)
    check_same_device(x=x, indices=indices, bin_ids=bin_ids, weights=weights, bins=bins)
    _check_values(validate, indices, bins, bin_ids=bin_ids)
    layout = Layout(PLAIN.value, top_k)
    return _gather(x, weights, indices, None, None, layout, num_assignments)


@call_scope
def scatter(x: torch.Tensor, indices: torch.Tensor, bin_ids: torch.Tensor, weights: torch.Tensor | None,
            bins: torch.Tensor, top_k: int, *, validate: bool | None = None) -> torch.Tensor:
    """Dropless scatter: [N, H] in expert-sorted order -> [T, H], summing each token's top_k rows.

    out[t] = sum_j x[p(a)] * weights[a] over a = t * top_k + j, p(a) its sorted position, summed in order j in fp32.
    `weights` may be None. Differentiable in x and weights.
    """
    check_bool("validate", validate, none=True)
    _check_x("x", x, 2)
    num_assignments = _check_routing(indices, weights, bins, top_k, bin_ids=bin_ids)
    if x.shape[0] != num_assignments:
        raise ValueError(f"x must have one row per assignment, len(indices) = {num_assignments}, got "
                         f"shape {tuple(x.shape)}")
    check_same_device(x=x, indices=indices, bin_ids=bin_ids, weights=weights, bins=bins)
    _check_values(validate, indices, bins, bin_ids=bin_ids)
    layout = Layout(PLAIN.value, top_k)
    return _scatter(x, weights, indices, None, None, layout, num_assignments // top_k)


@call_scope
def scatter_wgrad(x: torch.Tensor, grad: torch.Tensor, indices: torch.Tensor, bin_ids: torch.Tensor, bins: torch.Tensor,
                  top_k: int, *, validate: bool | None = None) -> torch.Tensor:
    """Gradient of `scatter` with respect to its weights: [T * top_k] in x's dtype.

    wgrad[a] = sum_h x[p(a), h] * grad[a // top_k, h], accumulated in fp32. Not differentiable itself.
    """
    check_bool("validate", validate, none=True)
    _check_x("x", x, 2)
    num_assignments = _check_routing(indices, None, bins, top_k, bin_ids=bin_ids)
    if x.shape[0] != num_assignments:
        raise ValueError(f"x must have one row per assignment, len(indices) = {num_assignments}, got "
                         f"shape {tuple(x.shape)}")
    _check_grad(grad, x, num_assignments, top_k)
    check_same_device(x=x, grad=grad, indices=indices, bin_ids=bin_ids, bins=bins)
    _check_values(validate, indices, bins, bin_ids=bin_ids)
    return _wgrad(x, grad, indices, None, None, Layout(PLAIN.value, top_k))


@call_scope
def padded_gather(x: torch.Tensor, indices: torch.Tensor, bin_ids: torch.Tensor, weights: torch.Tensor | None,
                  bins: torch.Tensor, padded_bins: torch.Tensor, top_k: int, *, num_rows: int | None = None,
                  validate: bool | None = None) -> torch.Tensor:
    """Block-padded gather: x [T, H] -> [R, H], expert e's rows starting at padded_bins[e - 1], padding zero.

    out[padded_start_e + j] = x[a // top_k] * weights[a] with a = indices[start_e + j]. R = num_rows when given (rows
    past padded_bins[-1] are zero; no host sync); otherwise R = padded_bins[-1], read from the device (one host sync,
    as in MegaBlocks). `weights` may be None. Differentiable in x and weights.
    """
    check_bool("validate", validate, none=True)
    _check_x("x", x, 2)
    num_assignments = _check_routing(indices, weights, bins, top_k, bin_ids=bin_ids, padded_bins=padded_bins)
    _check_num_tokens("x", x.shape[0], num_assignments, top_k)
    if num_rows is not None:
        check_int("num_rows", num_rows, 0)
    check_same_device(x=x, indices=indices, bin_ids=bin_ids, weights=weights, bins=bins, padded_bins=padded_bins)
    _check_values(validate, indices, bins, bin_ids=bin_ids, padded_bins=padded_bins, n_rows=num_rows,
                  n_rows_name="num_rows")
    if num_rows is None:
        num_rows = int(padded_bins[-1])
        if num_rows < 0:
            raise ValueError(f"padded_bins[-1] = {num_rows} gives a negative number of rows")
    layout = Layout(PADDED.value, top_k)
    return _gather(x, weights, indices, bins, padded_bins, layout, num_rows)


@call_scope
def padded_scatter(x: torch.Tensor, indices: torch.Tensor, bin_ids: torch.Tensor, weights: torch.Tensor | None,
                   bins: torch.Tensor, padded_bins: torch.Tensor, top_k: int, *,
                   validate: bool | None = None) -> torch.Tensor:
    """Block-padded scatter: [R, H] -> [T, H], summing each token's top_k rows; padding rows are never read.

    out[t] = sum_j x[padded_start_e + i] * weights[a] over a = t * top_k + j (e its expert, i its rank inside e).
    `weights` may be None. Differentiable in x and weights.
    """
    check_bool("validate", validate, none=True)
    _check_x("x", x, 2)
    num_assignments = _check_routing(indices, weights, bins, top_k, bin_ids=bin_ids, padded_bins=padded_bins)
    check_same_device(x=x, indices=indices, bin_ids=bin_ids, weights=weights, bins=bins, padded_bins=padded_bins)
    _check_values(validate, indices, bins, bin_ids=bin_ids, padded_bins=padded_bins, n_rows=x.shape[0],
                  n_rows_name="x.shape[0]")
    layout = Layout(PADDED.value, top_k)
    return _scatter(x, weights, indices, bins, padded_bins, layout, num_assignments // top_k)


@call_scope
def padded_scatter_wgrad(x: torch.Tensor, grad: torch.Tensor, indices: torch.Tensor, bin_ids: torch.Tensor,
                         bins: torch.Tensor, padded_bins: torch.Tensor, top_k: int, *,
                         validate: bool | None = None) -> torch.Tensor:
    """Gradient of `padded_scatter` with respect to its weights: [T * top_k] in x's dtype.

    wgrad[a] = sum_h x[padded_start_e + i, h] * grad[a // top_k, h], accumulated in fp32. Not differentiable itself.
    """
    check_bool("validate", validate, none=True)
    _check_x("x", x, 2)
    num_assignments = _check_routing(indices, None, bins, top_k, bin_ids=bin_ids, padded_bins=padded_bins)
    _check_grad(grad, x, num_assignments, top_k)
    check_same_device(x=x, grad=grad, indices=indices, bin_ids=bin_ids, bins=bins, padded_bins=padded_bins)
    _check_values(validate, indices, bins, bin_ids=bin_ids, padded_bins=padded_bins, n_rows=x.shape[0],
                  n_rows_name="x.shape[0]")
    return _wgrad(x, grad, indices, bins, padded_bins, Layout(PADDED.value, top_k))


_SORT_BITS = {torch.int16: 16, torch.int32: 32, torch.int64: 64}


def sort(x: torch.Tensor, end_bit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable sort of a 1-D integer tensor: (sorted values, permutation), both in x's dtype, like MegaBlocks' ops.sort.

    Only the low `end_bit` bits are keys (all bits when None), as in a radix sort over bits [0, end_bit); the values
    come back whole: sorted == x[permutation]. Ties keep their input order.
    """
    check_tensor("x", x, ndim=1, dtypes=tuple(_SORT_BITS))
    bits = _SORT_BITS[x.dtype]
    end_bit = bits if end_bit is None else check_int("end_bit", end_bit, 0)
    if end_bit > bits:
        raise ValueError(f"end_bit must be <= {bits} for {x.dtype}, got {end_bit}")
    if x.shape[0] > torch.iinfo(x.dtype).max + 1:
        raise ValueError(f"x has {x.shape[0]} entries, too many for a permutation in {x.dtype}")
    keys = x if end_bit == bits else x & ((1 << end_bit) - 1)
    permutation = torch.sort(keys, stable=True).indices
    return x[permutation], permutation.to(x.dtype)


def histogram(x: torch.Tensor, max_val: int) -> torch.Tensor:
    """int32 counts of each value in [0, max_val), like MegaBlocks' ops.histogram; out-of-range values are ignored.

    x is 1-D ([max_val] out) or 2-D (one histogram per row, [rows, max_val] out). Sync-free.
    """
    check_tensor("x", x, dtypes=tuple(_SORT_BITS))
    if x.dim() not in (1, 2):
        raise ValueError(f"x must have 1 or 2 dimensions, got shape {tuple(x.shape)}")
    check_int("max_val", max_val, 0)
    in_range = (x >= 0) & (x < max_val)
    bucket = torch.where(in_range, x, max_val).long()  # out-of-range values land in an extra bucket, dropped below
    counts = torch.zeros((*x.shape[:-1], max_val + 1), dtype=torch.int32, device=x.device)
    counts.scatter_add_(-1, bucket, torch.ones_like(bucket, dtype=torch.int32))
    return counts[..., :max_val].contiguous()


def inclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Inclusive prefix sum along `dim` in x's own dtype (torch.cumsum would widen int32 to int64)."""
    check_tensor("x", x)
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    ndim = max(x.dim(), 1)
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim must be in [{-ndim}, {ndim}) for x of shape {tuple(x.shape)}, got {dim}")
    return torch.cumsum(x, dim, dtype=x.dtype)


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """MegaBlocks' expert capacity: C = int(capacity_factor * (top_k * num_tokens / num_experts)).

    C can be 0 (few tokens or a small factor); MegaBlocks' layer then falls back to the largest expert count, i.e.
    drops nothing (`drop_over_capacity` does the same).
    """
    check_int("num_tokens", num_tokens, 0)
    check_int("top_k", top_k, 1)
    check_int("num_experts", num_experts, 1)
    check_finite_number("capacity_factor", capacity_factor, minimum=0)
    tokens_per_expert = top_k * num_tokens / num_experts
    return int(capacity_factor * tokens_per_expert)


def capacity_keep_mask(topk_ids: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """bool [T, top_k]: which assignments fit in `capacity` slots per expert (MegaBlocks' dropping rule).

    Each expert keeps its earliest assignments in the order a = t * top_k + j (MegaBlocks sorts stably); ids outside
    [0, num_experts) are never kept and take no slot. Sync-free: a stable sort, a histogram and a scatter.
    """
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=_INDEX_DTYPES)
    check_int("num_experts", num_experts, 1)
    check_int("capacity", capacity, 0)
    ids = topk_ids.reshape(-1)
    num_assignments = ids.shape[0]
    expert = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts).long()  # num_experts: no expert
    sorted_expert, permutation = torch.sort(expert, stable=True)
    counts = histogram(expert, num_experts + 1).long()
    first_position = torch.cumsum(counts, 0) - counts  # [E + 1] exclusive
    rank = torch.arange(num_assignments, device=ids.device) - first_position[sorted_expert]
    keep_sorted = (rank < capacity) & (sorted_expert < num_experts)
    keep = torch.empty_like(keep_sorted).scatter_(0, permutation, keep_sorted)
    return keep.view(topk_ids.shape)


def drop_over_capacity(topk_ids: torch.Tensor, num_experts: int, capacity_factor: float) -> torch.Tensor:
    """topk_ids with the assignments MegaBlocks drops at `capacity_factor` replaced by num_experts ("no expert").

    C = expert_capacity(T, top_k, num_experts, capacity_factor); when C is 0 nothing is dropped (MegaBlocks' fallback
    to the largest expert count). The fused forward skips ids >= num_experts, so this gives it MegaBlocks' capacity
    semantics. Sync-free.
    """
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=_INDEX_DTYPES)
    num_tokens, top_k = topk_ids.shape
    capacity = expert_capacity(num_tokens, top_k, num_experts, capacity_factor)
    if capacity == 0:
        return topk_ids
    keep = capacity_keep_mask(topk_ids, num_experts, capacity)
    return torch.where(keep, topk_ids, torch.full_like(topk_ids, num_experts))
