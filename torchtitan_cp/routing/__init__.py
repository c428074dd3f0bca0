"""Host-side routing for context parallelism over packed documents (torch + stdlib only).

See docs/routing.md for the vocabulary and docs/CONTRACTS.md for the exact device fields.
"""

from .balancers import (
    BALANCER_KEY,
    LoadBalancer,
    balancer_names,
    check_divisible,
    get_balancer,
    register,
)
from .cache import PlanCache
from .chunks import chunk_bound, chunk_indices, chunk_offsets, chunk_tables, device_chunk_tables
from .device import DeviceRouting, RoutingCaps, RoutingCapsExceeded
from .documents import document_mask_mod, row_document_index
from .host_metadata import HostMetadata
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
from .pass_kv import DevicePassKV, PassKVPairs, PassKVRound, PassKVSchedule, pass_kv_pairs
from .plan import RoutingPlan
from .sources import Layout, documents_layout, host_layout, readback_layout

__all__ = [
    "BALANCER_KEY",
    "Layout",
    "LoadBalancer",
    "balancer_names",
    "check_divisible",
    "get_balancer",
    "register",
    "document_mask_mod",
    "row_document_index",
    "documents_layout",
    "host_layout",
    "HostMetadata",
    "readback_layout",
    "DevicePassKV",
    "DeviceRouting",
    "FragmentTable",
    "PassKVPairs",
    "PassKVRound",
    "PassKVSchedule",
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
    "device_chunk_tables",
    "format_fragments",
    "fragments_from_indices",
    "headtail_fragments",
    "parse_fragments",
    "pass_kv_pairs",
    "ptrr_fragments_from_indices",
]
