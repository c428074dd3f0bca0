"""The gloo control group of a run and its collectives: rank 0 decides, every rank gets the same
answer or raises the same ``RunError`` (start of a run, resume planning, manifests).

Every function takes the group ``pg`` (None: one process, no torch.distributed), so the same
code runs in one process and under torchrun.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from torchtitan_cp.run.errors import RunError

__all__ = [
    "CONTROL_TIMEOUT",
    "all_gather",
    "barrier",
    "broadcast",
    "control_group",
    "group_rank",
    "group_size",
    "on_rank0",
    "set_control_timeout",
]

_CONTROL_GROUP: tuple[Any, Any] | None = None  # (the default group it belongs to, the group)
CONTROL_TIMEOUT = timedelta(seconds=300)
"""The control group's timeout when the caller names none (torchtitan's default
``comm.init_timeout_seconds``); the trainer passes its ``comm.init_timeout_seconds``."""


def control_group(timeout: timedelta | None = None) -> Any:
    """A gloo group for checkpoint control: resume planning, verification and manifests (rank 0
    decides, the ranks hash shares). Its timeout is ``timeout`` (the run's
    ``comm.init_timeout_seconds``), so a stopped rank ends a resume within it instead of hanging
    the others. Every rank must make the first call at the same point; later calls return it.
    None without torch.distributed. A new default group (a second trainer in the same process,
    after ``destroy_process_group``) gets a new one."""
    global _CONTROL_GROUP
    if not dist.is_initialized():
        return None
    world = dist.group.WORLD
    if _CONTROL_GROUP is None or _CONTROL_GROUP[0] is not world:
        group = dist.new_group(backend="gloo", timeout=timeout or CONTROL_TIMEOUT)
        _CONTROL_GROUP = (world, group)
    return _CONTROL_GROUP[1]


def set_control_timeout(timeout: timedelta) -> None:
    """Set the control group's timeout (a no-op without one). The checkpointer sets
    ``comm.train_timeout_seconds`` once training runs, so a rank stopped during a save (clearing
    the step, the manifest) ends the others within the bound of a training step and the line
    names that key; it kept ``comm.init_timeout_seconds`` (300 s) before. Every rank calls it at
    the same point, after the collectives that the longer timeout was for."""
    pg = control_group()
    if pg is not None:
        dist.set_timeout(timeout, pg)


def group_rank(pg: Any) -> int:
    """This process's rank in ``pg`` (0 without one)."""
    return dist.get_rank(pg) if pg is not None else 0


def group_size(pg: Any) -> int:
    """The ranks of ``pg`` (1 without one)."""
    return dist.get_world_size(pg) if pg is not None else 1


def broadcast(obj: Any, pg: Any) -> Any:
    """Rank 0's ``obj`` on every rank of ``pg``."""
    if pg is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
    return box[0]


def all_gather(obj: Any, pg: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    if pg is None:
        return [obj]
    out: list[Any] = [None] * group_size(pg)
    dist.all_gather_object(out, obj, group=pg)
    return out


def barrier(pg: Any) -> None:
    """Wait for every rank of ``pg``."""
    if pg is not None:
        dist.barrier(group=pg)


def on_rank0(fn: Any, pg: Any) -> Any:
    """Run ``fn()`` on rank 0; every rank gets its result, or raises the same
    ``RunError`` rank 0 raised (so all ranks stop with one identical line)."""
    result: Any = None
    error: RunError | None = None
    if group_rank(pg) == 0:
        try:
            result = fn()
        except RunError as e:
            error = e
    result, error = broadcast((result, error), pg)
    if error is not None:
        raise error
    return result
