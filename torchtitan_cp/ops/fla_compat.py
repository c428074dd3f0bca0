"""fla-core 0.6.0 compatibility: the one place that reaches below fla's public functions.

Imported only inside the fla adapters and custom ops (``ops/<family>/fla_kernel.py``,
``custom_ops.py``) and at their call (it loads fla, hence Triton).

One shim serves every fla chunk op: :func:`chunk_tables`, a context in which fla's chunked
kernels take the caller's chunk tables (``DeviceRouting``, built on the host) for one offsets
tensor, and :func:`indexed`, a public fla op run with its forward and its backward inside that
context. Reason: fla-core 0.6.0's public chunk ops (``chunk_kda``, ``chunk_simple_gla``,
``chunk_gla``, ...) take no chunk table: their autograd Functions call ``prepare_chunk_indices``,
which ends in a blocking pageable host-to-device copy, and the state passes of the diagonal ones
(``fla.ops.common.chunk_h.chunk_fwd_h`` / ``chunk_bwd_dh``) read their chunk count back with
``.item()``: a host sync per call either way. Inside the context, for calls whose
``cu_seqlens`` *is* the registered tensor (any other offsets reach fla's own code), the names
below are replaced in every loaded fla module, and put back on exit:

* ``prepare_chunk_indices(cu, BT)``: the routing's table for ``BT == FLA_CHUNK_SIZE``; for another
  chunk size (``chunk_gla`` picks 16 or 32 for spans under 64 tokens) built on the device from
  chunk counts known on the host (no read, no copy);
* ``prepare_chunk_offsets(cu, BT)``: the routing's offsets for ``FLA_CHUNK_SIZE`` (fla's own
  device computation otherwise: it reads nothing back);
* ``chunk_fwd_h`` / ``chunk_bwd_dh``: fla's own functions, launching fla's own kernels, with the
  chunk count from the host offsets instead of ``.item()``.

The delta rule's CP layer on fla composes fla's internal pieces under its own autograd nodes
(``ops/delta_rule/fla_kernel.py``); that is the delta rule's kernel, not a shim, so it lives with
the delta rule.

A new fla-backed recurrence needs no edit here: its eager adapter calls
``indexed(fla_op, *args, tables=(cu, cu_cpu, chunk_indices, chunk_offsets), **kwargs)`` and its
custom ops call fla's forward and backward pieces inside ``with chunk_tables(...)``
(docs/kernels.md, "One chunk-table shim"). Tested in tests/test_fla_indices.py (fla's
host-index helpers made to raise, every kernel launch recorded and its tables compared with
fla's own, no transfer and no device read on the meta device).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Generator
from typing import Any, NamedTuple

import torch
import triton
from fla.ops.common import chunk_h
from fla.ops.utils.index import prepare_chunk_offsets
from torch import Tensor

from torchtitan_cp.routing import device_chunk_tables

from .common.fla import FLA_CHUNK_SIZE

__all__ = [
    "chunk_tables",
    "indexed",
]


class _Tables(NamedTuple):
    cu_seqlens: Tensor
    cu_seqlens_cpu: Tensor
    chunk_indices: Tensor | None  # exactly NT rows (``common.fla.chunk_table``)
    chunk_offsets: Tensor | None


_active: dict[int, _Tables] = {}  # id(cu_seqlens) -> its tables, while a context is open
_depth = 0  # open contexts (the patch is installed by the first, removed by the last)
_saved: list[tuple[Any, str, Any]] = []  # (module, name, what was there) while patched


def _lookup(cu_seqlens: Tensor | None) -> _Tables | None:
    t = _active.get(id(cu_seqlens)) if cu_seqlens is not None else None
    return t if t is not None and t.cu_seqlens is cu_seqlens else None


def _chunk_count(t: _Tables, size: int) -> int:
    lens = (t.cu_seqlens_cpu[1:] - t.cu_seqlens_cpu[:-1]).to(torch.int64)
    return int(torch.div(lens + size - 1, size, rounding_mode="floor").sum())


def _chunk_indices(cu_seqlens, chunk_size, cu_seqlens_cpu=None) -> Tensor | None:
    t = _lookup(cu_seqlens)
    if t is None:
        return None
    if chunk_size == FLA_CHUNK_SIZE and t.chunk_indices is not None:
        return t.chunk_indices
    # fla's table for this chunk size from the device offsets; its length from the host.
    return device_chunk_tables(cu_seqlens, chunk_size, _chunk_count(t, chunk_size))[0].to(
        cu_seqlens
    )


def _chunk_offsets(cu_seqlens, chunk_size) -> Tensor | None:
    t = _lookup(cu_seqlens)
    if t is None or chunk_size != FLA_CHUNK_SIZE or t.chunk_offsets is None:
        return None
    return t.chunk_offsets


class _StatePass(NamedTuple):
    """What fla's forward and backward state passes share (``_state_pass``), the split count
    from the host."""

    N: int  # sequences
    NS: int  # splits of BS tokens over all sequences
    state: tuple[int, int]  # one state's shape: (K, V), or (V, K) when V comes first
    grid: Callable[[dict[str, int]], tuple[int]]
    launch: dict[str, Any]  # the arguments both kernels take: gates, offsets, sizes, flags


def _state_pass(
    k, v, gates, cu_seqlens, chunk_size, split_size, state_v_first
) -> _StatePass | None:
    t = _lookup(cu_seqlens)
    if t is None:
        return None
    T, H, K, V = k.shape[1], k.shape[2], k.shape[3], v.shape[-1]
    BS = chunk_size if split_size is None else split_size
    offsets = _chunk_offsets(t.cu_seqlens, BS)
    if offsets is None:
        offsets = prepare_chunk_offsets(t.cu_seqlens, BS)  # on the device, no read
    N = t.cu_seqlens.shape[0] - 1

    def grid(meta):
        return (triton.cdiv(K, meta["BK"]) * triton.cdiv(V, meta["BV"]) * N * H,)

    flags = {f"USE_{name.upper()}": gate is not None for name, gate in gates.items()}
    sizes = dict(T=T, H=H, K=K, V=V, BT=chunk_size, BS=BS, STATE_V_FIRST=state_v_first)
    launch = dict(**gates, **flags, **sizes, cu_seqlens=cu_seqlens, split_offsets=offsets)
    state = (V, K) if state_v_first else (K, V)
    return _StatePass(N, _chunk_count(t, BS), state, grid, launch)


def _fwd_h(
    k,
    v,
    g=None,
    g_gamma=None,
    gk=None,
    gv=None,
    h0=None,
    output_final_state=False,
    state_v_first=False,
    cu_seqlens=None,
    chunk_size=64,
    split_size=None,
    states_in_fp32=False,
):
    """fla's ``chunk_fwd_h`` with the chunk count from the host (None: not our offsets)."""
    gates = dict(g=g, g_gamma=g_gamma, gk=gk, gv=gv)
    sp = _state_pass(k, v, gates, cu_seqlens, chunk_size, split_size, state_v_first)
    if sp is None:
        return None
    B, H = k.shape[0], k.shape[2]
    h = k.new_empty(B, sp.NS, H, *sp.state, dtype=torch.float if states_in_fp32 else k.dtype)
    ht = k.new_empty(sp.N, H, *sp.state, dtype=torch.float) if output_final_state else None
    # Looked up at the call (not imported by name), so patched kernel objects are seen.
    chunk_h.chunk_fwd_kernel_h[sp.grid](k=k, v=v, h=h, h0=h0, ht=ht, **sp.launch)
    return h, ht


