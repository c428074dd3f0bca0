"""Fragment tables: which global token ranges every rank owns, in span order.

A *fragment table* is ``list[list[tuple[int, int]]]``: entry ``r`` lists rank ``r``'s fragments
``(start, stop)`` (global token ids, half-open) in the order their tokens lie in the rank's local
tensors. Global token id of row ``b``, column ``i`` of a ``[B, L]`` microbatch is ``b * L + i``.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import torch
from torch import Tensor

from .balancers import get_balancer

FragmentTable = list[list[tuple[int, int]]]

__all__ = [
    "FragmentTable",
    "contiguous_fragments",
    "cu_seqlens_from_positions",
    "cu_seqlens_tensor_from_positions",
    "format_fragments",
    "fragments_from_indices",
    "headtail_fragments",
    "int_tensor",
    "parse_fragments",
    "ptrr_fragments_from_indices",
]


def int_tensor(values: Sequence[int] | Tensor) -> Tensor:
    """1-D int64 CPU tensor from host ints or a tensor.

    Goes through ``array.array`` because ``torch.tensor(list)`` costs ~100 ns per element, which
    dominates a plan build at 16k documents.
    """
    if isinstance(values, Tensor):
        return values.detach().to("cpu", torch.int64).reshape(-1)
    if len(values) == 0:
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def fragments_from_indices(
    indices: Tensor, world_size: int, batch_size: int, seq_len: int
) -> FragmentTable:
    """Fragment table of a load balancer's rearrange indices.

    ``indices``: ``[1, L]`` (same order for every row) or ``[B, L]`` (one order per row); row ``b``
    is rearranged as ``row[indices[b]]`` and rank ``r`` keeps the ``r``-th of ``world_size`` equal
    contiguous chunks of every rearranged row (what ``_context_parallel_shard`` does with
    ``Shard(seq_dim)`` after ``index_select``). A rank's local tensor is ``[B, L / W]``, so its
    span is row 0's chunk, then row 1's, ... Each rank's global token ids are compressed into
    maximal runs of consecutive ids (a run may cross a row boundary; every row start is a
    document start anyway, so that changes no subsequence).
    """
    if world_size < 1 or batch_size < 1 or seq_len < 1:
        raise ValueError(
            f"world_size ({world_size}), batch_size ({batch_size}) and seq_len ({seq_len}) "
            "must all be >= 1"
        )
    if seq_len % world_size != 0:
        raise ValueError(
            f"seq_len {seq_len} is not divisible by world_size {world_size}: "
            "every rank must get an equal chunk"
        )
    if indices.ndim != 2 or indices.shape[1] != seq_len or indices.shape[0] not in (1, batch_size):
        raise ValueError(
            f"indices must have shape [1, {seq_len}] or [{batch_size}, {seq_len}], "
            f"got {list(indices.shape)}"
        )
    idx = indices.detach().to("cpu", torch.int64)
    n_rows = idx.shape[0]
    # A rearrange order must be a permutation of every row, or tokens would be lost or doubled.
    # O(L) per distinct row: bincount of the row-offset ids must be all ones.
    flat = (idx + torch.arange(n_rows).unsqueeze(1) * seq_len).reshape(-1)
    in_range = bool(((idx >= 0) & (idx < seq_len)).all())
    counts = torch.bincount(flat.clamp(0, n_rows * seq_len - 1), minlength=n_rows * seq_len)
    if not in_range or not bool((counts == 1).all()):
        ok_rows = ((idx >= 0) & (idx < seq_len)).all(dim=1) & (
            counts.view(n_rows, seq_len) == 1
        ).all(dim=1)
        bad = int((~ok_rows).nonzero()[0])
        raise ValueError(f"indices row {bad} is not a permutation of 0..{seq_len - 1}")

    # Runs of consecutive ids inside each (distinct row, rank) chunk: O(distinct rows x L).
    chunks = idx.view(n_rows, world_size, seq_len // world_size)
    first = torch.ones_like(chunks, dtype=torch.bool)
    first[..., 1:] = chunks[..., 1:] != chunks[..., :-1] + 1
    last = torch.ones_like(chunks, dtype=torch.bool)
    last[..., :-1] = first[..., 1:]
    run_start, run_stop = chunks[first], chunks[last] + 1  # (row, rank, position) order
    per_chunk = first.sum(dim=2).reshape(-1)  # runs per (row, rank)
    run_rank = torch.repeat_interleave(torch.arange(world_size).repeat(n_rows), per_chunk)
    run_row = torch.repeat_interleave(torch.arange(n_rows), per_chunk.view(n_rows, -1).sum(1))
    if n_rows == 1:  # one order for every row: replicate row 0's runs over the B rows
        rows = torch.arange(batch_size).unsqueeze(1)
        n_runs = run_start.numel()
        run_start = (run_start.unsqueeze(0) + rows * seq_len).reshape(-1)
        run_stop = (run_stop.unsqueeze(0) + rows * seq_len).reshape(-1)
        run_rank = run_rank.unsqueeze(0).expand(batch_size, -1).reshape(-1)
        run_row = rows.expand(-1, n_runs).reshape(-1)
    else:
        run_start, run_stop = run_start + run_row * seq_len, run_stop + run_row * seq_len
    # Span order: rank, then row, then position within the row's chunk (stable sort).
    order = torch.argsort(run_rank * batch_size + run_row, stable=True)
    a, b, rank = run_start[order], run_stop[order], run_rank[order]
    # Merge a run into the previous one when the ids continue (across a row boundary of the
    # same rank's span), so runs stay maximal.
    new_run = torch.ones_like(a, dtype=torch.bool)
    new_run[1:] = (a[1:] != b[:-1]) | (rank[1:] != rank[:-1])
    end_run = torch.ones_like(a, dtype=torch.bool)
    end_run[:-1] = new_run[1:]
    starts, stops = a[new_run].tolist(), b[end_run].tolist()
    counts = torch.bincount(rank[new_run], minlength=world_size).tolist()
    table: FragmentTable = []
    k = 0
    for n in counts:
        table.append(list(zip(starts[k : k + n], stops[k : k + n])))
        k += n
    return table


def contiguous_fragments(seq_len: int, batch_size: int, world_size: int) -> FragmentTable:
    """Plain ``Shard(seq_dim)`` (no load balancer): rank ``r`` owns chunk ``r`` of every row."""
    return _balancer_fragments("contiguous", seq_len, batch_size, world_size)


def headtail_fragments(seq_len: int, batch_size: int, world_size: int) -> FragmentTable:
    """Layout of torch's head-tail load balancer, taken from torch's own index generator."""
    return _balancer_fragments("headtail", seq_len, batch_size, world_size)


def _balancer_fragments(name: str, seq_len: int, batch_size: int, world_size: int) -> FragmentTable:
    stand_in = torch.zeros(1, seq_len, dtype=torch.int64)  # the order ignores the documents
    index = get_balancer(name).indices(stand_in, world_size, "cpu")
    identity = torch.arange(seq_len).unsqueeze(0)
    return fragments_from_indices(
        identity if index is None else index, world_size, batch_size, seq_len
    )


def ptrr_fragments_from_indices(
    indices: Tensor, world_size: int, batch_size: int, seq_len: int
) -> FragmentTable:
    """Layout of a PTRR permutation (``_PTRRLoadBalancer._generate_indices()``, ``[1|B, L]``)."""
    return fragments_from_indices(indices, world_size, batch_size, seq_len)


def parse_fragments(text: str) -> FragmentTable:
    """Parse ``"0:96,288:384;96:192,192:288"``: ranks split by ``;``, fragments by ``,``.

    An empty rank entry means a rank without fragments. Only syntax is checked here; whether the
    table tiles the stream is checked by ``RoutingPlan.build``.
    """
    table: FragmentTable = []
    for r, rank_text in enumerate(text.strip().split(";")):
        frags: list[tuple[int, int]] = []
        for piece in filter(None, (p.strip() for p in rank_text.split(","))):
            parts = piece.split(":")
            try:
                if len(parts) != 2:
                    raise ValueError
                frags.append((int(parts[0]), int(parts[1])))
            except ValueError:
                raise ValueError(
                    f"rank {r}: cannot parse fragment {piece!r} (expected start:stop)"
                ) from None
        table.append(frags)
    return table


def format_fragments(table: Sequence[Sequence[tuple[int, int]]]) -> str:
    """Inverse of :func:`parse_fragments`."""
    return ";".join(",".join(f"{a}:{b}" for a, b in frags) for frags in table)


def cu_seqlens_tensor_from_positions(positions: Tensor) -> Tensor:
    """Global document boundaries ``[D + 1]`` int64 of the flattened ``[B, L]`` host positions.

    A document starts where ``positions == 0`` and at every row start; the result starts at 0
    and ends at ``T = B * L``.
    """
    if positions.ndim != 2:
        raise ValueError(f"positions must be 2-D [B, L], got shape {list(positions.shape)}")
    pos = positions.detach().cpu()
    batch, length = pos.shape
    if length == 0 or batch == 0:
        raise ValueError(f"positions must be non-empty, got shape {list(positions.shape)}")
    if bool((pos[:, 0] != 0).any()):
        row = int((pos[:, 0] != 0).nonzero()[0])
        raise ValueError(f"row {row} starts at position {int(pos[row, 0])}, expected 0")
    if bool((pos < 0).any()):
        row, col = (int(v) for v in (pos < 0).nonzero()[0])
        raise ValueError(f"row {row} has negative position {int(pos[row, col])} at column {col}")
    starts = (pos.reshape(-1) == 0).nonzero().reshape(-1)  # row starts are zeros already
    return torch.cat([starts, torch.tensor([batch * length])])


def cu_seqlens_from_positions(positions: Tensor) -> list[int]:
    """Like :func:`cu_seqlens_tensor_from_positions`, as host ints."""
    return cu_seqlens_tensor_from_positions(positions).tolist()
