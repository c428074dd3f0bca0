"""Per-microbatch preprocessing: document boundaries, CP layout, sharding and the context.

The one room that builds a microbatch's ``SequenceContext``. One ``SequencePreprocessor``
serves the trainer and the validator (``preprocess``: one call per microbatch); for every
microbatch it finds the global document boundaries and every rank's fragments (the *layout*),
shards ``input``, ``labels`` and ``positions`` for this CP rank, and builds from the layout
everything the KDA/GDN/attention layers of that microbatch share: the device routing tensors,
the per-token global and document ids, the flex document mask and the pass-KV schedule with
its handle. A direct model call without a context (``context_from_device_positions``) is the
same preprocessor at world 1 on the readback source.

Two sources, chosen by ``[linear_attention] routing_source``:

* ``host``: boundaries from the data loader's CPU positions (``HostMetadata``), fragments from
  torch's own load balancers run on the CPU, PTRR from a block mask built on the CPU. Nothing is
  read back from the device.
* ``device_readback``: boundaries from the device positions and layouts from the device
  load-balancer indices, each copied back to the host (one copy per microbatch for PTRR's
  permutation, for all ranks at once). Every such copy is counted in ``readbacks``.

Callers that bring no host metadata fall back to ``device_readback`` with one warning.

With ``flex_attention=True`` (the model's attention runs flex, i.e. on CUDA) the context also
carries this rank's document ``BlockMask``, sharded by the layout's own rearrange index and built
from the same source's positions. With ``attention_cp="pass_kv"`` under CP it carries the plan's
pass-KV schedule instead (``SequenceContext.pass_kv``; the layers build per-pair masks).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.flex_attention import BlockMask

from torchtitan_cp.models.context import SequenceContext, check_attention_cp
from torchtitan_cp.ops import flex_document_mask, pass_kv_handle
from torchtitan_cp.ops.common.fla import FLA_CHUNK_SIZE
from torchtitan_cp.routing import (
    Layout,
    LoadBalancer,
    PlanCache,
    RoutingCaps,
    RoutingCapsExceeded,
    get_balancer,
    host_layout,
    readback_layout,
    row_document_index,
)
from torchtitan_cp.routing.host_metadata import HostMetadata, pop_host_metadata

logger = logging.getLogger(__name__)

SOURCES = ("host", "device_readback")


@dataclass
class RoutingStats:
    """Counters since the last ``take()``: what the routing did between two log steps."""

    readbacks: int = 0
    build_ms: float = 0.0
    microbatches: int = 0
    sources: set[str] = field(default_factory=set)

    def take(self) -> dict[str, Any]:
        out = {
            "readbacks": self.readbacks,
            "build_ms": self.build_ms,
            "microbatches": self.microbatches,
            "source": "+".join(sorted(self.sources)) or "none",
        }
        self.readbacks, self.build_ms, self.microbatches = 0, 0.0, 0
        self.sources = set()
        return out


def shard_rows(x: torch.Tensor, index: torch.Tensor | None, rank: int, world: int) -> torch.Tensor:
    """This rank's piece of ``x [B, L, ...]`` after rearranging each row by ``index``."""
    seqlen = x.shape[1]
    chunk = seqlen // world
    if index is None:
        return x[:, rank * chunk : (rank + 1) * chunk]
    idx = index[:, rank * chunk : (rank + 1) * chunk]
    if idx.shape[0] == 1:
        return x.index_select(1, idx[0])
    idx = idx.expand(x.shape[0], -1)  # one order per row: gather along L
    idx = idx.reshape(*idx.shape, *[1] * (x.dim() - 2)).expand(-1, -1, *x.shape[2:])
    return torch.gather(x, 1, idx)


