"""`ExpertsQuant`: one object that says how a call's expert weights are quantized and computed.

`fused_experts(..., quant=ExpertsQuant.fp8(w_gate_up_scale, w_down_scale, block_shape=(128, 128)))` says in one
argument what the v1 keyword arguments say in seven (`w_gate_up_scale`, `w_down_scale`, `fp8_block_shape`,
`gate_up_input_scale`, `down_input_scale`, `fp8_compute`, `w_gate_up_scale_layout`). Those stay accepted; the experts
path still reads them (`quant` becomes them at the public entry: `ExpertsQuant.keywords`). The format is declared,
never inferred: an `ExpertsQuant` whose format does not match the weights' dtypes is refused, naming both.

Fields by format:

  fp8    float8_e4m3fn / float8_e4m3fnuz weights (formats/fp8.py). `w_gate_up_scale` / `w_down_scale` fp32 (or
         float8_e8m0fnu) block [E, ceil(d1/b1), ceil(d2/b2)], channel [E, N] or tensor [E] scales; `block_shape`
         (b1, b2) for block scales; `gate_up_input_scale` / `down_input_scale` static activation scales (w8a8 only);
         `compute` "auto" | "w8a8" | "dequant"; `gate_up_scale_layout` "fused" | "merged".
  mxfp4  uint8 e2m1 blocks with e8m0 scales per 32 along K (formats/mxfp4.py), as GPT-OSS stores them; `compute`
         "auto" or "dequant" (they are dequantized in the loads).

`weight_layout` names how the weights are laid out in memory: "checkpoint", the layout a checkpoint stores (the only one
today; a prepared layout, made once when weights are loaded, will be another value of it).
"""

import dataclasses
from typing import Literal

import torch

from ..host.checks import check_choice, check_tensor
from .fp8 import DEFAULT_FP8_BLOCK_SHAPE, FP8_COMPUTE, GATE_UP_SCALE_LAYOUTS, check_block_shape
from .mxfp4 import is_mxfp4

QUANT_FORMATS = ("fp8", "mxfp4")
WEIGHT_LAYOUTS = ("checkpoint", )
# The v1 keyword arguments of `fused_experts` that an ExpertsQuant replaces, with their defaults.
V1_QUANT_KEYWORDS = {"w_gate_up_scale": None, "w_down_scale": None, "fp8_block_shape": DEFAULT_FP8_BLOCK_SHAPE,
                     "gate_up_input_scale": None, "down_input_scale": None, "fp8_compute": "auto",
                     "w_gate_up_scale_layout": "fused"}


