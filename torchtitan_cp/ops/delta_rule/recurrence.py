"""The gated delta rule (KDA / GDN) as a ``Recurrence``, and its context-parallel entry point.

Summary algebra: a token range maps the state affinely, ``S_out = M S_in + E`` with a full
transition ``M [HV, K, K]`` and ``E [HV, K, V]``, stored as ``[HV, K, V + K] = [E | M]``. On the
torch kernels (eager) the summary composes the chunk maps ``prepare`` already made for the
local kernel (``torch_kernel.compose_chunk_maps``). Elsewhere it comes from one final-state pass
over the published tokens: values ``[v | 0]`` from the entry state ``[0 | I]``, since the first V
columns follow E and the last K columns follow M (the same recurrence applied to the identity).
On fla (eager) that pass is fla's state kernel on the WY factors the layer prepared once, and its
cotangent joins the local kernel's before one WY backward (``fla_kernel``). Under
``torch.compile`` the states-only pass of either backend is its own custom op
(``custom_ops.delta_rule_summaries_torch_op`` / ``..._fla_op``); on fla it and the local op take
the factors of one preparation op (``FlaOpPrepared``), whose cotangent they cannot join across
op boundaries, so its backward runs at width V + K. The driver (``ops.cp.driver``) does the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..common import checks, fla_refusals
from ..common.custom_ops import OpArgs, op_args
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


class FlaOpPrepared(NamedTuple):
    """``DeltaRule.prepare``'s result on fla under ``torch.compile``: the inputs, their tables
    and ``delta_rule_fla_prepare``'s factors (``fla_kernel.FACTORS``), which the local op and
    the summaries op take."""

    inputs: tuple[Tensor, ...]
    tables: SequenceTables
    factors: list[Tensor]


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
        # Both backends split into a state-independent step (gate scores, the WY solve) that
        # the summaries and the local kernel share, and the state passes (torch_kernel /
        # fla_kernel). Under torch.compile fla's step is its own custom op; the torch
        # backend's ops run whole (their summaries pick tokens).
        backend = checks.resolve_backend(self.backend, inputs[0])
        if torch.compiler.is_compiling():
            if backend == "fla":
                return self._prepare_op(inputs, tables)
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

    def _prepare_op(self, inputs: tuple[Tensor, ...], tables: SequenceTables) -> FlaOpPrepared:
        fla_kernel.check_head_dim(inputs[0].shape[3])
        a = self._op_args(inputs[0], tables, None)
        factors = custom_ops.prepare_op_call(inputs, a, tables.chunk_indices, self.kind)
        return FlaOpPrepared(inputs, tables, factors)

    def _op_args(self, q: Tensor, tables: SequenceTables, h0: Tensor | None) -> OpArgs:
        backend = checks.resolve_backend(self.backend, q)
        cu, cu_cpu = tables.cu_seqlens, tables.cu_seqlens_cpu
        return op_args(backend, q.shape[3], self.scale, cu, cu_cpu, h0, q.device)

    def local(
        self, prepared: Any, initial_state: InitialState, output_final_state: bool
    ) -> tuple[Tensor, Tensor | None]:
        if isinstance(prepared, FlaOpPrepared):
            inputs, tables, factors = prepared
            a = self._op_args(inputs[0], tables, resolve_state(initial_state))
            ci = tables.chunk_indices
            return custom_ops.local_op_call(inputs, factors, a, ci, self.kind, output_final_state)
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
        # Under torch.compile: the states-only pass as its own custom op, no output kernel;
        # its backward takes the full cotangent [dE | dM] (custom_ops.py). The host row ids
        # tell it which rows are padding (not computed).
        inputs, tables = prepared[0], rows.tables
        q, k, v, g, beta = (x.index_select(1, rows.token_index) for x in inputs)
        a = self._op_args(q, tables, None)
        if isinstance(prepared, FlaOpPrepared):
            # The preparation's factors of the published tokens (the query scores not needed).
            factors = [
                f.index_select(1, rows.token_index) if f.dim() > 1 and name != "Aqk" else f[:0]
                for name, f in zip(fla_kernel.FACTORS, prepared.factors, strict=True)
            ]
            assert a.cu_seqlens is not None  # the summary stream is always packed
            return custom_ops.delta_rule_summaries_fla_op(
                q,
                k,
                v,
                g,
                beta,
                factors,
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
