"""The public MoE functions, composed from the stages (no kernels here):

  fused_experts     the experts path for callers with their own router: checks, then the experts operator
                    (experts/operator.py: dispatch -> GEMM1 -> GEMM2 -> combine, or the decode path), with its
                    backward (experts/autograd.py)
  fused_moe_forward the whole layer: routing's `route` operator, then the experts operator
  fused_expert_ffn / expert_ffn_triton: the v1 functions that start from already-permuted rows (forward only).

A call reads entry -> plan -> launches. Each public entry checks its options, builds the call's description
(`experts.call.ExpertsCall`) and, in eager inference, replays the launches recorded for the input signature
(host/replay.py); a call that cannot replay there (inputs that require grad) runs in full and its operator replays
below autograd. Nothing here reads device data on the host unless asked to validate: every size is known from shapes,
so a forward (and a backward) can be captured in a CUDA graph, and torch.compile traces the operators through their
fake implementations with symbolic token counts.
"""

import dataclasses
from typing import Literal

import torch

from .dispatch.binned import drop_over_capacity, expert_capacity
from .dispatch.combine import combine
from .dispatch.segments import segment_dispatch
from .experts.autograd import run_experts
from .experts.call import ExpertsCall
from .experts.checks import check_experts_args, check_experts_options, check_seed_weights
from .experts.operator import resolve_fp8_compute
from .formats.fp8 import DEFAULT_FP8_BLOCK_SHAPE, input_scale_problems
from .formats.mxfp4 import check_mxfp4_weight, is_mxfp4
from .formats.quant import ExpertsQuant, resolve_quant
from .gemm.grouped import check_segmented_rows, expert_gemm
from .gemm.mxfp4_dequant import dequantize_mxfp4_experts
from .gemm.planner import mxfp4_dequantizes_first, plan_segments
from .host.checks import (check_bool, check_choice, check_dim, check_float, check_ids_in_range, check_index, check_int,
                          check_kernel_device, check_real, check_same_device, check_token_weights, index_map_problems,
                          raise_problems, reads_values, segment_rows_problems, validate_option, warn_if_gradient_cut)
from .host.device import call_scope, current_environment
from .host.library import call, custom_op
from .host.replay import PlanCache
from .host.tiles import DecodeTiles, MoeTiles, check_forced_tiles
from .routing.router import check_router_args, check_router_options, route_with_grad

