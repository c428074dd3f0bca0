"""Context-parallel gated delta rule (KDA / GDN) over an arbitrary fragment layout.

Every token range maps the recurrent state affinely, ``S_out = M S_in + S_ext``. Each rank
computes that summary ``(M [HV,K,K], S_ext [HV,K,V])`` for the last subsequence of every local
fragment that a later fragment continues (``routing.publish``), all-gathers the fixed-size
summary buffers once, folds its predecessors' summaries in token order to get the entry state
of each fragment, and runs the ordinary local kernel with those entry states as
``initial_state``. The backward is autograd through the same graph; the all-gather's backward
reduce-scatters the summary cotangents to the ranks that computed them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from torchtitan_cp.routing import DeviceRouting

    from ..local import Backend, Kind

from .collectives import all_gather_autograd, check_routing_group

__all__ = ["context_parallel_delta_rule", "fold_dtype"]


def fold_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of summaries, fold and entry states: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _grad_anchor(*xs: Tensor) -> Tensor | None:
    # A zero that depends on every input needing grad; used to keep the all-gather in the
    # autograd graph on ranks that publish nothing, since every rank must join its backward.
    parts = [x.reshape(-1)[:0].sum() for x in xs if x.requires_grad]
    return sum(parts[1:], parts[0]) if parts else None


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
    ``[1,T,HV]`` (kind="gdn"); beta ``[1,T,HV]``. ``routing`` is this rank's ``DeviceRouting``;
    ``group`` the context-parallel process group (None: unsharded, world 1).

    Returns ``(o [1,T,HV,V], final_states)``; ``final_states`` is ``[Nt,HV,K,V]`` for the
    subsequences ``routing.terminal`` (zeros for -1 padding) when ``output_final_state``, else
    None. Equals the unsharded stream through the local kernel with the global cu_seqlens,
    restricted to this rank's span. One collective per call (plus its backward).
    """
    from ..local import chunk_delta_rule  # local kernels; imported late to avoid a cycle

    check_routing_group(routing, group, q.shape[1])
    HV, V = v.shape[2], v.shape[3]
    K = k.shape[3]
    S = routing.num_slots
    dt = fold_dtype(v.dtype)
    dev = v.device
    n_seq = routing.summary_cu_seqlens.numel() - 1  # a shape: no device read

    # --- 1. summaries [S_ext | M] of published last subsequences, one row per slot ---------
    eye = torch.eye(K, dtype=dt, device=dev).expand(HV, K, K)
    identity = torch.zeros(1, HV, K, V + K, dtype=dt, device=dev)
    identity[..., V:] = eye  # the map of a slot that publishes nothing
    if n_seq:
        idx = routing.summary_token_index
        qs, ks, vs, gs, bs = (x.index_select(1, idx) for x in (q, k, v, g, beta))
        # Values [v | 0] from state [0 | I]: the first V columns follow S_ext, the last K
        # columns follow M (the same recurrence with zero values applied to the identity).
        vs = torch.cat([vs, vs.new_zeros(*vs.shape[:3], K)], dim=-1)
        h0 = identity.expand(n_seq, -1, -1, -1).contiguous()
        _, fin = chunk_delta_rule(
            qs,
            ks,
            vs,
            gs,
            bs,
            kind=kind,
            scale=scale,
            initial_state=h0,
            output_final_state=True,
            cu_seqlens=routing.summary_cu_seqlens,
            cu_seqlens_cpu=routing.summary_cu_seqlens_cpu,
            chunk_indices=routing.summary_chunk_indices,
            chunk_offsets=routing.summary_chunk_offsets,
            backend=backend,
        )
        assert fin is not None  # output_final_state=True
        # Gather, not index_copy: deterministic on CUDA, and padded sequences are never read.
        table = torch.cat([fin.to(dt), identity])
        row = routing.summary_row
        buf = table.index_select(0, torch.where(row >= 0, row, n_seq))
    else:
        buf = identity.expand(S, -1, -1, -1).contiguous()
    if torch.is_grad_enabled():
        # Even a rank whose summaries do not depend on its inputs (nothing published, or a
        # capped summary pass over zero tokens) must join the all-gather's backward.
        anchor = _grad_anchor(q, k, v, g, beta)
        if anchor is not None:
            buf = buf + anchor

    # --- 2. one all-gather of every rank's summaries: [W*S, HV, K, V+K] -------------------
    gathered = all_gather_autograd(buf, group)

    # --- 3. entry states: fold predecessors in token order, S <- M_j S + E_j ---------------
    entry = torch.zeros(S, HV, K, V, dtype=dt, device=dev)
    preds = routing.pred_slots
    for p in range(preds.shape[1]):  # batched over slots; P is small (predecessor depth)
        col = preds[:, p]
        summ = gathered.index_select(0, col.clamp(min=0))
        nxt = torch.matmul(summ[..., V:], entry) + summ[..., :V]
        entry = torch.where((col >= 0).view(S, 1, 1, 1), nxt, entry)
    # Zero-valued term so that the gathered buffer is in the graph even when P == 0:
    # otherwise this rank would skip the reduce-scatter the other ranks are waiting in.
    entry = entry + gathered[:0].sum()

    # --- 4. local kernel over the whole span, entry states at each fragment's start --------
    N = routing.cu_seqlens.numel() - 1
    first = routing.frag_first
    target = torch.where(first >= 0, first, torch.full_like(first, N))  # row N = discard
    h0 = torch.zeros(N + 1, HV, K, V, dtype=dt, device=dev).index_add(0, target, entry)[:N]
    o, fin = chunk_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        kind=kind,
        scale=scale,
        initial_state=h0,
        output_final_state=output_final_state,
        cu_seqlens=routing.cu_seqlens,
        cu_seqlens_cpu=routing.cu_seqlens_cpu,
        chunk_indices=routing.chunk_indices,
        chunk_offsets=routing.chunk_offsets,
        backend=backend,
    )
    if not output_final_state or fin is None:
        return o, None
    term = routing.terminal
    finals = fin.index_select(0, term.clamp(min=0))
    finals = torch.where((term >= 0).view(-1, 1, 1, 1), finals, torch.zeros_like(finals))
    return o, finals
