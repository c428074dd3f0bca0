"""Varlen causal depthwise conv (torch backend) vs the float64 per-sequence oracle.

Tolerances (max abs error / max(1, max |reference|)): float64 1e-12, float32 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from tests.reference import conv_reference, rel_err
from torchtitan_cp.ops.conv.local import causal_conv1d

LAYOUTS = {
    "single": [0, 40],
    "short_with_empty": [0, 1, 2, 2, 5, 17, 18, 40],  # lengths 1, 1, 0, 3 (< W-1), ...
}
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("width", [4, 2])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_hist", "init_state"])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_conv_matches_oracle(layout, activation, with_state, width, dtype):
    gen = torch.Generator().manual_seed(width * 7 + with_state)
    cu = LAYOUTS[layout]
    T, N, D = cu[-1], len(cu) - 1, 6

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x, w, b = rnd(1, T, D), rnd(D, width), rnd(D)
    h0 = rnd(N, D, width - 1) if with_state else None
    inputs = [t for t in (x, w, b, h0) if t is not None]
    ref_leaves = [t.clone().requires_grad_() for t in inputs]
    leaves = [t.to(dtype).requires_grad_() for t in inputs]

    def call(fn, ts, cu_seqlens, **kw):
        h = ts[3] if with_state else None
        return fn(*ts[:3], cu_seqlens=cu_seqlens, initial_state=h, activation=activation, **kw)

    y_ref = call(conv_reference, ref_leaves, cu)
    y = call(causal_conv1d, leaves, torch.tensor(cu, dtype=torch.int32), backend="torch")
    assert y.dtype == dtype and y.shape == (1, T, D)
    assert rel_err(y, y_ref) < TOL[dtype]
    dy = rnd(1, T, D)
    g_ref = torch.autograd.grad((y_ref * dy).sum(), ref_leaves)
    g = torch.autograd.grad((y * dy.to(dtype)).sum(), leaves)
    for name, a, r in zip(("x", "weight", "bias", "initial_state"), g, g_ref):
        assert rel_err(a, r) < TOL[dtype], f"d{name}"


def test_conv_defaults_no_bias_single_sequence():
    torch.manual_seed(0)
    x, w = torch.randn(1, 20, 3, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    y = causal_conv1d(x, w)
    assert rel_err(y, conv_reference(x, w, None, cu_seqlens=None)) < 1e-12


def test_conv_history_equals_prefix():
    """A sequence split in two, the second half seeded with the first half's last W-1 tokens,
    reproduces the unsplit conv (what context parallelism relies on)."""
    torch.manual_seed(0)
    T, D, W, cut = 30, 4, 4, 13
    x, w, b = torch.randn(1, T, D), torch.randn(D, W), torch.randn(D)
    whole = causal_conv1d(x, w, b)
    hist = x[0, cut - (W - 1) : cut].t()[None]  # [1, D, W-1], oldest first
    second = causal_conv1d(x[:, cut:], w, b, initial_state=hist)
    torch.testing.assert_close(second, whole[:, cut:])


def test_conv_bf16_accumulates_in_float32():
    """bf16 in, bf16 out; the taps are summed in float32 so only the final rounding shows."""
    torch.manual_seed(0)
    x, w, b = torch.randn(1, 30, 8), torch.randn(8, 4), torch.randn(8)
    h0 = torch.randn(2, 8, 3)
    cu = torch.tensor([0, 11, 30])
    args = [t.bfloat16() for t in (x, w, b, h0)]
    y = causal_conv1d(*args[:3], cu_seqlens=cu, initial_state=args[3])
    y_ref = conv_reference(*args[:3], cu_seqlens=cu, initial_state=args[3])
    assert y.dtype == torch.bfloat16
    assert rel_err(y, y_ref) < 1e-2  # one bf16 rounding of the result (2^-8 relative)
