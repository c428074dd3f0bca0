"""SSD-specific kernel checks (the shared oracle and summary-algebra harness over every
registered recurrence is tests/test_recurrence_kernels.py): shape errors name the argument, and
the diagonal summary is about K times smaller than the delta rule's."""

from __future__ import annotations

import pytest
import torch

from tests.recurrences import HV, K, V, ssd_inputs
from torchtitan_cp.ops.cp.recurrence import recurrence
from torchtitan_cp.ops.ssd.local import chunk_ssd


def test_ssd_rejects_bad_shapes() -> None:
    q, k, v, g = ssd_inputs(10, 0)
    with pytest.raises(ValueError, match=r"g must be \[1, 10, 2\]"):
        chunk_ssd(q, k, v, g[..., :1])
    with pytest.raises(ValueError, match="initial_state must be"):
        chunk_ssd(q, k, v, g, initial_state=torch.zeros(1, HV, K, K))


def test_diagonal_summary_is_smaller() -> None:
    # The all-gathered summary per slot: SSD carries HV*(K*V + 1) numbers, KDA HV*K*(V + K).
    xs_ssd = ssd_inputs(4, 0)
    shape = (HV, K, V)
    ssd = recurrence("ssd").identity(shape, torch.float64, "cpu").numel()
    kda = recurrence("kda").identity(shape, torch.float64, "cpu").numel()
    assert ssd == HV * (K * V + 1) and kda == HV * K * (V + K)
    assert recurrence("ssd").state_shape(tuple(xs_ssd)) == shape
