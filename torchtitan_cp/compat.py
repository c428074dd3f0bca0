"""Every compatibility adjustment torchtitan 0.3.0 needs to run this recipe, in one place.

Each shim has a one-line reason and a test in tests/test_compat.py. ``apply()`` is idempotent
and must run before the trainer is built: the entry point (``torchtitan_cp.train``) calls it
before loading any of torchtitan's trainer code, and ``HybridTrainer.__init__`` again.
On CUDA machines only the shims that are not CPU-specific are applied; on torch 2.14 (the pin)
the torch shims (5-7) are not applied, on torch 2.11-2.13 they let one process train. Shim 8
(a torch config pin for compiled runs) and shim 9 (pipeline stages' shape inference) are applied
everywhere.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import re
from collections import namedtuple
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_APPLIED = False

# The trainer's floors. torchtitan 0.3.0 was written against torch 2.14 (DataParallelMeshDims in
# torch.distributed.fsdp, dist.set_timeout, FSDP over the spmd_types mesh). On torch 2.11-2.13 the
# shims below let it run one process (FSDP and CP degree 1, the GPU machine's configuration);
# anything needing more is refused by ``check_trainer_torch``. routing/, ops/, models/ (but for
# qwen35/ and hybrid/parallelize.py) and trainer/compile.py need only torch >= 2.11
# (scripts/gpu_imports.py checks it; the GPU image check runs them on 2.11.0).
TRAINER_TORCH_FLOOR = (2, 14)
LIBRARY_TORCH_FLOOR = (2, 11)


class TorchVersionError(RuntimeError):
    """The installed torch is older than a floor; the message is one line."""


def torch_release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string such as ``"2.11.0+cu130"`` or
    ``"2.14.0.dev20260801"`` (pre-releases of a minor count as that minor)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise TorchVersionError(f"cannot read a torch version from {version!r}")
    return int(match[1]), int(match[2])


def require_torch(floor: tuple[int, int], what: str, version: str | None = None) -> None:
    """Raise ``TorchVersionError`` naming the found and the needed version when torch
    (``version``, default the installed one) is older than ``floor``."""
    found = str(torch.__version__) if version is None else version
    if torch_release(found) < floor:
        need = ".".join(map(str, floor))
        raise TorchVersionError(
            f"{what} needs torch >= {need}, found torch {found} "
            "(./scripts/train.sh builds a venv with the pinned torch 2.14.1; see docs/gpu.md)"
        )


def torch_below_trainer_floor(version: str | None = None) -> bool:
    """True on torch 2.11-2.13, where the trainer runs single-process through the shims."""
    found = str(torch.__version__) if version is None else version
    return torch_release(found) < TRAINER_TORCH_FLOOR


def check_trainer_torch(world_size: int, version: str | None = None) -> None:
    """Raise ``TorchVersionError`` (one line) for a run this torch cannot train: below 2.11 any
    run, on 2.11-2.13 more than one process (FSDP, CP or replication need torch 2.14's FSDP)."""
    found = str(torch.__version__) if version is None else version
    require_torch(LIBRARY_TORCH_FLOOR, "the trainer (torchtitan 0.3.0)", found)
    if world_size > 1 and torch_below_trainer_floor(found):
        raise TorchVersionError(
            f"the trainer runs {world_size} processes (FSDP, CP or replication), which needs "
            f"torch >= 2.14, found torch {found}: torch 2.11-2.13 train one process only "
            "(FSDP and CP degree 1; see docs/gpu.md)"
        )


# Modules that bind ``device_type`` / ``device_module`` by value at import time.
_DEVICE_BINDINGS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torchtitan.tools.utils", ("device_type", "device_module")),
    ("torchtitan.components.metrics", ("device_type", "device_module")),
    ("torchtitan.distributed.parallel_dims", ("device_type",)),
    ("torchtitan.distributed.utils", ("device_type", "device_module")),
    ("torchtitan.tools.profiler", ("device_module",)),
)


def accelerator_available() -> bool:
    """True when CUDA devices exist; the recipe then runs on NCCL, else on gloo."""
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def device_type() -> str:
    return "cuda" if accelerator_available() else "cpu"


