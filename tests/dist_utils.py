"""Run a function on N gloo processes on this machine and surface their failures in pytest.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes (spawn start
method, one thread each), initialises a gloo process group on a free localhost port, calls
``fn(rank, world_size, *args)`` in every child and returns the list of their return values
(rank order). A child's exception is re-raised in the caller with the child's traceback; a
child that dies or a run that exceeds ``timeout`` fails the test and the children are
killed, so a mismatched collective cannot hang the suite.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0 and let the OS choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
    timeout: float,
) -> None:
    # Several processes share two cores: one intra-op thread each avoids oversubscription.
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, False, traceback.format_exc()))


class ChildFailure(AssertionError):
    """A spawned rank raised, died or timed out; the message carries its traceback."""


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 150.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return their results.

    ``fn`` and ``args`` must be picklable (module-level functions). Raises ``ChildFailure``
    naming the first failing rank.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(rank, world_size, port, fn, args, results, timeout),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                failures.append(f"timed out after {timeout:.0f}s; finished ranks {sorted(outputs)}")
                break
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if not p.is_alive() and p.exitcode not in (0, None) and r not in outputs
                ]
                if dead:
                    # Give a dying rank's report a moment to arrive before blaming the exit code.
                    try:
                        rank, ok, payload = results.get(timeout=2.0)
                    except queue.Empty:
                        codes = {r: procs[r].exitcode for r in dead}
                        failures.append(f"ranks exited without a report: {codes}")
                        break
                else:
                    continue
            if ok:
                outputs[rank] = payload
            else:
                failures.append(f"rank {rank} raised:\n{payload}")
                break  # the other ranks are probably blocked in a collective now
    finally:
        for p in procs:
            p.join(timeout=0.5 if failures else 10.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        raise ChildFailure("\n".join(failures))
    return [outputs[r] for r in range(world_size)]


# ---------------------------------------------------------------------------------------------
# Layout cases shared by the context-parallel tests. A case is (cu_seqlens, fragment table):
# global document offsets of the flattened [B, L] microbatch and, per rank, its fragments
# (start, stop) in span order.
# ---------------------------------------------------------------------------------------------

Layout = tuple[list[int], list[list[tuple[int, int]]]]


def random_cu_seqlens(gen: Any, rows: int, row_len: int, max_doc: int) -> list[int]:
    """Random document offsets for ``rows`` rows of ``row_len`` tokens (every row start is a
    document start); about a fifth of the documents have a single token."""
    import torch

    cu = [0]
    for r in range(rows):
        end = (r + 1) * row_len
        while cu[-1] < end:
            if torch.rand((), generator=gen).item() < 0.2:
                n = 1
            else:
                n = int(torch.randint(1, max_doc + 1, (), generator=gen))
            cu.append(min(cu[-1] + n, end))
    return cu


def random_layout(
    gen: Any, total: int, world: int, tiny: float = 0.5
) -> list[list[tuple[int, int]]]:
    """Random tiling of [0, total) into fragments (about ``tiny`` of them 1-3 tokens long),
    dealt to random ranks (each rank at least one) in a random span order."""
    import torch

    cuts = [0]
    while cuts[-1] < total:
        if torch.rand((), generator=gen).item() < tiny:
            n = int(torch.randint(1, 4, (), generator=gen))
        else:
            n = int(torch.randint(4, max(5, total // world), (), generator=gen))
        cuts.append(min(cuts[-1] + n, total))
    frags = list(zip(cuts[:-1], cuts[1:]))
    assert len(frags) >= world, "layout too coarse for the world size"
    owner = torch.randperm(len(frags), generator=gen).tolist()
    table: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for i, f in enumerate(frags):
        # The first `world` fragments of the permutation seed one per rank; the rest are random.
        r = owner.index(i)
        table[r if r < world else int(torch.randint(0, world, (), generator=gen))].append(f)
    for fl in table:
        order = torch.randperm(len(fl), generator=gen).tolist()
        fl[:] = [fl[i] for i in order]
    return table


def ptrr_layout(gen: Any, rows: int, row_len: int, world: int, block: int = 4) -> Layout:
    """torch's PTRR balancer (blocks of ``block`` tokens) on random documents of 1-19 tokens:
    (cu_seqlens, fragment table)."""
    import torch

    from tests.helpers import positions_from_lengths
    from torchtitan_cp.routing import (
        cu_seqlens_from_positions,
        fragments_from_indices,
        get_balancer,
    )

    lengths = [int(x) for x in torch.randint(1, 20, (8,), generator=gen)]
    positions = positions_from_lengths(rows, row_len, lengths)
    index = get_balancer("ptrr", ptrr_block_size=block).indices(positions, world, "cpu")
    assert index is not None
    table = fragments_from_indices(index, world, rows, row_len)
    return cu_seqlens_from_positions(positions), table


def explicit_layout_4() -> Layout:
    """Hand-made 4-rank case: two rows of 24 tokens; single-token documents (one at a row
    start); document [2, 20) in six pieces on ranks 0, 2, 3, 1, 0, 2 (1-token fragments
    included); rank 1 holds only document interiors; span orders are not increasing."""
    cu = [0, 1, 2, 20, 21, 24, 25, 45, 48]
    table = [
        [(30, 33), (0, 3), (14, 15)],
        [(33, 40), (10, 14)],
        [(3, 4), (15, 21), (40, 48)],
        [(21, 30), (4, 10)],
    ]
    return cu, table


def doc_ids_of(cu: list[int], tokens: list[int]) -> Any:
    """int64 tensor of the document (index into ``cu``) of every global token id in ``tokens``."""
    import bisect

    import torch

    return torch.tensor([bisect.bisect_right(cu, t) - 1 for t in tokens], dtype=torch.int64)


def span_index(fragments: list[tuple[int, int]]) -> list[int]:
    """Global token ids of a rank's span, in span order."""
    return [t for a, b in fragments for t in range(a, b)]


