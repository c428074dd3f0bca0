"""``torchrun`` with the recipe's one-line failures: ``python -m torchtitan_cp.launch [torchrun
options] -m torchtitan_cp.train ...`` (what ``./scripts/train.sh`` runs).

It takes torchrun's options and runs torchrun's own launcher (``torch.distributed.run``). When a
rank stops with one of the recipe's one-line errors (a configuration or data problem found inside
the ranks, a busy dump folder, an unusable checkpoint, a loss spike, a rank that stopped
answering), the first failing rank's line is printed once and the launch exits with that rank's
status (2 for configuration and data problems), instead of torchrun's ``ChildFailedError`` block
and status 1. Any other failure (a traceback) is reported by torchrun as usual; before that
report, a rank that failed without an error of its own (killed by a signal: a crash in C++) has
the end of its stderr printed, its Python stacks from faulthandler, also when
``--local-ranks-filter`` keeps its output off the console.

A launch stopped by a signal (SIGTERM from a scheduler or ``kill``, SIGINT) ends, once torchrun
has ended its ranks, with one line naming the signal and the checkpoint step a rerun of the
same command resumes from (each node's local rank 0 writes its checkpoint folder to
``RUN_INFO_ENV`` before training), exit 128 + the signal's number; before, torchrun's
``SignalException`` traceback, exit 1.

Multi-node (``--rdzv-backend=static``, ``--nnodes`` > 1): the rendezvous wait is bounded by
``RDZV_TIMEOUT`` seconds (default 300, the ``timeout`` of torchrun's static rendezvous, which
would otherwise wait 600 s in silence). A node other than 0 first waits for node 0's endpoint to
accept a connection, with a line every 10 s; then every node says every 10 s that it waits for
the others until torchrun starts its ranks. When the time runs out, on any node, the launch
ends with one line naming the endpoint and the fix, exit 2.
"""

from __future__ import annotations

import glob
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import IO, Any

PREFIX = "torchtitan_cp.train: error: "
LAUNCH_PREFIX = "torchtitan_cp.launch: error: "
RDZV_TIMEOUT_DEFAULT = 300
REPORT_EVERY = 10.0  # seconds between a waiting node's lines
SILENT_TAIL = 120  # lines of a silent rank's stderr shown (faulthandler's stacks fit)
CRASH_CONTEXT = 5  # of them, lines before faulthandler's dump


class LaunchError(Exception):
    """A one-line launch failure (exit status 2)."""