class _CpuDeviceModule:
    """``torch.cpu`` plus the few CUDA-style calls torchtitan makes on its device module."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def set_device(device: Any) -> None:
        pass

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def synchronize(device: Any = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        pass

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        # Peak resident set size of this process stands in for the allocator's peaks.
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak}

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        import os

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return namedtuple("CpuProperties", "name total_memory")("cpu", total)


CPU_DEVICE_MODULE = _CpuDeviceModule()


def _shim_device_bindings() -> None:
    # 1. torchtitan binds device_type to "cuda" when no accelerator exists; point it at the CPU.
    for module_name, names in _DEVICE_BINDINGS:
        module = importlib.import_module(module_name)
        for name in names:
            value = "cpu" if name == "device_type" else CPU_DEVICE_MODULE
            setattr(module, name, value)
    import torchtitan.tools.utils as utils

    # "cpu:<local_rank>" is no device: every rank uses the CPU.
    utils.get_local_device = lambda: torch.device("cpu")


def _shim_pg_timeouts() -> None:
    # 2. set_pg_timeouts calls barrier(device_ids=[...]), which gloo rejects: use a plain barrier.
    import torchtitan.distributed.utils as dist_utils

    def set_pg_timeouts(timeout: timedelta, parallel_dims: Any) -> None:
        dist.barrier()
        groups = [m.get_group() for m in parallel_dims.get_all_one_dimensional_meshes().values()]
        for group in [*groups, None]:
            dist.set_timeout(timeout, group)

    dist_utils.set_pg_timeouts = set_pg_timeouts


def _shim_grad_norm() -> None:
    # 3. On CPU, fp32 norms accumulate sequentially (~3e-5 relative error on a 1M-parameter
    # model), which hides whether two runs agree: take the total norm in float64 there (with
    # expert parallelism, as torchtitan does: the experts' and the rest's, each on its mesh;
    # with pipeline parallelism each stage's sum of powers, summed over the pp mesh).
    import torchtitan.distributed.utils as dist_utils

    original = dist_utils.clip_grad_norm_

    @torch.no_grad()
    def clip_grad_norm_(
        parameters,
        max_norm,
        norm_type=2.0,
        error_if_nonfinite=False,
        foreach=None,
        pp_mesh=None,
        ep_enabled=False,
    ):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        grads = [p.grad for p in params if p.grad is not None]
        if any(g.device.type != "cpu" for g in grads):
            return original(
                params, max_norm, norm_type, error_if_nonfinite, foreach, pp_mesh, ep_enabled
            )
        from torch.distributed.tensor import DTensor

        def norm(gs: list[torch.Tensor]) -> torch.Tensor:
            n = torch.nn.utils.get_total_norm(
                [g.to(torch.float64) for g in gs], norm_type, error_if_nonfinite, foreach
            )
            return n.full_tensor() if isinstance(n, DTensor) else n

        groups = [[p for p in params if p.grad is not None]]
        if ep_enabled:  # experts live on the EP mesh, the rest on another: one norm each
            on_ep = [
                isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())
                for p in groups[0]
            ]
            groups = [[p for p, e in zip(groups[0], on_ep) if e == want] for want in (True, False)]
        parts = [norm([p.grad for p in group if p.grad is not None]) for group in groups]
        if len(parts) == 1:
            total = parts[0]
        elif math.isinf(norm_type):
            total = torch.maximum(parts[0], parts[1])
        else:
            total = (parts[0] ** norm_type + parts[1] ** norm_type) ** (1.0 / norm_type)
        if pp_mesh is not None:  # each stage's norm: combined over the pipeline ranks
            group = pp_mesh.get_group()
            if math.isinf(norm_type):
                dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
            else:
                total = total**norm_type
                dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
                total = total ** (1.0 / norm_type)
        for group in groups:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.float(), foreach)
        return total

    dist_utils.clip_grad_norm_ = clip_grad_norm_


def _shim_fsdp_mesh_dims() -> None:
    # 5. torch < 2.14: torchtitan imports DataParallelMeshDims from torch.distributed.fsdp at
    # module level; one process never shards, so a stand-in that refuses to be built suffices.
    import torch.distributed.fsdp as fsdp

    if hasattr(fsdp, "DataParallelMeshDims"):
        return

    class DataParallelMeshDims:
        """Stand-in for torch 2.14's class: data-parallel mesh dims need torch >= 2.14."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise TorchVersionError(
                "FSDP over a data-parallel mesh (DataParallelMeshDims) needs torch >= 2.14, "
                f"found torch {torch.__version__}"
            )

    setattr(fsdp, "DataParallelMeshDims", DataParallelMeshDims)  # noqa: B010


