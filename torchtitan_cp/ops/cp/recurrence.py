"""The recurrence protocol: what a chunked, state-affine token mixer provides so that one
context-parallel driver (``ops.cp.driver``) can run it over any fragment layout.

A recurrence maps each packed sequence's entry state ``S_0 [HV, K, V]`` to outputs and a final
state. Over any token range the final state is affine in the entry state, ``S_out = A(S_in)``.
Its *summary* is a fixed-size encoding of that map, ``[*summary_shape]`` per range:

* the delta rule (KDA, GDN) needs a full transition, ``S_out = M S_in + E`` with ``M [HV, K, K]``;
* a diagonal recurrence (Mamba2's SSD, simple GLA) needs one log decay per head,
  ``S_out = exp(a) S_in + E`` with ``a [HV]``: its all-gather is about K times smaller.

A new recurrence implements this protocol in its own module and adds one line to
``RECURRENCES``; it never reads the driver (docs/architecture.md, "Adding a recurrence"). The
mixers find theirs by name (``recurrence("kda", ...)``) and run it through
``SequenceContext.run_recurrence``. The driver only ever applies a summary to a state, one
predecessor after the other in token order, so the protocol has no summary composition.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, NamedTuple, Protocol

from torch import Tensor

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["RECURRENCES", "Recurrence", "SequenceTables", "recurrence"]


class SequenceTables(NamedTuple):
    """Packed-sequence offsets and their fla chunk tables, as a local kernel receives them.

    ``cu_seqlens [N+1]`` on the inputs' device, ``cu_seqlens_cpu`` its host copy, and the
    ``[NT, 2]`` / ``[N+1]`` chunk tables (``DeviceRouting.chunk_indices`` ...; may be None).
    """

    cu_seqlens: Tensor
    cu_seqlens_cpu: Tensor
    chunk_indices: Tensor | None
    chunk_offsets: Tensor | None


class Recurrence(Protocol):
    """A chunked recurrence, affine in its per-sequence state ``[HV, K, V]``.

    ``inputs`` is a tuple of token-major tensors ``[1, T, ...]`` (the driver selects tokens
    with ``index_select(1, ·)``); their meaning belongs to the recurrence. ``tables`` is a
    ``SequenceTables``. States and summaries are in ``common.dtypes.compute_dtype`` of the inputs' dtype.
    """

    def state_shape(self, inputs: tuple[Tensor, ...]) -> tuple[int, int, int]:
        """``(HV, K, V)`` of one sequence's state."""
        ...

    def local(
        self,
        inputs: tuple[Tensor, ...],
        tables: SequenceTables,
        initial_state: Tensor | None,
        output_final_state: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """The local kernel: ``(o [1, T, ...], final [N, HV, K, V] or None)`` over the packed
        sequences of ``tables``, entering sequence n with ``initial_state[n]`` (zeros if None)."""
        ...

    def summarize(self, inputs: tuple[Tensor, ...], tables: SequenceTables) -> Tensor:
        """``[N, *summary_shape]``: the affine map of every sequence of ``tables`` (final
        states only: no outputs are computed where the backend allows it)."""
        ...

    def identity(self, state_shape: tuple[int, int, int], dtype, device) -> Tensor:
        """``[1, *summary_shape]``: the map of an empty range."""
        ...

    def apply(self, summary: Tensor, state: Tensor) -> Tensor:
        """``summary [S, *summary_shape]`` applied to ``state [S, HV, K, V]``. The driver folds a
        fragment's predecessors with it one at a time, in token order (their number is the
        routing's predecessor depth)."""
        ...


# name -> ("module:factory", fixed options). Lazy, so that this module imports no
# implementation (no cycles); a factory takes options as keywords and returns a ``Recurrence``.
RECURRENCES: dict[str, tuple[str, dict[str, str]]] = {
    "kda": ("torchtitan_cp.ops.delta_rule.recurrence:DeltaRule", {"kind": "kda"}),
    "gdn": ("torchtitan_cp.ops.delta_rule.recurrence:DeltaRule", {"kind": "gdn"}),
    "ssd": ("torchtitan_cp.ops.ssd.recurrence:SSD", {}),
}


def recurrence(name: str, **options) -> Recurrence:
    """The registered recurrence ``name`` built with ``options`` (e.g. ``backend="torch"``)."""
    if name not in RECURRENCES:
        raise ValueError(f"unknown recurrence {name!r}; registered: {sorted(RECURRENCES)}")
    path, fixed = RECURRENCES[name]
    module, factory = path.split(":")
    make: Callable[..., Recurrence] = getattr(importlib.import_module(module), factory)
    return make(**fixed, **options)
