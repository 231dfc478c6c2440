"""Bad and odd inputs: no input crashes the process, writes outside an output or returns a quiet lie.

Each test names the defect it guards:
  1 caller indices (sorted_idx, restore_idx, expert_offsets, indices, bins) are bounded in the kernels, and invalid
    ones raise ValueError naming them on CPU tensors or with validate=True
  2 NaN in a hidden state, in router_weight, or an all -inf router_bias: ids stay in [0, E), NaN reaches the output
  3 int64 ids outside int32 are outside [0, E) with validate=False, not wrapped into it
  4 errors that name their argument
  5 forward-only v1 functions warn once when they cut a gradient
  6 a non-tensor or a meta tensor for a tensor argument, a float or a bool for an int one: an error naming the argument
    from every public function, on a first call and after a valid one (a planned function then replays, see
    host/replay.py); the other options (bools, real numbers, choices, forced tiles, environment switches) in
    tests/test_options.py, over the same `PUBLIC_CALLS`
Shapes are tiny (the interpreter runs every kernel); values are compared with the float64 references.
"""

import dataclasses
import os
import subprocess
import sys
import types
import warnings
from collections.abc import Callable

import pytest
import torch
from conftest import ROOT
from helpers import DEVICE, ON_GPU, assert_close, make_weights

import moe_dispatch as md
from moe_dispatch.host import checks, replay
from moe_dispatch.moe import _FUSED_EXPERTS_PLANS, _FUSED_MOE_PLANS
from moe_dispatch.reference import (binned_routing_ref, fused_experts_ref, fused_moe_forward_ref, grouped_gemm_ref,
                                    moe_router_ref, permute_tokens_ref, unpermute_tokens_ref)

T, E, TOP_K, H, F = 6, 4, 2, 16, 8


def _routed(T=T, E=E, top_k=TOP_K):
    """Distinct random experts per token, as a router gives."""
    return torch.stack([torch.randperm(E)[:top_k] for _ in range(T)]).to(DEVICE)


def _permuted(dtype=torch.float32):
    x = torch.randn(T, H).to(DEVICE, dtype)
    ids = _routed()
    permuted, offsets, sorted_idx, restore_idx = md.permute_tokens(x, ids, E)
    return x, ids, permuted, offsets, sorted_idx, restore_idx


# Defect 1: indices from the caller


def test_fused_expert_ffn_rejects_bad_sorted_idx():
    """An out-of-range sorted_idx segfaulted (rc 139); a duplicated one gave a silently wrong sum."""
    _, _, permuted, offsets, sorted_idx, _ = _permuted()
    w_gate, w_up, w_down = make_weights(E, H, F, torch.float32, device=DEVICE)
    weights = torch.rand(T, TOP_K, device=DEVICE)
    for bad_value, what in ((10**6, "lie in"), (int(sorted_idx[1]), "not a permutation"), (-1, "negative")):
        bad = sorted_idx.clone()
        bad[0] = bad_value
        with pytest.raises(ValueError, match=f"sorted_idx.*{what}"):
            md.fused_expert_ffn(permuted, w_gate, w_up, w_down, offsets, E, weights, bad, T, TOP_K, validate=True)


@pytest.mark.skipif(ON_GPU, reason="CPU tensors run the kernels only through the interpreter; on a GPU the "
                                   "validate=True tests below cover the same checks")
def test_cpu_index_tensors_are_checked_by_default():
    """Bad index tensors on CPU tensors, validate left at None: a ValueError naming each, not a crash (checks are free
    there)."""
    x = torch.randn(T, H)
    permuted, offsets, sorted_idx, restore_idx = md.permute_tokens(x, torch.stack([torch.randperm(E)[:TOP_K]
                                                                                  for _ in range(T)]), E)
    w_gate, w_up, w_down = make_weights(E, H, F, torch.float32, device="cpu")
    bad = sorted_idx.clone()
    bad[0] = 10**6
    with pytest.raises(ValueError, match="sorted_idx"):
        md.fused_expert_ffn(permuted, w_gate, w_up, w_down, offsets, E, torch.rand(T, TOP_K), bad, T, TOP_K)
    bad = restore_idx.clone()
    bad[-1] = bad[0]
    with pytest.raises(ValueError, match="restore_idx"):
        md.unpermute_tokens(permuted, torch.rand(T, TOP_K), bad, T, TOP_K)
    with pytest.raises(ValueError, match="expert_offsets"):
        md.expert_ffn_triton(permuted, w_gate, w_up, w_down, offsets.flip(0), E)


def test_unpermute_tokens_rejects_duplicate_restore_idx():
    _, _, permuted, _, _, restore_idx = _permuted()
    bad = restore_idx.clone()
    bad[0] = bad[1]
    with pytest.raises(ValueError, match="restore_idx is not a permutation"):
        md.unpermute_tokens(permuted, torch.rand(T, TOP_K, device=DEVICE), bad, T, TOP_K, validate=True)
    with pytest.raises(TypeError, match="validate"):
        md.unpermute_tokens(permuted, torch.rand(T, TOP_K, device=DEVICE), restore_idx, T, TOP_K, validate="yes")


