"""The delta rule on fla-core's kernels (eager; CUDA, or CPU tensors under Triton's interpreter):
the local kernel and the CP layer, one WY preparation and one WY backward per layer.

fla is imported at the first call (importing this module loads no Triton kernel), and fla's
pieces take the routing's chunk tables directly: no host read, no host-to-device copy. The
local kernel alone (``chunk_delta_rule(backend="fla")``) is ``_Prepare`` and ``_Local`` below
without summaries: fla's ``chunk_kda`` / ``chunk_gated_delta_rule`` with their gate, l2norm and
beta options off, bitwise (tests/test_fla_indices.py), on the same pieces as the CP layer.

A CP layer on a span that continues a document and is continued needs two things of the same
tokens: the local kernel (outputs from the entry state ``S0``) and the summary ``[E | M]`` of the
published subsequences (the state map, from ``[0 | I]`` with values ``[u | 0]``). Both start from
the same state-independent work: fla's gate cumsum and WY preparation (``w``, ``u``, the
intra-chunk scores). Run as two fla calls, each repeats it, forward and backward, and the WY
backward (fla's ``chunk_kda_bwd_wy_dqkg_fused`` / ``chunk_bwd_dqkwg`` + ``prepare_wy_repr_bwd``)
is the largest kernel of the delta rule's backward. Here the layer is three autograd nodes that
share one ``FlaState``:

* ``_Prepare`` (``prepare``): gate cumsum and WY preparation, once. Its output is a zero-size
  *token* that the other two nodes take, so autograd runs its backward after both of theirs.
* ``_Summaries`` (``summaries``): the state kernel at value width ``V + K`` over the published
  rows' tokens, on the prepared ``w``, ``u``. No WY preparation of its own.
* ``_Local`` (``local``): the state kernel from ``S0`` at width ``V`` and the output kernel.

Backward. ``_Local``'s backward runs fla's state backward (``bwd_dhu``) with the output and
final-state cotangents and returns the entry-state gradient at once: the driver's fold and the
all-gather's reduce-scatter need it before any summary cotangent exists. ``_Summaries``'s
backward only records its cotangent. The driver applies a summary only to the entry state its
publisher's local kernel used for that row (``Recurrence.apply``), so a summary's cotangent is
``D [I | hᵀ]`` with ``D`` its first V columns: the cotangent of that row's final state in the
local kernel's own trajectory. ``_Prepare``'s backward therefore runs ``bwd_dhu`` once more with
``dht = D`` and no output cotangent, adds its ``dh`` / ``dv`` to the local kernel's (the state
backward is linear in its cotangents, and both passes are the same trajectory), and runs the WY
backward and fla's intra-chunk backward once for both. The second ``bwd_dhu``'s entry-state
gradient is dropped: a summary does not depend on the entry state it is applied to.

What this costs over the local kernel alone: the state kernel at width ``V + K`` over the
published tokens (forward) and one ``bwd_dhu`` (backward). Counted in docs/PERFORMANCE.md
(``scripts/bench_cp_overhead.py --fla-count``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..common.fla import (
    FLA_CHUNK_SIZE,
    contiguous,
    device_cu_seqlens,
    fla_chunk_indices,
    fla_offsets,
)
from ..cp.recurrence import InitialState, SequenceTables, SummaryRows, resolve_state

__all__ = [
    "FACTORS",
    "FlaPrepared",
    "check_head_dim",
    "chunk_delta_rule_fla",
    "local",
    "local_fwd",
    "op_state",
    "prepare",
    "prepared_factors",
    "summaries",
    "summaries_bwd",
    "summaries_fwd",
]


def _fla() -> Any:
    """fla's pieces, imported at the first call (importing this module loads no Triton)."""
    from fla.ops.common import chunk_delta_h
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv_local, chunk_fwd_o
    from fla.ops.gated_delta_rule import chunk_fwd as gdn_fwd
    from fla.ops.gated_delta_rule import wy_fast as gdn_wy
    from fla.ops.gla import chunk as gla
    from fla.ops.kda import chunk_bwd as kda_bwd
    from fla.ops.kda import chunk_intra as kda_intra
    from fla.ops.kda import wy_fast as kda_wy
    from fla.ops.utils import constant, cumsum

    functions = (
        chunk_delta_h.chunk_gated_delta_rule_fwd_h,
        chunk_delta_h.chunk_gated_delta_rule_bwd_dhu,
        chunk_fwd_o,
        chunk_bwd_dqkwg,
        chunk_bwd_dv_local,
        gdn_fwd.chunk_gated_delta_rule_fwd_intra,
        gla.chunk_gla_fwd_o_gk,
        kda_intra.chunk_kda_fwd_intra,
        kda_intra.chunk_kda_bwd_intra,
        cumsum.chunk_local_cumsum,
    )
    modules = dict(gdn_wy=gdn_wy, kda_bwd=kda_bwd, kda_wy=kda_wy)
    return SimpleNamespace(
        **{fn.__name__: fn for fn in functions}, **modules, RCP_LN2=constant.RCP_LN2
    )


