"""Host-side index plans derived once per DeviceRouting (shared by the CP ops).

The local chunk kernels need the token layout of the summary pass on the host
(``cu_seqlens_cpu``), but DeviceRouting carries ``publish`` / ``frag_last`` on the device
only. Reading them back costs one device->host copy per routing object (free on CPU); the
result is cached on the routing object so the many layers of a model share it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torchtitan_cp.routing import DeviceRouting


@dataclass(frozen=True)
class SummaryPlan:
    """Where the published (successor-continued) last subsequences lie in the local span.

    ``slots [n]``: local slot of each published fragment; ``token_index [L]``: local token ids of
    their last subsequences back to back; ``cu_seqlens [n+1]`` int32 (device) and
    ``cu_seqlens_cpu`` (host): offsets of each piece inside ``token_index``.
    """

    num: int
    slots: Tensor
    token_index: Tensor
    cu_seqlens: Tensor
    cu_seqlens_cpu: Tensor


_CACHE: dict[int, tuple[weakref.ref, SummaryPlan]] = {}


def _build(routing: DeviceRouting) -> SummaryPlan:
    device = routing.cu_seqlens.device
    cu = [int(c) for c in routing.cu_seqlens_cpu.tolist()]
    publish = routing.publish.detach().to("cpu").tolist()
    frag_last = routing.frag_last.detach().to("cpu").tolist()
    slots, pieces, lengths = [], [], [0]
    for s, (pub, j) in enumerate(zip(publish, frag_last)):
        if pub and j >= 0:
            slots.append(s)
            pieces.append(torch.arange(cu[j], cu[j + 1], dtype=torch.int64))
            lengths.append(lengths[-1] + cu[j + 1] - cu[j])
    token_index = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
    cu_cpu = torch.tensor(lengths, dtype=torch.int32)
    if device.type == "cuda":
        cu_cpu = cu_cpu.pin_memory()
    return SummaryPlan(
        num=len(slots),
        slots=torch.tensor(slots, dtype=torch.int64).to(device),
        token_index=token_index.to(device),
        cu_seqlens=cu_cpu.to(device),
        cu_seqlens_cpu=cu_cpu,
    )


def summary_plan(routing: DeviceRouting) -> SummaryPlan:
    """The (cached) summary-pass plan of ``routing``."""
    key = id(routing)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is routing:
        return hit[1]
    plan = _build(routing)
    try:
        ref = weakref.ref(routing, lambda _r, key=key: _CACHE.pop(key, None))
    except TypeError:  # not weak-referenceable (e.g. slots): just do not cache
        return plan
    _CACHE[key] = (ref, plan)
    return plan
