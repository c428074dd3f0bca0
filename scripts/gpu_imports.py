"""Import every module the CUDA path loads; the first failure is one line naming it (exit 2).

The single list of what a GPU environment must provide below the trainer, and (``--trainer``)
what the trainer adds (torchtitan's trainer, its data pipeline; torch 2.11-2.13 through
compat.py's shims). scripts/gpu_check.sh runs this before anything else and
scripts/gpu_image_check.sh runs it in the emulated image. Add a module here when the CUDA path
or the trainer starts importing it.

``import fla`` alone proves nothing: fla's ``__init__`` swallows a missing dependency, so the
entries name the exact functions the kernels adapters import (``module:attribute``).
"""

from __future__ import annotations

import importlib
import sys

CUDA_PATH_IMPORTS: tuple[str, ...] = (
    # fla-core 0.6.0 entry points (torchtitan_cp/ops/<family>/fla_kernel.py) and the helpers they load
    "fla.ops.kda:chunk_kda",
    "fla.ops.gated_delta_rule:chunk_gated_delta_rule",
    "fla.modules.causal_conv1d:causal_conv1d",
    "fla.ops.utils.index:prepare_chunk_indices",
    "fla.ops.kda.chunk_fwd:chunk_kda_fwd",  # the compiled path calls the pieces
    "fla.ops.common.chunk_delta_h:chunk_gated_delta_rule_fwd_h",  # ops/delta_rule/fla_kernel.py
    "fla.ops.simple_gla:chunk_simple_gla",  # Mamba2 (SSD) and retention layers
    "fla.ops.gla:chunk_gla",  # SSD with a gate per key (the registered "gla")
    "fla.ops.common.chunk_h:chunk_fwd_kernel_h",  # launched by fla_compat's chunk-table shim
    "fla.ops.common.chunk_h:chunk_bwd_kernel_dh",
    # torchtitan modules the model is built from (no torchtitan.distributed.fsdp: trainer only)
    "torchtitan.protocols.module:Module",
    "torchtitan.protocols.model_spec:ModelSpec",
    "torchtitan.models.common.attention:FlexAttention",
    # the project below the trainer
    "torchtitan_cp.routing:host_layout",
    "torchtitan_cp.ops:chunk_delta_rule",
    "torchtitan_cp.ops.delta_rule.fla_kernel:chunk_delta_rule_fla",
    "torchtitan_cp.ops.conv.fla_kernel:causal_conv1d_fla",
    "torchtitan_cp.ops.fla_compat:indexed",
    "torchtitan_cp.ops.delta_rule.fla_kernel:prepare",
    "torchtitan_cp.ops.delta_rule.custom_ops:delta_rule_fla_local_op",  # torch.compile's ops
    "torchtitan_cp.ops.conv.custom_ops:causal_conv1d_fla_op",
    "torchtitan_cp.ops.ssd.custom_ops:ssd_fla_op",
    "torchtitan_cp.ops.ssd.fla_kernel:chunk_ssd_fla",
    "torchtitan_cp.ops.cp.recurrence:recurrence",
    "torchtitan_cp.ops.ssd.local:chunk_ssd",
    "torchtitan_cp.models.mixers.mamba2",
    "torchtitan_cp.trainer.compile:routing_caps",
    "torchtitan_cp.models:model_config",
    "torchtitan_cp.routing.host_metadata:HostMetadata",
    "torchtitan_cp.models.sequence:SequencePreprocessor",
    "torchtitan_cp.ops.common.fla_autotune:persist",  # autotune once per machine
    "torchtitan_cp.ops.common.fla_refusals:fla_gated_backward_path",
    # the runner of the check's correctness part and CUDA-only tests (which need nothing else)
    "pytest",
    "tests.cp_gradients:cp_gradients",
)


# The trainer on top (scripts/gpu_check.py's first stage runs it): the packages by name first,
# so a missing one is named, then the recipe's trainer module (after compat's shims, in the entry
# point's order).
TRAINER_IMPORTS: tuple[str, ...] = (
    "datasets:load_dataset",
    "pyarrow",
    "torchdata.stateful_dataloader:StatefulDataLoader",
    "tyro",
    "tokenizers",
    "spmd_types",
    "torchtitan_cp.trainer.trainer:HybridTrainer",
)
_TRAINER_MODULE = "torchtitan_cp.trainer.trainer"


def check(
    imports: tuple[str, ...] = CUDA_PATH_IMPORTS, torch_version: str | None = None
) -> str | None:
    """The first problem as one line, or None when all of ``imports`` load: torch (the
    installed one, or ``torch_version``) below the floor of the code under the trainer, then
    the first failing import."""
    from torchtitan_cp import compat

    try:
        compat.require_torch(compat.LIBRARY_TORCH_FLOOR, "the CUDA path", torch_version)
    except compat.TorchVersionError as e:
        return str(e)
    for entry in imports:
        module_name, _, attr = entry.partition(":")
        try:
            if module_name == _TRAINER_MODULE:
                compat.apply()  # torch < 2.14: the names torchtitan's trainer imports
            module = importlib.import_module(module_name)
            if attr:
                getattr(module, attr)
        except Exception as e:  # ImportError, AttributeError, or whatever the module raises
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            target = f"{attr} from {module_name}" if attr else module_name
            return f"cannot import {target}: {type(e).__name__}: {reason}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    imports = CUDA_PATH_IMPORTS + (TRAINER_IMPORTS if "--trainer" in args else ())
    error = check(imports)
    if error is not None:
        print(f"gpu_imports: {error}", file=sys.stderr)
        return 2
    what = "the CUDA path and the trainer" if "--trainer" in args else "the CUDA path"
    print(f"gpu_imports: {len(imports)} imports of {what} load")
    return 0


if __name__ == "__main__":
    sys.exit(main())
