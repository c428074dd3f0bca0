"""Chunked SSD (Mamba2's state-space duality form; scalar-gated linear attention) in PyTorch.

Per sequence and value head: ``S_t = exp(g_t) S_{t-1} + k_t v_tᵀ``, ``o_t = S_tᵀ (scale q_t)``.
Inside a chunk, with ``G_t`` the cumulative log gate since the chunk start and ``S0`` the entry
state: ``o_t = exp(G_t) (scale q_t)ᵀ S0 + sum_{s<=t} (scale q_t · k_s) exp(G_t - G_s) v_s`` and
``S_end = exp(G_C) S0 + sum_s exp(G_C - G_s) k_s v_sᵀ``. Chunks are packed as in
``common.varlen.chunk_layout``; every exponent is masked to -inf before ``exp`` where not causal.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..common.dtypes import compute_dtype
from ..common.scores import head_decay_scores
from ..common.varlen import chunk_layout, entry_states

__all__ = ["chunk_ssd_torch"]


def chunk_ssd_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    chunk_size: int = 64,
    states_only: bool = False,
) -> tuple[Tensor | None, Tensor | None]:
    """Chunked SSD forward (autograd gives the backward).

    Args:
        q, k: ``[1, T, H, K]`` (Mamba2's C and B; H groups); v: ``[1, T, HV, V]``, HV a
            multiple of H. g: natural-log decay ≤ 0, ``[1, T, HV]``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (zeros when None).
        cu_seqlens / cu_seqlens_cpu: ``[N+1]`` sequence offsets (host copy preferred).
        states_only: return ``(None, final)`` without computing any output.

    Returns:
        ``(o [1, T, HV, V] in v's dtype or None, final [N, HV, K, V] in the compute dtype or
        None)``.
    """
    T, H, K = q.shape[1:]
    HV, V = v.shape[2:]
    scale = K**-0.5 if scale is None else scale
    cd = compute_dtype(q.dtype)
    C = chunk_size
    cu, state0 = entry_states(q, v, cu_seqlens, cu_seqlens_cpu, initial_state)
    want_final = output_final_state or states_only
    if T == 0:
        o = None if states_only else v.new_zeros(1, 0, HV, V)
        return o, (state0.clone() if want_final else None)

    lay = chunk_layout(cu, C)
    rep = HV // H
    kc = lay.pack(k, cd).repeat_interleave(rep, dim=1)  # [NC, HV, C, K]
    vc = lay.pack(v, cd)  # [NC, HV, C, V]
    G = lay.pack(g, cd).cumsum(2)  # [NC, HV, C] cumulative log gate inside the chunk, <= 0
    Gl = G[:, :, -1]  # [NC, HV]
    decay_end = torch.exp(Gl.unsqueeze(-1) - G).unsqueeze(-1)  # exp(G_C - G_t) <= 1
    E = (kc * decay_end).transpose(-1, -2) @ vc  # [NC, HV, K, V]
    dec = torch.exp(Gl)[..., None, None]  # [NC, HV, 1, 1]
    # Inter-chunk recurrence S <- exp(G_C) S + E, and every chunk's entry state S0.
    final, S0 = lay.scan(dec, E, state0, torch.mul, entries=not states_only)
    if states_only:
        return None, final
    assert S0 is not None
    qc = lay.pack(q, cd).repeat_interleave(rep, dim=1) * scale
    scores = head_decay_scores(qc.unsqueeze(0), kc, G)[0]  # [NC, HV, C, C]
    oc = (qc * torch.exp(G).unsqueeze(-1)) @ S0 + scores @ vc  # [NC, HV, C, V]
    return lay.unpack(oc).to(v.dtype), (final if want_final else None)
