"""Context-parallel softmax attention with a causal document mask (all-gather K/V).

Every rank all-gathers the keys and values of the whole stream (one differentiable collective
for K and V together) plus every token's global id and document id, then attends its local
queries to all gathered keys under the mask ``key_id <= query_id and same document``. Works for
any fragment layout because the mask is built from global ids, not from positions in the
gathered buffer. Memory is ``T_local x W*T_max`` scores per head: meant for CPU tests and short
contexts; a long-context GPU path would use ring / flex attention instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ..cp.collectives import all_gather_autograd, all_gather_plain, group_size

__all__ = ["context_parallel_attention", "document_causal_mask"]


def document_causal_mask(
    q_token_ids: Tensor, q_doc_ids: Tensor, k_token_ids: Tensor, k_doc_ids: Tensor
) -> Tensor:
    """Boolean mask ``[..., Tq, Tk]`` (True = attend): key id <= query id, same document, and
    key document >= 0 (negative document ids mark padding). Ids are ``[..., Tq]`` / ``[..., Tk]``."""
    same_doc = q_doc_ids.unsqueeze(-1) == k_doc_ids.unsqueeze(-2)
    causal = k_token_ids.unsqueeze(-2) <= q_token_ids.unsqueeze(-1)
    return same_doc & causal & (k_doc_ids >= 0).unsqueeze(-2)


def _pad_rows(x: Tensor, rows: int, value: float | int = 0) -> Tensor:
    # Pad dim 0 to `rows` so every rank contributes an equally sized block to the all-gather.
    if x.shape[0] == rows:
        return x
    pad = x.new_full((rows - x.shape[0], *x.shape[1:]), value)
    return torch.cat([x, pad], dim=0)


# Largest query-block x key mask materialised at once (elements); 2^24 bools = 16 MiB.
_MASK_ELEMENTS = 1 << 24


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor | None,
    *,
    token_ids: Tensor,
    doc_ids: Tensor,
    group: dist.ProcessGroup | None,
    scale: float | None = None,
    max_tokens: int | None = None,
    expand: Callable[[Tensor], tuple[Tensor, Tensor]] | None = None,
) -> Tensor:
    """Softmax attention of this rank's queries over the whole (all-gathered) stream.

    Args:
        q: ``[B, T_local, Hq, D]``; k: ``[B, T_local, Hkv, D]``; v: ``[B, T_local, Hkv, Dv]``
            with Hq a multiple of Hkv (GQA). Under CP the model passes B = 1 (the flattened
            stream); B > 1 means B independent streams sharing one layout.
        token_ids: ``[T_local]`` or ``[B, T_local]`` int64, the global stream index of every
            local token (defines causality; any strictly increasing token order works).
        doc_ids: same shape, the document of every local token (>= 0).
        group: context-parallel process group; None (or world 1) runs unsharded.
        scale: softmax scale, default ``D ** -0.5``.
        max_tokens: the largest ``T_local`` over the group, if known; otherwise it is
            found with a one-int all-reduce (a device->host sync on CUDA).
        expand: gather rows, not K/V (multi-head latent attention): ``k`` is then each
            token's row ``[B, T_local, 1, C]`` (e.g. MLA's compressed latent and shared rope
            key), ``v`` is None, and every rank turns the gathered rows ``[B, Tk, 1, C]`` into
            keys ``[B, Tk, Hkv, Dk]`` and values ``[B, Tk, Hkv, Dv]`` with ``expand``: C
            numbers travel per token instead of ``Hkv * (Dk + Dv)``. Padding rows are zeros.

    Returns:
        ``[B, T_local, Hq, Dv]`` in q's dtype. Differentiable in q, k, v; the gradients of
        gathered keys/values are reduce-scattered back to their owning ranks.
    """
    B, T, Hq, _ = q.shape
    Dk = k.shape[-1]
    if (expand is None) == (v is None):
        raise ValueError("pass v (K/V attention) or expand (gathered rows), not both or neither")
    if token_ids.shape != doc_ids.shape or token_ids.shape not in ((T,), (B, T)):
        raise ValueError(
            f"token_ids {list(token_ids.shape)} and doc_ids {list(doc_ids.shape)} must both be "
            f"[{T}] or [{B}, {T}] for q {list(q.shape)}"
        )
    world = group_size(group)
    ids = torch.stack([token_ids, doc_ids], dim=-1)  # [T, 2] or [B, T, 2]
    rows = k if v is None else torch.cat([k, v], dim=-1)
    if world == 1:
        kv, k_ids = rows, ids
    else:
        if max_tokens is None:
            n = torch.tensor([T], dtype=torch.int64, device=q.device)
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
            max_tokens = int(n.item())
        # One collective for K and V (also keeps a single, identically ordered backward
        # collective per layer on every rank). Token dim first: the gather concatenates dim 0.
        kv = rows.transpose(0, 1)  # [T, B, Hkv, Dk+Dv] (or [T, B, 1, C] rows to expand)
        kv = all_gather_autograd(_pad_rows(kv, max_tokens), group).transpose(0, 1)
        ids_t = ids.transpose(0, 1) if ids.dim() == 3 else ids  # token dim first
        k_ids = all_gather_plain(_pad_rows(ids_t, max_tokens, -1), group)
        k_ids = k_ids.transpose(0, 1) if ids.dim() == 3 else k_ids
    keys, values = (kv[..., :Dk], kv[..., Dk:]) if expand is None else expand(kv)
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)
    # Queries in blocks so the mask (and, on the math path, the scores) stay bounded:
    # block x Tk elements instead of T_local x Tk.
    tk = k_ids.shape[-2]
    block = max(1, min(T, _MASK_ELEMENTS // max(tk, 1)))
    outs = []
    for q0 in range(0, max(T, 1), block):  # one (empty) block for a rank without tokens
        q_ids = ids[..., q0 : q0 + block, :]
        mask = document_causal_mask(q_ids[..., 0], q_ids[..., 1], k_ids[..., 0], k_ids[..., 1])
        if mask.dim() == 3:
            mask = mask.unsqueeze(1)  # [B, 1, Tq, Tk]: same mask for every head
        outs.append(
            F.scaled_dot_product_attention(
                q[:, q0 : q0 + block].transpose(1, 2),
                keys,
                values,
                attn_mask=mask,
                scale=scale,
                enable_gqa=Hq != keys.shape[1],
            )
        )
    o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return o.transpose(1, 2)
