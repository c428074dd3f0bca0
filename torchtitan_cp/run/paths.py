"""What a run's folders allow, probed for real: the nearest folder that exists on a path, and
whether a new file can be written in a folder. The probe writes a file: ``os.access`` says yes
to root on read-only mounts. The pre-launch check (``trainer/validate.py``), the start of a run
(``run.resume.check_writable``) and the disk-full error of a save use these."""

from __future__ import annotations

import os
import tempfile

__all__ = ["existing_parent", "probe_write"]


def existing_parent(path: str) -> str:
    """``path`` when it exists, else its nearest existing parent (``"."`` for a relative path
    none of whose parts exist)."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    return path or "."


def probe_write(folder: str) -> None:
    """Create (and drop) a new file in the existing ``folder``; raises the OSError if that
    fails."""
    with tempfile.TemporaryFile(dir=folder, prefix=".write-probe-"):
        pass
