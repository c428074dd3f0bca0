"""The accumulation dtype of the models' norms and gates."""

from __future__ import annotations

import torch

__all__ = ["upcast"]


def upcast(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: at least float32, float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)
