"""Expert parallelism (parallel/expert_parallel.py) on the CPU: gloo process groups of 2 and 4 ranks, Triton's
interpreter.

One spawn per world size runs every case of that size (each spawned rank imports torch and triton once, the slow
part). Every rank builds the same global problem from the case's seed (all ranks' tokens, all E experts), runs
`ep_fused_experts` on its own tokens with its shard of the experts, then forward and backward of the single-process
experts with all experts on all tokens, in float64 autograd of moe_dispatch.reference.fused_experts_ref (plain
torch: the single-process kernels, which tests/test_backward.py holds to that reference, took half of each rank's
interpreter time here), and compares its slice: the output rows of its tokens and the gradients of its
hidden_states, its topk_weights and its rows of every expert weight and bias. Capacity cases compare with the
single-process run on ids masked by `ep_capacity_keep_ref` (moe_dispatch.reference, the rule written out in Python),
and their drop statistics exactly. A rank collects its failures and raises them together at the end, so mp.spawn
fails with every message. The in-process tests cover one rank, the plan's integers, the packed exchange buffer, the
number of collectives, the capacity formula and bad inputs.
"""

import dataclasses
import datetime
import os
import re
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import DEVICE, assert_close, needs_interpreter

import moe_dispatch as md
from moe_dispatch.parallel.ep_plan import count_rows
from moe_dispatch.parallel.expert_parallel import (ExpertParallelExperts, ExpertParallelStats, _Dispatch, _new_packed,
                                          _packing, _plan, _plan_from_counts, _token_rows, _unpack, ep_capacity,
                                          ep_fused_experts)
from moe_dispatch.reference import capacity_keep_mask_ref, ep_capacity_keep_ref, ep_plan_ref, fused_experts_ref

H, F, E_LOCAL = 16, 8, 2


@dataclasses.dataclass(frozen=True)
class EpCase:
    id: str
    why: str
    tokens: tuple  # T of each rank
    top_k: int = 2
    routing: str = "random"  # "random": distinct experts per token; "skewed": every token on rank 0's experts
    gpt_oss: bool = False  # transposed [E, H, 2F] / [E, F, H], interleaved gate/up, biases, clamped SwiGLU
    capacity_factor: float | None = None
    max_tokens_per_rank: int | None = None
    rerun: bool = False  # run twice: outputs and gradients bit-equal


CASES = {
    2: [
        EpCase("dropless-unequal-T", "T differs per rank (7, 5): split sizes differ both ways; rows deduplicated",
               (7, 5), rerun=True),
        EpCase("skewed", "every token on rank 0's experts: rank 1 receives no rows (T = 0 experts call)", (6, 6),
               routing="skewed"),
        EpCase("zero-tokens", "rank 1 has no tokens but still holds experts and receives rows", (9, 0)),
        EpCase("gpt-oss", "GPT-OSS layout: transposed, interleaved, both biases, swiglu_oai; k = 3", (5, 6),
               top_k=3, gpt_oss=True),
        EpCase("capacity", "C = int(0.5 * 8 * 2 / 2) = 4 rows per rank pair: drops; padded rows are sentinels",
               (8, 8), capacity_factor=0.5, rerun=True),
        EpCase("capacity-max-tokens", "unequal T with max_tokens_per_rank = 10 fixing C = 5 on both ranks",
               (10, 6), capacity_factor=0.5, max_tokens_per_rank=10),
    ],
    4: [
        EpCase("dropless-k3", "k = 3 over 4 ranks: a token reaches up to three ranks, summed in rank order",
               (6, 5, 0, 7), top_k=3),
        EpCase("capacity", "C = int(0.75 * 6 * 2 / 4) = 2 per pair, skew-free routing still overflows", (6, 6, 6, 6),
               capacity_factor=0.75),
        EpCase("skewed-gpt-oss", "everything to rank 0, GPT-OSS variant: three ranks idle", (4, 5, 3, 4),
               routing="skewed", gpt_oss=True),
    ],
}


