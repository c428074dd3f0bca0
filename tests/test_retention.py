"""The retention layer (``R``, models/mixers/retention.py) against a float64 token-by-token
implementation of RetNet's multi-scale retention over packed documents (the Mamba2 layer's
harness, tests/test_layers.py). Its CP tests are its entry in tests/test_layer_kinds_cp.py; its
recurrence is SSD with a fixed decay (tests/recurrences.py, tests/test_cp_recurrences.py)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tests.reference import ssd_reference
from tests.test_layers import _check_on_documents
from torchtitan_cp.models.mixers.retention import RetentionMixer


def _rope_reference(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding token by token: channel pairs (i, i + D/2) turned by pos·theta^(-2i/D)."""
    half = x.shape[-1] // 2
    out = torch.empty_like(x)
    for t in range(x.shape[1]):
        for i in range(half):
            a = float(pos[t]) * theta ** (-i / half)
            c, s = math.cos(a), math.sin(a)
            x1, x2 = x[:, t, :, i], x[:, t, :, i + half]
            out[:, t, :, i], out[:, t, :, i + half] = x1 * c - x2 * s, x2 * c + x1 * s
    return out


def _retention_reference(m: RetentionMixer, x, cu: list[int], pos) -> torch.Tensor:
    """RetNet's multi-scale retention in float64, token by token per document (x ``[1, T, D]``):
    RoPE'd q, k, ``S_t = gamma_h S_{t-1} + k_t v_tᵀ`` with ``gamma_h = 1 - 2^(-5-h)``,
    ``o_t = S_tᵀ q_t / sqrt(K)``, per-head RMSNorm times swish(g_proj x), output projection."""
    h, k, v = m.n_heads, m.head_dim, m.value_head_dim
    q = _rope_reference((x @ m.q_proj.weight.T).unflatten(-1, (h, k)), pos, m.rope_theta)
    kk = _rope_reference((x @ m.k_proj.weight.T).unflatten(-1, (h, k)), pos, m.rope_theta)
    vv = (x @ m.v_proj.weight.T).unflatten(-1, (h, v))
    gamma = torch.tensor([1 - 2.0 ** (-5 - i) for i in range(h)], dtype=torch.float64)
    g = gamma.log().expand(1, x.shape[1], h)
    o, _ = ssd_reference(q, kk, vv, g, cu_seqlens=cu)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + m.o_norm.eps) * m.o_norm.weight
    o = o * F.silu(x @ m.g_proj.weight.T).unflatten(-1, (h, v))
    return o.flatten(-2) @ m.o_proj.weight.T


def test_retention_mixer_matches_reference() -> None:
    torch.manual_seed(0)
    mixer = RetentionMixer.Config(
        dim=16, n_heads=3, head_dim=8, value_head_dim=4, rope_theta=500.0, backend="torch"
    ).build()
    with torch.no_grad():
        for lin in (mixer.q_proj, mixer.k_proj, mixer.v_proj, mixer.g_proj, mixer.o_proj):
            lin.weight.normal_(0, 0.3)
        mixer.o_norm.weight.uniform_(0.5, 1.5)
    _check_on_documents(mixer, 16, _retention_reference)


def test_retention_runs_ssd_kernels() -> None:
    # R's backends and torch.compile support are SSD's (M's): one flag flips both.
    from torchtitan_cp.models.hybrid.layers import LAYERS

    assert LAYERS["R"].kernels is LAYERS["M"].kernels
