"""Delta-rule, short-convolution and attention ops: local kernels and their context-parallel
versions (docs/CONTRACTS.md, docs/cp.md)."""

from .distributed import (
    check_flex_shape,
    context_parallel_attention,
    context_parallel_conv_history,
    context_parallel_delta_rule,
    flex_document_mask,
    pass_kv_attention,
)
from .local import Backend, Kind, causal_conv1d, chunk_delta_rule

__all__ = [
    "Backend",
    "Kind",
    "causal_conv1d",
    "check_flex_shape",
    "chunk_delta_rule",
    "context_parallel_attention",
    "context_parallel_conv_history",
    "context_parallel_delta_rule",
    "flex_document_mask",
    "pass_kv_attention",
]
