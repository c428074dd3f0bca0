"""What context parallelism costs a linear-attention layer beyond its local kernel, per rank.

    .venv/bin/python scripts/bench_cp_overhead.py [--kinds kda gdn ssd] [--dims 64 128]
        [--worlds 2 3 4] [--layouts contiguous headtail packed] [--tokens 1024]
        [--json out.json] [--label after]
    .venv/bin/python scripts/bench_cp_overhead.py --compare before.json after.json
    .venv/bin/python scripts/bench_cp_overhead.py --delay 200 --kinds kda --dims 128 --worlds 2
    .venv/bin/python scripts/bench_cp_overhead.py --fla-count [--kinds kda gdn] [--tokens 256]
    .venv/bin/python scripts/bench_cp_overhead.py --compile-count [--kinds kda gdn] [--dims 128]

For every (kind, K = V, W, layout) W gloo ranks each run the CP op (``context_parallel_delta_rule``
/ ``context_parallel_ssd``) forward + backward on their span and, on the same tokens, the local
kernel alone (``chunk_delta_rule`` / ``chunk_ssd`` with the span's own offsets, no entry
states). Per rank it reports

* **FLOPs** counted by ``torch.utils.flop_counter.FlopCounterMode`` (exact, independent of the
  machine's load) of both, and their ratio: CP / local = 1.00 means CP costs nothing extra;
* **CPU seconds** (``time.process_time``, median of ``--repeats``; one intra-op thread) of both;
* **bytes all-gathered** by the CP op (what each rank receives).

Layouts: a load balancer's config name (``contiguous``, ``headtail``, ``ptrr``, ...; read from
its registry by ``routing.documents_layout``) puts one document over the whole stream (every
middle fragment continues and is continued: the worst case); ``packed`` cuts the stream into
documents of 100-700 tokens under the contiguous layout; ``aligned`` puts document boundaries on
the rank boundaries (nothing crosses a rank: CP must equal local). (Tables and JSON files older
than the registry's names spell ``headtail`` as ``head-tail``.) The table's ``worst`` is the largest
ratio over the ranks.

It imports only the public ops and routing, so ``BENCH_SOURCE=/path/to/other/checkout`` runs the
same benchmark on another version (the before/after table of docs/PERFORMANCE.md); that checkout
needs ``routing.documents_layout`` (the layouts' one helper).

``--delay MS`` measures the overlap instead. First, load-independent: the CPU time the rank's
thread spends between posting the summaries' all-gather and waiting for it, and in the backward
between posting the reduce-scatter and waiting for it (work that hides each collective's
latency), against each pass's CPU time. Then every all-gather and reduce-scatter of the CP op
is held back by MS milliseconds (a thread sleeps, then runs it, as a slow network would), and
it gives the CP forward + backward's wall time with and without the delays; an op that overlaps
its collectives with state-independent work grows by less than the two delays (wall time,
medians of ``--repeats``: it needs an otherwise idle machine to mean much).

``--fla-count`` counts the fla (CUDA) path's work without a GPU: one process runs fla's Triton
kernels under Triton's interpreter (tests/fla_interpreter.py, the ``fla_interpreter`` test tier)
and counts every ``tl.dot`` as ``2 m n k`` of its tile shapes (the kernels' matmul work, masked
tails included; element-wise work is not counted, as with FlopCounterMode), every launch and its
programs (grid size). For KDA and GDN at each K = V it counts, forward + backward on ``--tokens``
tokens of one sequence: the local kernel (fla, with an entry state); the summary of the whole
span as a middle rank publishes it through fla's full ``chunk_kda`` / ``chunk_gated_delta_rule``
at value width V + K from ``[0 | I]`` (outputs discarded; the oldest form); and the CP layer of
that middle rank (``ops/delta_rule/fla_kernel.py``: one WY preparation for the summaries and the
local kernel, the summary's backward fed the cotangent the CP driver sends, ``D [I | hᵀ]``,
joined with the local kernel's before one WY backward); and the compiled path's custom ops
on the same tokens (``delta_rule_fla_prepare`` once, then ``delta_rule_fla_local`` and
``delta_rule_summaries_fla`` on its factors, forward + backward; the summaries' backward takes
the full cotangent ``[dE | dM]``). The JSON rows also split the local kernel, the CP layer and
the compiled ops by fla kernel name (``*_kernels``: FLOPs by the kernel that ran each dot).

``--compile-count`` counts the compiled path's summaries on the torch backend: what their custom
ops run (forward op, then the backward op that recomputes it), before (the local kernel's op pair
at value width V + K from ``[0 | I]``) and now (the states-only summaries op pair), against the
local kernel on the same tokens (FlopCounterMode on the ops' bodies: it cannot see into an op).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

if os.environ.get("BENCH_SOURCE"):
    sys.path.insert(0, os.environ["BENCH_SOURCE"])
# Triton's interpreter must be on before anything imports triton.language (FlopCounterMode does).
if "--fla-count" in sys.argv:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests import fla_interpreter

    fla_interpreter.install()

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

H = 2  # q/k and value heads


def _table(layout: str, world: int, per_rank: int) -> tuple[list[int], list[list[tuple[int, int]]]]:
    """``(cu_seqlens, fragments)`` of ``layout``: a load balancer's config name (one document
    over the stream) or ``aligned`` / ``packed`` (documents on the rank boundaries / of
    100-700 tokens, under the contiguous balancer)."""
    from torchtitan_cp.routing import balancer_names, documents_layout

    total = world * per_rank
    lens = [total]
    if layout == "aligned":
        lens = [per_rank] * world
    elif layout == "packed":
        gen = torch.Generator().manual_seed(world)
        cu = [0]
        while cu[-1] < total:
            cu.append(min(total, cu[-1] + int(torch.randint(100, 700, (1,), generator=gen))))
        lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    elif layout not in balancer_names():
        raise SystemExit(
            f"--layouts: unknown layout {layout!r}; choose a load balancer "
            f"({', '.join(balancer_names())}), aligned or packed"
        )
    balancer = layout if layout in balancer_names() else "contiguous"
    placed = documents_layout(lens, world, balancer)
    return placed.cu_seqlens.tolist(), placed.fragments


def _inputs(kind: str, T: int, D: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    q = F.normalize(rnd(1, T, H, D), dim=-1)
    k = F.normalize(rnd(1, T, H, D), dim=-1)
    v = rnd(1, T, H, D)
    if kind == "kda":
        g = -F.softplus(rnd(1, T, H, D)) * 0.1
    else:
        g = -F.softplus(rnd(1, T, H)) * 0.1
    xs = [q, k, v, g]
    if kind != "ssd":
        xs.append(torch.sigmoid(rnd(1, T, H)))
    return [x.requires_grad_(True) for x in xs]


def _ops(kind: str, routing, group):
    from torchtitan_cp.ops import chunk_delta_rule, context_parallel_delta_rule
    from torchtitan_cp.ops.ssd.local import chunk_ssd
    from torchtitan_cp.ops.ssd.recurrence import context_parallel_ssd

    cu = routing.cu_seqlens_cpu
    if kind == "ssd":

        def cp(*xs):
            return context_parallel_ssd(*xs, routing=routing, group=group, backend="torch")[0]

        def local(*xs):
            return chunk_ssd(*xs, cu_seqlens=cu, cu_seqlens_cpu=cu, backend="torch")[0]

    else:

        def cp(*xs):
            return context_parallel_delta_rule(
                *xs, kind=kind, routing=routing, group=group, backend="torch"
            )[0]

        def local(*xs):
            return chunk_delta_rule(
                *xs, kind=kind, cu_seqlens=cu, cu_seqlens_cpu=cu, backend="torch"
            )[0]

    return cp, local


def _fwd_bwd(fn, xs: list[torch.Tensor]) -> None:
    for x in xs:
        x.grad = None
    o = fn(*xs)
    o.backward(torch.ones_like(o))


def _flops(fn, xs) -> int:
    with FlopCounterMode(display=False) as counter:
        _fwd_bwd(fn, xs)
    return counter.get_total_flops()


def _cpu(fn, xs, repeats: int, group) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier(group)
        c0 = time.process_time()
        fn(xs)
        times.append(time.process_time() - c0)
    return statistics.median(times)


class _DelayedWork:
    def __init__(self, thread: threading.Thread) -> None:
        self._thread = thread

    def wait(self, *_args) -> bool:
        self._thread.join()
        return True

    def is_completed(self) -> bool:
        return not self._thread.is_alive()


def _install_delay(seconds: float) -> None:
    """Hold every all-gather of the CP ops, and every reduce-scatter of their backward, back by
    ``seconds`` (a slow network, emulated)."""
    from torchtitan_cp.ops.cp import collectives

    def delay(real):
        def delayed(out, x, *args, async_op=False, **kwargs):
            if not async_op:
                time.sleep(seconds)
                return real(out, x, *args, **kwargs)

            def run() -> None:
                time.sleep(seconds)
                with torch.no_grad():  # as c10d's own threads: grad mode is per thread
                    real(out, x, *args, **kwargs)

            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            return _DelayedWork(thread)

        return delayed

    collectives._all_gather_single = delay(collectives._all_gather_single)
    collectives._reduce_scatter_single = delay(collectives._reduce_scatter_single)


def _worker(rank: int, world: int, port: int, cfg: dict, out: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    try:
        from torchtitan_cp.routing import RoutingPlan

        kind, D, layout = cfg["kind"], cfg["dim"], cfg["layout"]
        cu, table = _table(layout, world, cfg["tokens"])
        routing = RoutingPlan.build(cu, table, rank).to_device(torch.device("cpu"))
        span = torch.cat([torch.arange(a, b) for a, b in table[rank]])
        full = _inputs(kind, cu[-1], D, seed=7)
        xs = [x.detach().index_select(1, span).requires_grad_(True) for x in full]
        group = dist.group.WORLD
        cp, local = _ops(kind, routing, group)
        res: dict = {"rank": rank}
        if cfg["delay_ms"]:
            res.update(_overlap(cp, xs, cfg, group))
        else:
            _fwd_bwd(cp, xs)  # warm-up (also of the collectives)
            res["cp_flops"] = _flops(cp, xs)
            res["local_flops"] = _flops(local, xs)
            res["cp_cpu"] = _cpu(lambda a: _fwd_bwd(cp, a), xs, cfg["repeats"], group)
            res["local_cpu"] = _cpu(lambda a: _fwd_bwd(local, a), xs, cfg["repeats"], group)
            # Every rank receives W copies of the per-slot summary buffer.
            HV, K, V = H, D, D
            per_slot = HV * (K * V + 1) if kind == "ssd" else HV * K * (V + K)
            res["gather_bytes"] = world * routing.num_slots * per_slot * 4
        out[rank] = res
    finally:
        dist.destroy_process_group()


class _Marks:
    """Thread CPU time at the post of each collective the CP op issues asynchronously and at
    the wait on its work (c10d's calls wrapped)."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}

    def __enter__(self):
        from torchtitan_cp.ops.cp import collectives

        self.real = collectives._all_gather_single, collectives._reduce_scatter_single
        marks = self.marks

        def wrap(real, name):
            class Work:
                def __init__(self, work) -> None:
                    self.work = work

                def wait(self, *args):
                    marks.setdefault(name + " wait", time.thread_time())
                    return self.work.wait(*args)

            def post(*args, async_op=False, **kwargs):
                marks.setdefault(name + " post", time.thread_time())
                work = real(*args, async_op=async_op, **kwargs)
                return Work(work) if async_op else work

            return post

        collectives._all_gather_single = wrap(self.real[0], "gather")
        collectives._reduce_scatter_single = wrap(self.real[1], "scatter")
        return self

    def __exit__(self, *exc) -> None:
        from torchtitan_cp.ops.cp import collectives

        collectives._all_gather_single, collectives._reduce_scatter_single = self.real

    def flight(self, name: str) -> float:
        """CPU seconds between the post and the wait (0 for a blocking collective)."""
        post = self.marks[name + " post"]
        return self.marks.get(name + " wait", post) - post


def _in_flight_cpu(cp, xs) -> dict[str, float]:
    """CPU seconds this thread spends, in the forward, between posting the all-gather and
    waiting for it and, in the backward, between posting the reduce-scatter and waiting for it
    (the work that overlaps each collective), and each pass's CPU seconds: thread CPU time, so
    that the machine's load does not enter."""
    for x in xs:
        x.grad = None
    with _Marks() as m:
        t0 = time.thread_time()
        o = cp(*xs)
        t1 = time.thread_time()
        o.backward(torch.ones_like(o))
        t2 = time.thread_time()
    return {
        "fwd_cpu": t1 - t0,
        "in_flight_cpu": m.flight("gather"),
        "bwd_cpu": t2 - t1,
        "bwd_in_flight_cpu": m.flight("scatter"),
    }


def _overlap(cp, xs, cfg: dict, group) -> dict:
    def wall() -> float:
        times = []
        for _ in range(cfg["repeats"]):
            dist.barrier(group)
            t0 = time.perf_counter()
            _fwd_bwd(cp, xs)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    _fwd_bwd(cp, xs)  # warm-up
    flight = [_in_flight_cpu(cp, xs) for _ in range(cfg["repeats"])]
    res = {key: statistics.median(f[key] for f in flight) for key in flight[0]}
    res["wall"] = wall()
    _install_delay(cfg["delay_ms"] / 1000)
    res["wall_delayed"] = wall()
    return res


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(cfg: dict, world: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, cfg, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"a rank failed for {cfg} (world {world})")
        return [out[r] for r in range(world)]


def _row(cfg: dict, world: int, ranks: list[dict]) -> dict:
    ratios = [r["cp_flops"] / max(r["local_flops"], 1) for r in ranks]
    cpu = [r["cp_cpu"] / max(r["local_cpu"], 1e-9) for r in ranks]
    worst = max(range(world), key=lambda i: ratios[i])
    return {
        **{k: cfg[k] for k in ("kind", "dim", "layout", "tokens")},
        "world": world,
        "worst_rank": worst,
        "flops_ratio": ratios,
        "cpu_ratio": cpu,
        "cp_gflop": ranks[worst]["cp_flops"] / 1e9,
        "local_gflop": ranks[worst]["local_flops"] / 1e9,
        "gather_kib": ranks[0]["gather_bytes"] / 1024,
    }


def _key(row: dict) -> tuple:
    return (row["kind"], row["dim"], row["world"], row["layout"], row["tokens"])


def markdown(rows: list[dict], before: dict | None = None) -> str:
    head = "| kind | K=V | W | layout | CP GFLOP | local GFLOP | CP/local FLOPs (worst rank) |"
    head += " CP/local per rank | CPU time ratio (worst) | all-gathered KiB |"
    if before is not None:
        head = head.replace("| kind", "| kind").rstrip("|") + "| before: CP/local FLOPs |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        line = (
            f"| {r['kind']} | {r['dim']} | {r['world']} | {r['layout']} | {r['cp_gflop']:.3f} "
            f"| {r['local_gflop']:.3f} | **{max(r['flops_ratio']):.2f}x** | "
            f"{' / '.join(f'{x:.2f}' for x in r['flops_ratio'])} | "
            f"{r['cpu_ratio'][r['worst_rank']]:.2f}x | {r['gather_kib']:.0f} |"
        )
        if before is not None:
            b = before.get(_key(r))
            line += f" {max(b['flops_ratio']):.2f}x |" if b else " - |"
        lines.append(line)
    return "\n".join(lines)