@dataclasses.dataclass(frozen=True)
class ExpertsQuant:
    """How the expert weights of a call are quantized (module docstring). Build it with `ExpertsQuant.fp8(...)` or
    `ExpertsQuant.mxfp4(...)`; the constructor checks every field by kind and names it."""

    format: Literal["fp8", "mxfp4"]  # QUANT_FORMATS
    w_gate_up_scale: torch.Tensor | None = None
    w_down_scale: torch.Tensor | None = None
    block_shape: tuple[int, int] | list[int] = DEFAULT_FP8_BLOCK_SHAPE  # fp8 block scales: (N side, K side) of the stored weight
    gate_up_input_scale: torch.Tensor | None = None  # fp8, w8a8: static scale of hidden_states
    down_input_scale: torch.Tensor | None = None  # fp8, w8a8: static scale of the intermediate
    compute: Literal["auto", "w8a8", "dequant"] = "auto"  # FP8_COMPUTE; mxfp4: "auto" or "dequant"
    gate_up_scale_layout: Literal["fused", "merged"] = "fused"  # GATE_UP_SCALE_LAYOUTS
    weight_layout: Literal["checkpoint"] = "checkpoint"  # WEIGHT_LAYOUTS

    def __post_init__(self):
        check_choice("quant.format", self.format, QUANT_FORMATS)
        check_choice("quant.weight_layout", self.weight_layout, WEIGHT_LAYOUTS)
        check_choice("quant.compute", self.compute, FP8_COMPUTE if self.format == "fp8" else ("auto", "dequant"))
        check_choice("quant.gate_up_scale_layout", self.gate_up_scale_layout, GATE_UP_SCALE_LAYOUTS)
        object.__setattr__(self, "block_shape", check_block_shape(self.block_shape, "quant.block_shape"))
        for name in ("w_gate_up_scale", "w_down_scale", "gate_up_input_scale", "down_input_scale"):
            value = getattr(self, name)
            if value is not None:
                check_tensor(f"quant.{name}", value)
        if self.format == "mxfp4":
            if self.w_gate_up_scale is None or self.w_down_scale is None:
                raise ValueError("quant.format 'mxfp4' needs both quant.w_gate_up_scale and quant.w_down_scale (the "
                                 "e8m0 scales of the two weights)")
            extra = [name for name in ("gate_up_input_scale", "down_input_scale") if getattr(self, name) is not None]
            extra += ["block_shape"] if self.block_shape != DEFAULT_FP8_BLOCK_SHAPE else []
            extra += ["gate_up_scale_layout"] if self.gate_up_scale_layout != "fused" else []
            if extra:
                raise ValueError(f"quant.{extra[0]} is a field of float8 weights; MXFP4 scales are one per 32 "
                                 "values along K, with no block shape, scale layout or static input scales")

    @classmethod
    def fp8(cls, w_gate_up_scale: torch.Tensor | None = None, w_down_scale: torch.Tensor | None = None, *,
            block_shape: tuple[int, int] | list[int] = DEFAULT_FP8_BLOCK_SHAPE,
            gate_up_input_scale: torch.Tensor | None = None, down_input_scale: torch.Tensor | None = None,
            compute: Literal["auto", "w8a8", "dequant"] = "auto",
            gate_up_scale_layout: Literal["fused", "merged"] = "fused") -> "ExpertsQuant":
        """float8 expert weights (either or both of w_gate_up, w_down) with their scales."""
        return cls("fp8", w_gate_up_scale, w_down_scale, block_shape, gate_up_input_scale, down_input_scale, compute,
                   gate_up_scale_layout)

    @classmethod
    def mxfp4(cls, w_gate_up_scale: torch.Tensor, w_down_scale: torch.Tensor, *,
              compute: Literal["auto", "dequant"] = "auto") -> "ExpertsQuant":
        """MXFP4 expert weights (both) with their e8m0 scales."""
        return cls("mxfp4", w_gate_up_scale, w_down_scale, compute=compute)

    def keywords(self) -> dict:
        """The v1 keyword arguments of `fused_experts` that say the same (V1_QUANT_KEYWORDS' names)."""
        return dict(w_gate_up_scale=self.w_gate_up_scale, w_down_scale=self.w_down_scale,
                    fp8_block_shape=self.block_shape, gate_up_input_scale=self.gate_up_input_scale,
                    down_input_scale=self.down_input_scale, fp8_compute=self.compute,
                    w_gate_up_scale_layout=self.gate_up_scale_layout)

    def check_weights(self, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
        """The weights are in this format: MXFP4 both uint8 blocks, FP8 at least one float8 (the other may stay in
        the activation dtype); TypeError naming the weight and the format otherwise."""
        if self.format == "mxfp4":
            for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
                if not is_mxfp4(w):
                    raise TypeError(f"quant.format is 'mxfp4' but {name} has dtype {_dtype(w)}; MXFP4 weights are "
                                    "uint8 blocks (two e2m1 values per byte)")
        elif not any(getattr(w, "dtype", None) in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
                     for w in (w_gate_up, w_down)):
            raise TypeError(f"quant.format is 'fp8' but w_gate_up and w_down have dtypes {_dtype(w_gate_up)} and "
                            f"{_dtype(w_down)}; at least one must be float8_e4m3fn or float8_e4m3fnuz")


def _is_default(value, default):
    """Whether a v1 keyword was left at its default: None, the default block shape (a tuple or list of it) or string."""
    if default is None:
        return value is None
    if isinstance(default, tuple):
        return isinstance(value, (tuple, list)) and tuple(value) == default
    return type(value) is str and value == default


def _dtype(tensor):
    return str(getattr(tensor, "dtype", type(tensor).__name__)).replace("torch.", "")


def resolve_quant(quant, w_gate_up, w_down, keywords) -> dict:
    """`fused_experts`' quantization, from `quant` or from the v1 keywords (never both): the v1 keyword dictionary
    the experts path reads. Passing `quant` with any v1 keyword away from its default is a TypeError naming it."""
    if quant is None:
        return keywords
    if not isinstance(quant, ExpertsQuant):
        raise TypeError(f"quant must be a moe_dispatch.ExpertsQuant or None, got {type(quant).__name__}")
    given = [name for name, default in V1_QUANT_KEYWORDS.items() if not _is_default(keywords[name], default)]
    if given:
        raise TypeError(f"quant= and {given[0]}= both describe the weights' quantization: pass one (quant holds "
                        f"{', '.join(V1_QUANT_KEYWORDS)})")
    quant.check_weights(w_gate_up, w_down)
    return quant.keywords()
