"""Packed-document dataloaders on top of torchtitan 0.3.0's HF text pipeline.

torchtitan's ``HuggingFaceTextDataset`` already packs documents into rows of ``seq_len``
tokens with per-document ``positions`` and labels shifted within each document. This
module adds three things:

* dataset names for the bundled corpus (``"bundled"``, ``"bundled_validation"``) and for any
  JSONL file (``"jsonl"`` + ``dataset_path``), so the defaults need no network;
* ``HostMetadata``: a CPU copy of each batch's positions (and its count of labels that count in
  the loss) that survives the trainer's and the validator's move of the batch to the device;
* ``PackedTextDataLoader`` / ``PackedValidationDataLoader``: dataloaders whose batches carry
  that metadata under ``input_dict["host_metadata"]``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import torch
from datasets import Dataset, load_dataset
from torch.utils.data import default_collate
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets import text_datasets as _tt_text
from torchtitan.hf_datasets.text_datasets import (
    HuggingFaceTextDataLoader,
    HuggingFaceTextDataset,
)

from torchtitan_cp.data import jsonl
from torchtitan_cp.routing.host_metadata import HOST_METADATA_KEY, HostMetadata, pop_host_metadata

__all__ = [
    "ASSETS_DIR",
    "BUNDLED_TOKENIZER_PATH",
    "DataError",
    "BUNDLED_TRAIN_PATH",
    "BUNDLED_VALIDATION_PATH",
    "HOST_METADATA_KEY",
    "HostMetadata",
    "PackedTextDataLoader",
    "PackedValidationDataLoader",
    "collate_with_host_metadata",
    "pop_host_metadata",
    "register_datasets",
]

ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"
BUNDLED_TOKENIZER_PATH = str(ASSETS_DIR / "tokenizer")
"""Pass as ``hf_assets_path``: torchtitan's HuggingFaceTokenizer loads it."""
BUNDLED_TRAIN_PATH = str(ASSETS_DIR / "corpus" / "train.jsonl")
BUNDLED_VALIDATION_PATH = str(ASSETS_DIR / "corpus" / "validation.jsonl")
DataError = jsonl.DataError


# ---------------------------------------------------------------------------------------
# Dataset registry
# ---------------------------------------------------------------------------------------


def _load_jsonl(path: str) -> Dataset:
    """Load a local JSONL file (one ``{"text": ...}`` per line) as a map-style dataset.

    Map-style (not streaming) so torchtitan resumes by sample index and reshuffles per epoch.
    A bad file is a ``DataError`` naming the file and line (see ``torchtitan_cp.data.jsonl``): the
    line-by-line scan runs only when ``datasets`` fails or the loaded columns are wrong, so a good
    file costs no extra pass.
    """
    if not path:
        raise ValueError('dataset "jsonl" needs dataset_path pointing at a .jsonl file')
    jsonl.check_jsonl_file(path)
    st = os.stat(path)
    return _load_jsonl_cached(os.path.abspath(path), st.st_mtime_ns, st.st_size)


def _longest_text(ds: Dataset) -> int:
    """Characters in the longest ``text`` (arrow kernels; no Python copy of the column)."""
    lengths = pc.call_function("utf8_length", [ds.data.column("text")])
    return int(pc.call_function("max", [lengths]).as_py() or 0)


@functools.lru_cache(maxsize=4)
def _load_jsonl_cached(path: str, mtime_ns: int, size: int) -> Dataset:
    # Keyed by mtime and size: the loader and the data-parallel check share one load per file.
    try:
        ds = load_dataset("json", data_files=path, split="train")
    except Exception as e:
        jsonl.scan(path, max_bytes=None)  # raises the DataError that names the line
        raise jsonl.DataError(f"{path}: cannot load as JSON lines: {e}") from e
    assert isinstance(ds, Dataset)
    feature = ds.features.get("text")
    text_ok = getattr(feature, "dtype", None) in ("string", "large_string")
    if not text_ok or ds.data.column("text").null_count:
        jsonl.scan(path, max_bytes=None)
        raise jsonl.DataError(f'{path}: "text" must be a string on every line, got {feature}')
    if len(ds) == 0:
        raise jsonl.DataError(f"{path}: no documents")
    if _longest_text(ds) == 0:
        raise jsonl.DataError(
            f'{path}: all {len(ds)} documents have an empty "text": no tokens to train on'
        )
    return ds


def _text(sample: dict[str, Any]) -> str:
    return sample["text"]


def register_datasets() -> None:
    """Add the bundled and generic JSONL datasets to torchtitan's dataset table.

    ``DATASETS`` in ``torchtitan.hf_datasets.text_datasets`` is torchtitan's documented
    extension point; entries are looked up by (lower-cased) name when a dataset is built.
    Idempotent; called on import of this module.
    """
    _tt_text.DATASETS.update(
        {
            "bundled": DatasetConfig(BUNDLED_TRAIN_PATH, _load_jsonl, _text),
            "bundled_validation": DatasetConfig(BUNDLED_VALIDATION_PATH, _load_jsonl, _text),
            "jsonl": DatasetConfig("", _load_jsonl, _text),
        }
    )


