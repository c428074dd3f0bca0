"""What the multi-head recurrent mixers (KDA, GDN, retention) share: a config sized by the
decoder's shared fields, the layer registry's hooks, and the FLOPs of a chunked recurrence (and
of softmax attention, its counterpart in the pipeline's cost model). Every mixer of the layer
registry builds its config from the decoder's as they do (``config_from_model``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from torchtitan.protocols.module import Module

from torchtitan_cp.ops import Backend
from torchtitan_cp.ops.common.fla import FLA_CHUNK_SIZE

__all__ = ["HeadsMixer", "attention_flops", "config_from_model", "recurrence_flops"]

C = TypeVar("C", bound=Module.Config)


class HeadsMixer(Module):
    """Base of a mixer with ``n_heads`` heads of ``head_dim`` (q, k) and ``value_head_dim``
    (v; None: head_dim) channels over a model of width ``dim``, and the layer registry's hooks
    (``models.hybrid.layers``). A field a subclass adds to its ``Config`` takes the decoder
    field of the same name (``conv_width``, ``rope_theta``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        n_heads: int
        head_dim: int
        value_head_dim: int | None = None
        norm_eps: float = 1e-5
        layer_id: int = 0
        backend: Backend = "auto"

        @property
        def v_dim(self) -> int:
            """Value channels per head."""
            return self.value_head_dim or self.head_dim

    # Config fields that choose a published variant (set by the model that builds the mixer,
    # e.g. Kimi Linear's); the hybrid decoder leaves them at their defaults, so ``from_model``
    # does not look for decoder fields of these names.
    variant_fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: Config):
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.value_head_dim = config.v_dim
        self.backend = config.backend

    @classmethod
    def from_model(cls, cfg: Any, layer_id: int, backend: Backend) -> HeadsMixer.Config:
        """The mixer of layer ``layer_id`` of a ``HybridDecoder.Config`` ``cfg``, on the
        registry's ``backend``. A field the mixer's ``Config`` adds takes the decoder field of
        the same name where the decoder has one (``rope_theta``), else keeps its default (the
        mixer's own constant)."""
        return config_from_model(
            cls.Config, cfg, layer_id=layer_id, backend=backend, skip=cls.variant_fields
        )

    @staticmethod
    def tensor_parallel_heads(cfg: Any) -> list[tuple[str, int]]:
        """The head counts (config key, count) that ``parallelism.tensor_parallel_degree``
        must divide (the registry's hook; ``parallelize_heads`` shards them)."""
        return [("model.n_heads", cfg.n_heads)]

    @staticmethod
    def flops(cfg: Any, seq_len: int) -> int:
        """Training FLOPs per token beyond the parameter matmuls (``recurrence_flops``)."""
        return recurrence_flops(cfg.n_heads, cfg.head_dim, cfg.value_head_dim or cfg.head_dim)


def config_from_model(
    config_cls: type[C],
    cfg: Any,
    *,
    skip: Iterable[str] = (),
    **given: Any,
) -> C:
    """A mixer's ``config_cls`` for a ``HybridDecoder.Config`` ``cfg``: the fields ``given``;
    every other field that ``cfg`` has a field of the same name for takes its value (``dim``,
    ``norm_eps``, ``rope_theta``, ...); those of ``Module.Config`` (the decoder's own
    ``param_init``, ``sharding_config``) and those in ``skip`` keep their defaults."""
    not_shared = {f.name for f in dataclasses.fields(Module.Config)} | set(skip) | set(given)
    shared = {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(config_cls)
        if f.name not in not_shared and hasattr(cfg, f.name)
    }
    return config_cls(**shared, **given)


def recurrence_flops(heads: int, k: int, v: int) -> int:
    """Training FLOPs per token of a chunked recurrence beyond its parameter matmuls: per head,
    state update and readout ~2·K·V MACs each, plus the intra-chunk work ~chunk·(K+V)."""
    return 6 * heads * (4 * k * v + FLA_CHUNK_SIZE * (k + v))


def attention_flops(heads: int, head_dim: int, seq_len: int, v_head_dim: int | None = None) -> int:
    """Training FLOPs per token of softmax attention beyond its parameter matmuls: QK^T
    (``head_dim`` channels per head) and PV (``v_head_dim``, default ``head_dim``) over the
    causal context of a ``seq_len`` row, documents not masked out (an upper bound), forward and
    backward."""
    v = head_dim if v_head_dim is None else v_head_dim
    return 6 * heads * (head_dim + v) * seq_len
