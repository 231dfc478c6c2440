"""MegaBlocks-style routing copies (binned, padded, plain) against float64 references written from the semantics.

Every op runs on every case in all three layouts and under two tile configurations: the default one and a tiny one
(4 rows x 16 columns) that makes row tiles straddle expert boundaries and leaves masked hidden tails. Outputs are
allocated through a poisoned `torch.empty` (NaN / -7), so an element the kernels forget to write fails the test.
Integers compare exactly; floats by norm-wise relative error, and where the reference is exactly zero (dropped
assignments, unused capacity, padding) the output must be exactly zero too.

On the CPU the kernels run through Triton's interpreter, so shapes are tiny; the large-token and int64-offset
cases run only on a GPU. Bandwidth is measured by scripts/bench_binned.py, not here.
"""

import dataclasses

import pytest
import torch

from helpers import DEVICE, assert_close, needs_gpu
from moe_dispatch import reference as ref
from moe_dispatch.dispatch import binned, row_copies


TINY_TILES = row_copies.CopyConfig(block_rows=4, block_h=16, num_warps=1)
LAYOUTS = ("binned", "padded", "plain")


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    num_tokens: int  # T
    num_experts: int  # E
    top_k: int
    hidden: int  # H
    capacity: int  # C of the binned layout
    routing: str = "uniform"  # how topk_ids are drawn, see _topk_ids
    weighted: bool = True
    block: int = 4  # padded layout: each expert's segment rounded up to a multiple of this
    dtype: torch.dtype = torch.float32


CASES = [
    # experts 1 and 4 receive nothing: zero-width bins in the middle and an empty padded segment
    Case("empty_experts", 7, 6, 2, 40, 3, routing="skip_1_4"),
    # expert 0 is every token's first choice: 12 assignments for 3 slots, most overflow and are dropped
    Case("overflow", 12, 3, 2, 24, 3, routing="skewed"),
    # every expert gets exactly C assignments: nothing dropped, no spare slot (off-by-one at the capacity edge)
    Case("exact_capacity", 6, 3, 2, 24, 4, routing="balanced"),
    # C = 0: an empty [E, 0, H] buffer; scatter and wgrad see every assignment dropped
    Case("capacity_zero", 5, 3, 2, 16, 0),
    # top_k = 1: a = t, no reduction over slots
    Case("top1", 9, 4, 1, 33, 2),
    # unweighted copies (weights=None): the HAS_WEIGHTS=False path
    Case("top2_unweighted", 8, 4, 2, 24, 3, weighted=False),
    # top_k = 4 of 5 experts: four slots summed per token in a fixed order
    Case("top4", 6, 5, 4, 20, 4),
    # H = 37 is no multiple of any tile width: masked hidden tail
    Case("hidden_tail", 5, 3, 2, 37, 3),
    # segment lengths not multiples of the 4-row tile: tiles straddle two and three experts
    Case("tiles_span_experts", 11, 3, 2, 16, 5, block=3),
    # a single token, C = 1: one-row buffers
    Case("single_token", 1, 2, 2, 8, 1),
    # no tokens at all: empty outputs, no launches over empty tensors
    Case("zero_tokens", 0, 3, 2, 8, 2),
    # one expert: the bin search has a single step
    Case("one_expert", 6, 1, 1, 12, 4),
    # prime E larger than the row tile: a six-step bin search, most experts empty or with one assignment
    Case("many_experts", 10, 37, 3, 8, 1),
    # half precision: fp32 scaling, one rounding to bf16 / fp16
    Case("bf16", 9, 4, 2, 48, 4, dtype=torch.bfloat16),
    Case("fp16", 9, 4, 2, 48, 4, dtype=torch.float16),
]


@dataclasses.dataclass(frozen=True)
class Routing:
    """MegaBlocks' routing tensors for one case (int32, as MegaBlocks makes them), built by the float64 reference."""

    topk_ids: torch.Tensor  # [T, top_k]
    indices: torch.Tensor  # [N] assignments in expert order
    bin_ids: torch.Tensor  # [N] expert of each sorted position
    bins: torch.Tensor  # [E] inclusive cumulative counts
    padded_bins: torch.Tensor  # [E] inclusive cumulative counts rounded up to `block`
    weights: torch.Tensor | None  # [N]


