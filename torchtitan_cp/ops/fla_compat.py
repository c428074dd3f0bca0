"""fla-core 0.6.0 compatibility: the one place that reaches below fla's public functions.

Imported only inside the fla adapters and custom ops (``ops/<family>/fla_kernel.py``,
``custom_ops.py``) and at their call (it loads fla, hence Triton). Each shim is the computation
of one public fla function for our call's options, with the chunk tables supplied by the caller
(``DeviceRouting``, built on the host) where the public function builds its own:

* :func:`chunk_kda_indexed`. Reason: ``fla.ops.kda.chunk_kda`` 0.6.0 has no ``chunk_indices``
  parameter; its autograd Function always calls ``prepare_chunk_indices``, which ends in a
  blocking pageable host-to-device copy (a host sync per call). It is fla's own
  ``chunk_kda_fwd`` / ``chunk_kda_bwd`` with every option chunk_kda would pass for our call (no
  in-kernel l2norm, gate or beta sigmoid; no CP context; no graph mode).
* :func:`delta_rule_summaries_indexed` (the CP summaries of the delta rule). Reason: fla-core
  0.6.0 has no differentiable states-only entry point, so the summaries ran the whole
  ``chunk_kda`` / ``chunk_gated_delta_rule`` (outputs included, then discarded) with value width
  ``V + K``. The shim runs fla's own pieces for the states alone: the gate cumsum, the WY
  preparation (``chunk_kda_fwd_intra`` / ``chunk_gated_delta_rule_fwd_intra``) and the state
  kernel ``chunk_gated_delta_rule_fwd_h`` from ``[0 | I]`` with values ``[u | 0]``; no output
  kernel. Its backward is fla's state backward at value width ``V`` with the entry state the
  summary is applied to (``Recurrence.apply``): ``fwd_h``, ``bwd_dhu`` with a zero output
  cotangent, and the WY backward (``chunk_kda_bwd_wy_dqkg_fused`` + ``chunk_kda_bwd_intra`` /
  ``chunk_bwd_dqkwg`` + ``prepare_wy_repr_bwd``); no ``dAv`` / ``dv_local``. Its two halves,
  :func:`delta_rule_summaries_fwd` / :func:`delta_rule_summaries_bwd`, are also the compiled
  path's summaries custom op (``ops/delta_rule/custom_ops.py``), whose backward takes the full
  cotangent (``entry=None``: width ``V + K`` from ``[0 | I]``).
* :func:`chunk_simple_gla_indexed` (with :func:`simple_gla_fwd_indexed` /
  :func:`simple_gla_bwd_indexed`, which the SSD custom ops call). Reason:
  ``fla.ops.simple_gla.chunk_simple_gla`` 0.6.0 has no ``chunk_indices`` parameter either (the
  same host copy per call), and its state passes (``fla.ops.common.chunk_h.chunk_fwd_h`` /
  ``chunk_bwd_dh``, forward and backward) read the chunk count back with ``.item()`` on the
  device's chunk offsets, a device-to-host sync per call. The shim launches fla's own state
  kernels with the caller's chunk offsets and the chunk count of the caller's (already cut) chunk
  table, and calls fla's ``chunk_local_cumsum``, ``chunk_fwd_o``, ``chunk_bwd_dqkwg`` and
  ``chunk_bwd_dv`` with the chunk table, in ``chunk_simple_gla``'s order with its options for
  our call (scalar gate ``g``, no ``g_gamma``, states ``[K, V]``).

Tested in tests/test_fla_indices.py (fla's host-index helpers made to raise, every kernel launch
recorded and its tables compared with fla's own).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from fla.ops.common import chunk_h
from fla.ops.common.chunk_delta_h import (
    chunk_gated_delta_rule_bwd_dhu,
    chunk_gated_delta_rule_fwd_h,
)
from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv, chunk_fwd_o
from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd
from fla.ops.kda.chunk_bwd import chunk_kda_bwd, chunk_kda_bwd_wy_dqkg_fused
from fla.ops.kda.chunk_fwd import chunk_kda_fwd
from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra, chunk_kda_fwd_intra
from fla.ops.utils.constant import RCP_LN2
from fla.ops.utils.cumsum import chunk_local_cumsum
from fla.ops.utils.index import prepare_chunk_offsets
from fla.utils import autocast_custom_bwd, autocast_custom_fwd, input_guard
from torch import Tensor

from .common.fla import FLA_CHUNK_SIZE, contiguous

__all__ = [
    "chunk_kda_indexed",
    "delta_rule_summaries_bwd",
    "delta_rule_summaries_fwd",
    "delta_rule_summaries_indexed",
    "chunk_simple_gla_indexed",
    "simple_gla_bwd_indexed",
    "simple_gla_fwd_indexed",
]


class _ChunkKDAIndexed(torch.autograd.Function):
    # Saved-for-backward set and gradient dtypes follow fla's ChunkKDAFunction for these options.
    # fla's decorators are typed for functions returning one Tensor, hence the ignores.

    @staticmethod
    @input_guard  # pyrefly: ignore[bad-argument-type]
    @autocast_custom_fwd
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                cu_seqlens_cpu, chunk_indices, chunk_offsets):  # fmt: skip
        o, final_state, g_cumsum, Aqk, Akk, *_ = chunk_kda_fwd(
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu,
            chunk_indices=chunk_indices,
            chunk_offsets=chunk_offsets,
            chunk_size=FLA_CHUNK_SIZE,
        )
        ctx.save_for_backward(q, k, v, g_cumsum, g, beta, Aqk, Akk, initial_state, cu_seqlens,
                              chunk_indices, chunk_offsets)  # fmt: skip
        ctx.scale = scale
        return o.type_as(q), final_state

    @staticmethod
    @input_guard  # pyrefly: ignore[bad-argument-type]
    @autocast_custom_bwd
    def backward(ctx, do, dht):  # pyrefly: ignore[bad-override]
        q, k, v, g_cumsum, g, beta, Aqk, Akk, h0, cu, ci, co = ctx.saved_tensors
        # Explicit, not left to input_guard: chunk_kda_bwd assumes contiguous rows, and the
        # cotangents can be expanded views (a reduction's backward). A no-op when contiguous.
        q, k, v, g_cumsum, beta, Aqk, Akk, h0, do, dht = contiguous(
            q, k, v, g_cumsum, beta, Aqk, Akk, h0, do, dht
        )
        dq, dk, dv, db, dg, dh0, _, _ = chunk_kda_bwd(
            q=q,
            k=k,
            v=v,
            beta=beta,
            Aqk=Aqk,
            Akk=Akk,
            scale=ctx.scale,
            initial_state=h0,
            do=do,
            dht=dht,
            g=g_cumsum,
            cu_seqlens=cu,
            chunk_indices=ci,
            chunk_offsets=co,
            chunk_size=FLA_CHUNK_SIZE,
        )
        grads = (dq.to(q), dk.to(k), dv.to(v), dg.to(g), db.to(beta), None, dh0)  # pyrefly: ignore[missing-attribute]
        return grads + (None,) * 5


# Opaque to dynamo exactly like the public chunk_kda it stands in for.
@torch.compiler.disable
def chunk_kda_indexed(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None,
    initial_state: Tensor | None,
    output_final_state: bool,
    cu_seqlens: Tensor,
    cu_seqlens_cpu: Tensor | None,
    chunk_indices: Tensor,
    chunk_offsets: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``chunk_kda`` (pre-computed natural-log gate, post-sigmoid beta, normalised q/k) over
    packed sequences with the caller's chunk table.

    Shapes as ``chunk_kda``: q, k ``[1,T,H,K]``; v ``[1,T,HV,V]``; g ``[1,T,HV,K]``; beta
    ``[1,T,HV]``; initial_state float32 ``[N,HV,K,V]``; cu_seqlens ``[N+1]`` on q's device;
    chunk_indices ``[NT,2]`` and chunk_offsets ``[N+1]`` (``routing.chunks`` with
    ``FLA_CHUNK_SIZE``) on q's device. Returns ``(o [1,T,HV,V], final_state [N,HV,K,V] | None)``.
    """
    K = q.shape[-1]
    if K > 256:
        raise ValueError(f"fla's KDA kernels support head dim K <= 256, got K={K}")
    if initial_state is not None and initial_state.dtype != torch.float32:
        raise ValueError(f"initial_state must be float32 for fla, got {initial_state.dtype}")
    # Contiguous before fla's forward (which saves them for chunk_kda_bwd); v is usually a
    # split view of the conv output.
    q, k, v, g, beta, initial_state = contiguous(q, k, v, g, beta, initial_state)
    return _ChunkKDAIndexed.apply(
        q,
        k,
        v,
        g,
        beta,
        K**-0.5 if scale is None else scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        cu_seqlens_cpu,
        chunk_indices,
        chunk_offsets,
    )


