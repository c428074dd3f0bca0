"""Memory per rank of Qwen3.5-27B, 35B-A3B and 397B-A17B and Kimi-Linear-48B-A3B under CP x TP
(x EP) with FSDP, and under PP x CP x TP (the busiest stage and the bubble): the numbers of docs/parallelism.md, from the formula stated there (an estimate, not a
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
    # Qwen3.5-397B-A17B (torchtitan's flavor, text model measured on the meta device): 60
    # layers (45 GatedDeltaNet, 15 gated attention), 512 experts of 1024 hidden, top 10
    "397B-A17B": dict(params=396.346e9, experts=386.547e9, layers=60, dim=4096, vocab=248320,
                      linear=2048 + 2048 + 8192 + 8192, attn=16384 + 512 + 512, kv=512 + 512,
                      ffn=10 * 1024 + 1024),
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


def pipeline_rank(
    model: dict, seq: int, pp: int, cp: int, tp: int, dp_shard: int, microbatches: int
) -> dict[str, float]:
    """GiB per rank of the busiest pipeline stage under 1F1B (one row per pipeline microbatch,
    ``microbatches`` of them a step) and the bubble: the stage holds 1/pp of the state; its
    first stage keeps pp microbatches in flight, each with the checkpointed inputs of its
    layers/pp layers, so the saved inputs are those of all layers for one row, as without PP;
    the last stage holds the logits. Bubble (idle fraction of a step): (pp - 1) / (m + pp - 1);
    Interleaved1F1B with v stages per rank: (pp - 1) / (v m + pp - 1)."""
    g = per_rank(model, seq, cp, tp, dp_shard)
    g["state"] /= pp
    g["total"] = sum(v for k, v in g.items() if k != "total")
    g["bubble"] = (pp - 1) / (microbatches + pp - 1)
    g["bubble_v2"] = (pp - 1) / (2 * microbatches + pp - 1)
    return g


PIPELINE_MICROBATCHES = 16

CP_TP_LAYOUTS = {  # (model, tokens): its (CP, TP, dp_shard) rows
    ("27B", 131072): [(8, 1, 1), (4, 2, 1)],
    ("27B", 1048576): [(32, 1, 1), (16, 4, 1), (8, 8, 1)],
    ("35B-A3B", 131072): [(8, 1, 1), (4, 2, 1), (8, 1, 2)],
    ("35B-A3B", 1048576): [(32, 1, 1), (16, 2, 1)],
    ("Kimi-48B-A3B", 131072): [(8, 1, 2)],
    ("Kimi-48B-A3B", 1048576): [(32, 1, 1), (32, 1, 2)],
}
PP_LAYOUTS = {  # (model, tokens): its (PP, CP, TP, dp_shard) rows
    ("397B-A17B", 131072): [(8, 8, 1, 2), (16, 8, 1, 1)],
    ("397B-A17B", 1048576): [(8, 32, 1, 1), (4, 16, 4, 1)],
    ("Kimi-48B-A3B", 131072): [(2, 8, 1, 1)],
    ("Kimi-48B-A3B", 1048576): [(2, 32, 1, 1)],
}
# per_rank's parts, in the tables' GiB columns
GIB_COLUMNS = {
    "state": "state",
    "saved": "saved inputs",
    "layer": "one layer",
    "kv": "K/V",
    "logits": "logits",
    "total": "total GiB",
}


def print_table(columns: list[str], rows: list[list[str]]) -> None:
    """A Markdown table, as docs/parallelism.md holds it."""
    print("| " + " | ".join(columns) + " |")
    print("|---" * len(columns) + "|")
    for cells in rows:
        print("| " + " | ".join(cells) + " |")


def row(name: str, seq: int, ranks: str, g: dict[str, float]) -> list[str]:
    """The cells of one layout: model, tokens, ranks, then the GiB columns."""
    return [name, f"{seq // 1024}k", ranks, *(f"{g[k]:.1f}" for k in GIB_COLUMNS)]


def main() -> None:
    rows = [
        row(name, seq, f"{cp} x {tp} ({cp * tp * dps})", per_rank(MODELS[name], seq, cp, tp, dps))
        for (name, seq), layouts in CP_TP_LAYOUTS.items()
        for cp, tp, dps in layouts
    ]
    print_table(["model", "tokens", "CP x TP (ranks)", *GIB_COLUMNS.values()], rows)
    print()
    rows = []
    for (name, seq), layouts in PP_LAYOUTS.items():
        for pp, cp, tp, dps in layouts:
            g = pipeline_rank(MODELS[name], seq, pp, cp, tp, dps, PIPELINE_MICROBATCHES)
            ranks = f"{pp} x {cp} x {tp} x {dps} ({pp * cp * tp * dps})"
            rows.append([*row(name, seq, ranks, g), f"{g['bubble']:.1%}", f"{g['bubble_v2']:.1%}"])
    columns = ["model", "tokens", "PP x CP x TP x dp_shard (ranks)", *GIB_COLUMNS.values()]
    print_table([*columns, "bubble 1F1B", "bubble interleaved (2/rank)"], rows)


if __name__ == "__main__":
    main()