def _shim_set_timeout() -> None:
    # 6. torch < 2.14: torchtitan calls dist.set_timeout after the first step; torch 2.11's
    # private _set_pg_timeout takes the same arguments and sets the same backend timeouts.
    if not hasattr(dist, "set_timeout"):
        setattr(dist, "set_timeout", dist.distributed_c10d._set_pg_timeout)  # noqa: B010


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def _shim_missing_tensorboard() -> None:
    # 7. torch < 2.14 images (the GPU machine's) have no tensorboard, which torchtitan's metrics
    # module imports at module level but uses only with metrics.enable_tensorboard (refused by
    # validate() there): give it a SummaryWriter that says so.
    import sys
    import types

    if tensorboard_available():
        return

    class SummaryWriter:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError(
                "metrics.enable_tensorboard needs the tensorboard package, which is not installed"
            )

    module = types.ModuleType("torch.utils.tensorboard", "tensorboard is not installed")
    module.SummaryWriter = SummaryWriter  # pyrefly: ignore[missing-attribute]
    sys.modules["torch.utils.tensorboard"] = module


def _shim_pin_compile_on_one_rank() -> None:
    # 8. torch's config ``patch`` writes the prior *value* back as a user override on exit, so
    # inductor's first pattern-matcher init (``patch(compile_on_one_rank=False)``) turns the
    # flag's unset sentinel into ``False``; functional collectives read the flag inside compiled
    # blocks, dynamo guards that read's type, and every block compiled before that init
    # recompiles once (a warm inductor cache moves the init to step 2). Pin it now, same value.
    config = getattr(torch, "compiler", None) and getattr(torch.compiler, "config", None)
    if config is not None and hasattr(config, "compile_on_one_rank"):
        config.compile_on_one_rank = bool(config.compile_on_one_rank)


def _shim_pipeline_inference_grads() -> None:
    # 9. torch's pipeline stages infer their shapes with a real forward and backward before the
    # first microbatch, and clear the gradients that leaves only on FSDP modules: a stage
    # without FSDP (ZBVZeroBubble's) would add them to step 1's. Clear every parameter's.
    from torch.distributed.pipelining.stage import PipelineStage

    original = PipelineStage._post_metadata_inference_cleanup
    if getattr(original, "_recipe_shim", False):
        return

    def cleanup(self: Any) -> None:
        original(self)
        for param in self.submod.parameters():
            param.grad = None

    cleanup._recipe_shim = True  # pyrefly: ignore[missing-attribute]
    PipelineStage._post_metadata_inference_cleanup = cleanup


def apply() -> None:
    """Apply every shim this machine needs (idempotent). The torch < 2.14 ones come first:
    the CPU ones import torchtitan modules that need them."""
    global _APPLIED
    if _APPLIED:
        return
    if torch_below_trainer_floor():
        _shim_fsdp_mesh_dims()
        _shim_set_timeout()
        _shim_missing_tensorboard()
    if not accelerator_available():
        _shim_device_bindings()
        _shim_pg_timeouts()
        _shim_grad_norm()
    _shim_pin_compile_on_one_rank()
    _shim_pipeline_inference_grads()
    _APPLIED = True


def force_sum_reduction_on_gloo(module: torch.nn.Module) -> None:
    """4. gloo has no PREMUL_SUM, which FSDP2 uses to average gradients: reduce with a plain
    sum on every FSDP module instead (the loss is already normalised by the global token count,
    so torchtitan does not rely on FSDP's averaging)."""
    if dist.is_initialized() and dist.get_backend() != "gloo":
        return
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_force_sum_reduction_for_comms(True)
            sub.set_gradient_divide_factor(1.0)
