"""The local kernels as ``torch.library`` custom ops, so ``torch.compile`` keeps them opaque.

Under ``torch.compile`` (torchtitan compiles every block with ``fullgraph=True``) the kernels
cannot be traced: the pure-PyTorch ones read their ``cu_seqlens_cpu`` back as Python ints and
loop over them, fla-core's entry points are ``torch.compiler.disable``d. Each kernel is therefore
a custom op with a fake (shape-only) implementation and a registered autograd formula whose
backward is another custom op:

==========================================  ==============================================
op (namespace ``torchtitan_cp``)            backward
==========================================  ==============================================
``delta_rule_torch`` (KDA / GDN, PyTorch)   ``delta_rule_torch_bwd``: re-runs the forward
                                            under autograd (costs one extra forward)
``causal_conv1d_torch`` (PyTorch)           ``causal_conv1d_torch_bwd``: same recompute
``delta_rule_fla`` (fla-core, CUDA)         ``delta_rule_fla_bwd``: fla's own
                                            ``chunk_kda_bwd`` / ``chunk_gated_delta_rule_bwd``
                                            on the intermediates the forward returned
``causal_conv1d_fla`` (fla-core, CUDA)      ``causal_conv1d_fla_bwd``: fla's
                                            ``causal_conv1d_bwd`` (no recompute)
==========================================  ==============================================

The fla ops hand fla's internal functions contiguous tensors only (``fla_backend.contiguous``:
saved inputs may be views, cotangents expanded) and return no uninitialised memory (KDA's
``Aqk`` has its never-written upper part zeroed), so compiled gradients equal eager ones and
``torch.library.opcheck`` passes (tests/test_fla_interpreter.py runs both on CPU).

Eager runs do not go through these ops (``ops.local`` calls them only while compiling), so the
eager path keeps its plain autograd. Shapes and conventions are those of ``ops.local``
(docs/CONTRACTS.md). Every op takes optional tensors as ``Tensor | None`` arguments, so a new
precomputed index (fla's ``chunk_indices``, ...) is one more optional argument on the forward op,
saved in ``_setup_*`` and passed on by its backward op. An argument's shape is part of the
compiled graph's guards, though: an index whose length follows the layout (fla's chunk indices
are ``[number of chunks, 2]``) recompiles per layout unless it is padded to a fixed size. So
``DeviceRouting.chunk_indices`` is padded to a layout-independent row count when the routing has
caps, and ``_fla_chunk_indices`` cuts it to the real chunk count inside the op (from the host
offsets, where shapes are invisible to the compiler); given no table, the op falls back to
fla's own helper (a host sync per call).

Only APIs present since torch 2.4 are used (``torch.library.custom_op``, ``register_fake``,
``register_autograd``), so the ops load on the GPU image's torch 2.11 as well.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any, cast

import torch
from torch import Tensor

from .fla_backend import contiguous
from .torch_backend import causal_conv1d_torch, chunk_delta_rule_torch

__all__ = [
    "causal_conv1d_fla_op",
    "causal_conv1d_torch_op",
    "delta_rule_fla_op",
    "delta_rule_torch_op",
]

_NS = "torchtitan_cp"
# fla-core's chunk size for the delta-rule kernels (BT): sizes its saved score matrices.
FLA_CHUNK = 64


def _num_seqs(cu_seqlens: Tensor | None) -> int:
    # A shape, not a value: stays static (or symbolic) under tracing.
    return 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    # The PyTorch kernel keeps states in float64 for float64 inputs, else float32.
    return torch.float64 if dtype == torch.float64 else torch.float32


@contextlib.contextmanager
def _autograd_inside_op() -> Generator[None]:
    """Record autograd inside a custom op's kernel. The dispatcher runs kernels with the
    autograd keys excluded (and grad mode off); the recomputing backward ops need both back."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality) | (
        torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView)
    )
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set() - keys
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield


def _grads(
    outputs: list[Tensor], cotangents: list[Tensor | None], inputs: list[Tensor]
) -> list[Tensor]:
    """``d outputs / d inputs`` for the given cotangents; zeros where an input is unused."""
    pairs = [(o, c) for o, c in zip(outputs, cotangents) if c is not None and o.requires_grad]
    if not pairs:
        return [torch.zeros_like(x) for x in inputs]
    got = torch.autograd.grad(
        [o for o, _ in pairs], inputs, [c for _, c in pairs], allow_unused=True
    )
    return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, got)]


# ----------------------------------------------------------------------------- delta rule, torch


