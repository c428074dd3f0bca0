"""HostSyncRecorder, the CPU dry run of CUDA's sync debug mode (torchtitan_cp.trainer.host_sync).

The device is the CPU named ``cpu:0`` (apart from the host's ``cpu``), as the GPU check's dry run
names the trainer's device. Each kind of synchronisation is recorded with its calling line, and
the same operations on host tensors are not.
"""

from __future__ import annotations

import pytest
import torch

from torchtitan_cp.trainer.host_sync import HostSyncRecorder

DEVICE = torch.device("cpu", 0)


def _events(fn) -> list[tuple[str, str]]:
    weight = torch.nn.Parameter(torch.randn(8))
    rec = HostSyncRecorder(DEVICE)
    rec.mark_device(weight)
    with rec:
        fn(weight)
    return [(e.kind, e.op) for e in rec.events]


def test_device_values_read_on_the_host_are_recorded():
    assert _events(lambda w: (w * 2).sum().item()) == [("readback", "aten._local_scalar_dense")]
    assert _events(lambda w: int(w.argmax())) == [("readback", "aten._local_scalar_dense")]
    assert _events(lambda w: w.tolist()) == [("readback", "Tensor.tolist")]
    # .cpu() is the readback; the host copy it returns is host data from then on.
    assert _events(lambda w: w.cpu().tolist()) == [("readback", "Tensor.cpu")]
    assert _events(lambda w: w.nonzero()) == [("data-dependent", "aten.nonzero")]
    assert _events(lambda w: w[w > 0]) == [("data-dependent", "aten.index (boolean mask)")]
    counts = torch.tensor([1, 2, 0, 1, 1, 0, 2, 1])
    assert _events(lambda w: w.repeat_interleave(counts.to(DEVICE, non_blocking=True))) == [
        ("data-dependent", "aten.repeat_interleave")
    ]


def test_blocking_copies_to_the_device_are_recorded_and_non_blocking_ones_not():
    host = torch.arange(8)
    assert _events(lambda w: w + host.to(DEVICE)) == [("blocking-h2d", "Tensor.to")]
    assert _events(lambda w: w + host.to(DEVICE, non_blocking=True)) == []
    assert _events(lambda w: torch.tensor([1.0], device=DEVICE)) == [
        ("blocking-h2d", "torch.tensor")
    ]
    # A fill on the device carries its value as a kernel argument: no copy.
    assert _events(lambda w: (torch.full((), 3, device=DEVICE) * w).sum()) == []
    assert _events(lambda w: w.detach().copy_(host)) == [("blocking-h2d", "aten.copy_")]


def test_host_work_is_not_recorded():
    host = torch.tensor([0, 3, 3, 7])

    def routing_like(w):
        # What the host routing does on the loader's CPU tensors: free, nothing to wait for.
        assert host.tolist() == [0, 3, 3, 7] and int(host.max()) == 7
        (host.diff() > 0).nonzero()
        host.to("cpu", torch.int32).tolist()
        idx = host.to(DEVICE, non_blocking=True)  # then one copy to the device, not waited for
        return w[idx]

    assert _events(routing_like) == []


def test_events_name_the_calling_line():
    rec = HostSyncRecorder(DEVICE)
    w = torch.ones(2)
    rec.mark_device(w)
    with rec:
        w.sum().item()
    (event,) = rec.events
    assert event.site.startswith("tests/test_host_sync.py:") and "test_events_name" in event.site
    assert str(event).startswith("readback aten._local_scalar_dense at tests/test_host_sync.py:")


def test_blocking_copies_to_a_device_tensors_device_are_recorded():
    # On CPU a device tensor's .device is plain "cpu", the host's own name, so such a copy is
    # only known for one when its result meets device tensors; it is then recorded at the line
    # that copied (what CUDA's sync debug mode reported at ops/conv/torch_kernel.py:71).
    host = torch.arange(8)

    def copy_then_use(w):
        idx = host.to(w.device)  # the copy: blocking on a GPU
        return w[idx[:4]] + w[idx[4:]]  # met by a device tensor twice: one copy, one event

    rec = HostSyncRecorder(DEVICE)
    w = torch.randn(8)
    rec.mark_device(w)
    with rec:
        copy_then_use(w)
    (event,) = rec.events
    assert (event.kind, event.op) == ("blocking-h2d", "Tensor.to")
    assert event.site.endswith("copy_then_use") and "idx = host.to" in _line(event.site)
    assert _events(lambda w: w * torch.tensor([2.0], device=w.device)) == [
        ("blocking-h2d", "torch.tensor")
    ]
    assert _events(lambda w: w + host.to(w)) == [("blocking-h2d", "Tensor.to")]
    assert _events(lambda w: w.new_tensor([1.0, 2.0]).sum()) == [
        ("blocking-h2d", "Tensor.new_tensor")
    ]
    # The same copies non-blocking, and host work that never meets the device: nothing.
    assert _events(lambda w: w + host.to(w.device, non_blocking=True)) == []
    assert _events(lambda w: host.to(w.device).tolist() and host.to("cpu").sum()) == []
    # Once met, the copy is a device tensor: reading it back is a readback.
    assert _events(lambda w: (w + (c := host.to(w.device))) is None or c.tolist()) == [
        ("blocking-h2d", "Tensor.to"),
        ("readback", "Tensor.tolist"),
    ]


