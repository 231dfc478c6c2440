"""The MoE forward and the v1 functions against the float64 references, edge cases, errors and determinism."""

import pytest
import torch
from cases import FORWARD_CASES, Case
from helpers import DEVICE, ON_GPU, assert_close, make_weights, needs_gpu

import moe_dispatch as md
from moe_dispatch.dispatch import segments
from moe_dispatch.dispatch.segments import SINGLE_MAX, dispatch
from moe_dispatch.reference import (capacity_keep_mask_ref, experts_ref, expert_ffn_ref, fused_expert_ffn_ref,
                                    fused_experts_ref, fused_moe_forward_ref, grouped_gemm_ref, moe_router_ref,
                                    permute_tokens_ref, unpermute_tokens_ref)


def make_inputs(case: Case, device=DEVICE):
    x = torch.randn(case.T, case.H).to(device, case.dtype)
    router_weight = (torch.randn(case.E, case.H) * 0.5).to(device, case.dtype)
    extras = {}
    if case.router_bias:
        extras["router_bias"] = (torch.randn(case.E) * 0.1).to(device, case.dtype)
    if case.correction:
        extras["e_score_correction_bias"] = (torch.randn(case.E) * 0.1).to(device, torch.float32)
    return x, router_weight, extras


@pytest.mark.parametrize("case", FORWARD_CASES, ids=lambda c: c.id)
def test_fused_moe_forward(case, poison_empty, monkeypatch):
    if case.chunked:
        monkeypatch.setattr(segments, "SINGLE_MAX", 0)
    x, router_weight, extras = make_inputs(case)
    w_gate, w_up, w_down = make_weights(case.E, case.H, case.F, case.dtype, device=DEVICE)
    kwargs = dict(case.routing_kwargs(), **extras)
    out, ids, weights = md.fused_moe_forward(x, router_weight, w_gate, w_up, w_down, case.E, case.top_k, case.gating,
                                             **kwargs)
    ref_out, ref_ids, ref_weights = fused_moe_forward_ref(x, router_weight, w_gate, w_up, w_down, case.E, case.top_k,
                                                          case.gating, **kwargs)
    assert ids.dtype == torch.int64 and weights.dtype == case.dtype and out.dtype == case.dtype
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    assert_close(weights, ref_weights, case.dtype, "top_k_weights")
    assert_close(out, ref_out, case.dtype)


@pytest.mark.parametrize("case", FORWARD_CASES[:5], ids=lambda c: c.id)
def test_moe_router(case):
    x, router_weight, extras = make_inputs(case)
    kwargs = dict(case.routing_kwargs(), **extras)
    ids, weights, logits = md.moe_router(x, router_weight, case.top_k, case.gating, **kwargs)
    ref_ids, ref_weights, ref_logits = moe_router_ref(x, router_weight, case.top_k, case.gating, **kwargs)
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    assert logits.dtype == case.dtype
    assert_close(weights, ref_weights, case.dtype, "weights")
    assert_close(logits, ref_logits, case.dtype, "logits")


def test_router_defaults_follow_the_seed():
    """softmax weights are not renormalised by default; sigmoid weights are (w / (sum + 1e-6))."""
    x = torch.randn(12, 32, device=DEVICE)
    w = torch.randn(8, 32, device=DEVICE) * 0.01  # near-uniform scores: two of eight sum to about 1/4
    _, soft, _ = md.moe_router(x, w, 2)
    assert (soft.sum(-1) < 1 - 1e-3).all()
    _, sig, _ = md.moe_router(x, w, 2, "sigmoid")
    torch.testing.assert_close(sig.sum(-1), torch.ones(12, device=DEVICE), rtol=0, atol=1e-5)


def _routing(T, E, top_k, kind):
    if kind == "random":
        return torch.stack([torch.randperm(E)[:top_k] for _ in range(T)])
    if kind == "one-expert":  # all tokens on expert E-1 (top_k = 1)
        return torch.full((T, top_k), E - 1)
    if kind == "empty-experts":  # only experts 1 and 3 are used
        return torch.stack([torch.tensor([1, 3])[torch.randperm(2)][:top_k] for _ in range(T)])
    raise ValueError(kind)


