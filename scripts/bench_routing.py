"""Cold build time of one rank's RoutingPlan + DeviceRouting per microbatch (CPU, host side).

Every repetition draws fresh random document lengths (and a random rank), so nothing can be
reused between repetitions; the fragment table only depends on (layout, T, W) and is built once
outside the timed region, as a trainer would. Prints a markdown table of medians.

    python scripts/bench_routing.py [--reps 5] [--pipeline] [--attention-gym]
    python scripts/bench_routing.py --ptrr-only [--ptrr-shapes 8x16384,8x131072]

``--ptrr`` (or ``--ptrr-only``) also times the PTRR balancer from the documents against the
dense path it replaced (flex's ``create_block_mask`` + torch's ``_PTRRLoadBalancer``, the tests'
oracle), side by side where the dense path fits ``--dense-max-pairs`` (B·L² token pairs).
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

from torchtitan_cp.routing import RoutingPlan, documents_layout  # noqa: E402

LAYOUTS = ("contiguous", "headtail")
"""The layouts timed: load balancers by their config names (whose order ignores the documents,
so one fragment table serves every draw of a shape)."""


def fragment_table(layout: str, total: int, world: int) -> list[list[tuple[int, int]]]:
    """The balancer ``layout``'s fragments of one row of ``total`` tokens over ``world`` ranks."""
    return documents_layout([total], world, layout).fragments


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
    for layout in LAYOUTS:
        for total in args.tokens:
            for world in args.worlds:
                table = fragment_table(layout, total, world)
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
    """Side by side on the same layouts: attention-gym 0.0.17's pure-Python planner
    (``ContextParallelPlan.from_fragments(...).routing(...)``) against ours, one rank, cold."""
    try:
        from attn_gym.linear.context_parallel import ContextParallelPlan
    except ImportError as err:
        print(
            f"\nattention-gym is not importable ({err}); skipping the side-by-side "
            "(pip install attn-gym==0.0.17 --no-deps to compare)."
        )
        return
    rng = random.Random(args.seed)
    print(
        "\n| layout | T | W | docs | attention-gym ms | torchtitan-cp ms | speed-up |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    for layout in LAYOUTS:
        for total in args.tokens:
            for world in args.worlds:
                table = fragment_table(layout, total, world)
                for docs in args.docs:
                    gym, ours = [], []
                    for _ in range(args.gym_reps):
                        cu = random_cu_seqlens(total, docs, rng)
                        rank = rng.randrange(world)
                        t0 = time.perf_counter()
                        ContextParallelPlan.from_fragments(cu, table, rank).routing(
                            "cpu", conv_history=3
                        )
                        t1 = time.perf_counter()
                        RoutingPlan.build(cu, table, rank).to_device("cpu", conv_history=3)
                        t2 = time.perf_counter()
                        gym.append(t1 - t0)
                        ours.append(t2 - t1)
                    g, o = 1e3 * statistics.median(gym), 1e3 * statistics.median(ours)
                    print(
                        f"| {layout} | {total} | {world} | {docs} | {g:.2f} | {o:.3f} | "
                        f"{g / o:.1f}x |"
                    )


def bench_host_pipeline(args: argparse.Namespace) -> None:
    """The whole per-microbatch host path of the trainer, from CPU positions: document
    boundaries, torch's balancer on the CPU, fragments, cache lookup (miss, then hit) and device
    routing. B rows of L tokens, T = B·L."""
    from torchtitan_cp.routing import PlanCache, cu_seqlens_tensor_from_positions, host_layout

    rng = random.Random(args.seed)
    print(
        "\n| layout | B x L | W | docs | cu_seqlens (loader) ms | layout ms | cache miss "
        "(build) ms | cache hit ms | to_device ms | per microbatch, miss ms |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    for layout in LAYOUTS:
        for total in args.tokens:
            bsz = 8
            seqlen = total // bsz
            for world in args.worlds:
                for docs in args.docs:
                    cu_ms, lay_t, miss_t, hit_t, dev_t = [], [], [], [], []
                    for _ in range(args.reps):
                        cu = random_cu_seqlens(total, docs, rng)
                        cu = sorted(set(cu) | set(range(0, total + 1, seqlen)))
                        starts = torch.zeros(total, dtype=torch.int64)
                        starts[torch.tensor(cu[:-1])] = 1
                        idx = torch.arange(total)
                        last = torch.cummax(torch.where(starts.bool(), idx, 0), 0).values
                        positions = (idx - last).reshape(bsz, seqlen)
                        cache = PlanCache(16)
                        rank = rng.randrange(world)
                        tc = time.perf_counter()
                        cu_t = cu_seqlens_tensor_from_positions(positions)  # in the loader
                        t0 = time.perf_counter()
                        lay = host_layout(
                            positions,
                            cu_seqlens=cu_t,
                            load_balancer=layout,
                            world_size=world,
                            device="cpu",
                        )
                        t1 = time.perf_counter()
                        cu_ms.append(t0 - tc)
                        plan = cache.get(lay.cu_seqlens, lay.fragments, rank)
                        t2 = time.perf_counter()
                        cache.get(lay.cu_seqlens, lay.fragments, rank)
                        t3 = time.perf_counter()
                        plan.to_device("cpu", conv_history=3)
                        t4 = time.perf_counter()
                        lay_t.append(t1 - t0)
                        miss_t.append(t2 - t1)
                        hit_t.append(t3 - t2)
                        dev_t.append(t4 - t3)
                    med = [1e3 * statistics.median(x) for x in (cu_ms, lay_t, miss_t, hit_t, dev_t)]
                    print(
                        f"| {layout} | {bsz} x {seqlen} | {world} | {docs} | {med[0]:.3f} | "
                        f"{med[1]:.3f} | {med[2]:.3f} | {med[3]:.3f} | {med[4]:.3f} | "
                        f"{med[1] + med[2] + med[4]:.3f} |"
                    )


def _shapes(text: str) -> list[tuple[int, int]]:
    return [(int(b), int(n)) for b, n in (s.split("x") for s in text.split(","))]


def _timed(times: list[tuple[float, float]], fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, appending its ``(wall s, CPU s)`` to ``times``."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn(*args, **kwargs)
    times.append((time.perf_counter() - t0, time.process_time() - c0))
    return out


def _cell(times: list[tuple[float, float]]) -> str:
    """``wall min / wall median / CPU median`` in ms, or a dash when not run."""
    if not times:
        return "—"
    wall, cpu = zip(*times)
    ms = [1e3 * min(wall), 1e3 * statistics.median(wall), 1e3 * statistics.median(cpu)]
    return " / ".join(f"{v:.3f}" for v in ms)


def _dense_ptrr(positions: torch.Tensor, block: int, world: int) -> torch.Tensor:
    """The path PTRR replaced: flex's dense mask, then torch's balancer (the tests' oracle)."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _PTRRLoadBalancer,
    )

    from tests.helpers import dense_document_block_mask

    return _PTRRLoadBalancer(dense_document_block_mask(positions, block), world)._generate_indices()


def bench_ptrr(args: argparse.Namespace) -> None:
    """PTRR's rearrange index per microbatch, from the loader's ``cu_seqlens`` (host path) and
    from the positions alone (readback path, here on the CPU), the whole host layout (index +
    fragment table), and the dense path on the same layouts where it fits. Every repetition
    draws new documents; ``cu_seqlens`` is derived outside the timed region (the loader does
    it). Wall min / median and CPU-time median (``time.process_time``), ms."""
    from torchtitan_cp.routing import cu_seqlens_tensor_from_positions, get_balancer, host_layout

    rng = random.Random(args.seed)
    block = args.ptrr_block_size
    lb = get_balancer("ptrr", ptrr_block_size=block)
    warm = torch.zeros(1, 2 * block, dtype=torch.int64)  # first calls set up flex's vmap
    _dense_ptrr(warm, block, 2)
    lb.indices(warm, 2, "cpu")
    print(
        f"\nPTRR, block {block}: index from the documents (host), from the positions (readback), "
        "the host layout (index + fragments), and the dense path; wall min / median, CPU median, ms"
        "\n\n| B x L | W | docs | host index ms (min / med / cpu) | readback index ms "
        "(min / med / cpu) | host layout ms (min / med / cpu) | dense index ms (min / med / cpu) "
        "| dense / host |\n| --- | ---: | ---: | --- | --- | --- | --- | ---: |"
    )
    for bsz, seqlen in args.ptrr_shapes:
        total = bsz * seqlen
        for world in args.ptrr_worlds:
            for docs in args.ptrr_docs:
                dense = bsz * seqlen * seqlen <= args.dense_max_pairs
                times: dict[str, list[tuple[float, float]]] = {
                    k: [] for k in ("host", "back", "lay", "dense")
                }
                for rep in range(args.reps):
                    cu = random_cu_seqlens(total, min(docs, total), rng)
                    cu = sorted(set(cu) | set(range(0, total + 1, seqlen)))
                    starts = torch.zeros(total, dtype=torch.bool)
                    starts[torch.tensor(cu[:-1])] = True
                    col = torch.arange(total)
                    last = torch.where(starts, col, 0).cummax(0).values
                    positions = (col - last).view(bsz, seqlen)
                    cu_t = cu_seqlens_tensor_from_positions(positions)  # in the loader
                    host = _timed(
                        times["host"], lb.indices, positions, world, "cpu", cu_seqlens=cu_t
                    )
                    _timed(times["back"], lb.indices, positions, world, "cpu")
                    _timed(
                        times["lay"],
                        host_layout,
                        positions,
                        cu_seqlens=cu_t,
                        load_balancer=lb,
                        world_size=world,
                        device="cpu",
                    )
                    if dense and rep < args.dense_reps:
                        ref = _timed(times["dense"], _dense_ptrr, positions, block, world)
                        assert torch.equal(ref, host)  # the same index, or nothing is compared
                if times["dense"]:
                    med = {k: statistics.median(w for w, _ in times[k]) for k in ("dense", "host")}
                    speedup = f"{med['dense'] / med['host']:.0f}x"
                else:
                    speedup = f"— (over {args.dense_max_pairs:.2g} pairs)"
                cells = " | ".join(_cell(t) for t in times.values())
                print(f"| {bsz} x {seqlen} | {world} | {docs} | {cells} | {speedup} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=_ints, default=[131072, 1048576])
    parser.add_argument("--worlds", type=_ints, default=[8, 64])
    parser.add_argument("--docs", type=_ints, default=[64, 1024, 4096, 16384])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attention-gym", action="store_true")
    parser.add_argument("--gym-reps", type=int, default=3)
    parser.add_argument("--pipeline", action="store_true", help="also time the whole host path")
    parser.add_argument("--ptrr", action="store_true", help="also time PTRR against the dense path")
    parser.add_argument("--ptrr-only", action="store_true", help="time only PTRR")
    parser.add_argument(
        "--ptrr-shapes",
        type=_shapes,
        default=[(1, 4096), (1, 8192), (2, 8192), (1, 16384), (8, 16384), (8, 131072)],
    )
    parser.add_argument("--ptrr-worlds", type=_ints, default=[8])
    parser.add_argument("--ptrr-docs", type=_ints, default=[64, 1024])
    parser.add_argument("--ptrr-block-size", type=int, default=128)
    parser.add_argument("--dense-reps", type=int, default=3)
    parser.add_argument(
        "--dense-max-pairs",
        type=float,
        default=2**28,
        help="skip the dense path above B*L*L token pairs (~10 bytes each)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # host-side planning runs next to the data loader, on one core
    if args.ptrr_only:
        bench_ptrr(args)
        return 0

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
    if args.pipeline:
        bench_host_pipeline(args)
    if args.attention_gym:
        bench_attention_gym(args)
    if args.ptrr:
        bench_ptrr(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