def local_subsequences(
    cu: list[int], fragments: list[tuple[int, int]]
) -> list[tuple[int, int, int]]:
    """(global start, global stop, document index) of every subsequence, in span order."""
    import bisect

    out = []
    for a, b in fragments:
        cuts = [a] + [c for c in cu if a < c < b] + [b]
        for x, y in zip(cuts[:-1], cuts[1:]):
            out.append((x, y, bisect.bisect_right(cu, x) - 1))
    return out


def loose_caps(cu: list[int], table: list[list[tuple[int, int]]]):
    """RoutingCaps above every rank's need, so the capped (padded) code paths run: padded
    slots, zero-length subsequences, -1 predecessors and -1 terminal entries."""
    from torchtitan_cp.routing import RoutingCaps

    n_frags = sum(len(f) for f in table)
    return RoutingCaps(
        slots=max(len(f) for f in table) + 1,
        subsequences=len(cu) - 1 + n_frags + 1,
        predecessors=n_frags,
        terminal=len(cu),
    )


def device_routing(
    cu: list[int],
    table: list[list[tuple[int, int]]],
    rank: int,
    conv_history: int = 3,
    caps: Any = None,
):
    """This rank's DeviceRouting on CPU, from the real routing package."""
    import torch

    from torchtitan_cp.routing import RoutingPlan

    return RoutingPlan.build(cu, table, rank).to_device(
        torch.device("cpu"), caps=caps, conv_history=conv_history
    )


def max_abs(a: Any, b: Any) -> float:
    """max |a - b|, 0 for empty tensors (a rank may own no tokens)."""
    return (a - b).abs().max().item() if a.numel() else 0.0


