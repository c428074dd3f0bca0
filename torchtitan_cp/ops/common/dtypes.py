"""The dtype of recurrent states, summaries and their fold (float32 or better)."""

from __future__ import annotations

import torch

__all__ = ["fold_dtype"]


def fold_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of summaries, fold and entry states: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)
