"""``python -m torchtitan_cp.checkpoint verify|seal STEP_DIR``: the checkpoint manifest CLI.

``verify`` checks a step folder (or every step of a checkpoint folder) against its manifest
(``run.manifest.check_step``, the resume's own check); ``seal`` writes a manifest for a step
you trust (a checkpoint written by plain torchtitan) once it checked that the folder loads.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from torchtitan_cp.run.manifest import (
    MANIFEST,
    check_step,
    dcp_layout_problem,
    read_manifest,
    write_manifest,
)
from torchtitan_cp.run.resume import STEP_RE, scan_steps


def _err(message: str) -> None:
    print(f"checkpoint: error: {message}", file=sys.stderr)


def _verify(step_dir: str) -> int:
    begin = time.monotonic()
    problem = check_step(step_dir)
    if problem:
        _err(f"{step_dir}: {problem}")
        return 1
    manifest, _ = read_manifest(step_dir)
    n = len(manifest["files"]) if manifest else 0
    print(
        f"{step_dir}: ok ({n} files match the manifest and load; {time.monotonic() - begin:.2f} s)"
    )
    return 0


def _seal(step_dir: str) -> int:
    if os.path.exists(os.path.join(step_dir, MANIFEST)):
        _err(f"{step_dir} already has a {MANIFEST}")
        return 2
    problem = dcp_layout_problem(step_dir)
    if problem:
        _err(f"will not seal {step_dir}: {problem}")
        return 2
    m = STEP_RE.fullmatch(os.path.basename(step_dir))
    manifest = write_manifest(step_dir, step=int(m.group(1)) if m else -1, run_id="sealed")
    files = manifest["files"]
    checked = (
        ".metadata loads and every byte range it lists lies inside its file"
        if os.path.isfile(os.path.join(step_dir, ".metadata"))
        else "every *.safetensors header matches its file's length"
    )
    size = sum(f["bytes"] for f in files.values()) / 2**20
    print(f"{step_dir}: wrote {MANIFEST} ({len(files)} files, {size:.1f} MiB); checked: {checked}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_cp.checkpoint",
        description="Check a checkpoint step folder (or every step of a checkpoint folder) "
        "against its manifest, or write a manifest for a step folder you trust (e.g. saved by "
        "plain torchtitan) once it checks that the folder loads.",
    )
    p.add_argument("command", choices=["verify", "seal"])
    p.add_argument("step_dir")
    args = p.parse_args(argv)
    step_dir = args.step_dir.rstrip("/") or "/"
    if not os.path.isdir(step_dir):
        _err(f"{step_dir} is not a folder")
        return 2
    steps = scan_steps(step_dir)
    if steps and not os.path.exists(os.path.join(step_dir, MANIFEST)):
        # The checkpoint folder itself: verify each step; seal one step at a time.
        names = ", ".join(os.path.basename(s.path) for s in steps)
        if args.command == "seal":
            _err(f"{step_dir} is a checkpoint folder ({names}); seal one step: {steps[-1].path}")
            return 2
        print(f"{step_dir}: a checkpoint folder with {len(steps)} step(s): {names}")
        return max(_verify(s.path) for s in steps)
    if not os.listdir(step_dir):
        _err(f"{step_dir} is empty: not a checkpoint step")
        return 2
    return _verify(step_dir) if args.command == "verify" else _seal(step_dir)


if __name__ == "__main__":
    sys.exit(main())
