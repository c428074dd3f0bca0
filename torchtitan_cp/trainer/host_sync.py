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
  ``copy_``, ``torch.tensor(..., device=device)``, ``device_tensor.new_tensor(...)``), which
  waits for the device's queue.

Device tensors are those marked with ``mark_device`` (parameters, optimizer state), the results
of copies to the device, of factories given the device (``device=``), and everything computed
from them. On a CPU machine the device must be named apart from the host: ``cpu:0`` (the same
memory; ``torch.device("cpu:0") != torch.device("cpu")``), so ``.to(device)`` from a host tensor
is a copy to the device, and returns a new tensor as on a GPU. A device tensor's ``.device`` is
plain ``cpu`` though, the host's own name, so ``.to("cpu")`` of a device tensor counts as staying
on the device: its values are caught when the host reads them (``.tolist()``, ``.item()``), and
``.cpu()`` counts as the readback it is. A blocking copy of a host tensor to ``cpu`` (``.to(
other.device)``, ``torch.tensor(..., device=other.device)``) may be a copy to the device or host
work: its result (and what is computed from it on the host) is *pending*, and becomes a device
tensor, with one ``blocking-h2d`` event at the line that copied, when an operation first meets
it with a device tensor; a pending copy that only the host uses records nothing. A copy to a
device tensor (``.to(other)``) is a device copy at once. Not seen: pinned memory (CPU tensors
cannot be pinned without an accelerator), and a host tensor that meets device tensors without
any copy (on a GPU an error, or a hidden copy where it indexes), and Python hooks of the
backward other than custom ``autograd.Function``s' (the autograd engine runs them without the
function-level mode; every aten op they dispatch is seen). What a collective does inside the
process group (its dispatch and ``Work.wait()``: gloo's reduce-scatter copies its result on the
host, NCCL does not) is the backend's, not the program's, and is not recorded.

``recorded(trainer)`` watches one trainer step (what ``scripts/gpu_check.py``'s dry run and the
test suite's trainer launches, ``tests/host_syncs.py``, wrap around ``train_step``).
Only torch is imported.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections import Counter
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import BackwardCFunction as _BackwardCFunction
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
_COLLECTIVES = ("c10d", "_c10d_functional")
_READBACK_METHODS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__}
_TORCH_DIR = os.path.dirname(torch.__file__)


@dataclass
class _Pending:
    """A blocking copy of a host tensor to ``cpu`` (maybe the device): where it happened, and
    whether a device tensor has met it (or a tensor computed from it) yet."""

    op: str
    site: str
    recorded: bool = False


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
        self.pending: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> _Pending
        self.events: list[SyncEvent] = []
        self.in_collective = False

    def is_device(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t in self.tainted

    def mark(self, tree: Any) -> None:
        for t in tree_leaves(tree):
            if isinstance(t, torch.Tensor):
                self.tainted[t] = True
                self.pending.pop(t, None)  # a device tensor now, whatever it was computed from

    def record(self, kind: str, op: str, site: str | None = None) -> None:
        self.events.append(SyncEvent(kind, op, site or _caller_site()))

    def targets_device(self, device: Any) -> bool:
        return device is not None and torch.device(device) == self.device

    def may_be_device(self, device: Any) -> bool:
        """``device`` is the host's name, which on CPU is also every device tensor's
        ``.device`` (the device itself has its own name, ``targets_device``)."""
        return device is not None and torch.device(device) == torch.device(self.device.type)

    def copied(self, out: Tensor, op: str) -> None:
        """``out`` is a blocking copy of a host tensor to ``cpu``: pending (module docstring)."""
        self.pending[out] = _Pending(op, _caller_site())

    def meet(self, tensors: list[Tensor]) -> None:
        """Device tensors met these pending copies: each copy is recorded once, and the
        tensors are device tensors from now on."""
        for t in tensors:
            p = self.pending.pop(t)
            if not p.recorded:
                p.recorded = True
                self.record("blocking-h2d", p.op, p.site)
            self.tainted[t] = True


class _Level:
    """Base of the two torch modes: they record into one ``_State``."""

    def __init__(self, state: _State) -> None:
        super().__init__()
        self.s = state


class _FunctionLevel(_Level, TorchFunctionMode):
    """Calls that never reach the dispatcher on CPU: ``.to``/``.cpu`` between "devices" that
    are both the CPU, ``.tolist()``, and factories told to build on the device."""

    def __torch_function__(self, func, types, args: tuple[Any, ...] = (), kwargs=None):
        kwargs = kwargs or {}
        s = self.s
        if func is torch.Tensor.to and args and isinstance(args[0], torch.Tensor):
            src = args[0]
            to_kwargs = {k: v for k, v in kwargs.items() if k != "copy"}
            device, _, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **to_kwargs)
            other = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
            out = func(*args, **kwargs)
            if s.is_device(src):
                return out
            if s.targets_device(device) or (other is not None and s.is_device(other)):
                if not non_blocking:
                    s.record("blocking-h2d", "Tensor.to")
                out = out.clone() if out is src else out  # a copy, as on a GPU
                s.mark(out)
            elif s.may_be_device(device) and not non_blocking:
                out = out.clone() if out is src else out
                s.copied(out, "Tensor.to")
            return out
        if func is torch.Tensor.new_tensor and s.is_device(args[0]):
            data = args[1] if len(args) > 1 else kwargs.get("data")
            if not s.is_device(data):
                s.record("blocking-h2d", "Tensor.new_tensor")
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
        copies = func in (torch.tensor, torch.as_tensor, torch.asarray)
        if "device" in kwargs and s.targets_device(kwargs["device"]):
            if copies:
                data = args[0] if args else kwargs.get("data")
                if not s.is_device(data):
                    s.record("blocking-h2d", f"torch.{func.__name__}")
            s.mark(out)
        elif copies and s.may_be_device(kwargs.get("device")):
            data = args[0] if args else kwargs.get("data")
            if not s.is_device(data) and isinstance(out, torch.Tensor):
                s.copied(out, f"torch.{func.__name__}")
        return out


