"""Context-parallel ops: one all-gather per layer, arbitrary fragment layouts (docs/cp.md)."""

from .delta_rule import context_parallel_delta_rule

__all__ = ["context_parallel_delta_rule"]
