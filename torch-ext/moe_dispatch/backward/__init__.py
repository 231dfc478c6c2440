"""Backward of the experts path: every gradient a grouped GEMM or a fixed-order reduction, no atomics.

  experts.py       the input-gradient kernels (dA with the activation's backward, dX, the routing weights'
                   gradient) and `experts_backward` (what `fused_experts`' autograd calls), which launches them and
                   the weight gradients
  weight_grads.py  the weight-gradient kernels (pointer and persistent: dW[e] = left_e^T right_e over an expert's
                   sorted rows, bias gradients as column sums) and their launcher `_weight_grad`

Reference: the float64 gradients of `reference.fused_experts_ref` (plain torch autograd).
"""
