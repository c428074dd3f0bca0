"""torchtitan_cp.launch (what ./scripts/train.sh runs instead of plain torchrun): which rank
failures end the launch with their one line and status. The launches themselves are in
test_runs.py (a refusal inside the ranks, a stopped rank)."""

from __future__ import annotations

import json
import os
import time

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from torchtitan_cp.launch import (
    one_line_failure,
    report_silent_failures,
    silent_failures,
    stderr_tail,
)


def failure(tmp_path, rank: int, exitcode: int, message: str | None, at: int) -> ProcessFailure:
    """A worker failure as torchrun reads it back: its error file (as the trainer's
    ``_record_for_torchrun`` or torch's ``@record`` writes it), or none."""
    path = tmp_path / f"error-{rank}-{exitcode}-{at}.json"
    if message is not None:
        data = {
            "message": {
                "message": message,
                "extraInfo": {"py_callstack": message, "timestamp": str(at)},
            }
        }
        path.write_text(json.dumps(data))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def test_first_failure_with_the_recipes_line_ends_the_launch_with_it(tmp_path):
    now = int(time.time())
    line = "torchtitan_cp.train: error: dump folder D is in use by another run (...)"
    both = {0: failure(tmp_path, 0, 2, line, now), 1: failure(tmp_path, 1, 2, line, now)}
    assert one_line_failure(both) == (line, 2)
    stopped = "torchtitan_cp.train: error: rank 0: no answer from rank 1 within 5 s (...)"
    assert one_line_failure({0: failure(tmp_path, 0, 1, stopped, now)}) == (stopped, 1)


def test_a_rank_torchrun_killed_in_the_same_second_is_not_the_root_cause(tmp_path):
    """torchrun SIGTERMs the other ranks after the first failure; a killed rank has no error
    file and its timestamp is when torchrun noticed it: the same second as the rank that failed
    on its own, and a lower rank. (CI once ended this way with torchrun's block and exit 1.)"""
    now = int(time.time())
    line = "torchtitan_cp.train: error: dump folder D: its lock names pid 4242 on host h (...)"
    killed_first = {0: failure(tmp_path, 0, -15, None, now), 1: failure(tmp_path, 1, 2, line, now)}
    assert one_line_failure(killed_first) == (line, 2)


def test_any_other_root_cause_keeps_torchruns_report(tmp_path):
    now = int(time.time())
    line = "torchtitan_cp.train: error: x"
    trace = "Traceback (most recent call last):\n  ...\nKeyError: 'files'"
    # the first failure (rank 1, a traceback) is the root cause, not rank 0's later line
    mixed = {0: failure(tmp_path, 0, 2, line, now + 5), 1: failure(tmp_path, 1, 1, trace, now)}
    assert one_line_failure(mixed) is None
    assert one_line_failure({0: failure(tmp_path, 0, -9, None, now)}) is None  # killed, no file
    assert one_line_failure({}) is None


def test_a_rank_stopped_while_writing_its_error_file_leaves_a_readable_one(tmp_path, monkeypatch):
    """torchrun SIGTERMs the other ranks when one fails; a rank stopped while the trainer
    rewrites its error file must leave a file torchrun can read (before: truncated first, so an
    empty file, and torchrun's own report died on it with a JSONDecodeError, losing the root
    cause; seen once in CI's test_direct_torchrun_runs_the_same_validation)."""
    from torchtitan_cp import train

    path = tmp_path / "error.json"
    before = {"message": {"message": "traceback of @record", "extraInfo": {"timestamp": "1"}}}
    path.write_text(json.dumps(before))
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    def stopped_midway(data, f):
        f.write('{"message": ')
        raise SystemExit(143)  # the SIGTERM, as the process sees it

    monkeypatch.setattr(json, "dump", stopped_midway)
    try:
        train._record_for_torchrun("torchtitan_cp.train: error: x")
    except SystemExit:
        pass
    assert json.loads(path.read_text()) == before  # still whole: torchrun reads the old one
    monkeypatch.undo()
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    train._record_for_torchrun("torchtitan_cp.train: error: x")
    assert json.loads(path.read_text())["message"]["message"] == "torchtitan_cp.train: error: x"


def test_ranks_that_failed_without_an_error_of_their_own(tmp_path):
    """A crash in C++ (a signal) or an exit status without a Python exception leaves torchrun
    no error file; torchrun's own SIGTERM to the survivors is a consequence, not named."""
    now = int(time.time())
    failures = {
        0: failure(tmp_path, 0, -15, None, now),  # torchrun stopped it after the first failure
        1: failure(tmp_path, 1, -11, None, now),  # a segfault
        2: failure(tmp_path, 2, 1, None, now),  # exit status 1 and no error file
        3: failure(tmp_path, 3, 1, "Traceback (most recent call last): ...", now),
    }
    assert silent_failures(failures) == [1, 2]


