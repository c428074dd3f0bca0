"""Attention under CP: K/V memory and traffic per rank, all-gather vs pass-KV, and CPU step time.

Memory and traffic come from shapes alone: the pass-KV numbers are the schedule's own count
(``PassKVPairs.traffic``, the order of work of ``ops/attention/pass_kv.py``), which
tests/test_cp_pass_kv.py checks byte for byte against a real run (messages posted, visiting
buffers alive); the all-gather numbers are the sizes of its collectives. One row of ``T`` tokens,
laid out by the load balancers of ``--layouts`` (their config names: ``headtail``, the default,
``contiguous``, ``ptrr``, ...; ``routing.documents_layout``), documents with exponentially
distributed lengths of the given mean (``one``: a single document), K/V of ``--kv-heads`` x
``--head-dim`` in ``--bytes``-byte elements (default 8 x 128 in bf16: 4 KiB per token).

    python scripts/bench_attention_cp.py [--worlds 2,4,8,16,32] [--tokens 65536,...]
    python scripts/bench_attention_cp.py --step-time [--steps 12]   # debug model, 2 gloo ranks

Prints markdown tables (docs/PERFORMANCE.md, "Attention under CP").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan_cp.routing import (  # noqa: E402
    PassKVSchedule,
    RoutingPlan,
    documents_layout,
    pass_kv_pairs,
)

GIB = 1 << 30


def doc_bounds(total: int, mean: int | None, seed: int) -> list[int]:
    """Document boundaries of one row: exponential lengths of ``mean`` tokens (>= 1), the last
    cut at the row end; None = one document."""
    if mean is None:
        return [0, total]
    gen = torch.Generator().manual_seed(seed)
    n = 2 * total // mean + 16
    lengths = (torch.empty(n).exponential_(1.0 / mean, generator=gen).ceil().clamp(min=1)).long()
    cu = torch.cumsum(lengths, 0)
    cu = cu[cu < total]
    return [0, *cu.tolist(), total]


def _pairs(cu: list[int], table: list[list[tuple[int, int]]]):
    """The layout's pair tables (the same call RoutingPlan.pass_kv makes) and the host time of
    one rank's whole schedule (tables, rounds, visiting ids) for the rank receiving the most."""
    plan = RoutingPlan.build(cu, table, 0)
    args = (
        plan._global_cu,
        plan._sorted_start,
        plan._sorted_stop,
        plan._sorted_rank,
        plan._sorted_local,
        len(table),
    )
    pairs = pass_kv_pairs(*args)
    busiest = max(range(len(table)), key=lambda r: pairs.traffic(r)["received"])
    best = float("inf")
    for _ in range(3):  # best of 3: the machine is shared
        t0 = time.perf_counter()
        PassKVSchedule.build(pass_kv_pairs(*args), busiest)
        best = min(best, time.perf_counter() - t0)
    return pairs, best


def memory_rows(args: argparse.Namespace) -> list[dict]:
    row_bytes = 2 * args.kv_heads * args.head_dim * args.bytes  # one token's K and V
    acc_bytes = 2 * args.kv_heads * args.head_dim * 4  # the same in float32 (own dK/dV)
    out = []
    for layout in args.layouts:
        for total in args.tokens:
            for world in args.worlds:
                for mean in args.docs:
                    cu = doc_bounds(total, mean, args.seed)
                    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
                    table = documents_layout(lens, world, layout).fragments
                    pairs, build_s = _pairs(cu, table)
                    t = [pairs.traffic(r) for r in range(world)]
                    own = max(x["own"] for x in t)
                    kv_peak = max(x["own"] + x["visiting_peak"] for x in t)
                    grad_peak = max(x["own"] * acc_bytes + x["grad_peak"] * row_bytes for x in t)
                    sent_fwd = max(x["sent"] for x in t)
                    sent_all = max(2 * x["sent"] + x["received"] for x in t)
                    out.append({
                        "layout": layout, "T": total, "W": world,
                        "docs": "one" if mean is None else f"{mean // 1024}k",
                        "rounds": len(pairs.shifts),
                        "ag_kv": total * row_bytes,  # every rank gathers all W spans
                        "pkv_kv": kv_peak * row_bytes,
                        "ratio": kv_peak / total,
                        # the gathered dK/dV before the reduce-scatter, and its output
                        "ag_grad": (total + own) * row_bytes,
                        "pkv_grad": grad_peak,
                        "ag_sent": 2 * (world - 1) * own * row_bytes,
                        "pkv_sent_fwd": sent_fwd * row_bytes,
                        "pkv_sent": sent_all * row_bytes,
                        "build_ms": 1e3 * build_s,
                    })  # fmt: skip # a table, laid out by hand to read across
    return out


