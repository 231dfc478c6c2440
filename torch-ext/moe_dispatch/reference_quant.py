"""Float64 references of the quantized weight formats (`moe_dispatch.reference` names them all): FP8 dequantization
and the block-scaled FP8 GEMMs, the experts on dequantized FP8 weights, the w8a8 path's arithmetic (its activation
quantization and `fused_experts_w8a8_ref`) with its tolerances, and MXFP4 (e2m1 values, e8m0 scales) both ways.
Plain torch, nothing else.
"""

import torch

from .reference_moe import _activation, _f64, _segments, fused_experts_ref, grouped_gemm_ref, split_gate_up_ref


def dequantize_fp8_ref(w_fp8, scale, block_shape=(128, 128), *, n_axis=1):
    """float64 w_fp8 * scale, from the `weight_scale_inv` convention: w_fp8 [E, d1, d2]; scale [E] (per tensor),
    [E, N] (per output channel, N = dimension `n_axis`) or [E, ceil(d1/b1), ceil(d2/b2)] (per (b1, b2) block, a
    trailing partial block keeping its own scale)."""
    w = w_fp8.to(torch.float64)
    scale = scale.to(torch.float64)
    if scale.dim() == 1:
        return w * scale[:, None, None]
    if scale.dim() == 2:
        return w * (scale[:, :, None] if n_axis == 1 else scale[:, None, :])
    b1, b2 = block_shape
    out = torch.empty_like(w)
    for i in range(scale.shape[1]):
        for j in range(scale.shape[2]):
            rows, cols = slice(i * b1, (i + 1) * b1), slice(j * b2, (j + 1) * b2)
            out[:, rows, cols] = w[:, rows, cols] * scale[:, i, j, None, None]
    return out


def fp8_block_gemm_ref(a, a_scale, b, b_scale, block=128):
    """-> out [M, N] float64 = (a * a_scale) @ (b * b_scale)^T, DeepSeek-style block-scaled fp8 operands: a [M, K] with
    a_scale [M, ceil(K/block)] (one scale per row and K block), b [N, K] with b_scale [ceil(N/block), ceil(K/block)]."""
    a64 = dequantize_fp8_ref(a[None], a_scale[None], (1, block))[0]
    b64 = dequantize_fp8_ref(b[None], b_scale[None], (block, block))[0]
    return a64 @ b64.T


def fp8_block_grouped_gemm_ref(a, a_scale, b, b_scale, expert_offsets, block=128):
    """-> out [expert_offsets[-1], N] float64: rows [o_e, o_{e+1}) of a (sorted by expert) times expert e's b[e]
    [N, K] with b_scale[e] (`fp8_block_gemm_ref`); expert_offsets [E + 1]."""
    offsets = expert_offsets.tolist()
    out = torch.zeros(offsets[-1], b.shape[1], dtype=torch.float64, device=a.device)
    for e in range(b.shape[0]):
        lo, hi = offsets[e], offsets[e + 1]
        if hi > lo:
            out[lo:hi] = fp8_block_gemm_ref(a[lo:hi], a_scale[lo:hi], b[e], b_scale[e], block)
    return out


def fp8_block_gated_grouped_gemm_ref(a, a_scale, b, b_scale, expert_offsets, *, activation="silu", gate_bias=None,
                                     up_bias=None, alpha=1.702, limit=7.0, block=128):
    """-> (h float8_e4m3fn [rows, F], h_scale float32 [rows, F / block]): GEMM1 of the w8a8 experts with its
    activation and the quantization of h (`quantize_fp8_groups_codes_ref`), the sums and the activation in float64
    then rounded to fp32 (as the kernel holds them). b [E, 2F, K] holds each expert's gate rows then its up rows;
    gate_bias and up_bias [E, F]; a, a_scale, b_scale and expert_offsets as in `fp8_block_grouped_gemm_ref`."""
    gate_up = fp8_block_grouped_gemm_ref(a, a_scale, b, b_scale, expert_offsets, block)
    gate, up = gate_up.chunk(2, dim=1)
    if gate_bias is not None:
        for e, (lo, hi) in enumerate(_segments(expert_offsets)):
            gate[lo:hi] += _f64(gate_bias[e])
            up[lo:hi] += _f64(up_bias[e])
    return quantize_fp8_groups_codes_ref(_activation(gate, up, activation, alpha, limit), block)