class SequencePreprocessor:
    """Builds the per-microbatch CP layout and ``SequenceContext`` (see module docstring)."""

    def __init__(
        self,
        *,
        device: torch.device | str,
        cp_group: dist.ProcessGroup | None,
        load_balancer: str | LoadBalancer | None,
        cp_rank: int | None = None,
        cp_world_size: int | None = None,
        routing_source: str = "host",
        plan_cache_size: int = 16,
        conv_history: int = 3,
        ptrr_block_size: int = 128,
        flex_attention: bool = False,
        attention_cp: str = "all_gather",
        caps: RoutingCaps | None = None,
        cap_keys: dict[str, str] | None = None,
    ) -> None:
        if routing_source not in SOURCES:
            raise ValueError(
                f"linear_attention.routing_source must be one of {SOURCES}, got {routing_source!r}"
            )
        self.balancer = get_balancer(load_balancer, ptrr_block_size=ptrr_block_size)
        self.device = torch.device(device)
        self.group = cp_group
        # Explicit rank/world let tools and tests lay out any rank without a process group.
        self.world = cp_world_size or (dist.get_world_size(cp_group) if cp_group is not None else 1)
        self.rank = cp_rank if cp_rank is not None else (dist.get_rank(cp_group) if cp_group else 0)
        self.routing_source = routing_source
        self.cache = PlanCache(plan_cache_size)
        self.conv_history = conv_history
        self.stats = RoutingStats()
        self._warned_fallback = False
        # Fixed routing shapes (torch.compile: no recompile per layout); ``cap_keys`` names the
        # config key behind each cap in the error a too-large microbatch raises.
        self.caps = caps
        self.cap_keys = dict(cap_keys or {})
        # Under CP with pass-KV attention every context carries the plan's pass-KV schedule,
        # and the attention layers build their own per-pair masks.
        check_attention_cp(attention_cp)
        self.pass_kv = attention_cp == "pass_kv" and self.world > 1
        # Flex attention layers take a document BlockMask per microbatch (without CP, or under
        # the all-gather CP path); under CP torch's mask sharding asks a DeviceMesh for this
        # rank, so wrap the group once.
        self.flex_attention = flex_attention and not self.pass_kv
        self._mesh: DeviceMesh | None = None
        if self.flex_attention and self.world > 1:
            if cp_group is None:
                raise ValueError("flex attention under context parallelism needs cp_group")
            self._mesh = DeviceMesh.from_group(cp_group, self.device.type)

    # Copies of the device batch back to the host, counted where they happen (also on a
    # CPU-only run, where the "device" batch lives in host memory but is still a second copy).
    def _count_readback(self, t: torch.Tensor) -> None:
        self.stats.readbacks += 1

    def _source_for(self, host: HostMetadata | None) -> str:
        if self.routing_source == "host" and host is None:
            if not self._warned_fallback:
                logger.warning(
                    "linear_attention.routing_source = 'host' but this batch has no host "
                    "metadata (custom data loader?): falling back to the device readback path."
                )
                self._warned_fallback = True
            return "device_readback"
        return self.routing_source

    def __call__(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        positions: torch.Tensor | None,
        host: HostMetadata | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, SequenceContext]:
        """Shard ``inputs``/``labels``/``positions`` ``[B, L]`` for this CP rank and build the
        microbatch's ``SequenceContext``. Returns local ``[B, L / W]`` tensors."""
        ctx, layout = self.context(inputs.shape, positions, host)
        if self.world > 1:
            inputs = shard_rows(inputs, layout.index, self.rank, self.world)
            labels = shard_rows(labels, layout.index, self.rank, self.world)
            if positions is not None:
                positions = shard_rows(positions, layout.index, self.rank, self.world)
        return inputs, labels, positions, ctx

    def preprocess(
        self, input_dict: dict[str, Any], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """A loader batch (``input``, ``positions`` and the ``HostMetadata``, which is taken
        out of ``input_dict``) as this rank's ``(inputs, labels, model kwargs)``: the model's
        ``forward(inputs, positions=..., seq_ctx=...)``. The trainer's and the validator's one
        call per microbatch."""
        host = pop_host_metadata(input_dict)
        unknown = sorted(set(input_dict) - {"input", "positions"})
        if unknown:
            raise ValueError(f"batch has keys the hybrid model does not take: {unknown}")
        inputs, labels, positions, ctx = self(
            input_dict["input"], labels, input_dict.get("positions"), host
        )
        return inputs, labels, {"positions": positions, "seq_ctx": ctx}

    def context(
        self,
        shape: tuple[int, ...] | torch.Size,
        positions: torch.Tensor | None,
        host: HostMetadata | None,
    ) -> tuple[SequenceContext, Layout]:
        """The layout of a ``[B, L]`` microbatch from this preprocessor's source, and the
        ``SequenceContext`` built from it (``build``)."""
        bsz, seqlen = shape
        source = self._source_for(host)
        self.balancer.check(seqlen, self.world)
        t0 = time.perf_counter()
        if host is not None and tuple(host.positions.shape) != (bsz, seqlen):
            raise ValueError(
                f"host positions have shape {list(host.positions.shape)} but the device batch "
                f"has shape {[bsz, seqlen]}"
            )
        if source == "host":
            assert host is not None  # _source_for falls back to readback without it
            layout = host_layout(
                host.positions,
                cu_seqlens=host.cu_seqlens(),
                load_balancer=self.balancer,
                world_size=self.world,
                device=self.device,
            )
        else:
            layout = readback_layout(
                positions,
                (bsz, seqlen),
                load_balancer=self.balancer,
                world_size=self.world,
                on_readback=self._count_readback,
            )
        return self.build(layout, (bsz, seqlen), source, host, positions, t0=t0), layout

    def build(
        self,
        layout: Layout,
        shape: tuple[int, int],
        source: str,
        host: HostMetadata | None,
        positions: torch.Tensor | None,
        *,
        t0: float | None = None,
    ) -> SequenceContext:
        """Everything the layers read about the ``[B, L]`` microbatch, from its ``layout`` (and,
        for the flex mask, the rows' documents from ``source``: ``host`` or ``positions``,
        or one document per row without either): this rank's
        plan (cached) materialised on the device (the routing with fla's chunk tables, padded
        to ``caps``), the per-token global and document ids, the pass-KV schedule and its
        handle (under CP with pass-KV), and the flex document mask (flex attention).

        Every call creates new device tensors (copied non-blocking from host memory), so no
        two microbatches share storage. ``t0`` (``time.perf_counter()`` where the layout's
        build began) times the routing for ``stats``."""
        t0 = time.perf_counter() if t0 is None else t0
        plan = self.cache.get(layout.cu_seqlens, layout.fragments, self.rank)
        try:
            # Chunk tables for fla's kernels come with the routing (no host sync inside fla).
            routing = plan.to_device(
                self.device,
                conv_history=self.conv_history,
                caps=self.caps,
                chunk_size=FLA_CHUNK_SIZE,
            )
        except RoutingCapsExceeded as e:
            key = self.cap_keys.get(e.cap)
            hint = f"; raise {key}" if key else ""
            raise ValueError(f"CP rank {self.rank}: {e}{hint}") from None
        subs = plan.subsequences
        lengths = subs[:, 2] - subs[:, 1]
        doc_ids = torch.repeat_interleave(subs[:, 0], lengths)
        token_ids = torch.repeat_interleave(
            subs[:, 1] - plan.cu_seqlens[:-1], lengths
        ) + torch.arange(plan.num_tokens, dtype=torch.int64)
        ids = torch.stack([token_ids, doc_ids])
        if self.device.type == "cuda":
            ids = ids.pin_memory()
        ids = ids.to(self.device, non_blocking=True)
        schedule = handle = None
        if self.pass_kv:
            schedule = plan.pass_kv.to_device(self.device, ids[0], ids[1])
            handle = pass_kv_handle(schedule)
        self.stats.build_ms += (time.perf_counter() - t0) * 1e3
        self.stats.microbatches += 1
        self.stats.sources.add(source)
        mask = None
        if self.flex_attention:
            mask = self._flex_mask(layout, source, host, positions, shape)
        return SequenceContext(
            routing=routing,
            group=self.group if self.world > 1 else None,  # no group: the layers run unsharded
            token_ids=ids[0],
            doc_ids=ids[1],
            source=source,
            block_mask=mask,
            pass_kv=schedule,
            pass_kv_handle=handle,
        )

    def _flex_mask(
        self,
        layout: Layout,
        source: str,
        host: HostMetadata | None,
        positions: torch.Tensor | None,
        shape: tuple[int, int],
    ) -> BlockMask:
        """This rank's document ``BlockMask``, sharded by ``layout.index`` like the batch.
        Per-row document indices come from the same source as the routing: host positions copied H2D, or
        the device positions (computed there, so still no readback)."""
        if source == "host":
            assert host is not None
            row_doc = row_document_index(host.positions)
            if self.device.type == "cuda":
                row_doc = row_doc.pin_memory()
            row_doc = row_doc.to(self.device, non_blocking=True)
        elif positions is not None:
            row_doc = row_document_index(positions)
        else:  # every row is one document
            row_doc = torch.zeros(shape, dtype=torch.int32, device=self.device)
        return flex_document_mask(row_doc, index=layout.index, mesh=self._mesh)


_warned_no_host_metadata = False


def context_from_device_positions(
    tokens: torch.Tensor, positions: torch.Tensor | None, *, flex_mask: bool = False
) -> SequenceContext:
    """Single-rank context for a direct model call that brings no ``SequenceContext``: the
    preprocessor at world 1 on the readback source (its layout from the device ``positions``,
    its context from the one builder).

    Documents come from ``positions`` (a document starts where ``positions == 0`` and at every
    row start); without positions each row is one document. Reading device positions back
    blocks the host, so this warns once per process. ``flex_mask`` adds the document
    ``BlockMask`` flex attention layers need.
    """
    global _warned_no_host_metadata
    if positions is not None and not _warned_no_host_metadata:
        logger.warning(
            "HybridDecoder called without a SequenceContext: deriving document boundaries "
            "from device positions (a device->host copy per forward). Pass host metadata "
            "to avoid it."
        )
        _warned_no_host_metadata = True
    preprocessor = SequencePreprocessor(
        device=tokens.device,
        cp_group=None,
        load_balancer=None,
        routing_source="device_readback",
        flex_attention=flex_mask,
    )
    ctx, _ = preprocessor.context(tokens.shape, positions, None)
    return ctx
