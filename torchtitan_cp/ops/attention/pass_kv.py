"""Pass-KV softmax attention under context parallelism, routed by the documents.

Each rank keeps only its own keys/values. The host schedule (``routing.pass_kv``) says, for
every round, which block of which rank's K/V this rank receives (and for which of its queries)
and which slice of its own K/V it sends; rounds and pairs that no query can use are absent.
Forward, per round: the local queries attend to one visiting block under that pair's causal
document mask, and the partial outputs merge by log-sum-exp. Backward, per round: the same K/V
travel again, each rank computes its queries' share of the gradient against the visiting block,
and the block's dK/dV go back to the owner, which adds them into its own.

What is shared and what is not: the rounds, the messages, the merge and the backward are one
code path (``_PassKV``); only the per-pair kernel differs: ``math_pair_attention`` (plain
PyTorch, any device; the CPU path) or ``flex_pair_attention`` (flex attention with one
``BlockMask`` per pair, compiled on CUDA). A kernel is a differentiable ``(q, k, v, mask, scale)
-> (o, lse)``; the backward re-runs it on one block at a time under autograd with the cotangents
of the merged result, so nothing of a visiting block outlives its round.

Overlap: a round's messages are posted (``dist.batch_isend_irecv``: one send, one receive) before
the previous round's block is computed, so the next exchange runs during the current compute
(on CUDA on NCCL's stream; on gloo in its background threads). At most two visiting K/V blocks
are alive at once: the one being computed and the next one in flight.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import Tensor

from torchtitan_cp.routing.pass_kv import DevicePassKV, PassKVRound

from ..common.custom_ops import NS, autograd_inside_op
from ..common.dtypes import compute_dtype
from ..cp.collectives import group_rank, group_size
from .sdpa import document_causal_mask

__all__ = [
    "PairKernel",
    "PairMask",
    "PassKVTrace",
    "flex_pair_attention",
    "math_pair_attention",
    "pass_kv_attention",
    "pass_kv_attention_op",
    "pass_kv_handle",
]

# Largest query-block x key mask the math kernel materialises at once (elements).
_MASK_ELEMENTS = 1 << 22
_KV_TAG, _GRAD_TAG = 0, 1  # gloo matches by tag; NCCL by order, which the schedule keeps


@dataclass(eq=False)
class PairMask:
    """The causal document mask of one (query rows, key rows) pair, as the ids it is built from:
    ``q_tok`` / ``q_doc`` ``[Tq]`` and ``k_tok`` / ``k_doc`` ``[Tk]`` int64 on the device (global
    token id and document id). ``cache`` keeps what a kernel derives from them (flex's
    ``BlockMask``) for every layer of the microbatch."""

    q_tok: Tensor
    q_doc: Tensor
    k_tok: Tensor
    k_doc: Tensor
    cache: dict[str, Any] = field(default_factory=dict)

    def dense(self, q0: int = 0, q1: int | None = None) -> Tensor:
        """Boolean ``[q1 - q0, Tk]`` (True = attend) for query rows ``[q0, q1)``."""
        sl = slice(q0, q1)
        return document_causal_mask(self.q_tok[sl], self.q_doc[sl], self.k_tok, self.k_doc)

    def rows(self, q0: int, q1: int) -> PairMask:
        """The mask of query rows ``[q0, q1)`` against all keys (no cache: a new pair)."""
        return PairMask(self.q_tok[q0:q1], self.q_doc[q0:q1], self.k_tok, self.k_doc)


class PairKernel(Protocol):
    """``(q [B, Hq, Tq, D], k [B, Hkv, Tk, D], v [B, Hkv, Tk, Dv], mask, scale) -> (o [B, Hq,
    Tq, Dv], lse [B, Hq, Tq])``, differentiable in q, k, v; ``lse`` natural-log, ``-inf`` (and
    ``o`` zero) for a query that sees no key of the block."""

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, mask: PairMask, scale: float
    ) -> tuple[Tensor, Tensor]: ...


def math_pair_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: PairMask, scale: float
) -> tuple[Tensor, Tensor]:
    """Plain-PyTorch pair kernel (the CPU path): float32 (float64 for float64 inputs) scores,
    queries in blocks so the mask stays bounded. Returns ``o`` and ``lse`` in that dtype."""
    B, Hq, Tq, D = q.shape
    Hkv, Tk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    acc = compute_dtype(q.dtype)
    if Tq == 0 or Tk == 0:  # nothing to attend: zero output, -inf lse (still differentiable)
        dep = 0 * (q.sum() + k.sum() + v.sum()).to(acc)
        o = q.new_zeros(B, Hq, Tq, Dv, dtype=acc) + dep
        return o, torch.full((B, Hq, Tq), float("-inf"), dtype=acc, device=q.device) + dep
    qg = q.reshape(B, Hkv, Hq // Hkv, Tq, D).to(acc)  # q head h reads kv head h // (Hq/Hkv)
    kt = k.to(acc).unsqueeze(2).transpose(-1, -2)
    va = v.to(acc).unsqueeze(2)
    block = max(1, min(Tq, _MASK_ELEMENTS // max(Tk, 1)))
    outs, lses = [], []
    for q0 in range(0, Tq, block):
        q1 = min(q0 + block, Tq)
        s = torch.matmul(qg[..., q0:q1, :], kt) * scale  # [B, Hkv, rep, tq, Tk]
        s = s.masked_fill(~mask.dense(q0, q1), float("-inf"))
        m = s.amax(dim=-1, keepdim=True).detach()
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # rows without keys
        p = torch.exp(s - m)
        denom = p.sum(dim=-1, keepdim=True)
        seen = denom > 0
        safe = torch.where(seen, denom, torch.ones_like(denom))  # no 0/0, no log(0) in any gradient
        outs.append(torch.matmul(p, va) / safe)
        lses.append(torch.where(seen, m + torch.log(safe), float("-inf")).squeeze(-1))
    o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
    lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=-1)
    return o.reshape(B, Hq, Tq, Dv), lse.reshape(B, Hq, Tq)


_compiled: dict[str, Callable[..., Any]] = {}


def _flex_fns(device: torch.device) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """flex_attention and create_block_mask: compiled on CUDA (flex's fused kernel; a mask built
    without materialising Tq x Tk), eager elsewhere (CPU flex is forward-only, for tests)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if device.type != "cuda":
        return flex_attention, create_block_mask
    if not _compiled:
        _compiled["flex"] = torch.compile(flex_attention, dynamic=True)
        _compiled["mask"] = torch.compile(create_block_mask, dynamic=True)
    return _compiled["flex"], _compiled["mask"]


