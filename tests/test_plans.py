"""Plans (moe_dispatch.host.replay): a replayed call computes what the full path computes, for new data in the same
signature, and a new signature, a bad input or a call that cannot be replayed goes through the full path.

On the CPU the replays re-launch through the interpreter (the recorded arguments, the package's Python skipped); on
a GPU they go through Triton's compiled launcher, the path eager users take.
"""

import pytest
import torch
from helpers import DEVICE, assert_close, make_weights

import moe_dispatch as md
from moe_dispatch.host import replay
from moe_dispatch.experts.autograd import BACKWARD_PLANS
from moe_dispatch.experts.operator import FORWARD_PLANS
from moe_dispatch.moe import _FUSED_EXPERTS_PLANS, _FUSED_MOE_PLANS
from moe_dispatch.reference import fused_experts_ref, fused_moe_forward_ref
from moe_dispatch.host.tiles import select_tiles


@pytest.fixture(autouse=True)
def fresh_plans(monkeypatch):
    monkeypatch.setattr(replay, "ENABLED", True)
    replay.clear()
    yield
    replay.clear()


def _inputs(T, E, top_k, H, F, dtype=torch.float32, seed=0, transposed=False):
    torch.manual_seed(seed)
    x = torch.randn(T, H).to(DEVICE, dtype)
    w_gate, w_up, w_down = make_weights(E, H, F, dtype, device=DEVICE)
    w_gate_up = torch.cat([w_gate, w_up], dim=1)
    if transposed:
        w_gate_up, w_down = w_gate_up.transpose(1, 2).contiguous(), w_down.transpose(1, 2).contiguous()
    ids = torch.stack([torch.randperm(E)[:top_k] for _ in range(T)] or [torch.zeros(0, top_k, dtype=torch.int64)])
    ids = ids.reshape(T, top_k).to(DEVICE)
    weights = torch.rand(T, top_k).to(DEVICE)
    return x, w_gate_up, w_down, ids, weights


def _checked(x, w_gate_up, w_down, ids, weights, **kwargs):
    """fused_experts (ids unchecked, so the call is plannable on the CPU too) against the float64 reference."""
    out = md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=False, **kwargs)
    assert_close(out, fused_experts_ref(x, w_gate_up, w_down, ids, weights,
                                        **{k: v for k, v in kwargs.items() if k != "tiles"}), torch.float32)
    return out


# (id, T, E, top_k, H, F, why)
CASES = [
    ("decode", 3, 8, 2, 32, 32, "a few tokens: the two-launch decode path"),
    ("general", 37, 6, 2, 32, 48, "past the decode bucket: dispatch, two grouped GEMMs and the combine"),
    ("odd-sizes", 5, 7, 3, 40, 24, "H and F not multiples of the tiles, prime E"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_replay_matches_reference_on_new_data(case, poison_empty):
    """The second and third calls of a signature are replays (one plan, recorded by the first); each gives its own
    inputs' result, in a fresh output tensor, with replay buffers poisoned like the recorded ones."""
    name, T, E, top_k, H, F, _ = case
    tiles = select_tiles(torch.device(DEVICE), T, top_k, E, F, H, torch.float32) if name == "general" else None
    outs = []
    for seed in range(3):
        x, w_gate_up, w_down, ids, weights = _inputs(T, E, top_k, H, F, seed=seed)
        out = _checked(x, w_gate_up, w_down, ids, weights, tiles=tiles)
        outs.append(out)
    assert len(_FUSED_EXPERTS_PLANS) == 1 and _FUSED_EXPERTS_PLANS.replayable_count() == 1, \
        _FUSED_EXPERTS_PLANS.last_reason
    assert outs[0].data_ptr() != outs[1].data_ptr() and not torch.equal(outs[0], outs[1])


def test_replay_is_bit_identical_to_the_full_path():
    x, w_gate_up, w_down, ids, weights = _inputs(4, 8, 2, 32, 32)
    replay.ENABLED = False
    full = md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=False)
    replay.ENABLED = True
    md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=False)  # records
    replayed = md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=False)
    assert _FUSED_EXPERTS_PLANS.replayable_count() == 1
    assert torch.equal(full, replayed)


