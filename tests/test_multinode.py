"""Multi-node launches through ``./scripts/train.sh``: two "nodes" of one process each on this
machine (two invocations with NNODES=2, NODE_RANK=0/1 and a local rendezvous endpoint), the
launch geometry refused before torchrun starts, and the pre-launch check for NNODES x NPROC."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.dist_utils import free_port
from tests.launch import REPO, read_metrics, torchrun_train, train_sh, train_sh_cmd
from torchtitan_cp.train import main

CONFIG = "configs/debug_cpu.toml"
ARGS = [
    "--training.steps",
    "3",
    "--parallelism.context_parallel_degree",
    "2",
    "--validator.no-enable",
    "--metrics.no-enable-wandb",
]


@pytest.mark.slow
def test_two_nodes_give_the_single_node_losses(tmp_path):
    """CP=2 across two nodes of one process (global ranks 0 and 1 on nodes 0 and 1) trains the
    same 3 steps as CP=2 on one node of two processes: the same ranks run the same gloo
    collectives, so the losses are equal bit for bit (tolerance 0)."""
    one = tmp_path / "one"
    t0 = time.perf_counter()
    torchrun_train(["--config_file", CONFIG, *ARGS], nproc=2, dump_folder=one)
    t1 = time.perf_counter()
    two = tmp_path / "two"
    endpoint = f"127.0.0.1:{free_port()}"
    procs = []
    for node in (0, 1):
        cmd, env = train_sh_cmd(
            [CONFIG, *ARGS, "--dump_folder", str(two)],
            NNODES="2",
            NODE_RANK=str(node),
            NPROC_PER_NODE="1",
            RDZV_ENDPOINT=endpoint,
        )
        procs.append(
            subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for node, (p, (_, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"node {node}:\n{err[-6000:]}"
    print(f"one node {t1 - t0:.1f} s, two nodes {time.perf_counter() - t1:.1f} s")
    # Each node's console shows its own process, by global rank: NODE_RANK decided the ranks.
    for node, (out, err) in enumerate(outs):
        assert f"[rank{node}]:" in out + err and f"[rank{1 - node}]:" not in out + err, node
        # the rendezvous lines stop once the node's ranks run
        started = err.find(f"[rank{node}]:")
        assert "waiting for" not in err[started:] if started >= 0 else True, err[-3000:]
    single, multi = read_metrics(one), read_metrics(two)
    assert [r["step"] for r in multi] == [1, 2, 3]
    assert [r["loss"] for r in multi] == [r["loss"] for r in single], (single, multi)


@pytest.mark.slow
@pytest.mark.parametrize(
    "env, needle",
    [
        ({"NNODES": "2"}, "NNODES=2 needs NODE_RANK, this machine's number (0..1)"),
        (
            {"NNODES": "2", "NODE_RANK": "2", "RDZV_ENDPOINT": "h:1"},
            "NODE_RANK=2 is not a node of NNODES=2 (use 0..1)",
        ),
        ({"NNODES": "2", "NODE_RANK": "1"}, "NNODES=2 needs the rendezvous endpoint of node 0"),
        (
            {"NNODES": "2", "NODE_RANK": "0", "RDZV_ENDPOINT": "node0"},
            "RDZV_ENDPOINT=node0 must be host:port",
        ),
        (
            {"NNODES": "2", "NODE_RANK": "1", "RDZV_ENDPOINT": "[::1:29500"},
            "RDZV_ENDPOINT=[::1:29500 must be host:port (an IPv6 address in brackets",
        ),
        (
            {"NNODES": "2", "NODE_RANK": "1", "RDZV_ENDPOINT": "a b:99999"},
            "RDZV_ENDPOINT=a b:99999 must be host:port",
        ),
        (
            {"NNODES": "2", "NODE_RANK": "1", "RDZV_ENDPOINT": "node0:0"},
            "port 1..65535",
        ),
        (
            {"NNODES": "2", "NODE_RANK": "1", "RDZV_ENDPOINT": "[::1]:29500", "RDZV_TIMEOUT": "0"},
            "RDZV_TIMEOUT must be a whole number of seconds >= 1, got '0'",
        ),
        ({"NNODES": "two"}, "NNODES must be a whole number >= 1"),
        ({"NODE_RANK": "1"}, "NODE_RANK=1 but NNODES=1; set NNODES"),
        ({"NPROC": "2", "NPROC_PER_NODE": "1"}, "NPROC=2 and NPROC_PER_NODE=1 disagree"),
    ],
    ids=[
        "no-node-rank",
        "node-rank-out-of-range",
        "no-endpoint",
        "bad-endpoint",
        "ipv6-unclosed",
        "space-and-port-range",
        "port-zero",
        "bad-rdzv-timeout",
        "bad-nnodes",
        "node-rank-alone",
        "nproc-disagree",
    ],  # fmt: skip # a table, laid out by hand to read across
)
def test_bad_launch_geometry_is_one_line_before_torchrun(tmp_path, env, needle):
    proc = train_sh([CONFIG, "--dump_folder", str(tmp_path / "run")], check=False, **env)
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("[env]")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("train.sh: error: ") and needle in lines[0], lines
    assert proc.stdout == "" and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_rendezvous_wait_is_bounded_and_speaks(tmp_path):
    """Before: node 1 whose endpoint had nothing listening printed nothing for 300 s (the
    store's timeout is 600 s), and node 0 alone as long. Now both say that they wait and end
    after RDZV_TIMEOUT with one line naming the endpoint and the fix, exit 2. Loopback only."""
    endpoint = f"127.0.0.1:{free_port()}"
    for node, needles in (
        (
            "1",
            [
                f"node 1 of 2: waiting for node 0 at {endpoint} (0 s of 2 s, RDZV_TIMEOUT)",
                f"torchtitan_cp.launch: error: node 1 of 2: no rendezvous at {endpoint} within "
                "2 s (RDZV_TIMEOUT; Connection refused): start node 0 (NODE_RANK=0)",
            ],
        ),
        (
            "0",
            [
                f"node 0 of 2: hosting the rendezvous at {endpoint}; waiting up to 2 s",
                f"torchtitan_cp.launch: error: node 0 of 2: the rendezvous at {endpoint} did not "
                "complete within 2 s (RDZV_TIMEOUT; ",
                "1/2 clients joined",
            ],
        ),
    ):
        proc = train_sh(
            [CONFIG, "--dump_folder", str(tmp_path / "run")],
            check=False,
            timeout=120,
            NNODES="2",
            NODE_RANK=node,
            NPROC_PER_NODE="1",
            RDZV_ENDPOINT=endpoint,
            RDZV_TIMEOUT="2",
        )
        lines = [
            x
            for x in proc.stderr.splitlines()
            if x.strip()
            and not x.startswith(("[env]", "[mesh]"))
            and "waiting for the other nodes" not in x
        ]  # every 10 s: none, unless slow
        assert proc.returncode == 2 and len(lines) == 2, proc.stderr[-3000:]
        assert needles[0] in lines[0] and all(n in lines[1] for n in needles[1:]), lines
        assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


def test_a_waiting_node_speaks_until_node_0_listens(monkeypatch):
    """``wait_for_endpoint`` (what node 1's launch runs first): a line every REPORT_EVERY
    seconds while nothing listens, and it returns once node 0's endpoint accepts."""
    import io
    import socket
    import threading

    from torchtitan_cp import launch

    monkeypatch.setattr(launch, "REPORT_EVERY", 0.5)
    port = free_port()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def listen_later() -> None:
        time.sleep(1.6)
        server.bind(("127.0.0.1", port))
        server.listen()

    later = threading.Thread(target=listen_later)
    later.start()
    out = io.StringIO()
    try:
        waited = launch.wait_for_endpoint("127.0.0.1", port, node=1, nnodes=2, timeout=30, out=out)
    finally:
        later.join()
        server.close()
    lines = out.getvalue().splitlines()
    assert 1.5 < waited < 30 and len(lines) >= 3, lines
    assert (
        lines[0]
        == f"node 1 of 2: waiting for node 0 at 127.0.0.1:{port} (0 s of 30 s, RDZV_TIMEOUT)"
    )
    assert all(line.endswith("of 30 s, RDZV_TIMEOUT)") for line in lines), lines


@pytest.mark.slow
def test_every_node_speaks_until_its_ranks_start(monkeypatch):
    """``RendezvousSpeaker`` (what every node runs beside torchrun's rendezvous): a line every
    ``every`` seconds, counted from the start of the wait, until this process has started a
    child (torchrun's ranks); never after."""
    import io

    from torchtitan_cp import launch

    out = io.StringIO()
    # A child from before the wait (a helper; under pytest, an earlier test's) is not a rank.
    helper = subprocess.Popen(["sleep", "30"])
    speaker = launch.RendezvousSpeaker(
        "node 0 of 2: waiting for the other nodes at h:1",
        timeout=300,
        every=0.5,
        waited=3.0,
        out=out,
    )
    speaker.start()
    time.sleep(2.2)
    assert speaker.is_alive(), "an older child does not end the wait"
    child = subprocess.Popen(["sleep", "30"])  # a rank started: the rendezvous is over
    try:
        speaker.join(timeout=10)
        assert not speaker.is_alive(), "it stops once a rank runs"
        lines = out.getvalue().splitlines()
        time.sleep(1.0)
        assert out.getvalue().splitlines() == lines, "nothing after"
    finally:
        for p in (child, helper):
            p.kill()
            p.wait()
        speaker.done.set()
    import re

    assert len(lines) >= 2, lines
    pattern = r"node 0 of 2: waiting for the other nodes at h:1 \((\d+) s of 300 s, RDZV_TIMEOUT\)"
    seconds = [int(re.fullmatch(pattern, x)[1]) for x in lines]  # type: ignore[index]
    assert seconds[0] >= 3 and seconds == sorted(seconds), lines  # from the wait's start


def check(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["--check", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_check_validates_nnodes_times_nproc(capsys, tmp_path):
    """``--check --nproc N --nnodes M`` (what train.sh runs) validates a world of N x M."""
    dump = ["--dump_folder", str(tmp_path / "run")]
    # stdout: the process count train.sh reads; stderr: only the mesh report.
    assert check(
        capsys, "--nproc", "1", "--nnodes", "2", *dump, "--parallelism.context_parallel_degree", "2"
    ) == (0, "1\n", "[mesh] cp 2 (2 processes)\n")
    code, _, err = check(
        capsys, "--nproc", "1", "--nnodes", "3", *dump, "--parallelism.context_parallel_degree", "2"
    )
    assert code == 2 and "does not divide the 3 processes" in err and err.count("\n") == 1, err
    code, _, err = check(capsys, "--nproc", "2", "--nnodes", "0", *dump)
    assert code == 2 and "NNODES must be a whole number >= 1" in err, err


def test_cp_groups_must_not_straddle_nodes(capsys, tmp_path):
    """CP is the innermost mesh axis: with 3 processes per node, CP=2 would put one group on
    two nodes; CP=3 (inside a node) and 6 processes over 2 nodes with CP=6 (whole nodes) pass."""
    dump = ["--dump_folder", str(tmp_path / "run"), "--training.seq_len", "384"]
    code, _, err = check(
        capsys, "--nproc", "3", "--nnodes", "2", *dump, "--parallelism.context_parallel_degree", "2"
    )
    assert code == 2 and err.count("\n") == 1, err
    assert "context_parallel_degree (2) and the 3 processes per node" in err
    for cp in ("3", "6"):
        code, _, err = check(
            capsys,
            "--nproc",
            "3",
            "--nnodes",
            "2",
            *dump,
            "--parallelism.context_parallel_degree",
            cp,
        )
        assert code == 0, (cp, err)
