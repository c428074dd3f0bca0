"""What fla-core 0.6.0 refuses to run on this machine, known before the first backward.

fla-core 0.6.0's ``chunk_bwd_dqkwg`` (``fla/ops/common/chunk_o.py``), which GDN's backward
(``chunk_gated_delta_rule`` with a gate; Qwen3.5's GatedDeltaNet) calls, raises RuntimeError on
Hopper GPUs (compute capability 9.x) for 3.4.0 <= triton < 3.7.1: those Triton versions give
wrong results there (fla issue #640). Its TileLang backend (``pip install tilelang``) takes the
call instead. KDA's backward does not use that function. The GPU machine lent to this project
(H200, triton 3.6.0) is such a machine, so the recipe asks here, before a run starts, rather
than failing at the first GDN backward.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import NamedTuple

__all__ = ["DeviceFacts", "device_facts", "fla_gdn_backward_refusal", "gdn_backend"]

logger = logging.getLogger(__name__)

_BAD_TRITON = ((3, 4, 0), (3, 7, 1))  # [low, high): fla-core 0.6.0, chunk_o.py, issue #640


class DeviceFacts(NamedTuple):
    """What the refusal depends on: the CUDA device's compute capability (None without CUDA),
    Triton's version (None if not installed) and whether tilelang is importable."""

    capability: tuple[int, int] | None
    triton: str | None
    tilelang: bool


def device_facts() -> DeviceFacts:
    """This process's answer (current CUDA device; nothing is initialised without CUDA)."""
    import torch

    cap = None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        cap = (major, minor)
    version = None
    if importlib.util.find_spec("triton") is not None:
        import triton

        version = triton.__version__
    return DeviceFacts(cap, version, importlib.util.find_spec("tilelang") is not None)


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for p in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def fla_gdn_backward_refusal(facts: DeviceFacts | None = None) -> str | None:
    """One line saying why fla-core refuses GDN's backward here, or None where it runs."""
    f = facts if facts is not None else device_facts()
    if f.capability is None or f.triton is None or f.capability[0] != 9 or f.tilelang:
        return None
    low, high = _BAD_TRITON
    if not low <= _release(f.triton) < high:
        return None
    return (
        f"fla-core refuses GDN's backward (gated chunk_bwd_dqkwg) on this Hopper GPU (compute "
        f"capability {f.capability[0]}.{f.capability[1]}) with triton {f.triton}: triton "
        ">= 3.4.0 and < 3.7.1 gives wrong gradients there (fla issue #640); install "
        "triton >= 3.7.1 or tilelang"
    )


_warned = False


def gdn_backend(requested: str, facts: DeviceFacts | None = None) -> str:
    """The backend GDN layers run for ``linear_attention.backend = requested``: ``fla`` where
    fla refuses GDN's backward is a ValueError (one line, the versions); ``auto`` there runs
    the PyTorch kernels (one warning per process); anything else is ``requested``."""
    global _warned
    if requested not in ("auto", "fla"):
        return requested
    reason = fla_gdn_backward_refusal(facts)
    if reason is None:
        return requested
    if requested == "fla":
        raise ValueError(f"linear_attention.backend = 'fla' for GDN layers: {reason}")
    if not _warned:
        logger.warning(
            f"{reason}; GDN layers run the PyTorch kernels (linear_attention.backend = 'auto')"
        )
        _warned = True
    return "torch"
