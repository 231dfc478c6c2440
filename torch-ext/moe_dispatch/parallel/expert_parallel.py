"""Expert parallelism (EP) over torch.distributed: each rank holds a contiguous shard of the experts.

Rank r of the group (W ranks) holds experts [r * E_local, (r + 1) * E_local), so E = E_local * W; `topk_ids` are
global ids. Every rank runs the same steps on its own tokens (T may differ per rank in dropless mode)::

    hidden_states [T, H], topk_ids / topk_weights [T, k] (global ids)
      -> plan        (device, parallel/ep_plan.py's kernels: 2 launches, 3 in dropless mode) pair (destination d,
                     token t) wanted when one of t's k experts lives on d;
                     rows per destination in token order, the slot of each kept pair       -> slot_token [n_slots]
                     dropless: counts exchanged (all_to_all_single of [W] int64), ONE host read of the split sizes
                     capacity: C rows per (source, destination), pairs past C dropped; no host read at all
      -> dispatch    gather each kept (token, d) row ONCE, with t's k routing weights and its k local ids on d
                     (slots whose expert lives elsewhere: sentinel E_local), straight into one packed byte row per
                     slot (`_packing`: x row | k weights | k int32 ids, each field at a 16-byte offset)
                     -> ONE all_to_all_single of [n_slots, B] uint8 -> [n_recv, B]; rows [n_recv, H], weights and
                     ids [n_recv, k] are strided views of it (`_unpack`, no copy)
      -> experts     fused_experts(validate=False) on the received rows with the local weights: per received row,
                     the weighted sum of that token's experts on this rank (sentinels contribute nothing)
      -> combine     all_to_all_single back (the reverse splits), then each token sums its per-rank partials in
                     rank order 0, 1, ... in fp32 (a fixed order, atomic-free: bit-identical reruns)  -> out [T, H]

Choices:
- **Dedup**: a token with several experts on one rank sends one row to that rank, not one per expert; the receiving
  `fused_experts` sees the row with up to k valid local ids, exactly like a single-GPU call.
- **One packed exchange per direction**: every collective pays a fixed latency (NCCL's and the host's), so the
  rows, weights and ids travel as one [n, B] uint8 buffer rather than three tensors. Field offsets and B are multiples
  of 16 bytes, so `.view(dtype)` of a field's columns is legal for every weight dtype (the offset and the row stride
  divisible by the element size) and Triton sees 16-byte aligned pointers; `fused_experts` reads the received views
  through their strides. Padding bytes between fields are sent uninitialised and never read.
- **Dropless** (default): the only device-to-host read is `.tolist()` on the [2W] send/receive counts right after the
  counts all-to-all (`_plan_from_counts`); it waits for the routing and that exchange, costs one sync per call (tens of
  microseconds of idle GPU at small T) and makes the split sizes host ints, as `all_to_all_single` needs.
  T may differ per rank, including T = 0.
- **Capacity** (`capacity_factor`): C = `ep_capacity(T_max, top_k, W, capacity_factor)` =
  int(capacity_factor * T_max * top_k / W), clamped to T_max; C = 0 drops nothing (C = T_max), MegaBlocks' fallback.
  T_max is `max_tokens_per_rank` when given (ranks may then hold different T <= T_max), else the local T, which
  must then be equal on every rank (not checked: checking would cost a collective; unequal C makes the exchange
  fail or hang). Every (source, destination) pair exchanges exactly C rows; a source keeps, per destination, its
  earliest C tokens that want that destination (token order, the "earliest first" rule of
  `binned.capacity_keep_mask`); unused rows are zero with sentinel ids. With one expert per rank (E_local = 1) and
  distinct ids per token this is MegaBlocks' per-expert capacity C = int(capacity_factor * T * top_k / E). Sizes are
  host ints from shapes, so a forward (and backward) can be captured in a CUDA graph with NCCL.
- **Gradients** (hidden_states, local weights and biases, topk_weights): the dispatch and the combine are each one
  autograd node around `torch.distributed.all_to_all_single` whose backward is the reverse exchange (the all-to-all
  is its own transpose) followed by the same fixed-order per-token sum, so the backward is deterministic too and
  every rank runs its backward collectives in the same order. The dispatch's backward packs the row and weight
  gradients like the forward (one exchange; this costs one copy of the [n_recv, H] row gradients into the packed
  buffer, which the separate exchanges did not). The local experts use
  `fused_experts`' registered Triton backward. Autograd must reach the EP nodes on every rank (the backward
  exchanges are collectives): requires_grad must agree across ranks, and every rank calls backward.
  `torch.distributed.nn.functional.all_to_all_single` would give the same exchange, but as one node per tensor,
  whose relative order in the backward autograd does not promise, and with an index_add (float atomics on a GPU)
  for the rows a token sent to several ranks.
- **One rank** (group of size 1, or group None without an initialised process group): dropless calls
  `fused_experts` directly; capacity mode drops by the same rule with the exchange skipped.
- Not for torch.compile (the dropless split sizes are data-dependent; not tested in capacity mode).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, Self

import torch
import torch.distributed as dist

from ..experts.checks import check_experts_args, check_experts_options
from ..formats.fp8 import is_fp8
from ..formats.mxfp4 import is_mxfp4
from ..host.checks import check_bool, check_finite_number, check_ids_in_range, check_int, check_real, check_tensor
from ..host.device import call_scope
from ..integrations.transformers_experts import fused_experts_options
from ..moe import fused_experts
from .ep_plan import count_rows, route_rows


class ExpertParallelStats(NamedTuple):
    """Per destination rank, on the device (int64 [W]); `return_stats=True` returns it beside the output."""

    wanted_rows: torch.Tensor  # (token, destination) rows this rank needed to send: tokens with an expert there
    dropped_rows: torch.Tensor  # rows beyond the capacity, not sent (always 0 in dropless mode)


class _Plan(NamedTuple):
    """Where every row goes; index tensors are int64 on the device, sizes are host ints."""

    slot_token: torch.Tensor  # [n_slots] token sent in slot s (T: padding, a zero row); slots grouped by destination
    slot_local_ids: torch.Tensor  # [n_slots, k] int32 ids on the destination (E_local: another rank's or padding)
    token_slots: torch.Tensor  # [R, T] slots of token t in rank order, R = min(k, W) (n_slots: none, a zero row)
    send_sizes: list | None  # rows to each destination; None: equal split (capacity mode)
    recv_sizes: list | None  # rows from each source; None: equal split
    num_recv: int
    padded: bool  # capacity mode: slots may be unused (slot_token == T)
    stats: ExpertParallelStats


def ep_capacity(num_tokens: int, top_k: int, world_size: int, capacity_factor: float) -> int:
    """Rows per (source, destination) pair in capacity mode: C = int(capacity_factor * num_tokens * top_k / world_size)
    clamped to num_tokens (a source never has more rows for one destination); C = 0 means no dropping (C =
    num_tokens), as MegaBlocks falls back to the largest count."""
    for name, value, minimum in (("num_tokens", num_tokens, 0), ("top_k", top_k, 1), ("world_size", world_size, 1)):
        check_int(name, value, minimum)
    check_finite_number("capacity_factor", capacity_factor, minimum=0)
    capacity = min(num_tokens, int(capacity_factor * num_tokens * top_k / world_size))
    return capacity if capacity > 0 else num_tokens


def _group_size_and_rank(group):
    """(W, rank in group); (1, 0) when torch.distributed is absent or not initialised and no group is given."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _exchange(rows, recv_sizes, send_sizes, num_recv, group, world_size, zero_row=False):
    """all_to_all_single of rows [n, ...] grouped by destination -> [num_recv, ...] grouped by source; with
    `zero_row`, one more row of zeros at the end (index num_recv: "no slot" for `_sum_token_slots`), at no copy."""
    if world_size == 1:
        return _with_zero_row(rows) if zero_row else rows
    out = rows.new_empty((num_recv + int(zero_row),) + tuple(rows.shape[1:]))
    if zero_row:
        out[num_recv].zero_()
    dist.all_to_all_single(out[:num_recv], rows.contiguous(), recv_sizes, send_sizes, group=group)
    return out


