"""One context-parallel driver for every state-affine recurrence (``ops.cp.recurrence``).

Every token range maps the recurrent state affinely. Each rank runs the recurrence's
state-independent step once (``Recurrence.prepare``), computes from it the summary of that map
(``Recurrence.summarize``) for the last subsequence of every local fragment that a later fragment
continues (``routing.publish``), posts one all-gather of the fixed-size summary buffers, and
starts the local kernel: what the kernel computes before it asks for its entry states overlaps
the collective; then the predecessors' summaries are folded in token order
(``Recurrence.apply``) into the entry state of each fragment. The backward is
autograd through the same graph; the all-gather's backward reduce-scatters the summary
cotangents to the ranks that computed them. Nothing here knows which recurrence it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from ..common.dtypes import compute_dtype
from .collectives import all_gather_start, check_routing_group
from .recurrence import Recurrence, SequenceTables, SummaryRows

if TYPE_CHECKING:
    from torchtitan_cp.routing import DeviceRouting

__all__ = [
    "context_parallel_recurrence",
    "local_tables",
    "summary_rows",
    "summary_tables",
]


def local_tables(routing: DeviceRouting) -> SequenceTables:
    """The span's subsequences: every local fragment cut at document boundaries."""
    return SequenceTables(
        routing.cu_seqlens, routing.cu_seqlens_cpu, routing.chunk_indices, routing.chunk_offsets
    )


def summary_tables(routing: DeviceRouting) -> SequenceTables:
    """The published last subsequences, packed (``routing.summary_token_index``)."""
    return SequenceTables(
        routing.summary_cu_seqlens,
        routing.summary_cu_seqlens_cpu,
        routing.summary_chunk_indices,
        routing.summary_chunk_offsets,
    )


def summary_rows(routing: DeviceRouting) -> SummaryRows:
    """The published last subsequences, as local subsequence ids and as packed tokens."""
    return SummaryRows(
        routing.summary_subsequence,
        routing.summary_subsequence_cpu,
        routing.summary_token_index,
        summary_tables(routing),
    )


def _grad_anchor(xs: tuple[Tensor, ...]) -> Tensor | None:
    # A zero that depends on every input needing grad; used to keep the all-gather in the
    # autograd graph on ranks that publish nothing, since every rank must join its backward.
    parts = [x.reshape(-1)[:0].sum() for x in xs if x.requires_grad]
    return sum(parts[1:], parts[0]) if parts else None


def context_parallel_recurrence(
    rec: Recurrence,
    inputs: tuple[Tensor, ...],
    *,
    routing: DeviceRouting,
    group: dist.ProcessGroup | None,
    output_final_state: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``rec`` on this rank's span, continuing documents across fragments and ranks.

    ``inputs`` are ``rec``'s token-major tensors ``[1, T, ...]`` over the local span of
    ``T = routing.num_tokens`` tokens; ``routing`` is this rank's ``DeviceRouting``; ``group`` the
    context-parallel process group (None: unsharded, world 1).

    Returns ``(o, final_states)``: ``o`` as ``rec.local`` returns it; ``final_states`` is
    ``[Nt, HV, K, V]`` for the subsequences ``routing.terminal`` (zeros for -1 padding) when
    ``output_final_state``, else None. Equals the unsharded stream through ``rec.local`` with the
    global cu_seqlens, restricted to this rank's span. One collective per call (plus its
    backward).
    """
    check_routing_group(routing, group, inputs[0].shape[1])
    shape = rec.state_shape(inputs)
    S = routing.num_slots
    dt = compute_dtype(inputs[0].dtype)
    dev = inputs[0].device
    n_seq = routing.summary_cu_seqlens.numel() - 1  # a shape: no device read

    # --- 1. the state-independent work, once: the summaries and the local kernel share it --
    prepared = rec.prepare(inputs, local_tables(routing))

    # --- 2. summaries of published last subsequences, one row per slot --------------------
    identity = rec.identity(shape, dt, dev)  # the map of a slot that publishes nothing
    if n_seq:
        summ = rec.summarize(prepared, summary_rows(routing)).to(dt)
        # Gather, not index_copy: deterministic on CUDA, and padded sequences are never read.
        table = torch.cat([summ, identity])
        row = routing.summary_row
        buf = table.index_select(0, torch.where(row >= 0, row, n_seq))
    else:
        buf = identity.expand(S, *identity.shape[1:]).contiguous()
    if torch.is_grad_enabled():
        # Even a rank whose summaries do not depend on its inputs (nothing published, or a
        # capped summary pass over zero tokens) must join the all-gather's backward.
        anchor = _grad_anchor(inputs)
        if anchor is not None:
            buf = buf + anchor

    # --- 3. post one all-gather of every rank's summaries: [W*S, *summary_shape] -----------
    pending = all_gather_start(buf, group)
    N = routing.cu_seqlens.numel() - 1

    preds = routing.pred_slots
    in_graph: list[Tensor] = []  # the gathered buffer's zero-valued tie to the outputs

    def entry_states() -> Tensor | None:
        # --- 4. (called by the local kernel once its state-independent work is issued) wait,
        # then fold predecessors in token order, S <- A_j(S), into each fragment's entry.
        gathered = pending.wait()
        # Zero-valued term so that the gathered buffer is in the graph whatever this rank
        # reads: otherwise it would skip the reduce-scatter the other ranks are waiting in.
        in_graph.append(gathered[:0].sum())
        if preds.shape[1] == 0:  # no fragment here continues a document (a host shape)
            return None  # zeros, and no entry-state gradient to compute
        if torch.compiler.is_compiling():
            # One program for every layout: every column over every slot, masked.
            entry = torch.zeros(S, *shape, dtype=dt, device=dev)
            for p in range(preds.shape[1]):  # batched over slots; P is the predecessor depth
                col = preds[:, p]
                nxt = rec.apply(gathered.index_select(0, col.clamp(min=0)), entry)
                entry = torch.where((col >= 0).view(S, 1, 1, 1), nxt, entry)
        else:
            # Only the slots that still have a predecessor at column p (a prefix in fold_order).
            order = routing.fold_order
            ordered = preds.index_select(0, order)
            entry = torch.zeros(S, *shape, dtype=dt, device=dev)
            for p, a in enumerate(routing.fold_steps):
                head = rec.apply(gathered.index_select(0, ordered[:a, p]), entry[:a])
                entry = torch.cat([head, entry[a:]]) if a < S else head
            entry = torch.zeros_like(entry).index_copy(0, order, entry)
        first = routing.frag_first
        target = torch.where(first >= 0, first, torch.full_like(first, N))  # row N = discard
        return torch.zeros(N + 1, *shape, dtype=dt, device=dev).index_add(0, target, entry)[:N]

    # --- 5. local kernel over the whole span, entry states at each fragment's start --------
    o, fin = rec.local(prepared, entry_states, output_final_state)
    if not in_graph:  # a kernel that never needed its entry states
        entry_states()
    o = o + in_graph[0].to(o.dtype)
    if not output_final_state or fin is None:
        return o, None
    term = routing.terminal
    finals = fin.index_select(0, term.clamp(min=0))
    finals = torch.where((term >= 0).view(-1, 1, 1, 1), finals, torch.zeros_like(finals))
    return o, finals + in_graph[0].to(finals.dtype)
