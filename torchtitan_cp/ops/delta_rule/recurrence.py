"""The gated delta rule (KDA / GDN) as a ``Recurrence``, and its context-parallel entry point.

Summary algebra: a token range maps the state affinely, ``S_out = M S_in + E`` with a full
transition ``M [HV, K, K]`` and ``E [HV, K, V]``, stored as ``[HV, K, V + K] = [E | M]``. On the
torch kernels (eager) the summary composes the chunk maps ``prepare`` already made for the
local kernel (``torch_kernel.compose_chunk_maps``). Elsewhere it comes from one final-state pass
over the published tokens: values ``[v | 0]`` from the entry state ``[0 | I]``, since the first V
columns follow E and the last K columns follow M (the same recurrence applied to the identity).
On fla (eager) that pass is fla's state kernel on the WY factors the layer prepared once, and its
cotangent joins the local kernel's before one WY backward (``fla_kernel``); under ``torch.compile``
the states-only pass of either backend is
its own custom op (``custom_ops.delta_rule_summaries_torch_op`` / ``..._fla_op``).
The driver (``ops.cp.driver``) does the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..common import checks, fla_refusals
from ..common.custom_ops import op_args
from ..cp.driver import context_parallel_recurrence
from ..cp.recurrence import (
    InitialState,
    SequenceTables,
    SummaryRows,
    TokenPrepared,
    qkv_state_shape,
    resolve_state,
)
from . import custom_ops, fla_kernel
from .local import chunk_delta_rule
from .torch_kernel import (
    DeltaRuleChunks,
    compose_chunk_maps,
    local_delta_rule_torch,
    prepare_delta_rule_torch,
)

if TYPE_CHECKING:
    from torchtitan_cp.routing import DeviceRouting

    from .local import Backend, Kind

__all__ = ["DeltaRule", "context_parallel_delta_rule"]


@dataclass(frozen=True)
class DeltaRule:
    """KDA (per-channel gate) or GDN (scalar gate); inputs ``(q, k, v, g, beta)`` with the shapes
    of ``ops.delta_rule.local.chunk_delta_rule``."""

    kind: Kind
    scale: float | None = None
    backend: Backend = "auto"

    state_shape = staticmethod(qkv_state_shape)

    def fla_refusal(self) -> str | None:
        # GDN's fla backward (chunk_gated_delta_rule, and the summaries' state backward)
        # calls the gated chunk_bwd_dqkwg; KDA's has its own fused dqkg kernel.
        return fla_refusals.fla_gated_backward_refusal() if self.kind == "gdn" else None

    def prepare(self, inputs: tuple[Tensor, ...], tables: SequenceTables) -> Any:
        # Eager, both backends split into a state-independent step (gate scores, the WY solve)
        # that the summaries and the local kernel share, and the state passes (torch_kernel /
        # fla_kernel); the compiled custom ops run whole (their summaries pick tokens).
        backend = checks.resolve_backend(self.backend, inputs[0])
        if torch.compiler.is_compiling():
            return TokenPrepared(inputs, tables)
        if backend == "fla":
            return fla_kernel.prepare(inputs, tables, kind=self.kind, scale=self.scale)
        q, k, v, g, beta = inputs
        return prepare_delta_rule_torch(
            q,
            k,
            v,
            g,
            beta,
            kind=self.kind,
            scale=self.scale,
            cu_seqlens=tables.cu_seqlens,
            cu_seqlens_cpu=tables.cu_seqlens_cpu,
        )

    def local(
        self, prepared: Any, initial_state: InitialState, output_final_state: bool
    ) -> tuple[Tensor, Tensor | None]:
        if isinstance(prepared, DeltaRuleChunks):
            return local_delta_rule_torch(prepared, initial_state, output_final_state)
        if isinstance(prepared, fla_kernel.FlaPrepared):
            return fla_kernel.local(prepared, initial_state, output_final_state)
        inputs, tables = prepared
        h0 = resolve_state(initial_state)
        return chunk_delta_rule(
            *inputs,
            kind=self.kind,
            scale=self.scale,
            initial_state=h0,
            output_final_state=output_final_state,
            backend=self.backend,
            **tables._asdict(),
        )

    def identity(self, state_shape: tuple[int, int, int], dtype, device) -> Tensor:
        HV, K, V = state_shape
        ident = torch.zeros(1, HV, K, V + K, dtype=dtype, device=device)
        ident[..., V:] = torch.eye(K, dtype=dtype, device=device)
        return ident

    def summarize(self, prepared: Any, rows: SummaryRows) -> Tensor:
        if isinstance(prepared, DeltaRuleChunks):
            # The chunk maps the local kernel uses, composed: no second recurrence.
            return compose_chunk_maps(
                prepared, rows.subsequence_cpu.tolist(), rows=rows.subsequence
            )
        if isinstance(prepared, fla_kernel.FlaPrepared):
            return fla_kernel.summaries(prepared, rows)
        # Under torch.compile (TokenPrepared): the states-only pass as its own custom op, no
        # output kernel; its backward takes the full cotangent [dE | dM] (custom_ops.py). The
        # host row ids tell it which rows are padding (not computed).
        inputs, _ = prepared
        q, k, v, g, beta = (x.index_select(1, rows.token_index) for x in inputs)
        tables = rows.tables
        backend = checks.resolve_backend(self.backend, q)
        a = op_args(
            backend,
            q.shape[3],
            self.scale,
            tables.cu_seqlens,
            tables.cu_seqlens_cpu,
            None,
            q.device,
        )
        if backend == "fla":
            assert a.cu_seqlens is not None  # the summary stream is always packed
            return custom_ops.delta_rule_summaries_fla_op(
                q,
                k,
                v,
                g,
                beta,
                a.cu_seqlens,
                a.cu_seqlens_cpu,
                tables.chunk_indices,
                rows.subsequence_cpu,
                self.kind,
                a.scale,
            )
        return custom_ops.delta_rule_summaries_torch_op(
            q, k, v, g, beta, a.cu_seqlens_cpu, rows.subsequence_cpu, self.kind, a.scale
        )

    def apply(self, summary: Tensor, state: Tensor) -> Tensor:
        V = state.shape[-1]
        return torch.matmul(summary[..., V:], state) + summary[..., :V]


def context_parallel_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    kind: Kind,
    routing: DeviceRouting,
    group: dist.ProcessGroup | None,
    scale: float | None = None,
    output_final_state: bool = False,
    backend: Backend = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Gated delta rule on this rank's span, continuing documents across fragments and ranks.

    Shapes (FLA conventions, local span of ``T = routing.num_tokens`` tokens): q, k
    ``[1,T,H,K]``; v ``[1,T,HV,V]``; g natural-log decay ``[1,T,HV,K]`` (kind="kda") or
    ``[1,T,HV]`` (kind="gdn"); beta ``[1,T,HV]``. Returns ``(o [1,T,HV,V], final_states
    [Nt,HV,K,V] | None)`` as ``context_parallel_recurrence`` describes.
    """
    return context_parallel_recurrence(
        DeltaRule(kind=kind, scale=scale, backend=backend),
        (q, k, v, g, beta),
        routing=routing,
        group=group,
        output_final_state=output_final_state,
    )
