"""Many trainer launches from one process that imports the trainer once (tests only).

A rank process of a ``torchrun`` launch spends about 5 s of CPU importing torch, torchtitan and
the recipe before it trains, and torchrun's agent about 3 s more per launch: a parity table of
20 rank processes pays that more than 20 times, most of its cost. Here one process imports the
trainer once and forks each launch's ranks from itself. Every rank is still its own process with
its own gloo process group, running the real entry point (``torchtitan_cp.train.main``) on the
real TOML and command line, in the environment torchrun gives a rank (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); launches run one after
another, each from the imported state only. What this does not exercise is torchrun itself (its
agent, rendezvous and error files): the launches of tests/test_train.py do.

Forking is safe because this process computes nothing and starts no thread of its own before it
forks (one OpenMP thread, ``OMP_NUM_THREADS=1`` as torchrun sets it). The one thread a library
starts at import, pyarrow's jemalloc purger, is fork-safe: jemalloc takes and releases its locks
around ``fork`` itself. Any other thread stops the launcher before it forks.

    python -m tests.fork_launch JOBS.json

``JOBS.json``: a list of ``{"args": [...], "nproc": N, "dump_folder": PATH}``, optionally with
``"copy_from": PATH`` (copied to ``dump_folder`` first, e.g. to resume another run's
checkpoint) and ``"remove": [PATH, ...]`` (relative to ``dump_folder``, removed after the copy), and
``"entry": "module:function"`` (called in each rank instead of ``torchtitan_cp.train.main``, with
the same arguments, e.g. ``tests.host_syncs:main``).
Rank ``r``'s output goes to ``DUMP_FOLDER.rank<r>.log``. Prints one line per launch with the
CPU time (user + system) of its ranks; on the first failed launch it kills that launch's other
ranks, prints their logs' tails on stderr and exits 1.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

from tests.dist_utils import free_port

TIMEOUT_S = 600


def _preload(jobs: list[dict]) -> None:
    """Import what every rank imports (torch, torchtitan, the recipe, each job's model), in
    this process, once: the forked ranks inherit it."""
    from torchtitan_cp import compat

    compat.apply()
    import torchtitan_cp.trainer.trainer  # noqa: F401  (torchtitan's trainer, the loaders)
    from torchtitan_cp.train import load_config

    seen = set()
    for job in jobs:
        key = json.dumps(job["args"])
        if key not in seen:
            seen.add(key)
            load_config([*job["args"], "--dump_folder", job["dump_folder"]])


# Threads that may run in the launcher when it forks (see above): pyarrow's jemalloc purger
FORK_SAFE_THREADS = {"jemalloc_bg_thd"}


def _unsafe_threads() -> list[str]:
    """Names of this process's threads other than the main one and the fork-safe ones."""
    names = [
        Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        for tid in os.listdir("/proc/self/task")
        if int(tid) != os.getpid()
    ]
    return [n for n in names if n not in FORK_SAFE_THREADS]


def _rank(job: dict, rank: int, port: int) -> None:
    """In the forked child: become rank ``rank`` of the launch and run the entry point."""
    from torchtitan_cp.run.process_exit import exit_process
    from torchtitan_cp.train import main

    nproc = job["nproc"]
    log = os.open(f"{job['dump_folder']}.rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if job.get("entry"):  # "module:function", called as main is (e.g. tests.host_syncs:main)
        module, name = job["entry"].split(":")
        main = getattr(importlib.import_module(module), name)
    try:
        status = main([*job["args"], "--dump_folder", job["dump_folder"]])
    except BaseException:
        traceback.print_exc()
        status = 1
    exit_process(status)


def _launch(job: dict) -> float:
    """Fork the launch's ranks, wait for all of them; their CPU seconds. Raises on a failure."""
    dump = Path(job["dump_folder"])
    if job.get("copy_from"):
        shutil.copytree(job["copy_from"], dump)
        for sub in job.get("remove", []):
            shutil.rmtree(dump / sub)
    unsafe = _unsafe_threads()
    if unsafe:
        raise RuntimeError(f"threads {unsafe} run in the launcher: forking is not safe")
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for rank in range(job["nproc"]):
        pid = os.fork()
        if pid == 0:
            _rank(job, rank, port)
        pids[pid] = rank
    cpu, failed, deadline = 0.0, [], time.monotonic() + job.get("timeout", TIMEOUT_S)
    waiting = dict(pids)
    while waiting:
        pid, status, usage = os.wait4(-1, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:
                failed.append(f"timed out after {job.get('timeout', TIMEOUT_S)} s")
                break
            time.sleep(0.2)
            continue
        rank = waiting.pop(pid)
        cpu += usage.ru_utime + usage.ru_stime
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            failed.append(f"rank {rank} exited with {code}")
            break
    if failed:
        for pid in waiting:
            os.kill(pid, signal.SIGKILL)
        for pid in waiting:
            os.waitpid(pid, 0)
        for rank in range(job["nproc"]):
            text = Path(f"{dump}.rank{rank}.log").read_text(errors="replace")
            print(f"--- {dump.name} rank {rank} ---\n{text[-6000:]}", file=sys.stderr)
        raise RuntimeError(f"{dump.name}: {'; '.join(failed)}")
    return cpu


def main(path: str) -> int:
    jobs = json.loads(Path(path).read_text())
    start = time.process_time()
    _preload(jobs)
    print(f"preload: {time.process_time() - start:.1f} s CPU", flush=True)
    for job in jobs:
        try:
            cpu = _launch(job)
        except RuntimeError as e:
            print(f"fork_launch: {e}", file=sys.stderr)
            return 1
        print(f"{Path(job['dump_folder']).name}: {job['nproc']} ranks, {cpu:.1f} s CPU", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
