"""pytest plugin of scripts/gpu_check.py's tests stage (``-p gpu_check_pytest``): flex attention
compiled without max_autotune, as in the other stages (loaded by every xdist worker too)."""

from __future__ import annotations

from typing import Any


def pytest_configure(config: Any) -> None:
    import torch

    if torch.cuda.is_available():
        from gpu_check import no_flex_max_autotune

        no_flex_max_autotune()
