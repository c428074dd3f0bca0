"""Host-side schedule of pass-KV softmax attention under context parallelism (torch only).

Under pass-KV every rank keeps only its own keys/values; K/V blocks travel point to point in
rounds, and only between ranks whose tokens can see each other under the causal document mask.
Everything below is computed on the host from the microbatch's document boundaries and every
rank's fragments (the routing plan's inputs): no device value is read and no shape depends on
device data. docs/cp.md ("Pass-KV attention") has a worked example.

**Pairs.** For a query rank ``q`` and a key rank ``k`` the keys of ``k`` that some query of ``q``
can see are, per document both hold, ``k``'s tokens of that document up to ``q``'s last token of
it. Their rows in ``k``'s span have a hull ``key_rows[q, k] = [a, b)``: one contiguous slice of
``k``'s span, so it is sent as a view, without a copy. ``query_rows[q, k]`` is the hull of the
rows of ``q``'s span whose queries see at least one of those keys (only they take part in that
pair's compute). ``exact_keys[q, k]`` counts the visible key rows themselves (the hull may hold
a few more, which the mask hides). The diagonal is a rank's own span.

**Rounds.** Round ``s`` (``1 <= s < W``) pairs every rank ``r`` with ``r - s`` (whose keys it
receives) and ``r + s`` (to which it sends), modulo ``W``: each round is a permutation, so every
rank sends at most one block and receives at most one block per round. A round in which no rank
receives anything is dropped for everyone (``shifts`` lists the rounds that remain); within a
remaining round a rank posts only the messages its pairs need and computes only what it
received. Every rank walks ``shifts`` in the same order, which keeps the order of the messages
between any two ranks the same on both ends (what NCCL's point-to-point matching relies on).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "DevicePassKV",
    "PassKVPairs",
    "PassKVRound",
    "PassKVSchedule",
    "expand_segments",
    "pass_kv_pairs",
]

_I64 = torch.int64


@dataclass(frozen=True)
class PassKVRound:
    """One round of one rank. Rows are half-open ``(start, stop)`` in a span.

    ``recv_from``: the rank whose keys arrive (``-1``: none), ``recv_rows`` their rows in *its*
    span, ``query_rows`` the rows of this rank's span that attend to them, ``visit_offset``
    where its rows start among the schedule's received rows. ``send_to``: the rank this
    rank's ``send_rows`` go to (``-1``: none).
    """

    shift: int
    recv_from: int = -1
    recv_rows: tuple[int, int] = (0, 0)
    query_rows: tuple[int, int] = (0, 0)
    visit_offset: int = 0
    send_to: int = -1
    send_rows: tuple[int, int] = (0, 0)

    @property
    def num_recv(self) -> int:
        return self.recv_rows[1] - self.recv_rows[0]

    @property
    def num_send(self) -> int:
        return self.send_rows[1] - self.send_rows[0]


@dataclass(frozen=True, eq=False)
class PassKVPairs:
    """The pair tables of one layout, the same on every rank (host int64 tensors).

    ``span_tokens [W]``; ``visible [W, W]`` bool, ``key_rows`` / ``query_rows [W, W, 2]`` and
    ``exact_keys [W, W]`` indexed ``[query rank, key rank]`` (see the module docstring; ``(0,
    0)`` where a pair sees nothing); ``shifts``: the rounds that remain, increasing.
    """

    world_size: int
    span_tokens: Tensor
    visible: Tensor
    key_rows: Tensor
    query_rows: Tensor
    exact_keys: Tensor
    shifts: tuple[int, ...]
    # Every subsequence sorted by (owner rank, span row): the id lookup of visiting rows.
    _piece_key: Tensor = field(repr=False)  # owner * (T + 1) + first span row
    _piece_start: Tensor = field(repr=False)  # global id of its first token
    _piece_doc: Tensor = field(repr=False)
    _stride: int = field(repr=False)  # T + 1

    def rounds(self, rank: int) -> tuple[PassKVRound, ...]:
        """``rank``'s rounds, one per entry of ``shifts`` (without ``visit_offset``)."""
        W = self.world_size
        vis = self.visible.tolist()
        krows = self.key_rows.tolist()
        qrows = self.query_rows.tolist()
        out = []
        for s in self.shifts:
            src, dst = (rank - s) % W, (rank + s) % W
            rd: dict[str, Any] = {"shift": s}
            if vis[rank][src]:
                rd.update(
                    recv_from=src,
                    recv_rows=tuple(krows[rank][src]),
                    query_rows=tuple(qrows[rank][src]),
                )
            if vis[dst][rank]:
                rd.update(send_to=dst, send_rows=tuple(krows[dst][rank]))
            out.append(PassKVRound(**rd))
        return tuple(out)

    def segments(self, owner_rows: list[tuple[int, int, int]]) -> Tensor:
        """The span rows ``(owner, start, stop)``, concatenated in the given order, as runs of
        consecutive global tokens of one document: ``[3, S]`` int64 (first token id, length,
        document). Work is per request and piece (subsequence), never per row."""
        parts = []
        for owner, a, b in owner_rows:
            if b <= a:
                continue
            base = owner * self._stride
            lo, hi = torch.searchsorted(
                self._piece_key, torch.tensor([base + a, base + b - 1]), right=True
            ).tolist()
            first = self._piece_key[lo - 1 : hi] - base  # span rows of the pieces it touches
            seg_a = first.clamp(min=a)
            seg_b = torch.cat([first[1:], torch.tensor([b])]).clamp(max=b)
            start = self._piece_start[lo - 1 : hi] + seg_a - first
            parts.append(torch.stack([start, seg_b - seg_a, self._piece_doc[lo - 1 : hi]]))
        return torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=_I64)

    def traffic(self, rank: int) -> dict[str, int]:
        """Rows of K/V (one row = one token's keys and values) that ``rank`` moves and holds,
        from the tables alone, for the op's order of work (docs/cp.md, "Memory and traffic"):

        ``own``; ``sent`` / ``received`` per forward (the backward moves the same K/V again
        plus, the other way, as many gradient rows); ``visiting_peak``: most received K/V rows
        alive at once (the block being computed and the next one in flight), forward and
        backward alike; ``grad_peak``: most visiting dK/dV rows alive at once in the backward
        (this round's and the previous round's outgoing block, the previous round's incoming
        one), besides the own ``dK/dV``; ``rounds`` / ``messages``: active rounds and posted
        point-to-point messages per forward."""
        rounds = self.rounds(rank)
        n = [rd.num_recv for rd in rounds] + [0]
        m = [rd.num_send for rd in rounds] + [0]
        visiting = max([n[0]] + [n[j] + n[j + 1] for j in range(len(rounds))])
        grad = 0
        for j in range(len(rounds)):
            prev = n[j - 1] + m[j - 1] if j else 0
            grad = max(grad, prev + n[j], n[j] + m[j])
        return {
            "own": int(self.span_tokens[rank]),
            "sent": sum(m),
            "received": sum(n),
            "visiting_peak": visiting,
            "grad_peak": grad,
            "rounds": sum(1 for rd in rounds if rd.recv_from >= 0 or rd.send_to >= 0),
            "messages": sum((rd.recv_from >= 0) + (rd.send_to >= 0) for rd in rounds),
        }