# Flex's query/key lengths are padded to a multiple of this (its block size): every pair then
# has lengths >= 128 (no 0/1 specialisation of a one-row hull) and far fewer distinct shapes, so
# the dynamic-shape compiles stay within dynamo's recompile limit (past it, flex would silently
# run its unfused path that materialises all scores).
FLEX_PAD = 128


def _pad_rows(t: Tensor, n: int, dim: int) -> Tensor:
    if t.shape[dim] == n:
        return t
    shape = list(t.shape)
    shape[dim] = n - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def flex_pair_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: PairMask, scale: float
) -> tuple[Tensor, Tensor]:
    """Flex-attention pair kernel (the CUDA path): one ``BlockMask`` per pair, built once per
    microbatch from the pair's device ids (no host sync: the ids are already on the device) and
    cached on ``mask``; ``lse`` from flex's ``AuxRequest(lse=True)``. Queries and keys are
    padded to a multiple of ``FLEX_PAD`` rows (padded keys are masked out, padded queries'
    rows dropped), so the compiled kernel sees few, never 0/1, lengths."""
    from torch.nn.attention.flex_attention import AuxRequest

    flex, create_mask = _flex_fns(q.device)
    tq, tk = q.shape[2], k.shape[2]
    pq, pk = -(-tq // FLEX_PAD) * FLEX_PAD, -(-tk // FLEX_PAD) * FLEX_PAD
    block_mask = mask.cache.get("flex")
    if block_mask is None:
        # Padded rows get document ids no real row has (-1 queries, -2 keys): never attended.
        q_tok, k_tok = _pad_rows(mask.q_tok, pq, 0), _pad_rows(mask.k_tok, pk, 0)
        q_doc = torch.cat([mask.q_doc, mask.q_doc.new_full((pq - tq,), -1)])
        k_doc = torch.cat([mask.k_doc, mask.k_doc.new_full((pk - tk,), -2)])

        def mask_mod(b, h, qi, ki):
            return (q_doc[qi] == k_doc[ki]) & (k_tok[ki] <= q_tok[qi])

        block_mask = create_mask(mask_mod, None, None, pq, pk, device=q.device)
        mask.cache["flex"] = block_mask
    o, aux = flex(
        _pad_rows(q, pq, 2),
        _pad_rows(k, pk, 2),
        _pad_rows(v, pk, 2),
        block_mask=block_mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
        return_aux=AuxRequest(lse=True),
    )
    return o[:, :, :tq], aux.lse[:, :, :tq]


KERNELS: dict[str, PairKernel] = {"math": math_pair_attention, "flex": flex_pair_attention}


class PassKVTrace:
    """What one call did, for tests and the benchmark: every posted message ``(direction,
    kind, peer, bytes)`` (``kind``: "kv" or "grad"), every kernel call ``(phase, peer)``
    (``peer`` -1 for the own block) and the most visiting buffers alive at once per kind
    (received K/V, outgoing and incoming dK/dV), counted when the buffer is freed."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, str, int, int]] = []
        self.computes: list[tuple[str, int]] = []
        self.live: dict[str, int] = {"kv": 0, "grad_out": 0, "grad_in": 0}
        self.peak: dict[str, int] = {"kv": 0, "grad_out": 0, "grad_in": 0}
        self.peak_bytes: dict[str, int] = {"kv": 0, "grad": 0}
        self._bytes = {"kv": 0, "grad": 0}

    def buffer(self, t: Tensor, kind: str) -> None:
        nbytes = t.numel() * t.element_size()
        group = "kv" if kind == "kv" else "grad"
        self.live[kind] += 1
        self._bytes[group] += nbytes
        self.peak[kind] = max(self.peak[kind], self.live[kind])
        self.peak_bytes[group] = max(self.peak_bytes[group], self._bytes[group])
        weakref.finalize(t, self._freed, kind, group, nbytes)

    def _freed(self, kind: str, group: str, nbytes: int) -> None:
        self.live[kind] -= 1
        self._bytes[group] -= nbytes


@dataclass
class PairKernelCall:
    """What a block's gradient needs besides the tensors: the kernel, its scale and the key
    width ``dk`` of the packed ``[k | v]`` rows (``_Call`` carries the same)."""

    kernel: PairKernel
    scale: float
    dk: int


@dataclass
class _Call:
    """Everything one call needs besides the tensors (held by the autograd node)."""

    routing: DevicePassKV
    group: dist.ProcessGroup | None  # None only for a one-rank schedule (no messages)
    kernel: PairKernel
    scale: float
    dk: int  # key width: the packed K/V rows are [k | v]
    trace: PassKVTrace | None
    masks: list[PairMask | None]  # per round (None: nothing received)
    own_mask: PairMask

    @property
    def rounds(self) -> tuple[PassKVRound, ...]:
        return self.routing.schedule.rounds


class _Posted:
    """One round's messages in flight: the receive buffer (None if none) and the works."""

    def __init__(self, recv: Tensor | None, recv_work: list, send_work: list) -> None:
        self.recv, self._recv_work, self._send_work = recv, recv_work, send_work

    def received(self) -> Tensor | None:
        """Wait for the receive and hand its buffer over (the caller's is the last reference,
        so dropping it frees the buffer)."""
        for w in self._recv_work:
            w.wait()
        self._recv_work = []
        buf, self.recv = self.recv, None
        return buf

    def sent(self) -> None:
        for w in self._send_work:
            w.wait()
        self._send_work = []


def _post(
    call: _Call,
    kind: str,
    send: tuple[Tensor, int] | None,
    recv: tuple[tuple[int, ...], torch.dtype, torch.device, int] | None,
) -> _Posted:
    """Post one send ``(tensor, peer)`` and/or one receive ``(shape, dtype, device, peer)`` as a
    single ``batch_isend_irecv`` (one NCCL group: no ordering deadlock between the two)."""
    tag = _KV_TAG if kind == "kv" else _GRAD_TAG
    ops, buf, n_send = [], None, 0
    if send is not None:
        t, peer = send
        ops.append(dist.P2POp(dist.isend, t, group=call.group, group_peer=peer, tag=tag))
        n_send = 1
        if call.trace is not None:
            call.trace.messages.append(("send", kind, peer, t.numel() * t.element_size()))
    if recv is not None:
        shape, dtype, device, peer = recv
        buf = torch.empty(shape, dtype=dtype, device=device)
        ops.append(dist.P2POp(dist.irecv, buf, group=call.group, group_peer=peer, tag=tag))
        if call.trace is not None:
            call.trace.messages.append(("recv", kind, peer, buf.numel() * buf.element_size()))
            call.trace.buffer(buf, "kv" if kind == "kv" else "grad_in")
    works = dist.batch_isend_irecv(ops) if ops else []
    if len(works) != len(ops):
        # A coalescing backend (NCCL) returns one work for the whole batch: the receive is
        # complete only when that work is (waiting on it orders NCCL's stream, not the host).
        # It is waited once: by received() when there is a receive (which every caller waits
        # for before the send), else by sent().
        return _Posted(buf, works, []) if buf is not None else _Posted(None, [], works)
    return _Posted(buf, works[n_send:], works[:n_send])  # gloo: one work per op


def _post_kv(call: _Call, kv: Tensor, j: int) -> _Posted | None:
    """Round ``j``'s K/V messages: this rank's ``send_rows`` out, the visiting block in."""
    if j >= len(call.rounds):
        return None
    rd = call.rounds[j]
    send = (kv[rd.send_rows[0] : rd.send_rows[1]], rd.send_to) if rd.send_to >= 0 else None
    recv = None
    if rd.recv_from >= 0:
        recv = ((rd.num_recv, *kv.shape[1:]), kv.dtype, kv.device, rd.recv_from)
    return _post(call, "kv", send, recv)


def _heads(rows: Tensor, dk: int) -> tuple[Tensor, Tensor]:
    """Packed rows ``[n, B, Hkv, Dk + Dv]`` -> views k ``[B, Hkv, n, Dk]``, v ``[B, Hkv, n, Dv]``."""
    return rows[..., :dk].permute(1, 2, 0, 3), rows[..., dk:].permute(1, 2, 0, 3)


def _pair_masks(routing: DevicePassKV) -> tuple[list[PairMask | None], PairMask]:
    """Per round the visiting block's mask (None where nothing arrives), and the own block's;
    made once per microbatch and kept on the routing (every layer reuses them)."""
    masks = routing.cache.get("masks")
    if masks is not None:
        return masks
    tok, doc = routing.token_ids, routing.doc_ids
    masks: Any = []
    for rd in routing.schedule.rounds:
        if rd.recv_from < 0:
            masks.append(None)
            continue
        qa, qb = rd.query_rows
        v0, v1 = rd.visit_offset, rd.visit_offset + rd.num_recv
        masks.append(
            PairMask(
                tok[qa:qb], doc[qa:qb], routing.visit_token_ids[v0:v1], routing.visit_doc_ids[v0:v1]
            )
        )
    masks = (masks, PairMask(tok, doc, tok, doc))
    routing.cache["masks"] = masks
    return masks


def _compute(call: _Call, phase: str, peer: int) -> None:
    if call.trace is not None:
        call.trace.computes.append((phase, peer))


def _forward(call: _Call, q: Tensor, kv: Tensor) -> tuple[Tensor, Tensor]:
    """Merged output ``[B, Hq, T, Dv]`` and log-sum-exp ``[B, Hq, T]`` (accumulation dtype)."""
    acc = compute_dtype(q.dtype)
    pending = _post_kv(call, kv, 0)  # the first exchange runs during the own block
    k, v = _heads(kv, call.dk)
    if q.shape[2] == 0:  # a rank without tokens: nothing to compute (its rounds are idle)
        B, Hq, _, _ = q.shape
        out = q.new_zeros(B, Hq, 0, v.shape[-1], dtype=acc)
        lse = q.new_zeros(B, Hq, 0, dtype=acc)
    else:
        _compute(call, "forward", -1)
        o, lse = call.kernel(q, k, v, call.own_mask, call.scale)
        out, lse = o.to(acc), lse.to(acc)
    for j, rd in enumerate(call.rounds):
        nxt = _post_kv(call, kv, j + 1)  # in flight while this round computes
        assert pending is not None
        rows = pending.received()
        if rows is not None:
            qa, qb = rd.query_rows
            mask = call.masks[j]
            assert mask is not None
            _compute(call, "forward", rd.recv_from)
            o_b, lse_b = call.kernel(q[:, :, qa:qb], *_heads(rows, call.dk), mask, call.scale)
            old = lse[..., qa:qb]
            new = torch.logaddexp(old, lse_b.to(acc))  # old is finite: every query sees itself
            out[:, :, qa:qb] = out[:, :, qa:qb] * torch.exp(old - new).unsqueeze(-1) + o_b.to(
                acc
            ) * torch.exp(lse_b.to(acc) - new).unsqueeze(-1)
            lse[..., qa:qb] = new
        del rows
        pending.sent()
        pending = nxt
    return out, lse


def _query_block(kernel: PairKernel, tq: int, tk: int) -> int:
    """Query rows per recompute in a block's backward. The math kernel keeps its float32 scores
    ``[B, Hq, rows, Tk]`` for autograd, so it recomputes in row blocks of at most
    ``_MASK_ELEMENTS`` mask elements (saved memory O(block x Tk), not O(Tq x Tk)); flex saves
    only its inputs, output and lse, so one call covers the block (and keeps its cached mask)."""
    if kernel is math_pair_attention:
        return max(1, min(tq, _MASK_ELEMENTS // max(tk, 1)))
    return tq


def _block_grads(
    call: _Call | PairKernelCall,
    q: Tensor,
    rows: Tensor,
    mask: PairMask,
    do: Tensor,
    lse: Tensor,
    delta: Tensor,
) -> tuple[Tensor, Tensor]:
    """Gradients of one block: ``dq [B, Hq, Tq, D]`` and packed ``dkv`` like ``rows``.

    The merged output is ``O = sum_b exp(lse_b - lse) o_b``, so block b's cotangents are
    ``w * dO`` for ``o_b`` and ``w * (<dO, o_b> - <dO, O>)`` for ``lse_b`` (``w = exp(lse_b -
    lse)``); autograd through the kernel turns them into the block's dq, dk, dv (the same as
    the flash-attention backward with the global lse). Query rows are recomputed in blocks
    (``_query_block``): each block's graph is freed before the next is built, and its dK/dV add
    up."""
    tq, tk = q.shape[2], rows.shape[0]
    if tq == 0 or tk == 0:  # a rank without tokens
        return torch.zeros_like(q, dtype=lse.dtype), torch.zeros_like(rows)
    step = _query_block(call.kernel, tq, tk)
    kv_ = rows.detach().requires_grad_(True)
    dqs: list[Tensor] = []
    dkv: Tensor | None = None
    for q0 in range(0, tq, step):
        q1 = min(q0 + step, tq)
        sub = mask if (q0, q1) == (0, tq) else mask.rows(q0, q1)
        with torch.enable_grad():
            q_ = q[:, :, q0:q1].detach().requires_grad_(True)
            o_b, lse_b = call.kernel(q_, *_heads(kv_, call.dk), sub, call.scale)
            w = torch.exp(lse_b.detach().to(lse.dtype) - lse[..., q0:q1])  # 0: no key here
            d = do[:, :, q0:q1]
            g_o = (w.unsqueeze(-1) * d).to(o_b.dtype)
            g_lse = (w * ((d * o_b.detach().to(d.dtype)).sum(-1) - delta[..., q0:q1])).to(
                lse_b.dtype
            )
            dq, dkv_b = torch.autograd.grad((o_b, lse_b), (q_, kv_), (g_o, g_lse))
        del o_b, lse_b, w, g_o, g_lse
        dqs.append(dq)
        dkv = dkv_b if dkv is None else dkv + dkv_b
        del dkv_b
    assert dkv is not None
    return (dqs[0] if len(dqs) == 1 else torch.cat(dqs, dim=2)), dkv


def _backward(
    call: _Call, q: Tensor, kv: Tensor, out: Tensor, lse: Tensor, d_out: Tensor
) -> tuple[Tensor, Tensor]:
    """``dq [B, Hq, T, D]`` and packed ``dkv [T, B, Hkv, Dk + Dv]`` (accumulation dtype)."""
    acc = lse.dtype
    do = d_out.to(acc)
    delta = (do * out.to(acc)).sum(-1)  # <dO, O> per query
    pending = _post_kv(call, kv, 0)
    if q.shape[2]:
        _compute(call, "backward", -1)
    dq, dkv_own = _block_grads(call, q, kv, call.own_mask, do, lse, delta)
    dq, dkv = dq.to(acc), dkv_own.to(acc)
    del dkv_own
    grads: _Posted | None = None  # the previous round's dK/dV exchange
    grads_rows = (0, 0)
    for j, rd in enumerate(call.rounds):
        nxt = _post_kv(call, kv, j + 1)
        assert pending is not None
        rows = pending.received()
        dkv_b = None
        if rows is not None:
            qa, qb = rd.query_rows
            mask = call.masks[j]
            assert mask is not None
            _compute(call, "backward", rd.recv_from)
            dq_b, dkv_b = _block_grads(
                call,
                q[:, :, qa:qb],
                rows,
                mask,
                do[:, :, qa:qb],
                lse[..., qa:qb],
                delta[..., qa:qb],
            )
            dq[:, :, qa:qb] += dq_b
            dkv_b = dkv_b.to(kv.dtype)
            if call.trace is not None:
                call.trace.buffer(dkv_b, "grad_out")
            del dq_b
        del rows
        pending.sent()
        if grads is not None:  # the previous round's incoming dK/dV join this rank's own
            got = grads.received()
            if got is not None:
                dkv[grads_rows[0] : grads_rows[1]] += got
            del got
            grads.sent()
        # This block's dK/dV back to its owner; this rank's sent rows' dK/dV from theirs.
        send = (dkv_b, rd.recv_from) if dkv_b is not None else None
        recv = None
        if rd.send_to >= 0:
            recv = ((rd.num_send, *kv.shape[1:]), kv.dtype, kv.device, rd.send_to)
        grads, grads_rows = _post(call, "grad", send, recv), rd.send_rows
        del dkv_b, send
        pending = nxt
    if grads is not None:
        got = grads.received()
        if got is not None:
            dkv[grads_rows[0] : grads_rows[1]] += got
        del got
        grads.sent()
    return dq, dkv


class _PassKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, call: _Call) -> Tensor:  # type: ignore[override]
        # Own K/V packed token-first [T, B, Hkv, Dk + Dv]: a row range is a contiguous view,
        # sent without a copy; k and v themselves are not kept.
        kv = torch.cat([k, v], dim=-1).transpose(0, 1).contiguous()
        qh = q.transpose(1, 2)  # [B, Hq, T, D]
        out, lse = _forward(call, qh, kv)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.call = call
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:  # type: ignore[override]
        q, kv, out, lse = ctx.saved_tensors
        call: _Call = ctx.call
        dq, dkv = _backward(call, q.transpose(1, 2), kv, out, lse, grad.transpose(1, 2))
        dkv = dkv.transpose(0, 1)  # [B, T, Hkv, Dk + Dv]
        dk, dv = dkv[..., : call.dk], dkv[..., call.dk :]
        return dq.transpose(1, 2).to(q.dtype), dk.to(kv.dtype), dv.to(kv.dtype), None


_warm: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()


def _warm_up(group: dist.ProcessGroup, device: torch.device) -> None:
    """NCCL: a batch of point-to-point ops may involve a subset of the group only after the
    group's first collective, which every rank joins: one tiny all-reduce on ``device`` (no host
    sync), once per group. gloo needs none."""
    if group in _warm or dist.get_backend(group) == "gloo":
        return
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    _warm.add(group)


def pass_kv_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    routing: DevicePassKV,
    group: dist.ProcessGroup | None,
    scale: float | None = None,
    kernel: str | PairKernel = "math",
    trace: PassKVTrace | None = None,
) -> Tensor:
    """Softmax attention of this rank's queries over the whole stream, K/V passed in rounds.

    Args:
        q: ``[B, T_local, Hq, D]``; k: ``[B, T_local, Hkv, D]``; v: ``[B, T_local, Hkv, Dv]``,
            Hq a multiple of Hkv (GQA). Under CP the models pass B = 1 (the flattened stream);
            B > 1 means B streams sharing one layout.
        routing: this microbatch's ``DevicePassKV`` (``RoutingPlan.pass_kv.to_device``, in
            ``SequenceContext.pass_kv``); ``routing.schedule.rank`` / ``world_size`` must be this
            process's within ``group``.
        group: the context-parallel group (every rank of it calls the op, and its backward).
        scale: softmax scale, default ``D ** -0.5``.
        kernel: "math" (plain PyTorch, any device), "flex" (flex attention; CUDA for training)
            or a ``PairKernel``.
        trace: records messages, kernel calls and live visiting buffers (tests, benchmark).

    Returns:
        ``[B, T_local, Hq, Dv]`` in q's dtype; differentiable in q, k, v.
    """
    schedule = routing.schedule
    world, rank = group_size(group), group_rank(group)
    if (schedule.world_size, schedule.rank) != (world, rank):
        raise ValueError(
            f"pass-KV schedule is for rank {schedule.rank} of {schedule.world_size}, but this "
            f"process is rank {rank} of {world} in the given group"
        )
    if q.shape[1] != schedule.num_tokens:
        raise ValueError(
            f"inputs have {q.shape[1]} tokens but the pass-KV schedule has {schedule.num_tokens}"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"query heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]})"
        )
    fn = KERNELS[kernel] if isinstance(kernel, str) else kernel
    if group is not None and world > 1:
        _warm_up(group, q.device)
    masks, own_mask = _pair_masks(routing)
    call = _Call(
        routing=routing,
        group=group,
        kernel=fn,
        scale=scale if scale is not None else q.shape[-1] ** -0.5,
        dk=k.shape[-1],
        trace=trace,
        masks=masks,
        own_mask=own_mask,
    )
    out = _PassKV.apply(q, k, v, call)
    assert isinstance(out, Tensor)
    return out


# ------------------------------------------------------------------------ the compiled path
#
# Under torch.compile(fullgraph=True) the rounds (a Python loop over the host schedule around
# point-to-point calls) cannot be traced, and tracing them would specialise the graph on each
# microbatch's schedule. So the compiled blocks call pass-KV as one opaque custom op: its inputs
# are q, k, v and a one-element "handle" tensor whose address names the microbatch's
# DevicePassKV (registered when the SequenceContext is built, outside the graph); the schedule
# itself never enters the graph, so a new layout is new data for the same graph.

_HANDLES: weakref.WeakValueDictionary[int, DevicePassKV] = weakref.WeakValueDictionary()


def pass_kv_handle(routing: DevicePassKV) -> Tensor:
    """The handle naming ``routing`` for ``pass_kv_attention_op``: a one-element tensor on the
    routing's device, unique while alive (its address is the key; nothing is read from it, so
    no host sync). Made once per ``DevicePassKV`` and kept in its cache."""
    handle = routing.cache.get("handle")
    if handle is None:
        handle = torch.empty(1, dtype=torch.int8, device=routing.token_ids.device)
        _HANDLES[handle.data_ptr()] = routing
        routing.cache["handle"] = handle
    return handle


def _op_call(handle: Tensor, group_name: str, scale: float, kernel: str, dk: int) -> _Call:
    routing = _HANDLES.get(handle.data_ptr())
    if routing is None:
        raise RuntimeError(
            "pass_kv_attention_op: the handle names no live pass-KV schedule (make it with "
            "pass_kv_handle(routing) and keep the routing alive while the op and its backward run)"
        )
    from torch.distributed.distributed_c10d import _resolve_process_group

    masks, own_mask = _pair_masks(routing)
    return _Call(
        routing=routing,
        group=_resolve_process_group(cast(Any, group_name)),
        kernel=KERNELS[kernel],
        scale=scale,
        dk=dk,
        trace=None,
        masks=masks,
        own_mask=own_mask,
    )


def _pack(k: Tensor, v: Tensor) -> Tensor:
    return torch.cat([k, v], dim=-1).transpose(0, 1).contiguous()


@torch.library.custom_op(f"{NS}::pass_kv_attention", mutates_args=())
def _pass_kv_fwd_op(
    q: Tensor, k: Tensor, v: Tensor, handle: Tensor, group_name: str, scale: float, kernel: str
) -> tuple[Tensor, Tensor]:
    """``(o [B, T, Hq, Dv] in q's dtype, lse [B, Hq, T] accumulation dtype)``, contiguous."""
    call = _op_call(handle, group_name, scale, kernel, k.shape[-1])
    group = call.group
    if group is not None and group_size(group) > 1:
        _warm_up(group, q.device)
    out, lse = _forward(call, q.transpose(1, 2), _pack(k, v))
    return out.to(q.dtype).transpose(1, 2).contiguous(), lse.contiguous()


@_pass_kv_fwd_op.register_fake
def _(q, k, v, handle, group_name, scale, kernel):
    B, T, Hq, _ = q.shape
    return q.new_empty(B, T, Hq, v.shape[-1]), q.new_empty(B, Hq, T, dtype=compute_dtype(q.dtype))


@torch.library.custom_op(f"{NS}::pass_kv_attention_bwd", mutates_args=())
def _pass_kv_bwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad: Tensor,
    handle: Tensor,
    group_name: str,
    scale: float,
    kernel: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` like q, k, v (contiguous): ``_backward``'s rounds."""
    dk_ = k.shape[-1]
    call = _op_call(handle, group_name, scale, kernel, dk_)
    with autograd_inside_op():  # the blocks' recompute runs under autograd
        dq, dkv = _backward(
            call, q.transpose(1, 2), _pack(k, v), out.transpose(1, 2), lse, grad.transpose(1, 2)
        )
    dkv = dkv.transpose(0, 1)
    return (
        dq.transpose(1, 2).to(q.dtype).contiguous(),
        dkv[..., :dk_].to(k.dtype).contiguous(),
        dkv[..., dk_:].to(v.dtype).contiguous(),
    )


@_pass_kv_bwd_op.register_fake
def _(q, k, v, out, lse, grad, handle, group_name, scale, kernel):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_pass_kv(ctx, inputs, output) -> None:
    q, k, v, handle, group_name, scale, kernel = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, handle)
    ctx.args = (group_name, scale, kernel)


def _backward_pass_kv(ctx, grad, _grad_lse):
    q, k, v, out, lse, handle = ctx.saved_tensors
    dq, dk, dv = _pass_kv_bwd_op(q, k, v, out, lse, grad.contiguous(), handle, *ctx.args)
    return dq, dk, dv, None, None, None, None


_pass_kv_fwd_op.register_autograd(_backward_pass_kv, setup_context=_setup_pass_kv)


def pass_kv_attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    handle: Tensor,
    group: dist.ProcessGroup,
    *,
    scale: float | None = None,
    kernel: str = "math",
) -> Tensor:
    """``pass_kv_attention`` as one custom op (what compiled blocks call): ``handle`` from
    ``pass_kv_handle(routing)``, made outside the compiled region; ``kernel`` "math" or "flex".
    The same rounds, messages and numbers as ``pass_kv_attention``; it keeps k and v (not the
    packed copy) for the backward. Returns ``[B, T_local, Hq, Dv]`` in q's dtype."""
    from torch.distributed._functional_collectives import _resolve_group_name

    out, _ = _pass_kv_fwd_op(
        q,
        k,
        v,
        handle,
        _resolve_group_name(group),
        scale if scale is not None else q.shape[-1] ** -0.5,
        kernel,
    )
    return out