def rdzv_timeout() -> int:
    """``RDZV_TIMEOUT`` in whole seconds (default 300)."""
    raw = os.environ.get("RDZV_TIMEOUT", "")
    if not raw:
        return RDZV_TIMEOUT_DEFAULT
    if not raw.isdigit() or int(raw) < 1:
        raise LaunchError(f"RDZV_TIMEOUT must be a whole number of seconds >= 1, got '{raw}'")
    return int(raw)


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` as torchrun reads it: (host, port)."""
    host, sep, port = endpoint.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise LaunchError(
            f"rendezvous endpoint {endpoint} must be host:port (an IPv6 address in brackets, "
            "[::1]:29500), port 1..65535"
        )
    return host, int(port)


def wait_for_endpoint(
    host: str, port: int, *, node: int, nnodes: int, timeout: float, out: IO[str] = sys.stderr
) -> float:
    """Wait until ``host:port`` (node 0's rendezvous store) accepts a TCP connection, printing
    a line every ``REPORT_EVERY`` seconds; returns the seconds waited, raises ``LaunchError``
    after ``timeout`` seconds."""
    endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    start = time.monotonic()
    next_report = start
    problem = "nothing answered"
    while True:
        now = time.monotonic()
        if now >= next_report:
            print(
                f"node {node} of {nnodes}: waiting for node 0 at {endpoint} "
                f"({now - start:.0f} s of {timeout:g} s, RDZV_TIMEOUT)",
                file=out,
                flush=True,
            )
            next_report += REPORT_EVERY
        left = timeout - (now - start)
        if left <= 0:
            raise LaunchError(
                f"node {node} of {nnodes}: no rendezvous at {endpoint} within {timeout:g} s "
                f"(RDZV_TIMEOUT; {problem}): start node 0 (NODE_RANK=0) with the same "
                f"RDZV_ENDPOINT, check that {host} is node 0's address and port {port} is open "
                "to this machine, or raise RDZV_TIMEOUT"
            )
        try:
            with socket.create_connection((host, port), timeout=min(2.0, left)):
                return time.monotonic() - start
        except socket.gaierror as e:
            problem = f"{host}: {e.strerror or e}"
        except OSError as e:
            problem = e.strerror or str(e) or "nothing answered"
        time.sleep(max(0.0, min(1.0, timeout - (time.monotonic() - start))))


def _children(pid: int) -> set[str] | None:
    """The child pids of process ``pid`` (torchrun starts its ranks once the rendezvous is
    complete); None when this cannot be told (no /proc), so a caller stops."""
    found: set[str] = set()
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found.update(f.read().split())
    except OSError:
        return None
    return found


class RendezvousSpeaker(threading.Thread):
    """While torchrun's rendezvous runs (until this process has started a new child, a rank,
    or ``done`` is set), a line every ``every`` seconds: ``{who} ({t} s of {timeout} s, RDZV_TIMEOUT)``."""

    def __init__(
        self,
        who: str,
        *,
        timeout: float,
        every: float,
        waited: float = 0.0,
        out: IO[str] = sys.stderr,
    ) -> None:
        super().__init__(daemon=True, name="rendezvous-speaker")
        self.who, self.timeout, self.every, self.out = who, timeout, every, out
        self.start_time = time.monotonic() - waited
        self.done = threading.Event()

    def run(self) -> None:
        pid = os.getpid()
        # Children this process already had (a helper, or a test runner's) are not ranks.
        before = _children(pid)
        next_line = time.monotonic() + self.every
        while not self.done.wait(0.5):
            now_children = _children(pid)
            if before is None or now_children is None or now_children - before:
                return
            now = time.monotonic()
            if now >= next_line:
                print(
                    f"{self.who} ({now - self.start_time:.0f} s of {self.timeout:g} s, "
                    "RDZV_TIMEOUT)",
                    file=self.out,
                    flush=True,
                )
                next_line += self.every


def _multinode(args: Any) -> tuple[str, int, int, int] | None:
    """(host, port, node rank, node count) of a static multi-node launch, else None."""
    nnodes = str(getattr(args, "nnodes", "1"))
    if getattr(args, "rdzv_backend", "") != "static" or not nnodes.isdigit() or nnodes == "1":
        return None
    host, port = split_endpoint(str(args.rdzv_endpoint))
    return host, port, int(args.node_rank), int(nnodes)


def _rendezvous_error(exc: BaseException, where: tuple[str, int, int, int], timeout: int) -> str:
    host, port, node, nnodes = where
    endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    others = "the other nodes" if node == 0 else "node 0 and the other nodes"
    return (
        f"node {node} of {nnodes}: the rendezvous at {endpoint} did not complete within "
        f"{timeout} s (RDZV_TIMEOUT; {first}): start {others} with NNODES={nnodes} and the same "
        "RDZV_ENDPOINT, or raise RDZV_TIMEOUT"
    )


def one_line_failure(failures: dict[int, Any]) -> tuple[str, int] | None:
    """``(line, exit status)`` of the first failure (torchrun's root cause) when it is one of
    the recipe's one-line errors, else None. ``failures``: rank -> torchrun's ProcessFailure."""
    if not failures:
        return None
    # A rank killed by a signal (torchrun's SIGTERM after the first failure) is a consequence,
    # never the root cause; its timestamp is when torchrun noticed it, often the same second as
    # the rank that failed on its own (timestamps are whole seconds).
    rank = min(failures, key=lambda r: (failures[r].exitcode <= 0, failures[r].timestamp, r))
    failure = failures[rank]
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    if not isinstance(message, str) or not message.startswith(PREFIX) or "\n" in message:
        return None
    if failure.exitcode <= 0:  # killed by a signal after writing it: not the rank's verdict
        return None
    return message, failure.exitcode


def silent_failures(failures: dict[int, Any]) -> list[int]:
    """Ranks that failed without an error of their own in torchrun's record: no error file
    (killed by a fatal signal, a segfault or an abort in C++, or an exit status without a
    Python exception), torchrun's own SIGTERM to the survivors excepted. ``failures``: rank ->
    torchrun's ProcessFailure."""
    return sorted(
        rank
        for rank, failure in failures.items()
        if not os.path.isfile(str(failure.error_file)) and failure.exitcode != -signal.SIGTERM
    )


def stderr_tail(log_dir: str, local_rank: int, lines: int = SILENT_TAIL) -> tuple[str, str] | None:
    """``(path, text)``: the end of local rank ``local_rank``'s stderr as torchrun kept it under
    ``log_dir`` (``--tee``/``--redirects``; its newest attempt), from ``CRASH_CONTEXT`` lines
    before faulthandler's "Fatal Python error" line when there is one (C++ says there why it
    aborted: "terminate called after throwing ..."); None when torchrun kept no file of it."""
    found = sorted(
        glob.glob(
            os.path.join(glob.escape(log_dir), "*", "attempt_*", str(local_rank), "stderr.log")
        ),
        key=os.path.getmtime,
    )
    if not found:
        return None
    try:
        with open(found[-1], errors="replace") as f:
            text = f.read().splitlines()
    except OSError:
        return None
    marks = [i for i, line in enumerate(text) if line.startswith("Fatal Python error")]
    shown, head = text, 0
    if marks:
        before = text[max(0, marks[-1] - CRASH_CONTEXT) : marks[-1]]
        shown = [*before, *_without_threads_of_no_python(text[marks[-1] :])]
        head = len(before) + 10
    if len(shown) > lines:  # the crash's first lines, then the stacks' ends (the main thread last)
        shown = [
            *shown[:head],
            f"... ({len(shown) - lines + 1} lines left out)",
            *shown[len(shown) - (lines - head - 1) :],
        ]
    return found[-1], "\n".join(shown)


def _without_threads_of_no_python(dump: list[str]) -> list[str]:
    """faulthandler's dump without what names nothing: the C++ threads (gloo's, autograd's)
    listed with ``<no Python frame>``, and the one long line of loaded extension modules."""
    kept: list[str] = []
    for i, line in enumerate(dump):
        no_frame = i + 1 < len(dump) and dump[i + 1].strip() == "<no Python frame>"
        if (line.startswith("Thread 0x") and no_frame) or line.strip() == "<no Python frame>":
            continue
        if line.startswith("Extension modules:") or (not line.strip() and kept and not kept[-1]):
            continue
        kept.append(line)
    return kept


def report_silent_failures(failures: dict[int, Any], log_dir: str, out: IO[str]) -> None:
    """Print, for every rank that failed without an error of its own, how it ended and the end
    of its stderr: under ``--local-ranks-filter`` (train.sh shows rank 0 only) a crashed rank's
    last words, its Python stacks from faulthandler, reach no console otherwise."""
    for rank in silent_failures(failures):
        failure = failures[rank]
        how = (
            f"was killed by {failure.signal_name()}"
            if failure.exitcode < 0
            else f"exited with status {failure.exitcode}"
        )
        tail = stderr_tail(log_dir, failure.local_rank)
        if tail is None:
            print(
                f"rank {rank} {how} without an error of its own; its stderr, if not filtered "
                "out, is above (torchrun kept no file of it: --tee 3 keeps one)",
                file=out,
            )
            continue
        path, text = tail
        print(
            f"rank {rank} {how} without an error of its own; the end of its stderr ({path}):",
            file=out,
        )
        print("\n".join(f"    {line}" for line in text.splitlines()), file=out, flush=True)


class _HeldLogs(logging.Handler):
    """Holds the records of torchrun's own loggers while the ranks run: its agent logs each
    worker's failure and the SIGTERMs it sends (a few lines per rank) before it raises, which a
    one-line error makes redundant. Any other outcome replays them."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self._propagate: dict[str, bool] = {}
        for name, item in list(logging.root.manager.loggerDict.items()):
            if name.startswith("torch.distributed") and isinstance(item, logging.Logger):
                self._propagate[name] = item.propagate
                item.addHandler(self)
                item.propagate = False

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def restore(self, *, replay: bool) -> None:
        for name, propagate in self._propagate.items():
            item = logging.getLogger(name)
            item.removeHandler(self)
            item.propagate = propagate
        for record in self.records if replay else ():
            logging.getLogger(record.name).handle(record)


def stopped_line(signum: int, info_file: str) -> str:
    """The launch's one line when a signal (SIGTERM: a scheduler's preemption or ``kill``,
    SIGINT: Ctrl-C) stopped it and torchrun ended its ranks: the signal and where a rerun of
    the same command resumes, from what local rank 0 wrote to ``info_file`` (``RUN_INFO_ENV``)
    and the checkpoint folder's newest complete step (one with its manifest)."""
    import json

    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    head = f"stopped by {name}; torchrun ended the ranks"
    try:
        with open(info_file) as f:
            folder = json.load(f)["checkpoint_folder"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{head} before they started training: rerun the same command to start"
    from torchtitan_cp.run.resume import scan_steps
    from torchtitan_cp.run.spike_guard import resume_hint

    complete = [s.step for s in scan_steps(folder) if s.complete] if folder is not None else []
    return f"{head}: {resume_hint(folder, complete[-1] if complete else None)}"


def main(argv: list[str] | None = None) -> int:
    from torch.distributed import DistError
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

    from torchtitan_cp.run.errors import LAUNCHER_ENV, RUN_INFO_ENV

    os.environ[LAUNCHER_ENV] = "1"  # the ranks leave their one-line error to this process
    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    speaker: RendezvousSpeaker | None = None
    try:
        where = _multinode(args)
        timeout = rdzv_timeout()
        if where is not None:
            conf = [
                kv
                for kv in (args.rdzv_conf or "").split(",")
                if kv and not kv.startswith("timeout=")
            ]
            args.rdzv_conf = ",".join([*conf, f"timeout={timeout}"])
            host, port, node, nnodes = where
            waited = 0.0
            if node > 0:
                waited = wait_for_endpoint(host, port, node=node, nnodes=nnodes, timeout=timeout)
                # the rest of the rendezvous (the store, the other nodes) gets what is left
                args.rdzv_conf = ",".join([*conf, f"timeout={max(1, int(timeout - waited))}"])
            else:
                print(
                    f"node 0 of {nnodes}: hosting the rendezvous at {args.rdzv_endpoint}; "
                    f"waiting up to {timeout} s (RDZV_TIMEOUT) for the other "
                    f"{nnodes - 1} node(s)",
                    file=sys.stderr,
                    flush=True,
                )
            speaker = RendezvousSpeaker(
                f"node {node} of {nnodes}: waiting for the other nodes at {args.rdzv_endpoint}",
                timeout=timeout,
                every=REPORT_EVERY,
                waited=waited,
            )
            speaker.start()
    except LaunchError as e:
        print(f"{LAUNCH_PREFIX}{e}", file=sys.stderr)
        return 2
    if args.log_dir is None:  # torchrun's own default, made here so that its path is known
        args.log_dir = tempfile.mkdtemp(prefix="torchelastic_")
    info_file = os.path.join(args.log_dir, "run_info.json")
    os.environ[RUN_INFO_ENV] = info_file  # the ranks' environment is this one's
    held = _HeldLogs()
    try:
        torchrun.run(args)
    except DistError as e:  # the rendezvous store timed out: before any rank started
        if where is None:
            held.restore(replay=True)
            raise
        held.restore(replay=False)
        print(f"{LAUNCH_PREFIX}{_rendezvous_error(e, where, timeout)}", file=sys.stderr)
        return 2
    except ChildFailedError as e:
        found = one_line_failure(e.failures)
        held.restore(replay=found is None)
        if found is None:
            report_silent_failures(e.failures, args.log_dir, sys.stderr)
            error = e

            @record
            def report() -> None:  # torchrun's own report: its @record prints the block
                raise error

            report()
        assert found is not None
        line, status = found
        print(line, file=sys.stderr)
        return status
    except SignalException as e:  # torchrun's handler, once it has ended the ranks
        held.restore(replay=False)
        print(f"{LAUNCH_PREFIX}{stopped_line(e.sigval, info_file)}", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)  # as a shell reports a process a signal ended
    except BaseException:
        held.restore(replay=True)
        raise
    finally:
        if speaker is not None:
            speaker.done.set()
    held.restore(replay=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
