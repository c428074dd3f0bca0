"""Cold build time of one rank's RoutingPlan + DeviceRouting per microbatch (CPU, host side).

Every repetition draws fresh random document lengths (and a random rank), so nothing can be
reused between repetitions; the fragment table only depends on (layout, T, W) and is built once
outside the timed region, as a trainer would. Prints a markdown table of medians.

    python scripts/bench_routing.py [--reps 5] [--attention-gym]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan_cp.routing import (  # noqa: E402
    RoutingPlan,
    contiguous_fragments,
    headtail_fragments,
)

LAYOUTS = {"contiguous": contiguous_fragments, "head-tail": headtail_fragments}


def random_cu_seqlens(total: int, docs: int, rng: random.Random) -> list[int]:
    """``docs`` documents with random lengths summing to ``total`` (distinct random cuts).

    ``random.sample`` over a range is O(docs), so drawing a layout does not sweep a T-sized
    buffer through the caches right before the timed build. The list comes from ``tolist()``
    like ``cu_seqlens_from_positions``'s does (ints allocated in order; a list of ints scattered
    over the heap reads ~2x slower, bound by memory latency).
    """
    cuts = sorted(rng.sample(range(1, total), docs - 1))
    return torch.tensor([0, *cuts, total]).tolist()


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def bench_routing(args: argparse.Namespace) -> list[dict]:
    rng = random.Random(args.seed)
    rows = []
    for layout, make in LAYOUTS.items():
        for total in args.tokens:
            for world in args.worlds:
                table = make(total, 1, world)
                for docs in args.docs:
                    plan_t, dev_t, subs = [], [], []
                    for _ in range(args.reps):
                        cu = random_cu_seqlens(total, docs, rng)
                        rank = rng.randrange(world)
                        t0 = time.perf_counter()
                        plan = RoutingPlan.build(cu, table, rank)
                        t1 = time.perf_counter()
                        plan.to_device("cpu", conv_history=3)
                        t2 = time.perf_counter()
                        plan_t.append(t1 - t0)
                        dev_t.append(t2 - t1)
                        subs.append(plan.num_subsequences)
                    total_t = [a + b for a, b in zip(plan_t, dev_t)]
                    rows.append(
                        {
                            "layout": layout,
                            "T": total,
                            "W": world,
                            "docs": docs,
                            "frags": max(len(f) for f in table),
                            "subs": int(statistics.median(subs)),
                            "plan_ms": 1e3 * statistics.median(plan_t),
                            "device_ms": 1e3 * statistics.median(dev_t),
                            "total_ms": 1e3 * statistics.median(total_t),
                            "best_ms": 1e3 * min(total_t),
                        }
                    )
    return rows


def bench_attention_gym(args: argparse.Namespace) -> None:
    """Side-by-side: attention-gym's document mask + flex BlockMask build, when importable.

    A BlockMask costs O((T / block)^2) mask evaluations, so it is only run up to
    ``--gym-max-tokens`` to keep this a short benchmark on a CPU.
    """
    try:
        from attn_gym.masks.causal import causal_mask
        from attn_gym.masks.document_mask import generate_doc_mask_mod
    except ImportError as err:
        print(
            f"\nattention-gym is not importable ({err}); skipping its planner "
            "(install attn-gym to compare)."
        )
        return
    from torch.nn.attention.flex_attention import create_block_mask

    rng = random.Random(args.seed)
    print("\n| attention-gym BlockMask | T | docs | build ms |\n| --- | ---: | ---: | ---: |")
    for total in args.tokens:
        if total > args.gym_max_tokens:
            print(f"| document causal | {total} | - | skipped (> --gym-max-tokens) |")
            continue
        for docs in args.docs:
            times = []
            for _ in range(args.reps):
                offsets = torch.tensor(random_cu_seqlens(total, docs, rng))
                t0 = time.perf_counter()
                mask_mod = generate_doc_mask_mod(causal_mask, offsets)
                create_block_mask(mask_mod, 1, 1, total, total, device="cpu")
                times.append(time.perf_counter() - t0)
            print(f"| document causal | {total} | {docs} | {1e3 * statistics.median(times):.3f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=_ints, default=[131072, 1048576])
    parser.add_argument("--worlds", type=_ints, default=[8, 64])
    parser.add_argument("--docs", type=_ints, default=[64, 1024, 4096, 16384])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attention-gym", action="store_true")
    parser.add_argument("--gym-max-tokens", type=int, default=16384)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # host-side planning runs next to the data loader, on one core

    rows = bench_routing(args)
    print(
        "| layout | T | W | docs | frags/rank | subseqs (rank) | plan ms | to_device ms | total ms "
        "| best total ms |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['layout']} | {r['T']} | {r['W']} | {r['docs']} | {r['frags']} | {r['subs']} "
            f"| {r['plan_ms']:.3f} | {r['device_ms']:.3f} | {r['total_ms']:.3f} | {r['best_ms']:.3f} |"
        )
    if args.attention_gym:
        bench_attention_gym(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
