"""The experts in other libraries' models.

  transformers_experts.py  transformers' experts interface backed by `fused_experts` (`register_experts`,
                           `moe_dispatch_experts`), GPT-OSS MXFP4 checkpoints (`from_pretrained_mxfp4`,
                           `Mxfp4Experts`, `use_mxfp4_experts`)
  transformers_options.py  what an experts module's attributes say: the `fused_experts` options of float, FP8 and
                           MXFP4 experts modules (`fused_experts_options`, `fp8_experts_options`,
                           `mxfp4_experts_options`; transformers_experts.py names them too)
  layers.py                stateless layers for `kernels.kernelize` (drop-in forwards of transformers' MoE blocks)

Reference: `reference.fused_experts_ref` (these call `fused_experts`).
"""
