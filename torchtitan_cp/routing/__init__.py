"""Host-side routing for context parallelism over packed documents (torch + stdlib only).

See docs/routing.md for the vocabulary and docs/CONTRACTS.md for the exact device fields.
"""

from .cache import PlanCache
from .chunks import chunk_bound, chunk_indices, chunk_offsets, chunk_tables
from .device import DeviceRouting, RoutingCaps, RoutingCapsExceeded
from .layouts import (
    FragmentTable,
    contiguous_fragments,
    cu_seqlens_from_positions,
    cu_seqlens_tensor_from_positions,
    format_fragments,
    fragments_from_indices,
    headtail_fragments,
    parse_fragments,
    ptrr_fragments_from_indices,
)
from .plan import RoutingPlan
from .sources import (
    LOAD_BALANCERS,
    Layout,
    document_block_mask,
    document_ids,
    document_mask_mod,
    host_layout,
    readback_layout,
)

__all__ = [
    "LOAD_BALANCERS",
    "Layout",
    "document_block_mask",
    "document_ids",
    "document_mask_mod",
    "host_layout",
    "readback_layout",
    "DeviceRouting",
    "FragmentTable",
    "PlanCache",
    "RoutingCaps",
    "RoutingCapsExceeded",
    "RoutingPlan",
    "chunk_bound",
    "chunk_indices",
    "chunk_offsets",
    "chunk_tables",
    "contiguous_fragments",
    "cu_seqlens_from_positions",
    "cu_seqlens_tensor_from_positions",
    "format_fragments",
    "fragments_from_indices",
    "headtail_fragments",
    "parse_fragments",
    "ptrr_fragments_from_indices",
]
