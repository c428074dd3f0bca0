"""Metrics at the edges: wandb online without credentials falls back to offline with one line
saying how to upload the run later. (global_max_loss under CP: test_train.py's CP run.)"""

from __future__ import annotations

import os

import pytest

from torchtitan_cp import compat

compat.apply()  # before torchtitan's trainer module binds the device names

from torchtitan_cp.trainer.metrics import wandb_offline_fallback  # noqa: E402


@pytest.fixture
def no_credentials(tmp_path, monkeypatch):
    """A home without ~/.netrc or wandb settings, no WANDB_* credentials, wandb online."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for key in (
        "WANDB_API_KEY",
        "WANDB_IDENTITY_TOKEN_FILE",
        "NETRC",
        "WANDB_CONFIG_DIR",
        "WANDB_BASE_URL",
    ):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_MODE", "online")
    return tmp_path


def test_online_without_credentials_goes_offline_with_the_sync_command(no_credentials):
    """Before: the GPU configs enabled wandb online and the run met the missing login inside
    the metrics rank."""
    line = wandb_offline_fallback("out/tb/*/wandb/offline-run-*")
    assert os.environ["WANDB_MODE"] == "offline"
    assert line is not None and line.startswith("wandb: no credentials")
    assert line.endswith("upload the run later with `wandb sync out/tb/*/wandb/offline-run-*`")
    assert "\n" not in line


def test_credentials_or_offline_change_nothing(no_credentials, monkeypatch):
    (no_credentials / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password k\n")
    assert wandb_offline_fallback("x") is None and os.environ["WANDB_MODE"] == "online"
    (no_credentials / ".netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_offline_fallback("x") is None
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_offline_fallback("x") is None and os.environ["WANDB_MODE"] == "disabled"
