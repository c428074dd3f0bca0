"""How a rank's process ends: as Python would, up to its ``atexit`` handlers, then ``os._exit``.

When the trainer returns, its own work is done and closed (process group destroyed, checkpoint,
metrics and wandb closed), but threads of other libraries are still alive: gloo's worker and
socket threads (a DeviceMesh submesh keeps each rank's two gloo backends past
``destroy_process_group``), autograd's device threads, daemon threads in torch's C++ with the
GIL released. Once Python's finalization has begun, a thread that takes the GIL again is ended
by CPython with ``pthread_exit``; unwinding through a C++ ``noexcept`` frame (pybind11's GIL
guards) aborts the whole process: "terminate called without an active exception", SIGABRT
after "Process group destroyed", and torchrun reports a finished run as failed (seen twice in
CI, on rank 1 of 2-rank CPU runs; tests/test_process_exit.py builds the same abort). Leaving
before finalization removes that window; nothing the run wrote is lost, because everything
Python runs before it (threading's shutdown, the ``atexit`` handlers: logging, wandb,
multiprocessing) still runs, and C's stdio buffers are flushed (``os._exit`` skips libc's
``exit``, which would flush them: NCCL_DEBUG's lines and any C++ ``printf`` to a pipe or file
would be lost).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading
from typing import NoReturn


def exit_process(status: int) -> NoReturn:
    """End this process with ``status`` without interpreter finalization: run what ``sys.exit``
    runs before it (threading's shutdown, the ``atexit`` handlers, a flush of stdout/stderr),
    flush C's stdio as libc's ``exit`` would, then ``os._exit(status)``. Call it from the main
    thread."""
    # What Py_FinalizeEx runs first, in its order: threading's own exit callbacks (they stop
    # concurrent.futures' idle workers, which a plain join would wait on forever), then the
    # joins of the non-daemon threads; then the atexit handlers.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to save
            pass
    _flush_c_stdio()
    os._exit(status)


def _flush_c_stdio() -> None:
    """``fflush(NULL)``: every open C stdio stream (what libc's ``exit`` does first)."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to load: nothing of it to flush
        pass