def _line(site: str) -> str:
    """The source line of a ``path:line function`` site of this test file."""
    lineno = int(site.split(":")[1].split(" ")[0])
    with open(__file__) as f:
        return f.read().splitlines()[lineno - 1]


class _CopiesInBackward(torch.autograd.Function):
    """A backward that copies a host index to its gradient's device and reads a value."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        idx = torch.arange(grad.shape[0]).to(grad.device)
        grad.tolist()
        return grad[idx] * 2


def test_a_custom_functions_backward_is_watched_too():
    # The autograd engine runs a custom Function's backward without the Python function-mode
    # stack: the recorder's own hook puts its function level back there.
    before = torch.autograd.function.BackwardCFunction.apply
    assert _events(lambda w: _CopiesInBackward.apply(w).sum().backward()) == [
        ("readback", "Tensor.tolist"),
        ("blocking-h2d", "Tensor.to"),
    ]
    assert torch.autograd.function.BackwardCFunction.apply is before  # the hook is gone


# The trainer's whole step, every layer kind and layout (issue 34): the real trainer forked per
# launch (tests/fork_launch.py) with each rank's step 2 under the recorder (tests/host_syncs.py).
_COMMON = (
    "--training.steps",
    "2",
    "--metrics.log_freq",
    "10",
    "--metrics.no-enable_wandb",
    "--validator.no-enable",
    "--checkpoint.no-enable",
    "--linear_attention.backend",
    "torch",
)


def _launches():
    from tests.launch import Launch
    from torchtitan_cp.models.hybrid.layers import LAYERS
    from torchtitan_cp.routing.balancers import balancer_names

    every_kind = (
        "--config_file",
        "configs/debug_cpu.toml",
        "--model.layer_pattern",
        "".join(LAYERS),
    )
    models = {
        "hybrid": every_kind,
        "qwen35": ("--config_file", "configs/qwen35_debug_cpu.toml"),
        "kimi_linear": ("--config_file", "configs/kimi_linear_debug_cpu.toml"),
    }
    runs = [(name, args, 1, ()) for name, args in models.items()]
    for i, balancer in enumerate(balancer_names()):
        # The first layout passes K/V between ranks in the attention layers, the others gather.
        cp = (
            "--parallelism.context_parallel_degree",
            "2",
            "--parallelism.context_parallel_load_balancer",
            balancer,
            *(("--model.attention_cp", "pass_kv") if i == 0 else ()),
        )
        runs.append((f"hybrid_cp2_{balancer}", every_kind, 2, cp))
    head_tail = ("--parallelism.context_parallel_degree", "2")  # the configs' head-tail
    runs += [(f"{name}_cp2", models[name], 2, head_tail) for name in ("qwen35", "kimi_linear")]
    return [
        Launch(name, nproc, [*args, *cp, *_COMMON], entry="tests.host_syncs:main")
        for name, args, nproc, cp in runs
    ]


@pytest.mark.slow
def test_trainer_steps_wait_for_nothing_for_every_layer_kind_and_layout(tmp_path):
    # Every layer kind of the registry in one hybrid model, Qwen3.5 and Kimi Linear, at CP=1
    # and CP=2 (the hybrid with every registered load balancer), the torch kernels: the whole
    # step 2 of every rank records nothing. Before issue 34 the recorder could not see the
    # blocking copies of the torch kernels' host-built index tables (conv, chunk packing, CP
    # summaries), which the GPU found; with it, every kind with a conv or a chunked kernel
    # recorded them here. About 80 s of CPU (8 launches, 13 ranks, the trainer imported once).
    import json

    from tests.launch import fork_train

    launches = _launches()
    fork_train(launches, folder=tmp_path)
    seen = {}
    for launch in launches:
        for rank in range(launch.nproc):
            path = tmp_path / launch.name / f"host_syncs_rank{rank}.json"
            seen[f"{launch.name}/rank{rank}"] = json.loads(path.read_text())["steps"]
    assert {k: v for k, v in seen.items() if v != {"2": []}} == {}
    assert len(seen) == 13
