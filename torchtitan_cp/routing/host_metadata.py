"""Host (CPU) copy of a batch's positions that survives the trainer's move to the device.

It sits in ``routing`` (torch only), below the data loader that fills it and the models'
``SequencePreprocessor`` that reads it, so the positions go from the loader to the kernels
without passing through the trainer or the data pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .layouts import cu_seqlens_tensor_from_positions

HOST_METADATA_KEY = "host_metadata"
"""The batch key under which the data loader stores ``HostMetadata``."""


@dataclass(frozen=True, eq=False)
class HostMetadata:
    """Host (CPU) copy of a batch's per-document positions.

    The trainer moves every tensor of a batch to the device and the validator calls
    ``.to()`` on every value; this wrapper's ``.to()`` returns itself, so document
    boundaries stay readable without a device-to-host sync, and are computed from the
    unsharded positions even after context-parallel sharding of the real ``positions``.
    Remove it from the batch (``pop_host_metadata``) before the model forward.
    """

    positions: torch.Tensor
    """[B, L] int64 on CPU. 0 marks a document start; torchtitan also restarts a row that
    begins mid-document at 0, so column 0 is always 0."""
    valid_tokens: int | None = None
    """Labels that count in the loss (not torchtitan's ``IGNORE_INDEX``), counted on the host
    by the loader; the trainer normalises the loss by their sum without reading the device."""
    _cu_seqlens: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        p = self.positions
        if p.dim() != 2 or p.dtype != torch.int64 or p.device.type != "cpu":
            raise ValueError(
                f"positions must be a [B, L] int64 CPU tensor, got {tuple(p.shape)} "
                f"{p.dtype} on {p.device}"
            )

    def to(self, *args: Any, **kwargs: Any) -> HostMetadata:
        """Stay on the host whatever the target: this is the point of the class."""
        return self

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]

    @property
    def seq_len(self) -> int:
        return self.positions.shape[1]

    @property
    def num_tokens(self) -> int:
        """T = B * L, the length of the flattened (row-major) global stream."""
        return self.positions.numel()

    def document_starts(self) -> torch.Tensor:
        """[B, L] bool: True where a document (or a row's first fragment) starts."""
        starts = self.positions == 0
        # A row cut mid-document still starts a new sequence for the model.
        starts[:, 0] = True
        return starts

    def cu_seqlens(self) -> torch.Tensor:
        """Global document offsets of the flattened rows: [N + 1] int64 on CPU.

        Starts at 0, ends at B * L, strictly increasing; a boundary sits wherever
        ``positions == 0`` and at every row start. ``.tolist()`` gives host ints. Computed once
        (the collate function does it in the loader, off the training loop); treat as read-only.
        """
        cu = self._cu_seqlens
        if cu is None:
            cu = cu_seqlens_tensor_from_positions(self.positions)
            object.__setattr__(self, "_cu_seqlens", cu)  # frozen: a memo, not new state
        return cu

    def seqlens(self) -> torch.Tensor:
        """[N] int64 lengths of the documents in the flattened stream."""
        return self.cu_seqlens().diff()

    @property
    def num_documents(self) -> int:
        return int(self.document_starts().sum())


def pop_host_metadata(input_dict: dict[str, Any]) -> HostMetadata | None:
    """Remove and return the batch's ``HostMetadata`` (None if absent).

    Call before turning the remaining ``input_dict`` entries into model-forward kwargs.
    """
    return input_dict.pop(HOST_METADATA_KEY, None)
