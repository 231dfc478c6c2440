"""Weight formats: how quantized expert weights are stored, checked, quantized and read by the GEMMs.

  scale_codes.py  `WeightScaleCode`, the WEIGHT_SCALE constexpr: how a GEMM applies a format's scales (imports
                  nothing of the package: the formats and the `@triton.jit` floor both sit above it)
  fp8.py          FP8 weights: the schemes (tensor, channel, block scales), quantizer and dequantizer, checks,
                  `WeightScale` (how a GEMM addresses the scales) and the facts behind the w8a8/dequant choice
  mxfp4.py        MXFP4 weights as GPT-OSS stores them (e2m1 values, e8m0 scales per 32 along K): checks,
                  quantizer, dequantizer
  quant.py        `ExpertsQuant`: a call's weight quantization as one object (format, scales, block shape,
                  activation quantization, weight layout), what `fused_experts(..., quant=...)` takes

Reference: `reference.dequantize_fp8_ref`, `dequantize_mxfp4_ref`, `quantize_mxfp4_ref`.
"""
