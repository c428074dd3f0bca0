"""Chunked SSD (Mamba2's state-space duality form; gated linear attention) in PyTorch.

Per sequence and value head: ``S_t = exp(g_t) S_{t-1} + k_t v_tᵀ``, ``o_t = S_tᵀ (scale q_t)``,
the gate one log decay per head (``g_t`` a scalar: Mamba2, simple GLA) or per key channel
(``exp(g_t)`` a diagonal ``[K]`` scaling the rows of S: FLA's GLA).
Inside a chunk, with ``G_t`` the cumulative log gate since the chunk start and ``S0`` the entry
state: ``o_t = exp(G_t) (scale q_t)ᵀ S0 + sum_{s<=t} (scale q_t · k_s) exp(G_t - G_s) v_s`` and
``S_end = exp(G_C) S0 + sum_s exp(G_C - G_s) k_s v_sᵀ``. Chunks are packed as in
``common.varlen.chunk_layout``; every exponent is masked to -inf before ``exp`` where not causal (per-key scores:
``common.scores.key_decay_scores``, sub-blocks of ``sub_chunk_size`` tokens).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..common.dtypes import compute_dtype
from ..common.scores import decay_scores
from ..common.varlen import chunk_layout, device_offsets, entry_states, host_cu_seqlens

__all__ = ["chunk_ssd_torch"]


def chunk_ssd_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | Callable[[], Tensor | None] | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    chunk_size: int = 64,
    sub_chunk_size: int = 16,
    states_only: bool = False,
) -> tuple[Tensor | None, Tensor | None]:
    """Chunked SSD forward (autograd gives the backward).

    Args:
        q, k: ``[1, T, H, K]`` (Mamba2's C and B; H groups); v: ``[1, T, HV, V]``, HV a
            multiple of H. g: natural-log decay ≤ 0, ``[1, T, HV]`` or ``[1, T, HV, K]``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (zeros when None), or a thunk returning it, called
            after the state-independent terms (the scores, the intra-chunk outputs) are issued:
            the CP driver's all-gather is in flight meanwhile.
        cu_seqlens / cu_seqlens_cpu: ``[N+1]`` sequence offsets: the host copy gives the sizes,
            the device copy the chunk tables (``common.varlen.chunk_layout``).
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
    cu = host_cu_seqlens(T, cu_seqlens, cu_seqlens_cpu)
    want_final = output_final_state or states_only

    def state0() -> Tensor:
        h0 = initial_state() if callable(initial_state) else initial_state
        return entry_states(q, v, len(cu) - 1, h0)

    if T == 0:
        o = None if states_only else v.new_zeros(1, 0, HV, V)
        return o, (state0().clone() if want_final else None)

    lay = chunk_layout(cu, C, device_offsets(cu, cu_seqlens, q.device))
    rep = HV // H
    kc = lay.pack(k, cd).repeat_interleave(rep, dim=1)  # [NC, HV, C, K]
    vc = lay.pack(v, cd)  # [NC, HV, C, V]
    G = lay.pack(g, cd).cumsum(2)  # [NC, HV, C(, K)] cumulative log gate in the chunk, <= 0
    Gk = G if G.dim() == 4 else G.unsqueeze(-1)  # [NC, HV, C, K or 1]
    Gl = Gk[:, :, -1:]  # [NC, HV, 1, K or 1]
    E = (kc * torch.exp(Gl - Gk)).transpose(-1, -2) @ vc  # [NC, HV, K, V]; exp(G_C - G_t) <= 1
    dec = torch.exp(Gl).transpose(-1, -2)  # [NC, HV, K or 1, 1]
    if states_only:
        return None, lay.scan(dec, E, state0(), torch.mul, entries=False)[0]
    # State-independent: the query side of the state term and the intra-chunk outputs (what
    # overlaps the CP driver's all-gather, Megatron's "CB" part of Mamba2's state passing).
    qc = lay.pack(q, cd).repeat_interleave(rep, dim=1) * scale
    sub = sub_chunk_size if C % sub_chunk_size == 0 else C
    scores = decay_scores(qc.unsqueeze(0), kc, G, sub)[0]  # [NC, HV, C, C]
    qg = qc * torch.exp(Gk)  # [NC, HV, C, K]
    oi = scores @ vc  # [NC, HV, C, V]
    # Inter-chunk recurrence S <- exp(G_C) S + E, and every chunk's entry state S0.
    final, S0 = lay.scan(dec, E, state0(), torch.mul, entries=True)
    assert S0 is not None
    oc = qg @ S0 + oi  # [NC, HV, C, V]
    return lay.unpack(oc).to(v.dtype), (final if want_final else None)
