"""``python -m torchtitan_cp.routing explain``: show one rank's routing for a layout.

The layout is either documents and a load balancer (what training does: the balancer of
``routing.balancers`` run on the host, as ``routing.sources.host_layout``) or a hand-written
fragment table. Examples::

    python -m torchtitan_cp.routing explain --doc-lens 300 50 162 --world 2 \\
        --balancer headtail --rank 1 [--seq-len 256] [--ptrr-block-size 128]
    python -m torchtitan_cp.routing explain --cu-seqlens 0,40,232,384 \\
        --fragments "0:96,288:384;96:192,192:288" --rank 1 [--json] [--plot layout.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, NoReturn

from .balancers import balancer_names, get_balancer
from .layouts import FragmentTable, format_fragments, parse_fragments
from .plan import RoutingPlan
from .sources import documents_layout

__all__ = ["explain", "layout_from_documents", "main", "plot_layout"]


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    # argparse prints the whole usage block and exits; we want one line and a return code.
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _parse_ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def layout_from_documents(
    doc_lens: Sequence[int],
    world: int,
    balancer: str = "contiguous",
    *,
    seq_len: int | None = None,
    ptrr_block_size: int = 128,
) -> tuple[list[int], FragmentTable]:
    """Global ``cu_seqlens`` and every rank's fragments when documents of ``doc_lens`` tokens
    are packed, in order, into rows of ``seq_len`` tokens (default: one row of all of them) and
    sharded over ``world`` CP ranks by ``balancer`` (a name of ``routing.balancers``; PTRR in
    blocks of ``ptrr_block_size``), exactly as training's host source does
    (``routing.sources.documents_layout``). A document that crosses a row end goes on as a new
    document at the next row's start (every row start is a document start). Bad input is one
    ``ValueError`` line naming the option."""
    lens = list(doc_lens)
    if not lens:
        raise ValueError("--doc-lens: give at least one document length")
    bad = next((i for i, n in enumerate(lens) if n < 1), None)
    if bad is not None:
        raise ValueError(f"--doc-lens: document {bad} has length {lens[bad]}; lengths must be >= 1")
    if world < 1:
        raise ValueError(f"--world must be >= 1, got {world}")
    if ptrr_block_size < 1:
        raise ValueError(f"--ptrr-block-size must be >= 1, got {ptrr_block_size}")
    total = sum(lens)
    row = total if seq_len is None else seq_len
    if row < 1:
        raise ValueError(f"--seq-len must be >= 1, got {row}")
    if total % row:
        raise ValueError(
            f"--doc-lens: {total} tokens do not fill rows of --seq-len {row} "
            f"({total // row} row(s) and {total % row} token(s) over)"
        )
    balancer_ = get_balancer(balancer, ptrr_block_size=ptrr_block_size)
    try:
        balancer_.check(row, world)
    except ValueError as err:
        where = "--seq-len" if seq_len is not None else "the sum of --doc-lens"
        raise ValueError(f"{where} ({row}) at --world {world}: {err}") from None
    layout = documents_layout(lens, world, balancer_, seq_len=row, block_size=ptrr_block_size)
    return layout.cu_seqlens.tolist(), layout.fragments


def explain(plan: RoutingPlan) -> dict[str, Any]:
    """The CLI's JSON object: subsequences ``[document, start, stop]`` (global), local
    ``cu_seqlens``, per-fragment ``predecessors`` / ``successors`` ``[rank, fragment]`` in token
    order, ``terminal`` local subsequence indices, and the pass-KV attention schedule
    (``shifts`` and this rank's rounds; rows are half-open span ranges)."""
    rounds = [
        {"shift": rd.shift, "recv_from": rd.recv_from, "recv_rows": list(rd.recv_rows),
         "query_rows": list(rd.query_rows), "send_to": rd.send_to,
         "send_rows": list(rd.send_rows)}
        for rd in plan.pass_kv.rounds
    ]  # fmt: skip # a table, laid out by hand to read across
    return {
        "subsequences": plan.subsequences.tolist(),
        "cu_seqlens": plan.cu_seqlens.tolist(),
        "predecessors": [[list(p) for p in preds] for preds in plan.predecessors],
        "successors": [[list(s) for s in succs] for succs in plan.successors],
        "terminal": plan.terminal.tolist(),
        "pass_kv": {"shifts": list(plan.pass_kv.pairs.shifts), "rounds": rounds},
    }


def _table(plan: RoutingPlan, cu_seqlens: Sequence[int], fragments: FragmentTable) -> str:
    info = explain(plan)
    terminal = set(info["terminal"])
    lines = [
        f"layout: --cu-seqlens {','.join(map(str, cu_seqlens))} "
        f'--fragments "{format_fragments(fragments)}"',
        f"rank {plan.rank} of {plan.world_size}: {len(plan.fragments)} fragment(s), "
        f"{plan.num_subsequences} subsequence(s), {plan.num_tokens} local tokens, "
        f"num_slots {plan.num_slots}",
        "",
        "frag  global [start, stop)  predecessors      successors",
    ]
    for j, (a, b) in enumerate(plan.fragments):
        preds = " ".join(f"r{r}f{f}" for r, f in info["predecessors"][j]) or "-"
        succs = " ".join(f"r{r}f{f}" for r, f in info["successors"][j]) or "-"
        lines.append(f"{j:>4}  [{a}, {b})".ljust(27) + f"{preds:<18}{succs}")
    lines += ["", " sub  frag  doc  global [start, stop)  local [start, stop)  terminal"]
    cu = info["cu_seqlens"]
    frag_of = [
        j
        for j, (f, g) in enumerate(zip(plan.frag_first, plan.frag_last))
        for _ in range(int(f), int(g) + 1)
    ]
    for i, (doc, a, b) in enumerate(info["subsequences"]):
        lines.append(
            f"{i:>4}  {frag_of[i]:>4}  {doc:>3}  "
            + f"[{a}, {b})".ljust(21)
            + f"[{cu[i]}, {cu[i + 1]})".ljust(21)
            + ("yes" if i in terminal else "no")
        )
    lines += ["", "pass-KV attention (model.attention_cp = 'pass_kv'):", plan.pass_kv.describe()]
    return "\n".join(lines)


def plot_layout(
    cu_seqlens: Sequence[int], fragments: FragmentTable, rank: int, path: str | IO[bytes]
) -> None:
    """Draw documents, every rank's fragments and the state routes (arrows from a fragment to the
    next piece of a document it continues into) to a PNG at ``path`` (a file name, written as
    given, or a binary file). ``rank``'s fragments are outlined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    world = len(fragments)
    total = cu_seqlens[-1]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.6 * (world + 1)))
    colors = plt.get_cmap("tab10")
    for d, (a, b) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        ax.barh(world, b - a, left=a, height=0.6, color=colors(d % 10), alpha=0.6)
        ax.text((a + b) / 2, world, f"d{d}", ha="center", va="center", fontsize=8)
    boundaries = set(cu_seqlens)
    owner_at = {}
    for r, frags in enumerate(fragments):
        for j, (a, b) in enumerate(frags):
            edge = "black" if r == rank else "none"
            ax.barh(r, b - a, left=a, height=0.6, color=colors(r % 10), alpha=0.5, edgecolor=edge)
            ax.text((a + b) / 2, r, f"r{r}f{j}", ha="center", va="center", fontsize=7)
            owner_at[a] = r
    # A fragment hands its state on when its stop is inside a document; a hand-over within one
    # rank is drawn as a small hop above the row so it stays visible.
    hop = 0.015 * total
    for r, frags in enumerate(fragments):
        for _, b in frags:
            if b < total and b not in boundaries:
                to = owner_at[b]
                start, end = (
                    ((b, r), (b, to)) if to != r else ((b - hop, r + 0.4), (b + hop, r + 0.4))
                )
                ax.annotate(
                    "",
                    xy=end,
                    xytext=start,
                    arrowprops={"arrowstyle": "->", "color": "crimson", "lw": 1.2},
                )
    ax.set_yticks(range(world + 1), [f"rank {r}" for r in range(world)] + ["documents"])
    ax.set_xlim(0, total)
    ax.set_xlabel("global token")
    ax.set_title(f"routing layout (rank {rank} outlined, arrows = state routes)")
    fig.tight_layout()
    # format= keeps the name as given: without it matplotlib appends ".png" to a suffix-less name.
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


def _open_plot(path: str) -> IO[bytes]:
    """Open ``--plot``'s file for writing before any work, so a bad path is one line, not a
    traceback after the table was printed."""
    p = Path(path)
    if p.suffix.lower() not in ("", ".png"):
        raise ValueError(f"--plot {path}: writes a PNG; give a file name ending in .png")
    if p.is_dir():
        raise ValueError(
            f"--plot {path}: is a directory; give a file name such as {p / 'layout.png'}"
        )
    try:
        import matplotlib  # noqa: F401  (checked here so a missing install is one line too)
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    try:
        return p.open("wb")
    except OSError as e:
        raise ValueError(f"--plot {path}: cannot write: {e.strerror or e}") from None


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m torchtitan_cp.routing", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    ex = sub.add_parser("explain", help="show one rank's subsequences and state routes")
    docs = ex.add_argument_group("documents and a load balancer (what training does)")
    docs.add_argument(
        "--doc-lens", type=int, nargs="+", metavar="N", help="document lengths, e.g. 300 50 162"
    )
    docs.add_argument("--world", type=int, help="CP ranks (context_parallel_degree)")
    docs.add_argument(
        "--balancer",
        choices=balancer_names(),
        help="context_parallel_load_balancer (default: contiguous)",
    )
    docs.add_argument("--seq-len", type=int, help="tokens per row (default: all in one row)")
    docs.add_argument("--ptrr-block-size", type=int, help="PTRR's block size (default: 128)")
    table = ex.add_argument_group("or a hand-written layout")
    table.add_argument("--cu-seqlens", type=_parse_ints, help="e.g. 0,40,232,384")
    table.add_argument("--fragments", type=str, help='e.g. "0:96,288:384;96:192,192:288"')
    ex.add_argument("--rank", type=int, required=True)
    ex.add_argument("--json", action="store_true", help="print one JSON object")
    ex.add_argument("--plot", metavar="PNG", help="also draw the layout to this PNG")
    return parser


def _layout(args: argparse.Namespace) -> tuple[list[int], FragmentTable]:
    """The layout the arguments name: documents and a balancer, or a fragment table."""
    hand = [f"--{k.replace('_', '-')}" for k in ("cu_seqlens", "fragments") if getattr(args, k)]
    if args.doc_lens is not None:
        if hand:
            raise ValueError(f"give either --doc-lens or {' and '.join(hand)}, not both")
        if args.world is None:
            raise ValueError("--doc-lens needs --world (the number of CP ranks)")
        if args.world >= 1 and not 0 <= args.rank < args.world:
            raise ValueError(f"--rank {args.rank} is out of range for --world {args.world}")
        return layout_from_documents(
            args.doc_lens,
            args.world,
            args.balancer or "contiguous",
            seq_len=args.seq_len,
            ptrr_block_size=128 if args.ptrr_block_size is None else args.ptrr_block_size,
        )
    if len(hand) < 2:
        raise ValueError(
            "the layout is required: --doc-lens N... --world W [--balancer NAME], "
            "or --cu-seqlens with --fragments"
        )
    doc_only = [
        f"--{k.replace('_', '-')}"
        for k in ("world", "balancer", "seq_len", "ptrr_block_size")
        if getattr(args, k) is not None
    ]
    if doc_only:
        verb = "go" if len(doc_only) > 1 else "goes"
        raise ValueError(f"{' and '.join(doc_only)} {verb} only with --doc-lens")
    return args.cu_seqlens, parse_fragments(args.fragments)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 for bad arguments or an invalid layout)."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        cu_seqlens, fragments = _layout(args)
        plan = RoutingPlan.build(cu_seqlens, fragments, args.rank)
        plot_file = _open_plot(args.plot) if args.plot else None
    except (_UsageError, ValueError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # --help
        return int(exit_.code or 0)
    if args.json:
        print(json.dumps(explain(plan)))
    else:
        print(_table(plan, cu_seqlens, fragments))
    if plot_file is not None:
        with plot_file:
            plot_layout(cu_seqlens, fragments, args.rank, plot_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