def test_gpt_oss_layout_replays():
    """Transposed, interleaved gate/up with biases and the clamped SwiGLU: views of inputs at byte offsets."""
    T, E, top_k, H, F = 3, 6, 2, 32, 16
    for seed in range(2):
        x, w_gate_up, w_down, ids, weights = _inputs(T, E, top_k, H, F, seed=seed, transposed=True)
        gate_up_bias = torch.randn(E, 2 * F).to(DEVICE) * 0.1
        down_bias = torch.randn(E, H).to(DEVICE) * 0.1
        kwargs = dict(activation="swiglu_oai", interleaved=True, transposed=True, gate_up_bias=gate_up_bias,
                      down_bias=down_bias)
        _checked(x, w_gate_up, w_down, ids, weights, **kwargs)
    assert _FUSED_EXPERTS_PLANS.replayable_count() == 1


def test_input_views_at_other_offsets_replay_correctly():
    """Same signature, different storage offsets: pointers come from the new inputs, never the recorded ones."""
    T, E, top_k, H, F = 2, 4, 2, 32, 16
    x, w_gate_up, w_down, ids, weights = _inputs(T, E, top_k, H, F)
    big = torch.randn(3, *w_gate_up.shape).to(DEVICE) * 0.1
    for i in range(3):
        _checked(x, big[i], w_down, ids, weights)
    assert len(_FUSED_EXPERTS_PLANS) == 1


def test_new_signatures_record_new_plans():
    T, E, top_k, H, F = 3, 8, 2, 32, 16
    x, w_gate_up, w_down, ids, weights = _inputs(T, E, top_k, H, F)
    md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=False)
    md.fused_experts(x[:2], w_gate_up, w_down, ids[:2], weights[:2], validate=False)  # T
    md.fused_experts(x, w_gate_up, w_down, ids.int(), weights, validate=False)  # ids dtype
    md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=False, activation="swiglu_oai")  # option
    x_t = torch.randn(H, T).to(DEVICE).t()  # strides
    _checked(x_t, w_gate_up, w_down, ids, weights)
    assert len(_FUSED_EXPERTS_PLANS) == 5


def test_misaligned_input_gets_its_own_plan():
    """Triton specializes pointers on 16-byte alignment: a view one element in is another signature."""
    T, E, top_k, H, F = 2, 4, 2, 32, 16
    x, w_gate_up, w_down, ids, weights = _inputs(T, E, top_k, H, F)
    flat = torch.randn(T * H + 1).to(DEVICE)
    aligned, shifted = flat[:T * H].view(T, H), flat[1:].view(T, H)
    for xs in (aligned, shifted, aligned, shifted):
        _checked(xs, w_gate_up, w_down, ids, weights)
    assert len(_FUSED_EXPERTS_PLANS) == 2


def test_bad_inputs_raise_every_time_after_a_plan():
    T, E, top_k, H, F = 2, 4, 2, 32, 16
    x, w_gate_up, w_down, ids, weights = _inputs(T, E, top_k, H, F)
    md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=False)
    md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=False)
    for _ in range(2):
        with pytest.raises(ValueError, match="w_down"):
            md.fused_experts(x, w_gate_up, w_down[:, :-1], ids, weights, validate=False)
        with pytest.raises(TypeError, match="topk_ids"):
            md.fused_experts(x, w_gate_up, w_down, ids.float(), weights, validate=False)
        with pytest.raises(TypeError, match="hidden_states"):
            md.fused_experts(x.tolist(), w_gate_up, w_down, ids, weights, validate=False)
    assert _FUSED_EXPERTS_PLANS.replayable_count() == 1


def test_value_checks_are_never_skipped():
    """validate=True reads the ids on every call (no plan); out-of-range ids raise each time."""
    T, E, top_k, H, F = 2, 4, 2, 32, 16
    x, w_gate_up, w_down, ids, weights = _inputs(T, E, top_k, H, F)
    md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=True)
    bad = ids.clone()
    bad[0, 0] = E + 3
    for _ in range(2):
        with pytest.raises(ValueError, match="topk_ids"):
            md.fused_experts(x, w_gate_up, w_down, bad, weights, validate=True)
    assert len(_FUSED_EXPERTS_PLANS) == 0