def test_unpermute_tokens_bounds_restore_idx_when_not_validated():
    """validate=False: a restore_idx entry past the rows adds nothing; the kernel never reads the memory behind them
    (here a real neighbouring row, so reading it would change the result)."""
    _, _, permuted, _, _, restore_idx = _permuted()
    backing = torch.randn(2 * T * TOP_K, H, device=DEVICE)
    backing[: T * TOP_K] = permuted
    expert_outputs = backing[: T * TOP_K]
    weights = torch.rand(T, TOP_K, device=DEVICE)
    bad = restore_idx.clone()
    bad[3] = T * TOP_K + 1
    out = md.unpermute_tokens(expert_outputs, weights, bad, T, TOP_K, validate=False)
    skipped = weights.clone()
    skipped.view(-1)[3] = 0.0
    assert_close(out, unpermute_tokens_ref(expert_outputs, skipped, restore_idx, T, TOP_K), torch.float32)


@pytest.mark.parametrize("offsets", [[0, 100, 2, 6, 12], [-2**40, 3, 2**40, 6, 12], [0, 3, 2, 1, 0]],
                         ids=["past-end", "huge", "decreasing"])
def test_segment_functions_clamp_unvalidated_expert_offsets(offsets):
    """validate=False with bad expert_offsets: rows are clamped into [0, M] and made non-decreasing on the device,
    so the GEMMs stay inside their rows (and give the reference's answer for the clamped offsets)."""
    M = T * TOP_K
    bad = torch.tensor(offsets, device=DEVICE)
    clamped = torch.cummax(bad.clamp(0, M), 0).values
    tokens = torch.randn(M, H, device=DEVICE)
    w = torch.randn(E, F, H, device=DEVICE) * 0.1
    with pytest.raises(ValueError, match="expert_offsets"):
        md.grouped_gemm(tokens, w, bad, E, validate=True)
    out = md.grouped_gemm(tokens, w, bad, E, validate=False)
    assert_close(out, grouped_gemm_ref(tokens, w, clamped, E), torch.float32)
    w_gate, w_up, w_down = make_weights(E, H, F, torch.float32, device=DEVICE)
    out = md.expert_ffn_triton(tokens, w_gate, w_up, w_down, bad, E, validate=False)
    assert out.shape == (M, H) and torch.isfinite(out).all()


_SEGFAULT_SCRIPT = """
import torch, moe_dispatch as md
torch.set_default_device("cuda" if torch.cuda.is_available() else "cpu")
T, E, k, H, F = 4, 3, 2, 8, 4
x = torch.randn(T, H)
p, off, si, ri = md.permute_tokens(x, torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]]), E)
si[0] = 2**40
out = md.fused_expert_ffn(p, torch.randn(E, F, H), torch.randn(E, F, H), torch.randn(E, H, F), off, E,
                          torch.rand(T, k), si, T, k, validate=False)
torch.cuda.synchronize() if torch.cuda.is_available() else None
print("returned", tuple(out.shape))
"""


