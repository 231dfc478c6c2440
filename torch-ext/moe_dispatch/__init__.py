"""moe_dispatch: a pure-Triton Mixture-of-Experts forward and MegaBlocks-style binned routing.

Pipeline (each stage a module; `moe.py` only composes them)::

    hidden_states [T, H]
      -> routing.py      router GEMM + softmax/sigmoid + (grouped) top-k        -> topk_ids, topk_weights [T, k]
      -> dispatch.py     per-expert counts, offsets, token order, tile map     (device-side, no host sync)
      -> grouped_gemm.py GEMM1: gathered rows x w_gate_up, act(gate) * up      -> [T*k, F] in expert order
                         GEMM2: x w_down, routed weight in the epilogue        -> [T*k, H] in expert order
      -> combine.py      deterministic sum of each token's k rows (fp32)      -> out [T, H]

At a few tokens in inference, decode.py replaces dispatch, the grouped GEMMs and combine with two launches (gate/up
per expert hit, then down + weighted sum per token); the tile tables choose (tiles.py).

fp8.py holds the FP8 weight formats (quantizer, checks, the choice of compute path); the grouped GEMMs dequantize
fp8 weights in their loads, and fp8_gemm.py runs e4m3 activations x e4m3 weights on FP8 tensor cores (w8a8).
mxfp4.py holds the MXFP4 weight format (e2m1 values with e8m0 scales per 32 along K, as GPT-OSS stores its experts).
expert_parallel.py wraps the experts path in an all-to-all over torch.distributed (experts sharded over ranks).
reference.py holds the float64 `<stage>_ref` reference of every public function and the tolerance table (plain
torch, launches nothing): `moe_dispatch.reference`, what the tests and the Hub benchmark check a kernel against.
_plan.py is the eager host path: a call is recorded once per input signature and then replayed through Triton's
compiled launcher (every launch site goes through `_plan.launch`).

`__all__` is the versioned public surface (API major = build.toml `version`).
"""

from .binned import (
    binned_gather,
    binned_scatter,
    binned_scatter_wgrad,
    expert_capacity,
    gather,
    histogram,
    inclusive_cumsum,
    padded_gather,
    padded_scatter,
    padded_scatter_wgrad,
    scatter,
    scatter_wgrad,
    sort,
)
from .combine import unpermute_tokens
from .dispatch import permute_tokens
from .expert_parallel import ExpertParallelExperts, ep_fused_experts
from .fp8 import dequantize_experts_fp8, quantize_experts_fp8
from .grouped_gemm import grouped_gemm
from .moe import expert_ffn_triton, fused_expert_ffn, fused_experts, fused_moe_forward
from .mxfp4 import dequantize_experts_mxfp4, quantize_experts_mxfp4
from .routing import moe_router
# bound by name: hub-loaded packages need explicit attributes
from . import expert_parallel, fp8, layers, mxfp4, reference, transformers_experts
from .transformers_experts import (Mxfp4Experts, from_pretrained_mxfp4, moe_dispatch_experts, register_experts,
                                   use_mxfp4_experts)

from ._version import __version__  # X.Y.Z; a build says its own (X.Y.Z, or X.Y.Z.dev0+g<commit>: scripts/build)

__all__ = [
    # v1 surface shared with bassrehab/moe-dispatch (same names, argument order, defaults, returns)
    "fused_moe_forward",
    "fused_expert_ffn",
    "moe_router",
    "permute_tokens",
    "unpermute_tokens",
    "grouped_gemm",
    "expert_ffn_triton",
    # v1 additions
    "fused_experts",
    # transformers integration (experts interface; kernelize layers live in `moe_dispatch.layers`)
    "moe_dispatch_experts",
    "register_experts",
    # GPT-OSS MXFP4 checkpoints through transformers (v1.x addition)
    "from_pretrained_mxfp4",
    "Mxfp4Experts",
    "use_mxfp4_experts",
    # binned routing (MegaBlocks semantics; argument order as in megablocks.backend.kernels)
    "binned_gather",
    "binned_scatter",
    "binned_scatter_wgrad",
    "gather",
    "scatter",
    "scatter_wgrad",
    "padded_gather",
    "padded_scatter",
    "padded_scatter_wgrad",
    "sort",
    "histogram",
    "inclusive_cumsum",
    "expert_capacity",
    # expert parallelism (v1.x addition)
    "ep_fused_experts",
    "ExpertParallelExperts",
    # FP8 expert weights (v1.x addition; `fused_experts` takes them with their scales)
    "quantize_experts_fp8",
    "dequantize_experts_fp8",
    # MXFP4 expert weights (v1.x addition; `fused_experts` takes them with their e8m0 scales)
    "quantize_experts_mxfp4",
    "dequantize_experts_mxfp4",
]
