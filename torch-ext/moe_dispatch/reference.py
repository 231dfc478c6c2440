"""Float64 references for every public function, written from the documented semantics (not from the kernels).

`moe_dispatch.reference`: shipped with the package, so the tests, the scripts and the Hub benchmark (which verifies
the kernel it loads with the references that kernel ships) import the same `<stage>_ref` functions and tolerance
table by name. Plain torch, nothing else: importing it compiles and launches no kernel. Inputs are upcast to float64
on their own device (so a GPU can run the reference at real model sizes); outputs are float64 (floats) or int64
(indices) on that device.

This module is the one to import; it names every public name of the files the references live in, which import
torch and each other only::

    reference_moe.py     the MoE forward's stages: router, experts (seed and transformers layouts), the whole forward,
                         permute / unpermute, grouped GEMM, expert FFN
    reference_binned.py  binned routing and its row copies (binned, padded, plain), capacity keep masks, expert
                         parallelism's keep mask and routing plan
    reference_quant.py   quantized weights: FP8 dequantization and block-scaled GEMMs, the w8a8 model and its
                         tolerances, MXFP4 both ways
    reference_checks.py  agreement: TOLERANCE, relative_error, assert_close, routing_agreement
"""

from .reference_binned import (
    binned_gather_ref,
    binned_routing_ref,
    binned_scatter_ref,
    binned_scatter_wgrad_ref,
    capacity_keep_mask_ref,
    ep_capacity_keep_ref,
    ep_plan_ref,
    gather_ref,
    padded_gather_ref,
    padded_scatter_ref,
    padded_scatter_wgrad_ref,
    scatter_ref,
    scatter_wgrad_ref,
)
from .reference_checks import ROUTING_AGREEMENT_MIN, TOLERANCE, assert_close, relative_error, routing_agreement
from .reference_moe import (
    expert_ffn_ref,
    expert_mlp_ref,
    experts_ref,
    fused_expert_ffn_ref,
    fused_experts_ref,
    fused_moe_forward_ref,
    grouped_gemm_ref,
    moe_router_ref,
    permute_tokens_ref,
    split_gate_up_ref,
    unpermute_tokens_ref,
)
from .reference_quant import (
    E2M1_TABLE,
    FP8_E4M3_MAX,
    FP8_GEMM_TOLERANCE,
    W8A8_MIN_AMAX,
    W8A8_MODEL_TOLERANCE,
    W8A8_MODEL_TOLERANCE_GPU,
    W8A8_TOLERANCE,
    dequantize_fp8_ref,
    dequantize_mxfp4_ref,
    fp8_block_gated_grouped_gemm_ref,
    fp8_block_gemm_ref,
    fp8_block_grouped_gemm_ref,
    fused_experts_fp8_ref,
    fused_experts_w8a8_ref,
    mxfp4_grouped_gemm_ref,
    quantize_fp8_groups_codes_ref,
    quantize_fp8_groups_ref,
    quantize_mxfp4_ref,
    w8a8_model_tolerance,
)

__all__ = [
    # reference_moe.py
    "expert_ffn_ref", "expert_mlp_ref", "experts_ref", "fused_expert_ffn_ref", "fused_experts_ref",
    "fused_moe_forward_ref", "grouped_gemm_ref", "moe_router_ref", "permute_tokens_ref", "split_gate_up_ref",
    "unpermute_tokens_ref",
    # reference_binned.py
    "binned_gather_ref", "binned_routing_ref", "binned_scatter_ref", "binned_scatter_wgrad_ref",
    "capacity_keep_mask_ref", "ep_capacity_keep_ref", "ep_plan_ref", "gather_ref", "padded_gather_ref",
    "padded_scatter_ref", "padded_scatter_wgrad_ref", "scatter_ref", "scatter_wgrad_ref",
    # reference_quant.py
    "E2M1_TABLE", "FP8_E4M3_MAX", "FP8_GEMM_TOLERANCE", "W8A8_MIN_AMAX", "W8A8_MODEL_TOLERANCE",
    "W8A8_MODEL_TOLERANCE_GPU", "W8A8_TOLERANCE", "dequantize_fp8_ref", "dequantize_mxfp4_ref",
    "fp8_block_gated_grouped_gemm_ref", "fp8_block_gemm_ref", "fp8_block_grouped_gemm_ref", "fused_experts_fp8_ref",
    "fused_experts_w8a8_ref", "mxfp4_grouped_gemm_ref", "quantize_fp8_groups_codes_ref", "quantize_fp8_groups_ref",
    "quantize_mxfp4_ref",
    "w8a8_model_tolerance",
    # reference_checks.py
    "ROUTING_AGREEMENT_MIN", "TOLERANCE", "assert_close", "relative_error", "routing_agreement",
]
