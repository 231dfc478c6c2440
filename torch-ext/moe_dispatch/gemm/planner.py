"""Which kernel runs: the one place that decides, from host facts only (shapes, dtypes, strides, the device, the
tile tables), the path of an experts call and the kernel variant of each of its GEMMs. The launchers execute what it
decides; it launches nothing and imports no launcher.

  plan_experts         the experts call (moe.py): the decode path (gemm/decode.py: two launches, no dispatch), the
                       grouped path (dispatch, gemm.grouped.expert_gemm twice, combine; float weights, or float8 on
                       the dequant path) or the w8a8 path (gemm.w8a8.w8a8_experts), with its tiles
  plan_w8a8_engine     the w8a8 path's engine: the portable Triton GEMMs, or the warp-specialized Gluon GEMM
                       (gemm.gluon_experts; SM90 with Triton's Gluon, from GLUON_FP8_MIN_ROWS rows per expert, or
                       as MOE_DISPATCH_GLUON_FP8 says); `gluon_fp8_refusal` says why not
  plan_mxfp4_engine    the MXFP4 path's engine at prefill: the portable grouped GEMMs (the decode in their loads), or
                       the warp-specialized Gluon MXFP4 GEMM (gemm.gluon_experts.gluon_mxfp4_experts; SM90 with
                       Triton's Gluon, as MOE_DISPATCH_GLUON_MXFP4 says: "1" wherever it can run, "auto" from
                       GLUON_MXFP4_MIN_ROWS rows per expert); `gluon_mxfp4_refusal` says why not
  plan_backward        the tiles of the experts backward (backward/experts.py): its input-gradient GEMMs and its
                       weight-gradient GEMMs
  plan_segments        the tiles of the v1 functions on rows already in expert order (grouped_gemm, expert_ffn)
  choose_fp8_compute   "w8a8" or "dequant" for float8 weights (`fused_experts`' `fp8_compute` resolved)
  expert_gemm_kernel   one bf16/fp16 grouped GEMM: the pointer kernel or the persistent descriptor kernel
  w8a8_gemm_kernel     one w8a8 GEMM: the pointer kernel (its operands swapped for small tiles on Hopper) or the
                       persistent descriptor kernel (gemm/w8a8_persistent.py)
  w8a8_input           how GEMM1 of the w8a8 path gets its float8 input: quantized in the loads, or by a pass over x
                       first (in token order, or gathered into expert order for the persistent kernel)
  mxfp4_dequantizes_first  whether an MXFP4 experts call decodes its weights once into a float buffer and runs the
                       float path (prefill sizes, gemm/mxfp4_dequant.py) instead of decoding them in the GEMMs' loads

Every decision reads only what a CUDA graph or torch.compile also knows: no device data.
"""

import dataclasses
import enum
from collections.abc import Callable

import torch

from ..formats.fp8 import DEFAULT_FP8_BLOCK_SHAPE, FP8_COMPUTE, W8A8_DTYPE, infer_scheme, w8a8_refusal
from ..host.checks import check_choice
from ..host.device import (GLUON_FP8_VARIABLE, GLUON_MXFP4_VARIABLE, SWITCH_VALUES, TMA_ALIGN, current_environment,
                           has_tma, has_wgmma, is_interpreter, on_gpu, tma_readable)
from ..host.tiles import (MAX_DECODE_ASSIGNMENTS, DecodeTiles, GemmTile, MoeTiles, Persistent, WeightGradTile,
                          select_decode_tiles, select_down_grad_tile, select_fp8_tiles, select_tiles,
                          select_weight_grad_tile)
from .args import GemmWeights, rows_fit_descriptor, weights_fit_descriptors

