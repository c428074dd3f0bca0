"""What the multi-head recurrent mixers (KDA, GDN, retention) share: their config fields, taken
from the decoder's shared sizes, and the FLOPs of a chunked recurrence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

from torchtitan.protocols.module import Module

from torchtitan_cp.ops import Backend
from torchtitan_cp.ops.common.fla import FLA_CHUNK_SIZE

__all__ = ["HeadsConfig", "recurrence_flops"]


@dataclass(kw_only=True, slots=True)
class HeadsConfig(Module.Config):
    """``n_heads`` heads of ``head_dim`` (q, k) and ``value_head_dim`` (v; None: head_dim)
    channels over a model of width ``dim``."""

    dim: int
    n_heads: int
    head_dim: int
    value_head_dim: int | None = None
    norm_eps: float = 1e-5
    layer_id: int = 0
    backend: Backend = "auto"

    @classmethod
    def from_model(cls, cfg: Any, layer_id: int, backend: Backend, **extra: Any) -> Self:
        """This config for layer ``layer_id`` of a ``HybridDecoder.Config`` ``cfg``: its shared
        sizes, the registry's ``backend`` and a subclass's ``extra`` fields."""
        return cls(
            dim=cfg.dim, n_heads=cfg.n_heads, head_dim=cfg.head_dim,
            value_head_dim=cfg.value_head_dim, norm_eps=cfg.norm_eps, layer_id=layer_id,
            backend=backend, **extra,
        )  # fmt: skip

    @property
    def v_dim(self) -> int:
        """Value channels per head."""
        return self.value_head_dim or self.head_dim


def recurrence_flops(heads: int, k: int, v: int) -> int:
    """Training FLOPs per token of a chunked recurrence beyond its parameter matmuls: per head,
    state update and readout ~2·K·V MACs each, plus the intra-chunk work ~chunk·(K+V)."""
    return 6 * heads * (4 * k * v + FLA_CHUNK_SIZE * (k + v))