@pytest.mark.parametrize("entry", ["fused_experts", "fused_moe_forward"])
def test_a_call_is_planned_at_one_level(entry):
    """Eager inference is planned at its public entry alone: the operator below runs inside the entry's record, never
    in a plan of its own; a training call is planned at the operator alone (its entry cannot replay)."""
    T, E, top_k, H, F = 37, 6, 2, 32, 16
    x, w_gate_up, w_down, ids, weights = _inputs(T, E, top_k, H, F)
    router = torch.randn(E, H, device=DEVICE)
    w_gate, w_up = w_gate_up[:, :F], w_gate_up[:, F:]
    cache = _FUSED_EXPERTS_PLANS if entry == "fused_experts" else _FUSED_MOE_PLANS

    def layer():
        if entry == "fused_experts":
            return md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=False)
        return md.fused_moe_forward(x, router, w_gate, w_up, w_down, E, top_k)[0]

    replays = cache.replays, FORWARD_PLANS.replays
    with torch.no_grad():
        for _ in range(2):
            layer()
    assert (len(cache), cache.replays - replays[0], len(FORWARD_PLANS)) == (1, 1, 0)
    x.requires_grad_(True)
    for _ in range(2):
        layer().sum().backward()
    assert (len(cache), len(FORWARD_PLANS), FORWARD_PLANS.replays - replays[1]) == (1, 1, 1)


def test_gradients_bypass_plans():
    T, E, top_k, H, F = 3, 4, 2, 32, 16
    x, w_gate_up, w_down, ids, weights = _inputs(T, E, top_k, H, F)
    x.requires_grad_(True)
    for _ in range(2):
        md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=False).sum().backward()
    assert len(_FUSED_EXPERTS_PLANS) == 0
    with torch.no_grad():
        md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=False)
    assert len(_FUSED_EXPERTS_PLANS) == 1


# (id, fused_experts options, retain_graph, why)
TRAINING_CASES = [
    ("plain", {}, False, "[E, 2F, H] silu; the backward writes d_preact over the saved pre-activations"),
    ("gpt-oss", dict(activation="swiglu_oai", interleaved=True, transposed=True, bias=True), False,
     "GPT-OSS's stored layout with biases: the paired kernels, bias gradients"),
    ("retained", {}, True, "retain_graph: the backward operator, which only reads the pre-activations"),
]


@pytest.mark.parametrize("case", TRAINING_CASES, ids=lambda c: c[0])
def test_training_steps_replay_below_autograd(case):
    """A training step cannot replay at `fused_experts` (its inputs require gradients), but the operator's forward
    and its backward replay below autograd: the second and third steps are replays, each step's output and four
    gradients (new inputs every step) match the float64 reference's autograd."""
    name, options, retain_graph, _ = case
    options = dict(options)
    bias = options.pop("bias", False)
    T, E, top_k, H, F = 37, 6, 2, 32, 16
    replays_before = (FORWARD_PLANS.replays, BACKWARD_PLANS.replays)
    for step in range(3):
        x, w_gate_up, w_down, ids, weights = _inputs(T, E, top_k, H, F, seed=step,
                                                     transposed=options.get("transposed", False))
        extra = {}
        if bias:
            extra = dict(gate_up_bias=torch.randn(E, 2 * F, device=DEVICE) * 0.1,
                         down_bias=torch.randn(E, H, device=DEVICE) * 0.1)
        leaves = [t.requires_grad_(True) for t in (x, w_gate_up, w_down, weights)]
        grad_out = torch.randn(T, H, device=DEVICE)
        out = md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=False, **options, **extra)
        grads = torch.autograd.grad(out, leaves, grad_out, retain_graph=retain_graph)
        ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
        ref = fused_experts_ref(*ref_leaves[:3], ids, ref_leaves[3], **options, **extra)
        ref_grads = torch.autograd.grad(ref, ref_leaves, grad_out.double())
        assert_close(out, ref, torch.float32)
        for what, g, r in zip(("d hidden_states", "d w_gate_up", "d w_down", "d topk_weights"), grads, ref_grads):
            assert_close(g, r, torch.float32, what=f"step {step} {what}")
    assert len(_FUSED_EXPERTS_PLANS) == 0  # never planned at the entry point
    replays = (FORWARD_PLANS.replays - replays_before[0], BACKWARD_PLANS.replays - replays_before[1])
    assert replays == (2, 2), (FORWARD_PLANS.last_reason, BACKWARD_PLANS.last_reason)


