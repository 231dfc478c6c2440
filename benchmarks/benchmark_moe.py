"""Benchmarks in the Hub's convention: `kernels benchmark moe-dispatch/moe-dispatch@v1` (branch v1 ships this folder),
or `kernels benchmark <folder>` with the folder holding build/ (scripts/build) and benchmarks/, e.g. a checkout.
Needs kernels >= 0.17 with its `benchmark` extra (tabulate); `--visual` also needs matplotlib (pip install
"kernels[benchmark]"), without which kernels prints an error and writes no picture.

Three classes, one per entry point, two workloads each; a workload is a model layer of benchmarks/model_shapes.py at
a token count T, real size in bf16 on a GPU, shrunk (`model_shapes.shrunk`) in fp32 on the CPU, where Triton's
interpreter runs the kernels (set TRITON_INTERPRET=1; the times then mean nothing):

    FusedExperts     fused_experts(x, w_gate_up, w_down, topk_ids, topk_weights)   random top-k routing
    FusedMoeForward  fused_moe_forward(...) with the model's routing               routing included
    MoeRouter        moe_router(...) with the model's routing                      logits, ids, weights

The baseline ("Ref" and "Speedup" in the runner's table): the runner times verify_<workload> as the reference
implementation, so verify_* runs what a transformers user runs instead of this kernel, in the same dtype on the same
device: transformers' own experts function (`grouped_mm` of transformers.integrations.moe, the default experts
implementation of its MoE models) on a module holding these weights, or, where transformers does not import, the
per-expert loop of its eager experts; the router is transformers' (linear, softmax in fp32 or DeepSeek-V3's sigmoid
with group-limited top-k) in plain torch. Speedup = baseline time / kernel time. FusedMoeForward's baseline runs that
router, then the experts on the kernel's routing, so the two outputs compare where a bf16 near-tie picks another
expert. verify_* returns the baseline's output for the runner's check, torch.allclose(out, baseline, atol=1e-2).

Verification against the float64 references the loaded kernel ships (`kernel.reference`, i.e.
moe_dispatch.reference, the ones the tests use), once per output, in the first verify_* call (the runner's warmup
calls, so outside the timed one unless --warmup 0): the output with reference.assert_close (the TOLERANCE table,
norm-wise; it raises naming the worst element) and the routing with reference.routing_agreement. Inputs are scaled so
outputs are O(0.1), where the runner's atol is below the tolerance.

Quick mode for CPUs: MOE_DISPATCH_BENCH_QUICK=1 keeps one small workload per class (3 in all, T = 2 on the CPU), for
a plumbing run in seconds: `MOE_DISPATCH_BENCH_QUICK=1 TRITON_INTERPRET=1 kernels benchmark . --iterations 3
--warmup 1`.
"""

import importlib.util
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from kernels.benchmark import Benchmark


