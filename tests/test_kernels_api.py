"""The local kernels' argument checking and backend dispatch (CPU only; fla needs CUDA, or
Triton's interpreter in the fla_interpreter tier), and that tier's one-line skip reasons."""

from __future__ import annotations

import pytest
import torch

from tests.launch import run_python
from torchtitan_cp.ops.conv.local import causal_conv1d
from torchtitan_cp.ops.delta_rule.local import chunk_delta_rule

T, H, K, V = 10, 2, 4, 3


def _args(kind="kda", **over):
    a = {
        "q": torch.randn(1, T, H, K),
        "k": torch.randn(1, T, H, K),
        "v": torch.randn(1, T, H, V),
        "g": -torch.rand(1, T, H, K) if kind == "kda" else -torch.rand(1, T, H),
        "beta": torch.rand(1, T, H),
    }
    a.update(over)
    return a


@pytest.mark.parametrize(
    ("kind", "over", "match"),
    [
        ("kda", {"q": torch.randn(T, H, K)}, r"q must be \[1, T, H, K\], got shape \[10, 2, 4\]"),
        ("kda", {"k": torch.randn(1, T, H, K + 1)}, r"k must match q"),
        ("kda", {"v": torch.randn(1, T + 1, H, V)}, r"v must be"),
        ("kda", {"v": torch.randn(1, T, 3, V)}, r"HV=3 must be a multiple of q/k heads H=2"),
        ("kda", {"g": torch.randn(1, T, H)}, r"g must be \[1, 10, 2, 4\] for kind='kda'"),
        ("gdn", {"g": torch.randn(1, T, H, K)}, r"g must be \[1, 10, 2\] for kind='gdn'"),
        ("kda", {"beta": torch.rand(1, T, H, 1)}, r"beta must be \[1, 10, 2\]"),
    ],
)
def test_delta_rule_shape_errors(kind, over, match):
    with pytest.raises(ValueError, match=match):
        chunk_delta_rule(**_args(kind, **over), kind=kind)


def test_delta_rule_argument_errors(interpreter_off):
    with pytest.raises(ValueError, match="kind must be 'kda' or 'gdn', got 'gla'"):
        chunk_delta_rule(**_args(), kind="gla")
    with pytest.raises(ValueError, match="backend must be one of"):
        chunk_delta_rule(**_args(), kind="kda", backend="triton")
    with pytest.raises(ValueError, match="backend='fla' needs CUDA"):
        chunk_delta_rule(**_args(), kind="kda", backend="fla")
    with pytest.raises(ValueError, match=r"end at T=10"):
        chunk_delta_rule(**_args(), kind="kda", cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match=r"initial_state must be \[2, 2, 4, 3\], got shape \[3,"):
        chunk_delta_rule(
            **_args(),
            kind="kda",
            cu_seqlens=torch.tensor([0, 4, 10]),
            initial_state=torch.zeros(3, H, K, V),
        )


def test_conv_errors(interpreter_off):
    x, w = torch.randn(1, T, 5), torch.randn(5, 4)
    with pytest.raises(ValueError, match=r"x must be \[1, T, D\], got shape \[10, 5\]"):
        causal_conv1d(x[0], w)
    with pytest.raises(ValueError, match=r"weight must be \[D=5, W\], got shape \[4, 5\]"):
        causal_conv1d(x, w.t())
    with pytest.raises(ValueError, match=r"bias must be \[5\]"):
        causal_conv1d(x, w, torch.zeros(4))
    with pytest.raises(
        ValueError, match=r"initial_state must be \[2, 5, 3\], got shape \[2, 5, 4\]"
    ):
        causal_conv1d(x, w, cu_seqlens=torch.tensor([0, 3, 10]), initial_state=torch.zeros(2, 5, 4))
    with pytest.raises(ValueError, match="activation must be 'silu' or None"):
        causal_conv1d(x, w, activation="relu")
    with pytest.raises(ValueError, match="backend='fla' needs CUDA"):
        causal_conv1d(x, w, backend="fla")


def test_fla_on_cpu_tensors_only_under_the_interpreter(monkeypatch):
    from torchtitan_cp.ops.common.checks import resolve_backend

    x = torch.zeros(1)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="backend='fla' needs CUDA tensors"):
        resolve_backend("fla", x)
    assert resolve_backend("auto", x) == "torch"
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("fla", x) == "fla"
    assert resolve_backend("auto", x) == "torch"  # auto never picks the interpreter
    with pytest.raises(ValueError, match="got meta"):  # CPU tensors only
        resolve_backend("fla", x.to("meta"))


def test_interpreter_tier_names_what_is_missing(monkeypatch):
    import importlib.metadata

    from tests import fla_interpreter

    def version(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert fla_interpreter._unavailable() == (
        "triton is not installed (the fla interpreter tier needs triton==3.8.0)"
    )
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "3.5.1")
    assert fla_interpreter._unavailable() == (
        "triton 3.5.1 is installed; the fla interpreter tier is written for 3.8.0"
    )


@pytest.mark.slow
def test_auto_backend_on_cpu_is_torch_and_fla_not_imported():
    """Importing and running the local kernels on CPU must not load fla's Triton kernels."""
    code = (
        "import sys, torch\n"
        "from torchtitan_cp.ops.conv.local import causal_conv1d\n"
        "from torchtitan_cp.ops.delta_rule.local import chunk_delta_rule\n"
        "q = torch.randn(1, 5, 1, 4); v = torch.randn(1, 5, 1, 2)\n"
        "chunk_delta_rule(q, q, v, -torch.rand(1, 5, 1), torch.rand(1, 5, 1), kind='gdn')\n"
        "causal_conv1d(torch.randn(1, 5, 3), torch.randn(3, 4))\n"
        "assert not any(m == 'fla' or m.startswith('fla.') for m in sys.modules), 'fla imported'\n"
    )
    run_python(code, check=True)
