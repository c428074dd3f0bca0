"""Softmax attention layer (GQA, RoPE or NoPE) with a causal document mask over the packed stream.

Under context parallelism ``[model] attention_cp`` picks how keys/values cross ranks:
``all_gather`` (every rank gathers the whole stream's K/V, per backend as below) or ``pass_kv``
(``ops.pass_kv_attention``: each rank keeps its own K/V, blocks travel point to point between
the ranks whose documents meet, per-pair kernel math on sdpa, flex on flex;
``models/blocks/attention_cp.py``).

Two backends, chosen by ``[model] attention_backend``:

* ``flex``: torchtitan's ``FlexAttention`` (compiled flex attention) with the microbatch's
  document ``BlockMask``. Under CP it runs torchtitan's own CP path: ``apply_cp_to_forward``
  all-gathers K/V and the mask covers this rank's queries (``ops.flex_document_mask``).
  The default on CUDA. On CPU it runs forward only (flex has no CPU backward).
* ``sdpa``: SDPA with an explicit document mask built from global token/document ids, the
  all-gather-K/V CP op ``ops.context_parallel_attention``. The default elsewhere.

The choice is made by the layer's ``inner_attention``, the recipe's one attention router
(``models/blocks/routed_attention.py``), which Qwen3.5's and Kimi Linear's attention hold too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torchtitan.protocols.module import Module

from torchtitan_cp.models.blocks.attention_cp import DEFAULT_ATTENTION_CP, AttentionCP
from torchtitan_cp.models.blocks.flex import AttentionBackend
from torchtitan_cp.models.blocks.heads import attention_flops, config_from_model
from torchtitan_cp.models.blocks.init import linear
from torchtitan_cp.models.blocks.rope import apply_rope
from torchtitan_cp.models.blocks.routed_attention import RoutedInnerAttention
from torchtitan_cp.models.blocks.tensor_parallel import tp_heads
from torchtitan_cp.models.context import SequenceContext


class SoftmaxAttention(Module):
    """Grouped-query attention; no token attends across a document boundary.

    Input/output ``[B, L, D]``. Under context parallelism each rank's queries attend to the
    keys/values of the whole stream: all-gathered (flex: torchtitan's ``apply_cp_to_forward``
    on ``inner_attention.flex``; sdpa: ``ops.context_parallel_attention``) or, with ``cp_mode =
    "pass_kv"``, passed between ranks in rounds (``ops.pass_kv_attention``); the routed
    ``inner_attention`` picks.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        n_heads: int
        n_kv_heads: int
        head_dim: int
        use_rope: bool = True
        rope_theta: float = 10000.0
        layer_id: int = 0
        backend: AttentionBackend = "auto"
        cp_mode: AttentionCP = DEFAULT_ATTENTION_CP

    @staticmethod
    def from_model(cfg: Any, layer_id: int, backend: str) -> SoftmaxAttention.Config:
        """The attention of layer ``layer_id`` of a ``HybridDecoder.Config`` (the registry's
        hook). Its backend is ``model.attention_backend``; ``backend`` (the linear layers') is
        not read. Its sizes are the ``attn_*`` fields (``n_heads``, ``head_dim`` are the linear
        layers'); ``dim``, ``use_rope``, ``rope_theta`` the fields of those names."""
        return config_from_model(
            SoftmaxAttention.Config,
            cfg,
            n_heads=cfg.attn_n_heads,
            n_kv_heads=cfg.attn_n_kv_heads,
            head_dim=cfg.attn_head_dim,
            layer_id=layer_id,
            backend=cfg.attention_backend,
            cp_mode=cfg.attention_cp,
        )

    @staticmethod
    def tensor_parallel_heads(cfg: Any) -> list[tuple[str, int]]:
        """The head counts TP must divide (the registry's hook): queries and K/V heads."""
        return [
            ("model.attn_n_heads", cfg.attn_n_heads),
            ("model.attn_n_kv_heads", cfg.attn_n_kv_heads),
        ]

    @staticmethod
    def flops(cfg: Any, seq_len: int) -> int:
        """QK^T and PV over the (causal, un-sparsified) context (``attention_flops``)."""
        return attention_flops(cfg.attn_n_heads, cfg.attn_head_dim, seq_len)

    def __init__(self, config: Config):
        super().__init__()
        if config.n_heads % config.n_kv_heads:
            raise ValueError(
                f"attention n_heads ({config.n_heads}) must be a multiple of "
                f"n_kv_heads ({config.n_kv_heads})"
            )
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
        )
        self.use_rope, self.rope_theta = config.use_rope, config.rope_theta
        d, hd = config.dim, config.head_dim
        self.wq = linear(d, config.n_heads * hd)
        self.wk = linear(d, config.n_kv_heads * hd)
        self.wv = linear(d, config.n_kv_heads * hd)
        self.wo = linear(config.n_heads * hd, d, std=0.02 / math.sqrt(2 * (config.layer_id + 1)))
        # Checks the backend's and the CP mode's names at build time.
        self.inner_attention = RoutedInnerAttention(
            RoutedInnerAttention.Config(backend=config.backend, cp_mode=config.cp_mode)
        )

    def parallelize_heads(self, mesh: DeviceMesh) -> None:
        """Tensor parallelism over heads on the TP ``mesh``: wq/wk/wv column-wise, wo
        row-wise into the sequence-parallel layout. A rank's query heads are contiguous, so
        they keep their K/V heads (GQA groups) when both counts divide by the degree."""
        tp_heads(mesh, self.n_heads, "model.attn_n_heads")
        tp_heads(mesh, self.n_kv_heads, "model.attn_n_kv_heads")
        plan: dict = {name: ColwiseParallel() for name in ("wq", "wk", "wv")}
        plan["wo"] = RowwiseParallel(output_layouts=Shard(1))
        parallelize_module(self, mesh, plan)

    def forward(
        self, x: torch.Tensor, ctx: SequenceContext, positions: torch.Tensor | None
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xs = x.reshape(1, bsz * seqlen, -1)
        # -1 heads: this rank's (all of them without tensor parallelism).
        q = self.wq(xs).unflatten(-1, (-1, self.head_dim))
        k = self.wk(xs).unflatten(-1, (-1, self.head_dim))
        v = self.wv(xs).unflatten(-1, (-1, self.head_dim))
        if self.use_rope:
            if positions is None:
                raise ValueError("SoftmaxAttention with RoPE needs the document positions")
            pos = positions.reshape(-1)
            q, k = apply_rope(q, pos, self.rope_theta), apply_rope(k, pos, self.rope_theta)
        # Rows back for the router: its flex mask is per row (under CP torchtitan gathers K/V
        # along dim 1); sdpa and pass-KV flatten them again.
        q, k, v = (t.reshape(bsz, seqlen, -1, self.head_dim) for t in (q, k, v))
        o = self.inner_attention.route(q, k, v, ctx, enable_gqa=self.n_heads != self.n_kv_heads)
        # Rows back before the output projection: under TP it reduce-scatters over them.
        return self.wo(o.reshape(bsz, seqlen, -1))
