"""Every collective outside the gloo control group gets tensors on the training device.

On CUDA torchtitan's default group is NCCL only and rejects CPU tensors; on CPU gloo takes
them, so the check follows where each tensor came from (tests/collective_devices.py) rather
than its device.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from tests.collective_devices import Tracker
from tests.dist_utils import free_port
from torchtitan_cp.ops.cp.collectives import _funcol_all_gather


@pytest.fixture
def world_of_one():
    """A one-rank gloo default group in this process, torn down afterwards."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_tracker_flags_host_tensors_outside_the_control_group(world_of_one, monkeypatch):
    from torchtitan_cp.run import control as run_control

    monkeypatch.setattr(run_control, "_CONTROL_GROUP", None)
    control = run_control.control_group()
    device = torch.device("cpu")  # the trainer's self.device on a CPU run
    with Tracker() as t:
        dist.all_reduce(torch.tensor([1.0, 2.0]))  # host: flagged
        dist.all_reduce(torch.tensor([1.0], device="cpu"))  # "cpu" spelled out: host
        x = torch.zeros(3).to(device) * 2  # moved to the device, then computed on it
        dist.all_reduce(x)
        dist.all_reduce(torch.ones(2, device=device) + torch.ones(2))  # device + host: device
        dist.all_reduce(torch.ones(2), group=control)  # the gloo control group takes host
        # A functional collective (what the CP layers use under torch.compile): flagged.
        _funcol_all_gather(torch.ones(2).cpu(), 0, dist.group.WORLD).wait()
    flagged = [(v["op"], v["host"]) for v in t.violations]
    assert flagged == [
        ("c10d.allreduce_", [[2]]),
        ("c10d.allreduce_", [[1]]),
        ("_c10d_functional.all_gather_into_tensor", [[2]]),
    ], t.violations
    assert sum(n for k, n in t.calls.items() if k.startswith("c10d.allreduce_")) == 5


@pytest.mark.slow
def test_trainer_collectives_use_the_training_device(tmp_path):
    """Two ranks, CP=2 (FSDP over dp_shard x cp), validation at step 2: no collective outside
    the control group gets a host tensor. Before the fix, trainer.py's _routing_metrics
    all-reduced a host tensor at every log step (4 violations per rank)."""
    from tests.launch import torchrun_train

    torchrun_train(
        [
            "--config_file",
            "configs/debug_cpu.toml",
            "--training.steps",
            "2",
            "--parallelism.context_parallel_degree",
            "2",
            "--validator.freq",
            "2",
            "--validator.steps",
            "1",
            "--metrics.no-enable-wandb",
        ],
        nproc=2,
        dump_folder=tmp_path,
        module="tests.collective_devices",
    )
    for rank in range(2):
        report = json.loads((tmp_path / f"collective_devices_rank{rank}.json").read_text())
        assert report["violations"] == [], (rank, report["violations"])
        callers = " ".join(report["calls"])
        # Checked: the routing metrics' reduction, the CP layers' gathers, FSDP's gradient
        # reduce-scatter (in torchtitan's forward-backward), the loss metrics' reduction.
        for caller in (
            "_routing_metrics",
            "ops/cp/collectives.py",
            "_reduce_scatter_base_ @ torchtitan/trainer.py",
            "_dist_reduce_tensor",
        ):
            assert caller in callers, (caller, sorted(report["calls"]))