def test_fused_expert_ffn_unvalidated_sorted_idx_does_not_crash():
    """A sorted_idx entry of 2**40 with validation off: the kernels bound it, so the call returns instead of faulting
    (run in a child process, so a crash fails the test rather than killing pytest)."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "torch-ext"))
    if not ON_GPU:  # on a GPU machine the repro runs on the GPU (an unbounded index there is an illegal access)
        env["TRITON_INTERPRET"] = "1"
    run = subprocess.run([sys.executable, "-c", _SEGFAULT_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and "returned (4, 8)" in run.stdout, (run.returncode, run.stderr[-2000:])


def test_binned_gather_bounds_unvalidated_bins():
    """validate=False with bins that start below 0: positions before `indices` are never read (here they hold a real
    assignment, so reading them would copy a token row); those buffer rows are zero."""
    num_tokens, top_k, num_experts, capacity = 4, 1, 2, 2
    x = torch.randn(num_tokens, 8, device=DEVICE)
    backing = torch.tensor([0, 1, 0, 1, 2, 3], device=DEVICE)
    indices = backing[2:]  # backing[0:2] sit right before indices in memory
    bins = torch.tensor([-2, 4], device=DEVICE)
    with pytest.raises(ValueError, match="bins"):
        md.binned_gather(x, indices, None, bins, capacity, top_k, validate=True)
    out = md.binned_gather(x, indices, None, bins, capacity, top_k, validate=False)
    assert torch.equal(out.cpu(), torch.zeros(num_experts, capacity, 8))


def test_padded_gather_names_a_negative_row_count():
    """validate=False and no num_rows: the row count read from padded_bins[-1] is checked before allocating."""
    x = torch.randn(2, 8, device=DEVICE)
    indices, bins = torch.tensor([0, 1], device=DEVICE), torch.tensor([2], device=DEVICE)
    with pytest.raises(ValueError, match="padded_bins"):
        md.padded_gather(x, indices, indices, None, bins, torch.tensor([-3], device=DEVICE), 1, validate=False)


# Defect 2: NaN


def _forward(x, router_weight, gating="softmax", **kwargs):
    w_gate, w_up, w_down = make_weights(E, H, F, torch.float32, device=DEVICE)
    out, ids, weights = md.fused_moe_forward(x, router_weight, w_gate, w_up, w_down, E, TOP_K, gating, **kwargs)
    ref, ref_ids, _ = fused_moe_forward_ref(x, router_weight, w_gate, w_up, w_down, E, TOP_K, gating, **kwargs)
    assert ((ids >= 0) & (ids < E)).all(), f"ids out of [0, {E}): {ids.tolist()}"
    assert torch.equal(ids.cpu(), ref_ids.cpu()), (ids.tolist(), ref_ids.tolist())  # NaN ranks first, like torch
    return out, ref, weights


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy under the interpreter: NaN arithmetic
@pytest.mark.parametrize("gating,kwargs", [("softmax", {}), ("sigmoid", {}),
                                           ("sigmoid", dict(n_group=2, topk_group=1))],
                         ids=["softmax", "sigmoid", "grouped"])
def test_nan_hidden_state_reaches_its_output_row(gating, kwargs):
    x = torch.randn(T, H, device=DEVICE)
    x[2, 5] = float("nan")
    out, ref, weights = _forward(x, torch.randn(E, H, device=DEVICE) * 0.5, gating, **kwargs)
    assert out[2].isnan().all() and weights[2].isnan().all()
    others = torch.arange(T, device=DEVICE) != 2
    assert_close(out[others], ref[others], torch.float32)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy under the interpreter: NaN arithmetic
@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
def test_nan_in_router_weight_reaches_the_output(gating):
    """softmax: every token's scores are NaN; sigmoid: expert 1's score is NaN and ranks first for every token."""
    router_weight = torch.randn(E, H, device=DEVICE) * 0.5
    router_weight[1, 3] = float("nan")
    out, _, _ = _forward(torch.randn(T, H, device=DEVICE), router_weight, gating)
    assert out.isnan().all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy under the interpreter: NaN arithmetic
def test_all_minus_inf_router_bias_reaches_the_output():
    """softmax over all -inf logits is NaN (as in torch); the ids are still 0..top_k-1."""
    bias = torch.full((E,), float("-inf"), device=DEVICE)
    out, _, weights = _forward(torch.randn(T, H, device=DEVICE), torch.randn(E, H, device=DEVICE), router_bias=bias)
    assert out.isnan().all() and weights.isnan().all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy under the interpreter: NaN arithmetic
def test_router_picks_each_id_once_for_nan_logits():
    """top_k = E: every token gets every id exactly once, NaN rows included (ties among NaNs to the lower id)."""
    x = torch.randn(T, H, device=DEVICE)
    x[0] = float("nan")
    router_weight = torch.randn(E, H, device=DEVICE)
    ids, weights, _ = md.moe_router(x, router_weight, E)
    ref_ids, _, _ = moe_router_ref(x, router_weight, E)
    assert torch.equal(ids.cpu(), ref_ids.cpu()) and torch.equal(ids[0].cpu(), torch.arange(E))
    assert torch.equal(ids.sort(1).values.cpu(), torch.arange(E).expand(T, E))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy under the interpreter: NaN arithmetic
def test_nan_hidden_state_in_fused_experts_is_not_zeroed_by_a_zero_weight():
    """eager: 0 * NaN = NaN. The token's rows are NaN, the others match the reference."""
    x = torch.randn(T, H, device=DEVICE)
    x[4, 0] = float("nan")
    w_gate_up, w_down = torch.randn(E, 2 * F, H, device=DEVICE) * 0.1, torch.randn(E, H, F, device=DEVICE) * 0.1
    ids = _routed()
    weights = torch.rand(T, TOP_K, device=DEVICE)
    weights[4, 1] = 0.0
    out = md.fused_experts(x, w_gate_up, w_down, ids, weights)
    assert out[4].isnan().all()
    keep = torch.arange(T, device=DEVICE) != 4
    assert_close(out[keep], fused_experts_ref(x, w_gate_up, w_down, ids, weights)[keep], torch.float32)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy under the interpreter: NaN arithmetic
@pytest.mark.parametrize("path", ["decode", "general", "backward"])
def test_nan_hidden_state_passes_the_swiglu_clamps(path):
    """GPT-OSS's clamped SwiGLU: a NaN gate or up value stays NaN through the clamps (min / max that drop NaN made
    the token's row finite); +-inf are still clamped, as torch.clamp does. On the decode path, the general one
    (forced MoeTiles), and the forward that saves pre-activations for a backward."""
    x = torch.randn(T, H, device=DEVICE)
    x[3, 1] = float("nan")
    w_gate_up, w_down = torch.randn(E, 2 * F, H, device=DEVICE) * 0.1, torch.randn(E, H, F, device=DEVICE) * 0.1
    ids, weights = _routed(), torch.rand(T, TOP_K, device=DEVICE)
    options = dict(activation="swiglu_oai", interleaved=True)
    if path == "general":
        options["tiles"] = md.tiles.MoeTiles(16, md.tiles.GemmTile(16, 16), md.tiles.GemmTile(16, 16))
    if path == "backward":
        x.requires_grad_(True)
    out = md.fused_experts(x, w_gate_up, w_down, ids, weights, **options)
    assert out[3].isnan().all(), out[3]
    keep = torch.arange(T, device=DEVICE) != 3
    ref = fused_experts_ref(x.detach(), w_gate_up, w_down, ids, weights, activation="swiglu_oai", interleaved=True)
    assert_close(out[keep].detach(), ref[keep], torch.float32)


# Defect 3: int64 ids outside int32


WIDE_IDS = [2**32 + 1, 2**31, -2**40, -2**32 + 3, -1]  # each would wrap (or did wrap) into [0, E) in 32 bits


