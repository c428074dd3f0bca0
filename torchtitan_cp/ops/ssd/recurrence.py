"""SSD, the recurrence of Mamba2 layers, as a ``Recurrence``, and its CP entry point.

Per sequence and value head: ``S_t = exp(g_t) S_{t-1} + k_t v_tᵀ``, ``o_t = S_tᵀ (scale q_t)``,
with ``g_t = dt_t A`` (one natural-log decay per head and token), ``k = B``, ``q = C`` and
``v = dt x`` as the Mamba2 layer feeds it (``models/mixers/mamba2.py``). Backends: pure PyTorch
(``ssd.torch_kernel``), and on CUDA fla-core 0.6.0's ``chunk_simple_gla``, which is exactly
this recurrence (head-wise data-dependent gate, no delta correction). fla-core ships no separate
Mamba2/SSD kernel (its ``fla.layers.mamba2`` calls the external mamba_ssm kernels).

A fixed decay per head (RetNet's retention, ``models/mixers/retention.py``) is the same
recurrence with ``SSD.fixed_decay`` set: the gate is that constant at every token, so the torch
kernel, fla's ``chunk_simple_gla`` (fla-core's own ``chunk_retention`` is ``chunk_simple_gla``
with a constant ``g_gamma``) and the summaries serve it unchanged. A gate per head and key
(FLA's GLA, ``SSD(gate="key")``, registered as ``"gla"``) is the same recurrence with
``exp(g_t)`` a diagonal ``[K]`` scaling the state's rows: the torch kernel takes either shape,
fla's path is ``chunk_gla``, and the summary's decay is ``[HV, K]``.

Summary algebra: the transition is diagonal, ``S_out = exp(a) S_in + E`` with one log decay
``a`` per head (per head and key: ``[HV, K]``), stored as ``[HV, K*V + 1] = [E | a]``
(``[HV, K*V + K]``); all-gathered per slot that is ``HV (K V + 1)`` numbers (``HV K (V + 1)``)
against the delta rule's ``HV K (V + K)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from ..common import checks, fla_refusals
from ..common.checks import Backend
from ..common.dtypes import compute_dtype
from ..cp.driver import context_parallel_recurrence
from ..cp.recurrence import (
    InitialState,
    SequenceTables,
    SummaryRows,
    TokenPrepared,
    qkv_state_shape,
)
from .local import chunk_ssd
from .torch_kernel import chunk_ssd_torch

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchtitan_cp.routing import DeviceRouting

__all__ = ["SSD", "context_parallel_ssd"]


@dataclass(frozen=True)
class SSD:
    """Mamba2's SSD as a ``Recurrence``; inputs ``(q, k, v, g)`` as for ``chunk_ssd``, or
    ``(q, k, v)`` with a ``fixed_decay``. ``gate``: ``"head"`` (g ``[1, T, HV]``) or ``"key"``
    (g ``[1, T, HV, K]``, FLA's GLA)."""

    scale: float | None = None
    backend: Backend = "auto"
    fixed_decay: Callable[[int, Tensor], Tensor] | None = None
    """A decay per head instead of the gate input (RetNet's retention): ``fixed_decay(HV, v)``
    is the natural-log decay ``[HV]`` (``[HV, K]`` with ``gate="key"``) of every token, on v's
    device in ``compute_dtype``."""
    gate: Literal["head", "key"] = "head"

    def gated(self, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """``(q, k, v, g)``: the inputs, the fixed decay broadcast to every token as the gate."""
        if self.fixed_decay is None:
            if (inputs[3].dim() == 4) != (self.gate == "key"):
                raise ValueError(
                    f"SSD(gate={self.gate!r}) got a gate of shape {list(inputs[3].shape)}"
                )
            return inputs
        q, k, v = inputs
        d = self.fixed_decay(v.shape[2], v)
        g = d.view(1, 1, *d.shape).expand(1, v.shape[1], *d.shape)
        return q, k, v, g.contiguous()  # fla's kernels read the gate densely

    state_shape = staticmethod(qkv_state_shape)

    def fla_refusal(self) -> str | None:
        # A gate per head runs chunk_simple_gla, whose backward calls the gated
        # chunk_bwd_dqkwg (a fixed decay too: it is passed as that gate); chunk_gla does not.
        return fla_refusals.fla_gated_backward_refusal() if self.gate == "head" else None

    def prepare(self, inputs: tuple[Tensor, ...], tables: SequenceTables) -> TokenPrepared:
        # SSD's summary is a states-only pass over the published tokens (no scores, no solve:
        # about one K x V product per token), so nothing is worth sharing with the local kernel.
        return TokenPrepared(inputs, tables)

    def local(
        self, prepared: TokenPrepared, initial_state: InitialState, output_final_state: bool
    ) -> tuple[Tensor, Tensor | None]:
        inputs, tables = prepared
        return chunk_ssd(
            *self.gated(inputs),
            scale=self.scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            backend=self.backend,
            **tables._asdict(),
        )

    def identity(self, state_shape: tuple[int, int, int], dtype, device) -> Tensor:
        HV, K, V = state_shape
        width = K * V + (K if self.gate == "key" else 1)
        return torch.zeros(1, HV, width, dtype=dtype, device=device)  # E = 0, a = 0

    def summarize(self, prepared: TokenPrepared, rows: SummaryRows) -> Tensor:
        tables = rows.tables
        q, k, v, g = self.gated(tuple(x.index_select(1, rows.token_index) for x in prepared.inputs))
        dt = compute_dtype(v.dtype)
        if checks.resolve_backend(self.backend, q) == "torch" and not torch.compiler.is_compiling():
            _, E = chunk_ssd_torch(
                q,
                k,
                v,
                g,
                cu_seqlens=tables.cu_seqlens,
                cu_seqlens_cpu=tables.cu_seqlens_cpu,
                states_only=True,
            )
        else:
            # fla has no state-only autograd entry point, and under torch.compile the local
            # kernel runs as an opaque custom op: both compute, and discard, the [.., V] output.
            _, E = chunk_ssd(
                q, k, v, g, output_final_state=True, backend=self.backend, **tables._asdict()
            )
        assert E is not None
        # Log decay of every sequence: differences of a float64 prefix sum at the offsets
        # (a device gather, no host read; float64 so long ranges lose no precision).
        cs = torch.cat(
            [g.new_zeros(1, 1, *g.shape[2:], dtype=torch.float64), g.double().cumsum(1)], 1
        )[0]
        cu = tables.cu_seqlens.to(device=g.device, dtype=torch.int64)
        a = (cs.index_select(0, cu[1:]) - cs.index_select(0, cu[:-1])).to(dt)  # [N, HV(, K)]
        return torch.cat([E.to(dt).flatten(-2), a.reshape(*a.shape[:2], -1)], -1)

    def apply(self, summary: Tensor, state: Tensor) -> Tensor:
        KV = state.shape[-2] * state.shape[-1]
        E = summary[..., :KV].unflatten(-1, state.shape[-2:])
        return torch.exp(summary[..., KV:])[..., None] * state + E  # a: [.., 1 or K, 1]


def context_parallel_ssd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    *,
    routing: DeviceRouting,
    group: dist.ProcessGroup | None,
    scale: float | None = None,
    output_final_state: bool = False,
    backend: Backend = "auto",
) -> tuple[Tensor, Tensor | None]:
    """SSD on this rank's span (shapes as ``chunk_ssd``), continuing documents across fragments
    and ranks; returns as ``context_parallel_recurrence``."""
    return context_parallel_recurrence(
        SSD(scale=scale, backend=backend, gate="key" if g.dim() == 4 else "head"),
        (q, k, v, g),
        routing=routing,
        group=group,
        output_final_state=output_final_state,
    )