def _topk_ids(case):
    T, E, k = case.num_tokens, case.num_experts, case.top_k
    if case.routing == "balanced":
        return torch.tensor([[(t * k + j) % E for j in range(k)] for t in range(T)], dtype=torch.int64).reshape(T, k)
    allowed = [e for e in range(E) if not (case.routing == "skip_1_4" and e in (1, 4))]
    rows = []
    for _ in range(T):
        row = [allowed[i] for i in torch.randperm(len(allowed))[:k].tolist()]
        if case.routing == "skewed" and 0 not in row:
            row[0] = 0
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64).reshape(T, k)


def _routing(case, device=DEVICE):
    topk_ids = _topk_ids(case)
    indices, bins = ref.binned_routing_ref(topk_ids, case.num_experts)
    counts = torch.diff(bins, prepend=bins.new_zeros(1))
    bin_ids = torch.repeat_interleave(torch.arange(case.num_experts), counts)
    padded_bins = torch.cumsum((counts + case.block - 1) // case.block * case.block, 0)
    weights = torch.rand(indices.shape[0], dtype=torch.float32) + 0.5 if case.weighted else None
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return Routing(to(topk_ids), to(indices.int()), to(bin_ids.int()), to(bins.int()), to(padded_bins.int()),
                   to(weights))


def _gather(layout, x, r, case):
    if layout == "binned":
        return binned.binned_gather(x, r.indices, r.weights, r.bins, case.capacity, case.top_k)
    if layout == "padded":
        return binned.padded_gather(x, r.indices, r.bin_ids, r.weights, r.bins, r.padded_bins, case.top_k)
    return binned.gather(x, r.indices, r.bin_ids, r.weights, r.bins, case.top_k)


def _scatter(layout, buffer, r, case):
    if layout == "binned":
        return binned.binned_scatter(buffer, r.indices, r.weights, r.bins, case.top_k)
    if layout == "padded":
        return binned.padded_scatter(buffer, r.indices, r.bin_ids, r.weights, r.bins, r.padded_bins, case.top_k)
    return binned.scatter(buffer, r.indices, r.bin_ids, r.weights, r.bins, case.top_k)


def _wgrad(layout, buffer, grad, r, case):
    if layout == "binned":
        return binned.binned_scatter_wgrad(buffer, grad, r.indices, r.bins, case.top_k)
    if layout == "padded":
        return binned.padded_scatter_wgrad(buffer, grad, r.indices, r.bin_ids, r.bins, r.padded_bins, case.top_k)
    return binned.scatter_wgrad(buffer, grad, r.indices, r.bin_ids, r.bins, case.top_k)


def _gather_ref(layout, x, r, case):
    if layout == "binned":
        return ref.binned_gather_ref(x, r.indices, r.weights, r.bins, case.capacity, case.top_k)
    if layout == "padded":
        return ref.padded_gather_ref(x, r.indices, r.weights, r.bins, r.padded_bins, case.top_k)
    return ref.gather_ref(x, r.indices, r.weights, r.bins, case.top_k)


def _scatter_ref(layout, buffer, r, case):
    if layout == "binned":
        return ref.binned_scatter_ref(buffer, r.indices, r.weights, r.bins, case.top_k)
    if layout == "padded":
        return ref.padded_scatter_ref(buffer, r.indices, r.weights, r.bins, r.padded_bins, case.top_k)
    return ref.scatter_ref(buffer, r.indices, r.weights, r.bins, case.top_k)


def _wgrad_ref(layout, buffer, grad, r, case):
    if layout == "binned":
        return ref.binned_scatter_wgrad_ref(buffer, grad, r.indices, r.bins, case.top_k)
    if layout == "padded":
        return ref.padded_scatter_wgrad_ref(buffer, grad, r.indices, r.bins, r.padded_bins, case.top_k)
    return ref.scatter_wgrad_ref(buffer, grad, r.indices, r.bins, case.top_k)


def _buffer_shape(layout, r, case):
    if layout == "binned":
        return (case.num_experts, case.capacity, case.hidden)
    rows = int(r.padded_bins[-1]) if layout == "padded" else r.indices.shape[0]
    return (rows, case.hidden)


# Every output is allocated through the poisoned torch.empty / empty_like (NaN floats, wild integers): unwritten
# elements fail the comparison.
pytestmark = pytest.mark.usefixtures("poison_empty")


@pytest.fixture(params=["default_tiles", "tiny_tiles"])
def tiles(request, monkeypatch):
    """Run under the device's default tile and under 4 x 16 tiles (expert-straddling row tiles, hidden tails)."""
    if request.param == "tiny_tiles":
        monkeypatch.setattr(row_copies, "copy_config", lambda *args: TINY_TILES)
    return request.param


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_gather(case, layout, tiles):
    r = _routing(case)
    x = torch.randn(case.num_tokens, case.hidden, device=DEVICE).to(case.dtype)
    out = _gather(layout, x, r, case)
    assert out.dtype == case.dtype
    assert_close(out, _gather_ref(layout, x, r, case), case.dtype, f"{layout} gather", exact_zeros=True)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_scatter(case, layout, tiles):
    r = _routing(case)
    buffer = torch.randn(_buffer_shape(layout, r, case), device=DEVICE).to(case.dtype)
    out = _scatter(layout, buffer, r, case)
    assert out.shape == (case.num_tokens, case.hidden) and out.dtype == case.dtype
    assert_close(out, _scatter_ref(layout, buffer, r, case), case.dtype, f"{layout} scatter", exact_zeros=True)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_wgrad(case, layout, tiles):
    r = _routing(case)
    buffer = torch.randn(_buffer_shape(layout, r, case), device=DEVICE).to(case.dtype)
    grad = torch.randn(case.num_tokens, case.hidden, device=DEVICE).to(case.dtype)
    out = _wgrad(layout, buffer, grad, r, case)
    assert out.shape == (case.num_tokens * case.top_k,) and out.dtype == case.dtype
    assert_close(out, _wgrad_ref(layout, buffer, grad, r, case), case.dtype, f"{layout} wgrad", exact_zeros=True)


def test_binned_round_trip_matches_capacity_mask():
    """The MegaBlocks pipeline end to end with this package's helpers: sort -> histogram -> inclusive_cumsum ->
    binned_gather (unweighted) -> binned_scatter (weighted) gives sum_j keep[t, j] * w[t, j] * x[t], with `keep` from
    capacity_keep_mask: the two agree on which assignments are dropped."""
    T, E, k, H = 13, 4, 2, 24
    capacity = binned.expert_capacity(T, k, E, 0.75)  # int(0.75 * 6.5) = 4 < typical counts: some drops
    topk_ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).int().to(DEVICE)
    weights = torch.rand(T, k, device=DEVICE)
    x = torch.randn(T, H, device=DEVICE)
    _, indices = binned.sort(topk_ids.reshape(-1))
    bins = binned.inclusive_cumsum(binned.histogram(topk_ids.reshape(-1), E), 0)
    buffer = binned.binned_gather(x, indices, None, bins, capacity, k)
    out = binned.binned_scatter(buffer, indices, weights.reshape(-1), bins, k)
    keep = ref.capacity_keep_mask_ref(topk_ids, E, capacity)
    assert not keep.all(), "the case should drop something"
    expected = ((keep * weights).double().sum(1, keepdim=True)) * x.double()
    assert_close(out, expected, torch.float32, "round trip", exact_zeros=True)


