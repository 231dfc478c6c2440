"""One table of real MoE layer shapes, shared by the tests (shrunk) and the benchmark (real size).

`MODEL_SHAPES[name]` gives the routed-expert part of one MoE layer: E experts, top_k per token, hidden size H and
expert FFN size F, plus how the model routes (so `fused_moe_forward` can be called the way the model calls it).
`shrunk(shape)` keeps everything that changes control flow (top_k, gating, groups, "H or F not a multiple of 128")
and shrinks the sizes to what the Triton interpreter runs in seconds.

The benchmark's targets differ by model: `matmul_fraction` is the share of the measured dense bf16 matmul
rate a prefill cell must reach.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    num_experts: int  # E
    top_k: int
    hidden: int  # H
    ffn: int  # F, per expert
    gating: str = "softmax"  # "softmax" or "sigmoid"
    renormalize: bool = False  # divide the k kept weights by their sum
    n_group: int | None = None  # group-limited top-k (DeepSeek-V3): experts split into n_group groups ...
    topk_group: int | None = None  # ... of which the best topk_group are eligible
    routed_scaling_factor: float = 1.0
    router_bias: bool = False  # router linear layer has a bias (GPT-OSS)
    score_correction_bias: bool = False  # e_score_correction_bias, used for selection only (DeepSeek-V3)
    matmul_fraction: float = 0.9  # target: prefill time <= flops / (matmul_fraction * P)

    def routing_kwargs(self) -> dict:
        """Keyword arguments of `fused_moe_forward` that select this model's routing (tensors excluded)."""
        kwargs = {"renormalize": self.renormalize, "routed_scaling_factor": self.routed_scaling_factor}
        if self.n_group is not None:
            kwargs.update(n_group=self.n_group, topk_group=self.topk_group)
        return kwargs

    def expert_weight_bytes(self, itemsize: int = 2) -> int:
        """Bytes of one expert's three matrices (gate, up, down)."""
        return 3 * self.hidden * self.ffn * itemsize


MODEL_SHAPES = {
    s.name: s
    for s in (
        # softmax over all E, keep 2, renormalise
        ModelShape("mixtral-8x7b", 8, 2, 4096, 14336, renormalize=True),
        ModelShape("mixtral-8x22b", 8, 2, 6144, 16384, renormalize=True),
        # Qwen2-57B-A14B ships norm_topk_prob = false
        ModelShape("qwen2-57b-a14b", 64, 8, 3584, 2560, renormalize=False),
        ModelShape("qwen3-30b-a3b", 128, 8, 2048, 768, renormalize=True, matmul_fraction=0.8),
        # routed experts only (the shared expert is a dense MLP); sigmoid scores, bias for selection, 8 groups keep 4
        ModelShape(
            "deepseek-v3", 256, 8, 7168, 2048, gating="sigmoid", renormalize=True, n_group=8, topk_group=4,
            routed_scaling_factor=2.5, score_correction_bias=True, matmul_fraction=0.8,
        ),
        # top-k over biased logits then softmax over the k == softmax then renormalise; H = F = 2880 is not a
        # multiple of 128 (the plain SiLU-gated FFN stands in for GPT-OSS's clamped SwiGLU: same bytes and FLOPs)
        ModelShape("gpt-oss-120b", 128, 4, 2880, 2880, renormalize=True, router_bias=True, matmul_fraction=0.8),
        ModelShape("gpt-oss-20b", 32, 4, 2880, 2880, renormalize=True, router_bias=True, matmul_fraction=0.8),
        # routed experts only (the shared expert, F 5632 behind a sigmoid gate, is a dense MLP); E = 60 is not a
        # power of two; norm_topk_prob = false
        ModelShape("qwen1.5-moe-a2.7b", 60, 4, 2048, 1408, renormalize=False, matmul_fraction=0.8),
        # OLMoE-1B-7B: small experts, top-8 of 64, norm_topk_prob = false
        ModelShape("olmoe-1b-7b", 64, 8, 2048, 1024, renormalize=False, matmul_fraction=0.8),
    )
}


def _small_dim(size: int, aligned: int, ragged: int) -> int:
    return aligned if size % 128 == 0 else ragged


def shrunk(shape: ModelShape, *, hidden: int | None = None, ffn: int | None = None,
           num_experts: int | None = None) -> ModelShape:
    """The same routing on interpreter-sized matrices.

    E becomes at most 16 (32 when groups are used, so each of the n_group groups keeps 4 experts and top-k still
    has a choice); H and F become 128/64 when the real size is a multiple of 128 and 96/48 when it is not.
    """
    if num_experts is None:
        floor = 4 * shape.n_group if shape.n_group else 16
        num_experts = min(shape.num_experts, max(floor, 2 * shape.top_k))
    return dataclasses.replace(
        shape,
        num_experts=num_experts,
        hidden=hidden if hidden is not None else _small_dim(shape.hidden, 128, 96),
        ffn=ffn if ffn is not None else _small_dim(shape.ffn, 64, 48),
    )
