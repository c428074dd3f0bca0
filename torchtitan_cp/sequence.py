"""Per-microbatch preprocessing: document boundaries, CP layout, sharding and the routing.

One ``SequencePreprocessor`` serves the trainer and the validator. For every microbatch it
finds the global document boundaries and every rank's fragments, shards ``input``, ``labels`` and
``positions`` for this CP rank, and builds the ``SequenceContext`` every KDA/GDN/attention layer
of that microbatch shares.

Two sources, chosen by ``[linear_attention] routing_source``:

* ``host``: boundaries from the data loader's CPU positions (``HostMetadata``), fragments from
  torch's own load balancers run on the CPU, PTRR from a block mask built on the CPU. Nothing is
  read back from the device.
* ``device_readback``: boundaries from the device positions and layouts from the device
  load-balancer indices, each copied back to the host (one copy per microbatch for PTRR's
  permutation, for all ranks at once). Every such copy is counted in ``readbacks``.

Callers that bring no host metadata fall back to ``device_readback`` with one warning.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
    _HeadTailLoadBalancer,
    _PTRRLoadBalancer,
)

from torchtitan_cp.data import HostMetadata
from torchtitan_cp.models.context import SequenceContext, build_sequence_context
from torchtitan_cp.routing import (
    PlanCache,
    cu_seqlens_tensor_from_positions,
    fragments_from_indices,
)

logger = logging.getLogger(__name__)

LOAD_BALANCERS = ("contiguous", "headtail", "ptrr")
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


def document_block_mask(positions: torch.Tensor, block_size: int = 128):
    """Causal packed-document ``BlockMask`` ``[B, 1, L, L]`` of ``positions [B, L]``, built on
    ``positions.device``. PTRR's balancer reads only its per-block counts."""
    from torch.nn.attention.flex_attention import create_block_mask

    starts = positions == 0
    starts[:, 0] = True
    doc = torch.cumsum(starts.to(torch.int32), dim=1)

    def mask_mod(b, h, q, kv):
        return (q >= kv) & (doc[b, q] == doc[b, kv])

    bsz, seqlen = positions.shape
    return create_block_mask(
        mask_mod, bsz, None, seqlen, seqlen, device=positions.device, BLOCK_SIZE=block_size
    )


def rearrange_indices(
    load_balancer: str,
    seq_len: int,
    world_size: int,
    positions: torch.Tensor | None,
    device: torch.device | str,
    block_size: int = 128,
) -> torch.Tensor | None:
    """torch's load-balancer rearrange indices ``[1 or B, L]`` on ``device`` (None: identity)."""
    if world_size == 1 or load_balancer == "contiguous":
        return None
    if load_balancer == "headtail":
        if seq_len % (2 * world_size):
            raise ValueError(
                f"training.seq_len ({seq_len}) must be divisible by 2 x "
                f"context_parallel_degree ({2 * world_size}) for the headtail load balancer"
            )
        return _HeadTailLoadBalancer(seq_len, world_size, device)._generate_indices()
    if load_balancer == "ptrr":
        if positions is None:
            raise ValueError("the ptrr load balancer needs positions to build its block mask")
        if seq_len % (block_size * world_size):
            raise ValueError(
                f"training.seq_len ({seq_len}) must be divisible by {block_size} x "
                f"context_parallel_degree ({block_size * world_size}) for the ptrr load balancer"
            )
        mask = document_block_mask(positions.to(device), block_size)
        return _PTRRLoadBalancer(mask, world_size)._generate_indices()
    raise ValueError(
        f"parallelism.context_parallel_load_balancer must be one of {LOAD_BALANCERS}, "
        f"got {load_balancer!r}"
    )


def shard_rows(x: torch.Tensor, index: torch.Tensor | None, rank: int, world: int) -> torch.Tensor:
    """This rank's piece of ``x [B, L, ...]`` after rearranging each row by ``index``."""
    seqlen = x.shape[1]
    chunk = seqlen // world
    if index is None:
        return x[:, rank * chunk : (rank + 1) * chunk]
    idx = index[:, rank * chunk : (rank + 1) * chunk]
    if idx.shape[0] == 1:
        return x.index_select(1, idx[0])
    return torch.gather(x, 1, idx.expand(x.shape[0], -1))


