"""Every registered recurrence, over every case of tests/recurrences.py: the torch kernel
through the registry (``prepare`` + ``local``) against the case's float64 token-by-token oracle
(outputs, final states, every gradient; packed sequences with empty and chunk-crossing ones,
initial states, grouped heads), and the summary algebra (summarize / apply / identity) against
the oracle. Family-specific checks: tests/test_kernels_delta_rule.py, tests/test_kernels_ssd.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import max_abs
from tests.recurrences import CASES, HV, K, RecurrenceCase, V
from torchtitan_cp.ops.cp.recurrence import (
    RECURRENCES,
    SequenceTables,
    SummaryRows,
    recurrence,
    run_local,
)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("cu", [[0, 20], [0, 3, 3, 70, 150, 151], [0, 64, 128, 129]])
def test_matches_oracle(case: RecurrenceCase, cu: list[int]) -> None:
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
    names = ["o", "final", *(f"d{n}" for n in case.names), "dh0"]
    for name, a, b in zip(names, got, want, strict=True):
        assert max_abs(a, b) <= 1e-10, name


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


def test_unknown_recurrence_is_named() -> None:
    with pytest.raises(ValueError, match="unknown recurrence 'rwkv'"):
        recurrence("rwkv")