# e2m1 (MXFP4's element type) by 4-bit code: bit 3 the sign, bits 1-2 the exponent (bias 1), bit 0 the mantissa; code
# 8 is -0.
E2M1_TABLE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4_ref(blocks, scale):
    """float64 MXFP4 weight [E, N, K] (OCP Microscaling, as GPT-OSS stores it): blocks uint8 [E, N, K/32, 16] or
    [E, N, K/2], two e2m1 codes a byte, the low nibble the even K index; scale uint8 or float8_e8m0fnu [E, N, K/32],
    code c = 2^(c - 127) for the 32 values of its group along K, c = 255 NaN."""
    E, N = blocks.shape[:2]
    packed = blocks.reshape(E, N, -1).to(torch.int64)
    table = torch.tensor(E2M1_TABLE, dtype=torch.float64, device=blocks.device)
    values = torch.stack((table[packed % 16], table[packed // 16]), dim=-1).reshape(E, N, -1)
    codes = (scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale).to(torch.float64)
    factor = torch.where(codes == 255, float("nan"), 2.0 ** (codes - 127))
    return values * factor.repeat_interleave(32, dim=-1)


def mxfp4_grouped_gemm_ref(a, blocks, scales, expert_offsets, *, bias=None, activation=None, alpha=1.702, limit=7.0,
                           routing=None):
    """float64 reference of gemm.gluon_mxfp4.mxfp4_grouped_gemm: rows of expert e, s = a_seg @ dequant(blocks[e],
    scales[e])^T (+ bias[e]); with `activation` the columns 2j and 2j + 1 of s are gate and up of output column j
    ([rows, N / 2]); with routing = (gather_idx, topk_weights) each row is s times topk_weights[t, k] of its assignment
    t * top_k + k = gather_idx[row]. Rows past the last offset are zeros."""
    E = blocks.shape[0]
    s = grouped_gemm_ref(a, dequantize_mxfp4_ref(blocks, scales), expert_offsets, E)
    if bias is not None:
        for e, (lo, hi) in enumerate(_segments(expert_offsets)):
            s[lo:hi] += _f64(bias[e])
    if activation is not None:
        return _activation(s[:, 0::2], s[:, 1::2], activation, alpha, limit)
    if routing is not None:
        gather_idx, topk_weights = routing
        rows = int(expert_offsets[-1])
        assignment = gather_idx[:rows].long().cpu()
        flat = _f64(topk_weights).reshape(-1).cpu()
        s[:rows] *= flat[assignment].to(s.device)[:, None]
    return s


def quantize_mxfp4_ref(w):
    """w [E, N, K] (K a multiple of 32) -> (blocks uint8 [E, N, K/32, 16], scale codes uint8 [E, N, K/32]) by the
    documented rule, in float64 (exact for weights float32 holds): per group of 32 along K the scale is
    2^(floor(log2 amax) - 2) clamped to [2^-127, 2^127], each value / scale goes to the nearest e2m1 value (ties to the
    even code, beyond 6 to 6, the sign kept); an all-zero group gets code 0 and +0 values, a group holding NaN or inf
    code 255 and zero codes."""
    E, N, K = w.shape
    groups = w.to(torch.float64).reshape(E, N, K // 32, 32)
    finite = torch.isfinite(groups).all(dim=-1)
    amax = torch.where(torch.isfinite(groups), groups.abs(), 0.0).amax(dim=-1)
    exponent = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
    exponent = torch.where(amax > 0, exponent, -127.0)
    scaled = groups / 2.0 ** exponent[..., None]
    table = torch.tensor(E2M1_TABLE[:8], dtype=torch.float64, device=w.device)
    distance = (scaled.abs().clamp(max=6.0)[..., None] - table).abs()  # [E, N, K/32, 32, 8]; saturated first
    nearest = distance == distance.amin(dim=-1, keepdim=True)  # one code, or two neighbours at a midpoint
    even = torch.arange(8, device=w.device) % 2 == 0
    code = torch.where((nearest & even).any(dim=-1), (nearest & even).int().argmax(dim=-1), nearest.int().argmax(-1))
    code = code + 8 * torch.signbit(scaled).long()
    code = torch.where(finite[..., None], code, 0)
    blocks = (code[..., 0::2] + 16 * code[..., 1::2]).to(torch.uint8)
    scale = torch.where(finite, exponent + 127, 255.0).to(torch.uint8)
    return blocks, scale


def fused_experts_fp8_ref(hidden_states, w_gate_up, w_down, topk_ids, topk_weights, *, w_gate_up_scale=None,
                          w_down_scale=None, fp8_block_shape=(128, 128), transposed=False, gate_up_bias=None,
                          down_bias=None, experts_per_chunk=None, **kwargs):
    """`fused_experts_ref` on the float64 dequantized weights (a float weight without a scale is used as it is).

    `experts_per_chunk` dequantizes that many experts at a time (real model sizes: DeepSeek-V3's gate_up weights are
    60 GB in float64); each chunk adds the contributions of its experts."""
    num_experts = w_down.shape[0]
    chunk = num_experts if experts_per_chunk is None else experts_per_chunk
    n_axis = 2 if transposed else 1
    ids = topk_ids.detach().long()
    out = None
    for start in range(0, num_experts, chunk):
        stop = min(num_experts, start + chunk)
        inside = (ids >= start) & (ids < stop)
        if chunk < num_experts and not inside.any():
            continue
        part = slice(start, stop)
        w1, w2 = w_gate_up[part], w_down[part]
        if w_gate_up_scale is not None:
            w1 = dequantize_fp8_ref(w1, w_gate_up_scale[part], fp8_block_shape, n_axis=n_axis)
        if w_down_scale is not None:
            w2 = dequantize_fp8_ref(w2, w_down_scale[part], fp8_block_shape, n_axis=n_axis)
        local_ids = torch.where(inside, ids - start, -1)
        term = fused_experts_ref(hidden_states, w1, w2, local_ids, topk_weights, transposed=transposed,
                                 gate_up_bias=gate_up_bias[part] if gate_up_bias is not None else None,
                                 down_bias=down_bias[part] if down_bias is not None else None, **kwargs)
        out = term if out is None else out + term
    if out is None:
        out = torch.zeros(hidden_states.shape, dtype=torch.float64, device=hidden_states.device)
    return out


# The w8a8 FP8 path's activation quantization, modelled in the arithmetic the kernels use (fp32, e4m3fn, round to
# nearest even, saturating): a group g of values v (one row, `group` consecutive columns) gets
#   amax = max(max |v_g|, W8A8_MIN_AMAX),  q = e4m3(clamp(v * (448 / amax), -448, 448)),  v ≈ q * (amax / 448)
# and with a static scale s:  q = e4m3(clamp(v / s, -448, 448)),  v ≈ q * s.
W8A8_MIN_AMAX = 1e-10
FP8_E4M3_MAX = 448.0

# RMS relative error of `fused_experts` on the w8a8 path against the float64 experts on the dequantized weights
# (fused_experts_fp8_ref), which do not quantize activations. Rounding to e4m3 (3 mantissa bits: a step of 2^-3
# relative to the binade, uniform error of that step / sqrt(12)) gives one element an RMS relative error of
# 2^-3 / sqrt(12) * sqrt(E[1/m^2]) = 0.0266 over mantissas m in [1, 2) (log-uniform). A dot product over K terms
# sums K independent errors, and on data without structure its value grows by sqrt(K) too, so the relative error of
# a GEMM output stays about that of one element: 2.7 % for the quantized x in GEMM1 and 2.7 % for the quantized
# intermediate in GEMM2, ~3.8 % together (the GEMM1 error passes through silu(gate) * up with a gain near 1; measured
# 3.9-4.5 % on the CPU tests' random experts, 4.3 % at real sizes). The bound is 1.6x that RMS: it catches a wrong
# scale (a factor 2 in one group or one K step moves the output by far more) but not a misrounding of single
# elements, which the comparison with the w8a8 model below (fused_experts_w8a8_ref) catches.
W8A8_TOLERANCE = 0.08
# A block-scaled fp8 GEMM against fp8_block_gemm_ref (the operands already fp8): bf16 output rounding (2^-9) and the FP8
# tensor cores' own accumulation within each 128-wide K block (narrower than fp32), over sums of a few thousand products.
FP8_GEMM_TOLERANCE = 1e-2

# Tight bound of the w8a8 kernels against their model (fused_experts_w8a8_ref) with fp32 activations: kernel and model
# round the same fp32 values to e4m3 with the same fp32 operations, so they differ by the order of fp32 sums (~1e-7)
# unless an intermediate value lies within that of an e4m3 rounding boundary (one element one step off: ~1e-2 on its
# row); measured 5e-8 to 1.2e-7 over tests/test_fp8.py's cases.
W8A8_MODEL_TOLERANCE = 1e-5
# On a GPU the bound is looser: Hopper's FP8 wgmma keeps fewer bits than fp32 in each K step's sum, so kernel and
# model round a few intermediate values to neighbouring e4m3 values (1/16 relative each, on a tiny F a visible share
# of a row). wgmma runs tiles of BLOCK_M >= 64 and, operands swapped, the smaller ones (planner.w8a8_gemm_kernel; only
# tiles that stay on mma.sync, on fp16-converted operands with fp32 sums, stay within 1e-5). The H200 measured 2e-4
# to 3.8e-3 RMS on tests/test_fp8_persistent.py's cases and 1.05e-2 on F = 80 with fp16 activations and per-expert
# static scales (test_w8a8_half_precision_and_default_block, swapped tiles). Still 4x tighter than W8A8_TOLERANCE; the
# error against the dequantized weights is unchanged (4.2-4.5e-2 at real sizes, as vLLM's FP8 kernel).
W8A8_MODEL_TOLERANCE_GPU = 2e-2


def w8a8_model_tolerance(device):
    """The tight bound of a w8a8 kernel against `fused_experts_w8a8_ref` on `device` ("cpu"/"cuda" or a device)."""
    return W8A8_MODEL_TOLERANCE if torch.device(device).type == "cpu" else W8A8_MODEL_TOLERANCE_GPU


def quantize_fp8_groups_ref(v, group, static_scale=None):
    """v [M, K] -> float64 q * scale of the w8a8 quantization (model above) with one scale per row and `group`
    columns, or the static scale (a 0-d tensor or float)."""
    v = v.to(torch.float32)
    if static_scale is not None:
        scale = torch.as_tensor(static_scale, dtype=torch.float32, device=v.device)
        q = (v / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        return q.to(torch.float64) * scale.to(torch.float64)
    q, scale = quantize_fp8_groups_codes_ref(v, group)
    M, groups = scale.shape
    return (q.to(torch.float64).view(M, groups, group) * scale.to(torch.float64)[:, :, None]).view(
        M, groups * group)[:, :v.shape[1]]


def quantize_fp8_groups_codes_ref(v, group):
    """v [M, K] -> (q float8_e4m3fn [M, cdiv(K, group) * group], scale float32 [M, cdiv(K, group)]): the w8a8
    quantization (model above) with one scale per row and `group` columns, v ~ q * scale (columns past K zero)."""
    v = v.to(torch.float32)
    M, K = v.shape
    groups = -(-K // group)
    padded = torch.nn.functional.pad(v, (0, -K % group)).view(M, groups, group)
    amax = padded.abs().amax(dim=2, keepdim=True).clamp_min(W8A8_MIN_AMAX)
    q = (padded * (FP8_E4M3_MAX / amax)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(M, groups * group), (amax / FP8_E4M3_MAX)[:, :, 0]


def _expert_scale(scale, e):
    """A static input scale's value for expert e (scale of shape [], [1] or [E])."""
    return None if scale is None else scale.reshape(-1)[e if scale.numel() > 1 else 0]


def fused_experts_w8a8_ref(hidden_states, w_gate_up, w_down, topk_ids, topk_weights, *, w_gate_up_scale,
                           w_down_scale, groups, fp8_block_shape=(128, 128), gate_up_input_scale=None,
                           down_input_scale=None, activation="silu", gate_up_bias=None, down_bias=None,
                           interleaved=False, transposed=False, swiglu_alpha=1.702, swiglu_limit=7.0,
                           experts_per_chunk=16, gemm_out_dtype=None):
    """The w8a8 path's arithmetic in float64 except its quantizations: x rows quantized per `groups[0]` columns (or
    with gate_up_input_scale), GEMM1 on the dequantized weights, bias, activation, the intermediate (rounded to fp32,
    as the kernel holds it) quantized per `groups[1]` columns (or with down_input_scale), GEMM2, down bias. The
    weights are dequantized `experts_per_chunk` experts at a time. `gemm_out_dtype`: both GEMMs' sums rounded to it
    before their biases (the Gluon engine, gemm/gluon_experts.py: its GEMM writes bf16). -> [T, H] float64."""
    n_axis = 2 if transposed else 1
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    ids = topk_ids.detach().long()
    weights = _f64(topk_weights)
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    hit = [e for e in ids.unique().tolist() if 0 <= e < w_down.shape[0]]
    for start in range(0, w_down.shape[0], experts_per_chunk):
        chunk = [e for e in hit if start <= e < start + experts_per_chunk]
        if not chunk:
            continue
        part = slice(start, start + experts_per_chunk)
        w1 = dequantize_fp8_ref(w_gate_up[part], w_gate_up_scale[part], fp8_block_shape, n_axis=n_axis)
        w2 = dequantize_fp8_ref(w_down[part], w_down_scale[part], fp8_block_shape, n_axis=n_axis)
        bias = gate_up_bias[part] if gate_up_bias is not None else None
        gate, up, down, (gate_bias, up_bias) = split_gate_up_ref(w1, w2, bias, interleaved=interleaved,
                                                                 transposed=transposed)
        for e in chunk:
            _w8a8_expert_ref(out, x, ids, weights, e, e - start, gate, up, down, gate_bias, up_bias, down_bias,
                             groups, gate_up_input_scale, down_input_scale, activation, swiglu_alpha, swiglu_limit,
                             gemm_out_dtype)
    return out.reshape(hidden_states.shape)


def _w8a8_expert_ref(out, x, ids, weights, e, local, gate, up, down, gate_bias, up_bias, down_bias, groups,
                     gate_up_input_scale, down_input_scale, activation, alpha, limit, gemm_out_dtype=None):
    """Adds expert e's weighted rows to out (float64): `local` indexes e in the dequantized chunk."""
    def gemm_out(t):
        return t if gemm_out_dtype is None else t.to(gemm_out_dtype).to(torch.float64)

    token, slot = (ids == e).nonzero(as_tuple=True)
    rows = quantize_fp8_groups_ref(x[token], groups[0], _expert_scale(gate_up_input_scale, e))
    g, u = gemm_out(rows @ gate[local].T), gemm_out(rows @ up[local].T)
    if gate_bias is not None:
        g, u = g + _f64(gate_bias[local]), u + _f64(up_bias[local])
    h = _activation(g, u, activation, alpha, limit)
    h = quantize_fp8_groups_ref(h, groups[1], _expert_scale(down_input_scale, e))
    y = gemm_out(h @ down[local].T)
    if down_bias is not None:
        y = y + _f64(down_bias[e])
    out.index_add_(0, token, weights[token, slot, None] * y)
