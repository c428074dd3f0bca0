"""Which collectives receive a host tensor: an NCCL mistake made visible on CPU.

On CUDA, torchtitan 0.3.0's default process group is NCCL only, so a collective on a CPU
tensor fails there ("No backend type associated with device type cpu"). gloo takes CPU tensors,
and on a CPU run the training device *is* the CPU, so devices cannot tell the two apart. This
module tracks where each tensor came from instead (``Tracker``):

* host: made by a factory (``torch.tensor``, ``zeros``, ...) without a device, or with the
  device written as the string ``"cpu"``; by ``.cpu()``, ``.pin_memory()``, ``from_numpy``;
  or computed from host tensors only. On CUDA all of these live on the CPU.
* device: made or moved with a ``torch.device`` (the trainer passes ``self.device``) or next
  to another tensor (``.to(other)``, ``*_like``, ``new_*``), or computed from any device
  tensor. On CUDA these live on the GPU.
* untagged: made where the tracker cannot see (C++ autograd, before it started): never flagged.

Every collective (``c10d.*`` and ``_c10d_functional.*`` dispatcher ops: torch.distributed's
functions, functional collectives, FSDP, DTensor) that receives a host tensor on a group other
than the gloo control group (``control.control_group()``) is a violation.

``torchrun ... -m tests.collective_devices ARGS`` runs the trainer's main under the tracker
and writes ``<dump_folder>/collective_devices_rank<R>.json``: every collective by op and
caller, and the violations with their caller.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

HOST, DEVICE = "host", "device"
_TAG = "_collective_devices_origin"

_FACTORIES = {
    torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full,
    torch.arange, torch.rand, torch.randn, torch.randint, torch.randperm, torch.linspace,
    torch.logspace, torch.eye, torch.empty_strided, torch.scalar_tensor, torch.from_numpy,
    torch.frombuffer,
}  # fmt: skip # a table, laid out by hand to read across
_LIKE = {
    torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
    torch.randn_like, torch.randint_like,
}  # fmt: skip # a table, laid out by hand to read across
_NEW = {"new_tensor", "new_zeros", "new_ones", "new_empty", "new_full"}


def origin(t: Any) -> str | None:
    return getattr(t, _TAG, None) if isinstance(t, torch.Tensor) else None


def _device_origin(device: Any) -> str | None:
    """A device argument's meaning: None when absent; host for the string "cpu"."""
    if device is None:
        return None
    if isinstance(device, str):
        return HOST if device.split(":")[0] == "cpu" else DEVICE
    return DEVICE  # a torch.device (or an index): what the trainer passes as self.device


def _tag_of_inputs(args: Any, kwargs: Any) -> str | None:
    tags = {origin(t) for t in tree_leaves((args, kwargs))}
    return DEVICE if DEVICE in tags else HOST if HOST in tags else None


def _to_target(args: tuple, kwargs: dict) -> str | None:
    """What ``Tensor.to(...)`` moves to: None for a dtype-only call."""
    if "device" in kwargs:
        return _device_origin(kwargs["device"])
    for a in args[1:]:
        if isinstance(a, torch.Tensor):
            return origin(a) or DEVICE
        if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
            return _device_origin(a)
    return None


class _Origins(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if func in _FACTORIES:
            tag = _device_origin(kwargs.get("device")) or HOST
        elif func in _LIKE or name in _NEW:
            tag = _device_origin(kwargs.get("device")) or origin(args[0])
        elif name == "to":
            tag = _to_target(args, kwargs) or origin(args[0])
        elif name == "cuda":
            tag = DEVICE
        elif name in ("cpu", "pin_memory"):
            tag = HOST
        else:
            tag = _tag_of_inputs(args, kwargs)
        if tag is not None:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    try:
                        setattr(t, _TAG, tag)
                    except (AttributeError, RuntimeError):  # e.g. tensors without a __dict__
                        pass
        return out


def _caller() -> str:
    """The innermost frame in torchtitan_cp or torchtitan (file:line function)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace(os.sep, "/")
        for pkg in ("torchtitan_cp/", "torchtitan/"):
            if pkg in path:
                return f"{pkg}{path.split(pkg, 1)[1]}:{frame.lineno} {frame.name}"
    return "?"


def _group_name(args: tuple) -> str | None:
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return torch._C._distributed_c10d.ProcessGroup.unbox(a).group_name
            except RuntimeError:  # a ReduceOp or another script object
                continue
    return None


def _control_group_name() -> str | None:
    from torchtitan_cp.run import control

    entry = control._CONTROL_GROUP  # (the default group it belongs to, the group)
    return entry[1].group_name if entry is not None else None


_NOT_SENT = ("wait", "_wrap_tensor_autograd")  # waits and autograd wrappers send nothing


class _Collectives(TorchDispatchMode):
    def __init__(self, tracker: Tracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__
        if func.namespace in ("c10d", "_c10d_functional") and not name.startswith(_NOT_SENT):
            self.tracker.record(str(func.overloadpacket), args, kwargs)
        return func(*args, **kwargs)


class Tracker:
    """``with Tracker() as t: ...``; then ``t.calls`` (op and caller -> count) and
    ``t.violations`` (host tensors handed to a collective outside the control group)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.violations: list[dict[str, Any]] = []
        self._modes = (_Origins(), _Collectives(self))

    def record(self, op: str, args: tuple, kwargs: dict) -> None:
        where = _caller()
        self.calls[f"{op} @ {where}"] += 1
        group = _group_name(args)
        if group is None:  # functional collectives name their group with a string argument
            group = next((a for a in args if isinstance(a, str)), None)
        if group is not None and group == _control_group_name():
            return
        hosts = [t for t in tree_leaves((args, kwargs)) if origin(t) == HOST]
        if hosts:
            shapes = [list(t.shape) for t in hosts]
            self.violations.append({"op": op, "where": where, "group": group, "host": shapes})

    def __enter__(self) -> Tracker:
        self._stack = contextlib.ExitStack()
        for mode in self._modes:
            self._stack.enter_context(mode)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.__exit__(*exc)


def _dump_folder(argv: list[str]) -> str:
    return argv[argv.index("--dump_folder") + 1]


if __name__ == "__main__":
    from torchtitan_cp.run.process_exit import exit_process
    from torchtitan_cp.train import run_worker

    argv = sys.argv[1:]
    with Tracker() as tracker:
        code = run_worker(argv)
    rank = int(os.environ.get("RANK", "0"))
    path = os.path.join(_dump_folder(argv), f"collective_devices_rank{rank}.json")
    with open(path, "w") as f:
        json.dump({"calls": dict(tracker.calls), "violations": tracker.violations}, f, indent=1)
    exit_process(code)