@torch.library.custom_op(f"{_NS}::delta_rule_torch", mutates_args=())
def delta_rule_torch_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    kind: str,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """``chunk_delta_rule_torch``; returns ``(o [1,T,HV,V], final_state [N,HV,K,V])`` (the final
    state always: it costs nothing extra here and keeps one output signature)."""
    o, final = chunk_delta_rule_torch(
        q, k, v, g, beta, kind=kind, scale=scale, initial_state=initial_state,
        output_final_state=True, cu_seqlens_cpu=cu_seqlens_cpu,
    )  # fmt: skip
    assert final is not None
    if initial_state is not None and final.data_ptr() == initial_state.data_ptr():
        final = final.clone()  # an op output must not alias an input
    return o, final


@delta_rule_torch_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens_cpu, kind, scale):
    HV, V = v.shape[2], v.shape[3]
    K = q.shape[3]
    final = q.new_empty(_num_seqs(cu_seqlens_cpu), HV, K, V, dtype=_state_dtype(q.dtype))
    return torch.empty_like(v), final


@torch.library.custom_op(f"{_NS}::delta_rule_torch_bwd", mutates_args=())
def delta_rule_torch_bwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    do: Tensor | None,
    dfinal: Tensor | None,
    kind: str,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv, dg, dbeta, dh0)`` by re-running the forward under autograd
    (dh0 is ``[N,HV,K,V]`` zeros without an initial state)."""
    HV, V, K = v.shape[2], v.shape[3], q.shape[3]
    h0 = initial_state
    if h0 is None:
        h0 = q.new_zeros(_num_seqs(cu_seqlens_cpu), HV, K, V, dtype=_state_dtype(q.dtype))
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    with _autograd_inside_op():
        o, final = chunk_delta_rule_torch(
            *leaves[:5], kind=kind, scale=scale, initial_state=leaves[5],
            output_final_state=True, cu_seqlens_cpu=cu_seqlens_cpu,
        )  # fmt: skip
        assert final is not None
        grads = _grads([o, final], [do, dfinal], leaves)
    return tuple(gr.to(x.dtype) for gr, x in zip(grads, (q, k, v, g, beta, h0)))  # type: ignore[return-value]


@delta_rule_torch_bwd_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens_cpu, do, dfinal, kind, scale):
    HV, V, K = v.shape[2], v.shape[3], q.shape[3]
    if initial_state is None:
        dh0 = q.new_empty(_num_seqs(cu_seqlens_cpu), HV, K, V, dtype=_state_dtype(q.dtype))
    else:
        dh0 = torch.empty_like(initial_state)
    return tuple(torch.empty_like(x) for x in (q, k, v, g, beta)) + (dh0,)


def _setup_delta_rule_torch(ctx, inputs, output) -> None:
    q, k, v, g, beta, h0, cu_cpu, kind, scale = inputs
    ctx.save_for_backward(q, k, v, g, beta, h0, cu_cpu)
    ctx.kind, ctx.scale = kind, scale


def _backward_delta_rule_torch(ctx, do, dfinal):
    q, k, v, g, beta, h0, cu_cpu = ctx.saved_tensors
    dq, dk, dv, dg, db, dh0 = delta_rule_torch_bwd_op(
        q, k, v, g, beta, h0, cu_cpu, do, dfinal, ctx.kind, ctx.scale
    )
    return dq, dk, dv, dg, db, (dh0 if h0 is not None else None), None, None, None


delta_rule_torch_op.register_autograd(
    _backward_delta_rule_torch, setup_context=_setup_delta_rule_torch
)


# ----------------------------------------------------------------------------- conv, torch


@torch.library.custom_op(f"{_NS}::causal_conv1d_torch", mutates_args=())
def causal_conv1d_torch_op(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    activation: str,
) -> Tensor:
    """``causal_conv1d_torch`` (``activation`` "silu" or "none"); ``[1, T, D]``."""
    act = None if activation == "none" else activation
    return causal_conv1d_torch(
        x, weight, bias, cu_seqlens_cpu=cu_seqlens_cpu, initial_state=initial_state, activation=act
    )


@causal_conv1d_torch_op.register_fake
def _(x, weight, bias, initial_state, cu_seqlens_cpu, activation):
    return torch.empty_like(x)


@torch.library.custom_op(f"{_NS}::causal_conv1d_torch_bwd", mutates_args=())
def causal_conv1d_torch_bwd_op(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    dy: Tensor,
    activation: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dweight, dbias, dinitial_state)`` by re-running the forward under autograd;
    ``dbias`` / ``dinitial_state`` are empty ``[0]`` tensors where the input is None."""
    act = None if activation == "none" else activation
    present = [t for t in (x, weight, bias, initial_state) if t is not None]
    leaves = [t.detach().requires_grad_(True) for t in present]
    it = iter(leaves)
    lx, lw = next(it), next(it)
    lb = next(it) if bias is not None else None
    lh = next(it) if initial_state is not None else None
    with _autograd_inside_op():
        y = causal_conv1d_torch(
            lx, lw, lb, cu_seqlens_cpu=cu_seqlens_cpu, initial_state=lh, activation=act
        )
        grads = iter(_grads([y], [dy], leaves))
    dx, dw = next(grads), next(grads)
    db = next(grads) if bias is not None else x.new_empty(0)
    dh = next(grads) if initial_state is not None else x.new_empty(0)
    return dx, dw, db, dh


