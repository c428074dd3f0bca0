"""The layer registry: every ``layer_pattern`` letter maps to one ``LayerKind`` here.

A kind names its mixer class, the kernels that class runs (which backends they have, whether
they compile), the recurrence it runs (whose fla kernels may be refused on a machine) and
whether it needs the document ``BlockMask`` of flex attention. The decoder, its
FLOPs count, init, parallelize, the compile check and the backend check only ever ask this table.
A kind's own sizes live in ``LayerOptions`` (``[model.layer_options.<name>]``); a kind that uses
the shared model fields has none (docs/architecture.md, "Adding a layer kind").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from torchtitan.protocols.module import Module

from torchtitan_cp.models.mixers.attention import SoftmaxAttention
from torchtitan_cp.models.mixers.delta_net import (
    GatedDeltaProductMixer,
    GatedDeltaProductOptions,
    GDNMixer,
    KDAMixer,
)
from torchtitan_cp.models.mixers.mamba2 import Mamba2Mixer, Mamba2Options
from torchtitan_cp.models.mixers.retention import RetentionMixer
from torchtitan_cp.ops.common.fla_refusals import fla_backend
from torchtitan_cp.ops.cp import recurrence as recurrences

__all__ = [
    "LAYERS",
    "Kernels",
    "LayerKind",
    "LayerOptions",
    "check_backend",
    "check_tensor_parallel",
    "parse_layer_pattern",
]


@dataclass(kw_only=True, slots=True)
class LayerOptions:
    """``[model.layer_options]``: per-kind sizes that the shared model fields do not cover."""

    mamba2: Mamba2Options = field(default_factory=Mamba2Options)
    """Sizes of the M (Mamba2) layers."""
    gated_delta_product: GatedDeltaProductOptions = field(default_factory=GatedDeltaProductOptions)
    """Sizes of the P (gated DeltaProduct) layers."""


class Mixer(Protocol):
    """What a kind's mixer class offers the registry (``HybridDecoder.Config`` as ``cfg``)."""

    def from_model(self, cfg: Any, layer_id: int, backend: Any, /) -> Module.Config:
        """The mixer's config for layer ``layer_id``, running ``backend`` (already resolved by
        the kind); the mixer's forward is ``(x [B, L, D], ctx, positions [B, L]) -> [B, L, D]``."""
        ...

    def flops(self, cfg: Any, seq_len: int, /) -> int:
        """Training FLOPs per token (forward + backward) beyond its parameter matmuls."""
        ...

    def tensor_parallel_heads(self, cfg: Any, /) -> list[tuple[str, int]]:
        """(config key, count) of each count a TP degree must divide: head counts (Mamba2:
        its B/C groups, each rank holding whole groups with their heads). The mixer's
        ``parallelize_heads(mesh)`` then shards it."""
        ...


@dataclass(frozen=True)
class Kernels:
    """What one family of kernels offers the kinds that run it.

    ``backends``: the ``linear_attention.backend`` values it has (besides ``auto``); empty for a
    kind that does not read that key. ``compiles``: it has ``torch.compile`` custom ops
    (``ops/<family>/custom_ops.py``), so its kinds run under ``compile.enable``.
    """

    backends: tuple[str, ...]
    compiles: bool


DELTA_RULE = Kernels(("torch", "fla"), compiles=True)  # ops/delta_rule (+ ops/conv)
SSD = Kernels(("torch", "fla"), compiles=True)  # ops/ssd (+ ops/conv)
ATTENTION = Kernels((), compiles=True)  # its backend is model.attention_backend


