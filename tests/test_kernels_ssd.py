"""SSD (Mamba2's recurrence): the torch kernel against the float64 token-by-token oracle
(outputs, final states, gradients; packed sequences with empty ones and chunk-crossing ones,
initial states, grouped heads), and the summary algebra of both registered recurrence families
(summarize / apply / compose) against running the recurrence itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import max_abs
from tests.reference import delta_rule_reference
from tests.reference_ssd import ssd_reference
from torchtitan_cp.ops.cp.recurrence import RECURRENCES, SequenceTables, recurrence
from torchtitan_cp.ops.ssd.local import chunk_ssd

H, HV, K, V = 1, 2, 8, 6


def _inputs(T: int, seed: int, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, HV, V)
    g = -F.softplus(rnd(1, T, HV)) * 0.3
    return [x.to(dtype) for x in (q, k, v, g)]


@pytest.mark.parametrize("cu", [[0, 20], [0, 3, 3, 70, 150, 151], [0, 64, 128, 129]])
def test_ssd_matches_oracle(cu: list[int]) -> None:
    T, N = cu[-1], len(cu) - 1
    xs = _inputs(T, len(cu))
    gen = torch.Generator().manual_seed(7)
    h0 = torch.randn(N, HV, K, V, generator=gen, dtype=torch.float64)
    d_o = torch.randn(1, T, HV, V, generator=gen, dtype=torch.float64)
    d_f = torch.randn(N, HV, K, V, generator=gen, dtype=torch.float64)
    cu_t = torch.tensor(cu, dtype=torch.int32)

    def run(fn, **kw):
        leaves = [x.clone().requires_grad_(True) for x in (*xs, h0)]
        o, f = fn(*leaves[:4], initial_state=leaves[4], cu_seqlens=cu_t, **kw)
        ((o * d_o).sum() + (f * d_f).sum()).backward()
        return [o, f, *(x.grad for x in leaves)]

    got = run(chunk_ssd, output_final_state=True, backend="torch")
    want = run(ssd_reference)
    for name, a, b in zip("o final dq dk dv dg dh0".split(), got, want):
        assert max_abs(a, b) <= 1e-10, name


def test_ssd_rejects_bad_shapes() -> None:
    q, k, v, g = _inputs(10, 0)
    with pytest.raises(ValueError, match=r"g must be \[1, 10, 2\]"):
        chunk_ssd(q, k, v, g[..., :1])
    with pytest.raises(ValueError, match="initial_state must be"):
        chunk_ssd(q, k, v, g, initial_state=torch.zeros(1, HV, K, K))


def _family(name: str):
    """(recurrence, inputs builder, oracle) for a registered recurrence name."""
    rec = recurrence(name, backend="torch")
    if name == "ssd":
        return rec, lambda T, s: _inputs(T, s), ssd_reference
    gen = torch.Generator().manual_seed(3)

    def build(T, s):
        gen.manual_seed(s)
        q = F.normalize(torch.randn(1, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
        k = F.normalize(torch.randn(1, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
        v = torch.randn(1, T, HV, V, generator=gen, dtype=torch.float64)
        gs = (1, T, HV, K) if name == "kda" else (1, T, HV)
        g = -F.softplus(torch.randn(*gs, generator=gen, dtype=torch.float64)) * 0.3
        beta = torch.sigmoid(torch.randn(1, T, HV, generator=gen, dtype=torch.float64))
        return [q, k, v, g, beta]

    def oracle(*xs, **kw):
        return delta_rule_reference(*xs, kind=name, **kw)

    return rec, build, oracle


@pytest.mark.parametrize("name", sorted(RECURRENCES))
def test_summary_algebra(name: str) -> None:
    # summarize(range) applied to S equals running the range from S; compose(a, b) equals
    # applying a then b; identity is neutral. Two sequences (lengths 9 and 70, one chunk-crossing).
    rec, build, oracle = _family(name)
    cu = [0, 9, 79]
    xs = build(cu[-1], 1)
    cu_t = torch.tensor(cu)
    summ = rec.summarize(tuple(xs), SequenceTables(cu_t, cu_t, None, None))
    shape = rec.state_shape(tuple(xs))
    gen = torch.Generator().manual_seed(2)
    S = torch.randn(2, *shape, generator=gen, dtype=torch.float64)
    _, fin = oracle(*xs, initial_state=S, cu_seqlens=cu)
    assert max_abs(rec.apply(summ, S), fin) <= 1e-10
    ident = rec.identity(shape, torch.float64, "cpu").expand_as(summ)
    assert max_abs(rec.apply(ident, S), S) == 0
    # Sequence 0 then sequence 1 as one map, against applying them in turn.
    both = rec.compose(summ[:1], summ[1:], shape)
    assert max_abs(rec.apply(both, S[:1]), rec.apply(summ[1:], rec.apply(summ[:1], S[:1]))) <= 1e-10


def test_diagonal_summary_is_smaller() -> None:
    # The all-gathered summary per slot: SSD carries HV*(K*V + 1) numbers, KDA HV*K*(V + K).
    xs_ssd = _inputs(4, 0)
    shape = (HV, K, V)
    ssd = recurrence("ssd").identity(shape, torch.float64, "cpu").numel()
    kda = recurrence("kda").identity(shape, torch.float64, "cpu").numel()
    assert ssd == HV * (K * V + 1) and kda == HV * K * (V + K)
    assert recurrence("ssd").state_shape(tuple(xs_ssd)) == shape


def test_unknown_recurrence_is_named() -> None:
    with pytest.raises(ValueError, match="unknown recurrence 'rwkv'"):
        recurrence("rwkv")
