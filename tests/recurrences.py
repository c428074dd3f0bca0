"""What every registered recurrence (``ops.cp.recurrence.RECURRENCES``) supplies to the shared
recurrence tests: how to build it, an input maker and a float64 token-by-token oracle.

The shared tests (``tests/test_kernels_ssd.py``'s summary algebra, ``tests/test_cp_ssd.py``) read
``CASES`` and nothing else; ``test_every_recurrence_has_cases`` fails for a registered recurrence
without a case here, so a new recurrence is one registry line plus its cases.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from tests.reference import delta_rule_reference, ssd_reference

__all__ = ["CASES", "H", "HV", "K", "V", "RecurrenceCase", "ssd_inputs"]

H, HV, K, V = 1, 2, 8, 6  # HV = 2 H: grouped value heads (Mamba2's B/C groups, GVA)


@dataclass(frozen=True)
class RecurrenceCase:
    """One registered recurrence under test, with options.

    ``inputs(T, seed, dtype)``: its token-major inputs ``[1, T, ...]`` (random, float64 values
    cast to ``dtype``); ``oracle(*inputs, initial_state=, cu_seqlens=)``: ``(o, final)`` in
    float64, token by token.
    """

    id: str
    name: str
    inputs: Callable[[int, int, torch.dtype], list[Tensor]]
    oracle: Callable[..., tuple[Tensor, Tensor]]
    options: dict[str, Any] = field(default_factory=dict)


def _rnd(gen: torch.Generator) -> Callable[..., Tensor]:
    return lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)


def ssd_inputs(T: int, seed: int, dtype: torch.dtype = torch.float64) -> list[Tensor]:
    """``(q, k, v, g)`` for SSD: q, k ``[1, T, H, K]``, v ``[1, T, HV, V]``, g ``[1, T, HV]``."""
    rnd = _rnd(torch.Generator().manual_seed(seed))
    q, k, v = rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, HV, V)
    g = -F.softplus(rnd(1, T, HV)) * 0.3
    return [x.to(dtype) for x in (q, k, v, g)]


def _delta_rule(kind: str) -> RecurrenceCase:
    def inputs(T: int, seed: int, dtype: torch.dtype = torch.float64) -> list[Tensor]:
        rnd = _rnd(torch.Generator().manual_seed(seed))
        q, k = F.normalize(rnd(1, T, H, K), dim=-1), F.normalize(rnd(1, T, H, K), dim=-1)
        v = rnd(1, T, HV, V)
        g = -F.softplus(rnd(1, T, HV, K) if kind == "kda" else rnd(1, T, HV)) * 0.3
        beta = torch.sigmoid(rnd(1, T, HV))
        return [x.to(dtype) for x in (q, k, v, g, beta)]

    def oracle(*xs: Tensor, **kw: Any) -> tuple[Tensor, Tensor]:
        return delta_rule_reference(*xs, kind=kind, **kw)

    return RecurrenceCase(kind, kind, inputs, oracle)


def head_decay(heads: int, like: Tensor) -> Tensor:
    """A fixed natural-log decay per head, ``-0.1 (h + 1)``: ``[heads]`` like ``like``."""
    return -0.1 * torch.arange(1, heads + 1, device=like.device, dtype=like.dtype)


def _fixed_decay_inputs(T: int, seed: int, dtype: torch.dtype = torch.float64) -> list[Tensor]:
    return ssd_inputs(T, seed, dtype)[:3]  # (q, k, v): the gate is the fixed decay


def _fixed_decay_oracle(q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> tuple[Tensor, Tensor]:
    g = head_decay(v.shape[2], v.double()).expand(1, v.shape[1], -1)
    return ssd_reference(q, k, v, g, **kw)


CASES: list[RecurrenceCase] = [
    _delta_rule("kda"),
    _delta_rule("gdn"),
    RecurrenceCase("ssd", "ssd", ssd_inputs, ssd_reference),
    # SSD with a fixed decay per head instead of the gate input (what retention runs).
    RecurrenceCase(
        "ssd-fixed-decay",
        "ssd",
        _fixed_decay_inputs,
        _fixed_decay_oracle,
        {"fixed_decay": head_decay},
    ),
]
