"""Session set-up: the ``fla_interpreter`` tier (tests/fla_interpreter.py).

fla's kernels must be imported after Triton's interpreter is on, and test modules import fla at
collection, so the interpreter is installed here, before collection, whenever the ``-m``
expression can select the tier. ``-m "not slow"`` (the fast loop) and ``-m "not
fla_interpreter"`` leave this process untouched.
"""

from __future__ import annotations

import fla_interpreter
import pytest

TIER_MARKS = {"fla_interpreter", "slow"}  # every test of the tier carries both


def _tier_selected(config: pytest.Config) -> bool:
    expr = config.getoption("markexpr", "") or ""
    if not expr:
        return True
    try:  # pytest's own -m evaluator (private, stable since pytest 6); unsure: select
        from _pytest.mark.expression import Expression

        return Expression.compile(expr).evaluate(lambda name, **_: name in TIER_MARKS)
    except Exception:
        return True


def pytest_configure(config: pytest.Config) -> None:
    if _tier_selected(config):
        fla_interpreter.install()


@pytest.fixture
def interpreter_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """A normal run's view of Triton in a process where the tier turned its interpreter on."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
