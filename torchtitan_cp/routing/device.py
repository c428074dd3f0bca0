"""The device-side routing record every CP op consumes (see docs/CONTRACTS.md)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["DeviceRouting", "RoutingCaps", "RoutingCapsExceeded"]


class RoutingCapsExceeded(ValueError):
    """A layout needs more than a ``RoutingCaps`` field allows; ``cap`` names the field."""

    def __init__(self, message: str, cap: str) -> None:
        super().__init__(message)
        self.cap = cap


@dataclass(frozen=True)
class RoutingCaps:
    """Fixed upper bounds that make every ``DeviceRouting`` shape independent of the layout.

    ``None`` leaves that dimension at the layout's own size. ``slots`` bounds the fragments of
    *any* rank (global slot ids use it), ``subsequences`` this rank's subsequences (N),
    ``predecessors`` any local fragment's predecessors (P), ``terminal`` this rank's terminal
    subsequences (Nt).
    """

    slots: int | None = None
    subsequences: int | None = None
    predecessors: int | None = None
    terminal: int | None = None

    def __post_init__(self) -> None:
        for name in ("slots", "subsequences", "predecessors", "terminal"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"RoutingCaps.{name} must be >= 0, got {value}")


@dataclass(frozen=True)
class DeviceRouting:
    """One rank's routing tensors. Tensors are on the target device and int64 unless noted;
    ``-1`` means "none". S = ``num_slots``, C = ``conv_history``, N = subsequences (capped),
    P = predecessors per fragment (capped), Nt = terminal subsequences (capped).
    """

    rank: int
    world_size: int
    num_slots: int
    conv_history: int
    num_tokens: int
    cu_seqlens: Tensor  # [N + 1] int32, local span offsets, padded with num_tokens
    cu_seqlens_cpu: Tensor  # [N + 1] int32 on the host (pinned when CUDA is available)
    frag_first: Tensor  # [S] local subsequence index of each fragment's first subsequence
    frag_last: Tensor  # [S] ... of its last subsequence
    publish: Tensor  # [S] bool, the last subsequence continues on a successor
    pred_slots: Tensor  # [S, P] global slot ids of the predecessors, token order
    fold_order: Tensor  # [S] local slots by predecessor count, descending (the fold's order)
    fold_steps: tuple[int, ...]  # [P] host ints: slots with more than p predecessors
    terminal: Tensor  # [Nt] local subsequence indices that end their document
    tail_index: Tensor  # [S, C] local token index of each fragment's last C tokens
    halo_index: Tensor  # [S, C] index into the gathered [W * S * C] tail buffer
    # The summary pass: the last subsequences of published fragments, back to back (with a
    # slots cap: S + 1 sequences over all num_tokens, the extra ones padding, never read).
    summary_row: Tensor  # [S] summary-pass sequence of each local fragment, -1 if unpublished
    summary_token_index: Tensor  # [Ls] local token ids of the summary-pass sequences
    summary_cu_seqlens: Tensor  # [Ns + 1] int32 offsets into summary_token_index
    summary_cu_seqlens_cpu: Tensor  # [Ns + 1] int32, the same on the host
    summary_subsequence: Tensor  # [Ns] int32 local subsequence of each summary sequence, -1 pad
    summary_subsequence_cpu: Tensor  # [Ns] int32, the same on the host
    # The kernels' chunk tables (``routing.chunks``) for both passes, so fla-core derives
    # nothing from cu_seqlens: NT = sum of ceil(len / chunk_size) over the sequences.
    chunk_size: int  # tokens per chunk the tables were built for (fla-core: 64)
    # [NT, 2] int32 (sequence, chunk within it), from cu_seqlens; with caps padded with (-1, -1)
    # rows to chunk_bound(num_tokens, N, chunk_size) rows: the kernels take the first NT.
    chunk_indices: Tensor
    chunk_offsets: Tensor  # [N + 1] first chunk of each sequence, then NT
    summary_chunk_indices: Tensor  # [NTs, 2] int32, the same from summary_cu_seqlens
    summary_chunk_offsets: Tensor  # [Ns + 1], the same from summary_cu_seqlens
