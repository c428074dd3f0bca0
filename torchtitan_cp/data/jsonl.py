"""Checks of local JSON-lines datasets that name the file and the line at fault.

Standard library only, so the pre-launch check (``torchtitan_cp.trainer.validate``) and the data loader
(``torchtitan_cp.data.loader``) share one definition of a valid file: UTF-8, one JSON object per line
with a string ``"text"``, no blank lines (the ``datasets`` JSON loader rejects them, even one at
the end), at least one document, and at least one non-empty text.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

__all__ = [
    "DataError",
    "JsonlSummary",
    "check_documents_for_ranks",
    "check_jsonl_file",
    "check_rank_shares",
    "check_row_fits",
    "empty_share_message",
    "rank_share",
    "scan",
]

SCAN_LIMIT_BYTES = 256 * 2**20
"""The pre-launch scan reads at most this much of a file; the loader checks the rest."""


class DataError(ValueError):
    """A bad dataset file; the message names the file and, where one line is at fault, the line
    (``path:line: problem``)."""


@dataclass(frozen=True)
class JsonlSummary:
    """What a scan found. ``documents`` and ``nonempty`` count the scanned part only."""

    path: str
    documents: int
    nonempty: int
    complete: bool
    """Whether the whole file was scanned (False: it is larger than the byte limit)."""
    empty: tuple[int, ...] = ()
    """Indices (0-based, = line - 1) of the documents whose text is empty."""
    text_bytes: tuple[int, ...] = ()
    """UTF-8 bytes of each scanned document's text (a bound on its tokens: every token of a
    byte-level tokenizer covers at least one byte)."""


def check_jsonl_file(path: str) -> None:
    """A DataError unless ``path`` is a readable, non-empty regular file."""
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    if not os.path.isfile(path):
        raise DataError(f"{path}: not a file (a JSONL dataset is one file, one document a line)")
    if not os.access(path, os.R_OK):
        raise DataError(f"{path}: not readable (permission denied)")
    if os.path.getsize(path) == 0:
        raise DataError(f'{path}: empty file: no documents (expected one {{"text": ...}} a line)')


def _check_line(path: str, lineno: int, raw: bytes) -> str:
    """The text of one line, or a DataError naming ``path:lineno``."""
    where = f"{path}:{lineno}"
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 (byte {e.start + 1} of the line)") from None
    if line.startswith("\ufeff"):
        raise DataError(
            f"{where}: starts with a byte-order mark; save the file as UTF-8 without BOM"
        )
    if not line.strip():
        raise DataError(f"{where}: blank line; the JSON-lines loader rejects it, delete it")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: malformed JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(obj, dict):
        raise DataError(
            f'{where}: expected a JSON object {{"text": ...}}, got {type(obj).__name__}'
        )
    if "text" not in obj:
        keys = ", ".join(sorted(map(str, obj))[:8]) or "none"
        raise DataError(f'{where}: no "text" key (keys: {keys})')
    text = obj["text"]
    if not isinstance(text, str):
        got = "null" if text is None else type(text).__name__
        raise DataError(f'{where}: "text" is {got}, expected a string')
    return text


def scan(path: str, *, max_bytes: int | None = SCAN_LIMIT_BYTES) -> JsonlSummary:
    """Check every line of ``path`` (up to ``max_bytes``; None = all) and count the documents.

    Raises DataError for the first bad line, an empty file, or a file whose every text is empty
    (it yields no tokens to learn from). Cost: one pass in Python, ~1 s per 100 MB."""
    check_jsonl_file(path)
    documents = nonempty = read = 0
    complete = True
    empty: list[int] = []
    sizes: list[int] = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if max_bytes is not None and read >= max_bytes:
                complete = False
                break
            read += len(raw)
            text = _check_line(path, lineno, raw.rstrip(b"\r\n"))
            if not text:
                empty.append(documents)
            sizes.append(len(text.encode("utf-8", "surrogatepass")))
            documents += 1
            nonempty += bool(text)
    if complete and nonempty == 0:
        raise DataError(
            f'{path}: all {documents} documents have an empty "text": no tokens to train on'
        )
    return JsonlSummary(path, documents, nonempty, complete, tuple(empty), tuple(sizes))


def check_documents_for_ranks(path: str, documents: int, dp_world_size: int) -> None:
    """Data parallelism splits the documents between the ranks: each needs at least one."""
    if documents < dp_world_size:
        raise DataError(
            f"{path}: {documents} document(s) for {dp_world_size} data-parallel ranks; every rank "
            "needs at least one (add documents or use fewer data-parallel ranks)"
        )


def rank_share(documents: int, dp_world_size: int, dp_rank: int) -> range:
    """The documents ``datasets.distributed.split_dataset_by_node`` gives a rank of a map-style
    dataset: contiguous shards, the first ``documents % world`` ranks one document longer."""
    div, mod = divmod(documents, dp_world_size)
    start = div * dp_rank + min(dp_rank, mod)
    return range(start, start + div + (dp_rank < mod))


def empty_share_message(where: str, documents: int, dp_rank: int) -> str:
    return (
        f"{where}: the {documents} documents of data-parallel rank {dp_rank} all have an empty "
        '"text": no tokens to train on (shuffle the file so every rank gets text)'
    )


MAX_PASSES_PER_ROW = 64
"""Most passes over a data-parallel rank's documents one row may take (tiny test files repeat
a few times per row; ``seq_len = 1e9`` on a 2 MB corpus would take thousands)."""


def check_row_fits(summary: JsonlSummary, dp_world_size: int, seq_len: int) -> None:
    """One row of ``seq_len`` tokens must fit in ``MAX_PASSES_PER_ROW`` passes over each
    data-parallel rank's documents; otherwise the loader repeats them pass after pass before the
    first step (at ``seq_len = 1e9``: for hours, with no output). A document adds at most its
    UTF-8 bytes plus 1 tokens to the packed stream (BOS and EOS, less the one the shifted labels
    take), an upper bound for byte-level tokenizers."""
    if not summary.complete or not summary.text_bytes:
        return
    for rank in range(dp_world_size):
        share = rank_share(summary.documents, dp_world_size, rank)
        tokens = sum(summary.text_bytes[i] for i in share) + len(share)
        if seq_len > MAX_PASSES_PER_ROW * tokens:
            raise DataError(
                f"{summary.path}: one row of training.seq_len = {seq_len} tokens needs over "
                f"{MAX_PASSES_PER_ROW} passes over data-parallel rank {rank}'s {len(share)} "
                f"documents (at most {tokens} tokens): the loader would spin over them before "
                "the first step; use a shorter training.seq_len or more data"
            )


def check_rank_shares(summary: JsonlSummary, dp_world_size: int) -> None:
    """A rank whose documents all have empty text would pack BOS tokens only, at a crawl."""
    if not summary.empty or not summary.complete:
        return
    empty = set(summary.empty)
    for rank in range(dp_world_size):
        share = rank_share(summary.documents, dp_world_size, rank)
        if len(share) and all(i in empty for i in share):
            raise DataError(empty_share_message(summary.path, len(share), rank))
