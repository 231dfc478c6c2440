"""The grouped GEMMs of the experts (one weight per expert, rows in expert order), which kernel runs, and the
`@triton.jit` pieces they share.

  jit.py                the kernels floor: the device functions every grouped GEMM is built from (tile walk, K loop
                        with float, float8 or MXFP4 weights, epilogue) and the ACTIVATION codes
  args.py               host-side argument packing shared by the launchers (`GemmWeights`, strides, scale and routing
                        arguments, shared constexprs) and the tensor-descriptor facts
  planner.py            which kernel runs: the path of an experts call (decode, grouped, w8a8), each GEMM's kernel
                        variant and tiles, from host facts and the tile tables; launches nothing
  grouped.py            the portable pointer kernel: both MoE projections, their input gradients, the v1 `grouped_gemm`
  persistent.py         the persistent kernel fed by tensor descriptors (TMA, Hopper): the prefill variant
  decode.py             the decode path: two launches for a few tokens, no dispatch
  w8a8_jit.py           the w8a8 kernels' shared jit pieces (e4m3 quantization, scaled dots, their epilogue)
  w8a8.py               float8 activations x float8 weights on FP8 tensor cores: the pointer kernel and the w8a8
                        experts path
  w8a8_persistent.py    the w8a8 GEMM as a persistent descriptor kernel (FP8 prefill)
  mxfp4_dequant.py      MXFP4 weights decoded once into a float buffer: the prefill strategy for MXFP4 experts
  gluon_ws.py           the warp-specialized skeleton of the Gluon GEMM (SM90, Triton 3.6): the guarded Gluon import,
                        `available`, the TMA producer warp, the tile order and the expert tile map, launch checks
  gluon_fp8.py          a warp-specialized SM90 block-scaled FP8 GEMM in Gluon on that skeleton (dense and over
                        expert-sorted rows)
  gluon_mxfp4.py        a warp-specialized SM90 grouped GEMM in Gluon on that skeleton, bf16 x MXFP4 weights (the
                        decode of one K step under the wgmma of the step before)
  gluon_experts.py      the experts paths on those GEMMs: w8a8 on gluon_fp8.py's (128 x 128 block scales, bf16;
                        planner.plan_w8a8_engine, MOE_DISPATCH_GLUON_FP8) and MXFP4 on gluon_mxfp4.py's
                        (planner.plan_mxfp4_engine, MOE_DISPATCH_GLUON_MXFP4), at prefill on SM90

Reference: `reference.grouped_gemm_ref`, `expert_ffn_ref`, `fused_experts_ref`, `fused_experts_fp8_ref`,
`fused_experts_w8a8_ref`, `fp8_block_gemm_ref`, `fp8_block_grouped_gemm_ref`.
"""
