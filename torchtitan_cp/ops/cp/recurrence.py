"""The recurrence protocol: what a chunked, state-affine token mixer provides so that one
context-parallel driver (``ops.cp.driver``) can run it over any fragment layout.

A recurrence maps each packed sequence's entry state ``S_0 [HV, K, V]`` to outputs and a final
state. Over any token range the final state is affine in the entry state, ``S_out = A(S_in)``.
Its *summary* is a fixed-size encoding of that map, ``[*summary_shape]`` per range:

* the delta rule (KDA, GDN) needs a full transition, ``S_out = M S_in + E`` with ``M [HV, K, K]``;
* a diagonal recurrence (Mamba2's SSD, simple GLA) needs one log decay per head,
  ``S_out = exp(a) S_in + E`` with ``a [HV]``: its all-gather is about K times smaller.

Every layer computes the state-independent per-chunk work once (``prepare``): the summaries
compose the chunk maps it made and the local kernel reuses them, so a span that continues a
document and is continued costs its local kernel plus the composition of its chunk maps, not
the recurrence twice (docs/cp.md, "The work of a CP layer").

A new recurrence implements this protocol in its own module and adds one line to
``RECURRENCES``; it never reads the driver (docs/architecture.md, "Adding a recurrence"). The
mixers find theirs by name (``recurrence("kda", ...)``) and run it through
``SequenceContext.run_recurrence``. The driver only ever applies a summary to a state, one
predecessor after the other in token order, so the protocol has no summary composition.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from torchtitan_cp.routing import chunk_bound, device_chunk_tables

from ..common.fla import FLA_CHUNK_SIZE

__all__ = [
    "RECURRENCES",
    "InitialState",
    "Recurrence",
    "SequenceTables",
    "SummaryRows",
    "TokenPrepared",
    "qkv_state_shape",
    "recurrence",
    "resolve_state",
    "run_local",
]


class SequenceTables(NamedTuple):
    """Packed-sequence offsets and their fla chunk tables, as a local kernel receives them.

    ``cu_seqlens [N+1]`` on the inputs' device, ``cu_seqlens_cpu`` its host copy, and the
    ``[NT, 2]`` / ``[N+1]`` chunk tables (``DeviceRouting.chunk_indices`` ...; may be None).
    The field names are the local kernels' keywords (``chunk_delta_rule(...,
    **tables._asdict())``), so the tables travel as one value and are spelled out once.
    """

    cu_seqlens: Tensor
    cu_seqlens_cpu: Tensor
    chunk_indices: Tensor | None
    chunk_offsets: Tensor | None

    def expanded(self, steps: int, num_tokens: int) -> SequenceTables:
        """The same sequences as a kernel's stream of ``steps`` steps per token (step ``j`` of
        token ``t`` at ``steps * t + j``): offsets times ``steps``, and fla chunk tables for
        that stream built on the device (``routing.device_chunk_tables``), padded to
        ``chunk_bound(steps * num_tokens, N)`` rows, so neither a host read nor a
        layout-dependent shape. ``num_tokens``: the tokens of the unexpanded stream (the
        inputs' ``T``). Without chunk tables, none are built (the torch kernels need none);
        without offsets (one dense sequence) the tables stay as they are."""
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if steps == 1 or self.cu_seqlens is None:
            return self
        cu, cu_cpu = self.cu_seqlens * steps, self.cu_seqlens_cpu * steps
        if self.chunk_indices is None:
            return SequenceTables(cu, cu_cpu, None, None)
        rows = chunk_bound(steps * num_tokens, cu.numel() - 1, FLA_CHUNK_SIZE)
        return SequenceTables(cu, cu_cpu, *device_chunk_tables(cu, FLA_CHUNK_SIZE, rows))


class SummaryRows(NamedTuple):
    """The published subsequences of a span, one summary row each (``DeviceRouting.summary_*``).

    ``subsequence [R]`` int32: the local subsequence (row of ``SequenceTables``) of each row, −1
    for padding rows (never read); ``subsequence_cpu`` its host copy. ``token_index [Ls]`` and
    ``tables``: the same rows' tokens packed back to back as their own stream, for a recurrence
    that summarises from the tokens rather than from what ``prepare`` computed.
    """

    subsequence: Tensor
    subsequence_cpu: Tensor
    token_index: Tensor
    tables: SequenceTables

    def expanded(self, steps: int) -> SummaryRows:
        """The same rows on a stream of ``steps`` kernel steps per token
        (``SequenceTables.expanded``): each token index ``t`` becomes ``steps * t + j``."""
        if steps == 1:
            return self
        sub = torch.arange(steps, device=self.token_index.device, dtype=self.token_index.dtype)
        index = (self.token_index.unsqueeze(1) * steps + sub).reshape(-1)
        tables = self.tables.expanded(steps, self.token_index.numel())
        return SummaryRows(self.subsequence, self.subsequence_cpu, index, tables)


InitialState = Tensor | Callable[[], Tensor | None] | None
"""What ``Recurrence.local`` enters its sequences with: a tensor ``[N, HV, K, V]``, None (zeros),
or a thunk returning either, called once, as late as the kernel can: the CP driver's thunk
waits for the summaries' all-gather and folds them, so what the kernel computes before calling
it (everything that does not depend on the state) overlaps the collective."""


def qkv_state_shape(inputs: tuple[Tensor, ...]) -> tuple[int, int, int]:
    """``(HV, K, V)`` for inputs that open with ``(q [1, T, H, K], k, v [1, T, HV, V])``, the
    FLA convention of every recurrence here with one step per token."""
    q, _, v = inputs[:3]
    return v.shape[2], q.shape[3], v.shape[3]


class Recurrence(Protocol):
    """A chunked recurrence, affine in its per-sequence state ``[HV, K, V]``.

    ``inputs`` is a tuple of token-major tensors ``[1, T, ...]``; their meaning belongs to the
    recurrence. ``tables`` is a ``SequenceTables``. States and summaries are in
    ``common.dtypes.compute_dtype`` of the inputs' dtype.

    One layer runs ``prepare`` once; its result serves both ``summarize`` and ``local``, so the
    per-chunk work that does not depend on the state (gate scores, the WY solve, every chunk's
    affine map) is computed once whether or not the span publishes summaries.
    """

    def state_shape(self, inputs: tuple[Tensor, ...]) -> tuple[int, int, int]:
        """``(HV, K, V)`` of one sequence's state."""
        ...

    def prepare(self, inputs: tuple[Tensor, ...], tables: SequenceTables) -> Any:
        """The state-independent work over the sequences of ``tables`` (opaque to the driver;
        differentiable: gradients reach ``inputs`` through it)."""
        ...

    def local(
        self, prepared: Any, initial_state: InitialState, output_final_state: bool
    ) -> tuple[Tensor, Tensor | None]:
        """The local kernel: ``(o [1, T, ...], final [N, HV, K, V] or None)`` over the prepared
        sequences, entering sequence n with ``initial_state[n]`` (see ``InitialState``)."""
        ...

    def summarize(self, prepared: Any, rows: SummaryRows) -> Tensor:
        """``[R, *summary_shape]``: the affine map of every row's subsequence (padding rows:
        anything finite; the driver never reads them). Called before ``local``."""
        ...

    def identity(self, state_shape: tuple[int, int, int], dtype, device) -> Tensor:
        """``[1, *summary_shape]``: the map of an empty range."""
        ...

    def fla_refusal(self) -> str | None:
        """Why fla-core refuses this recurrence's fla kernels on this machine (one line,
        ``ops.common.fla_refusals``), or None: asked of the kernels it calls, so a layer or
        a variant that runs them inherits the refusal."""
        ...

    def apply(self, summary: Tensor, state: Tensor) -> Tensor:
        """``summary [S, *summary_shape]`` applied to ``state [S, HV, K, V]``. The driver folds a
        fragment's predecessors with it one at a time, in token order (their number is the
        routing's predecessor depth). A recurrence may rely on this: the state a summary is
        applied to is always the entry state its publisher's ``local`` used for that row."""
        ...


def run_local(
    rec: Recurrence,
    inputs: tuple[Tensor, ...],
    tables: SequenceTables,
    initial_state: InitialState = None,
    output_final_state: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``rec``'s local kernel on its own: ``prepare`` then ``local`` (no summaries)."""
    return rec.local(rec.prepare(inputs, tables), initial_state, output_final_state)


def resolve_state(initial_state: InitialState) -> Tensor | None:
    """The tensor behind an ``InitialState`` (calls a thunk)."""
    return initial_state() if callable(initial_state) else initial_state


class TokenPrepared(NamedTuple):
    """``prepare``'s result for a recurrence whose kernels have no separate state-independent
    step (on some backend): the inputs and tables, kept for ``local`` and ``summarize``."""

    inputs: tuple[Tensor, ...]
    tables: SequenceTables


# name -> ("module:factory", fixed options). Lazy, so that this module imports no
# implementation (no cycles); a factory takes options as keywords and returns a ``Recurrence``.
RECURRENCES: dict[str, tuple[str, dict[str, str]]] = {
    "kda": ("torchtitan_cp.ops.delta_rule.recurrence:DeltaRule", {"kind": "kda"}),
    "gdn": ("torchtitan_cp.ops.delta_rule.recurrence:DeltaRule", {"kind": "gdn"}),
    "ssd": ("torchtitan_cp.ops.ssd.recurrence:SSD", {}),
    "gla": ("torchtitan_cp.ops.ssd.recurrence:SSD", {"gate": "key"}),  # a gate per key
    # DeltaProduct: several delta-rule steps per token, the delta rule on a longer stream.
    "gdp": ("torchtitan_cp.ops.delta_rule.product:DeltaProduct", {"kind": "gdn"}),
}


def recurrence(name: str, **options) -> Recurrence:
    """The registered recurrence ``name`` built with ``options`` (e.g. ``backend="torch"``)."""
    if name not in RECURRENCES:
        raise ValueError(f"unknown recurrence {name!r}; registered: {sorted(RECURRENCES)}")
    path, fixed = RECURRENCES[name]
    module, factory = path.split(":")
    make: Callable[..., Recurrence] = getattr(importlib.import_module(module), factory)
    return make(**fixed, **options)