EXPERT_CASES = [
    # (id, T, E, top_k, H, F, dtype, routing, why)
    ("one-expert", 40, 6, 1, 32, 32, torch.float32, "one-expert", "all tokens on the last expert: one long segment"),
    ("empty-experts", 30, 6, 2, 32, 32, torch.float16, "empty-experts", "experts 0, 2, 4, 5 get nothing"),
    ("int32-ids", 17, 8, 2, 48, 40, torch.float32, "random", "int32 ids and fp16 weights (any float dtype)"),
]


@pytest.mark.parametrize("case", EXPERT_CASES, ids=lambda c: c[0])
def test_fused_experts_routings(case, poison_empty):
    _, T, E, top_k, H, F, dtype, routing, _ = case
    x = torch.randn(T, H).to(DEVICE, dtype)
    ids = _routing(T, E, top_k, routing).to(DEVICE)
    if case[0] == "int32-ids":
        ids = ids.int()
    weights = torch.rand(T, top_k).to(DEVICE, torch.float16 if case[0] == "int32-ids" else torch.float32)
    w_gate_up = (torch.randn(E, 2 * F, H) * 0.1).to(DEVICE, dtype)
    w_down = (torch.randn(E, H, F) * 0.1).to(DEVICE, dtype)
    out = md.fused_experts(x, w_gate_up, w_down, ids, weights)
    assert_close(out, fused_experts_ref(x, w_gate_up, w_down, ids, weights), dtype)


def test_fused_experts_gpt_oss_layout():
    """Transposed [E, H, 2F] / [E, F, H] weights, interleaved gate/up, biases, clamped SwiGLU: no weight copies."""
    T, E, top_k, H, F = 14, 6, 3, 40, 24
    x = torch.randn(T, H, device=DEVICE)
    ids = _routing(T, E, top_k, "random").to(DEVICE)
    weights = torch.softmax(torch.randn(T, top_k), -1).to(DEVICE)
    w_gate_up = torch.randn(E, H, 2 * F, device=DEVICE) * 0.3
    w_down = torch.randn(E, F, H, device=DEVICE) * 0.3
    b1 = torch.randn(E, 2 * F, device=DEVICE)
    b2 = torch.randn(E, H, device=DEVICE)
    kwargs = dict(activation="swiglu_oai", gate_up_bias=b1, down_bias=b2, interleaved=True, transposed=True,
                  swiglu_alpha=1.702, swiglu_limit=2.0)  # a low limit so the clamps are exercised
    out = md.fused_experts(x, w_gate_up, w_down, ids, weights, **kwargs)
    assert_close(out, fused_experts_ref(x, w_gate_up, w_down, ids, weights, **kwargs), torch.float32)


def test_fused_experts_3d_and_noncontiguous():
    """[B, S, H] input keeps its shape; transposed-storage weights and strided ids/weights need no copies."""
    B, S, E, top_k, H, F = 2, 5, 4, 2, 32, 16
    x = torch.randn(B, H, S, device=DEVICE).transpose(1, 2)  # [B, S, H], non-contiguous
    ids = _routing(B * S, E, top_k, "random").to(DEVICE).t().contiguous().t()  # column-major [T, k]
    weights = torch.rand(top_k, B * S, device=DEVICE).t()
    w_gate_up = (torch.randn(E, H, 2 * F, device=DEVICE) * 0.1).transpose(1, 2)  # [E, 2F, H] view
    w_down = (torch.randn(E, F, H, device=DEVICE) * 0.1).transpose(1, 2)  # [E, H, F] view
    out = md.fused_experts(x, w_gate_up, w_down, ids, weights)
    assert out.shape == (B, S, H)
    assert_close(out, fused_experts_ref(x, w_gate_up, w_down, ids, weights), torch.float32)


