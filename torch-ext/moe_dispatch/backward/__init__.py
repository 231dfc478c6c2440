"""Backward of the experts path: every gradient a grouped GEMM or a fixed-order reduction, no atomics.

  experts.py  the input-gradient and weight-gradient kernels, their launchers and `experts_backward` (what
              `fused_experts`' autograd calls)

Reference: the float64 gradients of `reference.fused_experts_ref` (plain torch autograd).
"""