def test_wide_ids_contribute_nothing_without_validation():
    x = torch.randn(T, H, device=DEVICE)
    w_gate_up, w_down = torch.randn(E, 2 * F, H, device=DEVICE) * 0.1, torch.randn(E, H, F, device=DEVICE) * 0.1
    ids = _routed()
    for t, wide in enumerate(WIDE_IDS):
        ids[t, t % TOP_K] = wide
    weights = torch.rand(T, TOP_K, device=DEVICE)
    out = md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=False)
    assert_close(out, fused_experts_ref(x, w_gate_up, w_down, ids, weights), torch.float32)  # the ref skips them
    with pytest.raises(ValueError, match="topk_ids"):
        md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=True)


def test_wide_ids_get_no_row_in_permute_tokens():
    x = torch.randn(T, H, device=DEVICE)
    ids = _routed()
    ids[:, 0] = torch.tensor(WIDE_IDS + [2**33], device=DEVICE)
    _, offsets, _, restore_idx = md.permute_tokens(x, ids, E, validate=False)
    assert int(offsets[-1]) == T  # only column 1 kept
    assert (restore_idx.view(T, TOP_K)[:, 0] == -1).all() and (restore_idx.view(T, TOP_K)[:, 1] >= 0).all()


def test_wide_ids_in_the_capacity_helpers():
    ids = torch.tensor([[2**32 + 1, 0], [-2**40, 1], [2, 2**31]], device=DEVICE)
    keep = md.dispatch.binned.capacity_keep_mask(ids, E, 1)
    assert keep.cpu().tolist() == [[False, True], [False, True], [True, False]]
    assert md.histogram(ids.reshape(-1), E).cpu().tolist() == [1, 1, 1, 0]


# Defect 4: errors that name their argument


def test_errors_name_their_argument():
    x = torch.randn(T, H, device=DEVICE)
    w_gate, w_up, w_down = make_weights(E, H, F, torch.float32, device=DEVICE)
    with pytest.raises(TypeError, match="router_weight"):
        md.fused_moe_forward(x.half(), torch.randn(E, H, device=DEVICE), w_gate.half(), w_up.half(), w_down.half(), E,
                             TOP_K)
    with pytest.raises(TypeError, match="router_weight"):
        md.moe_router(x, torch.randn(E, H, dtype=torch.bfloat16, device=DEVICE), TOP_K)
    with pytest.raises(ValueError, match="hidden_states"):
        md.moe_router(torch.randn(T, 0, device=DEVICE), torch.randn(E, 0, device=DEVICE), TOP_K)
    for factor in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="capacity_factor"):
            md.expert_capacity(T, TOP_K, E, factor)
    with pytest.raises(ValueError, match="capacity_factor"):
        md.fused_moe_forward(x, torch.randn(E, H, device=DEVICE), w_gate, w_up, w_down, E, TOP_K,
                             capacity_factor=float("inf"))
    with pytest.raises(ValueError, match="dim"):
        md.inclusive_cumsum(torch.arange(3), 5)
    with pytest.raises(TypeError, match="dim"):
        md.inclusive_cumsum(torch.arange(3), None)
    with pytest.raises(TypeError, match="name"):
        md.register_experts(None)
    with pytest.raises(ValueError, match="name"):
        md.register_experts("")
    gate_up = torch.cat([w_gate, w_up], dim=1)
    ids, weights = torch.randint(0, E, (T, TOP_K), device=DEVICE), torch.rand(T, TOP_K, device=DEVICE)
    with pytest.raises(TypeError, match="tiles must be a MoeTiles"):
        md.fused_experts(x, gate_up, w_down, ids, weights, tiles=[64, 64])


