"""The one dtype rule: what recurrent states, summaries, their fold, gates, norms and kernel
accumulators are computed in."""

from __future__ import annotations

import torch

__all__ = ["compute_dtype"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float32 and narrower floats (bf16, fp16), float64 for float64.

    States, summaries and gates are summed over long ranges, and norms over many channels, so
    they never run in a narrower dtype than float32; float64 inputs keep float64 (the tests'
    1e-10 comparisons)."""
    return torch.promote_types(dtype, torch.float32)
