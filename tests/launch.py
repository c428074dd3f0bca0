"""Run the real entry point under torchrun from tests, and read what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from tests.dist_utils import free_port

REPO = Path(__file__).resolve().parents[1]


def repo_env(**extra: str) -> dict[str, str]:
    """This environment with the repository first on PYTHONPATH, wandb offline and one thread.
    Without Triton's interpreter (the fla_interpreter tier turns it on in the pytest process):
    a launched run is a normal run unless ``extra`` turns it back on."""
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_module(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` in the repository root; stdout/stderr captured as text."""
    cmd = [sys.executable, "-m", module, *args]
    return subprocess.run(
        cmd, cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=timeout
    )


def run_python(code: str, *, timeout: float = 120, check: bool = False):
    """``python -c CODE`` in the repository root (a fresh interpreter: import-time checks);
    ``check=True`` raises with its stderr when it fails."""
    cmd = [sys.executable, "-c", code]
    proc = subprocess.run(
        cmd, cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"python -c failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def torchrun_cmd(
    args: list[str],
    *,
    nproc: int,
    module: str = "torchtitan_cp.train",
    launcher: str = "torch.distributed.run",
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of ``torchrun --nproc_per_node=nproc -m MODULE ARGS``
    on a free localhost port (MODULE: the trainer, or a tests/ runner that wraps its main;
    ``launcher="torchtitan_cp.launch"``: the recipe's torchrun, which ./scripts/train.sh runs
    after its check)."""
    cmd = [
        sys.executable, "-m", launcher,
        f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "-m", module, *args,
    ]  # fmt: skip # a table, laid out by hand to read across
    return cmd, repo_env(PYTHONUNBUFFERED="1")


def torchrun_train(
    args: list[str],
    *,
    nproc: int,
    dump_folder: Path,
    timeout: float = 300,
    check: bool = True,
    module: str = "torchtitan_cp.train",
) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=nproc -m MODULE ARGS --dump_folder DUMP`` (MODULE: the
    trainer by default); ``check=False`` returns a failed run instead of raising."""
    cmd, env = torchrun_cmd([*args, "--dump_folder", str(dump_folder)], nproc=nproc, module=module)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        # stderr's last 20000 characters: a crashed rank's faulthandler stacks come before
        # torchrun's report, which repeats each other rank's traceback (several KiB each)
        raise AssertionError(
            f"training failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-20000:]}"
        )
    return proc


@dataclass
class Launch:
    """One launch of the trainer for ``fork_train``: ``nproc`` ranks of ``ARGS --dump_folder
    FOLDER/name``, after copying ``copy_from`` there and removing ``remove`` (paths inside it)."""

    name: str
    nproc: int
    args: list[str]
    copy_from: str | None = None
    remove: tuple[str, ...] = ()
    entry: str | None = None  # "module:function" each rank runs instead of train.main


def fork_train(launches: list[Launch], *, folder: Path, timeout: float = 1200) -> str:
    """Run ``launches`` one after another with tests/fork_launch.py: one process imports the
    trainer once and forks every launch's ranks (real processes and gloo groups, the real entry
    point; no torchrun agent). Each launch writes ``folder/<name>``. Returns the launcher's
    stdout (one line per launch with its ranks' CPU time); raises with the failed ranks' logs."""
    jobs = [
        {**asdict(launch), "dump_folder": str(folder / launch.name), "remove": list(launch.remove)}
        for launch in launches
    ]
    jobs_file = folder / "fork_launch.json"
    jobs_file.write_text(json.dumps(jobs, indent=1))
    cmd = [sys.executable, "-m", "tests.fork_launch", str(jobs_file)]
    env = repo_env(PYTHONUNBUFFERED="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"fork_launch failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
            f"{proc.stderr[-12000:]}"
        )
    return proc.stdout


def seeded_runs(
    folder: Path,
    extra: list[str],
    runs: dict[str, tuple[int, list[str]]],
    config: list[str],
    steps: int = 3,
    seed_extra: tuple[str, ...] = (),
) -> dict[str, list[dict]]:
    """``steps`` AdamW steps from one seed checkpoint (one process of ``config`` +
    ``seed_extra``) for each ``name: (nproc, args)`` of ``config``; every run also gets
    ``extra``. Returns each run's metrics rows. The seed and every run are launched from one
    process that imported the trainer once (``fork_train``): process start-ups were most of
    these tests' CPU time."""
    seed = [
        *config,
        "--checkpoint.enable",
        "--checkpoint.create_seed_checkpoint",
        "--metrics.no-enable-wandb",
        *seed_extra,
    ]
    common = [
        *config,
        "--training.steps",
        str(steps),
        "--validator.no-enable",
        "--metrics.no-enable-wandb",
        "--debug.deterministic",
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(folder / "seed" / "checkpoint" / "step-0"),
        *extra,
    ]
    launches = [Launch("seed", 1, seed)]
    launches += [Launch(name, nproc, [*common, *args]) for name, (nproc, args) in runs.items()]
    print(fork_train(launches, folder=folder))
    return {name: read_metrics(folder / name) for name in runs}


def python_train_cmd(args: list[str], *, dump_folder: Path) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of ``python -m torchtitan_cp.train ARGS``."""
    env = repo_env()
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torchtitan_cp.train", *args, "--dump_folder", str(dump_folder)]
    return cmd, env


def python_train(args: list[str], *, dump_folder: Path, timeout: float = 300, check: bool = True):
    """``python -m torchtitan_cp.train ARGS`` without torchrun (a world of one process);
    ``check=False`` returns a failed run instead of raising."""
    cmd, env = python_train_cmd(args, dump_folder=dump_folder)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed (exit {proc.returncode}):\n{proc.stderr[-8000:]}")
    return proc


def train_sh_cmd(args: list[str], **env: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of ``./scripts/train.sh ARGS`` with ``env`` added
    (``NPROC``, ``NNODES``, ... unset unless given)."""
    base = repo_env(PYTHONUNBUFFERED="1")
    for key in (
        "NPROC",
        "NNODES",
        "NODE_RANK",
        "RDZV_ENDPOINT",
        "MASTER_ADDR",
        "MASTER_PORT",
        "NPROC_PER_NODE",
        "RDZV_ID",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
    ):
        base.pop(key, None)
    return [str(REPO / "scripts" / "train.sh"), *args], {**base, **env}


def train_sh(args: list[str], *, timeout: float = 300, check: bool = True, **env: str):
    """``./scripts/train.sh ARGS`` with ``env``; ``check=False`` returns a failed run."""
    cmd, full_env = train_sh_cmd(args, **env)
    proc = subprocess.run(
        cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"train.sh failed (exit {proc.returncode}):\n{proc.stderr[-8000:]}")
    return proc


def read_metrics(dump_folder: Path, file: str = "metrics.jsonl") -> list[dict]:
    """Training rows of ``metrics.jsonl`` (run header lines and validation rows are left out)."""
    rows = [json.loads(line) for line in (dump_folder / file).read_text().splitlines()]
    return [r for r in rows if "run_header" not in r and "loss" in r]


def read_run_headers(dump_folder: Path, file: str = "metrics.jsonl") -> list[dict]:
    """The ``run_header`` lines of ``metrics.jsonl``, one per run, oldest first."""
    rows = [json.loads(line) for line in (dump_folder / file).read_text().splitlines()]
    return [r["run_header"] for r in rows if "run_header" in r]


def rank_pids(marker: str) -> dict[int, int]:
    """Local rank -> pid of the running trainer ranks whose environment holds ``marker`` (a
    string unique to one launch, e.g. its dump folder): /proc of this machine."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"LOCAL_RANK" in env and b"TORCHELASTIC_RUN_ID" in env and marker.encode() in cmdline:
            found[int(env[b"LOCAL_RANK"])] = int(pid)
    return found
