"""Torch op namespace of a source checkout (`torch-ext/`). Every build replaces this file with a generated one that
names the build's own namespace (scripts/build, kernel-builder), so two loaded builds never share an operator."""

import torch

NAMESPACE = "_moe_dispatch_source"

ops = getattr(torch.ops, NAMESPACE)


def add_op_namespace_prefix(op_name: str) -> str:
    """Qualify `op_name` with this build's namespace (for `torch.library.custom_op` / `triton_op` names)."""
    return f"{NAMESPACE}::{op_name}"