DESCRIPTOR_DTYPES = (torch.bfloat16, torch.float16)  # what the bf16 persistent kernel's dots take
# wgmma, the instruction the FP8 persistent kernel exists for, works on 64-row slabs per warpgroup; smaller tiles
# (decode) keep the pointer kernel, which the tables tune for them.
W8A8_PERSISTENT_MIN_BLOCK_M = 64
# The same slab: a w8a8 pointer tile of fewer rows swaps its operands (W^T A^T, gemm.w8a8_jit.scaled_dot) on Hopper when
# its BLOCK_N fills at least one such slab; the few rows become the MMA's narrow side.
W8A8_SWAP_MIN_BLOCK_N = 64
# From this BLOCK_M up (prefill tiles) a pass quantizes x once before GEMM1 of the w8a8 path; below it (decode) the
# GEMM quantizes each row in its loads, which rereads x once per N tile but saves a launch, unless its tiles swap
# their operands (`w8a8_input`).
PREQUANTIZE_MIN_BLOCK_M = 64
# MXFP4 experts can decode their weights once into a buffer of the activations' dtype (gemm/mxfp4_dequant.py) and run
# the float path on it: MOE_DISPATCH_MXFP4_PREFILL=buffer asks for it. It is never chosen on its own: since the GEMMs
# decode by PTX (bf16 on NVIDIA) and dot 128-row tiles with A first, the loads' path measured faster at every size
# (H100, GPT-OSS-120B T = 4096: 4.58 ms a layer against 7.20 with the buffer; docs/versions.md, v27). The buffer
# exists for the call only, within MXFP4_DEQUANTIZE_MAX_BYTES (GPT-OSS-120B: 6.4 GB a layer in bf16), and never when
# gradients are taken (autograd would keep it until the backward).
MXFP4_DEQUANTIZE_MAX_BYTES = 8 << 30
# The Gluon engine of the w8a8 path (gemm/gluon_experts.py): "auto" (the variable unset or empty) runs it from
# GLUON_FP8_MIN_ROWS rows per expert (T * top_k / E), "1" wherever it can run, "0" never. Read and validated with the
# package's other switches once per call (host/device.py: `Environment`), and part of every plan key.
GLUON_FP8_MODES = SWITCH_VALUES[GLUON_FP8_VARIABLE]
# Where the engine beat the portable w8a8 kernels on the H200 (docs/versions.md, v24); below, its 128-row M tiles are
# mostly empty.
GLUON_FP8_MIN_ROWS = 128
GLUON_FP8_BLOCK = DEFAULT_FP8_BLOCK_SHAPE  # the one weight block the Gluon GEMM reads: the default's
# The Gluon engine of the MXFP4 path (gemm/gluon_experts.py's gluon_mxfp4_experts): "auto" (MOE_DISPATCH_GLUON_MXFP4
# unset or empty) runs it from GLUON_MXFP4_MIN_ROWS rows per expert (T * top_k / E) outside the decode path, or nowhere
# while that is None; "1" wherever it can run, "0" never.
GLUON_MXFP4_MODES = SWITCH_VALUES[GLUON_MXFP4_VARIABLE]
# Where the engine (both GEMMs' epilogues fused) beat the portable MXFP4 kernels through fused_experts on an H100, same
# run, GPT-OSS-120B and -20B widths: faster in every cell from 16 rows per expert (1.13-1.25x), slower at 2-8 rows
# (docs/performance.md, "Prefill on the Gluon MXFP4 engine"); below, its 64-row M tiles are mostly empty.
GLUON_MXFP4_MIN_ROWS = 16


class ExpertsPath(enum.Enum):
    """The path of one experts call."""

    DECODE = "decode"  # decode.decode_experts: a few tokens, inference, no dispatch
    GROUPED = "grouped"  # dispatch -> gemm.grouped.expert_gemm x 2 -> combine
    W8A8 = "w8a8"  # dispatch -> gemm.w8a8.w8a8_experts -> combine (float8 weights and activations)
    # dispatch -> gemm.gluon_experts.gluon_w8a8_experts -> combine: the w8a8 path's arithmetic on the Gluon GEMM
    # (`plan_w8a8_engine`)
    W8A8_GLUON = "w8a8 on the Gluon GEMM"
    # dispatch -> gemm.gluon_experts.gluon_mxfp4_experts -> combine: MXFP4 weights on the Gluon MXFP4 GEMM
    # (`plan_mxfp4_engine`)
    MXFP4_GLUON = "MXFP4 on the Gluon GEMM"


class GemmKernel(enum.Enum):
    """The kernel variant of one grouped GEMM."""

    POINTER = "pointer"  # one program per output tile, A's rows gathered in the loads where asked
    POINTER_SWAPPED = "pointer, operands swapped"  # w8a8 only: the same, summing the transposed tile W^T A^T
    PERSISTENT = "persistent"  # one program per SM walking the tiles, weights (and sorted A) through descriptors


