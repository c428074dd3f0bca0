"""A collective that timed out because another rank stopped: one line naming that rank.

gloo raises ``RuntimeError("... Timed out waiting Nms for recv operation ...")`` on each rank that
waited, and closes the group's connections, so the ranks cannot ask each other over it. They meet
on the job's key-value store instead (torchrun's agent holds it, so it outlives any rank): each
rank that timed out posts its number and waits ``grace`` seconds for the others; the ranks that
did not post are the ones that stopped, hung or died. (NCCL's watchdog aborts the process
instead of raising: there torchrun's failure report names the ranks.)
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

from torchtitan_cp.run.errors import RankTimeoutError

_MARKERS = ("Timed out waiting", "Application timeout caused pair closure")


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is a gloo collective that waited past its group's timeout."""
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _MARKERS)


def _default_store() -> Any:
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # no process group, or a torch without the helper
        return None


def silent_ranks(store: Any, rank: int, world: int, *, grace: float) -> list[int] | None:
    """Post ``rank`` on ``store`` and return the ranks that did not post within ``grace``
    seconds (the others that timed out post theirs at about the same moment); None when the
    store cannot be reached."""
    if store is None:
        return None
    prefix = f"torchtitan_cp/timed_out/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    try:
        store.set_timeout(timedelta(seconds=max(grace, 1.0)))
        store.set(f"{prefix}/{rank}", "1")
        deadline = time.monotonic() + grace
        while True:
            missing = [r for r in range(world) if not store.check([f"{prefix}/{r}"])]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.1)
    except Exception:  # the store's host is the stopped process (launches without torchrun)
        return None


def timeout_error(
    rank: int, world: int, *, key: str, seconds: float, store: Any = None, grace: float = 10.0
) -> RankTimeoutError:
    """The one-line error for a collective of this rank that timed out after ``seconds``
    (the config ``key`` that set them)."""
    missing = silent_ranks(
        store if store is not None else _default_store(),
        rank,
        world,
        grace=min(grace, max(seconds, 1.0)),
    )
    waited = f"within {seconds:g} s ({key})"
    if missing is None:
        return RankTimeoutError(
            f"rank {rank}: a collective got no answer {waited}: another rank stopped, hung or "
            "died; see the other ranks' output, then resume from the last checkpoint"
        )
    if not missing:
        return RankTimeoutError(
            f"rank {rank}: every rank timed out {waited} in the same collective: an operation "
            f"slower than the timeout; raise --{key}"
        )
    names = ", ".join(map(str, missing))
    return RankTimeoutError(
        f"rank {rank}: no answer from rank {names} {waited}: it stopped, hung or died; see "
        f"its output (LOG_RANK={missing[0]}), then resume from the last checkpoint"
    )
