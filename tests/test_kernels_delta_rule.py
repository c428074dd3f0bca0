"""Pure-PyTorch chunked delta rule vs the float64 token-by-token oracle (tests/reference.py).

Tolerances (max abs error divided by max(1, max |reference|), per tensor):
  float64: 1e-12 for outputs, final states and every gradient (observed <= 7e-15).
  float32: 2e-5 for outputs and final states, 1e-4 for gradients (they sum over T); observed
  worst cases with per-token log gates down to -5 and 64-token chunks: 1.7e-6 and 6.1e-6.
"""

from __future__ import annotations

import functools
import zlib

import pytest
import torch
import torch.nn.functional as F

from tests.reference import delta_rule_reference, rel_err
from torchtitan_cp.ops.delta_rule.local import chunk_delta_rule
from torchtitan_cp.ops.delta_rule.torch_kernel import chunk_delta_rule_torch

TOL = {
    torch.float64: {"value": 1e-12, "grad": 1e-12},
    torch.float32: {"value": 2e-5, "grad": 1e-4},
}

# Document layouts as cu_seqlens (host ints).
LAYOUTS = {
    "single": [0, 150],
    "short_docs": [0, 1, 2, 5, 9, 26, 27, 60],  # length-1 documents, sub-chunk lengths
    "ragged_with_empty": [0, 33, 33, 97, 130, 131, 200],  # a zero-length sequence, non-multiples
    "chunk_aligned": [0, 64, 65, 193, 300],  # ends exactly on chunk boundaries
}
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


@functools.cache
def _case(kind: str, layout: str, gate: str, H: int = 2, HV: int = 2, K: int = 8, V: int = 12):
    """Random float64 inputs, fixed cotangents, and the oracle's outputs and gradients."""
    gen = torch.Generator().manual_seed(
        zlib.crc32(repr((kind, layout, gate, H, HV, K, V)).encode())
    )
    cu = LAYOUTS[layout]
    T, N = cu[-1], len(cu) - 1

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = F.normalize(rnd(1, T, H, K), dim=-1)
    k = F.normalize(rnd(1, T, H, K), dim=-1)
    v = rnd(1, T, HV, V)
    gshape = (1, T, HV, K) if kind == "kda" else (1, T, HV)
    u = torch.rand(*gshape, generator=gen, dtype=torch.float64)
    # "mild": log gates in [-0.5, 0]; "strong": down to -5 per token, so a 64-token chunk
    # accumulates ~-160 on average (exp of that overflows float32 if ever negated).
    g = -(0.5 if gate == "mild" else 5.0) * u
    beta = torch.rand(1, T, HV, generator=gen, dtype=torch.float64)
    h0 = rnd(N, HV, K, V)
    inputs = (q, k, v, g, beta, h0)
    leaves = [x.clone().requires_grad_() for x in inputs]
    o, ht = delta_rule_reference(*leaves[:5], kind=kind, initial_state=leaves[5], cu_seqlens=cu)
    do, dht = rnd(*o.shape), rnd(*ht.shape)
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), leaves)
    return cu, inputs, (do, dht), (o.detach(), ht.detach()), grads


def _check(kind, layout, gate, dtype, run, **case_kw):
    cu, inputs, (do, dht), (o_ref, ht_ref), grads_ref = _case(kind, layout, gate, **case_kw)
    leaves = [x.to(dtype).requires_grad_() for x in inputs]
    o, ht = run(*leaves[:5], initial_state=leaves[5], cu_seqlens=torch.tensor(cu))
    assert o.dtype == dtype and o.shape == o_ref.shape
    assert ht.shape == ht_ref.shape
    tol = TOL[dtype]
    assert rel_err(o, o_ref) < tol["value"], "output"
    assert rel_err(ht, ht_ref) < tol["value"], "final state"
    loss = (o * do.to(dtype)).sum() + (ht * dht.to(ht.dtype)).sum()
    grads = torch.autograd.grad(loss, leaves)
    for name, g_, g_ref in zip(NAMES, grads, grads_ref):
        assert torch.isfinite(g_).all(), f"d{name} not finite"
        assert rel_err(g_, g_ref) < tol["grad"], f"d{name}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_chunk16_matches_oracle(kind, layout, dtype):
    """Chunk 16 with sub-blocks of 4: several chunks per sequence, all code paths."""

    def run(*args, **kw):
        return chunk_delta_rule_torch(
            *args, kind=kind, output_final_state=True, chunk_size=16, sub_chunk_size=4, **kw
        )

    _check(kind, layout, "mild", dtype, run)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_strong_gates_default_chunk(kind, dtype):
    """Per-token log gates down to -5 with the default 64-token chunk: finite and accurate."""

    def run(*args, **kw):
        return chunk_delta_rule(*args, kind=kind, output_final_state=True, backend="torch", **kw)

    _check(kind, "ragged_with_empty", "strong", dtype, run, K=16, V=16)