# ----------------------------------------------------------------------------- delta-rule summaries
_fwd_h: Any = chunk_gated_delta_rule_fwd_h
_bwd_dhu: Any = chunk_gated_delta_rule_bwd_dhu


def delta_rule_summaries_fwd(q, k, v, g, beta, *, kind, scale, cu_seqlens, chunk_indices,
                             chunk_offsets=None) -> tuple[Tensor, tuple[Tensor, ...]]:  # fmt: skip
    """The states-only pass on contiguous inputs: ``(final [N, HV, K, V + K] = [E | M] float32,
    saved)``, ``saved = (g_cs, w, u, kh, Akk)`` what :func:`delta_rule_summaries_bwd` reads.

    Gate cumsum, WY preparation, then the state kernel from ``[0 | I]`` with values ``[u | 0]``
    (``u``, ``w`` the WY factors: the first V columns follow E, the last K follow M)."""
    B, T, _, K = k.shape
    HV, V = v.shape[2:]
    C = FLA_CHUNK_SIZE
    idx = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    g_cs = _chunk_local_cumsum(g, chunk_size=C, scale=RCP_LN2, **idx)
    if kind == "kda":
        w, u, _, kh, _, Akk = chunk_kda_fwd_intra(
            q=q, k=k, v=v, gk=g_cs, beta=beta, scale=scale, chunk_size=C, **idx
        )
        gate = dict(gk=g_cs)
    else:
        w, u, Akk = chunk_gated_delta_rule_fwd_intra(
            k=k, v=v, g=g_cs, beta=beta, chunk_size=C, **idx
        )
        kh, gate = k, dict(g=g_cs)
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    _, _, final = _fwd_h(
        k=kh, w=w, u=_widen(u, K), **gate, initial_state=_identity_entry(N, HV, K, V, k.device),
        output_final_state=True, save_new_value=False, chunk_size=C,
        chunk_offsets=chunk_offsets, **idx,
    )  # fmt: skip
    return final, (g_cs, w, u, kh, Akk)