@call_scope
def fused_experts(hidden_states: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, *, activation: Literal["silu", "swiglu_oai"] = "silu",
                  gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                  interleaved: bool = False, transposed: bool = False, swiglu_alpha: float = 1.702,
                  swiglu_limit: float = 7.0, validate: bool | None = None, validate_ids: bool | None = None,
                  tiles: MoeTiles | DecodeTiles | None = None, w_gate_up_scale: torch.Tensor | None = None,
                  w_down_scale: torch.Tensor | None = None,
                  fp8_block_shape: tuple[int, int] | list[int] = DEFAULT_FP8_BLOCK_SHAPE,
                  gate_up_input_scale: torch.Tensor | None = None, down_input_scale: torch.Tensor | None = None,
                  fp8_compute: Literal["auto", "w8a8", "dequant"] = "auto",
                  w_gate_up_scale_layout: Literal["fused", "merged"] = "fused",
                  quant: ExpertsQuant | None = None) -> torch.Tensor:
    """Experts path for callers with their own router: out[t] = sum_j topk_weights[t, j] * expert_{ids[t, j]}(x_t).

    hidden_states [..., H]; w_gate_up [E, 2F, H] (gate rows then up rows, the transformers layout) and w_down [E, H, F];
    with `transposed`, [E, H, 2F] and [E, F, H] (GPT-OSS); with `interleaved`, gate and up alternate along 2F (gate
    first). expert(x) = down(act(gate_up(x) + gate_up_bias)) + down_bias with act "silu" (silu(gate) * up) or
    "swiglu_oai" (GPT-OSS: gate clamped above at limit, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)).
    topk_ids [T, k] int32/int64; topk_weights [T, k] any float dtype (applied in fp32).
    Ids outside [0, E) contribute nothing. Checking for them costs a device-to-host sync, so `validate=None` raises
    only when the ids are on the CPU; True always checks, False never (expert-parallel sentinels). `validate_ids` is
    the deprecated v1.0 spelling of `validate`.
    `tiles` forces a tile configuration (tuning and tests): a `tiles.MoeTiles` the four-launch path (dispatch, two
    grouped GEMMs, combine), a `tiles.DecodeTiles` the two-launch decode path (gemm/decode.py) wherever that applies (no
    gradient needed, fp8_compute not "w8a8", T * top_k <= tiles.MAX_DECODE_ASSIGNMENTS = 256; elsewhere the tables' tiles
    run); by default the device's tile table chooses. Returns out [..., H] in hidden_states' dtype.

    Differentiable in hidden_states, w_gate_up, w_down, topk_weights and both biases (Triton backward, see
    backward/experts.py; only the gradients asked for are computed); ids outside [0, E) get no gradient. When a
    gradient will be needed the forward also saves the [T * top_k, 2F] pre-activations (input dtype).

    FP8 expert weights (v1.x addition, forward only; see formats/fp8.py and docs/usage.md, "FP8 expert weights"):
    w_gate_up and/or w_down in float8_e4m3fn / float8_e4m3fnuz with fp32 (or float8_e8m0fnu: powers of two) scales
    `w_gate_up_scale` / `w_down_scale` (w ≈ w_fp8 * scale), the scheme read from the scale's shape: [E, ceil(d1/b1),
    ceil(d2/b2)] block scales over the weight as stored ([E, d1, d2]) with `fp8_block_shape` (b1, b2); [E, N] per
    output channel (N = 2F for w_gate_up, H for w_down); [E] per tensor. hidden_states and the output stay
    bf16/fp16/fp32. Quantized weights are frozen: they get no gradient (a warning says so once when one requires
    grad), while hidden_states, topk_weights and the biases get the gradients of the experts with the dequantized
    weights (fine-tuning around frozen quantized experts); "auto" then takes "dequant", and a forced "w8a8" is
    forward only (its output carries no gradient, warned once).
    `w_gate_up_scale_layout` says how w_gate_up_scale's block scales cover the 2F rows (the layouts differ where F is
    not a multiple of the block's N side b, and are never guessed from shapes): "fused" (default) ceil(2F/b) blocks over
    the rows as stored; "merged" gate's ceil(F/b) blocks, then up's, each over its own F rows (a checkpoint's separate
    gate and up scales stacked, as transformers' FP8Experts holds them; concatenated gate/up rows only). Channel and
    tensor scales read alike in both. A scale whose shape does not match the declared layout raises ValueError.
    `fp8_compute` picks how they are computed (formats/fp8.py): "w8a8" quantizes the activations to e4m3 too and runs
    FP8 tensor-core dots (activations per token and K step of 128 columns, amax / 448, dynamically; the intermediate
    quantized in GEMM1's epilogue), "dequant" converts the weights to the activation dtype in the loads; "auto"
    (default) takes "w8a8" on NVIDIA GPUs with FP8 tensor cores (SM89+) for float8_e4m3fn weights whose block K side
    is a power of two >= 32, and "dequant" elsewhere. Forcing "w8a8" where it cannot run raises ValueError.
    `gate_up_input_scale` / `down_input_scale`: static activation scales of the checkpoint (x ≈ x_fp8 * scale for
    hidden_states and for the intermediate), fp32 of shape [] or [1] (per tensor) or [E] (per expert), used by
    "w8a8" instead of the dynamic scales (values beyond 448 * scale saturate); "dequant" does not quantize
    activations and ignores them.

    `quant` (since 1.1.0): the weights' quantization as one `ExpertsQuant` (formats/quant.py), e.g.
    `ExpertsQuant.fp8(w_gate_up_scale, w_down_scale, block_shape=(128, 128))` or `ExpertsQuant.mxfp4(w_gate_up_scale,
    w_down_scale)`, in place of the seven keywords above and below (passing both is a TypeError); its format is
    declared and checked against the weights' dtypes.

    MXFP4 expert weights (v1.x addition; formats/mxfp4.py): w_gate_up and w_down as uint8 blocks, as GPT-OSS checkpoints
    store them ([E, 2F, H/32, 16] and [E, H, F/32, 16], or those bytes as [E, 2F, H/2] and [E, H, F/2]: two e2m1
    values per byte, low nibble first), with their e8m0 scales `w_gate_up_scale` [E, 2F, H/32] and `w_down_scale`
    [E, H, F/32] (uint8 or float8_e8m0fnu); not transposed; interleaved or concatenated gate/up rows. They are
    dequantized in the loads and dotted in hidden_states' dtype ("dequant"; "w8a8" raises); frozen like float8
    weights above.

    Eager inference calls are planned (`host/replay.py`): the first call of an input signature runs in full and is
    recorded, later ones replay its launches through Triton's compiled launcher (same results, a fraction of the host
    time).

    Every option is checked before anything runs (`check_experts_options`): a bool is True or False (the string
    "False" is refused, not taken as true), a number a real number, a choice one of its strings, forced tiles what the
    kernels take; the environment switches are read once per call (host/device.py: `call_scope`).
    """
    if quant is not None:  # the one quantization object, as the v1 keywords (checked alike below)
        (w_gate_up_scale, w_down_scale, fp8_block_shape, gate_up_input_scale, down_input_scale, fp8_compute,
         w_gate_up_scale_layout) = resolve_quant(quant, w_gate_up, w_down, dict(
             w_gate_up_scale=w_gate_up_scale, w_down_scale=w_down_scale, fp8_block_shape=fp8_block_shape,
             gate_up_input_scale=gate_up_input_scale, down_input_scale=down_input_scale, fp8_compute=fp8_compute,
             w_gate_up_scale_layout=w_gate_up_scale_layout)).values()
    check_experts_options(activation=activation, interleaved=interleaved, transposed=transposed,
                          swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit, validate=validate,
                          validate_ids=validate_ids, tiles=tiles, fp8_block_shape=fp8_block_shape,
                          fp8_compute=fp8_compute, w_gate_up_scale_layout=w_gate_up_scale_layout)
    described = ExpertsCall.of(activation, interleaved, transposed, swiglu_alpha, swiglu_limit, tiles,
                               tuple(fp8_block_shape), fp8_compute, w_gate_up_scale_layout)
    tensors = (hidden_states, w_gate_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias, w_gate_up_scale,
               w_down_scale, gate_up_input_scale, down_input_scale)
    options = (described, validate, validate_ids)
    if torch.compiler.is_compiling() or not _checks_read_no_values(validate, validate_ids, topk_ids):
        out = _fused_experts_in_full(*tensors, *options)
    else:
        out = _FUSED_EXPERTS_PLANS.run(_fused_experts_in_full, tensors, options)
    return out if out.dim() == hidden_states.dim() else out.reshape(hidden_states.shape)


