"""Float64 token-by-token oracles for the local kernels (shared by kernel and CP tests).

Deliberately naive: one Python step per token, per sequence, in float64, so the math is easy to
audit and autograd gives exact reference gradients. Only meant for small sizes (T of a few
hundred, a couple of heads, K, V ≤ 32).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "conv_reference",
    "delta_product_reference",
    "delta_rule_reference",
    "rel_err",
    "seq_bounds",
    "ssd_reference",
    "token_scan",
]


def rel_err(actual: Tensor, ref: Tensor) -> float:
    """max |actual - ref| / max(max |ref|, 1), in float64 on ``actual``'s device."""
    ref = ref.to(actual.device)
    return ((actual.double() - ref).abs().max() / ref.abs().max().clamp(min=1.0)).item()


def seq_bounds(cu_seqlens: Tensor | Sequence[int] | None, total: int) -> list[tuple[int, int]]:
    """[(bos, eos), ...] for every sequence; a single sequence [0, total) when cu_seqlens is None."""
    if cu_seqlens is None:
        return [(0, total)]
    cu = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]
    return list(zip(cu[:-1], cu[1:]))


def delta_rule_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    kind: str,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    cu_seqlens: Tensor | Sequence[int] | None = None,
) -> tuple[Tensor, Tensor]:
    """Gated delta rule, one token at a time, in float64.

    Shapes (FLA conventions): q, k ``[1,T,H,K]``; v ``[1,T,HV,V]``; g natural-log decay
    ``[1,T,HV,K]`` (kind="kda") or ``[1,T,HV]`` (kind="gdn"); beta ``[1,T,HV]``;
    initial_state ``[N,HV,K,V]`` (N = number of sequences). HV must be a multiple of H (q/k head
    ``h`` serves value heads ``h*G .. h*G+G-1``).

    Per sequence and value head: ``S_t = (I - b_t k_t k_tᵀ) Diag(exp g_t) S_{t-1} + b_t k_t v_tᵀ``,
    ``o_t = S_tᵀ (scale q_t)``.

    Returns ``(o [1,T,HV,V] float64, final_states [N,HV,K,V] float64)``; differentiable.
    """
    if kind not in ("kda", "gdn"):
        raise ValueError(f"kind must be 'kda' or 'gdn', got {kind!r}")
    T, HV, K = q.shape[1], v.shape[2], k.shape[3]
    g64 = g[0].double()
    if kind == "gdn":
        g64 = g64[..., None].expand(T, HV, K)
    b64 = beta[0].double()

    def step(S: Tensor, t: int, kt: Tensor, vt: Tensor) -> Tensor:  # kt [HV,K], vt [HV,V]
        S = g64[t].exp()[..., None] * S  # decay first
        return _delta_update(S, kt, vt, b64[t])

    return token_scan(q, k, v, step, scale, initial_state, cu_seqlens)


def _delta_update(S: Tensor, kt: Tensor, vt: Tensor, bt: Tensor) -> Tensor:
    """``S + b k (v - kᵀ S)`` per value head: ``S [HV,K,V]``, ``kt [HV,K]``, ``vt [HV,V]``, ``bt [HV]``."""
    pred = torch.einsum("hk,hkv->hv", kt, S)  # current read-out of key k_t
    return S + bt[:, None, None] * kt[..., None] * (vt - pred)[:, None, :]