def _problem(case, world_size):
    """The global problem every rank rebuilds from the case id: all tokens, all E experts, the upstream gradient."""
    g = torch.Generator().manual_seed(sum(map(ord, case.id)) + world_size)
    E = E_LOCAL * world_size
    T_all = sum(case.tokens)
    x = torch.randn(T_all, H, generator=g)
    if case.routing == "skewed":
        ids = torch.rand(T_all, E_LOCAL, generator=g).argsort(dim=1)[:, :case.top_k]
    else:
        ids = torch.rand(T_all, E, generator=g).argsort(dim=1)[:, :case.top_k]
    weights = torch.rand(T_all, case.top_k, generator=g)
    gate_up_shape, down_shape = ((E, H, 2 * F), (E, F, H)) if case.gpt_oss else ((E, 2 * F, H), (E, H, F))
    w_gate_up = torch.randn(gate_up_shape, generator=g) * 0.2
    w_down = torch.randn(down_shape, generator=g) * 0.2
    biases = (torch.randn(E, 2 * F, generator=g) * 0.1, torch.randn(E, H, generator=g) * 0.1) if case.gpt_oss else (
        None, None)
    grad_out = torch.randn(T_all, H, generator=g)
    return x, ids, weights, w_gate_up, w_down, biases, grad_out


def _options(case):
    if case.gpt_oss:
        return dict(activation="swiglu_oai", interleaved=True, transposed=True, swiglu_limit=1.5)
    return {}


def _capacity(case, world_size):
    if case.capacity_factor is None:
        return None
    return ep_capacity(case.max_tokens_per_rank or case.tokens[0], case.top_k, world_size, case.capacity_factor)


def _kept_ids(case, world_size, ids):
    """Global ids with the assignments the capacity rule drops (per source rank) replaced by E."""
    capacity = _capacity(case, world_size)
    if capacity is None:
        return ids, torch.ones_like(ids, dtype=torch.bool)
    kept, start = [], 0
    for T in case.tokens:
        kept.append(ep_capacity_keep_ref(ids[start:start + T], E_LOCAL, world_size, capacity))
        start += T
    keep = torch.cat(kept)
    return torch.where(keep, ids, E_LOCAL * world_size), keep


def _dropped_rows_ref(ids, keep, world_size):
    """Per destination: rows a token wanted (an expert there) minus rows it kept (a kept assignment there)."""
    rank = ids // E_LOCAL
    wanted = torch.stack([(rank == d).any(1) for d in range(world_size)], 1).sum(0)
    kept = torch.stack([((rank == d) & keep).any(1) for d in range(world_size)], 1).sum(0)
    return wanted, wanted - kept


def _leaf(t):
    return None if t is None else t.clone().requires_grad_()


def _run_ep(case, rank, world_size, problem):
    x, ids, weights, w_gate_up, w_down, (gate_up_bias, down_bias), grad_out = problem
    start = sum(case.tokens[:rank])
    mine = slice(start, start + case.tokens[rank])
    shard = slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
    leaves = [_leaf(t) for t in (x[mine], weights[mine], w_gate_up[shard], w_down[shard],
                                  None if gate_up_bias is None else gate_up_bias[shard],
                                  None if down_bias is None else down_bias[shard])]
    x_r, weights_r, w_gate_up_r, w_down_r, gate_up_bias_r, down_bias_r = leaves
    out, stats = ep_fused_experts(x_r, w_gate_up_r, w_down_r, ids[mine], weights_r,
                                  capacity_factor=case.capacity_factor, max_tokens_per_rank=case.max_tokens_per_rank,
                                  gate_up_bias_local=gate_up_bias_r, down_bias_local=down_bias_r,
                                  num_experts=E_LOCAL * world_size, return_stats=True, **_options(case))
    (out * grad_out[mine]).sum().backward()
    grads = [t.grad if t is not None else None for t in leaves]
    return out.detach(), grads, stats