@dataclasses.dataclass(frozen=True)
class GradCase:
    id: str
    layout: str
    weighted: bool


GRAD_CASES = [GradCase(f"{layout}_{'weighted' if w else 'unweighted'}", layout, w) for layout in LAYOUTS
              for w in (True, False)]


@pytest.mark.parametrize("gcase", GRAD_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_gradcheck(op, gcase):
    """Numerical vs analytic gradients in float64 for x and (when given) weights; C = 2 drops an assignment. Fast
    mode: the two Jacobians compared along random directions (v^T J u), a few calls of the op instead of two per
    input element and one per output element; a wrong entry still moves the projection."""
    case = Case("grad", 3, 3, 2, 5, 2, routing="skewed", weighted=gcase.weighted, block=2, dtype=torch.float64)
    r = _routing(case)
    r = dataclasses.replace(r, weights=None if r.weights is None else r.weights.double())
    if op == "gather":
        x = torch.randn(case.num_tokens, case.hidden, dtype=torch.float64, device=DEVICE)
    else:
        x = torch.randn(_buffer_shape(gcase.layout, r, case), dtype=torch.float64, device=DEVICE)
    x.requires_grad_(True)
    inputs = (x,) if r.weights is None else (x, r.weights.clone().requires_grad_(True))

    def fn(x, weights=None):
        routing = dataclasses.replace(r, weights=weights)
        run = _gather if op == "gather" else _scatter
        return run(gcase.layout, x, routing, case)

    with torch.no_grad():  # the op must also work, and agree, outside autograd
        plain = fn(*[t.detach() for t in inputs])
    assert torch.equal(fn(*inputs).detach(), plain)
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-9, fast_mode=True)