@dataclasses.dataclass(frozen=True)
class ExpertsPlan:
    """What `plan_experts` decided: the path and its tiles (DecodeTiles on the decode path, else MoeTiles)."""

    path: ExpertsPath
    tiles: MoeTiles | DecodeTiles


def plan_experts(device: torch.device, num_tokens: int, top_k: int, num_experts: int, ffn: int, hidden: int,
                 dtype: torch.dtype, *, forced: MoeTiles | DecodeTiles | None = None, save_preact: bool = False,
                 fp8: bool = False, w8a8: bool = False, transposed: bool = False, mxfp4: bool = False) -> ExpertsPlan:
    """The path and tiles of one experts call (`fp8`: float8 weights; `w8a8`: on the w8a8 path, already resolved
    by `fp8_compute`; `transposed`: the weights' layout, and `mxfp4`: MXFP4 weights, which read the table's "mxfp4"
    section: host/tiles.py). The decode path takes
    inference calls (`save_preact` False, not w8a8) of at most
    MAX_DECODE_ASSIGNMENTS assignments when forced by a DecodeTiles, never when forced by a MoeTiles, and otherwise
    where the device's table has a decode bucket; every other call takes the forced MoeTiles or the table's.
    Not cached: an eager call's plan is recorded with its launches and replayed (host/replay.py), torch.compile traces
    it once, and the tests may swap the tables underneath."""
    if not save_preact and not w8a8:
        decode = _decode_tiles(forced, device, num_tokens, top_k, num_experts, ffn, hidden, dtype, fp8, transposed,
                               mxfp4)
        if decode is not None:
            return ExpertsPlan(ExpertsPath.DECODE, decode)
    if isinstance(forced, MoeTiles):
        tiles = forced
    elif w8a8:
        tiles = select_fp8_tiles(device, num_tokens, top_k, num_experts, ffn, hidden)
    else:
        tiles = select_tiles(device, num_tokens, top_k, num_experts, ffn, hidden, dtype, mxfp4=mxfp4)
    return ExpertsPlan(ExpertsPath.W8A8 if w8a8 else ExpertsPath.GROUPED, tiles)


def gluon_fp8_mode() -> str:
    """GLUON_FP8_VARIABLE's value in the call's switches (device.current_environment), one of GLUON_FP8_MODES
    ("auto" when unset or empty). Any other value raises ValueError."""
    return current_environment().gluon_fp8