def test_fused_moe_forward_3d():
    x = torch.randn(2, 3, 32, device=DEVICE)
    router_weight = torch.randn(4, 32, device=DEVICE)
    w_gate, w_up, w_down = make_weights(4, 32, 16, torch.float32, device=DEVICE)
    out, ids, weights = md.fused_moe_forward(x, router_weight, w_gate, w_up, w_down, 4, 2)
    ref_out, ref_ids, _ = fused_moe_forward_ref(x, router_weight, w_gate, w_up, w_down, 4, 2)
    assert out.shape == x.shape and ids.shape == (6, 2)
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    assert_close(out, ref_out, torch.float32)


def test_zero_tokens():
    x = torch.randn(0, 32, device=DEVICE)
    router_weight = torch.randn(4, 32, device=DEVICE)
    w_gate, w_up, w_down = make_weights(4, 32, 16, torch.float32, device=DEVICE)
    out, ids, weights = md.fused_moe_forward(x, router_weight, w_gate, w_up, w_down, 4, 2)
    assert out.shape == (0, 32) and ids.shape == (0, 2) and weights.shape == (0, 2)
    w_gate_up = torch.cat([w_gate, w_up], 1)
    empty_ids = torch.zeros(0, 2, dtype=torch.int64, device=DEVICE)
    assert md.fused_experts(x, w_gate_up, w_down, empty_ids, torch.zeros(0, 2, device=DEVICE)).shape == (0, 32)
    permuted, offsets, sorted_idx, restore_idx = md.permute_tokens(x, empty_ids, 4)
    assert permuted.shape == (0, 32) and offsets.tolist() == [0] * 5