def _run_reference(case, world_size, problem):
    """The single-process experts with all experts on all tokens (capacity drops applied to the ids), in float64
    autograd of the reference."""
    x, ids, weights, w_gate_up, w_down, (gate_up_bias, down_bias), grad_out = problem
    kept_ids, keep = _kept_ids(case, world_size, ids)
    leaves = [_leaf(t.double()) if t is not None else None
              for t in (x, weights, w_gate_up, w_down, gate_up_bias, down_bias)]
    x_all, weights_all, w_gate_up_all, w_down_all, gate_up_bias_all, down_bias_all = leaves
    out = fused_experts_ref(x_all, w_gate_up_all, w_down_all, kept_ids, weights_all, gate_up_bias=gate_up_bias_all,
                            down_bias=down_bias_all, **_options(case))
    (out * grad_out.double()).sum().backward()
    return out.detach(), [t.grad if t is not None else None for t in leaves], kept_ids, keep


def _check_case(case, rank, world_size, group):
    problem = _problem(case, world_size)
    x, ids, weights, w_gate_up, w_down = problem[:5]
    start = sum(case.tokens[:rank])
    mine = slice(start, start + case.tokens[rank])
    shard = slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
    # Every collective first, on every rank, so a failed comparison cannot leave the ranks out of step.
    out, grads, stats = _run_ep(case, rank, world_size, problem)
    again = _run_ep(case, rank, world_size, problem) if case.rerun else None
    layer_out = None
    if case.routing == "random" and not case.gpt_oss and case.capacity_factor is None:
        layer = ExpertParallelExperts.from_experts(w_gate_up, w_down, group)
        layer_out = layer(x[mine], ids[mine], weights[mine]).detach()

    if again is not None:
        assert torch.equal(out, again[0]), "rerun: output not bit-equal"
        for name, a, b in zip(("x", "topk_weights", "w_gate_up", "w_down"), grads, again[1]):
            assert torch.equal(a, b), f"rerun: gradient of {name} not bit-equal"
    ref_out, ref_grads, kept_ids, keep = _run_reference(case, world_size, problem)
    assert_close(out, ref_out[mine], torch.float32, "output")
    names = ("hidden_states", "topk_weights", "w_gate_up_local", "w_down_local", "gate_up_bias_local",
             "down_bias_local")
    for i, (name, grad, ref) in enumerate(zip(names, grads, ref_grads)):
        if ref is not None:
            assert_close(grad, ref[mine] if i < 2 else ref[shard], torch.float32, f"gradient of {name}",
                         exact_zeros=i == 1)
    wanted, dropped = _dropped_rows_ref(ids[mine], keep[mine], world_size)
    assert torch.equal(stats.wanted_rows, wanted), f"wanted rows {stats.wanted_rows.tolist()} != {wanted.tolist()}"
    assert torch.equal(stats.dropped_rows, dropped), f"dropped rows {stats.dropped_rows.tolist()} != {dropped.tolist()}"
    if case.capacity_factor is not None:
        assert (kept_ids != ids).any(), "the capacity case should drop something somewhere"
    if layer_out is not None:
        assert torch.equal(layer_out, out), "ExpertParallelExperts.from_experts differs from ep_fused_experts"


