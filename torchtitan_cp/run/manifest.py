"""Checkpoint manifests: write, read and verify a step folder (torchtitan's DCP format is
unchanged).

Every save ends with ``step-N/manifest.sha256.json``: the sha256 and size of each file in the
step folder, written by rank 0 after all ranks finished writing, under a temporary name and then
renamed, so a step folder without a valid manifest is an incomplete save. Ranks hash disjoint
shares of the files (parallel I/O) and rank 0 merges them. A manifest of any wrong shape makes
its step incomplete, like a missing one; a step must also load (``dcp_layout_problem``: every
byte range DCP's ``.metadata`` lists lies inside its file; a Hugging Face folder's safetensors
headers match their files' lengths, ``safetensors_problem``).

Imports no torchtitan: the models' HF folder checks read safetensors files with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from typing import Any

from torchtitan_cp.run.control import (
    all_gather,
    barrier,
    broadcast,
    group_rank,
    group_size,
    on_rank0,
)
from torchtitan_cp.run.errors import CheckpointError

__all__ = [
    "MANIFEST",
    "MANIFEST_FORMAT",
    "check_step",
    "dcp_layout_problem",
    "file_sha256",
    "list_files",
    "manifest_problem",
    "read_manifest",
    "safetensors_problem",
    "write_manifest",
]

MANIFEST = "manifest.sha256.json"
MANIFEST_FORMAT = "torchtitan_cp.checkpoint-manifest/1"
_CHUNK = 8 << 20


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def list_files(step_dir: str) -> list[str]:
    """Files under ``step_dir`` (relative, sorted), leaving out the manifest and its temp files."""
    out = []
    for root, _, names in os.walk(step_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), step_dir)
            if not rel.startswith(MANIFEST):
                out.append(rel)
    return sorted(out)


def _hash_share(step_dir: str, files: list[str], pg: Any) -> dict[str, dict[str, Any]]:
    """sha256 and size of ``files``; rank r hashes files r, r + world, ... (all ranks call)."""
    mine = {}
    for rel in files[group_rank(pg) :: group_size(pg)]:
        path = os.path.join(step_dir, rel)
        try:
            mine[rel] = {"sha256": file_sha256(path), "bytes": os.path.getsize(path)}
        except OSError as e:
            mine[rel] = {"error": e.strerror or str(e)}
    merged: dict[str, dict[str, Any]] = {}
    for part in all_gather(mine, pg):
        merged.update(part)
    return merged


def write_manifest(step_dir: str, *, step: int, run_id: str, pg: Any = None) -> dict[str, Any]:
    """Hash every file of a finished save and write the manifest atomically (all ranks call,
    after all ranks finished writing the step)."""
    barrier(pg)
    files = broadcast(list_files(step_dir) if group_rank(pg) == 0 else None, pg)
    digests = _hash_share(step_dir, files, pg)
    manifest = {
        "format": MANIFEST_FORMAT,
        "step": step,
        "run_id": run_id,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": digests,
    }

    def write() -> None:
        bad = {k: v["error"] for k, v in digests.items() if "error" in v}
        if bad:
            raise CheckpointError(f"checkpoint {step_dir}: cannot read back saved files: {bad}")
        tmp = os.path.join(step_dir, f"{MANIFEST}.tmp-{os.getpid()}")
        try:
            with open(tmp, "w") as f:
                json.dump(manifest, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(step_dir, MANIFEST))
        except OSError as e:
            raise CheckpointError(
                f"checkpoint {step_dir}: cannot write its {MANIFEST} ({e.strerror or e}); "
                "the step stays incomplete and is moved aside at the next start"
            ) from None
        _fsync_dir(step_dir)

    on_rank0(write, pg)
    return manifest


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_SHA256_RE = re.compile(r"[0-9a-f]{64}")


def manifest_problem(manifest: Any) -> str | None:
    """What is wrong with the shape of a parsed manifest (``"it ..."``), or None."""
    if not isinstance(manifest, dict):
        return f"is a JSON {type(manifest).__name__}, not an object"
    if manifest.get("format") != MANIFEST_FORMAT:
        return f"has format {manifest.get('format')!r}, not {MANIFEST_FORMAT!r}"
    files = manifest.get("files")
    if not isinstance(files, dict):
        return 'has no "files" table' if files is None else '"files" is not a table'
    if not files:
        return "lists no files"
    for rel, entry in files.items():
        if not rel or os.path.isabs(rel) or ".." in rel.split("/"):
            return f"names {rel!r}, which is not a file inside the step folder"
        if not isinstance(entry, dict):
            return f"entry {rel!r} is not a table"
        size, digest = entry.get("bytes"), entry.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f'entry {rel!r} has no valid "bytes" ({size!r})'
        if not isinstance(digest, str) or not _SHA256_RE.fullmatch(digest):
            return f'entry {rel!r} has no valid "sha256"'
    return None


def read_manifest(step_dir: str) -> tuple[dict[str, Any] | None, str]:
    """(manifest, "") or (None, why it is missing or invalid). A manifest of any wrong shape
    makes the step incomplete, like a missing one."""
    path = os.path.join(step_dir, MANIFEST)
    if not os.path.isfile(path):
        return None, f"incomplete: no {MANIFEST} (a save that did not finish)"
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        return None, f"incomplete: {path} is unreadable ({e})"
    problem = manifest_problem(manifest)
    if problem is not None:
        return None, f"incomplete: {path} {problem}"
    return manifest, ""


def safetensors_problem(path: str | os.PathLike[str]) -> str | None:
    """None when ``path`` is as long as its safetensors header says, else what is wrong
    (naming the file): cut inside the header, an unreadable header, or tensors past its end.
    Reads the header only."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{path} is truncated: {size} bytes, shorter than a safetensors header"
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            return f"{path} is truncated: {size} bytes, its header alone needs {8 + n}"
        try:
            header = json.loads(f.read(n))
            end = max(
                (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                default=0,
            )
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return f"{path} has an unreadable safetensors header: not a safetensors file"
    if 8 + n + end > size:
        return f"{path} is truncated: {size} bytes, its header describes {8 + n + end}"
    return None


def dcp_layout_problem(step_dir: str) -> str | None:
    """None when ``step_dir`` holds a loadable checkpoint layout, else the first problem,
    naming the file: DCP (``.metadata`` unpickles and every byte range it lists lies inside an
    existing file; this reads ``.metadata`` only) or, without ``.metadata``, Hugging Face
    safetensors (each file's header and length)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = os.path.join(step_dir, ".metadata")
    if not os.path.isfile(meta):
        shards = sorted(n for n in os.listdir(step_dir) if n.endswith(".safetensors"))
        if not shards:
            what = "is empty" if not os.listdir(step_dir) else "holds no .metadata (DCP)"
            return f"{step_dir} {what}: not a checkpoint step (no .metadata, no *.safetensors)"
        for name in shards:
            problem = safetensors_problem(os.path.join(step_dir, name))
            if problem:
                return problem
        return None
    try:
        metadata = FileSystemReader(step_dir).read_metadata()
    except Exception as e:  # a truncated pickle raises any of several types
        return f"{meta} cannot be read ({type(e).__name__}: {e}): truncated or not DCP metadata"
    ends: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        rel = getattr(info, "relative_path", None)
        if isinstance(rel, str):
            ends[rel] = max(ends.get(rel, 0), int(info.offset) + int(info.length))
    for rel, end in sorted(ends.items()):
        path = os.path.join(step_dir, rel)
        if not os.path.isfile(path):
            return f"{path} is missing ({meta} refers to it)"
        size = os.path.getsize(path)
        if size < end:
            return f"{path} is truncated: {size} bytes, {meta} refers to bytes up to {end}"
    return None


def check_step(step_dir: str, *, sha256: bool = True, pg: Any = None) -> str | None:
    """None when ``step_dir`` matches its manifest, else the first problem, naming the file.
    ``sha256=False`` checks presence and sizes only (no reading). All ranks call."""
    manifest, why = broadcast(read_manifest(step_dir) if group_rank(pg) == 0 else None, pg)
    if manifest is None:
        return why
    expected: dict[str, dict[str, Any]] = manifest["files"]
    files = sorted(expected)
    got: dict[str, dict[str, Any]]
    if sha256:
        got = _hash_share(step_dir, files, pg)
    else:
        got = {}
        for rel in files:
            path = os.path.join(step_dir, rel)
            got[rel] = {"bytes": os.path.getsize(path)} if os.path.isfile(path) else {"error": ""}
    for rel in files:
        path = os.path.join(step_dir, rel)
        want, have = expected[rel], got[rel]
        if "error" in have:
            return f"{path} is missing or unreadable"
        if have["bytes"] != want["bytes"]:
            return f"{path} has {have['bytes']} bytes, its manifest says {want['bytes']}"
        if sha256 and have["sha256"] != want["sha256"]:
            return (
                f"{path} does not match its manifest (sha256 {have['sha256'][:12]}..., "
                f"expected {want['sha256'][:12]}...): the file is corrupted"
            )
    # A step sealed after it was cut short matches its manifest but cannot load.
    return broadcast(dcp_layout_problem(step_dir) if group_rank(pg) == 0 else None, pg)