class _DotCounter:
    """Counts, under Triton's interpreter, every launch (kernel, programs) and ``tl.dot`` FLOPs,
    in all and by kernel name (``by_kernel``)."""

    def __init__(self) -> None:
        from triton.runtime import interpreter

        self.flops = 0
        self.launches: list[tuple[str, int]] = []
        self.by_kernel: dict[str, int] = {}
        builder, grid_exec = interpreter.InterpreterBuilder, interpreter.GridExecutor
        dot, call, set_grid = builder.create_dot, grid_exec.__call__, builder.set_grid_dim
        counter = self

        def create_dot(b, a, bb, d, *rest):
            m, k = a.data.shape[-2:]
            batch = 1
            for n_ in a.data.shape[:-2]:
                batch *= n_
            flops = 2 * batch * m * k * bb.data.shape[-1]
            counter.flops += flops
            name = counter.launches[-1][0] if counter.launches else "?"
            counter.by_kernel[name] = counter.by_kernel.get(name, 0) + flops
            return dot(b, a, bb, d, *rest)

        def grid_call(ge, *args, **kwargs):
            counter.launches.append((getattr(ge.fn, "__name__", "?"), 0))
            return call(ge, *args, **kwargs)

        def set_grid_dim(b, x, y, z):
            name, _ = counter.launches[-1]
            counter.launches[-1] = (name, x * y * z)
            return set_grid(b, x, y, z)

        builder.create_dot, grid_exec.__call__ = create_dot, grid_call
        builder.set_grid_dim = set_grid_dim

    def take(self) -> tuple[int, int, int]:
        """(FLOPs, launches, programs) since the last take."""
        out = (self.flops, len(self.launches), sum(p for _, p in self.launches))
        self.flops, self.launches = 0, []
        return out

    def take_kernels(self) -> dict[str, int]:
        """FLOPs by kernel name since the last call, largest first."""
        out = dict(sorted(self.by_kernel.items(), key=lambda kv: -kv[1]))
        self.by_kernel = {}
        return out


