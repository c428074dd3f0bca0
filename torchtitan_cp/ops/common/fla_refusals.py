"""What fla-core 0.6.0 refuses to run on this machine, known before the first backward.

fla-core 0.6.0's gated ``chunk_bwd_dqkwg`` (``fla/ops/common/chunk_o.py``, called with a gate
``g``) raises RuntimeError on Hopper GPUs (compute capability 9.x) for 3.4.0 <= triton < 3.7.1:
those Triton versions give wrong results there (fla issue #640). Its TileLang backend takes the
call instead, but only where fla 0.6.0 can use it (``fla/backends.py``,
``TileLangBackend.is_available`` and ``is_enabled``): ``tilelang`` importable, a usable
``nvcc`` for TileLang's JIT (``fla/utils/env.py:has_usable_nvcc``: ``$CUDA_HOME`` or
``$CUDA_PATH`` ``/bin/nvcc``, ``nvcc`` on ``PATH``, the ``nvidia-cuda-nvcc`` wheel's binary,
``/usr/local/cuda/bin/nvcc``; fla #1026), and ``FLA_TILELANG`` not ``0``. Without an nvcc fla
falls back to Triton and raises. The GPU machine lent to this project (H200, triton 3.6.0) is
such a machine, so the recipe asks here, before a run starts, rather than failing at the first
backward.

The refusal is keyed on that kernel, not on a layer: each recurrence says whether its fla
backward calls it (``Recurrence.fla_refusal``): the scalar-gate delta rule (GDN,
``chunk_gated_delta_rule``) and SSD with a gate per head (Mamba2 and retention,
``chunk_simple_gla``) do; KDA (its own fused ``dqkg``) and GLA (``chunk_gla``) do not.
``fla_backend`` then turns a layer's requested backend into the one it runs.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import shutil
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "DeviceFacts",
    "device_facts",
    "find_nvcc",
    "fla_backend",
    "fla_gated_backward_path",
    "fla_gated_backward_refusal",
]

logger = logging.getLogger(__name__)

_BAD_TRITON = ((3, 4, 0), (3, 7, 1))  # [low, high): fla-core 0.6.0, chunk_o.py, issue #640
CUDA_DEFAULT = Path("/usr/local/cuda")  # the toolkit fla looks in last


class DeviceFacts(NamedTuple):
    """What the refusal depends on: the CUDA device's compute capability (None without CUDA),
    Triton's version (None if not installed), whether fla may use tilelang (importable, and
    ``FLA_TILELANG`` not ``0``) and the nvcc TileLang would compile with (None: none found)."""

    capability: tuple[int, int] | None
    triton: str | None
    tilelang: bool
    nvcc: str | None = None


def find_nvcc() -> str | None:
    """The nvcc fla 0.6.0 would let TileLang use (``fla/utils/env.py:has_usable_nvcc``, same
    order), or None."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            if (Path(home) / "bin" / "nvcc").exists():
                return str(Path(home) / "bin" / "nvcc")
            break  # fla reads the first of the two that is set, then moves on
    found = shutil.which("nvcc")
    if found is not None:
        return found
    try:
        files = importlib.metadata.files("nvidia-cuda-nvcc") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name in ("nvcc", "nvcc.exe"):
            return str(f.locate())
    default = CUDA_DEFAULT / "bin" / "nvcc"
    return str(default) if default.exists() else None


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
    tilelang = importlib.util.find_spec("tilelang") is not None
    tilelang &= os.environ.get("FLA_TILELANG", "1") != "0"
    return DeviceFacts(cap, version, tilelang, find_nvcc())


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for p in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _hopper_bad_triton(f: DeviceFacts) -> bool:
    if f.capability is None or f.triton is None or f.capability[0] != 9:
        return False
    low, high = _BAD_TRITON
    return low <= _release(f.triton) < high


def fla_gated_backward_refusal(facts: DeviceFacts | None = None) -> str | None:
    """One line saying why fla-core refuses its gated ``chunk_bwd_dqkwg`` here (the backward
    of every recurrence whose ``fla_refusal`` asks), or None where it runs."""
    f = facts if facts is not None else device_facts()
    if not _hopper_bad_triton(f) or (f.tilelang and f.nvcc is not None):
        return None
    cap = f"{f.capability[0]}.{f.capability[1]}" if f.capability else "?"
    tl = (
        "tilelang is installed but fla finds no nvcc for it (fla #1026)"
        if f.tilelang
        else "no tilelang"
    )
    return (
        f"fla-core refuses the backward of its gated chunk_bwd_dqkwg on this Hopper GPU (compute "
        f"capability {cap}) with triton {f.triton}: triton >= 3.4.0 and < 3.7.1 gives wrong "
        f"gradients there (fla issue #640), and {tl}; install triton >= 3.7.1, or tilelang "
        "with an nvcc (CUDA_HOME or PATH)"
    )


def fla_gated_backward_path(facts: DeviceFacts | None = None) -> str:
    """One line: which kernels run the gated backward (GDN, Mamba2, retention) under
    ``backend = "auto"`` here, and why."""
    f = facts if facts is not None else device_facts()
    what = "gated backward (GDN, Mamba2, retention)"
    if f.capability is None:
        return f"{what}: PyTorch kernels (no CUDA device)"
    if not _hopper_bad_triton(f):
        return f"{what}: fla's Triton kernels (triton {f.triton}, capability {f.capability[0]}.{f.capability[1]})"
    if f.tilelang and f.nvcc is not None:
        return f"{what}: fla's TileLang kernels (triton {f.triton} is refused on Hopper, fla #640; tilelang with nvcc {f.nvcc})"
    return f"{what}: PyTorch kernels ({fla_gated_backward_refusal(f)})"


_warned: set[str] = set()


def fla_backend(requested: str, refusal: str | None, layers: str) -> str:
    """The backend ``layers`` (e.g. "GDN (Gated DeltaNet) layers") run for
    ``linear_attention.backend = requested`` when their recurrence's fla kernels are refused
    here for ``refusal`` (its ``fla_refusal()``; None: not refused): ``fla`` is a ValueError
    (one line, the versions), ``auto`` runs the PyTorch kernels (one warning per process and
    ``layers``); anything else, or no refusal, is ``requested``."""
    if requested not in ("auto", "fla") or refusal is None:
        return requested
    if requested == "fla":
        raise ValueError(f"linear_attention.backend = 'fla' for {layers}: {refusal}")
    if layers not in _warned:
        logger.warning(
            f"{refusal}; {layers} run the PyTorch kernels (linear_attention.backend = 'auto')"
        )
        _warned.add(layers)
    return "torch"
