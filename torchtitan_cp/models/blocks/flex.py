"""Flex attention for the packed stream: the attention backend choice, torchtitan's
``FlexAttention`` (eager off CUDA) and torchtitan's CP wrapper for it.

Two backends, chosen by ``[model] attention_backend``: ``flex`` (torchtitan's ``FlexAttention``
with the microbatch's document ``BlockMask``; under CP torchtitan's ``apply_cp_to_forward``
all-gathers K/V), the default on CUDA; ``sdpa`` (``ops.context_parallel_attention``) elsewhere.
Layers with ``[model] attention_cp = "pass_kv"`` pass K/V instead (``attention_cp.py``), so the
wrapper leaves them alone.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torchtitan.models.common.attention import FlexAttention

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "DocumentFlexAttention",
    "apply_flex_context_parallel",
    "resolve_attention_backend",
]

AttentionBackend = Literal["auto", "flex", "sdpa"]
ATTENTION_BACKENDS = ("auto", "flex", "sdpa")


def resolve_attention_backend(
    backend: str, device_type: str | torch.device
) -> Literal["flex", "sdpa"]:
    """``auto`` is flex on CUDA and sdpa elsewhere; an unknown name is a ValueError."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"model.attention_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}"
        )
    if backend == "auto":
        return "flex" if torch.device(device_type).type == "cuda" else "sdpa"
    return "flex" if backend == "flex" else "sdpa"


class DocumentFlexAttention(FlexAttention):
    """torchtitan's ``FlexAttention`` (``[B, L, H, D]`` in and out); torchtitan's CP wrapper
    accepts it as one. On CUDA it is torchtitan's compiled kernel; elsewhere flex runs eagerly,
    because inductor's CPU flex template fails to compile CP-sharded masks (torch 2.14.1) and
    CPU flex is forward-only anyway (evaluation, tests)."""

    def forward(  # pyrefly: ignore[bad-override]
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: BlockMask,
        enable_gqa: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        if q_BLNH.is_cuda:
            return super().forward(
                q_BLNH,
                k_BLNH,
                v_BLNH,
                attention_masks=attention_masks,
                enable_gqa=enable_gqa,
                **kwargs,
            )
        if kwargs:
            raise NotImplementedError(f"eager flex attention takes no {sorted(kwargs)}")
        out = flex_attention(
            q_BLNH.transpose(1, 2),
            k_BLNH.transpose(1, 2),
            v_BLNH.transpose(1, 2),
            block_mask=attention_masks,
            enable_gqa=enable_gqa,
        )
        assert isinstance(out, torch.Tensor)
        return out.transpose(1, 2)


def apply_flex_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> int:
    """torchtitan's CP path for flex attention: wrap the flex attention of every attention
    router of ``model`` (``blocks.routed_attention.RoutedInnerAttention``, the module holding a
    ``DocumentFlexAttention`` as ``flex``; the hybrid decoder's, Qwen3.5's) on the all-gather CP
    path so it all-gathers K/V over ``cp_mesh`` (its queries and mask stay this rank's). Returns
    the number of layers wrapped; layers on the sdpa backend gather K/V themselves, pass-KV
    layers pass them."""
    # torchtitan's CP module needs torch >= 2.14 (the model itself runs on 2.11).
    from torchtitan.distributed.context_parallel import apply_cp_to_forward

    # Any: the router, found by what it holds (it imports this module).
    routers: list[Any] = [
        m
        for m in model.modules()
        if isinstance(getattr(m, "flex", None), DocumentFlexAttention) and m.cp_mode == "all_gather"
    ]
    layers = [
        m for m in routers if resolve_attention_backend(m.backend, cp_mesh.device_type) == "flex"
    ]
    if layers:
        apply_cp_to_forward([m.flex for m in layers], cp_mesh)
        for m in layers:
            m.flex_cp = True
    return len(layers)