@dataclass(frozen=True)
class LayerKind:
    """One letter of ``layer_pattern``: a name, a description (for errors), its mixer class,
    the kernels it runs, whether it needs the document ``BlockMask`` when flex runs, and the
    registered recurrence (``ops.cp.recurrence.RECURRENCES``) its mixer runs, whose
    ``fla_refusal`` decides where its fla kernels are refused."""

    name: str
    description: str
    mixer: Mixer
    kernels: Kernels
    flex_mask: bool = False
    recurrence: str | None = None

    @property
    def compiles(self) -> bool:
        return self.kernels.compiles

    def backend(self, requested: str) -> str:
        """The backend this kind runs for ``linear_attention.backend = requested``: ``auto``
        picks only what the kind has (both: fla on CUDA, torch elsewhere; one: that one).
        Where fla-core refuses the kernels of its recurrence (``ops.common.fla_refusals``):
        ``auto`` runs torch (one warning), ``fla`` is a ValueError naming the versions."""
        has = self.kernels.backends
        if self.recurrence is not None:
            refusal = recurrences.recurrence(self.recurrence).fla_refusal()
            requested = fla_backend(requested, refusal, f"{self.description} layers")
        if requested != "auto" or not has or set(has) >= {"torch", "fla"}:
            return requested
        return has[0]

    def build(self, cfg: Any, layer_id: int) -> Module.Config:
        """The mixer config of layer ``layer_id`` of the decoder config ``cfg``."""
        return self.mixer.from_model(cfg, layer_id, self.backend(cfg.linear_attention_backend))

    def flops(self, cfg: Any, seq_len: int) -> int:
        return self.mixer.flops(cfg, seq_len)


LAYERS: dict[str, LayerKind] = {
    "K": LayerKind("kda", "KDA (Kimi Delta Attention)", KDAMixer, DELTA_RULE, recurrence="kda"),
    "G": LayerKind("gdn", "GDN (Gated DeltaNet)", GDNMixer, DELTA_RULE, recurrence="gdn"),
    "P": LayerKind(
        "gated_delta_product",
        "gated DeltaProduct",
        GatedDeltaProductMixer,
        DELTA_RULE,
        recurrence="gdp",
    ),
    "A": LayerKind("attention", "softmax attention", SoftmaxAttention, ATTENTION, flex_mask=True),
    "M": LayerKind("mamba2", "Mamba2 (SSD)", Mamba2Mixer, SSD, recurrence="ssd"),
    "R": LayerKind("retention", "RetNet retention", RetentionMixer, SSD, recurrence="ssd"),
}


def parse_layer_pattern(pattern: str) -> list[str]:
    """``"KKGA"`` -> ``["kda", "kda", "gdn", "attention"]``; an unknown letter is a ValueError."""
    letters = ", ".join(f"{c} ({k.description})" for c, k in LAYERS.items())
    if not pattern:
        raise ValueError(f"model.layer_pattern must not be empty (use letters {letters})")
    bad = sorted({c for c in pattern if c not in LAYERS})
    if bad:
        raise ValueError(
            f"model.layer_pattern {pattern!r} has unknown layer letter(s) {', '.join(bad)}; "
            f"use {letters}"
        )
    return [LAYERS[c].name for c in pattern]


def check_backend(pattern: str, backend: str) -> None:
    """A ValueError naming the key, the letter and what it has when a kind of ``pattern`` has
    no ``backend`` kernel (``auto`` fits every kind)."""
    if backend == "auto":
        return
    for c in dict.fromkeys(pattern):
        kind = LAYERS[c]
        has = kind.kernels.backends
        if has and backend not in has:
            raise ValueError(
                f"linear_attention.backend = {backend!r}: layer {c} ({kind.description}) has no "
                f"{backend} kernel, only {' and '.join(has)}; use 'auto' or one of those"
            )


def check_tensor_parallel(cfg: Any, tp: int) -> None:
    """A ValueError (one line: the key, the letter, what would work) when the decoder config
    ``cfg`` cannot shard its heads over ``tp`` ranks: a head (or Mamba2 group) count the degree
    does not divide."""
    if tp == 1:
        return
    for c in dict.fromkeys(cfg.layer_pattern):
        for key, heads in LAYERS[c].mixer.tensor_parallel_heads(cfg):
            if heads % tp:
                fits = [d for d in range(1, heads + 1) if heads % d == 0]
                raise ValueError(
                    f"parallelism.tensor_parallel_degree = {tp} does not divide {key} = {heads} "
                    f"(layer {c}, {LAYERS[c].description}): TP ranks hold whole heads (Mamba2: "
                    f"whole B/C groups with their heads); use a degree in {fits}"
                )