DUMP = """\
[rank1]: a log line before the crash
Fatal Python error: Segmentation fault

Thread 0x00007f01 (most recent call first):
  <no Python frame>

Thread 0x00007f02 (most recent call first):
  File "queue.py", line 171 in get

Current thread 0x00007f03 (most recent call first):
  File "torchtitan_cp/trainer/trainer.py", line 381 in train
  File "torchtitan_cp/train.py", line 298 in main

Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)
"""


def test_stderr_tail_starts_at_the_crash_and_names_only_python_frames(tmp_path):
    """The end of a crashed rank's stderr as torchrun kept it (``--tee``): from a few lines
    before faulthandler's first line, without the C++ threads' empty stacks and the extension module list, from the
    newest attempt; a long dump keeps its head and the end (the main thread is listed last)."""
    old = tmp_path / "run_x" / "attempt_0" / "1" / "stderr.log"
    new = tmp_path / "run_x" / "attempt_1" / "1" / "stderr.log"
    for path, text in ((old, "an older attempt\n"), (new, DUMP)):
        path.parent.mkdir(parents=True)
        path.write_text(text)
    os.utime(old, (1, 1))
    found, text = stderr_tail(str(tmp_path), 1)
    assert found == str(new)
    assert text.splitlines() == [
        "[rank1]: a log line before the crash",  # up to CRASH_CONTEXT lines before the dump
        "Fatal Python error: Segmentation fault",
        "",
        "Thread 0x00007f02 (most recent call first):",
        '  File "queue.py", line 171 in get',
        "",
        "Current thread 0x00007f03 (most recent call first):",
        '  File "torchtitan_cp/trainer/trainer.py", line 381 in train',
        '  File "torchtitan_cp/train.py", line 298 in main',
    ]
    assert stderr_tail(str(tmp_path), 0) is None  # torchrun kept no file of local rank 0
    frames = [f'  File "f.py", line {i} in f{i}' for i in range(300)]
    new.write_text("\n".join(["Fatal Python error: Aborted", "", *frames]))
    lines = stderr_tail(str(tmp_path), 1, lines=40)[1].splitlines()
    assert len(lines) == 40 and lines[0] == "Fatal Python error: Aborted"
    assert lines[10] == "... (263 lines left out)" and lines[-1] == frames[-1]


def test_run_worker_records_an_escaping_error_for_torchrun(tmp_path, monkeypatch, capsys):
    """An exception that escapes the trainer's main (outside torchtitan's ``@record``-ed
    ``train``) is printed, written to torchrun's error file with its traceback, and status 1."""
    from torchtitan_cp import train

    def main(argv):
        raise RuntimeError(f"closing failed: {argv}")

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setattr(train, "main", main)
    assert train.run_worker(["x"]) == 1
    record = json.loads(path.read_text())["message"]
    assert record["message"] == "RuntimeError: closing failed: ['x']"
    stack = record["extraInfo"]["py_callstack"]
    assert stack.startswith("Traceback (most recent call last):") and "in main" in stack
    assert stack in capsys.readouterr().err
    monkeypatch.setattr(train, "main", lambda argv: 2)  # a status passes through
    assert train.run_worker([]) == 2


def test_report_names_each_silent_rank_and_where_its_stderr_is(tmp_path):
    """What the launcher prints above torchrun's report: each silent rank, how it ended, and
    the end of its stderr file, or where its stderr went when torchrun kept no file."""
    import io

    now = int(time.time())
    failures = {
        0: failure(tmp_path, 0, 1, "Traceback ...", now),
        1: failure(tmp_path, 1, -6, None, now),
    }
    logs = tmp_path / "logs"
    out = io.StringIO()
    report_silent_failures(failures, str(logs), out)
    assert out.getvalue() == (
        "rank 1 was killed by SIGABRT without an error of its own; its stderr, if not filtered "
        "out, is above (torchrun kept no file of it: --tee 3 keeps one)\n"
    )
    path = logs / "run_x" / "attempt_0" / "1" / "stderr.log"
    path.parent.mkdir(parents=True)
    path.write_text("terminate called without an active exception\nFatal Python error: Aborted\n")
    out = io.StringIO()
    report_silent_failures(failures, str(logs), out)
    assert out.getvalue() == (
        f"rank 1 was killed by SIGABRT without an error of its own; the end of its stderr "
        f"({path}):\n    terminate called without an active exception\n"
        "    Fatal Python error: Aborted\n"
    )
