"""Packed-document dataloaders on top of torchtitan 0.3.0's HF text pipeline.

torchtitan's ``HuggingFaceTextDataset`` already packs documents into rows of ``seq_len``
tokens with per-document ``positions`` and labels shifted within each document. This
module adds three things:

* dataset names for the bundled corpus (``"bundled"``, ``"bundled_validation"``) and for any
  JSONL file (``"jsonl"`` + ``dataset_path``), so the defaults need no network;
* ``HostMetadata``: a CPU copy of each batch's positions that survives the trainer's and
  the validator's move of the batch to the device;
* ``PackedTextDataLoader`` / ``PackedValidationDataLoader``: dataloaders whose batches carry
  that metadata under ``input_dict["host_metadata"]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, load_dataset
from torch.utils.data import default_collate
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets import text_datasets as _tt_text
from torchtitan.hf_datasets.text_datasets import (
    HuggingFaceTextDataLoader,
    HuggingFaceTextDataset,
)

from torchtitan_cp.host_metadata import HOST_METADATA_KEY, HostMetadata, pop_host_metadata

__all__ = [
    "ASSETS_DIR",
    "BUNDLED_TOKENIZER_PATH",
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

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
BUNDLED_TOKENIZER_PATH = str(ASSETS_DIR / "tokenizer")
"""Pass as ``hf_assets_path``: torchtitan's HuggingFaceTokenizer loads it."""
BUNDLED_TRAIN_PATH = str(ASSETS_DIR / "corpus" / "train.jsonl")
BUNDLED_VALIDATION_PATH = str(ASSETS_DIR / "corpus" / "validation.jsonl")


# ---------------------------------------------------------------------------------------
# Dataset registry
# ---------------------------------------------------------------------------------------


def _load_jsonl(path: str) -> Dataset:
    """Load a local JSONL file (one ``{"text": ...}`` per line) as a map-style dataset.

    Map-style (not streaming) so torchtitan resumes by sample index and reshuffles per epoch.
    """
    if not path:
        raise ValueError('dataset "jsonl" needs dataset_path pointing at a .jsonl file')
    return load_dataset("json", data_files=path, split="train")


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
    meta = HostMetadata(input_dict["positions"].clone())
    meta.cu_seqlens()  # derive (and validate) the document boundaries here, in the loader
    input_dict[HOST_METADATA_KEY] = meta
    return input_dict, labels


# ---------------------------------------------------------------------------------------
# Dataloaders
# ---------------------------------------------------------------------------------------


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
