"""The ``slow`` marker's rule, as a pytest plugin: a test that starts a process must carry it.

While a test runs (setup and call), every way of starting a process is recorded:
``subprocess.Popen`` (``subprocess.run`` and friends), ``multiprocessing``'s ``Process.start``
(``run_distributed``'s gloo ranks), ``os.fork``, ``os.forkpty``, ``os.system`` and
``os.posix_spawn*``, when the code that asked for it is ours (a test, a test helper, the
package, a script), not a third-party library's internals (matplotlib's font cache, say): the
first caller outside the standard library and ``torch.multiprocessing`` decides. A test without
the ``slow`` marker (on the function, its class or its module's ``pytestmark``) that started one
fails, naming what it started; ``pytest -m "not slow"`` therefore stays the fast in-process loop. tests/conftest.py loads this plugin; a pytest session
run inside a test (``pytester``) loads it with ``-p tests.process_starts`` and records into its
own test, not the outer one.
"""

from __future__ import annotations

import functools
import multiprocessing.process
import os
import subprocess
import sys
from types import FrameType
from typing import Any

import pytest

SLOW = "slow"

# One list per running test, innermost last: what that test started.
_RUNNING: list[list[str]] = []


def _asked_by_us(frame: FrameType | None) -> bool:
    """Whether the first caller outside the standard library (and torch's multiprocessing
    wrappers) is code of this repository rather than an installed package."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.split(".")[0] in sys.stdlib_module_names or name.startswith(
            "torch.multiprocessing"
        ):
            frame = frame.f_back
            continue
        path = frame.f_code.co_filename
        return "site-packages" not in path and "dist-packages" not in path
    return False


def _recording(what: str, start: Any) -> Any:
    @functools.wraps(start)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _RUNNING and _asked_by_us(sys._getframe(1)):
            _RUNNING[-1].append(what)
        return start(*args, **kwargs)

    wrapper.__records_process_starts__ = True  # type: ignore[attr-defined]
    return wrapper


def _patch(owner: Any, name: str, what: str) -> None:
    start = getattr(owner, name, None)
    if start is not None and not getattr(start, "__records_process_starts__", False):
        setattr(owner, name, _recording(what, start))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{SLOW}: multi-process, end-to-end or interpreted-kernel tests (every test that starts "
        "a process carries it)",
    )
    _patch(subprocess.Popen, "__init__", "subprocess.Popen")
    _patch(multiprocessing.process.BaseProcess, "start", "multiprocessing Process.start")
    for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
        _patch(os, name, f"os.{name}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _RUNNING.append([])
    try:
        return (yield)
    finally:
        _RUNNING.pop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    started = _RUNNING[-1] if _RUNNING else []
    if report.when == "call" and report.passed and started and not item.get_closest_marker(SLOW):
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} starts a process ({started[0]}) but is not marked "
            f"@pytest.mark.{SLOW}: mark it (or its module: pytestmark = [pytest.mark.{SLOW}])"
        )
    return report