def test_wgrad_is_not_differentiable_but_detached():
    case = Case("wgrad_detached", 4, 3, 2, 8, 2)
    r = _routing(case)
    buffer = torch.randn(3, 2, 8, device=DEVICE, requires_grad=True)
    grad = torch.randn(4, 8, device=DEVICE, requires_grad=True)
    assert not binned.binned_scatter_wgrad(buffer, grad, r.indices, r.bins, 2).requires_grad


def test_deterministic():
    """Same inputs, bitwise-same outputs (no atomics; scatter sums the k slots in a fixed order)."""
    case = Case("determinism", 32, 5, 4, 40, 20, dtype=torch.bfloat16)
    r = _routing(case)
    x = torch.randn(case.num_tokens, case.hidden, device=DEVICE).to(case.dtype)
    first = _gather("binned", x, r, case)
    back = _scatter("binned", first, r, case)
    wgrad = _wgrad("binned", first, x, r, case)
    assert torch.equal(first, _gather("binned", x, r, case))
    assert torch.equal(back, _scatter("binned", first, r, case))
    assert torch.equal(wgrad, _wgrad("binned", first, x, r, case))


def test_sort_is_stable_and_matches_megablocks_shape():
    x = torch.randint(0, 5, (40,), dtype=torch.int32, device=DEVICE)
    values, permutation = binned.sort(x)
    expected = sorted(range(40), key=x.cpu().tolist().__getitem__)
    assert values.dtype == permutation.dtype == torch.int32
    assert permutation.cpu().tolist() == expected
    assert torch.equal(values, x[permutation.long()])
    # end_bit: only the low bits are keys (a radix sort over bits [0, end_bit)), values come back whole
    x = torch.tensor([6, 1, 4, 3, 5, 0], dtype=torch.int64, device=DEVICE)
    values, permutation = binned.sort(x, end_bit=2)  # keys 2, 1, 0, 3, 1, 0
    assert permutation.cpu().tolist() == [2, 5, 1, 4, 0, 3] and values.cpu().tolist() == [4, 0, 1, 5, 6, 3]


def test_histogram_and_cumsum():
    x = torch.tensor([3, 0, 3, 7, -1, 2, 3, 9], dtype=torch.int32, device=DEVICE)
    counts = binned.histogram(x, 8)  # -1 and 9 are out of range: not counted (CUB HistogramEven)
    assert counts.dtype == torch.int32 and counts.cpu().tolist() == [1, 0, 1, 3, 0, 0, 0, 1]
    batched = binned.histogram(torch.stack([x, x.flip(0)]), 4)
    assert batched.shape == (2, 4) and batched.cpu().tolist() == [[1, 0, 1, 3]] * 2
    bins = binned.inclusive_cumsum(counts, 0)
    assert bins.dtype == torch.int32 and bins.cpu().tolist() == [1, 1, 2, 5, 5, 5, 5, 6]
    assert binned.histogram(torch.zeros(0, dtype=torch.int64, device=DEVICE), 3).cpu().tolist() == [0, 0, 0]


def test_expert_capacity_formula():
    """MegaBlocks: int(capacity_factor * (top_k * T / E))."""
    assert binned.expert_capacity(16384, 2, 8, 1.0) == 4096
    assert binned.expert_capacity(10, 1, 3, 1.5) == 5  # 1.5 * (10 / 3) rounds to exactly 5.0 in floating point
    assert binned.expert_capacity(7, 2, 4, 1.0) == 3  # 3.5 truncates
    assert binned.expert_capacity(3, 1, 8, 1.0) == 0  # 0.375 -> 0: the caller falls back (see drop_over_capacity)
    assert binned.expert_capacity(0, 2, 8, 2.0) == 0
    with pytest.raises(ValueError, match="capacity_factor"):
        binned.expert_capacity(8, 2, 4, -1.0)
    with pytest.raises(TypeError, match="num_tokens"):
        binned.expert_capacity(8.0, 2, 4, 1.0)


