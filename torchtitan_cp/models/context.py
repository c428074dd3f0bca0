"""Per-microbatch sequence metadata handed to every mixing layer of the decoder."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.attention.flex_attention import BlockMask

from torchtitan_cp.ops import flex_document_mask, pass_kv_handle
from torchtitan_cp.ops.common.fla import FLA_CHUNK_SIZE
from torchtitan_cp.ops.cp.driver import context_parallel_recurrence, local_tables
from torchtitan_cp.ops.cp.recurrence import Recurrence
from torchtitan_cp.routing import (
    DevicePassKV,
    DeviceRouting,
    RoutingCaps,
    RoutingPlan,
    cu_seqlens_from_positions,
    row_document_index,
)

logger = logging.getLogger(__name__)


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
            o, _ = rec.local(inputs, local_tables(self.routing), None, False)
        return o


def build_sequence_context(
    plan: RoutingPlan,
    device: torch.device | str,
    group: dist.ProcessGroup | None,
    *,
    source: str = "host",
    conv_history: int = 3,
    block_mask: BlockMask | None = None,
    caps: RoutingCaps | None = None,
    pass_kv: bool = False,
) -> SequenceContext:
    """Materialise ``plan`` on ``device``: the routing plus per-token global and document ids.

    Every call creates new device tensors (copied non-blocking from host memory), so no two
    microbatches share routing storage. ``caps`` pads the routing to layout-independent shapes
    (what a compiled model needs to avoid recompiling per layout). ``pass_kv`` adds the plan's
    pass-KV attention schedule (cached with the plan) and its device ids, when CP is on.
    """
    # Chunk tables for fla's kernels come with the routing (no host sync inside fla).
    routing = plan.to_device(
        device, conv_history=conv_history, caps=caps, chunk_size=FLA_CHUNK_SIZE
    )
    subs = plan.subsequences
    lengths = subs[:, 2] - subs[:, 1]
    local_starts = plan.cu_seqlens[:-1]
    doc_ids = torch.repeat_interleave(subs[:, 0], lengths)
    token_ids = torch.repeat_interleave(subs[:, 1] - local_starts, lengths) + torch.arange(
        plan.num_tokens, dtype=torch.int64
    )
    ids = torch.stack([token_ids, doc_ids])
    if torch.device(device).type == "cuda":
        ids = ids.pin_memory()
    ids = ids.to(device, non_blocking=True)
    schedule = handle = None
    if pass_kv and plan.world_size > 1:
        schedule = plan.pass_kv.to_device(device, ids[0], ids[1])
        handle = pass_kv_handle(schedule)
    return SequenceContext(
        routing=routing, group=group, token_ids=ids[0], doc_ids=ids[1], source=source,
        block_mask=block_mask, pass_kv=schedule, pass_kv_handle=handle,
    )  # fmt: skip


_warned_no_host_metadata = False


def context_from_device_positions(
    tokens: torch.Tensor, positions: torch.Tensor | None, *, flex_mask: bool = False
) -> SequenceContext:
    """Single-rank context for a direct model call that brings no ``SequenceContext``.

    Documents come from ``positions`` (a document starts where ``positions == 0`` and at every
    row start); without positions each row is one document. Reading device positions back
    blocks the host, so this warns once per process. ``flex_mask`` adds the document
    ``BlockMask`` flex attention layers need.
    """
    global _warned_no_host_metadata
    bsz, seqlen = tokens.shape
    if positions is None:
        cu = list(range(0, bsz * seqlen + 1, seqlen))
    else:
        if not _warned_no_host_metadata:
            logger.warning(
                "HybridDecoder called without a SequenceContext: deriving document boundaries "
                "from device positions (a device->host copy per forward). Pass host metadata "
                "to avoid it."
            )
            _warned_no_host_metadata = True
        cu = cu_seqlens_from_positions(positions)
    plan = RoutingPlan.build(cu, [[(0, bsz * seqlen)]], 0)
    mask = None
    if flex_mask:
        rows = positions if positions is not None else torch.ones_like(tokens)
        mask = flex_document_mask(row_document_index(rows))
    return build_sequence_context(
        plan, tokens.device, None, source="device_readback", block_mask=mask
    )
