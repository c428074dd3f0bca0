"""run.process_exit: a rank leaves before interpreter finalization, so a thread that returns
from torch's C++ into Python at exit cannot abort a finished run.

The hazard, built on purpose: a daemon thread, started by the last ``atexit`` handler, waits in
torch's C++ (``TCPStore.wait``, GIL released) and returns while a slow module teardown
(``__del__`` sleeping) holds the interpreter in finalization. That is what aborted finished 2-rank trainer runs in CI (SIGABRT, "terminate
called without an active exception" after "Process group destroyed").
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.launch import REPO, repo_env

pytestmark = [pytest.mark.slow]

# Imported first by each script below, so its atexit handler runs last, just before the
# interpreter finalizes: the thread returns 0.5 s later, while the teardown lasts 3 s.
HAZARD = """
import atexit, datetime, threading, time
import torch.distributed as dist

_store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))


def _wait_in_cpp():
    try:
        _store.wait(["never set"], datetime.timedelta(seconds=0.5))
    except Exception:  # the timeout: the thread goes back into Python here
        pass


class _SlowTeardown:
    def __del__(self, sleep=time.sleep):
        sleep(3.0)


teardown = _SlowTeardown()
atexit.register(lambda: threading.Thread(target=_wait_in_cpp, daemon=True).start())
"""

SCRIPT = """
import atexit, concurrent.futures, sys, threading, time
import hazard

atexit.register(lambda: print("atexit handler ran"))
threading.Thread(target=lambda: (time.sleep(0.3), print("non-daemon thread joined"))).start()
# An executor left open, as compile workers leave theirs: its idle worker must not hold the exit.
pool = concurrent.futures.ThreadPoolExecutor(1)
pool.submit(print, "executor worker ran").result()
print("buffered, never flushed by the script")
{leave}
"""

ABORT = "terminate called without an active exception"


def _run(tmp_path, code: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "hazard.py").write_text(HAZARD)
    env = repo_env(PYTHONPATH=f"{tmp_path}:{REPO}")
    cmd = [sys.executable, "-c", code, *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("leave", ["sys.exit(3)", "exit_process(3)"])
def test_exit_process_leaves_before_finalization_and_loses_nothing(tmp_path, leave):
    """``sys.exit`` (the control): the thread returns during finalization and the process
    aborts. ``exit_process``: status 3, the non-daemon thread joined, an open executor's idle
    worker not waited on, the ``atexit`` handler run, stdout flushed, no abort."""
    code = SCRIPT.format(leave=leave)
    if leave.startswith("exit_process"):
        code = "from torchtitan_cp.run.process_exit import exit_process\n" + code
    proc = _run(tmp_path, code)
    if leave.startswith("sys.exit"):
        assert proc.returncode == -signal.SIGABRT and ABORT in proc.stderr, proc.stderr[-2000:]
        return
    assert proc.returncode == 3 and ABORT not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines == [
        "executor worker ran",
        "buffered, never flushed by the script",
        "non-daemon thread joined",
        "atexit handler ran",
    ], proc.stdout


def test_trainer_entry_point_leaves_through_exit_process(tmp_path):
    """``python -m torchtitan_cp.train`` with the hazard loaded first: its status (0, the
    ``--check`` of the debug config) and no abort (on ``sys.exit(main())``: SIGABRT)."""
    code = "import hazard, runpy; runpy.run_module('torchtitan_cp.train', run_name='__main__')"
    args = ["--check", "--nproc", "2", "--config_file", "configs/debug_cpu.toml"]
    proc = _run(tmp_path, code, *args, "--dump_folder", str(tmp_path / "run"))
    assert proc.returncode == 0 and ABORT not in proc.stderr, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "2", proc.stdout


def test_exit_process_flushes_c_stdio_into_a_pipe():
    """A C-level ``printf`` into a pipe (fully buffered, as NCCL_DEBUG's lines are under
    torchrun) reaches the reader: ``exit_process`` flushes C stdio before ``os._exit``, which
    skips libc's own flush (``os._exit`` alone: the line is lost)."""
    code = (
        "import ctypes\n"
        "from torchtitan_cp.run.process_exit import exit_process\n"
        "ctypes.CDLL(None).printf(b'NCCL INFO from C\\n')\n"
        "exit_process(0)\n"
    )
    env = repo_env()
    env.pop("PYTHONUNBUFFERED", None)  # set, Python would make C's stdout unbuffered too
    cmd = [sys.executable, "-c", code]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "NCCL INFO from C\n", (proc.stdout, proc.stderr[-2000:])