def test_cpu_tensors_without_the_interpreter_are_refused_naming_the_argument(monkeypatch):
    """On the CPU, Triton runs kernels only through its interpreter; without it a launch would fail inside Triton
    ("cannot be accessed from Triton"), so every entry point refuses CPU tensors once its arguments are validated,
    naming the public argument (the operators' inner names, "fused_experts's x", "route's x", leaked before)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, ids = torch.randn(T, H), _routed().cpu()
    w_gate, w_up, w_down = make_weights(E, H, F, torch.float32, device="cpu")
    weights = torch.rand(T, TOP_K)
    with pytest.raises(ValueError, match="^hidden_states is on the CPU.*TRITON_INTERPRET=1"):
        md.fused_experts(x, torch.cat([w_gate, w_up], dim=1), w_down, ids, weights)
    with pytest.raises(ValueError, match="^hidden_states is on the CPU"):
        md.fused_moe_forward(x, torch.randn(E, H), w_gate, w_up, w_down, E, TOP_K)
    with pytest.raises(ValueError, match="^hidden_states is on the CPU"):
        md.moe_router(x, torch.randn(E, H), TOP_K)
    with pytest.raises(ValueError, match="^tokens is on the CPU"):
        md.grouped_gemm(torch.randn(T, H), w_gate, torch.tensor([0, 2, 4, 6, 6]), E)
    with pytest.raises(ValueError, match="^permuted_tokens is on the CPU"):
        md.expert_ffn_triton(torch.randn(T, H), w_gate, w_up, w_down, torch.tensor([0, 2, 4, 6, 6]), E)
    with pytest.raises(ValueError, match="hidden_states is on the CPU"):
        md.permute_tokens(x, ids, E)
    with pytest.raises(ValueError, match="expert_outputs is on the CPU"):
        md.unpermute_tokens(torch.randn(T * TOP_K, H), weights, torch.arange(T * TOP_K), T, TOP_K)
    with pytest.raises(ValueError, match="topk_ids"):  # argument errors come first, as with the interpreter
        md.fused_experts(x, torch.cat([w_gate, w_up], dim=1), w_down, ids[:, :1], weights)


def test_float64_topk_weights_are_accepted():
    x = torch.randn(T, H, device=DEVICE)
    w_gate_up, w_down = torch.randn(E, 2 * F, H, device=DEVICE) * 0.1, torch.randn(E, H, F, device=DEVICE) * 0.1
    ids = _routed()
    weights = torch.rand(T, TOP_K, device=DEVICE, dtype=torch.float64)
    out = md.fused_experts(x, w_gate_up, w_down, ids, weights)
    assert out.dtype == torch.float32
    assert_close(out, fused_experts_ref(x, w_gate_up, w_down, ids, weights), torch.float32)
    _, _, permuted, _, _, restore_idx = _permuted()
    assert_close(md.unpermute_tokens(permuted, weights, restore_idx, T, TOP_K),
                 unpermute_tokens_ref(permuted, weights, restore_idx, T, TOP_K), torch.float32)


# Defect 5: gradients cut without a word


@pytest.fixture
def fresh_gradient_warnings(monkeypatch):
    monkeypatch.setattr(checks, "_GRADIENT_WARNED", set())


def _forward_only_calls(x):
    ids = _routed()
    weights = torch.rand(T, TOP_K, device=DEVICE)
    with torch.no_grad():
        permuted, offsets, sorted_idx, restore_idx = md.permute_tokens(x, ids, E)
    permuted.requires_grad_(True)
    w = torch.randn(E, F, H, device=DEVICE, requires_grad=True)
    w_gate, w_up, w_down = (t.requires_grad_(True) for t in make_weights(E, H, F, torch.float32, device=DEVICE))
    return {
        "permute_tokens": lambda: md.permute_tokens(x, ids, E),
        "unpermute_tokens": lambda: md.unpermute_tokens(permuted, weights, restore_idx, T, TOP_K),
        "grouped_gemm": lambda: md.grouped_gemm(permuted.detach(), w, offsets, E),
        "expert_ffn_triton": lambda: md.expert_ffn_triton(permuted, w_gate, w_up, w_down, offsets, E),
        "fused_expert_ffn": lambda: md.fused_expert_ffn(permuted, w_gate, w_up, w_down, offsets, E, weights,
                                                        sorted_idx, T, TOP_K),
    }


def test_forward_only_functions_warn_once_when_a_gradient_is_cut(fresh_gradient_warnings):
    x = torch.randn(T, H, device=DEVICE, requires_grad=True)
    for name, call in _forward_only_calls(x).items():
        with pytest.warns(UserWarning, match=f"{name} is forward-only"):
            call()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            call()  # once per function


def test_no_gradient_warning_under_no_grad(fresh_gradient_warnings):
    x = torch.randn(T, H, device=DEVICE, requires_grad=True)
    calls = _forward_only_calls(x)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        for call in calls.values():
            call()


# Defect 6: non-tensors, meta tensors and mistyped ints, on a first call and on a replayed plan


class _Experts(torch.nn.Module):
    """What `moe_dispatch_experts` reads of a transformers experts module: the two weights and a SiLU `act_fn`."""

    def __init__(self, w_gate_up, w_down):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(w_gate_up, requires_grad=False)
        self.down_proj = torch.nn.Parameter(w_down, requires_grad=False)
        self.act_fn = torch.nn.SiLU()


def _ep_layer(w_gate_up_local, w_down_local, hidden_states, topk_ids, topk_weights, gate_up_bias_local=None,
              down_bias_local=None):
    """`ExpertParallelExperts` built and called on one rank (no process group) in inference: its constructor's and
    its forward's arguments in one call."""
    layer = md.ExpertParallelExperts(w_gate_up_local, w_down_local, gate_up_bias_local=gate_up_bias_local,
                                     down_bias_local=down_bias_local, num_experts=E, validate=False)
    with torch.no_grad():
        return layer(hidden_states, topk_ids, topk_weights)