register_datasets()


# ---------------------------------------------------------------------------------------
# Host metadata
# ---------------------------------------------------------------------------------------


def collate_with_host_metadata(
    samples: list[tuple[dict[str, torch.Tensor], torch.Tensor]],
) -> tuple[dict[str, Any], torch.Tensor]:
    """Stack samples like the default collate, then attach ``HostMetadata``.

    Module-level (not a lambda) so it pickles into dataloader worker processes.
    """
    input_dict, labels = default_collate(samples)
    # Clone: the host copy must not alias a tensor that later code may modify in place.
    meta = HostMetadata(
        input_dict["positions"].clone(), valid_tokens=int((labels != IGNORE_INDEX).sum())
    )
    meta.cu_seqlens()  # derive (and validate) the document boundaries here, in the loader
    input_dict[HOST_METADATA_KEY] = meta
    return input_dict, labels


# ---------------------------------------------------------------------------------------
# Dataloaders
# ---------------------------------------------------------------------------------------


def local_jsonl_path(dataset: str, dataset_path: str | None) -> str | None:
    """The file a dataset name reads when it is one of this module's local JSONL datasets
    (``bundled``, ``bundled_validation``, ``jsonl``); None for other datasets (c4, ...)."""
    entry = _tt_text.DATASETS.get(dataset.lower())
    if entry is None or entry.loader is not _load_jsonl:
        return None
    return dataset_path or entry.path


def _check_local_dataset(config: Any, dp_world_size: int) -> None:
    """Every data-parallel rank runs this on the same file, so all of them stop with the same
    line (not one rank's IndexError and a lost connection on the others)."""
    path = local_jsonl_path(config.dataset, config.dataset_path)
    if path:
        jsonl.check_documents_for_ranks(path, len(_load_jsonl(path)), dp_world_size)


def _check_rank_share(dataset: HuggingFaceTextDataset, config: Any, dp_rank: int) -> None:
    """A rank whose documents are all empty would pack BOS tokens only, at a crawl."""
    data = dataset._original_data
    if not isinstance(data, Dataset) or "text" not in data.column_names or len(data) == 0:
        return
    if data._indices is not None:  # .data would be the whole table, not this rank's rows
        return
    if _longest_text(data) == 0:
        where = local_jsonl_path(config.dataset, config.dataset_path) or config.dataset
        raise DataError(jsonl.empty_share_message(where, len(data), dp_rank))


class PackedTextDataLoader(HuggingFaceTextDataLoader):
    """torchtitan's HF text dataloader, reading the bundled corpus by default.

    Batches are ``(input_dict, labels)`` with ``input_dict`` holding ``input`` [B, L],
    ``positions`` [B, L] and ``host_metadata`` (``HostMetadata``), labels [B, L].
    A real HF dataset works as with torchtitan: ``dataset="c4", dataset_path=...``, or
    ``dataset="jsonl", dataset_path="/path/file.jsonl"`` for local text.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(HuggingFaceTextDataLoader.Config):
        dataset: str = "bundled"
        """Name in torchtitan's dataset table: bundled, bundled_validation, jsonl, c4, ..."""

        dataset_path: str | None = None
        """Where the dataset is read: a .jsonl file for jsonl (bundled and bundled_validation
        read their own file when unset), a Hugging Face dataset path or local folder for the
        others (c4: allenai/c4 when unset)."""

        host_metadata: bool = True
        """Attach ``input_dict["host_metadata"]``; off gives torchtitan's plain batches."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: BaseTokenizer,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = 1,
        **kwargs: Any,
    ) -> None:
        _check_local_dataset(config, dp_world_size)
        dataset = HuggingFaceTextDataset(
            dataset_name=config.dataset,
            dataset_path=config.dataset_path,
            tokenizer=tokenizer,
            seq_len=seq_len,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            infinite=config.infinite,
        )
        loader_kwargs: dict[str, Any] = {
            "num_workers": config.num_workers,
            "persistent_workers": config.persistent_workers,
            "pin_memory": config.pin_memory,
            "prefetch_factor": config.prefetch_factor,
            "snapshot_every_n_steps": snapshot_every_n_steps,
            "batch_size": local_batch_size,
        }
        _check_rank_share(dataset, config, dp_rank)
        if config.host_metadata:
            loader_kwargs["collate_fn"] = collate_with_host_metadata
        # Skip HuggingFaceTextDataLoader.__init__: it offers no way to pass a collate_fn.
        ParallelAwareDataloader.__init__(
            self, dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, **loader_kwargs
        )


class PackedValidationDataLoader(PackedTextDataLoader):
    """Reads the held-out bundled split once; for ``Validator.Config(dataloader=...)``.

    The validator rebuilds its dataloader on every call and overrides ``infinite``
    (``steps != -1`` loops), so each validation pass starts from the same documents.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(PackedTextDataLoader.Config):
        dataset: str = "bundled_validation"
        infinite: bool = False