def _with_zero_row(rows):
    return torch.cat([rows, rows.new_zeros((1,) + tuple(rows.shape[1:]))])


def _token_rows(rows, slot_token, padded, out=None):
    """rows [T, C] -> [n_slots, C], slot s holding the row of token slot_token[s]; `padded` (capacity mode): T
    marks an unused slot, a zero row. `out` (a [n_slots, C] view of a packed buffer, any row stride) receives the
    gather in place, without an intermediate tensor."""
    return torch.index_select(_with_zero_row(rows) if padded else rows, 0, slot_token, out=out)


_FIELD_ALIGN = 16  # bytes: a multiple of every element size, and the alignment Triton specializes pointers on


class _Packing(NamedTuple):
    """Byte layout of the rows of one packed exchange: field i holds widths[i] elements of dtypes[i] at byte
    offsets[i] of each row of row_bytes bytes; offsets and row_bytes are multiples of `_FIELD_ALIGN`."""

    widths: tuple
    dtypes: tuple
    offsets: tuple
    row_bytes: int


def _packing(*fields):
    """fields (width, dtype), in order -> `_Packing`, each field padded to the next multiple of 16 bytes."""
    offsets, end = [], 0
    for width, dtype in fields:
        offsets.append(end)
        end += -(-width * dtype.itemsize // _FIELD_ALIGN) * _FIELD_ALIGN
    widths, dtypes = zip(*fields)
    return _Packing(widths, dtypes, tuple(offsets), end)


def _unpack(buffer, packing):
    """buffer [n, row_bytes] uint8 -> one view [n, width] of its dtype per field, sharing the buffer's memory."""
    return tuple(buffer[:, offset:offset + width * dtype.itemsize].view(dtype)
                 for width, dtype, offset in zip(packing.widths, packing.dtypes, packing.offsets))


def _new_packed(packing, num_rows, device):
    """An uninitialised [num_rows, row_bytes] uint8 buffer and its field views (`_unpack`), to be filled in place."""
    buffer = torch.empty((num_rows, packing.row_bytes), dtype=torch.uint8, device=device)
    return buffer, _unpack(buffer, packing)


def _sum_token_slots(slot_rows, token_slots, dtype):
    """out[t] = sum_c slot_rows[token_slots[c, t]] over c = 0, 1, ... (rank order), accumulated in fp32.

    slot_rows [n_slots + 1, C] ends with a zero row, where tokens with fewer than R destinations point."""
    acc = slot_rows.index_select(0, token_slots[0]).float()  # [T, C]
    for c in range(1, token_slots.shape[0]):
        acc += slot_rows.index_select(0, token_slots[c])
    return acc.to(dtype)


def _plan(topk_ids, world_size, experts_per_rank, capacity, group):
    """Routing -> `_Plan` on the device (parallel/ep_plan.py's kernels). capacity None: dropless (counts the rows,
    exchanges the counts, one host read); else C rows per destination, no host read and no collective."""
    counts = None
    if capacity is None:
        counts = count_rows(topk_ids, world_size, experts_per_rank)  # [2W]: send counts, then the received ones
        if world_size == 1:
            counts[1:].copy_(counts[:1])
        else:
            dist.all_to_all_single(counts[world_size:], counts[:world_size], group=group)
    return _plan_from_counts(topk_ids, world_size, experts_per_rank, capacity, counts)


def _plan_from_counts(topk_ids, world_size, experts_per_rank, capacity, counts):
    """`_plan` after the counts exchange: `counts` int64 [2W] (rows sent to, then received from, each rank) in
    dropless mode, None in capacity mode. Launches parallel/ep_plan.py's route and token-slot kernels (none when
    T = 0)."""
    W = world_size
    if capacity is None:
        # The one device-to-host read of dropless mode: split sizes must be host ints for all_to_all_single.
        sizes = counts.tolist()
        send_sizes, recv_sizes = sizes[:W], sizes[W:]
        num_slots, num_recv = sum(send_sizes), sum(recv_sizes)
    else:
        send_sizes = recv_sizes = None
        num_slots = num_recv = W * capacity
    slot_token, slot_local_ids, token_slots, stats = route_rows(topk_ids, W, experts_per_rank, capacity, counts,
                                                                num_slots)
    return _Plan(slot_token, slot_local_ids, token_slots, send_sizes, recv_sizes, num_recv, capacity is not None,
                 ExpertParallelStats(stats[0], stats[1]))


class _Dispatch(torch.autograd.Function):
    """(x [T, H], topk_weights [T, k]) -> received (rows [n_recv, H], weights [n_recv, k], local ids [n_recv, k]),
    strided views of one received byte buffer: one all_to_all_single forward, one backward."""

    @staticmethod
    def forward(ctx, x, topk_weights, plan, group, world_size):
        ctx.plan, ctx.group, ctx.world_size = plan, group, world_size
        H, k = x.shape[1], topk_weights.shape[1]
        packing = _packing((H, x.dtype), (k, topk_weights.dtype), (k, plan.slot_local_ids.dtype))
        ctx.grad_packing = _packing((H, x.dtype), (k, topk_weights.dtype))
        send, (rows, weights, ids) = _new_packed(packing, plan.slot_token.shape[0], x.device)
        _token_rows(x, plan.slot_token, plan.padded, out=rows)
        _token_rows(topk_weights, plan.slot_token, plan.padded, out=weights)
        ids.copy_(plan.slot_local_ids)
        received = _exchange(send, plan.recv_sizes, plan.send_sizes, plan.num_recv, group, world_size)
        rows, weights, ids = _unpack(received, packing)
        ctx.mark_non_differentiable(ids)
        return rows, weights, ids

    @staticmethod
    def backward(ctx, grad_rows, grad_weights, _):
        plan = ctx.plan
        # The reverse exchange of both gradients packed together, so every rank runs the same one collective.
        send, views = _new_packed(ctx.grad_packing, grad_rows.shape[0], grad_rows.device)
        for view, grad in zip(views, (grad_rows, grad_weights)):
            view.copy_(grad)
        received = _exchange(send, plan.send_sizes, plan.recv_sizes, plan.slot_token.shape[0], ctx.group,
                             ctx.world_size, zero_row=True)
        grad_rows, grad_weights = _unpack(received, ctx.grad_packing)
        grad_x = grad_topk = None
        if ctx.needs_input_grad[0]:
            grad_x = _sum_token_slots(grad_rows, plan.token_slots, grad_rows.dtype)
        if ctx.needs_input_grad[1]:
            grad_topk = _sum_token_slots(grad_weights, plan.token_slots, grad_weights.dtype)
        return grad_x, grad_topk, None, None, None


class _Combine(torch.autograd.Function):
    """Received partials [n_recv, H] -> back to their sources -> out [T, H], each token's partials in rank order."""

    @staticmethod
    def forward(ctx, partials, plan, group, world_size):
        ctx.plan, ctx.group, ctx.world_size = plan, group, world_size
        returned = _exchange(partials, plan.send_sizes, plan.recv_sizes, plan.slot_token.shape[0], group, world_size,
                             zero_row=True)
        return _sum_token_slots(returned, plan.token_slots, partials.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        plan = ctx.plan
        grad_slots = _token_rows(grad_out, plan.slot_token, plan.padded)  # the sum's transpose
        return _exchange(grad_slots, plan.recv_sizes, plan.send_sizes, plan.num_recv, ctx.group,
                         ctx.world_size), None, None, None


@call_scope
def ep_fused_experts(hidden_states: torch.Tensor, w_gate_up_local: torch.Tensor, w_down_local: torch.Tensor,
                     topk_ids: torch.Tensor, topk_weights: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                     capacity_factor: float | None = None, max_tokens_per_rank: int | None = None,
                     activation: Literal["silu", "swiglu_oai"] = "silu", gate_up_bias_local: torch.Tensor | None = None,
                     down_bias_local: torch.Tensor | None = None, interleaved: bool = False, transposed: bool = False,
                     swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, num_experts: int | None = None,
                     validate: bool | None = None,
                     return_stats: bool = False) -> torch.Tensor | tuple[torch.Tensor, ExpertParallelStats]:
    """`fused_experts` with the experts sharded over the ranks of `group` (default: the default process group).

    Rank r holds experts [r * E_local, (r + 1) * E_local): w_gate_up_local / w_down_local / the biases are
    `fused_experts`' tensors with E_local leading rows (same layouts, `transposed`, `interleaved`, activations).
    hidden_states [..., H], topk_ids [T, k] global ids in [0, E_local * W), topk_weights [T, k]. Returns out
    [..., H] equal (within rounding: each rank's partial is rounded to the input dtype once) to `fused_experts` with
    all E experts; with `return_stats`, (out, ExpertParallelStats). Ids outside [0, E) contribute nothing;
    `validate` as in `fused_experts` (None: read and check ids only on the CPU). `num_experts`, when given, must
    equal E_local * W.

    Dropless by default (one device-to-host read per call); `capacity_factor` switches to C rows per rank pair
    (`ep_capacity`; `max_tokens_per_rank` sets T_max when ranks hold different T), no host read, overflow dropped
    earliest-first and counted in the stats. Every rank of the group must call it (collectives), and, in training,
    backward. Differentiable in hidden_states, the local weights and biases and topk_weights. See the module
    docstring for the data flow.
    """
    check_experts_options(activation=activation, interleaved=interleaved, transposed=transposed,
                          swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit, validate=validate)
    check_real("capacity_factor", capacity_factor, none=True, minimum=0)
    if max_tokens_per_rank is not None:
        check_int("max_tokens_per_rank", max_tokens_per_rank, 0)
    if num_experts is not None:
        check_int("num_experts", num_experts, 1)
    check_bool("return_stats", return_stats)
    W, _ = _group_size_and_rank(group)
    for name, weight in (("w_gate_up_local", w_gate_up_local), ("w_down_local", w_down_local)):
        if is_fp8(weight) or is_mxfp4(weight):
            raise TypeError(f"{name} is {weight.dtype}: ep_fused_experts takes float weights only for now (float8 and "
                            "MXFP4 experts run through fused_experts on one GPU, see docs/usage.md)")
    T, H, E_local, _ = check_experts_args(hidden_states, w_gate_up_local, w_down_local, topk_ids, topk_weights,
                                          activation=activation, gate_up_bias=gate_up_bias_local,
                                          down_bias=down_bias_local, transposed=transposed, suffix="_local")
    if num_experts is not None and num_experts != E_local * W:
        raise ValueError(f"num_experts={num_experts!r} but w_gate_up_local holds {E_local} experts on each of {W} "
                         f"ranks ({E_local * W} in all)")
    capacity = None
    if capacity_factor is not None:
        if max_tokens_per_rank is None:
            max_tokens_per_rank = T
        elif max_tokens_per_rank < T:
            raise ValueError(f"max_tokens_per_rank={max_tokens_per_rank} but this rank holds T={T} tokens")
        capacity = ep_capacity(max_tokens_per_rank, topk_ids.shape[1], W, capacity_factor)
    elif max_tokens_per_rank is not None:
        raise ValueError("max_tokens_per_rank is only used with capacity_factor")
    check_ids_in_range("topk_ids", topk_ids, E_local * W, validate)

    options = dict(activation=activation, gate_up_bias=gate_up_bias_local, down_bias=down_bias_local,
                   interleaved=interleaved, transposed=transposed, swiglu_alpha=swiglu_alpha,
                   swiglu_limit=swiglu_limit, validate=False)
    x = hidden_states.reshape(T, H)
    if W == 1 and capacity is None:
        out = fused_experts(x, w_gate_up_local, w_down_local, topk_ids, topk_weights, **options)
        wanted = ((topk_ids >= 0) & (topk_ids < E_local)).any(dim=1).sum().view(1)
        stats = ExpertParallelStats(wanted, torch.zeros_like(wanted))
    else:
        with torch.no_grad():
            plan = _plan(topk_ids, W, E_local, capacity, group)
        rows, weights, local_ids = _Dispatch.apply(x, topk_weights, plan, group, W)
        partials = fused_experts(rows, w_gate_up_local, w_down_local, local_ids, weights, **options)
        out = _Combine.apply(partials, plan, group, W)
        stats = plan.stats
    out = out.reshape(hidden_states.shape)
    return (out, stats) if return_stats else out


def _check_weights(suffix, w_gate_up, w_down, gate_up_bias, down_bias):
    """A layer's weights are tensors and its biases tensors or None, on meta too (weights loaded after the layer is
    built); the forward checks the rest."""
    for name, weight in (("w_gate_up", w_gate_up), ("w_down", w_down), ("gate_up_bias", gate_up_bias),
                         ("down_bias", down_bias)):
        if weight is not None or not name.endswith("bias"):
            check_tensor(name + suffix, weight, allow_meta=True)


class ExpertParallelExperts(torch.nn.Module):
    """This rank's shard of the experts as parameters; forward(hidden_states, topk_ids, topk_weights) -> out.

    The forward has the signature of transformers' experts modules (`MixtralExperts`, ...), so it can replace one
    (`from_experts_module`). `options` are `ep_fused_experts`' keywords (capacity_factor, activation, transposed, ...).
    """

    _OPTIONS = ("capacity_factor", "max_tokens_per_rank", "activation", "interleaved", "transposed", "swiglu_alpha",
                "swiglu_limit", "num_experts", "validate")

    def __init__(self, w_gate_up_local: torch.Tensor, w_down_local: torch.Tensor,
                 group: dist.ProcessGroup | None = None, *, gate_up_bias_local: torch.Tensor | None = None,
                 down_bias_local: torch.Tensor | None = None, **options: Any) -> None:
        super().__init__()
        unknown = sorted(set(options) - set(self._OPTIONS))
        if unknown:
            raise TypeError(f"unknown options {unknown}; known: {list(self._OPTIONS)}")
        _check_weights("_local", w_gate_up_local, w_down_local, gate_up_bias_local, down_bias_local)
        self.w_gate_up_local = torch.nn.Parameter(w_gate_up_local)
        self.w_down_local = torch.nn.Parameter(w_down_local)
        self.gate_up_bias_local = None if gate_up_bias_local is None else torch.nn.Parameter(gate_up_bias_local)
        self.down_bias_local = None if down_bias_local is None else torch.nn.Parameter(down_bias_local)
        self.group = group
        self.options = options

    @classmethod
    def from_experts(cls, w_gate_up: torch.Tensor, w_down: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                     gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                     **options: Any) -> Self:
        """Keep this rank's rows [r * E_local, (r + 1) * E_local) of all-expert tensors (copies, E divisible by W)."""
        _check_weights("", w_gate_up, w_down, gate_up_bias, down_bias)
        W, rank = _group_size_and_rank(group)
        E = w_gate_up.shape[0]
        if E % W:
            raise ValueError(f"w_gate_up has {E} experts, not divisible by the group size {W}")
        E_local = E // W

        def shard(t):
            return None if t is None else t.detach()[rank * E_local:(rank + 1) * E_local].clone()

        return cls(shard(w_gate_up), shard(w_down), group, gate_up_bias_local=shard(gate_up_bias),
                   down_bias_local=shard(down_bias), num_experts=E, **options)

    @classmethod
    def from_experts_module(cls, experts: torch.nn.Module, group: dist.ProcessGroup | None = None,
                            **options: Any) -> Self:
        """This rank's shard of a transformers experts module (gate_up_proj, down_proj, biases, layout, activation
        read as `moe_dispatch_experts` reads them)."""
        read = fused_experts_options(experts)
        gate_up_bias, down_bias = read.pop("gate_up_bias", None), read.pop("down_bias", None)
        return cls.from_experts(experts.gate_up_proj, experts.down_proj, group, gate_up_bias=gate_up_bias,
                                down_bias=down_bias, **read, **options)

    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return ep_fused_experts(hidden_states, self.w_gate_up_local, self.w_down_local, topk_ids, topk_weights,
                                self.group, gate_up_bias_local=self.gate_up_bias_local,
                                down_bias_local=self.down_bias_local, **self.options)
