"""One run per dump folder: an exclusive ``fcntl.flock`` on ``<dump_folder>/run.lock``.

Rank 0 holds the lock for the run's lifetime. The kernel drops an ``flock`` when its holder's
file descriptor closes, also when the process is killed, so a lock we can take is never held by a
live run. The file records its holder (host, pid, start time, run id) for the refusal message; a
clean release empties it, so a non-empty file found with the lock free was left by a run that
died: that lock is taken over, with a line saying whose it was.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import socket
import time
from typing import IO, Any

from torchtitan_cp.run.errors import RunError

LOCK_FILE = "run.lock"


def new_run_id() -> str:
    """A sortable, unique run id: UTC start time plus 6 random hex digits."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "holder unknown (it is still starting)"
    return (
        f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, "
        f"started {holder.get('start_time', '?')}, run {holder.get('run_id', '?')}"
    )


def _read_holder(f: IO[str]) -> dict[str, Any]:
    f.seek(0)
    text = f.read().strip()
    if not text:
        return {}
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        return {"pid": "?", "host": "?", "start_time": "?", "run_id": text[:60]}
    return holder if isinstance(holder, dict) else {}


class RunLock:
    """The dump folder's run lock. ``acquire`` raises ``RunError`` naming the holder when
    another live run holds it; ``release`` (or process exit) frees it."""

    def __init__(self, dump_folder: str) -> None:
        self.dump_folder = dump_folder
        self.path = os.path.join(dump_folder, LOCK_FILE)
        self._f: IO[str] | None = None

    @property
    def held(self) -> bool:
        return self._f is not None

    def acquire(self, run_id: str, start_time: str) -> str | None:
        """Take the lock; returns a line to log when a stale lock was taken over, else None."""
        try:
            os.makedirs(self.dump_folder, exist_ok=True)
            f = open(self.path, "a+")  # noqa: SIM115 - held open for the run's lifetime
        except OSError as e:
            raise RunError(
                f"dump folder {self.dump_folder} is not writable (cannot create {LOCK_FILE}: "
                f"{e.strerror}); pass a writable --dump_folder"
            ) from None
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(f)
            f.close()
            raise RunError(
                f"dump folder {self.dump_folder} is in use by another run ({_describe(holder)}; "
                f"lock {self.path}): wait for it to finish or pass another --dump_folder"
            ) from None
        stale = _read_holder(f)
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "start_time": start_time,
            "run_id": run_id,
        }
        f.seek(0)
        f.truncate()
        f.write(json.dumps(me) + "\n")
        f.flush()
        os.fsync(f.fileno())
        self._f = f
        if stale:
            return (
                f"took over the stale run lock {self.path} left by {_describe(stale)} "
                "(that process is gone)"
            )
        return None

    def release(self) -> None:
        """Empty the file (a clean end, not a stale lock) and drop the lock."""
        f, self._f = self._f, None
        if f is None:
            return
        try:
            f.seek(0)
            f.truncate()
            f.flush()
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            f.close()