def _span_offsets(lengths: Tensor, owners: Tensor, locals_: Tensor, world: int) -> Tensor:
    """Each fragment's first row in its owner's span (fragments in span order per owner)."""
    order = torch.argsort(owners * (int(locals_.max()) + 1) + locals_)
    lens = lengths[order]
    excl = torch.cumsum(lens, 0) - lens
    tokens = torch.zeros(world, dtype=_I64).index_add_(0, owners, lengths)
    base = torch.cumsum(tokens, 0) - tokens
    off = torch.empty_like(lengths)
    off[order] = excl - base[owners[order]]
    return off


def pass_kv_pairs(
    cu_seqlens: Tensor, starts: Tensor, stops: Tensor, owners: Tensor, locals_: Tensor, world: int
) -> PassKVPairs:
    """The pair tables of a layout: global document boundaries ``cu_seqlens [D + 1]`` and every
    fragment's ``starts``, ``stops``, owner rank and index within the owner's span (``[F]``
    int64 each, any order; they tile ``[0, T)``, as ``RoutingPlan.build`` checks).

    Vectorised over subsequences; the dense work is ``[pieces of documents on >= 2 ranks, W]``.
    """
    cu = cu_seqlens
    total = int(cu[-1])
    lengths = stops - starts
    off = _span_offsets(lengths, owners, locals_, world)
    tokens = torch.zeros(world, dtype=_I64).index_add_(0, owners, lengths)

    # Every subsequence ("piece"): document, global [start, stop), owner, first span row.
    d_first = torch.searchsorted(cu, starts, right=True) - 1
    d_last = torch.searchsorted(cu, stops - 1, right=True) - 1
    nsub = d_last - d_first + 1
    frag = torch.repeat_interleave(torch.arange(starts.numel()), nsub)
    first = torch.cumsum(nsub, 0) - nsub
    doc = d_first[frag] + torch.arange(frag.numel()) - first[frag]
    p_start = torch.maximum(cu[doc], starts[frag])
    p_stop = torch.minimum(cu[doc + 1], stops[frag])
    p_rank = owners[frag]
    p_off = off[frag] + p_start - starts[frag]

    # Only documents held by two ranks or more pair different ranks.
    ndoc = cu.numel() - 1
    owner_docs = torch.unique(doc * world + p_rank) // world
    multi = torch.bincount(owner_docs, minlength=ndoc) >= 2
    sel = multi[doc]
    compact = torch.full((ndoc,), -1, dtype=_I64)
    n_multi = int(multi.sum())
    compact[multi] = torch.arange(n_multi)
    c = compact[doc[sel]]
    s_start, s_stop, s_rank, s_off = p_start[sel], p_stop[sel], p_rank[sel], p_off[sel]

    # Per (rank, shared document): the end of its last token, the start of its first.
    cell = s_rank * n_multi + c
    last_stop = torch.zeros(world * n_multi, dtype=_I64).scatter_reduce_(
        0, cell, s_stop, "amax", include_self=True
    )
    first_start = torch.full((world * n_multi,), total, dtype=_I64).scatter_reduce_(
        0, cell, s_start, "amin", include_self=True
    )
    ranks = torch.arange(world)
    big = torch.iinfo(_I64).max
    pair = world * world

    def hull(flat: Tensor, lo: Tensor, hi: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
        # Masked values instead of boolean indexing: no compaction pass over [P', W].
        flat = flat.reshape(-1)
        lo = torch.where(keep, lo, big).reshape(-1)
        hi = torch.where(keep, hi, 0).reshape(-1)
        a = torch.full((pair,), big, dtype=_I64).scatter_reduce_(0, flat, lo, "amin")
        b = torch.zeros(pair, dtype=_I64).scatter_reduce_(0, flat, hi, "amax")
        return a, b

    # Key side: piece p of key rank k, query rank q (a column): visible keys [start, min(stop,
    # q's last stop in the document)).
    # Row gathers from [n_multi, W] (contiguous rows; a column gather from [W, n_multi] walks
    # memory with a stride of n_multi and costs ~10x more at thousands of documents).
    q_stop = last_stop.view(world, n_multi).t().contiguous()[c]  # [P', W]
    n_keys = (torch.minimum(s_stop.unsqueeze(1), q_stop) - s_start.unsqueeze(1)).clamp(min=0)
    rows = torch.arange(s_rank.numel())
    n_keys[rows, s_rank] = 0  # the diagonal is the rank's own block
    k_flat = ranks.unsqueeze(0) * world + s_rank.unsqueeze(1)  # index q * W + k
    ka, kb = hull(
        k_flat, s_off.unsqueeze(1).expand_as(n_keys), s_off.unsqueeze(1) + n_keys, n_keys > 0
    )
    exact = torch.zeros(pair, dtype=_I64).index_add_(0, k_flat.reshape(-1), n_keys.reshape(-1))

    # Query side: piece p of query rank q, key rank k (a column): queries from max(start, k's
    # first start in the document) to stop see a key of k.
    k_start = first_start.view(world, n_multi).t().contiguous()[c]
    vis_from = torch.maximum(s_start.unsqueeze(1), k_start)
    n_q = (s_stop.unsqueeze(1) - vis_from).clamp(min=0)
    n_q[rows, s_rank] = 0
    q_flat = s_rank.unsqueeze(1) * world + ranks.unsqueeze(0)
    qa, qb = hull(
        q_flat,
        s_off.unsqueeze(1) + vis_from - s_start.unsqueeze(1),
        (s_off + s_stop - s_start).unsqueeze(1).expand_as(n_q),
        n_q > 0,
    )

    visible = (exact > 0).view(world, world)
    key_rows = torch.stack([ka, kb], 1).view(world, world, 2)
    query_rows = torch.stack([qa, qb], 1).view(world, world, 2)
    key_rows[~visible] = 0
    query_rows[~visible] = 0
    exact = exact.view(world, world)
    diag = torch.stack([torch.zeros_like(tokens), tokens], 1)
    key_rows[ranks, ranks] = diag
    query_rows[ranks, ranks] = diag
    exact[ranks, ranks] = tokens
    visible[ranks, ranks] = tokens > 0

    shift = torch.arange(1, world).unsqueeze(1)
    src = (ranks.unsqueeze(0) - shift) % world  # [W - 1, W]: who rank r hears from in round s
    active = visible[ranks.unsqueeze(0).expand_as(src), src].any(dim=1)
    shifts = tuple(int(s) for s in (active.nonzero().reshape(-1) + 1).tolist())

    stride = total + 1
    order = torch.argsort(p_rank * stride + p_off)
    return PassKVPairs(
        world_size=world,
        span_tokens=tokens,
        visible=visible,
        key_rows=key_rows,
        query_rows=query_rows,
        exact_keys=exact,
        shifts=shifts,
        _piece_key=(p_rank * stride + p_off)[order],
        _piece_start=p_start[order],
        _piece_doc=doc[order],
        _stride=stride,
    )


def expand_segments(segments: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """Token ids and document ids ``[total]`` of ``segments [3, S]`` (first token id, length,
    document), on the segments' device; ``total`` (their summed length, a host int) keeps
    ``repeat_interleave`` from reading the lengths back."""
    start, n, doc = segments
    excl = torch.cumsum(n, 0) - n
    tok = torch.repeat_interleave(start - excl, n, output_size=total)
    tok += torch.arange(total, dtype=_I64, device=segments.device)
    return tok, torch.repeat_interleave(doc, n, output_size=total)


@dataclass(frozen=True, eq=False)
class PassKVSchedule:
    """One rank's pass-KV schedule: the layout's ``pairs``, this rank's ``rounds`` (one per
    ``pairs.shifts``) and the received rows as ``visit_segments [3, S]`` (runs of consecutive
    tokens of one document, in round order: first token id, length, document) over
    ``num_visiting`` rows; the per-pair masks are built from their ids and the local ones."""

    rank: int
    pairs: PassKVPairs
    rounds: tuple[PassKVRound, ...]
    visit_segments: Tensor
    num_visiting: int

    @property
    def world_size(self) -> int:
        return self.pairs.world_size

    @property
    def num_tokens(self) -> int:
        return int(self.pairs.span_tokens[self.rank])

    @classmethod
    def build(cls, pairs: PassKVPairs, rank: int) -> PassKVSchedule:
        rounds = pairs.rounds(rank)
        wanted, offset, placed = [], 0, []
        for rd in rounds:
            placed.append(dataclasses.replace(rd, visit_offset=offset))
            if rd.recv_from >= 0:
                wanted.append((rd.recv_from, *rd.recv_rows))
                offset += rd.num_recv
        return cls(rank, pairs, tuple(placed), pairs.segments(wanted), offset)

    def visit_ids(self) -> tuple[Tensor, Tensor]:
        """Global token ids and document ids ``[num_visiting]`` of the received rows (host)."""
        return expand_segments(self.visit_segments, self.num_visiting)

    def to_device(
        self, device: torch.device | str, token_ids: Tensor, doc_ids: Tensor
    ) -> DevicePassKV:
        """The device half for one microbatch: ``token_ids`` / ``doc_ids`` ``[T_local]`` are this
        rank's own (``SequenceContext``'s, on ``device``); the visiting rows' ids are expanded
        on the device from the segments (one small non-blocking copy, no host sync)."""
        segments = self.visit_segments
        if torch.device(device).type == "cuda":
            segments = segments.pin_memory()
        segments = segments.to(device, non_blocking=True, copy=True)
        tok, doc = expand_segments(segments, self.num_visiting)
        return DevicePassKV(self, token_ids, doc_ids, tok, doc)

    def describe(self) -> str:
        """Human-readable rounds of this rank (``routing explain`` and the docs)."""
        lines = [
            f"rank {self.rank}: own rows [0, {self.num_tokens}), rounds {list(self.pairs.shifts)}"
        ]
        for rd in self.rounds:
            parts = []
            if rd.recv_from >= 0:
                parts.append(
                    f"recv rows {_rows(rd.recv_rows)} of rank {rd.recv_from} for queries "
                    f"{_rows(rd.query_rows)}"
                )
            if rd.send_to >= 0:
                parts.append(f"send rows {_rows(rd.send_rows)} to rank {rd.send_to}")
            lines.append(f"  round {rd.shift}: " + ("; ".join(parts) or "idle"))
        return "\n".join(lines)


def _rows(rows: tuple[int, int]) -> str:
    return f"[{rows[0]}, {rows[1]})"


@dataclass(frozen=True, eq=False)
class DevicePassKV:
    """One microbatch's pass-KV schedule with its device ids: ``token_ids`` / ``doc_ids``
    ``[T_local]`` (this rank's queries and own keys), ``visit_token_ids`` / ``visit_doc_ids``
    ``[Nv]`` (the received rows). ``cache`` holds what the attention op derives from them once
    per microbatch and shares across layers (flex block masks)."""

    schedule: PassKVSchedule
    token_ids: Tensor
    doc_ids: Tensor
    visit_token_ids: Tensor
    visit_doc_ids: Tensor
    cache: dict[Any, Any] = field(default_factory=dict)