def _bwd_dh(
    q,
    k,
    v,
    do,
    h0,
    dht,
    scale,
    g=None,
    g_gamma=None,
    gk=None,
    gv=None,
    state_v_first=False,
    cu_seqlens=None,
    chunk_size=64,
    split_size=None,
    states_in_fp32=False,
):
    """fla's ``chunk_bwd_dh`` with the chunk count from the host (None: not our offsets)."""
    gates = dict(g=g, g_gamma=g_gamma, gk=gk, gv=gv)
    sp = _state_pass(k, v, gates, cu_seqlens, chunk_size, split_size, state_v_first)
    if sp is None:
        return None
    B, H, HQ = k.shape[0], k.shape[2], q.shape[2]
    dh = k.new_empty(B, sp.NS, HQ, *sp.state, dtype=torch.float if states_in_fp32 else k.dtype)
    dh0 = torch.empty_like(h0, dtype=torch.float) if h0 is not None else None
    chunk_h.chunk_bwd_kernel_dh[sp.grid](
        q=q, do=do, dh=dh, dht=dht, dh0=dh0, scale=scale, HQ=HQ, NG=HQ // H, **sp.launch
    )
    return dh, dh0


_REPLACEMENTS: dict[str, Callable[..., Any]] = {
    "prepare_chunk_indices": _chunk_indices,
    "prepare_chunk_offsets": _chunk_offsets,
    "chunk_fwd_h": _fwd_h,
    "chunk_bwd_dh": _bwd_dh,
}