class _DispatchLevel(_Level, TorchDispatchMode):
    """Every aten op: propagates device-ness and records reads of device values."""

    def __torch_dispatch__(self, func, types, args: tuple[Any, ...] = (), kwargs=None):
        kwargs = kwargs or {}
        s = self.s
        if s.in_collective:
            # The process group's own work inside a collective (gloo's reduce-scatter splits
            # and copies on the host; NCCL none of it): not the program's.
            return func(*args, **kwargs)
        if func.namespace in _COLLECTIVES:
            s.in_collective = True
            try:
                out = func(*args, **kwargs)
            finally:
                s.in_collective = False  # (not nested: the flag was off to get here)
            if any(s.is_device(t) for t in tree_leaves((args, kwargs))):
                s.mark(out)
            return out
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_device = any(s.is_device(t) for t in inputs)
        pending = [t for t in inputs if t in s.pending]
        if pending and on_device:
            s.meet(pending)
            pending = []
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
        elif pending:  # host work on a pending copy: the result is pending with it
            p = s.pending[pending[0]]
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    s.pending[t] = p
        return out


def _collective_work_wait(state: _State) -> Callable[[], None] | None:
    """Count what a collective's ``Work.wait()`` does as the collective's own work (gloo's
    reduce-scatter copies its result into the output there, on the host: NCCL does not).
    Returns the undo, or None without torch.distributed."""
    try:
        from torch._C._distributed_c10d import Work
    except ImportError:
        return None
    original = Work.wait

    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = state.in_collective
        state.in_collective = True
        try:
            return original(self, *args, **kwargs)
        finally:
            state.in_collective = outer

    Work.wait = wait  # type: ignore[method-assign]

    def undo() -> None:
        Work.wait = original  # type: ignore[method-assign]

    return undo


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
        functions = _FunctionLevel(self._state)
        self._modes = [functions, _DispatchLevel(self._state)]
        for mode in self._modes:
            mode.__enter__()
        # The autograd engine runs backward without the Python function-mode stack (dispatch
        # modes it keeps), so a custom Function's backward (the CP collectives', the kernels'
        # custom ops' and autograd Functions') re-enters the function level here.
        original = _BackwardCFunction.apply
        self._backward_apply = original

        def apply(ctx: Any, *args: Any) -> Any:
            if torch._C._len_torch_function_stack() > 0:
                return original(ctx, *args)
            with functions:
                return original(ctx, *args)

        _BackwardCFunction.apply = apply  # type: ignore[method-assign]
        self._work_wait = _collective_work_wait(self._state)
        return self

    def __exit__(self, *exc: Any) -> None:
        _BackwardCFunction.apply = self._backward_apply  # type: ignore[method-assign]
        if self._work_wait is not None:
            self._work_wait()
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []


@contextlib.contextmanager
def recorded(trainer: Any) -> Generator[HostSyncRecorder]:
    """A trainer step (``with recorded(trainer): trainer.train_step(...)``) under a recorder on
    the trainer's device, its parameters, buffers and optimizer state marked as device tensors
    (the CPU dry run of a step under ``set_sync_debug_mode``)."""
    rec = HostSyncRecorder(trainer.device)
    rec.mark_modules(trainer.model_parts)
    rec.mark_optimizer_state(trainer.optimizers)
    with rec:
        yield rec


def event_lines(events: Iterable[SyncEvent]) -> list[str]:
    """One line per distinct event, first-seen order, ``"Nx ..."`` where it repeats."""
    counts = Counter(str(e) for e in events)
    return [f"{n}x {e}" if n > 1 else e for e, n in counts.items()]
