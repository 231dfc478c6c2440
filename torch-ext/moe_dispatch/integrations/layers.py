"""Layers for `kernels.kernelize`: drop-in forwards for transformers' MoE blocks.

`kernelize` binds a layer's `forward` to the original module, so these classes hold no state: no `__init__`, no
members but `forward`, `can_torch_compile` and `has_backward`, and every `forward` has the original's parameters.
The attributes each forward reads from the module it replaces are annotated in the class body.

Each block still calls its own router module, so router-logit hooks, `output_router_logits` and aux losses see
exactly what they would without the kernel; the expert FFNs go through `moe_dispatch_experts`.

- `MegaBlocksMoeMLP`: GPT-OSS's `GptOssMLP`, which transformers already marks with
  `@use_kernel_forward_from_hub("MegaBlocksMoeMLP")`; returns `(out, router_scores)` like the original.
- `SparseMoeBlock`: the top-k sparse MoE blocks of Mixtral, Qwen2-MoE (with its gated shared expert), Qwen3-MoE,
  OLMoE and DeepSeek-V3 (with its shared experts). transformers does not mark these; attach them with
  `kernels.replace_kernel_forward_from_hub(MixtralSparseMoeBlock, "SparseMoeBlock")` before `kernelize`.
"""

import torch
from torch import nn

from .transformers_experts import moe_dispatch_experts


class MegaBlocksMoeMLP(nn.Module):
    """GPT-OSS MoE block: router (top-k of biased logits, softmax over the k), then the experts' clamped SwiGLU."""

    router: nn.Module  # GptOssTopKRouter: (router_logits, router_scores [T, k], router_indices [T, k])
    # GptOssExperts (transposed, interleaved gate/up, biases, alpha / limit), or transformers_experts.Mxfp4Experts (an
    # MXFP4 checkpoint's uint8 blocks and scales as stored)
    experts: nn.Module

    # The experts run as torch custom operators with a registered backward (tests/test_transformers.py trains and
    # compiles through both layers).
    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, hidden_dim)
        _, router_scores, router_indices = self.router(hidden_states)
        out = moe_dispatch_experts(self.experts, hidden_states, router_indices, router_scores)
        return out.reshape(batch_size, sequence_length, hidden_dim), router_scores


class SparseMoeBlock(nn.Module):
    """Top-k sparse MoE block: `gate` (the router), routed `experts`, optional shared expert(s); returns `[B, S, H]`."""

    gate: nn.Module  # router: (router_logits, top_k_weights [T, k], top_k_index [T, k])
    experts: nn.Module  # routed experts in transformers' layout (gate_up_proj [E, 2F, H], down_proj [E, H, F])
    # Optional, by model: `jitter_noise` (Mixtral, training only), `shared_expert` + `shared_expert_gate`
    # (Qwen2-MoE: sigmoid-gated shared expert), `shared_experts` (DeepSeek-V3: added ungated).

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        jitter_noise = getattr(self, "jitter_noise", 0.0)
        if self.training and jitter_noise > 0:
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - jitter_noise, 1.0 + jitter_noise)
        hidden_states = hidden_states.reshape(-1, hidden_dim)
        _, top_k_weights, top_k_index = self.gate(hidden_states)
        out = moe_dispatch_experts(self.experts, hidden_states, top_k_index, top_k_weights)
        shared_expert = getattr(self, "shared_expert", None)
        if shared_expert is not None:
            shared_out = shared_expert(hidden_states)
            shared_gate = getattr(self, "shared_expert_gate", None)
            if shared_gate is not None:
                shared_out = torch.sigmoid(shared_gate(hidden_states)) * shared_out
            out = out + shared_out
        shared_experts = getattr(self, "shared_experts", None)
        if shared_experts is not None:
            out = out + shared_experts(hidden_states)
        return out.reshape(batch_size, sequence_length, hidden_dim)
