"""Memory per rank of Qwen3.5-27B and 35B-A3B and Kimi-Linear-48B-A3B under CP x TP (x EP)
with FSDP: the numbers of docs/parallelism.md, from the formula stated there (an estimate, not a
measurement).

    python scripts/parallel_memory.py

Sizes are torchtitan 0.3.0's Qwen3.5 flavors (``torchtitan/models/qwen3_5/__init__.py``) and
this recipe's ``kimi_linear`` ``48B-A3B`` flavor (parameter counts measured on the meta device,
text model only).
"""

from __future__ import annotations

GIB = 2**30

MODELS = {
    # params: total; experts: routed-expert params; layers; dim; vocab; per-token widths of one
    # linear-attention layer (q+k+v+z projections) and of one attention layer (q+gate, k, v);
    # ffn: per-token width of the feed-forward (dense: hidden; MoE: top_k x hidden + shared).
    "27B": dict(params=26.896e9, experts=0.0, layers=64, dim=5120, vocab=248320,
                linear=2048 + 2048 + 6144 + 6144, attn=12288 + 1024 + 1024, kv=1024 + 1024,
                ffn=17408),
    "35B-A3B": dict(params=34.661e9, experts=32.212e9, layers=40, dim=2048, vocab=248320,
                    linear=2048 + 2048 + 4096 + 4096, attn=8192 + 512 + 512, kv=512 + 512,
                    ffn=8 * 512 + 512),
    # Kimi Linear: KDA q, k, v, decay gate, output gate (32 heads x 128 each); MLA q (32 x 192),
    # the latent (512 + 64) and its expansion (32 x (128 + 128)). kv: the all-gather CP path
    # gathers the 576-number latent but every rank expands it to the whole row's keys
    # (32 x 192) and values (32 x 128): both are held.
    "Kimi-48B-A3B": dict(params=49.123e9, experts=47.110e9, layers=27, dim=2304, vocab=163840,
                         linear=5 * 4096, attn=6144 + 576 + 8192,
                         kv=576 + 32 * (192 + 128), ffn=8 * 1024 + 1024),
}  # fmt: skip # a table, laid out by hand to read across

STATE_BYTES = 16  # fp32 parameter + gradient + AdamW's two moments
ACT_BYTES = 2  # bf16 activations
LOSS_CHUNKS = 8  # loss.num_chunks: fp32 logits of one chunk at a time


def per_rank(model: dict, seq: int, cp: int, tp: int, dp_shard: int) -> dict[str, float]:
    """GiB per rank for one row of ``seq`` tokens (batch 1), full activation checkpointing."""
    n = dp_shard * cp * tp
    t = seq / cp  # tokens of this CP rank; TP ranks split them between layers (SP)
    state = STATE_BYTES * model["params"] / n
    # the checkpointed input of every layer, sequence-parallel over TP
    saved = model["layers"] * (t / tp) * model["dim"] * ACT_BYTES
    # one layer recomputed for its backward: its projections (x4: outputs, conv/norm copies,
    # their gradients) on this rank's heads, and the feed-forward of its tokens
    layer = 4 * t * (max(model["linear"], model["attn"]) + 2 * model["ffn"]) / tp * ACT_BYTES
    # the all-gather CP path of one attention layer: K/V of the whole row, this rank's heads
    kv = seq * model["kv"] / tp * ACT_BYTES
    # logits of one loss chunk and their gradient, fp32, replicated over TP
    logits = 2 * (t / LOSS_CHUNKS) * model["vocab"] * 4
    parts = dict(state=state, saved=saved, layer=layer, kv=kv, logits=logits)
    parts["total"] = sum(parts.values())
    return {k: v / GIB for k, v in parts.items()}


def main() -> None:
    layouts = [
        ("27B", 131072, 8, 1, 1),
        ("27B", 131072, 4, 2, 1),
        ("27B", 1048576, 32, 1, 1),
        ("27B", 1048576, 16, 4, 1),
        ("27B", 1048576, 8, 8, 1),
        ("35B-A3B", 131072, 8, 1, 1),
        ("35B-A3B", 131072, 4, 2, 1),
        ("35B-A3B", 131072, 8, 1, 2),
        ("35B-A3B", 1048576, 32, 1, 1),
        ("35B-A3B", 1048576, 16, 2, 1),
        ("Kimi-48B-A3B", 131072, 8, 1, 2),
        ("Kimi-48B-A3B", 1048576, 32, 1, 1),
        ("Kimi-48B-A3B", 1048576, 32, 1, 2),
    ]
    print(
        "| model | tokens | CP x TP (ranks) | state | saved inputs | one layer | K/V | "
        "logits | total GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, seq, cp, tp, dps in layouts:
        g = per_rank(MODELS[name], seq, cp, tp, dps)
        print(
            f"| {name} | {seq // 1024}k | {cp} x {tp} ({cp * tp * dps}) | {g['state']:.1f} | "
            f"{g['saved']:.1f} | {g['layer']:.1f} | {g['kv']:.1f} | {g['logits']:.1f} | "
            f"{g['total']:.1f} |"
        )


if __name__ == "__main__":
    main()