@pytest.mark.parametrize("layout", ["expanded", "column-major"])
def test_training_backward_replays_for_a_strided_gradient(layout):
    """The gradient reaching the experts' output need not be contiguous: `out.sum()` hands autograd an expanded one
    (strides 0, 0), a transposed consumer a column-major one. The backward still replays from the second step on
    (it copies the gradient to rows before its planned call, not inside it) and matches the float64 reference."""
    T, E, top_k, H, F = 29, 6, 2, 32, 16
    replays_before = BACKWARD_PLANS.replays
    for step in range(3):
        x, w_gate_up, w_down, ids, weights = _inputs(T, E, top_k, H, F, seed=10 + step)
        leaves = [t.requires_grad_(True) for t in (x, w_gate_up, w_down, weights)]
        if layout == "expanded":
            grad_out = torch.randn(1, H, device=DEVICE).expand(T, H)
        else:
            grad_out = torch.randn(H, T, device=DEVICE).t()
        out = md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=False)
        grads = torch.autograd.grad(out, leaves, grad_out)
        ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
        ref = fused_experts_ref(*ref_leaves[:3], ids, ref_leaves[3])
        ref_grads = torch.autograd.grad(ref, ref_leaves, grad_out.double())
        for what, g, r in zip(("d hidden_states", "d w_gate_up", "d w_down", "d topk_weights"), grads, ref_grads):
            assert_close(g, r, torch.float32, what=f"step {step} {what}")
    assert BACKWARD_PLANS.replays - replays_before == 2, BACKWARD_PLANS.last_reason


def test_nan_propagates_through_a_replay():
    T, E, top_k, H, F = 3, 8, 2, 32, 16
    x, w_gate_up, w_down, ids, weights = _inputs(T, E, top_k, H, F)
    md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=False)
    x[1, 3] = float("nan")
    out = md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=False)
    assert _FUSED_EXPERTS_PLANS.replayable_count() == 1
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()


def test_zero_tokens():
    """Zero tokens: no launch at all; the replay gives an empty output too."""
    T, E, top_k, H, F = 0, 4, 2, 32, 16
    x, w_gate_up, w_down, ids, weights = _inputs(T, E, top_k, H, F)
    for _ in range(2):
        out = md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=False)
        assert out.shape == (0, H)
    assert len(_FUSED_EXPERTS_PLANS) == 1


def test_foreign_ops_refuse_a_plan():
    """The recorder refuses what it cannot replay: a torch op that computes, a tensor from outside the call."""
    outside = torch.zeros(4, device=DEVICE)

    def computes(x):
        return x * 2

    def reads_outside(x):
        return outside

    cache = replay.PlanCache("test")
    x = torch.ones(4, device=DEVICE)
    for fn, reason in ((computes, "torch op"), (reads_outside, "outside the call")):
        for _ in range(2):
            assert torch.equal(cache.run(fn, (x,), ()), fn(x))
        assert cache.last_reason is not None and reason in cache.last_reason
        cache.clear()


def test_a_launch_outside_the_recorder_refuses_a_plan():
    """A kernel started outside host.replay.launch (the Gluon GEMMs', announced with `unrecorded_launch`) is not in
    the record, so a replay would skip it: the signature keeps no plan. The same call without the announcement, all
    of its launches recorded, replays."""
    from moe_dispatch.dispatch.segments import segment_tile_map

    def tile_map(offsets, announce):
        tile_expert = segment_tile_map(offsets, 300, 3, 128)[1]
        if announce:
            replay.unrecorded_launch("a kernel the recorder does not see")
        return tile_expert

    offsets = torch.tensor([0, 100, 100, 300], dtype=torch.int32, device=DEVICE)
    expected = tile_map(offsets, False)
    for announce, replays in ((False, 2), (True, 0)):
        cache = replay.PlanCache("test")
        for _ in range(3):
            assert torch.equal(cache.run(tile_map, (offsets,), (announce,)), expected)
        assert cache.replays == replays, cache.last_reason
    assert "launches a kernel the recorder does not see" in cache.last_reason