@pytest.mark.parametrize("capacity", [0, 1, 2, 5, 100])
def test_capacity_keep_mask(capacity):
    """Against a per-assignment walk in order a = t * top_k + j; ids outside [0, E) (sentinels) are never kept."""
    T, E, k = 17, 5, 3
    topk_ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    topk_ids[3, 1] = E  # an expert-parallel sentinel
    topk_ids[8, 0] = -1
    topk_ids = topk_ids.to(DEVICE)
    keep = binned.capacity_keep_mask(topk_ids, E, capacity)
    assert keep.dtype == torch.bool and torch.equal(keep, ref.capacity_keep_mask_ref(topk_ids, E, capacity))


def test_drop_over_capacity():
    T, E, k = 12, 4, 2
    topk_ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(DEVICE)
    capacity = binned.expert_capacity(T, k, E, 0.5)  # 3
    dropped = binned.drop_over_capacity(topk_ids, E, 0.5)
    keep = ref.capacity_keep_mask_ref(topk_ids, E, capacity)
    assert dropped.dtype == topk_ids.dtype
    assert torch.equal(dropped, torch.where(keep, topk_ids, E))
    # capacity rounds to 0 -> MegaBlocks falls back to the largest count: nothing is dropped
    assert torch.equal(binned.drop_over_capacity(topk_ids, E, 0.01), topk_ids)


def _valid_args():
    case = Case("validation", 4, 3, 2, 8, 2)
    r = _routing(case, device="cpu")
    x = torch.randn(4, 8)
    return case, r, x


def _bad(r, **changes):
    return dataclasses.replace(r, **changes)