def _dispatcher(ours: Callable[..., Any], theirs: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(theirs)
    def call(*args, **kwargs):
        out = ours(*args, **kwargs)
        return theirs(*args, **kwargs) if out is None else out

    return call


def _patch() -> None:
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "fla" or name.startswith("fla.")):
            continue
        for attr, ours in _REPLACEMENTS.items():
            theirs = vars(mod).get(attr)
            if callable(theirs):
                _saved.append((mod, attr, theirs))
                setattr(mod, attr, _dispatcher(ours, theirs))


def _unpatch() -> None:
    while _saved:
        mod, attr, theirs = _saved.pop()
        setattr(mod, attr, theirs)


@contextlib.contextmanager
def chunk_tables(
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    chunk_indices: Tensor | None,
    chunk_offsets: Tensor | None,
) -> Generator[None]:
    """Inside: every fla chunk op called with this ``cu_seqlens`` tensor (on the device) takes the
    routing's chunk tables (``chunk_indices`` exactly ``[NT, 2]``, cut with
    ``common.fla.chunk_table``; ``chunk_offsets [N + 1]`` or None) for fla's chunk size, tables
    built on the device from host counts for another chunk size, and its state passes take their
    chunk count from ``cu_seqlens_cpu``: no host-to-device copy, no device read. A no-op without
    offsets or without a table (fla then builds its own: a host sync per call)."""
    global _depth
    if cu_seqlens is None or cu_seqlens_cpu is None or chunk_indices is None:
        yield
        return
    key = id(cu_seqlens)
    before = _active.get(key)
    _active[key] = _Tables(cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_offsets)
    if _depth == 0:
        _patch()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            _unpatch()
        if before is None:
            del _active[key]
        else:
            _active[key] = before


class _Indexed(torch.autograd.Function):
    """A public fla op's forward and backward, each inside ``chunk_tables``: the op's own autograd
    graph is built in the forward and differentiated in the backward (nothing is recomputed)."""

    @staticmethod
    def forward(ctx, fn, tables, nargs, names, options, *tensors):  # pyrefly: ignore[bad-override]
        leaves = [
            x.detach().requires_grad_() if isinstance(x, Tensor) and x.requires_grad else x
            for x in tensors
        ]
        with torch.enable_grad(), chunk_tables(*tables):
            outs = fn(*leaves[:nargs], **options, **dict(zip(names, leaves[nargs:])))
        ctx.graph, ctx.tables = (outs, leaves), tables
        return tuple(o.detach() if o is not None else None for o in outs)

    @staticmethod
    def backward(ctx, *grads):  # pyrefly: ignore[bad-override]
        outs, leaves = ctx.graph
        pairs = [
            (o, g)
            for o, g in zip(outs, grads)
            if g is not None and o is not None and o.requires_grad
        ]
        wanted = [x for x in leaves if isinstance(x, Tensor) and x.requires_grad]
        got = iter([None] * len(wanted))
        if pairs and wanted:
            with chunk_tables(*ctx.tables):
                got = iter(
                    torch.autograd.grad(
                        [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
                    )
                )
        dx = [next(got) if isinstance(x, Tensor) and x.requires_grad else None for x in leaves]
        return None, None, None, None, None, *dx


# Opaque to dynamo exactly like the public fla ops it calls.
@torch.compiler.disable
def indexed(
    fn: Callable[..., tuple[Tensor, Tensor | None]],
    *args: Tensor,
    tables: tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None],
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """``fn(*args, **kwargs)`` (a public fla chunk op returning ``(o, final_state)``) with its
    forward and backward inside ``chunk_tables(*tables)``; ``tables`` is ``(cu_seqlens,
    cu_seqlens_cpu, chunk_indices, chunk_offsets)`` and its offsets are passed on to ``fn``.
    Gradients reach every tensor argument, positional or keyword, that requires them."""
    kwargs = dict(kwargs, cu_seqlens=tables[0], cu_seqlens_cpu=tables[1])
    names = [n for n, x in kwargs.items() if isinstance(x, Tensor)]
    options = {n: x for n, x in kwargs.items() if n not in names}
    tensors = (*args, *(kwargs[n] for n in names))
    if not torch.is_grad_enabled() or not any(x.requires_grad for x in tensors):
        with chunk_tables(*tables):
            return fn(*args, **kwargs)
    o, final = _Indexed.apply(fn, tables, len(args), names, options, *tensors)
    return o, final