@dataclass
class FlaState:
    """What the three nodes of one layer share (module docstring). ``idx``: the local
    sequences' offsets and chunk tables as fla's pieces take them."""

    kind: str
    scale: float
    inputs: tuple[Tensor, ...]  # (q, k, v, g, beta), contiguous, detached
    idx: dict[str, Any]
    g_dtype: torch.dtype
    fwd: dict[str, Tensor] = field(default_factory=dict)  # g_cs, scores, WY factors
    h0: Tensor | None = None  # the local kernel's entry states (float32), once it ran
    local_grads: dict[str, Any] | None = None  # _Local's backward: its dh, dv, do, ...
    summary_grads: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # (rows, D)


class FlaPrepared(NamedTuple):
    """``DeltaRule.prepare``'s result on fla (eager): the shared state and the token tying the
    summaries and the local kernel to the one WY preparation in the autograd graph."""

    state: FlaState
    token: Tensor


def _gate(st: FlaState) -> dict[str, Tensor]:
    return {"gk" if st.kind == "kda" else "g": st.fwd["g_cs"]}


def _wy(st: FlaState, f: Any, need_q: bool) -> None:
    """The WY factors into ``st.fwd`` (``w``, ``u``, ``kg``, and with ``need_q`` the gated
    queries ``qg`` at the value heads, which only the output cotangent reads): computed by the
    preparation, dropped after the local forward and rebuilt from the scores in the backward,
    as fla's own functions do (memory: fla keeps the scores, not the factors)."""
    if "w" in st.fwd and (not need_q or "qg" in st.fwd):
        return
    q, k, v, _, beta = st.inputs
    if st.kind == "kda":
        w, u, qg, kg = f.kda_wy.recompute_w_u_fwd(
            q=q, k=k, v=v, beta=beta, A=st.fwd["Akk"], gk=st.fwd["g_cs"], **_tab(st)
        )
    else:
        w, u = f.gdn_wy.recompute_w_u_fwd(
            k=k, v=v, beta=beta, A=st.fwd["A"], g=st.fwd["g_cs"], **_tab(st)
        )
        qg, kg = q, k
    st.fwd.update(w=w, u=u, qg=qg, kg=kg)


def _tab(st: FlaState) -> dict[str, Any]:
    return {"cu_seqlens": st.idx["cu_seqlens"], "chunk_indices": st.idx["chunk_indices"]}


def _states(st: FlaState, f: Any, h0: Tensor | None, output_final_state: bool):
    """fla's state kernel over the local sequences from ``h0``: ``(h, v_new, final)``."""
    return f.chunk_gated_delta_rule_fwd_h(
        k=st.fwd["kg"],
        w=st.fwd["w"],
        u=st.fwd["u"],
        **_gate(st),
        initial_state=h0,
        output_final_state=output_final_state,
        chunk_size=FLA_CHUNK_SIZE,
        **st.idx,
    )