def _inputs():
    """Valid tiny arguments of every public function, one namespace for all (made by the references: no launch)."""
    x = torch.randn(T, H, device=DEVICE)
    ids, weights = _routed(), torch.rand(T, TOP_K, device=DEVICE)
    w_gate, w_up, w_down = make_weights(E, H, F, torch.float32, device=DEVICE)
    w_gate_up = torch.cat([w_gate, w_up], dim=1)
    permuted, offsets, sorted_idx, restore_idx = permute_tokens_ref(x, ids, E)
    indices, bins = binned_routing_ref(ids, E)
    counts = torch.diff(bins, prepend=bins.new_zeros(1))
    padded_bins = torch.cumsum((counts + 3) // 4 * 4, 0)  # each expert's rows rounded up to 4
    w_fp8, scale = md.quantize_experts_fp8(w_gate_up, block_shape=(8, 8))
    return types.SimpleNamespace(
        x=x, ids=ids, weights=weights, w_gate=w_gate, w_up=w_up, w_down=w_down, w_gate_up=w_gate_up,
        router_weight=torch.randn(E, H, device=DEVICE), router_bias=torch.randn(E, device=DEVICE),
        gate_up_bias=torch.randn(E, 2 * F, device=DEVICE), down_bias=torch.randn(E, H, device=DEVICE),
        permuted=permuted.float(), offsets=offsets, sorted_idx=sorted_idx, restore_idx=restore_idx,
        indices=indices, bins=bins, bin_ids=torch.repeat_interleave(torch.arange(E, device=DEVICE), counts),
        padded_bins=padded_bins, assignment_weights=weights.reshape(-1),
        binned_rows=torch.randn(E, 2, H, device=DEVICE),  # capacity 2
        padded_rows=torch.randn(int(padded_bins[-1]), H, device=DEVICE), experts=_Experts(w_gate_up, w_down),
        w_fp8=w_fp8, scale=scale)


@dataclasses.dataclass(frozen=True)
class PublicCall:
    """A public function and its valid arguments, all by name. Its tensor arguments: those whose valid value is a
    tensor, and the `optional` ones (None is valid there; those missing from `arguments` are left at None)."""

    function: Callable
    arguments: Callable[[types.SimpleNamespace], dict]  # _inputs() -> {argument: valid value}
    optional: tuple = ()
    ints: tuple = ()  # int arguments
    plans: replay.PlanCache | None = None  # where a valid call records a plan
    bools: tuple = ()  # True / False arguments (None too where the signature's default is None)
    reals: tuple = ()  # real-number arguments (None too where the signature's default is None)
    choices: tuple = ()  # arguments that name one of a few strings
    launches: bool = True  # launches kernels: reads the environment switches (host/device.py)


PUBLIC_CALLS = [
    # planned: a replay skips every check, so its key must tell each bad argument from the valid one
    PublicCall(md.fused_moe_forward, lambda i: dict(
        hidden_states=i.x, router_weight=i.router_weight, w_gate=i.w_gate, w_up=i.w_up, w_down=i.w_down,
        num_experts=E, top_k=TOP_K, router_bias=i.router_bias, e_score_correction_bias=i.router_bias),
        optional=("router_bias", "e_score_correction_bias"), ints=("num_experts", "top_k"), plans=_FUSED_MOE_PLANS,
        bools=("renormalize",), reals=("routed_scaling_factor", "capacity_factor"), choices=("gating",)),
    # planned with validate=False (validate=None reads CPU ids: such calls run in full); the scales go with float8
    # weights, but a non-tensor or meta scale is refused before that is looked at
    PublicCall(md.fused_experts, lambda i: dict(
        hidden_states=i.x, w_gate_up=i.w_gate_up, w_down=i.w_down, topk_ids=i.ids, topk_weights=i.weights,
        gate_up_bias=i.gate_up_bias, down_bias=i.down_bias, validate=False),
        optional=("gate_up_bias", "down_bias", "w_gate_up_scale", "w_down_scale", "gate_up_input_scale",
                  "down_input_scale"), plans=_FUSED_EXPERTS_PLANS,
        bools=("interleaved", "transposed", "validate", "validate_ids"), reals=("swiglu_alpha", "swiglu_limit"),
        choices=("activation", "fp8_compute", "w_gate_up_scale_layout")),
    # the transformers experts interface: fused_experts' tensors under other names (named as the caller knows them)
    PublicCall(md.moe_dispatch_experts, lambda i: dict(
        self=i.experts, hidden_states=i.x, top_k_index=i.ids, top_k_weights=i.weights), plans=_FUSED_EXPERTS_PLANS),
    # expert parallelism on one rank: fused_experts under the _local names, the layer's constructor too
    PublicCall(md.ep_fused_experts, lambda i: dict(
        hidden_states=i.x, w_gate_up_local=i.w_gate_up, w_down_local=i.w_down, topk_ids=i.ids, topk_weights=i.weights,
        gate_up_bias_local=i.gate_up_bias, down_bias_local=i.down_bias, num_experts=E, validate=False),
        optional=("gate_up_bias_local", "down_bias_local"), ints=("num_experts",), plans=_FUSED_EXPERTS_PLANS,
        bools=("interleaved", "transposed", "validate", "return_stats"),
        reals=("swiglu_alpha", "swiglu_limit", "capacity_factor"), choices=("activation",)),
    PublicCall(_ep_layer, lambda i: dict(
        w_gate_up_local=i.w_gate_up, w_down_local=i.w_down, hidden_states=i.x, topk_ids=i.ids, topk_weights=i.weights,
        gate_up_bias_local=i.gate_up_bias, down_bias_local=i.down_bias),
        optional=("gate_up_bias_local", "down_bias_local"), plans=_FUSED_EXPERTS_PLANS),
    # the v1 functions
    PublicCall(md.moe_router, lambda i: dict(
        hidden_states=i.x, router_weight=i.router_weight, top_k=TOP_K, router_bias=i.router_bias,
        e_score_correction_bias=i.router_bias), optional=("router_bias", "e_score_correction_bias"), ints=("top_k",),
        bools=("renormalize",), reals=("routed_scaling_factor",), choices=("gating",)),
    PublicCall(md.permute_tokens, lambda i: dict(hidden_states=i.x, top_k_indices=i.ids, num_experts=E),
               ints=("num_experts",), bools=("validate", "validate_ids")),
    PublicCall(md.unpermute_tokens, lambda i: dict(
        expert_outputs=i.permuted, top_k_weights=i.weights, restore_idx=i.restore_idx, num_tokens=T, top_k=TOP_K),
        ints=("num_tokens", "top_k"), bools=("validate",)),
    PublicCall(md.grouped_gemm, lambda i: dict(
        tokens=i.permuted, weights=i.w_gate, expert_offsets=i.offsets, num_experts=E), ints=("num_experts",),
        bools=("validate",)),
    PublicCall(md.expert_ffn_triton, lambda i: dict(
        permuted_tokens=i.permuted, w_gate=i.w_gate, w_up=i.w_up, w_down=i.w_down, expert_offsets=i.offsets,
        num_experts=E), ints=("num_experts",), bools=("validate",)),
    PublicCall(md.fused_expert_ffn, lambda i: dict(
        permuted_tokens=i.permuted, w_gate=i.w_gate, w_up=i.w_up, w_down=i.w_down, expert_offsets=i.offsets,
        num_experts=E, top_k_weights=i.weights, sorted_idx=i.sorted_idx, num_tokens=T, top_k=TOP_K),
        ints=("num_experts", "num_tokens", "top_k"), bools=("validate",)),
    # binned routing: weights may be None; bin_ids and padded_bins are required where an op takes them
    PublicCall(md.binned_gather, lambda i: dict(
        x=i.x, indices=i.indices, weights=i.assignment_weights, bins=i.bins, expert_capacity=2, top_k=TOP_K),
        optional=("weights",), ints=("expert_capacity", "top_k"), bools=("validate",)),
    PublicCall(md.binned_scatter, lambda i: dict(
        x=i.binned_rows, indices=i.indices, weights=i.assignment_weights, bins=i.bins, top_k=TOP_K),
        optional=("weights",), ints=("top_k",), bools=("validate",)),
    PublicCall(md.binned_scatter_wgrad, lambda i: dict(
        x=i.binned_rows, grad=i.x, indices=i.indices, bins=i.bins, top_k=TOP_K), ints=("top_k",),
        bools=("validate",)),
    PublicCall(md.gather, lambda i: dict(
        x=i.x, indices=i.indices, bin_ids=i.bin_ids, weights=i.assignment_weights, bins=i.bins, top_k=TOP_K),
        optional=("weights",), ints=("top_k",), bools=("validate",)),
    PublicCall(md.scatter, lambda i: dict(
        x=i.permuted, indices=i.indices, bin_ids=i.bin_ids, weights=i.assignment_weights, bins=i.bins, top_k=TOP_K),
        optional=("weights",), ints=("top_k",), bools=("validate",)),
    PublicCall(md.scatter_wgrad, lambda i: dict(
        x=i.permuted, grad=i.x, indices=i.indices, bin_ids=i.bin_ids, bins=i.bins, top_k=TOP_K), ints=("top_k",),
        bools=("validate",)),
    PublicCall(md.padded_gather, lambda i: dict(
        x=i.x, indices=i.indices, bin_ids=i.bin_ids, weights=i.assignment_weights, bins=i.bins,
        padded_bins=i.padded_bins, top_k=TOP_K, num_rows=i.padded_rows.shape[0]),
        optional=("weights",), ints=("top_k", "num_rows"), bools=("validate",)),
    PublicCall(md.padded_scatter, lambda i: dict(
        x=i.padded_rows, indices=i.indices, bin_ids=i.bin_ids, weights=i.assignment_weights, bins=i.bins,
        padded_bins=i.padded_bins, top_k=TOP_K), optional=("weights",), ints=("top_k",), bools=("validate",)),
    PublicCall(md.padded_scatter_wgrad, lambda i: dict(
        x=i.padded_rows, grad=i.x, indices=i.indices, bin_ids=i.bin_ids, bins=i.bins, padded_bins=i.padded_bins,
        top_k=TOP_K), ints=("top_k",), bools=("validate",)),
    # plain torch
    PublicCall(md.sort, lambda i: dict(x=i.indices, end_bit=8), ints=("end_bit",), launches=False),
    PublicCall(md.histogram, lambda i: dict(x=i.indices, max_val=E), ints=("max_val",), launches=False),
    PublicCall(md.inclusive_cumsum, lambda i: dict(x=i.bins, dim=0), ints=("dim",), launches=False),
    PublicCall(md.expert_capacity, lambda i: dict(num_tokens=T, top_k=TOP_K, num_experts=E, capacity_factor=1.0),
               ints=("num_tokens", "top_k", "num_experts"), reals=("capacity_factor",), launches=False),
    # FP8 weights (plain torch); n_axis=True was taken for 1
    PublicCall(md.quantize_experts_fp8, lambda i: dict(w=i.w_gate_up, block_shape=(8, 8), n_axis=1),
               ints=("n_axis",), choices=("scheme",), launches=False),
    PublicCall(md.dequantize_experts_fp8, lambda i: dict(w_fp8=i.w_fp8, scale=i.scale, block_shape=(8, 8), n_axis=1),
               ints=("n_axis",), choices=("scheme",), launches=False),
]
TENSOR_CALLS = [call for call in PUBLIC_CALLS if call.function is not md.expert_capacity]
INT_CALLS = [call for call in PUBLIC_CALLS if call.ints]
WHEN = ["first-call", "after-a-valid-call"]


def _call_id(call):
    return call.function.__name__.lstrip("_")


def _valid_arguments(call, when):
    """The call's valid arguments; with "after-a-valid-call", after one call with them, which records a plan where the
    function has plans (a bad call that follows replays it unless the plan key tells them apart)."""
    arguments = call.arguments(_inputs())
    if when == "after-a-valid-call":
        call.function(**arguments)
        if call.plans is not None:
            assert call.plans.replayable_count() == 1, call.plans.last_reason
    return arguments


def _tensor_arguments(call, arguments):
    return [name for name, value in arguments.items() if isinstance(value, torch.Tensor)] + [
        name for name in call.optional if name not in arguments]


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("call", TENSOR_CALLS, ids=_call_id)
def test_a_non_tensor_is_refused_naming_the_argument(call, when):
    """None (a list where None is allowed) for a tensor argument: a TypeError naming it, not an AttributeError from
    inside (fused_moe_forward(None, ...) read None's `.is_cuda` for its plan key)."""
    arguments = _valid_arguments(call, when)
    for name in _tensor_arguments(call, arguments):
        for bad in ([[0.0]] if name in call.optional else [None, [[0.0]]]):
            with pytest.raises(TypeError, match=rf"\b{name} must be a torch\.Tensor, got {type(bad).__name__}"):
                call.function(**{**arguments, name: bad})


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("call", TENSOR_CALLS, ids=_call_id)
def test_a_meta_tensor_is_refused_naming_the_argument(call, when):
    """A tensor on the meta device (weights not loaded yet): a ValueError naming it, not torch's "Cannot copy out of
    meta tensor" from inside; on the CPU a meta tensor's plan key read device -1, the CPU's, and replayed its plan."""
    arguments = _valid_arguments(call, when)
    for name in _tensor_arguments(call, arguments):
        valid = arguments.get(name)
        bad = valid.to("meta") if valid is not None else torch.ones(E, device="meta")
        with pytest.raises(ValueError, match=rf"\b{name} is on meta"):
            call.function(**{**arguments, name: bad})


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("call", INT_CALLS, ids=_call_id)
def test_an_int_argument_refuses_floats_and_bools(call, when):
    """num_experts=4.0 ran fused_moe_forward; a TypeError naming the argument for a float or a bool, on a first call
    and after a valid one (top_k=2.0 replayed the plan of top_k=2: the key compared options with ==)."""
    arguments = _valid_arguments(call, when)
    for name in call.ints:
        for bad in (float(arguments[name]), True):
            with pytest.raises(TypeError, match=rf"\b{name} must be an int"):
                call.function(**{**arguments, name: bad})


# (id, valid options, options equal to them under == but refused on a first call, the argument named)
EQUAL_BUT_REFUSED = [
    # the repro: a float top_k replayed the plan of top_k=2
    ("top_k=2.0", dict(top_k=2), dict(top_k=2.0), "top_k"),
    # True == 1, and hash(True) == hash(1)
    ("top_k=True", dict(top_k=1), dict(top_k=True), "top_k"),
    # compared with router_weight's E by ==, so even a first call took it
    ("num_experts=4.0", dict(num_experts=E), dict(num_experts=float(E)), "num_experts"),
    # DeepSeek-V3 grouped routing: a bool group count
    ("topk_group=True", dict(gating="sigmoid", n_group=2, topk_group=1),
     dict(gating="sigmoid", n_group=2, topk_group=True), "topk_group"),
]


@pytest.mark.parametrize("valid,bad,name", [case[1:] for case in EQUAL_BUT_REFUSED],
                         ids=[case[0] for case in EQUAL_BUT_REFUSED])
def test_a_plan_does_not_take_options_equal_to_its_own(valid, bad, name):
    """fused_moe_forward refuses `bad` on a first call, records a plan for `valid`, then refuses `bad` again: the plan
    key holds each option's type beside its value."""
    i = _inputs()
    arguments = dict(hidden_states=i.x, router_weight=i.router_weight, w_gate=i.w_gate, w_up=i.w_up, w_down=i.w_down,
                     num_experts=E, top_k=TOP_K)
    with pytest.raises(TypeError, match=rf"\b{name} must be an int"):
        md.fused_moe_forward(**{**arguments, **bad})
    md.fused_moe_forward(**{**arguments, **valid})
    assert _FUSED_MOE_PLANS.replayable_count() == 1, _FUSED_MOE_PLANS.last_reason
    with pytest.raises(TypeError, match=rf"\b{name} must be an int"):
        md.fused_moe_forward(**{**arguments, **bad})


def test_a_plan_does_not_take_a_block_shape_equal_to_its_own():
    """fp8_block_shape (8.0, 8) == (8, 8): the items of a tuple option are typed in the key too."""
    i = _inputs()
    arguments = dict(hidden_states=i.x, w_gate_up=i.w_fp8, w_down=i.w_down, topk_ids=i.ids, topk_weights=i.weights,
                     w_gate_up_scale=i.scale, validate=False)
    with pytest.raises(ValueError, match="fp8_block_shape must be two positive ints"):
        md.fused_experts(**arguments, fp8_block_shape=(8.0, 8))
    md.fused_experts(**arguments, fp8_block_shape=(8, 8))
    assert _FUSED_EXPERTS_PLANS.replayable_count() == 1, _FUSED_EXPERTS_PLANS.last_reason
    with pytest.raises(ValueError, match="fp8_block_shape must be two positive ints"):
        md.fused_experts(**arguments, fp8_block_shape=(8.0, 8))
