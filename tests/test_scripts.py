"""The GPU check (scripts/gpu_check.sh and gpu_check.py) as a CPU dry run, so it does not rot
between GPU sessions; its bad-input errors; scripts/gpu_imports.py and scripts/gpu_wheels.sh."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.launch import REPO


@pytest.mark.slow
def test_gpu_check_dry_run_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    # The shell wrapper too: its dependency probe, then its CUDA-only tests (skipped here).
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--device", "cpu", "--flavor", "debug",
         "--pattern", "KA", "--seq-len", "256", "--mean-doc", "40", "--steps", "2",
         "--warmup", "1", "--compile-backend", "aot_eager", "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    timing = result["timing"]
    assert timing["host"]["readbacks_per_step"] == 0
    assert timing["device_readback"]["readbacks_per_step"] >= 1
    # Compiled blocks take the second microbatch's new layout without compiling again.
    assert result["compile"]["compiled"]["frames_compiled_after_warmup"] == 0
    assert "| compiled |" in proc.stdout
    assert "| host |" in proc.stdout
    assert "skipped" in proc.stdout and "CUDA tests failed" not in proc.stderr


def _gpu_check(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, **env_extra)
    return subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip


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
    err = gpu_imports.check(("torchtitan_cp.models:no_such_name",))
    assert err is not None and err.startswith(
        "cannot import no_such_name from torchtitan_cp.models"
    )


def _gpu_wheels(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/gpu_wheels.sh", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


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
    assert {"pytest", "pluggy", "iniconfig", "typeguard", "docstring-parser"} <= names
    assert not {n for n in names if n in ("torch", "triton", "numpy") or n.startswith("nvidia")}
    wheels = sorted(p.name for p in tmp_path.glob("*.whl"))
    assert wheels == sorted(pins.values())
    for wheel in wheels:
        tags = wheel[: -len(".whl")].split("-")[-3:]
        assert tags[0] in ("py3", "py2.py3", "cp312"), wheel
        assert tags[2] == "any" or "manylinux" in tags[2] and "x86_64" in tags[2], wheel
    total = sum(p.stat().st_size for p in tmp_path.glob("*.whl"))
    assert total <= 64 * 2**20
    assert f"{len(pins)} wheels for CPython 3.12" in proc.stdout


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
