"""Host-side routing plan of one rank: subsequences, state routes and conv halo sources.

Everything is computed with vectorised CPU torch ops over the documents and *all* ranks'
fragments at once (one sort, a few ``searchsorted``); the cost is linear in documents plus
fragments and has no Python loop over documents.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .chunks import chunk_bound, chunk_tables
from .device import DeviceRouting, RoutingCaps, RoutingCapsExceeded
from .layouts import int_tensor
from .pass_kv import PassKVSchedule, pass_kv_pairs

__all__ = ["RoutingPlan"]

_I64 = torch.int64


def _check_cu_seqlens(cu: Tensor) -> None:
    if cu.numel() < 2:
        raise ValueError(f"cu_seqlens needs at least 2 entries (one document), got {cu.tolist()}")
    first, last = cu[[0, -1]].tolist()
    if first != 0:
        raise ValueError(f"cu_seqlens must start at 0, starts at {first}")
    steps = cu[1:] - cu[:-1]
    if bool((steps <= 0).any()):
        i = int((steps <= 0).nonzero()[0])
        raise ValueError(
            f"cu_seqlens must be strictly increasing: cu_seqlens[{i}] = {int(cu[i])}, "
            f"cu_seqlens[{i + 1}] = {int(cu[i + 1])}"
        )


def _diagnose_tiling(
    starts: list[int], stops: list[int], ranks: list[int], locs: list[int], total: int
) -> str:
    """Explain why the fragments (already known not to tile [0, total)) fail. Slow path only."""
    order = sorted(range(len(starts)), key=lambda i: (starts[i], stops[i]))

    def name(i: int) -> str:
        return f"rank {ranks[i]} fragment {locs[i]} [{starts[i]}, {stops[i]})"

    if not order:
        return f"no fragments, but cu_seqlens ends at {total}"
    covered = 0
    prev = None
    for i in order:
        if starts[i] < covered:
            other = f"{name(prev)}" if prev is not None else "the stream start"
            return f"overlap: {name(i)} overlaps {other}"
        if starts[i] > covered:
            after = f" after {name(prev)}" if prev is not None else ""
            return f"gap: tokens [{covered}, {starts[i]}) are owned by no rank{after}"
        covered, prev = stops[i], i
    if covered != total:
        what = "past" if covered > total else "short of"
        return f"fragments end at {covered}, {what} cu_seqlens[-1] = T = {total}"
    return "fragments do not tile the stream"  # unreachable in practice


@dataclass(frozen=True, eq=False)
class RoutingPlan:
    """Routing of one rank for one microbatch layout. Frozen: ``PlanCache`` hands the same plan
    to every microbatch with that layout, so no field can be rebound (``FrozenInstanceError``),
    and its tensors are read-only by contract (``to_device`` copies, never aliases, them).

    Host fields (int64 CPU tensors unless noted):
      ``rank``, ``world_size``, ``num_slots`` (most fragments any rank owns), ``num_tokens``
      (this rank's span length), ``total_tokens`` (T);
      ``fragments``: this rank's ``(start, stop)`` in span order (a tuple of pairs);
      ``subsequences``: ``[N, 3]`` (document, global start, global stop) in span order;
      ``cu_seqlens``: ``[N + 1]`` local span offsets of the subsequences;
      ``terminal``: ``[Nt]`` local indices of the subsequences that end their document;
      ``frag_first`` / ``frag_last``: ``[F_local]`` local subsequence index of each fragment's
      first / last subsequence;
      ``predecessors`` / ``successors`` (lists, built on access) and :meth:`conv_sources`.
    Build one with :meth:`build`.
    """

    rank: int
    world_size: int
    num_slots: int
    num_tokens: int
    total_tokens: int
    fragments: tuple[tuple[int, int], ...]
    subsequences: Tensor
    cu_seqlens: Tensor
    terminal: Tensor
    frag_first: Tensor
    frag_last: Tensor
    # Global fragments sorted by start: start, stop, owner rank, index within the owner.
    _sorted_start: Tensor = field(repr=False)
    _sorted_stop: Tensor = field(repr=False)
    _sorted_rank: Tensor = field(repr=False)
    _sorted_local: Tensor = field(repr=False)
    # Per local fragment: sorted position, first predecessor's sorted position (== own
    # position when none), one past the last successor's (== own + 1 when none), start of the
    # document of its first subsequence, its span offset, global start and length.
    _pos: Tensor = field(repr=False)
    _pred_begin: Tensor = field(repr=False)
    _succ_end: Tensor = field(repr=False)
    _doc_start: Tensor = field(repr=False)
    _span_offset: Tensor = field(repr=False)
    _frag_start: Tensor = field(repr=False)
    _frag_len: Tensor = field(repr=False)
    # The global document boundaries (the pass-KV schedule pairs every rank's documents).
    _global_cu: Tensor = field(repr=False)

    # ------------------------------------------------------------------ build
    @classmethod
    def build(
        cls,
        cu_seqlens: Sequence[int] | Tensor,
        fragments: Sequence[Sequence[tuple[int, int]]],
        rank: int,
    ) -> RoutingPlan:
        """Plan for ``rank`` given the global document boundaries ``cu_seqlens`` ``[D + 1]`` and
        every rank's fragments (``fragments[r]`` in rank ``r``'s span order).

        Raises ``ValueError`` naming the problem for a bad ``cu_seqlens``, a rank out of range,
        an empty or inverted fragment, or a table that does not tile ``[0, T)`` exactly once.
        """
        cu = int_tensor(cu_seqlens)
        _check_cu_seqlens(cu)
        total = int(cu[-1])
        world = len(fragments)
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is out of range for {world} ranks in the fragment table")

        # One host pass over the table (linear in fragments) into a single [F, 4] tensor of
        # (start, stop, owner rank, index within the owner): one conversion instead of a dozen
        # small ops, which dominate at a few hundred fragments.
        try:
            flat = [
                x
                for r, frags in enumerate(fragments)
                for j, (a, b) in enumerate(frags)
                for x in (a, b, r, j)
            ]
        except (TypeError, ValueError):
            raise ValueError("every fragment must be a (start, stop) pair") from None
        table = int_tensor(flat).view(-1, 4).t().contiguous()  # [4, F], rows contiguous
        nfrag = table.shape[1]
        if nfrag == 0:
            raise ValueError(f"fragment table has no fragments, but cu_seqlens ends at {total}")
        starts, stops = table[0], table[1]
        if bool((stops <= starts).any()):
            i = int((stops <= starts).nonzero()[0])
            a, b, r, j = table[:, i].tolist()
            kind = "empty" if a == b else "start > stop"
            raise ValueError(f"rank {r} fragment {j} ({a}, {b}) is {kind}")
        order = torch.argsort(starts, stable=True)
        ordered = table[:, order]
        s_start, s_stop = ordered[0], ordered[1]
        first_start, last_stop = int(s_start[0]), int(s_stop[-1])
        if not (first_start == 0 and last_stop == total and torch.equal(s_start[1:], s_stop[:-1])):
            starts_l, stops_l, owner_l, local_l = table.tolist()
            raise ValueError(
                "fragment table does not tile [0, T) exactly once: "
                + _diagnose_tiling(starts_l, stops_l, owner_l, local_l, total)
            )

        own = tuple((int(a), int(b)) for a, b in fragments[rank])
        n_local = len(own)
        lo = sum(len(f) for f in fragments[:rank])
        a, b = starts[lo : lo + n_local], stops[lo : lo + n_local]
        lengths = b - a

        # Document of each fragment's first token and of its last token.
        docs_ab = torch.searchsorted(cu, torch.cat([a, b - 1]), right=True) - 1
        d_first, d_last = docs_ab[:n_local], docs_ab[n_local:]
        nsub = d_last - d_first + 1
        ends = torch.cumsum(nsub, 0)
        frag_first = ends - nsub
        # Subsequences: fragment j covers documents d_first[j] .. d_last[j].
        sub_frag = torch.repeat_interleave(torch.arange(n_local), nsub)
        docs = d_first[sub_frag] + torch.arange(sub_frag.numel()) - frag_first[sub_frag]
        doc_bounds = cu[torch.stack([docs, docs + 1])]
        sub_start = torch.maximum(doc_bounds[0], a[sub_frag])
        sub_stop = torch.minimum(doc_bounds[1], b[sub_frag])
        cu_local = torch.cat([torch.zeros(1, dtype=_I64), torch.cumsum(sub_stop - sub_start, 0)])

        # Predecessors are the sorted fragments from the one holding the first-subsequence
        # document's start up to (excluding) this one; successors from the next one up to the one
        # holding the last-subsequence document's final token. Tiling makes this exact, and the
        # same search finds each local fragment's own sorted position.
        doc_edges = cu[torch.cat([d_first, d_last + 1])]
        doc_start = doc_edges[:n_local]
        where = torch.searchsorted(
            s_start, torch.cat([doc_start, doc_edges[n_local:] - 1, a]), right=True
        )
        return cls(
            rank=rank,
            world_size=world,
            num_slots=max(len(f) for f in fragments),
            num_tokens=int(cu_local[-1]),
            total_tokens=total,
            fragments=own,
            subsequences=torch.stack([docs, sub_start, sub_stop], dim=1),
            cu_seqlens=cu_local,
            terminal=(sub_stop == doc_bounds[1]).nonzero().reshape(-1),
            frag_first=frag_first,
            frag_last=ends - 1,
            _sorted_start=s_start,
            _sorted_stop=s_stop,
            _sorted_rank=ordered[2],
            _sorted_local=ordered[3],
            _pos=where[2 * n_local :] - 1,
            _pred_begin=where[:n_local] - 1,
            _succ_end=where[n_local : 2 * n_local],
            _doc_start=doc_start,
            _span_offset=torch.cumsum(lengths, 0) - lengths,
            _frag_start=a,
            _frag_len=lengths,
            _global_cu=cu.clone(),  # by value: the caller may reuse its tensor
        )

    # ------------------------------------------------------------------ host views
    @property
    def num_subsequences(self) -> int:
        return self.subsequences.shape[0]

    @functools.cached_property
    def _lists(self) -> tuple[list[int], list[int], list[int], list[int]]:
        # cached_property writes the instance __dict__ directly, which a frozen dataclass allows.
        return (
            self._sorted_rank.tolist(),
            self._sorted_local.tolist(),
            self._sorted_start.tolist(),
            self._sorted_stop.tolist(),
        )

    def _host_lists(self) -> tuple[list[int], list[int], list[int], list[int]]:
        return self._lists

    @property
    def predecessors(self) -> list[list[tuple[int, int]]]:
        """Per local fragment, ``(rank, fragment)`` of the earlier pieces of its first
        subsequence's document, increasing token order (empty when that document starts here)."""
        ranks, locs, _, _ = self._host_lists()
        return [
            [(ranks[q], locs[q]) for q in range(begin, pos)]
            for begin, pos in zip(self._pred_begin.tolist(), self._pos.tolist())
        ]

    @property
    def successors(self) -> list[list[tuple[int, int]]]:
        """Per local fragment, ``(rank, fragment)`` of the later pieces of its last
        subsequence's document, increasing token order (empty when that document ends here)."""
        ranks, locs, _, _ = self._host_lists()
        return [
            [(ranks[q], locs[q]) for q in range(pos + 1, end)]
            for pos, end in zip(self._pos.tolist(), self._succ_end.tolist())
        ]

    def conv_sources(self, conv_history: int = 3) -> list[list[tuple[int, int, int]]]:
        """Per local fragment, the owners ``(rank, fragment, offset within that fragment)`` of the
        up to ``conv_history`` tokens before the fragment start that belong to the same document,
        oldest first. They may lie in several short fragments on several ranks."""
        if conv_history < 0:
            raise ValueError(f"conv_history must be >= 0, got {conv_history}")
        ranks, locs, s_start, _ = self._host_lists()
        out = []
        for (start, _), doc_start in zip(self.fragments, self._doc_start.tolist()):
            srcs = []
            for t in range(max(doc_start, start - conv_history), start):
                q = bisect.bisect_right(s_start, t) - 1
                srcs.append((ranks[q], locs[q], t - s_start[q]))
            out.append(srcs)
        return out

    @functools.cached_property
    def pass_kv(self) -> PassKVSchedule:
        """This rank's pass-KV attention schedule (``routing.pass_kv``), built on first use
        and cached with the plan (so ``PlanCache`` hits reuse it)."""
        pairs = pass_kv_pairs(
            self._global_cu,
            self._sorted_start,
            self._sorted_stop,
            self._sorted_rank,
            self._sorted_local,
            self.world_size,
        )
        return PassKVSchedule.build(pairs, self.rank)

    # ------------------------------------------------------------------ device
    def to_device(
        self,
        device: torch.device | str,
        *,
        caps: RoutingCaps | None = None,
        conv_history: int = 3,
        chunk_size: int = 64,
    ) -> DeviceRouting:
        """Device tensors of this plan (fields and shapes in docs/CONTRACTS.md).

        Builds fresh host tensors on every call (pinned when CUDA is available) and copies them
        with ``non_blocking=True``, packed into one int64 and one int32 buffer (two copies).
        ``chunk_size`` is the token chunk of the kernels' chunk tables (fla-core's is 64).
        """
        if conv_history < 0:
            raise ValueError(f"conv_history must be >= 0, got {conv_history}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        fixed_shapes = caps is not None
        caps = caps or RoutingCaps()
        n_local = len(self.fragments)
        n_sub = self.num_subsequences
        n_pred = self._pos - self._pred_begin
        need_pred = int(n_pred.max()) if n_local else 0
        n_term = self.terminal.numel()
        slots = _capped("slots", caps.slots, self.num_slots, "fragments on one rank")
        n_cap = _capped(
            "subsequences", caps.subsequences, n_sub, f"subsequences on rank {self.rank}"
        )
        p_cap = _capped("predecessors", caps.predecessors, need_pred, "predecessors of a fragment")
        t_cap = _capped(
            "terminal", caps.terminal, n_term, f"terminal subsequences on rank {self.rank}"
        )
        C = conv_history

        slot_of_sorted = self._sorted_rank * slots + self._sorted_local
        nfrag = slot_of_sorted.numel()

        def per_slot(values: Tensor, width: int | None = None) -> Tensor:
            shape = (slots,) if width is None else (slots, width)
            out = torch.full(shape, -1, dtype=_I64)
            out[:n_local] = values
            return out

        frag_first = per_slot(self.frag_first)
        frag_last = per_slot(self.frag_last)
        publish = per_slot((self._succ_end > self._pos + 1).to(_I64))
        publish[n_local:] = 0

        q = self._pred_begin.unsqueeze(1) + torch.arange(p_cap)
        pred = slot_of_sorted[q.clamp(max=nfrag - 1)]
        pred = torch.where(q < self._pos.unsqueeze(1), pred, -1)
        pred_slots = per_slot(pred, p_cap)
        # The fold's schedule: slots by predecessor count, descending, so the slots that still
        # fold at column p are a prefix (``fold_steps[p]`` of them); stable, so ties keep order.
        counts = torch.zeros(slots, dtype=_I64)
        counts[:n_local] = n_pred.clamp(max=p_cap)
        fold_order = torch.argsort(counts, descending=True, stable=True)
        fold_steps = tuple(int((counts > p).sum()) for p in range(p_cap))

        terminal = torch.full((t_cap,), -1, dtype=_I64)
        terminal[:n_term] = self.terminal

        starts, lengths = self._frag_start, self._frag_len
        back = C - torch.arange(C)  # column c holds the token `back[c]` before the end
        tail = self._span_offset.unsqueeze(1) + lengths.unsqueeze(1) - back
        tail = torch.where(lengths.unsqueeze(1) >= back, tail, -1)
        tail_index = per_slot(tail, C)

        tok = starts.unsqueeze(1) - back  # global ids of the C tokens before each fragment
        owner = torch.searchsorted(self._sorted_start, tok.clamp(min=0), right=True) - 1
        halo = slot_of_sorted[owner] * C + C - (self._sorted_stop[owner] - tok)
        halo = torch.where(tok >= self._doc_start.unsqueeze(1), halo, -1)
        halo_index = per_slot(halo, C)

        # Summary pass: each published fragment's last subsequence, back to back, so the
        # kernels get its varlen offsets on the host without reading the device back.
        published = publish[:n_local].nonzero().reshape(-1)
        n_pub = published.numel()
        summary_row = torch.full((slots,), -1, dtype=_I64)
        summary_row[published] = torch.arange(n_pub, dtype=_I64)
        last = self.frag_last[published]
        summary_sub = last.clone()
        piece_start = self.cu_seqlens[last]
        piece_len = self.cu_seqlens[last + 1] - piece_start
        summary_cu = torch.zeros(n_pub + 1, dtype=_I64)
        torch.cumsum(piece_len, 0, out=summary_cu[1:])
        n_real = int(summary_cu[-1])
        summary_tokens = torch.repeat_interleave(
            piece_start - summary_cu[:-1], piece_len
        ) + torch.arange(n_real, dtype=_I64)
        if caps.slots is not None:
            # Layout-independent shapes: S + 1 sequences over all num_tokens; the first extra
            # sequence holds the padding tokens, the rest are empty; no fragment reads them.
            pad = self.num_tokens - n_real
            summary_tokens = torch.cat([summary_tokens, torch.zeros(pad, dtype=_I64)])
            extra = torch.full((slots + 1 - n_pub,), self.num_tokens, dtype=_I64)
            summary_cu = torch.cat([summary_cu, extra])
            summary_sub = torch.cat([summary_sub, torch.full((slots + 1 - n_pub,), -1)])

        cu_cpu = torch.full((n_cap + 1,), self.num_tokens, dtype=torch.int32)
        cu_cpu[: n_sub + 1] = self.cu_seqlens
        # The kernels' chunk tables of both passes, so the kernel library derives nothing from
        # cu_seqlens itself (its own helper copies from pageable memory: a sync per call).
        main_chunks, main_offsets = chunk_tables(cu_cpu, chunk_size)
        summary_chunks, summary_offsets = chunk_tables(summary_cu, chunk_size)
        if fixed_shapes:
            # Layout-independent shapes: rows up to chunk_bound, padding rows (-1, -1). The
            # kernels get the first NT rows (NT from the host offsets), never the padding.
            n_sum = summary_cu.numel() - 1
            main_chunks = _pad_rows(main_chunks, chunk_bound(self.num_tokens, n_cap, chunk_size))
            summary_chunks = _pad_rows(
                summary_chunks, chunk_bound(int(summary_cu[-1]), n_sum, chunk_size)
            )
        # Every device tensor, by its DeviceRouting field name, in one of two packed buffers
        # (one H2D copy each); a new field is one line here plus its contract.
        wide = {  # int64
            "frag_first": frag_first,
            "frag_last": frag_last,
            "publish": publish,  # unpacked as bool
            "pred_slots": pred_slots,
            "fold_order": fold_order,
            "terminal": terminal,
            "tail_index": tail_index,
            "halo_index": halo_index,
            "summary_row": summary_row,
            "summary_token_index": summary_tokens,
            "chunk_offsets": main_offsets,
            "summary_chunk_offsets": summary_offsets,
        }
        narrow = {  # int32, the kernels' varlen metadata; the host copy stays readable
            "cu_seqlens": cu_cpu,
            "summary_cu_seqlens": summary_cu.to(torch.int32),
            "summary_subsequence": summary_sub.to(torch.int32),
            "chunk_indices": main_chunks,
            "summary_chunk_indices": summary_chunks,
        }
        dev = torch.device(device)
        pin = torch.cuda.is_available()
        _, wide_dev = _pack(wide, dev, pin)
        narrow_host, narrow_dev = _pack(narrow, dev, pin, host=_HOST_FIELDS)
        wide_dev["publish"] = wide_dev["publish"].to(torch.bool)
        return DeviceRouting(
            rank=self.rank,
            world_size=self.world_size,
            num_slots=slots,
            conv_history=C,
            num_tokens=self.num_tokens,
            chunk_size=chunk_size,
            fold_steps=fold_steps,
            cu_seqlens_cpu=narrow_host["cu_seqlens"],
            summary_cu_seqlens_cpu=narrow_host["summary_cu_seqlens"],
            summary_subsequence_cpu=narrow_host["summary_subsequence"],
            **wide_dev,
            **narrow_dev,
        )

    def __repr__(self) -> str:
        return (
            f"RoutingPlan(rank={self.rank}, world_size={self.world_size}, "
            f"num_slots={self.num_slots}, fragments={self.fragments}, "
            f"subsequences={self.num_subsequences}, num_tokens={self.num_tokens})"
        )


# The int32 fields the kernels also read on the host (no device readback): a ``*_cpu`` twin each.
_HOST_FIELDS = ("cu_seqlens", "summary_cu_seqlens", "summary_subsequence")


def _pack(
    fields: dict[str, Tensor], device: torch.device, pin: bool, host: tuple[str, ...] = ()
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Copy same-dtype host tensors to ``device`` as one buffer; returns ``(host views of the
    1-D fields named in host, device views of every field)`` by name, each of its field's
    shape. With ``host`` a CPU target gets a copy too, so host and device never alias."""
    tensors = list(fields.values())
    packed = torch.cat([f.reshape(-1) for f in tensors])
    if pin:
        packed = packed.pin_memory()
    packed_dev = packed.to(device, non_blocking=True, copy=bool(host))
    sizes = [f.numel() for f in tensors]
    parts = torch.split(packed_dev, sizes)
    dev = {k: p.view(f.shape) for (k, f), p in zip(fields.items(), parts)}
    if not host:
        return {}, dev
    host_parts = dict(zip(fields, torch.split(packed, sizes)))
    return {k: host_parts[k] for k in host}, dev


def _pad_rows(table: Tensor, rows: int) -> Tensor:
    out = torch.full((rows, table.shape[1]), -1, dtype=table.dtype)
    out[: table.shape[0]] = table
    return out


def _capped(name: str, cap: int | None, need: int, what: str) -> int:
    if cap is None:
        return need
    if need > cap:
        raise RoutingCapsExceeded(
            f"layout exceeds RoutingCaps.{name}={cap}: needs {need} {what}", name
        )
    return cap