_FUSED_EXPERTS_PLANS = PlanCache("fused_experts")


def _checks_read_no_values(validate, validate_ids, topk_ids) -> bool:
    """Whether a call's checks read only shapes, dtypes and devices (what a plan's key holds), so that a replay may
    skip them: validate False, or None with ids on a GPU; the deprecated `validate_ids` always runs in full."""
    if validate_ids is not None or validate is True:
        return False
    return validate is False or (validate is None and isinstance(topk_ids, torch.Tensor)
                                 and topk_ids.device.type != "cpu")


def _fused_experts_in_full(hidden_states, w_gate_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias,
                           w_gate_up_scale, w_down_scale, gate_up_input_scale, down_input_scale,
                           described: ExpertsCall, validate, validate_ids):
    """`fused_experts` in full: the checks, the quantized weights' compute resolved, the experts operator. Returns
    out [T, H]."""
    T, H, E, _ = check_experts_args(hidden_states, w_gate_up, w_down, topk_ids, topk_weights,
                                    activation=described.activation, gate_up_bias=gate_up_bias, down_bias=down_bias,
                                    transposed=described.transposed, w_gate_up_scale=w_gate_up_scale,
                                    w_down_scale=w_down_scale, fp8_block_shape=described.block_shape,
                                    gate_up_input_scale=gate_up_input_scale, down_input_scale=down_input_scale,
                                    interleaved=described.interleaved,
                                    w_gate_up_scale_layout=described.gate_up_scale_layout)
    validate = validate_option(validate, validate_ids, "fused_experts")
    check_ids_in_range("topk_ids", topk_ids, E, validate)
    x = hidden_states.reshape(T, H)
    compute = described.compute
    grad = _needs_grad(hidden_states, topk_weights, gate_up_bias, down_bias)
    if is_mxfp4(w_gate_up):  # the [E, N, K / 2] byte views and uint8 scale codes the kernels read (no copy)
        if compute == "w8a8":
            raise ValueError("fp8_compute='w8a8' cannot run MXFP4 weights: they are dequantized in the loads "
                             "(fp8_compute 'auto' or 'dequant')")
        check_choice("fp8_compute", compute, ("auto", "dequant"))
        w_gate_up, w_gate_up_scale = check_mxfp4_weight("w_gate_up", w_gate_up, "w_gate_up_scale", w_gate_up_scale)
        w_down, w_down_scale = check_mxfp4_weight("w_down", w_down, "w_down_scale", w_down_scale)
        compute = "dequant"
        if mxfp4_dequantizes_first(T, topk_ids.shape[1], E, 2 * w_down.shape[2], H, x.dtype,
                                   forced_tiles=described.tiles is not None, grad=grad,
                                   prefill=current_environment().mxfp4_prefill):
            w_gate_up = dequantize_mxfp4_experts(w_gate_up, w_gate_up_scale, x.dtype)
            w_down = dequantize_mxfp4_experts(w_down, w_down_scale, x.dtype)
            w_gate_up_scale = w_down_scale = None
    if grad:
        # gradients through frozen quantized weights: the dequant path (the w8a8 path is forward only)
        compute = "dequant" if compute == "auto" else compute
        if (described.gate_up_scale_layout == "merged" and w_gate_up_scale is not None and w_gate_up_scale.dim() == 3
                and (w_gate_up.shape[2 if described.transposed else 1] // 2)
                % described.block_shape[1 if described.transposed else 0]):
            raise ValueError("w_gate_up_scale_layout='merged' with F not a multiple of the block's N side has no "
                             "backward: run it without gradients, or pass the scales of the fused weight")
    compute = resolve_fp8_compute(compute, described.forced_tiles(), x, topk_ids.shape[1], w_gate_up, w_down,
                                  (w_gate_up_scale, w_down_scale), described.block_shape, described.transposed)
    for name, scale in (("gate_up_input_scale", gate_up_input_scale), ("down_input_scale", down_input_scale)):
        if scale is not None and reads_values(validate, scale):
            raise_problems(input_scale_problems(name, scale))
    scales = dict(w_gate_up_scale=w_gate_up_scale, w_down_scale=w_down_scale, gate_up_input_scale=gate_up_input_scale,
                  down_input_scale=down_input_scale)
    return run_experts(x, w_gate_up, None, w_down, topk_ids, topk_weights, gate_up_bias, down_bias,
                       call_options=dataclasses.replace(described, compute=compute), scales=scales)


def _needs_grad(*tensors):
    """Whether autograd will ask for gradients of any of `tensors` (None ones skipped)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


@call_scope
def fused_moe_forward(hidden_states: torch.Tensor, router_weight: torch.Tensor, w_gate: torch.Tensor,
                      w_up: torch.Tensor, w_down: torch.Tensor, num_experts: int, top_k: int,
                      gating: Literal["softmax", "sigmoid"] = "softmax", *, renormalize: bool | None = None,
                      router_bias: torch.Tensor | None = None, n_group: int | None = None,
                      topk_group: int | None = None, e_score_correction_bias: torch.Tensor | None = None,
                      routed_scaling_factor: float = 1.0, capacity_factor: float | None = None,
                      tiles: MoeTiles | DecodeTiles | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Whole MoE layer (v1 API): route, then run the experts.

    hidden_states [..., H], router_weight [E, H], w_gate and w_up [E, F, H], w_down [E, H, F]. Routing semantics are
    those of `moe_router`. With `capacity_factor`, each expert takes at most C = int(capacity_factor * T * top_k / E)
    assignments, the earliest in order t * top_k + j (MegaBlocks' rule; C = 0 drops nothing, as MegaBlocks falls back
    to the largest count); dropped assignments contribute nothing to `out` but are still reported in the returned ids
    and weights (`binned.capacity_keep_mask` tells which were kept). Returns (out [..., H] in the input dtype,
    top_k_indices [T, top_k] int64, top_k_weights [T, top_k] in the input dtype) with T the product of the leading dims.
    Differentiable in hidden_states, router_weight, router_bias and the three expert weights (see `fused_experts`; the
    routing weights' gradient flows through the softmax / sigmoid, the top-k choice is not differentiated).
    """
    check_int("num_experts", num_experts, 1)
    check_router_options(top_k, gating, renormalize, n_group, topk_group, routed_scaling_factor)
    check_real("capacity_factor", capacity_factor, none=True, minimum=0)
    check_forced_tiles("tiles", tiles)
    tensors = (hidden_states, router_weight, w_gate, w_up, w_down, router_bias, e_score_correction_bias)
    options = (num_experts, top_k, gating, renormalize, n_group, topk_group, routed_scaling_factor, capacity_factor,
               tiles)
    if torch.compiler.is_compiling():
        out, topk_ids, topk_weights = _fused_moe_forward_full(*tensors, *options)
    else:
        out, topk_ids, topk_weights = _FUSED_MOE_PLANS.run(_fused_moe_forward_full, tensors, options)
    return out.reshape(hidden_states.shape), topk_ids, topk_weights.to(hidden_states.dtype)


_FUSED_MOE_PLANS = PlanCache("fused_moe_forward")


def _fused_moe_forward_full(hidden_states, router_weight, w_gate, w_up, w_down, router_bias, e_score_correction_bias,
                            num_experts, top_k, gating, renormalize, n_group, topk_group, routed_scaling_factor,
                            capacity_factor, tiles):
    """`fused_moe_forward` in full -> (out [T, H], topk_ids, topk_weights in fp32)."""
    E = check_router_args(hidden_states, router_weight, top_k, gating, router_bias, n_group, topk_group,
                          e_score_correction_bias)
    check_int("num_experts", num_experts, 1)
    if num_experts != E:
        raise ValueError(f"num_experts={num_experts!r} but router_weight has {E} rows")
    H = hidden_states.shape[-1]
    check_seed_weights(w_gate, w_up, w_down, E, H, hidden_states.dtype)
    check_same_device(hidden_states=hidden_states, w_gate=w_gate, w_up=w_up, w_down=w_down)
    x = hidden_states.reshape(-1, H)
    if capacity_factor is not None:
        expert_capacity(x.shape[0], top_k, E, capacity_factor)  # checks capacity_factor before anything runs
    topk_ids, topk_weights, _ = route_with_grad(
        x, router_weight, top_k, gating, router_bias, renormalize=renormalize, n_group=n_group,
        topk_group=topk_group, e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=routed_scaling_factor)
    expert_ids = topk_ids if capacity_factor is None else drop_over_capacity(topk_ids, E, capacity_factor)
    out = run_experts(x, w_gate, w_up, w_down, expert_ids, topk_weights,
                      call_options=ExpertsCall(tiles=tiles))
    return out, topk_ids, topk_weights


@custom_op("expert_ffn")
def _expert_ffn_op(permuted_tokens: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                   expert_offsets: torch.Tensor, sorted_idx: torch.Tensor | None, top_k: int,
                   top_k_weights: torch.Tensor | None) -> torch.Tensor:
    """SwiGLU FFN of each expert on its segment of already-permuted rows -> [M, H] (zero past expert_offsets[-1]); with
    top_k_weights, row p is scaled by the weight of assignment sorted_idx[p]."""
    M, H = permuted_tokens.shape
    E, F, _ = w_gate.shape
    tiles = plan_segments(permuted_tokens.device, M, E, F, H, permuted_tokens.dtype)
    info = segment_dispatch(expert_offsets, M, E, tiles.block_m, gather_idx=sorted_idx, top_k=top_k)
    intermediate = expert_gemm(permuted_tokens, w_gate, info, tiles.gate_up, weight_up=w_up, activation="silu")
    out = torch.zeros((M, H), device=permuted_tokens.device, dtype=permuted_tokens.dtype)
    return expert_gemm(intermediate, w_down, info, tiles.down, topk_weights=top_k_weights, out=out)


@_expert_ffn_op.register_fake
def _(permuted_tokens, w_gate, w_up, w_down, expert_offsets, sorted_idx, top_k, top_k_weights):
    return permuted_tokens.new_empty(permuted_tokens.shape)


@custom_op("fused_expert_ffn")
def _fused_expert_ffn_op(permuted_tokens: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                         w_down: torch.Tensor, expert_offsets: torch.Tensor, top_k_weights: torch.Tensor,
                         sorted_idx: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    y = _expert_ffn_op._init_fn(permuted_tokens, w_gate, w_up, w_down, expert_offsets, sorted_idx, top_k,
                                top_k_weights)
    # restore[a] = row of assignment a; rows without a valid assignment land in a discarded extra slot.
    N = sorted_idx.shape[0]
    slots = torch.where((sorted_idx >= 0) & (sorted_idx < N), sorted_idx, N).long()
    restore = torch.full((N + 1,), -1, device=sorted_idx.device, dtype=torch.int64)
    restore.scatter_(0, slots, torch.arange(N, device=sorted_idx.device))
    return combine(y, restore[:N], num_tokens, top_k)


@_fused_expert_ffn_op.register_fake
def _(permuted_tokens, w_gate, w_up, w_down, expert_offsets, top_k_weights, sorted_idx, num_tokens, top_k):
    return permuted_tokens.new_empty((num_tokens, permuted_tokens.shape[1]))


def _check_segment_ffn_args(permuted_tokens, w_gate, w_up, w_down, expert_offsets, num_experts, validate,
                            more_problems=None):
    check_int("num_experts", num_experts, 1)  # a TypeError for 4.0 or True (check_segmented_rows takes True for 1)
    check_segmented_rows("permuted_tokens", permuted_tokens, expert_offsets, num_experts, validate,
                         more_problems=more_problems)
    check_seed_weights(w_gate, w_up, w_down, num_experts, permuted_tokens.shape[1], permuted_tokens.dtype)
    check_same_device(permuted_tokens=permuted_tokens, w_gate=w_gate, w_up=w_up, w_down=w_down)
    check_kernel_device("permuted_tokens", permuted_tokens)


@call_scope
def expert_ffn_triton(permuted_tokens: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                      expert_offsets: torch.Tensor, num_experts: int, *, validate: bool | None = None) -> torch.Tensor:
    """v1 API: per-expert SwiGLU FFN on rows already in expert order. Returns [M, H]; rows past expert_offsets[-1]
    are zero. `validate` as in grouped_gemm. Forward-only."""
    check_bool("validate", validate, none=True)
    _check_segment_ffn_args(permuted_tokens, w_gate, w_up, w_down, expert_offsets, num_experts, validate)
    warn_if_gradient_cut("expert_ffn_triton", permuted_tokens=permuted_tokens, w_gate=w_gate, w_up=w_up, w_down=w_down)
    return call(_expert_ffn_op, permuted_tokens, w_gate, w_up, w_down, expert_offsets, None, 1, None)


@call_scope
def fused_expert_ffn(permuted_tokens: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                     expert_offsets: torch.Tensor, num_experts: int, top_k_weights: torch.Tensor,
                     sorted_idx: torch.Tensor, num_tokens: int, top_k: int, *,
                     validate: bool | None = None) -> torch.Tensor:
    """v1 API: expert FFN on permuted rows, then the weighted combine back to token order -> [num_tokens, H].

    sorted_idx[p] is the assignment id (t * top_k + j) of row p, as returned by permute_tokens (-1: no assignment).
    `validate`: check expert_offsets (as in grouped_gemm) and sorted_idx (ids in [0, num_tokens * top_k), none twice,
    none negative inside a segment); None checks CPU tensors only, True also on a GPU (one sync), False never.
    Forward-only.
    """
    check_bool("validate", validate, none=True)
    check_float("permuted_tokens", permuted_tokens, ndim=2)
    check_index("sorted_idx", sorted_idx, ndim=1)
    check_token_weights(top_k_weights, num_tokens, top_k)
    check_dim("sorted_idx", sorted_idx, 0, permuted_tokens.shape[0], "rows of permuted_tokens")
    check_same_device(permuted_tokens=permuted_tokens, top_k_weights=top_k_weights, sorted_idx=sorted_idx)
    if permuted_tokens.shape[0] != num_tokens * top_k:
        raise ValueError(f"permuted_tokens has {permuted_tokens.shape[0]} rows, expected num_tokens * top_k = "
                         f"{num_tokens * top_k}")
    _check_segment_ffn_args(
        permuted_tokens, w_gate, w_up, w_down, expert_offsets, num_experts, validate,
        more_problems=lambda: (index_map_problems("sorted_idx", sorted_idx, num_tokens * top_k,
                                                  "assignments t * top_k + j")
                               + segment_rows_problems("sorted_idx", sorted_idx, expert_offsets)))
    warn_if_gradient_cut("fused_expert_ffn", permuted_tokens=permuted_tokens, w_gate=w_gate, w_up=w_up,
                         w_down=w_down, top_k_weights=top_k_weights)
    return call(_fused_expert_ffn_op, permuted_tokens, w_gate, w_up, w_down, expert_offsets, top_k_weights,
                sorted_idx, num_tokens, top_k)