@causal_conv1d_torch_bwd_op.register_fake
def _(x, weight, bias, initial_state, cu_seqlens_cpu, dy, activation):
    db = torch.empty_like(bias) if bias is not None else x.new_empty(0)
    dh = torch.empty_like(initial_state) if initial_state is not None else x.new_empty(0)
    return torch.empty_like(x), torch.empty_like(weight), db, dh


def _setup_conv_torch(ctx, inputs, output) -> None:
    x, weight, bias, h0, cu_cpu, activation = inputs
    ctx.save_for_backward(x, weight, bias, h0, cu_cpu)
    ctx.activation = activation


def _backward_conv_torch(ctx, dy):
    x, weight, bias, h0, cu_cpu = ctx.saved_tensors
    dx, dw, db, dh = causal_conv1d_torch_bwd_op(x, weight, bias, h0, cu_cpu, dy, ctx.activation)
    return dx, dw, (db if bias is not None else None), (dh if h0 is not None else None), None, None


causal_conv1d_torch_op.register_autograd(_backward_conv_torch, setup_context=_setup_conv_torch)


# ----------------------------------------------------------------------------- delta rule, fla


def _fla_chunk_indices(
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    chunk_indices: Tensor | None,
    num_tokens: int,
) -> Tensor | None:
    """The chunk table fla's kernels get: the routing's (``DeviceRouting.chunk_indices``, padded
    to a fixed row count with caps) cut to its first NT rows, NT from the host offsets (a view:
    no copy, no device read); without one, fla's own helper (a host sync per call)."""
    if cu_seqlens is None:
        return None
    if chunk_indices is not None:
        from .fla_backend import _chunk_table

        return _chunk_table(cu_seqlens_cpu, num_tokens, chunk_indices, None)
    from fla.ops.utils.index import prepare_chunk_indices

    return prepare_chunk_indices(cu_seqlens, FLA_CHUNK, cu_seqlens_cpu=cu_seqlens_cpu)


def _zero_unwritten_scores(A: Tensor, cu_seqlens: Tensor | None) -> Tensor:
    """fla's KDA forward allocates ``Aqk [1, T, HV, BT]`` with ``torch.empty`` and writes, for a
    token at position p of its chunk, columns 0..p only (its backward reads no other). Zero the
    rest, so the op returns no uninitialised memory (opcheck; run-to-run equal outputs).
    Device ops on the device offsets: no host read."""
    T, BT = A.shape[1], A.shape[-1]
    t = torch.arange(T, device=A.device)
    if cu_seqlens is None:
        pos = t % BT
    else:
        cu = cu_seqlens.to(torch.int64)
        seq = torch.searchsorted(cu[1:], t, right=True)  # the sequence each token belongs to
        pos = (t - cu.index_select(0, seq)) % BT
    unwritten = torch.arange(BT, device=A.device)[None, :] > pos[:, None]  # [T, BT]
    return A.masked_fill(unwritten[None, :, None, :], 0)