class SequencePreprocessor:
    """Builds the per-microbatch CP layout and ``SequenceContext`` (see module docstring)."""

    def __init__(
        self,
        *,
        device: torch.device | str,
        cp_group: dist.ProcessGroup | None,
        load_balancer: str | None,
        cp_rank: int | None = None,
        cp_world_size: int | None = None,
        routing_source: str = "host",
        plan_cache_size: int = 16,
        conv_history: int = 3,
        ptrr_block_size: int = 128,
    ) -> None:
        if routing_source not in SOURCES:
            raise ValueError(
                f"linear_attention.routing_source must be one of {SOURCES}, got {routing_source!r}"
            )
        lb = load_balancer or "contiguous"
        if lb not in LOAD_BALANCERS:
            raise ValueError(
                f"parallelism.context_parallel_load_balancer must be one of {LOAD_BALANCERS}, "
                f"got {load_balancer!r}"
            )
        self.device = torch.device(device)
        self.group = cp_group
        # Explicit rank/world let tools and tests lay out any rank without a process group.
        self.world = cp_world_size or (dist.get_world_size(cp_group) if cp_group is not None else 1)
        self.rank = cp_rank if cp_rank is not None else (dist.get_rank(cp_group) if cp_group else 0)
        self.load_balancer = lb
        self.routing_source = routing_source
        self.cache = PlanCache(plan_cache_size)
        self.conv_history = conv_history
        self.ptrr_block_size = ptrr_block_size
        self.stats = RoutingStats()
        self._warned_fallback = False

    # -- copies of the device batch back to the host, counted where they happen (also on a
    # CPU-only run, where the "device" batch lives in host memory but is still a second copy).
    def _readback(self, t: torch.Tensor) -> torch.Tensor:
        self.stats.readbacks += 1
        return t.cpu()

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
        bsz, seqlen = inputs.shape
        source = self._source_for(host)
        if seqlen % self.world:
            raise ValueError(
                f"sequence length {seqlen} is not divisible by context_parallel_degree {self.world}"
            )
        t0 = time.perf_counter()
        if host is not None and tuple(host.positions.shape) != (bsz, seqlen):
            raise ValueError(
                f"host positions have shape {list(host.positions.shape)} but the device batch "
                f"has shape {[bsz, seqlen]}"
            )
        if source == "host":
            cu = cu_seqlens_tensor_from_positions(host.positions)
            index_host = rearrange_indices(
                self.load_balancer, seqlen, self.world, host.positions, "cpu", self.ptrr_block_size
            )
            index_dev = None
            if index_host is not None:
                index_dev = index_host.to(self.device, non_blocking=True)
        else:
            if positions is None:
                cu = torch.arange(0, bsz * seqlen + 1, seqlen)
            else:
                cu = cu_seqlens_tensor_from_positions(self._readback(positions))
            index_dev = rearrange_indices(
                self.load_balancer, seqlen, self.world, positions, self.device, self.ptrr_block_size
            )
            # One copy for every rank's layout (not one per rank).
            index_host = self._readback(index_dev) if index_dev is not None else None
        if index_host is None:
            frag_index = torch.arange(seqlen).unsqueeze(0)
        else:
            frag_index = index_host
        fragments = fragments_from_indices(frag_index, self.world, bsz, seqlen)
        plan = self.cache.get(cu, fragments, self.rank)
        ctx = build_sequence_context(
            plan,
            self.device,
            self.group if self.world > 1 else None,  # no group: the layers run unsharded
            source=source,
            conv_history=self.conv_history,
        )
        self.stats.build_ms += (time.perf_counter() - t0) * 1e3
        self.stats.microbatches += 1
        self.stats.sources.add(source)
        if self.world > 1:
            inputs = shard_rows(inputs, index_dev, self.rank, self.world)
            labels = shard_rows(labels, index_dev, self.rank, self.world)
            if positions is not None:
                positions = shard_rows(positions, index_dev, self.rank, self.world)
        return inputs, labels, positions, ctx
