"""Find the operations of a training step that make the host wait for the device.

On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` is the authority: every synchronising call
raises. A CPU machine has no device to wait for, so ``HostSyncRecorder`` is its dry run: it
tells device tensors from host tensors by where they came from and records, with the frame
that called it, every operation that would synchronise on an accelerator:

* ``readback``: a device value read on the host (``aten._local_scalar_dense`` behind ``.item()``,
  ``int()``, ``bool()``; ``.tolist()``, ``.numpy()``, ``.cpu()``; a device-to-host ``copy_``);
* ``data-dependent``: an op whose output size depends on device values (``nonzero``, boolean
  indexing, ``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``);
* ``blocking-h2d``: a host-to-device copy without ``non_blocking=True`` (``.to(device)``,
  ``copy_``, ``torch.tensor(..., device=device)``), which waits for the device's queue.

Device tensors are those marked with ``mark_device`` (parameters, optimizer state), the results
of copies to the device, of factories given the device (``device=``), and everything computed
from them. On a CPU machine the device must be named apart from the host: ``cpu:0`` (the same
memory; ``torch.device("cpu:0") != torch.device("cpu")``), so ``.to(device)`` from a host tensor
is a copy to the device, and returns a new tensor as on a GPU. A device tensor's ``.device`` is
plain ``cpu`` though, so ``.to("cpu")`` of a device tensor counts as staying on the device: its
values are caught when the host reads them (``.tolist()``, ``.item()``), and ``.cpu()`` counts as
the readback it is. Copies to ``other.device`` are not seen as copies to the device (the CUDA
check sees them), nor is pinned memory (CPU tensors cannot be pinned without an accelerator).
Only torch is imported.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten

# Ops whose output size depends on device values: the host must wait for them.
_DATA_DEPENDENT = {
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten._local_scalar_dense.default,
}
_READBACK_METHODS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__}
_TORCH_DIR = os.path.dirname(torch.__file__)


@dataclass(frozen=True)
class SyncEvent:
    kind: str
    """``readback``, ``data-dependent`` or ``blocking-h2d``."""
    op: str
    """What did it, e.g. ``aten._local_scalar_dense`` or ``Tensor.to``."""
    site: str
    """``path:line function`` of the innermost caller outside torch."""

    def __str__(self) -> str:
        return f"{self.kind} {self.op} at {self.site}"


def _caller_site() -> str:
    here = os.path.abspath(__file__)
    for frame in reversed(traceback.extract_stack()[:-1]):
        path = os.path.abspath(frame.filename)
        if path == here or path.startswith(_TORCH_DIR + os.sep):
            continue
        parts = path.split(os.sep)
        return f"{'/'.join(parts[-2:])}:{frame.lineno} {frame.name}"
    return "?"


class _State:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tainted: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.events: list[SyncEvent] = []

    def is_device(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t in self.tainted

    def mark(self, tree: Any) -> None:
        for t in tree_leaves(tree):
            if isinstance(t, torch.Tensor):
                self.tainted[t] = True

    def record(self, kind: str, op: str) -> None:
        self.events.append(SyncEvent(kind, op, _caller_site()))

    def targets_device(self, device: Any) -> bool:
        return device is not None and torch.device(device) == self.device


class _FunctionLevel(TorchFunctionMode):
    """Calls that never reach the dispatcher on CPU: ``.to``/``.cpu`` between "devices" that
    are both the CPU, ``.tolist()``, and factories told to build on the device."""

    def __init__(self, state: _State) -> None:
        super().__init__()
        self.s = state

    def __torch_function__(self, func, types, args: tuple[Any, ...] = (), kwargs=None):
        kwargs = kwargs or {}
        s = self.s
        if func is torch.Tensor.to and args and isinstance(args[0], torch.Tensor):
            src = args[0]
            to_kwargs = {k: v for k, v in kwargs.items() if k != "copy"}
            device, _, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **to_kwargs)
            out = func(*args, **kwargs)
            if not s.is_device(src) and s.targets_device(device):
                if not non_blocking:
                    s.record("blocking-h2d", "Tensor.to")
                out = out.clone() if out is src else out  # a copy, as on a GPU
                s.mark(out)
            return out
        if func is torch.Tensor.cuda and s.device.type == "cuda":
            if not kwargs.get("non_blocking", False) and not s.is_device(args[0]):
                s.record("blocking-h2d", "Tensor.cuda")
        if func is torch.Tensor.cpu and s.is_device(args[0]):
            s.record("readback", "Tensor.cpu")
            out = func(*args, **kwargs)
            if out is args[0]:
                out = out.clone()  # a host copy: not a device tensor
                s.tainted.pop(out, None)
            return out
        if func in _READBACK_METHODS and s.is_device(args[0]):
            s.record("readback", f"Tensor.{func.__name__}")
        out = func(*args, **kwargs)
        if "device" in kwargs and s.targets_device(kwargs["device"]):
            if func in (torch.tensor, torch.as_tensor, torch.asarray):
                data = args[0] if args else kwargs.get("data")
                if not s.is_device(data):
                    s.record("blocking-h2d", f"torch.{func.__name__}")
            s.mark(out)
        return out


class _DispatchLevel(TorchDispatchMode):
    """Every aten op: propagates device-ness and records reads of device values."""

    def __init__(self, state: _State) -> None:
        super().__init__()
        self.s = state

    def __torch_dispatch__(self, func, types, args: tuple[Any, ...] = (), kwargs=None):
        kwargs = kwargs or {}
        s = self.s
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_device = any(s.is_device(t) for t in inputs)
        if on_device:
            name = f"aten.{func.overloadpacket.__name__}"
            if func in _DATA_DEPENDENT:
                kind = "readback" if func is aten._local_scalar_dense.default else "data-dependent"
                s.record(kind, name)
            elif func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
                indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
                if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
                    s.record("data-dependent", f"{name} (boolean mask)")
            elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
                s.record("data-dependent", name)
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            if s.is_device(dst) and not s.is_device(src) and not non_blocking:
                s.record("blocking-h2d", "aten.copy_")
            elif s.is_device(src) and not s.is_device(dst):
                s.record("readback", "aten.copy_")
        out = func(*args, **kwargs)
        if on_device:
            s.mark(out)
        return out


class HostSyncRecorder:
    """Context manager recording what would synchronise on ``device`` (see module docstring).

    ``mark_device(...)`` the tensors that live on the device before the recorded region
    (parameters, buffers, optimizer state); ``events`` lists what happened inside.
    """

    def __init__(self, device: torch.device | str) -> None:
        self._state = _State(torch.device(device))
        self._modes: list[Any] = []

    @property
    def events(self) -> list[SyncEvent]:
        return list(self._state.events)

    def mark_device(self, *trees: Any) -> None:
        """Mark tensors (any nesting of lists, tuples and dicts) as device tensors."""
        self._state.mark(trees)

    def mark_modules(self, modules: Iterable[torch.nn.Module]) -> None:
        for m in modules:
            self.mark_device(list(m.parameters()), list(m.buffers()))

    def mark_optimizer_state(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Parameter-shaped state (moments); a 0-dim ``step`` counter stays a host tensor, as
        torch keeps it on the CPU unless the optimizer is fused or capturable."""
        for opt in optimizers:
            for p, state in opt.state.items():
                for v in state.values():
                    if isinstance(v, torch.Tensor) and v.shape == p.shape:
                        self.mark_device(v)

    def __enter__(self) -> HostSyncRecorder:
        self._modes = [_FunctionLevel(self._state), _DispatchLevel(self._state)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []
