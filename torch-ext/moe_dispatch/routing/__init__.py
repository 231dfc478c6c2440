"""Routing: which experts each token goes to, and with what weights.

  router.py  the router GEMM, gating (softmax or sigmoid), group-limited top-k and renormalisation: its kernels,
             launchers, custom ops and autograd (`moe_router`, `route_with_grad`)

Reference: `reference.moe_router_ref`.
"""