def delta_product_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    kind: str = "gdn",
    scale: float | None = None,
    initial_state: Tensor | None = None,
    cu_seqlens: Tensor | Sequence[int] | None = None,
) -> tuple[Tensor, Tensor]:
    """The gated delta product, one token (and within it one step) at a time, in float64.

    q ``[1,T,H,K]``; k ``[1,T,n,H,K]``, v ``[1,T,n,HV,V]``, beta ``[1,T,n,HV]``: ``n`` steps per
    token; g ``[1,T,HV]`` (gdn) or ``[1,T,HV,K]`` (kda). Per token: ``S = Diag(exp g_t) S``, then
    for each step ``j`` in order ``S = (I - b_tj k_tj k_tjᵀ) S + b_tj k_tj v_tjᵀ``; ``o_t = S_tᵀ
    (scale q_t)``. Returns ``(o [1,T,HV,V], final_states [N,HV,K,V])`` in float64."""
    T, n, H, K = k.shape[1:]
    HV = v.shape[3]
    g64 = g[0].double()
    if kind == "gdn":
        g64 = g64[..., None].expand(T, HV, K)
    k64 = k[0].double().repeat_interleave(HV // H, dim=2)  # [T, n, HV, K]
    v64, b64 = v[0].double(), beta[0].double()

    def step(S: Tensor, t: int, _k: Tensor, _v: Tensor) -> Tensor:
        S = g64[t].exp()[..., None] * S
        for j in range(n):
            S = _delta_update(S, k64[t, j], v64[t, j], b64[t, j])
        return S

    return token_scan(q, q, v[:, :, 0], step, scale, initial_state, cu_seqlens)


def ssd_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    cu_seqlens: Tensor | Sequence[int] | None = None,
) -> tuple[Tensor, Tensor]:
    """SSD (Mamba2's recurrence), one token at a time, in float64:
    ``S_t = exp(g_t) S_{t-1} + k_t v_tᵀ``, ``o_t = S_tᵀ (scale q_t)``.

    q, k ``[1,T,H,K]``; v ``[1,T,HV,V]``; g ``[1,T,HV]`` (a decay per head) or ``[1,T,HV,K]``
    (per head and key: FLA's GLA); initial_state ``[N,HV,K,V]``. Returns ``(o [1,T,HV,V] float64, final_states [N,HV,K,V] float64)``; differentiable.
    """
    g64 = g[0].double()

    def step(S: Tensor, t: int, kt: Tensor, vt: Tensor) -> Tensor:
        decay = g64[t].exp().reshape(S.shape[0], -1, 1)  # [HV, 1 or K, 1]
        return decay * S + kt[..., None] * vt[:, None, :]

    return token_scan(q, k, v, step, scale, initial_state, cu_seqlens)


def token_scan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    step: Callable[[Tensor, int, Tensor, Tensor], Tensor],
    scale: float | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | Sequence[int] | None,
) -> tuple[Tensor, Tensor]:
    """The token loop every state oracle shares (a new recurrence's oracle is its ``step``).

    Per sequence, the state ``S [HV,K,V]`` starts at ``initial_state[n]`` (zeros when None),
    becomes ``step(S, t, k_t, v_t)`` at every token (``k_t [HV,K]``, ``v_t [HV,V]``; ``t`` indexes
    the caller's own per-token tensors) and is read out as ``o_t = S_tᵀ (scale q_t)``. q, k
    ``[1,T,H,K]`` are repeated to the HV value heads of v ``[1,T,HV,V]`` (q/k head ``h`` serves
    value heads ``h*G .. h*G+G-1``); everything is float64. Returns ``(o [1,T,HV,V],
    final_states [N,HV,K,V])``, differentiable."""
    T, H, K = q.shape[1:]
    HV, V = v.shape[2:]
    scale = K**-0.5 if scale is None else scale
    rep = HV // H
    q64 = q[0].double().repeat_interleave(rep, dim=1) * scale
    k64 = k[0].double().repeat_interleave(rep, dim=1)
    v64 = v[0].double()
    outs, finals = [], []
    for n, (bos, eos) in enumerate(seq_bounds(cu_seqlens, T)):
        S = q64.new_zeros(HV, K, V) if initial_state is None else initial_state[n].double()
        for t in range(bos, eos):
            S = step(S, t, k64[t], v64[t])
            outs.append(torch.einsum("hk,hkv->hv", q64[t], S))
        finals.append(S)
    o = torch.stack(outs, 0) if outs else v64.new_zeros(0, HV, V)
    return o[None], torch.stack(finals, 0)


def conv_reference(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    cu_seqlens: Tensor | Sequence[int] | None,
    initial_state: Tensor | None = None,
    activation: str | None = "silu",
) -> Tensor:
    """Causal depthwise conv per sequence, in float64.

    x ``[1,T,D]``; weight ``[D,W]`` (column W-1 multiplies the current token); bias ``[D]``;
    initial_state ``[N,D,W-1]`` = the W-1 tokens before each sequence, oldest first (zeros when
    None). Returns ``[1,T,D]`` float64, differentiable.
    """
    T, D = x.shape[1:]
    W = weight.shape[1]
    w64 = weight.double()
    outs = []
    for n, (bos, eos) in enumerate(seq_bounds(cu_seqlens, T)):
        if initial_state is None:
            hist = x.new_zeros(W - 1, D, dtype=torch.float64)
        else:
            hist = initial_state[n].double().t()  # [W-1, D]
        xe = torch.cat([hist, x[0, bos:eos].double()], 0)  # [W-1+L, D]
        L = eos - bos
        y = sum(w64[:, i] * xe[i : i + L] for i in range(W))
        if bias is not None:
            y = y + bias.double()
        outs.append(y)
    y = torch.cat(outs, 0) if outs else x.new_zeros(0, D, dtype=torch.float64)
    if activation in ("silu", "swish"):
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    return y[None]
