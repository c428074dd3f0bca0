"""Export a Qwen3.5 checkpoint of this recipe to a Hugging Face folder.

    python scripts/export_hf.py --config_file configs/qwen35_debug_cpu.toml \
        --checkpoint outputs/qwen35_debug_cpu/checkpoint/step-30 --out hf_out [--overwrite] \
        [--model.x v ...]

Checks the step against its manifest first (the same check, and the same message, as a resume:
``python -m torchtitan_cp.checkpoint verify``), reads the model weights of the torchtitan DCP
checkpoint (any sharding; optimizer state is left behind), converts them with torchtitan's
``Qwen35StateDictAdapter`` and writes ``config.json``, ``model.safetensors`` and the tokenizer
files of ``hf_assets_path`` into a temporary folder beside ``--out``, checks it, then renames it
into place. A non-empty ``--out`` is refused unless ``--overwrite``, which replaces the whole
folder (older shards and their index included). Every failure is one line, exit status 2.
The result loads back with ``[checkpoint] initial_load_path = OUT, initial_load_in_hf = true``
(or in transformers). One process, CPU; the same ``[model]`` keys as the training run select
the architecture.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys


class ExportError(Exception):
    """A one-line export failure."""


def _check_step(step_dir: str) -> None:
    from torchtitan_cp.run.checkpoint import MANIFEST, check_step, scan_steps

    if not os.path.isdir(step_dir):
        raise ExportError(f"--checkpoint {step_dir}: no such step folder")
    steps = scan_steps(step_dir)
    if steps and not os.path.exists(os.path.join(step_dir, MANIFEST)):
        names = ", ".join(os.path.basename(s.path) for s in steps)
        raise ExportError(
            f"--checkpoint {step_dir} is a checkpoint folder ({names}); pass one step, e.g. "
            f"{steps[-1].path}"
        )
    problem = check_step(step_dir)
    if problem is not None:
        raise ExportError(f"--checkpoint {step_dir} fails verification: {problem}")


def _check_out(out: str, overwrite: bool) -> None:
    """``out`` may be written: absent, empty, or replaced with ``overwrite``."""
    if os.path.lexists(out) and not os.path.isdir(out):
        raise ExportError(f"--out {out} is a file, not a folder")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        names = sorted(os.listdir(out))
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        raise ExportError(
            f"--out {out} is not empty ({len(names)} entries: {shown}); pass --overwrite to "
            "replace the whole folder, or choose another --out"
        )


def _staging_folder(out: str) -> str:
    """A new empty folder beside ``out`` to write into."""
    parent = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out))}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.mkdir(tmp)
    except OSError as e:
        raise ExportError(f"--out {out}: cannot write into {parent} ({e.strerror or e})") from None
    return tmp


def _replace(tmp: str, out: str) -> None:
    """Rename the finished ``tmp`` to ``out``; an existing ``out`` is renamed aside first and
    removed once the new folder is in place."""
    old = None
    if os.path.isdir(out):
        old = f"{tmp}.old"
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export(argv: list[str] | None) -> str:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="DCP checkpoint step folder (step-N)")
    parser.add_argument("--out", required=True, help="HF folder to write")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty --out (all of it)"
    )
    args, rest = parser.parse_known_args(argv)
    checkpoint, out = args.checkpoint.rstrip("/") or "/", args.out.rstrip("/") or "/"

    from torchtitan_cp import compat

    compat.apply()
    _check_step(checkpoint)  # first: the same check and message as a resume
    _check_out(out, args.overwrite)
    import torch.distributed.checkpoint as dcp

    from torchtitan_cp.models import recipe_model_spec
    from torchtitan_cp.models.qwen35.hf import check_hf_folder, write_hf_folder
    from torchtitan_cp.run.checkpoint import fit_error, fit_problem
    from torchtitan_cp.train import load_config
    from torchtitan_cp.trainer.config import ConfigError

    try:
        config = load_config(rest)
    except (ConfigError, ValueError) as e:
        raise ExportError(str(e)) from None
    if config.model.name != "qwen3_5":
        raise ExportError("export_hf.py exports model.name = 'qwen3_5' checkpoints only")
    tmp = _staging_folder(out)
    try:
        spec = recipe_model_spec(config.model)
        model = spec.model.build()
        state = model.state_dict()
        problem = fit_problem(state, checkpoint)
        if problem is not None:
            raise ExportError(str(fit_error(checkpoint, problem)))
        dcp.load(state, checkpoint_id=checkpoint)
        model.load_state_dict(state)
        write_hf_folder(model, spec.model, tmp, tokenizer_dir=config.hf_assets_path)
        check_hf_folder(tmp, spec.model)
        _replace(tmp, out)
    except OSError as e:
        where = getattr(e, "filename", None) or out
        raise ExportError(f"writing {out} failed: {where}: {e.strerror or e}") from None
    except ValueError as e:  # check_hf_folder: the folder just written does not check
        raise ExportError(f"the exported folder does not check: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    try:
        out = export(argv)
    except ExportError as e:
        print(f"export_hf.py: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
