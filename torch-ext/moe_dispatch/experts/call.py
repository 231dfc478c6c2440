"""`ExpertsCall`: what one call of the experts computes, apart from its tensors, as one frozen (hashable) object.

The public entries build it once from their options (`fused_experts`: the layout and activation options, the forced
tiles and the non-tensor fields of its quantization, `ExpertsQuant` or the v1 keywords); the plan cache keys on it
(host/replay.py), and it crosses the custom operator's boundary as the schema's trailing slots (`op_options`, read back
by `ExpertsCall(*slots)`). The tensors (weights, biases, their scales) travel beside it.
"""

import dataclasses
import functools

import torch

from ..formats.fp8 import DEFAULT_FP8_BLOCK_SHAPE, WeightScale, gate_up_row_offset, infer_scheme
from ..formats.mxfp4 import mxfp4_weight_scale
from ..gemm.args import weight_k
from ..host.tiles import DecodeTiles, MoeTiles, tiles_from_list


@dataclasses.dataclass(frozen=True)
class ExpertsCall:
    """The non-tensor description of an experts call (module docstring); see `fused_experts` for each field."""

    activation: str = "silu"  # checks.EXPERT_ACTIVATIONS
    interleaved: bool = False  # gate and up alternate along 2F (gate first); else gate rows, then up rows
    transposed: bool = False  # [E, H, 2F] / [E, F, H] weights (GPT-OSS) instead of [E, 2F, H] / [E, H, F]
    alpha: float = 1.702  # swiglu_oai: sigmoid(alpha * gate)
    limit: float = 7.0  # swiglu_oai: the clamp of gate (above) and up (both sides)
    tiles: tuple[int, ...] | None = None  # a forced MoeTiles / DecodeTiles as flat ints; None: the tables choose
    block_shape: tuple[int, int] = DEFAULT_FP8_BLOCK_SHAPE  # float8 block scales: (N side, K side) as stored
    compute: str = "dequant"  # quantized weights: "auto" at the entry, "w8a8" or "dequant" once resolved
    gate_up_scale_layout: str = "fused"  # formats/fp8.GATE_UP_SCALE_LAYOUTS

    def __post_init__(self):  # one spelling per value, so that equal calls share a plan
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "limit", float(self.limit))
        object.__setattr__(self, "block_shape", tuple(self.block_shape))
        if self.tiles is not None and not isinstance(self.tiles, tuple):
            tiles = self.tiles.to_list() if isinstance(self.tiles, (MoeTiles, DecodeTiles)) else self.tiles
            object.__setattr__(self, "tiles", tuple(tiles))

    def __hash__(self):
        # hashed once, at the first plan lookup (host/replay.py hashes the call at every one); never while torch.compile
        # traces the call (Dynamo cannot trace `hash` of a tuple, and no plan is looked up there)
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached

    @staticmethod
    def of(*options) -> "ExpertsCall":
        """`ExpertsCall(*options)`, made once per distinct options (hashable ones) in eager calls: the public entries
        build one at every call, where a few microseconds of host time count (an eager decode call is about 35 us).
        Under torch.compile a new one (Dynamo traces no lru_cache lookup)."""
        if torch.compiler.is_compiling():
            return ExpertsCall(*options)
        return _experts_call_of(*options)

    def op_options(self) -> tuple:
        """The operator schema's trailing slots (`operator.fused_experts_op`), in field order."""
        return (self.activation, self.interleaved, self.transposed, self.alpha, self.limit,
                None if self.tiles is None else list(self.tiles), list(self.block_shape), self.compute,
                self.gate_up_scale_layout)

    def forced_tiles(self) -> MoeTiles | DecodeTiles | None:
        return None if self.tiles is None else tiles_from_list(list(self.tiles))


@functools.lru_cache(maxsize=256)
def _experts_call_of(*options) -> ExpertsCall:
    return ExpertsCall(*options)


def ffn_size(w_down, transposed) -> int:
    """F of the down weight ([E, H, F], transposed [E, F, H])."""
    return weight_k(w_down, transposed)


def split_gate_up(w, num_ffn, interleaved, axis):
    """Gate and up views of a gate_up tensor along `axis` (no copy)."""
    if interleaved:
        lead = (slice(None),) * axis
        return w[lead + (slice(0, None, 2),)], w[lead + (slice(1, None, 2),)]
    return w.narrow(axis, 0, num_ffn), w.narrow(axis, num_ffn, num_ffn)


def weight_scales(call: ExpertsCall, w_gate_up_scale, w_down_scale, num_ffn, *, paired=False, mxfp4=False):
    """fp8.WeightScale of each GEMM (None for a float weight). The gate and up views of w_gate_up read the one scale
    tensor of the unsplit weight: view column j is row 2j (+1 for up) interleaved, j (+F for up) concatenated (+F
    rounded up to whole blocks for "merged" block scales: fp8.gate_up_row_offset). `paired`: the interleaved weight
    is read whole, column j is row j. `mxfp4`: MXFP4 weights, their scales uint8 e8m0 codes."""
    if mxfp4:
        # interleaved rows are read whole (paired); concatenated ones as two views, up's rows F further on
        return (mxfp4_weight_scale(w_gate_up_scale, up_row_offset=0 if paired else num_ffn),
                mxfp4_weight_scale(w_down_scale))
    gate_up = down = None
    if w_gate_up_scale is not None:
        scheme = infer_scheme(w_gate_up_scale)
        if paired:
            row_step, up_row_offset = 1, 0
        elif call.interleaved:
            row_step, up_row_offset = 2, 1
        else:
            row_step, up_row_offset = 1, gate_up_row_offset(num_ffn, scheme, call.block_shape,
                                                            transposed=call.transposed,
                                                            layout=call.gate_up_scale_layout)
        gate_up = WeightScale.of(w_gate_up_scale, scheme, call.block_shape, transposed=call.transposed,
                                 row_step=row_step, up_row_offset=up_row_offset)
    if w_down_scale is not None:
        down = WeightScale.of(w_down_scale, infer_scheme(w_down_scale), call.block_shape, transposed=call.transposed)
    return gate_up, down