def test_deterministic():
    """Same inputs, bit-identical outputs (no float atomics anywhere)."""
    case = FORWARD_CASES[1]
    x, router_weight, extras = make_inputs(case)
    weights = make_weights(case.E, case.H, case.F, case.dtype, device=DEVICE)
    runs = [md.fused_moe_forward(x, router_weight, *weights, case.E, case.top_k, **case.routing_kwargs())[0]
            for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


@pytest.fixture(params=["one-program", "chunked"])
def dispatch_path(request, monkeypatch):
    """Runs a dispatch test on each path: the one-program sort (N <= SINGLE_MAX) and the multi-chunk kernels (forced
    by SINGLE_MAX = 0, with the prefix kernel scanning 2 chunks at a time, so that every case walks several blocks of
    each expert's row). The one-program kernels scan their tile map 16 entries at a time here, so the scan's carries
    from one block to the next are exercised. Returns the path's name."""
    monkeypatch.setattr(segments, "BLOCK_TILES", 16)
    if request.param == "chunked":
        monkeypatch.setattr(segments, "SINGLE_MAX", 0)
        monkeypatch.setattr(segments, "BLOCK_CHUNKS", 2)
    return request.param


@pytest.mark.parametrize("T,E,top_k,kind", [(9, 5, 2, "random"), (100, 8, 3, "random"), (70, 4, 2, "empty-experts"),
                                            (SINGLE_MAX, 3, 1, "one-expert"), (SINGLE_MAX + 1, 3, 1, "one-expert"),
                                            (131, 256, 8, "random"),
                                            pytest.param(2048, 256, 8, "random", marks=needs_gpu)])
@pytest.mark.parametrize("block_m", [16, 64])
def test_dispatch_metadata(T, E, top_k, kind, block_m, dispatch_path):
    """Counts and offsets exact, gather/scatter inverse, stable order, tile map covers each row exactly once, on both
    paths (the cases past SINGLE_MAX run the chunked one either way; on the one-program fixture the largest runs it
    with the default dispatch.segments.BLOCK_CHUNKS).

    The largest case, DeepSeek's E = 256 at top-8, is sized by what it checks, not by a real batch: N = 131 * 8 = 1048
    > SINGLE_MAX, so it is chunked on both fixtures; 9 chunks of CHUNK = 128, the last one partial (24 assignments,
    masked loads); with BLOCK_CHUNKS = 2 each of the 256 experts' prefix rows is scanned in 5 blocks (the carry
    crosses 4 block edges, the last block half masked), and most experts get rows in a few chunks and none in the rest.
    The prefix kernel's interpreted work grows with E x N / (CHUNK x BLOCK_CHUNKS): T = 2048 (128 chunks, 64 prefix
    blocks) took 80 s a case there for no further branch, so that batch runs on a GPU only."""
    ids = _routing(T, E, top_k, kind).to(DEVICE)
    info = dispatch(ids, E, block_m)
    _, ref_offsets, ref_sorted, ref_restore = permute_tokens_ref(torch.zeros(T, 1), ids.cpu(), E)
    assert torch.equal(info.expert_offsets.long().cpu(), ref_offsets)
    assert torch.equal(info.gather_idx.long().cpu(), ref_sorted)
    assert torch.equal(info.scatter_idx.long().cpu(), ref_restore)
    assert info.expert_offsets[-1].item() == T * top_k
    _check_tile_map(info, ids, E, block_m)


def _check_tile_map(info, ids, num_experts, block_m):
    """Every kept sorted row is in exactly one tile, each tile inside one expert's segment; unused tiles are -1 and
    come after the used ones. Returns the number of tiles used."""
    flat = ids.reshape(-1).cpu().long()
    kept = flat[(flat >= 0) & (flat < num_experts)]
    counts = torch.bincount(kept, minlength=num_experts)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    tile_expert, tile_start = info.tile_expert.cpu().long(), info.tile_row_start.cpu().long()
    covered = torch.zeros(kept.numel(), dtype=torch.int64)
    for e, start in zip(tile_expert.tolist(), tile_start.tolist()):
        if e < 0:
            continue
        assert 0 <= e < num_experts and offsets[e] <= start < offsets[e + 1], (e, start)
        covered[start:min(start + block_m, offsets[e + 1].item())] += 1
    assert torch.equal(covered, torch.ones_like(covered)), "a kept row is in no tile or in two"
    used = (tile_expert >= 0).sum().item()
    assert (tile_expert[used:] == -1).all() and (tile_expert[:used] >= 0).all()
    return used


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("kind", ["worst-case", "worst-case-with-sentinels", "one-expert", "all-sentinels"])
def test_dispatch_tile_map_adversarial(kind, block_m, dispatch_path):
    """Routings that need the most tiles (every expert one row past a tile edge), with expert-parallel sentinels
    mixed in, on one expert, or nothing kept: the static tile map still covers every kept row exactly once."""
    E = 5
    if kind.startswith("worst-case"):  # each expert gets block_m + 1 rows: 2 tiles each, one of them a single row
        ids = torch.arange(E).repeat_interleave(block_m + 1)[torch.randperm(E * (block_m + 1))].view(-1, 1)
        if kind == "worst-case-with-sentinels":
            ids = torch.cat([ids, torch.full_like(ids, E + 3)], dim=1)  # top_k = 2, every second id dropped
            ids[::4, 1] = -1
    elif kind == "one-expert":
        ids = torch.full((3 * block_m + 1, 2), 2)
    else:
        ids = torch.full((block_m + 3, 2), E)
    info = dispatch(ids.to(DEVICE), E, block_m)
    used = _check_tile_map(info, ids, E, block_m)
    if kind.startswith("worst-case"):
        assert used == 2 * E
    elif kind == "all-sentinels":
        assert used == 0 and info.expert_offsets[-1].item() == 0


def test_dispatch_drops_out_of_range_ids(dispatch_path):
    """Expert-parallel sentinels (ids >= E) and negative ids get no position and contribute nothing."""
    T, E, top_k, H, F = 20, 4, 2, 32, 16
    ids = _routing(T, E, top_k, "random")
    ids[::3, 0] = E + 2
    ids[1, 1] = -1
    info = dispatch(ids.to(DEVICE), E, 16)
    dropped = (ids.reshape(-1) < 0) | (ids.reshape(-1) >= E)
    assert info.expert_offsets[-1].item() == (~dropped).sum().item()
    assert (info.scatter_idx.cpu()[dropped] == -1).all()
    assert (info.gather_idx.cpu()[(~dropped).sum():] == -1).all()
    x = torch.randn(T, H, device=DEVICE)
    weights = torch.rand(T, top_k, device=DEVICE)
    w_gate_up, w_down = torch.randn(E, 2 * F, H, device=DEVICE) * 0.1, torch.randn(E, H, F, device=DEVICE) * 0.1
    out = md.fused_experts(x, w_gate_up, w_down, ids.to(DEVICE), weights, validate=False)
    keep = (~dropped).reshape(T, top_k).to(DEVICE)
    ref = fused_experts_ref(x, w_gate_up, w_down, torch.where(keep, ids.to(DEVICE), 0), weights * keep)
    assert_close(out, ref, torch.float32)


def test_v1_permute_unpermute_roundtrip():
    T, E, top_k, H = 45, 6, 3, 40
    x = torch.randn(T, H, device=DEVICE)
    ids = _routing(T, E, top_k, "random").to(DEVICE)
    weights = torch.rand(T, top_k, device=DEVICE)
    permuted, offsets, sorted_idx, restore_idx = md.permute_tokens(x, ids, E)
    ref_permuted, ref_offsets, ref_sorted, ref_restore = permute_tokens_ref(x, ids, E)
    assert offsets.dtype == sorted_idx.dtype == restore_idx.dtype == torch.int64
    assert torch.equal(offsets.cpu(), ref_offsets.cpu()) and torch.equal(sorted_idx.cpu(), ref_sorted.cpu())
    assert torch.equal(restore_idx.cpu(), ref_restore.cpu())
    assert torch.equal(permuted.cpu(), ref_permuted.float().cpu())
    out = md.unpermute_tokens(permuted, weights, restore_idx, T, top_k)
    assert_close(out, unpermute_tokens_ref(ref_permuted, weights, ref_restore, T, top_k), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_v1_segment_functions(dtype):
    """grouped_gemm, expert_ffn_triton, fused_expert_ffn on permute_tokens' output, ragged sizes."""
    T, E, top_k, H, F = 23, 5, 2, 36, 20
    x = torch.randn(T, H).to(DEVICE, dtype)
    ids = _routing(T, E, top_k, "random").to(DEVICE)
    ids[ids == 2] = 3  # expert 2 empty
    weights = torch.rand(T, top_k).to(DEVICE, dtype)
    permuted, offsets, sorted_idx, _ = md.permute_tokens(x, ids, E)
    w = (torch.randn(E, F, H) * 0.1).to(DEVICE, dtype)
    assert_close(md.grouped_gemm(permuted, w, offsets, E), grouped_gemm_ref(permuted, w, offsets, E), dtype)
    w_gate, w_up, w_down = make_weights(E, H, F, dtype, device=DEVICE)
    assert_close(md.expert_ffn_triton(permuted, w_gate, w_up, w_down, offsets, E),
                 expert_ffn_ref(permuted, w_gate, w_up, w_down, offsets, E), dtype)
    args = (permuted, w_gate, w_up, w_down, offsets, E, weights, sorted_idx, T, top_k)
    assert_close(md.fused_expert_ffn(*args), fused_expert_ffn_ref(*args), dtype)


def _valid_forward_args():
    E, H, F = 4, 32, 16
    x = torch.randn(5, H)
    router_weight = torch.randn(E, H)
    w_gate, w_up, w_down = torch.randn(E, F, H), torch.randn(E, F, H), torch.randn(E, H, F)
    return dict(hidden_states=x, router_weight=router_weight, w_gate=w_gate, w_up=w_up, w_down=w_down,
                num_experts=E, top_k=2)


def _valid_experts_args():
    E, H, F = 4, 32, 16
    return dict(hidden_states=torch.randn(5, H), w_gate_up=torch.randn(E, 2 * F, H), w_down=torch.randn(E, H, F),
                topk_ids=torch.randint(0, E, (5, 2)), topk_weights=torch.rand(5, 2))


def _on_device(args):
    """The cases' tensors (built at collection, on the CPU) on the suite's device; a meta tensor stays on meta."""
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) and not v.is_meta else v for k, v in args.items()}


