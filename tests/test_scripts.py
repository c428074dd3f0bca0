"""The GPU check's one call (scripts/gpu_check.sh --all and gpu_check.py) as a CPU dry run, so it
does not rot between GPU sessions; its deadline; its bad-input errors; scripts/gpu_imports.py and
scripts/gpu_wheels.sh."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.launch import REPO

SMALL = (
    "--flavor",
    "debug",
    "--pattern",
    "KA",
    "--seq-len",
    "256",
    "--mean-doc",
    "40",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--compile-backend",
    "aot_eager",
)

# The parts of the one call, in the order it runs them (between its two "call" lines).
PARTS = (
    "correctness",
    "trainer_sync",
    "timing",
    "cp_op_ms",
    "compile",
    "autotune_reuse",
    "cuda_tests",
)


def _call(results, *args: str, budget: int = 3000) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        PYTHON=sys.executable,
        OMP_NUM_THREADS="1",
        GPU_CACHE=str(results.parent / "cache"),
        GPU_CHECK_BUDGET=str(budget),
    )
    return subprocess.run(
        [
            "bash",
            "scripts/gpu_check.sh",
            "--all",
            "--device",
            "cpu",
            "--results",
            str(results),
            *args,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=budget + 300,
    )


def _rows(results) -> list[dict]:
    return [json.loads(line) for line in results.read_text().splitlines()]


@pytest.mark.slow
def test_gpu_check_one_call_dry_run(tmp_path):
    # The one GPU call's CPU dry run (issue 34), every part in its order, each its own process:
    # about 120 s of CPU (the four trainer runs and the compiled model most of it).
    results = tmp_path / "gpu_check.jsonl"
    proc = _call(results, *SMALL, "--box-scale", "20")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = _rows(results)
    parts = [r["part"] for r in rows]
    order = ["call", *PARTS, "call"]
    assert [p for i, p in enumerate(parts) if i == 0 or p != parts[i - 1]] == order
    assert len({r["call"] for r in rows}) == 1 and all(r["ok"] for r in rows)
    by = {(r["part"], r["name"]): r for r in rows}
    # Every line says which fla autotune rule its process ran under.
    rules = {r["part"]: r["fla_autotune"] for r in rows}
    assert rules["correctness"].startswith("one config per fla-core autotuner, its smallest")
    assert (
        rules["timing"]
        == rules["cp_op_ms"]
        == rules["compile"]
        == ("one config per fla-core autotuner, fla's first (its preferred)")
    )
    env = by["call", "environment"]
    assert env["torch_version"] == torch.__version__ and env["fla_core"] == "0.6.0"
    assert {"cuda", "triton", "ptxas", "tilelang", "nvcc"} <= env.keys()
    assert env["fla_gated_backward"] == "runs"
    assert env["gated_backward"].startswith("gated backward (GDN, Mamba2, retention):")
    assert "gpu_check: gated backward (GDN, Mamba2, retention): " in proc.stdout  # the one line
    # correctness: the parity tests of every registered recurrence, one line each.
    from tests.recurrences import CASES

    cp = [r for r in rows if "test_cp_gradients_on_every_rank_torch" in r["name"]]
    assert len(cp) == len(CASES) and all(
        len(r["cp_gradients"]["max_rel_grad_err_per_rank"]) == 4 for r in cp
    )
    # trainer_sync: steps 2-3 of the host path, on the configured backend and on torch, list
    # nothing; the log step reads the loss and the gradient norm (_log_step), the first
    # non-finite loss mark (_stop_if_not_finite), and puts the routing counters on the device
    # for their all-reduce and reads them back.
    for name in ("host", "host_torch"):
        steps = by["trainer_sync", name]["steps"]
        assert steps["2"] == steps["3"] == [], (name, steps)
        assert sorted((e.split(" ")[0], e.rsplit(" ", 1)[1]) for e in steps["4"]) == [
            ("blocking-h2d", "_routing_metrics"),
            ("readback", "_log_step"),
            ("readback", "_log_step"),
            ("readback", "_routing_metrics"),
            ("readback", "_stop_if_not_finite"),
        ], steps["4"]
    readback = by["trainer_sync", "device_readback"]
    assert readback["synchronised"]
    assert [e.split(":")[0] for e in readback["steps"]["2"]] == [
        "readback Tensor.cpu at routing/sources.py"
    ]
    control = by["trainer_sync", "torchtitan_step"]["steps"]
    # torchtitan's step: a blocking copy of the valid-token count and of input, positions and
    # labels every step; at the log step it also reads the global valid-token count back.
    copies = [e for e in control["2"] if "blocking-h2d Tensor.to at torchtitan/trainer.py" in e]
    assert sum(int(e.split("x ")[0]) if "x " in e else 1 for e in copies) == 4, control["2"]
    log_reads = [e for e in control["4"] if e.startswith("readback") and "torchtitan/" in e]
    assert len(log_reads) == 3, control["4"]
    timing = by["timing", "step_time"]
    assert timing["host"]["readbacks_per_step"] == 0
    assert timing["device_readback"]["readbacks_per_step"] >= 1
    for T in (256, 512):
        ms = by["cp_op_ms", f"kda_{T}"]
        assert ms["world"] == 4 and all(
            ms[f"{n}_fwd_bwd_ms"] > 0 for n in ("local", "cp", "unsharded")
        )
        assert ms["reference"]["cp_ms_per_rank"] == 5.73
    # Compiled blocks take the second microbatch's new layout without compiling again.
    assert by["compile", "compile"]["compiled"]["frames_compiled_after_warmup"] == 0
    assert "skipped" in by["autotune_reuse", "autotune_reuse"]
    tests = by["cuda_tests", "cuda_tests"]
    assert "skipped" in tests["summary"] and "failed" not in tests["summary"]
    assert by["call", "done"]["ok"]


@pytest.mark.slow
def test_gpu_check_parts_keep_to_the_deadline(tmp_path):
    # A part past its box is killed and says so, the next part still starts, and a part with
    # no time left before the deadline is not started: about 15 s of CPU.
    results = tmp_path / "gpu_check.jsonl"
    skip = [a for p in PARTS if p != "compile" for a in ("--skip", p)]
    proc = _call(results, *SMALL, *skip, "--box-scale", "0.02", budget=600)  # compile: 3 s
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    by = {(r["part"], r["name"]): r for r in _rows(results)}
    assert "killed after its 3 s box (its own)" == by["compile", "compile"]["timed_out"]
    assert not by["call", "done"]["ok"]
    results.unlink()
    proc = _call(results, *SMALL, budget=0)  # the deadline is already past
    assert proc.returncode == 1
    rows = _rows(results)
    skipped = [r["part"] for r in rows if str(r.get("skipped", "")).startswith("no time left")]
    assert skipped == list(PARTS)


def _gpu_check(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, **env_extra)
    return subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--device", "cpu"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _manifest(folder, python: str, *lines: str) -> None:
    folder.mkdir(exist_ok=True)
    text = "\n".join(["# scripts/gpu_wheels.sh", f"python {python}", *lines])
    (folder / "gpu_wheels.txt").write_text(text + "\n")


PYVER = f"{sys.version_info[0]}.{sys.version_info[1]}"


@pytest.mark.slow
def test_gpu_check_names_the_missing_wheel(tmp_path):
    wheels = tmp_path / "wheels"
    _manifest(wheels, PYVER, "einops==0.8.2 einops-0.8.2-py3-none-any.whl")
    proc = _gpu_check({"WHEEL_DIR": str(wheels), "SITE": str(tmp_path / "site")})
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "lacks the wheel of einops==0.8.2 (einops-0.8.2-py3-none-any.whl)" in proc.stderr
    assert not (tmp_path / "site").exists()  # nothing installed, nothing measured
    assert proc.stdout == ""


@pytest.mark.slow
def test_gpu_check_rejects_wheels_for_another_python(tmp_path):
    wheels = tmp_path / "wheels"
    _manifest(wheels, "3.99", "einops==0.8.2 einops-0.8.2-py3-none-any.whl")
    proc = _gpu_check({"WHEEL_DIR": str(wheels), "SITE": str(tmp_path / "site")})
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert f"for Python 3.99 but {sys.executable} is Python {PYVER}" in proc.stderr
    assert f"--python-version {PYVER}" in proc.stderr


@pytest.mark.slow
def test_gpu_check_wants_a_filled_wheel_folder(tmp_path):
    proc = _gpu_check({"WHEEL_DIR": str(tmp_path), "SITE": str(tmp_path / "site")})
    assert proc.returncode == 2
    assert proc.stderr == (
        f"gpu_check: no gpu_wheels.txt in {tmp_path}; fill it with scripts/gpu_wheels.sh "
        f"{tmp_path}\n"
    )


def _load_gpu_imports():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_imports", REPO / "scripts/gpu_imports.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_imports_name_the_first_failure():
    gpu_imports = _load_gpu_imports()
    # The pinned venv has the whole CUDA path, so a renamed module must update the list.
    assert gpu_imports.check() is None
    err = gpu_imports.check(("torchtitan_cp.routing:host_layout", "no_such_module_x.sub:f"))
    assert err == (
        "cannot import f from no_such_module_x.sub: ModuleNotFoundError: "
        "No module named 'no_such_module_x'"
    )
    err = gpu_imports.check((), torch_version="2.10.1+cu128")
    assert err is not None and err.startswith(
        "the CUDA path needs torch >= 2.11, found torch 2.10.1+cu128"
    )
    assert gpu_imports.check(gpu_imports.TRAINER_IMPORTS) is None
    err = gpu_imports.check(("torchtitan_cp.models:no_such_name",))
    assert err is not None and err.startswith(
        "cannot import no_such_name from torchtitan_cp.models"
    )


def _gpu_wheels(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "scripts/gpu_wheels.sh", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, error",
    [
        (["--python-version", "312"], "--python-version must be 3.N, got '312'"),
        (["--python-version"], "--python-version needs X.Y"),
        (["--abi", "cp312"], "unknown option --abi"),
        (["a", "b"], "more than one DIR"),
    ],
)
def test_gpu_wheels_rejects_bad_arguments(args, error):
    proc = _gpu_wheels(*args)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and error in proc.stderr, proc.stderr


@pytest.mark.slow
def test_gpu_wheels_resolves_for_python_312(tmp_path):
    # Needs PyPI (as scripts/test.sh does for a fresh .venv). What the image check installs.
    proc = _gpu_wheels(str(tmp_path), "--python-version", "3.12")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (tmp_path / "gpu_wheels.txt").read_text().splitlines()
    assert lines[1] == "python 3.12"
    pins = dict(line.split(" ") for line in lines[2:])
    names = {pin.split("==")[0] for pin in pins}
    assert {"torchtitan", "fla-core", "einops", "packaging", "spmd-types", "tyro"} <= names
    assert {"typeguard", "docstring-parser"} <= names  # tyro's
    # The trainer's data pipeline: datasets and torchdata; pyarrow and pandas are the image's.
    assert {"datasets", "torchdata"} <= names
    # What the image has, and what the check does not import.
    image = {
        "torch",
        "triton",
        "numpy",
        "tokenizers",
        "huggingface-hub",
        "pytest",
        "sympy",
        "pyarrow",
        "pandas",
    }
    assert not {n for n in names if n in image or n.startswith("nvidia")}
    assert not names & {"wandb", "tensorboard", "aiohttp", "pillow", "hf-xet"}
    wheels = sorted(p.name for p in tmp_path.glob("*.whl"))
    assert wheels == sorted(pins.values())
    for wheel in wheels:
        tags = wheel[: -len(".whl")].split("-")[-3:]
        assert tags[0] in ("py3", "py2.py3", "cp312", "py312"), wheel
        assert tags[2] == "any" or "manylinux" in tags[2] and "x86_64" in tags[2], wheel
    total = sum(p.stat().st_size for p in tmp_path.glob("*.whl"))
    assert f"{len(pins)} wheels for CPython 3.12" in proc.stdout
    # Wheels and tree together within 40 MiB (the first call's budget of the 64 it may carry).
    together = float(proc.stdout.split("together ")[1].split(" MiB")[0])
    assert total / 2**20 < together <= 40, proc.stdout


def test_sync_check_names_the_synchronising_frame():
    # A synchronising step is reported with the innermost project/fla frame, where to look.
    import importlib.util

    import pytest
    import torch

    from torchtitan_cp.ops.common.fla import chunk_table

    spec = importlib.util.spec_from_file_location("gpu_check", f"{REPO}/scripts/gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    with pytest.raises(ValueError) as info:
        chunk_table(None, 0, torch.zeros(1, 2), None)
    site = gpu_check.sync_site(info.value)
    assert site.startswith("torchtitan_cp/ops/common/fla.py:") and "chunk_table" in site


def test_sync_warnings_list_every_synchronisation_with_its_frame():
    # What the trainer_sync part collects on CUDA under set_sync_debug_mode("warn"): every
    # synchronisation of a step, in order, each with the frame that made it (not only the
    # first, which "error" mode stopped at). torch's warning is raised where the operation is
    # called; here the same warning comes from two project frames.
    import importlib.util
    import warnings

    from torchtitan_cp.ops.common import varlen

    spec = importlib.util.spec_from_file_location("gpu_check", f"{REPO}/scripts/gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    text = "called a synchronizing CUDA operation"

    def ship_then_warn():  # stands for a kernel that synchronises
        varlen.ship([0, 1], torch.device("cpu"))
        warnings.warn(text, UserWarning, stacklevel=1)

    with pytest.warns(UserWarning, match="unrelated"):
        with gpu_check.sync_warnings() as found:
            ship_then_warn()
            warnings.warn("unrelated", UserWarning, stacklevel=1)  # passes through
            ship_then_warn()
    assert len(found) == 2 and all(f.endswith(f": {text}") for f in found), found
    assert all("test_scripts.py" in f and "ship_then_warn" in f for f in found), found
