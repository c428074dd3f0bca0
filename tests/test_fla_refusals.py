"""fla-core's refusal of its gated ``chunk_bwd_dqkwg`` on Hopper with 3.4.0 <= triton < 3.7.1
(fla #640), the lent H200's own case (triton 3.6.0): known before the run, on a CPU machine by
faking the device's answer (``fla_refusals.device_facts``). The refusal is keyed on that kernel:
every recurrence whose fla backward calls it (GDN; SSD with a gate per head: Mamba2, retention)
says so, and every layer running one inherits it. ``fla`` for those layers is a one-line refusal
naming the versions (pre-launch check and model build); ``auto`` runs them (hybrid ``G``, ``M``,
``R``, Qwen3.5's GatedDeltaNet) on the PyTorch kernels with one warning per kind; KDA and GLA
are untouched."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from torchtitan_cp.ops.common import fla_refusals
from torchtitan_cp.ops.common.fla_refusals import DeviceFacts, fla_gated_backward_refusal

H200_IMAGE = DeviceFacts((9, 0), "3.6.0", False)  # docs/gpu.md: the lent machine
NVCC = "/opt/cuda/bin/nvcc"
GATED = "gated backward (GDN, Mamba2, retention)"


def test_refusal_follows_fla_s_own_condition():
    reason = fla_gated_backward_refusal(H200_IMAGE)
    assert reason is not None and "\n" not in reason
    assert "triton 3.6.0" in reason and "capability 9.0" in reason and "#640" in reason
    assert fla_gated_backward_refusal(DeviceFacts((9, 0), "3.4.0", False)) is not None
    for ok in (
        DeviceFacts((9, 0), "3.7.1", False),
        DeviceFacts((9, 0), "3.3.1", False),
        DeviceFacts((9, 0), "3.6.0", True, NVCC),
        DeviceFacts((8, 0), "3.6.0", False),
        DeviceFacts((10, 0), "3.6.0", False),
        DeviceFacts(None, "3.6.0", False),
        DeviceFacts((9, 0), None, False),
    ):
        assert fla_gated_backward_refusal(ok) is None, ok
    # fla takes its TileLang route only with an nvcc for TileLang's JIT (fla #1026).
    no_nvcc = fla_gated_backward_refusal(DeviceFacts((9, 0), "3.6.0", True))
    assert no_nvcc is not None and "finds no nvcc" in no_nvcc and "#1026" in no_nvcc


def test_each_recurrence_answers_for_its_own_fla_kernels(monkeypatch):
    """Keyed on the kernel: on the faked H200 every recurrence whose fla backward runs the gated
    chunk_bwd_dqkwg (fla-core 0.6.0: chunk_gated_delta_rule, chunk_simple_gla) is refused, and
    only those; a registered variant (retention's fixed decay) inherits its family's answer."""
    from tests.recurrences import CASES
    from torchtitan_cp.ops.cp.recurrence import RECURRENCES, recurrence

    monkeypatch.setattr(fla_refusals, "device_facts", lambda: H200_IMAGE)
    refused = {c.id: recurrence(c.name, **c.options).fla_refusal() is not None for c in CASES}
    assert {c.name for c in CASES} == set(RECURRENCES)
    assert refused == {
        "kda": False,
        "gdn": True,
        "gdp2": True,  # the delta rule on its stream of steps: GDN's kernels
        "ssd": True,
        "ssd-fixed-decay": True,
        **{c.id: False for c in CASES if c.name == "gla"},
    }, refused
    monkeypatch.setattr(fla_refusals, "device_facts", lambda: DeviceFacts((9, 0), "3.7.1", False))
    assert not any(recurrence(c.name, **c.options).fla_refusal() for c in CASES)


def test_faked_h200_refuses_fla_for_gated_layers_and_auto_falls_back(monkeypatch, caplog):
    from torchtitan_cp.models.hybrid.layers import LAYERS
    from torchtitan_cp.train import load_config
    from torchtitan_cp.trainer.config import ConfigError
    from torchtitan_cp.trainer.validate import _check_backends

    monkeypatch.setattr(fla_refusals, "device_facts", lambda: H200_IMAGE)
    monkeypatch.setattr(fla_refusals, "_warned", set())
    with caplog.at_level(logging.WARNING, logger=fla_refusals.__name__):
        for letter in "GMR":  # the gated kernel: GDN, Mamba2 (SSD), retention (SSD)
            assert LAYERS[letter].backend("auto") == "torch"
            assert LAYERS[letter].backend("auto") == "torch"
    warned = [r.getMessage() for r in caplog.records if "triton 3.6.0" in r.getMessage()]
    assert len(warned) == 3, warned  # one per kind
    assert any("Mamba2 (SSD) layers run the PyTorch kernels" in w for w in warned), warned
    assert LAYERS["K"].backend("auto") == "auto" and LAYERS["G"].backend("torch") == "torch"
    for letter, name in (("G", "GDN"), ("M", "Mamba2"), ("R", "RetNet retention")):
        with pytest.raises(ValueError, match=rf"'fla' for {name}.* layers: .*triton 3.6.0"):
            LAYERS[letter].backend("fla")
    # The pre-launch check (as on the CUDA machine): one line with the versions naming every
    # refused kind, for the hybrid's layers and for Qwen3.5's GatedDeltaNets; KDA-only and
    # attention-only patterns pass it.
    from torchtitan_cp.models.recipe import recipe_model_spec

    for argv, named in (
        (["--config_file", "configs/debug_cpu.toml", "--model.layer_pattern", "KGKA"], "GDN"),
        (["--config_file", "configs/debug_cpu.toml", "--model.layer_pattern", "KMRA"],
         "Mamba2 (SSD) layers and RetNet retention layers"),
        (["--config_file", "configs/qwen35_debug_cpu.toml"], "GatedDeltaNet layers"),
    ):  # fmt: skip # a table, laid out by hand to read across
        config = load_config(argv)
        config.linear_attention.backend = "fla"
        model_cfg = recipe_model_spec(config.model).model
        with pytest.raises(ConfigError, match=rf"{re.escape(named)}.*: .*triton 3\.6\.0") as err:
            _check_backends(config, model_cfg, "cuda", 1)
        assert "\n" not in str(err.value)
    from torchtitan_cp.trainer.validate import _fla_refused

    config = load_config(["--config_file", "configs/debug_cpu.toml"])
    config.model.layer_pattern = "KKA"
    assert _fla_refused(recipe_model_spec(config.model).model) == []
    # The Qwen3.5 model built with auto routes its GatedDeltaNets to the torch kernels.
    config = load_config(["--config_file", "configs/qwen35_debug_cpu.toml"])
    model = recipe_model_spec(config.model).model.build()
    from torchtitan_cp.models.qwen35.model import RoutedGatedDeltaKernel

    kernels = [m for m in model.modules() if isinstance(m, RoutedGatedDeltaKernel)]
    assert kernels and all(k.backend == "torch" for k in kernels)


def _fake_tilelang_and_nvcc(tmp_path, monkeypatch, *, nvcc: bool):
    """An importable ``tilelang`` package and (``nvcc``) an executable ``nvcc`` on ``PATH``,
    nothing else that fla would find (no CUDA_HOME, no default toolkit)."""
    (tmp_path / "site" / "tilelang").mkdir(parents=True)
    (tmp_path / "site" / "tilelang" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if nvcc:
        (bin_dir / "nvcc").write_text("#!/bin/sh\n")
        (bin_dir / "nvcc").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    for var in ("CUDA_HOME", "CUDA_PATH", "FLA_TILELANG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(fla_refusals, "CUDA_DEFAULT", tmp_path / "no_cuda")
    return bin_dir


@pytest.mark.parametrize("nvcc", [True, False])
def test_tilelang_route_needs_an_nvcc_as_fla_does(tmp_path, monkeypatch, nvcc):
    # What device_facts reads on the H200 image with tilelang installed, with and without an
    # nvcc on PATH: fla 0.6.0 takes its TileLang route (no refusal) only with one.
    import importlib

    bin_dir = _fake_tilelang_and_nvcc(tmp_path, monkeypatch, nvcc=nvcc)
    importlib.invalidate_caches()
    facts = fla_refusals.device_facts()._replace(capability=(9, 0), triton="3.6.0")
    assert facts.tilelang
    assert facts.nvcc == (str(bin_dir / "nvcc") if nvcc else None)
    refusal = fla_gated_backward_refusal(facts)
    path = fla_refusals.fla_gated_backward_path(facts)
    assert "\n" not in path
    if nvcc:
        assert refusal is None and path.startswith(f"{GATED}: fla's TileLang kernels")
    else:
        assert refusal is not None and "finds no nvcc" in refusal
        assert path.startswith(f"{GATED}: PyTorch kernels (") and "#1026" in path
    # FLA_TILELANG=0 turns fla's TileLang route off, nvcc or not.
    monkeypatch.setenv("FLA_TILELANG", "0")
    off = fla_refusals.device_facts()._replace(capability=(9, 0), triton="3.6.0")
    assert not off.tilelang and fla_gated_backward_refusal(off) is not None


def test_find_nvcc_agrees_with_fla(tmp_path, monkeypatch):
    # The same places in the same order as fla's own has_usable_nvcc (fla/utils/env.py), which
    # caches its answer: its unwrapped body is asked under each faked environment.
    from fla.utils.env import has_usable_nvcc

    bin_dir = _fake_tilelang_and_nvcc(tmp_path, monkeypatch, nvcc=True)
    monkeypatch.setattr(fla_refusals, "CUDA_DEFAULT", Path("/usr/local/cuda"))  # fla's own
    assert fla_refusals.find_nvcc() == str(bin_dir / "nvcc")
    assert has_usable_nvcc.__wrapped__()
    (bin_dir / "nvcc").unlink()
    home = tmp_path / "toolkit"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "nvcc").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(home))
    assert fla_refusals.find_nvcc() == str(home / "bin" / "nvcc")
    assert has_usable_nvcc.__wrapped__()
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "empty"))
    expected = has_usable_nvcc.__wrapped__()  # /usr/local/cuda decides, for both
    assert (fla_refusals.find_nvcc() is not None) == expected