FORWARD_ERRORS = [
    # (change, exception, argument named in the message)
    (dict(hidden_states=torch.randint(0, 3, (5, 32))), TypeError, "hidden_states"),
    (dict(router_weight=torch.randn(4, 32, 1)), ValueError, "router_weight"),
    (dict(router_weight=torch.randn(4, 31)), ValueError, "router_weight"),
    (dict(w_gate=torch.randn(3, 16, 32)), ValueError, "w_gate"),
    (dict(w_up=torch.randn(4, 8, 32)), ValueError, "w_up"),
    (dict(w_down=torch.randn(4, 32, 8)), ValueError, "w_down"),
    (dict(w_down=torch.randn(4, 32, 16, dtype=torch.float64)), TypeError, "w_down"),
    (dict(w_gate=torch.randn(4, 16, 32, device="meta")), ValueError, "device"),
    (dict(top_k=0), ValueError, "top_k"),
    (dict(top_k=5), ValueError, "top_k"),
    (dict(num_experts=5), ValueError, "num_experts"),
    (dict(gating="relu"), ValueError, "gating"),
    (dict(n_group=3), ValueError, "n_group"),
    (dict(n_group=2, topk_group=3), ValueError, "topk_group"),
    (dict(router_bias=torch.randn(5)), ValueError, "router_bias"),
]


