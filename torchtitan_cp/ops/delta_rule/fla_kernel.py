"""Thin adapter from our delta-rule signature to fla-core's Triton kernels (CUDA; CPU tensors
only under Triton's interpreter, in the fla_interpreter test tier).

fla is imported inside the function, so importing this module on a CPU-only machine never loads
Triton kernels. The chunk tables come from the routing (``ops/common/fla.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..common.fla import fla_chunk_indices, fla_offsets
from ..cp.recurrence import SequenceTables, SummaryRows

__all__ = ["FlaPrepared", "chunk_delta_rule_fla", "summaries_fla"]


class FlaPrepared(NamedTuple):
    """``DeltaRule.prepare``'s result on fla (eager): fla's local kernel runs whole, so this keeps
    the inputs and tables; ``saved["entry"]`` receives the local kernel's entry states (float32
    ``[N, HV, K, V]`` or None for zeros), which the summaries' backward reads
    (``summaries_fla``)."""

    inputs: tuple[Tensor, ...]
    tables: SequenceTables
    saved: dict


def summaries_fla(prepared: FlaPrepared, rows: SummaryRows, *, kind: str, scale: float | None):
    """``[R, HV, K, V + K]`` summaries ``[E | M]`` of the published rows from fla's states-only
    pass (``fla_compat.delta_rule_summaries_indexed``: WY preparation and state kernel, no output
    kernel); their backward runs from the entry state ``local`` recorded for each row."""
    from ..fla_compat import delta_rule_summaries_indexed

    inputs, _, saved = prepared
    q, k, v, g, beta = (x.index_select(1, rows.token_index) for x in inputs)
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    sub = rows.subsequence
    tables = rows.tables
    cu, cu_cpu, _, _ = fla_offsets(
        q,
        tables.cu_seqlens,
        tables.cu_seqlens_cpu,
        tables.chunk_indices,
        tables.chunk_offsets,
        None,
    )
    assert cu is not None  # the summary stream is always packed
    if q.shape[1] == 0:  # every row empty (a capped pass): identities, nothing to differentiate
        ident = torch.zeros(sub.numel(), HV, K, V + K, device=q.device)
        ident[..., V:] = torch.eye(K, device=q.device)
        return ident

    def entry() -> Tensor:
        if "entry" not in saved:
            raise RuntimeError("the fla summaries' backward needs the local kernel's forward")
        h = saved["entry"]
        if h is None:
            return torch.zeros(sub.numel(), HV, K, V, device=q.device)
        picked = h.index_select(0, sub.clamp(min=0).to(torch.int64))
        return torch.where((sub >= 0).view(-1, 1, 1, 1), picked, torch.zeros_like(picked))

    return delta_rule_summaries_indexed(
        q,
        k,
        v,
        g,
        beta,
        kind=kind,
        scale=scale,
        entry=entry,
        cu_seqlens=cu,
        chunk_indices=fla_chunk_indices(cu, cu_cpu, tables.chunk_indices, q.shape[1]),
        chunk_offsets=tables.chunk_offsets,
    )


def chunk_delta_rule_fla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    kind: str,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    chunk_indices: Tensor | None = None,
    chunk_offsets: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``fla.ops.kda.chunk_kda`` (kind="kda") or ``chunk_gated_delta_rule`` (kind="gdn").

    Same shapes as ``ops.delta_rule.local.chunk_delta_rule``; gates are already natural-log decays and q/k
    already normalised, so all of FLA's in-kernel gate / l2norm / sigmoid options stay off.
    States are float32 ``[N, HV, K, V]``. ``chunk_indices [NT, 2]`` int32 (or padded, see
    ``common.fla.chunk_table``) and ``chunk_offsets [N + 1]`` on q's device: the chunk tables of
    ``cu_seqlens`` (KDA goes through
    ``fla_compat.chunk_kda_indexed``, which accepts both; GDN's public function takes
    ``chunk_indices`` and derives its chunk offsets on the device, which needs no host read).
    """
    cu_seqlens, cu_seqlens_cpu, chunk_indices, initial_state = fla_offsets(
        q, cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_offsets, initial_state
    )
    if kind == "kda" and chunk_indices is not None:
        from ..fla_compat import chunk_kda_indexed

        assert cu_seqlens is not None  # checked above
        return chunk_kda_indexed(
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu,
            chunk_indices=chunk_indices,
            chunk_offsets=chunk_offsets,
        )
    kwargs = dict(
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )
    if kind == "kda":
        from fla.ops.kda import chunk_kda

        return chunk_kda(q, k, v, g, beta, **kwargs)
    if kind == "gdn":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        return chunk_gated_delta_rule(q, k, v, g, beta, chunk_indices=chunk_indices, **kwargs)
    raise ValueError(f"kind must be 'kda' or 'gdn', got {kind!r}")