def print_memory(rows: list[dict]) -> None:
    print(
        "| layout | T | W | docs | rounds | K/V held, all-gather | K/V held, pass-KV | "
        "ratio | dK/dV bufs AG / pass-KV | sent fwd+bwd AG / pass-KV (fwd) | schedule ms |"
    )
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        g = lambda b: f"{b / GIB:.3g}"  # noqa: E731
        print(
            f"| {r['layout']} | {r['T'] // 1024}k | {r['W']} | {r['docs']} | {r['rounds']} | "
            f"{g(r['ag_kv'])} GiB | {g(r['pkv_kv'])} GiB | {r['ratio']:.3f} | "
            f"{g(r['ag_grad'])} / {g(r['pkv_grad'])} GiB | {g(r['ag_sent'])} / "
            f"{g(r['pkv_sent'])} ({g(r['pkv_sent_fwd'])}) GiB | {r['build_ms']:.1f} |"
        )


# ------------------------------------------------------------------------- step time


def _step_worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist
    import torch.nn.functional as F

    from torchtitan_cp.models import model_config
    from torchtitan_cp.models.sequence import SequencePreprocessor
    from torchtitan_cp.routing.host_metadata import HostMetadata

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    torch.manual_seed(0)
    model = model_config("debug", layer_pattern=args.pattern).build()
    model.init_states()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 4096, (args.batch, args.seq_len), generator=gen)
    positions = torch.cat([torch.arange(n) for n in doc_lengths(args, gen)])[: args.seq_len]
    positions = positions.expand(args.batch, -1).contiguous()
    seqs = {
        mode: SequencePreprocessor(device="cpu", cp_group=dist.group.WORLD,
                                   load_balancer="headtail", attention_cp=mode)
        for mode in ("all_gather", "pass_kv")
    }  # fmt: skip # a table, laid out by hand to read across
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in seqs}
    for step in range(args.steps + 2):
        for mode, seq in seqs.items():  # interleaved: both modes see the same machine load
            dist.barrier()
            w0, c0 = time.perf_counter(), time.process_time()
            inp, lab, pos, ctx = seq(tokens, tokens, positions, HostMetadata(positions.clone()))
            logits = model(inp, pos, ctx)
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab.reshape(-1)).backward()
            if step >= 2:
                times[mode].append((time.perf_counter() - w0, time.process_time() - c0))
            model.zero_grad()
    dist.destroy_process_group()
    queue.put((rank, times))


def doc_lengths(args: argparse.Namespace, gen: torch.Generator) -> list[int]:
    n = 2 * args.seq_len // args.doc_mean + 4
    return torch.randint(1, 2 * args.doc_mean, (n,), generator=gen).tolist()


def step_time(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    from tests.dist_utils import free_port  # the repository root is on sys.path (above)

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_step_worker, args=(r, 2, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    print(
        f"debug model {args.pattern}, CP=2 head-tail, {args.batch} x {args.seq_len} tokens, "
        f"documents ~{args.doc_mean}, forward + backward, {args.steps} steps (median):"
    )
    for mode in ("all_gather", "pass_kv"):
        wall = statistics.median(
            max(results[r][mode][i][0] for r in results) for i in range(args.steps)
        )
        cpu = statistics.median(results[0][mode][i][1] for i in range(args.steps))
        print(f"| {mode} | {1e3 * wall:.0f} ms | {1e3 * cpu:.0f} ms |")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=_ints, default=[2, 4, 8, 16, 32])
    p.add_argument("--tokens", type=_ints, default=[65536, 262144, 1048576])
    p.add_argument(
        "--docs",
        type=lambda s: [None if x == "one" else int(x) for x in s.split(",")],
        default=[1024, 8192, 65536, None],
        help="mean document lengths, or 'one'",
    )
    p.add_argument("--layouts", type=lambda s: s.split(","), default=["headtail"])
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--bytes", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-time", action="store_true")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--pattern", default="KGKA")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--doc-mean", type=int, default=64)
    args = p.parse_args()
    if args.step_time:
        step_time(args)
        return
    print_memory(memory_rows(args))


if __name__ == "__main__":
    main()
