"""The gated delta product (DeltaProduct, Siems et al. 2025; fla's ``gated_delta_product``) as a
``Recurrence``: ``householder`` delta-rule updates per token, the state read once per token.

Per sequence and value head, token ``t`` decays the state once and then applies ``n`` updates,
``S ← (I - β_tj k_tj k_tjᵀ) S + β_tj k_tj v_tjᵀ`` for ``j = 0 .. n-1``; ``o_t = S_tᵀ (scale q_t)``.
That is the delta rule on a kernel stream of ``n`` steps per token (step ``j`` of token ``t``
at ``n t + j``) whose gate is ``g_t`` at step 0 and 0 after it, and whose query is ``q_t`` at
step ``n - 1`` and 0 before it. So this wraps ``DeltaRule`` on that stream: its summaries,
chunk maps, compiled custom ops and fla path, with the routing's tables for the stream
(``SequenceTables.expanded``), and a token range's map is the same on both streams.

The stream's outputs at steps ``0 .. n-2`` are computed and dropped: fla's dedicated
``chunk_gated_delta_product`` skips them, but takes no chunk tables (a host sync per call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..cp.recurrence import InitialState, SequenceTables, SummaryRows
from .recurrence import DeltaRule

if TYPE_CHECKING:
    from .local import Backend, Kind

__all__ = ["DeltaProduct", "step_stream"]


def step_stream(inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """The delta rule's ``(q, k, v, g, beta)`` on the stream of ``n`` steps per token.

    ``inputs``: q ``[1, T, H, K]``; k ``[1, T, n, H, K]``; v ``[1, T, n, HV, V]``; g ``[1, T, HV]``
    (gdn) or ``[1, T, HV, K]`` (kda); beta ``[1, T, n, HV]``. Returns the delta rule's inputs
    with ``n T`` tokens (differentiable; k, v and beta are views)."""
    q, k, v, g, beta = inputs
    n = k.shape[2]

    def at(x: Tensor, step: int) -> Tensor:  # x [1, T, ...] at one step, zeros at the others
        parts = [torch.zeros_like(x)] * n
        parts[step] = x
        return torch.stack(parts, 2).flatten(1, 2)

    # The gate's shape (per head or per key) carries over as it is.
    return at(q, n - 1), k.flatten(1, 2), v.flatten(1, 2), at(g, 0), beta.flatten(1, 2)


@dataclass(frozen=True)
class DeltaProduct:
    """``householder`` gated delta-rule updates per token; inputs as ``step_stream`` takes them.
    ``kind`` picks the gate as ``DeltaRule``'s does (fla has the per-head one, ``gdn``)."""

    kind: Kind = "gdn"
    householder: int = 2
    scale: float | None = None
    backend: Backend = "auto"

    def __post_init__(self) -> None:
        if self.householder < 1:
            raise ValueError(f"householder must be >= 1, got {self.householder}")

    @property
    def rule(self) -> DeltaRule:
        return DeltaRule(kind=self.kind, scale=self.scale, backend=self.backend)

    def state_shape(self, inputs: tuple[Tensor, ...]) -> tuple[int, int, int]:
        q, _, v = inputs[:3]
        return v.shape[3], q.shape[3], v.shape[4]

    def fla_refusal(self) -> str | None:
        return self.rule.fla_refusal()

    def prepare(self, inputs: tuple[Tensor, ...], tables: SequenceTables) -> Any:
        if inputs[1].shape[2] != self.householder:
            raise ValueError(
                f"k must be [1, T, householder={self.householder}, H, K], "
                f"got {list(inputs[1].shape)}"
            )
        stream = tables.expanded(self.householder, inputs[0].shape[1])
        return self.rule.prepare(step_stream(inputs), stream)

    def local(
        self, prepared: Any, initial_state: InitialState, output_final_state: bool
    ) -> tuple[Tensor, Tensor | None]:
        o, final = self.rule.local(prepared, initial_state, output_final_state)
        n = self.householder  # the state is read at each token's last step only
        return o.unflatten(1, (-1, n))[:, :, n - 1], final

    def summarize(self, prepared: Any, rows: SummaryRows) -> Tensor:
        return self.rule.summarize(prepared, rows.expanded(self.householder))

    def identity(self, state_shape: tuple[int, int, int], dtype, device) -> Tensor:
        return self.rule.identity(state_shape, dtype, device)

    def apply(self, summary: Tensor, state: Tensor) -> Tensor:
        return self.rule.apply(summary, state)
