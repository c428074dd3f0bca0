"""What the recipe's decoders share: ``forward(tokens, positions, seq_ctx)`` taking the
microbatch's ``SequenceContext`` (``RoutedDecoder``: the hybrid decoder, Qwen3.5, Kimi Linear),
what a torchtitan decoder run through this recipe (``models.qwen35``, ``models.kimi_linear``)
adds to its config: the kernel and attention options its layers read and the trainer's options
applied to them (``RoutedDecoderConfig``), and the options its config builder takes on top of
the flavor (``RoutedOptions``).

Both are mixins placed before the base class: ``class Model(RoutedDecoder, Decoder)`` and
``class Config(RoutedDecoderConfig, Decoder.Config)``; the model writes ``routed_forward``, its
forward once the context is known.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

import torch
from torchtitan.models.common.decoder import Decoder

from torchtitan_cp.models.blocks.attention_cp import (
    DEFAULT_ATTENTION_CP,
    AttentionCP,
    check_attention_cp,
)
from torchtitan_cp.models.blocks.flex import AttentionBackend, resolve_attention_backend
from torchtitan_cp.models.blocks.routed_attention import RoutedInnerAttention
from torchtitan_cp.models.context import SequenceContext
from torchtitan_cp.models.sequence import context_from_device_positions

__all__ = ["RoutedDecoder", "RoutedDecoderConfig", "RoutedOptions"]

LinearAttentionBackend = Literal["auto", "torch", "fla"]


@dataclass(kw_only=True)
class RoutedDecoderConfig:
    """The recipe's options of a torchtitan decoder's ``Config``: the linear-attention kernels'
    backend (``[linear_attention] backend``), the softmax attention's backend and its CP mode
    (``[model] attention_backend``, ``attention_cp``).

    No ``slots``: torchtitan's Config bases have slots, and two bases with slots cannot be
    combined (the subclass's own ``slots=True`` still gives these fields slots)."""

    linear_attention_backend: LinearAttentionBackend = "auto"
    attention_backend: AttentionBackend = "auto"
    attention_cp: AttentionCP = DEFAULT_ATTENTION_CP

    def uses_flex_attention(self, device_type: str | torch.device) -> bool:
        """Whether the softmax attention layers run flex on ``device_type`` (then every
        microbatch needs a document ``BlockMask``)."""
        first_attention = self.first_attention  # pyrefly: ignore[missing-attribute]
        return first_attention is not None and (
            resolve_attention_backend(self.attention_backend, device_type) == "flex"
        )

    def update_from_config(self, *, config: Any, **kwargs: Any) -> None:
        """torchtitan's hook with the trainer's config: ``Decoder``'s checks and RoPE sizing
        (not a subclass's own: Qwen35Model's fills sharding configs for every module and needs
        the vision encoder; the recipe shards the mixers and the decoder's ends with torch's
        plans and keeps torchtitan's configs for the MoE layers only, ``shard_moe``), and
        ``[linear_attention] backend`` (``set_linear_attention_backend``)."""
        Decoder.Config.update_from_config(self, config=config, **kwargs)  # pyrefly: ignore[bad-argument-type]
        par = config.parallelism
        self.shard_moe(par.expert_parallel_degree, getattr(par, "tensor_parallel_degree", 1))
        la = getattr(config, "linear_attention", None)
        if la is not None:
            self.set_linear_attention_backend(la.backend)

    def shard_moe(self, ep: int, tp: int) -> None:
        """torchtitan's own MoE sharding configs on the MoE layers when expert (``ep``) or
        tensor (``tp``) parallelism is on (``blocks.experts.set_moe_sharding``)."""
        if ep > 1 or tp > 1:
            # Imported here: blocks.experts loads torchtitan's FSDP (torch >= 2.14), which the
            # model layer must not need below the trainer (tests/test_compat.py).
            from torchtitan_cp.models.blocks.experts import set_moe_sharding

            set_moe_sharding(self.layers, ep=ep, tp=tp)  # pyrefly: ignore[missing-attribute]

    def set_linear_attention_backend(self, backend: LinearAttentionBackend) -> None:
        """Where the model's linear-attention layers read their backend (this field unless a
        model's layers hold their own)."""
        self.linear_attention_backend = backend


@dataclass(frozen=True, kw_only=True)
class RoutedOptions:
    """What a torchtitan decoder's config builder takes on top of its flavor
    (``qwen35_config(flavor, **options)``, ``kimi_linear_config``): the ``[model]`` keys every
    such model has, and ``[linear_attention] backend``. Checked when built: a ValueError names
    ``model.attention_backend`` or ``model.attention_cp`` for a value the recipe does not have."""

    n_layers: int | None = None
    """Keep the first layers of the flavor (its layer pattern is positional); None: all."""
    vocab_size: int | None = None
    """Resize the embedding and the head (e.g. to a smaller tokenizer); None: the flavor's."""
    attention_backend: AttentionBackend = "auto"
    attention_cp: AttentionCP = DEFAULT_ATTENTION_CP
    linear_attention_backend: LinearAttentionBackend = "auto"

    def __post_init__(self) -> None:
        resolve_attention_backend(self.attention_backend, "cpu")
        check_attention_cp(self.attention_cp)

    def layers(self, available: int, where: str) -> int:
        """How many of the flavor's ``available`` layers to keep; a ValueError naming
        ``model.n_layers`` and ``where`` (``"qwen3_5 debugmodel"``) outside [1, available]."""
        if self.n_layers is None:
            return available
        if not 1 <= self.n_layers <= available:
            raise ValueError(
                f"model.n_layers must be in [1, {available}] for {where}, got {self.n_layers}"
            )
        return self.n_layers

    def vocab(self, flavor_vocab: int) -> int:
        """The vocabulary size: ``vocab_size`` (>= 1, else a ValueError naming it) or the
        flavor's."""
        if self.vocab_size is None:
            return flavor_vocab
        if self.vocab_size < 1:
            raise ValueError(f"model.vocab_size must be >= 1, got {self.vocab_size}")
        return self.vocab_size

    def inner_attention(self) -> RoutedInnerAttention.Config:
        """The attention router every softmax attention layer of the model holds."""
        return RoutedInnerAttention.Config(
            backend=self.attention_backend, cp_mode=self.attention_cp
        )

    def config_fields(self) -> dict[str, Any]:
        """``RoutedDecoderConfig``'s fields."""
        return {f.name: getattr(self, f.name) for f in fields(RoutedDecoderConfig)}


class RoutedDecoder:
    """``forward(tokens [B, L_local], positions [B, L_local] | None, seq_ctx)`` of a decoder
    whose layers read the microbatch's ``SequenceContext``: returns ``routed_forward``'s logits
    ``[B, L_local, vocab]`` (hidden states when the trainer's chunked loss applies the head)."""

    config: Any

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        seq_ctx: SequenceContext | None = None,
    ) -> torch.Tensor:
        if seq_ctx is None:
            # A direct call (custom loader, evaluation script) without host metadata: the
            # documents from the device positions (a device->host copy per forward, warned
            # once).
            seq_ctx = context_from_device_positions(
                tokens, positions, flex_mask=self.config.uses_flex_attention(tokens.device)
            )
        return self.routed_forward(tokens, positions, seq_ctx)

    def routed_forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None, seq_ctx: SequenceContext
    ) -> torch.Tensor:
        """The model's forward over ``seq_ctx`` (the microbatch's, or one built from
        ``positions``)."""
        raise NotImplementedError(f"{type(self).__name__} has no routed_forward")
