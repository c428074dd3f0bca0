"""Delta-rule, short-convolution and attention ops: local kernels and their context-parallel
versions (docs/CONTRACTS.md, docs/cp.md)."""

from .attention.flex_mask import check_flex_shape, flex_document_mask
from .attention.pass_kv import pass_kv_attention, pass_kv_attention_op, pass_kv_handle
from .attention.sdpa import context_parallel_attention
from .common.checks import Backend
from .conv.halo import context_parallel_conv_history
from .conv.local import causal_conv1d
from .delta_rule.local import Kind, chunk_delta_rule
from .delta_rule.recurrence import context_parallel_delta_rule

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
    "pass_kv_attention_op",
    "pass_kv_handle",
]