@torch.library.custom_op(f"{_NS}::delta_rule_fla", mutates_args=())
def delta_rule_fla_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    chunk_indices: Tensor | None,
    kind: str,
    scale: float,
    output_final_state: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fla-core's forward pieces (``chunk_kda_fwd`` / ``chunk_gated_delta_rule_fwd``) with the
    gate, l2norm and beta options off. Returns ``(o, final_state, g_cumsum, A1, A2)``: the
    output in q's dtype, the float32 final states ``[N,HV,K,V]`` (``[0]`` when not requested)
    and what fla's backward reads instead of recomputing (kda: Aqk, Akk; gdn: A and ``[0]``).
    """
    q, k, v, g, beta, initial_state = contiguous(q, k, v, g, beta, initial_state)
    chunk_indices = _fla_chunk_indices(cu_seqlens, cu_seqlens_cpu, chunk_indices, q.shape[1])
    # Untyped kwargs: fla annotates optional tensors (initial_state, offsets) as required.
    kw: dict[str, Any] = dict(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, chunk_size=FLA_CHUNK,
    )  # fmt: skip
    if kind == "kda":
        from fla.ops.kda.chunk_fwd import chunk_kda_fwd

        kw["cu_seqlens_cpu"] = cu_seqlens_cpu
        o, final, g_cum, Aqk, Akk, *_ = chunk_kda_fwd(**kw)
        a1, a2 = _zero_unwritten_scores(Aqk, cu_seqlens), Akk
    else:
        from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

        g_cum, o, A, final, _, _ = chunk_gated_delta_rule_fwd(**kw)
        a1, a2 = A, q.new_empty(0)
    if final is None:
        final = q.new_empty(0, dtype=torch.float32)
    return o.to(q.dtype), final, g_cum, a1, a2


@delta_rule_fla_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, chunk_indices, kind, scale,
      output_final_state):  # fmt: skip
    T, HV, V, K = q.shape[1], v.shape[2], v.shape[3], q.shape[3]
    if output_final_state:
        final = q.new_empty(_num_seqs(cu_seqlens), HV, K, V, dtype=torch.float32)
    else:
        final = q.new_empty(0, dtype=torch.float32)
    scores = q.new_empty(1, T, HV, FLA_CHUNK, dtype=k.dtype)
    g_cum = torch.empty_like(g, dtype=torch.float32)
    a2 = torch.empty_like(scores) if kind == "kda" else q.new_empty(0)
    return q.new_empty(1, T, HV, V), final, g_cum, scores, a2


@torch.library.custom_op(f"{_NS}::delta_rule_fla_bwd", mutates_args=())
def delta_rule_fla_bwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    g_cumsum: Tensor,
    a1: Tensor,
    a2: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    chunk_indices: Tensor | None,
    do: Tensor,
    dfinal: Tensor | None,
    kind: str,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fla-core's own backward; ``(dq, dk, dv, dg, dbeta, dh0)`` (dh0 ``[0]`` without h0)."""
    chunk_indices = _fla_chunk_indices(cu_seqlens, cu_seqlens_cpu, chunk_indices, q.shape[1])
    # The saved inputs are the forward's arguments as the caller passed them (views included).
    q, k, v, beta, g_cumsum, a1, a2, initial_state, do, dfinal = contiguous(
        q, k, v, beta, g_cumsum, a1, a2, initial_state, do, dfinal
    )
    kw: dict[str, Any] = dict(
        q=q, k=k, v=v, beta=beta, scale=scale, initial_state=initial_state, do=do, dht=dfinal,
        cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_size=FLA_CHUNK,
    )  # fmt: skip
    grads: tuple[Any, ...]
    if kind == "kda":
        from fla.ops.kda.chunk_bwd import chunk_kda_bwd

        grads = chunk_kda_bwd(**kw, Aqk=a1, Akk=a2, g=g_cumsum)
    else:
        from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd

        grads = chunk_gated_delta_rule_bwd(**kw, g=g_cumsum, A=a1)
    dq, dk, dv, db, dgate, dh0 = grads[:6]
    if dh0 is None or initial_state is None:
        dh0 = q.new_empty(0, dtype=torch.float32)
    else:
        dh0 = dh0.to(initial_state.dtype)
    return (
        dq.to(q.dtype),
        dk.to(k.dtype),
        dv.to(v.dtype),
        cast(Tensor, dgate).to(g_cumsum.dtype),
        db.to(beta.dtype),
        dh0,
    )


@delta_rule_fla_bwd_op.register_fake
def _(q, k, v, beta, g_cumsum, a1, a2, initial_state, cu_seqlens, cu_seqlens_cpu, chunk_indices,
      do, dfinal, kind, scale):  # fmt: skip
    dh0 = (
        torch.empty_like(initial_state)
        if initial_state is not None
        else q.new_empty(0, dtype=torch.float32)
    )
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(g_cumsum), torch.empty_like(beta), dh0)  # fmt: skip


def _setup_delta_rule_fla(ctx, inputs, output) -> None:
    q, k, v, g, beta, h0, cu, cu_cpu, chunk_indices, kind, scale, _ = inputs
    _, _, g_cum, a1, a2 = output
    ctx.save_for_backward(q, k, v, beta, g_cum, a1, a2, h0, cu, cu_cpu, chunk_indices)
    ctx.kind, ctx.scale, ctx.g_dtype = kind, scale, g.dtype


