"""Expert parallelism over torch.distributed: experts sharded over ranks, tokens exchanged all-to-all.

  expert_parallel.py  `ep_fused_experts` and the `ExpertParallelExperts` module: plan, dispatch all-to-all, local
                      experts, combine all-to-all
  ep_plan.py          the routing plan's kernels (which rows a rank sends where) and their launchers

Reference: `reference.ep_plan_ref`, `ep_capacity_keep_ref`.
"""