def _model_shapes():
    """benchmarks/model_shapes.py, the module already imported under that name (tests, scripts) if there is one."""
    if "model_shapes" not in sys.modules:
        spec = importlib.util.spec_from_file_location("model_shapes", Path(__file__).with_name("model_shapes.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["model_shapes"] = module
        spec.loader.exec_module(module)
    return sys.modules["model_shapes"]


# `kernels benchmark` execs this file by path, nothing of the repository on sys.path: the shapes load from beside it.
model_shapes = _model_shapes()

ON_GPU_TOKENS = {"decode": 16, "prefill": 1024}  # T per workload kind on a GPU; the CPU runs T = 5 and 12
ON_CPU_TOKENS = {"decode": 5, "prefill": 12}
QUICK = os.environ.get("MOE_DISPATCH_BENCH_QUICK", "0") not in ("", "0")  # one workload per class, fewer tokens
QUICK_CPU_TOKENS = 2


def transformers_experts_function():
    """transformers' `grouped_mm` experts function, or None where transformers does not import."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _default_apply_gate
    except ImportError:
        return None, None
    return ALL_EXPERTS_FUNCTIONS.get("grouped_mm"), _default_apply_gate


class TransformersExperts(torch.nn.Module):
    """What transformers' experts functions read from an experts module (the attributes its experts decorator sets),
    holding the benchmark's weights: `[E, 2F, H]` gate then up, `[E, H, F]`, SiLU. scripts/bench_host.py uses it too."""

    def __init__(self, w_gate_up, w_down, apply_gate):
        super().__init__()
        self.num_experts, self.intermediate_dim, self.hidden_dim = w_gate_up.shape[0], w_down.shape[2], w_down.shape[1]
        self.gate_up_proj = torch.nn.Parameter(w_gate_up, requires_grad=False)
        self.down_proj = torch.nn.Parameter(w_down, requires_grad=False)
        self.act_fn = torch.nn.SiLU()
        self.has_gate, self.has_bias, self.is_transposed, self.is_concatenated = True, False, False, True
        self.has_post_expert_norm = False
        self._is_expert_parallel = False
        self._apply_gate = apply_gate.__get__(self)


def eager_experts(x, w_gate_up, w_down, topk_ids, topk_weights):
    """transformers' eager experts: a loop over the experts hit, in the input dtype."""
    out = torch.zeros_like(x)
    F_ = w_down.shape[2]
    for e in topk_ids.unique().tolist():
        token, slot = torch.where(topk_ids == e)
        gate_up = x[token] @ w_gate_up[e].T
        h = F.silu(gate_up[:, :F_]) * gate_up[:, F_:]
        out.index_add_(0, token, (h @ w_down[e].T) * topk_weights[token, slot, None].to(x.dtype))
    return out


def torch_router(x, router_weight, shape, router_bias=None, e_score_correction_bias=None):
    """transformers' routers in plain torch -> (ids [T, k], weights [T, k] in x's dtype, logits [T, E]): Mixtral /
    Qwen-MoE (softmax in fp32, top-k, optional renormalisation) and DeepSeek-V3 (sigmoid in fp32, selection bias,
    group-limited top-k, renormalisation, scaling)."""
    if shape.gating == "sigmoid":
        logits = F.linear(x.float(), router_weight.float())
        scores = logits.sigmoid()
        choice = scores + e_score_correction_bias if e_score_correction_bias is not None else scores
        if shape.n_group:
            T, E = choice.shape
            group_scores = choice.view(T, shape.n_group, -1).topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(shape.topk_group, dim=-1).indices, 1)
            choice = choice.masked_fill(keep.repeat_interleave(E // shape.n_group, dim=1) == 0, 0.0)
        ids = choice.topk(shape.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if shape.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, (weights * shape.routed_scaling_factor).to(x.dtype), logits.to(x.dtype)
    logits = F.linear(x, router_weight, router_bias)
    weights, ids = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(shape.top_k, dim=-1)
    if shape.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights.to(x.dtype), logits


class _Layer:
    """One model layer's tensors on the runner's device (a mixin: the runner only runs Benchmark subclasses)."""

    seed = 0

    def make(self, model, kind, experts=True):
        on_gpu = self.device != "cpu"
        shape = model_shapes.MODEL_SHAPES[model]
        self.shape = shape if on_gpu else model_shapes.shrunk(shape)
        self.dtype = torch.bfloat16 if on_gpu else torch.float32
        T = (ON_GPU_TOKENS if on_gpu else ON_CPU_TOKENS)[kind]
        if QUICK and not on_gpu:
            T = QUICK_CPU_TOKENS
        E, H, F = self.shape.num_experts, self.shape.hidden, self.shape.ffn

        def randn(*size, scale=1.0, dtype=self.dtype):
            return torch.randn(*size, device=self.device, dtype=dtype).mul_(scale)

        # gate/up pre-activations O(1), expert outputs O(0.1), router logits O(0.1) (see the module docstring)
        self.x = randn(T, H)
        if experts:
            self.w_gate_up = randn(E, 2 * F, H, scale=H**-0.5)
            self.w_down = randn(E, H, F, scale=0.2 * F**-0.5)
            self.w_gate, self.w_up = self.w_gate_up.split(F, dim=1)  # views: fused_moe_forward's seed layout
        self.router_weight = randn(E, H, scale=0.1 * H**-0.5)
        self.router_kwargs = dict(self.shape.routing_kwargs())
        if self.shape.router_bias:
            self.router_kwargs["router_bias"] = randn(E, scale=0.1)
        if self.shape.score_correction_bias:
            self.router_kwargs["e_score_correction_bias"] = randn(E, scale=0.01, dtype=torch.float32)
        scores = torch.rand(T, E, device=self.device)
        self.topk_ids = scores.topk(self.shape.top_k, dim=1).indices
        self.topk_weights = torch.rand(T, self.shape.top_k, device=self.device).softmax(dim=1)
        self._verified = None  # the output last checked against the float64 references
        if experts:
            function, apply_gate = transformers_experts_function()
            self._experts_module = (TransformersExperts(self.w_gate_up, self.w_down, apply_gate)
                                    if function is not None else None)
            self._experts_function = function

    def baseline_experts(self, ids, weights):
        """transformers' experts path on this layer (its eager loop where transformers does not import)."""
        if self._experts_function is not None:
            return self._experts_function(self._experts_module, self.x, ids, weights.to(self.dtype))
        return eager_experts(self.x, self.w_gate_up, self.w_down, ids, weights)

    def baseline_router(self):
        return torch_router(self.x, self.router_weight, self.shape, self.router_kwargs.get("router_bias"),
                            self.router_kwargs.get("e_score_correction_bias"))

    def verify_once(self, check):
        """check() -- the float64 verification -- for each new output only, so repeated verify_* calls (the runner's
        warmup, then the timed one) time the baseline alone."""
        if self._verified is not self.out:
            check()
            self._verified = self.out

    @property
    def reference(self):
        """The float64 references the kernel under test ships (moe_dispatch.reference)."""
        return self.kernel.reference

    def checked(self, out, ref, what):
        self.reference.assert_close(out, ref, self.dtype, what)
        return ref.to(out.dtype)

    def check_routing(self, ids, weights):
        """The kernel's experts agree with the float64 router's; where they do, so do the weights."""
        reference = self.reference
        ref_ids, ref_weights, ref_logits = reference.moe_router_ref(
            self.x, self.router_weight, self.shape.top_k, self.shape.gating, **self.router_kwargs)
        agreement = reference.routing_agreement(ids, ref_ids)
        assert agreement >= reference.ROUTING_AGREEMENT_MIN, f"routing agrees on {agreement:.3f} of the tokens"
        same = (ids.sort(-1).values == ref_ids.sort(-1).values).all(-1)
        order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
        reference.assert_close(weights.gather(1, order)[same], ref_weights.gather(1, ref_order)[same], self.dtype,
                               "routing weights")
        return ref_logits


class FusedExperts(_Layer, Benchmark):
    def setup_mixtral_decode(self):
        self.make("mixtral-8x7b", "decode")

    def setup_qwen3_prefill(self):
        self.make("qwen3-30b-a3b", "prefill")

    def run(self):
        self.out = self.kernel.fused_experts(self.x, self.w_gate_up, self.w_down, self.topk_ids, self.topk_weights)

    def verify(self):
        def check():
            ref = self.reference.fused_experts_ref(self.x, self.w_gate_up, self.w_down, self.topk_ids,
                                                   self.topk_weights)
            self.checked(self.out, ref, "fused_experts")

        self.verify_once(check)
        return self.baseline_experts(self.topk_ids, self.topk_weights)



class FusedMoeForward(_Layer, Benchmark):
    def setup_mixtral_prefill(self):
        self.make("mixtral-8x7b", "prefill")

    def setup_deepseek_v3_decode(self):
        self.make("deepseek-v3", "decode")

    def run(self):
        self.out, self.ids, self.weights = self.kernel.fused_moe_forward(
            self.x, self.router_weight, self.w_gate, self.w_up, self.w_down, self.shape.num_experts,
            self.shape.top_k, self.shape.gating, **self.router_kwargs)

    def verify(self):
        """The experts against float64 with the kernel's own routing (a near-tie may pick another expert in bf16),
        and that routing against the float64 router; then the baseline: transformers' router, and its experts on the
        kernel's routing."""
        def check():
            self.check_routing(self.ids, self.weights)
            ref = self.reference.experts_ref(self.x, self.w_gate, self.w_up, self.w_down, self.ids,
                                             self.weights.float())
            self.checked(self.out, ref, "fused_moe_forward")

        self.verify_once(check)
        self.baseline_router()
        return self.baseline_experts(self.ids, self.weights)


class MoeRouter(_Layer, Benchmark):
    def setup_qwen3_prefill(self):
        self.make("qwen3-30b-a3b", "prefill", experts=False)

    def setup_deepseek_v3_prefill(self):
        self.make("deepseek-v3", "prefill", experts=False)

    def run(self):
        self.ids, self.weights, self.out = self.kernel.moe_router(
            self.x, self.router_weight, self.shape.top_k, self.shape.gating, **self.router_kwargs)

    def verify(self):
        def check():
            ref_logits = self.check_routing(self.ids, self.weights)
            self.checked(self.out, ref_logits, "router logits")

        self.verify_once(check)
        return self.baseline_router()[2]


# The workloads: benchmark_<name> times the kernel, verify_<name> the baseline (after the float64 check); the runner
# finds them by name. QUICK keeps the first of each class.
WORKLOADS = {
    FusedExperts: ("mixtral_decode", "qwen3_prefill"),
    FusedMoeForward: ("deepseek_v3_decode", "mixtral_prefill"),
    MoeRouter: ("qwen3_prefill", "deepseek_v3_prefill"),
}
for _cls, _names in WORKLOADS.items():
    for _name in _names[:1] if QUICK else _names:
        setattr(_cls, f"benchmark_{_name}", _cls.run)
        setattr(_cls, f"verify_{_name}", _cls.verify)
del _cls, _names, _name