def _prepare_fwd(st: FlaState, f: Any) -> None:
    """fla's gate cumsum and WY preparation into ``st.fwd``: ``g_cs``, the scores (kda:
    ``Aqk``, ``Akk``; gdn: ``A``) and the factors ``w``, ``u``, ``kg`` (and gdn's ``qg = q``)."""
    q, k, v, g, beta = st.inputs
    C = FLA_CHUNK_SIZE
    g_cs = f.chunk_local_cumsum(g, chunk_size=C, scale=f.RCP_LN2, **_tab(st))
    if st.kind == "kda":
        w, u, _, kg, Aqk, Akk = f.chunk_kda_fwd_intra(
            q=q, k=k, v=v, gk=g_cs, beta=beta, scale=st.scale, chunk_size=C, **_tab(st)
        )
        st.fwd.update(g_cs=g_cs, Aqk=Aqk, Akk=Akk, w=w, u=u, kg=kg)  # no qg (intra makes none)
    else:
        w, u, A = f.chunk_gated_delta_rule_fwd_intra(
            k=k, v=v, g=g_cs, beta=beta, chunk_size=C, **_tab(st)
        )
        st.fwd.update(g_cs=g_cs, A=A, w=w, u=u, qg=q, kg=k)


def _identity_entry(n: int, HV: int, K: int, V: int, device: torch.device) -> Tensor:
    """``[0 | I]`` ``[n, HV, K, V + K]`` float32: the entry state whose final state is
    ``[E | M]``."""
    h0 = torch.zeros(n, HV, K, V + K, dtype=torch.float32, device=device)
    h0[..., V:] = torch.eye(K, dtype=torch.float32, device=device)
    return h0


def _widen(x: Tensor, K: int) -> Tensor:
    """``[x | 0]``: K zero value columns (the ones that follow M)."""
    return torch.cat([x, x.new_zeros(*x.shape[:-1], K)], -1)


def _summary_pass(st: FlaState, f: Any, token_index: Tensor | None, idx: dict, n: int) -> Tensor:
    """``[n, HV, K, V + K]`` float32 ``[E | M]`` of the sequences ``idx`` over the tokens
    ``token_index`` of the prepared stream (None: all of it): fla's state kernel from
    ``[0 | I]`` with values ``[u | 0]`` (the first V columns follow E, the last K follow M)."""
    q, _, v, _, _ = st.inputs
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    fw = st.fwd
    if token_index is not None:
        fw = {
            n_: fw[n_].index_select(1, token_index).contiguous() for n_ in ("kg", "w", "u", "g_cs")
        }
    _, _, final = f.chunk_gated_delta_rule_fwd_h(
        k=fw["kg"],
        w=fw["w"],
        u=_widen(fw["u"], K),
        **{"gk" if st.kind == "kda" else "g": fw["g_cs"]},
        initial_state=_identity_entry(n, HV, K, V, q.device),
        output_final_state=True,
        save_new_value=False,
        chunk_size=FLA_CHUNK_SIZE,
        **idx,
    )
    return final


class _Prepare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, st: FlaState, *inputs: Tensor) -> Tensor:  # pyrefly: ignore[bad-override]
        _prepare_fwd(st, _fla())
        ctx.st = st
        return st.inputs[0].new_zeros(0)

    @staticmethod
    def backward(ctx, _dtoken: Tensor):  # pyrefly: ignore[bad-override]
        st: FlaState = ctx.st
        f = _fla()
        if st.local_grads is None:  # the local kernel's outputs got no cotangent
            _local_backward(st, f, None, None)
        lg = st.local_grads
        assert lg is not None
        dh, dv, do = lg["dh"], lg["dv"], lg["do"]
        if st.summary_grads:
            # The summaries' cotangent D on each published row's final state (module docstring),
            # through the local kernel's own trajectory: one more bwd_dhu, no output cotangent.
            dht = torch.zeros(lg["state_shape"], dtype=torch.float32, device=dh.device)
            for rows, D in st.summary_grads:
                live = (rows >= 0).view(-1, 1, 1, 1)
                dht.index_add_(0, rows.clamp(min=0).long(), torch.where(live, D.float(), 0))
            dh2, _, dv2 = f.chunk_gated_delta_rule_bwd_dhu(
                q=st.fwd["kg"],  # no output cotangent: q is not read
                k=st.fwd["kg"],
                w=st.fwd["w"],
                **_gate(st),
                h0=st.h0,
                dht=dht,
                do=torch.zeros_like(do),
                dv=torch.zeros_like(dv),
                scale=st.scale,
                chunk_size=FLA_CHUNK_SIZE,
                **st.idx,
            )
            dh, dv = dh + dh2, dv + dv2
        grads = _wy_backward(st, f, lg, dh, dv)
        st.fwd.clear()
        st.local_grads, st.summary_grads = None, []
        return None, *grads