@pytest.mark.parametrize("change,exc,name", FORWARD_ERRORS, ids=lambda v: str(v)[:40] if isinstance(v, dict) else None)
def test_fused_moe_forward_errors(change, exc, name):
    args = _on_device(dict(_valid_forward_args(), **change))
    with pytest.raises(exc, match=name):
        md.fused_moe_forward(**args)


EXPERTS_ERRORS = [
    (dict(topk_ids=torch.tensor([[0, 4]] * 5), validate=True), ValueError, "topk_ids"),
    (dict(topk_ids=torch.tensor([[0, -1]] * 5), validate=True), ValueError, "topk_ids"),
    (dict(topk_ids=torch.rand(5, 2)), TypeError, "topk_ids"),
    (dict(topk_ids=torch.randint(0, 4, (6, 2))), ValueError, "topk_ids"),
    (dict(topk_weights=torch.rand(5, 3)), ValueError, "topk_weights"),
    (dict(w_gate_up=torch.randn(4, 33, 32)), ValueError, "w_gate_up"),
    (dict(w_gate_up=torch.randn(4, 32, 31)), ValueError, "w_gate_up"),
    (dict(w_down=torch.randn(5, 32, 16)), ValueError, "w_down"),
    (dict(activation="gelu"), ValueError, "activation"),
    (dict(gate_up_bias=torch.randn(4, 31)), ValueError, "gate_up_bias"),
    (dict(down_bias=torch.randn(3, 32)), ValueError, "down_bias"),
]


@pytest.mark.parametrize("change,exc,name", EXPERTS_ERRORS, ids=lambda v: str(v)[:40] if isinstance(v, dict) else None)
def test_fused_experts_errors(change, exc, name):
    args = _on_device(dict(_valid_experts_args(), **change))
    with pytest.raises(exc, match=name):
        md.fused_experts(**args)


