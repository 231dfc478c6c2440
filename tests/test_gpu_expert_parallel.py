"""Expert parallelism on 2 GPUs with NCCL: real model sizes in bf16, CUDA-graph capture of the capacity mode. Skipped
unless torch sees at least two GPUs; the CPU suite (tests/test_expert_parallel.py, gloo) checks the same semantics at
tiny sizes. docs/performance.md's "Expert parallelism" section records its run on two H200s.

Each test spawns two ranks (one GPU each); both build the same all-expert problem from one seed, run
`ep_fused_experts` with their half of the experts, and compare with `fused_experts` holding all experts on one GPU
(the single-GPU reference fits on an H200: DeepSeek-V3's 256 routed experts are 22.5 GB in bf16).
"""

import datetime
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import capture_cuda_graph
from model_shapes import MODEL_SHAPES

import moe_dispatch as md
from moe_dispatch.reference import assert_close

WORLD_SIZE = 2
DTYPE = torch.bfloat16
pytestmark = pytest.mark.skipif(torch.cuda.device_count() < WORLD_SIZE, reason="needs 2 GPUs (NCCL)")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(check, *args):
    mp.spawn(_worker, args=(_free_port(), check, args), nprocs=WORLD_SIZE, join=True, start_method="spawn")


def _worker(rank, port, check, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=300), device_id=torch.device("cuda", rank))
    try:
        check(rank, *args)
    finally:
        dist.destroy_process_group()


def _problem(shape, T_per_rank, seed=0):
    """All experts and all ranks' tokens, identical on every rank (seeded on the GPU)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    E, k, H, F = shape.num_experts, shape.top_k, shape.hidden, shape.ffn
    T_all = T_per_rank * WORLD_SIZE
    x = torch.randn(T_all, H, device="cuda", dtype=DTYPE, generator=g)
    ids = torch.rand(T_all, E, device="cuda", generator=g).argsort(dim=1)[:, :k]
    weights = torch.rand(T_all, k, device="cuda", generator=g)
    w_gate_up = torch.randn(E, 2 * F, H, device="cuda", dtype=DTYPE, generator=g) * H**-0.5
    w_down = torch.randn(E, H, F, device="cuda", dtype=DTYPE, generator=g) * F**-0.5
    return x, ids, weights, w_gate_up, w_down


def _check_real_size(rank, name, T_per_rank, backward):
    shape = MODEL_SHAPES[name]
    x, ids, weights, w_gate_up, w_down = _problem(shape, T_per_rank)
    E_local = shape.num_experts // WORLD_SIZE
    mine, shard = slice(rank * T_per_rank, (rank + 1) * T_per_rank), slice(rank * E_local, (rank + 1) * E_local)
    x_r = x[mine].clone().requires_grad_(backward)
    weights_r = weights[mine].clone().requires_grad_(backward)
    w_gate_up_r = w_gate_up[shard].clone().requires_grad_(backward)
    w_down_r = w_down[shard].clone().requires_grad_(backward)
    out = md.ep_fused_experts(x_r, w_gate_up_r, w_down_r, ids[mine], weights_r, num_experts=shape.num_experts)
    # The upstream gradient of all ranks' tokens, the same on every rank: the weight gradients sum over all tokens.
    grad_out = torch.randn(x.shape, device="cuda", dtype=DTYPE, generator=torch.Generator("cuda").manual_seed(1))
    if backward:
        out.backward(grad_out[mine])
    ref_leaves = [t.clone().requires_grad_(backward) for t in (x, weights, w_gate_up, w_down)]
    ref = md.fused_experts(ref_leaves[0], ref_leaves[2], ref_leaves[3], ids, ref_leaves[1])
    assert_close(out, ref[mine], DTYPE, f"{name} rank {rank} output")
    if backward:
        ref.backward(grad_out)
        for what, got, want in (("hidden_states", x_r.grad, ref_leaves[0].grad[mine]),
                                ("topk_weights", weights_r.grad, ref_leaves[1].grad[mine]),
                                ("w_gate_up_local", w_gate_up_r.grad, ref_leaves[2].grad[shard]),
                                ("w_down_local", w_down_r.grad, ref_leaves[3].grad[shard])):
            assert_close(got, want, DTYPE, f"{name} rank {rank} d{what}")  # bf16 inputs: bf16's tolerance


@pytest.mark.parametrize("name,T_per_rank,backward", [
    ("deepseek-v3", 64, False),  # 128 + 128 routed experts, top-8 of 256: most tokens reach both ranks
    ("mixtral-8x22b", 256, True),  # 4 + 4 experts, top-2, forward and backward
])
def test_real_sizes_nccl(name, T_per_rank, backward, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _spawn(_check_real_size, name, T_per_rank, backward)


def _check_capacity_graph(rank, T_per_rank):
    """Capacity mode has no host read: capture it in a CUDA graph, replay with new routing, match eager."""
    shape = MODEL_SHAPES["qwen3-30b-a3b"]
    x, ids, weights, w_gate_up, w_down = _problem(shape, T_per_rank)
    E_local = shape.num_experts // WORLD_SIZE
    mine, shard = slice(rank * T_per_rank, (rank + 1) * T_per_rank), slice(rank * E_local, (rank + 1) * E_local)
    w_gate_up_r, w_down_r = w_gate_up[shard].contiguous(), w_down[shard].contiguous()
    static = [x[mine].clone(), ids[mine].clone(), weights[mine].clone()]

    def run():
        return md.ep_fused_experts(static[0], w_gate_up_r, w_down_r, static[1], static[2], capacity_factor=1.0,
                                   return_stats=True)

    graph, (static_out, static_stats) = capture_cuda_graph(run, warmups=2)
    for seed in (1, 2):
        x2, ids2, weights2, _, _ = _problem(shape, T_per_rank, seed=seed)
        for buffer, new in zip(static, (x2[mine], ids2[mine], weights2[mine])):
            buffer.copy_(new)
        graph.replay()
        eager_out, eager_stats = run()
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager_out), f"rank {rank}: replay differs from eager (seed {seed})"
        assert torch.equal(static_stats.dropped_rows, eager_stats.dropped_rows)


@pytest.mark.parametrize("T_per_rank", [8, 512])
def test_capacity_mode_cuda_graph_nccl(T_per_rank, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _spawn(_check_capacity_graph, T_per_rank)

