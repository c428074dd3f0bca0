"""The explain CLI: JSON, table, plot and one-line errors with exit status 2."""

import json
import os

import pytest

from tests.helpers import positions_from_lengths
from tests.launch import run_module
from torchtitan_cp.routing import (
    balancer_names,
    format_fragments,
    headtail_fragments,
    host_layout,
    parse_fragments,
)
from torchtitan_cp.routing.__main__ import layout_from_documents, main

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
    }  # fmt: skip # a table, laid out by hand to read across


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
        (["explain", "--cu-seqlens", "0,4", "--rank", "0"], "the layout is required"),
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


# --- documents and a load balancer instead of a hand-written table ---------------------------

DOCS = ["explain", "--doc-lens", "300", "50", "162", "--world", "2"]


def test_doc_lens_give_the_balancers_layout(capsys):
    """Head-tail over one row of 512 tokens: the same plan as the hand-written table of
    torch's head-tail order (``headtail_fragments``) over the same documents."""
    assert main([*DOCS, "--balancer", "headtail", "--rank", "1", "--json"]) == 0
    from_docs = json.loads(capsys.readouterr().out)
    table = format_fragments(headtail_fragments(seq_len=512, batch_size=1, world_size=2))
    assert table == "0:128,384:512;128:384"
    hand = ["explain", "--cu-seqlens", "0,300,350,512", "--fragments", table, "--rank", "1"]
    assert main([*hand, "--json"]) == 0
    assert from_docs == json.loads(capsys.readouterr().out)
    assert from_docs["subsequences"] == [[0, 128, 300], [1, 300, 350], [2, 350, 384]]


def test_doc_lens_default_to_contiguous():
    cu, table = layout_from_documents([300, 50, 162], 2)
    assert cu == [0, 300, 350, 512] and table == [[(0, 256)], [(256, 512)]]


def test_a_document_crossing_a_row_end_goes_on_in_the_next_row():
    """Rows of 256: document 0 (300 tokens) is cut at the row end; the next row starts a
    document (so no tokens are lost and no row starts inside one)."""
    cu, table = layout_from_documents([300, 50, 162], 2, "headtail", seq_len=256)
    assert cu == [0, 256, 300, 350, 512]
    assert table == [[(0, 64), (192, 320), (448, 512)], [(64, 192), (320, 448)]]


@pytest.mark.parametrize("balancer", balancer_names())
def test_every_balancer_matches_training_host_layout(balancer):
    """The CLI's layout is the one training builds (``host_layout``) for the same rows, for
    every registered balancer (a new one is covered by registering it)."""
    lens, seq_len = [100, 156, 256, 40, 216], 256
    positions = positions_from_lengths(3, seq_len, lens)
    want = host_layout(positions, load_balancer=balancer, world_size=2, device="cpu", block_size=64)
    cu, table = layout_from_documents(lens, 2, balancer, seq_len=seq_len, ptrr_block_size=64)
    assert cu == want.cu_seqlens.tolist() == [0, 100, 256, 512, 552, 768]
    assert table == want.fragments


def test_table_names_the_layout_it_explains(capsys):
    """The table's first line is the layout as ``--cu-seqlens`` / ``--fragments``, so a layout
    from documents can be edited by hand and explained again."""
    assert main([*DOCS, "--balancer", "headtail", "--rank", "0"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == 'layout: --cu-seqlens 0,300,350,512 --fragments "0:128,384:512;128:384"'


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--doc-lens", "300", "0", "--world", "2", "--rank", "0"], "document 1 has length 0"),
        (["--doc-lens", "5", "--rank", "0"], "--doc-lens needs --world"),
        (["--doc-lens", "4", "--world", "0", "--rank", "0"], "--world must be >= 1"),
        (["--doc-lens", "4", "--world", "2", "--rank", "2"], "--rank 2 is out of range"),
        (["--doc-lens", "4", "--world", "2", "--balancer", "x", "--rank", "0"], "invalid choice"),
        (
            ["--doc-lens", "5", "3", "--world", "1", "--seq-len", "3", "--rank", "0"],
            "8 tokens do not fill rows of --seq-len 3",
        ),
        (
            ["--doc-lens", "300", "--world", "2", "--balancer", "ptrr", "--rank", "0"],
            "the sum of --doc-lens (300) at --world 2",
        ),
        (
            ["--doc-lens", "6", "--world", "2", "--balancer", "headtail", "--rank", "0"],
            "use 4 or 8",
        ),
        (
            ["--doc-lens", "8", "--world", "2", "--ptrr-block-size", "0", "--rank", "0"],
            "--ptrr-block-size must be >= 1",
        ),
        (
            ["--doc-lens", "4", "--cu-seqlens", "0,4", "--world", "1", "--rank", "0"],
            "either --doc-lens or --cu-seqlens",
        ),
        (
            ["--cu-seqlens", "0,4", "--fragments", "0:4", "--world", "2", "--rank", "0"],
            "--world goes only with --doc-lens",
        ),
        (["--cu-seqlens", "0,4", "--rank", "0"], "the layout is required"),
        (["--rank", "0"], "the layout is required"),
    ],
)
def test_bad_documents_exit_2(extra, message, capsys):
    assert main(["explain", *extra]) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_the_cp_md_example_from_documents(capsys):
    """docs/cp.md's worked example (W = 4 head-tail over 6 documents) from its document
    lengths: the layout and pass-KV rounds the page shows."""
    assert layout_from_documents([6, 4, 6, 6, 4, 6], 4, "headtail") == (
        [0, 6, 10, 16, 22, 26, 32],
        parse_fragments("0:4,28:32;4:8,24:28;8:12,20:24;12:20"),
    )
    argv = ["explain", "--doc-lens", "6", "4", "6", "6", "4", "6", "--world", "4"]
    assert main([*argv, "--balancer", "headtail", "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "rank 1: own rows [0, 8), rounds [1, 3]" in out
    assert (
        "round 1: recv rows [0, 4) of rank 0 for queries [0, 2); send rows [2, 4) to rank 2" in out
    )