def test_v1_function_errors():
    x = torch.randn(6, 8)
    with pytest.raises(ValueError, match="top_k_indices"):
        md.permute_tokens(x, torch.randint(0, 3, (5, 2)), 3)
    with pytest.raises(ValueError, match="top_k_indices"):
        md.permute_tokens(x, torch.full((6, 2), 3), 3)
    with pytest.raises(ValueError, match="expert_offsets"):
        md.grouped_gemm(x, torch.randn(3, 4, 8), torch.tensor([0, 4, 2, 6]), 3)
    with pytest.raises(ValueError, match="expert_offsets"):
        md.grouped_gemm(x, torch.randn(3, 4, 8), torch.tensor([0, 6]), 3)
    with pytest.raises(ValueError, match="weights"):
        md.grouped_gemm(x, torch.randn(3, 4, 9), torch.tensor([0, 2, 4, 6]), 3)
    with pytest.raises(ValueError, match="restore_idx"):
        md.unpermute_tokens(x, torch.rand(3, 2), torch.arange(5), 3, 2)
    with pytest.raises(ValueError, match="top_k_weights"):
        md.unpermute_tokens(x, torch.rand(3, 3), torch.arange(6), 3, 2)


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 4.0])
def test_fused_moe_forward_capacity(capacity_factor):
    """capacity_factor drops exactly MegaBlocks' overflow: C = int(cf * T * k / E), earliest assignments kept."""
    T, E, top_k, H, F = 40, 4, 2, 32, 16
    x = torch.randn(T, H, device=DEVICE)
    router_weight = torch.randn(E, H, device=DEVICE)
    router_weight[0] += 0.5 * x.mean(0)  # skew the routing so expert 0 overflows
    w_gate, w_up, w_down = make_weights(E, H, F, torch.float32, device=DEVICE)
    out, ids, weights = md.fused_moe_forward(x, router_weight, w_gate, w_up, w_down, E, top_k,
                                             capacity_factor=capacity_factor)
    capacity = int(capacity_factor * T * top_k / E)
    keep = capacity_keep_mask_ref(ids, E, capacity)
    if capacity_factor == 0.5:
        assert not keep.all(), "the case must overflow some expert"
    ref = experts_ref(x, w_gate, w_up, w_down, ids, weights.float() * keep)
    assert_close(out, ref, torch.float32)


def test_validate_ids_is_a_deprecated_spelling_of_validate():
    """v1.0 callers' `validate_ids=` keeps working (same meaning) with a DeprecationWarning; a disagreeing pair is
    refused."""
    x = torch.randn(3, 8, device=DEVICE)
    w_gate_up, w_down = torch.randn(2, 8, 8, device=DEVICE), torch.randn(2, 8, 4, device=DEVICE)
    ids, weights = torch.tensor([[0], [1], [5]], device=DEVICE), torch.rand(3, 1, device=DEVICE)
    with pytest.warns(DeprecationWarning, match="validate_ids"), pytest.raises(ValueError, match="topk_ids"):
        md.fused_experts(x, w_gate_up, w_down, ids, weights, validate_ids=True)
    with pytest.warns(DeprecationWarning, match="validate_ids"):
        out = md.permute_tokens(x, ids, 2, validate_ids=False)[0]
    assert out.shape == (3, 8)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="disagree"):
        md.fused_experts(x, w_gate_up, w_down, ids, weights, validate=False, validate_ids=True)



@pytest.mark.skipif(ON_GPU, reason="the interpreter's strictness (tests/conftest.py); a GPU launch raises by itself")
def test_launch_with_an_undeclared_keyword_fails_as_on_a_gpu():
    """tests/conftest.py makes the interpreter refuse a launch keyword that is neither a kernel parameter nor a GPU
    compile option, as a GPU does (the PDL flag once reached a kernel that did not declare it)."""
    from moe_dispatch.dispatch.combine import _combine_kernel

    y = torch.zeros(2, 4, device=DEVICE)
    row_idx = torch.arange(2, dtype=torch.int32, device=DEVICE)
    out = torch.empty(2, 4, device=DEVICE)
    args = (y, row_idx, y, out, 2, 4, 2, 4, 0, 0, 4)
    meta = dict(TOP_K=1, HAS_WEIGHTS=False, BLOCK_T=2, BLOCK_H=4, PDL=False, num_warps=4)
    _combine_kernel[(1, 1)](*args, **meta)
    assert torch.equal(out, y)
    with pytest.raises(TypeError, match="UNDECLARED"):
        _combine_kernel[(1, 1)](*args, UNDECLARED=1, **meta)
