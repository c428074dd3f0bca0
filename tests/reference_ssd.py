"""Float64 token-by-token oracle for SSD (Mamba2's recurrence), in the style of reference.py."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from tests.reference import seq_bounds

__all__ = ["ssd_reference"]


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
    """``S_t = exp(g_t) S_{t-1} + k_t v_tᵀ``, ``o_t = S_tᵀ (scale q_t)``, one token at a time.

    q, k ``[1,T,H,K]``; v ``[1,T,HV,V]``; g ``[1,T,HV]``; initial_state ``[N,HV,K,V]``.
    Returns ``(o [1,T,HV,V] float64, final_states [N,HV,K,V] float64)``; differentiable.
    """
    T, H, K = q.shape[1:]
    HV, V = v.shape[2:]
    scale = K**-0.5 if scale is None else scale
    rep = HV // H
    q64 = q[0].double().repeat_interleave(rep, dim=1) * scale
    k64 = k[0].double().repeat_interleave(rep, dim=1)
    v64, g64 = v[0].double(), g[0].double()
    outs, finals = [], []
    for n, (bos, eos) in enumerate(seq_bounds(cu_seqlens, T)):
        S = q64.new_zeros(HV, K, V) if initial_state is None else initial_state[n].double()
        for t in range(bos, eos):
            S = g64[t].exp()[:, None, None] * S + k64[t][..., None] * v64[t][:, None, :]
            outs.append(torch.einsum("hk,hkv->hv", q64[t], S))
        finals.append(S)
    o = torch.stack(outs, 0) if outs else v64.new_zeros(0, HV, V)
    return o[None], torch.stack(finals, 0)
