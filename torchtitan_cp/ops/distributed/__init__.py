"""Context-parallel ops: one all-gather per layer, arbitrary fragment layouts (docs/cp.md)."""

from .attention import context_parallel_attention, document_causal_mask
from .conv_halo import context_parallel_conv_history
from .delta_rule import context_parallel_delta_rule

__all__ = [
    "context_parallel_attention",
    "context_parallel_conv_history",
    "context_parallel_delta_rule",
    "document_causal_mask",
]
