"""The experts in other libraries' models.

  transformers_experts.py  transformers' experts interface backed by `fused_experts` (`register_experts`,
                           `moe_dispatch_experts`), GPT-OSS MXFP4 checkpoints (`from_pretrained_mxfp4`,
                           `Mxfp4Experts`, `use_mxfp4_experts`)
  layers.py                stateless layers for `kernels.kernelize` (drop-in forwards of transformers' MoE blocks)

Reference: `reference.fused_experts_ref` (these call `fused_experts`).
"""
