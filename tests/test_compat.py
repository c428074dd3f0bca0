"""Each torchtitan 0.3.0 compatibility shim in torchtitan_cp.compat, one test apiece."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from tests.dist_utils import run_distributed
from torchtitan_cp import compat

cpu_only = pytest.mark.skipif(compat.accelerator_available(), reason="CPU-only shims")


@cpu_only
def test_device_bindings_point_at_cpu():
    compat.apply()
    for module_name, names in compat._DEVICE_BINDINGS:
        module = importlib.import_module(module_name)
        for name in names:
            value = getattr(module, name)
            if name == "device_type":
                assert value == "cpu", module_name
            else:
                assert value is compat.CPU_DEVICE_MODULE, module_name
    utils = importlib.import_module("torchtitan.tools.utils")
    assert utils.get_local_device() == torch.device("cpu")
    # The memory monitor torchtitan builds must work with the CPU device module.
    from torchtitan.components.metrics import build_device_memory_monitor

    stats = build_device_memory_monitor().get_peak_stats()
    assert stats.max_reserved_gib > 0


def _pg_timeouts(rank: int, world: int) -> bool:
    from datetime import timedelta

    compat.apply()
    dist_utils = importlib.import_module("torchtitan.distributed.utils")
    dims = SimpleNamespace(get_all_one_dimensional_meshes=lambda: {})
    dist_utils.set_pg_timeouts(timedelta(seconds=30), dims)
    return True


@pytest.mark.slow
@cpu_only
def test_set_pg_timeouts_works_on_gloo():
    assert run_distributed(_pg_timeouts, 2) == [True, True]


def _fsdp_sum(rank: int, world: int) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2, bias=False)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    compat.force_sum_reduction_on_gloo(model)
    x = torch.full((1, 4), float(rank + 1))
    model(x).sum().backward()
    return model.weight.grad.full_tensor().reshape(-1).tolist()


@pytest.mark.slow
def test_fsdp_gradients_are_summed_on_gloo():
    # d(sum(W x))/dW = x per output row: rank 0 contributes 1s, rank 1 contributes 2s.
    grads = run_distributed(_fsdp_sum, 2)
    assert grads[0] == grads[1] == [3.0] * 8


@cpu_only
def test_grad_norm_is_taken_in_float64_on_cpu():
    compat.apply()
    dist_utils = importlib.import_module("torchtitan.distributed.utils")
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(1_000_000)) for _ in range(2)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    exact = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params))
    norm = dist_utils.clip_grad_norm_(params, max_norm=1e9)
    assert abs(float(norm) - float(exact)) <= 1e-12 * float(exact)


def test_torch_floor_names_found_and_needed_version():
    with pytest.raises(compat.TorchVersionError) as err:
        compat.require_torch(compat.TRAINER_TORCH_FLOOR, "the trainer", "2.11.0+cu130")
    message = str(err.value)
    assert "\n" not in message
    assert "needs torch >= 2.14, found torch 2.11.0+cu130" in message
    for ok in ("2.14.1", "2.14.0.dev20260801+cu130", "2.15.0", "3.0.0"):
        compat.require_torch(compat.TRAINER_TORCH_FLOOR, "the trainer", ok)
    compat.require_torch(compat.TRAINER_TORCH_FLOOR, "the trainer")  # the pinned torch
    compat.require_torch(compat.LIBRARY_TORCH_FLOOR, "the model", "2.11.0")
    with pytest.raises(compat.TorchVersionError, match="cannot read a torch version"):
        compat.require_torch(compat.TRAINER_TORCH_FLOOR, "the trainer", "unknown")


def test_torch_211_trains_one_process_only():
    # Below 2.14 the shims carry one process (FSDP and CP degree 1); more is one line.
    for version in ("2.11.0+cu130", "2.13.1"):
        compat.check_trainer_torch(1, version)
        with pytest.raises(compat.TorchVersionError) as err:
            compat.check_trainer_torch(2, version)
        assert str(err.value).count("\n") == 0
        assert (
            f"runs 2 processes (FSDP, CP or replication), which needs torch >= 2.14, "
            f"found torch {version}: torch 2.11-2.13 train one process only" in str(err.value)
        )
    compat.check_trainer_torch(8, "2.14.1")
    with pytest.raises(compat.TorchVersionError, match="needs torch >= 2.11, found torch 2.10"):
        compat.check_trainer_torch(1, "2.10.0")


def test_pre_launch_check_refuses_two_processes_on_torch_211(monkeypatch):
    from torchtitan_cp.train import load_config
    from torchtitan_cp.trainer.config import ConfigError
    from torchtitan_cp.trainer.validate import validate

    config = load_config([])
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    validate(config, 1, "cpu", scan_data=False)
    with pytest.raises(ConfigError, match="runs 2 processes .* found torch 2.11.0"):
        validate(config, 2, "cpu", scan_data=False)


def test_torch_211_shims_supply_what_torchtitan_imports(monkeypatch):
    # 5 and 6: the names torchtitan 0.3.0 takes from torch 2.14, made absent as on 2.11.
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp

    monkeypatch.delattr(fsdp, "DataParallelMeshDims")
    monkeypatch.delattr(dist, "set_timeout")
    compat._shim_fsdp_mesh_dims()
    compat._shim_set_timeout()
    assert dist.set_timeout is dist.distributed_c10d._set_pg_timeout
    with pytest.raises(compat.TorchVersionError, match="needs torch >= 2.14"):
        fsdp.DataParallelMeshDims(shard="fsdp")  # only FSDP over > 1 process builds one
    compat._shim_set_timeout()  # idempotent, and a torch that has them keeps its own
    monkeypatch.undo()
    before = fsdp.DataParallelMeshDims
    compat._shim_fsdp_mesh_dims()
    assert fsdp.DataParallelMeshDims is before


def test_missing_tensorboard_is_a_clear_error(monkeypatch):
    # 7: torchtitan imports SummaryWriter at module level; without tensorboard only enabling it
    # fails, before launch, in one line.
    import sys

    from torchtitan_cp.train import load_config
    from torchtitan_cp.trainer.config import ConfigError
    from torchtitan_cp.trainer.validate import validate

    monkeypatch.setattr(compat, "tensorboard_available", lambda: False)
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    compat._shim_missing_tensorboard()
    from torch.utils.tensorboard import SummaryWriter

    with pytest.raises(RuntimeError, match="needs the tensorboard package"):
        SummaryWriter("x")
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard")
    config = load_config(["--metrics.enable_tensorboard"])
    with pytest.raises(ConfigError) as err:
        validate(config, 1, "cpu", scan_data=False)
    assert str(err.value) == (
        "metrics.enable_tensorboard = true needs the tensorboard package, which is not "
        "installed here; pip install tensorboard or set it to false"
    )


def test_train_entry_point_states_the_floor_before_importing_torchtitan(monkeypatch, capsys):
    from torchtitan_cp import train

    monkeypatch.setattr(compat, "LIBRARY_TORCH_FLOOR", (99, 0))
    assert train.main(["--help"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err.startswith("torchtitan_cp.train: error: the trainer")
    assert f"needs torch >= 99.0, found torch {torch.__version__}" in err


@pytest.mark.slow
def test_model_and_sequence_do_not_load_torchtitan_fsdp():
    # torchtitan.distributed.fsdp needs torch >= 2.14; below the trainer the floor is 2.11.
    from tests.launch import run_python

    code = (
        "import sys\n"
        "import torchtitan_cp.models, torchtitan_cp.models.sequence, torchtitan_cp.routing.host_metadata\n"
        "from torchtitan_cp.models import model_config\n"
        "model_config('debug').build()\n"
        "print(sorted(m for m in sys.modules if m.startswith('torchtitan.distributed.fsdp')))\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
    from torchtitan_cp.models import model_spec
    from torchtitan_cp.models.hybrid.parallelize import parallelize_hybrid

    assert model_spec("debug").parallelize_fn is parallelize_hybrid


@pytest.mark.slow
def test_config_patch_exit_does_not_recompile_blocks_that_read_compile_on_one_rank():
    # Shim 8, in a fresh interpreter (the shim is process-wide): a compiled function that reads
    # the flag as functional collectives do, then inductor's pattern-matcher patch of it. Without
    # the pin the patch's exit leaves False where the unset sentinel was and the function
    # recompiles (found as two extra graphs at step 2 of a compiled pass-KV training that ran
    # after another compiled training had warmed the inductor cache).
    from tests.launch import run_python

    code = """
import sys, torch
from torch._dynamo.utils import counters
from torchtitan_cp import compat
if sys.argv[-1] == "pin":
    compat._shim_pin_compile_on_one_rank()
@torch.compile(backend="eager", fullgraph=True)
def f(x):
    return x * 2 if torch.compiler.config.compile_on_one_rank else x + 1
x = torch.ones(3)
f(x)
with torch.compiler.config.patch(compile_on_one_rank=False):
    pass
f(x)
print(counters["stats"]["unique_graphs"])
"""
    graphs = {}
    for mode in ("pin", "none"):
        proc = run_python(code.replace('sys.argv[-1] == "pin"', repr(mode == "pin")), check=True)
        graphs[mode] = int(proc.stdout.split()[-1])
    assert graphs["pin"] == 1, graphs
    # The mechanism itself: if torch stops rewriting the override, the pin can go.
    assert graphs["none"] == 2, graphs