def fla_count(kinds: list[str], dims: list[int], tokens: int) -> list[dict]:
    """The fla path's local kernel and summary pass, counted under Triton's interpreter."""
    from tests import fla_interpreter

    if fla_interpreter.reason() is not None:
        raise SystemExit(f"--fla-count needs Triton's interpreter: {fla_interpreter.reason()}")
    from torchtitan_cp.ops import chunk_delta_rule
    from torchtitan_cp.ops.common.fla import FLA_CHUNK_SIZE
    from torchtitan_cp.ops.cp.recurrence import SequenceTables, SummaryRows
    from torchtitan_cp.ops.delta_rule.custom_ops import (
        delta_rule_fla_local_op,
        delta_rule_fla_prepare_op,
        delta_rule_summaries_fla_op,
    )
    from torchtitan_cp.ops.delta_rule.recurrence import DeltaRule
    from torchtitan_cp.routing import chunk_indices, chunk_offsets

    counter = _DotCounter()
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    ci, co = chunk_indices(cu, FLA_CHUNK_SIZE), chunk_offsets(cu, FLA_CHUNK_SIZE)
    tables = SequenceTables(cu, cu, ci, co)

    def fla_delta_rule(
        xs: Sequence[torch.Tensor], kind: str, h0: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fla's ``chunk_delta_rule`` on the one sequence from ``h0``: output and final state."""
        o, fin = chunk_delta_rule(
            *xs,
            kind=kind,
            initial_state=h0,
            output_final_state=True,
            cu_seqlens=cu,
            cu_seqlens_cpu=cu,
            backend="fla",
        )
        assert fin is not None
        return o, fin

    rows = []
    for kind in kinds:
        for D in dims:
            xs = _inputs(kind, tokens, D, seed=D)
            gen = torch.Generator().manual_seed(1)
            h = torch.randn(1, H, D, D, generator=gen) * 0.1  # the entry state
            dS = torch.randn(1, H, D, D, generator=gen)  # D: the final state's cotangent
            cot = torch.cat([dS, dS @ h.transpose(-1, -2)], -1)  # what the driver sends
            row: dict[str, Any] = dict(kind=kind, dim=D, tokens=tokens)
            # Local kernel, fwd + bwd, with an entry state.
            counter.take()
            counter.take_kernels()
            o, fin = fla_delta_rule(xs, kind, h)
            fwd = counter.take()
            (o.sum() + (fin * dS).sum()).backward()
            bwd = counter.take()
            row["local"] = [a + b for a, b in zip(fwd, bwd, strict=True)]
            row["local_kernels"] = counter.take_kernels()
            # Before: fla's full forward and backward at value width V + K, outputs discarded.
            q, k, v, g, beta = xs
            vs = torch.cat([v, v.new_zeros(*v.shape[:3], D)], -1)
            h0 = torch.cat([torch.zeros(1, H, D, D), torch.eye(D).expand(1, H, D, D)], -1)
            counter.take()
            o, fin = fla_delta_rule((q, k, vs, g, beta), kind, h0)
            (fin * cot).sum().backward()
            row["summary_before"] = list(counter.take())
            counter.take_kernels()
            # Now: the CP layer of a middle rank on fla (ops/delta_rule/fla_kernel.py): one WY
            # preparation, the summary of the whole span, the local kernel from h, and one WY
            # backward for the summary's cotangent (what the driver sends) and the local's.
            rec = DeltaRule(kind=kind, backend="fla")
            leaves = tuple(x.detach().requires_grad_(True) for x in xs)
            one = torch.zeros(1, dtype=torch.int32)
            counter.take()
            prepared = rec.prepare(leaves, tables)
            s = rec.summarize(prepared, SummaryRows(one, one, torch.arange(tokens), tables))
            o, fin = rec.local(prepared, h, True)
            assert fin is not None
            ((o.sum() + (fin * dS).sum()) + (s * cot).sum()).backward()
            row["cp_layer"] = list(counter.take())
            row["cp_layer_kernels"] = counter.take_kernels()
            # Under torch.compile the CP layer is custom ops (DeltaRule.prepare): the preparation
            # op once, the local op pair and the summaries op pair of the whole span on its
            # factors (the summaries' backward takes the cotangent the fold's traced backward
            # gives, at width V + K).
            leaves = tuple(x.detach().requires_grad_(True) for x in xs)
            counter.take()
            ins = (x.detach() for x in xs)  # the preparation op has no backward (custom_ops.py)
            factors = delta_rule_fla_prepare_op(*ins, cu, cu, ci, kind, D**-0.5)
            o, fin = delta_rule_fla_local_op(*leaves, factors, h, cu, cu, ci, kind, D**-0.5, True)
            no_scores = [f[:0] if i == 2 else f for i, f in enumerate(factors)]
            s = delta_rule_summaries_fla_op(*leaves, no_scores, cu, cu, ci, one, kind, D**-0.5)
            ((o.sum() + (fin * dS).sum()) + (s * cot).sum()).backward()
            row["compiled"] = list(counter.take())
            row["compiled_kernels"] = counter.take_kernels()
            rows.append(row)
            loc = row["local"][0]
            print(
                f"{kind} K=V={D} T={tokens}: local {loc / 1e9:.3f} GFLOP "
                f"({row['local'][1]} launches); summary before "
                f"{row['summary_before'][0] / 1e9:.3f} ({row['summary_before'][0] / loc:.2f}x); CP layer (local + summary, shared) "
                f"{row['cp_layer'][0] / 1e9:.3f} ({row['cp_layer'][0] / loc:.2f}x); compiled op "
                f"pairs {row['compiled'][0] / 1e9:.3f} ({row['compiled'][0] / loc:.2f}x)",
                flush=True,
            )
    return rows


def _count(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _compile_count_row(kind: str, D: int, tokens: int) -> dict:
    from functools import partial

    from torchtitan_cp.ops.common.custom_ops import recompute_grads
    from torchtitan_cp.ops.delta_rule.custom_ops import summaries_torch_grads
    from torchtitan_cp.ops.delta_rule.torch_kernel import (
        chunk_delta_rule_torch,
        summaries_delta_rule_torch,
    )

    cu = torch.tensor([0, tokens], dtype=torch.int32)
    xs = _inputs(kind, tokens, D, seed=D)
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(1, H, D, D, generator=gen) * 0.1  # the entry state
    dS = torch.randn(1, H, D, D, generator=gen)
    cot = torch.cat([dS, dS @ h.transpose(-1, -2)], -1)  # what the driver sends
    ins = tuple(x.detach() for x in xs)
    kernel = partial(
        chunk_delta_rule_torch, kind=kind, scale=D**-0.5, output_final_state=True, cu_seqlens_cpu=cu
    )

    def eager_local():
        o, fin = kernel(*xs, initial_state=h)
        (o.sum() + (fin * dS).sum()).backward()

    def op_pair(inputs, h0, do, dfin):  # a torch-kernel op's forward, then its backward op
        with torch.no_grad():
            kernel(*inputs, initial_state=h0)
        recompute_grads(kernel, inputs, h0, cu, do, dfin)

    def summaries_now():
        with torch.no_grad():
            summaries_delta_rule_torch(*ins, kind=kind, scale=D**-0.5, cu_seqlens_cpu=cu)
        summaries_torch_grads(ins, cu, cot, kind, D**-0.5)

    q, k, v, g, beta = ins
    vs = torch.cat([v, v.new_zeros(*v.shape[:3], D)], -1)
    h0 = torch.cat([torch.zeros(1, H, D, D), torch.eye(D).expand(1, H, D, D)], -1)
    return dict(
        kind=kind,
        dim=D,
        tokens=tokens,
        local=_count(eager_local),
        local_op=_count(lambda: op_pair(ins, h, torch.ones_like(v), dS)),
        # Before: the local kernel's op pair at value width V + K from [0 | I], its output's
        # cotangent zeros (autograd materialises it), the final state's the driver's.
        summary_before=_count(lambda: op_pair((q, k, vs, g, beta), h0, torch.zeros_like(vs), cot)),
        summary_now=_count(summaries_now),
    )


def compile_count(kinds: list[str], dims: list[int], tokens: int) -> list[dict]:
    """The compiled path's summaries on the torch backend, counted: what its custom ops run
    (a custom op is opaque to FlopCounterMode, so their bodies are counted: the forward op's,
    then the backward op's, which recomputes the forward under autograd). One sequence of
    ``tokens`` tokens, published whole; the backward's cotangent is the driver's ``D [I | hᵀ]``
    (both ops take it whole)."""
    rows = []
    for kind in kinds:
        for D in dims:
            row = _compile_count_row(kind, D, tokens)
            rows.append(row)
            loc = row["local"]
            print(
                f"{kind} K=V={D} T={tokens}: local {loc / 1e9:.3f} GFLOP (its compiled op pair "
                f"{row['local_op'] / 1e9:.3f}); compiled summary before "
                f"{row['summary_before'] / 1e9:.3f} ({row['summary_before'] / loc:.2f}x), now "
                f"{row['summary_now'] / 1e9:.3f} ({row['summary_now'] / loc:.2f}x)",
                flush=True,
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--kinds", nargs="+", default=["kda", "gdn", "ssd"])
    ap.add_argument("--dims", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--worlds", nargs="+", type=int, default=[2, 3, 4])
    ap.add_argument("--layouts", nargs="+", default=["contiguous", "headtail", "packed"])
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--delay", type=float, default=0.0, help="ms added to every all-gather and reduce-scatter"
    )
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--fla-count", action="store_true", help="count the fla path (interpreter)")
    ap.add_argument(
        "--compile-count",
        action="store_true",
        help="count the compiled path's summaries (torch backend)",
    )
    args = ap.parse_args()
    if args.compile_count or args.fla_count:
        kinds = [k for k in args.kinds if k != "ssd"]
        rows = (compile_count if args.compile_count else fla_count)(kinds, args.dims, args.tokens)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return
    if args.compare:
        before = {_key(r): r for r in json.loads(args.compare[0].read_text())}
        print(markdown(json.loads(args.compare[1].read_text()), before))
        return
    rows = []
    for kind in args.kinds:
        for dim in args.dims:
            for world in args.worlds:
                for layout in args.layouts:
                    cfg = dict(
                        kind=kind,
                        dim=dim,
                        layout=layout,
                        tokens=args.tokens,
                        repeats=args.repeats,
                        delay_ms=args.delay,
                    )
                    ranks = run_config(cfg, world)
                    if args.delay:
                        for r in ranks:
                            grow = (r["wall_delayed"] - r["wall"]) * 1000
                            print(
                                f"{kind} K=V={dim} W={world} {layout} rank {r['rank']}: forward "
                                f"{r['fwd_cpu'] * 1000:.1f} ms CPU, "
                                f"{r['in_flight_cpu'] * 1000:.1f} of them while the all-gather "
                                f"is in flight; backward {r['bwd_cpu'] * 1000:.1f} ms CPU, "
                                f"{r['bwd_in_flight_cpu'] * 1000:.1f} while the reduce-scatter "
                                f"is; wall {r['wall'] * 1000:.1f} ms, with {args.delay:.0f} ms "
                                f"on each collective {r['wall_delayed'] * 1000:.1f} ms: grew "
                                f"{grow:.1f} ms ({grow / (2 * args.delay):.2f} of the delays)",
                                flush=True,
                            )
                        continue
                    rows.append(_row(cfg, world, ranks))
                    print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    if rows:
        print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
