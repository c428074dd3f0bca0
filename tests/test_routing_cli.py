"""The explain CLI: JSON, table, plot and one-line errors with exit status 2."""

import json
import os

import pytest

from tests.launch import run_module
from torchtitan_cp.routing.__main__ import main

ARGS = [
    "explain",
    "--cu-seqlens",
    "0,40,232,384",
    "--fragments",
    "0:96,288:384;96:192,192:288",
    "--rank",
    "1",
]


def test_json(capsys):
    assert main([*ARGS, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {
        "subsequences": [[1, 96, 192], [1, 192, 232], [2, 232, 288]],
        "cu_seqlens": [0, 96, 136, 192],
        "predecessors": [[[0, 0]], [[0, 0], [1, 0]]],
        "successors": [[[1, 1]], [[0, 1]]],
        "terminal": [1],
        "pass_kv": {
            "shifts": [1],
            "rounds": [{"shift": 1, "recv_from": 0, "recv_rows": [40, 96],
                        "query_rows": [0, 136], "send_to": 0, "send_rows": [136, 192]}],
        },
    }  # fmt: skip


def test_table(capsys):
    assert main(ARGS) == 0
    out = capsys.readouterr().out
    assert "rank 1 of 2" in out and "r0f0 r1f0" in out and "[192, 232)" in out
    assert "round 1: recv rows [40, 96) of rank 0 for queries [0, 136)" in out


def test_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "layout.png"
    assert main([*ARGS, "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_suffix_writes_the_name_given(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "layout"
    assert main([*ARGS, "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "layout.png").exists()


@pytest.mark.parametrize(
    "target, message",
    [
        ("dir", "is a directory; give a file name such as"),
        ("file/layout.png", "cannot write"),  # parent is a regular file
        ("missing/layout.png", "cannot write"),
        ("layout.svg", "give a file name ending in .png"),
    ],
)
def test_bad_plot_path_is_one_line_exit_2(tmp_path, capsys, target, message):
    """A directory or a path that cannot be written: one line, exit 2, nothing written or
    printed (before: an OSError traceback, and ``--plot /tmp`` wrote /tmp.png)."""
    pytest.importorskip("matplotlib")
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    path = tmp_path / target
    assert main([*ARGS, "--plot", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert message in err and str(path) in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "dir.png").exists() and not path.is_file()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_plot_into_read_only_directory_exit_2(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert main([*ARGS, "--plot", str(ro / "layout.png")]) == 2
    finally:
        ro.chmod(0o755)
    err = capsys.readouterr().err
    assert "cannot write: Permission denied" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv,message",
    [
        (["explain", "--cu-seqlens", "0,x", "--fragments", "0:4", "--rank", "0"], "integers"),
        (["explain", "--cu-seqlens", "0,4", "--fragments", "0-4", "--rank", "0"], "cannot parse"),
        (["explain", "--cu-seqlens", "0,4", "--fragments", "0:3", "--rank", "0"], "short of"),
        (["explain", "--cu-seqlens", "0,4", "--fragments", "0:4", "--rank", "3"], "out of range"),
        (["explain", "--cu-seqlens", "0,4", "--fragments", "0:4"], "required"),
        (["frobnicate"], "invalid choice"),
        ([], "required"),
    ],
)
def test_bad_arguments_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.slow
def test_subprocess_exit_code():
    bad = run_module(
        "torchtitan_cp.routing",
        "explain",
        "--cu-seqlens",
        "0,4",
        "--fragments",
        "0:2;3:4",
        "--rank",
        "0",
        timeout=60,
    )
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "gap: tokens [2, 3)" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.slow
def test_subprocess_plot_to_directory_exit_2(tmp_path):
    """Through the module entry point: ``--plot DIR`` (before: wrote ``DIR.png`` next to it)."""
    pytest.importorskip("matplotlib")
    bad = run_module("torchtitan_cp.routing", *ARGS, "--plot", str(tmp_path), timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "is a directory" in bad.stderr
    assert not tmp_path.with_suffix(".png").exists()
