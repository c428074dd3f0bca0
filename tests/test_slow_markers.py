"""The ``slow`` marker's rule (tests/process_starts.py): a test that starts a process without the
marker fails. Each case below runs in a pytest session inside this test (``pytester``, in this
process); its "process starts" fail before anything is forked, so this test starts nothing."""

from __future__ import annotations

pytest_plugins = ["pytester"]

CASES = """
import multiprocessing
import subprocess

import pytest


class _NoStart(multiprocessing.Process):
    # Process.start is recorded, then this fails before any fork or spawn.
    @staticmethod
    def _Popen(process_obj):
        raise OSError("not started")


def popen():
    with pytest.raises(TypeError):
        subprocess.Popen(123)  # recorded, then rejected before any fork


def spawn():
    with pytest.raises(OSError):
        _NoStart(target=print).start()


@pytest.fixture
def started():
    popen()


def test_popen():
    popen()


def test_spawn():
    spawn()


def test_through_fixture(started):
    pass


class TestGroup:
    def test_method(self):
        popen()


@pytest.mark.slow
def test_marked():
    popen()
    spawn()


def test_in_process():
    pass
"""


def test_unmarked_process_starts_fail_and_marked_ones_pass(pytester, monkeypatch) -> None:
    # One inner session: the cases as they are, and again under a module-level slow marker.
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # a bare session starts faster
    pytester.makepyfile(
        test_cases=CASES,
        test_slow_module="import pytest\npytestmark = [pytest.mark.slow]\n" + CASES,
    )
    result = pytester.runpytest_inprocess("-p", "tests.process_starts", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2 + 6, failed=4)
    result.stdout.fnmatch_lines_random(
        [
            "*test_cases.py::test_popen starts a process (subprocess.Popen) but is not marked "
            "@pytest.mark.slow*",
            "*test_cases.py::test_spawn starts a process (multiprocessing Process.start) but is "
            "not marked*",
            "*test_cases.py::test_through_fixture starts a process (subprocess.Popen)*",
            "*test_cases.py::TestGroup::test_method starts a process (subprocess.Popen)*",
        ]
    )