def gluon_fp8_refusal(plan: ExpertsPlan, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                      w_gate_up_scale: torch.Tensor | None, w_down_scale: torch.Tensor | None, *, separate_up: bool,
                      block_shape, scale_layout: str, static_input_scales: bool, transposed: bool, top_k: int,
                      available: Callable[[torch.device], bool]) -> str | None:
    """Why the Gluon engine (gemm/gluon_experts.py) does not run this experts call (a sentence), or None when it does.

    It runs unless GLUON_FP8_VARIABLE is "0", from GLUON_FP8_MIN_ROWS rows per expert (T * top_k / E) when the variable
    is "auto" (unset) and at any count when it is "1", on the w8a8 path at prefill tiles (BLOCK_M >= PREQUANTIZE_MIN_BLOCK_M;
    the decode path and decode tiles keep the portable kernels, whose 16-row tiles suit them), for bf16 activations and
    float8_e4m3fn weights with fp32 128 x 128 block scales, [E, 2F, H] / [E, H, F] (not transposed), gate and up in one
    contiguous weight (concatenated with "fused" scales, or with "merged" ones where F is a multiple of 128 and the two
    agree; or interleaved), both weights contiguous with rows of whole 16 bytes (H and F multiples of 16: TMA), dynamic
    activation scales (the GEMM takes one scale per row and 128 columns), and where `available(device)` says the Gluon
    GEMM can run (gemm.gluon_fp8.available: Triton 3.6's Gluon, an SM90 GPU; the CPU never). Host facts only."""
    mode = gluon_fp8_mode()
    if mode == "0":
        return f"{GLUON_FP8_VARIABLE} is 0"
    if plan.path is not ExpertsPath.W8A8:
        return f"the call takes the {plan.path.value} path, not w8a8"
    if plan.tiles.block_m < PREQUANTIZE_MIN_BLOCK_M:
        return f"decode-sized tiles (BLOCK_M {plan.tiles.block_m} < {PREQUANTIZE_MIN_BLOCK_M})"
    if x.dtype != torch.bfloat16:
        return f"activations are {x.dtype}; the Gluon GEMM writes bf16"
    if transposed:
        return "transposed weights; the Gluon GEMM reads [E, N, K] rows"
    if separate_up:
        return "gate and up are separate tensors; the Gluon GEMM reads one [E, 2F, H] weight"
    if static_input_scales:
        return "static activation scales; the Gluon GEMM takes one scale per row and 128 columns"
    for name, weight, scale in (("w_gate_up", w_gate_up, w_gate_up_scale), ("w_down", w_down, w_down_scale)):
        if weight.dtype != W8A8_DTYPE:
            return f"{name} is {weight.dtype}, not {W8A8_DTYPE}"
        if scale is None or infer_scheme(scale) != "block" or scale.dtype != torch.float32:
            return f"{name} has no fp32 block scales"
        if not weight.is_contiguous() or not tma_readable(weight):
            return f"{name} is not contiguous with rows of whole {TMA_ALIGN} bytes (TMA)"
    if tuple(block_shape) != GLUON_FP8_BLOCK:
        return f"block shape {tuple(block_shape)}, not {GLUON_FP8_BLOCK}"
    num_ffn = w_down.shape[2]
    if scale_layout == "merged" and num_ffn % GLUON_FP8_BLOCK[0]:
        return f"merged gate/up scales with F = {num_ffn} not a multiple of {GLUON_FP8_BLOCK[0]}"
    return _size_or_device_refusal(mode, x, top_k, w_gate_up.shape[0], GLUON_FP8_MIN_ROWS, "GLUON_FP8_MIN_ROWS",
                                   available, "the Gluon GEMM")


def _size_or_device_refusal(mode, x, top_k, num_experts, min_rows, min_rows_name, available, gemm) -> str | None:
    """The last two refusals of a Gluon engine: under `min_rows` rows per expert (T * top_k / E) in mode "auto" (at
    any size where `min_rows` is None), or a device where `available` says its GEMM (named `gemm`) cannot run; else
    None."""
    if mode == "auto" and min_rows is None:
        return f"{min_rows_name} is None: in mode auto the engine runs nowhere until it has measured faster"
    rows = x.shape[0] * top_k / max(num_experts, 1)
    if mode == "auto" and rows < min_rows:
        return (f"{rows:g} rows per expert (T * top_k / E), under {min_rows_name} = {min_rows}, where the portable "
                "kernels are faster")
    if not available(x.device):
        return f"{gemm} cannot run on {x.device}"
    return None


def _engine_plan(refusal, path: ExpertsPath, plan: ExpertsPlan, *args, **facts) -> ExpertsPlan:
    """`plan` on `path` (a Gluon engine's) where `refusal(plan, *args, **facts)` names no reason; else `plan`."""
    if refusal(plan, *args, **facts) is None:
        return dataclasses.replace(plan, path=path)
    return plan


def plan_w8a8_engine(plan: ExpertsPlan, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                     w_gate_up_scale: torch.Tensor | None, w_down_scale: torch.Tensor | None, **facts) -> ExpertsPlan:
    """`plan` on ExpertsPath.W8A8_GLUON where `gluon_fp8_refusal` (same arguments) finds no reason against it; else
    `plan` unchanged (the portable kernels)."""
    return _engine_plan(gluon_fp8_refusal, ExpertsPath.W8A8_GLUON, plan, x, w_gate_up, w_down, w_gate_up_scale,
                        w_down_scale, **facts)


