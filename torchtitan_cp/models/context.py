"""Per-microbatch sequence metadata handed to every mixing layer of the decoder.

``SequenceContext`` is what the layers read; ``models.sequence`` builds it (the one builder, from
the microbatch's layout), and the attention CP modes it is built for are named here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.nn.attention.flex_attention import BlockMask

from torchtitan_cp.ops.cp.driver import context_parallel_recurrence, local_tables
from torchtitan_cp.ops.cp.recurrence import Recurrence, run_local
from torchtitan_cp.routing import DevicePassKV, DeviceRouting

__all__ = [
    "ATTENTION_CP_MODES",
    "DEFAULT_ATTENTION_CP",
    "AttentionCP",
    "SequenceContext",
    "check_attention_cp",
]

AttentionCP = Literal["all_gather", "pass_kv"]
"""How softmax attention's keys/values cross CP ranks (``[model] attention_cp``): gathered
whole, or passed point to point over the pass-KV schedule the context then carries
(``models/blocks/attention_cp.py``)."""
ATTENTION_CP_MODES = ("all_gather", "pass_kv")
DEFAULT_ATTENTION_CP: AttentionCP = "all_gather"


def check_attention_cp(mode: str) -> None:
    """A ValueError naming ``model.attention_cp`` for an unknown mode."""
    if mode not in ATTENTION_CP_MODES:
        raise ValueError(f"model.attention_cp must be one of {ATTENTION_CP_MODES}, got {mode!r}")


@dataclass(frozen=True, eq=False)
class SequenceContext:
    """What a KDA/GDN/attention layer needs to know about the microbatch it is processing.

    One instance serves every layer of one microbatch; it is never mutated, so a backward
    that still runs on an older batch keeps reading that batch's tensors.

    Attributes:
        routing: this rank's device routing (a single-rank routing when CP is off).
        group: the context-parallel process group, or None without CP.
        token_ids: ``[T_local]`` int64, global stream index of every local token (span order).
        doc_ids: ``[T_local]`` int64, *global* document index (into the microbatch's
            ``cu_seqlens``) of every local token; not ``routing.row_document_index``.
        source: "host" or "device_readback": how the routing was built (for logging).
        block_mask: the document ``BlockMask`` for flex attention layers (this rank's queries
            against the gathered keys under CP); None when the model runs its attention on SDPA
            or passes K/V.
        pass_kv: the pass-KV attention schedule of this rank with its device ids (under CP
            with ``model.attention_cp = "pass_kv"``), else None.
        pass_kv_handle: ``ops.pass_kv_handle(pass_kv)``, the one-element tensor that names the
            schedule to the pass-KV custom op (compiled blocks see only tensors), or None.
    """

    routing: DeviceRouting
    group: dist.ProcessGroup | None
    token_ids: torch.Tensor
    doc_ids: torch.Tensor
    source: str = "host"
    block_mask: BlockMask | None = None
    pass_kv: DevicePassKV | None = None
    pass_kv_handle: torch.Tensor | None = None

    @property
    def cp_enabled(self) -> bool:
        return self.group is not None and dist.get_world_size(self.group) > 1

    def run_recurrence(self, rec: Recurrence, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``rec`` over this rank's span (``inputs`` token-major ``[1, T_local, ...]``): through
        the CP driver under context parallelism, else its local kernel over the span's
        documents. Returns the output as ``rec.local`` does."""
        if self.cp_enabled:
            o, _ = context_parallel_recurrence(rec, inputs, routing=self.routing, group=self.group)
        else:
            o, _ = run_local(rec, inputs, local_tables(self.routing))
        return o