def test_an_output_nothing_wrote_refuses_a_plan():
    """A fresh output that no recorded launch or fill wrote (the launches ran through another loaded copy of the
    package, whose operator this one shares) must not be replayed: the replay would return uninitialised memory."""
    def unseen_writer(x):
        out = torch.empty_like(x)
        with torch.utils._python_dispatch._disable_current_modes():  # a write the recorder does not see
            out.copy_(x)
        return out

    cache = replay.PlanCache("test")
    x = torch.arange(4.0, device=DEVICE)
    for _ in range(3):
        assert torch.equal(cache.run(unseen_writer, (x,), ()), x)
    assert cache.last_reason is not None and "wrote the output" in cache.last_reason


def test_disabled_plans_and_user_dispatch_modes_run_in_full():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counting.ops += 1
            return func(*args, **(kwargs or {}))

    T, E, top_k, H, F = 2, 4, 2, 32, 16
    x, w_gate_up, w_down, ids, weights = _inputs(T, E, top_k, H, F)
    replay.ENABLED = False
    md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=False)
    assert len(_FUSED_EXPERTS_PLANS) == 0
    replay.ENABLED = True
    md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=False)
    replays = _FUSED_EXPERTS_PLANS.replays
    with Counting():
        md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=False)
    assert Counting.ops > 0 and _FUSED_EXPERTS_PLANS.replays == replays  # the user's mode saw the full path


def test_fused_moe_forward_replays():
    T, E, top_k, H, F = 3, 8, 2, 32, 16
    w_gate, w_up, w_down = make_weights(E, H, F, torch.float32, device=DEVICE)
    for seed in range(3):
        torch.manual_seed(seed)
        x = torch.randn(T, H).to(DEVICE)
        router = (torch.randn(E, H) * 0.5).to(DEVICE)
        out, ids, weights = md.fused_moe_forward(x, router, w_gate, w_up, w_down, E, top_k)
        ref_out, ref_ids, ref_weights = fused_moe_forward_ref(x, router, w_gate, w_up, w_down, E, top_k)
        assert torch.equal(ids.cpu(), ref_ids.cpu())
        assert_close(weights, ref_weights, torch.float32, "top_k_weights")
        assert_close(out, ref_out, torch.float32)
    assert len(_FUSED_MOE_PLANS) == 1


def test_replayed_backward_allocates_by_lifetime():
    """The backward's plans allocate each buffer at its first use and drop it after its last (host/replay.py): the
    activated rows [N, F] are dropped before the step that first writes dW_gate_up, which is allocated there and
    kept (an output). The replayed gradients are the full path's, bit for bit."""
    T, E, top_k, H, F = 37, 6, 2, 32, 24
    grads = []
    for _ in range(2):  # recorded, then replayed
        x, w_gate_up, w_down, ids, weights = _inputs(T, E, top_k, H, F)
        leaves = [t.requires_grad_(True) for t in (x, w_gate_up, w_down, weights)]
        out = md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=False)
        grads.append(torch.autograd.grad(out, leaves, torch.ones(T, H, device=DEVICE)))
    assert BACKWARD_PLANS.replays >= 1, BACKWARD_PLANS.last_reason
    for full, replayed in zip(*grads):
        assert torch.equal(full, replayed)
    (plan,) = [p for p in BACKWARD_PLANS._plans.values() if p is not None]
    assert plan.scratch_bytes == 0 and plan.allocate_before is not None
    shapes = [spec[0] for spec in plan.buffers]
    act, grad_gate_up = shapes.index((T * top_k, F)), shapes.index((E, 2 * F, H))
    dropped = [i for i, drops in enumerate(plan.drop_after) if act in drops]
    allocated = [i for i, new in enumerate(plan.allocate_before) if grad_gate_up in new]
    assert len(dropped) == 1 and len(allocated) == 1 and dropped[0] < allocated[0], (dropped, allocated)
    assert not any(grad_gate_up in drops for drops in plan.drop_after)