def _wy_backward(st: FlaState, f: Any, lg: dict[str, Any], dh: Tensor, dv: Tensor):
    """fla's WY and intra-chunk backward, once, for the joined state cotangents:
    ``(dq, dk, dv, dg, dbeta)`` in the inputs' dtypes."""
    q, k, v, _, beta = st.inputs
    fw, C = st.fwd, FLA_CHUNK_SIZE
    if st.kind == "kda":
        dq, dk, dv, db, dg, dAkk = f.kda_bwd.chunk_kda_bwd_wy_dqkg_fused(
            q=q,
            k=k,
            v=v,
            v_new=lg["v_new"],
            g=fw["g_cs"],
            beta=beta,
            A=fw["Akk"],
            h=lg["h"],
            do=lg["do"],
            dh=dh,
            dv=dv,
            scale=st.scale,
            chunk_size=C,
            **st.idx,
        )
        dq, dk, db, dg = f.chunk_kda_bwd_intra(
            q=q,
            k=k,
            g=fw["g_cs"],
            beta=beta,
            dAqk=lg["dAqk"],
            dAkk=dAkk,
            dq=dq,
            dk=dk,
            db=db,
            dg=dg,
            chunk_size=C,
            **_tab(st),
        )
        H, HV = q.shape[2], v.shape[2]
        if HV > H:  # grouped value heads: dq, dk back to the key heads
            dq, dk = (x.view(*x.shape[:2], H, HV // H, x.shape[-1]).sum(dim=3) for x in (dq, dk))
    else:
        dq, dk, dw, dg = f.chunk_bwd_dqkwg(
            q=q,
            k=k,
            v=lg["v_new"],
            w=fw["w"],
            g=fw["g_cs"],
            h=lg["h"],
            dv=dv,
            do=lg["do"],
            dh=dh,
            scale=st.scale,
            chunk_size=C,
            **_tab(st),
        )
        dk2, dv, db, dg2 = f.gdn_wy.prepare_wy_repr_bwd(
            k=k, v=v, beta=beta, g=fw["g_cs"], A=fw["A"], dw=dw, du=dv, **_tab(st)
        )
        dk, dg = dk + dk2, dg + dg2
    dg = f.chunk_local_cumsum(dg, chunk_size=C, reverse=True, **_tab(st))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(st.g_dtype), db.to(beta.dtype)


class _Summaries(torch.autograd.Function):
    @staticmethod
    def forward(  # pyrefly: ignore[bad-override]
        ctx, token: Tensor, st: FlaState, rows: SummaryRows, idx: dict[str, Any]
    ) -> Tensor:
        q, _, v, _, _ = st.inputs
        HV, K, V = v.shape[2], q.shape[3], v.shape[3]
        n = rows.subsequence.numel()
        ctx.st, ctx.rows, ctx.V = st, rows.subsequence, V
        if rows.token_index.numel() == 0:  # every row empty (a capped pass): identities
            return _identity_entry(n, HV, K, V, q.device)
        return _summary_pass(st, _fla(), rows.token_index, idx, n)

    @staticmethod
    def backward(ctx, dS: Tensor):  # pyrefly: ignore[bad-override]
        ctx.st.summary_grads.append((ctx.rows, dS[..., : ctx.V]))
        return torch.zeros(0, dtype=dS.dtype, device=dS.device), None, None, None


def _local_backward(st: FlaState, f: Any, do: Tensor | None, dfinal: Tensor | None) -> None:
    """fla's local backward up to the state backward (rebuilding the factors and the state
    trajectory from the scores, as fla does): records ``dh``, ``dv``, ``dh0`` and what the
    WY backward reads in ``st.local_grads``."""
    if "g_cs" not in st.fwd:
        raise RuntimeError(
            "the delta rule's fla CP layer was differentiated twice: its backward frees the "
            "layer's shared state (one backward per forward, as without retain_graph)"
        )
    _wy(st, f, need_q=do is not None)
    q, k, v, _, _ = st.inputs
    h, v_new, _ = _states(st, f, st.h0, False)
    C = FLA_CHUNK_SIZE
    lg: dict[str, Any] = dict(h=h, v_new=v_new)
    if do is None:  # no output cotangent: the output kernel's backward is zeros
        lg["do"] = do = torch.zeros_like(v)
        dv = torch.zeros_like(v)
        if st.kind == "kda":
            lg["dAqk"] = torch.zeros_like(st.fwd["Akk"], dtype=torch.float32)
    elif st.kind == "kda":
        lg["do"] = do = do.contiguous()
        lg["dAqk"], dv = f.kda_bwd.chunk_kda_bwd_dAv(
            q=q, k=k, v=v_new, do=do, A=st.fwd["Aqk"], scale=st.scale, chunk_size=C, **_tab(st)
        )
    else:
        lg["do"] = do = do.contiguous()
        dv = f.chunk_bwd_dv_local(
            q=q, k=k, g=st.fwd["g_cs"], do=do, scale=st.scale, chunk_size=C, **_tab(st)
        )
    N = st.idx["cu_seqlens"].numel() - 1 if st.idx["cu_seqlens"] is not None else q.shape[0]
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    lg["state_shape"] = (N, HV, K, V)
    lg["dh"], lg["dh0"], lg["dv"] = f.chunk_gated_delta_rule_bwd_dhu(
        q=st.fwd.get("qg", st.fwd["kg"]),  # without an output cotangent q is not read
        k=st.fwd["kg"],
        w=st.fwd["w"],
        **_gate(st),
        h0=st.h0,
        dht=None if dfinal is None else dfinal.float().contiguous(),
        do=do,
        dv=dv,
        scale=st.scale,
        chunk_size=C,
        **st.idx,
    )
    st.local_grads = lg


def _local_fwd(st: FlaState, f: Any, output_final_state: bool) -> tuple[Tensor, Tensor | None]:
    """fla's state kernel from ``st.h0`` and its output kernel on the prepared factors:
    ``(o in q's dtype, final | None)``."""
    h, v_new, final = _states(st, f, st.h0, output_final_state)
    q = st.inputs[0]
    if st.kind == "kda":
        o = f.chunk_gla_fwd_o_gk(
            q=q,
            v=v_new,
            g=st.fwd["g_cs"],
            A=st.fwd["Aqk"],
            h=h,
            scale=st.scale,
            chunk_size=FLA_CHUNK_SIZE,
            **_tab(st),
        )
    else:
        o = f.chunk_fwd_o(
            q=q,
            k=st.inputs[1],
            v=v_new,
            h=h,
            g=st.fwd["g_cs"],
            scale=st.scale,
            chunk_size=FLA_CHUNK_SIZE,
            **_tab(st),
        )
    return o.to(q.dtype), final


class _Local(torch.autograd.Function):
    @staticmethod
    def forward(  # pyrefly: ignore[bad-override]
        ctx, token: Tensor, h0: Tensor | None, st: FlaState, output_final_state: bool
    ):
        st.h0 = None if h0 is None else h0.detach().float().contiguous()
        o, final = _local_fwd(st, _fla(), output_final_state)
        for name in ("w", "u", "qg", "kg"):  # rebuilt in the backward (_wy), as fla does
            st.fwd.pop(name, None)
        ctx.st, ctx.has_h0 = st, h0 is not None
        ctx.h0_dtype = None if h0 is None else h0.dtype
        return o, final

    @staticmethod
    def backward(ctx, do: Tensor, dfinal: Tensor | None):  # pyrefly: ignore[bad-override]
        st: FlaState = ctx.st
        _local_backward(st, _fla(), do, dfinal)
        assert st.local_grads is not None
        dh0 = st.local_grads.pop("dh0")
        dh0 = dh0.to(ctx.h0_dtype) if ctx.has_h0 and dh0 is not None else None
        return torch.zeros(0, dtype=do.dtype, device=do.device), dh0, None, None


def check_head_dim(K: int) -> None:
    """fla's delta-rule kernels take key heads of at most 256 channels."""
    if K > 256:
        raise ValueError(f"fla's delta-rule kernels support head dim K <= 256, got K={K}")


def prepare(inputs: tuple[Tensor, ...], tables: SequenceTables, *, kind: str, scale: float | None):
    """The layer's gate cumsum and WY preparation on fla, once (``FlaPrepared``)."""
    q, k, v, g, beta = inputs
    K = q.shape[-1]
    check_head_dim(K)
    cu, cu_cpu, _, _ = fla_offsets(q, *tables, None)
    ci = fla_chunk_indices(cu, cu_cpu, tables.chunk_indices, q.shape[1])
    st = FlaState(
        kind=kind,
        scale=K**-0.5 if scale is None else scale,
        inputs=tuple(x.detach() for x in contiguous(q, k, v, g, beta)),
        idx=dict(cu_seqlens=cu, chunk_indices=ci, chunk_offsets=tables.chunk_offsets),
        g_dtype=g.dtype,
    )
    return FlaPrepared(st, _Prepare.apply(st, q, k, v, g, beta))


def summaries(prepared: FlaPrepared, rows: SummaryRows) -> Tensor:
    """``[R, HV, K, V + K]`` float32 summaries ``[E | M]`` of the published rows, from the
    prepared WY factors (no preparation of their own)."""
    st, token = prepared
    tables = rows.tables
    cu, cu_cpu = device_cu_seqlens(tables.cu_seqlens, tables.cu_seqlens_cpu, token.device)
    assert cu is not None  # the summary stream is always packed
    ci = fla_chunk_indices(cu, cu_cpu, tables.chunk_indices, rows.token_index.numel())
    idx = dict(cu_seqlens=cu, chunk_indices=ci, chunk_offsets=tables.chunk_offsets)
    return _Summaries.apply(token, st, rows, idx)


def local(
    prepared: FlaPrepared, initial_state: InitialState, output_final_state: bool
) -> tuple[Tensor, Tensor | None]:
    """The local kernel on the prepared factors: ``(o [1, T, HV, V], final [N, HV, K, V] |
    None)`` entering sequence n with ``initial_state[n]``."""
    st, token = prepared
    return _Local.apply(token, resolve_state(initial_state), st, output_final_state)


def chunk_delta_rule_fla(
    inputs: tuple[Tensor, ...],
    tables: SequenceTables,
    *,
    kind: str,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The local kernel on fla (``chunk_delta_rule(backend="fla")`` outside ``torch.compile``):
    :func:`prepare`, then :func:`local`, with no summaries. ``inputs`` ``(q, k, v, g, beta)`` and
    the result as ``ops.delta_rule.local.chunk_delta_rule``; ``tables`` the sequences' offsets
    and chunk tables (all None: one sequence)."""
    prepared = prepare(inputs, tables, kind=kind, scale=scale)
    return local(prepared, initial_state, output_final_state)


# ------------------------------------------------------------------------- the compiled path
# Under torch.compile the CP layer is three custom op pairs on these pieces
# (``custom_ops.delta_rule_fla_prepare`` / ``_local`` / ``delta_rule_summaries_fla``): the
# preparation runs once, as its own op, and the other two take its factors. Ops cannot share
# one layer's state across their backward, so the summaries op's backward takes the full
# cotangent ``[dE | dM]`` and runs the state backward at value width V + K from ``[0 | I]``
# with values ``[u | 0]``, on the same pieces.

# The factors the compiled ops pass, in order (``prepared_factors``): the gate cumsum, the WY
# matrix, KDA's query scores, the WY factors and KDA's gated keys (an absent one is [0]).
FACTORS = ("g_cs", "A", "Aqk", "w", "u", "kg")


def op_state(
    inputs: tuple[Tensor, ...], factors: dict[str, Tensor], *, kind: str, scale: float, idx: dict
) -> FlaState:
    """A layer state over contiguous ``inputs`` from a preparation made elsewhere: ``factors``
    by name (``FACTORS``; the gate cumsum and the WY matrix at least: the WY factors are
    rebuilt from it when absent, ``recompute_w_u_fwd``)."""
    st = FlaState(kind=kind, scale=scale, inputs=inputs, idx=idx, g_dtype=inputs[3].dtype)
    wy = "Akk" if kind == "kda" else "A"
    st.fwd.update(g_cs=factors["g_cs"], **{wy: factors["A"]})
    if kind == "kda" and "Aqk" in factors:
        st.fwd["Aqk"] = factors["Aqk"]
    if "w" in factors:
        st.fwd.update(w=factors["w"], u=factors["u"])
        if kind == "kda":
            st.fwd["kg"] = factors["kg"]
        else:  # GDN's state passes read the keys and queries themselves (``_prepare_fwd``)
            st.fwd.update(kg=inputs[1], qg=inputs[0])
    else:
        _wy(st, _fla(), need_q=False)
    return st


def prepared_factors(st: FlaState) -> list[Tensor]:
    """``_prepare_fwd``'s result in ``FACTORS`` order (``[0]`` for what a kind has not)."""
    _prepare_fwd(st, _fla())
    fw, q = st.fwd, st.inputs[0]
    kda = st.kind == "kda"
    names = ("g_cs", "Akk" if kda else "A", "Aqk", "w", "u", "kg")
    # A custom op's outputs may not alias each other: one [0] per absent factor.
    return [fw[n] if (kda or n not in ("Aqk", "kg")) else q.new_zeros(0) for n in names]


def local_fwd(st: FlaState, h0: Tensor | None, output_final_state: bool):
    """The local kernel on a prepared state (``op_state``): ``(o, final | None)``."""
    st.h0 = h0
    return _local_fwd(st, _fla(), output_final_state)


def summaries_fwd(st: FlaState) -> Tensor:
    """The states-only pass of a prepared summary stream: ``[N, HV, K, V + K] = [E | M]``
    float32, one row per sequence."""
    cu = st.idx["cu_seqlens"]
    n = st.inputs[0].shape[0] if cu is None else cu.shape[0] - 1
    return _summary_pass(st, _fla(), None, st.idx, n)


def summaries_bwd(st: FlaState, dS: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dk, dv, dg, dbeta)`` (dg of the natural-log gate) of :func:`summaries_fwd`'s output
    (``st`` from :func:`op_state`: its backward rebuilds the state trajectory) for any cotangent ``dS [N, HV, K, V + K]``: fla's state backward at width V + K with no
    output cotangent, then its WY backward (no ``dAv`` / ``dv_local``)."""
    f = _fla()
    q, k, v, g, beta = st.inputs
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    wide = FlaState(
        kind=st.kind,
        scale=st.scale,
        inputs=(q, k, _widen(v, K), g, beta),
        idx=st.idx,
        g_dtype=st.g_dtype,
        fwd=dict(st.fwd, u=_widen(st.fwd["u"], K)),
        h0=_identity_entry(dS.shape[0], HV, K, V, q.device),
    )
    _local_backward(wide, f, None, dS)
    lg = wide.local_grads
    assert lg is not None
    _, dk, dv, dg, db = _wy_backward(wide, f, lg, lg["dh"], lg["dv"])
    return dk, dv[..., :V].contiguous(), dg, db
