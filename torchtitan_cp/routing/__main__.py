"""``python -m torchtitan_cp.routing explain``: show one rank's routing for a layout.

Example::

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

from .layouts import FragmentTable, parse_fragments
from .plan import RoutingPlan

__all__ = ["explain", "main", "plot_layout"]


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
    ]  # fmt: skip
    return {
        "subsequences": plan.subsequences.tolist(),
        "cu_seqlens": plan.cu_seqlens.tolist(),
        "predecessors": [[list(p) for p in preds] for preds in plan.predecessors],
        "successors": [[list(s) for s in succs] for succs in plan.successors],
        "terminal": plan.terminal.tolist(),
        "pass_kv": {"shifts": list(plan.pass_kv.pairs.shifts), "rounds": rounds},
    }


def _table(plan: RoutingPlan) -> str:
    info = explain(plan)
    terminal = set(info["terminal"])
    lines = [
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
    ex.add_argument("--cu-seqlens", type=_parse_ints, required=True, help="e.g. 0,40,232,384")
    ex.add_argument(
        "--fragments", type=str, required=True, help='e.g. "0:96,288:384;96:192,192:288"'
    )
    ex.add_argument("--rank", type=int, required=True)
    ex.add_argument("--json", action="store_true", help="print one JSON object")
    ex.add_argument("--plot", metavar="PNG", help="also draw the layout to this PNG")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 for bad arguments or an invalid layout)."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        fragments = parse_fragments(args.fragments)
        plan = RoutingPlan.build(args.cu_seqlens, fragments, args.rank)
        plot_file = _open_plot(args.plot) if args.plot else None
    except (_UsageError, ValueError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # --help
        return int(exit_.code or 0)
    if args.json:
        print(json.dumps(explain(plan)))
    else:
        print(_table(plan))
    if plot_file is not None:
        with plot_file:
            plot_layout(args.cu_seqlens, fragments, args.rank, plot_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