def _widen(x: Tensor, K: int) -> Tensor:
    """``[x | 0]``: K zero value columns (the ones that follow M)."""
    return torch.cat([x, x.new_zeros(*x.shape[:-1], K)], -1)


def _identity_entry(N: int, HV: int, K: int, V: int, device) -> Tensor:
    """``[0 | I]`` ``[N, HV, K, V + K]`` float32: the entry state whose final state is ``[E | M]``."""
    h0 = torch.zeros(N, HV, K, V + K, dtype=torch.float32, device=device)
    h0[..., V:] = torch.eye(K, dtype=torch.float32, device=device)
    return h0


def delta_rule_summaries_bwd(q, k, v, beta, saved, dS, *, kind, scale, entry, cu_seqlens,
                             chunk_indices, chunk_offsets=None) -> tuple[Tensor, ...]:  # fmt: skip
    """``(dk, dv, dg, dbeta)`` (dg of the natural-log gate, float32) of the summaries for the
    cotangent ``dS [N, HV, K, V + K]``, on contiguous inputs, from ``saved`` of
    :func:`delta_rule_summaries_fwd`: fla's state backward with no output cotangent (``fwd_h``,
    ``bwd_dhu``, the WY backward; no ``dAv`` / ``dv_local``).

    ``entry [N, HV, K, V]`` (float32): the state each summary is applied to; then only ``D =
    dS[..., :V]`` is read (the cotangent is ``D [I | hᵀ]``) and the pass runs at value width V
    from ``entry``. ``entry=None``: any cotangent; the pass runs at width ``V + K`` from
    ``[0 | I]`` with values ``[u | 0]`` (the compiled path's custom op)."""
    g_cs, w, u, kh, Akk = saved
    H, HV, K, V = k.shape[2], v.shape[2], k.shape[3], v.shape[-1]
    C = FLA_CHUNK_SIZE
    idx = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    gate = dict(gk=g_cs) if kind == "kda" else dict(g=g_cs)
    if entry is None:
        N = dS.shape[0]
        h_in, dht = _identity_entry(N, HV, K, V, k.device), dS.float().contiguous()
        u, v_in = _widen(u, K), _widen(v, K)
    else:
        h_in, dht, v_in = entry.float().contiguous(), dS[..., :V].float().contiguous(), v
    h, v_new, _ = _fwd_h(
        k=kh, w=w, u=u, **gate, initial_state=h_in, output_final_state=False, chunk_size=C,
        chunk_offsets=chunk_offsets, **idx,
    )  # fmt: skip
    do = torch.zeros_like(v_in)  # no output
    dh, _, dv = _bwd_dhu(
        q=kh, k=kh, w=w, do=do, dv=torch.zeros_like(u), **gate, h0=h_in, dht=dht,
        scale=scale, chunk_size=C, chunk_offsets=chunk_offsets, **idx,
    )  # fmt: skip
    if kind == "kda":
        _, dk, dv, db, dg, dAkk = chunk_kda_bwd_wy_dqkg_fused(
            q=q, k=k, v=v_in, v_new=v_new, g=g_cs, beta=beta, A=Akk, h=h, do=do, dh=dh, dv=dv,
            scale=scale, chunk_size=C, chunk_offsets=chunk_offsets, **idx,
        )  # fmt: skip
        dq0 = torch.zeros_like(dk)
        dAqk = torch.zeros_like(Akk, dtype=torch.float)
        _, dk, db, dg = chunk_kda_bwd_intra(
            q=q, k=k, g=g_cs, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq0, dk=dk, db=db, dg=dg,
            chunk_size=C, **idx,
        )  # fmt: skip
        if HV > H:  # grouped value heads: dk back to the key heads
            dk = dk.view(*dk.shape[:2], H, HV // H, dk.shape[-1]).sum(dim=3)
    else:
        _, dk, dw, dg = chunk_bwd_dqkwg(
            q=q, k=k, v=v_new, w=w, g=g_cs, h=h, dv=dv, do=do, dh=dh, scale=scale,
            chunk_size=C, **idx,
        )  # fmt: skip
        dk2, dv, db, dg2 = prepare_wy_repr_bwd(
            k=k, v=v_in, beta=beta, g=g_cs, A=Akk, dw=dw, du=dv, **idx
        )
        dk.add_(dk2)
        dg.add_(dg2)
    dg = _chunk_local_cumsum(dg, chunk_size=C, reverse=True, **idx)
    return dk, dv[..., :V].contiguous(), dg, db


class _DeltaRuleSummaries(torch.autograd.Function):
    """``[E | M]`` of every packed sequence from fla's state pieces (``delta_rule_summaries_indexed``).

    Forward: :func:`delta_rule_summaries_fwd`. Backward: the summary is only ever applied to the
    entry state ``h`` its publisher's local kernel used (``Recurrence.apply``), so its cotangent
    is ``D [I | hᵀ]`` with ``D`` its first V columns, which is the cotangent of the final state of
    the same tokens run from ``h``: :func:`delta_rule_summaries_bwd` from ``h`` (value width V,
    not V + K).
    """

    @staticmethod
    @input_guard  # pyrefly: ignore[bad-argument-type]
    @autocast_custom_fwd
    def forward(ctx, q, k, v, g, beta, kind, scale, entry, cu_seqlens, chunk_indices,
                chunk_offsets):  # fmt: skip
        final, saved = delta_rule_summaries_fwd(
            q, k, v, g, beta, kind=kind, scale=scale, cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, beta, *saved, cu_seqlens, chunk_indices, chunk_offsets)
        ctx.kind, ctx.scale, ctx.entry, ctx.g_dtype = kind, scale, entry, g.dtype
        return final

    @staticmethod
    @input_guard  # pyrefly: ignore[bad-argument-type]
    @autocast_custom_bwd
    def backward(ctx, dS):  # pyrefly: ignore[bad-override]
        q, k, v, beta, *saved, cu, ci, co = ctx.saved_tensors
        dk, dv, dg, db = delta_rule_summaries_bwd(
            q, k, v, beta, tuple(saved), dS, kind=ctx.kind, scale=ctx.scale, entry=ctx.entry(),
            cu_seqlens=cu, chunk_indices=ci, chunk_offsets=co,
        )  # fmt: skip
        grads = (None, dk.to(k), dv.to(v), dg.to(ctx.g_dtype), db.to(beta))
        return grads + (None,) * 6


# Opaque to dynamo like the public fla functions it replaces.
@torch.compiler.disable
def delta_rule_summaries_indexed(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    kind: str,
    scale: float | None,
    entry: Any,
    cu_seqlens: Tensor,
    chunk_indices: Tensor,
    chunk_offsets: Tensor | None = None,
) -> Tensor:
    """The delta rule's summaries ``[N, HV, K, V + K] = [E | M]`` (float32) of the packed
    sequences ``cu_seqlens``, from fla's WY preparation and state kernel: no output kernel,
    nothing discarded.

    Inputs as ``chunk_kda_indexed`` (g ``[1,T,HV]`` for kind="gdn"); chunk tables exact
    (``common.fla.chunk_table``). ``entry``: a callable returning the ``[N, HV, K, V]`` state
    each summary will be applied to (its publisher's entry state), called in the backward only,
    which is exact for the driver's use (``Recurrence.apply``) and for no other cotangent.
    """
    if kind not in ("kda", "gdn"):
        raise ValueError(f"kind must be 'kda' or 'gdn', got {kind!r}")
    K = q.shape[-1]
    if K > 256:
        raise ValueError(f"fla's delta-rule kernels support head dim K <= 256, got K={K}")
    q, k, v, g, beta = contiguous(q, k, v, g, beta)
    return _DeltaRuleSummaries.apply(
        q, k, v, g, beta, kind, K**-0.5 if scale is None else scale, entry, cu_seqlens,
        chunk_indices, chunk_offsets,
    )  # fmt: skip


# ----------------------------------------------------------------------------- simple GLA (SSD)
# fla's bare ``@dispatch`` decorator hides these functions' signatures from type checkers.
_chunk_local_cumsum: Any = chunk_local_cumsum
_chunk_bwd_dv: Any = chunk_bwd_dv


def _state_split(
    k: Tensor, cu_seqlens: Tensor | None, chunk_indices: Tensor | None, chunk_offsets: Tensor | None
) -> tuple[int, int, Tensor | None]:
    """(N sequences, NT chunks, chunk offsets) as fla's ``chunk_fwd_h`` computes them, without
    its ``.item()``: NT is the row count of the caller's chunk table (cut to the real chunks from
    the host offsets), the offsets the caller's or fla's own device computation (no host read)."""
    B, T = k.shape[:2]
    if cu_seqlens is None:
        return B, triton.cdiv(T, FLA_CHUNK_SIZE), None
    if chunk_indices is None:
        raise ValueError("simple GLA over cu_seqlens needs chunk_indices (routing.chunks)")
    if chunk_offsets is None:
        chunk_offsets = prepare_chunk_offsets(cu_seqlens, FLA_CHUNK_SIZE)
    return cu_seqlens.shape[0] - 1, chunk_indices.shape[0], chunk_offsets


def _chunk_states(
    k: Tensor,
    v: Tensor,
    g_cumsum: Tensor,
    h0: Tensor | None,
    output_final_state: bool,
    split: tuple[int, int, Tensor | None],
    cu_seqlens: Tensor | None,
    states_in_fp32: bool,
) -> tuple[Tensor, Tensor | None]:
    """fla's ``chunk_fwd_h`` (scalar gate, ``[K, V]`` states): the state entering every chunk
    ``[B, NT, H, K, V]`` and the final states ``[N, H, K, V]`` float32 (or None)."""
    B, T, H, K, V = *k.shape, v.shape[-1]
    N, NT, offsets = split
    h = k.new_empty(B, NT, H, K, V, dtype=torch.float if states_in_fp32 else k.dtype)
    ht = k.new_empty(N, H, K, V, dtype=torch.float) if output_final_state else None

    def grid(meta):
        return (triton.cdiv(K, meta["BK"]) * triton.cdiv(V, meta["BV"]) * N * H,)

    # Looked up at the call (not imported by name), so patched kernel objects are seen.
    chunk_h.chunk_fwd_kernel_h[grid](
        k=k, v=v, h=h, g=g_cumsum, g_gamma=None, gk=None, gv=None, h0=h0, ht=ht,
        cu_seqlens=cu_seqlens, split_offsets=offsets, T=T, H=H, K=K, V=V, BT=FLA_CHUNK_SIZE,
        BS=FLA_CHUNK_SIZE, USE_G=True, USE_G_GAMMA=False, USE_GK=False, USE_GV=False,
        STATE_V_FIRST=False,
    )  # fmt: skip
    return h, ht


def _chunk_state_grads(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g_cumsum: Tensor,
    h0: Tensor | None,
    do: Tensor,
    dht: Tensor | None,
    scale: float,
    split: tuple[int, int, Tensor | None],
    cu_seqlens: Tensor | None,
) -> tuple[Tensor, Tensor | None]:
    """fla's ``chunk_bwd_dh`` (scalar gate, float32 states): the state gradient of every chunk
    ``[B, NT, H, K, V]`` and ``dh0 [N, H, K, V]`` float32 (None without h0)."""
    B, T, H, K, V = *k.shape, v.shape[-1]
    N, NT, offsets = split
    dh = k.new_empty(B, NT, H, K, V, dtype=torch.float)
    dh0 = torch.empty_like(h0, dtype=torch.float) if h0 is not None else None

    def grid(meta):
        return (triton.cdiv(K, meta["BK"]) * triton.cdiv(V, meta["BV"]) * N * H,)

    chunk_h.chunk_bwd_kernel_dh[grid](
        q=q, g=g_cumsum, g_gamma=None, gk=None, gv=None, do=do, dh=dh, dht=dht, dh0=dh0,
        cu_seqlens=cu_seqlens, split_offsets=offsets, scale=scale, T=T, HQ=H, H=H, K=K, V=V,
        BT=FLA_CHUNK_SIZE, BS=FLA_CHUNK_SIZE, NG=1, USE_G=True, USE_G_GAMMA=False, USE_GK=False,
        USE_GV=False, STATE_V_FIRST=False,
    )  # fmt: skip
    return dh, dh0


def simple_gla_fwd_indexed(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    *,
    scale: float,
    initial_state: Tensor | None,
    output_final_state: bool,
    cu_seqlens: Tensor | None,
    chunk_indices: Tensor | None,
    chunk_offsets: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """``chunk_simple_gla``'s forward for contiguous inputs: ``(o [1,T,H,V] in v's dtype,
    final [N,H,K,V] float32 | None, g_cumsum [1,T,H] float32)``; g_cumsum (the chunk-local
    cumulative gate in log2 units) is what :func:`simple_gla_bwd_indexed` reads."""
    ci = chunk_indices if cu_seqlens is not None else None
    split = _state_split(k, cu_seqlens, ci, chunk_offsets)
    # fla pre-scales the gate by 1/ln 2 so its kernels use exp2.
    g_cumsum = _chunk_local_cumsum(
        g, chunk_size=FLA_CHUNK_SIZE, scale=RCP_LN2, cu_seqlens=cu_seqlens, chunk_indices=ci
    )
    h, ht = _chunk_states(k, v, g_cumsum, initial_state, output_final_state, split, cu_seqlens,
                          states_in_fp32=False)  # fmt: skip
    o = chunk_fwd_o(
        q=q, k=k, v=v, h=h, g=g_cumsum, scale=scale, cu_seqlens=cu_seqlens,
        chunk_size=FLA_CHUNK_SIZE, chunk_indices=ci,
    )  # fmt: skip
    return o, ht, g_cumsum


def simple_gla_bwd_indexed(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g_cumsum: Tensor,
    do: Tensor,
    dht: Tensor | None,
    *,
    scale: float,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    chunk_indices: Tensor | None,
    chunk_offsets: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """``chunk_simple_gla``'s backward for contiguous inputs: ``(dq, dk, dv, dg float32,
    dh0 float32 | None)``, dg the gradient of the forward's (natural-log) ``g``."""
    ci = chunk_indices if cu_seqlens is not None else None
    split = _state_split(k, cu_seqlens, ci, chunk_offsets)
    h, _ = _chunk_states(k, v, g_cumsum, initial_state, False, split, cu_seqlens,
                         states_in_fp32=True)  # fmt: skip
    dh, dh0 = _chunk_state_grads(q, k, v, g_cumsum, initial_state, do, dht, scale, split,
                                 cu_seqlens)  # fmt: skip
    common: dict[str, Any] = dict(
        g=g_cumsum, do=do, dh=dh, scale=scale, cu_seqlens=cu_seqlens,
        chunk_size=FLA_CHUNK_SIZE, chunk_indices=ci,
    )  # fmt: skip
    dq, dk, _, dg = chunk_bwd_dqkwg(q=q, k=k, v=v, h=h, **common)
    dv = _chunk_bwd_dv(q=q, k=k, **common)
    dg = _chunk_local_cumsum(
        dg, chunk_size=FLA_CHUNK_SIZE, reverse=True, cu_seqlens=cu_seqlens, chunk_indices=ci
    )
    return dq, dk, dv, dg, dh0


class _ChunkSimpleGLAIndexed(torch.autograd.Function):
    # Saved set and gradient dtypes follow fla's ChunkSimpleGLAFunction for our options.

    @staticmethod
    @input_guard  # pyrefly: ignore[bad-argument-type]
    @autocast_custom_fwd
    def forward(ctx, q, k, v, g, scale, initial_state, output_final_state, cu_seqlens,
                chunk_indices, chunk_offsets):  # fmt: skip
        o, final, g_cumsum = simple_gla_fwd_indexed(
            q, k, v, g, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, g_cumsum, initial_state, cu_seqlens, chunk_indices,
                              chunk_offsets)  # fmt: skip
        ctx.scale, ctx.g_dtype = scale, g.dtype
        return o.to(q.dtype), final

    @staticmethod
    @input_guard  # pyrefly: ignore[bad-argument-type]
    @autocast_custom_bwd
    def backward(ctx, do, dht):  # pyrefly: ignore[bad-override]
        q, k, v, g_cumsum, h0, cu, ci, co = ctx.saved_tensors
        dq, dk, dv, dg, dh0 = simple_gla_bwd_indexed(
            q, k, v, g_cumsum, do, dht, scale=ctx.scale, initial_state=h0, cu_seqlens=cu,
            chunk_indices=ci, chunk_offsets=co,
        )  # fmt: skip
        grads = (dq.to(q), dk.to(k), dv.to(v), dg.to(ctx.g_dtype), None, dh0)
        return grads + (None,) * 4


# Opaque to dynamo exactly like the public chunk_simple_gla it stands in for.
@torch.compiler.disable
def chunk_simple_gla_indexed(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    *,
    scale: float | None,
    initial_state: Tensor | None,
    output_final_state: bool,
    cu_seqlens: Tensor,
    chunk_indices: Tensor,
    chunk_offsets: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``chunk_simple_gla`` (head-wise natural-log gate ``g``) over packed sequences with the
    caller's chunk tables.

    Shapes as ``chunk_simple_gla``: q, k ``[1,T,H,K]``; v ``[1,T,H,V]``; g ``[1,T,H]``;
    initial_state float32 ``[N,H,K,V]``; cu_seqlens ``[N+1]`` on q's device; chunk_indices
    exactly ``[NT,2]`` (cut with ``common.fla.chunk_table``) and chunk_offsets ``[N+1]`` (or
    None: derived on the device) with ``FLA_CHUNK_SIZE``, on q's device. Returns
    ``(o [1,T,H,V], final_state [N,H,K,V] | None)``.
    """
    if initial_state is not None and initial_state.dtype != torch.float32:
        raise ValueError(f"initial_state must be float32 for fla, got {initial_state.dtype}")
    return _ChunkSimpleGLAIndexed.apply(
        q,
        k,
        v,
        g,
        q.shape[-1] ** -0.5 if scale is None else scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        chunk_indices,
        chunk_offsets,
    )