def gluon_mxfp4_refusal(plan: ExpertsPlan, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                        w_gate_up_scale: torch.Tensor | None, w_down_scale: torch.Tensor | None, *, separate_up: bool,
                        transposed: bool, save_preact: bool, forced_tiles: bool, top_k: int,
                        available: Callable[[torch.device], bool]) -> str | None:
    """Why the MXFP4 Gluon engine (gemm.gluon_experts.gluon_mxfp4_experts) does not run this experts call (a
    sentence), or None when it does.

    It runs unless GLUON_MXFP4_VARIABLE is "0", from GLUON_MXFP4_MIN_ROWS rows per expert (T * top_k / E) when the
    variable is "auto" (unset; nowhere while that is None) and at any count when it is "1", on the grouped path (the decode path keeps its GEMVs),
    without gradients (it saves no pre-activations), unless the caller forced tiles (they are the portable kernels'),
    for bf16 activations and MXFP4 weights (uint8 bytes [E, N, K / 2],
    uint8 e8m0 codes), gate and up in one weight (concatenated or interleaved), both weights contiguous (their rows
    are read as one [E * N, K / 2] matrix by TMA), and where `available(device)` says the Gluon GEMM can run
    (gemm.gluon_mxfp4.available: Triton 3.6's Gluon, an SM90 GPU; the CPU never). Host facts only."""
    mode = current_environment().gluon_mxfp4
    if mode == "0":
        return f"{GLUON_MXFP4_VARIABLE} is 0"
    if plan.path is not ExpertsPath.GROUPED:
        return f"the call takes the {plan.path.value} path, not grouped"
    if save_preact:
        return "gradients are taken: the engine saves no pre-activations"
    if forced_tiles:
        return "the caller forced tiles: they are the portable kernels'"
    if x.dtype != torch.bfloat16:
        return f"activations are {x.dtype}; the Gluon MXFP4 GEMM reads bf16"
    if transposed:
        return "transposed weights; the Gluon MXFP4 GEMM reads [E, N, K / 2] rows"
    if separate_up:
        return "gate and up are separate tensors; the engine reads one [E, 2F, H / 2] weight"
    for name, weight, scale in (("w_gate_up", w_gate_up, w_gate_up_scale), ("w_down", w_down, w_down_scale)):
        if weight.dtype != torch.uint8 or weight.dim() != 3:
            return f"{name} is not MXFP4 bytes [E, N, K / 2]"
        if scale is None or scale.dtype != torch.uint8:
            return f"{name} has no uint8 e8m0 scale codes"
        if not weight.is_contiguous() or not tma_readable(weight):
            return f"{name} is not contiguous with rows of whole {TMA_ALIGN} bytes (TMA)"
    return _size_or_device_refusal(mode, x, top_k, w_gate_up.shape[0], GLUON_MXFP4_MIN_ROWS, "GLUON_MXFP4_MIN_ROWS",
                                   available, "the Gluon MXFP4 GEMM")


def plan_mxfp4_engine(plan: ExpertsPlan, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                      w_gate_up_scale: torch.Tensor | None, w_down_scale: torch.Tensor | None, **facts) -> ExpertsPlan:
    """`plan` on ExpertsPath.MXFP4_GLUON where `gluon_mxfp4_refusal` (same arguments) finds no reason against it; else
    `plan` unchanged (the portable kernels)."""
    return _engine_plan(gluon_mxfp4_refusal, ExpertsPath.MXFP4_GLUON, plan, x, w_gate_up, w_down, w_gate_up_scale,
                        w_down_scale, **facts)


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    """What `plan_backward` decided: `tiles` for the input-gradient GEMMs (gate_up's tile for dA, the down tile for
    dX, block_m for the segments) and `weight_tile` for the weight-gradient GEMMs."""

    tiles: MoeTiles
    weight_tile: WeightGradTile


