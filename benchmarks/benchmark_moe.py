"""Benchmarks in the Hub's convention: `kernels benchmark moe-dispatch/moe-dispatch@v1` (branch v1 ships this folder),
or `kernels benchmark <folder>` with the folder holding build/ (scripts/build) and benchmarks/, e.g. a checkout.
Needs kernels >= 0.17 with its `benchmark` extra (tabulate).

Three classes, one per entry point, two workloads each; a workload is a model layer of benchmarks/model_shapes.py at
a token count T, real size in bf16 on a GPU, shrunk (`model_shapes.shrunk`) in fp32 on the CPU, where Triton's
interpreter runs the kernels (set TRITON_INTERPRET=1; the times then mean nothing):

    FusedExperts     fused_experts(x, w_gate_up, w_down, topk_ids, topk_weights)   random top-k routing
    FusedMoeForward  fused_moe_forward(...) with the model's routing               routing included
    MoeRouter        moe_router(...) with the model's routing                      logits, ids, weights

Verification against the float64 references of reference.py (the ones the tests use): verify_<workload> checks
the output with reference.assert_close (the TOLERANCE table, norm-wise; it raises naming the worst element) and
the routing with reference.routing_agreement, then returns the reference in the output's dtype for the runner's own
check, torch.allclose(out, ref, atol=1e-2). Inputs are scaled so outputs are O(0.1), where that check is below the
tolerance. The runner times verify_* as "Ref": the float64 reference, not a competing kernel.

The runner executes this file by path (module "benchmark_module") with neither a package nor this folder on
sys.path, so its two helper modules are loaded by path from beside it (`_beside`); where benchmarks/ is on sys.path
(tests, scripts) that gives the very modules `import reference` gives.
"""

import importlib.util
import sys
from pathlib import Path

import torch
from kernels.benchmark import Benchmark


def _beside(name):
    """benchmarks/<name>.py as module `name` (the one already imported under that name, if any)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


reference = _beside("reference")
model_shapes = _beside("model_shapes")

ON_GPU_TOKENS = {"decode": 16, "prefill": 1024}  # T per workload kind on a GPU; the CPU runs T = 5 and 12
ON_CPU_TOKENS = {"decode": 5, "prefill": 12}


class _Layer:
    """One model layer's tensors on the runner's device (a mixin: the runner only runs Benchmark subclasses)."""

    seed = 0

    def make(self, model, kind, experts=True):
        on_gpu = self.device != "cpu"
        shape = model_shapes.MODEL_SHAPES[model]
        self.shape = shape if on_gpu else model_shapes.shrunk(shape)
        self.dtype = torch.bfloat16 if on_gpu else torch.float32
        T = (ON_GPU_TOKENS if on_gpu else ON_CPU_TOKENS)[kind]
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

    def checked(self, out, ref, what):
        reference.assert_close(out, ref, self.dtype, what)
        return ref.to(out.dtype)

    def check_routing(self, ids, weights):
        """The kernel's experts agree with the float64 router's; where they do, so do the weights."""
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
        ref = reference.fused_experts_ref(self.x, self.w_gate_up, self.w_down, self.topk_ids, self.topk_weights)
        return self.checked(self.out, ref, "fused_experts")

    benchmark_mixtral_decode = benchmark_qwen3_prefill = run
    verify_mixtral_decode = verify_qwen3_prefill = verify


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
        and that routing against the float64 router."""
        self.check_routing(self.ids, self.weights)
        ref = reference.experts_ref(self.x, self.w_gate, self.w_up, self.w_down, self.ids, self.weights.float())
        return self.checked(self.out, ref, "fused_moe_forward")

    benchmark_mixtral_prefill = benchmark_deepseek_v3_decode = run
    verify_mixtral_prefill = verify_deepseek_v3_decode = verify


class MoeRouter(_Layer, Benchmark):
    def setup_qwen3_prefill(self):
        self.make("qwen3-30b-a3b", "prefill", experts=False)

    def setup_deepseek_v3_prefill(self):
        self.make("deepseek-v3", "prefill", experts=False)

    def run(self):
        self.ids, self.weights, self.out = self.kernel.moe_router(
            self.x, self.router_weight, self.shape.top_k, self.shape.gating, **self.router_kwargs)

    def verify(self):
        ref_logits = self.check_routing(self.ids, self.weights)
        return self.checked(self.out, ref_logits, "router logits")

    benchmark_qwen3_prefill = benchmark_deepseek_v3_prefill = run
    verify_qwen3_prefill = verify_deepseek_v3_prefill = verify