def _backward_delta_rule_fla(ctx, do, dfinal, *_):
    q, k, v, beta, g_cum, a1, a2, h0, cu, cu_cpu, chunk_indices = ctx.saved_tensors
    if dfinal is not None and dfinal.numel() == 0:
        dfinal = None
    dq, dk, dv, dg, db, dh0 = delta_rule_fla_bwd_op(
        q, k, v, beta, g_cum, a1, a2, h0, cu, cu_cpu, chunk_indices, do, dfinal, ctx.kind,
        ctx.scale,
    )  # fmt: skip
    dh0 = dh0 if h0 is not None else None
    return dq, dk, dv, dg.to(ctx.g_dtype), db, dh0, None, None, None, None, None, None


delta_rule_fla_op.register_autograd(_backward_delta_rule_fla, setup_context=_setup_delta_rule_fla)


# ----------------------------------------------------------------------------- conv, fla


@torch.library.custom_op(f"{_NS}::causal_conv1d_fla", mutates_args=())
def causal_conv1d_fla_op(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    chunk_indices: Tensor | None,
    activation: str,
) -> Tensor:
    """fla-core's ``causal_conv1d_fwd`` (Triton); ``initial_state`` in fla's ``[N, D, W]``
    cache layout. ``[1, T, D]``."""
    from fla.modules.causal_conv1d.ops import causal_conv1d_fwd

    act = None if activation == "none" else activation
    # Contiguous inputs: fla's wrapper (not called here) would otherwise pick a layout fallback.
    x, weight, bias, initial_state = contiguous(x, weight, bias, initial_state)
    chunk_indices = _fla_chunk_indices(cu_seqlens, cu_seqlens_cpu, chunk_indices, x.shape[1])
    y, _ = causal_conv1d_fwd(
        x=x, weight=weight, bias=bias, residual=None, initial_state=initial_state,
        output_final_state=False, activation=act, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
    )  # fmt: skip
    return y


@causal_conv1d_fla_op.register_fake
def _(x, weight, bias, initial_state, cu_seqlens, cu_seqlens_cpu, chunk_indices, activation):
    return torch.empty_like(x)


@torch.library.custom_op(f"{_NS}::causal_conv1d_fla_bwd", mutates_args=())
def causal_conv1d_fla_bwd_op(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    chunk_indices: Tensor | None,
    dy: Tensor,
    activation: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """fla-core's ``causal_conv1d_bwd``: ``(dx, dweight, dbias, dinitial_state)``, ``[0]`` for
    a missing bias / initial state."""
    from fla.modules.causal_conv1d.ops import causal_conv1d_bwd

    act = None if activation == "none" else activation
    x, weight, bias, initial_state, dy = contiguous(x, weight, bias, initial_state, dy)
    chunk_indices = _fla_chunk_indices(cu_seqlens, cu_seqlens_cpu, chunk_indices, x.shape[1])
    dx, dw, db, _, dh0 = causal_conv1d_bwd(
        x=x, dy=dy, dht=None, weight=weight, bias=bias, residual=None,
        initial_state=initial_state, activation=act, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
    )  # fmt: skip
    # Every gradient in its input's dtype, as the fake impl promises.
    db = db.to(bias.dtype) if (bias is not None and db is not None) else x.new_empty(0)
    if initial_state is not None and dh0 is not None:
        dh0 = dh0.to(initial_state.dtype)
    else:
        dh0 = x.new_empty(0)
    return dx.to(x.dtype), dw.to(weight.dtype), db, dh0


@causal_conv1d_fla_bwd_op.register_fake
def _(x, weight, bias, initial_state, cu_seqlens, cu_seqlens_cpu, chunk_indices, dy, activation):
    db = torch.empty_like(bias) if bias is not None else x.new_empty(0)
    dh = torch.empty_like(initial_state) if initial_state is not None else x.new_empty(0)
    return torch.empty_like(x), torch.empty_like(weight), db, dh


def _setup_conv_fla(ctx, inputs, output) -> None:
    x, weight, bias, h0, cu, cu_cpu, chunk_indices, activation = inputs
    ctx.save_for_backward(x, weight, bias, h0, cu, cu_cpu, chunk_indices)
    ctx.activation = activation


def _backward_conv_fla(ctx, dy):
    x, weight, bias, h0, cu, cu_cpu, chunk_indices = ctx.saved_tensors
    dx, dw, db, dh = causal_conv1d_fla_bwd_op(
        x, weight, bias, h0, cu, cu_cpu, chunk_indices, dy, ctx.activation
    )
    db = db if bias is not None else None
    dh = dh if h0 is not None else None
    return dx, dw, db, dh, None, None, None, None


causal_conv1d_fla_op.register_autograd(_backward_conv_fla, setup_context=_setup_conv_fla)