VALIDATION = [
    # (id, call(case, r, x), exception, message fragment naming the argument)
    ("bins_decreasing", lambda c, r, x: binned.binned_gather(x, r.indices, r.weights, r.bins.flip(0), 2, 2),
     ValueError, "bins must be non-negative and non-decreasing"),
    ("bins_last", lambda c, r, x: binned.binned_gather(x, r.indices, r.weights, r.bins - 1, 2, 2),
     ValueError, r"bins\[-1\] must equal len\(indices\)"),
    ("indices_length", lambda c, r, x: binned.binned_gather(x[:3], r.indices, r.weights, r.bins, 2, 2),
     ValueError, r"len\(indices\) must be x.shape\[0\] \* top_k"),
    ("indices_not_multiple", lambda c, r, x: binned.binned_scatter(torch.randn(3, 2, 8), r.indices, None, r.bins, 3),
     ValueError, "multiple of top_k"),
    ("indices_not_permutation",
     lambda c, r, x: binned.binned_gather(x, torch.zeros_like(r.indices), r.weights, r.bins, 2, 2),
     ValueError, "indices must be a permutation"),
    ("weights_length", lambda c, r, x: binned.binned_gather(x, r.indices, r.weights[:-1], r.bins, 2, 2),
     ValueError, "weights must have"),
    ("capacity_negative", lambda c, r, x: binned.binned_gather(x, r.indices, r.weights, r.bins, -1, 2),
     ValueError, "expert_capacity must be >= 0"),
    ("capacity_float", lambda c, r, x: binned.binned_gather(x, r.indices, r.weights, r.bins, 2.0, 2),
     TypeError, "expert_capacity must be an int"),
    ("top_k_zero", lambda c, r, x: binned.binned_gather(x, r.indices, r.weights, r.bins, 2, 0),
     ValueError, "top_k must be >= 1"),
    ("device_mismatch", lambda c, r, x: binned.binned_gather(x, r.indices, r.weights, r.bins.to("meta"), 2, 2),
     ValueError, "bins is on meta"),
    ("x_dtype", lambda c, r, x: binned.binned_gather(x.long(), r.indices, r.weights, r.bins, 2, 2),
     TypeError, "x must have dtype"),
    ("indices_dtype", lambda c, r, x: binned.binned_gather(x, r.indices.float(), r.weights, r.bins, 2, 2),
     TypeError, "indices must have dtype"),
    ("weights_dtype", lambda c, r, x: binned.binned_gather(x, r.indices, r.weights.int(), r.bins, 2, 2),
     TypeError, "weights must have dtype"),
    ("grad_dtype", lambda c, r, x: binned.binned_scatter_wgrad(torch.randn(3, 2, 8), x.double(), r.indices, r.bins, 2),
     TypeError, "grad must have the dtype of x"),
    ("grad_tokens", lambda c, r, x: binned.binned_scatter_wgrad(torch.randn(3, 2, 8), x[:3], r.indices, r.bins, 2),
     ValueError, "grad has 3 tokens"),
    ("x_rank", lambda c, r, x: binned.binned_gather(x[None], r.indices, r.weights, r.bins, 2, 2),
     ValueError, "x must have 2 dimensions"),
    ("indices_rank", lambda c, r, x: binned.binned_gather(x, r.indices[None], r.weights, r.bins, 2, 2),
     ValueError, "indices must have 1 dimensions"),
    ("scatter_x_rank", lambda c, r, x: binned.binned_scatter(x, r.indices, r.weights, r.bins, 2),
     ValueError, "x must have 3 dimensions"),
    ("scatter_experts", lambda c, r, x: binned.binned_scatter(torch.randn(2, 2, 8), r.indices, r.weights, r.bins, 2),
     ValueError, "one capacity bin per expert"),
    ("empty_bins", lambda c, r, x: binned.binned_gather(x, r.indices, r.weights, r.bins[:0], 2, 2),
     ValueError, "bins must hold"),
    ("bin_ids_inconsistent", lambda c, r, x: binned.gather(x, r.indices, r.bin_ids.flip(0), r.weights, r.bins, 2),
     ValueError, "bin_ids must give"),
    ("bin_ids_length", lambda c, r, x: binned.gather(x, r.indices, r.bin_ids[1:], r.weights, r.bins, 2),
     ValueError, "bin_ids must have"),
    ("padded_bins_too_small", lambda c, r, x: binned.padded_gather(x, r.indices, r.bin_ids, r.weights, r.bins,
                                                                   r.bins - 1, 2),
     ValueError, "padded_bins must be non-decreasing"),
    ("padded_bins_length", lambda c, r, x: binned.padded_scatter(x, r.indices, r.bin_ids, r.weights, r.bins,
                                                                 r.padded_bins[1:], 2),
     ValueError, "padded_bins must have"),
    ("padded_num_rows", lambda c, r, x: binned.padded_gather(x, r.indices, r.bin_ids, r.weights, r.bins,
                                                             r.padded_bins, 2, num_rows=1),
     ValueError, "exceeds num_rows"),
    ("plain_scatter_rows", lambda c, r, x: binned.scatter(x, r.indices, r.bin_ids, r.weights, r.bins, 2),
     ValueError, "one row per assignment"),
    ("sort_end_bit", lambda c, r, x: binned.sort(r.indices, end_bit=33), ValueError, "end_bit must be <= 32"),
    ("histogram_rank", lambda c, r, x: binned.histogram(r.indices.view(1, 1, -1), 3), ValueError, "1 or 2 dim"),
    ("keep_mask_capacity", lambda c, r, x: binned.capacity_keep_mask(r.topk_ids, 3, -2), ValueError, "capacity"),
]


@pytest.mark.parametrize("call, error, match", [v[1:] for v in VALIDATION], ids=[v[0] for v in VALIDATION])
def test_validation(call, error, match):
    case, r, x = _valid_args()
    with pytest.raises(error, match=match):
        call(case, r, x)


def test_validate_false_skips_value_checks():
    """validate=False trusts bins (the GPU default): a wrong bins[-1] is not read, and the kernels stay in bounds."""
    r = _routing(Case("validation", 4, 3, 2, 8, 2))
    x = torch.randn(4, 8, device=DEVICE)
    out = binned.binned_gather(x, r.indices, r.weights, r.bins - 1, 2, 2, validate=False)
    assert out.shape == (3, 2, 8) and not torch.isnan(out).any()


