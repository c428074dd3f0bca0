"""One run per dump folder: an exclusive ``fcntl.flock`` on ``<dump_folder>/run.lock``, and on
``<checkpoint folder>/run.lock`` when a run saves checkpoints (so a run whose absolute
``--checkpoint.folder`` is another live run's is refused before it loads anything).

Rank 0 holds the lock for the run's lifetime. The kernel drops an ``flock`` when its holder's
file descriptor closes, also when the process is killed, so a lock we can take is never held by a
live run. The file records its holder (host, pid, start time, run id) for the refusal message; a
clean release empties it, so a non-empty file found with the lock free was left by a run that
died: that lock is taken over, with a line saying whose it was, once the record shows the holder
is gone (same host, and its pid is not running or belongs to a process started later). A record
naming another host, or a pid of this host that still runs, is refused naming it: the user
deletes the file once that run is over.
"""

from __future__ import annotations

import calendar
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


def _process_start(pid: int) -> float | None:
    """When process ``pid`` of this host started (seconds since the epoch), from /proc; None
    when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _lock_time(holder: dict[str, Any]) -> float | None:
    try:
        return calendar.timegm(time.strptime(str(holder.get("start_time")), "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError:
        return None


def _live_holder(holder: dict[str, Any], path: str) -> str | None:
    """Why a lock record whose flock is free may still belong to a running run, or None when
    its holder is gone. The kernel frees an flock when its holder dies, but only for holders on
    this host (locks on network filesystems are not shared across hosts everywhere), and a pid
    may be reused by a later process."""
    host = holder.get("host")
    if host != socket.gethostname():
        return (
            f"a run on another host ({host}): this host cannot tell whether it still runs "
            "(file locks are not shared across hosts on every filesystem)"
        )
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0 or pid == os.getpid() or not _alive(pid):
        return None
    started, locked = _process_start(pid), _lock_time(holder)
    if started is not None and locked is not None and started > locked + 2:
        return None  # the pid now belongs to a process started after the lock was taken
    return f"and process {pid} is still running on this host without holding the lock"


def _gone(holder: dict[str, Any]) -> str:
    pid = holder.get("pid")
    if isinstance(pid, int) and pid > 0 and pid != os.getpid() and _alive(pid):
        return f"pid {pid} now belongs to a process started after that run"
    return "that process is gone"


class RunLock:
    """A folder's run lock (the dump folder's, or the checkpoint folder's with
    ``what="checkpoint folder"``, ``option="--checkpoint.folder"``). ``acquire`` raises
    ``RunError`` naming the holder when another live run holds it; ``release`` (or process
    exit) frees it."""

    def __init__(
        self, dump_folder: str, *, what: str = "dump folder", option: str = "--dump_folder"
    ) -> None:
        self.dump_folder = dump_folder
        self.path = os.path.join(dump_folder, LOCK_FILE)
        self.what, self.option = what, option
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
                f"{self.what} {self.dump_folder} is not writable (cannot create {LOCK_FILE}: "
                f"{e.strerror}); pass a writable {self.option}"
            ) from None
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(f)
            f.close()
            raise RunError(
                f"{self.what} {self.dump_folder} is in use by another run ({_describe(holder)}; "
                f"lock {self.path}): wait for it to finish or pass another {self.option}"
            ) from None
        stale = _read_holder(f)
        refusal = _live_holder(stale, self.path) if stale else None
        if refusal is not None:
            f.close()
            raise RunError(
                f"{self.what} {self.dump_folder}: its lock {self.path} names "
                f"{_describe(stale)}, {refusal}; if that run is over, delete {self.path}; else "
                f"wait for it or pass another {self.option}"
            )
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
                f"({_gone(stale)})"
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
