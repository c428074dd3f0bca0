"""Rotary position embedding at document-relative positions."""

from __future__ import annotations

import torch

from torchtitan_cp.ops.common.dtypes import compute_dtype

__all__ = ["apply_rope"]


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of ``x [1, T, H, D]`` at document-relative ``positions [T]``."""
    half = x.shape[-1] // 2
    acc = compute_dtype(x.dtype)
    inv_freq = theta ** (-torch.arange(0, half, device=x.device, dtype=acc) / half)
    angles = positions.to(acc)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = x.to(acc)[..., :half], x.to(acc)[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
