"""SSD (Mamba2's recurrence): the torch kernel against the float64 token-by-token oracle
(outputs, final states, gradients; packed sequences with empty ones and chunk-crossing ones,
initial states, grouped heads), and the summary algebra of every registered recurrence
(summarize / apply / identity, over its cases in tests/recurrences.py) against its oracle."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import max_abs
from tests.recurrences import CASES, HV, K, RecurrenceCase, V, ssd_inputs
from torchtitan_cp.ops.cp.recurrence import (
    RECURRENCES,
    SequenceTables,
    SummaryRows,
    recurrence,
    run_local,
)
from torchtitan_cp.ops.ssd.local import chunk_ssd


@pytest.mark.parametrize("case", [c for c in CASES if c.name == "ssd"], ids=lambda c: c.id)
@pytest.mark.parametrize("cu", [[0, 20], [0, 3, 3, 70, 150, 151], [0, 64, 128, 129]])
def test_ssd_matches_oracle(case: RecurrenceCase, cu: list[int]) -> None:
    # Every SSD case: the data-dependent gate (Mamba2) and a fixed decay per head.
    T, N = cu[-1], len(cu) - 1
    xs = case.inputs(T, len(cu), torch.float64)
    gen = torch.Generator().manual_seed(7)
    h0 = torch.randn(N, HV, K, V, generator=gen, dtype=torch.float64)
    d_o = torch.randn(1, T, HV, V, generator=gen, dtype=torch.float64)
    d_f = torch.randn(N, HV, K, V, generator=gen, dtype=torch.float64)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    rec = recurrence(case.name, backend="torch", **case.options)

    def run(fn):
        leaves = [x.clone().requires_grad_(True) for x in (*xs, h0)]
        o, f = fn(leaves[:-1], leaves[-1])
        ((o * d_o).sum() + (f * d_f).sum()).backward()
        return [o, f, *(x.grad for x in leaves)]

    tables = SequenceTables(cu_t, cu_t, None, None)
    got = run(lambda xs, h0: run_local(rec, tuple(xs), tables, h0, True))
    want = run(lambda xs, h0: case.oracle(*xs, initial_state=h0, cu_seqlens=cu_t))
    names = ["o", "final", *(f"d{i}" for i in range(len(xs))), "dh0"]
    for name, a, b in zip(names, got, want, strict=True):
        assert max_abs(a, b) <= 1e-10, name


def test_ssd_rejects_bad_shapes() -> None:
    q, k, v, g = ssd_inputs(10, 0)
    with pytest.raises(ValueError, match=r"g must be \[1, 10, 2\]"):
        chunk_ssd(q, k, v, g[..., :1])
    with pytest.raises(ValueError, match="initial_state must be"):
        chunk_ssd(q, k, v, g, initial_state=torch.zeros(1, HV, K, K))


def test_every_recurrence_has_cases() -> None:
    # A registered recurrence without test supplies (tests/recurrences.py) is untested.
    assert {c.name for c in CASES} == set(RECURRENCES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_summary_algebra(case: RecurrenceCase) -> None:
    # summarize(range) applied to S equals running the range from S; identity is neutral. Two
    # sequences (lengths 9 and 70, one chunk-crossing).
    rec = recurrence(case.name, backend="torch", **case.options)
    cu = [0, 9, 79]
    xs = case.inputs(cu[-1], 1, torch.float64)
    cu_t = torch.tensor(cu)
    tables = SequenceTables(cu_t, cu_t, None, None)
    # Both sequences as summary rows, plus a padding row (-1) the driver never reads.
    sub = torch.tensor([0, 1, -1], dtype=torch.int32)
    rows = SummaryRows(
        sub,
        sub,
        torch.arange(cu[-1]),
        SequenceTables(*(torch.tensor(cu + [cu[-1]]),) * 2, None, None),
    )
    prepared = rec.prepare(tuple(xs), tables)
    summ = rec.summarize(prepared, rows)[:2]
    shape = rec.state_shape(tuple(xs))
    gen = torch.Generator().manual_seed(2)
    S = torch.randn(2, *shape, generator=gen, dtype=torch.float64)
    _, fin = case.oracle(*xs, initial_state=S, cu_seqlens=cu)
    assert max_abs(rec.apply(summ, S), fin) <= 1e-10
    _, fin_local = rec.local(prepared, S, True)  # the same prepared work serves the kernel
    assert max_abs(fin_local, fin) <= 1e-10
    ident = rec.identity(shape, torch.float64, "cpu").expand_as(summ)
    assert max_abs(rec.apply(ident, S), S) == 0


def test_diagonal_summary_is_smaller() -> None:
    # The all-gathered summary per slot: SSD carries HV*(K*V + 1) numbers, KDA HV*K*(V + K).
    xs_ssd = ssd_inputs(4, 0)
    shape = (HV, K, V)
    ssd = recurrence("ssd").identity(shape, torch.float64, "cpu").numel()
    kda = recurrence("kda").identity(shape, torch.float64, "cpu").numel()
    assert ssd == HV * (K * V + 1) and kda == HV * K * (V + K)
    assert recurrence("ssd").state_shape(tuple(xs_ssd)) == shape


def test_unknown_recurrence_is_named() -> None:
    with pytest.raises(ValueError, match="unknown recurrence 'rwkv'"):
        recurrence("rwkv")