@needs_gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_large_token_count_gpu(layout):
    """T = 16384, H = 1024, k = 2, E = 8 in bf16 with fp32 weights, C from capacity factor 1.0 (uniform routing drops
    a few percent): every op against the float64 reference, twice, bitwise identical."""
    case = Case("large", 16384, 8, 2, 1024, binned.expert_capacity(16384, 2, 8, 1.0), block=128, dtype=torch.bfloat16)
    topk_ids = torch.rand(case.num_tokens, case.num_experts, device=DEVICE).topk(case.top_k, dim=1).indices
    _, indices = binned.sort(topk_ids.reshape(-1).int())
    counts = binned.histogram(topk_ids.reshape(-1), case.num_experts)
    bins = binned.inclusive_cumsum(counts, 0)
    padded_bins = binned.inclusive_cumsum((counts + 127) // 128 * 128, 0)
    bin_ids = binned.sort(topk_ids.reshape(-1).int())[0]
    r = Routing(topk_ids, indices, bin_ids, bins, padded_bins, torch.rand(indices.shape[0], device=DEVICE))
    x = torch.randn(case.num_tokens, case.hidden, device=DEVICE, dtype=case.dtype)
    grad = torch.randn_like(x)
    out = _gather(layout, x, r, case)
    assert_close(out, _gather_ref(layout, x, r, case), case.dtype, "gather", exact_zeros=True)
    assert torch.equal(out, _gather(layout, x, r, case))
    back = _scatter(layout, out, r, case)
    assert_close(back, _scatter_ref(layout, out, r, case), case.dtype, "scatter", exact_zeros=True)
    assert torch.equal(back, _scatter(layout, out, r, case))
    wgrad = _wgrad(layout, out, grad, r, case)
    assert_close(wgrad, _wgrad_ref(layout, out, grad, r, case), case.dtype, "wgrad", exact_zeros=True)
    assert torch.equal(wgrad, _wgrad(layout, out, grad, r, case))


@needs_gpu
def test_int64_offsets_gpu():
    """E * C * H > 2^31: buffer offsets overflow int32. Unweighted copies are exact, so gather then scatter gives
    x * (number of kept assignments of each token) bit for bit."""
    T, E, k, H = 300_000, 8, 2, 4096
    capacity = binned.expert_capacity(T, k, E, 1.0)  # 75000; E * C * H = 2.46e9
    topk_ids = torch.rand(T, E, device=DEVICE).topk(k, dim=1).indices
    _, indices = binned.sort(topk_ids.reshape(-1).int())
    bins = binned.inclusive_cumsum(binned.histogram(topk_ids.reshape(-1), E), 0)
    x = torch.randn(T, H, device=DEVICE, dtype=torch.bfloat16)
    buffer = binned.binned_gather(x, indices, None, bins, capacity, k)
    assert buffer.numel() > 2**31
    last = int(bins[-1]) - int(bins[-2])
    rows = min(last, capacity)
    assert torch.equal(buffer[-1, :rows], x[indices[int(bins[-2]):int(bins[-2]) + rows].long() // k])
    assert torch.all(buffer[-1, rows:] == 0)
    kept = binned.capacity_keep_mask(topk_ids, E, capacity).sum(1, keepdim=True)
    del buffer
    back = binned.binned_scatter(binned.binned_gather(x, indices, None, bins, capacity, k), indices, None, bins, k)
    assert torch.equal(back, x * kept.to(x.dtype))


@needs_gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
def test_sync_free_gpu():
    """Forward, backward and the capacity helpers never synchronise with the host (torch raises on any sync here);
    padded_gather is given num_rows, its one documented sync otherwise."""
    case = Case("sync_free", 256, 8, 2, 64, 40, block=16)
    r = _routing(case)
    x = torch.randn(case.num_tokens, case.hidden, device=DEVICE, requires_grad=True)
    weights = r.weights.clone().requires_grad_(True)
    padded_rows = int(r.padded_bins[-1])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        buffer = binned.binned_gather(x, r.indices, weights, r.bins, case.capacity, case.top_k)
        out = binned.binned_scatter(buffer, r.indices, weights, r.bins, case.top_k)
        out.sum().backward()
        binned.binned_scatter_wgrad(buffer.detach(), x.detach(), r.indices, r.bins, case.top_k)
        padded = binned.padded_gather(x, r.indices, r.bin_ids, weights, r.bins, r.padded_bins, case.top_k,
                                      num_rows=padded_rows)
        binned.padded_scatter(padded, r.indices, r.bin_ids, weights, r.bins, r.padded_bins, case.top_k).sum().backward()
        plain = binned.gather(x, r.indices, r.bin_ids, weights, r.bins, case.top_k)
        binned.scatter(plain, r.indices, r.bin_ids, weights, r.bins, case.top_k).sum().backward()
        binned.drop_over_capacity(r.topk_ids, case.num_experts, 0.5)
        binned.sort(r.topk_ids.reshape(-1).int())
        binned.inclusive_cumsum(binned.histogram(r.topk_ids.reshape(-1), case.num_experts), 0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert x.grad is not None and weights.grad is not None