def _worker(rank, world_size, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    failures = []
    try:
        group = dist.group.WORLD
        for case in CASES[world_size]:
            try:
                _check_case(case, rank, world_size, group)
            except AssertionError as error:
                failures.append(f"rank {rank} case {case.id} ({case.why}): {error}")
        if world_size == 4:
            # Bad input raises on every rank before any collective.
            weights = torch.zeros(3, 2 * F, H), torch.zeros(3, H, F)
            try:
                ExpertParallelExperts.from_experts(*weights)
                failures.append(f"rank {rank}: from_experts accepted E = 3 over 4 ranks")
            except ValueError as error:
                if "not divisible by the group size 4" not in str(error):
                    failures.append(f"rank {rank}: from_experts error {error}")
            try:
                ep_fused_experts(torch.zeros(2, H), *[w[:2] for w in weights], torch.zeros(2, 1, dtype=torch.long),
                                 torch.ones(2, 1), num_experts=6)
                failures.append(f"rank {rank}: num_experts=6 accepted with 2 experts on each of 4 ranks")
            except ValueError as error:
                if "num_experts=6" not in str(error):
                    failures.append(f"rank {rank}: num_experts error {error}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if failures:
        raise AssertionError("\n".join(failures))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_interpreter
@pytest.mark.parametrize("world_size", sorted(CASES))
def test_expert_parallel_gloo(world_size, monkeypatch):
    """Every case of CASES[world_size] in one spawn of world_size gloo ranks (see the module docstring)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the children run the kernels on the CPU too
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(world_size, _free_port()), nprocs=world_size, join=True,
             start_method="spawn")


# In-process: one rank, the plan, the capacity rule, bad inputs.

T, TOP_K, E = 7, 2, 4


def _inputs(E=E, T=T, top_k=TOP_K):
    x = torch.randn(T, H, requires_grad=True)
    w_gate_up = (torch.randn(E, 2 * F, H) * 0.2).requires_grad_()
    w_down = (torch.randn(E, H, F) * 0.2).requires_grad_()
    ids = torch.rand(T, E).argsort(dim=1)[:, :top_k]
    return x, w_gate_up, w_down, ids, torch.rand(T, top_k, requires_grad=True)


@needs_interpreter
def test_one_rank_falls_back_to_fused_experts():
    """No process group: dropless is fused_experts itself (bit-equal); capacity drops by the same rule with W = 1."""
    assert not dist.is_initialized()
    x, w_gate_up, w_down, ids, weights = _inputs()
    out, stats = ep_fused_experts(x, w_gate_up, w_down, ids, weights, return_stats=True)
    assert torch.equal(out, md.fused_experts(x, w_gate_up, w_down, ids, weights))
    assert stats.wanted_rows.tolist() == [T] and stats.dropped_rows.tolist() == [0]
    capacity = ep_capacity(T, TOP_K, 1, 0.3)  # int(0.3 * 7 * 2) = 4 of the 7 tokens
    assert capacity == 4
    out, stats = ep_fused_experts(x, w_gate_up, w_down, ids, weights, capacity_factor=0.3, return_stats=True)
    kept_ids = torch.where(ep_capacity_keep_ref(ids, E, 1, capacity), ids, E)
    assert_close(out, md.fused_experts(x, w_gate_up, w_down, kept_ids, weights, validate=False), torch.float32,
                 exact_zeros=True)
    assert stats.dropped_rows.tolist() == [T - capacity]
    out.sum().backward()
    assert torch.equal(weights.grad[capacity:], torch.zeros(T - capacity, TOP_K)), "dropped tokens get no gradient"


def test_plan_dedups_rows_and_pads_capacity_slots():
    """Capacity-mode plan (no communication) for W = 3, E_local = 2, C = 2, integers exact."""
    ids = torch.tensor([[0, 1], [2, 5], [5, 4], [1, 0], [3, 9]], device=DEVICE)  # 9 is outside [0, 6): no rank
    plan = _plan(ids, 3, 2, 2, None)
    # rank 0: tokens 0, 3 (each once, though both have two experts there); rank 1: tokens 1, 4; rank 2: 1, 2
    assert plan.slot_token.tolist() == [0, 3, 1, 4, 1, 2]
    assert plan.slot_local_ids.tolist() == [[0, 1], [1, 0], [0, 2], [1, 2], [2, 1], [1, 0]]
    pad = 6  # no slot
    assert plan.token_slots.tolist() == [[0, 2, 5, 1, 3], [pad, 4, pad, pad, pad]]
    assert plan.stats.wanted_rows.tolist() == [2, 2, 2] and plan.stats.dropped_rows.tolist() == [0, 0, 0]
    plan = _plan(ids, 3, 2, 1, None)  # C = 1: the earliest token per destination
    assert plan.slot_token.tolist() == [0, 1, 1] and plan.stats.dropped_rows.tolist() == [1, 1, 1]
    assert plan.token_slots.tolist() == [[0, 1, 3, 3, 3], [3, 2, 3, 3, 3]]  # token 1: ranks 1 and 2


@dataclasses.dataclass(frozen=True)
class PlanCase:
    id: str
    why: str
    world_size: int
    experts_per_rank: int
    top_k: int
    tokens: int
    capacity: int | None = None  # None: dropless
    routing: str = "random"  # "random": distinct ids in [0, E); "outside": some ids < 0 or >= E; "one-rank": all on 0


# parallel/ep_plan.py chunks tokens by 16 under the interpreter: T = 33 is three chunks, the last one partial.
PLAN_CASES = [
    PlanCase("w1-dropless", "one rank: every pair on rank 0, slots in token order", 1, 3, 2, 7),
    PlanCase("w1-capacity", "one rank, C = 3 < T: the tail dropped, no padding", 1, 2, 1, 7, capacity=3),
    PlanCase("w2-dropless-k1", "top_k = 1: one destination per token, R = 1", 2, 1, 1, 7),
    PlanCase("w2-dropless-chunks", "T = 33: the running position carries over three chunks", 2, 3, 2, 33),
    PlanCase("w3-k4-dropless", "top_k = 4 > W = 3: R = W, dedup of several experts per rank", 3, 2, 4, 33),
    PlanCase("w3-capacity-c1", "C = 1: only the earliest token per destination, the rest dropped", 3, 2, 2, 7,
             capacity=1),
    PlanCase("w3-capacity-mid", "C = 5 between: drops on some ranks, padding on others", 3, 2, 2, 33, capacity=5),
    PlanCase("w5-capacity-ct", "C = T: nothing dropped, every segment padded past its rows", 5, 1, 2, 7, capacity=7),
    PlanCase("w5-k4-chunks", "W = 5 (not a power of two), k = 4, three chunks", 5, 3, 4, 33),
    PlanCase("outside-dropless", "negative and too-large ids are on no rank", 3, 2, 2, 33, routing="outside"),
    PlanCase("outside-capacity", "ids outside [0, E) neither count towards C nor take a slot", 2, 3, 4, 33,
             capacity=6, routing="outside"),
    PlanCase("one-rank-capacity", "all tokens on rank 0: it drops past C, the others are all padding", 3, 2, 2, 33,
             capacity=4, routing="one-rank"),
    PlanCase("one-rank-dropless", "all tokens on rank 0: the others get no slot", 5, 2, 2, 7, routing="one-rank"),
    PlanCase("empty-dropless", "T = 0: no launch, empty outputs", 3, 2, 2, 0),
    PlanCase("empty-capacity", "T = 0 with C > 0 (max_tokens_per_rank): every slot padding", 2, 2, 2, 0,
             capacity=3),
    PlanCase("single-token", "T = 1 over five ranks", 5, 1, 4, 1, capacity=1),
]


def _plan_ids(case):
    g = torch.Generator().manual_seed(sum(map(ord, case.id)))
    E = case.world_size * case.experts_per_rank
    T, k = case.tokens, case.top_k
    if case.routing == "one-rank":
        return torch.randint(0, case.experts_per_rank, (T, k), generator=g)
    if case.routing == "outside":
        return torch.randint(-3, E + 3, (T, k), generator=g)  # repeats too: a token may name an expert twice
    return torch.rand(T, max(E, k), generator=g).argsort(dim=1)[:, :k] % E  # k > E repeats ids


def _received_counts(case):
    """What a counts exchange could return: any W non-negative counts (they only size the receive side)."""
    return torch.arange(case.world_size, dtype=torch.int64) * 3 % 5


@pytest.mark.parametrize("case", PLAN_CASES, ids=lambda case: case.id)
def test_plan_kernels_match_reference(case, poison_empty):
    """parallel/ep_plan.py's kernels give exactly the reference plan: every field and the stats, integers equal (outputs
    start poisoned, so an element no kernel writes shows)."""
    ids = _plan_ids(case).to(DEVICE)
    W, E_local = case.world_size, case.experts_per_rank
    recv = None
    if case.capacity is None:
        counts = count_rows(ids, W, E_local)
        recv = _received_counts(case).to(DEVICE)
        counts[W:] = recv  # as if exchanged
        plan = _plan_from_counts(ids, W, E_local, None, counts)
    else:
        plan = _plan(ids, W, E_local, case.capacity, None)
    ref = ep_plan_ref(ids, W, E_local, case.capacity, recv_counts=recv)
    for name in ("slot_token", "slot_local_ids", "token_slots"):
        got, want = getattr(plan, name), ref[name]
        assert got.dtype == want.dtype and torch.equal(got, want), f"{name}: {got.tolist()} != {want.tolist()}"
    for name in ("wanted_rows", "dropped_rows"):
        got, want = getattr(plan.stats, name), ref[name]
        assert got.dtype == torch.int64 and torch.equal(got, want), f"{name}: {got.tolist()} != {want.tolist()}"
    for name in ("send_sizes", "recv_sizes", "num_recv", "padded"):
        assert getattr(plan, name) == ref[name], name


def test_plan_reference_on_a_worked_example():
    """The reference's own integers on a small case, so the kernels are not checked against a wrong model."""
    ids = torch.tensor([[0, 1], [2, 5], [5, 4], [1, 0], [3, -1]])  # -1: no rank
    ref = ep_plan_ref(ids, 3, 2, None, recv_counts=torch.tensor([1, 0, 4]))
    assert ref["slot_token"].tolist() == [0, 3, 1, 4, 1, 2] and ref["send_sizes"] == [2, 2, 2]
    assert ref["recv_sizes"] == [1, 0, 4] and ref["num_recv"] == 5 and not ref["padded"]
    assert ref["token_slots"].tolist() == [[0, 2, 5, 1, 3], [6, 4, 6, 6, 6]]
    ref = ep_plan_ref(ids, 3, 2, 3)  # C = 3: one unused slot per destination
    assert ref["slot_token"].tolist() == [0, 3, 5, 1, 4, 5, 1, 2, 5]
    assert ref["slot_local_ids"][2].tolist() == [2, 2] and ref["dropped_rows"].tolist() == [0, 0, 0]


def test_capacity_plan_reads_nothing_on_the_host(monkeypatch):
    """Capacity mode: no device-to-host read (no tolist, item, bool or int of a tensor); dropless: exactly one."""
    reads = []

    def counted(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            reads.append(name)
            return original(self, *args, **kwargs)
        return read

    ids = torch.tensor([[0, 1], [2, 5], [5, 4], [1, 0], [3, 9]], device=DEVICE)
    counts = count_rows(ids, 3, 2)
    counts[3:] = torch.tensor([1, 2, 3], device=DEVICE)
    for name in ("tolist", "item", "__bool__", "__int__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    plan = _plan(ids, 3, 2, 2, None)
    assert reads == [], f"capacity mode read {reads} on the host"
    _plan_from_counts(ids, 3, 2, None, counts)
    assert reads == ["tolist"], f"dropless mode should read the split sizes once, read {reads}"
    monkeypatch.undo()
    assert plan.slot_token.tolist() == [0, 3, 1, 4, 1, 2]


@pytest.mark.parametrize("weights_dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("padded", [False, True], ids=["dropless", "capacity"])
def test_packed_rows_round_trip(weights_dtype, padded):
    """Rows, weights and ids gathered straight into one packed byte buffer, moved as whole byte rows (as an
    all-to-all moves them) and read back through `_unpack`: bit-equal, every field 16-byte aligned. H = 7 fp16 x
    (14 bytes) and k = 3 leave padding after every field."""
    g = torch.Generator().manual_seed(7)
    T, H, k = 5, 7, 3
    x = torch.randn(T, H, generator=g).to(DEVICE, torch.float16)
    weights = torch.rand(T, k, generator=g, dtype=torch.float64).to(DEVICE, weights_dtype)
    slot_token = torch.tensor([3, 0, 0, 4, 1] + ([T, 2] if padded else [2]), device=DEVICE)  # T: unused slot
    slot_ids = torch.randint(0, 9, (slot_token.shape[0], k), generator=g, dtype=torch.int32).to(DEVICE)
    packing = _packing((H, torch.float16), (k, weights_dtype), (k, torch.int32))
    assert all(offset % 16 == 0 for offset in packing.offsets) and packing.row_bytes % 16 == 0
    assert packing.offsets[1] == 16 and packing.row_bytes == 16 + 16 * (1 + (k * weights_dtype.itemsize > 16)) + 16
    send, views = _new_packed(packing, slot_token.shape[0], DEVICE)
    pointers = [v.data_ptr() for v in views]
    _token_rows(x, slot_token, padded, out=views[0])
    _token_rows(weights, slot_token, padded, out=views[1])
    views[2].copy_(slot_ids)
    assert [v.data_ptr() for v in views] == pointers, "a gather reallocated its packed view"
    order = torch.tensor([6, 2, 0, 5, 1, 4, 3][:slot_token.shape[0]] if padded else [5, 2, 0, 1, 4, 3],
                         device=DEVICE)
    received = send[order].clone()
    rows, got_weights, ids = _unpack(received, packing)
    zero = torch.zeros(1, H, dtype=x.dtype, device=DEVICE), torch.zeros(1, k, dtype=weights_dtype, device=DEVICE)
    want_rows = torch.cat([x, zero[0]])[slot_token][order]
    want_weights = torch.cat([weights, zero[1]])[slot_token][order]
    for name, got, want in (("rows", rows, want_rows), ("weights", got_weights, want_weights),
                            ("ids", ids, slot_ids[order])):
        assert got.dtype == want.dtype and torch.equal(got, want), f"{name}: {got.tolist()} != {want.tolist()}"
        assert got.untyped_storage().data_ptr() == received.untyped_storage().data_ptr(), f"{name} is a copy"
        assert got.data_ptr() % 16 == 0 and got.stride() == (packing.row_bytes // got.element_size(), 1), name


def test_dispatch_is_one_exchange_per_direction(monkeypatch):
    """_Dispatch over two ranks with a loopback all_to_all_single (every rank receives what it sent): ONE collective
    in the forward, ONE in the backward; the received fields are the gathered rows, and the gradients the per-token
    sums (two slots per token at most: exact in fp32)."""
    calls = []

    def loopback(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        calls.append((input.dtype, tuple(input.shape)))
        assert output_split_sizes == input_split_sizes and output.shape == input.shape
        output.copy_(input)

    W, E_local, T, k = 2, 2, 7, 3
    g = torch.Generator().manual_seed(11)
    ids = torch.rand(T, W * E_local, generator=g).argsort(dim=1)[:, :k]
    ids[2] = W * E_local  # a token on no rank: no slot, a zero gradient
    ids = ids.to(DEVICE)
    counts = count_rows(ids, W, E_local)
    counts[W:] = counts[:W]
    plan = _plan_from_counts(ids, W, E_local, None, counts)
    x = torch.randn(T, H, generator=g).to(DEVICE).requires_grad_()
    weights = torch.rand(T, k, generator=g).to(DEVICE).requires_grad_()
    monkeypatch.setattr(dist, "all_to_all_single", loopback)
    rows, got_weights, local_ids = _Dispatch.apply(x, weights, plan, None, W)
    assert len(calls) == 1 and calls[0][0] == torch.uint8, f"forward collectives: {calls}"
    assert torch.equal(rows, x[plan.slot_token]) and torch.equal(got_weights, weights[plan.slot_token])
    assert torch.equal(local_ids, plan.slot_local_ids) and not local_ids.requires_grad
    storages = {t.untyped_storage().data_ptr() for t in (rows, got_weights, local_ids)}
    assert len(storages) == 1, "the received fields should be views of one buffer"
    grad_rows = torch.randn(rows.shape, generator=g).to(DEVICE)
    grad_weights = torch.randn(got_weights.shape, generator=g).to(DEVICE)
    ((rows * grad_rows).sum() + (got_weights * grad_weights).sum()).backward()
    assert len(calls) == 2 and calls[1][0] == torch.uint8, f"collectives after the backward: {calls}"
    monkeypatch.undo()
    want_x = torch.zeros_like(x).index_add_(0, plan.slot_token, grad_rows)
    want_weights = torch.zeros_like(weights).index_add_(0, plan.slot_token, grad_weights)
    assert torch.equal(x.grad, want_x) and torch.equal(weights.grad, want_weights)
    assert not x.grad[2].any() and (plan.slot_token != 2).all()


def test_capacity_formula():
    assert ep_capacity(8, 2, 2, 0.5) == 4  # int(0.5 * 8 * 2 / 2)
    assert ep_capacity(8, 8, 2, 1.0) == 8  # 32 clamped to T: a source has at most T rows per destination
    assert ep_capacity(1, 2, 8, 1.0) == 1  # int(0.25) = 0: no dropping (MegaBlocks' fallback), C = T
    assert ep_capacity(0, 2, 4, 1.0) == 0
    with pytest.raises(ValueError, match="capacity_factor"):
        ep_capacity(8, 2, 2, -1.0)


def test_capacity_reference_is_megablocks_rule_with_one_expert_per_rank():
    """With E_local = 1 a (token, rank) row is one assignment: the EP rule is MegaBlocks' per-expert rule."""
    ids = torch.rand(40, 8).argsort(dim=1)[:, :3]
    for capacity in (0, 3, 10, 40):
        assert torch.equal(ep_capacity_keep_ref(ids, 1, 8, capacity), capacity_keep_mask_ref(ids, 8, capacity))


@needs_interpreter
def test_bad_inputs_name_the_argument():
    x, w_gate_up, w_down, ids, weights = _inputs()
    with pytest.raises(ValueError, match="w_down_local"):
        ep_fused_experts(x, w_gate_up, w_down[:3], ids, weights)
    with pytest.raises(ValueError, match="gate_up_bias_local"):
        ep_fused_experts(x, w_gate_up, w_down, ids, weights, gate_up_bias_local=torch.zeros(3, 2 * F))
    with pytest.raises(ValueError, match="num_experts"):
        ep_fused_experts(x, w_gate_up, w_down, ids, weights, num_experts=8)
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        ep_fused_experts(x, w_gate_up, w_down, ids, weights, capacity_factor=1.0, max_tokens_per_rank=T - 1)
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        ep_fused_experts(x, w_gate_up, w_down, ids, weights, max_tokens_per_rank=T)
    with pytest.raises(ValueError, match="capacity_factor"):
        ep_fused_experts(x, w_gate_up, w_down, ids, weights, capacity_factor=-0.5)
    with pytest.raises(ValueError, match="topk_ids"):
        ep_fused_experts(x, w_gate_up, w_down, ids + E, weights)  # CPU ids are read: E..2E-1 are on no rank
    with pytest.raises(TypeError, match="unknown options"):
        ExpertParallelExperts(w_gate_up, w_down, capacity=2)
    with pytest.raises(TypeError, match="w_down_local is torch.float8_e4m3fn"):
        ep_fused_experts(x, w_gate_up, w_down.to(torch.float8_e4m3fn), ids, weights)
    assert isinstance(ep_fused_experts(x, w_gate_up, w_down, ids, weights, return_stats=True)[1], ExpertParallelStats)


@needs_interpreter
def test_layer_from_all_experts_on_one_rank():
    x, w_gate_up, w_down, ids, weights = _inputs()
    layer = ExpertParallelExperts.from_experts(w_gate_up, w_down)
    assert torch.equal(layer(x, ids, weights), md.fused_experts(x, w_gate_up, w_down, ids, weights))
    assert {name for name, _ in layer.named_parameters()} == {"w_gate_up_local", "w_down_local"}


@needs_interpreter
def test_torchrun_example_runs_on_cpu():
    """examples/ep_example.py as the README runs it on a CPU: torchrun, 2 ranks, gloo, Triton's interpreter."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "torch-ext"), TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(_free_port()), "examples/ep_example.py"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}/2" in run.stdout and f"rank {rank}: capacity mode" in run.stdout, run.stdout
    errors = [float(e) for e in re.findall(r"relative error vs all experts on one rank (\S+)", run.stdout)]
    assert len(errors) == 2 and max(errors) <= 1e-4, run.stdout
