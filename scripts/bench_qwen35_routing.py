"""Per-microbatch host cost of Qwen3.5's document metadata: this recipe's host routing against
its readback path and torchtitan's upstream ``create_varlen_metadata_for_document`` (CPU).

For a packed batch of B rows, each path produces what Qwen3.5's layers consume (device and host
document offsets; with CP also the routing): ``host`` = SequencePreprocessor from the loader's
CPU positions + ``routed_varlen_metadata``; ``readback`` = the same from the device positions
(counted copies); ``upstream`` = torchtitan's per-row ``nonzero`` + ``.tolist()`` (CP=1 only: it
has no CP). Every repetition draws new documents (no plan-cache hits). Prints a markdown table
of medians; "readbacks" counts device->host copies per microbatch (on CUDA each is a sync).

    python scripts/bench_qwen35_routing.py [--reps 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def positions_batch(bsz: int, seqlen: int, docs_per_row: int, gen: torch.Generator):
    pos = torch.empty(bsz, seqlen, dtype=torch.int64)
    for b in range(bsz):
        cuts = torch.randperm(seqlen - 1, generator=gen)[: docs_per_row - 1] + 1
        starts = torch.zeros(seqlen, dtype=torch.bool)
        starts[0] = True
        starts[cuts] = True
        idx = torch.arange(seqlen)
        last = torch.cummax(torch.where(starts, idx, 0), 0).values
        pos[b] = idx - last
    return pos


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    from torchtitan.models.common.attention import create_varlen_metadata_for_document

    from torchtitan_cp.models.qwen35.model import routed_varlen_metadata
    from torchtitan_cp.models.sequence import SequencePreprocessor
    from torchtitan_cp.routing.host_metadata import HostMetadata

    gen = torch.Generator().manual_seed(0)
    print("| B x L | CP | docs/row | path | readbacks | ms per microbatch |")
    print("| --- | ---: | ---: | --- | ---: | ---: |")
    for bsz, seqlen in ((2, 8192), (1, 65536)):
        for world in (1, 4):
            for docs in (8, 256):
                times: dict[str, list[float]] = {"host": [], "readback": [], "upstream": []}
                reads: dict[str, int] = {"host": 0, "readback": 0, "upstream": bsz + 1}
                for _ in range(args.reps):
                    pos = positions_batch(bsz, seqlen, docs, gen)
                    tok = torch.zeros_like(pos)
                    host = HostMetadata(pos.clone())
                    host.cu_seqlens()  # the loader's collate computes this, off the loop
                    for name, source in (("host", "host"), ("readback", "device_readback")):
                        seq = SequencePreprocessor(
                            device="cpu",
                            cp_group=None,
                            load_balancer="headtail",
                            cp_rank=world - 1,
                            cp_world_size=world,
                            routing_source=source,
                        )
                        t0 = time.perf_counter()
                        _, _, _, ctx = seq(tok, tok, pos, host if source == "host" else None)
                        routed_varlen_metadata(ctx)
                        times[name].append(time.perf_counter() - t0)
                        reads[name] = seq.stats.readbacks
                    if world == 1:
                        t0 = time.perf_counter()
                        create_varlen_metadata_for_document(pos, include_host_offsets=True)
                        times["upstream"].append(time.perf_counter() - t0)
                for name, ts in times.items():
                    if ts:
                        ms = 1e3 * statistics.median(ts)
                        print(
                            f"| {bsz} x {seqlen} | {world} | {docs} | {name} | "
                            f"{reads[name]} | {ms:.3f} |"
                        )


if __name__ == "__main__":
    main()