@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_strong_gates_chunk16(kind):
    def run(*args, **kw):
        return chunk_delta_rule_torch(
            *args, kind=kind, output_final_state=True, chunk_size=16, **kw
        )

    _check(kind, "single", "strong", torch.float32, run)


@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_grouped_value_heads(kind):
    """HV = 2H: q/k head h serves value heads 2h and 2h+1 (FLA's GVA convention)."""

    def run(*args, **kw):
        return chunk_delta_rule(*args, kind=kind, output_final_state=True, **kw)

    _check(kind, "short_docs", "mild", torch.float64, run, H=1, HV=2)


def test_extreme_gates_stay_finite():
    """Log gates of -60 per token (cumulative -3840 per chunk) in float32: no inf/nan anywhere."""
    T, H, K, V = 130, 1, 8, 8
    q = F.normalize(torch.randn(1, T, H, K), dim=-1).requires_grad_()
    k = F.normalize(torch.randn(1, T, H, K), dim=-1).requires_grad_()
    v = torch.randn(1, T, H, V, requires_grad=True)
    g = torch.full((1, T, H, K), -60.0, requires_grad=True)
    beta = torch.rand(1, T, H, requires_grad=True)
    o, ht = chunk_delta_rule(q, k, v, g, beta, kind="kda", output_final_state=True)
    o_ref, ht_ref = delta_rule_reference(q, k, v, g, beta, kind="kda")
    assert rel_err(o, o_ref) < 2e-5 and rel_err(ht, ht_ref) < 2e-5
    grads = torch.autograd.grad(o.sum() + ht.sum(), (q, k, v, g, beta))
    assert all(torch.isfinite(x).all() for x in grads)


def test_no_cu_seqlens_no_initial_state_and_scale():
    """Defaults: one sequence, zero initial state; an explicit scale is honoured."""
    T, H, K, V = 40, 2, 8, 4
    torch.manual_seed(0)
    q, k = (F.normalize(torch.randn(1, T, H, K, dtype=torch.float64), dim=-1) for _ in range(2))
    v = torch.randn(1, T, H, V, dtype=torch.float64)
    g = -torch.rand(1, T, H, dtype=torch.float64)
    beta = torch.rand(1, T, H, dtype=torch.float64)
    o, ht = chunk_delta_rule(q, k, v, g, beta, kind="gdn", scale=0.3, output_final_state=True)
    o_ref, ht_ref = delta_rule_reference(q, k, v, g, beta, kind="gdn", scale=0.3)
    assert rel_err(o, o_ref) < 1e-12 and rel_err(ht, ht_ref) < 1e-12
    o2, none = chunk_delta_rule(q, k, v, g, beta, kind="gdn", scale=0.3)
    assert none is None and torch.equal(o, o2)


def test_all_empty_and_cpu_offsets():
    """T = 0 with zero-length sequences returns the initial states; cu_seqlens_cpu is used."""
    H, K, V = 2, 4, 4
    q = torch.zeros(1, 0, H, K)
    v = torch.zeros(1, 0, H, V)
    h0 = torch.randn(3, H, K, V)
    cu = torch.tensor([0, 0, 0, 0], dtype=torch.int32)
    o, ht = chunk_delta_rule(
        q,
        q,
        v,
        torch.zeros(1, 0, H, K),
        torch.zeros(1, 0, H),
        kind="kda",
        initial_state=h0,
        output_final_state=True,
        cu_seqlens=cu,
        cu_seqlens_cpu=cu,
    )
    assert o.shape == (1, 0, H, V) and torch.equal(ht, h0)


def test_bf16_inputs_keep_float32_state():
    T, H, K, V = 50, 1, 8, 8
    torch.manual_seed(1)
    args = [
        F.normalize(torch.randn(1, T, H, K), dim=-1),
        F.normalize(torch.randn(1, T, H, K), dim=-1),
        torch.randn(1, T, H, V),
        -torch.rand(1, T, H, K),
        torch.rand(1, T, H),
    ]
    o, ht = chunk_delta_rule(*(a.bfloat16() for a in args), kind="kda", output_final_state=True)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    o_ref, ht_ref = delta_rule_reference(*(a.bfloat16() for a in args), kind="kda")
    assert rel_err(o, o_ref) < 2e-2 and rel_err(ht, ht_ref) < 1e-4


