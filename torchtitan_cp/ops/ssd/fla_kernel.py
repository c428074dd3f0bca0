"""SSD on fla-core 0.6.0's ``chunk_simple_gla`` (CUDA; CPU tensors only under Triton's
interpreter, in the fla_interpreter test tier): exactly this recurrence (head-wise
data-dependent gate, no delta correction). fla is imported inside the function."""

from __future__ import annotations

from ..common.fla import device_cu_seqlens

__all__ = ["chunk_ssd_fla"]


def chunk_ssd_fla(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens, cu_cpu):
    from fla.ops.simple_gla import chunk_simple_gla

    cu_dev, cu_cpu = device_cu_seqlens(cu_seqlens, cu_cpu, q.device)
    rep = v.shape[2] // q.shape[2]  # simple GLA has one q/k head per value head
    q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    h0 = initial_state.float() if initial_state is not None else None
    return chunk_simple_gla(
        q, k, v, g=g.float(), scale=scale, initial_state=h0,
        output_final_state=output_final_state, cu_seqlens=cu_dev, cu_seqlens_cpu=cu_cpu,
    )  # fmt: skip
