"""LRU cache of routing plans, keyed by the full layout so a stale plan is never returned."""

from __future__ import annotations

import array
from collections import OrderedDict
from collections.abc import Sequence

from torch import Tensor

from .layouts import int_tensor
from .plan import RoutingPlan

__all__ = ["PlanCache"]


def _int64_bytes(t: Tensor) -> bytes:
    try:
        return t.numpy().tobytes()
    except RuntimeError:  # torch built without numpy: slower, same bytes
        return array.array("q", t.tolist()).tobytes()


CacheKey = tuple[bytes, tuple[tuple[tuple[int, int], ...], ...], int]


class PlanCache:
    """Least-recently-used cache of :class:`RoutingPlan` (``capacity`` >= 1 plans).

    The key holds every document boundary, every rank's fragments and the rank *by value*, so
    editing a tensor in place or changing any one of them is a miss (unlike caching by tensor
    identity). ``stats()`` reports hits, misses and evictions.
    """

    def __init__(self, capacity: int = 16) -> None:
        if capacity < 1:
            raise ValueError(f"PlanCache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._plans: OrderedDict[CacheKey, RoutingPlan] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    @staticmethod
    def key(
        cu_seqlens: Sequence[int] | Tensor,
        fragments: Sequence[Sequence[tuple[int, int]]],
        rank: int,
    ) -> CacheKey:
        """The value key of a layout: the boundaries' int64 bytes (hashing 16k boundaries as
        bytes costs microseconds, a tuple of Python ints a millisecond), every fragment, rank."""
        if isinstance(cu_seqlens, Tensor):
            cu_key = _int64_bytes(int_tensor(cu_seqlens).contiguous())
        else:
            cu_key = array.array("q", cu_seqlens).tobytes()
        frag_key = tuple(tuple((int(a), int(b)) for a, b in frags) for frags in fragments)
        return cu_key, frag_key, int(rank)

    def get(
        self,
        cu_seqlens: Sequence[int] | Tensor,
        fragments: Sequence[Sequence[tuple[int, int]]],
        rank: int,
    ) -> RoutingPlan:
        """The cached plan for this layout, building (and maybe evicting) on a miss."""
        key = self.key(cu_seqlens, fragments, rank)
        plan = self._plans.get(key)
        if plan is not None:
            self.hits += 1
            self._plans.move_to_end(key)
            return plan
        self.misses += 1
        plan = RoutingPlan.build(cu_seqlens, key[1], key[2])
        self._plans[key] = plan
        if len(self._plans) > self.capacity:
            self._plans.popitem(last=False)
            self.evictions += 1
        return plan

    def __contains__(self, key: object) -> bool:
        return key in self._plans

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        """Drop every plan (counters are kept)."""
        self._plans.clear()

    def stats(self) -> dict[str, int]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "size": len(self._plans),
            "capacity": self.capacity,
        }
