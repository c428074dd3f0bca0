"""CP load balancers behind one interface, and the one registry of them (torch only).

A load balancer decides which tokens of a ``[B, L]`` microbatch row each of ``W`` CP ranks owns:
its rearrange index puts row ``b`` in the order ``row[index[b]]`` and rank ``r`` keeps the
``r``-th of ``W`` equal chunks. Everything else asks the balancer:

* the host and readback sources (``routing.sources``) call :meth:`LoadBalancer.indices`, and
  reuse one layout per batch shape unless :attr:`LoadBalancer.depends_on_documents`;
* the compile caps (``compile.py``) ask :meth:`LoadBalancer.runs_per_row`;
* config validation (``validate.py``) and the layouts ask :meth:`LoadBalancer.check`, the
  one place a balancer's ``training.seq_len`` divisibility rule lives.

Adding one: subclass :class:`LoadBalancer`, decorate it with :func:`register`, and give it a
test next to the others (docs/architecture.md, "Adding a load balancer").
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor
from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
    _HeadTailLoadBalancer,
)

from .documents import (
    block_document_starts,
    block_document_starts_from_positions,
    visible_key_blocks,
)

__all__ = [
    "BALANCER_KEY",
    "LoadBalancer",
    "balancer_names",
    "check_divisible",
    "get_balancer",
    "register",
]

# The config key that names the balancer (torchtitan's; None there means contiguous).
BALANCER_KEY = "parallelism.context_parallel_load_balancer"
# The key of the CP world every rule below divides by.
WORLD_KEY = "context_parallel_degree"


def check_divisible(seq_len: int, rules: Sequence[tuple[int, str]], context: str) -> None:
    """Raise one ``ValueError`` line if ``seq_len`` is not a multiple of every ``(multiple, why)``
    rule (``why`` names the config keys, e.g. ``"2 x context_parallel_degree (2)"``); the
    message ends with the nearest valid lengths. ``context`` says whose rule it is."""
    rules = [(m, why) for m, why in rules if m > 1]
    need = math.lcm(*(m for m, _ in rules)) if rules else 1
    if seq_len % need == 0:
        return
    lower, upper = seq_len - seq_len % need, seq_len - seq_len % need + need
    hint = f"{lower} or {upper}" if lower else f"{upper}"
    whys = " and by ".join(why for _, why in rules)
    raise ValueError(
        f"training.seq_len ({seq_len}) must be divisible by {whys} {context}: use {hint}"
    )


@dataclass(frozen=True)
class LoadBalancer(ABC):
    """One CP load balancer. Frozen and hashable: layouts are cached per balancer and shape.

    ``name``: its value of ``parallelism.context_parallel_load_balancer``.
    ``depends_on_documents``: its order follows the document layout of the microbatch (False:
    the order depends only on ``(L, W)``, so the sources compute it once per shape).
    """

    name: ClassVar[str]
    depends_on_documents: ClassVar[bool]

    @classmethod
    def from_options(cls, **options: int) -> LoadBalancer:
        """The balancer from the ``linear_attention`` options; by default it takes none."""
        return cls()

    def multiple(self, world: int) -> tuple[int, str]:
        """``(m, why)``: ``training.seq_len`` must be a multiple of ``m`` at CP degree
        ``world``; ``why`` spells ``m`` in config keys. Every balancer needs equal chunks."""
        return world, f"{WORLD_KEY} ({world})"

    def check(self, seq_len: int, world: int, *, also: Sequence[tuple[int, str]] = ()) -> None:
        """A ``ValueError`` naming the config keys unless ``seq_len`` suits this balancer at
        CP degree ``world`` (and the caller's own rules ``also``, in the same message)."""
        if world < 1 or seq_len < 1:
            raise ValueError(f"training.seq_len ({seq_len}) and {WORLD_KEY} ({world}) must be >= 1")
        rules = [self.multiple(world)] if world > 1 else []
        check_divisible(
            seq_len, [*rules, *also], f"for {BALANCER_KEY.split('.')[-1]} = {self.name}"
        )

    def indices(
        self,
        positions: Tensor,
        world: int,
        device: torch.device | str,
        *,
        cu_seqlens: Tensor | None = None,
    ) -> Tensor | None:
        """Rearrange index ``[1 or B, L]`` int64 on ``device`` for ``positions [B, L]`` (any
        device; a balancer that ignores the documents reads only its shape), or None for the
        identity. One rank (``world == 1``) never reorders. ``cu_seqlens [D + 1]``: the global
        document boundaries of these positions when the caller has them (the host metadata);
        a balancer that follows the documents then reads them instead of the positions."""
        seq_len = positions.shape[1]
        self.check(seq_len, world)
        if world == 1:
            return None
        return self._indices(positions, world, device, cu_seqlens=cu_seqlens)

    @abstractmethod
    def _indices(
        self,
        positions: Tensor,
        world: int,
        device: torch.device | str,
        *,
        cu_seqlens: Tensor | None = None,
    ) -> Tensor | None:
        """``indices`` for ``world > 1`` and a checked ``seq_len``."""

    @abstractmethod
    def runs_per_row(self, seq_len: int, world: int) -> int:
        """Most contiguous token runs one rank can own in one row (``world > 1``): the geometry
        the compile caps bound fragments and predecessors by."""


_REGISTRY: dict[str, type[LoadBalancer]] = {}
_RESOLVED: dict[object, LoadBalancer] = {}  # get_balancer's answers (balancers are immutable)


def register(cls: type[LoadBalancer]) -> type[LoadBalancer]:
    """Class decorator: make ``cls`` selectable by its ``name``."""
    if cls.name in _REGISTRY:
        raise ValueError(f"a load balancer named {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    _RESOLVED.clear()
    return cls


def balancer_names() -> tuple[str, ...]:
    """The registered names, in registration order."""
    return tuple(_REGISTRY)


def get_balancer(name: str | LoadBalancer | None, **options: int) -> LoadBalancer:
    """The balancer a config names (None = contiguous, torchtitan's convention), built from the
    ``linear_attention`` options it reads (e.g. ``ptrr_block_size=128``; the others ignore
    them); an instance passes through. Resolved once per (name, options): the sources call
    this for every microbatch."""
    if name is not None and type(name) is not str:
        if isinstance(name, LoadBalancer):
            return name
        raise TypeError(f"{BALANCER_KEY} must be a name or a LoadBalancer, got {name!r}")
    key = (name, *options.items()) if options else name
    balancer = _RESOLVED.get(key)
    if balancer is None:
        cls = _REGISTRY.get(name or "contiguous")
        if cls is None:
            choices = ", ".join(_REGISTRY)
            raise ValueError(f"{BALANCER_KEY} must be one of {choices}, got {name!r}")
        balancer = _RESOLVED[key] = cls.from_options(**options)
    return balancer


@register
@dataclass(frozen=True)
class Contiguous(LoadBalancer):
    """Plain ``Shard(seq_dim)``: rank ``r`` owns chunk ``r`` of every row."""

    name: ClassVar[str] = "contiguous"
    depends_on_documents: ClassVar[bool] = False

    def _indices(self, positions, world, device, *, cu_seqlens=None) -> None:  # see the base
        return None

    def runs_per_row(self, seq_len: int, world: int) -> int:
        return 1


@register
@dataclass(frozen=True)
class HeadTail(LoadBalancer):
    """torch's head-tail balancer: rank ``r`` owns chunks ``r`` and ``2W - 1 - r`` of each row."""

    name: ClassVar[str] = "headtail"
    depends_on_documents: ClassVar[bool] = False

    def multiple(self, world: int) -> tuple[int, str]:
        return 2 * world, f"2 x {WORLD_KEY} ({world})"

    def _indices(self, positions, world, device, *, cu_seqlens=None) -> Tensor:  # see the base
        return _HeadTailLoadBalancer(positions.shape[1], world, device)._generate_indices()

    def runs_per_row(self, seq_len: int, world: int) -> int:
        return 2


@register
@dataclass(frozen=True)
class PTRR(LoadBalancer):
    """torch's PTRR balancer (``_PTRRLoadBalancer``) over the causal document mask in blocks of
    ``block_size`` tokens (``linear_attention.ptrr_block_size``): its order follows the documents.

    It reproduces torch's index exactly without building the mask: a query block's work is the
    number of key blocks it sees (full and partial alike), which follows from where the
    document of its first token starts (``routing.documents.visible_key_blocks``), so the cost
    grows with blocks + documents, not with ``L x L``. ``tests/test_ptrr_documents.py`` checks
    it against torch's balancer on the dense ``BlockMask``."""

    name: ClassVar[str] = "ptrr"
    depends_on_documents: ClassVar[bool] = True
    block_size: int = 128

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(
                f"linear_attention.ptrr_block_size must be >= 1, got {self.block_size}"
            )

    @classmethod
    def from_options(cls, **options: int) -> LoadBalancer:
        return cls(block_size=options.get("ptrr_block_size", 128))

    def multiple(self, world: int) -> tuple[int, str]:
        return (
            self.block_size * world,
            f"ptrr_block_size x {WORLD_KEY} ({self.block_size} x {world})",
        )

    def _indices(self, positions, world, device, *, cu_seqlens=None) -> Tensor:  # see the base
        bsz, seqlen = positions.shape
        if cu_seqlens is not None:  # host: one search per block in the document boundaries
            starts = block_document_starts(cu_seqlens, bsz, seqlen, self.block_size)
        else:  # readback: from the positions where they are, without a host copy
            starts = block_document_starts_from_positions(positions, self.block_size)
        work = visible_key_blocks(starts, self.block_size)
        return self._schedule(work, world).to(device)

    def _schedule(self, work: Tensor, world: int) -> Tensor:
        """torch's PTRR order of the ``[B, NB]`` blocks by ``work``, as a token index ``[B, L]``.

        Per row: blocks sorted by work, heaviest first (ties keep block order: a stable sort);
        dealt out in rounds of ``world``, rank ``r`` taking the ``r``-th block of even rounds
        and the ``r``-th from the end of odd ones; each rank's blocks back in row order, rank
        after rank."""
        bsz, blocks = work.shape
        order = torch.sort(work, dim=1, descending=True, stable=True).indices
        rounds = order.view(bsz, blocks // world, world)
        rounds[:, 1::2] = rounds[:, 1::2].flip(-1)
        per_rank = rounds.transpose(1, 2).sort(dim=2).values.reshape(bsz, blocks, 1)
        tokens = torch.arange(self.block_size, device=work.device)
        return (per_rank * self.block_size + tokens).reshape(bsz, blocks * self.block_size)

    def runs_per_row(self, seq_len: int, world: int) -> int:
        # Whole blocks, and one run may straddle into the next rank's chunk.
        return math.ceil(seq_len / (world * self.block_size)) + 1
