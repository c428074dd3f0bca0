"""PlanCache: value keys, LRU order, counters."""

import pytest
import torch

from torchtitan_cp.routing import PlanCache, RoutingPlan, parse_fragments

CU = [0, 40, 232, 384]
TABLE = parse_fragments("0:96,288:384;96:192,192:288")


def test_hit_on_identical_key():
    cache = PlanCache()
    plan = cache.get(CU, TABLE, 1)
    assert isinstance(plan, RoutingPlan)
    # equal values in other containers (tensor, tuples) are the same key
    again = cache.get(torch.tensor(CU), tuple(tuple(f) for f in TABLE), 1)
    assert again is plan
    assert cache.stats() == {"hits": 1, "misses": 1, "evictions": 0, "size": 1, "capacity": 16}


@pytest.mark.parametrize(
    "cu,table,rank",
    [
        ([0, 41, 232, 384], TABLE, 1),  # one document boundary moved
        ([0, 40, 384], TABLE, 1),  # one boundary removed
        (CU, parse_fragments("0:96,288:384;96:190,190:288"), 1),  # one fragment changed
        (CU, parse_fragments("96:192,192:288;0:96,288:384"), 1),  # ranks swapped
        (CU, parse_fragments("0:96,288:384;192:288,96:192"), 1),  # span order changed
        (CU, TABLE, 0),  # other rank
    ],
)
def test_miss_on_any_change(cu, table, rank):
    cache = PlanCache()
    first = cache.get(CU, TABLE, 1)
    other = cache.get(cu, table, rank)
    assert other is not first
    assert cache.stats()["misses"] == 2 and cache.stats()["hits"] == 0
    assert PlanCache.key(cu, table, rank) != PlanCache.key(CU, TABLE, 1)


def test_in_place_tensor_edit_is_a_miss():
    cache = PlanCache()
    cu = torch.tensor(CU)
    first = cache.get(cu, TABLE, 1)
    cu[1] = 50
    second = cache.get(cu, TABLE, 1)
    assert second is not first and second.subsequences.tolist()[0] == [1, 96, 192]
    assert cache.stats()["misses"] == 2


def test_lru_eviction_order():
    cache = PlanCache(capacity=2)
    a = cache.get(CU, TABLE, 0)
    cache.get(CU, TABLE, 1)
    assert cache.get(CU, TABLE, 0) is a  # touch rank 0: rank 1 is now least recent
    cache.get([0, 384], TABLE, 0)  # evicts rank 1
    assert PlanCache.key(CU, TABLE, 1) not in cache
    assert PlanCache.key(CU, TABLE, 0) in cache
    assert cache.stats() == {"hits": 1, "misses": 3, "evictions": 1, "size": 2, "capacity": 2}
    cache.get(CU, TABLE, 1)  # miss again, evicts rank 0 (older than [0, 384])
    assert PlanCache.key(CU, TABLE, 0) not in cache
    assert cache.stats()["evictions"] == 2 and len(cache) == 2


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        PlanCache(0)


def test_invalid_layout_is_not_cached():
    cache = PlanCache()
    with pytest.raises(ValueError, match="gap"):
        cache.get([0, 10], [[(0, 4)], [(5, 10)]], 0)
    assert len(cache) == 0 and cache.stats()["misses"] == 1