def plan_backward(device: torch.device, num_tokens: int, top_k: int, num_experts: int, ffn: int, hidden: int,
                  dtype: torch.dtype, *, tiles: MoeTiles | None = None,
                  weight_tile: WeightGradTile | None = None) -> BackwardPlan:
    """The tiles of one experts backward: the forced ones where given (tuning, tests), else the forward's table for
    the input-gradient GEMMs (they stream the same operands as the forward's GEMMs, transposed; dA's with the stages
    of tiles.select_down_grad_tile) and the weight-gradient tile of the device (tiles.select_weight_grad_tile)."""
    if tiles is None:
        tiles = select_tiles(device, num_tokens, top_k, num_experts, ffn, hidden, dtype)
        down_grad = select_down_grad_tile(device, tiles.gate_up, tiles.block_m, dtype.itemsize)
        tiles = dataclasses.replace(tiles, gate_up=down_grad)
    if weight_tile is None:
        weight_tile = select_weight_grad_tile(device, dtype, num_tokens * top_k // max(num_experts, 1))
    return BackwardPlan(tiles, weight_tile)


def weight_grad_kernel(left, right, out, tile: WeightGradTile) -> bool:
    """Whether experts_backward's weight-gradient GEMM out[e] = left_e^T right_e (operands in sorted order) runs the
    persistent descriptor kernel: the tile asks for it, TMA on the device, a descriptor dtype, and both operands
    readable as descriptor tiles (column stride 1, row stride and base 16-byte aligned). The interpreter takes every
    dtype, so the CPU suite's float32 and float64 cases run the kernel too."""
    return (tile.persistent and has_tma(left.device) and (left.dtype in DESCRIPTOR_DTYPES or is_interpreter())
            and out.shape[0] > 0 and left.shape[0] > 0 and rows_fit_descriptor(left) and rows_fit_descriptor(right))


def plan_segments(device: torch.device, rows: int, num_experts: int, ffn: int, hidden: int,
                  dtype: torch.dtype) -> MoeTiles:
    """The tiles of the v1 functions that start from `rows` rows already in expert order (gemm.grouped.grouped_gemm,
    moe.expert_ffn_triton, moe.fused_expert_ffn): the forward's table at one assignment per row; a single GEMM
    takes the `down` tile (its output is not activated)."""
    return select_tiles(device, rows, 1, num_experts, ffn, hidden, dtype)


def _decode_tiles(forced, device, num_tokens, top_k, num_experts, ffn, hidden, dtype, fp8, transposed, mxfp4):
    if num_tokens * top_k > MAX_DECODE_ASSIGNMENTS or isinstance(forced, MoeTiles):
        return None
    if isinstance(forced, DecodeTiles):
        return forced
    return select_decode_tiles(device, num_tokens, top_k, num_experts, ffn, hidden, dtype, fp8=fp8,
                               transposed=transposed, mxfp4=mxfp4)


def choose_fp8_compute(choice: str, device: torch.device, w_gate_up, w_down, schemes, block_shape, transposed, *,
                       runs_decode: Callable[[], bool] = lambda: False) -> str:
    """"w8a8" or "dequant" for `fused_experts`' `fp8_compute` `choice` ("auto", "w8a8" or "dequant") on these
    weights (`schemes`: their scales' schemes, fp8.infer_scheme).

    "auto" takes "w8a8" on devices with FP8 tensor cores when the weights allow it (fp8.w8a8_refusal), except where
    the decode path will run (`runs_decode()`, asked only then: `plan_experts` of the call with float8 weights, where
    the table's FP8 decode bucket does not send "auto" to w8a8;
    torch.compile traces this, and the tile tables are read from files only inside the operator): at a few
    tokens the GEMMs are weight-bound, and the weight-only path reads the same bytes without quantizing the
    activations, in two launches. A forced "w8a8" that cannot run raises ValueError saying why."""
    check_choice("fp8_compute", choice, FP8_COMPUTE)
    if choice == "dequant":
        return "dequant"
    why = w8a8_refusal(device, {"w_gate_up": w_gate_up, "w_down": w_down}, schemes, block_shape, transposed)
    if choice == "w8a8":
        if why is not None:
            raise ValueError(f"fp8_compute='w8a8' cannot run: {why}. Use fp8_compute='auto' or 'dequant'.")
        return "w8a8"
    return "w8a8" if why is None and on_gpu(device) and not runs_decode() else "dequant"


def _persistent_fits(a, w: GemmWeights, *, transposed, gather_a, weight_scale) -> bool:
    """Whether the bf16 persistent descriptor kernel can run this GEMM: float weights in a layout that descriptors
    can read ([E, n, K] rows, an interleaved pair's 2n rows, or transposed [E, K, n] through 3-D descriptors), TMA
    on the device, and A readable as descriptor tiles unless its rows are gathered."""
    if weight_scale is not None or a.dtype not in DESCRIPTOR_DTYPES:
        return False
    if not has_tma(a.device) or a.shape[1] == 0 or not weights_fit_descriptors(w, transposed):
        return False
    return gather_a or rows_fit_descriptor(a)


def expert_gemm_kernel(a, w: GemmWeights, tile: GemmTile, *, transposed, gather_a, weight_scale) -> GemmKernel:
    """The kernel of gemm.grouped.expert_gemm for these operands: what the tile asks for (`tile.persistent`) where
    the operands allow it, else the pointer kernel."""
    if tile.persistent == Persistent.OFF:
        return GemmKernel.POINTER
    if _persistent_fits(a, w, transposed=transposed, gather_a=gather_a, weight_scale=weight_scale):
        return GemmKernel.PERSISTENT
    return GemmKernel.POINTER


def w8a8_gemm_kernel(a, w: GemmWeights, tile: GemmTile, *, block_m, transposed, gather_a) -> GemmKernel:
    """The kernel of gemm.w8a8.w8a8_gemm: the persistent descriptor kernel where the tile asks for it and it can run
    (float8 A already in sorted order and readable as descriptor tiles, weights [E, n, K] that descriptors can
    address, TMA, at least W8A8_PERSISTENT_MIN_BLOCK_M rows per tile); else the pointer kernel, with its operands
    swapped where a tile of fewer rows would leave Hopper's FP8 MMA (wgmma, 64-row slabs) for mma.sync: fewer than
    W8A8_PERSISTENT_MIN_BLOCK_M rows, at least W8A8_SWAP_MIN_BLOCK_N columns, K-contiguous weights (FP8 wgmma reads
    both operands K-major). All round alike."""
    if block_m < W8A8_PERSISTENT_MIN_BLOCK_M:
        return GemmKernel.POINTER_SWAPPED if _w8a8_swaps(tile, a.device, transposed) else GemmKernel.POINTER
    if tile.persistent == Persistent.OFF or gather_a or transposed or a.dtype != W8A8_DTYPE:
        return GemmKernel.POINTER
    if not has_tma(a.device):
        return GemmKernel.POINTER
    if rows_fit_descriptor(a) and weights_fit_descriptors(w):
        return GemmKernel.PERSISTENT
    return GemmKernel.POINTER


def _w8a8_swaps(tile: GemmTile, device, transposed) -> bool:
    """Whether a w8a8 pointer tile of fewer than W8A8_PERSISTENT_MIN_BLOCK_M rows swaps its operands."""
    return has_wgmma(device) and not transposed and tile.block_n >= W8A8_SWAP_MIN_BLOCK_N


def w8a8_input(tiles: MoeTiles, device, *, transposed, input_scale) -> tuple[bool, bool]:
    """(prequantize, sorted_rows) for GEMM1 of the w8a8 path: whether a pass quantizes x before the GEMM (prefill
    tiles, and small tiles that swap their operands, whose A must reach the MMA from shared memory: quantized in the
    loads it would make a round trip through registers every K step, where read as float8 it streams in with the
    weights; and a per-tensor or dynamic input scale: a per-expert static scale stays in the loads, since the pass
    does not know the rows' experts), and whether that pass also gathers the rows into expert order (persistent tiles,
    which read A through descriptors and so cannot gather; where descriptors exist: TMA, K-contiguous weights)."""
    per_tensor = input_scale is None or input_scale.numel() == 1
    small = tiles.block_m < PREQUANTIZE_MIN_BLOCK_M
    if not per_tensor or (small and not _w8a8_swaps(tiles.gate_up, device, transposed)):
        return False, False
    if small:
        return True, False
    return True, bool(tiles.gate_up.persistent) and not transposed and has_tma(device)


def mxfp4_dequantizes_first(num_tokens: int, top_k: int, num_experts: int, ffn: int, hidden: int, dtype: torch.dtype,
                            *, forced_tiles: bool, grad: bool, prefill: str = "auto") -> bool:
    """Whether an MXFP4 experts call runs the float path on its weights decoded into a buffer first: only where
    `prefill` (MOE_DISPATCH_MXFP4_PREFILL) is "buffer" ("auto" and "loads" keep the decode in the GEMMs' loads, the
    faster path), without gradients, within the buffer's byte bound, and not when the caller forced tiles (they are
    the MXFP4 path's). `num_tokens` and `top_k` are the call's, for the record: no size decides it."""
    if prefill != "buffer" or grad or forced_tiles or num_experts == 0:
        return False
    buffer_bytes = num_experts * 3 * ffn * hidden * torch.empty((), dtype=dtype).element_size()
    return buffer_bytes <= MXFP4_DEQUANTIZE_MAX_BYTES
