"""Test cases as data: each one says why it exists. Shrunk model cases come from the shared MODEL_SHAPES table."""

import dataclasses

import torch
from model_shapes import MODEL_SHAPES, shrunk

@dataclasses.dataclass(frozen=True)
class Shape:
    """A problem size: T tokens, E experts, top_k per token, hidden H, expert FFN F, in `dtype`."""

    id: str
    why: str
    T: int
    E: int
    top_k: int
    H: int
    F: int
    dtype: torch.dtype = torch.float32


@dataclasses.dataclass(frozen=True)
class Case(Shape):
    """A forward case: a shape and how its tokens are routed."""

    gating: str = "softmax"
    renormalize: bool | None = None
    n_group: int | None = None
    topk_group: int | None = None
    correction: bool = False
    routed_scaling_factor: float = 1.0
    router_bias: bool = False
    chunked: bool = False  # the test switches the one-program dispatch off (dispatch.SINGLE_MAX = 0)

    def routing_kwargs(self):
        return dict(renormalize=self.renormalize, n_group=self.n_group, topk_group=self.topk_group,
                    routed_scaling_factor=self.routed_scaling_factor)


def _from_model(name, T, dtype, why):
    s = shrunk(MODEL_SHAPES[name])
    return Case(f"{name}-T{T}-{str(dtype)[6:]}", why, T, s.num_experts, s.top_k, s.hidden, s.ffn, dtype, s.gating,
                s.renormalize, s.n_group, s.topk_group, s.score_correction_bias, s.routed_scaling_factor, s.router_bias)


FORWARD_CASES = [
    _from_model("mixtral-8x7b", 37, torch.float32, "softmax top-2 renormalised; odd T leaves a ragged last tile"),
    _from_model("qwen3-30b-a3b", 20, torch.float16, "top-8 of many experts: most experts get 0-2 rows"),
    _from_model("qwen2-57b-a14b", 6, torch.bfloat16, "bf16 through the interpreter (dots upcast), no renormalisation"),
    _from_model("deepseek-v3", 9, torch.float32, "sigmoid + correction bias + group-limited top-k + scaling"),
    _from_model("gpt-oss-120b", 11, torch.float32, "router bias; H and F not multiples of the tiles"),
    Case("decode-T1", "T = 1: one token, k rows, most tiles empty", 1, 8, 2, 64, 48),
    Case("top1", "top_k = 1: one row per token, combine is a copy", 19, 4, 1, 32, 32),
    Case("topk-eq-E-prime", "top_k = E with a prime E: every expert gets every token", 7, 7, 7, 40, 24),
    Case("multi-chunk", "T*k = 300 > one dispatch chunk: the three-kernel dispatch (forced: the one-program path "
         "takes up to dispatch.SINGLE_MAX = 1024)", 150, 16, 2, 32, 32, torch.float16, chunked=True),
    Case("ragged-dims", "H = 33, F = 17: masked K and N tails in both GEMMs", 13, 5, 2, 33, 17),
    Case("sigmoid-no-renorm", "sigmoid gating with renormalize=False", 10, 8, 3, 32, 32, gating="sigmoid",
         renormalize=False),
]


@dataclasses.dataclass(frozen=True)
class GradCase(Shape):
    """A backward case of `fused_experts`: a shape and the experts' variant."""

    activation: str = "silu"
    interleaved: bool = False
    transposed: bool = False
    bias: bool = False
    ids: str = "random"  # "random", "sentinels" (some ids outside [0, E)), "few-experts" (ids in [0, 3) only)
    limit: float = 7.0
    chunked: bool = False  # the test switches the one-program dispatch off (dispatch.SINGLE_MAX = 0)


GRAD_CASES = [
    GradCase("silu", "transformers layout: concatenated gate/up, SiLU", 9, 4, 2, 32, 24),
    GradCase("silu-interleaved-bias", "interleaved gate/up with both biases", 9, 4, 2, 32, 24, interleaved=True,
             bias=True),
    GradCase("gpt-oss", "GPT-OSS: transposed, interleaved, biases, clamped SwiGLU with both clamps active",
             11, 4, 2, 32, 24, activation="swiglu_oai", interleaved=True, transposed=True, bias=True, limit=0.5),
    GradCase("swiglu-transposed-concat", "transposed layout with concatenated gate/up", 7, 3, 2, 32, 16,
             activation="swiglu_oai", transposed=True, limit=0.5),
    GradCase("sentinels", "ids outside [0, E): no contribution, zero weight gradient", 10, 4, 2, 32, 16,
             ids="sentinels", bias=True),
    GradCase("empty-experts", "E = 7, ids in [0, 3): experts without rows get exactly zero weight gradients", 8, 7, 2,
             32, 16, ids="few-experts", bias=True),
    GradCase("top1-ragged", "top_k = 1, H = 33, F = 17: masked K and N tails in every backward GEMM", 13, 5, 1, 33,
             17),
    GradCase("multi-chunk-fp16", "N = 150 > one dispatch chunk of 128: the three-kernel dispatch (forced) under the "
             "backward; ~19 rows per expert: two row tiles, the weight gradients sum over both; fp16", 75, 8, 2, 32, 32,
             torch.float16, chunked=True),
    GradCase("bf16", "bf16 through the interpreter (dots upcast)", 12, 4, 2, 32, 32, torch.bfloat16, bias=True),
]
