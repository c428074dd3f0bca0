"""Context-parallel ops over arbitrary fragment layouts: one all-gather per layer, or pass-KV
point-to-point rounds for attention (docs/cp.md)."""

from .attention import context_parallel_attention, document_causal_mask
from .conv_halo import context_parallel_conv_history
from .delta_rule import context_parallel_delta_rule
from .flex_mask import FLEX_BLOCK_SIZE, LayoutOrder, check_flex_shape, flex_document_mask
from .pass_kv import PassKVTrace, pass_kv_attention

__all__ = [
    "FLEX_BLOCK_SIZE",
    "LayoutOrder",
    "PassKVTrace",
    "check_flex_shape",
    "context_parallel_attention",
    "context_parallel_conv_history",
    "context_parallel_delta_rule",
    "document_causal_mask",
    "flex_document_mask",
    "pass_kv_attention",
]