def empty_rank_layout(total: int) -> list[list[tuple[int, int]]]:
    """Three ranks, the middle one without any fragment."""
    return [[(0, total // 3), (2 * total // 3, total)], [], [(total // 3, 2 * total // 3)]]


def prefix_groups(world: int, sizes: tuple[int, ...] = (2, 3)) -> dict[int, Any]:
    """Process groups of ranks ``[0, w)`` for each ``w`` in ``sizes`` plus ``world`` (WORLD), so
    one spawn serves several world sizes (start-up is the cost). Collective: every rank calls
    it."""
    import torch.distributed as dist

    groups: dict[int, Any] = {w: dist.new_group(list(range(w))) for w in sizes}
    groups[world] = dist.group.WORLD
    return groups


def report_worst(tol: dict, per_rank: list[dict[str, float]]) -> None:
    """Print the worst observed error per dtype over all ranks (``pytest -s``, for the docs)
    and check it against ``tol`` (dtype -> max abs); the ranks assert their own cases too."""
    worst = {dt: max(r[dt] for r in per_rank) for dt in per_rank[0]}
    print(f"observed max abs error: {worst}")
    assert all(worst[str(dt)] <= t for dt, t in tol.items()), worst


def balanced_layouts(
    gen: Any, rows: int, row_len: int, world: int, max_doc: int
) -> list[tuple[str, list[int], list[list[tuple[int, int]]]]]:
    """The two load-balancer layouts every CP test covers: contiguous and head-tail, each with
    its own random documents (drawn in that order from ``gen``), laid out by the registry's
    balancer (``routing.documents_layout``)."""
    from torchtitan_cp.routing import documents_layout

    out = []
    for name, balancer in (("contiguous", "contiguous"), ("head-tail", "headtail")):
        cu = random_cu_seqlens(gen, rows, row_len, max_doc)
        lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        table = documents_layout(lens, world, balancer, seq_len=row_len).fragments
        out.append((name, cu, table))
    return out


def random_case(
    gen: Any, rows: int, row_len: int, world: int, name: str = "random", tiny: float = 0.5
) -> tuple[str, list[int], list[list[tuple[int, int]]]]:
    """(name, cu_seqlens, table): random documents of up to 40 tokens on a random table
    (``random_layout``), drawn in that order from ``gen``."""
    cu = random_cu_seqlens(gen, rows, row_len, 40)
    return name, cu, random_layout(gen, rows * row_len, world, tiny=tiny)


def attention_span_errors(
    qkv: list[Any], d_o: Any, cu: list[int], span: Any, attend: Callable[..., Any]
) -> dict[str, float]:
    """Max abs errors of ``attend(q, k, v)`` on one rank's ``span`` (int64 global token ids)
    against unsharded ``context_parallel_attention(group=None)`` over the whole stream: the
    output ``o`` and the gradients ``dq``, ``dk``, ``dv`` of ``sum(o * d_o)``."""
    import torch

    from torchtitan_cp.ops import context_parallel_attention

    total = cu[-1]
    ref = [x.clone().requires_grad_(True) for x in qkv]
    o_ref = context_parallel_attention(
        *ref, token_ids=torch.arange(total), doc_ids=doc_ids_of(cu, list(range(total))), group=None
    )
    (o_ref * d_o).sum().backward()
    loc = [x.index_select(1, span).clone().requires_grad_(True) for x in qkv]
    o = attend(*loc)
    (o * d_o.index_select(1, span)).sum().backward()
    errs = {"o": max_abs(o, o_ref.index_select(1, span))}
    for nm, a, r in zip(("dq", "dk", "dv"), loc, ref):
        errs[nm] = max_abs(a.grad, r.grad.index_select(1, span))
    return errs


def sweep_worlds(
    rank: int,
    world: int,
    tol: dict,
    layouts: Callable[[int], list[tuple]],
    check: Callable[..., float],
    worlds: tuple[int, ...] = (2, 3, 4),
) -> dict[str, float]:
    """The context-parallel tests' worker loop, on every rank of a ``world``-rank spawn: for each
    world size ``w`` in ``worlds`` this rank belongs to, each case of ``layouts(w)`` (a tuple,
    name first) and each dtype of ``tol``, call ``check(rank, group, case, dtype, seed)`` with the
    group of ranks ``[0, w)``, the case renamed ``W{w}/name`` and its index as ``seed``. Returns
    the worst error ``check`` returned per dtype (``str(dtype)`` keys, for ``report_worst``).
    Collective: every rank calls it (one spawn serves every world size)."""
    groups = prefix_groups(world, tuple(w for w in worlds if w != world))
    worst = {str(dt): 0.0 for dt in tol}
    for w in worlds:
        if rank >= w:
            continue
        for seed, (name, *rest) in enumerate(layouts(w)):
            for dtype in tol:
                err = check(rank, groups[w], (f"W{w}/{name}", *rest), dtype, seed)
                worst[str(dtype)] = max(worst[str(dtype)], err)
    return worst


def _sweep_worker(rank: int, world: int, tol: dict, layouts: Callable, check: Callable) -> dict:
    return sweep_worlds(rank, world, tol, layouts, check)


def run_sweep(
    tol: dict, layouts: Callable, check: Callable, world: int = 4, timeout: float = 240.0
) -> None:
    """``sweep_worlds`` on ``world`` spawned gloo ranks, then ``report_worst`` over them.
    ``layouts`` and ``check`` must be picklable (module-level functions or partials of them)."""
    report_worst(tol, run_distributed(_sweep_worker, world, tol, layouts, check, timeout=timeout))


class _CoalescedWork:
    """One work standing for a whole batch of point-to-point ops, as NCCL returns: complete
    when every op is."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self, timeout: Any = None) -> bool:
        for w in self._works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


class NcclLikeP2P:
    """``with NcclLikeP2P() as p:`` gloo behaving as NCCL does where pass-KV's code branches on
    it: ``dist.batch_isend_irecv`` returns one work for the whole batch (NCCL coalesces the
    batch into one group), and ``dist.get_backend`` reports ``"nccl"`` (so ``_warm_up``'s
    all-reduce runs). ``p.batches`` counts batches posted, ``p.works`` the works returned and
    ``p.all_reduces`` the all-reduces made meanwhile. The ops themselves still run on gloo."""

    def __init__(self) -> None:
        self.batches = self.works = self.all_reduces = 0

    def __enter__(self) -> NcclLikeP2P:
        import torch.distributed as dist

        self._saved = (dist.batch_isend_irecv, dist.get_backend, dist.all_reduce)
        real_batch, _, real_reduce = self._saved

        def batch(ops: list) -> list:
            works = real_batch(ops)
            self.batches += 1
            out = [_CoalescedWork(works)] if works else []
            self.works += len(out)
            return out

        def reduce(*args: Any, **kwargs: Any) -> Any:
            self.all_reduces += 1
            return real_reduce(*args, **kwargs)

        dist.batch_isend_irecv = batch
        dist.get_backend = lambda group=None: "nccl"
        dist.all_reduce = reduce
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        dist.batch_isend_irecv, dist.get_backend, dist.all_reduce = self._saved
