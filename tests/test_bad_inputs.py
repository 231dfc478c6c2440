"""Bad and odd inputs: no input crashes the process, writes outside an output or returns a quiet lie.

Each test names the defect it guards:
  1 caller indices (sorted_idx, restore_idx, expert_offsets, indices, bins) are bounded in the kernels, and invalid
    ones raise ValueError naming them on CPU tensors or with validate=True
  2 NaN in a hidden state, in router_weight, or an all -inf router_bias: ids stay in [0, E), NaN reaches the output
  3 int64 ids outside int32 are outside [0, E) with validate=False, not wrapped into it
  4 errors that name their argument
  5 forward-only v1 functions warn once when they cut a gradient
Shapes are tiny (the interpreter runs every kernel); values are compared with the float64 references.
"""

import os
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import ROOT
from helpers import DEVICE, ON_GPU, assert_close, make_weights

import moe_dispatch as md
from moe_dispatch import _checks
from moe_dispatch.reference import (fused_experts_ref, fused_moe_forward_ref, grouped_gemm_ref, moe_router_ref,
                                    unpermute_tokens_ref)

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
    w_gate, w_up, w_down = make_weights(E, H, F, torch.float32)
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
    w_gate, w_up, w_down = make_weights(E, H, F, torch.float32)
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
    w_gate, w_up, w_down = make_weights(E, H, F, torch.float32)
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
    keep = md.binned.capacity_keep_mask(ids, E, 1)
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
    naming the operator's argument."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, ids = torch.randn(T, H), _routed().cpu()
    w_gate, w_up, w_down = make_weights(E, H, F, torch.float32, device="cpu")
    weights = torch.rand(T, TOP_K)
    with pytest.raises(ValueError, match="fused_experts's x is on the CPU.*TRITON_INTERPRET=1"):
        md.fused_experts(x, torch.cat([w_gate, w_up], dim=1), w_down, ids, weights)
    with pytest.raises(ValueError, match="'s x is on the CPU"):
        md.fused_moe_forward(x, torch.randn(E, H), w_gate, w_up, w_down, E, TOP_K)
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
    monkeypatch.setattr(_checks, "_GRADIENT_WARNED", set())


def _forward_only_calls(x):
    ids = _routed()
    weights = torch.rand(T, TOP_K, device=DEVICE)
    with torch.no_grad():
        permuted, offsets, sorted_idx, restore_idx = md.permute_tokens(x, ids, E)
    permuted.requires_grad_(True)
    w = torch.randn(E, F, H, device=DEVICE, requires_grad=True)
    w_gate, w_up, w_down = (t.requires_grad_(True) for t in make_weights(E, H, F, torch.float32))
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

