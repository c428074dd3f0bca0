"""SSD on fla-core 0.6.0's ``chunk_simple_gla`` (a gate per head) or ``chunk_gla`` (a gate per
head and key) (CUDA; CPU tensors only under Triton's interpreter, in the fla_interpreter test
tier): exactly this recurrence (data-dependent gate, no delta correction). fla is imported
inside the function.

The chunk tables come from the routing (``ops/common/fla.py``) and reach fla through the one
chunk-table shim, ``fla_compat.indexed``, which builds no index on the host and reads no chunk
count back from the device; without them, fla's public function builds its own (a host copy and
a device read per call over packed sequences).
"""

from __future__ import annotations

from torch import Tensor

from ..common.fla import fla_offsets

__all__ = ["chunk_ssd_fla"]


def chunk_ssd_fla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    scale: float | None,
    initial_state: Tensor | None,
    output_final_state: bool,
    cu_seqlens: Tensor | None,
    cu_cpu: Tensor | None,
    *,
    chunk_indices: Tensor | None = None,
    chunk_offsets: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Shapes as ``ops.ssd.local.chunk_ssd``; q/k heads are repeated to the value heads here
    (fla's GLA has one q/k head per value head). ``chunk_indices [NT, 2]`` int32 (or padded,
    see ``common.fla.chunk_table``) and ``chunk_offsets [N + 1]`` int64 on q's device: the chunk
    tables of ``cu_seqlens`` with ``FLA_CHUNK_SIZE``. States are float32 ``[N, HV, K, V]``."""
    cu_dev, cu_cpu, chunk_indices, h0 = fla_offsets(
        q, cu_seqlens, cu_cpu, chunk_indices, chunk_offsets, initial_state
    )
    rep = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    from ..fla_compat import indexed

    if g.dim() == 4:
        from fla.ops.gla import chunk_gla as op
    else:
        from fla.ops.simple_gla import chunk_simple_gla as op
    return indexed(
        op,
        q,
        k,
        v,
        g.float(),
        tables=(cu_dev, cu_cpu, chunk_indices, chunk_offsets),
        scale=scale,
        initial_state=h0,
        output_final_state=output_final_state,
    )