@pytest.mark.parametrize("seed", range(4))
def test_random_layouts_and_chunkings(seed):
    """Random document lengths (0 and 1 included) and chunk / sub-block sizes, float64.

    Chunk 12 with sub-block 8 exercises the fallback to one sub-block per chunk.
    """
    gen = torch.Generator().manual_seed(100 + seed)
    lengths = torch.randint(0, 40, (6,), generator=gen).tolist() + [0, 1]
    perm = torch.randperm(len(lengths), generator=gen).tolist()
    cu = [0, *torch.tensor([lengths[i] for i in perm]).cumsum(0).tolist()]
    chunk, sub = [(8, 4), (16, 8), (32, 4), (12, 8)][seed]
    kind = ("kda", "gdn")[seed % 2]
    T, N, H, K, V = cu[-1], len(cu) - 1, 1, 6, 5

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = F.normalize(rnd(1, T, H, K), dim=-1), F.normalize(rnd(1, T, H, K), dim=-1)
    g = -3 * torch.rand(*((1, T, H, K) if kind == "kda" else (1, T, H)), generator=gen).double()
    inputs = [q, k, rnd(1, T, H, V), g, torch.rand(1, T, H, generator=gen).double()]
    inputs.append(rnd(N, H, K, V))
    ref = [x.clone().requires_grad_() for x in inputs]
    new = [x.clone().requires_grad_() for x in inputs]
    o_ref, ht_ref = delta_rule_reference(*ref[:5], kind=kind, initial_state=ref[5], cu_seqlens=cu)
    o, ht = chunk_delta_rule_torch(
        *new[:5],
        kind=kind,
        initial_state=new[5],
        output_final_state=True,
        cu_seqlens_cpu=torch.tensor(cu),
        chunk_size=chunk,
        sub_chunk_size=sub,
    )
    assert rel_err(o, o_ref) < 1e-12 and rel_err(ht, ht_ref) < 1e-12
    do, dht = rnd(*o.shape), rnd(*ht.shape)
    g_ref = torch.autograd.grad((o_ref * do).sum() + (ht_ref * dht).sum(), ref)
    g_new = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), new)
    for name, a, r in zip(NAMES, g_new, g_ref):
        assert rel_err(a, r) < 1e-12, f"d{name}"


@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_composed_summaries_share_the_prepared_chunks(kind):
    """CP summaries from the prepared chunk maps (``compose_chunk_maps``): applied to the entry
    state the local kernel used they give its final state, and their backward (which carries
    only the first V cotangent columns, relying on that) gives the gradient of the final state
    with that entry state held fixed. float64, 16-token chunks, rows of 1, 5 and 0 chunks."""
    from torchtitan_cp.ops.delta_rule.torch_kernel import (
        compose_chunk_maps,
        local_delta_rule_torch,
        prepare_delta_rule_torch,
    )

    cu = [0, 70, 79, 79, 150]
    T, H, K, V = cu[-1], 2, 8, 12
    gen = torch.Generator().manual_seed(5)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    g = -F.softplus(rnd(1, T, H, K) if kind == "kda" else rnd(1, T, H)) * 0.3
    xs = [F.normalize(rnd(1, T, H, K), dim=-1), F.normalize(rnd(1, T, H, K), dim=-1)]
    xs += [rnd(1, T, H, V), g, torch.sigmoid(rnd(1, T, H))]
    h0 = rnd(4, H, K, V)
    rows = [1, 0, 2, -1]  # one-chunk row, five-chunk row, empty and padding rows: identity
    D, do = rnd(4, H, K, V), rnd(1, T, H, V)
    cu_t = torch.tensor(cu)
    kw = dict(kind=kind, cu_seqlens_cpu=cu_t, chunk_size=16, sub_chunk_size=4)

    leaves = [x.clone().requires_grad_(True) for x in xs]
    chunks = prepare_delta_rule_torch(*leaves, **kw)
    summ = compose_chunk_maps(chunks, rows)
    o, fin = local_delta_rule_torch(chunks, h0, True)
    assert fin is not None
    entry = torch.stack([h0[r] if r >= 0 else h0[0] for r in rows])
    applied = summ[..., V:] @ entry + summ[..., :V]
    for i, r in enumerate(rows):
        want = fin[r] if r >= 0 and cu[r + 1] > cu[r] else entry[i]
        assert (applied[i] - want).abs().max() <= 1e-12, r
    ((applied * D).sum() + (o * do).sum()).backward()

    # Reference: the plain kernel, each row's final state from its own entry, held fixed.
    ref = [x.clone().requires_grad_(True) for x in xs]
    o_ref, fin_ref = chunk_delta_rule_torch(*ref, initial_state=h0, output_final_state=True, **kw)
    assert fin_ref is not None
    live = [(i, r) for i, r in enumerate(rows) if r >= 0]
    loss = sum((fin_ref[r] * D[i]).sum() for i, r in live) + (o_ref * do).sum()
    loss.backward()  # type: ignore[union-attr]
    for name, a, b in zip(NAMES, leaves, ref):
        assert (a.grad - b.grad).abs().max() <= 1e-10, name


def test_composed_summaries_backward_needs_the_local_kernel():
    from torchtitan_cp.ops.delta_rule.torch_kernel import (
        compose_chunk_maps,
        prepare_delta_rule_torch,
    )

    T, H, K = 20, 1, 4
    xs = [torch.randn(1, T, H, K, requires_grad=True) for _ in range(3)]
    g, beta = -torch.rand(1, T, H), torch.rand(1, T, H)
    chunks = prepare_delta_rule_torch(*xs, g, beta, kind="gdn", cu_seqlens_cpu=torch.tensor([0, T]))
    with pytest.raises(RuntimeError, match="needs the local kernel's forward"):
        compose_chunk_maps(chunks, [0]).sum().backward()
