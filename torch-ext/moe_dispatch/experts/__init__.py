"""The experts path below the public entries (moe.py): one custom operator per direction, each planned once.

  call.py      `ExpertsCall`: a call's non-tensor description (layout, activation, forced tiles, quantization fields),
               built once at the entry, the plan key's and the operator schema's options
  checks.py    the shape, dtype, device and option checks of `fused_experts` and `ep_fused_experts`
  operator.py  operator `fused_experts`: the planner's choice of path, then the launches (dispatch, two grouped GEMMs,
               combine; or the decode path; or the w8a8 kernels)
  autograd.py  `run_experts` (the operator with autograd; quantized weights frozen) and operator
               `fused_experts_backward` (kernels in backward/)
"""
