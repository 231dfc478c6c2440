"""Expert parallelism with torchrun: each rank holds E / W experts, tokens travel by all-to-all.

    GPUs (NCCL, one GPU per rank):  PYTHONPATH=torch-ext torchrun --nproc-per-node 2 examples/ep_example.py
    CPU (gloo, Triton interpreter): PYTHONPATH=torch-ext TRITON_INTERPRET=1 torchrun --nproc-per-node 2 \\
                                        examples/ep_example.py                      (tiny sizes, ~10 s)

Every rank builds the same all-expert weights from one seed (as if loaded from one checkpoint), keeps its shard in an
`ExpertParallelExperts` layer, routes its own tokens (a different T per rank) with `moe_router`, runs the layer
(dropless), checks the result against `fused_experts` with all experts on this rank, takes one training step, then
runs the capacity mode and prints how many (token, rank) rows it dropped.
"""

import os

import torch
import torch.distributed as dist

import moe_dispatch as md


def main():
    on_gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if on_gpu:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dtype, H, F, experts_per_rank, top_k, T_base, T_step = torch.bfloat16, 2048, 1024, 4, 2, 512, 64
    else:
        device = torch.device("cpu")
        dtype, H, F, experts_per_rank, top_k, T_base, T_step = torch.float32, 32, 16, 2, 2, 5, 1
    E = experts_per_rank * world_size
    T = T_base + T_step * rank  # T may differ per rank
    T_max = T_base + T_step * (world_size - 1)  # the same on every rank: sets the capacity C

    torch.manual_seed(0)  # the same "checkpoint" on every rank
    router_weight = (torch.randn(E, H) * 0.1).to(device, dtype)
    w_gate_up = (torch.randn(E, 2 * F, H) * H**-0.5).to(device, dtype)  # transformers layout [E, 2F, H]
    w_down = (torch.randn(E, H, F) * F**-0.5).to(device, dtype)
    layer = md.ExpertParallelExperts.from_experts(w_gate_up, w_down)  # keeps rows [rank * E / W, (rank + 1) * E / W)

    torch.manual_seed(1 + rank)  # each rank its own tokens
    x = torch.randn(T, H, device=device, dtype=dtype)
    topk_ids, topk_weights, _ = md.moe_router(x, router_weight, top_k, renormalize=True)

    out = layer(x, topk_ids, topk_weights)  # dropless: one host read of the split sizes
    full = md.fused_experts(x, w_gate_up, w_down, topk_ids, topk_weights, validate=False)
    error = ((out.float() - full.float()).norm() / full.float().norm()).item()
    print(f"rank {rank}/{world_size}: T={T}, experts [{rank * experts_per_rank}, {(rank + 1) * experts_per_rank}), "
          f"relative error vs all experts on one rank {error:.1e}", flush=True)

    out.float().square().mean().backward()  # gradients flow back through both exchanges
    print(f"rank {rank}: grad norm of local w_down {layer.w_down_local.grad.float().norm().item():.3e}", flush=True)

    with torch.no_grad():
        _, stats = md.ep_fused_experts(x, layer.w_gate_up_local, layer.w_down_local, topk_ids, topk_weights,
                                       capacity_factor=0.5, max_tokens_per_rank=T_max,
                                       return_stats=True)
    print(f"rank {rank}: capacity mode, rows wanted per destination {stats.wanted_rows.tolist()}, dropped "
          f"{stats.dropped_rows.tolist()}", flush=True)
    # Every rank reaches the end before any tears the group down: a rank destroying its gloo connections while a peer
    # still uses them aborts that peer ("terminate called without an active exception", seen 1 run in 6 here).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
